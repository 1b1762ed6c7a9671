"""τ²-bench training: python -m envace_jax.main --config=configs/tau2.py:retail --workdir=DIR

The argument is the domain: "airline" (default), "retail" or "mock". Telecom does not fit SmolLM2's context and is not
supported by the τ² adapter (score it with tau2's own orchestrator).

The defaults (base.py) train SmolLM2-135M on 2 CPU cores in well under 30 minutes: 3 steps of 1 task × 2 rollouts,
at most 4 agent turns of ≤ 96 tokens. Airline and retail system prompts are ≈ 5k SmolLM2 tokens, so the ACT view
takes the whole 8192-token context. Paper-size run (Qwen3-8B on accelerators):
  --config.model=qwen3-8b --config.model_path=/path/to/Qwen3-8B --config.dtype=bfloat16
  --config.train.tasks_per_step=16 --config.train.group_size=4 --config.grpo.learning_rate=1e-6
  --config.rollout.act_capacity=32768 --config.rollout.act_max_new_tokens=8192 (likewise rehearse_ / user_)
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

# Load base.py beside this file by path, so the config works from any working directory (config_flags loads
# files by path; `configs` is not an installed package).
_spec = importlib.util.spec_from_file_location("envace_configs_base", pathlib.Path(__file__).with_name("base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """τ² training on the domain ``arg`` (default "airline"); an unknown domain is reported by config_check."""
  c = base.get_config()
  c.env.benchmark = "tau2"
  c.env.domain = arg or "airline"
  if c.env.domain == "mock":
    # The mock domain has one split, "base" (9 tasks), and a ≈0.5k-token system prompt.
    c.env.split = "base"
    c.env.eval_split = "base"
    c.rollout.act_capacity = 2048
    c.rollout.rehearse_capacity = 2048
    c.rollout.user_capacity = 1024
  return c
