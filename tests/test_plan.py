"""--mode=plan: per-device memory from the compiled programs, checked against the cache and parameter formulas."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest

from envace_jax import config_check, plan, runtime
from envace_jax.model import config as model_config
from envace_jax.model import transformer
from tests.test_train import ROOT, tiny_config

MIB = 1024**2


def _parts(result):
  return {p.name: p for p in result["parts"]}


def test_plan_on_the_mesh_matches_the_formulas(data_dir):
  """B=4 × G=2 on a data 1 × fsdp 8 mesh: the policy cache's 2 views × 8 rows and the reference user's 8 rows split
  over the 8 batch shards, the update's 8-row micro-batch too; each part is its formula, the peak their documented
  sum."""
  config = tiny_config(data_dir, **{"train.tasks_per_step": 4, "grpo.micro_batch_size": 8, "mesh.data": 1,
                                    "mesh.fsdp": 8})  # fmt: skip
  result = plan.plan(config, device_memory_gb=1.0)
  mc = model_config.get_model_config("tiny")
  devices = runtime.make_mesh(config).size
  assert devices == 8 and result["rows"] == 16 and result["capacity"] == config.rollout.act_capacity
  parts = _parts(result)
  slot = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4  # k and v, float32, per row and slot
  # Per device: its rows' keys and values, and their int32 lengths.
  assert parts["KV cache: policy"].bytes == (slot * config.rollout.act_capacity + 4) * 16 // devices
  assert parts["KV cache: reference user"].bytes == (slot * config.rollout.user_capacity + 4) * 8 // devices
  params = transformer.param_count(transformer.init_params(mc, jax.random.key(0))) * 4
  state = parts["train state: parameters"].bytes
  assert params // devices <= state < params  # sharded over fsdp where a dimension divides
  assert parts["train state: AdamW moments"].bytes == 2 * state + 4  # two moments laid out like the params, a count
  # The samplers read the train state's arrays and the reference user's sampler the reference: no other copy.
  assert parts["reference (the initial weights)"].bytes == state
  assert not [name for name in parts if name.startswith("sampler copy")]
  assert parts["sampler temporaries"].bytes == max(
    result["programs"]["prefill (policy)"]["temp"], result["programs"]["decode (policy)"]["temp"]
  )
  assert parts["update temporaries"].bytes == result["programs"]["update step"]["temp"] > 0
  persistent = sum(p.bytes for p in result["parts"] if p.phase == "persistent")
  phase = lambda name: sum(p.bytes for p in result["parts"] if p.phase == name)  # noqa: E731
  assert result["peak_bytes"] == persistent + max(phase("rollout"), phase("update"))
  assert result["device_bytes"] == 10**9 and result["fits"] is True
  small = plan.plan(config, device_memory_gb=result["peak_bytes"] / 2e9)
  assert small["fits"] is False and "does NOT fit (200% of it)" in plan.format_plan(small)


def test_plan_with_shared_openings(data_dir):
  """``opening_tokens`` = 100: each cache is a prefix level of one row per (view, task), 128 slots (100 rounded up
  to a power of two, as `Sampler.fork` cuts it), and the rollouts' rows own the capacity less 100. The
  policy's 8 opening rows split over the 8 batch shards; the reference user's 4 do not, so each device holds them
  whole."""
  config = tiny_config(data_dir, **{"train.tasks_per_step": 4, "grpo.micro_batch_size": 8, "mesh.data": 1,
                                    "mesh.fsdp": 8})  # fmt: skip
  parts = _parts(plan.plan(config, device_memory_gb=1.0, opening_tokens=100))
  mc = model_config.get_model_config("tiny")
  slot = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
  own, user = config.rollout.act_capacity - 100, config.rollout.user_capacity - 100
  assert parts["KV cache: policy"].bytes == (slot * own + 4) * 16 // 8 + (slot * 128 + 4) * 8 // 8
  assert parts["KV cache: reference user"].bytes == (slot * user + 4) * 8 // 8 + (slot * 128 + 4) * 4
  with pytest.raises(config_check.ConfigError, match="opening_tokens=100000"):
    plan.plan(config, opening_tokens=100000)


def test_plan_off_the_mesh_and_without_a_limit(data_dir):
  """B=1 × G=2 rows do not split over 8 shards: the sampler and its caches sit whole on one device (as
  runtime.make_sampler places them); a CPU reports no memory limit, so the verdict asks for one."""
  config = tiny_config(data_dir)
  result = plan.plan(config)
  mc = model_config.get_model_config("tiny")
  parts = _parts(result)
  slot = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
  assert result["rows"] == 4 and parts["KV cache: policy"].bytes == (slot * config.rollout.act_capacity + 4) * 4
  params = transformer.param_count(transformer.init_params(mc, jax.random.key(0))) * 4
  assert parts["reference (the initial weights)"].bytes == parts["train state: parameters"].bytes == params
  assert not [name for name in parts if name.startswith("sampler copy")]
  assert result["device_bytes"] is None and result["fits"] is None
  assert "pass --device_memory_gb=N to compare" in plan.format_plan(result)


def test_a_plan_needs_no_weights_on_disk(data_dir):
  """A preset without bundled weights is refused for a run but planned from its shapes alone."""
  config = tiny_config(data_dir, model="qwen3-8b", tokenizer="", dtype="bfloat16")
  with pytest.raises(config_check.ConfigError, match="preset without bundled weights"):
    config_check.validate(config)
  config_check.validate(config, weights=False)


@pytest.mark.slow
def test_plan_from_the_command_line(data_dir):
  args = [sys.executable, "-m", "envace_jax.main", f"--config={ROOT / 'configs' / 'tiny.py'}", "--mode=plan",
          f"--config.env.data_dir={data_dir}", "--device_memory_gb=0.5"]  # fmt: skip
  out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True).stdout
  assert out.startswith("Memory plan per device: tiny on 8 × cpu devices") and "KV cache: policy" in out
  assert "device memory 0.47 GiB: fits" in out
