"""Does world-rehearsal training raise the reward? Before/after on a fixed task set per seed, the training curve, a PNG.

    python experiments/learning_check.py                       # SmolLM2-135M on τ² mock, 3 seeds, 8 steps each
    python experiments/learning_check.py --model=tiny --steps=2 --seeds=0   # a smoke run of the script itself

Each seed builds ``train.Trainer`` (the loop of ``python -m envace_jax.main``) on τ² mock with the rule-checklist
reward, then:
  1. scores the policy at step 0 on a fixed set: every training task, ``--group`` rehearsed rollouts each (the
     same rollout code and reward as training; a fixed key, so the only difference later is the parameters);
  2. trains ``--steps`` steps (each step draws ``--tasks`` tasks: the per-step training reward mostly tells which task
     came up, so it is printed but not judged);
  3. scores the trained policy on the same set with the same key.
The check passes when, for every seed, the mean reward on the fixed set after training exceeds the one before. Prints
a table and the verdict and saves ``--out`` (PNG: per-step training reward per seed, and before/after per seed).
Not a timed test: it trains for minutes (SmolLM2 on 2 CPU cores: ~2.5 min per step at B=1, G=4).
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


def fixed_set_reward(trainer, tasks, seed: int) -> float:
  """Mean rule-checklist reward of the current policy on ``tasks`` (G rollouts each, a fixed key)."""
  import jax

  trajectories, _ = trainer.rollout(tasks, jax.random.key(10_000 + seed))
  rewards = [t.reward.reward for t in trajectories if t.reward is not None and t.reward.valid]
  return float(np.mean(rewards)) if rewards else float("nan")


def run_seed(args, seed: int) -> tuple[list[float], float, float]:
  """(training reward per step, fixed-set reward before, after) for one seed."""
  from envace_jax import metrics, train

  with tempfile.TemporaryDirectory() as workdir:
    config = load_config(args.model, seed, args.steps, args.data_dir, args.lr, args.group, args.tasks)
    start = time.perf_counter()
    trainer = train.Trainer(config, workdir)
    tasks = [trainer.train_source[i] for i in range(len(trainer.train_source))]
    before = fixed_set_reward(trainer, tasks, seed)
    trainer.run()
    after = fixed_set_reward(trainer, tasks, seed)
    records = metrics.read_jsonl(workdir)
    print(f"seed {seed}: before {before:.3f}, after {after:.3f}, {time.perf_counter() - start:.0f} s", flush=True)
  return [float(r["reward/mean"]) for r in records], before, after


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--lr", type=float, default=1e-5)
  parser.add_argument("--group", type=int, default=4, help="G rollouts per task")
  parser.add_argument("--tasks", type=int, default=1, help="B tasks per step")
  parser.add_argument("--data-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "envace_tfds"))
  parser.add_argument("--out", default="learning_check.png")
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  results = {seed: run_seed(args, seed) for seed in seeds}
  curves = {seed: r[0] for seed, r in results.items()}

  print(f"\nτ² mock, {args.model}, B={args.tasks}, G={args.group}, lr={args.lr}, {args.steps} steps")
  print("training reward per step (a different task each step):")
  print("seed | " + " ".join(f"{s:>5}" for s in range(1, args.steps + 1)))
  for seed, curve in curves.items():
    print(f"{seed:>4} | " + " ".join(f"{r:5.2f}" for r in curve))
  mean = np.mean(list(curves.values()), axis=0)
  print(" all | " + " ".join(f"{r:5.2f}" for r in mean))
  print("fixed set (every training task x G, same key): seed | before  after  gain")
  ok = True
  for seed, (_, before, after) in results.items():
    ok &= bool(after > before)
    print(f"  {seed:>4} | {before:6.3f} {after:6.3f} {after - before:+6.3f}")
  print(f"learning check (after > before on the fixed set, every seed): {'PASSED' if ok else 'FAILED'}")

  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
  steps = np.arange(1, args.steps + 1)
  for seed, curve in curves.items():
    ax.plot(steps, curve, alpha=0.5, label=f"seed {seed}")
  ax.plot(steps, mean, color="black", linewidth=2, label="mean")
  ax.set_xlabel("step")
  ax.set_ylabel("training reward (rule checklist)")
  ax.set_title(f"EnvACE on τ² mock ({args.model})")
  ax.legend()
  for seed, (_, before, after) in results.items():
    bx.plot([0, args.steps], [before, after], marker="o", label=f"seed {seed}")
  bx.set_xlabel("step")
  bx.set_ylabel("fixed-set reward")
  bx.set_title("before / after")
  bx.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f"saved {args.out}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
