"""The defaults every config here starts from: ``envace_jax.config.defaults`` (each key's meaning, default, and the
paper's value beside it). The benchmark configs beside this file load it by path and override what differs.

Run: python -m envace_jax.main --config=configs/base.py --mode=demo
"""

from envace_jax.config.defaults import get_config

__all__ = ["get_config"]
