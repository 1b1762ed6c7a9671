"""Paged KV storage (envace_jax/model/paged.py): page bookkeeping, and attention over pages against a dense NumPy
reference and against the reference that ships with JAX's ragged paged attention kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax.model import paged

K, G, H, Z, P = 2, 2, 8, 4, 32  # KV heads, query heads per KV head, head dim, slots per page, pages
_attend, _write = jax.jit(paged.reference_attention), jax.jit(paged.write)  # one program per shape, not per op


def _dense_attention(q_nh, keys_skh, values_skh):
  """One query [N, H] over keys and values [S, K, H]: softmax attention, query head n reading KV head n // G."""
  out = np.zeros_like(q_nh)
  for n in range(q_nh.shape[0]):
    scores = keys_skh[:, n // G] @ q_nh[n] / np.sqrt(H)
    probs = np.exp(scores - scores.max())
    out[n] = (probs / probs.sum()) @ values_skh[:, n // G]
  return out


class _Rows:
  """Rows written through the pool and, alongside, as dense per-row NumPy arrays."""

  def __init__(self):
    self.pool = paged.PagePool(P, Z)
    self.array = paged.init_pool(P, Z, K, H)
    self.dense: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    self.rng = np.random.default_rng(0)

  def fork(self, row, new_rows):
    self.array = paged.copy_pages(self.array, self.pool.fork(row, new_rows))
    for new in new_rows:
      self.dense[new] = tuple(x.copy() for x in self.dense[row])

  def call(self, rows, valid):
    """Writes each row's valid new tokens, attends, checks every valid query against the dense reference."""
    valid = np.asarray(valid, bool)
    b, t = valid.shape
    lengths = np.asarray([self.pool.lengths.get(r, 0) for r in rows], np.int32)
    for r, n, v in zip(rows, lengths, valid, strict=True):
      self.pool.grow(r, int(n + v.sum()))
    width = max(len(self.pool.pages[r]) for r in rows) + 1  # one unused entry (P) too
    table = self.pool.table(rows, width)
    k_new, v_new = (self.rng.standard_normal((b, t, K, H)).astype(np.float32) for _ in range(2))
    q = self.rng.standard_normal((b, t, K * G, H)).astype(np.float32)
    slots = np.asarray(paged.row_slots(lengths, valid))
    self.array = _write(self.array, paged.flat_slots(table, slots, valid, P, Z), k_new, v_new)
    kv_lens = lengths + valid.sum(axis=1)
    out = np.asarray(_attend(q, self.array, table, kv_lens, slots))
    for i, r in enumerate(rows):
      keys, values = self.dense.get(r, (np.zeros((0, K, H), np.float32),) * 2)
      self.dense[r] = (np.concatenate([keys, k_new[i][valid[i]]]), np.concatenate([values, v_new[i][valid[i]]]))
      for j in np.flatnonzero(valid[i]):
        upto = slots[i, j] + 1
        expect = _dense_attention(q[i, j], self.dense[r][0][:upto], self.dense[r][1][:upto])
        np.testing.assert_allclose(out[i, j], expect, atol=1e-5, rtol=1e-5)
    return q, table, kv_lens, slots, valid, out


def test_forked_rows_share_full_pages_and_attend_like_dense_rows():
  rows = _Rows()
  rows.call(["a"], [[True] * 7])  # a prefill chunk
  rows.call(["a"], [[True, True, False]])  # a ragged chunk: 9 slots, pages 4 + 4 + 1
  assert rows.pool.pages["a"] == [0, 1, 2] and rows.pool.allocated() == 3
  rows.fork("a", ["b", "c"])  # the two full pages shared, the partial third copied into each fork
  assert rows.pool.pages["b"] == [0, 1, 3] and rows.pool.pages["c"] == [0, 1, 4]
  assert rows.pool.allocated() == 5  # not 9 (three rows of three pages)
  # Each fork continues differently (ragged chunk, then decode); the source row too. Writes land in own pages only.
  rows.call(["b", "c", "a"], [[True, True, True, False, False], [True] * 5, [False] * 5])
  rows.call(["a", "b", "c"], [[True], [True], [True]])
  assert [rows.pool.lengths[r] for r in "abc"] == [10, 13, 15]
  # Distinct pages: the 2 shared, a's partial one, b's copy + 1 new (13 slots), c's copy + 1 new (15 slots).
  assert rows.pool.allocated() == 2 + 1 + 2 + 2 and rows.pool.pages["c"][:2] == [0, 1]
  rows.pool.release("b")
  rows.pool.release("a")
  assert rows.pool.allocated() == 2 + 2  # c still holds the two shared pages and its own two
  rows.pool.release("c")
  assert rows.pool.allocated() == 0
  rows.pool.grow("d", 1)
  assert rows.pool.pages["d"] == [0]  # the lowest free page again
  assert rows.pool.table(["d", "e"], 2).tolist() == [[0, P], [P, P]]  # P: no page (e is unknown: none)


def test_matches_the_kernel_packages_own_reference():
  """`kernel_attention` packs our padded queries for the ragged kernel's interface; with the kernel replaced by the
  pure-JAX ``ref_ragged_paged_attention`` from the same JAX package (a host loop over the rows: eager only), it gives
  our reference's outputs, for right and left padding (a row's i-th valid query is at its slot lengths + i either
  way). The packing itself reads nothing on the host: it traces under ``jax.jit`` with abstract inputs."""
  import functools

  rpa = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
  rows = _Rows()
  rows.call(["a"], [[True] * 6])
  rows.fork("a", ["b"])
  for chunk in ([[True, True, False, False], [True] * 4], [[False, False, True, True], [False, True, True, False]]):
    q, table, kv_lens, slots, valid, ours = rows.call(["a", "b"], chunk)
    theirs = paged.kernel_attention(q, rows.array, table, kv_lens, slots, valid, kernel=rpa.ref_ragged_paged_attention)
    np.testing.assert_allclose(np.asarray(theirs)[valid], ours[valid], atol=1e-5, rtol=1e-5)
    assert not np.asarray(theirs)[~valid].any()  # padding queries: zeros
  stand_in = lambda q, *args, **kwargs: q  # noqa: E731  a traceable kernel of the same interface
  abstract = jax.eval_shape(
    jax.jit(functools.partial(paged.kernel_attention, kernel=stand_in)), q, rows.array, table, kv_lens, slots, valid
  )
  assert abstract.shape == q.shape


def test_the_backend_selects_the_kernel(monkeypatch):
  pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
  assert not paged.kernel_applies("cpu") and not paged.kernel_applies("gpu")
  assert paged.kernel_applies("tpu") and not paged.kernel_applies("tpu", prefix_levels=1)
  assert paged.kernel_applies("tpu", heads=(16, 8, jnp.bfloat16))  # Qwen3-8B's heads
  assert not paged.kernel_applies("tpu", heads=(9, 3, jnp.float32))  # SmolLM2-135M's: 2K = 6 does not tile
  calls = []
  monkeypatch.setattr(paged, "kernel_attention", lambda *args: calls.append(len(args)) or "kernel")
  q, pool = jnp.zeros((1, 1, 16, 128)), paged.init_pool(4, 16, 8, 128)
  assert paged.attention(q, pool, None, None, None, None, backend="tpu") == "kernel" and calls == [6]


def test_pool_errors_name_the_problem_and_leave_the_pool_unchanged():
  pool = paged.PagePool(3, 4)
  with pytest.raises(paged.PagesExhausted, match="needs 4 more pages of 4 slots; 3 of 3 are free"):
    pool.grow("x", 13)
  assert pool.allocated() == 0 and "x" not in pool.pages
  with pytest.raises(ValueError, match="cannot shrink to -1"):
    pool.grow("n", -1)
  assert "n" not in pool.pages and "n" not in pool.lengths
  pool.grow("x", 8)
  assert pool.fork("x", []) == [] and pool.allocated() == 2
  assert pool.fork("x", ["y"]) == [] and pool.allocated() == 2  # full pages only: shared, nothing copied
  with pytest.raises(ValueError, match="cannot shrink to 7"):
    pool.grow("x", 7)
  # y keeps 3 slots of page 0, which x shares: y gets its own copy (its next writes must not reach x's slots)
  assert pool.shrink("y", 3) == [(0, 2)] and pool.pages["y"] == [2] and pool.pages["x"] == [0, 1]
  assert pool.allocated() == 3
  with pytest.raises(ValueError, match="shrink cannot make it 4"):
    pool.shrink("y", 4)
  with pytest.raises(ValueError, match="already holds pages or is named twice"):
    pool.fork("x", ["z", "y"])
  with pytest.raises(ValueError, match="named twice"):
    pool.fork("x", ["z", "z"])
  pool.shrink("x", 6)  # x's partial page 1 is its own: no copy
  with pytest.raises(paged.PagesExhausted, match="needs 2 pages for their copies of its last page; 0 of 3 are free"):
    pool.fork("x", ["z", "w"])
  assert set(pool.pages) == {"x", "y"} and pool.allocated() == 3  # nothing half-made
  pool.shrink("x", 0)
  assert pool.pages["x"] == [] and pool.allocated() == 1
  with pytest.raises(ValueError, match="holds 1 pages, more than the table's width 0"):
    pool.table(["y"], 0)


def test_a_sharded_pool_gives_each_row_pages_of_its_shard():
  """A pool of 2 shards over 4 rows (rows 0, 1: shard 0, pages 0-2; rows 2, 3: shard 1, pages 3-5): a row takes only
  its shard's pages, lowest first; a shard runs out on its own (the other's free pages do not help), `pages_needed`
  says how much to grow (twice the fullest shard's shortfall), `extend` grows each shard's block at its end and
  renumbers the held pages as `PagedKVCache.extended` renumbers a table, and a fork across shards is refused."""
  pool = paged.PagePool(6, 4, shards=2, rows=4)
  pool.grow(0, 8)
  pool.grow(2, 4)
  assert pool.pages == {0: [0, 1], 2: [3]} and pool.free() == 3
  with pytest.raises(paged.PagesExhausted, match="needs 2 more pages of 4 slots; 1 of 6 of shard 0 are free"):
    pool.grow(1, 8)
  assert pool.pages_needed([(1, 8), (3, 4)]) == 2 and pool.pages_needed([(3, 8)]) == 0
  pool.extend(8)  # blocks of 4: page 3 (shard 1's first) becomes 4
  assert pool.pages == {0: [0, 1], 2: [4]} and pool.allocated() == 3
  pool.grow(1, 8)
  pool.grow(3, 12)
  assert pool.pages == {0: [0, 1], 2: [4], 1: [2, 3], 3: [5, 6, 7]} and pool.free() == 0
  pool.release(0)
  assert pool.pages_needed([(0, 4)]) == 0 and pool.pages_needed([(3, 16)]) == 2
  with pytest.raises(ValueError, match="row 0 is on another shard than row 2"):
    pool.fork(2, [0])
  with pytest.raises(ValueError, match="cannot become 9 pages"):
    pool.extend(9)
  with pytest.raises(ValueError, match="must be multiples of it"):
    paged.PagePool(5, 4, shards=2, rows=4)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("data",))
  shards = paged.Shards(mesh, ("data",))
  table = jnp.asarray([[0, 1, 8], [4, 8, 8]], jnp.int32)  # page ids of a pool of 8, 8: no page
  cache = paged.PagedKVCache((jnp.zeros((8, 4, 2, 2)),), table, jnp.zeros(2, jnp.int32), shards=shards)
  np.testing.assert_array_equal(cache.extended(12).table, [[0, 1, 12], [6, 12, 12]])  # blocks of 6


def test_a_shrunk_fork_writes_its_own_copy_of_a_shared_page():
  """A fork cut back into a page it shares (a generation that reserved more than it wrote) gets its own copy of that
  page: its next writes leave the source row's slots as they were (checked against the dense rows)."""
  rows = _Rows()
  rows.call(["a"], [[True] * 8])  # two full pages
  rows.fork("a", ["b"])  # both shared
  copies = rows.pool.shrink("b", 6)
  assert copies == [(1, 2)] and rows.pool.pages["b"] == [0, 2]
  rows.array = paged.copy_pages(rows.array, copies)
  rows.dense["b"] = tuple(x[:6] for x in rows.dense["b"])
  rows.call(["b", "a"], [[True, True, True], [True, False, False]])  # b rewrites its slots 6, 7; a reads its own


def test_reads_stop_at_a_rows_pages_and_copies_run_in_order():
  """A row whose length runs past its pages (a caller that did not grow it) attends to its own slots only, never to
  the page a padded table entry would clip to; chained copies (a fork of a fork) read what the earlier one wrote."""
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((1, 1, K * G, H)), jnp.float32)
  pool = jnp.asarray(rng.standard_normal((P, Z, 2 * K, H)), jnp.float32)
  args = (jnp.asarray([[0, P, P]]), jnp.asarray([6]), jnp.asarray([[5]]))
  before = paged.reference_attention(q, pool, *args)
  after = paged.reference_attention(q, pool.at[P - 1].set(9.0), *args)
  np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
  chained = paged.copy_pages(pool, [(1, 2), (2, 3)])
  np.testing.assert_array_equal(np.asarray(chained[3]), np.asarray(pool[1]))


@pytest.mark.parametrize("with_prefix", [False, True])
def test_the_model_on_pages_gives_the_dense_caches_logits(with_prefix):
  """`transformer.apply` over a `PagedKVCache` (a ragged prefill, a fork, a ragged chunk, two decode steps) gives the
  logits of the same calls over a dense `KVCache`, rows a, b and a's fork c; with a shared prefix level too."""
  import jax

  from envace_jax.model import config as config_lib
  from envace_jax.model import transformer

  config = config_lib.get_model_config("tiny").replace(scan_layers=False)
  params = transformer.unstack_layers(transformer.init_params(config.replace(scan_layers=True), jax.random.key(1)))
  rng = np.random.default_rng(2)
  apply = jax.jit(transformer.apply, static_argnames="config")
  prefix = None
  if with_prefix:  # one shared row of 6 tokens that every row continues
    prefix = transformer.init_cache(config, batch=1, capacity=8)
    _, prefix = apply(config, params, rng.integers(0, config.vocab_size, (1, 6)).astype(np.int32), cache=prefix)
  dense = transformer.init_cache(config, batch=2, capacity=32).replace(prefix=prefix)
  pool = paged.PagePool(num_pages=24, page_size=4)
  pages = paged.init_cache(config, pool, ["a", "b"], width=8).replace(prefix=prefix)

  def call(cache, rows, valid):
    valid = np.asarray(valid, bool)
    tokens = rng.integers(0, config.vocab_size, valid.shape).astype(np.int32)
    for r, n in zip(rows, valid.sum(axis=1), strict=True):
      pool.grow(r, pool.lengths.get(r, 0) + int(n))
    out = {}
    for name, c in (("dense", cache[0]), ("paged", cache[1].replace(table=jnp.asarray(pool.table(rows, 8))))):
      out[name], cache_out = apply(config, params, tokens, cache=c, valid=valid)
      cache = (cache_out, cache[1]) if name == "dense" else (cache[0], cache_out)
    np.testing.assert_allclose(np.asarray(out["paged"])[valid], np.asarray(out["dense"])[valid], atol=1e-5, rtol=0)
    return cache

  caches = call((dense, pages), ["a", "b"], [[True] * 9, [True] * 5 + [False] * 4])
  # Row a forks into c: dense copies the row, paged shares a's two full pages and copies its partial third.
  copies = pool.fork("a", ["c"])
  assert len(copies) == 1 and pool.allocated() == 3 + 2 + 1
  dense = caches[0].replace(prefix=None).take(np.array([0, 1, 0])).replace(prefix=prefix)
  pools = tuple(paged.copy_pages(p, copies) for p in caches[1].pools)
  lengths = jnp.asarray([pool.lengths[r] for r in "abc"], jnp.int32)
  caches = (dense, caches[1].replace(pools=pools, lengths=lengths))
  caches = call(caches, ["a", "b", "c"], [[True, True, False], [True] * 3, [True, False, False]])
  for _ in range(2):
    caches = call(caches, ["a", "b", "c"], [[True], [True], [True]])
  assert [pool.lengths[r] for r in "abc"] == [13, 10, 12] and int(caches[1].lengths.sum()) == 35

  def same_rows(dense, pages):  # `PagedKVCache.dense`: each row's pages as dense own slots
    own = pages.dense()
    filled = np.arange(32)[None, :] < np.asarray(dense.lengths)[:, None]  # [B, S]
    for a, b, slots in ((dense.k[0], own.k[0], -1), (dense.v[-1], own.v[-1], 2)):  # k [B,K,H,S], v [B,K,S,H]
      a, b = (np.moveaxis(np.asarray(x), slots, 1) for x in (a, b))  # [B, S, ...]
      np.testing.assert_allclose(a[filled], b[filled], atol=1e-6, rtol=0)  # computed by two programs

  same_rows(*caches)
  # A full pool grows (`PagePool.extend`, `PagedKVCache.extended`): the rows keep their slots, "no page" becomes
  # the new count, and the model goes on over it.
  pool.extend(40)
  caches = (caches[0], caches[1].extended(40))
  assert caches[1].pools[0].shape[0] == 40 and pool.free() == 40 - pool.allocated()
  same_rows(*caches)
  caches = call(caches, ["a", "b", "c"], [[True, True], [True, False], [True, True]])
  same_rows(*caches)
  # The rollout's host-side bookkeeping (`host_filled` and the rest) reads what the device forms compute.
  want = np.asarray([pool.lengths[r] for r in "abc"]) + (6 if with_prefix else 0)
  for c in caches:
    np.testing.assert_array_equal(c.host_filled(), want)
    np.testing.assert_array_equal(c.host_filled(), np.asarray(c.filled()))
    np.testing.assert_array_equal(c.host_offsets(), np.asarray(c.offsets()))
    np.testing.assert_array_equal(c.host_row_capacity(), np.asarray(c.row_capacity()))


def test_a_write_past_a_rows_pages_is_dropped():
  """A slot in no page the row holds (past its last page, or past the table) maps out of the pool, so `write` drops
  it instead of writing into another row's page."""
  table = jnp.asarray([[5, P]])
  flat = paged.flat_slots(table, jnp.asarray([[3, 4, 8]]), jnp.ones((1, 3), bool), P, Z)
  assert flat.tolist() == [[5 * Z + 3, P * Z, P * Z]]
  pool = paged.write(paged.init_pool(P, Z, K, H), flat, jnp.ones((1, 3, K, H)), jnp.ones((1, 3, K, H)))
  assert int(jnp.count_nonzero(pool)) == 2 * K * H  # slot 3's keys and values only
