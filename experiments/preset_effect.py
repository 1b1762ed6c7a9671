"""What the `official` preset changes in a run: the same config trained twice, with and without ``+official``
(envace_jax/config/presets.py, docs/departures.md), per-step rewards, losses and rollout counts side by side.

    python experiments/preset_effect.py                                   # configs/tiny.py, 3 steps, G=4, 2 seeds
    python experiments/preset_effect.py --config=configs/tau2.py:mock --steps=2 --seeds=0 \
        --flag=--config.train.sft_warmup_steps=1                          # SmolLM2-135M on τ² mock

Each (variant, seed) is one ``python -m envace_jax.main`` run in its own workdir under ``--workdir`` (a finished one
is read, not rerun: the grid resumes). Writes ``--out`` (JSON: every step's metrics of every run, and the means over
seeds per variant and step) and prints a table. Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from envace_jax import metrics  # noqa: E402

KEYS = (
  "reward/mean",
  "update/loss",
  "update/tokens",
  "update/tokens/act",
  "update/tokens/rehearse",
  "adv/act/abs_mean",
  "adv/rehearse/abs_mean",
  "rollout/tool_call_validity",
  "rollout/rehearsed_json_validity",
  "rollout/groups_without_signal",
  "rollout/turns",
)


def run(config: str, preset: str, seed: int, steps: int, group: int, flags: list[str], workdir: pathlib.Path):
  """The metrics rows of one run (reused when ``workdir`` already holds ``steps`` of them)."""
  rows = metrics.read_jsonl(workdir) if (workdir / metrics.JSONL_NAME).exists() else []
  if len(rows) >= steps:
    return rows
  spec = config + (("+" if ":" in config else ":") + preset if preset else "")
  cmd = [
    sys.executable, "-m", "envace_jax.main", f"--config={spec}", f"--workdir={workdir}",
    f"--config.seed={seed}", f"--config.train.steps={steps}", f"--config.train.group_size={group}",
    "--config.train.eval_tasks=0", *flags,
  ]  # fmt: skip
  start = time.time()
  subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
  print(f"{spec} seed {seed}: {time.time() - start:.0f} s", flush=True)
  return metrics.read_jsonl(workdir)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/tiny.py")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--group", type=int, default=4)
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--flag", action="append", default=[], help="a --config.* flag for both variants")
  parser.add_argument("--workdir", default="/tmp/envace_preset_effect")
  parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "preset_effect.json"))
  args = parser.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  runs = {}
  for preset in ("", "official"):
    for seed in seeds:
      name = f"{preset or 'default'}/seed{seed}"
      workdir = pathlib.Path(args.workdir) / name
      rows = run(args.config, preset, seed, args.steps, args.group, args.flag, workdir)
      runs[name] = [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in rows]
  means = {}
  for preset in ("default", "official"):
    for step in range(1, args.steps + 1):
      got = [r for s in seeds for r in runs[f"{preset}/seed{s}"] if r["step"] == step]
      means[f"{preset}/step{step}"] = {k: float(np.mean([r[k] for r in got if k in r])) for k in KEYS if got}
  out = {"config": args.config, "steps": args.steps, "group": args.group, "seeds": seeds, "flags": args.flag}
  out.update(runs=runs, means=means, date=time.strftime("%Y-%m-%d"))
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1, allow_nan=True) + "\n")
  print(f"{'variant/step':22s}" + "".join(f"{k:>24s}" for k in KEYS[:5]))
  for name, row in means.items():
    print(f"{name:22s}" + "".join(f"{row.get(k, float('nan')):24.4f}" for k in KEYS[:5]))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
