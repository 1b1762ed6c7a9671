"""A random tiny model with SmolLM2's tokenizer on τ² mock, for CPU tests and smoke runs.

  python -m envace_jax.main --config=configs/tiny.py --workdir=DIR
  python -m envace_jax.main --config=configs/tiny.py --mode=demo      (the demo samples random ids: no tokenizer)

The ``tiny`` preset (2 layers, d_model 64, 1024-token context) with the vocab_size of SmolLM2's tokenizer, so chats
render and tool calls parse as with the real model; two steps of 1 task × 2 rollouts with 16-token generations.
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
  presets = base.presets.only(arg)  # tiny takes no argument of its own
  c = base.get_config()
  c.model = "tiny"
  c.tokenizer = "smollm2-135m"
  c.sampler.capacity = 512  # the demo prompt with its tool schema is 246 SmolLM2 tokens
  c.sampler.max_new_tokens = 16
  c.env.benchmark = "tau2"
  c.env.domain = "mock"
  c.env.split = "base"
  c.env.eval_split = "base"
  c.train.steps = 2
  c.train.eval_tasks = 2
  c.rollout.max_turns = 2
  c.rollout.grounding_max_tokens = 256
  for role, capacity in (("act", 1024), ("rehearse", 1024), ("user", 512)):  # the tiny preset's context is 1024
    c.rollout[f"{role}_capacity"] = capacity
    c.rollout[f"{role}_max_new_tokens"] = 16
  # Test-time rehearsal sized for the 1024-token context: the mock policy is ≈0.5k tokens.
  c.eval.tasks = 1
  c.eval.rehearsal_n = 2
  c.eval.assessment_max_tokens = 16
  c.eval.memory_max_tokens = 16
  c.eval.digest_max_tokens = 64
  return base.presets.apply(c, presets)
