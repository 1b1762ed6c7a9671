"""Paged KV storage: rows own fixed-size pages of one pool as they grow, share full pages after a fork, and give them
back when they end, so storage follows the distinct tokens (PagedAttention, Kwon et al. 2023; the layout of the ragged
paged attention kernel JAX ships for TPU, `jax.experimental.pallas.ops.tpu.ragged_paged_attention`).

Shapes (P pages in the pool, Z slots per page, B rows, W pages a call reads per row, T new tokens, K KV heads,
N query heads, G = N / K, H head dim):

    pool       dtype[P, Z, 2K, H]   one layer's pages; keys at even combined heads, values at odd (the kernel's layout)
    table      int32[B, W]          a row's pages in slot order: row b's slot s is offset s % Z of page table[b, s // Z]
    kv_lens    int32[B]             filled slots per row (after the call's writes)
    q_slots    int32[B, T]          each query's own slot; it sees the row's slots <= its own

A page that is only partly filled belongs to one row: `PagePool.fork` shares a row's full pages (a reference count
per page) and copies its last, partial page, so a fork's writes never touch another row's slots. A table's unused
entries hold P, no page: a write there is dropped (a row never writes into pages it does not hold) and reads of it
are masked (slots a row has not filled are never attended).

`attention_part` is the reference attention over paged rows, on every backend; `attention` uses the TPU kernel where
it applies (`kernel_applies`) and the reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envace_jax.model import transformer  # attribute access at call time: transformer imports this module


@struct.dataclass
class PagedKVCache:
  """A KV cache whose own slots live in pages (`transformer.apply` takes it where it takes a `transformer.KVCache`).

  Attributes:
    pools: a tuple of L dtype[P, Z, 2K, H], one pool per layer (`init_pool`); every layer uses the same pages.
    table: int32[B, W], each row's pages (`PagePool.table`); W pages are read per row by a call, so W bounds the
      slots a row may hold after it (W * Z).
    lengths: int32[B], filled own slots per row.
    prefix: None, or a dense `transformer.KVCache` of shared prefix levels, as `KVCache.prefix`.
  """

  pools: tuple[jax.Array, ...]
  table: jax.Array
  lengths: jax.Array
  prefix: transformer.KVCache | None = None

  def levels(self):
    return transformer.KVCache.levels(self)

  def offsets(self):
    return transformer.KVCache.offsets(self)


def init_cache(config, pool: PagePool, rows: Sequence[object], width: int, dtype=None) -> PagedKVCache:
  """A paged cache over zeroed pools for ``config``'s layers, holding ``rows`` of ``pool`` (their pages and
  lengths as the pool has them now). dtype defaults to the config's compute dtype."""
  zeros = lambda: init_pool(pool.num_pages, pool.page_size, config.num_kv_heads, config.head_dim, dtype or config.dtype)  # noqa: E731
  lengths = jnp.asarray([pool.lengths.get(r, 0) for r in rows], jnp.int32)
  return PagedKVCache(tuple(zeros() for _ in range(config.num_layers)), jnp.asarray(pool.table(rows, width)), lengths)


class PagesExhausted(RuntimeError):
  """The pool has no free page for a row that grows."""


class PagePool:
  """Host-side page bookkeeping for one pool: which pages each row holds, and how many rows share each page.

  Rows are any hashable ids (the sampler's view keys). Pages are handed out lowest index first.

  Args:
    num_pages: P, the pool's size.
    page_size: Z, slots per page.
  """

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"PagePool needs num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}.")
    self.num_pages, self.page_size = num_pages, page_size
    self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest free page
    self._refs = np.zeros(num_pages, np.int64)
    self.pages: dict[object, list[int]] = {}
    self.lengths: dict[object, int] = {}

  def allocated(self) -> int:
    """Pages held by at least one row."""
    return int(np.count_nonzero(self._refs))

  def _take(self, n: int, row: object) -> list[int]:
    if n > len(self._free):
      raise PagesExhausted(
        f"row {row!r} needs {n} more pages of {self.page_size} slots; {len(self._free)} of {self.num_pages} are free. "
        "Release finished rows first, or give the pool more pages."
      )
    taken = [self._free.pop() for _ in range(n)]
    self._refs[taken] += 1
    return taken

  def grow(self, row: object, length: int) -> None:
    """Gives ``row`` (new or not) the pages to hold ``length`` slots. Raises PagesExhausted (nothing allocated) when
    the pool has too few free pages, ValueError when ``length`` is below the row's current length."""
    held = self.pages.setdefault(row, [])
    if length < self.lengths.get(row, 0):
      raise ValueError(f"row {row!r} holds {self.lengths[row]} slots; it cannot shrink to {length}.")
    need = -(-length // self.page_size) - len(held)
    if need > 0:
      try:
        held += self._take(need, row)
      except PagesExhausted:
        if not held:
          del self.pages[row]
        raise
    self.lengths[row] = length

  def shrink(self, row: object, length: int) -> None:
    """Keeps ``row``'s first ``length`` slots and gives back the pages past them (a generation reserved more pages
    than it filled). Raises ValueError when ``length`` is above the row's current length."""
    if length > self.lengths[row]:
      raise ValueError(f"row {row!r} holds {self.lengths[row]} slots; shrink cannot grow it to {length}.")
    held, keep = self.pages[row], -(-length // self.page_size)
    self._drop(held[keep:])
    self.pages[row], self.lengths[row] = held[:keep], length

  def _drop(self, pages: Sequence[int]) -> None:
    for page in pages:
      self._refs[page] -= 1
      if self._refs[page] == 0:
        self._free.append(page)
    self._free.sort(reverse=True)

  def fork(self, row: object, new_rows: Sequence[object]) -> list[tuple[int, int]]:
    """New rows that continue ``row``: each shares its full pages and gets a copy of its partly filled last page.

    Returns the (source page, destination page) copies to make on the device (`copy_pages`) before a fork writes.
    Raises ValueError for a new row that already exists, PagesExhausted when the copies do not fit.
    """
    held, length = self.pages[row], self.lengths[row]
    partial = length % self.page_size != 0
    full = held[: length // self.page_size]
    copies = []
    for new in new_rows:
      if new in self.pages:
        raise ValueError(f"fork: row {new!r} already holds pages; release it first.")
      own = self._take(1, new) if partial else []
      self._refs[full] += 1
      self.pages[new], self.lengths[new] = list(full) + own, length
      copies += [(held[len(full)], own[0])] if partial else []
    return copies

  def release(self, row: object) -> None:
    """Drops ``row``; a page goes back to the free list when no row holds it any more."""
    self._drop(self.pages.pop(row))
    del self.lengths[row]

  def table(self, rows: Sequence[object], width: int) -> np.ndarray:
    """int32[len(rows), width]: each row's pages in slot order, padded with P (no page: see the module docstring); a
    row the pool does not know holds none. Raises ValueError when a row holds more than ``width`` pages."""
    out = np.full((len(rows), width), self.num_pages, np.int32)
    for i, row in enumerate(rows):
      held = self.pages.get(row, [])
      if len(held) > width:
        raise ValueError(f"row {row!r} holds {len(held)} pages, more than the table's width {width}.")
      out[i, : len(held)] = held
    return out


def init_pool(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> jax.Array:
  """An empty pool: zeros dtype[P, Z, 2K, H]."""
  return jnp.zeros((num_pages, page_size, 2 * num_kv_heads, head_dim), dtype)


def row_slots(lengths: jax.Array, valid: jax.Array) -> jax.Array:
  """int32[B, T]: each new token's slot in its row. Row b's valid tokens fill slots lengths[b], lengths[b] + 1, ...
  in chunk order, as `transformer`'s dense cache does (lengths: int32[B] filled before the call; valid: bool[B, T]);
  a padding entry's value is meaningless (`flat_slots` drops it)."""
  return lengths[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1


def flat_slots(table: jax.Array, slots: jax.Array, valid: jax.Array, num_pages: int, page_size: int) -> jax.Array:
  """int32[B, T]: the index into the pool's flattened [P * Z] slots of each row slot (`row_slots`), given the rows'
  pages int32[B, W] (`PagePool.table`); padding, and a slot in no page the row holds, get P * Z or more, out of
  range, which `write` drops."""
  pages = jnp.take_along_axis(table, jnp.clip(slots // page_size, 0, table.shape[1] - 1), axis=1)
  inside = valid & (slots // page_size < table.shape[1])
  return jnp.where(inside, pages * page_size + slots % page_size, num_pages * page_size)


def write(pool: jax.Array, slots: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array) -> jax.Array:
  """The pool with new keys [B, T, K, H] and values [B, T, K, H] written at ``slots`` int32[B, T] (`flat_slots`);
  out-of-range slots are dropped."""
  p, z, kk, h = pool.shape
  b, t = slots.shape
  kv = jnp.stack([k_btkh, v_btkh], axis=3).reshape(b, t, kk, h).astype(pool.dtype)  # k, v interleaved per head
  return pool.reshape(p * z, kk, h).at[slots].set(kv, mode="drop").reshape(pool.shape)


def copy_pages(pool: jax.Array, copies: Sequence[tuple[int, int]]) -> jax.Array:
  """The pool with `PagePool.fork`'s (source, destination) page copies made."""
  if not copies:
    return pool
  src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*copies, strict=True))
  return pool.at[dst].set(pool[src])


def attention_part(q_bkgth, pool, table, kv_lens, q_slots):
  """The queries' share of softmax attention over their rows' pages: `transformer._softmax_part`'s triple (running
  max [B, K, G, T], sum of exp [B, K, G, T], float32 weighted values [B, K, G, T, H]), so it merges with other key
  sets (shared prefix levels) by log-sum-exp. Reads the W pages of ``table`` per row (gathered: a copy of them).

  Args:
    q_bkgth: dtype[B, K, G, T, H] queries, rotary-embedded.
    pool: dtype[P, Z, 2K, H]; table: int32[B, W]; kv_lens: int32[B]; q_slots: int32[B, T] (module docstring).
  """
  b, k, g, t, h = q_bkgth.shape
  w, z = table.shape[1], pool.shape[1]
  kv = jnp.take(pool, table, axis=0, mode="clip").reshape(b, w * z, 2 * k, h).astype(q_bkgth.dtype)  # P: masked
  keys, values = kv[:, :, 0::2], kv[:, :, 1::2]  # [B, S, K, H]
  scores = jnp.einsum("bkgth,bskh->bkgts", q_bkgth, keys, preferred_element_type=jnp.float32) * h**-0.5
  slot = jnp.arange(w * z)
  visible = (slot < kv_lens[:, None, None]) & (slot <= q_slots[:, :, None])  # [B, T, S]
  return transformer._softmax_part(scores, visible[:, None, None], values, "bkgts,bskh->bkgth")


def reference_attention(q_btnh, pool, table, kv_lens, q_slots, valid=None):
  """Softmax attention of queries dtype[B, T, N, H] over their rows' pages: dtype[B, T, N, H] (a query that sees no
  slot gets zeros). ``valid`` is unused (padding queries are computed and meaningless); it keeps `attention`'s
  signature."""
  del valid
  b, t, n, h = q_btnh.shape
  k = pool.shape[2] // 2
  q_bkgth = q_btnh.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
  out = transformer._merge_parts([attention_part(q_bkgth, pool, table, kv_lens, q_slots)], q_btnh.dtype)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def kernel_attention(q_btnh, pool, table, kv_lens, q_slots, valid, kernel: Callable | None = None):
  """`reference_attention` through the ragged paged attention kernel's interface: the valid queries packed
  [sum of q_len, N, H] row after row, ``cu_q_lens`` their offsets. The kernel takes each row's queries to be its
  last q_len slots, so a row's valid queries must be its newest tokens (`row_slots` places them so). Eager
  arguments only (the packing reads ``valid``).

  Args:
    kernel: the kernel (default: `jax.experimental.pallas.ops.tpu.ragged_paged_attention`, TPU only); tests pass
      the same package's pure-JAX ``ref_ragged_paged_attention``, which runs anywhere.
  """
  del q_slots  # implied: the kernel places row b's queries at its last q_len slots
  if kernel is None:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel
  b, t, n, h = q_btnh.shape
  valid_np = np.asarray(valid, bool)
  q_len = valid_np.sum(axis=1)
  for row in range(b):
    if not valid_np[row, : q_len[row]].all():
      raise ValueError(f"kernel_attention: row {row}'s valid queries are not its first {q_len[row]} positions.")
  order = np.flatnonzero(valid_np.reshape(-1))  # valid (row, t) in row-major order
  packed = q_btnh.reshape(b * t, n, h)[order]
  cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(q_len)]), jnp.int32)
  out = kernel(
    packed, pool, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table, jnp.int32), cu_q_lens,
    jnp.asarray([b], jnp.int32), sm_scale=h**-0.5,
  )  # fmt: skip
  return jnp.zeros((b * t, n, h), q_btnh.dtype).at[order].set(out.astype(q_btnh.dtype)).reshape(b, t, n, h)


def kernel_applies(backend: str, *, prefix_levels: int = 0) -> bool:
  """Whether `attention` uses the TPU kernel: on TPU, for rows without shared prefix levels (the kernel returns no
  log-sum-exp to merge a prefix's part with; rows with prefixes take `attention_part`), when JAX ships the kernel."""
  if backend != "tpu" or prefix_levels:
    return False
  try:
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention  # noqa: F401
  except ImportError:
    return False
  return True


def attention(q_btnh, pool, table, kv_lens, q_slots, valid, *, backend: str | None = None):
  """Attention over paged rows, by backend: the TPU kernel where `kernel_applies`, else `reference_attention`.
  Shapes as `reference_attention`'s."""
  if kernel_applies(backend or jax.default_backend()):
    return kernel_attention(q_btnh, pool, table, kv_lens, q_slots, valid)
  return reference_attention(q_btnh, pool, table, kv_lens, q_slots, valid)
