"""The update's cost per row length: loss and gradient of one long training row, seconds and compiled memory.

    python experiments/bench_update.py [--lengths 2048,8192] [--no-remat-memory]

One ACT row of T tokens, half of them trained, laid out by the update's own ``rl.batch.collate``, through
``rl.logprobs.target_logprobs`` with per-layer rematerialisation (the update's setting), and the gradient of the summed
logprobs: SmolLM2-135M's shapes in float32 with random weights (the cost does not depend on their values). Printed per
T: seconds of one call after compiling (best of ``--repeats``), tokens/s, and the compiled temporaries
(``memory_analysis``) with remat and, unless ``--no-remat-memory``, without it (compiled only, not run). Attention is
tiled in the forward and the backward (``transformer._tiled_attention``), so what grows with T is mostly every
layer's saved input.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from envace_jax.model import config as model_config  # noqa: E402
from envace_jax.model import transformer  # noqa: E402
from envace_jax.model.roles import Role  # noqa: E402
from envace_jax.rehearsal.trajectory import TrainingRow  # noqa: E402
from envace_jax.rl import batch as batch_lib  # noqa: E402
from envace_jax.rl import logprobs  # noqa: E402
from experiments import common  # noqa: E402


def row(t: int) -> batch_lib.TrainBatch:
  """One causal [1, T] ACT row whose second half is trained, laid out by the update's own ``collate``."""
  trained = np.arange(t) >= t // 2
  view = TrainingRow(
    tokens=np.random.default_rng(0).integers(0, 1000, t, dtype=np.int32),
    roles=np.full(t, Role.ACT, np.int32),
    loss_mask=trained,
    logprobs=np.zeros(t, np.float32),
    role=Role.ACT,
    trajectory=0,
    num_generations=1,
  )
  return batch_lib.collate([view], [1.0], trained_roles=[Role.ACT])


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

    def compiled(remat: bool, batch=batch):
      grad = jax.grad(lambda p: jnp.sum(logprobs.target_logprobs(config, p, batch, remat=remat)[0]))
      return jax.jit(grad).lower(params).compile()

    run = compiled(True)
    temps = run.memory_analysis().temp_size_in_bytes / 2**30
    without = "–" if args.no_remat_memory else f"{compiled(False).memory_analysis().temp_size_in_bytes / 2**30:.2f}"
    best = float("inf")
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(run(params))
      best = min(best, time.perf_counter() - start)
    print(f"| {t} | {t // 2} | {best:.1f} | {t / best:.0f} | {temps:.2f} | {without} |", flush=True)


if __name__ == "__main__":
  main()
