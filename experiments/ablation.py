"""EnvACE vs plain GRPO against the real tools vs per-role parameters vs the base policy, on τ², at the same budget.

    python experiments/ablation.py                  # CPU default: tiny model on τ² mock (pipeline check), ≈15 min
    python experiments/ablation.py --model=smollm2  # SmolLM2-135M on τ² airline + retail, 1 seed: ≈1.7 h on 2 cores
    python experiments/ablation.py --seeds=0 --steps=1 --eval-tasks=1 --trials=1 --methods=envace,base   # smoke run
    python experiments/ablation.py --full --model-path=/path/to/Qwen3-8B --workdir=/ckpt/ablation   # paper size

The methods (README's table; one config value each, nothing else differs):
  envace         ``grpo.mode=envace``: one policy acts and rehearses every tool response (the paper's method);
  grpo_real_env  ``grpo.mode=grpo_real_env rollout.env_mode=real grpo.trained_roles=act``: plain GRPO, tool calls
                 answered by the benchmark's real tools, only ACT trained;
  per_role       ``grpo.mode=per_role``: separate parameters for ACT and REHEARSE;
  base           no training: the initial weights.
Every trained method gets the same budget (``--steps`` updates of ``--tasks`` tasks × ``--group`` rollouts, the same
seeds, so the same task order and initial weights). Each (method, domain, seed) cell trains with
``train.train_and_evaluate`` into ``--workdir/METHOD/DOMAIN/seedS`` and is then evaluated with ``evaluate.run``
(rehearsal off: committed execution against the real tools and the real user simulator on the first
``--eval-tasks`` test tasks, scored by τ²'s evaluator, pass^1; the same evaluation key per seed for every method, so
all methods meet the same first user messages). The cell's result is ``cell.json`` there: a rerun skips finished
cells (and a half-trained cell resumes from its checkpoint), so a killed run continues where it stopped. Aggregated
results go to ``--workdir/ablation.json``; the table (rows = method, columns = domains + average, pass^1 in %, mean
± sample std over seeds) is printed and ``--out`` (PNG) shows it as bars with error bars.

Paper (Qwen3-8B, τ² average pass^1): EnvACE 36.7, plain GRPO 31.2, per-role 35.5.

Sizes. Any config value can be set as for ``python -m envace_jax.main``: ``--config.grpo.learning_rate=1e-5``.
``--full`` takes the paper's sizes (``experiments/common.py``'s ``FULL``: Qwen3-8B in bfloat16, B=16 tasks × G=4,
lr 1e-6, 32k-token views, 8k-token responses; our 200 steps, every test task × 4 trials, 3 seeds unless given), e.g.
    python experiments/ablation.py --full --model-path=/path/to/Qwen3-8B --domains=airline,retail --seeds=0,1,2 \\
      --workdir=/ckpt/ablation --config.mesh.fsdp=8     # e.g. on 8 accelerators
Costs on 2 CPU cores (measured on this machine):
  tiny (default: 4 methods × mock × 5 seeds, 32 steps of B=1 × G=4, all 9 tasks × 4 trials): 23 min with other jobs
    sharing the cores (1363 s wall, 1215 s CPU, 4.2 GB peak), ≈15 min on idle cores; the first seed costs most (JIT
    compilation), later cells load compiled programs from a persistent cache (``--workdir/jax_cache``).
  smollm2: a step of B=1 × G=2 on airline ≈ 6.5 min (README); the base cell with one airline test task took 161 s
    (loading, compilation, 119 s of committed execution; another job shared the cores). Per seed and domain ≈ 3
    methods × 2 steps × 6.5 min + 4 evaluations × 2 tasks × ≈1.5-2 min ≈ 50-55 min: airline + retail with one seed
    ≈ 1.7 h (one cell at a time, ≈ 13 GB peak). That does not fit a 20-minute budget, hence the tiny default.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import textwrap
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/ablation.py` puts experiments/ first on the path, not the root
  sys.path.insert(0, str(ROOT))

from experiments import common  # noqa: E402

METHODS: dict[str, dict[str, Any] | None] = {**common.TRAINING_MODES, "base": None}  # base: no training
LABELS = {"envace": "EnvACE", "grpo_real_env": "GRPO (real env)", "per_role": "per-role", "base": "base policy"}
PAPER_TAU2_AVG = {"envace": 36.7, "grpo_real_env": 31.2, "per_role": 35.5}  # Qwen3-8B, pass^1 (%)
CELL_FILE = "cell.json"

# Per model: seeds, steps, G, B, eval tasks. tiny and smollm2 are CPU-sized (module docstring); full is the paper's.
DEFAULTS = {
  "tiny": dict(domains="mock", seeds="0,1,2,3,4", steps=32, group=4, tasks=1, eval_tasks=-1, trials=4),
  "smollm2": dict(domains="airline,retail", seeds="0", steps=2, group=2, tasks=1, eval_tasks=2, trials=1),
  "full": dict(domains="airline,retail", seeds="0,1,2", steps=200, group=4, tasks=16, eval_tasks=-1, trials=4),
}


def cell_config(args, method: str, domain: str, seed: int):
  """The config of one cell: the model's τ² config, the budget, the method's values, then ``--config.*``."""
  c = common.make_config(args.model, domain, seed, args.data_dir, full=args.full, model_path=args.model_path)
  c.train.steps = args.steps
  c.train.tasks_per_step = args.tasks
  c.train.group_size = args.group
  c.train.checkpoint_every = max(1, args.steps // 4)
  c.train.eval_every = 0
  c.train.eval_tasks = 0  # the cell is evaluated by evaluate.run below, the same way for every method
  c.eval.rehearsal = "off"
  c.eval.tasks = args.eval_tasks
  c.eval.num_trials = args.trials
  c.eval.fidelity = False
  c.eval.reward_gap = False
  c.eval.fidelity_gold = False  # the gold-call fidelity probe: not needed here
  for key, value in (METHODS[method] or {}).items():
    common.set_value(c, key, value)
  common.apply_overrides(c, args.overrides)
  return c


def budget(args) -> dict[str, Any]:
  """What must match for a saved cell to be reused."""
  return {
    "model": "full" if args.full else args.model,
    "steps": args.steps,
    "tasks": args.tasks,
    "group": args.group,
    "eval_tasks": args.eval_tasks,
    "trials": args.trials,
    "overrides": [list(o) for o in args.overrides],
  }


def run_cell(args, method: str, domain: str, seed: int) -> dict[str, Any]:
  """Trains (unless ``base``) and evaluates one cell, or reads its saved result."""
  from envace_jax import evaluate, train

  workdir = pathlib.Path(args.workdir) / method / domain / f"seed{seed}"
  path = workdir / CELL_FILE
  if path.exists():
    cell = common.read_json(path)
    stale = common.budget_mismatch(cell["budget"], budget(args))
    if stale:
      raise SystemExit(f"{path} was made with another budget ({'; '.join(stale)}); use a fresh --workdir")
    print(f"{method} {domain} seed {seed}: saved, pass^1 {cell['pass^1']:.3f}", flush=True)
    return cell
  config = cell_config(args, method, domain, seed)
  start = time.perf_counter()
  if METHODS[method] is not None:
    train.train_and_evaluate(config, str(workdir))
  trained = time.perf_counter()
  result = evaluate.run(copy.deepcopy(config), str(workdir))
  row = result["rows"][0]
  cell = {
    "method": method,
    "domain": domain,
    "seed": seed,
    "pass^1": float(row["pass^1"]),
    "reward": float(row["reward"]),
    "checkpoint_step": result["checkpoint_step"],
    "train_s": trained - start,
    "eval_s": time.perf_counter() - trained,
    "budget": budget(args),
    "eval": row,
  }
  common.write_json(path, cell)
  print(
    f"{method} {domain} seed {seed}: pass^1 {cell['pass^1']:.3f}, train {cell['train_s']:.0f} s, "
    f"eval {cell['eval_s']:.0f} s",
    flush=True,
  )
  return cell


def aggregate(cells: list[dict[str, Any]], methods: list[str], domains: list[str]) -> list[dict[str, Any]]:
  """One row per method: pass^1 mean and std over seeds per domain, and of the per-seed average over domains."""
  rows = []
  for method in methods:
    mine = [c for c in cells if c["method"] == method]
    seeds = sorted({c["seed"] for c in mine})
    row: dict[str, Any] = {"method": method, "seeds": seeds}
    for domain in domains:
      row[domain] = common.mean_std([c["pass^1"] for c in mine if c["domain"] == domain])
    per_seed = [np.mean([c["pass^1"] for c in mine if c["seed"] == s]) for s in seeds]
    row["average"] = common.mean_std(per_seed)
    rows.append(row)
  return rows


def format_table(rows: list[dict[str, Any]], domains: list[str], title: str) -> str:
  cols = [*domains, "average"]
  width = 15
  head = f"{'method':<16} " + " ".join(f"{c:>{width}}" for c in cols) + f" {'paper τ² avg':>13}"
  lines = [title, head, "-" * len(head)]
  for r in rows:
    paper = PAPER_TAU2_AVG.get(r["method"])
    lines.append(
      f"{LABELS[r['method']]:<16} "
      + " ".join(f"{common.pm(*r[c]):>{width}}" for c in cols)
      + f" {(f'{paper:.1f}' if paper is not None else '-'):>13}"
    )
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], domains: list[str], title: str, out: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cols = [*domains, "average"]
  x = np.arange(len(cols))
  width = 0.8 / max(len(rows), 1)
  fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(cols), 4))
  for i, r in enumerate(rows):
    means = [100 * r[c][0] for c in cols]
    stds = [100 * r[c][1] for c in cols]
    ax.bar(x + (i - (len(rows) - 1) / 2) * width, means, width, yerr=stds, capsize=3, label=LABELS[r["method"]])
  ax.set_xticks(x, cols)
  ax.set_ylabel("pass^1 (%), mean ± std over seeds")
  ax.set_title(textwrap.fill(title, 90), fontsize=8)
  ax.set_ylim(0, 1.15 * max([100 * (r[c][0] + r[c][1]) for r in rows for c in cols if np.isfinite(r[c][0])] + [1.0]))
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
  parser.add_argument("--domains", default=None, help="τ² domains (tiny: mock; else airline,retail)")
  parser.add_argument("--seeds", default=None, help="comma-separated seeds")
  common.add_run_arguments(parser, "/tmp/envace_ablation", "ablation.png")
  args = common.parse_run_arguments(parser, argv, DEFAULTS)
  args.methods = common.parse_names(args.methods)
  unknown = set(args.methods) - set(METHODS)
  if unknown:
    parser.error(f"--methods: unknown {sorted(unknown)}; valid: {', '.join(METHODS)}")
  args.domains = common.parse_names(args.domains)
  args.seeds = common.parse_ints(args.seeds)
  if not args.full:
    try:
      common.check_domains(args.model, args.domains)
    except ValueError as e:
      parser.error(str(e))
  return args


def main(argv: list[str]) -> dict[str, Any]:
  """Runs (or resumes) every cell, prints the table, saves the PNG and ``--workdir/ablation.json``.

  Returns:
    {"rows": one per method (``method``, ``seeds``, each domain and ``average`` as (mean, std) of pass^1),
     "cells": one per (method, domain, seed) with ``pass^1``, ``reward``, timings and the evaluation summary}.
  """
  args = parse_args(argv)
  common.use_compilation_cache(args.compile_cache, args.workdir)
  if args.model == "tiny" and not args.full:
    print(common.TINY_CAVEAT, flush=True)
  start = time.perf_counter()
  cells = [
    run_cell(args, method, domain, seed) for seed in args.seeds for domain in args.domains for method in args.methods
  ]
  rows = aggregate(cells, args.methods, args.domains)
  tasks = "/".join(sorted({str(int(c["eval"]["tasks"])) for c in cells}))  # per domain: how many -1 (all) meant
  model = "Qwen3-8B (--full)" if args.full else args.model
  title = (
    f"τ² pass^1 (%) after {args.steps} steps of B={args.tasks} x G={args.group}, {model}, seeds {args.seeds}, "
    f"{tasks} test tasks x {args.trials} trials, rehearsal off; mean ± std over seeds"
  )
  print()
  print(format_table(rows, args.domains, title))
  print(f"paper τ² avg: Qwen3-8B (EnvACE-8B), the paper's table; total {time.perf_counter() - start:.0f} s")
  if args.model == "tiny" and not args.full:
    print(common.TINY_CAVEAT)
  result = {"rows": rows, "cells": cells, "title": title}
  common.write_json(pathlib.Path(args.workdir) / "ablation.json", result)
  plot(rows, args.domains, title, args.out)
  print(f"saved {args.out} and {pathlib.Path(args.workdir) / 'ablation.json'}")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
