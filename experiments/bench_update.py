"""The update's cost per row length: loss and gradient of one long training row, seconds and compiled memory.

    python experiments/bench_update.py [--lengths 2048,8192] [--no-remat-memory]

One row of T tokens (a causal sequence, as a trajectory's view trains; half of it trained) through
``rl.logprobs.target_logprobs`` with per-layer rematerialisation, the update's setting, and the gradient of the summed
logprobs: SmolLM2-135M's shapes in float32 with random weights (the cost does not depend on their values). Printed per
T: seconds of one call after compiling (best of ``--repeats``), tokens/s, and the compiled temporaries
(``memory_analysis``) with remat and, unless ``--no-remat-memory``, without it (compiled only, not run). What grows with
T is attention: ``transformer._tiled_attention`` tiles it in the forward and the backward.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from envace_jax.model import config as model_config  # noqa: E402
from envace_jax.model import transformer  # noqa: E402
from envace_jax.rl import logprobs  # noqa: E402
from experiments import common  # noqa: E402


def row(t: int) -> types.SimpleNamespace:
  """A [1, T] causal row whose second half is trained (the fields ``target_logprobs`` reads)."""
  trained = np.arange(t // 2, t, dtype=np.int32)[None]
  tokens = np.random.default_rng(0).integers(0, 1000, (1, t), dtype=np.int32)
  return types.SimpleNamespace(
    tokens=jnp.asarray(tokens),
    roles=jnp.zeros((1, t), jnp.int32),
    valid=jnp.ones((1, t), bool),
    positions=jnp.arange(t, dtype=jnp.int32)[None],
    segments=jnp.zeros((1, t), jnp.int32),
    parents=jnp.zeros((1, t), jnp.int32),
    target_index=jnp.asarray(trained),
    source_index=jnp.asarray(trained - 1),
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", type=common.parse_ints, default=[2048, 8192], help="row lengths T, multiples of 512")
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--no-remat-memory", action="store_true", help="skip compiling the variant without remat")
  args = parser.parse_args()
  common.quiet_libraries()
  config = model_config.get_model_config("smollm2-135m", dtype="float32")
  params = transformer.init_params(config, jax.random.key(0))
  print("| T | trained | seconds | tokens/s | temporaries GiB, remat | without remat |")
  print("|---|---|---|---|---|---|")
  for t in args.lengths:
    batch = row(t)
    temps = {}
    for remat in (True, False) if not args.no_remat_memory else (True,):
      grad = jax.jit(jax.grad(lambda p, b=batch, r=remat: jnp.sum(logprobs.target_logprobs(config, p, b, remat=r)[0])))
      compiled = grad.lower(params).compile()
      temps[remat] = compiled.memory_analysis().temp_size_in_bytes / 2**30
      if remat:
        run = compiled
    best = float("inf")
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(run(params))
      best = min(best, time.perf_counter() - start)
    without = f"{temps[False]:.2f}" if False in temps else "–"
    print(f"| {t} | {t // 2} | {best:.1f} | {t / best:.0f} | {temps[True]:.2f} | {without} |", flush=True)


if __name__ == "__main__":
  main()
