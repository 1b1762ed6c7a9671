"""Does training raise the reward? Before/after on a fixed task set per seed, the training curve, a PNG.

    python experiments/learning_check.py                       # SmolLM2-135M on τ² mock, 3 seeds, EnvACE
    python experiments/learning_check.py --mode=grpo_real_env  # the same budget, plain GRPO against the real tools
    python experiments/learning_check.py --model=tiny --steps=1 --seeds=0 --sft-steps=1   # a smoke run of the script

Each seed builds ``train.Trainer`` (the loop of ``python -m envace_jax.main``) on τ² mock with the rule-checklist
reward (``--mode=grpo_real_env``: τ²'s own evaluator), training on ``--task-ids`` only (``env.train_task_ids``; by
default three tasks with one gold call each, every one of them in every step: the loop is asked to fit a fixed
batch, the simplest setting where learning must show). The user's first message is the task's scenario
(``rollout.scenario_opening``; ``--simulated-opening`` turns it off): SmolLM2-135M as the user simulator almost
never states the request, and an agent that is not told the task cannot earn its reward. Then:
  1. takes ``--sft-steps`` supervised warm-up steps (``train.sft_warmup_steps``: the tasks' gold calls for ACT, the
     real tools' responses for REHEARSE) at ``--sft-lr``. Without them SmolLM2-135M never calls a tool, every rollout
     of a task gets the same reward and every GRPO advantage is 0 (measured: reward std 0 in all groups, grad norm 0);
  2. scores the policy on the fixed set: every training task, ``--fixed-group`` rollouts each (the same rollout code
     and reward as training; a fixed key, so the only difference later is the parameters);
  3. trains ``--steps`` GRPO steps at ``--lr``, from a fresh AdamW state (``grpo.fresh_optimizer_after_sft``: no
     momentum of the warm-up is left in them);
  4. scores the trained policy on the same set with the same key.
The check passes when both hold: for every seed, the fixed-set reward after the GRPO steps exceeds the one before
them (after the warm-up: what is judged is reinforcement learning, not the supervised warm-up), and the
training reward at the last GRPO step, averaged over the seeds, exceeds the one at the first (whose
rollouts come from the policy before any GRPO update). Prints a table and the verdict and saves ``--out`` (PNG:
per-step training reward per seed, and before/after per seed).
Not a timed test. Measured on 2 CPU cores with the defaults (SmolLM2; 2 warm-up steps, 6 GRPO steps of B=3 x G=4
at lr 2e-5, the fixed set 3 tasks x 8): 25 min per seed for EnvACE; PASSED, fixed-set gains +0.27, +0.23,
+0.23, mean training reward 0.25 at the first GRPO step and 0.50 at the last
(experiments/results/2026-11-30_learning_check.md).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/learning_check.py` puts experiments/ first on the path
  sys.path.insert(0, str(ROOT))

from experiments import common  # noqa: E402

# One gold call each, three different tools: create a task, update a task's status, transfer to a human.
TASK_IDS = "create_task_1,update_task_1,impossible_task_1"


def tasks_per_step(args) -> int:
  """B: ``--tasks``, else one per ``--task-ids`` id (every training task in every step), else 1."""
  return args.tasks or len(common.parse_names(args.task_ids)) or 1


def load_config(args, seed: int):
  """The training config of one seed (``args``: this script's arguments)."""
  c = common.make_config(args.model, "mock", seed, args.data_dir)
  c.train.steps = args.sft_steps + args.steps
  c.train.sft_warmup_steps = args.sft_steps
  c.train.eval_tasks = 0
  c.train.eval_every = 0
  c.train.group_size = args.group
  c.env.train_task_ids = args.task_ids
  common.apply_overrides(c, common.TRAINING_MODES[args.mode])
  c.train.tasks_per_step = tasks_per_step(args)
  c.grpo.learning_rate = args.lr
  c.grpo.sft_learning_rate = args.sft_lr
  c.rollout.max_turns = args.max_turns
  c.rollout.scenario_opening = not args.simulated_opening
  for role in ("act", "rehearse", "user"):
    c.rollout[f"{role}_max_new_tokens"] = args.max_new_tokens
  return c


def fixed_set_reward(trainer, tasks, seed: int, group: int) -> float:
  """Mean rule-checklist reward of the current policy on ``tasks`` (``group`` rollouts each, a fixed key)."""
  import jax

  trajectories, _ = trainer.rollout(tasks, jax.random.key(10_000 + seed), group_size=group)
  rewards = [t.reward.reward for t in trajectories if t.reward is not None and t.reward.valid]
  return float(np.mean(rewards)) if rewards else float("nan")


def run_seed(args, seed: int) -> tuple[list[float], list[float], float, float]:
  """(warm-up NLL per step, GRPO training reward per step, fixed-set reward before the GRPO steps, after) of a seed."""
  from envace_jax import train

  with tempfile.TemporaryDirectory() as workdir:
    config = load_config(args, seed)
    start = time.perf_counter()
    trainer = train.Trainer(config, workdir)
    tasks = [trainer.train_source[i] for i in range(len(trainer.train_source))]
    nll = [trainer.step(s).get("sft/nll", float("nan")) for s in range(1, args.sft_steps + 1)]  # nan: no rows
    before = fixed_set_reward(trainer, tasks, seed, args.fixed_group)
    curve = []
    for s in range(args.sft_steps + 1, args.sft_steps + args.steps + 1):
      record = trainer.step(s)
      curve.append(float(record["reward/mean"]))
      print(f"seed {seed} step {s}: reward {curve[-1]:.3f} std {record['reward/std']:.3f}, "
            f"grad norm {record.get('update/grad_norm', float('nan')):.3f}, {record['time/step_s']:.0f} s "
            f"(update {record['time/update_s']:.0f} s)", flush=True)  # fmt: skip
    after = fixed_set_reward(trainer, tasks, seed, args.fixed_group)
    print(f"seed {seed}: before {before:.3f}, after {after:.3f}, {time.perf_counter() - start:.0f} s", flush=True)
  return nll, curve, before, after


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--mode", default="envace", choices=list(common.TRAINING_MODES), help="what is trained")
  parser.add_argument("--steps", type=int, default=6, help="GRPO steps after the warm-up")
  parser.add_argument("--lr", type=float, default=2e-5, help="GRPO learning rate")
  parser.add_argument("--sft-steps", type=int, default=2, help="supervised warm-up steps, B tasks each (0: none)")
  parser.add_argument("--sft-lr", type=float, default=1e-4, help="warm-up learning rate")
  parser.add_argument("--group", type=int, default=4, help="G rollouts per task")
  parser.add_argument("--task-ids", default=TASK_IDS, help="the training tasks (env.train_task_ids; '': all 9)")
  parser.add_argument("--tasks", type=int, default=0, help="B tasks per step (0: one per task id; 1 without)")
  parser.add_argument("--fixed-group", type=int, default=8, help="rollouts per task on the fixed set")
  parser.add_argument("--max-turns", type=int, default=2, help="ACT generations per trajectory (mock: call, reply)")
  parser.add_argument("--max-new-tokens", type=int, default=64, help="per generation, every role")
  parser.add_argument(
    "--simulated-opening",
    action="store_true",
    help="the user simulator writes the user's first message (default: the task's scenario is it; "
    "rollout.scenario_opening)",
  )
  parser.add_argument("--data-dir", default=common.DEFAULT_DATA_DIR)
  parser.add_argument("--out", default="learning_check.png")
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  results = {seed: run_seed(args, seed) for seed in seeds}
  curves = {seed: r[1] for seed, r in results.items()}

  print(f"\nτ² mock, {args.model}, {args.mode}, tasks {args.task_ids or 'all'}: {args.sft_steps} warm-up steps at lr "
        f"{args.sft_lr}, then {args.steps} GRPO steps (B={tasks_per_step(args)}, G={args.group}, "
        f"lr={args.lr})")  # fmt: skip
  if args.sft_steps:
    print("warm-up NLL per step (nats per trained token, before each update):")
    for seed, r in results.items():
      print(f"{seed:>4} | " + " ".join(f"{x:5.3f}" for x in r[0]))
  print("GRPO training reward per step (on-policy, a new key each step):")
  print("seed | " + " ".join(f"{s:>5}" for s in range(1, args.steps + 1)))
  for seed, curve in curves.items():
    print(f"{seed:>4} | " + " ".join(f"{r:5.2f}" for r in curve))
  mean = np.mean(list(curves.values()), axis=0)
  print(" all | " + " ".join(f"{r:5.2f}" for r in mean))
  print(f"fixed set (every training task x {args.fixed_group}, one key), before and after the GRPO steps:")
  print("  seed | before  after   gain")
  ok = True
  for seed, (_, _, before, after) in results.items():
    ok &= bool(after > before)
    print(f"  {seed:>4} | {before:6.3f} {after:6.3f} {after - before:+6.3f}")
  print(f"fixed set, after > before the GRPO steps for every seed: {'yes' if ok else 'no'}")
  rising = bool(mean[-1] > mean[0])
  print(f"training reward, mean over seeds, last GRPO step > first: {mean[-1]:.3f} vs {mean[0]:.3f}: "
        f"{'yes' if rising else 'no'}")  # fmt: skip
  ok &= rising
  print(f"learning check: {'PASSED' if ok else 'FAILED'}")

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
  for seed, (_, _, before, after) in results.items():
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
