"""A random tiny model for CPU tests and smoke runs: python -m envace_jax.main --config=configs/tiny.py --mode=demo"""

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
  c = base.get_config(arg)
  c.model = "tiny"
  c.sampler.capacity = 256
  c.sampler.max_new_tokens = 16
  return c
