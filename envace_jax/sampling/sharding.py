"""The device mesh, and the logical-axis rules that place parameters, batches and KV caches on it.

One ``jax.sharding.Mesh`` with axes (data, fsdp, tensor) (docs/scaling.md). The model names every
parameter dimension with a logical axis (``transformer.logical_axes``: 'embed', 'heads', 'mlp', ...); the table
``LOGICAL_RULES`` below maps each logical name to a mesh axis (or to None: replicated), as MaxText does. Everything
here turns (logical names, shape, mesh, rules) into a ``NamedSharding``:

    mesh = make_mesh(data=-1, fsdp=1, tensor=2)          # -1: every remaining device
    params = shard_params(params, param_shardings(config, mesh))
    forward = sharded_apply(config, mesh)
    logits, cache = forward(params, tokens, roles, positions, cache, valid)

Any model places on any mesh (`logical_to_spec`): a dimension its mesh axes do not divide, or whose axes an earlier
dimension took, is replicated. SmolLM2's 9 query / 3 KV heads on tensor=2 replicate the heads and still shard the
rest; activations [batch, T, embed] shard batch over fsdp, so embed stays whole.

GSPMD (``jax.jit`` with explicit in/out shardings) propagates these placements through the scanned layers and
inserts the collectives; the mesh's axes are ``AxisType.Auto`` so no sharding is written into the array types.
Multi-host: call ``jax.distributed.initialize()`` first; ``jax.devices()`` then lists every process's devices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from envace_jax.config.choices import MESH_AXES
from envace_jax.model import paged, transformer
from envace_jax.model.config import ModelConfig

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

# Logical axis name -> mesh axis (or axes, or None: replicated). A name may appear more than once: the entries are
# tried in order and the first whose mesh axes are free and divide the dimension wins (MaxText's convention).
# Override by passing your own table to any function below.
LOGICAL_RULES: tuple[tuple[str, MeshAxes], ...] = (
  ("batch", ("data", "fsdp")),
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),
  ("head_dim", None),
  ("layers", None),
  ("roles", None),
  ("cache_sequence", None),
)

# Logical names of a stacked KV cache's v, dtype[L, B, K, S, H], and of its transposed k, dtype[L, B, K, H, S]; a
# per-layer cache drops the leading "layers".
CACHE_AXES = ("layers", "batch", "kv_heads", "cache_sequence", "head_dim")
K_CACHE_AXES = ("layers", "batch", "kv_heads", "head_dim", "cache_sequence")

_logged: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _logged:
    _logged.add(message)
    logging.info(message)


# ---------------------------------------------------------------------------------------------------------------------
# The mesh


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with axes ``MESH_AXES`` = (data, fsdp, tensor) over ``devices`` (default: ``jax.devices()``, all hosts).

  Args:
    data, fsdp, tensor: axis sizes; at most one may be -1, meaning "all remaining devices".
    devices: the devices to lay out; their number must equal the product of the sizes.
  Returns:
    A ``Mesh`` of shape (data, fsdp, tensor) with ``AxisType.Auto`` axes, laid out by ``jax.make_mesh`` (which
    orders devices by the physical topology on TPUs).
  Raises:
    ValueError: a size is neither positive nor -1, more than one size is -1, or the sizes do not multiply to the
      number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  for name, size in sizes.items():
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ValueError(f"mesh {name}={size!r}; each axis size must be a positive int, or -1 for the remaining devices.")
  fill = [name for name, size in sizes.items() if size == -1]
  if len(fill) > 1:
    raise ValueError(f"mesh sizes {sizes}: at most one axis may be -1 (all remaining devices), got {fill}.")
  fixed = math.prod(int(size) for size in sizes.values() if size != -1)
  if fill:
    if len(devices) % fixed:
      raise ValueError(
        f"mesh sizes {sizes}: the fixed axes multiply to {fixed}, which does not divide the {len(devices)} "
        f"devices, so {fill[0]}=-1 has no whole size."
      )
    sizes[fill[0]] = len(devices) // fixed
  shape = tuple(int(sizes[name]) for name in MESH_AXES)
  if math.prod(shape) != len(devices):
    raise ValueError(
      f"mesh sizes data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} = {math.prod(shape)} devices, but "
      f"{len(devices)} devices exist; make the sizes multiply to {len(devices)} (or set one to -1)."
    )
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def mesh_from_config(cfg: Mapping[str, Any] | Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """``make_mesh`` from a mapping or ml_collections ConfigDict with keys among data / fsdp / tensor.

  Missing keys take ``make_mesh``'s defaults (data=-1, fsdp=1, tensor=1).

  Raises:
    ValueError: a key other than data / fsdp / tensor (likely a typo), or any error of ``make_mesh``.
  """
  items = dict(cfg.items()) if hasattr(cfg, "items") else dict(cfg)
  unknown = sorted(set(items) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"mesh config has unknown keys {unknown}; the mesh axes are {MESH_AXES}.")
  return make_mesh(**items, devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
  """A sharding that puts a full copy of the array on every device of ``mesh``."""
  return NamedSharding(mesh, PartitionSpec())


# ---------------------------------------------------------------------------------------------------------------------
# Logical names -> shardings


def _as_axes(mesh_axes: MeshAxes) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def logical_to_spec(
  spec_or_names: PartitionSpec | Sequence[str | None],
  shape: Sequence[int],
  mesh: Mesh,
  rules: Rules = LOGICAL_RULES,
) -> PartitionSpec:
  """The mesh ``PartitionSpec`` for an array of ``shape`` whose dimensions carry logical names.

  Each dimension takes the first rule for its name whose mesh axes are not yet used by an earlier dimension and
  whose size product divides the dimension; if none qualifies the dimension is replicated (logged once at INFO).
  A trailing part of ``spec_or_names`` may be missing (replicated), as with PartitionSpec. The result always has
  one entry per dimension of ``shape``, so specs compare equal regardless of how they were written.

  Args:
    spec_or_names: a PartitionSpec or sequence of logical names (None: replicated), one per leading dimension.
    rules: (logical name, mesh axis | tuple of mesh axes | None) pairs; see ``LOGICAL_RULES``.
  Raises:
    ValueError: more names than dimensions, a name with no rule (map it to None to replicate), or a rule that
      names a mesh axis the mesh does not have.
  """
  names = tuple(spec_or_names)
  shape = tuple(shape)
  if len(names) > len(shape):
    raise ValueError(f"logical axes {names} have more entries than the array has dimensions (shape {shape}).")
  table: dict[str, list[tuple[str, ...]]] = {}
  for name, mesh_axes in rules:
    table.setdefault(name, []).append(_as_axes(mesh_axes))
  used: set[str] = set()
  out: list[MeshAxes] = []
  for dim, (name, size) in enumerate(zip(names + (None,) * (len(shape) - len(names)), shape, strict=True)):
    if name is None:
      out.append(None)
      continue
    if not isinstance(name, str):
      raise ValueError(f"logical axis {name!r} of {names} is not a name; nest mesh axes in the rules, not the spec.")
    if name not in table:
      raise ValueError(
        f"logical axis {name!r} has no rule in {[n for n, _ in rules]}; add ({name!r}, None) to replicate."
      )
    chosen: tuple[str, ...] = ()
    for mesh_axes in table[name]:
      missing = [a for a in mesh_axes if a not in mesh.shape]
      if missing:
        raise ValueError(f"rule {name!r} -> {mesh_axes} names mesh axes {missing} not in the mesh {dict(mesh.shape)}.")
      if not mesh_axes:
        break  # an explicit None rule: replicate
      if used.intersection(mesh_axes):
        _log_once(
          f"sharding: dim {dim} ({name!r}) of shape {shape} would reuse mesh axes "
          f"{sorted(used.intersection(mesh_axes))} already taken in {names}; trying the next rule or replicating."
        )
        continue
      devices = math.prod(mesh.shape[a] for a in mesh_axes)
      if size % devices:
        _log_once(
          f"sharding: dim {dim} ({name!r}) of size {size} in shape {shape} is not divisible by mesh axes "
          f"{mesh_axes} ({devices} devices); trying the next rule or replicating."
        )
        continue
      chosen = mesh_axes
      break
    used.update(chosen)
    out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return PartitionSpec(*out)


def logical_to_sharding(
  spec_or_names: PartitionSpec | Sequence[str | None],
  shape: Sequence[int],
  mesh: Mesh,
  rules: Rules = LOGICAL_RULES,
) -> NamedSharding:
  """``NamedSharding(mesh, logical_to_spec(...))``; see ``logical_to_spec`` for the rules and errors."""
  return NamedSharding(mesh, logical_to_spec(spec_or_names, shape, mesh, rules))


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def param_shardings(config: ModelConfig, mesh: Mesh, rules: Rules = LOGICAL_RULES) -> Any:
  """A tree like ``transformer.init_params(config, key)``'s whose leaves are ``NamedSharding``s.

  Computed from abstract shapes only (nothing is allocated), so it works for models larger than one device.

  Raises:
    ValueError: as ``logical_to_spec``.
  """
  axes = transformer.logical_axes(config)
  shapes = transformer.abstract_params(config)
  return jax.tree.map(lambda spec, x: logical_to_sharding(spec, x.shape, mesh, rules), axes, shapes, is_leaf=_is_spec)


def shard_params(params: Any, shardings: Any) -> Any:
  """Places every parameter per ``shardings`` (``jax.device_put``); the tree of arrays, now laid out on the mesh.

  Multi-host: every process must pass the same full values.

  Raises:
    ValueError: the two trees have different structures.
  """
  if jax.tree.structure(params) != jax.tree.structure(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)):
    raise ValueError(
      "params and shardings have different tree structures; build shardings with param_shardings() for the "
      "same config the params were made for."
    )
  return jax.device_put(params, shardings)


def cast(tree: Any, dtype: Any) -> Any:
  """``tree`` with its floating leaves in ``dtype``, each cast copy on the sharding of the leaf it copies (one jitted
  program with ``out_shardings``): how the samplers and the reference read float32 master weights in the compute
  dtype. ``tree`` itself, no copy, when every floating leaf already has that dtype.

  Args:
    tree: arrays (jax or numpy; a numpy leaf is placed on the default device first).
    dtype: e.g. "bfloat16" (a ``ModelConfig.dtype``).
  """
  dtype = jnp.dtype(dtype)
  leaves, treedef = jax.tree.flatten(tree)
  if all(x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in leaves):
    return tree
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
  return jax.tree.unflatten(treedef, _cast_program(dtype.name, tuple(x.sharding for x in leaves))(leaves))


@functools.lru_cache(maxsize=16)
def _cast_program(dtype: str, shardings: tuple[jax.sharding.Sharding, ...]):
  def run(leaves):
    return [x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]

  return jax.jit(run, out_shardings=list(shardings))


def batch_size_multiple(mesh: Mesh, rules: Rules = LOGICAL_RULES) -> int:
  """N, the number of batch shards: the product of the mesh axes of the first 'batch' rule (1 if none)."""
  for name, mesh_axes in rules:
    if name == "batch":
      return math.prod(mesh.shape[a] for a in _as_axes(mesh_axes))
  return 1


def batch_axes(rules: Rules = LOGICAL_RULES) -> tuple[str, ...]:
  """The mesh axes of the first 'batch' rule (empty if none): what rows split over."""
  return next((_as_axes(m) for n, m in rules if n == "batch"), ())


def paged_shards(mesh: Mesh, rules: Rules = LOGICAL_RULES) -> paged.Shards:
  """The shards of a paged cache on ``mesh``: its rows and pages split over the batch axes (`paged.Shards`)."""
  return paged.Shards(mesh, batch_axes(rules))


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = LOGICAL_RULES) -> NamedSharding:
  """The sharding of an array of rank ``ndim`` whose leading axis is the batch (split per the 'batch' rule).

  The batch must be a multiple of ``batch_size_multiple(mesh, rules)``; other dimensions are replicated.
  """
  if ndim < 1:
    raise ValueError(f"batch_sharding needs an array with a leading batch axis, got ndim={ndim}.")
  axes = batch_axes(rules)
  lead = None if not axes else axes[0] if len(axes) == 1 else axes
  return NamedSharding(mesh, PartitionSpec(lead, *([None] * (ndim - 1))))


def cache_shardings(
  config: ModelConfig, mesh: Mesh, cache: transformer.KVCache, rules: Rules = LOGICAL_RULES
) -> transformer.KVCache:
  """A ``KVCache`` whose fields are ``NamedSharding``s: k by ``K_CACHE_AXES``, v by ``CACHE_AXES``, lengths on the
  batch; its ``prefix`` levels likewise (a level whose rows do not split over the batch shards is replicated over
  them: `logical_to_spec`). For a `paged.PagedKVCache` (of ``paged_shards(mesh, rules)``), a PagedKVCache whose
  pools' pages, table and lengths split over the batch axes (each shard holds its rows' pages: `paged.Shards`), its
  prefix levels as above.

  Args:
    config: the model's config (checks the cache's layer and head counts).
    cache: a KVCache, or one of ``jax.ShapeDtypeStruct``s; only shapes are read. v: [L, B, K, S, H] (stacked) or
      a tuple of L [B, K, S, H] (per layer); k the same with S and H swapped.
  Raises:
    ValueError: the cache's shape does not match ``config``.
  """
  lengths = logical_to_sharding(("batch",), tuple(cache.lengths.shape), mesh, rules)
  if isinstance(cache, paged.PagedKVCache):
    shards = paged_shards(mesh, rules)
    if cache.shards != shards or cache.lengths.shape[0] % shards.count or cache.pools[0].shape[0] % shards.count:
      raise ValueError(
        f"a paged cache of {cache.lengths.shape[0]} rows and {cache.pools[0].shape[0]} pages split over "
        f"{cache.shards} cannot lie on {shards.count} batch shards {shards.axes} of mesh {dict(mesh.shape)}."
      )
    rows = NamedSharding(mesh, shards.spec)
    prefix = None if cache.prefix is None else cache_shardings(config, mesh, cache.prefix, rules)
    return cache.replace(pools=(rows,) * len(cache.pools), table=rows, lengths=rows, prefix=prefix)
  per_layer = isinstance(cache.v, tuple)
  shape = tuple(cache.v[0].shape) if per_layer else tuple(cache.v.shape)
  layers = len(cache.v) if per_layer else shape[0]
  inner = shape if per_layer else shape[1:]
  k_heads, head_dim = config.num_kv_heads, config.head_dim
  if layers != config.num_layers or len(inner) != 4 or (inner[1], inner[3]) != (k_heads, head_dim):
    raise ValueError(
      f"cache v has {layers} layers of shape {inner}; expected {config.num_layers} layers of "
      f"[B, K={k_heads}, S, H={head_dim}]."
    )
  k_shape = (*shape[:-2], shape[-1], shape[-2])
  if per_layer:
    k = logical_to_sharding(K_CACHE_AXES[1:], k_shape, mesh, rules)
    v = logical_to_sharding(CACHE_AXES[1:], shape, mesh, rules)
    prefix = None if cache.prefix is None else cache_shardings(config, mesh, cache.prefix, rules)
    return transformer.KVCache(k=(k,) * layers, v=(v,) * layers, lengths=lengths, prefix=prefix)
  k = logical_to_sharding(K_CACHE_AXES, k_shape, mesh, rules)
  v = logical_to_sharding(CACHE_AXES, shape, mesh, rules)
  return transformer.KVCache(k=k, v=v, lengths=lengths)


def init_sharded_cache(
  config: ModelConfig, mesh: Mesh, batch: int, capacity: int, dtype: Any = None, rules: Rules = LOGICAL_RULES
) -> transformer.KVCache:
  """``transformer.init_cache`` allocated directly in place on the mesh (no full copy on any single device).

  Returns:
    KVCache laid out for ``config.scan_layers`` (see ``transformer.KVCache``), zeros, lengths int32[batch],
    sharded per ``cache_shardings``.
  Raises:
    ValueError: ``batch`` is not a multiple of ``batch_size_multiple(mesh, rules)``.
  """
  _check_batch(batch, mesh, rules)
  make = functools.partial(transformer.init_cache, config, batch, capacity, dtype)
  shardings = cache_shardings(config, mesh, jax.eval_shape(make), rules)
  return jax.jit(make, out_shardings=shardings)()


def _check_batch(batch: int, mesh: Mesh, rules: Rules) -> None:
  n = batch_size_multiple(mesh, rules)
  if batch % n:
    raise ValueError(
      f"batch size {batch} is not divisible by the {n} batch shards of mesh {dict(mesh.shape)}; pad the batch to a "
      f"multiple of {n} (mark the padded rows valid=False and ignore their outputs)."
    )


# ---------------------------------------------------------------------------------------------------------------------
# The sharded forward pass


def sharded_apply(config: ModelConfig, mesh: Mesh, rules: Rules = LOGICAL_RULES):
  """``transformer.apply`` jitted with explicit shardings on ``mesh``.

  Returns:
    ``f(params, tokens, roles=None, positions=None, cache=None, valid=None) -> (logits, cache)`` with the shapes of
    ``transformer.apply`` (the cache laid out for ``config.scan_layers``). Params are expected laid out per
    ``param_shardings(config, mesh, rules)`` (use ``shard_params``; uncommitted host arrays are also accepted); the
    inputs and logits are split on the batch, the cache per ``cache_shardings``. One compiled function per (input
    shapes, which optional inputs are given), as with any ``jax.jit``.
  Raises (when f is called):
    ValueError: B is not a multiple of the number of batch shards (pad the batch).
  """
  p_shardings = param_shardings(config, mesh, rules)
  forward = functools.partial(transformer.apply, config)

  @functools.cache
  def jitted(ndim_tokens: int, cache_shape: tuple[tuple[int, ...], tuple[int, ...]] | None):
    rows = batch_sharding(mesh, ndim_tokens, rules)
    logits = batch_sharding(mesh, ndim_tokens + 1, rules)
    c_shardings = None
    if cache_shape is not None:
      v_shape, lengths_shape = cache_shape  # only shapes are read: one layer's v [B, K, S, H]
      k_shape = (*v_shape[:-2], v_shape[-1], v_shape[-2])
      lengths = jax.ShapeDtypeStruct(lengths_shape, np.int32)
      if config.scan_layers:
        k, v = (jax.ShapeDtypeStruct((config.num_layers, *shape), np.float32) for shape in (k_shape, v_shape))
      else:
        k, v = ((jax.ShapeDtypeStruct(shape, np.float32),) * config.num_layers for shape in (k_shape, v_shape))
      c_shardings = cache_shardings(config, mesh, transformer.KVCache(k=k, v=v, lengths=lengths), rules)
    return jax.jit(
      forward,
      in_shardings=(p_shardings, rows, rows, rows, c_shardings, rows),
      out_shardings=(logits, c_shardings),
    )

  def f(params, tokens, roles=None, positions=None, cache=None, valid=None):
    _check_batch(tokens.shape[0], mesh, rules)
    cache_shape = None if cache is None else (tuple(cache.v[0].shape), tuple(cache.lengths.shape))
    return jitted(len(tokens.shape), cache_shape)(params, tokens, roles, positions, cache, valid)

  f.jitted = jitted  # for inspection: f.jitted(tokens.ndim, None or (v[0].shape, lengths.shape)).lower(...).compile()
  return f
