"""``--mode=plan``: each device's memory for a training run, read from the compiled programs before any weight loads.

    python -m envace_jax.main --config=configs/tau2.py --mode=plan [--device_memory_gb=141] [--plan_backend=gpu]

Nothing is allocated and no weight is read: the model's shapes come from its preset or its ``config.json``
(`config.get_model_config`), every array is a ``jax.ShapeDtypeStruct``, and the jitted functions the run uses are
lowered with the run's mesh and shardings and compiled (``jax.jit(...).lower(...).compile()``), so the figures are
XLA's own (``memory_analysis()``: per device, after partitioning), compiled for the backend the plan runs on:

  * the rollout's sampler, as `rehearsal.unfold` allocates it: one policy cache of ``views × B × G`` rows (ACT,
    REHEARSE in rehearse mode, USER when the policy plays it) and a reference cache of ``B × G`` rows when the frozen
    reference plays the user. With ``opening_tokens`` = O > 0 each view's opening (system prompt, tool schemas, the
    task) is a prefix level of ``views × B`` rows of O slots (rounded up to a power of two, as `Sampler.fork` cuts
    it) that a task's G rollouts share, and each rollout's row owns the largest role capacity less O; with O = 0
    each row owns the largest role capacity. One prefill chunk (``sampler.prefill_chunk`` tokens) and the decode
    loop, reading the weights in the compute dtype (``config.dtype``);
  * the update, as `rl.grpo.make_update_step` runs it (``step.programs``, the very jitted functions): the
    micro-batch gradient program on one micro-batch of ``grpo.micro_batch_size`` rows of the longest view, the
    accumulator that adds it to the gradients of the earlier micro-batches (two gradient trees alive), and the
    program that normalises them and applies AdamW to the train state (donated).

Parts, per device, as the training loop holds them (`train.Trainer`): what persists (the reference in the compute
dtype, the train state as `rl.grpo.init_train_state` builds it and as the update leaves it, read with
``jax.eval_shape`` of that code, and the samplers' copy of the weights where they read another dtype or placement),
and each phase's buffers: the rollout (KV caches and the sampler's temporaries) and the update's three programs one
after another (each its inputs, outputs not aliased to a donated input, temporaries). The phases run one after the
other, so the peak is what persists plus the largest phase.

Where the plan compiles for another backend than the one it plans for (``backend``; e.g. a GPU run planned on a
CPU), the attention kernels differ: every program is also traced with `attention.backend` set to each of cpu, gpu
and tpu under `attention.recording`, which says which implementation each call (prefill, decode, the update's
training rows) takes; for gpu the cuDNN training call's ``[M, 1, T, T]`` bias and its gradient, which
``jax.nn.dot_product_attention`` always returns (``should_export_dbias``, jax/_src/cudnn/fused_attention_stablehlo.py),
are added as a part (analytic, one layer at a time under remat). The device's usable memory is JAX's pool: on a GPU
``XLA_CLIENT_MEM_FRACTION`` (or the deprecated ``XLA_PYTHON_CLIENT_MEM_FRACTION``; default 0.75) of the device's
memory (https://docs.jax.dev/en/latest/gpu_memory_allocation.html; jaxlib/xla_client.py reads them), or the
backend's own ``bytes_limit`` (``device.memory_stats()``) when no size is given and a device reports one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from envace_jax import config_check, runtime
from envace_jax import policy as policy_lib
from envace_jax.model import attention, transformer
from envace_jax.model import config as model_config
from envace_jax.model.roles import Role
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rl import batch as batch_lib
from envace_jax.rl import grpo
from envace_jax.sampling import sharding
from envace_jax.sampling.sampler import RowSampling, Sampler, next_pow2

GIB = 1024**3
BACKENDS = ("cpu", "gpu", "tpu")
GPU_MEM_FRACTION = 0.75  # JAX's default GPU pool (jax docs, "GPU memory allocation")
# The programs whose attention calls the plan records, and the kind of call each makes (`attention.Call.kind`).
TRACED = {"prefill (policy)": "prefill", "decode (policy)": "decode", "update: micro-batch gradient": "train"}
PHASES = ("rollout", "update: micro-batch", "update: accumulate", "update: apply")


@dataclasses.dataclass(frozen=True)
class Part:
  """One line of the plan: ``bytes`` on the device that holds the most of it, and what it is."""

  name: str
  bytes: int
  phase: str  # "persistent" or one of PHASES
  detail: str


def _abstract(tree: Any, shardings: Any = None, dtype: Any = None) -> Any:
  """``jax.ShapeDtypeStruct``s of ``tree``'s leaves (with ``shardings``' leaves where given; floating leaves in
  ``dtype`` where given)."""

  def one(x, s=None):
    cast = dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
    return jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype) if cast else x.dtype, sharding=s)

  if shardings is None:
    return jax.tree.map(one, tree)
  return jax.tree.map(one, tree, shardings)


def device_bytes(tree: Any, shardings: Any = None) -> int:
  """Bytes of ``tree`` (arrays or ShapeDtypeStructs) on the device holding the largest share: each leaf's shard
  shape under its sharding (``shardings`` leaves, or the leaf's own), whole where it has none."""
  leaves = jax.tree.leaves(tree)
  shard_list = jax.tree.leaves(shardings) if shardings is not None else [getattr(x, "sharding", None) for x in leaves]
  total = 0
  for x, s in zip(leaves, shard_list, strict=True):
    shape = s.shard_shape(x.shape) if s is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def _memory(compiled) -> dict[str, int]:
  stats = compiled.memory_analysis()
  names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
  return {name.removesuffix("_size_in_bytes"): int(getattr(stats, name, 0) or 0) for name in names}


def update_phases(
  micro: Mapping[str, int],
  add: Mapping[str, int],
  finish: Mapping[str, int],
  *,
  state: int,
  batch: int,
  accumulates: bool,
) -> dict[str, list[tuple[str, int, str]]]:
  """Each update program's buffers beyond what persists, from the programs' memory analyses (`_memory`).

  Args:
    micro, add, finish: the memory analyses of ``step.programs``' "micro", "add" and "finish" (bytes per device).
    state: bytes of the train state ``finish`` takes (persistent, donated). batch: bytes of the micro-batch ``micro``
      reads besides the parameters (which persist: the train state's).
    accumulates: the step has more than one micro-batch, so the gradients of the earlier ones are held while a
      micro-batch runs (``acc`` in ``make_update_step``'s ``step``).
  Returns:
    {phase: [(part name, bytes, detail)]} for "update: micro-batch", "update: accumulate" (only with
    ``accumulates``) and "update: apply".
  """
  grads = micro["output"]
  acc = [("gradient accumulator", grads, "the earlier micro-batches' gradients and sums, held")] if accumulates else []
  out = {
    "update: micro-batch": [
      *acc,
      ("micro-batch gradient", grads, "the program's output: gradients (the master weights' dtype) and sums"),
      ("micro-batch rows", batch, "the program's input besides the weights"),
      ("micro-batch temporaries", micro["temp"], "activations, their gradients, the stacked layers"),
    ],
    "update: apply": [
      ("summed gradient", finish["argument"] - state, "the apply program's input besides the state"),
      ("apply: new buffers", finish["output"] - finish["alias"], "outputs not written over the donated state"),
      ("apply temporaries", finish["temp"], "clipping, AdamW"),
    ],
  }
  if accumulates:
    out["update: accumulate"] = [
      ("gradient accumulator", grads, "held, donated to the sum"),
      ("micro-batch gradient", grads, "added to it"),
      ("accumulate: new buffers", add["output"] - add["alias"], "outputs not written over the accumulator"),
      ("accumulate temporaries", add["temp"], ""),
    ]
  return out


def gpu_memory_fraction() -> tuple[float, str]:
  """The fraction of a GPU's memory JAX's pool may use, and where it came from (the environment jaxlib reads:
  jaxlib/xla_client.py ``generate_pjrt_gpu_plugin_options``)."""
  if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
    return 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform: no pool"
  for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
    if os.environ.get(name):
      return float(os.environ[name]), f"{name}={os.environ[name]}"
  return GPU_MEM_FRACTION, "JAX's default pool; set XLA_CLIENT_MEM_FRACTION to change"


def usable_memory(device_memory_gb: float, backend: str) -> tuple[int | None, str]:
  """Bytes a run may hold on one device, and how that was found.

  Args:
    device_memory_gb: the device's memory in GB (10^9 bytes); 0: the ``bytes_limit`` JAX reports for the first
      device (GPU and TPU report one; a CPU none).
    backend: the backend planned for: on "gpu" JAX's pool is `gpu_memory_fraction` of the device.
  Returns:
    (bytes or None when unknown, a line saying which figure it is).
  """
  if device_memory_gb:
    size = int(device_memory_gb * 1e9)
    if backend == "gpu":
      fraction, source = gpu_memory_fraction()
      return int(size * fraction), f"{fraction:g} × {device_memory_gb:g} GB ({source})"
    return size, f"{device_memory_gb:g} GB (--device_memory_gb)"
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]), f"the backend's bytes_limit ({jax.devices()[0].device_kind})"
  return None, "unknown"


def _sampler_programs(sampler: Sampler, params, cache, num_new: int, sampling, stops: tuple[bytes, ...]):
  """The abstract arguments of one prefill chunk and of the decode loop over ``cache``: {name: (program, args)}."""
  b, capacity, chunk = cache.lengths.shape[0], cache.capacity, sampler.prefill_chunk
  rows = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct((b, *shape), dtype)  # noqa: E731
  vocab = sampler.config.vocab_size
  prefill = (params, cache, rows(vocab, dtype=jnp.float32), rows(chunk), rows(chunk), rows(chunk, dtype=bool), rows(),
             rows(dtype=bool), capacity)  # fmt: skip
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), b))
  state = jax.eval_shape(lambda c: sampler._initial_state(c, num_new, stops), cache).replace(cache=cache)
  until = jax.ShapeDtypeStruct((), jnp.int32)
  values = RowSampling(rows(dtype=bool), rows(dtype=jnp.float32), rows(dtype=jnp.float32))  # greedy, 1/T, top_p
  decode = (params, state, rows(), keys, rows(), until, values, sampling.top_k, stops, capacity, until)  # last: limit
  return {"prefill": (sampler._jit("prefill", cache), prefill), "decode": (sampler._jit("decode", cache), decode)}


def _compile(program, args) -> dict[str, int]:
  return _memory(program.lower(*args).compile())


def _cache(config, mesh, rows: int, capacity: int, openings: int, opening_tokens: int, min_bucket: int):
  """The abstract cache `rehearsal.unfold` forks: ``rows`` rows, and with ``opening_tokens`` a prefix level of
  ``openings`` rows (placed as `Sampler.fork` places it)."""

  def make(batch, slots):
    shape = jax.eval_shape(functools.partial(transformer.init_cache, config, batch, slots))
    return _abstract(shape, sharding.cache_shardings(config, mesh, shape) if mesh is not None else None)

  if not opening_tokens:
    return make(rows, capacity)
  prefix = make(openings, next_pow2(opening_tokens, min_bucket))
  return make(rows, capacity - opening_tokens).replace(prefix=prefix)


def _shared(cache, names: str, b: int) -> str:
  if cache.prefix is None:
    return ""
  return f", after openings of {names} × {b} rows × {cache.prefix.capacity} slots stored once for the G rollouts"


def kernels(traced: Mapping[str, tuple[Any, tuple]]) -> dict[str, dict[str, list[str]]]:
  """Which attention implementation each traced program's calls take, per backend.

  Each program is traced (``jax.eval_shape``: nothing compiles) with `attention.backend` set to each of `BACKENDS`
  under `attention.recording`. jit caches a traced program whatever that setting, so JAX's caches are cleared before
  each backend and after the last (what runs next traces afresh, for its own backend).

  Args:
    traced: {name: (jitted function, abstract arguments)}.
  Returns:
    {backend: {name: sorted "impl" or "impl (prefix levels, paged)" descriptions of its calls}}.
  """
  out: dict[str, dict[str, list[str]]] = {}
  try:
    for name in BACKENDS:
      out[name] = {}
      for program, (fn, args) in traced.items():
        jax.clear_caches()
        with attention.backend(name), attention.recording() as calls:
          fn.trace(*args)  # jax.eval_shape's own path for a jitted function (`PersistentProgram` passes it on)
        out[name][program] = sorted({_describe(c) for c in calls})
  finally:
    jax.clear_caches()
  return out


def _describe(call) -> str:
  over = [f"{call.prefix_levels} prefix level" + "s" * (call.prefix_levels > 1)] if call.prefix_levels else []
  over += ["pages"] if call.paged else []
  return f"{call.impl} ({call.kind}" + (" over " + ", ".join(over) if over else "") + ")"


def cudnn_bias_bytes(m: int, t: int, dtype: str) -> int:
  """Bytes of the cuDNN training call's mask bias ``dtype[M, 1, T, T]`` and its gradient (the same shape), one layer
  at a time (remat: each layer's backward runs alone): ``jax.nn.dot_product_attention`` turns a bool mask into the
  bias and cuDNN's backward always returns its gradient."""
  return 2 * m * t * t * jnp.dtype(dtype).itemsize


def plan(
  config, device_memory_gb: float = 0.0, opening_tokens: int = 0, backend: str = "", compare_openings: bool = False
) -> dict[str, Any]:
  """The per-device memory plan of ``config``'s training run (see the module docstring).

  Args:
    config: a run config (``configs/*.py``); validated first.
    device_memory_gb: the device's memory in GB (10^9 bytes), of which `usable_memory` takes what JAX may use; 0:
      the limit JAX reports for the first device (GPU, TPU), none on CPU.
    opening_tokens: tokens of each view's opening, shared by a task's G rollouts (0: none assumed).
    backend: the backend the run will use ("cpu", "gpu", "tpu"; "": the one this process has). The figures are
      compiled for this process's backend; for a GPU the cuDNN bias is added (`cudnn_bias_bytes`).
    compare_openings: with ``opening_tokens``, also compile the prefill over rows that own every slot (no
      openings), as "prefill (policy, no openings)" in ``programs``: what the shared prefix costs in temporaries.
  Returns:
    {"model", "devices", "backend", "compiled_for", "mesh" {axis: size}, "rows", "capacity", "micro_batches",
    "parts": [Part], "programs": {name: memory analysis}, "phases" {phase: bytes}, "persistent_bytes",
    "peak_bytes", "device_bytes" (None when unknown), "device_source", "fits" (None when unknown), "attention"
    {backend: {program: [calls]}}}.
  Raises:
    config_check.ConfigError: a bad config value, or an unknown ``backend``.
  """
  config_check.validate(config, weights=False)
  compiled_for = {"cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), jax.default_backend())
  backend = {"cuda": "gpu"}.get(backend, backend) or compiled_for
  if backend not in BACKENDS:
    raise config_check.ConfigError([f"plan backend={backend!r}: use one of {BACKENDS}."])
  source = config_check.weights_source(config)
  mc = model_config.get_model_config(source if source is not None else config.model, dtype=config.dtype)
  param_dtype = jnp.dtype(config.get("param_dtype", "float32")).name
  mc = mc.replace(param_dtype=param_dtype, attention=config.attention)
  ucfg = UnfoldConfig.from_config(config)
  gcfg = grpo.GrpoConfig.from_config(config)
  mesh = runtime.make_mesh(config)
  b, g = config.train.tasks_per_step, config.train.group_size
  n = b * g
  views = [Role.ACT] + ([Role.REHEARSE] if ucfg.env_mode == "rehearse" else [])
  if ucfg.user_mode == "policy":
    views.append(Role.USER)
  capacity = max(ucfg.capacity(r) for r in views)
  reference_user = runtime.reference_user(config)  # not where the benchmark's user turns are logged (the testbed)
  cached = views + ([Role.USER] if reference_user else [])  # the reference user's cache forks too
  if not 0 <= opening_tokens < min(ucfg.capacity(r) for r in cached):
    raise config_check.ConfigError(
      [f"opening_tokens={opening_tokens}: must be >= 0 and below every view's capacity (rollout.*_capacity)."]
    )
  parts: list[Part] = []
  programs: dict[str, dict[str, int]] = {}
  traced: dict[str, tuple[Any, tuple]] = {}
  compute = jnp.dtype(mc.dtype).name

  # Persistent: the reference (the initial weights, in the compute dtype, where the run holds one:
  # `runtime.holds_reference`), the train state, and the samplers' own copy of the policy where they read another
  # dtype or placement than the train state's.
  shards = sharding.batch_size_multiple(mesh)
  update_mesh = mesh if shards > 1 and gcfg.micro_batch_size % shards == 0 else None
  sample_cfg = mc.replace(scan_layers=False)
  on_mesh = mesh if mesh.size > 1 and n % shards == 0 else None  # as runtime.make_sampler places B×G rows
  sample_shapes = transformer.abstract_params(sample_cfg)
  sample_sh = sharding.param_shardings(sample_cfg, on_mesh) if on_mesh is not None else None
  compute_shapes = _abstract(sample_shapes, dtype=compute)
  placed = on_mesh is not None  # more than one device (a one-device mesh is none)
  holds = runtime.holds_reference(config)
  if holds and reference_user and placed:
    parts.append(Part("reference (the initial weights)", device_bytes(compute_shapes, sample_sh), "persistent",
                      f"{compute}, sharded like the reference user's sampler, which reads it"))  # fmt: skip
  elif holds and update_mesh is not None:  # runtime.initial_state builds it on the train state's parameter shardings
    ref_sh = sharding.param_shardings(sample_cfg, update_mesh)
    parts.append(Part("reference (the initial weights)", device_bytes(compute_shapes, ref_sh), "persistent",
                      f"{compute}, sharded like the train state's parameters"))  # fmt: skip
  elif holds:
    parts.append(Part("reference (the initial weights)", device_bytes(compute_shapes), "persistent",
                      f"{compute}, whole, on the default device"))  # fmt: skip
  state = jax.eval_shape(functools.partial(grpo.init_train_state, gcfg), sample_shapes)
  state_sh = grpo.train_state_shardings(mc, gcfg, update_mesh) if update_mesh is not None else None
  state_abstract = _abstract(state, state_sh)

  # The update, as make_update_step runs it: its own jitted programs on one micro-batch of the longest view.
  step = grpo.make_update_step(mc.replace(scan_layers=True), gcfg, mesh=update_mesh)
  m = gcfg.micro_batch_size
  t = batch_lib.bucket_length(capacity, gcfg.length_bucket)
  field = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct((m, *shape), dtype)  # noqa: E731
  mb = batch_lib.TrainBatch(
    tokens=field(t), roles=field(t), valid=field(t, dtype=bool), positions=field(t), segments=field(t),
    parents=field(t), loss_mask=field(t, dtype=bool), old_logprobs=field(t, dtype=jnp.float32),
    ref_logprobs=field(t, dtype=jnp.float32), row_role=field(), target_index=field(t), source_index=field(t),
    target_mask=field(t, dtype=bool), target_advantages=field(t, dtype=jnp.float32),
    target_weights=field(t, dtype=jnp.float32),
  )  # fmt: skip
  if update_mesh is not None:
    mb_sh = jax.tree.map(lambda s: jax.sharding.NamedSharding(update_mesh, jax.sharding.PartitionSpec(*s.spec[1:])),
                         grpo.train_batch_shardings(update_mesh))  # fmt: skip
    mb = _abstract(mb, mb_sh)
  micro_args = (state_abstract.params, mb)
  grads = step.programs["micro"].trace(*micro_args).out_info  # (gradients like the params, the sums)
  if update_mesh is not None:
    rep = sharding.replicated(update_mesh)
    grads = _abstract(grads, (state_sh.params, jax.tree.map(lambda _: rep, grads[1])))
  after = step.programs["finish"].trace(state_abstract, *grads).out_info[0]  # the state as the update leaves it
  held = after if device_bytes(after, state_sh) > device_bytes(state, state_sh) else state
  where = "sharded over the mesh" if update_mesh is not None else "on one device"
  policy = policy_lib.Policy.from_config(config)
  trees = f" × {len(policy.trees)} role trees" if policy.separate else ""
  shared = placed == (update_mesh is not None)
  dtypes = lambda tree: "/".join(sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree) if x.ndim}))  # noqa: E731
  grown = ""
  if held is after:
    grown = f"; {dtypes(state.opt_state)} at step 0, {dtypes(after.opt_state)} after the first update (a recompile)"
  parts.append(Part("train state: parameters", device_bytes(held.params, state_sh and state_sh.params), "persistent",
                    f"{dtypes(held.params)}, {where}{trees}"))  # fmt: skip
  opt = (held.opt_state, held.step)
  parts.append(Part("train state: AdamW moments", device_bytes(opt, state_sh and (state_sh.opt_state, state_sh.step)),
                    "persistent", f"{dtypes(held.opt_state)} (and the counts), {where}{trees}{grown}"))  # fmt: skip
  copies = not shared or compute != param_dtype
  for name in policy.sampler_names if copies else ():
    why = "placed unlike the train state" if not shared else f"read in {compute}"
    parts.append(Part(f"sampler copy: {name}", device_bytes(compute_shapes, sample_sh), "persistent",
                      f"{compute}, the sampler's weights ({why}), refreshed after each update"))  # fmt: skip

  # Stop strings are matched against a stand-in byte table (16 bytes per token; a few MB at most): no tokenizer loads.
  sampler = Sampler(sample_cfg, None, token_bytes=[b"\0" * 16] * sample_cfg.vocab_size, mesh=on_mesh,
                    **runtime.sampler_options(config))  # fmt: skip
  params_abstract = _abstract(sample_shapes, sample_sh, dtype=compute)

  # The rollout: the caches and the sampler's programs.
  rows = len(views) * n
  pad_to = shards if on_mesh is not None else 1
  rows += -rows % pad_to
  stops = tuple(sorted({s.encode() for r in views for s in ucfg.stop_strings(r)}))
  num_new = next_pow2(max(ucfg.max_new_tokens(r) for r in views), 1)
  cache = _cache(sample_cfg, on_mesh, rows, capacity, len(views) * b, opening_tokens, sampler.min_bucket)
  names = "+".join(r.name for r in views)
  # Dense own slots: the most pages can hold (a pool grows up to every row at the largest capacity); with
  # rollout.kv_page_size a view's own slots are pages, held as the rows need them.
  bound = "; pages as the rows need them, at most this" if ucfg.kv_page_size else ""
  parts.append(Part("KV cache: policy", device_bytes(cache), "rollout",
                    f"{rows} rows ({names} × {b}×{g}) × {cache.capacity} slots" + _shared(cache, names, b)
                    + f", {compute}{bound}"))  # fmt: skip
  policy_programs = _sampler_programs(sampler, params_abstract, cache, num_new, ucfg.sampling(Role.ACT), stops)
  for kind, (fn, args) in policy_programs.items():
    traced[f"{kind} (policy)"] = (fn, args)
    programs[f"{kind} (policy)"] = _compile(fn, args)
  if compare_openings and opening_tokens:
    alone = _cache(sample_cfg, on_mesh, rows, capacity, len(views) * b, 0, sampler.min_bucket)
    ref = _sampler_programs(sampler, params_abstract, alone, num_new, ucfg.sampling(Role.ACT), stops)
    programs["prefill (policy, no openings)"] = _compile(*ref["prefill"])
  rollout_temp = max(programs["prefill (policy)"]["temp"], programs["decode (policy)"]["temp"])
  if reference_user:
    ref_rows = n + (-n % pad_to)
    ref_cache = _cache(sample_cfg, on_mesh, ref_rows, ucfg.user_capacity, b, opening_tokens, sampler.min_bucket)
    parts.append(Part("KV cache: reference user", device_bytes(ref_cache), "rollout",
                      f"{ref_rows} rows × {ref_cache.capacity} slots" + _shared(ref_cache, "USER", b)))  # fmt: skip
    stops_user = tuple(s.encode() for s in ucfg.stop_strings(Role.USER))
    num_user = next_pow2(ucfg.user_max_new_tokens, 1)
    ref = _sampler_programs(sampler, params_abstract, ref_cache, num_user, ucfg.user_sampling, stops_user)
    programs["decode (reference user)"] = _compile(*ref["decode"])
  parts.append(Part("sampler temporaries", rollout_temp, "rollout", "the larger of prefill's and decode's"))

  # The update's programs, compiled.
  programs["update: micro-batch gradient"] = _compile(step.programs["micro"], micro_args)
  programs["update: accumulate"] = _compile(step.programs["add"], (grads, grads))
  programs["update: apply"] = _compile(step.programs["finish"], (state_abstract, *grads))
  traced["update: micro-batch gradient"] = (step.programs["micro"], micro_args)
  train_rows = len(views) * n  # at most: rows of a group's role pack on their shared prefix (rl/batch.py)
  phases = update_phases(
    programs["update: micro-batch gradient"], programs["update: accumulate"], programs["update: apply"],
    state=device_bytes(state_abstract), batch=device_bytes(mb),
    accumulates=train_rows > m,
  )  # fmt: skip
  calls = kernels(traced)
  if backend == "gpu" and compiled_for != "gpu" and any(c.startswith("cudnn") for c in
                                                          calls["gpu"]["update: micro-batch gradient"]):  # fmt: skip
    m_local = m // (shards if update_mesh is not None else 1)
    phases["update: micro-batch"].append((
      "cuDNN attention bias and its gradient", cudnn_bias_bytes(m_local, t, compute),
      f"analytic: {compute}[{m_local}, 1, {t}, {t}] twice, one layer at a time (not in the CPU-compiled figures)",
    ))  # fmt: skip
  for phase, lines in phases.items():
    for name, size, what in lines:
      size_note = f"; {m} rows × {t} tokens (remat per layer)" if name == "micro-batch temporaries" else ""
      parts.append(Part(name, size, phase, what + size_note))

  persistent = sum(p.bytes for p in parts if p.phase == "persistent")
  totals = {ph: sum(p.bytes for p in parts if p.phase == ph) for ph in PHASES if any(p.phase == ph for p in parts)}
  peak = persistent + max(totals.values())
  result = {
    "model": config.model if source is None else source,
    "devices": f"{mesh.size} × {backend}",
    "backend": backend,
    "compiled_for": compiled_for,
    "mesh": dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)),
    "batch": {"tasks": b, "group": g, "micro_batch": m, "micro_batch_tokens": t},
    "rows": rows,
    "capacity": capacity,
    "parts": parts,
    "programs": programs,
    "phases": totals,
    "persistent_bytes": persistent,
    "peak_bytes": peak,
    "attention": calls,
  }
  return with_memory(result, device_memory_gb)


def with_memory(result: Mapping[str, Any], device_memory_gb: float) -> dict[str, Any]:
  """`plan`'s ``result`` judged against a device of ``device_memory_gb`` GB (0: the limit JAX reports; `usable_memory`
  for ``result["backend"]``): a copy with "device_bytes", "device_source" and "fits" set. Nothing is compiled again.
  """
  limit, limit_source = usable_memory(device_memory_gb, result["backend"])
  fits = None if limit is None else result["peak_bytes"] <= limit
  return {**result, "device_bytes": limit, "device_source": limit_source, "fits": fits}


def format_plan(result: Mapping[str, Any]) -> str:
  """`plan`'s result as a table (GiB per device): the parts, each phase's total, the peak and the verdict against
  the usable memory (and which figure that is), and the attention kernel of each traced program per backend."""
  mesh = " × ".join(f"{k} {v}" for k, v in result["mesh"].items())
  bt = result["batch"]
  lines = [
    f"Memory plan per device: {result['model']} on {result['devices']} devices (mesh {mesh}), B×G = "
    f"{bt['tasks']}×{bt['group']}, micro-batches of {bt['micro_batch']} rows × {bt['micro_batch_tokens']} tokens; "
    f"figures from XLA's memory analysis of the programs compiled for {result['compiled_for']}, nothing allocated.",
    f"{'part':<42} {'phase':<20} {'GiB':>9}  what",
  ]
  for p in result["parts"]:
    lines.append(f"{p.name:<42} {p.phase:<20} {p.bytes / GIB:>9.3f}  {p.detail}")
  lines.append(f"{'persistent':<42} {'':<20} {result['persistent_bytes'] / GIB:>9.3f}")
  for phase, size in result["phases"].items():
    lines.append(f"{'phase total':<42} {phase:<20} {size / GIB:>9.3f}")
  peak = result["peak_bytes"] / GIB
  lines.append(f"{'peak (persistent + the largest phase)':<42} {'':<20} {peak:>9.3f}")
  limit = result["device_bytes"]
  if limit is None:
    lines.append("device memory unknown (JAX reports no limit for this backend): pass --device_memory_gb=N to compare")
  else:
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines.append(
      f"device memory {limit / GIB:.2f} GiB usable, {result['device_source']}: {verdict} "
      f"({100 * peak * GIB / limit:.0f}% of it)"
    )
  lines.append("attention kernel per call, by backend (traced with attention.backend):")
  for name, by_program in result["attention"].items():
    calls = "; ".join(f"{program}: {', '.join(impls) or 'no call'}" for program, impls in by_program.items())
    lines.append(f"  {name}: {calls}")
  return "\n".join(lines)


def as_json(result: Mapping[str, Any]) -> dict[str, Any]:
  """`plan`'s result with its parts as dicts (``json.dumps`` takes it)."""
  return {**result, "parts": [dataclasses.asdict(p) for p in result["parts"]]}


def run(config, device_memory_gb: float = 0.0, opening_tokens: int = 0, backend: str = "") -> dict[str, Any]:
  """``--mode=plan``: prints `format_plan` of `plan` and returns the result."""
  result = plan(config, device_memory_gb, opening_tokens, backend)
  print(format_plan(result))
  return result
