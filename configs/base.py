"""The defaults every config here starts from: ``envace_jax.config.defaults`` (each key's meaning, default, and the
paper's value beside it). The benchmark configs beside this file load it by path and override what differs.

Run: python -m envace_jax.main --config=configs/base.py --mode=demo

Every config here takes presets after its argument, ``configs/tau2.py:retail+official`` or ``configs/checklist.py:official``
(envace_jax/config/presets.py): ``official`` sets the official implementation's semantics (docs/departures.md).
"""

from envace_jax.config import presets
from envace_jax.config.defaults import get_config

__all__ = ["get_config", "presets"]
