"""A random tiny model for CPU tests and smoke runs: python -m envace_jax.main --config=configs/tiny.py --mode=demo"""

from __future__ import annotations

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config(arg)
  c.model = "tiny"
  c.sampler.capacity = 256
  c.sampler.max_new_tokens = 16
  return c
