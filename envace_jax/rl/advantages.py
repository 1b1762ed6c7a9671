"""Role-wise GRPO advantages (paper §3): the group of a generation is (task, role) (host numpy, outside jit).

Every trajectory gets one advantage per role, which each of its rows of that role carries into the update (rl/grpo.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envace_jax.config.choices import BASELINE_GROUPS, LONE_MEMBER_ADVANTAGES, WEIGHTINGS
from envace_jax.model.roles import NUM_ROLES, Role
from envace_jax.rehearsal.trajectory import Trajectory
from envace_jax.rl.batch import generation_spans


def role_name(role: int) -> str:
  """``Role(role).name.lower()``, e.g. "act"; the role id as text when it is not a Role."""
  return Role(role).name.lower() if 0 <= role < NUM_ROLES else str(role)


def role_advantages(*args, **kwargs) -> tuple[np.ndarray, dict[str, float]]:
  """Role-wise GRPO advantages, one per (trajectory, role): `generation_advantages` (same arguments) without empty
  generations.

  Returns:
    (advantages float32[N, R'], stats): see `generation_advantages`.
  """
  adv, _, stats = generation_advantages(*args, **kwargs)
  return adv, stats


def generation_advantages(
  rewards: np.ndarray,
  groups: np.ndarray,
  generations: np.ndarray,
  valid: np.ndarray | None = None,
  *,
  trained_roles: Sequence[int],
  weighting: str = "row",
  std_normalize: bool = False,
  eps: float = 1e-6,
  baseline_groups: str = "task_role",
  lone_member_advantage: str = "zero",
  empty: np.ndarray | None = None,
  empty_penalty: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
  """GRPO advantages A = (s - baseline) [/ (std + eps)] of every generation, from its score s.

  A generation's score is its trajectory's reward R_i, less ``empty_penalty`` when the generation is empty (the
  official trainer's ``apply_invalid_action_penalty``: ``invalid_action_penalty_coef`` 0.1 on a generation whose
  decoded text is blank, verl/trainer/ppo/ray_trainer.py and agent_system/agent/agents/checklist/*_agent.py).

  The baseline group (``baseline_groups``): "task_role" (the paper's role-wise GRPO, official
  ``group_by_agent_id=True``): the generations of one role in the G trajectories of one task (``groups``); "task"
  (official ``group_by_agent_id=False``, a role-agnostic ablation): every trained role's generations of the task's
  trajectories, one group. The members of a group and their weights (``weighting``): "row", every generation counts
  once (the official); "trajectory", each trajectory once with the mean score of its generations in the group (the
  official "task" grouping). Invalid trajectories have weight 0. With W the group's total weight:

      baseline = sum_j w_j s_j / W
      std      = sqrt(sum_j w_j (s_j - baseline)^2 / (W - 1))      (Bessel-corrected like verl's torch.std)

  A group whose scores are all equal has zero variance: its advantages are exactly 0 (counted in the stats). A
  group of one member (W = 1: one generation, or one trajectory; counted as lone) gets, by
  ``lone_member_advantage``, "zero" (ours: a zero-variance group, there is nothing to compare it with) or "reward"
  (the official: baseline 0 and std 1, so A = s [/ (1 + eps)]).

  Args:
    rewards: float[N] reward of each trajectory (ignored where ``valid`` is False; may be NaN there).
    groups: int[N] group (task) id of each trajectory.
    generations: int[N, R'] number of generations of each role id in each trajectory (columns indexed by role id,
      R' > max(trained_roles); ``trajectory_arrays`` builds it with R' = NUM_ROLES).
    valid: bool[N]; False (e.g. a judge transport failure) excludes the trajectory from every baseline and gives it
      zero advantage; default all True.
    trained_roles: role ids to compute advantages for; other columns stay 0.
    weighting: one of WEIGHTINGS (above).
    std_normalize: divide by the group's std (+ eps).
    eps: see std_normalize.
    baseline_groups: one of BASELINE_GROUPS (above).
    lone_member_advantage: one of LONE_MEMBER_ADVANTAGES (above).
    empty: int[N, R'] how many of those generations are empty (`empty_generations`); default none.
    empty_penalty: subtracted from an empty generation's score (>= 0).
  Returns:
    (advantages float32[N, R'], empty_advantages float32[N, R'], stats): the advantage of trajectory i's non-empty
    and empty role-r generations (equal unless a penalty makes them differ); 0 for invalid trajectories, untrained
    roles and roles a trajectory never generated. stats (floats): ``invalid_trajectories``, and per trained role
    name (e.g. "act"): ``adv/<role>/groups`` (groups with at least one member of the role),
    ``adv/<role>/zero_variance_groups``, ``adv/<role>/lone_groups``, ``adv/<role>/trajectories``,
    ``adv/<role>/generations``, ``adv/<role>/abs_mean`` (mean |A| over members, a trajectory's |A| of its non-empty
    generations).
  Raises:
    ValueError: mismatched shapes, a role outside the columns of ``generations``, negative or too many empty
      generation counts, a non-finite reward on a valid trajectory, a negative penalty or an unknown choice.
  """
  for name, value, valid_values in (
    ("weighting", weighting, WEIGHTINGS),
    ("baseline_groups", baseline_groups, BASELINE_GROUPS),
    ("lone_member_advantage", lone_member_advantage, LONE_MEMBER_ADVANTAGES),
  ):
    if value not in valid_values:
      raise ValueError(f"{name}={value!r}; valid values: {valid_values}.")
  if not empty_penalty >= 0.0:
    raise ValueError(f"empty_penalty={empty_penalty!r}; it must be >= 0.")
  rewards = np.asarray(rewards, np.float64).reshape(-1)
  n = rewards.shape[0]
  groups = np.asarray(groups).reshape(-1)
  gens = np.asarray(generations)
  valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool).reshape(-1)
  if groups.shape != (n,) or valid.shape != (n,) or gens.ndim != 2 or gens.shape[0] != n:
    raise ValueError(
      f"role_advantages: rewards[{n}] needs groups[{n}], valid[{n}] and generations[{n}, R]; got groups "
      f"{groups.shape}, valid {valid.shape}, generations {gens.shape}."
    )
  empty = np.zeros(gens.shape, np.int64) if empty is None else np.asarray(empty)
  if empty.shape != gens.shape:
    raise ValueError(f"role_advantages: empty {empty.shape} must have generations' shape {gens.shape}.")
  if np.any(gens < 0) or np.any(empty < 0) or np.any(empty > gens):
    raise ValueError("role_advantages: generation counts must be >= 0, and empty ones at most the generations.")
  bad = valid & ~np.isfinite(rewards)
  if np.any(bad):
    raise ValueError(
      f"role_advantages: trajectories {np.flatnonzero(bad).tolist()} are valid but have a non-finite reward; "
      "mark them valid=False or fix the reward."
    )
  roles = [int(r) for r in trained_roles]
  for r in roles:
    if not 0 <= r < gens.shape[1]:
      raise ValueError(f"role_advantages: role {r} is outside generations' {gens.shape[1]} columns.")
  out = np.zeros(gens.shape, np.float32)
  out_empty = np.zeros(gens.shape, np.float32)
  kinds: dict[tuple[Any, int], tuple[str, bool]] = {}  # (group, role) -> ("zero_variance" | "scored", lone)
  # One baseline per (group, set of roles): each trained role alone, or all of them together.
  unit_roles = [[r] for r in roles] if baseline_groups == "task_role" else [roles]
  for rs in unit_roles:
    g_all = np.where(valid[:, None], gens[:, rs], 0).astype(np.float64)  # [N, |rs|]
    e_all = np.where(valid[:, None], empty[:, rs], 0).astype(np.float64)
    count, n_empty = g_all.sum(axis=1), e_all.sum(axis=1)
    for g in np.unique(groups[count > 0]):
      members = np.flatnonzero((groups == g) & (count > 0))
      c, e, x = count[members], n_empty[members], rewards[members]
      if weighting == "row":  # one entry per generation: (score, weight) of the non-empty and the empty ones
        values = np.concatenate([x, x - empty_penalty])
        weights = np.concatenate([c - e, e])
      else:  # one entry per trajectory: the mean score of its generations in the group
        values, weights = x - empty_penalty * e / c, np.ones(len(members))
      used = weights > 0
      total = float(np.sum(weights))
      lone = total == 1.0
      if lone and lone_member_advantage == "reward":
        kind, baseline, scale = "scored", 0.0, (1.0 + eps if std_normalize else 1.0)
      elif values[used].max() == values[used].min():
        kind, baseline, scale = "zero_variance", None, 1.0
      else:
        kind = "scored"
        baseline = float(np.sum(weights * values) / total)
        std = np.sqrt(np.sum(weights * (values - baseline) ** 2) / (total - 1.0))
        scale = std + eps if std_normalize else 1.0
      for r in rs:
        kinds[(g, r)] = (kind, lone)
      if baseline is None:
        continue
      if weighting == "row":
        adv, adv_empty = (x - baseline) / scale, (x - empty_penalty - baseline) / scale
      else:
        adv = adv_empty = (values - baseline) / scale
      for r in rs:
        has = gens[members, r] > 0
        out[members[has], r] = adv[has]
        out_empty[members[has], r] = adv_empty[has]
  stats: dict[str, float] = {"invalid_trajectories": float(np.sum(~valid))}
  for r in roles:
    name = role_name(r)
    members = valid & (gens[:, r] > 0)
    role_kinds = [k for (_, role), k in kinds.items() if role == r]
    stats[f"adv/{name}/groups"] = float(len(role_kinds))
    stats[f"adv/{name}/zero_variance_groups"] = float(sum(kind == "zero_variance" for kind, _ in role_kinds))
    stats[f"adv/{name}/lone_groups"] = float(sum(lone for _, lone in role_kinds))
    stats[f"adv/{name}/trajectories"] = float(np.sum(members))
    stats[f"adv/{name}/generations"] = float(np.sum(np.where(valid, gens[:, r], 0)))
    stats[f"adv/{name}/abs_mean"] = float(np.sum(np.abs(out[members, r]))) / max(int(np.sum(members)), 1)
  return out, out_empty, stats


def empty_generations(
  trajectories: Sequence[Trajectory], roles: Sequence[int], is_empty: Callable[[np.ndarray], bool]
) -> tuple[np.ndarray, list[dict[int, np.ndarray]]]:
  """Which generations of each trajectory's rows are empty, for ``generation_advantages``' penalty.

  A row's generations are its runs of trained tokens (`batch.generation_spans`: each is one sampler output's ids).

  Args:
    roles: the role ids whose rows are read.
    is_empty: int32[n] ids of one generation -> whether its text is empty (the trainer: blank once decoded without
      special tokens, as the official trainer's ``batch_decode(..., skip_special_tokens=True)`` then ``strip()``).
  Returns:
    (counts int32[N, NUM_ROLES] of empty generations, flags): flags[i][role] bool[runs], one per generation of
    trajectory i's rows of that role (`Trajectory.training_rows` order, then each row's runs), absent: no row.
  """
  counts = np.zeros((len(trajectories), NUM_ROLES), np.int32)
  flags: list[dict[int, np.ndarray]] = []
  for i, traj in enumerate(trajectories):
    flags.append({})
    for role in roles:
      rows = [row for row in traj.training_rows() if row.role == int(role)]
      if not rows:
        continue
      f = np.asarray(
        [bool(is_empty(np.asarray(row.tokens[a:b]))) for row in rows for a, b in generation_spans(row.loss_mask)], bool
      )
      flags[i][int(role)] = f
      counts[i, int(role)] = int(f.sum())
  return counts, flags


def trajectory_arrays(trajectories: Sequence[Trajectory]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The inputs of ``role_advantages`` from scored trajectories (index i = position in the list).

  Returns:
    rewards float32[N], groups int32[N] (``Trajectory.group``), generations int32[N, NUM_ROLES]
    (``Trajectory.generations(role)``), valid bool[N] (``RewardInfo.valid``).
  Raises:
    ValueError: a trajectory has no reward yet.
  """
  n = len(trajectories)
  rewards, groups = np.zeros(n, np.float32), np.zeros(n, np.int32)
  generations, valid = np.zeros((n, NUM_ROLES), np.int32), np.zeros(n, bool)
  for i, traj in enumerate(trajectories):
    if traj.reward is None:
      raise ValueError(f"trajectory {i} (group {traj.group}, sample {traj.sample}) has no reward; score it first.")
    rewards[i], groups[i], valid[i] = traj.reward.reward, traj.group, traj.reward.valid
    for r in range(NUM_ROLES):
      generations[i, r] = traj.generations(r)
  return rewards, groups, generations, valid
