"""Role ids: which hat the policy wears for each token.

Every token in a rendered conversation carries the id of the role that produced it (paper §3.1). The transformer adds
a learned, zero-initialised embedding per role to the token embedding, so generated tokens tell the model whether it
is acting (ACT) or rehearsing the environment (REHEARSE).

The ids are stable: they index the role-embedding table stored in checkpoints. Add new roles at the end.
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
