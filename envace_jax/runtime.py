"""What every job builds from a config before it runs: the model, its tokenizer, the mesh, the samplers.

Shared by the demo, training and evaluation so that ``--config.model=qwen3-8b --config.model_path=DIR`` means the
same thing everywhere (see ``config_check.weights_source``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from envace_jax import compilation_cache, config_check, distributed
from envace_jax.envs import datasets, registry
from envace_jax.envs.base import Task
from envace_jax.model import config as config_lib
from envace_jax.model import transformer, weights
from envace_jax.model.tokenizer import Tokenizer
from envace_jax.rl import grpo
from envace_jax.sampling import sharding
from envace_jax.sampling.sampler import Sampler


@dataclasses.dataclass
class Model:
  """A loaded model.

  Attributes:
    config: its ModelConfig, training layout (``scan_layers=True``: layers stacked on a leading axis).
    params: the parameter tree as loaded (``config.param_dtype``, float32 by default): off a mesh, in that layout, on
      the default device; `train.Trainer` and `evaluate.load_policy` replace it with the layers apart
      (`transformer.unstack_tree`: the samplers' layout, the reference policy). Loaded onto a mesh
      (``load_model(config, mesh)``), already with the layers apart, each leaf laid out per
      ``sharding.param_shardings``.
    tokenizer: the tokenizer rendering its chats, or None (a random preset without ``config.tokenizer``).
    source: where the weights came from ("random init (seed s)" or the weights path), for logs.
  """

  config: config_lib.ModelConfig
  params: Any
  tokenizer: Tokenizer | None
  source: str


def load_model(config, mesh: jax.sharding.Mesh | None = None) -> Model:
  """The configured model, offline: a preset's bundled weights, a local directory or GGUF, or a random preset.

  A random preset ("tiny") with ``config.tokenizer`` set takes that tokenizer's vocabulary size, so it can render
  real chats (tests and smoke runs). ``config.chat_template="chatml"`` renders chats in ChatML instead of the
  tokenizer's own template.

  Args:
    mesh: load straight onto it, layers apart: each tensor is created on its parts of the mesh, so no device ever
      holds more than its own parts. Weights files are read by `weights.load_hf_dir_onto` (the values loaded without
      a mesh, bit for bit); a random preset is initialised by one program whose outputs are those parts (that
      program's values on one device, bit for bit; within one float32 ulp of the eager init without a mesh, where
      XLA fuses each normal draw with its scale). None: on the default device.
  Raises:
    weights.WeightsError, config_lib.ConfigError: the weights cannot be read.
  """
  source = config_check.weights_source(config)
  tok_source = config_check.tokenizer_source(config)
  tokenizer = None
  if tok_source is not None:
    tokenizer = Tokenizer.from_hf_dir(weights.resolve(tok_source)) if tok_source != source else None
  dtypes = {"dtype": config.dtype, "param_dtype": config.get("param_dtype", "float32")}
  if source is None:
    overrides = {**dtypes, "scan_layers": True, "attention": config.attention}
    if tokenizer is not None:
      overrides["vocab_size"] = tokenizer.vocab_size
    model_config = config_lib.get_model_config(config.model, **overrides)
    if mesh is None:
      params = transformer.init_params(model_config, jax.random.key(config.seed))
    else:
      init = lambda: transformer.unstack_layers(transformer.init_params(model_config, jax.random.key(config.seed)))
      params = jax.jit(init, out_shardings=_param_shardings(model_config, mesh))()
    return Model(model_config, params, _chat_template(config, tokenizer), f"random init (seed {config.seed})")
  if mesh is None:
    pretrained = weights.load_pretrained(source, **dtypes)
    path, model_config, params = pretrained.path, pretrained.config, pretrained.params
  else:
    path = weights.resolve(source)
    model_config = config_lib.ModelConfig.from_hf_dir(path, **dtypes)
    _, params = weights.load_hf_dir_onto(path, _param_shardings(model_config, mesh), model_config)
  if tokenizer is None:
    tokenizer = Tokenizer.from_hf_dir(path)
  tokenizer = _chat_template(config, tokenizer)
  model_config = model_config.replace(scan_layers=True, attention=config.attention)
  return Model(model_config, params, tokenizer, str(path))


def _param_shardings(model_config: config_lib.ModelConfig, mesh: jax.sharding.Mesh) -> Any:
  """The parameters' shardings on ``mesh``, layers apart (the train state's and the samplers' layout)."""
  return sharding.param_shardings(model_config.replace(scan_layers=False), mesh)


def reference_user(config) -> bool:
  """Whether a training run's frozen reference plays the user: ``rollout.user_mode="reference"`` on a benchmark whose
  user turns are simulated (τ², VitaBench); the testbed's, BFCL's and FinMCP's are logged in the tasks
  (``registry.Benchmark.logged_user_turns``), so no user sampler runs."""
  return config.rollout.user_mode == "reference" and not registry.get(config.env.benchmark).logged_user_turns


def holds_reference(config) -> bool:
  """Whether a training run holds the frozen reference policy (the initial weights, a tree beside the train state's):
  for the loss's KL term (``grpo.use_kl``) or the reference user (`reference_user`). Otherwise the train state starts
  on the loaded arrays themselves: one copy of the weights fewer (0.5 GiB for SmolLM2-135M in float32)."""
  return bool(config.grpo.use_kl) or reference_user(config)


def initial_state(
  model: Model, grpo_cfg: grpo.GrpoConfig, mesh: jax.sharding.Mesh, reference: bool = True
) -> tuple[grpo.TrainState, Any]:
  """A run's step-0 train state and its frozen reference, built on ``mesh`` from a model loaded onto it
  (``load_model(config, mesh)``) without a full copy on any one device.

  The train state is ``grpo.init_train_state``'s, laid out per ``grpo.train_state_shardings``: its params are
  ``model.params`` themselves (a jitted cast where the state holds another dtype; per_role: the other role's tree a
  jitted copy) and its optimizer state and step are created on their shardings by one jitted program. The reference
  is a jitted copy in the compute dtype (``model.config.dtype``), sharded like the params: a buffer of its own even
  where the dtypes agree, since the update donates the state. `weights.observe_loading`'s hooks hear "reference",
  each params tree and "optimizer state" as they are placed. With ``reference=False`` (`holds_reference`) no
  reference is built.

  Returns:
    (TrainState, reference params or None): the reference in ``model.params``' tree (layers apart).
  """
  shardings = grpo.train_state_shardings(model.config, grpo_cfg, mesh)
  p_shardings = _param_shardings(model.config, mesh)
  params = model.params
  compute = jnp.dtype(model.config.dtype)
  cast = lambda tree, dtypes: jax.jit(
    lambda p: jax.tree.map(lambda x, d: jnp.array(x, d, copy=True), p, dtypes), out_shardings=p_shardings
  )(tree)
  frozen = None
  if reference:
    frozen = cast(params, jax.tree.map(lambda _: compute, params))
    weights.loaded("reference")
  init = functools.partial(grpo.init_train_state, grpo_cfg)
  abstract = jax.eval_shape(init, params)
  trees = abstract.params if grpo_cfg.per_role else {"policy": abstract.params}
  owned, free = {}, True  # the loaded arrays go to the first tree that holds their dtypes; the others get copies
  for name, tree in trees.items():
    dtypes = jax.tree.map(lambda a: a.dtype, tree)
    if free and dtypes == jax.tree.map(lambda x: x.dtype, params):
      owned[name], free = params, False
    else:
      owned[name] = cast(params, dtypes)
    weights.loaded(f"params {name}")
  step, opt_state = jax.jit(
    lambda p: (lambda s: (s.step, s.opt_state))(init(p)), out_shardings=(shardings.step, shardings.opt_state)
  )(params)
  weights.loaded("optimizer state")
  state = grpo.TrainState(step=step, params=owned if grpo_cfg.per_role else owned["policy"], opt_state=opt_state)
  return state, frozen


def _chat_template(config, tokenizer: Tokenizer | None) -> Tokenizer | None:
  """``tokenizer`` with ``config.chat_template`` applied ("chatml": ChatML; "": its own template)."""
  if tokenizer is not None and config.get("chat_template") == "chatml":
    return tokenizer.with_chat_template(None)
  return tokenizer


def _clear_staging_caches() -> None:
  """JAX's own caches of traced jaxprs, lowered modules and Python-dispatched executables (``jax._src.util``; no
  public call clears them without jit's compiled-executable caches). Nothing when that private function is gone."""
  from jax._src import util as jax_util

  clear = getattr(jax_util, "clear_all_caches", None)
  if clear is not None:
    clear()


@functools.cache
def _malloc_trim():
  """glibc's ``malloc_trim``, or None (another C library, another OS)."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
  except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
    return None
  trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
  return trim


def forget_shared_programs() -> None:
  """Drops this process's shared sampler and update programs (`Sampler`'s ``share_programs``,
  `grpo.make_update_step`): the next sampler or update step made traces and compiles (or reads from the persistent
  cache) programs of its own, as in a new process. Samplers and steps made before keep theirs. For a measurement
  that must see a run's first compiles (experiments/throughput.py's test)."""
  compilation_cache.SharedPrograms.forget_all()


def release_host_memory(staging: bool = False, programs: bool = False) -> None:
  """Drops JAX's tracing and lowering caches, keeping the compiled programs (with ``programs``, those too), and hands
  the C heap's free pages back to the OS (glibc ``malloc_trim(0)``; nothing where it is missing).

  Why (experiments/results/2026-12-03_main_job.md): XLA's CPU runtime frees a program's temporaries into glibc's
  arenas, which keep them (one main-job update: 6.2 GiB resident, 3.1 GiB after the trim), and JAX keeps every
  program's jaxpr and lowered module. `jax.clear_caches()` would drop the compiled programs too; after
  `_clear_staging_caches` a call with shapes seen before runs the program it has without tracing or compiling again
  (``tests/test_runtime.py``). Eager operations' small programs do compile again, so the caches are dropped only
  when a program of ``_LARGE_COMPILE_S`` or more was compiled (or read from the persistent compilation cache) since
  they last were, or when ``staging`` is True.
  Training and evaluation call this between phases, when no large program runs; the pages come back zeroed when
  next used.

  ``programs``: `jax.clear_caches`, for the end of a phase whose programs will not run again soon. A compiled program
  holds 20-100 MiB of host memory on a CPU (a SmolLM2 forward: about 25 MiB compiled, 30-100 MiB read back from the
  persistent cache; experiments/results/2026-12-07_programs_memory.md), so a process that keeps meeting new shapes
  (an evaluation's chunks: 7.3 -> 16.7 GiB over 23 chunks) grows by its programs; a program needed again is read back
  from the persistent compilation cache (or compiled where that is off).
  """
  global _large_at_clear
  if programs:
    jax.clear_caches()
    compilation_cache.PersistentProgram.forget_all()
  if staging or programs or _large_compiles > _large_at_clear:
    _large_at_clear = _large_compiles
    _clear_staging_caches()
  trim = _malloc_trim()
  if trim is not None:
    trim(0)


def host_memory_gib() -> dict[str, float]:
  """This process's resident set now and its peak so far, GiB (``/proc/self/statm`` and ``getrusage``; Linux
  reports the peak in KiB, macOS in bytes). Where there is no ``/proc`` the current figure is NaN; where there is no
  ``resource`` module (Windows) both are."""
  try:
    import resource  # POSIX only
  except ImportError:
    return {"memory/host_rss_gib": math.nan, "memory/host_peak_gib": math.nan}
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)
  try:
    with open("/proc/self/statm") as f:
      now = int(f.read().split()[1]) * resource.getpagesize() / 2**30
  except OSError:
    now = math.nan
  return {"memory/host_rss_gib": now, "memory/host_peak_gib": peak}


_COMPILE_EVENTS = "/jax/core/compile/"  # jaxpr trace, lowering to MLIR, backend compile (jax._src.dispatch)
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_MISSES = "/jax/compilation_cache/cache_misses"  # not there; counted where the new entry is written
# An XLA compile this long is a real model's program (a SmolLM2 sampler program: 2-13 s on a 2-core CPU, an update
# 10-40 s), not an eager operation's (about 0.01 s) or the tiny test model's (1-3 s, whose caches are small: dropping
# them after those made two resume tests 15% slower); each one leaves its jaxpr and lowered module in JAX's caches.
_LARGE_COMPILE_S = 3.0
OUTSIDE_PHASES = "other"  # `CompileClock.programs_by_phase_since`'s name for compiles outside any phase
_large_compiles = 0  # since import
_large_at_clear = 0  # _large_compiles when the caches were last dropped


def _count_large_compile(event: str, start: float, end: float, **_) -> None:
  global _large_compiles
  if event == _BACKEND_COMPILE and end - start >= _LARGE_COMPILE_S:
    _large_compiles += 1


jax.monitoring.register_event_time_span_listener(_count_large_compile)  # for release_host_memory, from import on


_COMPILE_TIME_SAVED = "/jax/compilation_cache/compile_time_saved_sec"  # a persistent-cache hit: its compile time less


def _count_large_load(event: str, duration: float, **_) -> None:
  """A large program read from the persistent cache counts as compiled: it traced and lowered as one that XLA
  compiled does (without this a warm run never dropped the caches: the τ² main job's second run peaked at 11.5 GiB
  against 8.5 GiB, experiments/results/2026-12-05_compile_cache.md)."""
  global _large_compiles
  # JAX's figure is the compile time less the read (close enough); PersistentProgram's its trace, lowering and compile
  if event in (_COMPILE_TIME_SAVED, compilation_cache.SAVED_EVENT) and duration >= _LARGE_COMPILE_S:
    _large_compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_large_load)


class CompileClock:
  """What JAX compiles while the clock listens: the seconds spent tracing, lowering and compiling (the time spans of
  ``jax.monitoring``'s compile events, merged so that nested ones, a jit traced inside another's trace, count once) and
  the programs XLA compiled or loaded from the persistent compilation cache (either way it stays resident), with how
  many of them the cache held (``hits``) and how many it lacked and then stored (``misses``: JAX counts a miss where it
  writes the entry). JAX's persistent cache saves only XLA's compile (``since(mark, backend_only=True)``); the
  samplers' and the update's programs (`compilation_cache.PersistentProgram`) a later run reads without tracing or
  lowering them, each read a span of its own (``LOAD_EVENT``: a program, a hit, and one of ``loads``).

      with CompileClock() as clock:
        mark = clock.mark()
        with clock.phase("rollout"):
          ...
        seconds, programs = clock.since(mark), clock.programs_since(mark)
        per_phase = clock.programs_by_phase_since(mark)  # {"rollout": n, ...}
  """

  def __init__(self):
    self._spans: list[tuple[float, float, bool, str]] = []  # (start, end, a backend compile, phase)
    self._phase = OUTSIDE_PHASES
    self._listening = True
    self.hits = self.misses = self.loads = 0
    jax.monitoring.register_event_time_span_listener(self._on_span)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_event(self, event: str, **_) -> None:
    if event == compilation_cache.JAX_CACHE_HITS:
      self.hits += 1
    elif event == _CACHE_MISSES:
      self.misses += 1

  def _on_span(self, event: str, start: float, end: float, **_) -> None:
    if event.startswith(_COMPILE_EVENTS):  # reported by the compiling thread, after the compile, inside its phase
      self._spans.append((start, end, event == _BACKEND_COMPILE, self._phase))
    elif event == compilation_cache.LOAD_EVENT:  # an executable read without tracing: a program, a cache hit
      self._spans.append((start, end, True, self._phase))
      self.hits += 1
      self.loads += 1

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    """Attributes what compiles inside the block to phase ``name`` (the innermost phase, when nested)."""
    outer, self._phase = self._phase, name
    try:
      yield
    finally:
      self._phase = outer

  def mark(self) -> int:
    return len(self._spans)

  def since(self, mark: int, backend_only: bool = False) -> float:
    """Compile seconds recorded after ``mark`` (overlapping spans merged); only XLA's backend compiles (or cache
    reads) with ``backend_only``."""
    total, end = 0.0, -float("inf")
    for s, e, *_ in sorted(span for span in self._spans[mark:] if span[2] or not backend_only):
      if e > end:
        total += e - max(s, end)
        end = e
    return total

  def programs_since(self, mark: int) -> int:
    """Programs XLA compiled (or loaded from the persistent cache) after ``mark``."""
    return sum(backend for _, _, backend, _ in self._spans[mark:])

  def programs_by_phase_since(self, mark: int) -> dict[str, int]:
    """`programs_since` split by `phase` (``OUTSIDE_PHASES`` for what compiled outside any); phases that compiled
    nothing are left out, so the values sum to ``programs_since(mark)``."""
    return dict(collections.Counter(phase for _, _, backend, phase in self._spans[mark:] if backend))

  def close(self) -> None:
    """Stops listening (the figures so far stay readable); a second call does nothing."""
    if self._listening:
      jax.monitoring.unregister_event_time_span_listener(self._on_span)
      jax.monitoring.unregister_event_listener(self._on_event)
      self._listening = False

  def __enter__(self) -> CompileClock:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def make_mesh(config) -> jax.sharding.Mesh:
  """The (data, fsdp, tensor) mesh of ``config.mesh`` over all devices."""
  return sharding.mesh_from_config(config.mesh)


def sampler_options(config) -> dict[str, int]:
  """The `Sampler` keyword arguments ``config.sampler`` sets (the prompt-chunk sizes: ``prefill_chunk``,
  ``min_bucket``), for every Sampler built from a config (rollouts and evaluation, ``--mode=demo``, the memory plan)."""
  return {"prefill_chunk": config.sampler.prefill_chunk, "min_bucket": config.sampler.min_bucket}


def make_sampler(config, model: Model, params: Any, mesh: jax.sharding.Mesh | None, rows: int) -> Sampler:
  """A Sampler over ``params``; on ``mesh`` only when it has more than one device and ``rows`` (the cache's batch:
  tasks x group_size, this process's share) splits evenly over its batch shards, else on one device, with a
  warning naming the values when the mesh is larger (the rollouts then run on one device of it)."""
  shards = sharding.batch_size_multiple(mesh) if mesh is not None else 1
  use_mesh = mesh if mesh is not None and mesh.size > 1 and rows % shards == 0 else None
  if mesh is not None and use_mesh is None and mesh.size > 1:
    axes = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in sharding.batch_axes())
    logging.warning(
      "sampler on one device of the %d-device mesh: its %d rows (tasks x group_size) do not split over the %d "
      "batch shards (%s); make the rows a multiple of %d to sample on the whole mesh",
      mesh.size, rows, shards, axes, shards,
    )  # fmt: skip
  tok = model.tokenizer
  return Sampler(
    model.config,
    params,
    eos_ids=tok.eos_ids if tok else (),
    token_bytes=tok.token_bytes() if tok else None,
    pad_id=(tok.pad_id or 0) if tok else 0,
    mesh=use_mesh,
    **sampler_options(config),
  )


def dataset_config(config) -> str:
  """The prepared-dataset config of ``config.env`` (`registry.Benchmark.source_config`)."""
  return registry.get(config.env.benchmark).source_config(config.env.domain, config.env.data_path)


def load_split(config, split: str) -> datasets.TaskSource:
  """Prepares (once, cached under ``config.env.data_dir``; process 0 first in a multi-process run) and opens one
  split of the configured benchmark."""
  name = dataset_config(config)
  benchmark, data_dir = config.env.benchmark, config.env.data_dir
  distributed.primary_first(f"prepare {benchmark} {name}", lambda: datasets.prepare(benchmark, name, data_dir))
  return datasets.load(config.env.benchmark, name, split, config.env.data_dir)


def _few(ids: list[str], n: int = 12) -> str:
  return ", ".join(ids[:n]) + (f", ... ({len(ids)} in all)" if len(ids) > n else "")


def _select(config, source: datasets.TaskSource, split: str, key: str) -> Sequence[Task]:
  """``source`` cut to the comma-separated ids of ``config.env.<key>`` (in the order given), or itself when empty.

  Raises:
    config_check.ConfigError: an id that is not in the split (the message lists the split's ids).
  """
  wanted = [s.strip() for s in config.env[key].split(",") if s.strip()]
  if not wanted:
    return source
  index = {source[i].id: i for i in range(len(source))}
  missing = [w for w in wanted if w not in index]
  if missing:
    where = f"{config.env.benchmark} {config.env.domain} split {split!r}"
    listed = _few(list(index))
    raise config_check.ConfigError([f"env.{key}: {', '.join(missing)} not in {where}; its tasks are {listed}"])
  return source.get_many(index[w] for w in dict.fromkeys(wanted))


def evaluation_tasks(config, n: int) -> list[Task]:
  """The held-out tasks: ``config.env.eval_split``, cut to ``config.env.eval_task_ids`` when it is set, then the first
  ``n`` (all of them when ``n`` is negative). ``train.eval_tasks`` and ``eval.tasks`` are the two ``n``.

  Raises:
    config_check.ConfigError: an id that is not in the split.
  """
  split = config.env.eval_split
  source = _select(config, load_split(config, split), split, "eval_task_ids")
  n = len(source) if n < 0 else min(n, len(source))
  return [source[i] for i in range(n)]


def training_tasks(config) -> Sequence[Task]:
  """The tasks training draws from: ``config.env.split``, cut to ``config.env.train_task_ids`` when it is set.

  Returns the split itself (a ``datasets.TaskSource``) or, with ids, a list of its tasks in the order given.

  Raises:
    config_check.ConfigError: an id that is not in the split (the message lists the split's ids), or
      ``train.tasks_per_step`` larger than the number of tasks kept.
  """
  source = _select(config, load_split(config, config.env.split), config.env.split, "train_task_ids")
  if config.train.tasks_per_step > len(source):
    raise config_check.ConfigError(
      [
        f"train.tasks_per_step={config.train.tasks_per_step} exceeds the {len(source)} training tasks; lower it"
        " (or keep more tasks in env.train_task_ids)"
      ]
    )
  return source
