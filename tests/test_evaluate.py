"""pass^k as τ²-bench defines it: per task C(c, k) / C(n, k), averaged over tasks."""

from __future__ import annotations

import jax
import pytest

from envace_jax import evaluate


def test_pass_hat_k_hand_computed():
  # One task, c = 2 successes of n = 4 trials: pass^1 = 2/4, pass^2 = C(2,2)/C(4,2) = 1/6, pass^3 = 0.
  assert evaluate.pass_hat_k([2], 4, 1) == pytest.approx(0.5)
  assert evaluate.pass_hat_k([2], 4, 2) == pytest.approx(1 / 6)
  assert evaluate.pass_hat_k([2], 4, 3) == 0.0
  # Averaged over tasks: (C(4,2)/C(4,2) + C(1,2)/C(4,2)) / 2 = (1 + 0) / 2.
  assert evaluate.pass_hat_k([4, 1], 4, 2) == pytest.approx(0.5)


@pytest.mark.parametrize("successes,n,k", [([1], 2, 0), ([1], 2, 3), ([3], 2, 1), ([-1], 2, 1)])
def test_pass_hat_k_rejects_bad_counts(successes, n, k):
  with pytest.raises(ValueError, match="pass\\^k|success counts"):
    evaluate.pass_hat_k(successes, n, k)


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
  replayed = evaluate.replay_for_real(create_task, _rehearsed(create_task, True).messages, env)
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
  gap = evaluate.reward_gap(config, [create_task, create_task], trajs)
  assert gap == {
    "gap/rehearsed_reward": 0.75,
    "gap/real_reward": 0.5,
    "gap/gap": 0.25,
    "gap/trajectories": 2.0,
  }


def _tiny_config(data_dir, **overrides):
  from tests.test_train import tiny_config

  return tiny_config(data_dir, **overrides)


@pytest.mark.slow
def test_eval_mode_on_a_trained_checkpoint(tmp_path, capsys):
  """Train the tiny config one step, then --mode=eval: the checkpoint is restored, every rehearsal mode runs on the
  same openings, costs, fidelity and the reward gap are reported, printed and written as JSON."""
  import json

  from envace_jax import train
  from tests.test_train import _params

  data_dir = tmp_path / "tfds"
  config = _tiny_config(data_dir, **{"train.steps": 1, "train.eval_tasks": 0, "eval.num_trials": 2})
  train.train_and_evaluate(config, str(tmp_path / "run"))
  model = evaluate.runtime.load_model(config)
  params, step = evaluate.restore_policy(config, model, str(tmp_path / "run"))
  saved = _params(tmp_path / "run", 1)
  assert step == 1 and all(
    bool((a == b).all()) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(saved), strict=True)
  )
  assert evaluate.restore_policy(config, model, str(tmp_path / "empty")) == (model.params, None)

  result = evaluate.run(config, str(tmp_path / "run"))
  table = capsys.readouterr().out
  assert [r["rehearsal"] for r in result["rows"]] == ["off", "parallel", "sequential"]
  assert result["checkpoint_step"] == 1 and "step 1" in result["weights"]
  for row in result["rows"]:
    assert row["tasks"] == 1 and row["trials"] == 2 and {"pass^1", "pass^2", "fidelity/calls"} <= set(row)
    assert row["cost/execution/generated_tokens"] > 0 and row["cost/opening/generated_tokens"] > 0
    if row["rehearsal"] == "off":
      assert row["cost/rehearsal/generated_tokens"] == 0 and "memory_tokens" not in row
    else:
      assert row["N"] == 2 and row["cost/rehearsal/generated_tokens"] > 0 and row["cost/assessment/seconds"] > 0
      assert 0 < row["memory_tokens"] <= 16
  assert result["reward_gap"]["gap/trajectories"] == 2
  # REHEARSE on the gold calls: measured once (not per mode), one probe per assistant-side gold action of the task.
  task = evaluate.runtime.load_split(config, config.env.eval_split)[0]
  gold_calls = sum(a.requestor == "assistant" for a in task.gold_actions)
  assert gold_calls >= 1 and result["fidelity_gold"]["fidelity_gold/calls"] == gold_calls
  assert 0.0 <= result["fidelity_gold"]["fidelity_gold/json_valid"] <= 1.0
  assert not any(k.startswith("fidelity_gold/") for row in result["rows"] for k in row)
  for word in ("off", "parallel", "sequential", "pass^1", "pass^2", "keyF1", "reward gap", "gold calls"):
    assert word in table
  written = json.loads((tmp_path / "run" / evaluate.RESULTS_FILE).read_text())
  assert [r["rehearsal"] for r in written["rows"]] == ["off", "parallel", "sequential"]
