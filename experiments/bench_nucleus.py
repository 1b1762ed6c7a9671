"""The cost of top-p sampling: `sampler.sample_tokens` with the nucleus found among the top
`sampler.NUCLEUS_CANDIDATES` tokens (today's program) against the whole-vocabulary sort (the former program), on a
CPU or any backend. The held-out evaluation samples with ``eval.sampling`` (temperature 0.6, top_p 0.95, the official
setting), so every decode step of it pays this.

    python experiments/bench_nucleus.py                 # sample_tokens alone, 8 rows x SmolLM2's 49,152 logits
    python experiments/bench_nucleus.py --decode --reps=2   # + generate on 8 testbed prompts, SmolLM2-135M base

The first table times `sample_tokens` (median of 20 calls) on peaked logits (a trained model's: the nucleus lies in
the top candidates) and on flat ones (where today's program falls back to the sort). ``--decode`` runs ``generate``
(96 new tokens, then 1: the difference is the decode steps) on the first 8 ``iid`` testbed prompts in one
subprocess per variant (programs are traced per process), and checks both variants drew the same tokens. Results:
experiments/results/2026-12-05_eval_speed.md. Costs about a minute, ``--decode`` 6-10 more.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

WHOLE_SORT = 10**9  # NUCLEUS_CANDIDATES at least the vocabulary: `_nucleus` sorts every row (the former program)


def bench_sample_tokens(rows: int = 8, vocab: int = 49_152) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from envace_jax.sampling import sampler as S

  rng = np.random.default_rng(0)
  flat = rng.standard_normal((rows, vocab)).astype(np.float32) * 2.0
  peaked = flat.copy()
  peaked[:, :5] += 25.0
  keys = jax.random.split(jax.random.key(0), rows)
  print("| logits | sampling | top candidates (ms) | whole sort (ms) |\n|---|---|---|---|")
  for name, logits in (("peaked", jnp.asarray(peaked)), ("flat", jnp.asarray(flat))):
    for label, sp in (
      ("greedy", S.SamplingParams(temperature=0.0)),
      ("temperature 0.6", S.SamplingParams(temperature=0.6)),
      ("temperature 0.6, top_p 0.95", S.SamplingParams(temperature=0.6, top_p=0.95)),
    ):
      cells = []
      for candidates in (256, WHOLE_SORT):
        S.NUCLEUS_CANDIDATES = candidates
        f = jax.jit(lambda x, k, sp=sp: S.sample_tokens(x, k, sp))  # a fresh trace reads the constant
        f(logits, keys).block_until_ready()
        times = []
        for _ in range(20):
          start = time.perf_counter()
          f(logits, keys).block_until_ready()
          times.append(time.perf_counter() - start)
        cells.append(f"{1e3 * float(np.median(times)):.1f}")
      print(f"| {name} | {label} | {cells[0]} | {cells[1]} |", flush=True)


def decode_run(candidates: int, reps: int) -> dict:
  """One variant, in this process: generate 96 and 1 new tokens on 8 testbed prompts; best of ``reps`` after one
  warm-up call each."""
  import jax

  from envace_jax import runtime
  from envace_jax.model.roles import Role
  from envace_jax.model.tokenizer import Message
  from envace_jax.sampling import sampler as S
  from experiments import testbed_calibration as cal

  S.NUCLEUS_CANDIDATES = candidates
  config = cal.make_config("cpu", 0, "smollm2-135m")
  config.env.eval_split = "iid"
  model, samplers, _ = cal.load(config, None, None)
  prompts, roles = [], []
  for t in runtime.evaluation_tasks(config, 8)[:8]:
    ids, r = model.tokenizer.render(
      [Message("system", t.system_prompt), Message("user", t.user_turns[0])], t.tools, add_generation_prompt=True
    )
    prompts.append(ids)
    roles.append(r)
  sampler = samplers["policy"]
  sp = S.SamplingParams(**{k: config.eval.sampling[k] for k in ("temperature", "top_k", "top_p")})
  out = {"candidates": candidates}
  for new in (96, 1):
    times = []
    for _ in range(reps + 1):
      cache = sampler.init_cache(8, 2048)
      start = time.perf_counter()
      got, cache = sampler.generate(
        cache, prompts, roles, role=int(Role.ACT), key=jax.random.key(1), max_new_tokens=new, sampling=sp
      )
      jax.block_until_ready(cache)
      times.append(time.perf_counter() - start)
    out[f"s_{new}"] = min(times[1:])
    if new == 96:
      out["tokens"], out["steps"] = got.tokens.tolist(), int(got.lengths.max())
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--decode", action="store_true", help="also generate on testbed prompts (SmolLM2-135M base)")
  p.add_argument("--reps", type=int, default=2, help="timed generate calls per length (best kept)")
  p.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)  # the --decode subprocess
  args = p.parse_args(argv)
  if args.variant is not None:
    print(json.dumps(decode_run(args.variant, args.reps)))
    return
  bench_sample_tokens()
  if not args.decode:
    return
  runs = []
  for candidates in (256, WHOLE_SORT):
    cmd = [sys.executable, __file__, f"--variant={candidates}", f"--reps={args.reps}"]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    runs.append(json.loads(text.strip().splitlines()[-1]))
  print("\n| program | generate 96 tokens (s) | 1 token (s) | decode ms/step |\n|---|---|---|---|")
  for run, name in zip(runs, ("top candidates", "whole sort"), strict=True):
    per_step = 1e3 * (run["s_96"] - run["s_1"]) / (run["steps"] - 1)
    print(f"| {name} | {run['s_96']:.1f} | {run['s_1']:.1f} | {per_step:.0f} |")
  print(f"\nsame tokens: {runs[0]['tokens'] == runs[1]['tokens']}")


if __name__ == "__main__":
  main()
