"""Checkpoints: everything a run needs to resume exactly, in one orbax ``CheckpointManager`` per workdir.

    ckpt = Checkpointer.from_config(workdir, config)        # save interval and retention from config.train
    if ckpt.latest_step() is not None:
      abstract = {"params": jax.eval_shape(init, key), "opt_state": jax.eval_shape(optimizer.init, params_shape)}
      abstract = with_shardings(abstract, {"params": param_shardings, "opt_state": opt_shardings})
      restored = ckpt.restore(abstract_state=abstract)       # the latest step, each array placed on its sharding
      params, opt_state, rng = restored.params, restored.opt_state, restored.rng
      stream = TaskStream.from_state(source, restored.data_state)
    ...
    ckpt.save(step, params=params, opt_state=opt_state, rng=rng, data_state=stream.state(), metrics=scalars)
    ckpt.close()                                            # waits for the last (asynchronous) save

On disk, ``workdir/checkpoints/<step>/`` holds three orbax items:
  ``state/``   {"params": ..., "opt_state": ...}, orbax's standard array format (bit-exact; sharded arrays are
               written by every process, each its own shards). ``params`` is the model's tree, or in per-role mode
               {"act": tree, "rehearse": tree}; ``opt_state`` is the optax state (e.g. AdamW) over it.
  ``config/``  the run's config as JSON: a checkpoint describes itself (``read_config``; ``python -m
               envace_jax.inspect_checkpoint DIR`` prints it without the config file).
  ``meta/``    JSON: the step, the RNG key (``jax.random.key_data`` and the key's implementation), the data position
               (``TaskStream.state()``), the step's metrics (non-finite floats as "NaN"/"Infinity" strings) and the
               save's wall time.

Saves are asynchronous (orbax copies the arrays to host memory before ``save`` returns, so the caller may donate
or update them right after, and holds that copy until the save is written: the trainer ``wait``s before its next
update, `train.Trainer.finish_save`); ``restore``, ``latest_step``, ``wait`` and ``close`` wait for saves in flight.

Damage. A step that does not read raises ``DamagedCheckpointError``, one line: the step, the file (relative to the
step's folder) and what is wrong, e.g.

    checkpoint step 2 in RUN/checkpoints is damaged: state/d/20fc…: truncated (OUT_OF_RANGE: reading array
    params.embed.embedding; Requested byte range [0, 9525) is not valid for value of size 4762)

Before a step is read its metadata files are checked (``state/_METADATA``, ``config/metadata``, ``meta/metadata``
present; they, ``state/_sharding`` and ``state/array_metadatas/*`` valid JSON; ``state/manifest.ocdbt`` present);
a data file missing, cut short or garbled is found by TensorStore as the arrays are read (NOT_FOUND, OUT_OF_RANGE,
DATA_LOSS). ``restore(fallback=True)`` (training resume, ``--mode=eval``, ``serve --checkpoint``: config
``train.checkpoint_fallback``, default on) then logs that line as a warning and restores the newest older step that
reads, saying so; ``Restored.damaged`` lists the steps passed over, and a resuming run moves them to
``workdir/damaged_checkpoints/`` (``set_aside``) so it can save those steps again. With no step that reads, one line
lists what is wrong with each. All of it is `Checkpointer.read_newest`. An intact step whose arrays do not fit the
run (another model, mode or dtype) is ``IncompatibleCheckpointError`` instead, said to be no damage, and is never
passed over. Bytes changed in place are found where TensorStore checks them (OCDBT's b-tree nodes carry a CRC-32C:
"corrupt (DATA_LOSS ...)"); orbax keeps no checksum of its own, so a change nothing checks could read as other
values. A file orbax does without (``_CHECKPOINT_METADATA``; a missing ``state/_sharding`` or ``array_metadatas``)
is no damage: the step reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from envace_jax.metrics import from_json_safe, to_json_safe
from envace_jax.model import transformer

CHECKPOINT_SUBDIR = "checkpoints"
# Where a resumed run moves the damaged steps a fallback passed over (`Checkpointer.set_aside`), beside checkpoints/
DAMAGED_SUBDIR = "damaged_checkpoints"
_STATE, _CONFIG, _META = "state", "config", "meta"
# A step's files (relative to its folder) orbax 0.12 cannot restore without; and the JSON files among them, with
# those it reads when present (it does without a missing _sharding or array_metadatas, and ignores
# _CHECKPOINT_METADATA either way). Checked before a step is read: orbax's own errors for them are a FileNotFoundError,
# a bare JSONDecodeError naming no file, or (state/_METADATA) an empty tree that looks like another config's.
_REQUIRED_FILES = (f"{_STATE}/_METADATA", f"{_CONFIG}/metadata", f"{_META}/metadata")
_JSON_FILES = (*_REQUIRED_FILES, f"{_STATE}/_sharding")
# TensorStore's status codes for a data file that is gone, shorter than its index says, or garbled.
_TENSORSTORE_PROBLEMS = {
  "NOT_FOUND": "missing",
  "OUT_OF_RANGE": "truncated",
  "DATA_LOSS": "corrupt",
  "FAILED_PRECONDITION": "corrupt",  # e.g. "Truncated Zstd-compressed stream" inside a data file
}
# orbax wraps TensorStore's error for one shard of a large array in a bare Exception with this message (its
# serialization.py, the async shard read); the TensorStore error is its __cause__.
_ORBAX_SHARD_READ = "Encountered error while reading array index"
# What reading a damaged step raises from orbax and TensorStore (a TensorStore error is a ValueError).
_READ_ERRORS = (OSError, ValueError, KeyError, EOFError)
_T = TypeVar("_T")
# Config keys that decide the parameter tree's shapes and structure: quoted in incompatibility errors.
_MODEL_KEYS = ("model", "model_path", "tokenizer", "param_dtype", "grpo.mode")
_MAX_LISTED = 8  # mismatching arrays named in an error


class CheckpointError(RuntimeError):
  """A checkpoint is missing, damaged, or does not fit the state it is restored into (another model, mode or dtype)."""


class DamagedCheckpointError(CheckpointError):
  """A saved step does not read: a file of it is missing, cut short or not what its index says.

  Attributes:
    step: the step (None when the error is about every step: no step of the workdir reads).
    path: the file or folder at fault, relative to the step's folder (e.g. "state/d/20fc…", "meta/metadata").
    problem: what is wrong with it, one line: "missing", "truncated (OUT_OF_RANGE: ...)", "corrupt (DATA_LOSS:
      ...)", "not valid JSON, cut short or overwritten (...)", "lists no arrays", "unreadable (...)"; for the error
      that no step reads, each step's "path: problem".
  """

  def __init__(self, message: str, step: int | None = None, path: str = "", problem: str = ""):
    super().__init__(message)
    self.step, self.path, self.problem = step, path, problem


class IncompatibleCheckpointError(CheckpointError):
  """A saved step reads, but its arrays do not fit this run's state: it was written by another config."""


@dataclasses.dataclass
class Restored:
  """What ``Checkpointer.restore`` returns.

  Attributes:
    step: the checkpoint's step (updates done); the run continues at step + 1.
    params: the parameter tree, arrays on the target's shardings.
    opt_state: the optimizer state, with the target's structure (optax namedtuples when the target has them).
    rng: the run's RNG key, a typed key array (``jax.random.wrap_key_data`` of the saved key data).
    data_state: the saved data position (``TaskStream.state()``), or None when none was saved.
    metrics: the scalars saved with the step.
    config: the config the checkpoint was saved with.
    damaged: the newer steps a fallback passed over (``restore(fallback=True)``), step -> "path: what is wrong".
  """

  step: int
  params: Any
  opt_state: Any
  rng: jax.Array
  data_state: dict[str, Any] | None
  metrics: dict[str, Any]
  config: ml_collections.ConfigDict
  damaged: dict[int, str] = dataclasses.field(default_factory=dict)


def _config_dict(config: ml_collections.ConfigDict | Mapping[str, Any] | None) -> dict[str, Any]:
  if config is None:
    return {}
  if isinstance(config, ml_collections.ConfigDict):
    return json.loads(config.to_json_best_effort())
  return to_json_safe(dict(config))


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
  value: Any = config
  for part in dotted.split("."):
    if not isinstance(value, Mapping) or part not in value:
      return None
    value = value[part]
  return value


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """``abstract`` (a tree of arrays or ``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape``) with the shardings
  of the matching tree ``shardings`` attached: the target ``Checkpointer.restore`` places arrays on.

  Raises:
    ValueError: the two trees have different structures.
  """
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def _abstract(tree: Any) -> Any:
  """Arrays -> ShapeDtypeStruct keeping their sharding. A leaf without one (``jax.eval_shape``'s, a numpy array's)
  goes to this process's first device: orbax would otherwise take the sharding the checkpoint was written with, which
  another topology (a multi-process run's checkpoint read by one process) cannot build."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def leaf(x):
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.ShapeDtypeStruct):
      return x if sharding is not None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
    dtype = np.asarray(x).dtype if sharding is None else x.dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding or device)

  return jax.tree.map(leaf, tree)


def _stacked_abstract(tree: Any) -> Any:
  """``tree``'s abstract arrays with every per-layer dict (``layers_0 ..``) as one stacked ``layers`` dict: the
  layout checkpoints had before the train state held its layers apart. A stacked leaf keeps layer 0's sharding with
  the layer axis replicated."""

  def stack_leaf(*xs):
    s = xs[0].sharding
    if isinstance(s, jax.sharding.NamedSharding):
      s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, *s.spec))
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype, sharding=s)

  def stack(d):
    names = sorted((n for n in d if n.startswith("layers_")), key=lambda n: int(n.split("_")[1]))
    out = {k: v for k, v in d.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree.map(stack_leaf, *(d[n] for n in names))
    return out

  is_layers = lambda x: isinstance(x, dict) and "layers_0" in x  # noqa: E731
  return jax.tree.map(lambda x: stack(x) if is_layers(x) else x, tree, is_leaf=is_layers)


def _one_line(text: str, limit: int = 240) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_files(step_dir: str) -> tuple[str, str] | None:
  """(path relative to ``step_dir``, what is wrong) of the first required file missing or JSON file that does not
  parse; None when all are there."""
  for rel in _REQUIRED_FILES:
    if not os.path.isfile(os.path.join(step_dir, rel)):
      return rel, "missing"
  # An OCDBT array store (state/d/ holds its data files) reads nothing without its manifest.
  if os.path.isdir(os.path.join(step_dir, _STATE, "d")) and not os.path.isfile(
    os.path.join(step_dir, _STATE, "manifest.ocdbt")
  ):
    return f"{_STATE}/manifest.ocdbt", "missing"
  array_metadatas = os.path.join(step_dir, _STATE, "array_metadatas")
  extra = sorted(os.listdir(array_metadatas)) if os.path.isdir(array_metadatas) else []
  for rel in (*_JSON_FILES, *(f"{_STATE}/array_metadatas/{name}" for name in extra)):
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
      continue
    try:
      with open(path, encoding="utf-8") as f:
        json.load(f)
    except (OSError, ValueError) as e:
      return rel, f"not valid JSON, cut short or overwritten ({_one_line(e, 120)})"
  return None


def _drop_closed_loop_noise() -> None:
  """When a read fails, TensorStore still completes the reads orbax abandoned, and each calls back into orbax's
  closed asyncio loop: Python prints every such RuntimeError("Event loop is closed") as an ignored exception with its
  traceback (15 for one missing data file), around the one-line report. From the first read on, the
  ``sys.unraisablehook`` in place drops those (only those: anything else still reaches it)."""
  previous = sys.unraisablehook
  if getattr(previous, "_envace_drops_closed_loop", False):
    return

  def hook(unraisable):
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return
    previous(unraisable)

  hook._envace_drops_closed_loop = True
  sys.unraisablehook = hook


def _diagnose(step_dir: str, error: BaseException) -> tuple[str, str]:
  """(path relative to ``step_dir``, what is wrong) from what reading the step raised: TensorStore's errors name the
  data file ("local file ...") and a status code; orbax's FileNotFoundError names the file."""
  text = str(error).split("[tensorstore_spec=")[0].strip()
  files = re.findall(r'local file "([^"]+)"', text)
  missing = getattr(error, "filename", None) or (re.search(r"File (\S+) not found", text) or [None, None])[1]
  path = files[-1] if files else missing or step_dir
  rel = os.path.relpath(path, step_dir)
  rel = path if rel.startswith("..") else rel
  if isinstance(error, FileNotFoundError):
    return rel, "missing"
  code = re.match(r"([A-Z_]+): ", text)
  if not code:
    return rel, f"unreadable ({type(error).__name__}: {_one_line(text, 160)})"
  details = []
  array = re.search(r'Error reading "([^"/]+)', text)
  if array:
    details.append(f"reading array {array[1]}")
  tail = text.rsplit(f'local file "{files[-1]}"', 1)[1].lstrip(": ").strip() if files else ""
  if tail:
    details.append(tail)
  problem = _TENSORSTORE_PROBLEMS.get(code[1], code[1].lower())
  return rel, _one_line(f"{problem} ({code[1]}" + (": " + "; ".join(details) if details else "") + ")")


def _path_name(path: tuple) -> str:
  """A key path as orbax names the array: dict keys, sequence indices and namedtuple fields joined with '/'."""
  parts = []
  for entry in path:
    for attr in ("key", "idx", "name"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  return "/".join(parts)


def _flat_target(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_path_name(p): (tuple(x.shape), np.dtype(x.dtype)) for p, x in flat}


def _flat_saved(tree: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Orbax tree metadata (nested dicts / lists of ArrayMetadata; None for empty nodes) -> path -> (shape, dtype)."""
  out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
  if tree is None:
    return out
  if isinstance(tree, Mapping):
    items = tree.items()
  elif isinstance(tree, list | tuple):
    items = enumerate(tree)
  else:
    return {prefix: (tuple(tree.shape), np.dtype(tree.dtype))}
  for key, value in items:
    out.update(_flat_saved(value, f"{prefix}/{key}" if prefix else str(key)))
  return out


class Checkpointer:
  """Saves and restores a run's state under ``workdir/checkpoints`` (see the module docstring for the layout).

  Args:
    workdir: the run's directory; checkpoints go to ``workdir/checkpoints`` (created on first save).
    config: the run's config, stored as JSON with every checkpoint (a ConfigDict or a JSON-able mapping).
    max_to_keep: how many of the newest checkpoints to keep (older ones are deleted); None keeps all.
    save_every: ``save`` writes only steps that are multiples of this (``force=True`` writes any step).
    async_save: write in a background thread (the default); False blocks in ``save`` until written.
    read_only: for readers of a workdir another process may be writing (``--mode=eval``,
      ``envace_jax.inspect_checkpoint``, notebooks): nothing is created or deleted (an unfinished save's tmp folder
      stays for its writer) and ``save`` raises.

  Raises:
    ValueError: max_to_keep or save_every below 1.
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    config: ml_collections.ConfigDict | Mapping[str, Any] | None = None,
    max_to_keep: int | None = 3,
    save_every: int = 1,
    async_save: bool = True,
    read_only: bool = False,
  ):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    if save_every < 1:
      raise ValueError(f"save_every must be >= 1, got {save_every}")
    self.save_every = int(save_every)
    self.read_only = bool(read_only)
    self.directory = os.path.join(os.path.abspath(os.fspath(workdir)), CHECKPOINT_SUBDIR)
    self._config = _config_dict(config)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=not read_only,
      # A save killed mid-way leaves a tmp folder; it is never a checkpoint. Only the writer removes it: a reader
      # could be looking at a live run's save in progress.
      cleanup_tmp_directories=not read_only,
      read_only=read_only,
      enable_async_checkpointing=async_save,
    )
    handlers = {
      _STATE: ocp.StandardCheckpointHandler(),
      _CONFIG: ocp.JsonCheckpointHandler(),
      _META: ocp.JsonCheckpointHandler(),
    }
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    # Orbax removes those tmp folders on a background thread and only waits for it at the next save; wait here so
    # that a writer's start-up is done when the constructor returns (the method is private, hence the guard).
    getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

  @classmethod
  def from_config(cls, workdir: str | os.PathLike, config: ml_collections.ConfigDict, **kwargs) -> Checkpointer:
    """A Checkpointer with ``config.train.checkpoint_every`` and ``config.train.keep_checkpoints``."""
    kwargs.setdefault("save_every", config.train.checkpoint_every)
    kwargs.setdefault("max_to_keep", config.train.keep_checkpoints)
    return cls(workdir, config=config, **kwargs)

  # -- which steps -------------------------------------------------------------------------------------------------

  def latest_step(self) -> int | None:
    """The newest saved step, or None when the workdir has no checkpoint."""
    self._manager.wait_until_finished()
    self._manager.reload()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every saved step, oldest first."""
    self._manager.wait_until_finished()
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    """Whether ``save(step)`` (without force) would write: ``step`` is a multiple of ``save_every``."""
    return int(step) % self.save_every == 0

  def _step(self, step: int | None) -> int:
    latest = self.latest_step()
    if step is None:
      if latest is None:
        raise CheckpointError(f"no checkpoint in {self.directory}")
      return latest
    if step not in self._manager.all_steps():
      raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; saved steps: {self.all_steps()}")
    return int(step)

  # -- damage ------------------------------------------------------------------------------------------------------

  def _damaged(self, step: int, path: str, problem: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(
      f"checkpoint step {step} in {self.directory} is damaged: {path}: {problem}", step, path, problem
    )

  @contextlib.contextmanager
  def _reading(self, step: int):
    """Checks ``step``'s files (`_check_files`), then turns what reading them raises into a one-line
    DamagedCheckpointError naming the step, the file and what is wrong."""
    step_dir = os.path.join(self.directory, str(step))
    _drop_closed_loop_noise()  # some come before orbax raises
    found = _check_files(step_dir)
    if found:
      raise self._damaged(step, *found)
    try:
      yield
    except _READ_ERRORS as e:
      raise self._damaged(step, *_diagnose(step_dir, e)) from e
    except Exception as e:
      if type(e) is Exception and str(e).startswith(_ORBAX_SHARD_READ) and isinstance(e.__cause__, _READ_ERRORS):
        raise self._damaged(step, *_diagnose(step_dir, e.__cause__)) from e
      raise

  def read_newest(
    self,
    read: Callable[[int], _T],
    *,
    step: int | None = None,
    fallback: bool = True,
    fallback_setting: str = "",
  ) -> tuple[int, _T, dict[int, str]]:
    """``read(s)`` of the newest saved step ``s`` at or before ``step`` (default: the latest) that reads: the one
    place a damaged checkpoint is passed over (``restore(fallback=True)``, ``serve --checkpoint``).

    ``read`` raises DamagedCheckpointError for a step that does not read (the Checkpointer's readers do). Each such
    step is logged as a warning, one line (the step, the file, what is wrong), and the step before it is tried; the
    step that reads is logged as restored instead of them. Any other error (an intact checkpoint of another config:
    IncompatibleCheckpointError) is raised at once: an older step of the same run would not fit either.

    Args:
      read: reads one step (e.g. ``self.read_config``).
      step: the newest step to try; None for the latest.
      fallback: False raises the first step's DamagedCheckpointError instead of trying older steps.
      fallback_setting: the setting that turns ``fallback`` on, named in that error (e.g.
        "train.checkpoint_fallback").

    Returns:
      (the step read, what ``read`` returned, the newer steps passed over: step -> "path: what is wrong").

    Raises:
      CheckpointError: no checkpoint (of ``step``).
      DamagedCheckpointError: the step does not read and ``fallback`` is False; or no step reads (one line listing
        what is wrong with each).
    """
    first = self._step(step)
    damaged: dict[int, str] = {}
    candidates = [s for s in reversed(self.all_steps()) if s <= first]
    for s in candidates:
      try:
        value = read(s)
      except DamagedCheckpointError as e:
        if not fallback:
          if fallback_setting:
            raise DamagedCheckpointError(
              f"{e}; {fallback_setting} is off, so no older step is tried (turn it on to restore the newest step that "
              f"reads, or move {os.path.join(self.directory, str(s))} away)",
              e.step,
              e.path,
              e.problem,
            ) from e
          raise
        damaged[s] = f"{e.path}: {e.problem}"
        logging.warning("%s; %s", e, "trying the step before it" if s != candidates[-1] else "no older step")
        continue
      if damaged:
        logging.warning(
          "checkpoint step %d in %s restored instead of the damaged step%s %s: the newest step that reads",
          s,
          self.directory,
          "s" if len(damaged) > 1 else "",
          ", ".join(map(str, damaged)),
        )
      return s, value, damaged
    listed = "; ".join(f"step {s}: {problem}" for s, problem in damaged.items())
    raise DamagedCheckpointError(
      f"no checkpoint in {self.directory} reads ({listed}); start afresh in another workdir, or move the "
      "damaged steps away",
      None,
      "",
      listed,
    )

  def set_aside(self, steps: Iterable[int]) -> str:
    """Moves the folders of ``steps`` (the damaged steps a fallback passed over, ``Restored.damaged``) to
    ``workdir/damaged_checkpoints/<step>``, so that a resumed run saves those steps afresh and the damaged files
    stay for a look. Process 0 moves (the others find them gone on a shared disk); every process reloads the list of
    steps. A step already set aside there before gets a suffix (``<step>.1``).

    Returns:
      The folder they went to.

    Raises:
      CheckpointError: this Checkpointer is ``read_only``.
    """
    if self.read_only:
      raise CheckpointError(f"{self.directory} is open read-only; nothing can be set aside")
    target = os.path.join(os.path.dirname(self.directory), DAMAGED_SUBDIR)
    if jax.process_index() == 0:
      for step in steps:
        source = os.path.join(self.directory, str(step))
        if not os.path.isdir(source):
          continue
        os.makedirs(target, exist_ok=True)
        dest, n = os.path.join(target, str(step)), 0
        while os.path.exists(dest):
          n += 1
          dest = os.path.join(target, f"{step}.{n}")
        shutil.move(source, dest)
        logging.warning("damaged checkpoint step %d moved to %s", step, dest)
    self._manager.reload()
    return target

  # -- save --------------------------------------------------------------------------------------------------------

  def save(
    self,
    step: int,
    *,
    params: Any,
    opt_state: Any,
    rng: jax.Array,
    data_state: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    force: bool = False,
  ) -> bool:
    """Saves the state of ``step`` (updates done) when ``step`` is on the save interval, or when ``force``.

    Args:
      step: a non-negative int; each step is saved once.
      params: the parameter tree (or {"act": tree, "rehearse": tree} in per-role mode), JAX or numpy arrays.
      opt_state: the optimizer state (any pytree of arrays: optax namedtuples are fine).
      rng: a typed key (``jax.random.key``); stored as ``jax.random.key_data`` with the key's implementation.
      data_state: the data position, ``TaskStream.state()`` (plain JSON values).
      metrics: the step's scalars.
      force: save even off the interval (do this for the last step of a run).

    Returns:
      Whether a checkpoint was started.

    Raises:
      TypeError: ``rng`` is not a typed key array (make it with ``jax.random.key``, not ``PRNGKey``).
      CheckpointError: this Checkpointer is ``read_only``.
      orbax's StepAlreadyExistsError: ``step`` is already saved.
    """
    if self.read_only:
      raise CheckpointError(f"{self.directory} is open read-only; open a Checkpointer without read_only=True to save")
    if not jax.dtypes.issubdtype(getattr(rng, "dtype", np.float32), jax.dtypes.prng_key):
      raise TypeError(f"rng must be a typed key array from jax.random.key(...), got {getattr(rng, 'dtype', rng)!r}")
    if not force and not self.should_save(step):
      return False
    key_data = np.asarray(jax.random.key_data(rng))
    meta = {
      "step": int(step),
      "rng": {
        "impl": str(jax.random.key_impl(rng)),
        "shape": list(key_data.shape),
        "dtype": str(key_data.dtype),
        "data": key_data.reshape(-1).tolist(),
      },
      "data_state": to_json_safe(dict(data_state)) if data_state is not None else None,
      "metrics": to_json_safe(dict(metrics or {})),
      "time": time.time(),
      "versions": {"jax": jax.__version__, "orbax": getattr(ocp, "__version__", "")},
    }
    args = ocp.args.Composite(
      **{
        _STATE: ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        _CONFIG: ocp.args.JsonSave(self._config),
        _META: ocp.args.JsonSave(meta),
      }
    )
    # force: the interval is decided above (orbax's own policy would also save a fresh run's first step).
    saved = self._manager.save(int(step), args=args, force=True)
    if saved:
      logging.info("checkpoint of step %d -> %s", step, self.directory)
    return saved

  # -- restore -----------------------------------------------------------------------------------------------------

  def read_meta(self, step: int | None = None) -> dict[str, Any]:
    """The ``meta`` item of ``step`` (default: the latest): step, rng, data_state, metrics, time, versions.

    Raises:
      CheckpointError: no such checkpoint.
      DamagedCheckpointError: the step's files are missing, cut short or unreadable.
    """
    step = self._step(step)
    with self._reading(step):
      restored = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
    return from_json_safe(restored[_META])

  def read_config(self, step: int | None = None) -> ml_collections.ConfigDict:
    """The config ``step`` (default: the latest) was saved with; reads no arrays.

    Raises:
      CheckpointError: no such checkpoint.
      DamagedCheckpointError: the step's files are missing, cut short or unreadable.
    """
    step = self._step(step)
    with self._reading(step):
      restored = self._manager.restore(step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()}))
    return ml_collections.ConfigDict(restored[_CONFIG] or {})

  def saved_arrays(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every saved array of ``step`` (default: the latest), by path ("params/embed/embedding",
    "opt_state/0/mu/..."); reads no arrays.

    Raises:
      CheckpointError: no such checkpoint.
      DamagedCheckpointError: the step's files are missing, cut short or unreadable.
    """
    step = self._step(step)
    with self._reading(step):
      return self._saved_arrays(step)

  def _saved_arrays(self, step: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    metadata = self._manager.item_metadata(step)[_STATE]
    saved = _flat_saved(getattr(metadata, "tree", metadata))
    if not saved:  # every save has parameters: an index that lists none is broken, not another config's
      raise self._damaged(step, f"{_STATE}/_METADATA", "lists no arrays")
    return saved

  def _check_compatible(self, step: int, target: Any) -> None:
    saved = self._saved_arrays(step)
    wanted = _flat_target(target)
    problems = []
    # Parameters first: they say what changed; the optimizer state's moments mirror them.
    for name in sorted(set(saved) | set(wanted), key=lambda n: (not n.startswith("params/"), n)):
      if name not in saved:
        problems.append(f"{name}: not in the checkpoint (this run has {wanted[name][0]} {wanted[name][1]})")
      elif name not in wanted:
        problems.append(f"{name}: in the checkpoint ({saved[name][0]} {saved[name][1]}) but not in this run's state")
      elif saved[name] != wanted[name]:
        (s_shape, s_dtype), (w_shape, w_dtype) = saved[name], wanted[name]
        problems.append(f"{name}: checkpoint {s_shape} {s_dtype}, this run {w_shape} {w_dtype}")
    if not problems:
      return
    listed = problems[:_MAX_LISTED] + (
      [f"... and {len(problems) - _MAX_LISTED} more"] if len(problems) > _MAX_LISTED else []
    )
    restored = self._manager.restore(step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()}))
    saved_config = _config_dict(restored[_CONFIG] or {})
    settings = []
    for key in _MODEL_KEYS:
      then, now = _lookup(saved_config, key), _lookup(self._config, key)
      if then != now:
        settings.append(f"{key}: checkpoint {then!r}, this run {now!r}")
    raise IncompatibleCheckpointError(
      f"the checkpoint of step {step} in {self.directory} reads, but was made with an incompatible config (not "
      f"damage: another model, mode or dtype): {len(problems)} of its arrays do not match this run's state.\n  "
      + "\n  ".join(listed)
      + ("\nModel settings that differ:\n  " + "\n  ".join(settings) if settings else "")
      + "\nResume with the checkpoint's own config (`python -m envace_jax.inspect_checkpoint "
      f"{os.path.dirname(self.directory)}` prints it), or start the new config in a fresh --workdir."
    )

  def _default_target(self, step: int) -> dict[str, Any]:
    """The saved arrays as ShapeDtypeStructs on the first local device (opt_state as nested dicts/lists)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    metadata = self._manager.item_metadata(step)[_STATE]
    tree = getattr(metadata, "tree", metadata)
    return jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device),
      dict(tree),
      is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
    )

  def restore(
    self,
    step: int | None = None,
    *,
    abstract_state: Mapping[str, Any] | None = None,
    fallback: bool = False,
    fallback_setting: str = "",
  ) -> Restored:
    """Restores ``step`` (default: the latest) onto the target's shapes, dtypes and shardings; with ``fallback``,
    the newest step at or before it that reads.

    A step that does not read (a data file missing or cut short, a metadata file missing or garbled) raises a
    DamagedCheckpointError of one line: the step, the file (relative to the step's folder) and what is wrong. With
    ``fallback`` each such step is logged so as a warning and the step before it is tried (`read_newest`);
    ``Restored.damaged`` lists the steps passed over.

    Args:
      step: the step to restore; None for the latest.
      abstract_state: {"params": tree, "opt_state": tree} of ``jax.ShapeDtypeStruct`` with shardings (see
        ``with_shardings``; ``jax.eval_shape`` of the initialisers gives the shapes; a leaf without a sharding goes
        to the first local device, whatever topology wrote the checkpoint) or of concrete arrays (their shardings
        are used). The restored trees have this structure. None restores every array onto the first
        local device, the optimizer state as nested dicts and lists (for inspection, not for resuming).
      fallback: a damaged step falls back to the newest older step that reads (training resume, ``--mode=eval``
        and ``serve --checkpoint`` pass ``config.train.checkpoint_fallback``).
      fallback_setting: the setting that turns ``fallback`` on, named in the error when it is off.

    Raises:
      CheckpointError: no checkpoint.
      IncompatibleCheckpointError (a CheckpointError): the checkpoint reads, but its arrays do not match
        ``abstract_state`` (another model, per-role vs shared parameters, another dtype), checked before any array
        is read; the message names the first differing arrays and the two configs' model settings. Never a reason to
        fall back. A checkpoint with stacked layers restores onto a target with per-layer arrays (``layers_0 ..``),
        as older runs saved them.
      DamagedCheckpointError (a CheckpointError): the step does not read and ``fallback`` is off, or no step reads.
      ValueError: ``abstract_state`` lacks "params" or "opt_state".
    """
    if abstract_state is not None:
      missing = {"params", "opt_state"} - set(abstract_state)
      if missing:
        raise ValueError(f"abstract_state needs the keys 'params' and 'opt_state'; missing {sorted(missing)}")
    _, restored, damaged = self.read_newest(
      lambda s: self._restore(s, abstract_state), step=step, fallback=fallback, fallback_setting=fallback_setting
    )
    restored.damaged = damaged
    return restored

  def _restore(self, step: int, abstract_state: Mapping[str, Any] | None) -> Restored:
    """``restore`` of one step."""
    stored_stacked = False
    with self._reading(step):
      if abstract_state is None:
        target = self._default_target(step)
      else:
        target = _abstract({"params": abstract_state["params"], "opt_state": abstract_state["opt_state"]})
        saved, wanted = self._saved_arrays(step), _flat_target(target)
        stored_stacked = any("/layers/" in n for n in saved) and not any("/layers/" in n for n in wanted)
        if stored_stacked:  # written before the train state held its layers apart: restored stacked, then split
          target = _stacked_abstract(target)
        self._check_compatible(step, target)
      args = ocp.args.Composite(
        **{
          _STATE: ocp.args.StandardRestore(target),
          _CONFIG: ocp.args.JsonRestore(),
          _META: ocp.args.JsonRestore(),
        }
      )
      restored = self._manager.restore(step, args=args)
      meta = from_json_safe(restored[_META])
      key = meta["rng"]
      key_data = np.asarray(key["data"], dtype=key["dtype"]).reshape(key["shape"])
      rng = jax.random.wrap_key_data(key_data, impl=key["impl"])
      saved_step = int(meta["step"])
    state = restored[_STATE]
    if stored_stacked:
      state = transformer.unstack_tree(state)
    return Restored(
      step=saved_step,
      params=state["params"],
      opt_state=state["opt_state"],
      rng=rng,
      data_state=meta.get("data_state"),
      metrics=meta.get("metrics") or {},
      config=ml_collections.ConfigDict(restored[_CONFIG] or {}),
    )

  # -- lifetime ----------------------------------------------------------------------------------------------------

  def wait(self) -> None:
    """Blocks until saves in flight are written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for saves in flight and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
