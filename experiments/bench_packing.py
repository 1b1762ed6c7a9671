"""Tokens the update trains on for one step of τ² airline, by how the rows are packed (rl/batch.py).

    python experiments/bench_packing.py [--tasks 4] [--group 4] [--time]

The rows are real: each task's reference conversation replayed as a demonstration (`train.Trainer.demonstrations`,
SmolLM2's tokenizer and chat template, configs/tau2.py's views), each repeated ``--group`` times in one group as if G
rollouts had followed it. Every ACT row opens with the domain's policy and tool schemas, every REHEARSE row with the
environment's instructions and the same schemas. Three layouts of the same trained tokens:

  * plain: one row per (trajectory, role);
  * per task: a task's rows of one role packed around their shared prefix (``grpo.max_packed_length=0``);
  * across tasks: the rows of one role in several tasks packed around their common root too, up to
    ``grpo.max_packed_length`` tokens per row (envace_jax/config/defaults.py).

Printed per layout: rows, tokens the forward sees (valid), the padded [rows, T] it computes on, and with ``--time``
the seconds of one update step (the jitted forward, backward and AdamW step on SmolLM2, best of 2 after a compile).
With G = 1 (the supervised warm-up: one demonstration per task) per-task packing has nothing to share.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from envace_jax.model.roles import NUM_ROLES  # noqa: E402
from envace_jax.rl import grpo  # noqa: E402
from experiments import common  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tasks", type=int, default=4, help="tasks per step (B)")
  parser.add_argument("--group", type=int, default=4, help="rows per task and role (G)")
  parser.add_argument(
    "--max-packed-length", type=int, default=0, help="0: envace_jax/config/defaults.py's grpo.max_packed_length"
  )
  parser.add_argument("--time", action="store_true", help="also time one update step per layout")
  parser.add_argument("--data-dir", default=common.DEFAULT_DATA_DIR)
  args = parser.parse_args()

  from envace_jax import train

  common.quiet_libraries()

  config = common.make_config("smollm2", "airline", 0, args.data_dir)
  config.train.tasks_per_step = args.tasks
  limit = args.max_packed_length or config.grpo.max_packed_length
  with tempfile.TemporaryDirectory() as workdir:
    trainer = train.Trainer(config, workdir)
    demos, skipped = trainer.demonstrations(trainer.stream.next_batch())
  trajectories = [t for t in demos for _ in range(args.group)]  # G copies in the task's group (Trajectory.group)
  adv = np.zeros((len(trajectories), NUM_ROLES), np.float32)
  adv[:, list(trainer.grpo_cfg.trained_roles)] = 1.0
  layouts = {
    "plain": dict(pack_shared_prefix=False),
    "per task": dict(pack_shared_prefix=True, max_packed_length=0),
    "across tasks": dict(pack_shared_prefix=True, max_packed_length=limit),
  }
  print(f"τ² airline, SmolLM2 tokenizer: {len(demos)} demonstrations ({skipped} tasks skipped) × G={args.group}, "
        f"max_packed_length {limit}; {os.cpu_count()} CPUs")  # fmt: skip
  print(f"{'layout':<14} {'rows':>5} {'valid tokens':>13} {'padded tokens':>14} {'trained':>8} {'update s':>9}")
  for name, fields in layouts.items():
    cfg = dataclasses.replace(trainer.grpo_cfg, **fields)
    batch = grpo.build_batch(trajectories, adv, cfg, pad_id=trainer.model.tokenizer.pad_id or 0)
    rows = int(np.asarray(batch.valid).any(axis=-1).sum())
    seconds = float("nan")
    if args.time:
      update = grpo.make_update_step(trainer.model.config, cfg, donate=False)
      times = []
      for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(update(trainer.state, batch))
        times.append(time.perf_counter() - start)
      seconds = min(times[1:])
    print(f"{name:<14} {rows:>5} {int(np.asarray(batch.valid).sum()):>13} {int(np.asarray(batch.tokens).size):>14} "
          f"{batch.num_tokens:>8} {seconds:>9.1f}")  # fmt: skip


if __name__ == "__main__":
  main()
