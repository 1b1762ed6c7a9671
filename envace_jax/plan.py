"""``--mode=plan``: each device's memory for a training run, read from the compiled programs before any weight loads.

    python -m envace_jax.main --config=configs/tau2.py --mode=plan [--device_memory_gb=141]

Nothing is allocated and no weight is read: the model's shapes come from its preset or its ``config.json``
(`config.get_model_config`), every array is a ``jax.ShapeDtypeStruct``, and the jitted functions the run uses are
lowered with the run's mesh and shardings and compiled (``jax.jit(...).lower(...).compile()``), so the figures are
XLA's own (``memory_analysis()``: per device, after partitioning):

  * the rollout's sampler, as `rehearsal.unfold` allocates it: one policy cache of ``views × B × G`` rows (ACT,
    REHEARSE in rehearse mode, USER when the policy plays it) and a reference cache of ``B × G`` rows when the frozen
    reference plays the user. With ``opening_tokens`` = O > 0 each view's opening (system prompt, tool schemas, the
    task) is a prefix level of ``views × B`` rows of O slots (rounded up to a power of two, as `Sampler.fork` cuts
    it) that a task's G rollouts share, and each rollout's row owns the largest role capacity less O; with O = 0
    each row owns the largest role capacity. One prefill chunk (``sampler.prefill_chunk`` tokens) and the decode
    loop;
  * the update step: the train state (parameters and AdamW's two moments) and one micro-batch of
    ``grpo.micro_batch_size`` rows of the longest view, compiled as one program (`rl.grpo.update_step`).

Parts, per device, as the training loop holds them (`train.Trainer`): what persists (the reference, the train state,
a sampler's own copy where it is placed unlike the train state) and each phase's KV caches and program temporaries
(activations, logits, the decode loop's carry). The rollout and the update run one after the other, so the peak is
what persists plus the larger phase.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from envace_jax import config_check, runtime
from envace_jax import policy as policy_lib
from envace_jax.model import config as model_config
from envace_jax.model import transformer
from envace_jax.model.roles import Role
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rl import batch as batch_lib
from envace_jax.rl import grpo
from envace_jax.sampling import sharding
from envace_jax.sampling.sampler import Sampler, next_pow2

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Part:
  """One line of the plan: ``bytes`` on the device that holds the most of it, and what it is."""

  name: str
  bytes: int
  phase: str  # "persistent", "rollout" or "update"
  detail: str


def _abstract(tree: Any, shardings: Any = None) -> Any:
  """``jax.ShapeDtypeStruct``s of ``tree``'s leaves (with ``shardings``' leaves where given)."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


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


def _sampler_programs(sampler: Sampler, params, cache, num_new: int, sampling, stops: tuple[bytes, ...]):
  """Compiled memory of one prefill chunk and the decode loop over ``cache`` (both abstract)."""
  b, capacity, chunk = cache.lengths.shape[0], cache.capacity, sampler.prefill_chunk
  rows = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct((b, *shape), dtype)  # noqa: E731
  vocab = sampler.config.vocab_size
  prefill = sampler._jit("prefill", cache).lower(
    params, cache, rows(vocab, dtype=jnp.float32), rows(chunk), rows(chunk), rows(chunk, dtype=bool), rows(),
    rows(dtype=bool), capacity,
  ).compile()  # fmt: skip
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), b))
  state = jax.eval_shape(lambda c: sampler._initial_state(c, num_new, stops), cache).replace(cache=cache)
  until = jax.ShapeDtypeStruct((), jnp.int32)
  decode = (
    sampler._jit("decode", cache).lower(params, state, rows(), keys, rows(), until, sampling, stops, capacity).compile()
  )
  return _memory(prefill), _memory(decode)


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


def plan(config, device_memory_gb: float = 0.0, opening_tokens: int = 0) -> dict[str, Any]:
  """The per-device memory plan of ``config``'s training run (see the module docstring).

  Args:
    config: a run config (``configs/*.py``); validated first.
    device_memory_gb: the device's memory in GB (10^9 bytes) to compare with; 0: the limit JAX reports for the
      first device (GPU, TPU), none on CPU.
    opening_tokens: tokens of each view's opening, shared by a task's G rollouts (0: none assumed).
  Returns:
    {"model", "devices", "mesh" {axis: size}, "rows", "capacity", "parts": [Part], "programs": {name: memory
    analysis}, "peak_bytes", "device_bytes" (None when unknown), "fits" (None when unknown)}.
  Raises:
    config_check.ConfigError: a bad config value.
  """
  config_check.validate(config, weights=False)
  source = config_check.weights_source(config)
  mc = model_config.get_model_config(source if source is not None else config.model, dtype=config.dtype)
  mc = mc.replace(param_dtype=jnp.dtype(config.get("param_dtype", "float32")).name, attention=config.attention)
  ucfg = UnfoldConfig.from_config(config)
  gcfg = grpo.GrpoConfig.from_config(config)
  mesh = runtime.make_mesh(config)
  b, g = config.train.tasks_per_step, config.train.group_size
  n = b * g
  views = [Role.ACT] + ([Role.REHEARSE] if ucfg.env_mode == "rehearse" else [])
  if ucfg.user_mode == "policy":
    views.append(Role.USER)
  capacity = max(ucfg.capacity(r) for r in views)
  if not 0 <= opening_tokens < min(ucfg.capacity(r) for r in views):
    raise config_check.ConfigError(
      [f"opening_tokens={opening_tokens}: must be >= 0 and below every view's capacity (rollout.*_capacity)."]
    )
  parts: list[Part] = []
  programs: dict[str, dict[str, int]] = {}

  # Persistent: the reference (the initial weights), the train state, and a sampler's own copy of the policy only
  # where its placement is not the train state's (`train.Trainer`: the samplers read the state's arrays).
  shards = sharding.batch_size_multiple(mesh)
  update_mesh = mesh if shards > 1 and gcfg.micro_batch_size % shards == 0 else None
  sample_cfg = mc.replace(scan_layers=False)
  on_mesh = mesh if mesh.size > 1 and n % shards == 0 else None  # as runtime.make_sampler places B×G rows
  sample_shapes = jax.eval_shape(functools.partial(transformer.init_params, sample_cfg), jax.random.key(0))
  sample_sh = sharding.param_shardings(sample_cfg, on_mesh) if on_mesh is not None else None
  placed = on_mesh is not None  # more than one device (a one-device mesh is none)
  if ucfg.user_mode == "reference" and placed:
    parts.append(Part("reference (the initial weights)", device_bytes(sample_shapes, sample_sh), "persistent",
                      "sharded like the reference user's sampler, which reads it"))  # fmt: skip
  else:
    parts.append(Part("reference (the initial weights)", device_bytes(sample_shapes), "persistent",
                      "whole, on the default device"))  # fmt: skip
  state = jax.eval_shape(functools.partial(grpo.init_train_state, gcfg), sample_shapes)
  state_sh = grpo.train_state_shardings(mc, gcfg, update_mesh) if update_mesh is not None else None
  where = "sharded over the mesh" if update_mesh is not None else "on one device"
  policy = policy_lib.Policy.from_config(config)
  trees = f" × {len(policy.trees)} role trees" if policy.separate else ""
  shared = placed == (update_mesh is not None)
  parts.append(Part("train state: parameters", device_bytes(state.params, state_sh and state_sh.params),
                    "persistent", where + trees + (", read by the policy's samplers" if shared else "")))  # fmt: skip
  parts.append(Part("train state: AdamW moments", device_bytes(state.opt_state, state_sh and state_sh.opt_state),
                    "persistent", where + trees))  # fmt: skip
  if not shared:
    for name in policy.sampler_names:
      parts.append(Part(f"sampler copy: {name}", device_bytes(sample_shapes, sample_sh), "persistent",
                        "the sampler is placed unlike the train state"))  # fmt: skip
  # Stop strings are matched against a stand-in byte table (16 bytes per token; a few MB at most): no tokenizer loads.
  sampler = Sampler(sample_cfg, None, token_bytes=[b"\0" * 16] * sample_cfg.vocab_size,
                    prefill_chunk=config.sampler.prefill_chunk, mesh=on_mesh)  # fmt: skip
  params_abstract = _abstract(sample_shapes, sample_sh)

  # The rollout: the caches and the sampler's programs.
  rows = len(views) * n
  pad_to = shards if on_mesh is not None else 1
  rows += -rows % pad_to
  stops = tuple(sorted({s.encode() for r in views for s in ucfg.stop_strings(r)}))
  num_new = next_pow2(max(ucfg.max_new_tokens(r) for r in views), 1)
  cache = _cache(sample_cfg, on_mesh, rows, capacity, len(views) * b, opening_tokens, sampler.min_bucket)
  names = "+".join(r.name for r in views)
  # Dense own slots, the layout on a mesh; off one, a view's own slots are pages (rollout.kv_page_size).
  bound = "; off a mesh, pages as the rows need them" if on_mesh is None and ucfg.kv_page_size else ""
  parts.append(Part("KV cache: policy", device_bytes(cache), "rollout",
                    f"{rows} rows ({names} × {b}×{g}) × {cache.capacity} slots" + _shared(cache, names, b)
                    + f", {jnp.dtype(mc.dtype).name}{bound}"))  # fmt: skip
  prefill, decode = _sampler_programs(sampler, params_abstract, cache, num_new, ucfg.sampling(Role.ACT), stops)
  programs["prefill (policy)"], programs["decode (policy)"] = prefill, decode
  rollout_temp = max(prefill["temp"], decode["temp"])
  if ucfg.user_mode == "reference":
    ref_rows = n + (-n % pad_to)
    ref_cache = _cache(sample_cfg, on_mesh, ref_rows, ucfg.user_capacity, b, opening_tokens, sampler.min_bucket)
    parts.append(Part("KV cache: reference user", device_bytes(ref_cache), "rollout",
                      f"{ref_rows} rows × {ref_cache.capacity} slots" + _shared(ref_cache, "USER", b)))  # fmt: skip
    stops_user = tuple(s.encode() for s in ucfg.stop_strings(Role.USER))
    num_user = next_pow2(ucfg.user_max_new_tokens, 1)
    _, ref_decode = _sampler_programs(sampler, params_abstract, ref_cache, num_user, ucfg.user_sampling, stops_user)
    programs["decode (reference user)"] = ref_decode
  parts.append(Part("sampler temporaries", rollout_temp, "rollout", "the larger of prefill's and decode's"))

  # The update: one micro-batch of the longest view.
  m = gcfg.micro_batch_size
  t = batch_lib.bucket_length(capacity, gcfg.length_bucket)
  field = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct((1, m, *shape), dtype)  # noqa: E731
  batch = batch_lib.TrainBatch(
    tokens=field(t), roles=field(t), valid=field(t, dtype=bool), positions=field(t), segments=field(t),
    parents=field(t), loss_mask=field(t, dtype=bool), old_logprobs=field(t, dtype=jnp.float32),
    ref_logprobs=field(t, dtype=jnp.float32), row_role=field(), target_index=field(t), source_index=field(t),
    target_mask=field(t, dtype=bool), target_advantages=field(t, dtype=jnp.float32),
  )  # fmt: skip
  program = _update_program(mc.replace(scan_layers=True), gcfg, update_mesh)
  update = _memory(program.lower(_abstract(state, state_sh), batch).compile())
  programs["update step"] = update
  parts.append(Part("update temporaries", update["temp"], "update",
                    f"activations and gradients of {m} rows × {t} tokens (remat per layer)"))  # fmt: skip

  persistent = sum(p.bytes for p in parts if p.phase == "persistent")
  phases = {ph: sum(p.bytes for p in parts if p.phase == ph) for ph in ("rollout", "update")}
  peak = persistent + max(phases.values())
  limit = int(device_memory_gb * 1e9) if device_memory_gb else _device_limit()
  return {
    "model": config.model if source is None else source,
    "devices": f"{mesh.size} × {jax.devices()[0].platform}",
    "mesh": dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)),
    "rows": rows,
    "capacity": capacity,
    "parts": parts,
    "programs": programs,
    "peak_bytes": peak,
    "device_bytes": limit,
    "fits": None if limit is None else peak <= limit,
  }


def _update_program(mc, gcfg, mesh):
  """`rl.grpo.update_step` jitted as one program, on ``mesh`` with the train state's and batch's shardings."""
  fn = functools.partial(grpo.update_step, mc, gcfg)
  if mesh is None:
    return jax.jit(fn)
  state_sh = grpo.train_state_shardings(mc, gcfg, mesh)
  batch_sh, rep = grpo.train_batch_shardings(mesh), sharding.replicated(mesh)
  return jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep))


def _device_limit() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def format_plan(result: Mapping[str, Any]) -> str:
  """`plan`'s result as a table (GiB per device) with the verdict."""
  mesh = " × ".join(f"{k} {v}" for k, v in result["mesh"].items())
  lines = [
    f"Memory plan per device: {result['model']} on {result['devices']} devices (mesh {mesh}); figures from the "
    "compiled programs (XLA's memory analysis), nothing allocated.",
    f"{'part':<42} {'phase':<10} {'GiB':>9}  what",
  ]
  for p in result["parts"]:
    lines.append(f"{p.name:<42} {p.phase:<10} {p.bytes / GIB:>9.3f}  {p.detail}")
  peak = result["peak_bytes"] / GIB
  lines.append(f"{'peak (persistent + the larger phase)':<42} {'':<10} {peak:>9.3f}")
  limit = result["device_bytes"]
  if limit is None:
    lines.append("device memory unknown (JAX reports no limit for this backend): pass --device_memory_gb=N to compare")
  else:
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines.append(f"device memory {limit / GIB:.2f} GiB: {verdict} ({100 * peak * GIB / limit:.0f}% of it)")
  return "\n".join(lines)


def run(config, device_memory_gb: float = 0.0, opening_tokens: int = 0) -> dict[str, Any]:
  """``--mode=plan``: prints `format_plan` of `plan` and returns the result."""
  result = plan(config, device_memory_gb, opening_tokens)
  print(format_plan(result))
  return result
