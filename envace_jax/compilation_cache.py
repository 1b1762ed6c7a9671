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

JAX's cache saves XLA's compile, not the tracing and lowering that come before it. The samplers' and the update's
programs (`PersistentProgram`) are also kept as executables in ``<folder>/executables`` under a key made above the
HLO, so a later process runs them without tracing or lowering them. Deleting either folder is always safe.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import pickle
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

try:  # the settings a jit's own cache key holds; without it `PersistentProgram` is plain `jax.jit`
  from jax._src import config as jax_config

  jax_config.trace_context, jax_config.persistent_cache_min_compile_time_secs  # noqa: B018
except (ImportError, AttributeError):
  jax_config = None

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
  global _executables
  executables = os.path.join(folder, EXECUTABLES)
  os.makedirs(executables, exist_ok=True)
  _executables = executables if jax_config is not None else None
  prune(folder)
  return folder


def disable_executables() -> None:
  """Turns `PersistentProgram`'s files off for this process (JAX's cache stays on): every program traces again."""
  global _executables
  _executables = None


def prune(folder: str, max_bytes: int = MAX_SIZE_BYTES) -> int:
  """Deletes the least recently used files of ``folder`` and its ``executables`` subfolder (by the later of access
  and modification time) until the rest take at most ``max_bytes``. A file another process deletes or is reading
  meanwhile is skipped (a reader that loses its file compiles the program again).

  Returns:
    The bytes deleted.
  """
  entries = []
  for where in (folder, os.path.join(folder, EXECUTABLES)):
    try:
      listing = list(os.scandir(where))
    except OSError:  # no subfolder (yet)
      continue
    for entry in listing:
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


# ------------------------------------------------------------------------------------------------ executables
#
# JAX's cache above saves XLA's compile, not the trace and the lowering that make its key: a warm main job still
# traced and lowered every program, 13 s of its 36 s of compile seconds going to the 18 sampler and update programs
# (experiments/results/2026-12-06_compile_share.md). `PersistentProgram` keeps those programs' executables under a key
# made above the HLO, from what their traces read, so a later process with the same key loads them untraced.

EXECUTABLES = "executables"  # the subfolder of `directory()` that holds them
LOAD_EVENT = "/envace_jax/executable_cache/load"  # time span: an executable read back (runtime.CompileClock counts it)
SAVED_EVENT = "/envace_jax/executable_cache/compile_time_saved_sec"  # its trace, lowering and compile when written
_executables: str | None = None  # the folder, once `enable` turned the cache on
# XLA's CPU runtime serializes an executable that was itself read back from a file without its code ("Function ...
# not found" when the copy runs), so only a fresh compile is written: compiled with this option (its default value),
# a `PersistentProgram`'s executable is another entry of JAX's caches than the same program jitted elsewhere in the
# process, JAX's persistent cache does not write it (its file here does), and one that JAX's cache answered anyway
# (counted here) is not written.
_OWN_COMPILE = {"xla_embed_ir_in_executable": False}
_CHECK = 32  # bytes of a file's BLAKE2b checksum, before its pickle: a flipped byte loaded and ran wrong or crashed


def _debugging() -> bool:
  """``jax.disable_jit`` or NaN/Inf checking on: jit's own paths (re-running eagerly, the operation's own error)."""
  return bool(jax.config.jax_disable_jit or jax.config.jax_debug_nans or jax.config.jax_debug_infs)


JAX_CACHE_HITS = "/jax/compilation_cache/cache_hits"  # jax._src.compiler: a program read from JAX's persistent cache
_jax_cache_hits = [0]


def _count_jax_cache_hit(event: str, **_) -> None:
  if event == JAX_CACHE_HITS:
    _jax_cache_hits[0] += 1


jax.monitoring.register_event_listener(_count_jax_cache_hit)


class _Unstable(TypeError):
  """A value whose text would not name it the same way in another process (an object shown by its address)."""


def _stable(obj: Any) -> str:
  """Text that names ``obj`` the same way in every process: for None, bools, numbers, strings, bytes, containers of
  them, dataclasses (their fields), enums, types and functions by their module and name, NumPy dtypes and small
  arrays, meshes, shardings and partition specs.

  Raises:
    _Unstable: anything else (its text could omit what a trace reads).
  """
  if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
    return f"{type(obj).__name__}:{obj!r}"
  if isinstance(obj, tuple | list | frozenset | set):
    items = sorted(map(_stable, obj)) if isinstance(obj, frozenset | set) else [_stable(x) for x in obj]
    return f"{type(obj).__name__}({', '.join(items)})"
  if isinstance(obj, collections.abc.Mapping):
    return "{" + ", ".join(sorted(f"{_stable(k)}: {_stable(v)}" for k, v in obj.items())) + "}"
  if isinstance(obj, enum.Enum):
    return f"{type(obj).__module__}.{type(obj).__qualname__}.{obj.name}"
  if isinstance(obj, type) or (inspect.isfunction(obj) and obj.__closure__ is None and "<" not in obj.__qualname__):
    return f"{obj.__module__}.{obj.__qualname__}"
  if dataclasses.is_dataclass(obj):
    fields = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return f"{_stable(type(obj))}({', '.join(f'{k}={_stable(v)}' for k, v in fields)})"
  if isinstance(obj, np.dtype):
    return f"dtype:{obj.str}:{obj.name}"
  if isinstance(obj, np.generic | np.ndarray) and np.size(obj) <= 1024:
    return f"ndarray:{np.dtype(obj.dtype).name}:{np.shape(obj)}:{np.asarray(obj).tolist()!r}"
  if isinstance(obj, jax.sharding.Mesh):
    parts = (obj.devices.shape, tuple(obj.axis_names), obj.device_ids.tolist(), tuple(obj.axis_types))
    return f"Mesh({', '.join(map(_stable, parts))})"
  if isinstance(obj, jax.sharding.PartitionSpec):
    return f"PartitionSpec{_stable(tuple(obj))}"
  if isinstance(obj, jax.sharding.NamedSharding):
    return f"NamedSharding({_stable(obj.mesh)}, {_stable(obj.spec)}, {_stable(obj.memory_kind)})"
  if isinstance(obj, jax.sharding.SingleDeviceSharding):
    (device,) = obj.device_set
    return f"SingleDeviceSharding({device.platform}:{device.id}, {_stable(obj.memory_kind)})"
  raise _Unstable(f"no stable text for a {type(obj).__qualname__}")


_KINDS: dict[type, str] = {}  # an argument leaf's type -> "array", "numpy", "python" or "other" (isinstance is slow)


def _kind(t: type) -> str:
  if t not in _KINDS:
    array = issubclass(t, jax.Array) and not issubclass(t, jax.core.Tracer)
    numpy = issubclass(t, np.ndarray | np.generic)
    _KINDS[t] = "array" if array else "numpy" if numpy else "python" if t in (bool, int, float, complex) else "other"
  return _KINDS[t]


def _leaf(x: Any) -> tuple:
  """What a compiled program depends on in one argument leaf: its abstract value (shape, dtype, weak type) and
  placement; for a NumPy array its shape and dtype; for a Python number its type. About 1 ms for SmolLM2's 274
  parameter arrays with the flattening.

  Raises:
    _Unstable: a tracer or any other kind of leaf (the caller then calls ``jax.jit`` as usual).
  """
  kind = _KINDS.get(type(x)) or _kind(type(x))
  if kind == "array":  # committed or not: whether jit pins the outputs to the inputs' devices
    return (x.aval, x.sharding, x.committed)
  if kind == "numpy":
    return ("numpy", x.shape, x.dtype)
  if kind == "python":
    return ("python", type(x))
  raise _Unstable(f"no executable for a {type(x).__qualname__} argument")


def _stable_leaf(leaf: tuple) -> str:
  if leaf[0] == "numpy":
    return f"numpy{leaf[1]}:{leaf[2]}"
  if leaf[0] == "python":
    return f"python:{leaf[1].__name__}"
  aval, placement, committed = leaf
  return f"array{aval.shape}:{aval.dtype}:{aval.weak_type}:{_stable(placement)}:{committed}"


def _stable_context(context: tuple) -> str:
  """JAX's trace context (the settings a jit's own cache key holds), each entry by `_stable`, an object shown by its
  address by its attributes instead (the axis environment)."""
  parts = []
  for item in context:
    try:
      parts.append(_stable(item))
    except _Unstable:
      slots = [
        n for c in type(item).__mro__ for n in getattr(c, "__slots__", ()) if n not in ("__weakref__", "__dict__")
      ]
      state = vars(item) if hasattr(item, "__dict__") else {n: getattr(item, n) for n in slots if hasattr(item, n)}
      parts.append(f"{type(item).__qualname__}{_stable(state)}")
  return ", ".join(parts)


@functools.cache
def _environment() -> str:
  """What a program's executable depends on besides its arguments, signature and `_settings`, fixed for a process:
  the package's own source, the installed jax, jaxlib, PJRT plugins, flax and numpy, XLA's flags, the Python version,
  the backend and its devices."""
  import envace_jax

  digest = hashlib.sha256()
  root = os.path.dirname(os.path.abspath(envace_jax.__file__))
  for folder, subfolders, files in os.walk(root):
    subfolders.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(folder, name)
      digest.update(os.path.relpath(path, root).encode() + b"\0")
      with open(path, "rb") as f:
        digest.update(f.read() + b"\0")
  prefixes = ("jax", "libtpu", "flax", "numpy", "ml-dtypes", "ml_dtypes", "nvidia-")
  versions = sorted({(d.metadata["Name"] or "").lower(): d.version for d in importlib.metadata.distributions()}.items())
  versions = [(n, v) for n, v in versions if n.startswith(prefixes)]
  backend = jax.devices()[0].client
  devices = [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]
  flags = [(k, os.environ.get(k)) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_PLATFORMS")]
  extra = (versions, backend.platform, backend.platform_version, devices, flags, sys.version)
  digest.update(repr(extra).encode())
  return digest.hexdigest()


def _settings() -> str:
  """JAX's settings now, less where caches and logs go (read at every new key: a setting changed mid-process, e.g.
  ``jax_default_prng_impl``, is another key)."""
  return repr(sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k and "log" not in k))


def read_executable(blob: bytes) -> tuple[Any, float]:
  """The executable in one file of the executables folder (`PersistentProgram` writes them: a BLAKE2b checksum of
  ``_CHECK`` bytes, then the pickle), loaded onto the devices it was compiled for, and the seconds its trace, lowering
  and compile took when written.

  Raises:
    ValueError: the checksum does not match (a damaged file); whatever unpickling or XLA's deserialization raises for
      a truncated file or one written by another jaxlib.
  """
  from jax.experimental import serialize_executable

  check, body = blob[:_CHECK], memoryview(blob)[_CHECK:]  # the body read in place, not copied
  if hashlib.blake2b(body, digest_size=_CHECK).digest() != check:  # damage the unpickler would not see
    raise ValueError("its checksum does not match")
  seconds, ids, payload, in_tree, out_tree = pickle.loads(body)
  by_id = {d.id: d for d in jax.devices()}
  devices = [by_id[i] for i in ids]  # the program's own devices (by default it would get them all)
  return serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices), seconds


class PersistentProgram:
  """A ``jax.jit`` program whose executables a later process loads without tracing: each one is written to
  ``<directory()>/executables`` under a key made of ``signature`` (everything its trace reads besides its arguments,
  as for `SharedPrograms`), the static arguments, each argument's shape, dtype, weak type and placement, JAX's trace
  context and `_environment` (the package's source, library versions, XLA flags, devices); a change to any of them is
  another key (JAX's settings are read at every new key; a constant of the package's modules patched at run time is
  not: a test that patches one must not build samplers or update steps with the cache on). Elsewhere the program is
  ``jitted`` itself: with the cache off (`enable` not called or turned off), in a multi-process run, with
  ``jax.disable_jit`` or NaN/Inf checking on, under a trace (tracer arguments), or for a signature that is None or
  has no stable text (`_stable`).
  ``lower``, ``trace`` and the rest of ``jitted``'s attributes are its own.

  A read is reported as the ``LOAD_EVENT`` time span (`runtime.CompileClock` counts it as a compile) and calls
  ``on_load``; an entry that does not load (its checksum does not match, or it is from an older jaxlib) is deleted
  and compiled again. Like
  JAX's own cache, loading runs what the file holds: the folder must be the user's own.

      step = PersistentProgram(jax.jit(f, static_argnames="n"), "f", signature=(config,), static_argnames=("n",))
      step(x, n=3)  # compiles (or loads) once per key, then runs
  """

  _all: weakref.WeakSet[PersistentProgram] = weakref.WeakSet()

  def __init__(
    self,
    jitted: Callable,
    name: str,
    signature: Hashable,
    static_argnames: tuple[str, ...] = (),
    on_load: Callable[[], None] | None = None,
  ):
    self._jitted, self.name, self._static, self._on_load = jitted, name, frozenset(static_argnames), on_load
    try:
      self._signature = None if signature is None else _stable(signature)
    except _Unstable:
      self._signature = None
    try:  # static arguments a call may give by position (jax.jit's own rule)
      names = list(inspect.signature(inspect.unwrap(jitted)).parameters)
    except (TypeError, ValueError):
      names = []
    self._static_at = {i: n for i, n in enumerate(names) if n in self._static}
    self._compiled: dict[Hashable, Any] = {}
    PersistentProgram._all.add(self)

  def __getattr__(self, attr: str) -> Any:
    return getattr(self._jitted, attr)

  def __call__(self, *args, **kwargs):
    folder = _executables
    if folder is None or self._signature is None or _debugging() or jax.process_count() > 1:
      return self._jitted(*args, **kwargs)
    given = args
    static = [(k, kwargs.pop(k)) for k in list(kwargs) if k in self._static]
    if self._static_at and any(i < len(args) for i in self._static_at):
      static += [(self._static_at[i], a) for i, a in enumerate(args) if i in self._static_at]
      args = tuple(a for i, a in enumerate(args) if i not in self._static_at)
    static = tuple(sorted(static, key=lambda item: item[0]))
    leaves, tree = jax.tree.flatten((args, kwargs))
    try:  # a static value with its type: 1, True and 1.0 are equal keys of a dict, and other programs
      typed = tuple((k, type(v), v) for k, v in static)
      key = (typed, tree, tuple(map(_leaf, leaves)), jax_config.trace_context())
      compiled = self._compiled.get(key)
    except TypeError:  # _Unstable, or a static value that does not hash
      return self._jitted(*given, **kwargs, **self._named(static, given))
    if compiled is None:
      compiled = self._compiled[key] = self._load_or_compile(folder, key, static, given, kwargs)
    return compiled(*args, **kwargs)

  def _named(self, static: tuple, given: tuple) -> dict:
    """The static arguments of ``static`` that the call gave by name (not among its positional ``given``)."""
    positional = {n for i, n in self._static_at.items() if i < len(given)}
    return {k: v for k, v in static if k not in positional}

  def _path(self, folder: str, key: tuple, static: tuple) -> str | None:
    _, tree, leaves, context = key
    try:
      text = repr((self.name, self._signature, _stable(static), str(tree), [_stable_leaf(x) for x in leaves]))
      text += _stable_context(context)
    except _Unstable:
      return None
    digest = hashlib.sha256((_environment() + _settings() + text).encode()).hexdigest()[:48]
    return os.path.join(folder, f"{re.sub(r'[^A-Za-z0-9_]', '_', self.name)}-{digest}.exe")

  def _load_or_compile(self, folder: str, key: tuple, static: tuple, given: tuple, kwargs: dict):
    """The executable for ``key``, read from its file, else lowered from the call's own arguments (``given``: the
    positional ones, static included) and compiled, then written."""
    from jax.experimental import serialize_executable

    path = self._path(folder, key, static)
    start = time.time()
    try:
      with open(path, "rb") as f:
        blob = f.read()
    except (OSError, TypeError):  # none yet (TypeError: no path)
      blob = None
    if blob is not None:
      try:
        compiled, seconds = read_executable(blob)
      except Exception as e:  # noqa: BLE001 (damaged, truncated, written by another jaxlib): compile it again
        logging.warning("compilation cache: %s did not load (%s: %s); compiling it again", path, type(e).__name__, e)
        with contextlib.suppress(OSError):
          os.remove(path)
      else:
        jax.monitoring.record_event_time_span(LOAD_EVENT, start, time.time())
        jax.monitoring.record_event_duration_secs(SAVED_EVENT, seconds)
        if self._on_load is not None:
          self._on_load()
        return compiled
    start = time.time()
    hits = _jax_cache_hits[0]
    lowered = self._jitted.lower(*given, **kwargs, **self._named(static, given))
    with jax_config.persistent_cache_min_compile_time_secs(float("inf")):  # this file, not JAX's, holds it
      compiled = lowered.compile(compiler_options=_OWN_COMPILE)
    if _jax_cache_hits[0] != hits:  # JAX's cache answered after all (an entry from elsewhere): not written
      path = None
    if path is not None:
      try:
        ids = [d.id for d in compiled._executable._unloaded_executable.device_list]  # no public accessor
        body = pickle.dumps((time.time() - start, ids, *serialize_executable.serialize(compiled)))
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temporary, "wb") as f:
          f.write(hashlib.blake2b(body, digest_size=_CHECK).digest() + body)
        os.replace(temporary, path)  # whole or not at all, for a reader in another process
      except Exception as e:  # noqa: BLE001 (not serializable, disk full): it still runs, from memory
        logging.info("compilation cache: %s not written (%s: %s)", path, type(e).__name__, e)
    return compiled

  @classmethod
  def forget_all(cls) -> None:
    """Drops every program's executables held in memory (the files stay); the next call loads or compiles again."""
    for program in list(cls._all):
      program._compiled.clear()
