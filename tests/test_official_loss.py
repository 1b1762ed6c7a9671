"""The official EnvACE trainer's numbers (tests/data/official/loss.json): advantages, the empty-output penalty and the
loss aggregation, reproduced by the settings that restore them; the other settings give ours.

The fixture holds inputs authored here and what the official functions (verl/trainer/ppo/core_algos.py, ray_trainer.py,
dp_actor.py's accumulation at commit 173e941) returned for them; see its "source".
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from envace_jax.config import defaults
from envace_jax.envs.base import RewardInfo, Task
from envace_jax.model import transformer
from envace_jax.model.config import PRESETS
from envace_jax.model.roles import NUM_ROLES, Role
from envace_jax.rehearsal.trajectory import TrainingRow, Trajectory
from envace_jax.rl import advantages as advantages_lib
from envace_jax.rl import grpo
from envace_jax.rl.batch import collate, generation_weights, split_micro_batches

FIXTURE = json.loads((pathlib.Path(__file__).parent / "data" / "official" / "loss.json").read_text())
ACT, REHEARSE, USER, SYSTEM = int(Role.ACT), int(Role.REHEARSE), int(Role.USER), int(Role.SYSTEM)
ROLE_IDS = {"act": ACT, "rehearse": REHEARSE}
CONFIG = PRESETS["tiny"]


def test_the_defaults_are_the_official_loss_and_our_advantage_choices():
  c = defaults.get_config()
  assert c.grpo.loss_aggregation == "generation_mean"
  assert c.grpo.baseline_groups == "task_role" and c.grpo.weighting == "row"
  assert c.grpo.lone_member_advantage == "zero"  # ours; "reward" is the official (see the departures table)


def test_a_checkpoint_from_before_these_settings_resumes_as_it_trained():
  c = defaults.get_config().to_dict()
  del c["grpo"]["loss_aggregation"], c["reward"]["empty_output_penalty"]
  old = defaults.completed(c)
  assert old.grpo.loss_aggregation == "token_mean" and old.reward.empty_output_penalty == 0.0
  assert old.grpo.lone_member_advantage == "zero" and old.grpo.baseline_groups == "task_role"  # as before
  assert defaults.completed(defaults.get_config().to_dict()) == defaults.get_config()
  # As Checkpointer.read_config returns it, a ConfigDict (not a Mapping): its sections were not merged, so a setting
  # added since was missing and --mode=eval of an older checkpoint stopped ("train.init_from is missing").
  old = defaults.completed(ml_collections.ConfigDict(c))
  assert old.grpo.loss_aggregation == "token_mean" and old.reward.empty_output_penalty == 0.0
  assert old.grpo.learning_rate == c["grpo"]["learning_rate"] and old.to_dict().keys() == c.keys()


# ---------------------------------------------------------------------------------------------------------------------
# Advantages


def _arrays():
  trajs = FIXTURE["trajectories"]
  n = len(trajs)
  rewards = np.asarray([t["reward"] for t in trajs], np.float32)
  groups = np.asarray([t["task"] for t in trajs], np.int32)
  gens, empty = np.zeros((n, NUM_ROLES), np.int32), np.zeros((n, NUM_ROLES), np.int32)
  for i, t in enumerate(trajs):
    for role, count in t["generations"].items():
      gens[i, ROLE_IDS[role]] = count
    for role, _ in t["empty"]:
      empty[i, ROLE_IDS[role]] += 1
  return rewards, groups, gens, empty


def _case_id(case):
  return f"{case['baseline_groups']}-std{int(case['std_normalize'])}-penalty{case['empty_output_penalty']}"


@pytest.mark.parametrize("case", FIXTURE["advantage_cases"], ids=_case_id)
def test_advantages_reproduce_the_official(case):
  rewards, groups, gens, empty = _arrays()
  # The official "task" grouping averages each trajectory's scores: weighting "trajectory".
  weighting = "row" if case["baseline_groups"] == "task_role" else "trajectory"
  kwargs = dict(
    trained_roles=(ACT, REHEARSE),
    weighting=weighting,
    std_normalize=case["std_normalize"],
    eps=case["epsilon"],
    baseline_groups=case["baseline_groups"],
    empty=empty,
    empty_penalty=case["empty_output_penalty"],
  )
  adv, adv_empty, _ = advantages_lib.generation_advantages(
    rewards, groups, gens, lone_member_advantage="reward", **kwargs
  )
  ours, ours_empty, stats = advantages_lib.generation_advantages(
    rewards, groups, gens, lone_member_advantage="zero", **kwargs
  )
  # Lone members: task 1's one REHEARSE generation (per role only) and task 3's one trajectory.
  lone = {(10, ACT), (10, REHEARSE)} | ({(5, REHEARSE)} if case["baseline_groups"] == "task_role" else set())
  assert stats["adv/rehearse/lone_groups"] == (2 if case["baseline_groups"] == "task_role" else 1)
  for g in case["generations"]:
    i, r = g["trajectory"], ROLE_IDS[g["role"]]
    got = (adv_empty if g["empty"] else adv)[i, r]
    assert got == pytest.approx(g["advantage"], abs=1e-6), g
    mine = (ours_empty if g["empty"] else ours)[i, r]
    assert mine == (0.0 if (i, r) in lone else got), g
  # A lone member's official advantage is its reward (less nothing: no std to divide by, eps aside).
  assert adv[10, ACT] == pytest.approx(0.3, abs=1e-6) and ours[10, ACT] == 0.0


EOS, BLANK = 2, 1000  # ids from BLANK on stand for whitespace


def _token(i, role, k):
  return 100 + 40 * i + 10 * role + k


def _is_empty(ids):
  return bool(np.all((ids == EOS) | (ids >= BLANK)))


def _fixture_trajectories():
  """The fixture's trajectories with rows whose generations are runs of trained tokens, each after two untrained
  tokens: trajectory i's k-th generation of role r is 2 + k tokens ``_token(i, r, k)``, or when empty
  ``_token(i, r, k) + BLANK`` (a blank token, `_is_empty`) then EOS."""
  task = Task(id="t", benchmark="tiny", domain="test", split="train", system_prompt="", tools=())
  trajectories = []
  for i, t in enumerate(FIXTURE["trajectories"]):
    traj = Trajectory(task=task, group=t["task"], sample=i, reward=RewardInfo(reward=t["reward"]))
    empty = {(role, k) for role, k in t["empty"]}
    for role, count in t["generations"].items():
      if not count:
        continue
      tokens, roles, mask = [1, 1], [SYSTEM, USER], [False, False]
      for k in range(count):
        token = _token(i, ROLE_IDS[role], k)
        ids = [token + BLANK, EOS] if (role, k) in empty else [token] * (2 + k)
        tokens += ids + [1, 1]
        roles += [ROLE_IDS[role]] * len(ids) + [USER, USER]
        mask += [True] * len(ids) + [False, False]
      n = len(tokens)
      traj.rows[ROLE_IDS[role]] = TrainingRow(np.asarray(tokens, np.int32), np.asarray(roles, np.int32),
                                              np.asarray(mask), np.full(n, -1.0, np.float32), ROLE_IDS[role], i,
                                              count)  # fmt: skip
    trajectories.append(traj)
  return trajectories


@pytest.mark.parametrize("case", FIXTURE["advantage_cases"][:4], ids=_case_id)  # task_role, as trained by default
def test_each_generations_trained_tokens_carry_the_official_advantage(case):
  """From trajectories to the batch: empty generations found in the rows, their penalised advantage on their own
  tokens (rows of several generations, packed or not), every other generation's on its own."""
  trajectories = _fixture_trajectories()
  rewards, groups, gens, valid = advantages_lib.trajectory_arrays(trajectories)
  counts, flags = advantages_lib.empty_generations(trajectories, (ACT, REHEARSE), _is_empty)
  np.testing.assert_array_equal(counts, _arrays()[3])
  adv, adv_empty, _ = advantages_lib.generation_advantages(
    rewards, groups, gens, valid, trained_roles=(ACT, REHEARSE), std_normalize=case["std_normalize"],
    eps=case["epsilon"], lone_member_advantage="reward", empty=counts, empty_penalty=case["empty_output_penalty"],
  )  # fmt: skip
  for pack in (False, True):
    cfg = grpo.GrpoConfig.from_config(pack_shared_prefix=pack, min_shared_prefix=1, length_bucket=16)
    batch = grpo.build_batch(trajectories, adv, cfg, empty=(adv_empty, flags))
    tokens = np.take_along_axis(batch.tokens, batch.target_index, axis=-1)
    for g in case["generations"]:
      i, k = g["trajectory"], g["generation"]
      token = _token(i, ROLE_IDS[g["role"]], k) + (BLANK if g["empty"] else 0)
      where = batch.target_mask & (tokens == token)
      assert where.sum() == (1 if g["empty"] else 2 + k)
      np.testing.assert_allclose(batch.target_advantages[where], g["advantage"], atol=1e-6, err_msg=str(g))


def test_role_advantages_is_generation_advantages_without_empty_generations():
  rewards, groups, gens, _ = _arrays()
  adv, stats = advantages_lib.role_advantages(rewards, groups, gens, trained_roles=(ACT, REHEARSE))
  same, _, same_stats = advantages_lib.generation_advantages(rewards, groups, gens, trained_roles=(ACT, REHEARSE))
  np.testing.assert_array_equal(adv, same)
  assert stats == same_stats
  # Task 2's equal rewards and the lone groups have zero variance under "zero": exact zeros.
  assert stats["adv/act/zero_variance_groups"] == 2 and stats["adv/act/lone_groups"] == 1
  assert not adv[8:, :].any()


def test_advantage_settings_are_checked():
  rewards, groups, gens, empty = _arrays()
  with pytest.raises(ValueError, match="baseline_groups='agent'"):
    advantages_lib.role_advantages(rewards, groups, gens, trained_roles=(ACT,), baseline_groups="agent")
  with pytest.raises(ValueError, match="lone_member_advantage='one'"):
    advantages_lib.role_advantages(rewards, groups, gens, trained_roles=(ACT,), lone_member_advantage="one")
  with pytest.raises(ValueError, match="empty ones at most"):
    advantages_lib.generation_advantages(rewards, groups, gens, trained_roles=(ACT,), empty=empty + gens)


# ---------------------------------------------------------------------------------------------------------------------
# Loss


GAP = 3  # untrained tokens between two generations of a row: the template's closing and opening


def _fixture_rows(case):
  """The fixture's six generations in two rows of several generations each (as a view's row holds them): ACT
  generations 0, 2, 4 and REHEARSE 1, 3, 5, each after GAP untrained tokens; per-token advantages, old logprobs, and
  the current and reference logprobs laid out like ``old_logprobs``. Returns (rows, advantages, new, ref, where):
  where[j] = (row, first position) of generation j."""
  lengths = FIXTURE["loss_lengths"]
  rows, advs, news, refs, where = [], [], [], [], {}
  for row_index, (role, gens) in enumerate(((ACT, (0, 2, 4)), (REHEARSE, (1, 3, 5)))):
    tokens, roles, mask, old, new, ref, adv = [], [], [], [], [], [], []
    for j in gens:
      n = lengths[j]
      tokens += [7] * GAP
      roles += [SYSTEM if not tokens[:-GAP] else USER] + [USER] * (GAP - 1)
      mask += [False] * GAP
      for lst in (old, new, ref, adv):
        lst += [0.0] * GAP
      where[j] = (row_index, len(tokens))
      tokens += [11 + t for t in range(n)]
      roles += [role] * n
      mask += [True] * n
      old += case["old_logprobs"][j]
      new += case["logprobs"][j]
      ref += case["ref_logprobs"][j]
      adv += [case["advantages"][j]] * n
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    rows.append(TrainingRow(np.asarray(tokens, np.int32), np.asarray(roles, np.int32), np.asarray(mask), f32(old),
                            role, row_index, len(gens)))  # fmt: skip
    advs.append(f32(adv))
    news.append(f32(new))
    refs.append(f32(ref))
  return rows, advs, news, refs, where


def _grpo_cfg(case, aggregation):
  return grpo.GrpoConfig.from_config(
    loss_aggregation=aggregation,
    clip_eps_low=FIXTURE["clip_eps_low"],
    clip_eps_high=FIXTURE["clip_eps_high"],
    clip_ratio_c=FIXTURE["clip_ratio_c"],
    kl_estimator=FIXTURE["kl_estimator"],
    use_kl=case["use_kl"],
    kl_coef=case["kl_coef"] or 1e-4,
  )


def _padded(rows, values, width):
  return np.stack([np.pad(v, (0, width - len(v))) for v in values])


@pytest.mark.parametrize("aggregation", ["generation_mean", "token_mean"])
@pytest.mark.parametrize("case", FIXTURE["loss_cases"], ids=lambda c: c["name"])
def test_loss_and_its_gradient_reproduce_the_official(case, aggregation):
  """Our per-token terms, weighted by the batch's generation weights, give the official loss (one generation per
  micro-batch, token mean, divided by the accumulation steps) and its gradient in each token's logprob; token_mean
  gives the same terms averaged over all tokens. The generations share rows, so the weights come from the runs."""
  cfg = _grpo_cfg(case, aggregation)
  rows, advs, news, refs, where = _fixture_rows(case)
  batch = collate(rows, advs, trained_roles=cfg.trained_roles, length_bucket=16)
  t = batch.tokens.shape[1]
  batch = batch.replace(ref_logprobs=_padded(rows, refs, t))
  current = jnp.asarray(_padded(rows, news, t))
  assert batch.num_generations == 6 and batch.num_tokens == sum(FIXTURE["loss_lengths"])

  def loss(current):
    logp = jnp.take_along_axis(current, batch.target_index, axis=1)
    objective, sums = grpo.logprob_sums(cfg, batch, logp, jnp.zeros_like(logp))
    return objective / sums["units"], sums

  (value, sums), grad = jax.value_and_grad(loss, has_aux=True)(current)
  _, metrics = grpo.normalize(cfg, {}, sums)
  want = case["official"][aggregation]
  assert float(value) == pytest.approx(want["loss"], abs=1e-6)
  assert float(metrics["loss"]) == pytest.approx(want["loss"], abs=1e-6)
  assert float(metrics["pg_loss"]) == pytest.approx(want["pg_loss"], abs=1e-6)
  assert float(metrics["kl"]) == pytest.approx(want["kl"], abs=1e-6)
  assert metrics["generations"] == 6 and metrics["tokens"] == 38
  for j, (row, start) in where.items():
    n = FIXTURE["loss_lengths"][j]
    np.testing.assert_allclose(grad[row, start : start + n], want["grad_logprobs"][j], atol=1e-6, rtol=0)
  if case["name"] == "issue_rows":  # the numbers
    assert round(float(value), 4) == {"generation_mean": 0.2804, "token_mean": 0.3974}[aggregation]
  if case["name"] == "clipped":  # every clip binds somewhere
    assert min(metrics["clip_frac_low"], metrics["clip_frac_high"], metrics["clip_frac_dual"]) > 0


def test_generation_weights_are_one_over_each_runs_length():
  w = generation_weights(np.asarray([0, 1, 1, 1, 0, 0, 1, 0, 1, 1], bool))
  np.testing.assert_allclose(w, [0, 1 / 3, 1 / 3, 1 / 3, 0, 0, 1, 0, 0.5, 0.5], rtol=1e-7)
  assert generation_weights(np.zeros(4, bool)).sum() == 0


# ---------------------------------------------------------------------------------------------------------------------
# One update step on a tiny model


_loss_and_grads = jax.jit(grpo.loss_and_grads, static_argnames=("config", "cfg"))


@functools.cache
def _params():
  return transformer.init_params(CONFIG, jax.random.key(0))


def _row(rng, gens, role, trajectory, prompt=5, gap=3):
  """A row of several generations of ``role`` (lengths ``gens``) after a prompt, GAP untrained tokens between them,
  old logprobs off the policy; and the per-generation (end of its prefix, start, stop) positions."""
  n = prompt + sum(gens) + gap * (len(gens) - 1)
  tokens = rng.integers(0, CONFIG.vocab_size, n).astype(np.int32)
  roles = np.full(n, USER, np.int32)
  roles[0] = SYSTEM
  mask = np.zeros(n, bool)
  spans, at = [], prompt
  for k, g in enumerate(gens):
    mask[at : at + g] = True
    roles[at : at + g] = role
    spans.append((at, at + g))
    at += g + (gap if k < len(gens) - 1 else 0)
  old = np.where(mask, np.log(1.0 / CONFIG.vocab_size) + rng.normal(0.0, 1.0, n), 0.0).astype(np.float32)
  return TrainingRow(tokens, roles, mask, old, role, trajectory, len(gens)), spans


def _one_generation(row, span):
  """The row cut after one generation, only that generation trained: what the official trains as its own
  micro-batch row (the same prefix, so the same logprobs)."""
  start, stop = span
  mask = np.zeros(stop, bool)
  mask[start:stop] = True
  return TrainingRow(row.tokens[:stop], row.roles[:stop], mask, np.where(mask, row.logprobs[:stop], 0.0).astype(
    np.float32), row.role, row.trajectory, 1)  # fmt: skip


def test_a_generation_mean_step_equals_the_mean_of_each_generations_token_mean_step():
  """make_update_step with generation_mean (rows of several generations, packed per task, two micro-batches, KL on)
  takes the step whose gradient is the mean over generations of each generation's own token-mean gradient, each
  computed alone on its own row (the official micro-batches), and whose loss is the mean of theirs."""
  params = _params()
  rng = np.random.default_rng(41)
  shared = rng.integers(0, CONFIG.vocab_size, 70).astype(np.int32)  # one task's opening, long enough to pack
  rows, spans, adv = [], [], []
  for trajectory, (gens, role, a) in enumerate(
    [((9, 2, 14), ACT, 0.8), ((5, 11), ACT, -0.6), ((1, 6, 3, 7), REHEARSE, 1.2), ((12,), REHEARSE, -0.9)]
  ):
    row, s = _row(rng, gens, role, trajectory, prompt=80)
    row.tokens[:70] = shared
    rows.append(row)
    spans.append(s)
    adv.append(a)
  # adam_eps 1: AdamW's first step is lr * g / (|g| + 1), near-linear in the gradient, so the comparison measures the
  # gradient rather than AdamW's sign-like step on near-zero entries (which turns float noise into lr-sized moves).
  kw = dict(learning_rate=1e-2, adam_eps=1.0, use_kl=True, kl_coef=0.1, micro_batch_size=1, length_bucket=16)
  cfg = grpo.GrpoConfig.from_config(loss_aggregation="generation_mean", **kw)
  batch = collate(rows, adv, trained_roles=cfg.trained_roles, length_bucket=16, pack_groups=[0, 0, 0, 0],
                  min_shared_prefix=64)  # fmt: skip
  assert batch.tokens.shape[0] == 2 and batch.num_generations == 10  # packed: one row per role
  shift = lambda b: np.where(b.loss_mask, b.old_logprobs + 0.2, 0.0).astype(np.float32)  # noqa: E731
  batch = batch.replace(ref_logprobs=shift(batch))
  state, metrics = grpo.make_update_step(CONFIG, cfg, donate=False)(
    grpo.init_train_state(cfg, params), split_micro_batches(batch, 1)
  )

  # The reference: each generation alone, token_mean, then the plain mean over the ten.
  token_cfg = grpo.GrpoConfig.from_config(loss_aggregation="token_mean", **kw)
  grads, losses = [], []
  for row, s, a in zip(rows, spans, adv, strict=True):
    for span in s:
      one = collate([_one_generation(row, span)], [a], trained_roles=cfg.trained_roles, length_bucket=16)
      one = one.replace(ref_logprobs=shift(one))
      g, m = _loss_and_grads(CONFIG, token_cfg, transformer.stack_tree(params), split_micro_batches(one, 1))
      grads.append(g)
      losses.append(float(m["loss"]))
  mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
  assert float(metrics["loss"]) == pytest.approx(np.mean(losses), abs=1e-6)
  assert metrics["generations"] == 10 and metrics["tokens"] == 70
  want_state, _ = grpo.apply_gradients(cfg, grpo.init_train_state(cfg, params), transformer.unstack_tree(mean),
                                       {"tokens": metrics["tokens"]})  # fmt: skip
  got, want = jax.tree.leaves(state.params), jax.tree.leaves(want_state.params)
  moved = max(float(np.max(np.abs(np.asarray(w) - np.asarray(p)))) for w, p in
              zip(want, jax.tree.leaves(transformer.unstack_tree(params)), strict=True))  # fmt: skip
  assert moved > 1e-4
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want, strict=True))
  assert diff <= 1e-8
