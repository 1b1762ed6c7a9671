"""--mode=plan: per-device memory from the compiled programs, checked against the cache and parameter formulas."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from envace_jax import config_check, plan, runtime
from envace_jax.model import config as model_config
from envace_jax.model import transformer
from envace_jax.rl import batch as batch_lib
from envace_jax.rl import grpo
from tests.rl.test_grpo import ACT, REHEARSE, make_row
from tests.test_train import ROOT, TESTBED, tiny_config

MIB = 1024**2


def _parts(result):
  return {p.name: p for p in result["parts"]}


def _in_phase(result, phase):
  return {p.name: p for p in result["parts"] if p.phase == phase}


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
  # Two moments laid out like the params, AdamW's count and the state's step.
  assert parts["train state: AdamW moments"].bytes == 2 * state + 8
  # The samplers read the train state's arrays and the reference user's sampler the reference: no other copy.
  assert parts["reference (the initial weights)"].bytes == state
  assert not [name for name in parts if name.startswith("sampler copy")]
  assert parts["sampler temporaries"].bytes == max(
    result["programs"]["prefill (policy)"]["temp"], result["programs"]["decode (policy)"]["temp"]
  )
  # The update as make_update_step runs it: 16 rows in micro-batches of 8, so the first micro-batch's gradient is
  # held while the second's is computed; both are sharded like the parameters (plus the replicated sums).
  micro = _in_phase(result, "update: micro-batch")
  assert micro["micro-batch temporaries"].bytes == result["programs"]["update: micro-batch gradient"]["temp"] > 0
  assert micro["gradient accumulator"].bytes == micro["micro-batch gradient"].bytes
  assert state <= micro["micro-batch gradient"].bytes < state + 4096
  assert _in_phase(result, "update: apply")["apply temporaries"].bytes == result["programs"]["update: apply"]["temp"]
  persistent = sum(p.bytes for p in result["parts"] if p.phase == "persistent")
  phase = lambda name: sum(p.bytes for p in result["parts"] if p.phase == name)  # noqa: E731
  assert set(result["phases"]) == set(plan.PHASES)
  assert result["peak_bytes"] == persistent + max(phase(name) for name in plan.PHASES)
  assert result["device_bytes"] == 10**9 and result["fits"] is True
  small = plan.with_memory(result, device_memory_gb=result["peak_bytes"] / 2e9)  # the same plan, half the memory
  assert small["fits"] is False and "does NOT fit (200% of it)" in plan.format_plan(small)


def test_plan_with_shared_openings_for_a_gpu(data_dir, monkeypatch):
  """``opening_tokens`` = 100: each cache is a prefix level of one row per (view, task), 128 slots (100 rounded up
  to a power of two, as `Sampler.fork` cuts it), and the rollouts' rows own the capacity less 100. The
  policy's 8 opening rows split over the 8 batch shards; the reference user's 4 do not, so each device holds them
  whole. Planned for a GPU with bf16 compute over fp32 master weights: the samplers read a bf16 copy, the
  reference is bf16, cuDNN trains (the attention record) and its [M, 1, T, T] bias and gradient are counted, and
  the usable memory is the pool's fraction of the device."""
  config = tiny_config(data_dir, dtype="bfloat16", **{"train.tasks_per_step": 4, "grpo.micro_batch_size": 8,
                                                      "mesh.data": 1, "mesh.fsdp": 8})  # fmt: skip
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  result = plan.plan(config, device_memory_gb=1.0, opening_tokens=100, backend="gpu")
  parts = _parts(result)
  mc = model_config.get_model_config("tiny")
  slot = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2  # bfloat16
  own, user = config.rollout.act_capacity - 100, config.rollout.user_capacity - 100
  assert parts["KV cache: policy"].bytes == (slot * own + 4) * 16 // 8 + (slot * 128 + 4) * 8 // 8
  assert parts["KV cache: reference user"].bytes == (slot * user + 4) * 8 // 8 + (slot * 128 + 4) * 4
  state = parts["train state: parameters"].bytes
  assert parts["sampler copy: policy"].bytes == parts["reference (the initial weights)"].bytes == state // 2
  t = result["batch"]["micro_batch_tokens"]
  assert parts["cuDNN attention bias and its gradient"].bytes == 2 * (8 // 8) * t * t * 2
  assert result["attention"]["gpu"]["update: micro-batch gradient"] == ["cudnn (train)"]
  assert result["attention"]["cpu"]["update: micro-batch gradient"] == ["reference (train)"]
  assert "prefix level" in result["attention"]["gpu"]["decode (policy)"][0]
  assert result["device_bytes"] == 5 * 10**8 and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5" in result["device_source"]
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
  # The testbed's user turns are logged: no reference user and, without the KL term, no reference
  # (`runtime.holds_reference`).
  logged = _parts(plan.plan(tiny_config(data_dir, **TESTBED)))
  assert set(parts) - set(logged) == {"KV cache: reference user", "reference (the initial weights)"}
  assert logged["KV cache: policy"] == parts["KV cache: policy"]


def _live_bytes():
  return sum(x.nbytes for x in jax.live_arrays())


def test_the_plan_matches_a_real_update(data_dir):
  """A real update (`grpo.make_update_step` on real arrays, one device, K = 2 micro-batches of the plan's 1 row ×
  256 tokens): the bytes it holds while a micro-batch's gradient is out (measured: ``jax.live_arrays`` after each
  micro-batch program, over what was live before), plus the micro-batch's rows and the compiled program's
  temporaries (``memory_analysis`` of the program the step ran), agree with the plan's train state plus its
  micro-batch phase within 10%; the train state's bytes exactly."""
  caps = {"rollout.act_capacity": 256, "rollout.rehearse_capacity": 256, "rollout.user_capacity": 128,
          "rollout.grounding_max_tokens": 64}  # fmt: skip
  config = tiny_config(data_dir, **caps)
  result = plan.plan(config)
  m, t = result["batch"]["micro_batch"], result["batch"]["micro_batch_tokens"]
  assert (m, t) == (1, 256)
  parts = _parts(result)
  mc = model_config.get_model_config("tiny", dtype=config.dtype).replace(param_dtype=config.param_dtype)
  gcfg = grpo.GrpoConfig.from_config(config)
  rng = np.random.default_rng(0)
  rows = [make_row(rng, t, 8, ACT, old_noise=1.0), make_row(rng, t, 8, REHEARSE, old_noise=1.0)]
  batch = batch_lib.collate(rows, [1.0, -1.0], trained_roles=gcfg.trained_roles, length_bucket=gcfg.length_bucket)
  batch = batch_lib.split_micro_batches(batch, m)
  gc.collect()
  before = _live_bytes()
  params = transformer.init_params(mc.replace(scan_layers=False), jax.random.key(0))
  state = jax.device_put(grpo.init_train_state(gcfg, params), jax.devices()[0])
  del params
  state_bytes = _live_bytes() - before
  assert state_bytes == parts["train state: parameters"].bytes + parts["train state: AdamW moments"].bytes
  step = grpo.make_update_step(mc, gcfg)
  micro, held = step.programs["micro"], []

  def measured(params, mb):
    out = jax.block_until_ready(micro(params, mb))
    held.append(_live_bytes() - before)
    return out

  step.programs["micro"] = measured
  state, _ = step(state, batch)
  assert step.compiled_shapes() == [(m, t, t)] and len(held) == 2  # the plan's shape, twice: an accumulator
  mb = batch_lib.trimmed(jax.tree.map(lambda x: x[0], batch), gcfg.length_bucket)
  compiled = micro.lower(state.params, mb).compile().memory_analysis()
  real = max(held) + sum(x.nbytes for x in jax.tree.leaves(mb)) + compiled.temp_size_in_bytes
  planned = state_bytes + result["phases"]["update: micro-batch"]
  assert abs(planned - real) <= 0.1 * real, (planned, real)
  assert parts["gradient accumulator"].bytes == parts["micro-batch gradient"].bytes > 0


def test_a_plan_needs_no_weights_on_disk(data_dir):
  """A preset without bundled weights is refused for a run but planned from its shapes alone."""
  config = tiny_config(data_dir, model="qwen3-8b", tokenizer="", dtype="bfloat16")
  with pytest.raises(config_check.ConfigError, match="preset without bundled weights"):
    config_check.validate(config)
  config_check.validate(config, weights=False)


@pytest.mark.slow
def test_plan_from_the_command_line(data_dir):
  args = [sys.executable, "-m", "envace_jax.main", f"--config={ROOT / 'configs' / 'tiny.py'}", "--mode=plan",
          f"--config.env.data_dir={data_dir}", "--device_memory_gb=0.5", "--plan_backend=gpu"]  # fmt: skip
  env = {k: v for k, v in os.environ.items() if "MEM_FRACTION" not in k and k != "XLA_PYTHON_CLIENT_ALLOCATOR"}
  out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True, env=env).stdout
  assert out.startswith("Memory plan per device: tiny on 8 × gpu devices") and "KV cache: policy" in out
  assert "device memory 0.35 GiB usable, 0.75 × 0.5 GB (JAX's default pool" in out  # JAX preallocates 75%
  assert "compiled for cpu" in out and "  gpu: prefill (policy): " in out
