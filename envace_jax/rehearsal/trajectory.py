"""Trajectories and their training rows: the token bookkeeping between the rollout and the update.

A self-unfolded trajectory (paper §3; docs/method.md) keeps one append-only token sequence per
**view**: the agent's (ACT), the environment's (REHEARSE) and the user simulator's (USER). Each view's sequence is
exactly what that view's KV cache holds: prompt tokens rendered from messages, and generated tokens exactly as the
sampler produced them. At the end each view becomes one `TrainingRow`: nothing is re-tokenised from text.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from envace_jax.envs.base import ChatMessage, RewardInfo, Task
from envace_jax.model.roles import Role


class Termination(str, enum.Enum):
  """Why a trajectory ended (kept on the trajectory and counted in metrics)."""

  AGENT_STOP = "agent_stop"  # the agent replied with its stop marker / final answer and the user ended
  USER_STOP = "user_stop"  # the user simulator emitted a stop marker (###STOP###, ###TRANSFER###, ...)
  USER_TURNS_DONE = "user_turns_done"  # logged user turns (BFCL, checklist format) are exhausted
  MAX_TURNS = "max_turns"  # the configured turn budget ran out
  CONTEXT_EXHAUSTED = "context_exhausted"  # a view's KV cache is full
  MALFORMED = "malformed"  # malformed output ended the trajectory (when configured to)
  USER_ERROR = "user_error"  # an external user simulator failed (transport); not a model outcome: exclude it
  # A finished logged turn failed a checklist item marked required_for_next_turn (reward.required_items="end")
  REQUIRED_FAILED = "required_failed"
  JUDGE_FAILED = "judge_failed"  # the judge gave no verdict on a finished turn during the rollout: reward invalid


def common_prefix_length(tokens: Sequence[Sequence[int]], roles: Sequence[Sequence[int]]) -> int:
  """The number of leading positions where every sequence has the same token id and role id (0 for none given):
  the part of several views' token sequences that can be stored, prefilled or trained on once."""
  if not tokens:
    return 0
  n = min(len(t) for t in tokens)
  ids = np.stack([np.asarray([t[:n] for t in tokens], np.int64), np.asarray([r[:n] for r in roles], np.int64)])
  differ = np.flatnonzero((ids != ids[:, :1]).any(axis=(0, 1)))
  return int(differ[0]) if differ.size else n


@dataclasses.dataclass
class TrainingRow:
  """One view of one trajectory, packed: T tokens (T = the view's length).

  Attributes:
    tokens: int32[T] token ids, exactly as held by the view's KV cache.
    roles: int32[T] role id (roles.Role) of every token.
    loss_mask: bool[T] True on the tokens this view's ``role`` generated.
    logprobs: float32[T] the sampler's logprob of ``tokens[t]`` given ``tokens[:t]`` under the unmodified policy
      (temperature 1, no truncation) where ``loss_mask``, 0 elsewhere.
    role: the role that generated in this view (Role.ACT, Role.REHEARSE or Role.USER).
    trajectory: index of the trajectory in its rollout batch (B*G trajectories, task-major: b*G + g).
    num_generations: how many generations (sampler outputs) this row holds.
  """

  tokens: np.ndarray
  roles: np.ndarray
  loss_mask: np.ndarray
  logprobs: np.ndarray
  role: int
  trajectory: int
  num_generations: int

  def __post_init__(self):
    n = len(self.tokens)
    for name in ("roles", "loss_mask", "logprobs"):
      if len(getattr(self, name)) != n:
        raise ValueError(f"TrainingRow.{name} has length {len(getattr(self, name))}, tokens has {n}.")

  @property
  def num_trained_tokens(self) -> int:
    return int(np.sum(self.loss_mask))


@dataclasses.dataclass
class Trajectory:
  """One rollout of one task.

  Attributes:
    task: the task.
    group: index of the task in the rollout batch (the GRPO group).
    sample: index of this rollout within its group (0..G-1).
    messages: the conversation as the agent saw it (OpenAI layout), for the evaluator and for humans.
    rows: the views' training rows, by role id (with ``rollout.rehearse_context="per_call"``, REHEARSE's last call).
    extra_rows: rows beyond one per role, in order: REHEARSE's earlier calls with ``rehearse_context="per_call"``.
    termination: why it ended.
    counts: recoverable faults and sizes for metrics, e.g. ``tool_calls``, ``malformed_act``,
      ``invalid_rehearsed_json``, ``unknown_tool``, ``turns``, ``generations_act``, ``unencodable_chars`` (code
      points its views' tokens hold as U+FFFD: `views.View.unencodable`, summed over the views, so a text shown in
      two views counts twice) ...
    reward: the trajectory's reward (set after the rollout), or None.
    events: a host-side log of what happened (parse errors with their raw text, ...), JSON-compatible.
  """

  task: Task
  group: int
  sample: int
  messages: list[ChatMessage] = dataclasses.field(default_factory=list)
  rows: dict[int, TrainingRow] = dataclasses.field(default_factory=dict)
  extra_rows: list[TrainingRow] = dataclasses.field(default_factory=list)
  termination: Termination | None = None
  counts: dict[str, int] = dataclasses.field(default_factory=dict)
  reward: RewardInfo | None = None
  events: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)

  def count(self, name: str, n: int = 1) -> None:
    self.counts[name] = self.counts.get(name, 0) + n

  def training_rows(self) -> list[TrainingRow]:
    """Every training row: ``rows`` by role id, then ``extra_rows``."""
    return [row for _, row in sorted(self.rows.items())] + list(self.extra_rows)

  def generations(self, role: Role | int) -> int:
    """Number of generations of ``role`` in this trajectory, over all its rows (0 when it has none)."""
    return sum(row.num_generations for row in self.training_rows() if row.role == int(role))
