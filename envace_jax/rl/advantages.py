"""Role-wise GRPO advantages (paper §3): the group of a generation is (task, role) (host numpy, outside jit).

Every trajectory gets one advantage per role, which each of its rows of that role carries into the update (rl/grpo.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from envace_jax.config.choices import WEIGHTINGS
from envace_jax.model.roles import NUM_ROLES, Role
from envace_jax.rehearsal.trajectory import Trajectory


def role_name(role: int) -> str:
  """``Role(role).name.lower()``, e.g. "act"; the role id as text when it is not a Role."""
  return Role(role).name.lower() if 0 <= role < NUM_ROLES else str(role)


def role_advantages(
  rewards: np.ndarray,
  groups: np.ndarray,
  generations: np.ndarray,
  valid: np.ndarray | None = None,
  *,
  trained_roles: Sequence[int],
  weighting: str = "row",
  std_normalize: bool = False,
  eps: float = 1e-6,
) -> tuple[np.ndarray, dict[str, float]]:
  """Role-wise GRPO advantages A[i, r] = (R_i - baseline_{g(i), r}) [/ (std_{g(i), r} + eps)].

  The group of trajectory i's role-r generations is (groups[i], r). Member i of that group has weight
  w_i = generations[i, r] ("row": every generation counts once) or 1[generations[i, r] > 0] ("trajectory"); invalid
  trajectories have weight 0. Then

      baseline = sum_i w_i R_i / sum_i w_i
      std      = sqrt(sum_i w_i (R_i - baseline)^2 / (sum_i w_i - 1))      (frequency weights, Bessel-corrected
                                                                           like the torch.std of verl's GRPO)

  A group whose members' rewards are all equal (including a group of one) has zero variance: its advantages are
  exactly 0 and it is counted in the stats (verl instead gives a lone member its raw reward).

  Args:
    rewards: float[N] reward of each trajectory (ignored where ``valid`` is False; may be NaN there).
    groups: int[N] group (task) id of each trajectory.
    generations: int[N, R'] number of generations of each role id in each trajectory (columns indexed by role id,
      R' > max(trained_roles); ``trajectory_arrays`` builds it with R' = NUM_ROLES).
    valid: bool[N]; False (e.g. a judge transport failure) excludes the trajectory from every baseline and gives it
      zero advantage; default all True.
    trained_roles: role ids to compute advantages for; other columns stay 0.
    weighting: "row" or "trajectory" (also used for the std).
    std_normalize: divide by the group's std (+ eps).
    eps: see std_normalize.
  Returns:
    (advantages float32[N, R'], stats): advantages are 0 for invalid trajectories, untrained roles and roles a
    trajectory never generated. stats (floats): ``invalid_trajectories``, and per trained role name (e.g. "act"):
    ``adv/<role>/groups`` (groups with at least one member), ``adv/<role>/zero_variance_groups``,
    ``adv/<role>/trajectories``, ``adv/<role>/generations``, ``adv/<role>/abs_mean`` (mean |A| over members).
  Raises:
    ValueError: mismatched shapes, a role outside the columns of ``generations``, negative generation counts, a
      non-finite reward on a valid trajectory, or an unknown weighting.
  """
  if weighting not in WEIGHTINGS:
    raise ValueError(f"weighting={weighting!r}; valid values: {WEIGHTINGS}.")
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
  if np.any(gens < 0):
    raise ValueError("role_advantages: generation counts must be >= 0.")
  bad = valid & ~np.isfinite(rewards)
  if np.any(bad):
    raise ValueError(
      f"role_advantages: trajectories {np.flatnonzero(bad).tolist()} are valid but have a non-finite reward; "
      "mark them valid=False or fix the reward."
    )
  out = np.zeros(gens.shape, np.float32)
  stats: dict[str, float] = {"invalid_trajectories": float(np.sum(~valid))}
  for r in trained_roles:
    r = int(r)
    if not 0 <= r < gens.shape[1]:
      raise ValueError(f"role_advantages: role {r} is outside generations' {gens.shape[1]} columns.")
    weight = (gens[:, r] if weighting == "row" else gens[:, r] > 0).astype(np.float64)
    weight = np.where(valid, weight, 0.0)
    name = role_name(r)
    num_groups = zero_var = 0
    abs_sum = 0.0
    for g in np.unique(groups[weight > 0]):
      members = (groups == g) & (weight > 0)
      w, x = weight[members], rewards[members]
      num_groups += 1
      if x.max() == x.min():
        zero_var += 1
        continue
      baseline = np.sum(w * x) / np.sum(w)
      adv = x - baseline
      if std_normalize:
        adv = adv / (np.sqrt(np.sum(w * (x - baseline) ** 2) / (np.sum(w) - 1.0)) + eps)
      out[members, r] = adv
      abs_sum += float(np.sum(np.abs(adv)))
    members = int(np.sum(weight > 0))
    stats[f"adv/{name}/groups"] = float(num_groups)
    stats[f"adv/{name}/zero_variance_groups"] = float(zero_var)
    stats[f"adv/{name}/trajectories"] = float(members)
    stats[f"adv/{name}/generations"] = float(np.sum(np.where(valid, gens[:, r], 0)))
    stats[f"adv/{name}/abs_mean"] = abs_sum / max(members, 1)
  return out, stats


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
