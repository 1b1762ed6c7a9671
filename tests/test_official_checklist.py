"""Golden tests of the checklist reward against the official EnvACE code (issue 41, items 2-5).

``tests/data/official/checklist.json`` holds three authored dialogues (a checklist-format record, the agent's outputs
and the tool results, in order) and what the official code made of them, run outside the repository with a stub
judge (its ``source`` and ``stub_judge`` say which functions and what rule): the per-turn rewards, the trajectory's
reward (and the float32 the official trainer writes), the judge requests, the user turns replayed, and the judge
request's sampling and schema. Here the same dialogues run through our rollout (`unfold` with a scripted policy, the
required-item gate of `scoring.turn_gate`) and our judge (`rl.judge.ChecklistJudge`) against a local
OpenAI-compatible server answering by the same rule: the official settings (``config/defaults.py``'s) reproduce
every number; the settings we had before (per-turn judging, every turn replayed, partial turns judged) give ours.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import jax
import numpy as np
import pytest

from envace_jax import config_check, scoring
from envace_jax.config import defaults
from envace_jax.envs import checklist
from envace_jax.envs.base import ChatMessage, ToolCall
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.rehearsal.trajectory import Termination
from envace_jax.rehearsal.unfold import UnfoldConfig, unfold
from envace_jax.rl import judge as judge_lib
from tests.rehearsal.stand_ins import ScriptedSampler
from tests.rl.test_rewards import _completion, _Server

FIXTURE = json.loads((pathlib.Path(__file__).parent / "data" / "official" / "checklist.json").read_text())
DIALOGUES = {d["name"]: d for d in FIXTURE["dialogues"]}
CHECKLIST_DATA = pathlib.Path(__file__).parent / "envs" / "data" / "checklist_fixture.jsonl"
OURS_BEFORE = {  # the judging we had before issue 41 (each the non-official value of its setting)
  "judge_granularity": "turn",
  "required_items": "ignore",
  "unfinished_turn": "judge",
  "judge_schema": "analysis",
  "judge_temperature": 0.0,
  "judge_top_p": 1.0,
  "judge_max_tokens": 1024,
  "judge_max_retries": 3,
  "judge_timeout_s": 60.0,
}
# Our reward of each dialogue under OURS_BEFORE, by hand from the stub rule (the fixture's "stub_judge"):
OURS = {
  # every turn replayed and judged: turn 0 A (0.75) passes, B fails; turn 1 C and D pass: (0.75 + 1) / 2
  "required_item_fails": ([0.75, 1.0], 0.875, 4),
  # turn 1, cut off by the malformed call, judged as it stands: F ("Sending") passes, G not: (1 + 0.5) / 2
  "unfinished_turn": ([1.0, 0.5], 0.75, 3),
  # the whole of turn 0 shows "Trying", so H fails there: (0.5 + 0.7 + 1) / 3
  "per_step_judging": ([0.5, 0.7, 1.0], (0.5 + 0.7 + 1.0) / 3, 5),
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
  return smollm2_tokenizer  # the tokenizer only: no model runs here


def _stub(prompt: str) -> bool:
  """The fixture's stub judge on our prompt: kw=WORD (and not=WORD2) from the item; the judged messages are the
  prompt's current section."""
  kw = re.search(r"kw=(\w+)", prompt).group(1)
  avoid = re.search(r"not=(\w+)", prompt)
  current = prompt.split("# Current turn (judge this)\n", 1)[1].split("\n\n# Rules\n", 1)[0]
  return kw in current and not (avoid and avoid.group(1) in current)


def _respond(body, n):
  answer = _stub(body["messages"][0]["content"])
  if "response_format" in body:
    verdict = {field: "stub" for field in judge_lib.OFFICIAL_FIELDS[:-1]} | {"answer": answer}
  else:
    verdict = {"analysis": "stub", "answer": answer}
  return 200, _completion(json.dumps(verdict)), 0.0


@pytest.fixture(scope="module")
def server():
  s = _Server(_respond)
  yield s
  s.close()


def _config(url: str, settings: dict):
  c = defaults.get_config()
  c.env.benchmark, c.env.data_path = "checklist", str(CHECKLIST_DATA)
  c.reward.kind, c.reward.judge_url, c.reward.judge_model = "judge", url, "judge"
  for key, value in settings.items():
    c.reward[key] = value
  return c


def _run(tokenizer, dialogue: dict, config):
  """The dialogue through our rollout (scripted agent and rehearsed tool results) and reward."""
  task = checklist.record_to_task(dialogue["record"])
  acts, results = dialogue["act"], dialogue["tool_results"]
  plans = {Role.ACT: acts, Role.REHEARSE: [tool_format.render_tool_response(r) for r in results]}
  policy = ScriptedSampler(tokenizer, lambda role, i, k: plans[role][k], 1)
  # on_malformed="end": a malformed call ends the episode, as officially (issue 41 item 8's setting).
  unfold_cfg = UnfoldConfig.from_config(
    config, group_size=1, max_turns=30, on_malformed="end", act_max_new_tokens=256, rehearse_max_new_tokens=256
  )
  judge = scoring.make_judge(config)
  out = unfold([task], policy, tokenizer, unfold_cfg, jax.random.key(0), turn_gate=scoring.turn_gate(config, judge))
  (traj,) = out.trajectories
  return traj, scoring.score(config, traj, judge=judge)


@pytest.mark.parametrize("name", list(DIALOGUES))
def test_official_settings_reproduce_the_official_rewards(tokenizer, server, name):
  dialogue = DIALOGUES[name]
  official = dialogue["official"]
  before = len(server.requests)
  traj, info = _run(tokenizer, dialogue, _config(server.url, {}))
  assert info.valid
  turns = len(dialogue["record"]["checklists"][0])
  scored = [info.breakdown[f"turn[{t}]"] for t in range(turns)]
  assert scored[: len(official["turn_rewards"])] == official["turn_rewards"]  # exactly
  assert scored[len(official["turn_rewards"]) :] == [0.0] * (turns - len(official["turn_rewards"]))
  assert info.reward == official["reward"]  # exactly: the same sums in the same order
  # The official trainer sums the turns in float32 (rollout_loop.py) before dividing: within one float32 step.
  assert abs(np.float32(info.reward) - np.float32(official["reward_float32"])) <= np.spacing(np.float32(1.0))
  assert info.info["requests"] == official["judge_requests"] == len(server.requests) - before
  assert sum(m.role == "user" for m in traj.messages) == official["user_turns_replayed"]
  assert traj.counts["generations_act"] == official["agent_outputs_used"]
  want = {"required_item_fails": Termination.REQUIRED_FAILED, "unfinished_turn": Termination.MALFORMED}
  assert traj.termination == want.get(name, Termination.USER_TURNS_DONE)


@pytest.mark.parametrize("name", list(DIALOGUES))
def test_our_earlier_settings_give_ours(tokenizer, server, name):
  turn_scores, reward, requests = OURS[name]
  before = len(server.requests)
  traj, info = _run(tokenizer, DIALOGUES[name], _config(server.url, OURS_BEFORE))
  assert info.valid and [info.breakdown[f"turn[{t}]"] for t in range(len(turn_scores))] == turn_scores
  assert info.reward == pytest.approx(reward, abs=1e-12) and info.reward != DIALOGUES[name]["official"]["reward"]
  assert info.info["requests"] == requests == len(server.requests) - before
  assert sum(m.role == "user" for m in traj.messages) == len(DIALOGUES[name]["record"]["checklists"][0])


def test_the_judge_request_is_the_officials(tokenizer, server):
  """Sampling, schema, attempts and timeout of the official settings (the fixture's ``judge_request``, recorded from
  `eval_one_check`'s payload); the earlier settings send ours."""
  want = FIXTURE["judge_request"]
  settings = judge_lib.JudgeConfig.from_config(_config(server.url, {}))
  assert (settings.max_retries + 1, settings.timeout_s) == (want["attempts"], want["timeout_s"])
  before = len(server.requests)
  _run(tokenizer, DIALOGUES["required_item_fails"], _config(server.url, {}))
  for request in server.requests[before:]:
    body = request["body"]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (
      want["temperature"], want["top_p"], want["max_tokens"])  # fmt: skip
    assert body["response_format"] == want["response_format"]
    assert all(field in body["messages"][0]["content"] for field in judge_lib.OFFICIAL_FIELDS)
  before = len(server.requests)
  _run(tokenizer, DIALOGUES["required_item_fails"], _config(server.url, OURS_BEFORE))
  for request in server.requests[before:]:
    body = request["body"]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.0, 1.0, 1024)
    assert "response_format" not in body and '"analysis"' in body["messages"][0]["content"]


def test_the_gate_judges_required_items_once_and_a_judge_failure_ends_the_trajectory_invalid(tokenizer):
  """The gate's verdicts are the reward's (a turn is not judged twice); a turn the judge cannot judge ends the
  trajectory at once (``judge_failed``) and its reward is invalid, never a plausible number."""
  failing = _Server(lambda body, n: (400, '{"error": "prompt too long"}', 0.0))
  try:
    traj, info = _run(tokenizer, DIALOGUES["required_item_fails"], _config(failing.url, {}))
  finally:
    failing.close()
  assert traj.termination == Termination.JUDGE_FAILED and sum(m.role == "user" for m in traj.messages) == 1
  assert not info.valid and math.isnan(info.reward) and "HTTP 400" in info.info["scoring_error"]
  assert traj.counts[scoring.SCORING_ERROR] == 1
  (event,) = [e for e in traj.events if e.get("type") == scoring.JUDGED_TURN]
  assert event["turn"] == 0 and len(failing.requests) == event["requests"] == 4


def test_the_settings_are_checked(tokenizer):
  c = _config("http://127.0.0.1:1/v1", {"judge_granularity": "message", "required_items": "warn"})
  with pytest.raises(config_check.ConfigError) as err:
    config_check.validate(c)
  assert [p.split("=")[0] for p in err.value.problems] == ["reward.judge_granularity", "reward.required_items"]
  c = _config("http://127.0.0.1:1/v1", {"judge_top_p": 0.0, "unfinished_turn": "half", "judge_schema": "xml"})
  with pytest.raises(config_check.ConfigError) as err:
    config_check.validate(c)
  assert sorted(p.split("=")[0] for p in err.value.problems) == [
    "reward.judge_schema", "reward.judge_top_p", "reward.unfinished_turn"]  # fmt: skip
  # A config stored before these settings existed completes with what that version did (defaults.EARLIER_BEHAVIOUR).
  stored = defaults.get_config().to_dict()
  for key in ("judge_granularity", "required_items", "unfinished_turn", "judge_schema", "judge_top_p"):
    del stored["reward"][key]
  old = judge_lib.JudgeConfig.from_config(defaults.completed(stored), base_url="http://x/v1", model="m")
  assert (old.granularity, old.unfinished_turn, old.schema, old.top_p) == ("turn", "judge", "analysis", 1.0)
  assert defaults.completed(stored).reward.required_items == "ignore"


def test_a_tool_item_fails_without_a_request_on_a_step_answered_by_an_error_tool_call(server):
  """Officially (interaction.py) an item whose focus is the tool calls or their results fails, unjudged, on a step
  whose tool result is an ``error_tool_call`` object; the other items of that step are judged."""
  record = json.loads(json.dumps(DIALOGUES["required_item_fails"]["record"]))
  record["checklists"][0][0][0]["focus_on"] = "assistant.tool_calls"  # A: kw=cloudy, a tool item now
  task = checklist.record_to_task(record)
  call = ToolCall("get_weather", {"city": "Paris"}, id="call_0")
  failed = '{"error_tool_call": "the simulator could not answer"}'
  conversation = [
    ChatMessage("user", task.user_turns[0]),
    ChatMessage("assistant", "Let me check: cloudy?", tool_calls=(call,)),
    ChatMessage("tool", failed, tool_call_id="call_0", name="get_weather"),
  ]
  settings = judge_lib.JudgeConfig.from_config(_config(server.url, {}), backoff_s=0.01)
  with judge_lib.ChecklistJudge(settings) as judge:
    before = len(server.requests)
    result = judge.judge_turn(task, conversation, 0)
    assert result["passed"] == {"turn[0]/A": False, "turn[0]/B": False} and result["requests"] == 1
    assert len(server.requests) - before == 1  # B only
    ok = [*conversation[:2], ChatMessage("tool", '{"sky": "sunny"}', tool_call_id="call_0", name="get_weather")]
    assert judge.judge_turn(task, ok, 0)["passed"]["turn[0]/A"]  # "cloudy" is in the step: judged, passes


def _chat(messages: list[dict]) -> list[ChatMessage]:
  out = []
  for m in messages:
    calls = tuple(
      ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]), id=c["id"])
      for c in m.get("tool_calls", ())
    )
    out.append(ChatMessage(m["role"], m["content"], tool_calls=calls))
  return out


def test_the_official_transcript_layout_is_reproduced():
  """``reward.judge_transcript="official"`` writes messages as the official get_messages_str_v2 does (the fixture's
  ``transcripts``: authored messages, its output): the whole conversation, and a turn judged on its own (numbered
  from turn 0 again, as the official current section is)."""
  t = FIXTURE["transcripts"]
  messages = _chat(t["messages"])
  assert judge_lib.render_official(messages) == t["whole"]
  assert judge_lib.render_official(messages[5:]) == t["second_turn"]
  assert judge_lib.render_official(messages[1:4]) == t["first_turn_step_0"]
  assert "user_visible_reply: It is 3 degrees." in judge_lib.render_messages(messages)  # ours: no <think>, a reply


def test_a_prompt_template_file_gives_the_wording(server, tmp_path):
  """``reward.judge_prompt_file``: the official wording can be supplied as a template; bad placeholders are named."""
  template = tmp_path / "judge.txt"
  template.write_text(
    "Q: $question\nF: $failure_examples\nE: $evidence\n# Current turn (judge this)\n$current\n\n# Rules\n"
  )
  config = _config(server.url, {"judge_prompt_file": str(template), "judge_transcript": "official"})
  config_check.validate(config)
  settings = judge_lib.JudgeConfig.from_config(config)
  task = checklist.record_to_task(DIALOGUES["required_item_fails"]["record"])
  conversation = [ChatMessage("user", task.user_turns[0]), ChatMessage("assistant", "<think>x</think>It is cloudy.")]
  with judge_lib.ChecklistJudge(settings) as judge:
    before = len(server.requests)
    assert judge.judge_turn(task, conversation, 0)["passed"] == {"turn[0]/A": True, "turn[0]/B": False}
  prompts = [r["body"]["messages"][0]["content"] for r in server.requests[before:]]  # items A, B in either order
  (prompt,) = [p for p in prompts if p.startswith("Q: Does the turn show kw=cloudy?")]
  assert prompt.startswith("Q: Does the turn show kw=cloudy?\nF: []\nE: []\n# Current turn (judge this)\n# Turn: 0\n")
  assert "content.user_visible_reply: It is cloudy." in prompt
  template.write_text("Q: $question $answer")
  with pytest.raises(config_check.ConfigError) as err:
    config_check.validate(_config(server.url, {"judge_prompt_file": str(template)}))
  (problem,) = err.value.problems
  assert problem.startswith(f"reward.judge_prompt_file={str(template)!r}: ") and "KeyError 'answer'" in problem
  assert "$question, $focus_on, $pass_condition, $failure_examples, $evidence, $history, $current" in problem
