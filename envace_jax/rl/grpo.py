"""Role-wise GRPO: the config, the dual-clipped policy loss with exact micro-batch accumulation, the optax step.

The paper trains one policy that wears two hats, ACT and REHEARSE, with GRPO where the group of a generation is
(task, role) (paper §3, role-wise GRPO; docs/method.md, a training step, steps 6-7). The advantages live in
rl/advantages.py, the padded batch in rl/batch.py, the training forward in rl/logprobs.py. Data flows:

    rewards, groups, generations, valid = advantages.trajectory_arrays(trajectories)   # host numpy
    adv_nr, adv_stats = advantages.role_advantages(rewards, groups, generations, valid,
                                                   trained_roles=cfg.trained_roles, weighting=cfg.weighting,
                                                   std_normalize=cfg.std_normalize, eps=cfg.adv_eps)
    batch = build_batch(trajectories, adv_nr, cfg)                                     # TrainBatch [K, M, ...]
    batch = logprobs.with_ref_logprobs(model_config, ref_params, batch)                # only when cfg.use_kl
    state = init_train_state(cfg, params)
    step = make_update_step(model_config, cfg, mesh=mesh)
    state, metrics = step(state, batch)

Modes (``GrpoConfig.mode``) share one code path. ``per_role`` keeps two trees ``{"act": ..., "rehearse": ...}`` (the
paper's ablation): micro-batches hold rows of one role, whose loss moves only its own tree; each tree has its own
AdamW state, global-norm clip and loss denominator, as two separate models would. ``grpo_real_env`` trains ACT only.

Shapes: N trajectories, R role ids (``roles.NUM_ROLES``), K micro-batches, M rows per micro-batch, T tokens per row
(bucketed), I trained-token slots per row (bucketed), V vocabulary. A row may pack the G rows of one (task, role)
around their shared opening (``GrpoConfig.pack_shared_prefix``; see rl/batch.py): advantages are per trained token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from envace_jax import compilation_cache, distributed
from envace_jax.config import choices, defaults
from envace_jax.config.choices import (
  BASELINE_GROUPS,
  KL_ESTIMATORS,
  LONE_MEMBER_ADVANTAGES,
  LOSS_AGGREGATIONS,
  OLD_LOGPROBS,
  WEIGHTINGS,
)
from envace_jax.config.choices import GRPO_MODES as MODES
from envace_jax.model import attention, transformer
from envace_jax.model.config import ModelConfig
from envace_jax.model.roles import NUM_ROLES, Role
from envace_jax.rehearsal.trajectory import Trajectory
from envace_jax.rl.advantages import role_name
from envace_jax.rl.batch import TrainBatch, collate, generation_spans, split_micro_batches, trimmed
from envace_jax.rl.logprobs import target_logprobs
from envace_jax.sampling import sharding

# per_role mode: the name of each role's parameter tree.
ROLE_TREES: dict[str, int] = {"act": int(Role.ACT), "rehearse": int(Role.REHEARSE)}
_LOG_RATIO_CLAMP = 20.0  # |logp_new - logp_old| and |ref - logp| are clamped here before exp (verl's convention)
_KL_CLAMP = 10.0  # the low_var_kl estimate is clamped to [-10, 10] (verl's kl_penalty)


def _parse_role(value: Any) -> int:
  if isinstance(value, str):
    try:
      return int(Role[value.upper()])
    except KeyError:
      raise ValueError(f"trained_roles: unknown role {value!r}; valid: {[r.name.lower() for r in Role]}.") from None
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= int(value) < NUM_ROLES:
    return int(value)
  raise ValueError(f"trained_roles: {value!r} is not a role; use role ids 0..{NUM_ROLES - 1} or names (roles.Role).")


# ---------------------------------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpoConfig:
  """Everything the update needs; validated on construction. Frozen and hashable (a static jit argument).

  The fields are ``config.grpo``'s keys, each explained once in ``envace_jax/config/defaults.py`` (no defaults
  here: `from_config` reads them), ``sft_steps``, the run's supervised warm-up updates (``train.sft_warmup_steps``),
  and ``empty_output_penalty`` (``reward.empty_output_penalty``). ``trained_roles`` is stored as a sorted tuple of
  role ids.
  """

  mode: str
  trained_roles: tuple[int, ...]
  weighting: str
  baseline_groups: str
  lone_member_advantage: str
  empty_output_penalty: float
  std_normalize: bool
  adv_eps: float
  clip_eps_low: float
  clip_eps_high: float
  clip_ratio_c: float
  loss_aggregation: str
  use_kl: bool
  kl_coef: float
  kl_estimator: str
  learning_rate: float
  sft_steps: int
  sft_learning_rate: float
  fresh_optimizer_after_sft: bool
  weight_decay: float
  max_grad_norm: float
  adam_b1: float
  adam_b2: float
  adam_eps: float
  micro_batch_size: int
  length_bucket: int
  remat: bool
  head_chunk: int
  pack_shared_prefix: bool
  min_shared_prefix: int
  max_packed_length: int
  dynamic_sampling: bool
  dynamic_sampling_max_draws: int
  old_logprobs: str

  def __post_init__(self):
    enumerated = (
      ("mode", MODES),
      ("weighting", WEIGHTINGS),
      ("baseline_groups", BASELINE_GROUPS),
      ("lone_member_advantage", LONE_MEMBER_ADVANTAGES),
      ("loss_aggregation", LOSS_AGGREGATIONS),
      ("kl_estimator", KL_ESTIMATORS),
      ("old_logprobs", OLD_LOGPROBS),
    )
    for name, valid in enumerated:
      if getattr(self, name) not in valid:
        raise ValueError(f"GrpoConfig.{name}={getattr(self, name)!r}; valid values: {valid}.")
    roles = self.trained_roles
    if isinstance(roles, (str, int, np.integer)):
      roles = (roles,)
    roles = tuple(sorted({_parse_role(r) for r in roles}))
    if not roles:
      raise ValueError("GrpoConfig.trained_roles is empty; train at least one role (e.g. ('act',)).")
    if self.mode == "per_role" and not set(roles) <= set(ROLE_TREES.values()):
      raise ValueError(
        f"GrpoConfig.trained_roles={[role_name(r) for r in roles]} with mode='per_role': only roles with their own "
        f"parameter tree can be trained, valid: {list(ROLE_TREES)}."
      )
    if self.mode == "grpo_real_env" and int(Role.REHEARSE) in roles:
      raise ValueError(
        "GrpoConfig.trained_roles includes 'rehearse' with mode='grpo_real_env', where the real environment answers "
        "tool calls; use mode='envace' to train rehearsal."
      )
    object.__setattr__(self, "trained_roles", roles)
    checks = (
      ("clip_eps_low", 0.0 <= self.clip_eps_low < 1.0, "in [0, 1)"),
      ("clip_eps_high", self.clip_eps_high >= 0.0, ">= 0"),
      ("clip_ratio_c", self.clip_ratio_c > 1.0, "> 1"),
      ("adv_eps", self.adv_eps > 0.0, "> 0"),
      ("empty_output_penalty", self.empty_output_penalty >= 0.0, ">= 0"),
      ("kl_coef", self.kl_coef >= 0.0, ">= 0"),
      ("learning_rate", self.learning_rate > 0.0, "> 0"),
      ("sft_steps", self.sft_steps >= 0, ">= 0"),
      ("sft_learning_rate", self.sft_learning_rate >= 0.0, ">= 0 (0: learning_rate)"),
      ("weight_decay", self.weight_decay >= 0.0, ">= 0"),
      ("max_grad_norm", self.max_grad_norm > 0.0, "> 0"),
      ("adam_b1", 0.0 <= self.adam_b1 < 1.0, "in [0, 1)"),
      ("adam_b2", 0.0 <= self.adam_b2 < 1.0, "in [0, 1)"),
      ("adam_eps", self.adam_eps > 0.0, "> 0"),
      ("micro_batch_size", self.micro_batch_size >= 1, ">= 1"),
      ("length_bucket", self.length_bucket >= 1 and not self.length_bucket & (self.length_bucket - 1), "a power of 2"),
      ("head_chunk", self.head_chunk >= 1 and not self.head_chunk & (self.head_chunk - 1), "a power of 2"),
      ("min_shared_prefix", self.min_shared_prefix >= 1, ">= 1"),
      ("max_packed_length", self.max_packed_length >= 0, ">= 0"),
      ("dynamic_sampling_max_draws", self.dynamic_sampling_max_draws >= 0, ">= 0"),
    )
    for name, ok, need in checks:
      if not ok:
        raise ValueError(f"GrpoConfig.{name}={getattr(self, name)!r}; it must be {need}.")

  @classmethod
  def from_config(cls, config=None, **overrides) -> GrpoConfig:
    """``config.grpo`` with ``sft_steps = config.train.sft_warmup_steps`` and ``empty_output_penalty =
    config.reward.empty_output_penalty``, then ``overrides`` (field: value); config None: the defaults.

    Raises:
      ValueError: an unknown key or an invalid value.
    """
    c = defaults.or_defaults(config)
    fields = {
      **c.grpo.to_dict(),
      "sft_steps": c.train.sft_warmup_steps,
      "empty_output_penalty": c.reward.empty_output_penalty,
    }
    fields["trained_roles"] = choices.parse_names(fields["trained_roles"])
    return cls.from_mapping({**fields, **overrides})

  @classmethod
  def from_mapping(cls, mapping: Mapping[str, Any] | Any) -> GrpoConfig:
    """From a dict or ml_collections ConfigDict with these field names.

    Raises:
      ValueError: an unknown key (likely a typo; the message lists the valid ones), or any validation error.
    """
    items = dict(mapping.items()) if hasattr(mapping, "items") else dict(mapping)
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(items) - set(fields))
    if unknown:
      raise ValueError(f"GrpoConfig: unknown keys {unknown}; valid keys: {fields}.")
    if isinstance(items.get("trained_roles"), list):
      items["trained_roles"] = tuple(items["trained_roles"])
    return cls(**items)

  @property
  def injects_learning_rate(self) -> bool:
    """The warm-up has its own rate: AdamW's rate lives in the optimizer state (`make_optimizer`)."""
    return bool(self.sft_steps and self.sft_learning_rate)

  @property
  def per_role(self) -> bool:
    return self.mode == "per_role"


# ---------------------------------------------------------------------------------------------------------------------
# The batch of one step


def build_batch(
  trajectories: Sequence[Trajectory],
  advantages: np.ndarray,
  cfg: GrpoConfig,
  *,
  empty: tuple[np.ndarray, Sequence[Mapping[int, np.ndarray]]] | None = None,
  num_micro_batches: int | None = None,
  pad_id: int = 0,
) -> TrainBatch:
  """The [K, M, ...] batch of one step: rows of trained roles from valid trajectories, with their advantages.

  With ``cfg.pack_shared_prefix`` the rows of one task (``Trajectory.group``) and one role are packed on their shared
  opening (``collate``'s ``pack_groups``).

  Args:
    trajectories: N scored trajectories; trajectory i's advantages are ``advantages[i]``.
    advantages: float32[N, R'] from ``role_advantages`` (``generation_advantages``: of the non-empty generations).
    empty: (empty_advantages float32[N, R'], flags) from ``generation_advantages`` and ``empty_generations``: the
      tokens of a generation flagged empty (``flags[i][role][k]``, the row's k-th run of trained tokens) take
      ``empty_advantages[i, role]``; None: every generation takes ``advantages``.
    num_micro_batches, pad_id: see ``split_micro_batches`` and ``collate``.
  Raises:
    ValueError: no trainable row (every trajectory invalid or no trained role present), or see ``collate``.
  """
  rows, adv, groups = [], [], []
  left = [dict(flags) for flags in empty[1]] if empty is not None else None  # each role's flags not yet used
  for i, traj in enumerate(trajectories):
    if traj.reward is None or not traj.reward.valid:
      continue
    for row in traj.training_rows():
      if row.role in cfg.trained_roles and row.num_trained_tokens:
        rows.append(row)
        a = float(advantages[i, row.role])
        flags = left[i].get(row.role) if empty is not None else None
        if flags is not None:  # per token: the empty generations' own advantage (flags: the role's rows in order)
          spans = generation_spans(row.loss_mask)
          mine, left[i][row.role] = flags[: len(spans)], flags[len(spans) :]
          if mine.any():
            a = np.full(len(row.tokens), a, np.float32)
            for (start, stop), flag in zip(spans, mine, strict=True):
              if flag:
                a[start:stop] = empty[0][i, row.role]
        adv.append(a)
        groups.append(traj.group)
  if not rows:
    raise ValueError("build_batch: no trainable rows (every trajectory invalid, or no row of a trained role).")
  batch = collate(
    rows,
    adv,
    trained_roles=cfg.trained_roles,
    length_bucket=cfg.length_bucket,
    pad_id=pad_id,
    pack_groups=groups if cfg.pack_shared_prefix else None,
    min_shared_prefix=cfg.min_shared_prefix,
    max_packed_length=cfg.max_packed_length,
  )
  return split_micro_batches(batch, cfg.micro_batch_size, by_role=cfg.per_role, num_micro_batches=num_micro_batches)


# ---------------------------------------------------------------------------------------------------------------------
# Per-token terms


def clipped_policy_loss(
  log_ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float, clip_c: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The dual-clipped PPO surrogate per token (PPO: Schulman et al. 2017; dual clip: Ye et al. 2020; DAPO's
  decoupled eps_low / eps_high), as verl computes it. With r = exp(log_ratio), A the advantage:

      clipped = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))
      loss    = min(clipped, -clip_c * A)   if A < 0
                clipped                     otherwise

  Args:
    log_ratio: float32[...] logp_new - logp_old (callers clamp it to +-20 before).
    advantages: float32[...] broadcastable to log_ratio.
  Returns:
    (loss float32[...], clip_low, clip_high, clip_dual bool[...]): where the lower clip binds (A < 0 and
    r < 1 - eps_low), the upper clip binds (A > 0 and r > 1 + eps_high), the dual clip binds (A < 0 and
    clipped > -clip_c * A, i.e. r > clip_c). The gradient is zero wherever a clip binds.
  """
  ratio = jnp.exp(log_ratio)
  adv = jnp.broadcast_to(advantages, ratio.shape)
  unclipped = -adv * ratio
  clipped = jnp.maximum(unclipped, -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  dual = -adv * clip_c
  loss = jnp.where(adv < 0, jnp.minimum(clipped, dual), clipped)
  clip_low = (adv < 0) & (ratio < 1.0 - eps_low)
  clip_high = (adv > 0) & (ratio > 1.0 + eps_high)
  clip_dual = (adv < 0) & (clipped > dual)
  return loss, clip_low, clip_high, clip_dual


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
  """A per-token estimate of KL(policy || reference) from the sampled token's logprobs (Schulman 2020,
  "Approximating KL divergence"; verl's ``kl_penalty``):

      k1:          logp - ref
      k2:          0.5 * (logp - ref)^2
      low_var_kl:  clip(exp(d) - d - 1, -10, 10) with d = clip(ref - logp, -20, 20)   (k3)

  Args:
    logp, ref_logp: float32[...] under the policy and the reference.
    estimator: one of KL_ESTIMATORS.
  Raises:
    ValueError: an unknown estimator.
  """
  if estimator == "k1":
    return logp - ref_logp
  if estimator == "k2":
    return 0.5 * jnp.square(logp - ref_logp)
  if estimator == "low_var_kl":
    d = jnp.clip(ref_logp - logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(d) - d - 1.0, -_KL_CLAMP, _KL_CLAMP)
  raise ValueError(f"kl estimator {estimator!r}; valid values: {KL_ESTIMATORS}.")


# ---------------------------------------------------------------------------------------------------------------------
# Loss with exact micro-batch accumulation


def micro_batch_sums(
  config: ModelConfig, cfg: GrpoConfig, params: Any, batch: TrainBatch
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Weighted sums over the trained tokens of one [M, ...] micro-batch: `logprob_sums` of the training forward's
  logprobs (`target_logprobs`)."""
  logp, entropy = target_logprobs(config, params, batch, cfg.remat, cfg.head_chunk)
  return logprob_sums(cfg, batch, logp, entropy)


def logprob_sums(
  cfg: GrpoConfig, batch: TrainBatch, logp: jax.Array, entropy: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss terms of a micro-batch from its trained tokens' logprobs, summed with each token's aggregation weight.

  ``cfg.loss_aggregation`` sets the weight w of a trained token and what one unit of the loss's denominator is:
  "token_mean": w = 1, units = trained tokens (one mean over every trained token of the step); "generation_mean":
  w = ``batch.target_weights`` (1 / the tokens of its generation), units = generations, so the step's loss is the
  mean over generations of each generation's token mean, as the official trainer's one-generation micro-batches
  with ``loss_agg_mode=token-mean`` divided by the accumulation steps make it (verl/workers/actor/dp_actor.py
  ``update_policy``; the KL term is weighted the same way). `normalize` divides by the step's units.

  Args:
    batch: [M, ...] micro-batch (TrainBatch; its [M, I] target fields are read).
    logp, entropy: float32[M, I] of the trained tokens (``target_index``) under the policy.
  Returns:
    (objective, sums): objective float32[] = sum of w * (policy loss (+ kl_coef * KL when use_kl)), the value to
    differentiate; sums (no gradient): ``objective``, ``pg_loss``, ``kl``, ``clip_low``, ``clip_high``,
    ``clip_dual``, ``entropy``, ``approx_kl`` (each the sum of w * term), ``units``, ``tokens``, ``generations`` and
    ``tokens/<role>`` (counts), ``nll`` and ``nll/<role>`` (sums of -logp, unweighted).

  A NaN old logprob stands for ``logp`` itself (without its gradient): the ratio is exactly 1 and the token's
  surrogate has the gradient of ``advantage * logp``. The supervised warm-up passes NaN (`train.Trainer.sft_step`)
  instead of recomputing the logprobs with a forward of its own.
  """
  mask = batch.target_mask
  old = jnp.take_along_axis(batch.old_logprobs, batch.target_index, axis=1)
  old = jnp.where(jnp.isnan(old), jax.lax.stop_gradient(logp), old)
  log_ratio = jnp.clip(logp - old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  pg, low, high, dual = clipped_policy_loss(
    log_ratio, batch.target_advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.clip_ratio_c
  )
  msum = lambda x: jnp.sum(jnp.where(mask, x, 0).astype(jnp.float32))  # noqa: E731
  generations = jnp.round(msum(batch.target_weights))  # each generation's weights sum to 1
  weight = batch.target_weights if cfg.loss_aggregation == "generation_mean" else 1.0
  wsum = lambda x: msum(x * weight)  # noqa: E731
  objective = pg
  sums = {}
  if cfg.use_kl:
    ref = jnp.take_along_axis(batch.ref_logprobs, batch.target_index, axis=1)
    kl = kl_penalty(logp, ref, cfg.kl_estimator)
    objective = pg + cfg.kl_coef * kl
    sums["kl"] = wsum(kl)
  else:
    sums["kl"] = jnp.zeros((), jnp.float32)
  tokens = msum(1.0)
  sums.update(
    objective=wsum(objective),
    pg_loss=wsum(pg),
    units=generations if cfg.loss_aggregation == "generation_mean" else tokens,
    tokens=tokens,
    generations=generations,
    clip_low=wsum(low),
    clip_high=wsum(high),
    clip_dual=wsum(dual),
    entropy=wsum(entropy),
    approx_kl=wsum(-log_ratio),
  )
  sums["nll"] = msum(-logp)
  for r in cfg.trained_roles:
    in_role = jnp.broadcast_to((batch.row_role == r)[:, None], mask.shape)
    sums[f"tokens/{role_name(r)}"] = msum(in_role)
    sums[f"nll/{role_name(r)}"] = msum(jnp.where(in_role, -logp, 0.0))
  return sums["objective"], jax.lax.stop_gradient(sums)


def _tree_names(cfg: GrpoConfig) -> tuple[str, ...]:
  return tuple(ROLE_TREES) if cfg.per_role else ("policy",)


def micro_batch_grads(
  config: ModelConfig, cfg: GrpoConfig, params: Any, batch: TrainBatch
) -> tuple[Any, dict[str, jax.Array]]:
  """The gradient of one [M, ...] micro-batch's summed objective (``micro_batch_sums``) and its sums, unnormalised.

  In per_role mode params is ``{"act": tree, "rehearse": tree}`` and the micro-batch runs through the tree of its
  role ``row_role[0]`` (a per-leaf select, so the other tree's gradient is exactly 0).

  Returns:
    (grads float32 like params, sums): ``micro_batch_sums``' sums plus ``tree_units/<tree>`` and
    ``tree_objective/<tree>`` (the micro-batch's loss units and objective under the tree it trained).
  """
  names = _tree_names(cfg)
  if cfg.per_role:
    is_act = batch.row_role[0] == int(Role.ACT)

    def objective(p):
      chosen = jax.tree.map(lambda a, r: jnp.where(is_act, a, r), p["act"], p["rehearse"])
      return micro_batch_sums(config, cfg, chosen, batch)

    tree_of = {"act": is_act, "rehearse": ~is_act}
  else:
    objective = lambda p: micro_batch_sums(config, cfg, p, batch)  # noqa: E731
    tree_of = {"policy": jnp.bool_(True)}
  (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(params)
  for name in names:  # per-tree denominators and objectives
    sums[f"tree_units/{name}"] = jnp.where(tree_of[name], sums["units"], 0.0)
    sums[f"tree_objective/{name}"] = jnp.where(tree_of[name], sums["objective"], 0.0)
  return jax.tree.map(lambda g: g.astype(jnp.float32), grads), sums


def normalize(cfg: GrpoConfig, grads: Any, sums: dict[str, jax.Array]) -> tuple[Any, dict[str, jax.Array]]:
  """Summed micro-batch gradients and sums to the step's mean gradient and metrics (see `loss_and_grads`): each
  tree's gradient divided by its own loss units (per_role) or by all of the step's (``logprob_sums``: trained tokens
  or generations, per ``loss_aggregation``)."""
  names = _tree_names(cfg)
  if cfg.per_role:
    grads = {name: _scale(grads[name], sums[f"tree_units/{name}"]) for name in names}
  else:
    grads = _scale(grads, sums["units"])
  return grads, _finalize(sums, names)


def loss_and_grads(
  config: ModelConfig, cfg: GrpoConfig, params: Any, batch: TrainBatch
) -> tuple[Any, dict[str, jax.Array]]:
  """Gradient of the step's loss over all K micro-batches, accumulated exactly.

  A ``lax.scan`` over the micro-batches sums each one's gradient (`micro_batch_grads`) and loss units; the result
  is (sum of gradients) / (sum of units), the gradient of sum(w * objective) / sum(units) (`logprob_sums`: a mean
  over trained tokens or over generations), however the rows are split, packed or sharded (per_role: per tree,
  `normalize`).

  Args:
    config: model config (``scan_layers=True`` is the training layout; either works).
    params: a tree, or the per_role dict.
    batch: TrainBatch with [K, M, ...] fields.
  Returns:
    (grads like params (float32), metrics): float32[] scalars ``loss`` (= objective / units), ``pg_loss``, ``kl``,
    ``entropy``, ``approx_kl`` (mean logp_old - logp_new), ``clip_frac_low`` / ``_high`` / ``_dual`` (fractions of
    trained tokens), each a mean in the loss's aggregation (over tokens, or over generations of each generation's
    token mean), ``tokens``, ``generations`` and ``tokens/<role>``; per_role also ``loss/<tree>`` (each tree's own
    mean).
  """

  def body(carry, mb):
    grads, sums = micro_batch_grads(config, cfg, params, mb)
    return jax.tree.map(jnp.add, carry, (grads, sums)), None

  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
  first = jax.tree.map(lambda x: x[0], batch)
  template = jax.eval_shape(functools.partial(_sums_shape, config, cfg), params, first)
  sums0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)
  (grads, sums), _ = jax.lax.scan(body, (zeros, sums0), batch)
  return normalize(cfg, grads, sums)


def _sums_shape(config, cfg, params, mb):
  """The structure of the per-micro-batch sums dict (abstract evaluation, for the scan carry)."""
  p = params["act"] if cfg.per_role else params
  sums = micro_batch_sums(config, cfg, p, mb)[1]
  for name in _tree_names(cfg):
    sums[f"tree_units/{name}"] = sums["units"]
    sums[f"tree_objective/{name}"] = sums["objective"]
  return sums


def _scale(tree: Any, count: jax.Array) -> Any:
  return jax.tree.map(lambda g: g / jnp.maximum(count, 1.0), tree)


def _finalize(sums: dict[str, jax.Array], names: Sequence[str]) -> dict[str, jax.Array]:
  count = jnp.maximum(sums["units"], 1.0)
  m = {
    "loss": sums["objective"] / count,
    "pg_loss": sums["pg_loss"] / count,
    "kl": sums["kl"] / count,
    "entropy": sums["entropy"] / count,
    "approx_kl": sums["approx_kl"] / count,
    "clip_frac_low": sums["clip_low"] / count,
    "clip_frac_high": sums["clip_high"] / count,
    "clip_frac_dual": sums["clip_dual"] / count,
  }
  m.update({k: v for k, v in sums.items() if k in ("tokens", "generations") or k.startswith("tokens/")})
  m["nll"] = sums["nll"] / jnp.maximum(sums["tokens"], 1.0)  # the trained tokens' mean -logp before the step
  for k in sums:
    if k.startswith("nll/"):
      m[k] = sums[k] / jnp.maximum(sums["tokens/" + k.removeprefix("nll/")], 1.0)
  if len(names) > 1:
    for name in names:
      m[f"loss/{name}"] = sums[f"tree_objective/{name}"] / jnp.maximum(sums[f"tree_units/{name}"], 1.0)
  return m


# ---------------------------------------------------------------------------------------------------------------------
# The update step


@struct.dataclass
class TrainState:
  """What the update step carries.

  Attributes:
    step: int32[] updates applied so far.
    params: the master weights, in the model config's ``param_dtype`` (float32 by default) whatever the compute
      ``dtype``: one parameter tree, or ``{"act": tree, "rehearse": tree}`` in per_role mode; layers unstacked
      (``layers_0 ..``, `transformer.unstack_layers`), the layout samplers read, so a sampler uses these arrays
      without a copy where it computes in their dtype (else it reads a cast copy: `sampling.sampler.Sampler`'s
      ``params``). The update stacks them for its scanned forward (inside each micro-batch program, a temporary);
      the model casts each weight to the compute dtype where it is used, so the gradients and the step are in the
      master's dtype.
    opt_state: the optax state of ``make_optimizer(cfg)`` for params; per_role: ``{"act": ..., "rehearse": ...}``.
      AdamW's moments are float32 from step 0 whatever the params' dtype (`_init_opt_state`), so no step changes a
      leaf's dtype (which would compile the update again).
  """

  step: Any
  params: Any
  opt_state: Any


def _float32_shapes(params: Any) -> Any:
  """``params`` with every leaf that is not float32 replaced by its float32 ``jax.ShapeDtypeStruct`` (on the leaf's
  sharding where it is committed to one): what AdamW's moments are made from, with no float32 copy of the weights.
  Leaves without a dtype (optax's placeholders, `train_state_shardings`) are kept."""

  def leaf(x):
    if getattr(x, "dtype", jnp.float32) == jnp.float32:
      return x
    placed = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed
    return jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding if placed else None)

  return jax.tree.map(leaf, params)


def make_optimizer(cfg: GrpoConfig) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm(max_grad_norm)`` then AdamW (decoupled weight decay) at ``cfg.learning_rate``.

  With a supervised warm-up at its own rate (``sft_steps`` and ``sft_learning_rate`` set) AdamW is wrapped in
  ``optax.inject_hyperparams``: its learning rate lives in the optimizer state and `with_learning_rate` sets it per
  training step (a schedule on the optimizer's own count would drift when a step has nothing to train); the rate is
  a float32 scalar.

  AdamW's moments are float32 whatever the params' dtype, from ``init`` on: ``init`` makes them from the params'
  float32 shapes (`_float32_shapes`: optax makes the second moment in the params' dtype), and the first stays float32
  (``mu_dtype``; optax otherwise keeps the dtype the first update promotes it to: a bfloat16 tree's moment turned
  float32 at step 1, compiling the update again).
  """
  if cfg.injects_learning_rate:
    adamw = optax.inject_hyperparams(optax.adamw, static_args="mu_dtype", hyperparam_dtype=jnp.float32)
  else:
    adamw = optax.adamw
  opt = optax.chain(
    optax.clip_by_global_norm(cfg.max_grad_norm),
    adamw(
      cfg.learning_rate,
      b1=cfg.adam_b1,
      b2=cfg.adam_b2,
      eps=cfg.adam_eps,
      weight_decay=cfg.weight_decay,
      mu_dtype=jnp.float32,
    ),
  )
  return opt._replace(init=lambda params: opt.init(_float32_shapes(params)))


def with_learning_rate(cfg: GrpoConfig, state: TrainState, supervised: bool) -> TrainState:
  """``state`` whose AdamW steps at ``cfg.sft_learning_rate`` (``supervised``) or ``cfg.learning_rate``.

  Unchanged when the optimizer has no injected rate (no warm-up at its own rate: ``learning_rate`` throughout).
  """
  if not cfg.injects_learning_rate:
    return state
  rate = cfg.sft_learning_rate if supervised else cfg.learning_rate

  def set_rate(chain_state):
    clip, adamw = chain_state
    hyperparams = {**adamw.hyperparams, "learning_rate": jnp.asarray(rate, jnp.float32)}
    return (clip, adamw._replace(hyperparams=hyperparams))

  opt_state = state.opt_state
  opt_state = {n: set_rate(opt_state[n]) for n in ROLE_TREES} if cfg.per_role else set_rate(opt_state)
  return state.replace(opt_state=opt_state)


def fresh_optimizer_state(cfg: GrpoConfig, state: TrainState) -> TrainState:
  """``state`` with its optimizer state re-initialised (AdamW's moments and count zeroed; per_role: both trees'),
  each leaf placed like the one it replaces (same sharding); params and step are kept. Used at the first RL update
  after the supervised warm-up (``fresh_optimizer_after_sft``)."""
  # Created on the old leaves' shardings by one program: no device ever holds a whole moment (Qwen3-8B's two are
  # 64 GB in float32).
  shardings = jax.tree.map(lambda old: old.sharding, state.opt_state)
  fresh = jax.jit(functools.partial(_init_opt_state, cfg), out_shardings=shardings)(state.params)
  return state.replace(opt_state=fresh)


def _is_split(params: Any) -> bool:
  return isinstance(params, Mapping) and set(params) == set(ROLE_TREES)


def init_train_state(cfg: GrpoConfig, params: Any) -> TrainState:
  """Step 0: params (layers unstacked: a copy where they come stacked) and a fresh optimizer state (float32
  moments).

  Args:
    params: the master weights in their dtype (a run's: ``config.param_dtype``, float32 by default; nothing is
      cast), one parameter tree, either layout. In per_role mode either that (both role trees start as copies of it,
      as the paper's ablation starts both models from the same checkpoint) or ``{"act": tree, "rehearse": tree}``.
  """
  params = transformer.unstack_tree(params)
  if cfg.per_role and not _is_split(params):
    params = {name: jax.tree.map(jnp.array, params) for name in ROLE_TREES}  # copies: each tree owns its buffers
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=_init_opt_state(cfg, params))


def _init_opt_state(cfg: GrpoConfig, params: Any) -> Any:
  """A fresh optimizer state for ``params`` (per_role: one per role tree of the split params)."""
  opt = make_optimizer(cfg)
  if cfg.per_role:
    return {name: opt.init(params[name]) for name in ROLE_TREES}
  return opt.init(params)


def _apply_updates(opt, grads, opt_state, params, has_tokens):
  """One optimizer step on one tree; params and state are kept bitwise when the tree had no trained token."""
  grad_norm = optax.tree.norm(grads)
  updates, new_state = opt.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jnp.where(has_tokens, new, old)
  return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state), grad_norm


def apply_gradients(
  cfg: GrpoConfig, state: TrainState, grads: Any, metrics: dict[str, jax.Array]
) -> tuple[TrainState, dict[str, jax.Array]]:
  """The optimizer step on normalised gradients (in the state's layout): global-norm clip and AdamW per tree.

  A tree with no trained token (``metrics["tokens"]``, per_role ``tokens/<tree>``) is not stepped: AdamW's weight
  decay and momentum would otherwise move it with no data. Returns the new state and ``metrics`` plus
  ``grad_norm`` (global norm before clipping; per_role also ``grad_norm/<tree>``).
  """
  opt = make_optimizer(cfg)
  metrics = dict(metrics)
  if cfg.per_role:
    params, opt_state, norms = {}, {}, []
    for name in ROLE_TREES:
      has = metrics.get(f"tokens/{name}", jnp.zeros(())) > 0
      params[name], opt_state[name], norm = _apply_updates(
        opt, grads[name], state.opt_state[name], state.params[name], has
      )
      metrics[f"grad_norm/{name}"] = norm
      norms.append(norm)
    metrics["grad_norm"] = jnp.sqrt(sum(jnp.square(n) for n in norms))
  else:
    params, opt_state, metrics["grad_norm"] = _apply_updates(
      opt, grads, state.opt_state, state.params, metrics["tokens"] > 0
    )
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def update_step(
  config: ModelConfig, cfg: GrpoConfig, state: TrainState, batch: TrainBatch
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One GRPO update as one pure function: accumulated gradient (`loss_and_grads`), then `apply_gradients`.

  The single-program form of ``make_update_step``: the reference its tests compare with, and what ``--mode=plan``
  compiles.

  Args:
    config: model config of the params' layout (``scan_layers=True`` for training).
    batch: TrainBatch with [K, M, ...] fields.
  Returns:
    (the new state, metrics): those of ``loss_and_grads`` and ``apply_gradients``.
  """
  grads, metrics = loss_and_grads(config, cfg, transformer.stack_tree(state.params), batch)
  return apply_gradients(cfg, state, transformer.unstack_tree(grads), metrics)


def train_state_shardings(
  config: ModelConfig, cfg: GrpoConfig, mesh: Mesh, rules: sharding.Rules = sharding.LOGICAL_RULES
) -> TrainState:
  """A TrainState of ``NamedSharding``s for its layout (layers unstacked): params by ``sharding.param_shardings``,
  AdamW moments like their params, scalars (step, optimizer counts) replicated. Abstract shapes only: nothing is
  allocated."""
  config = config.replace(scan_layers=False)
  p_shardings = sharding.param_shardings(config, mesh, rules)
  shapes = transformer.abstract_params(config)
  opt = make_optimizer(cfg)
  rep = sharding.replicated(mesh)
  o_shardings = optax.tree_map_params(
    opt, lambda _, s: s, jax.eval_shape(opt.init, shapes), p_shardings, transform_non_params=lambda _: rep
  )
  if cfg.per_role:
    p_shardings = {name: p_shardings for name in ROLE_TREES}
    o_shardings = {name: o_shardings for name in ROLE_TREES}
  return TrainState(step=rep, params=p_shardings, opt_state=o_shardings)


def train_batch_shardings(mesh: Mesh, rules: sharding.Rules = sharding.LOGICAL_RULES) -> TrainBatch:
  """A TrainBatch of ``NamedSharding``s for [K, M, ...] fields: rows (M) split over the batch axes, K and the
  token axes ([K, M, T] and [K, M, I] fields) replicated."""
  rows = sharding.batch_sharding(mesh, 1, rules).spec[0]
  per_row = NamedSharding(mesh, PartitionSpec(None, rows))
  per_token = NamedSharding(mesh, PartitionSpec(None, rows, None))
  fields = {f.name: per_token for f in dataclasses.fields(TrainBatch)}
  fields.update(row_role=per_row)
  return TrainBatch(**fields)


def shard_train_state(state: TrainState, shardings: TrainState) -> TrainState:
  """Places a TrainState per ``train_state_shardings`` (``jax.device_put``)."""
  return jax.device_put(state, shardings)


def _check_step_batch(batch: TrainBatch, cfg: GrpoConfig, shards: int) -> None:
  if np.ndim(batch.tokens) != 3:
    raise ValueError(
      f"the update step takes [K, M, T] micro-batches, got tokens of shape {np.shape(batch.tokens)}; use "
      "split_micro_batches (or build_batch)."
    )
  m = np.shape(batch.tokens)[1]
  if m % shards:
    raise ValueError(f"micro-batch of {m} rows is not divisible by the {shards} batch shards of the mesh.")
  if cfg.per_role:
    role = np.asarray(batch.row_role)
    used = np.asarray(batch.target_mask).any(axis=-1)
    if np.any(used & (role != role[:, :1])):
      raise ValueError("per_role mode needs single-role micro-batches; use split_micro_batches(..., by_role=True).")


# make_update_step's arguments -> its jitted programs, so that a second Trainer (or a test's second step) with the same
# model, GRPO settings and mesh traces, lowers and loads nothing again.
_SHARED_UPDATES = compilation_cache.SharedPrograms()


def _micro_batch_shardings(mesh: Mesh, rules: sharding.Rules):
  """One micro-batch's shardings: `train_batch_shardings` without the leading K axis."""
  return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*s.spec[1:])), train_batch_shardings(mesh, rules))


def _update_programs(config: ModelConfig, cfg: GrpoConfig, mesh, rules, donate: bool, signature=None) -> tuple:
  """make_update_step's jitted (micro, add, finish, take); with a ``signature``, each one's executables kept for later
  processes (`compilation_cache.PersistentProgram`)."""

  def micro(params, mb):
    grads, sums = micro_batch_grads(config, cfg, transformer.stack_tree(params), mb)
    return transformer.unstack_tree(grads), sums

  def finish(state, grads, sums):
    grads, metrics = normalize(cfg, grads, sums)
    return apply_gradients(cfg, state, grads, metrics)

  add = lambda acc, new: jax.tree.map(jnp.add, acc, new)  # noqa: E731
  take = lambda batch, k: jax.tree.map(lambda x: x[k], batch)  # noqa: E731
  donated = ("state",) if donate else ()
  if mesh is None:
    # Pinned to the default device: a program's cache key includes whether each argument is committed to a device,
    # and the state mixes fresh (uncommitted) leaves with earlier outputs (committed) from step to step.
    one = SingleDeviceSharding(jax.devices()[0])
    micro_jit = jax.jit(micro, in_shardings=one, out_shardings=one)
    add_jit = jax.jit(add, in_shardings=one, out_shardings=one, donate_argnames="acc")
    finish_jit = jax.jit(finish, in_shardings=one, out_shardings=one, donate_argnames=donated)
    take_jit = jax.jit(take, in_shardings=one, out_shardings=one)
  else:
    state_sh = train_state_shardings(config, cfg, mesh, rules)
    rep = sharding.replicated(mesh)
    batch_sh, mb_sh = train_batch_shardings(mesh, rules), _micro_batch_shardings(mesh, rules)
    acc_sh = (state_sh.params, rep)
    micro_jit = jax.jit(micro, in_shardings=(state_sh.params, mb_sh), out_shardings=acc_sh)
    add_jit = jax.jit(add, in_shardings=(acc_sh, acc_sh), out_shardings=acc_sh, donate_argnames="acc")
    finish_jit = jax.jit(
      finish, in_shardings=(state_sh, *acc_sh), out_shardings=(state_sh, rep), donate_argnames=donated
    )
    take_jit = jax.jit(take, in_shardings=(batch_sh, rep), out_shardings=mb_sh)
  jits = {"micro": micro_jit, "add": add_jit, "finish": finish_jit, "take": take_jit}
  return tuple(
    compilation_cache.PersistentProgram(jitted, f"update_{name}", signature and (signature, name))
    for name, jitted in jits.items()
  )


def make_update_step(
  config: ModelConfig,
  cfg: GrpoConfig,
  *,
  mesh: Mesh | None = None,
  rules: sharding.Rules = sharding.LOGICAL_RULES,
  donate: bool = True,
):
  """The update step as jitted programs: one per micro-batch shape (gradient and sums of one micro-batch), one that
  adds them up, one optimizer step; on a mesh with explicit in/out shardings.

  The arithmetic is ``update_step``'s (the same sums in the same order). What differs is the shapes: a host batch's
  micro-batch k is cut to its own bucketed length (`batch.trimmed`: its T and I, not the longest row of the step's),
  and a micro-batch without a trained token is skipped (its gradient and sums are exactly zero). So a step compiles
  only the micro-batch shapes it has not met before, whatever its number of micro-batches or its longest row, and
  short micro-batches cost what their own rows cost. A batch of device arrays (a multi-host caller's global arrays)
  runs every micro-batch at the batch's own T and I. In a multi-process run a host batch is the whole batch, the same
  in every process (`distributed`): each micro-batch is cut as above, then placed as a global array.

  Args:
    config: model config of the params' layout.
    mesh: optional mesh: the state is laid out per ``train_state_shardings`` (place it with ``shard_train_state``),
      the batch per ``train_batch_shardings``, metrics replicated.
    donate: donate the state's buffers (the old state is unusable after the call).
  Returns:
    ``step(state, batch) -> (state, metrics)`` with ``batch`` [K, M, ...]; ``step.compiled_shapes()`` lists the
    micro-batch shapes (M, T, I) compiled so far; ``step.programs`` maps "micro" (``(params, micro-batch) ->
    (grads, sums)``), "add" (the accumulator: ``(acc, new) -> acc + new``, ``acc`` donated) and "finish"
    (``(state, grads, sums) -> (state, metrics)``) to the jitted programs ``step`` calls (``envace_jax/plan.py``
    lowers them, a test wraps them).
  Raises (when step is called):
    ValueError: the batch is not [K, M, T], M is not a multiple of the batch shards, or per_role micro-batches
      mix roles.
  """

  # The programs of an earlier call with the same arguments and attention backend (`_SHARED_UPDATES`), when they hash
  # and no `attention.recording` block would miss their traces.
  signature = None if attention.is_recording() else (config, cfg, mesh, rules, donate, attention.current_backend())
  shared = _SHARED_UPDATES.get(signature, lambda: _update_programs(config, cfg, mesh, rules, donate, signature))
  micro_jit, add_jit, finish_jit, take_jit = shared
  shards = 1 if mesh is None else sharding.batch_size_multiple(mesh, rules)
  shapes: set[tuple[int, int, int]] = set()

  def micro_batches(batch: TrainBatch):
    leaves = jax.tree.leaves(batch)
    k = np.shape(batch.tokens)[0]
    if not all(isinstance(x, np.ndarray | np.generic) for x in leaves):
      return [take_jit(batch, np.int32(i)) for i in range(k)]
    mbs = [trimmed(jax.tree.map(lambda x, i=i: x[i], batch), cfg.length_bucket) for i in range(k)]
    kept = [mb for mb in mbs if mb.target_mask.any()] or mbs[:1]  # none: one still gives the gradient's structure
    if mesh is not None and jax.process_count() > 1:  # every process holds the batch; each places its devices' rows
      kept = [distributed.place(mb, _micro_batch_shardings(mesh, rules)) for mb in kept]
    return kept

  programs = {"micro": micro_jit, "add": add_jit, "finish": finish_jit}

  def step(state: TrainState, batch: TrainBatch):
    _check_step_batch(batch, cfg, shards)
    acc = None
    for mb in micro_batches(batch):
      shapes.add((int(np.shape(mb.tokens)[0]), int(np.shape(mb.tokens)[1]), int(np.shape(mb.target_index)[1])))
      out = programs["micro"](state.params, mb)
      acc = out if acc is None else programs["add"](acc, out)
    return programs["finish"](state, *acc)

  step.compiled_shapes = lambda: sorted(shapes)
  step.programs = programs
  return step
