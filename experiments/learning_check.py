"""Does world-rehearsal training raise the training reward? A short run per seed on τ² mock, curve + PNG.

    python experiments/learning_check.py                       # SmolLM2-135M, 3 seeds, 12 steps each
    python experiments/learning_check.py --model=tiny --steps=8 --seeds=0,1

Each seed runs ``train.Trainer`` (the same loop as ``python -m envace_jax.main``) on τ² mock's tasks with the rule
checklist reward, without the final evaluation, and records the mean training reward per step. The check passes
when, for every seed, the mean reward of the last ``--window`` steps exceeds that of the first ``--window`` steps.
Prints a table (seed x step) and the verdict, and saves ``--out`` (PNG: reward per step, one line per seed, plus
their mean). Not a timed test: it trains for minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(model: str, seed: int, steps: int, data_dir: str, lr: float, group: int, tasks: int):
  spec = importlib.util.spec_from_file_location(
    "tau2_config", ROOT / "configs" / ("tiny.py" if model == "tiny" else "tau2.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config() if model == "tiny" else module.get_config("mock")
  c.seed = seed
  c.env.data_dir = data_dir
  c.train.steps = steps
  c.train.eval_tasks = 0
  c.train.eval_every = 0
  c.train.group_size = group
  c.train.tasks_per_step = tasks
  c.train.checkpoint_every = steps
  c.grpo.learning_rate = lr
  return c


def run_seed(args, seed: int) -> list[float]:
  from envace_jax import metrics, train

  with tempfile.TemporaryDirectory() as workdir:
    config = load_config(args.model, seed, args.steps, args.data_dir, args.lr, args.group, args.tasks)
    start = time.perf_counter()
    train.train_and_evaluate(config, workdir)
    records = metrics.read_jsonl(workdir)
    print(f"seed {seed}: {args.steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
  return [float(r["reward/mean"]) for r in records]


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--window", type=int, default=3, help="steps averaged at the start and at the end")
  parser.add_argument("--lr", type=float, default=1e-5)
  parser.add_argument("--group", type=int, default=4, help="G rollouts per task")
  parser.add_argument("--tasks", type=int, default=2, help="B tasks per step")
  parser.add_argument("--data-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "envace_tfds"))
  parser.add_argument("--out", default="learning_check.png")
  args = parser.parse_args(argv)
  if 2 * args.window > args.steps:
    parser.error("--steps must be at least twice --window")
  seeds = [int(s) for s in args.seeds.split(",")]
  curves = {seed: run_seed(args, seed) for seed in seeds}

  print(f"\nmean training reward per step (τ² mock, {args.model}, B={args.tasks}, G={args.group}, lr={args.lr})")
  print("seed | " + " ".join(f"{s:>5}" for s in range(1, args.steps + 1)) + " | first  last  gain")
  ok = True
  for seed, curve in curves.items():
    first, last = np.mean(curve[: args.window]), np.mean(curve[-args.window :])
    ok &= bool(last > first)
    print(f"{seed:>4} | " + " ".join(f"{r:5.2f}" for r in curve) + f" | {first:5.2f} {last:5.2f} {last - first:+5.2f}")
  mean = np.mean(list(curves.values()), axis=0)
  print(" all | " + " ".join(f"{r:5.2f}" for r in mean))
  print(f"learning check ({args.window}-step windows, every seed): {'PASSED' if ok else 'FAILED'}")

  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  steps = np.arange(1, args.steps + 1)
  for seed, curve in curves.items():
    ax.plot(steps, curve, alpha=0.5, label=f"seed {seed}")
  ax.plot(steps, mean, color="black", linewidth=2, label="mean")
  ax.set_xlabel("step")
  ax.set_ylabel("mean training reward (rule checklist)")
  ax.set_title(f"EnvACE on τ² mock ({args.model})")
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f"saved {args.out}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
