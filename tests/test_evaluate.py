"""pass^k as τ²-bench defines it: per task C(c, k) / C(n, k), averaged over tasks."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import pytest

from envace_jax import evaluate, heldout, scoring
from envace_jax.envs.base import RewardInfo


def test_pass_hat_k_hand_computed():
  # One task, c = 2 successes of n = 4 trials: pass^1 = 2/4, pass^2 = C(2,2)/C(4,2) = 1/6, pass^3 = 0.
  assert scoring.pass_hat_k([2], 4, 1) == pytest.approx(0.5)
  assert scoring.pass_hat_k([2], 4, 2) == pytest.approx(1 / 6)
  assert scoring.pass_hat_k([2], 4, 3) == 0.0
  # Averaged over tasks: (C(4,2)/C(4,2) + C(1,2)/C(4,2)) / 2 = (1 + 0) / 2.
  assert scoring.pass_hat_k([4, 1], 4, 2) == pytest.approx(0.5)


class _KnownEnv:
  """A stand-in for a benchmark's environment whose evaluator returns a fixed reward, or raises (``None``)."""

  def __init__(self, reward):
    self.reward = reward

  def evaluate(self, conversation):
    if self.reward is None:
      raise RecursionError("maximum recursion depth exceeded")  # as BFCL's checker on arguments nested too deep
    return RewardInfo(self.reward)


def test_score_committed_counts_invalid_trials_as_failures_and_0_999999_as_a_success(create_task):
  """3 tasks x 3 trials with known rewards, checked against τ²-bench's own `is_successful` and `pass_hat_k`.
  Task 0: 1.0, 0.999999 (a success: τ² accepts |r - 1| <= 1e-6), 0.0. Task 1: 1.0, a scorer that raises (invalid, a
  failed trial), 1.0. Task 2: 0.5, 0.9999989 (not a success), an external user that failed (invalid, not a scoring
  error)."""
  from tau2.metrics import agent_metrics

  from envace_jax.rehearsal.trajectory import Termination, Trajectory

  rewards = [[1.0, 0.999999, 0.0], [1.0, None, 1.0], [0.5, 0.9999989, 0.25]]
  trajectories, envs = [], []
  for b, row in enumerate(rewards):
    for g, r in enumerate(row):
      trajectories.append(Trajectory(create_task, b, g, [], counts={"generations_act": b + g, "tool_calls": g}))
      envs.append(_KnownEnv(r))
  trajectories[-1].termination = Termination.USER_ERROR
  summary = scoring.score_committed(_tiny_config("/unused"), trajectories, envs, num_tasks=3, num_trials=3)
  valid = [1.0, 0.999999, 0.0, 1.0, 1.0, 0.5, 0.9999989]
  assert summary["reward"] == pytest.approx(sum(valid) / 7, abs=1e-15)
  assert (summary["tasks"], summary["trials"]) == (3.0, 3.0)
  assert (summary["reward/invalid"], summary["reward/scoring_errors"]) == (2.0, 1.0)
  assert summary["turns"] == 2.0 and summary["tool_calls"] == 1.0  # means over all nine trials
  successes = [
    sum(r is not None and agent_metrics.is_successful(r) for r in row[: 2 if b == 2 else 3])
    for b, row in enumerate(rewards)
  ]
  assert successes == [2, 2, 0]
  # pass^1's 95% interval over tasks (2/3, 2/3, 0): a resample's mean is 0, 2/9, 4/9 or 2/3 with CDF 1/27, 7/27,
  # 19/27, 1, so its 2.5th and 97.5th percentiles are 0 and 2/3.
  assert (summary["pass^1/lo"], summary["pass^1/hi"]) == (0.0, pytest.approx(2 / 3))
  assert (
    [scoring.is_success(r) for r in (1.0, 0.999999, 0.9999989, 1.000001, 1.0000011)]
    == [agent_metrics.is_successful(r) for r in (1.0, 0.999999, 0.9999989, 1.000001, 1.0000011)]
    == [True, True, False, True, False]
  )
  for k in (1, 2, 3):
    want = sum(agent_metrics.pass_hat_k(3, c, k) for c in successes) / 3
    assert summary[f"pass^{k}"] == pytest.approx(want, abs=1e-15)
  assert (summary["pass^1"], summary["pass^2"], summary["pass^3"]) == pytest.approx((4 / 9, 2 / 9, 0.0), abs=1e-15)
  assert [t.reward.valid for t in trajectories] == [True] * 4 + [False] + [True] * 3 + [False]
  assert (
    "RecursionError" in trajectories[4].reward.info["scoring_error"] and trajectories[4].counts["scoring_error"] == 1
  )


@pytest.mark.parametrize("successes,n,k", [([1], 2, 0), ([1], 2, 3), ([3], 2, 1), ([-1], 2, 1)])
def test_pass_hat_k_rejects_bad_counts(successes, n, k):
  with pytest.raises(ValueError, match="pass\\^k|success counts"):
    scoring.pass_hat_k(successes, n, k)


# ---------------------------------------------------------------------------------------------------------------------
# The rehearsal-vs-real reward gap and --mode=eval.


@pytest.fixture(scope="module")
def create_task():
  from envace_jax.envs import tau2

  return next(t for t in tau2.load_tasks("mock", "base") if t.id == "create_task_1")


def _rehearsed(task, calls: bool):
  from envace_jax.envs.base import ChatMessage, ToolCall
  from envace_jax.rehearsal.trajectory import Trajectory

  call = ToolCall("create_task", {"user_id": "user_1", "title": "Important Meeting"}, id="call_0")
  messages = [ChatMessage("assistant", "Hi! How can I help you today?"), ChatMessage("user", "Create the task.")]
  if calls:
    messages += [
      ChatMessage("assistant", "", tool_calls=(call,)),
      ChatMessage("tool", '{"task_id": "imagined_99"}', tool_call_id="call_0", name="create_task"),
    ]
  messages += [ChatMessage("assistant", "Done: the task is created."), ChatMessage("user", "Thanks! ###STOP###")]
  return Trajectory(task, 0, 0, messages)


def test_replay_for_real_swaps_rehearsed_results_for_real_ones(create_task):
  from envace_jax.envs import tau2

  env = tau2.Tau2Env("mock")
  replayed = scoring.replay_for_real(create_task, _rehearsed(create_task, True).messages, env)
  assert [m.role for m in replayed] == ["assistant", "user", "assistant", "tool", "assistant", "user"]
  real = replayed[3]
  assert "imagined_99" not in real.content and '"title": "Important Meeting"' in real.content
  assert real.tool_call_id == "call_0" and not real.is_error
  assert env.evaluate(replayed).reward == 1.0


def test_reward_gap_hand_computed(create_task):
  # create_task_1 has one gold action and no communicate_info: rule items action (weight 1) + well_formed (1).
  # With the call: rule 1.0, real 1.0. Without it: rule (0 + 1) / 2 = 0.5, real 0 (the DB lacks the task).
  # Means: rehearsed 0.75, real 0.5, gap 0.25.
  config = _tiny_config("/unused")
  trajs = [_rehearsed(create_task, True), _rehearsed(create_task, False)]
  gap = scoring.reward_gap(config, [create_task, create_task], trajs)
  assert gap == {
    "gap/rehearsed_reward": 0.75,
    "gap/real_reward": 0.5,
    "gap/gap": 0.25,
    "gap/trajectories": 2.0,
    "gap/invalid": 0.0,
    "gap/scoring_errors": 0.0,
  }


def _tiny_config(data_dir, **overrides):
  from tests.test_train import tiny_config

  return tiny_config(data_dir, **overrides)


@pytest.mark.slow
def test_eval_mode_on_a_trained_checkpoint(tmp_path, data_dir, capsys, monkeypatch):
  """Train one scripted step (tests/test_loop.py's stand-ins), then --mode=eval with the same stand-ins: the
  checkpoint is restored, every rehearsal mode runs on the same openings (trial 1 asks for the gold task, trial 2 for
  a wrong one), costs, fidelity and the reward gap are reported, printed and written as JSON."""
  import json

  from envace_jax import runtime
  from tests.test_loop import CALL, DONE, RESPONSE, STOP, Policy, User, _config, _scripted_trainer, _tokens
  from tests.test_train import _params

  config = _config(data_dir, "envace", **{"train.eval_tasks": 0, "eval.num_trials": 2})
  trainer = _scripted_trainer(config, tmp_path / "run")
  trainer.run()
  model = runtime.load_model(config)
  tok = model.tokenizer
  params, step = evaluate.restore_policy(config, model, str(tmp_path / "run"))
  saved = _params(tmp_path / "run", 1)
  assert step == 1 and all(
    bool((a == b).all()) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(saved), strict=True)
  )
  assert evaluate.restore_policy(config, model, str(tmp_path / "empty")) == (model.params, None)

  made = iter([Policy(tok), User(tok)])
  monkeypatch.setattr(runtime, "make_sampler", lambda *args, **kwargs: next(made))
  result = evaluate.run(config, str(tmp_path / "run"))
  table = capsys.readouterr().out
  assert [r["rehearsal"] for r in result["rows"]] == ["off", "parallel", "sequential"]
  assert result["checkpoint_step"] == 1 and "step 1" in result["weights"]
  n = config.eval.rehearsal_n  # configs/tiny.py: 2
  # Per (task, trial): the committed execution calls, reads the real response and reports, and the user stops; every
  # rehearsal does the same with an imagined response and an imagined user.
  committed = _tokens(tok, CALL["gold"], DONE, STOP, CALL["wrong"], DONE, STOP)
  rehearsal = _tokens(tok, CALL["gold"], RESPONSE, DONE, STOP, CALL["wrong"], RESPONSE, DONE, STOP)
  for row in result["rows"]:
    assert row["tasks"] == 1 and row["trials"] == 2
    assert (row["reward"], row["pass^1"], row["pass^2"]) == (0.5, 0.5, 0.0)  # the wrong title fails τ²'s DB check
    assert row["cost/execution/generated_tokens"] == committed and row["fidelity/calls"] == 2
    if row["rehearsal"] == "off":
      assert row["N"] == 0 and row["cost/rehearsal/generated_tokens"] == 0 and "memory_tokens" not in row
    else:
      assert row["N"] == n and row["cost/rehearsal/generated_tokens"] == n * rehearsal
      assert row["memory_tokens"] == min(config.eval.memory_max_tokens, len(tok.encode(Policy.MEMORY)))
  gap = result["reward_gap"]  # rule checklist 1.0 and 0.5 (the wrong call), τ² on the real DB 1.0 and 0.0
  assert (gap["gap/trajectories"], gap["gap/rehearsed_reward"], gap["gap/real_reward"]) == (2, 0.75, 0.5)
  # REHEARSE on the gold calls: measured once (not per mode), one probe per assistant-side gold action of the task.
  assert (
    result["fidelity_gold"]["fidelity_gold/calls"] == 1 and result["fidelity_gold"]["fidelity_gold/json_valid"] == 1
  )
  assert not any(k.startswith(("fidelity_gold/", "gap/")) for row in result["rows"] for k in row)
  for word in ("off", "parallel", "sequential", "pass^1", "pass^2", "keyF1", "reward gap", "gold calls"):
    assert word in table
  written = json.loads((tmp_path / "run" / evaluate.RESULTS_FILE).read_text())
  assert json.dumps(written["rows"], sort_keys=True) == json.dumps(result["rows"], sort_keys=True, default=float)


def test_act_turns_in_rehearse_format_hand_counted(create_task):
  """1 of 4 ACT generations holds a ``<tool_response>`` block (the agent answering as the environment); the tool
  message's own block is not ACT's; no generation at all: NaN."""
  import math

  from envace_jax.envs.base import ChatMessage, ToolCall
  from envace_jax.rehearsal.trajectory import Trajectory

  call = ToolCall("create_task", {"user_id": "user_1", "title": "T"}, id="c0")
  confused = [ChatMessage("user", "hi"), ChatMessage("assistant", '<tool_response>\n{"ok": 1}\n</tool_response>'),
              ChatMessage("assistant", "Done.")]  # fmt: skip
  fine = [ChatMessage("assistant", tool_calls=(call,)), ChatMessage("tool", "<tool_response>", tool_call_id="c0"),
          ChatMessage("assistant", "Created.")]  # fmt: skip
  trajectories = [
    Trajectory(create_task, 0, 0, confused, counts={"generations_act": 2}),
    Trajectory(create_task, 0, 1, fine, counts={"generations_act": 2}),
  ]
  assert scoring.act_in_rehearse_format(trajectories) == 0.25
  assert math.isnan(scoring.act_in_rehearse_format([Trajectory(create_task, 0, 0, [], counts={})]))
  summary = scoring.score_committed(_tiny_config("/unused"), trajectories, [_KnownEnv(0.0)] * 2, 1, 2)
  assert summary["act_rehearse_format"] == 0.25


def _per_role_run(workdir, data_dir):
  """(config, params) of a per-role tiny run's checkpoint at step 1 in ``workdir``, saved as the Trainer saves it
  (its config with it) without training: the initial state, ACT's tree doubled so that it is not the base weights."""
  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax import runtime
  from envace_jax.rl import grpo

  config = _tiny_config(data_dir, **{"grpo.mode": "per_role"})
  state = grpo.init_train_state(grpo.GrpoConfig.from_config(config), runtime.load_model(config).params)
  params = {**state.params, "act": jax.tree.map(lambda x: x * 2, state.params["act"])}
  with checkpoint_lib.Checkpointer.from_config(workdir, config) as ckpt:
    ckpt.save(1, params=params, opt_state=state.opt_state, rng=jax.random.key(0), force=True)
  return config, params


def test_eval_reads_a_per_role_runs_config_from_its_checkpoint(tmp_path, data_dir, capsys):
  """``--mode=eval --workdir=DIR`` on a per-role run: the config saved with the checkpoint (per_role) is used, the
  --config.KEY flags given are set on it, and the ACT and REHEARSE trees restore; the tiny config as given (EnvACE,
  one tree) does not fit that checkpoint."""
  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax import runtime

  workdir = str(tmp_path / "run")
  trained, saved = _per_role_run(workdir, data_dir)
  given = _tiny_config(data_dir)
  config = evaluate.command_config(given, workdir, {"eval.tasks": 3, "eval.rehearsal": "off"}, config_given=False)
  assert capsys.readouterr().out == (
    f"config: the run's own, saved with step 1 in {workdir}, with eval.rehearsal='off', eval.tasks=3\n"
  )
  assert (config.grpo.mode, config.eval.tasks, config.eval.rehearsal) == ("per_role", 3, "off")
  trained.eval.tasks, trained.eval.rehearsal = 3, "off"
  as_json = lambda c: json.loads(c.to_json_best_effort())  # noqa: E731  (the stored config holds lists for tuples)
  assert as_json(config) == as_json(trained)
  model = runtime.load_model(config)
  params, step = evaluate.restore_policy(config, model, workdir)
  assert step == 1 and set(params) == {"act", "rehearse"}
  leaves = lambda tree: jax.tree.leaves(tree)  # noqa: E731
  assert all(bool((a == b).all()) for a, b in zip(leaves(params), leaves(saved), strict=True))
  with pytest.raises(checkpoint_lib.IncompatibleCheckpointError, match="grpo.mode: checkpoint 'per_role'"):
    evaluate.restore_policy(given, model, workdir)  # what --config=configs/tiny.py alone did before


def test_eval_command_needs_no_flags_on_a_run_and_says_when_it_evaluates_base_weights(
  tmp_path, data_dir, capsys, monkeypatch
):
  """The command line on a run's workdir needs no --config (the run's own is read; a flag given still applies: here
  eval.tasks=0, which the config check refuses after the announcement, so nothing is evaluated). On an empty workdir
  one line says the base weights of --config's model are evaluated; without --config either, one line says why."""
  root = pathlib.Path(__file__).resolve().parents[1]
  run, empty = tmp_path / "run", str(tmp_path / "empty")
  _per_role_run(str(run), data_dir)
  cmd = [sys.executable, "-m", "envace_jax.main", "--mode=eval", f"--workdir={run}", "--config.eval.tasks=0"]
  proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, text=True)
  assert proc.returncode == 2 and proc.stdout.startswith(
    f"config: the run's own, saved with step 1 in {run}, with eval.tasks=0\n"
    "invalid config: eval.tasks=0: --mode=eval needs at least one task"
  ), proc.stdout
  given = _tiny_config(data_dir)
  with pytest.raises(ValueError, match=f"--mode=eval: {empty} does not exist; give --config=FILE"):
    evaluate.command_config(given, empty, {}, config_given=False)
  pathlib.Path(empty).mkdir()
  with pytest.raises(ValueError, match=f"--mode=eval: {empty} holds no checkpoint to read the run's config from"):
    evaluate.command_config(given, empty, {}, config_given=False)
  assert evaluate.command_config(given, empty, {}) is given and capsys.readouterr().out == ""

  class Stop(Exception):
    pass

  def stop(*args, **kwargs):
    raise Stop

  monkeypatch.setattr(heldout, "evaluate_policy", stop)  # the line comes before any task runs
  with pytest.raises(Stop):
    evaluate.run(given, empty)
  out = capsys.readouterr().out  # after TFDS's lines where this process prepares the data
  assert out.splitlines()[-1] == f"no checkpoint in {empty}: evaluating the base weights of tiny", out
