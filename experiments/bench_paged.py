"""G rows continuing one opening, decoded over four KV layouts: storage and decode speed (`model/paged.py`).

    python -m experiments.bench_paged                          # SmolLM2-135M shapes, opening {1024} x G {8}; ~3 min
    python -m experiments.bench_paged --openings 256,2048 --groups 4,16 --page-size 64
    python -m experiments.bench_paged --model tiny             # the random tiny model: seconds

Layouts (the same opening prefilled once, then the same greedy decode of N tokens per row, EOS off):
  * ``dense``: every row holds the opening and its own tokens (G rows of opening + N + 1 slots);
  * ``prefix``: the opening stored once as a `KVCache.prefix` level, each row its own N + 1 slots (today's sampler);
  * ``paged``: each row's slots in pages (`envace_jax/model/paged.py`): the opening's full pages shared by the G forks,
    each fork's pages reserved for the N + 1 slots it will write; attention gathers a row's pages (reads G copies);
  * ``paged+prefix``: the opening as a prefix level, each row's own slots in pages.
Printed per layout: KV slots stored per layer (pages held x page size, plus the prefix level's opening slots), decode
tok/s (G x N / seconds, best of ``--repeats``, compilation excluded by an untimed run), and whether its G x N tokens
equal the dense layout's. Random weights (decode speed does not depend on their values): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from envace_jax.model import config as config_lib
from envace_jax.model import paged, transformer


def greedy_decode(config, params, cache, first, steps: int):
  """Greedy decode of ``steps`` tokens after ``first`` int32[G]: (int32[G, steps] tokens, the cache)."""

  def body(i, carry):
    cache, token, out = carry
    logits, cache = transformer.apply(config, params, token[:, None], cache=cache)
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    return cache, token, out.at[:, i].set(token)

  out = jnp.zeros((first.shape[0], steps), jnp.int32)
  cache, _, out = jax.lax.fori_loop(0, steps, body, (cache, first, out))
  return out, cache


def _layouts(config, params, opening: np.ndarray, group: int, new_tokens: int, page_size: int) -> dict:
  """name -> (a function building a fresh cache, KV slots stored per layer)."""
  c = len(opening)
  root = transformer.init_cache(config, batch=1, capacity=c)
  _, root = transformer.apply(config, params, jnp.asarray(opening)[None], cache=root)
  own = new_tokens + 1

  def dense():
    cache = transformer.init_cache(config, batch=group, capacity=c + own)
    k = tuple(x.at[..., :c].set(jnp.repeat(p, group, axis=0)) for x, p in zip(cache.k, root.k, strict=True))
    v = tuple(x.at[:, :, :c].set(jnp.repeat(p, group, axis=0)) for x, p in zip(cache.v, root.v, strict=True))
    return cache.replace(k=k, v=v, lengths=jnp.full((group,), c, jnp.int32))

  def prefix():
    return transformer.init_cache(config, batch=group, capacity=own).replace(prefix=root)

  def pages(with_prefix: bool):
    pool = paged.PagePool(num_pages=group * (-(-(c + own) // page_size)) + 1, page_size=page_size)
    rows = list(range(group))
    if with_prefix:
      cache = paged.init_cache(config, pool, rows, width=-(-own // page_size)).replace(prefix=root)
    else:  # the opening written into the root row's pages, its full pages then shared by the G forks
      cache = paged.init_cache(config, pool, ["root"], width=-(-c // page_size))
      pool.grow("root", c)
      cache = cache.replace(table=jnp.asarray(pool.table(["root"], cache.table.shape[1])))
      _, cache = transformer.apply(config, params, jnp.asarray(opening)[None], cache=cache)
      copies = pool.fork("root", rows)
      pool.release("root")
      cache = cache.replace(pools=tuple(paged.copy_pages(p, copies) for p in cache.pools))
    for r in rows:
      pool.grow(r, pool.lengths.get(r, 0) + own)  # the generation's slots, reserved before it runs
    width = max(len(pool.pages[r]) for r in rows)
    lengths = jnp.full((group,), 0 if with_prefix else c, jnp.int32)
    built = cache.replace(table=jnp.asarray(pool.table(rows, width)), lengths=lengths)
    return built, pool.allocated() * page_size

  paged_cache, paged_slots = pages(False)
  mixed_cache, mixed_slots = pages(True)
  return {
    "dense": (dense, group * (c + own)),
    "prefix": (prefix, c + group * own),
    "paged": (lambda: jax.tree.map(jnp.copy, paged_cache), paged_slots),
    "paged+prefix": (lambda: jax.tree.map(jnp.copy, mixed_cache), c + mixed_slots),
  }


def bench(config, params, opening: int, group: int, new_tokens: int, page_size: int, repeats: int) -> list[dict]:
  ids = np.asarray(jax.random.randint(jax.random.key(opening), (opening,), 1, config.vocab_size), np.int32)
  first = jnp.asarray(np.arange(group) % config.vocab_size + 1, jnp.int32)  # each row continues differently
  decode = jax.jit(greedy_decode, static_argnames=("config", "steps"))
  rows, reference = [], None
  for name, (build, slots) in _layouts(config, params, ids, group, new_tokens, page_size).items():
    jax.block_until_ready(decode(config, params, build(), first, new_tokens))  # compiles
    best = float("inf")
    for _ in range(repeats):
      cache = jax.block_until_ready(build())
      start = time.perf_counter()
      tokens, _ = jax.block_until_ready(decode(config, params, cache, first, new_tokens))
      best = min(best, time.perf_counter() - start)
    tokens = np.asarray(tokens)
    reference = tokens if reference is None else reference
    row = {"opening": opening, "G": group, "layout": name, "kv_slots": slots, "tok_s": group * new_tokens / best}
    rows.append(row | {"same": bool(np.array_equal(tokens, reference))})
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="smollm2-135m", help="a model config preset (random weights)")
  parser.add_argument("--openings", default="1024", help="comma-separated opening lengths (tokens)")
  parser.add_argument("--groups", default="8", help="comma-separated G")
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--page-size", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  config = config_lib.get_model_config(args.model).replace(scan_layers=False)
  params = transformer.unstack_layers(transformer.init_params(config.replace(scan_layers=True), jax.random.key(0)))
  print(f"{args.model}, random weights, {jax.default_backend()}, page size {args.page_size}, N={args.new_tokens}")
  print("| opening | G | layout | KV slots per layer | decode tok/s | same tokens as dense |")
  print("|---|---|---|---|---|---|")
  rows = []
  for opening in map(int, args.openings.split(",")):
    for group in map(int, args.groups.split(",")):
      for row in bench(config, params, opening, group, args.new_tokens, args.page_size, args.repeats):
        print(f"| {opening} | {group} | {row['layout']} | {row['kv_slots']} | {row['tok_s']:.1f} | {row['same']} |")
        rows.append(row)
  return rows


if __name__ == "__main__":
  main()
