"""envs/registry.py: one entry per benchmark, the same set as the prepared datasets, and each entry's entry points
reaching its own adapter."""

from __future__ import annotations

import pytest

from envace_jax.envs import datasets, registry
from envace_jax.envs.base import EnvError, Task
from envace_jax.rl import rewards


def test_the_registry_and_the_dataset_builders_name_the_same_benchmarks():
  assert list(registry.BENCHMARKS) == list(datasets._BUILDERS)
  for name, bench in registry.BENCHMARKS.items():
    assert bench.name == name and bench.adapter().BENCHMARK == name
  with pytest.raises(EnvError, match=r"unknown benchmark 'gsm8k'; choose one of \['tau2', 'bfcl'"):
    registry.get("gsm8k")


def test_domains_splits_and_dataset_configs():
  tau2 = registry.get("tau2")
  assert tau2.domains() == ("mock", "airline", "retail")
  assert tau2.splits("airline") == ("train", "test") and tau2.splits("mock") == ("base",)
  with pytest.raises(EnvError, match="'telecom' is not a τ² domain"):
    tau2.splits("telecom")
  assert tau2.source_config("retail", "") == "retail"
  assert registry.get("bfcl").splits("multi_turn_base") == ("test",)
  assert registry.get("checklist").domains() == () and registry.get("checklist").splits("x") is None
  assert registry.get("checklist").source_config("d", "/data/x.jsonl") == "/data/x.jsonl"
  finmcp = registry.get("finmcp")
  assert finmcp.domains() == ("all", "single_tool", "multi_tool", "multi_turn") and finmcp.splits("all") == ("test",)
  assert finmcp.source_config("all", "/data/fin") == "all:/data/fin"


def test_environments_and_conversations_come_from_each_adapter():
  task = Task("t", "checklist", "d", "train", "s", tools=(), user_turns=("hi",))
  env = registry.get("checklist").make_env(task, rule_checklist=rewards.rule_checklist)
  assert type(env).__name__ == "ChecklistEnv" and env._scorer is rewards.rule_checklist
  assert registry.get("tau2").make_env(Task("t", "tau2", "mock", "base", "", ())).domain == "mock"
  assert registry.initial_conversation(task) == ()
  assert registry.initial_conversation(Task("t", "not-registered", "d", "train", "", ())) == ()
  with pytest.raises(EnvError, match=r"supports tau2, bfcl, testbed \(set train.sft_warmup_steps=0\)"):
    registry.get("checklist").reference_conversation(task, env)
