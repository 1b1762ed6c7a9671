"""Unencodable text (issue 41, item 11): lone surrogates, NUL and noncharacters become U+FFFD as in the official code.

``tests/data/official/sanitize.json`` holds strings we wrote and what the official functions give for them (see its
``"source"``): ``MCPChecklistTool._sanitize_text_for_tokenizer`` and the arguments JSON of ``parse_tool_calls``.
`sanitize.sanitize` must reproduce them exactly, the tokenizer must encode them as their replacement, and a rollout
whose model output, rehearsed response or user text holds such characters must finish, count them and be scored
(acceptance 3). No model: a scripted sampler generates.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import math
import pathlib
import threading

import jax
import pytest

from envace_jax import scoring
from envace_jax.config import defaults
from envace_jax.envs import checklist, tau2
from envace_jax.model import sanitize, tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message
from envace_jax.rehearsal.trajectory import Termination
from envace_jax.rehearsal.unfold import UnfoldConfig, unfold
from envace_jax.rehearsal.users import ExternalUserConfig, UserSimulator
from envace_jax.rl.judge import ChecklistJudge, JudgeConfig
from tests.rehearsal.stand_ins import ScriptedSampler

FIXTURE = json.loads((pathlib.Path(__file__).parent / "data" / "official" / "sanitize.json").read_text("utf-8"))
CHECKLIST = pathlib.Path(__file__).parent / "envs" / "data" / "checklist_fixture.jsonl"
CONFIG = UnfoldConfig.from_config(group_size=1, max_turns=4, act_capacity=4096, rehearse_capacity=4096)


def test_sanitize_reproduces_the_official_function():
  assert len(FIXTURE["sanitize"]) >= 12 and FIXTURE["source"]
  for case in FIXTURE["sanitize"]:
    text, official = case["input"], case["output"]
    assert sanitize.sanitize(text) == official, ascii(text)
    replaced = sum(a != b for a, b in zip(text, official, strict=True))
    assert sanitize.count(text) == replaced, ascii(text)
    assert (sanitize.describe(text) is None) == (replaced == 0)
  assert sanitize.describe("ab\ud800") == "character 2 is U+D800, a lone surrogate"
  assert sanitize.count({"k\ud800": ["\x00", 1, None, ("\ufffe",)]}) == 3  # keys and values, nested


def test_the_tokenizer_encodes_what_the_official_code_sends_it(smollm2_tokenizer):
  """Every fixture string encodes and renders as its official replacement; the backend alone refuses a surrogate
  (the crash this fixes)."""
  tok = smollm2_tokenizer
  with pytest.raises(TypeError):
    tok.backend.encode("\ud800")
  for case in FIXTURE["sanitize"]:
    text, official = case["input"], case["output"]
    assert tok.encode(text) == tok.encode(official), ascii(text)
    for role in ("user", "tool", "system"):
      ids, roles = tok.render([Message(role, text)], add_generation_prompt=True)
      want, want_roles = tok.render([Message(role, official)], add_generation_prompt=True)
      assert ids.tolist() == want.tolist() and roles.tolist() == want_roles.tolist()
    assert tok.render_text([Message("user", text)]) == tok.render_text([Message("user", official)])


def test_parsed_arguments_serialised_and_sanitised_are_the_officials():
  """The official parser sanitises each call's arguments JSON (``json.dumps(..., ensure_ascii=False)``); ours keeps the
  decoded arguments and the same function applied to the same serialisation gives the official text."""
  for case in FIXTURE["parse"]:
    action = tool_format.parse_action(case["text"])
    (official,) = case["calls"]
    assert action.call.name == official["name"]
    assert sanitize.sanitize(json.dumps(action.call.arguments, ensure_ascii=False)) == official["arguments"]


class _RawScripted(ScriptedSampler):
  """A scripted sampler whose generations are the backend's ids of the text, unsanitised: a generated noncharacter
  stays its own bytes, as a sampled one would."""

  def scripted(self, role, row, n):
    k = self.generation_index[(row, role)]
    self.generation_index[(row, role)] += 1
    text = self.script(Role(role), row % n, k)
    ids = self.tokenizer.backend.encode(text, add_special_tokens=False).ids
    return ids if text.endswith(tool_format.TOOL_RESPONSE_CLOSE) else ids + [self.tokenizer.eos_ids[0]]


def _run(tokenizer, tasks, config, plans, **kwargs):
  def script(role, i, k):
    plan = plans[role]
    return plan[min(k, len(plan) - 1)]

  policy = _RawScripted(tokenizer, script, len(tasks) * config.group_size)
  kwargs.setdefault("reference_sampler", None)
  return unfold(tasks, policy, tokenizer, config, jax.random.key(0), **kwargs)


def _weather_rollout(tok):
  """The checklist fixture's weather task, its first tool schema and user turns holding lone surrogates, rolled out
  once with ACT's call holding the JSON escape \\ud800 and REHEARSE's response the escape and a generated U+FFFE."""
  weather = checklist.load_tasks(CHECKLIST)[0]
  schema = json.loads(json.dumps(weather.tools[0]))
  schema["function"]["description"] += " \ud800"
  task = dataclasses.replace(
    weather, user_turns=("Weather in Paris? \ud800", "Thanks \udfff!"), tools=(schema, *weather.tools[1:])
  )
  call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris\\ud800", "unit": "C"}}\n</tool_call>'
  response = '<tool_response>\n{"city": "Paris\\ud800", "temp": 12, "note": "a\ufffeb"}\n</tool_response>'
  plans = {Role.ACT: [call, "It is 12 C in Paris.", "You are welcome."], Role.REHEARSE: [response]}
  out = _run(tok, [task], CONFIG, plans)
  return out.trajectories[0], out.views[0]


def test_a_rollout_with_unencodable_text_finishes_counts_it_and_is_scored(smollm2_tokenizer):
  """ACT's call holds the JSON escape \\ud800 (a lone surrogate once decoded), REHEARSE's response the escape and a
  generated noncharacter (U+FFFE), the logged user turns and a tool schema lone surrogates: before, the first
  `View.append` of a lone surrogate raised TypeError in the tokenizer and took the training step down."""
  tok = smollm2_tokenizer
  traj, views_ = _weather_rollout(tok)
  assert traj.termination == Termination.USER_TURNS_DONE and traj.counts["tool_calls"] == 1
  assert traj.counts.get("malformed_act", 0) == 0 and traj.counts.get("invalid_rehearsed_json", 0) == 0
  assert traj.messages[1].tool_calls[0].arguments == {"city": "Paris\ud800", "unit": "C"}  # as decoded
  # Where each text entered a view: the schema (ACT's tools, REHEARSE's system message), the first user turn (ACT,
  # REHEARSE), the call (REHEARSE), the generated U+FFFE (ACT, as the observation), the second user turn (ACT,
  # REHEARSE).
  assert views_[Role.ACT].unencodable == 1 + 1 + 1 + 1 and views_[Role.REHEARSE].unencodable == 1 + 1 + 1 + 1
  assert traj.counts["unencodable_chars"] == 8
  rehearse_text = tok.decode(traj.rows[int(Role.REHEARSE)].tokens)
  assert '"city": "Paris\ufffd"' in rehearse_text and "Weather in Paris? \ufffd" in rehearse_text
  act_text = tok.decode(traj.rows[int(Role.ACT)].tokens)
  assert '"note": "a\ufffdb"' in act_text and '"city": "Paris\\ud800"' in act_text  # the escape stays text
  assert "\ud800" not in act_text + rehearse_text and "\ufffe" not in act_text
  reward = scoring.score(defaults.get_config(), traj)
  assert reward.valid and math.isfinite(reward.reward), reward


def test_a_simulated_users_unencodable_reply_and_a_real_tools_result(smollm2_tokenizer):
  """A user simulator's reply (an external user's JSON can hold \\ud800) and a real tool's result that echoes the
  call's lone surrogate reach the views as U+FFFD; the benchmark's own evaluator scores the trajectory."""

  class User(UserSimulator):
    def __init__(self):
      self.turns = 0

    def reply(self, messages):
      self.turns += 1
      return "Create a task 'Meeting \ud800' for user_1." if self.turns == 1 else "Thanks! ###STOP###"

  task = next(t for t in tau2.load_tasks("mock", "base") if t.id == "create_task_1")
  call = '<tool_call>\n{"name": "create_task", "arguments": {"user_id": "user_1", "title": "M\\ud800"}}\n</tool_call>'
  config = dataclasses.replace(CONFIG, user_mode="external", env_mode="real")
  env = tau2.Tau2Env("mock")  # unfold resets it with the task
  out = _run(smollm2_tokenizer, [task], config, {Role.ACT: [call, "Done."]}, envs=[env], user_simulator=User())
  traj = out.trajectories[0]
  assert traj.termination == Termination.USER_STOP
  result = next(m for m in traj.messages if m.role == "tool")
  shown = smollm2_tokenizer.decode(traj.rows[int(Role.ACT)].tokens)
  assert "Meeting \ufffd" in shown and "\ud800" not in shown
  assert traj.counts["unencodable_chars"] == 1 + sanitize.count(result.content)
  reward = scoring.score(defaults.get_config(), traj, env=env)
  assert reward.valid and math.isfinite(reward.reward), reward


def test_an_external_user_and_the_judge_are_sent_encodable_text(smollm2_tokenizer):
  """Over HTTP a lone surrogate cannot be sent (httpx encodes the body as UTF-8): an external user whose reply holds
  the escape \\ud800 got it back in the next request, which raised UnicodeEncodeError out of the rollout; the judge's
  prompt quoting a call whose arguments hold it failed the same way (the trajectory then unscored). Both now send
  U+FFFD, as the official code's do."""
  requests = []
  user_replies = ["Create a task 'M\ud800' for user_1.", "Thanks! ###STOP###"]

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      requests.append(body)
      if body["model"] == "judge":
        text = '{"analysis": "ok", "answer": true}'
      else:
        text = user_replies[sum(m["role"] == "assistant" for m in body["messages"])]
      payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(payload)))
      self.end_headers()
      self.wfile.write(payload)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://127.0.0.1:{server.server_address[1]}/v1"
  try:
    task = next(t for t in tau2.load_tasks("mock", "base") if t.id == "create_task_1")
    user = ExternalUserConfig(base_url=url, model="sim", api_key_env="", max_retries=0)
    config = dataclasses.replace(CONFIG, user_mode="external", external_user=user)
    traj = _run(smollm2_tokenizer, [task], config, {Role.ACT: ["Sure."]}).trajectories[0]
    assert traj.termination == Termination.USER_STOP and len(requests) == 2
    assert requests[1]["messages"][2] == {"role": "assistant", "content": "Create a task 'M\ufffd' for user_1."}
    assert traj.counts["unencodable_chars"] == 2  # the reply in the ACT and REHEARSE views

    weather, _ = _weather_rollout(smollm2_tokenizer)
    judge = ChecklistJudge(JudgeConfig.from_config(base_url=url, model="judge", max_retries=0, max_concurrency=1))
    with judge:
      reward = scoring.score(defaults.get_config(), weather, judge=judge)
    prompts = [r["messages"][0]["content"] for r in requests if r["model"] == "judge"]
    assert reward.valid and reward.reward == 1.0 and prompts, reward
    assert any('"Paris\ufffd"' in p for p in prompts) and not any("\ud800" in p for p in prompts)
  finally:
    server.shutdown()
    server.server_close()
