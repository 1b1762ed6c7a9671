"""policy.Policy: which parameter tree samples and trains each role, for the shared policy and the per-role ablation."""

from __future__ import annotations

import types

import numpy as np
import pytest

from envace_jax import policy as policy_lib
from envace_jax.model.roles import Role
from tests.test_train import tiny_config


class _Sampler:
  def __init__(self, params):
    self.params = params


@pytest.mark.parametrize("mode", ["envace", "grpo_real_env", "per_role"])
def test_trees_samplers_sync_and_roles(mode, tmp_path):
  policy = policy_lib.Policy.from_config(tiny_config(tmp_path, **{"grpo.mode": mode}))
  separate = mode == "per_role"
  assert policy.separate == separate
  assert policy.trees == (("act", "rehearse") if separate else ("policy",))
  assert policy.sampler_names == (("policy", "rehearse") if separate else ("policy",))
  base = object()
  params = policy.initial(base)
  assert params == ({"act": base, "rehearse": base} if separate else base)

  trees = {"act": "A", "rehearse": "R"} if separate else "P"
  samplers = policy.samplers(trees, _Sampler)
  assert {k: s.params for k, s in samplers.items()} == (
    {"policy": "A", "rehearse": "R"} if separate else {"policy": "P"}
  )
  policy.sync(samplers, {"act": "A2", "rehearse": "R2"} if separate else "P2")
  assert [s.params for s in samplers.values()] == (["A2", "R2"] if separate else ["P2"])

  by_role = policy.by_role(samplers)
  if separate:  # the ACT tree plays a policy user
    assert by_role == {Role.ACT: samplers["policy"], Role.REHEARSE: samplers["rehearse"], Role.USER: samplers["policy"]}
    assert [policy.tree_of(r) for r in (Role.ACT, Role.REHEARSE, Role.USER)] == ["act", "rehearse", "act"]
  else:
    assert by_role is samplers["policy"]
    assert {policy.tree_of(r) for r in Role} == {"policy"}


def test_logprobs_take_each_micro_batch_from_its_roles_tree(monkeypatch):
  """A micro-batch of ACT rows reads the ACT tree's logprobs, one of REHEARSE rows the REHEARSE tree's."""
  k, m, t = 2, 3, 4
  batch = types.SimpleNamespace(row_role=np.array([[int(Role.ACT)] * m, [int(Role.REHEARSE)] * m]))
  value = {"A": 1.0, "R": 2.0, "P": 3.0}
  monkeypatch.setattr(policy_lib, "recompute_logprobs", lambda _, tree, b: np.full((k, m, t), value[tree]))
  separate = policy_lib.Policy(separate=True).logprobs(None, {"act": "A", "rehearse": "R"}, batch)
  np.testing.assert_array_equal(separate, np.stack([np.full((m, t), 1.0), np.full((m, t), 2.0)]))
  np.testing.assert_array_equal(policy_lib.Policy(separate=False).logprobs(None, "P", batch), np.full((k, m, t), 3.0))
