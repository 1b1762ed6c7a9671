"""The KV cache of `transformer.apply` and the pieces of a softmax split over several key sets.

`softmax_part` / `combine` / `merge_parts` compute attention over the union of key sets (a row's own slots, its
`KVCache` prefix levels, its pages in `paged.py`) by log-sum-exp, the merge FlashAttention's online softmax uses.
Both `transformer.py` and `paged.py` import this module; it imports neither.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envace_jax.model.config import ModelConfig

# A large negative logit for masked attention; finite, so a query with no visible key gives no NaN.
MASKED = -1e30


@struct.dataclass
class KVCache:
  """Keys and values of every layer with a static capacity, and the filled length of each sequence; optionally the
  continuation of a shorter cache of shared prefixes (``prefix``), whose storage its rows share instead of copying.

  Attributes:
    k: rotary-embedded keys, transposed: dtype[L, B, K, H, S] for a scanned model, a tuple of L dtype[B, K, H, S]
      otherwise.
    v: values: dtype[L, B, K, S, H], or a tuple of L dtype[B, K, S, H].
    lengths: int32[B], number of filled slots of each sequence (slots 0..lengths-1 hold its own tokens).
    prefix: None, or a KVCache of P rows (P divides B, per-layer layout) whose row ``b // (B // P)`` holds what
      precedes row b's own slots: row b's history is its prefix row's history (prefixes nest), then its own slots.
      The G rows that continue one prefix attend over it together (`_attend_prefix`), so its keys and values are
      stored and read once per step, not once per row (Hydragen, Juravsky et al. 2024; cascade attention).
  """

  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  lengths: jax.Array
  prefix: KVCache | None = None

  @property
  def capacity(self) -> int:
    """S, the number of own slots per sequence (a prefix's tokens are not counted)."""
    return self.v[0].shape[2]  # layer 0 of v: [B, K, S, H] in both layouts

  def row_capacity(self) -> jax.Array:
    """int32[B]: the own slots each row may fill (S for every row here; a paged row's own, `paged.PagedKVCache`)."""
    return jnp.full(self.lengths.shape, self.capacity, jnp.int32)

  def levels(self) -> list[KVCache]:
    """The prefix chain, nearest first (empty without a prefix)."""
    chain, level = [], self.prefix
    while level is not None:
      chain.append(level)
      level = level.prefix
    return chain

  def offsets(self) -> jax.Array:
    """int32[B]: tokens each row's prefixes hold before its own slots (0 without a prefix)."""
    b = self.lengths.shape[0]
    total = jnp.zeros((b,), jnp.int32)
    for level in self.levels():
      total = total + jnp.repeat(level.lengths, b // level.lengths.shape[0], total_repeat_length=b)
    return total

  def filled(self) -> jax.Array:
    """int32[B]: each row's whole history in tokens, its prefixes' included."""
    return self.offsets() + self.lengths

  def host_filled(self) -> np.ndarray:
    """`filled` computed on the host (int32[B], NumPy) from the levels' lengths: the rollout's bookkeeping reads it
    between calls, where the device form would compile a program per batch and prefix shape."""
    return self.host_offsets() + np.asarray(jax.device_get(self.lengths), np.int32)

  def host_offsets(self) -> np.ndarray:
    """`offsets` computed on the host (int32[B], NumPy; see `host_filled`)."""
    b = self.lengths.shape[0]
    total = np.zeros(b, np.int32)
    for level in self.levels():
      lengths = np.asarray(jax.device_get(level.lengths), np.int32)
      total += np.repeat(lengths, b // lengths.shape[0])
    return total

  def host_row_capacity(self) -> np.ndarray:
    """`row_capacity` on the host (int32[B], NumPy)."""
    return np.full(self.lengths.shape, self.capacity, np.int32)

  def stored_slots(self) -> int:
    """Slots allocated for keys (one per token position per row, per layer), this cache's and its prefixes'."""
    return sum(c.lengths.shape[0] * c.capacity for c in (self, *self.levels()))

  def flatten(self) -> KVCache:
    """The same histories as a cache without prefix (each row's prefixes copied in front of its own slots), with
    capacity = the most slots any row's history spans (prefix capacities + own). For inspection and tests."""
    if self.prefix is None:
      return self
    b = self.lengths.shape[0]
    parts = [*reversed(self.levels()), self]  # root first
    capacity = sum(c.capacity for c in parts)
    stacked = not isinstance(self.k, tuple)
    if stacked:
      raise ValueError("flatten: a cache with a prefix is laid out per layer (scan_layers=False).")
    k = [jnp.zeros((b, *self.k[0].shape[1:3], capacity), self.k[0].dtype) for _ in self.k]
    v = [jnp.zeros((b, self.v[0].shape[1], capacity, self.v[0].shape[3]), self.v[0].dtype) for _ in self.v]
    start = jnp.zeros((b,), jnp.int32)
    for part in parts:
      rows = jnp.arange(b) // (b // part.lengths.shape[0])
      slots = jnp.arange(part.capacity)
      target = jnp.where(slots[None, :] < part.lengths[rows][:, None], start[:, None] + slots[None, :], capacity)
      r = jnp.arange(b)[:, None, None]
      heads = jnp.arange(self.v[0].shape[1])[None, :, None]
      for i in range(len(k)):
        k[i] = k[i].at[r, heads, :, target[:, None, :]].set(jnp.swapaxes(part.k[i][rows], 2, 3), mode="drop")
        v[i] = v[i].at[r, heads, target[:, None, :]].set(part.v[i][rows], mode="drop")
      start = start + part.lengths[rows]
    return KVCache(k=tuple(k), v=tuple(v), lengths=start)

  def take(self, rows: Any) -> KVCache:
    """Row i of the result is row ``rows[i]`` of this cache (int[B'] indices; a row may be taken several times),
    or an empty row (zeros, length 0) where ``rows[i]`` is B or more. Raises ValueError for a cache with a prefix."""
    if self.prefix is not None:
      raise ValueError("take copies rows of a cache without prefix.")
    stacked = not isinstance(self.k, tuple)
    index = jnp.asarray(rows, jnp.int32)
    take = lambda x, axis: jnp.take(x, index, axis=axis, mode="fill", fill_value=0)  # noqa: E731
    kv = lambda x: take(x, 1 if stacked else 0)  # noqa: E731
    return KVCache(k=jax.tree.map(kv, self.k), v=jax.tree.map(kv, self.v), lengths=take(self.lengths, 0))

  def gather(self, rows: jax.Array, capacity: int, grouped: bool = False) -> KVCache:
    """A cache of B' = len(rows) rows holding the histories of rows ``rows`` (int32[B']; B or more: an empty row):
    their first ``capacity`` own slots, and a copy of each prefix level's row for each, so that row i continues level
    row i. With ``grouped`` (``rows`` whole groups of rows that share a root-level row, see `gather_levels`) each
    level's row is copied once per group instead. For work on a few rows of a large batch (`Sampler.prefill`,
    `Stream.advance`); `put` writes the own slots back. Per-layer layout only (ValueError otherwise)."""
    if not isinstance(self.k, tuple):
      raise ValueError("gather: a cache laid out per layer (scan_layers=False).")
    rows = jnp.asarray(rows, jnp.int32)
    levels = gather_levels(self, rows, grouped)
    return self.replace(prefix=None).take(rows).trimmed(capacity).replace(prefix=levels)

  def put(self, rows: jax.Array, part: KVCache) -> KVCache:
    """This cache with the own slots and lengths of ``part`` (from ``gather(rows, capacity)``, then written) in rows
    ``rows`` (B or more: dropped); prefix levels untouched (read-only)."""
    rows = jnp.asarray(rows, jnp.int32)
    n = part.capacity
    k = tuple(x.at[rows, :, :, :n].set(y, mode="drop") for x, y in zip(self.k, part.k, strict=True))
    v = tuple(x.at[rows, :, :n].set(y, mode="drop") for x, y in zip(self.v, part.v, strict=True))
    return self.replace(k=k, v=v, lengths=self.lengths.at[rows].set(part.lengths, mode="drop"))

  def trimmed(self, capacity: int) -> KVCache:
    """This cache's first ``capacity`` slots (every row's filled ones: the caller checks), prefix kept."""
    stacked = not isinstance(self.k, tuple)
    k = jax.tree.map(lambda x: x[..., :capacity], self.k)
    v = jax.tree.map(lambda x: x[:, :, :, :capacity] if stacked else x[:, :, :capacity], self.v)
    return self.replace(k=k, v=v)


def finest_group(cache) -> int:
  """R: how many consecutive rows of a cache (a `KVCache` or `paged.PagedKVCache`) share every prefix level's row,
  B / the most rows any level has (B without a prefix)."""
  return cache.lengths.shape[0] // max((level.lengths.shape[0] for level in cache.levels()), default=1)


def gather_levels(cache, rows: jax.Array, grouped: bool = False) -> KVCache | None:
  """The prefix chain of a cache (a `KVCache` or `paged.PagedKVCache`) for B' = len(rows) rows that continue its rows
  ``rows`` (int32[B']), nested as in the cache; None without a prefix.

  Each level's row for each of the B' rows, copied; or with ``grouped``, once per group: when ``rows`` lists whole
  groups of the rows that share every level's row (runs of R = B / L consecutive rows starting at a multiple of R, L
  the most rows any level has; padding runs of B or more), every gathered level has B' / R rows, row j the one its
  j-th group continues, so R times fewer slots are copied (`Sampler.prefill`)."""
  b = cache.lengths.shape[0]
  levels = cache.levels()
  group = finest_group(cache)
  prefix = None
  for level in reversed(levels):  # root first: each level becomes the prefix of the one below it
    ratio = b // level.lengths.shape[0]
    index = rows[::group] // ratio if grouped else rows // ratio
    prefix = level.replace(prefix=None).take(index).replace(prefix=prefix)
  return prefix


def init_cache(config: ModelConfig, batch: int, capacity: int, dtype: Any = None) -> KVCache:
  """An empty KV cache of ``capacity`` slots per row, laid out for ``config.scan_layers`` (see KVCache).

  dtype defaults to the config's compute dtype.
  """
  k_shape = (batch, config.num_kv_heads, config.head_dim, capacity)
  v_shape = (batch, config.num_kv_heads, capacity, config.head_dim)
  dtype = dtype or config.dtype
  if config.scan_layers:
    zeros = lambda shape: jnp.zeros((config.num_layers, *shape), dtype)
  else:
    zeros = lambda shape: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
  # k and v must be distinct buffers: the sampler donates both.
  return KVCache(k=zeros(k_shape), v=zeros(v_shape), lengths=jax.device_put(np.zeros((batch,), np.int32)))


def softmax_part(scores, visible, v, spec: str):
  """One key set's share of a softmax over several: (running max [..], sum of exp [..], float32 weighted values
  [.., H]) for float32 ``scores`` [.., S] masked by ``visible``, values contracted by the einsum ``spec``."""
  scores = jnp.where(visible, scores, MASKED)
  best = scores.max(axis=-1)
  probs = jnp.where(visible, jnp.exp(scores - best[..., None]), 0.0)
  return best, probs.sum(axis=-1), jnp.einsum(spec, probs.astype(v.dtype), v, preferred_element_type=jnp.float32)


def combine(a, b):
  """Two `softmax_part` triples as one over the union of their key sets (the log-sum-exp merge)."""
  best = jnp.maximum(a[0], b[0])
  scale_a, scale_b = jnp.exp(a[0] - best), jnp.exp(b[0] - best)
  return best, a[1] * scale_a + b[1] * scale_b, a[2] * scale_a[..., None] + b[2] * scale_b[..., None]


def merge_parts(parts, dtype):
  """Softmax attention over the union of the parts' key sets, from their `softmax_part` triples."""
  _, total, acc = functools.reduce(combine, parts)
  return (acc / jnp.where(total > 0, total, 1.0)[..., None]).astype(dtype)
