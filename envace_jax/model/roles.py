"""Role ids: which hat the policy wears for each token (paper §3.1).

Each id selects a row of the transformer's learned, zero-initialised role embedding. The ids are stable: they index
the role-embedding table stored in checkpoints. Add new roles at the end.
"""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
  """Role id of a token. Values index rows of the role-embedding table ``[num_roles, D]``."""

  SYSTEM = 0  # system prompt: policy, tool schemas, rehearsal memory
  USER = 1  # the user (or the user simulator's output as the agent sees it)
  ACT = 2  # the agent: tool calls and replies
  REHEARSE = 3  # the policy imagining a tool/environment response
  OBSERVATION = 4  # a real tool's output


NUM_ROLES = len(Role)
