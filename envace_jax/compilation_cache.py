"""JAX's persistent compilation cache, on by default: a run loads the programs an earlier run compiled.

The main job compiles about 135 programs (samplers per prompt chunk and cache shape, the update per micro-batch shape,
eager operations at new shapes: the testbed's, 2026-12-06); a second run on the same machine, an evaluation of a
finished run, the next cell of an experiment and every test worker would compile the same programs again. JAX's own
cache (``jax_compilation_cache_dir``; it caches CPU executables too) keys each program by its HLO, the compile options,
the backend and the jax/jaxlib versions, so a stale entry is never loaded.

Where: ``$ENVACE_JAX_COMPILATION_CACHE`` when set ("off" turns the cache off), else
``$XDG_CACHE_HOME/envace_jax/jax`` (``~/.cache/envace_jax/jax``). A ``JAX_COMPILATION_CACHE_DIR`` the user set for JAX
itself is kept. One folder is shared by every process of the user (test workers, multi-process runs, a notebook's
kernel): each program is its own file, named by its key; `enable` bounds the folder at `MAX_SIZE_BYTES`. CI starts
from a cold cache (``.ci/run`` sets ``XDG_CACHE_HOME`` to an empty folder). Used by ``python -m envace_jax.main``,
``python -m envace_jax.serve``, the experiment scripts (``experiments/common.py``) and the test suite
(``tests/conftest.py``).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Hashable
from typing import Any

import jax

ENV_VAR = "ENVACE_JAX_COMPILATION_CACHE"
_OFF = ("off", "none", "0", "false")
# Programs that compile faster than this are not written. Every program is: on a small testbed job, a threshold of
# 0.2 s left 300 quick programs out of the cache, and the second run spent 17% of the first run's compile seconds
# against 14% with none (the τ² job's cache: 280 files, 37 MB; docs/performance.md).
MIN_COMPILE_SECONDS = 0.0
# `enable` deletes the least recently used files beyond this. JAX's own bound (jax_compilation_cache_max_size) is not
# used: it keeps an "-atime" file per entry and, once one entry lacks it (written by a process with no bound: a
# subprocess that only has JAX_COMPILATION_CACHE_DIR), every later write of a bounded process fails with a warning.
MAX_SIZE_BYTES = 8 << 30


def default_directory() -> str:
  """``$XDG_CACHE_HOME/envace_jax/jax``, or ``~/.cache/envace_jax/jax`` without XDG_CACHE_HOME."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "envace_jax", "jax")


def directory() -> str | None:
  """The cache folder a run uses (module docstring); None when the cache is off."""
  value = os.environ.get(ENV_VAR)
  if value is not None:
    return None if value.strip().lower() in _OFF or not value.strip() else os.path.expanduser(value)
  return jax.config.jax_compilation_cache_dir or default_directory()


def enable(min_compile_seconds: float = MIN_COMPILE_SECONDS) -> str | None:
  """Turns the persistent cache on in ``directory()`` for this process (before its first compile).

  Returns:
    The folder, or None when ``ENVACE_JAX_COMPILATION_CACHE=off``.
  Raises:
    OSError: the folder cannot be created (say another one with ``ENVACE_JAX_COMPILATION_CACHE=DIR``).
  """
  folder = directory()
  if folder is None:
    return None
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise OSError(f"cannot create the compilation cache {folder!r} ({e}); set {ENV_VAR}=DIR or {ENV_VAR}=off") from e
  settings = {
    "jax_compilation_cache_dir": folder,
    "jax_persistent_cache_min_compile_time_secs": min_compile_seconds,
    "jax_persistent_cache_min_entry_size_bytes": 0,
    "jax_compilation_cache_max_size": -1,  # unbounded for JAX; `prune` bounds it
  }
  for name, value in settings.items():
    jax.config.update(name, value)
  prune(folder)
  return folder


def prune(folder: str, max_bytes: int = MAX_SIZE_BYTES) -> int:
  """Deletes ``folder``'s least recently used files (by the later of access and modification time) until the rest
  take at most ``max_bytes``. A file another process deletes or is reading meanwhile is skipped (a reader that loses
  its file compiles the program again).

  Returns:
    The bytes deleted.
  """
  entries = []
  with os.scandir(folder) as it:
    for entry in it:
      try:
        st = entry.stat(follow_symlinks=False)
      except OSError:
        continue
      if entry.is_file(follow_symlinks=False):
        entries.append((max(st.st_atime, st.st_mtime), st.st_size, entry.path))
  total, freed = sum(size for _, size, _ in entries), 0
  for _, size, path in sorted(entries):
    if total - freed <= max_bytes:
      break
    try:
      os.remove(path)
    except OSError:
      continue
    freed += size
  return freed


class SharedPrograms:
  """Jitted programs shared within a process, keyed by everything their traces read besides their arguments (a
  sampler's settings, an update step's): a second sampler or update step with the same signature traces, lowers and
  loads nothing again. Least recently made signatures beyond ``size`` are dropped (whoever holds their programs keeps
  them). Used by `sampling.sampler.Sampler` and `rl.grpo.make_update_step`; `forget_all` empties every registry."""

  _registries: list[SharedPrograms] = []

  def __init__(self, size: int = 4):
    self.size = size
    self._items: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    SharedPrograms._registries.append(self)

  def get(self, signature: Hashable | None, make: Callable[[], Any]) -> Any:
    """The programs made for ``signature`` before, else ``make()`` kept for it; with ``signature`` None or one that
    does not hash (e.g. rules given as lists), ``make()`` unshared."""
    if signature is None:
      return make()
    try:
      found = self._items.get(signature)
    except TypeError:
      return make()
    if found is None:
      found = self._items[signature] = make()
      while len(self._items) > self.size:
        self._items.popitem(last=False)
    else:
      self._items.move_to_end(signature)
    return found

  @classmethod
  def forget_all(cls) -> None:
    for registry in cls._registries:
      registry._items.clear()
