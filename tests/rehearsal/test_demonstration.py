"""Demonstrations for the supervised warm-up: reference conversations replayed through the rollout's bookkeeping.

The checks: the trained tokens are exactly the gold calls (ACT) and the real tools' responses (REHEARSE) as the roles
write them; the rows are what a rollout's views hold; and the replayed conversation is a correct one by the
benchmark's own evaluator (τ²'s ``evaluate_simulation``, BFCL's checker), in rehearse and in real mode.
"""

from __future__ import annotations

import pytest

from envace_jax.envs import bfcl, registry, tau2
from envace_jax.envs.base import EnvError, Task
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Tokenizer
from envace_jax.rehearsal import demonstration, views
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rehearsal.trajectory import Termination


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer) -> Tokenizer:
  return smollm2_tokenizer  # the tokenizer only: no test here runs SmolLM2's weights


@pytest.fixture(scope="module")
def mock_tasks():
  return {t.id: t for t in tau2.load_tasks("mock", "base")}


def _demo(tokenizer, task, env_mode="rehearse", **config):
  env = tau2.Tau2Env(task.domain) if task.benchmark == "tau2" else bfcl.BfclEnv()
  conversation = registry.get(task.benchmark).reference_conversation(task, env)
  sizes = {"group_size": 2, "act_capacity": 8192, "rehearse_capacity": 8192}
  cfg = UnfoldConfig.from_config(**{**sizes, "env_mode": env_mode, **config})
  real = (tau2.Tau2Env(task.domain) if task.benchmark == "tau2" else bfcl.BfclEnv()) if env_mode == "real" else None
  return demonstration.demonstration(cfg, task, conversation, tokenizer, views.ChatFormat.of(tokenizer), 3, env=real)


def _trained_text(tokenizer, row):
  return tokenizer.decode(row.tokens[row.loss_mask])


def test_tau2_demonstration_trains_the_gold_call_and_the_real_response(tokenizer, mock_tasks):
  task = mock_tasks["create_task_1"]
  traj = _demo(tokenizer, task)
  act, rehearse = traj.rows[int(Role.ACT)], traj.rows[int(Role.REHEARSE)]
  call = tool_format.render_tool_call("create_task", {"user_id": "user_1", "title": "Important Meeting"})
  assert _trained_text(tokenizer, act) == call  # a call ends at its stop string: no eos is trained
  response = '{"task_id": "task_2", "title": "Important Meeting", "description": null, "status": "pending"}'
  assert _trained_text(tokenizer, rehearse) == tool_format.render_tool_response(response)
  assert (act.role, act.trajectory, act.num_generations) == (int(Role.ACT), 3, 1)
  assert set(act.roles[act.loss_mask].tolist()) == {int(Role.ACT)} and not act.logprobs.any()
  # The agent's view: the greeting, the scenario standing in for the user's first message, then the call.
  text = tokenizer.decode(act.tokens)
  assert text.index("Hi! How can I help you today?") < text.index("Create a new task called 'Important Meeting'")
  assert text.endswith("<|im_start|>assistant\n" + call)
  assert traj.termination == Termination.USER_STOP and traj.reward.reward == 1.0
  assert traj.counts["demonstration_messages"] == 2 and traj.counts["tool_calls"] == 1
  # The replayed conversation is a correct one by τ²'s own evaluator.
  env = tau2.Tau2Env("mock")
  env.reset(task)
  assert env.evaluate(traj.messages).reward == 1.0


def test_tau2_logged_history_is_not_repeated_and_replies_end_with_eos(tokenizer, mock_tasks):
  task = mock_tasks["update_task_with_initialization_data"]  # one gold call, then the information to communicate
  traj = _demo(tokenizer, task)
  act = traj.rows[int(Role.ACT)]
  assert act.num_generations == 2
  reply = "; ".join(task.communicate_info)
  assert _trained_text(tokenizer, act).endswith(reply + "<|im_end|>")
  history = mock_tasks["update_task_with_message_history"]
  traj = _demo(tokenizer, history)
  text = tokenizer.decode(traj.rows[int(Role.ACT)].tokens)
  assert text.count("I need to create a task for the project review meeting.") == 1
  env = tau2.Tau2Env("mock")
  env.reset(history)
  assert env.evaluate(traj.messages).reward == 1.0


def test_real_mode_has_act_rows_only_and_the_env_answers(tokenizer, mock_tasks):
  task = mock_tasks["update_task_1"]
  traj = _demo(tokenizer, task, env_mode="real")
  assert set(traj.rows) == {int(Role.ACT)}
  tool = [m for m in traj.messages if m.role == "tool"]
  assert len(tool) == 1 and '"status": "completed"' in tool[0].content
  env = tau2.Tau2Env("mock")
  env.reset(task)
  assert env.evaluate(traj.messages).reward == 1.0


def test_a_demonstration_that_does_not_fit_ends_with_context_exhausted(tokenizer, mock_tasks):
  task = mock_tasks["create_task_1"]
  opening = _demo(tokenizer, task).rows[int(Role.ACT)]
  prompt = len(opening.tokens) - int(opening.loss_mask.sum()) - 3  # the opening before the call's header
  traj = _demo(tokenizer, task, act_capacity=prompt + 10)
  assert traj.termination == Termination.CONTEXT_EXHAUSTED
  assert int(Role.ACT) not in traj.rows  # nothing was recorded past the capacity


def test_bfcl_parallel_calls_become_one_call_per_generation_each_with_its_result(tokenizer):
  task = bfcl.load_tasks("multi_turn_base")[0]
  per_turn = [len(calls) for calls in task.criteria["ground_truth"]]
  assert max(per_turn) > 1  # the case under test: several ground-truth calls in one turn
  for env_mode in ("rehearse", "real"):
    traj = _demo(tokenizer, task, env_mode=env_mode, greeting="")
    act = traj.rows[int(Role.ACT)]
    assert act.num_generations == sum(per_turn) and traj.counts["user_turns"] == len(task.user_turns)
    assert traj.termination == Termination.USER_TURNS_DONE
    if env_mode == "rehearse":
      assert traj.rows[int(Role.REHEARSE)].num_generations == sum(per_turn)
    # each call is followed by its own result, in the order the ground truth lists them
    kinds = [("call" if m.tool_calls else "result") for m in traj.messages if m.role in ("assistant", "tool")]
    assert kinds == ["call", "result"] * sum(per_turn)
    env = bfcl.BfclEnv()
    env.reset(task)
    assert env.evaluate(traj.messages).reward == 1.0


def test_benchmarks_without_gold_calls_are_refused_with_the_fix():
  task = Task(id="t", benchmark="checklist", domain="d", split="train", system_prompt="s", tools=(), user_turns=("hi",))
  with pytest.raises(EnvError, match=r"supports tau2, bfcl, testbed \(set train.sft_warmup_steps=0\)"):
    registry.get(task.benchmark).reference_conversation(task, env=None)
