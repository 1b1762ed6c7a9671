"""The defaults every config here starts from: ``envace_jax.config.defaults`` (each key's meaning, default, and the
paper's value beside it). The benchmark configs beside this file load it by path and override what differs.

Run: python -m envace_jax.main --config=configs/base.py --mode=demo

Every config here takes presets after its argument, ``configs/tau2.py:retail+official``, or as its argument,
``configs/checklist.py:official`` (envace_jax/config/presets.py): ``official`` sets the official implementation's
semantics, ``paper`` adds the paper's sizes (docs/departures.md).
"""

import ml_collections

from envace_jax.config import defaults, presets

__all__ = ["get_config", "presets"]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """``defaults.get_config()`` with the presets ``arg`` names (``official``, ``paper``, joined by ``+``)."""
  return presets.apply(defaults.get_config(), presets.only(arg))
