"""What the experiment scripts share: a config per (model, domain, seed), ``--config.KEY=VALUE`` overrides, per-cell
JSON results, mean ± std.

Imported by ``experiments/evidence.py`` and ``experiments/learning_check.py``, which put the repository root on
``sys.path`` first, so both ``python experiments/X.py`` and ``python -m experiments.X`` work.

Models:
  ``tiny``     the random tiny preset (configs/tiny.py): 1024-token context, so only τ² mock fits (airline's and
               retail's system prompts are ≈5k tokens). Its numbers check the plumbing, not the method.
  ``smollm2``  SmolLM2-135M-Instruct (configs/tau2.py:DOMAIN), the CPU model with real weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import flags
from ml_collections import config_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = str(pathlib.Path(tempfile.gettempdir()) / "envace_tfds")


def config_file(name: str, arg: str | None = None):
  """``configs/<name>.py``'s ``get_config(arg)`` (loaded by path: ``configs`` is not a package)."""
  spec = importlib.util.spec_from_file_location(f"envace_configs_{name}", ROOT / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def check_domains(model: str, domains: Sequence[str]) -> None:
  """Raises ValueError for a domain the model cannot run (the tiny model holds only τ² mock)."""
  if model == "tiny" and set(domains) != {"mock"}:
    raise ValueError(
      f"--model=tiny runs only --domains=mock: its 1024-token context cannot hold the ≈5k-token system prompts of "
      f"{', '.join(d for d in domains if d != 'mock')}; use --model=smollm2 there"
    )


def make_config(model: str, domain: str, seed: int, data_dir: str):
  """The run config of ``model`` on τ² ``domain`` with ``seed``."""
  if model == "tiny":
    check_domains(model, [domain])
    c = config_file("tiny")
  else:
    c = config_file("tau2", domain)
  c.seed = seed
  c.env.data_dir = data_dir
  return c


def split_overrides(extra: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
  """``--config.KEY=VALUE`` arguments (as ``python -m envace_jax.main`` takes them) as (KEY, VALUE) pairs, and
  whatever else was left."""
  overrides, rest = [], []
  for arg in extra:
    if arg.startswith("--config.") and "=" in arg:
      key, value = arg[len("--config.") :].split("=", 1)
      overrides.append((key, value))
    else:
      rest.append(arg)
  return overrides, rest


def apply_flags(config, overrides: Sequence[tuple[str, str]]):
  """``config`` with (KEY, TEXT) overrides parsed as ``python -m envace_jax.main --config.KEY=TEXT`` parses them
  (ml_collections' ``config_flags``: each field's type; a tuple field takes the text as one item, which the config
  check splits at commas). Changes ``config`` in place and returns it.

  Raises:
    ValueError: an unknown key, or a value that does not convert (the message names the key).
  """
  argv = ["experiment", *(f"--config.{k}={v}" for k, v in overrides)]
  flag_values = flags.FlagValues()
  try:
    config_flags.DEFINE_config_dict("config", config, flag_values=flag_values, lock_config=False, sys_argv=argv)
    flag_values(argv)
  except (AttributeError, KeyError) as e:
    raise ValueError(f"no config field for an override in {argv[1:]}: {e}") from None
  except flags.Error as e:
    raise ValueError(str(e)) from None
  return flag_values.config


# The paper's method and its two ablations as config overrides (each goes through the same training loop).
TRAINING_MODES: dict[str, dict[str, Any]] = {
  "envace": {"grpo.mode": "envace"},
  "grpo_real_env": {"grpo.mode": "grpo_real_env", "rollout.env_mode": "real", "grpo.trained_roles": ("act",)},
  "per_role": {"grpo.mode": "per_role"},
}


def apply_overrides(config, overrides: Mapping[str, Any]) -> None:
  """Sets ``config.<KEY>`` to each Python value of ``overrides`` (dotted keys; values already typed).

  Raises:
    KeyError: a key the config does not have.
  """
  flat = set(_flat_keys(config))
  unknown = [k for k in overrides if k not in flat]
  if unknown:
    raise KeyError(f"no config field {unknown[0]!r}")
  config.update_from_flattened_dict(dict(overrides))


def _flat_keys(node, prefix: str = ""):
  for key, value in node.items():
    if hasattr(value, "items"):
      yield from _flat_keys(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


def parse_ints(text: str) -> list[int]:
  return [int(s) for s in text.split(",") if s.strip()]


def parse_names(text: str) -> list[str]:
  return [s.strip() for s in text.split(",") if s.strip()]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof 1) of the finite ``values``: (nan, nan) if none, (value, nan) for one
  (a single seed has no spread to report)."""
  v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
  if not len(v):
    return float("nan"), float("nan")
  return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else float("nan")


def pm(mean: float, std: float, scale: float = 100.0, digits: int = 1) -> str:
  """``mean ± std`` (scaled: pass^1 as a percentage); the mean alone for a nan std (one value), "-" for a nan mean."""
  if not np.isfinite(mean):
    return "-"
  if not np.isfinite(std):
    return f"{mean * scale:.{digits}f}"
  return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


def read_json(path: str | os.PathLike) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_json(path: str | os.PathLike, data: Any) -> None:
  """Writes ``data`` atomically (a temporary file renamed), so a killed run never leaves a half-written result."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(data, indent=2, default=float), encoding="utf-8")
  os.replace(tmp, path)


def budget_mismatch(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
  """The keys where a saved cell's budget differs from this run's (a stale cell must not be reused silently)."""
  return [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in wanted.items() if saved.get(k) != v]


def use_compilation_cache(directory: str | None = None) -> None:
  """JAX's persistent compilation cache (envace_jax/compilation_cache.py): the user's shared folder when
  ``directory`` is None, ``directory`` when given, off when "none". Every cell builds fresh samplers and update steps
  with the same shapes, so later cells (and reruns) load the compiled programs. Process-wide and set once: tests pass
  "none"."""
  if directory is not None and directory.lower() == "none":
    return
  from envace_jax import compilation_cache

  if directory is not None:
    os.environ[compilation_cache.ENV_VAR] = directory
  compilation_cache.enable()


def quiet_libraries() -> None:
  """The experiment scripts' output without τ²'s DEBUG log of every tool response (loguru; its warnings and errors
  stay) and TFDS's progress bars, as ``python -m envace_jax.main`` prints by default (envace_jax/console.py)."""
  import tensorflow_datasets as tfds

  tfds.disable_progress_bar()
  try:
    from loguru import logger
  except ImportError:  # no τ² installed
    return
  logger.remove()
  logger.add(sys.stderr, level="WARNING")
