"""BFCL v4 multi-turn: python -m envace_jax.main --config=configs/bfcl.py:multi_turn_miss_func --workdir=DIR

The argument is the category: "multi_turn_base" (default), "multi_turn_miss_func", "multi_turn_miss_param" or
"multi_turn_long_context". User turns are logged in the data (no user simulator); tools run in BFCL's own backends.

BFCL ships only a test split, so this config is for evaluation (and for smoke-testing the training loop); the paper
trains on checklist-format data (configs/checklist.py) and evaluates here.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

_spec = importlib.util.spec_from_file_location("envace_configs_base", pathlib.Path(__file__).with_name("base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """BFCL on the category ``arg`` (default "multi_turn_base"); an unknown category is reported by config_check."""
  arg, presets = base.presets.split(arg)
  c = base.get_config()
  c.env.benchmark = "bfcl"
  c.env.domain = arg or "multi_turn_base"
  c.env.split = "test"  # the only split
  c.env.eval_split = "test"
  c.rollout.user_capacity = 1024  # unused: user turns come from the data
  return base.presets.apply(c, presets)
