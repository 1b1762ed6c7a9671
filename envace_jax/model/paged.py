"""Paged KV storage: rows own fixed-size pages of one pool as they grow, share full pages after a fork, and give them
back when they end, so storage follows the distinct tokens (PagedAttention, Kwon et al. 2023; the layout of the ragged
paged attention kernel JAX ships for TPU, `jax.experimental.pallas.ops.tpu.ragged_paged_attention`).

Shapes (P pages in the pool, Z slots per page, B rows, W pages a call reads per row, T new tokens, K KV heads,
N query heads, G = N / K, H head dim):

    pool       dtype[P, Z, 2K, H]   one layer's pages; keys at even combined heads, values at odd (the kernel's layout)
    table      int32[B, W]          a row's pages in slot order: row b's slot s is offset s % Z of page table[b, s // Z]
    kv_lens    int32[B]             filled slots per row (after the call's writes)
    q_slots    int32[B, T]          each query's own slot; it sees the row's slots <= its own

On a mesh (`Shards`) the rows and the pages split over the mesh's batch axes together, so a row's pages are on its
device: N shards, row b on shard b // (B / N), pages [s * P / N, (s + 1) * P / N) on shard s, the block of the pools'
leading axis that device holds (a `PagePool` of N shards gives a row only pages of its shard; growing the pool
renumbers the pages, `PagePool.extend` and `PagedKVCache.extended` alike). A page id is its index in the pools
whether or not they are split. Writes and attention run per shard (``jax.shard_map``): no page crosses devices.

A page that is only partly filled belongs to one row: `PagePool.fork` shares a row's full pages (a reference count
per page) and copies its last, partial page, so a fork's writes never touch another row's slots. A table's unused
entries hold P, no page: a write there is dropped (a row never writes into pages it does not hold) and reads of it
are masked (slots a row has not filled are never attended).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envace_jax.model import attention as attention_lib
from envace_jax.model import kvcache


@dataclasses.dataclass(frozen=True)
class Shards:
  """The mesh axes a paged cache's rows and pages split over (the module docstring): ``axes`` of ``mesh`` (the
  sampler's batch axes, `sampling.sharding.batch_axes`), N = their product shards."""

  mesh: jax.sharding.Mesh
  axes: tuple[str, ...]

  @property
  def count(self) -> int:
    """N, the number of shards."""
    return math.prod(self.mesh.shape[a] for a in self.axes)

  @property
  def spec(self) -> jax.sharding.PartitionSpec:
    """A leading axis split over the shards, the others replicated."""
    return jax.sharding.PartitionSpec(self.axes)

  def local(self, pages: jax.Array, num_pages: int) -> jax.Array:
    """Inside ``jax.shard_map`` over ``axes``: each page id's index in this shard's block of M = P / N pages, or M
    (no page) for a page of another shard or none."""
    block = num_pages // self.count
    start = jax.lax.axis_index(self.axes) * block
    return jnp.where((pages >= start) & (pages < start + block), pages - start, block)

  def map(self, fn: Callable, *args):
    """``fn(*args)`` per shard: every argument and result split on its leading axis over ``axes`` (``jax.shard_map``
    over the whole mesh; the other axes' copies are the same)."""
    specs = (self.spec,) * len(args)
    return jax.shard_map(fn, mesh=self.mesh, in_specs=specs, out_specs=self.spec, check_vma=False)(*args)


@struct.dataclass
class PagedKVCache:
  """A KV cache whose own slots live in pages: `transformer.apply` and the `Sampler` (prefill, generate, `Stream`; on
  a mesh too, split by ``shards``) take it where they take a `transformer.KVCache`. A row may fill the slots of the
  pages it holds (`row_capacity`; the caller grows it with `PagePool.grow` and sets ``table``); work on a few rows
  (`gather`, `put`) slices the table instead of copying keys and values.

  Attributes:
    pools: a tuple of L dtype[P, Z, 2K, H], one pool per layer (`init_pool`); every layer uses the same pages.
    table: int32[B, W], each row's pages (`PagePool.table`); W pages are read per row by a call, so W bounds the
      slots a row may hold after it (W * Z).
    lengths: int32[B], filled own slots per row.
    prefix: None, or a dense `transformer.KVCache` of shared prefix levels, as `KVCache.prefix`.
    shards: None (one device), or the mesh axes the rows and pages split over (static; module docstring).
  """

  pools: tuple[jax.Array, ...]
  table: jax.Array
  lengths: jax.Array
  prefix: kvcache.KVCache | None = None
  shards: Shards | None = struct.field(pytree_node=False, default=None)

  def levels(self) -> list[kvcache.KVCache]:
    return kvcache.KVCache.levels(self)

  def offsets(self) -> jax.Array:
    return kvcache.KVCache.offsets(self)

  def filled(self) -> jax.Array:
    return kvcache.KVCache.filled(self)

  def host_offsets(self) -> np.ndarray:
    return kvcache.KVCache.host_offsets(self)

  def host_filled(self) -> np.ndarray:
    return kvcache.KVCache.host_filled(self)

  @property
  def page_size(self) -> int:
    return self.pools[0].shape[1]

  @property
  def capacity(self) -> int:
    """W * Z, the most own slots a row's table can address (a row may hold fewer pages: `row_capacity`)."""
    return self.table.shape[1] * self.page_size

  def row_capacity(self) -> jax.Array:
    """int32[B]: the own slots each row holds pages for (its table entries below P, times Z)."""
    return jnp.sum(self.table < self.pools[0].shape[0], axis=1, dtype=jnp.int32) * self.page_size

  def host_row_capacity(self) -> np.ndarray:
    """`row_capacity` on the host (int32[B], NumPy)."""
    table = np.asarray(jax.device_get(self.table))
    return np.sum(table < self.pools[0].shape[0], axis=1, dtype=np.int32) * self.page_size

  def stored_slots(self) -> int:
    """Slots of the distinct pages the rows' tables name, and the prefix levels' slots (host-side count)."""
    table = np.asarray(jax.device_get(self.table))
    pages = np.unique(table[table < self.pools[0].shape[0]]).size
    return pages * self.page_size + (self.prefix.stored_slots() if self.prefix is not None else 0)

  def trimmed(self, capacity: int) -> PagedKVCache:
    """The first ceil(capacity / Z) table entries of every row (a call that reads no slot past ``capacity``)."""
    return self.replace(table=self.table[:, : -(-capacity // self.page_size)])

  def gather(self, rows: jax.Array, capacity: int, grouped: bool = False) -> PagedKVCache:
    """`kvcache.KVCache.gather` for pages: rows ``rows`` (int32[B']; B or more: an empty row), their first
    ceil(capacity / Z) pages and a copy of each prefix level's row for each (once per group with ``grouped``:
    `kvcache.gather_levels`). The pools are shared, not copied: `put` takes the written pools back."""
    rows = jnp.asarray(rows, jnp.int32)
    none = self.pools[0].shape[0]
    table = jnp.take(self.trimmed(capacity).table, rows, axis=0, mode="fill", fill_value=none)
    lengths = jnp.take(self.lengths, rows, mode="fill", fill_value=0)
    return self.replace(table=table, lengths=lengths, prefix=kvcache.gather_levels(self, rows, grouped))

  def allocated_slots(self) -> int:
    """Slots the pools allocate (P * Z, held or free) and the prefix levels' slots: the cache's memory per layer."""
    return self.pools[0].shape[0] * self.page_size + (self.prefix.stored_slots() if self.prefix is not None else 0)

  def extended(self, num_pages: int) -> PagedKVCache:
    """This cache over pools of ``num_pages`` pages (P or more; the new pages zeroed), for a `PagePool` that
    `PagePool.extend` grew to as many: the table's P (no page) becomes the new count. Copies the pools once."""
    old = self.pools[0].shape[0]
    if num_pages < old:
      raise ValueError(f"extended: the pools hold {old} pages; they cannot shrink to {num_pages}.")
    grow = lambda pool: jnp.concatenate([pool, jnp.zeros((num_pages - old, *pool.shape[1:]), pool.dtype)])  # noqa: E731
    table = jnp.where(self.table >= old, num_pages, self.table)
    if self.shards is not None:  # each shard's block grows at its end, its pages renumbered as `PagePool.extend` does
      n = self.shards.count
      if num_pages % n:
        raise ValueError(f"extended: {num_pages} pages do not split over {n} shards.")
      table = jnp.where(table < num_pages, table // (old // n) * (num_pages // n) + table % (old // n), num_pages)
      block = lambda pool: pool.reshape(n, old // n, *pool.shape[1:])  # noqa: E731
      pad = lambda pool: jnp.zeros((n, (num_pages - old) // n, *pool.shape[1:]), pool.dtype)  # noqa: E731
      sharding = jax.sharding.NamedSharding(self.shards.mesh, self.shards.spec)
      grow = jax.jit(
        lambda pool: jnp.concatenate([block(pool), pad(pool)], axis=1).reshape(num_pages, *pool.shape[1:]),
        out_shardings=sharding,
      )
    return self.replace(pools=tuple(grow(p) for p in self.pools), table=table)

  def dense(self) -> kvcache.KVCache:
    """The same rows as a `transformer.KVCache` with W * Z own slots (each row's pages in slot order, zeros where it
    holds none) and the same prefix levels; for inspection and tests (``dense().flatten()`` puts the levels in
    front)."""

    def rows(pool):
      kv = jnp.take(pool, self.table, axis=0, mode="fill", fill_value=0)  # [B, W, Z, 2K, H]
      b, w, z, kk, h = kv.shape
      kv = kv.reshape(b, w * z, kk, h)
      return kv[:, :, 0::2].transpose(0, 2, 3, 1), kv[:, :, 1::2].transpose(0, 2, 1, 3)  # [B, K, H, S], [B, K, S, H]

    k, v = zip(*(rows(p) for p in self.pools), strict=True)
    return kvcache.KVCache(k=tuple(k), v=tuple(v), lengths=self.lengths, prefix=self.prefix)

  def flatten(self) -> kvcache.KVCache:
    """`kvcache.KVCache.flatten` of `dense`: each row's whole history in one dense row."""
    return self.dense().flatten()

  def put(self, rows: jax.Array, part: PagedKVCache) -> PagedKVCache:
    """This cache with ``part``'s pools (from ``gather(rows, capacity)``, then written) and lengths in rows ``rows``
    (B or more: dropped); the table and prefix levels unchanged."""
    lengths = self.lengths.at[jnp.asarray(rows, jnp.int32)].set(part.lengths, mode="drop")
    return self.replace(pools=part.pools, lengths=lengths)


def init_cache(
  config, pool: PagePool, rows: Sequence[object], width: int, dtype=None, shards: Shards | None = None
) -> PagedKVCache:
  """A paged cache over zeroed pools for ``config``'s layers, holding ``rows`` of ``pool`` (their pages and
  lengths as the pool has them now). dtype defaults to the config's compute dtype. With ``shards`` (a pool of as
  many shards) the pools are made split over them (no whole pool on one device); the table and lengths are host
  values for the caller to place. Raises ValueError when the pool's shards are not ``shards``'s."""
  zeros = lambda: init_pool(pool.num_pages, pool.page_size, config.num_kv_heads, config.head_dim, dtype or config.dtype)  # noqa: E731
  if (shards.count if shards is not None else 1) != pool.shards:
    raise ValueError(f"init_cache: a pool of {pool.shards} shards for a cache over {shards}.")
  if shards is not None:
    zeros = jax.jit(zeros, out_shardings=jax.sharding.NamedSharding(shards.mesh, shards.spec))
  lengths = jax.device_put(np.asarray([pool.lengths.get(r, 0) for r in rows], np.int32))
  pools = tuple(zeros() for _ in range(config.num_layers))
  return PagedKVCache(pools, jax.device_put(np.asarray(pool.table(rows, width))), lengths, shards=shards)


class PagesExhausted(RuntimeError):
  """The pool has no free page for a row that grows."""


class PagePool:
  """Host-side page bookkeeping for one pool: which pages each row holds, and how many rows share each page.

  Rows are any hashable ids (the sampler's view keys). Pages are handed out lowest index first.

  Args:
    num_pages: P, the pool's size.
    page_size: Z, slots per page.
    shards: N, for a cache split over N shards (`Shards`): row r (an int in [0, rows)) takes only pages of shard
      s = r // (rows / N), the ids [s * P / N, (s + 1) * P / N). P, and every size `extend` grows to, is a multiple of
      N.
    rows: B, the cache's rows (with shards > 1; a multiple of N).

  Raises:
    ValueError: P or Z below 1; P or B not a multiple of N.
  """

  def __init__(self, num_pages: int, page_size: int, shards: int = 1, rows: int | None = None):
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"PagePool needs num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}.")
    if shards > 1 and (num_pages % shards or rows is None or rows % shards):
      raise ValueError(f"PagePool of {shards} shards: num_pages={num_pages} and rows={rows} must be multiples of it.")
    self.num_pages, self.page_size, self.shards = num_pages, page_size, shards
    self._rows_per_shard = rows // shards if shards > 1 else None
    block = num_pages // shards
    self._free = [list(range((s + 1) * block - 1, s * block - 1, -1)) for s in range(shards)]  # stacks: lowest last
    self._refs = np.zeros(num_pages, np.int64)
    self.pages: dict[object, list[int]] = {}
    self.lengths: dict[object, int] = {}

  def _shard_of_page(self, page: int) -> int:
    return page // (self.num_pages // self.shards)

  def shard(self, row: object) -> int:
    """The shard whose pages ``row`` takes (0 without shards)."""
    return 0 if self._rows_per_shard is None else int(row) // self._rows_per_shard

  def allocated(self) -> int:
    """Pages held by at least one row."""
    return int(np.count_nonzero(self._refs))

  def free(self) -> int:
    """Pages no row holds."""
    return sum(map(len, self._free))

  def pages_needed(self, needs: Sequence[tuple[object, int]]) -> int:
    """How many pages `extend` must add (a multiple of the shards; 0 when none) before every (row, slots) of
    ``needs`` can `grow` to its slots: with shards, each shard's rows take from its own free pages."""
    short = [-len(free) for free in self._free]
    for row, length in needs:
      short[self.shard(row)] += max(-(-length // self.page_size) - len(self.pages.get(row, ())), 0)
    return self.shards * max(*short, 0)

  def extend(self, num_pages: int) -> None:
    """Grows the pool to ``num_pages`` pages, the new ones free (`PagedKVCache.extended` grows the device pools to
    match). With shards, each shard's block grows at its end and the held pages are renumbered (page s * M + i
    becomes s * M' + i, M and M' the blocks before and after: `PagedKVCache.extended` renumbers its table the same
    way); without, ids stay. Raises ValueError below the current size, or for a size not a multiple of the shards."""
    if num_pages < self.num_pages or num_pages % self.shards:
      raise ValueError(
        f"the pool holds {self.num_pages} pages in {self.shards} shards; it cannot become {num_pages} pages."
      )
    old, new = self.num_pages // self.shards, num_pages // self.shards
    moved = lambda g: g // old * new + g % old  # noqa: E731
    self.pages = {row: [moved(g) for g in held] for row, held in self.pages.items()}
    refs = np.zeros(num_pages, np.int64)
    refs[[moved(g) for g in range(self.num_pages)]] = self._refs
    self._refs, self.num_pages = refs, num_pages
    self._free = [[g for g in range((s + 1) * new - 1, s * new - 1, -1) if refs[g] == 0] for s in range(self.shards)]

  def _take(self, n: int, row: object) -> list[int]:
    free = self._free[self.shard(row)]
    if n > len(free):
      where = f" of shard {self.shard(row)}" if self.shards > 1 else ""
      raise PagesExhausted(
        f"row {row!r} needs {n} more pages of {self.page_size} slots; {len(free)} of {self.num_pages}{where} are "
        "free. Release finished rows first, or give the pool more pages."
      )
    taken = [free.pop() for _ in range(n)]
    self._refs[taken] += 1
    return taken

  def grow(self, row: object, length: int) -> None:
    """Gives ``row`` (new or not) the pages to hold ``length`` slots. Raises PagesExhausted when the pool has too few
    free pages, ValueError when ``length`` is below the row's current length; either way the pool is unchanged."""
    if length < self.lengths.get(row, 0) or length < 0:
      raise ValueError(f"row {row!r} holds {self.lengths.get(row, 0)} slots; it cannot shrink to {length}.")
    held = self.pages.get(row, [])
    need = -(-length // self.page_size) - len(held)
    self.pages[row] = held + (self._take(need, row) if need > 0 else [])
    self.lengths[row] = length

  def shrink(self, row: object, length: int) -> list[tuple[int, int]]:
    """Keeps ``row``'s first ``length`` slots and gives back the pages past them (a generation reserved more pages
    than it filled). When the row's new last page is partly filled and shared, the row gets a copy of it (its next
    writes must not reach the other rows): returns that (source, destination) copy for `copy_pages`, or none.
    Raises ValueError when ``length`` is above the row's current length or negative, PagesExhausted when the copy
    has no free page (the pool unchanged)."""
    if not 0 <= length <= self.lengths[row]:
      raise ValueError(f"row {row!r} holds {self.lengths[row]} slots; shrink cannot make it {length}.")
    held, keep = self.pages[row], -(-length // self.page_size)
    copies = []
    if length % self.page_size and self._refs[held[keep - 1]] > 1:
      (own,) = self._take(1, row)
      copies = [(held[keep - 1], own)]
      self._drop([held[keep - 1]])
      held = held[: keep - 1] + [own] + held[keep:]
    self._drop(held[keep:])
    self.pages[row], self.lengths[row] = held[:keep], length
    return copies

  def _drop(self, pages: Sequence[int]) -> None:
    for page in pages:
      self._refs[page] -= 1
      if self._refs[page] == 0:
        self._free[self._shard_of_page(page)].append(page)
    for free in self._free:
      free.sort(reverse=True)

  def fork(self, row: object, new_rows: Sequence[object]) -> list[tuple[int, int]]:
    """New rows that continue ``row``: each shares its full pages and gets a copy of its partly filled last page.

    Returns the (source page, destination page) copies to make on the device (`copy_pages`) before a fork writes.
    The partial page is found from ``lengths[row]``, the slots the row holds room for: shrink a row to its filled
    length before forking it. Raises ValueError for a new row that exists or is named twice, PagesExhausted when the
    copies do not fit; either way the pool is unchanged.
    """
    held, length = self.pages[row], self.lengths[row]
    partial = length % self.page_size != 0
    full = held[: length // self.page_size]
    clash = [new for new in new_rows if new in self.pages] or [new for new in new_rows if list(new_rows).count(new) > 1]
    if clash:
      raise ValueError(f"fork: row {clash[0]!r} already holds pages or is named twice; release it first.")
    apart = [new for new in new_rows if self.shard(new) != self.shard(row)]
    if apart:
      raise ValueError(f"fork: row {apart[0]!r} is on another shard than row {row!r}, whose pages it would share.")
    free = len(self._free[self.shard(row)])
    if partial and len(new_rows) > free:
      raise PagesExhausted(
        f"fork of row {row!r} into {len(new_rows)} rows needs {len(new_rows)} pages for their copies of its last page; "
        f"{free} of {self.num_pages} are free."
      )
    copies = []
    for new in new_rows:
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


def write(pool: jax.Array, slots: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, shards: Shards | None = None):
  """The pool with new keys [B, T, K, H] and values [B, T, K, H] written at ``slots`` int32[B, T] (`flat_slots`);
  out-of-range slots are dropped. With ``shards``, each shard writes its rows into its block of the pool."""
  if shards is not None:
    num_pages, z = pool.shape[:2]

    def local(pool, slots, k_btkh, v_btkh):
      pages = shards.local(slots // z, num_pages)  # P / N: out of this block, dropped
      return write(pool, pages * z + jnp.where(slots < num_pages * z, slots % z, 0), k_btkh, v_btkh)

    return shards.map(local, pool, slots, k_btkh, v_btkh)
  p, z, kk, h = pool.shape
  b, t = slots.shape
  kv = jnp.stack([k_btkh, v_btkh], axis=3).reshape(b, t, kk, h).astype(pool.dtype)  # k, v interleaved per head
  return pool.reshape(p * z, kk, h).at[slots].set(kv, mode="drop").reshape(pool.shape)


def copy_pages(pool: jax.Array, copies: Sequence[tuple[int, int]]) -> jax.Array:
  """The pool with `PagePool.fork`'s or `shrink`'s (source, destination) page copies made, in the order given (a copy
  whose source is an earlier copy's destination reads what that copy wrote)."""
  if not copies:
    return pool
  if {d for _, d in copies} & {s for s, _ in copies}:
    for src, dst in copies:
      pool = pool.at[dst].set(pool[src])
    return pool
  src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*copies, strict=True))
  return pool.at[dst].set(pool[src])


def attention_part(q_bkgth, pool, table, kv_lens, q_slots, shards: Shards | None = None, *, static: bool = False):
  """The queries' share of softmax attention over their rows' pages, on every backend (what `transformer.apply`
  runs): `kvcache.softmax_part`'s triple (running max [B, K, G, T], sum of exp [B, K, G, T], float32 weighted values
  [B, K, G, T, H]), so it merges with other key sets (shared prefix levels) by log-sum-exp.

  One page of every row at a time (an online softmax over pages, as `transformer._online_softmax` over key blocks),
  up to the last page any row of the call fills: a step reads one [B, Z, 2K, H] gather, not a copy of every row's
  W pages, and the pages past the longest row are not read. On a 2-core CPU at 2048 own slots: 20x faster than
  gathering all W pages first (XLA's dots on their transposed operands), 2-3x slower than a dense row in place.

  Args:
    q_bkgth: dtype[B, K, G, T, H] queries, rotary-embedded.
    pool: dtype[P, Z, 2K, H]; table: int32[B, W]; kv_lens: int32[B]; q_slots: int32[B, T] (module docstring).
    shards: None, or the shards the rows and pages split over: each shard attends its rows over its block.
    static: loop over all W pages (a trip count known when tracing; the pages past every row's length are masked
      and change nothing) instead of up to the longest row's last page (a trip count read from data: XLA:GPU then
      copies the loop's condition to the host every iteration). What `transformer.Attention` asks for on GPU and TPU.
  """
  if shards is not None:
    num_pages = pool.shape[0]
    local = lambda q, pool, table, kv_lens, q_slots: attention_part(  # noqa: E731
      q, pool, shards.local(table, num_pages), kv_lens, q_slots, static=static
    )
    return shards.map(local, q_bkgth, pool, table, kv_lens, q_slots)
  b, k, g, t, h = q_bkgth.shape
  p, z = pool.shape[0], pool.shape[1]
  used = table.shape[1] if static else jnp.minimum((jnp.max(kv_lens) + z - 1) // z, table.shape[1])

  def body(w, carry):
    pages = jax.lax.dynamic_index_in_dim(table, w, axis=1, keepdims=False)  # [B]; P: no page, masked
    kv = jnp.take(pool, pages, axis=0, mode="clip").reshape(b, z, k, 2, h).astype(q_bkgth.dtype)
    scores = jnp.einsum("bkgth,bzkh->bkgtz", q_bkgth, kv[:, :, :, 0], preferred_element_type=jnp.float32) * h**-0.5
    slot = w * z + jnp.arange(z)
    visible = (slot < kv_lens[:, None, None]) & (slot <= q_slots[:, :, None]) & (pages < p)[:, None, None]
    part = kvcache.softmax_part(scores, visible[:, None, None], kv[:, :, :, 1], "bkgtz,bzkh->bkgth")
    return kvcache.combine(carry, part)

  init = (
    jnp.full((b, k, g, t), kvcache.MASKED, jnp.float32),
    jnp.zeros((b, k, g, t), jnp.float32),
    jnp.zeros((b, k, g, t, h), jnp.float32),
  )
  return jax.lax.fori_loop(0, used, body, init)


def reference_attention(q_btnh, pool, table, kv_lens, q_slots, valid=None):
  """Softmax attention of queries dtype[B, T, N, H] over their rows' pages: dtype[B, T, N, H] (a query that sees no
  slot gets zeros). ``valid`` is unused (padding queries are computed and meaningless); it keeps `attention`'s
  signature."""
  del valid
  b, t, n, h = q_btnh.shape
  k = pool.shape[2] // 2
  q_bkgth = q_btnh.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
  out = kvcache.merge_parts([attention_part(q_bkgth, pool, table, kv_lens, q_slots)], q_btnh.dtype)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def kernel_attention(q_btnh, pool, table, kv_lens, q_slots, valid, kernel: Callable | None = None):
  """`reference_attention` through the ragged paged attention kernel's interface, under ``jax.jit`` or eagerly: the
  valid queries packed [B * T, N, H] row after row in chunk order (padding after them all, past ``cu_q_lens[B]``,
  which the kernel does not read), ``cu_q_lens`` their offsets. The kernel places row b's q_len valid queries at its
  last q_len slots, kv_lens[b] - q_len + i for the i-th: `row_slots`' slot for it whatever the padding, so
  ``q_slots`` is implied. Padding queries get zeros. (It was eager only while the packing read ``valid`` on the host
  and packed to the valid count: here the packed length is the static B * T and the order is computed on device.)

  Args:
    kernel: the kernel (default: `jax.experimental.pallas.ops.tpu.ragged_paged_attention`, TPU only); tests pass
      the same package's pure-JAX ``ref_ragged_paged_attention``, which runs anywhere.
  """
  del q_slots  # implied: the kernel places row b's queries at its last q_len slots
  if kernel is None:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel
  b, t, n, h = q_btnh.shape
  valid = jnp.asarray(valid, bool)
  q_len = jnp.sum(valid, axis=1, dtype=jnp.int32)
  order = jnp.argsort(~valid.reshape(-1), stable=True)  # valid (row, t) first in row-major order, then padding
  packed = q_btnh.reshape(b * t, n, h)[order]
  cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_len, dtype=jnp.int32)])
  out = kernel(
    packed, pool, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table, jnp.int32), cu_q_lens,
    jnp.asarray([b], jnp.int32), sm_scale=h**-0.5,
  )  # fmt: skip
  out = jnp.pad(out, ((0, b * t - out.shape[0]), (0, 0), (0, 0)))  # the reference returns the valid count only
  out = jnp.zeros((b * t, n, h), q_btnh.dtype).at[order].set(out.astype(q_btnh.dtype)).reshape(b, t, n, h)
  return jnp.where(valid[:, :, None, None], out, 0)


def kernel_applies(backend: str, *, prefix_levels: int = 0, heads: tuple[int, int, Any] | None = None) -> bool:
  """Whether the TPU kernel serves paged rows (`attention`, `transformer.Attention`): on TPU, for rows without shared
  prefix levels (the kernel returns no log-sum-exp to merge a prefix's part with: model/attention.py routes those),
  when JAX ships the kernel
  and, given ``heads`` = (query heads N, KV heads K, dtype), its tiling takes them (it refuses 2K = 6, SmolLM2's)."""
  if backend != "tpu" or prefix_levels:
    return False
  try:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel
  except ImportError:
    return False
  if heads is not None:
    n, k, dtype = heads
    try:
      kernel.get_min_heads_per_blk(n, 2 * k, dtype, dtype)
    except (ValueError, AssertionError):
      return False
  return True


def attention(q_btnh, pool, table, kv_lens, q_slots, valid, *, backend: str | None = None):
  """Attention over paged rows, by backend: the TPU kernel where `kernel_applies`, else `reference_attention`.
  Shapes as `reference_attention`'s."""
  heads = (q_btnh.shape[2], pool.shape[2] // 2, pool.dtype)
  if kernel_applies(backend or attention_lib.current_backend(), heads=heads):
    return kernel_attention(q_btnh, pool, table, kv_lens, q_slots, valid)
  return reference_attention(q_btnh, pool, table, kv_lens, q_slots, valid)
