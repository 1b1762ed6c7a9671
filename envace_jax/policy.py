"""The policy's parameter trees and which of them samples and trains each role: one tree shared by every role (EnvACE,
the paper's method, and plain GRPO), or one tree per role (the paper's per-role ablation: ACT and REHEARSE each with
its own parameters and AdamW state; a policy-played user speaks with the ACT tree).

This is the only module outside the config and the update (``rl/grpo.py``'s ``ROLE_TREES``, which steps each tree)
that tells the two apart. The samplers of a run are named by tree: "policy" (the shared tree, or ACT's) and
"rehearse" (REHEARSE's own tree, when there is one), beside the frozen "reference".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from envace_jax.model.roles import Role
from envace_jax.rl import grpo
from envace_jax.rl.batch import TrainBatch
from envace_jax.rl.logprobs import recompute_logprobs

Params = Any
SAMPLER_OF_TREE = {"policy": "policy", "act": "policy", "rehearse": "rehearse"}  # tree name -> sampler name


@dataclasses.dataclass(frozen=True)
class Policy:
  """Attributes:
  separate: one parameter tree per role (``grpo.mode="per_role"``) instead of one shared tree."""

  separate: bool

  @classmethod
  def from_config(cls, config) -> Policy:
    return cls(separate=config.grpo.mode == "per_role")

  @property
  def trees(self) -> tuple[str, ...]:
    """The tree names: ("policy",) or ("act", "rehearse"), the keys of a separate policy's params."""
    return tuple(grpo.ROLE_TREES) if self.separate else ("policy",)

  @property
  def sampler_names(self) -> tuple[str, ...]:
    """The names of the trees' samplers in a run's samplers mapping: ("policy",) or ("policy", "rehearse")."""
    return tuple(SAMPLER_OF_TREE[name] for name in self.trees)

  def tree_of(self, role: Role) -> str:
    """The tree that samples and trains ``role`` (the ACT tree plays a policy user)."""
    if not self.separate:
      return "policy"
    return "rehearse" if role == Role.REHEARSE else "act"

  def split(self, params: Params) -> dict[str, Params]:
    """{tree name: parameter tree} of a run's params (one tree, or {"act": ..., "rehearse": ...})."""
    return {name: params[name] for name in self.trees} if self.separate else {"policy": params}

  def initial(self, base: Params) -> Params:
    """The params a run starts from: ``base``, or one reference to it per role tree (copied by the update)."""
    return {name: base for name in self.trees} if self.separate else base

  def samplers(self, params: Params, make: Callable[[Params], Any]) -> dict[str, Any]:
    """{"policy": sampler, and "rehearse" for a separate REHEARSE tree}: ``make(tree)`` for each tree of ``params``."""
    return {SAMPLER_OF_TREE[name]: make(tree) for name, tree in self.split(params).items()}

  def sync(self, samplers: Mapping[str, Any], params: Params) -> None:
    """Points each tree's sampler at that tree's current arrays (`Sampler.params`' setter: no copy off a mesh in the
    master's dtype; a cast copy in the compute dtype otherwise)."""
    for name, tree in self.split(params).items():
      samplers[SAMPLER_OF_TREE[name]].params = tree

  def by_role(self, samplers: Mapping[str, Any]):
    """What a rollout samples the policy with (``rehearsal.unfold``'s ``sampler``): the one sampler, or a mapping
    Role -> sampler."""
    if not self.separate:
      return samplers["policy"]
    return {role: samplers[SAMPLER_OF_TREE[self.tree_of(role)]] for role in (Role.ACT, Role.REHEARSE, Role.USER)}

  def logprobs(self, model_config, params: Params, batch: TrainBatch) -> np.ndarray:
    """float32[K, M, T] logprobs of ``batch``'s trained tokens, each micro-batch under the tree of its rows' role
    (``batch.row_role``; a separate policy's micro-batches hold one role each), in ``batch.old_logprobs``' layout."""
    trees = self.split(params)
    if not self.separate:
      return np.asarray(recompute_logprobs(model_config, trees["policy"], batch))
    by_tree = {name: np.asarray(recompute_logprobs(model_config, tree, batch)) for name, tree in trees.items()}
    act = (np.asarray(batch.row_role) == int(Role.ACT))[..., None]
    return np.where(act, by_tree["act"], by_tree["rehearse"])
