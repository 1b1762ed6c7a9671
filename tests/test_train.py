"""The training loop end to end on the tiny config (random tiny model, SmolLM2's tokenizer, τ² mock tasks)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import config_check, evaluate, metrics, runtime, train
from envace_jax.envs import datasets

ROOT = pathlib.Path(__file__).resolve().parents[1]


# configs/tiny.py's model on the testbed (logged user turns) instead of τ²'s mock tasks.
TESTBED = {"env.benchmark": "testbed", "env.domain": "cpu", "env.split": "train", "env.eval_split": "iid"}


def tiny_config(data_dir, **overrides):
  spec = importlib.util.spec_from_file_location("tiny_config", ROOT / "configs" / "tiny.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.env.data_dir = str(data_dir)
  c.train.eval_tasks = 1
  for dotted, value in overrides.items():
    *path, leaf = dotted.split(".")
    node = c
    for p in path:
      node = node[p]
    node[leaf] = value
  return c


def _params(workdir, step):
  restored = checkpoint_lib.Checkpointer(workdir).restore(step)
  return restored.params


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"grpo.mode": "ppo"}, "grpo.mode"),
    ({"train.group_size": 1}, "group_size"),
    ({"grpo.dynamic_sampling_max_draws": -1}, r"grpo.dynamic_sampling_max_draws=-1 must be >= 0"),
    ({"model": "qwen3-8b", "model_path": "/nonexistent/qwen3"}, "model_path"),
    (
      {"train.sft_warmup_steps": 1, "env.benchmark": "checklist"},
      r"train.sft_warmup_steps=1 with env.benchmark='checklist': .* only 'tau2', 'bfcl', 'testbed' have; set it to 0",
    ),
    ({"train.sft_warmup_steps": 3}, "train.sft_warmup_steps=3 must be <= train.steps=2"),
    ({"chat_template": "qwen3"}, r"chat_template='qwen3' is not valid .*; choose one of '', 'chatml'"),
    ({"attention": "flash"}, r"attention='flash' is not valid; choose one of 'auto', 'reference', 'xla', 'cudnn', "),
    ({"train.eval_tasks": -2}, r"train.eval_tasks=-2 must be >= -1 \(-1: every task of eval_split, 0: no evaluation\)"),
    (
      {"env.train_task_ids": "create_task_1, no_such_task"},
      r"env.train_task_ids: no_such_task not in tau2 mock split 'base'; its tasks are create_task_1, ",
    ),
    (
      {"env.train_task_ids": "create_task_1", "train.tasks_per_step": 2},
      r"train.tasks_per_step=2 exceeds the 1 training tasks",
    ),
    (
      {"env.eval_task_ids": "update_task_1,nope"},
      r"env.eval_task_ids: nope not in tau2 mock split 'base'; its tasks are create_task_1, ",
    ),
  ],
)
def test_bad_config_fails_before_any_compute(tmp_path, data_dir, monkeypatch, overrides, message):
  def no_compute(*args, **kwargs):
    raise AssertionError("a model was loaded before the config was validated")

  monkeypatch.setattr(runtime, "load_model", no_compute)
  with pytest.raises(config_check.ConfigError, match=message):
    train.train_and_evaluate(tiny_config(data_dir, **overrides), str(tmp_path))
  assert not os.listdir(tmp_path)


def test_train_task_ids_keep_those_tasks_in_the_order_given(data_dir):
  config = tiny_config(data_dir, **{"env.train_task_ids": "impossible_task_1, create_task_1,impossible_task_1"})
  assert [t.id for t in runtime.training_tasks(config)] == ["impossible_task_1", "create_task_1"]
  assert len(runtime.training_tasks(tiny_config(data_dir))) == 9  # "": the whole split


def test_eval_task_ids_keep_those_tasks_then_the_first_n(data_dir):
  config = tiny_config(data_dir, **{"env.eval_task_ids": "impossible_task_1,update_task_1,create_task_1"})
  assert [t.id for t in runtime.evaluation_tasks(config, -1)] == ["impossible_task_1", "update_task_1", "create_task_1"]
  assert [t.id for t in runtime.evaluation_tasks(config, 2)] == ["impossible_task_1", "update_task_1"]
  config.eval.tasks = 1
  assert [t.id for t in evaluate.eval_tasks(config)] == ["impossible_task_1"]
  assert [t.id for t in runtime.evaluation_tasks(tiny_config(data_dir), 2)] == [
    "create_task_1",
    "create_task_1_with_env_assertions",
  ]


def test_a_scorer_that_raises_makes_the_trajectory_invalid_and_is_recorded():
  """Arguments nested deeper than the benchmark's checker can recurse (a looping model output) must not crash the
  step, and must not be a valid 0 either: the trajectory is invalid and the error is recorded and counted."""
  from envace_jax import scoring
  from envace_jax.envs import bfcl
  from envace_jax.envs.base import ChatMessage, ToolCall
  from envace_jax.rehearsal.trajectory import Trajectory

  task = bfcl.load_tasks("multi_turn_base")[0]
  nested = 1
  for _ in range(400):
    nested = [nested]
  conv = [
    ChatMessage("user", task.user_turns[0]),
    ChatMessage("assistant", tool_calls=(ToolCall("cd", {"folder": nested}),)),
  ]
  traj = Trajectory(task=task, group=0, sample=0, messages=conv)
  env = bfcl.BfclEnv()
  env.reset(task)
  traj.reward = scoring.score(tiny_config("/unused"), traj, env=env)
  assert not traj.reward.valid and np.isnan(traj.reward.reward)
  assert "RecursionError" in traj.reward.info[scoring.SCORING_ERROR]
  assert traj.counts[scoring.SCORING_ERROR] == 1 and "RecursionError" in traj.events[-1][scoring.SCORING_ERROR]
  assert scoring.counts([traj]) == {"reward/invalid": 1.0, "reward/scoring_errors": 1.0}


def test_chat_template_chatml_replaces_the_tokenizers_own(data_dir):
  """config.chat_template="chatml" renders the views in ChatML (for templates that are not append-only, as Qwen3's)."""
  from envace_jax.model.tokenizer import Message

  own = runtime.load_model(tiny_config(data_dir)).tokenizer
  chatml = runtime.load_model(tiny_config(data_dir, chat_template="chatml")).tokenizer
  assert own.chat_template is not None and chatml.chat_template is None  # SmolLM2's GGUF ships its own
  chat = [Message("user", "hi")]
  assert chatml.render_text(chat) == "<|im_start|>user\nhi<|im_end|>\n"
  assert own.render_text(chat) != chatml.render_text(chat)  # SmolLM2's template adds its default system prompt


@pytest.mark.slow
def test_pretrained_weights_are_stored_in_param_dtype(smollm2):
  """config.param_dtype applies to real weights as to random ones (bfloat16 halves a run's parameter memory)."""
  from envace_jax.config import defaults

  config = defaults.get_config()  # model smollm2-135m, its bundled weights
  config.dtype = config.param_dtype = "bfloat16"
  model = runtime.load_model(config)
  leaves = jax.tree.leaves(model.params)
  assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)} and model.config.param_dtype == "bfloat16"
  reference = jax.tree.leaves(smollm2.params)
  assert len(leaves) == len(reference)
  np.testing.assert_array_equal(
    np.asarray(leaves[0], np.float32), np.asarray(reference[0].astype(jnp.bfloat16), np.float32)
  )


def test_bf16_compute_trains_float32_master_weights_and_samples_from_bf16_copies(tmp_path, data_dir):
  """bfloat16 compute (issue 40): the train state holds float32 master weights (here the per-role ablation's two
  trees); each policy sampler reads a bfloat16 copy of its tree on the same device, made again at every sync; the
  frozen reference (its sampler's and the KL's) is held in bfloat16 only."""
  trainer = train.Trainer(tiny_config(data_dir, dtype="bfloat16", **{"grpo.mode": "per_role"}), str(tmp_path))
  f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
  leaves = jax.tree.leaves

  def check_copies(state_params):
    for tree, sampler in (("act", "policy"), ("rehearse", "rehearse")):
      master, copy = leaves(state_params[tree]), leaves(trainer.samplers[sampler].params)
      assert {x.dtype for x in master} == {f32} and {x.dtype for x in copy} == {bf16}
      for m, c in zip(master, copy, strict=True):
        assert c.sharding == m.sharding
        np.testing.assert_array_equal(np.asarray(c), np.asarray(m.astype(jnp.bfloat16)))

  check_copies(trainer.state.params)
  assert trainer.model.params is trainer.ref_params and trainer.samplers["reference"].params is trainer.ref_params
  for ref, initial in zip(leaves(trainer.ref_params), leaves(trainer.state.params["act"]), strict=True):
    assert ref.dtype == bf16
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(initial.astype(jnp.bfloat16)))
  moved = jax.tree.map(lambda x: x + 1e-2, trainer.state.params)  # what an update returns: new float32 arrays
  trainer.state = trainer.state.replace(params=moved)
  trainer._sync_samplers()
  check_copies(moved)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_a_run_without_the_kl_term_or_a_reference_user_holds_no_reference(tmp_path, data_dir, on_mesh):
  """On the testbed (user turns logged: no user simulator) the frozen reference is held only for the KL term
  (`runtime.holds_reference`): without it the trainer's new arrays are the train state alone (params, AdamW's
  moments and counts, the step; besides the samplers' stop-string tables and the run's key), the policy sampler
  reads the state's own arrays, and there is no reference sampler. τ² (simulated users) holds it as before (the bf16
  test above), and so does the KL term (the plan's test)."""
  overrides = dict(TESTBED)
  if on_mesh:  # the update on the 8-device mesh (`runtime.initial_state`)
    overrides.update({"train.tasks_per_step": 4, "grpo.micro_batch_size": 8})
  config = tiny_config(data_dir, **overrides)
  assert not runtime.reference_user(config) and not runtime.holds_reference(config)
  assert runtime.holds_reference(tiny_config(data_dir, **overrides, **{"grpo.use_kl": True}))
  before = {id(x) for x in jax.live_arrays()}
  trainer = train.Trainer(config, str(tmp_path))
  held = {id(x) for x in jax.live_arrays()} - before
  assert (trainer.update_mesh is not None) == on_mesh
  assert trainer.ref_params is None and trainer.model.params is None and set(trainer.samplers) == {"policy"}
  state = {id(x) for x in jax.tree.leaves(trainer.state)}
  tables = {id(x) for s in trainer.samplers.values() for x in jax.tree.leaves((s.eos_ids, s._byte_table))}
  rest = [x for x in jax.live_arrays() if id(x) in held - state - tables]
  assert [(x.shape, x.dtype) for x in rest] == [((2,), jnp.uint32)]  # the run's key
  sampled, trained = jax.tree.leaves(trainer.samplers["policy"].params), jax.tree.leaves(trainer.state.params)
  assert all(a is b for a, b in zip(sampled, trained, strict=True))
  # The initial weights' evaluation after training (`Trainer.run`, ``train.eval_at_start``): with no reference
  # held, the model is loaded again (the update donates the step-0 arrays), equal to them and placed like them.
  initial = trainer._initial_params()
  assert not {id(x) for x in jax.tree.leaves(initial)} & state
  jax.tree.map(np.testing.assert_array_equal, initial, trainer.state.params)
  placed = lambda a, b: a.sharding == b.sharding and a.committed == b.committed  # else the samplers compile anew
  assert all(jax.tree.leaves(jax.tree.map(placed, initial, trainer.state.params)))
  # Pending for a run from the loaded weights whose eval.jsonl has no step-0 row yet, and only for such a run.
  assert not trainer._initial_pending()  # train.eval_at_start off
  trainer.config.train.eval_at_start = True
  assert trainer._initial_pending()
  trainer.config.train.init_from = str(tmp_path)  # another run's start
  assert not trainer._initial_pending()
  trainer.config.train.init_from = ""
  (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "time": 0.0}) + "\n")  # a resumed run's, written
  assert not trainer._initial_pending()
  trainer.ckpt.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["envace", "per_role"])
def test_a_grpo_step_moves_logprobs_along_the_advantages(tmp_path, data_dir, mode):
  """End to end through the Trainer (rollout, role-wise advantages, batch, update): one small step raises the
  advantage-weighted logprob of the trained tokens, sum_t A_t (log p_new - log p_old) > 0 -- the first-order change
  of the surrogate. Rewards are set by hand (the random tiny model would score every rollout the same); a sign error
  or advantages paired with the wrong rows would fail it."""
  from envace_jax.envs.base import RewardInfo

  config = tiny_config(data_dir, **{"grpo.mode": mode, "train.group_size": 4, "grpo.learning_rate": 1e-4})
  trainer = train.Trainer(config, str(tmp_path))
  trajectories, _ = trainer.rollout(trainer.stream.next_batch(), jax.random.key(3))
  for i, traj in enumerate(trajectories):
    traj.reward = RewardInfo(reward=float(i % 4 in (0, 3)))  # per group of 4: 1, 0, 0, 1
  adv, _ = trainer.advantages(trajectories)
  batch = trainer.training_batch(trajectories, adv)
  before = trainer.policy_logprobs(batch)
  calls, wait, update = [], trainer.ckpt.wait, trainer.update
  trainer.ckpt.wait = lambda: (calls.append("wait"), wait())[1]
  trainer.update = lambda *args: (calls.append("update"), update(*args))[1]
  trainer.apply_update(batch, supervised=False)
  assert calls == ["wait", "update"]  # a save in flight is written before the update's temporaries are allocated
  delta = trainer.policy_logprobs(batch) - before
  token_adv = np.zeros(delta.shape, np.float32)  # [K, M, T]: each trained token's advantage, from the I layout
  k, m, i = np.nonzero(np.asarray(batch.target_mask))
  token_adv[k, m, np.asarray(batch.target_index)[k, m, i]] = np.asarray(batch.target_advantages)[k, m, i]
  assert np.count_nonzero(token_adv > 0) and np.count_nonzero(token_adv < 0)
  moved = float(np.sum(np.where(np.asarray(batch.loss_mask), token_adv * delta, 0.0)))
  assert moved > 0.0, moved
  # One copy of the policy's weights: after the update the samplers sample the train state's own arrays (per_role:
  # each role's tree), the reference user the reference's; no other parameter tree is held.
  state = trainer.state.params
  trees = {"policy": state["act"], "rehearse": state["rehearse"]} if mode == "per_role" else {"policy": state}
  trees["reference"] = trainer.ref_params
  for name, tree in trees.items():
    held = jax.tree.leaves(trainer.samplers[name].params)
    assert all(a is b for a, b in zip(held, jax.tree.leaves(tree), strict=True)), name
  assert jax.tree.leaves(trainer.model.params)[0] is jax.tree.leaves(trainer.ref_params)[0]


def test_recomputed_old_logprobs_are_the_samplers_up_to_numerics(tmp_path, data_dir):
  """grpo.old_logprobs="recompute" (verl's, the official code's): before the update, a forward of the current
  parameters replaces the sampler's logprobs as the ratio's denominator; in float32 they agree with the sampler's."""
  config = tiny_config(data_dir, **{"grpo.old_logprobs": "recompute", "train.group_size": 2})
  trainer = train.Trainer(config, str(tmp_path))
  seen = {}

  @contextlib.contextmanager
  def phase(name):
    out = {}
    yield out
    seen[name] = out

  trainer.phase = phase
  trainer.step(1)
  sampled, recomputed = seen["batch"]["batch"], seen["old_logprobs"]["batch"]
  mask = np.asarray(sampled.loss_mask)
  assert mask.sum() > 0
  np.testing.assert_allclose(
    np.asarray(recomputed.old_logprobs)[mask], np.asarray(sampled.old_logprobs)[mask], atol=2e-4, rtol=0
  )
  assert np.all(np.asarray(recomputed.old_logprobs)[~mask] == 0.0)


# ---------------------------------------------------------------------------------------------------------------------
# The supervised warm-up (train.sft_warmup_steps)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["envace", "per_role"])
def test_sft_update_is_the_gradient_of_the_demonstrations_mean_nll(tmp_path, data_dir, mode):
  """Advantage 1 and NaN old logprobs (the update's own, as `Trainer.sft_step` passes them): the GRPO surrogate's
  gradient is exactly -grad log p, averaged as the loss aggregation averages (generation_mean: over the
  demonstrations' generations of each one's token mean; per_role: each tree over its own role's generations)."""
  from envace_jax.model.roles import NUM_ROLES, Role
  from envace_jax.rl import grpo, logprobs

  config = tiny_config(data_dir, **{"train.sft_warmup_steps": 1, "grpo.mode": mode})
  trainer = train.Trainer(config, str(tmp_path))
  tasks = [trainer.train_source[i] for i in range(3)]
  trajectories, skipped = trainer.demonstrations(tasks)
  assert skipped == 0 and len(trajectories) == 3
  adv = np.zeros((3, NUM_ROLES), np.float32)
  adv[:, [int(Role.ACT), int(Role.REHEARSE)]] = 1.0
  batch = trainer.training_batch(trajectories, adv)
  batch = batch.replace(old_logprobs=np.full(np.shape(batch.old_logprobs), np.nan, np.float32))
  params = trainer.state.params
  grads, _ = jax.jit(grpo.loss_and_grads, static_argnames=("config", "cfg"))(
    trainer.model.config, trainer.grpo_cfg, params, batch
  )

  def nll(p, keep):
    total = count = 0.0
    for k in range(batch.tokens.shape[0]):
      mb = jax.tree.map(lambda x, k=k: x[k], batch)
      if not keep(int(mb.row_role[0])):
        continue
      logp, _ = logprobs.target_logprobs(trainer.model.config, p, mb)
      # grpo.loss_aggregation="generation_mean" (the default): each generation's token mean, averaged.
      total += jnp.sum(jnp.where(mb.target_mask, logp * mb.target_weights, 0.0))
      count += jnp.round(jnp.sum(mb.target_weights))
    return -total / count

  reference = jax.jit(
    jax.grad(nll), static_argnames="keep"
  )  # one program, not the gradient's ops dispatched one by one
  if mode == "envace":
    expected = {"policy": reference(params, lambda r: True)}
    grads = {"policy": grads}
  else:
    trees = {"act": int(Role.ACT), "rehearse": int(Role.REHEARSE)}
    expected = {n: reference(params[n], lambda r, role=role: r == role) for n, role in trees.items()}
  for name, tree in expected.items():
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(tree))
    jax.tree.map(lambda a, b, s=scale: np.testing.assert_allclose(a, b, atol=1e-4 * s), grads[name], tree)


@pytest.mark.slow
def test_sft_steps_lower_the_nll_then_rl_takes_over(tmp_path, data_dir):
  """Supervised steps on the same demonstrations lower their NLL at the warm-up's own learning rate; a warm-up step
  with nothing to train does not shift the rates; the step after the warm-up is a GRPO step at the RL rate."""
  config = tiny_config(
    data_dir,
    **{"train.steps": 5, "train.sft_warmup_steps": 4, "grpo.sft_learning_rate": 2e-2, "train.eval_tasks": 0},
  )
  trainer = train.Trainer(config, str(tmp_path))
  rate = lambda: float(trainer.state.opt_state[1].hyperparams["learning_rate"])  # noqa: E731
  tasks = trainer.stream.next_batch()
  nothing = [t for t in trainer.train_source if t.id == "create_task_1_nl_eval"]  # no gold call, nothing to say
  batches = iter([tasks, nothing, tasks, tasks])
  trainer.stream.next_batch = lambda: next(batches)  # the same demonstrations at every warm-up step but one
  first = trainer.step(1)
  assert "reward/mean" not in first and first["sft/tokens"] > 0 and first["sft/demonstrations"] == len(tasks)
  assert rate() == pytest.approx(2e-2)
  skipped = trainer.step(2)
  assert skipped["update/skipped"] == 1.0 and "sft/nll" not in skipped
  _, last = trainer.step(3), trainer.step(4)
  assert last["sft/nll"] < first["sft/nll"] - 1.5, (first["sft/nll"], last["sft/nll"])  # nats per token
  assert int(trainer.state.step) == 3  # three updates in four warm-up steps
  trainer.stream.next_batch = lambda: tasks
  warm_mu = _adam_moments(trainer.state.opt_state)
  rl = trainer.step(5)
  assert "reward/mean" in rl and "sft/nll" not in rl
  assert rate() == pytest.approx(config.grpo.learning_rate)
  # The RL step started from a fresh AdamW state: one step counted, and its first moment is (1 - b1) x the clipped
  # gradient alone, with nothing of the warm-up's momentum (b1 x warm_mu) in it.
  assert _adam_counts(trainer.state.opt_state) == {1}
  mu = _adam_moments(trainer.state.opt_state)
  assert np.linalg.norm(warm_mu) > 0
  if rl["update/grad_norm"] > 0.0:  # |mu| = (1 - b1) |clipped gradient|; with the warm-up's momentum it would not be
    ratio = np.linalg.norm(mu) / (1 - config.grpo.adam_b1) / min(rl["update/grad_norm"], config.grpo.max_grad_norm)
    assert ratio == pytest.approx(1.0, rel=1e-3), ratio
  else:  # every advantage 0: a fresh moment stays 0, the warm-up's would be b1 x warm_mu
    assert not mu.any()


def _adam_counts(opt_state) -> set[int]:
  return {int(c) for _, c in optax.tree_utils.tree_get_all_with_path(opt_state, "count")}


def _adam_moments(opt_state) -> np.ndarray:
  """AdamW's first moment, all leaves flattened into one float64 vector."""
  (_, mu), *_ = optax.tree_utils.tree_get_all_with_path(opt_state, "mu")
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(mu)])


@pytest.mark.slow
def test_fresh_optimizer_after_sft_off_keeps_the_warm_up_moments(tmp_path, data_dir):
  config = tiny_config(
    data_dir,
    **{"train.steps": 2, "train.sft_warmup_steps": 1, "train.eval_tasks": 0, "grpo.fresh_optimizer_after_sft": False},
  )
  trainer = train.Trainer(config, str(tmp_path))
  trainer.step(1)
  assert _adam_counts(trainer.state.opt_state) == {1}
  trainer.step(2)
  assert _adam_counts(trainer.state.opt_state) == {2}


@pytest.mark.slow
def test_dynamic_sampling_replaces_a_group_without_signal(tmp_path, data_dir, monkeypatch):
  """grpo.dynamic_sampling on B=2 x G=2 with one extra draw allowed. Step 1: the first batch's first task gets the
  same reward in both rollouts (no signal), so one more batch of 2 tasks is rolled out and the step trains on the
  first batch's second task and the extra batch's first task, renumbered groups 0 and 1; the metrics count the
  dropped group. Step 2: no task has signal; the extra batch has none either, so the step keeps its first batch."""
  config = tiny_config(
    data_dir,
    **{
      "train.steps": 2,
      "train.eval_tasks": 0,
      "train.tasks_per_step": 2,
      "train.group_size": 2,
      "grpo.micro_batch_size": 4,
      "grpo.dynamic_sampling": True,
      "grpo.dynamic_sampling_max_draws": 1,
      "rollout.max_turns": 1,
    },
  )
  trainer = train.Trainer(config, str(tmp_path))
  source = runtime.training_tasks(config)
  stream = datasets.TaskStream(source, 2, config.seed)
  batches = [[t.id for t in stream.next_batch()] for _ in range(4)]  # what steps 1 and 2 draw, in order
  no_signal = {batches[0][0]}  # 9 mock tasks: the 4 batches of an epoch hold 8 different ones
  rollout, training_batch, drawn, keys, trained = trainer.rollout, trainer.training_batch, [], [], []

  def scripted(tasks, key, group_size=None):  # reward: the rollout's index in its group, or 0.5 for no signal
    trajectories, stats = rollout(tasks, key, group_size)
    drawn.append([t.id for t in tasks])
    keys.append(tuple(np.asarray(jax.random.key_data(key)).ravel()))
    for traj in trajectories:
      flat = traj.task.id in no_signal
      traj.reward = dataclasses.replace(traj.reward, reward=0.5 if flat else float(traj.sample), valid=True)
    return trajectories, stats

  def recorded(trajectories, adv, empty=None):
    trained.append([(t.task.id, t.group) for t in trajectories])
    return training_batch(trajectories, adv, empty)

  monkeypatch.setattr(trainer, "rollout", scripted)
  monkeypatch.setattr(trainer, "training_batch", recorded)
  first = trainer.step(1)
  assert drawn == batches[:2] and trainer.stream.state()["position"] == 4
  assert trained[-1] == [(batches[0][1], 0), (batches[0][1], 0), (batches[1][0], 1), (batches[1][0], 1)]
  assert first["rollout/groups_without_signal"] == 0.5
  counts = {k.split("/")[1]: v for k, v in first.items() if k.startswith("dynamic_sampling/")}
  generated = counts.pop("generated_tokens")  # the extra batch's
  assert counts == {"dropped_groups": 1.0, "extra_draws": 1.0, "groups": 2.0, "surplus_groups": 1.0, "fallback": 0.0}
  assert generated > 0 and first["time/rollout_s"] > first["time/dynamic_sampling_s"] > 0
  assert first["adv/act/groups"] == 2 and first["adv/act/zero_variance_groups"] == 0 and first["update/grad_norm"] > 0

  no_signal.update(batches[2] + batches[3])
  second = trainer.step(2)
  assert drawn[2:] == batches[2:] and trained[-1] == [(t, g) for g, t in enumerate(batches[2]) for _ in range(2)]
  assert [second[f"dynamic_sampling/{k}"] for k in ("dropped_groups", "groups", "fallback")] == [4.0, 0.0, 1.0]
  assert len(set(keys)) == 4  # every batch sampled with its own key
  assert second["rollout/groups_without_signal"] == 1.0 and second["adv/act/zero_variance_groups"] == 2


def test_dynamic_sampling_keeps_the_groups_with_signal_it_found_when_the_draws_run_out():
  """`Trainer.dynamic_sampling` alone, on scripted groups (no model): B=3, the first batch has one group with signal,
  the only extra batch allowed has one more, so the step trains on those 2 (renumbered 0 and 1) and counts 4
  dropped; with no extra draw allowed, the first batch's one group with signal is trained alone."""
  import types

  from envace_jax.envs.base import RewardInfo, Task
  from envace_jax.rehearsal.trajectory import Trajectory
  from envace_jax.rl import grpo

  def batch(name, rewards):  # one group per task: rewards[b] = that group's G=2 rewards
    tasks = [Task(f"{name}{b}", "tau2", "mock", "base", "", ()) for b in range(len(rewards))]
    trajectories = [
      Trajectory(task, b, g, reward=RewardInfo(reward=r))
      for b, (task, rs) in enumerate(zip(tasks, rewards, strict=True))
      for g, r in enumerate(rs)
    ]
    return tasks, trajectories

  for draws in (1, 0):  # fresh trajectories each time: the method renumbers the groups it keeps
    _, first = batch("a", [(0.5, 0.5), (0.0, 1.0), (1.0, 1.0)])
    extra_tasks, extra = batch("b", [(0.2, 0.2), (0.3, 0.9), (0.0, 0.0)])
    fake = types.SimpleNamespace(
      grpo_cfg=grpo.GrpoConfig.from_config(dynamic_sampling=True, dynamic_sampling_max_draws=draws),
      stream=types.SimpleNamespace(next_batch=lambda tasks=extra_tasks: tasks),
      rollout=lambda tasks, key, out=extra: (out, {"time_total_s": 2.0, "generated_tokens_act": 7}),
    )
    trajectories, out = train.Trainer.dynamic_sampling(fake, train.group_trajectories(first), jax.random.key(0))
    got = [(t.task.id, t.group) for t in trajectories]
    if draws:
      assert got == [("a1", 0), ("a1", 0), ("b1", 1), ("b1", 1)]
      counts = {"dropped_groups": 4, "extra_draws": 1, "groups": 2, "surplus_groups": 0, "fallback": 0}
    else:
      assert got == [("a1", 0), ("a1", 0)]
      counts = {"dropped_groups": 2, "extra_draws": 0, "groups": 1, "surplus_groups": 0, "fallback": 0}
    want = {f"dynamic_sampling/{k}": float(v) for k, v in counts.items()}
    want["dynamic_sampling/generated_tokens"] = 7.0 * draws  # the extra batch's, as its rollout stats give them
    assert out == {**want, "time/dynamic_sampling_s": 2.0 * draws}


def test_a_run_records_what_it_compiled(tiny_run):
  """``compile.jsonl``: one line for the run, its programs at least those its steps compiled (the run also loads
  the model and evaluates), compile seconds within its wall seconds, the suite's cache folder (tests/conftest.py)."""
  workdir, _ = tiny_run
  (record,) = [json.loads(line) for line in (workdir / train.COMPILE_LOG).read_text().splitlines()]
  steps = metrics.read_jsonl(workdir)
  assert record["programs"] >= sum(r["compile/programs"] for r in steps) > 0
  assert sum(r["time/compile_s"] for r in steps) <= record["compile_s"] <= record["wall_s"]
  assert 0 < record["backend_s"] <= record["compile_s"]
  assert record["cache_hits"] + record["cache_misses"] <= record["programs"]  # at most one lookup per program
  assert record["cache"] == jax.config.jax_compilation_cache_dir
