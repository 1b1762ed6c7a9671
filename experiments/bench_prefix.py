"""G rollouts continuing one long opening: the opening copied into every row (dense) vs stored once as a prefix level
that the G rows attend over together (`Sampler.fork`, `transformer._attend_prefix`), on SmolLM2-135M-Instruct.

    python -m experiments.bench_prefix                       # opening {1024, 4096} x G {4, 16}; ~15 minutes
    python -m experiments.bench_prefix --openings 4096 --groups 8 --new-tokens 64

Per (opening, G), both layouts start from the same prefilled opening (real text tokens) and run the same greedy
``generate``: a 1-token continuation, then N new tokens per row (EOS off). Printed: key/value slots allocated per layer
(`KVCache.stored_slots`; dense: G rows of opening + N + 2 slots), decode tok/s (G × N / seconds, best of
``--repeats``, compilation excluded by one untimed run of each), and whether the G × N tokens are identical (they
must be: the layouts hold the same keys and values). Each row reports the cores other processes used while it ran
(`bench_sampler.CpuMeter`): the ratio between the two layouts is the figure to read on a busy machine.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from envace_jax.model.roles import Role
from experiments.bench_sampler import CpuMeter, copy_cache, load_ours, log, machine_header, text_ids


def _run(sampler, cache, group: int, new_tokens: int) -> tuple[float, np.ndarray]:
  start = time.perf_counter()
  out, _ = sampler.generate(
    cache, [[1]] * group, Role.OBSERVATION, role=Role.ACT, key=jax.random.key(0), max_new_tokens=new_tokens
  )
  return time.perf_counter() - start, out.tokens


def bench(sampler, tokenizer, opening: int, group: int, new_tokens: int, repeats: int) -> dict:
  ids = text_ids(tokenizer, 1, opening)
  parent = sampler.init_cache(1, opening)
  parent, _, _, _ = sampler.prefill(parent, [ids[0].tolist()], Role.USER)
  jax.block_until_ready(parent)
  row = {"opening": opening, "G": group}
  make = {
    "dense": lambda: _dense(sampler, parent, group, opening + new_tokens + 2),
    "shared": lambda: sampler.fork(copy_cache(parent), group, capacity=new_tokens + 2),
  }
  tokens = {}
  meter = CpuMeter()
  for name, build in make.items():
    cache = build()
    row[f"{name}_slots"] = cache.stored_slots()
    _run(sampler, cache, group, new_tokens)  # compiles
    best = float("inf")
    for _ in range(repeats):
      cache = jax.block_until_ready(build())
      seconds, tokens[name] = _run(sampler, cache, group, new_tokens)
      best = min(best, seconds)
    row[f"{name}_tok_s"] = group * new_tokens / best
  row["busy"] = meter.stop()
  row["same"] = bool(np.array_equal(tokens["dense"], tokens["shared"]))
  return row


def _dense(sampler, parent, group: int, capacity: int):
  """The opening copied into G rows of ``capacity`` slots."""
  cache = sampler.init_cache(group, capacity)
  n = parent.capacity
  k = tuple(c.at[..., :n].set(jnp.repeat(p, group, axis=0)) for c, p in zip(cache.k, parent.k, strict=True))
  v = tuple(c.at[:, :, :n].set(jnp.repeat(p, group, axis=0)) for c, p in zip(cache.v, parent.v, strict=True))
  return jax.block_until_ready(cache.replace(k=k, v=v, lengths=jnp.repeat(parent.lengths, group)))


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--openings", default="1024,4096", help="comma-separated opening lengths (tokens)")
  parser.add_argument("--groups", default="4,16", help="comma-separated G")
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  sampler, tokenizer, _ = load_ours(prefill_chunk=512)
  rows = []
  for opening in map(int, args.openings.split(",")):
    for group in map(int, args.groups.split(",")):
      log(f"opening {opening}, G={group}")
      rows.append(bench(sampler, tokenizer, opening, group, args.new_tokens, args.repeats))
  print("\n".join(machine_header()))
  print(f"greedy decode of N={args.new_tokens} tokens per row after a 1-token continuation; best of {args.repeats}")
  columns = ["opening", "G", "KV slots dense", "KV slots shared", "decode tok/s dense", "decode tok/s shared", "ratio"]
  columns += ["same", "other cores busy"]
  print("| " + " | ".join(columns) + " |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['opening']} | {r['G']} | {r['dense_slots']} | {r['shared_slots']} | {r['dense_tok_s']:.1f} | "
      f"{r['shared_tok_s']:.1f} | {r['shared_tok_s'] / r['dense_tok_s']:.2f} | {r['same']} | {r['busy'][0]:.2f} |"
    )
  return rows


if __name__ == "__main__":
  main()
