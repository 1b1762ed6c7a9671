"""The training loop and the evaluation checked on values: a scripted policy whose every output is known, so each
reward, advantage, metric and evaluation number has one right value, computed here by hand.

The stand-in policy (`Policy`, no model) plays τ² mock's ``create_task_1``: the reference user (`User`) asks for
the gold task in the even rows of its cache and for a wrongly titled one in the odd rows (the G forks of one opening
share a context, not a row), ACT calls ``create_task`` with the title it was asked for and then reports, REHEARSE
answers with a fixed response. With G = 2 the group holds one gold trajectory and one wrong one. The update runs the
real tiny model on the scripted tokens (old logprobs are the stand-in's, so its loss is not checked here; the update's
own tests are tests/rl/test_grpo.py). Scoring failures and misconfigured scorers go through the same loop.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import config_check, evaluate, heldout, metrics, runtime, scoring, train
from envace_jax.envs import tau2
from envace_jax.envs.base import EnvError
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.rehearsal import private
from envace_jax.rl import rewards
from tests.rehearsal.stand_ins import ContextSampler, _encode
from tests.test_train import tiny_config

GOLD = {"user_id": "user_1", "title": "Important Meeting"}
WRONG = {"user_id": "user_1", "title": "Wrong Meeting"}
ASK = {
  "gold": "Please create a task 'Important Meeting' for user_1.",
  "wrong": "Please create a task 'Wrong Meeting' for user_1.",
}
CALL = {k: tool_format.render_tool_call("create_task", args) for k, args in (("gold", GOLD), ("wrong", WRONG))}
RESPONSE = '<tool_response>\n{"task_id": "task_2", "title": "Important Meeting", "status": "pending"}\n</tool_response>'
DONE = "I created the task for user_1."
STOP = "Thanks! ###STOP###"


def _after_system(context: str) -> str:
  return context.split("<|im_end|>", 1)[1] if "<|im_end|>" in context else context


class Policy(ContextSampler):
  """ACT: the call the user asked for, then DONE once a tool response is in its view; REHEARSE: RESPONSE; USER (in
  private rehearsals): the gold request, STOP once DONE was said; assessments and memory: fixed texts."""

  MEMORY = "Call create_task for user_1 titled 'Important Meeting', then confirm."

  def __init__(self, tokenizer):
    super().__init__(tokenizer, self.answer)

  def answer(self, role, context):
    seen = _after_system(context)
    if role == Role.REHEARSE:
      return RESPONSE
    if role == Role.USER:
      return STOP if DONE in seen else ASK["gold"]
    if private.ASSESS_PROMPT in context:
      return " success\nWhat went wrong: nothing\nKey tool results: create_task"
    if private.MEMORY_PROMPT in context:
      return self.MEMORY
    if "<tool_response>" in seen:
      return DONE
    return CALL["wrong" if "Wrong Meeting" in seen else "gold"]


class User(ContextSampler):
  """The reference user: asks for the gold task in even cache rows, the wrong one in odd rows; STOP after DONE."""

  def __init__(self, tokenizer):
    super().__init__(tokenizer, self.answer, by_row=True)

  def answer(self, role, context, row):
    assert role == Role.USER
    return STOP if DONE in _after_system(context) else ASK["wrong" if row % 2 else "gold"]


def _tokens(tokenizer, *texts: str) -> int:
  """How many tokens the stand-ins generate for ``texts`` (their canonical ids, plus an eos where one is added)."""
  return sum(len(_encode(tokenizer, t)) for t in texts)


MODES = {
  "envace": {},
  "per_role": {"grpo.mode": "per_role"},
  "grpo_real_env": {"grpo.mode": "grpo_real_env", "rollout.env_mode": "real", "grpo.trained_roles": ("act",)},
}


def _config(data_dir, mode, **overrides):
  return tiny_config(
    data_dir,
    **{
      "env.train_task_ids": "create_task_1",
      "train.tasks_per_step": 1,
      "train.group_size": 2,
      "train.steps": 1,
      "train.eval_tasks": 1,
      "rollout.max_turns": 3,
      "rollout.act_max_new_tokens": 64,
      "rollout.rehearse_max_new_tokens": 64,
      "rollout.user_max_new_tokens": 64,
      **MODES[mode],
      **overrides,
    },
  )


def _scripted_trainer(config, workdir) -> train.Trainer:
  trainer = train.Trainer(config, str(workdir))
  tok = trainer.model.tokenizer
  trainer.samplers = {"policy": Policy(tok), "reference": User(tok)}
  if trainer.grpo_cfg.per_role:
    trainer.samplers["rehearse"] = Policy(tok)
  return trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_scripted_step_and_evaluation_have_the_hand_computed_values(tmp_path, data_dir, monkeypatch, mode):
  executed = []
  execute = tau2.Tau2Env.execute
  monkeypatch.setattr(tau2.Tau2Env, "execute", lambda self, call: executed.append(call.name) or execute(self, call))
  trainer = _scripted_trainer(_config(data_dir, mode), tmp_path)
  tok = trainer.model.tokenizer
  real = mode == "grpo_real_env"

  trajectories, _ = trainer.rollout(trainer.stream.next_batch(), jax.random.key(0))
  # Rollout: the gold trajectory, then the wrong one; each: ask, call, response, DONE, STOP.
  assert [t.termination.value for t in trajectories] == ["user_stop", "user_stop"]
  for t, which in zip(trajectories, ("gold", "wrong"), strict=True):
    assert [m.role for m in t.messages] == ["assistant", "user", "assistant", "tool", "assistant", "user"]
    assert (
      t.messages[1].content == ASK[which]
      and t.messages[2].tool_calls[0].arguments == {"gold": GOLD, "wrong": WRONG}[which]
    )
    assert (int(Role.REHEARSE) in t.rows) == (not real)
  assert executed == (["create_task", "create_task"] if real else [])
  # Rewards. Rehearsed: the rule checklist, items (gold action, well-formed) -> 1.0 and 0.5. Real: τ²'s evaluator on
  # the real DB -> 1.0 and 0.0 (the wrong title leaves the DB unlike the gold one).
  want = [1.0, 0.0] if real else [1.0, 0.5]
  assert [t.reward.reward for t in trajectories] == want and all(t.reward.valid for t in trajectories)
  # Role-wise advantages: every role has the same count of rows in both trajectories (ACT 2, REHEARSE 1), so the
  # row-weighted baseline is the mean reward and A = R - mean.
  adv, stats = trainer.advantages(trajectories)
  half = (want[0] - want[1]) / 2
  np.testing.assert_array_equal(adv[:, int(Role.ACT)], [half, -half])
  np.testing.assert_array_equal(adv[:, int(Role.REHEARSE)], [0.0, 0.0] if real else [half, -half])
  assert stats["adv/act/generations"] == 4.0 and stats["adv/act/abs_mean"] == half
  assert ("adv/rehearse/generations" in stats) == (not real)

  if mode == "per_role":  # each role sampled with its own tree's sampler
    assert {role for role, _, _ in trainer.samplers["rehearse"].seen} == {Role.REHEARSE}
    assert {role for role, _, _ in trainer.samplers["policy"].seen} == {Role.ACT}

  executed.clear()
  result = trainer.run()
  (record,) = metrics.read_jsonl(tmp_path)
  assert record["reward/mean"] == np.mean(want) and record["reward/std"] == half
  assert record["reward/invalid"] == 0.0 and record["reward/scoring_errors"] == 0.0
  assert record["rollout/tool_call_validity"] == 1.0 and record["rollout/tool_calls_per_trajectory"] == 1.0
  assert record["rollout/turns"] == 2.0 and record["termination/user_stop"] == 2.0
  assert (
    math.isnan(record["rollout/rehearsed_json_validity"]) if real else record["rollout/rehearsed_json_validity"] == 1.0
  )
  act_tokens = _tokens(tok, CALL["gold"], DONE, CALL["wrong"], DONE)
  rehearse_tokens = 0 if real else _tokens(tok, RESPONSE, RESPONSE)
  assert record["update/tokens"] == act_tokens + rehearse_tokens
  assert record["rollout/generated_tokens"] == act_tokens + rehearse_tokens + _tokens(
    tok, ASK["gold"], STOP, ASK["wrong"], STOP
  )
  # The held-out evaluation: committed execution of create_task_1 against the real tools (the gold request: row 0).
  ev = result["eval"]
  assert ev["eval/reward"] == 1.0 and ev["eval/pass^1"] == 1.0 and ev["eval/tasks"] == 1.0
  assert ev["eval/reward/invalid"] == 0.0 and ev["eval/reward/scoring_errors"] == 0.0 and ev["eval/tool_calls"] == 1.0
  assert ev["eval/fidelity/calls"] == 1.0 and ev["eval/fidelity/json_valid"] == 1.0
  # The reward gap: one rehearsed trajectory (the gold request), rule reward 1.0; executed for real, τ² reward 1.0.
  assert (ev["eval/gap/rehearsed_reward"], ev["eval/gap/real_reward"], ev["eval/gap/gap"]) == (1.0, 1.0, 0.0)
  written = metrics.read_jsonl(tmp_path, "eval.jsonl")
  assert [r["step"] for r in written] == [1] and {k: written[0][k] for k in ev} == ev
  # Real tools: the step's two calls, the committed call, the gold call replayed for fidelity and the gap's replay.
  assert executed == (["create_task"] * 5 if real else ["create_task"] * 3)
  with checkpoint_lib.Checkpointer(tmp_path) as ckpt:  # per_role: one tree per role; else the model's one tree
    saved = {name.split("/")[1] for name in ckpt.saved_arrays(1) if name.startswith("params/")}
  assert saved == ({"act", "rehearse"} if mode == "per_role" else set(trainer.model.params))


# ---------------------------------------------------------------------------------------------------------------------
# Scoring failures: an unscoreable output is invalid and counted; a misconfigured scorer stops the run before it rolls
# anything out (envace_jax/scoring.py).


def _raise_on_wrong(score):
  """``score`` that raises RecursionError (as BFCL's checker does on arguments nested too deep) for the wrong call."""

  def scorer(*args, **kwargs):
    conversation = next(a for a in args if isinstance(a, list | tuple) and a and hasattr(a[0], "role"))
    if any("Wrong Meeting" in json.dumps(dict(c.arguments)) for m in conversation for c in m.tool_calls):
      raise RecursionError("maximum recursion depth exceeded")
    return score(*args, **kwargs)

  return scorer


@pytest.mark.slow
def test_an_unscoreable_output_is_invalid_excluded_and_counted_in_training_and_evaluation(
  tmp_path, data_dir, monkeypatch, capsys
):
  """The wrong trajectory's scorer raises: in training it is left out of the mean, the baselines and the batch; in
  the evaluation (2 trials: the user asks for the gold task in trial 1, the wrong one in trial 2) it is a failed trial
  of pass^k and left out of the mean reward; both count it in reward/invalid and reward/scoring_errors."""
  monkeypatch.setattr(rewards, "rule_checklist", _raise_on_wrong(rewards.rule_checklist))
  monkeypatch.setattr(tau2.Tau2Env, "evaluate", _raise_on_wrong(tau2.Tau2Env.evaluate))
  config = _config(data_dir, "envace", **{"eval.num_trials": 2})
  trainer = _scripted_trainer(config, tmp_path / "run")
  tok = trainer.model.tokenizer
  trajectories, _ = trainer.rollout(trainer.stream.next_batch(), jax.random.key(0))
  assert trajectories[0].reward.reward == 1.0 and trajectories[0].reward.valid
  assert not trajectories[1].reward.valid and math.isnan(trajectories[1].reward.reward)
  assert "RecursionError" in trajectories[1].reward.info[scoring.SCORING_ERROR]
  adv, stats = trainer.advantages(trajectories)
  assert not adv.any() and stats["invalid_trajectories"] == 1.0  # one valid member: no baseline to beat
  assert stats["adv/act/trajectories"] == 1.0 and stats["adv/act/zero_variance_groups"] == 1.0

  result = trainer.run(keep_optimizer=False)  # as the main job: the final evaluation runs without AdamW's moments
  assert trainer.state.opt_state is None and trainer.state.params is not None
  (record,) = metrics.read_jsonl(tmp_path / "run")
  assert record["reward/mean"] == 1.0 and record["reward/std"] == 0.0
  assert record["reward/invalid"] == 1.0 and record["reward/scoring_errors"] == 1.0
  assert record["update/tokens"] == _tokens(tok, CALL["gold"], DONE, RESPONSE)  # the valid trajectory's rows only
  ev = result["eval"]
  assert ev["eval/reward"] == 1.0 and ev["eval/pass^1"] == 0.5 and ev["eval/pass^2"] == 0.0
  assert ev["eval/reward/invalid"] == 1.0 and ev["eval/reward/scoring_errors"] == 1.0
  # The gap rehearses both requests: the wrong one fails both scorers, the gold one scores 1.0 on both.
  assert (ev["eval/gap/trajectories"], ev["eval/gap/invalid"], ev["eval/gap/scoring_errors"]) == (1.0, 1.0, 1.0)
  assert ev["eval/gap/gap"] == 0.0

  # --mode=eval on the trained checkpoint, with the same stand-ins: the same numbers in every rehearsal mode (the
  # openings do not depend on the mode), in the returned rows, the printed table and eval_results.json.
  made = iter([Policy(tok), User(tok)])
  monkeypatch.setattr(runtime, "make_sampler", lambda *args, **kwargs: next(made))
  config.eval.rehearsal = "off,parallel"
  capsys.readouterr()
  out = evaluate.run(config, str(tmp_path / "run"))
  table = capsys.readouterr().out
  assert out["checkpoint_step"] == 1 and [r["rehearsal"] for r in out["rows"]] == ["off", "parallel"]
  for row in out["rows"]:
    assert (row["reward"], row["pass^1"], row["pass^2"]) == (1.0, 0.5, 0.0)
    assert (row["reward/invalid"], row["reward/scoring_errors"]) == (1.0, 1.0)
  assert (out["reward_gap"]["gap/trajectories"], out["reward_gap"]["gap/invalid"]) == (1.0, 1.0)
  lines = [line.split() for line in table.splitlines() if line.startswith("mock ")]
  assert [line[1] for line in lines] == ["off", "parallel"]
  # pass^1, pass^2, reward, invalid, scoring errors
  assert all(line[4:9] == ["0.500", "0.000", "1.000", "1", "1"] for line in lines)
  assert "1 left out as unscoreable, 1 of them by a scorer error" in table
  # Strict JSON (NaN written as "NaN", as in metrics.jsonl): a reader that refuses bare NaN reads it.
  saved = json.loads((tmp_path / "run" / evaluate.RESULTS_FILE).read_text(), parse_constant=_refuse)
  assert [r["reward/invalid"] for r in saved["rows"]] == [1.0, 1.0]


def _refuse(name: str):
  raise ValueError(f"{name} is not JSON")


def _no_model(*args, **kwargs):
  raise AssertionError("the model was loaded before the scorers were checked")


@pytest.mark.parametrize("where", ["train", "eval"])
def test_an_evaluator_that_cannot_be_set_up_stops_the_run_before_the_model_loads(
  tmp_path, data_dir, monkeypatch, where
):
  def reset(self, task):
    raise EnvError(f"τ² task {task.id!r} is scored by NL assertions, which need an LLM judge; not supported")

  monkeypatch.setattr(tau2.Tau2Env, "reset", reset)
  monkeypatch.setattr(runtime, "load_model", _no_model)
  config = _config(data_dir, "envace")
  with pytest.raises(config_check.ConfigError) as e:
    train.Trainer(config, str(tmp_path)) if where == "train" else evaluate.run(config, str(tmp_path))
  assert e.value.problems == [
    "env.benchmark='tau2', env.domain='mock': the benchmark's evaluator cannot score task 'create_task_1': τ² task "
    "'create_task_1' is scored by NL assertions, which need an LLM judge; not supported"
  ]


def _judged(data_dir, url, **overrides):
  return _config(
    data_dir, "envace", **{"reward.kind": "judge", "reward.judge_url": url, "reward.judge_model": "j", **overrides}
  )


@pytest.mark.parametrize("where", ["train", "eval"])
def test_a_judge_that_refuses_the_key_at_start_up_stops_the_run_before_the_model_loads(
  tmp_path, data_dir, monkeypatch, where
):
  from tests.rl.test_rewards import _Server

  server = _Server(lambda body, n: (401, '{"error": "invalid api key"}', 0.0))
  monkeypatch.setenv("ENVACE_TEST_JUDGE_KEY", "sk-wrong")
  monkeypatch.setattr(runtime, "load_model", _no_model)
  config = _judged(data_dir, server.url, **{"reward.judge_api_key_env": "ENVACE_TEST_JUDGE_KEY"})
  try:
    with pytest.raises(config_check.ConfigError) as e:
      train.Trainer(config, str(tmp_path)) if where == "train" else evaluate.run(config, str(tmp_path))
  finally:
    server.close()
  (problem,) = e.value.problems
  assert problem.startswith(
    f"reward.judge_url={server.url!r}, reward.judge_model='j', reward.judge_api_key_env='ENVACE_TEST_JUDGE_KEY': "
    f"judge endpoint {server.url}/chat/completions answered HTTP 401"
  )
  assert len(server.requests) == 1 and server.requests[0]["headers"]["Authorization"] == "Bearer sk-wrong"


def test_an_unreachable_judge_at_start_up_stops_the_run_before_the_model_loads(tmp_path, data_dir, monkeypatch):
  from envace_jax.rl import judge
  from tests.rl.test_rewards import _closed_port

  monkeypatch.setattr(judge.time, "sleep", lambda s: None)  # the probe's retries, without their backoff
  monkeypatch.setattr(runtime, "load_model", _no_model)
  url = f"http://127.0.0.1:{_closed_port()}/v1"
  with pytest.raises(
    config_check.ConfigError,
    match=rf"^invalid config \(1 problem\):\n  - reward.judge_url='{url}': "
    r"the judge cannot be reached \(ConnectError: .* \(after 5 attempts\)\); start it or fix the URL$",
  ):
    train.Trainer(_judged(data_dir, url), str(tmp_path))


@pytest.mark.slow
def test_a_judge_that_refuses_requests_mid_run_makes_them_invalid_and_a_revoked_key_stops_the_run(
  tmp_path, data_dir, monkeypatch
):
  """HTTP 400 (a prompt the server refuses) for every item after the start-up probe: each trajectory is invalid, the
  step counts them and skips the update. Then HTTP 401: the run stops with the config error."""
  from tests.rl.test_rewards import _Server

  status = {"code": 200}
  server = _Server(lambda body, n: (status["code"], '{"choices": [{"message": {"content": "{}"}}]}', 0.0))
  try:
    trainer = _scripted_trainer(_judged(data_dir, server.url, **{"train.eval_tasks": 0}), tmp_path)
    assert len(server.requests) == 1  # the probe
    status["code"] = 400
    record = trainer.step(1)
    assert (record["reward/invalid"], record["reward/scoring_errors"], record["update/skipped"]) == (2.0, 2.0, 1.0)
    assert math.isnan(record["reward/mean"])
    # create_task_1's derived checklist (rl/judge.py) has two items, the gold action and τ²'s NL assertion "The
    # agent confirmed the task was created successfully": two requests per trajectory, none retried.
    assert len(server.requests) == 1 + 2 * 2
    status["code"] = 401
    with pytest.raises(config_check.ConfigError, match=r"reward.judge_url=.*answered HTTP 401"):
      trainer.step(2)
  finally:
    server.close()


# ---------------------------------------------------------------------------------------------------------------------
# The reward gap rehearses held-out tasks with nothing of their gold (heldout.evaluate_policy).


@pytest.mark.parametrize("scenario_opening", [False, True])
def test_the_reward_gaps_rehearsals_see_no_gold_and_no_scenario(data_dir, monkeypatch, scenario_opening):
  """During the gap measurement the REHEARSE view holds the instructions, the tool schemas, the dialogue and the
  agent's own calls: no grounding block, none of the task's reference interactions (its gold actions executed for
  real) and nothing of the user scenario, also when the rollout opens with the scenario (rollout.scenario_opening).
  The training rollout of the same task does show its grounding (and the scenario, when it opens with it), which is
  what this test would catch leaking."""
  from envace_jax.rehearsal import unfold as unfold_lib
  from envace_jax.rehearsal import views
  from envace_jax.rehearsal.episode import UnfoldConfig

  overrides = {"eval.fidelity": False, "eval.fidelity_gold": False, "rollout.scenario_opening": scenario_opening}
  config = _config(data_dir, "envace", **overrides)
  task = next(t for t in runtime.training_tasks(config) if t.id == "create_task_1")
  (reference,) = task.reference_interactions
  assert reference.name == "create_task" and dict(reference.arguments) == GOLD
  tok = runtime.load_model(config).tokenizer
  scenario = [line.strip() for line in task.user_scenario.splitlines() if len(line.strip()) > 20]
  assert len(scenario) >= 2

  rehearse_views = []

  def recording(*args, **kwargs):
    out = unfold_lib.unfold(*args, **kwargs)
    rehearse_views.extend(tok.decode(v[Role.REHEARSE].tokens) for v in out.views if Role.REHEARSE in v)
    return out

  def leaks(text: str) -> list[str]:
    found = [s for s in (views.GROUNDING_HEADER, reference.result) if s in text]
    return found + [s for s in scenario if s in text]

  monkeypatch.setattr(heldout, "unfold", recording)
  samplers = {"policy": Policy(tok), "reference": User(tok)}
  summary, _ = heldout.evaluate_policy(config, [task], samplers, tok, jax.random.key(0), num_trials=2)
  assert summary["gap/trajectories"] == 2.0 and len(rehearse_views) == 2
  for text in rehearse_views:
    assert CALL["gold"] in text or CALL["wrong"] in text  # REHEARSE did rehearse the agent's call
    assert leaks(text) == []
  # The same task rolled out for training: its REHEARSE view is grounded in the reference interaction.
  ucfg = UnfoldConfig.from_config(config)
  out = unfold_lib.unfold([task], Policy(tok), tok, ucfg, jax.random.key(0), reference_sampler=User(tok))
  shown = [views.GROUNDING_HEADER, reference.result, *(scenario if scenario_opening else [])]
  assert leaks(tok.decode(out.views[0][Role.REHEARSE].tokens)) == shown
