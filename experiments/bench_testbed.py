"""The testbed's training step and held-out evaluation: seconds per GRPO step and held-out tasks per minute.

    python experiments/bench_testbed.py --params_from=WORKDIR [--steps 3] [--eval_tasks 128] [--json OUT]

issue 43's engine target, on what the evidence grid (experiments/evidence.py) spends its budget: `train.Trainer` on
``configs/testbed.py`` (level cpu, SmolLM2-135M, B=4 tasks x G=4 rollouts a step, world-rehearsal GRPO), its
parameters those of ``--params_from``'s newest checkpoint (a warm-up, e.g. the grid's ``WORKDIR/warmup/seed0``: the
base model makes no tool call, so its steps are not the grid's), then ``--steps`` GRPO steps (`Trainer.step`: rollout,
dynamic sampling, update) and the committed execution of ``--eval_tasks`` held-out iid tasks in chunks of
``--eval_chunk`` (`heldout.committed_execution`, success only, as the grid's success chunks). Printed and written to
``--json``: each step's seconds, the steps after the first (which compiles), the evaluation's seconds and tasks per
minute, the compile seconds inside each (JAX's compile events), rewards, successes and generated tokens (the same work
at two commits gives the same figures), and the peak RSS.

The script uses only `train.Trainer(config, workdir)`, ``Trainer.step``, `heldout.committed_execution` and orbax (the
checkpoint's parameters), which main has had since before issue 43, so the same file runs against an older commit:
copy it into that commit's worktree (`git worktree add`) and run it there. The compilation cache is off unless
``--cache`` (a comparison of engines compiles at both commits). On 2 CPU cores: 6.5-8 minutes a step, 30-80 s a
chunk of 8 tasks (experiments/results/2026-12-06_engine_targets.md); the evaluation's peak RSS about 5 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import monitoring  # noqa: E402

from envace_jax import heldout, train  # noqa: E402
from experiments import common  # noqa: E402

_COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)
_compile_s = [0.0]


def _on_duration(event: str, seconds: float, **_) -> None:
  if event in _COMPILE_EVENTS:
    _compile_s[0] += seconds


def _timed(fn):
  """(fn(), wall seconds, compile seconds inside it)."""
  start, compiled = time.perf_counter(), _compile_s[0]
  out = fn()
  return out, time.perf_counter() - start, _compile_s[0] - compiled


def _checkpoint_params(workdir: str, like):
  """The parameters of ``workdir``'s newest checkpoint, read with orbax alone (the train state's optimizer part
  differs between commits, its parameters do not), in ``like``'s tree (layers stacked or apart), dtypes and
  placement; (params, step)."""
  import orbax.checkpoint as ocp

  from envace_jax.model import transformer

  folder = os.path.join(workdir, "checkpoints")
  step = max((int(d) for d in os.listdir(folder) if d.isdigit()), default=None)
  if step is None:
    sys.exit(f"--params_from={workdir!r}: no checkpoint step in {folder}")
  raw = ocp.PyTreeCheckpointer().restore(os.path.join(folder, str(step), "state"))["params"]
  raw = transformer.stack_tree(raw) if "layers" in like else transformer.unstack_tree(raw)
  return jax.tree.map(lambda new, old: jax.device_put(np.asarray(new, old.dtype), old.sharding), raw, like), step


def _commit() -> str:
  try:
    return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, text=True).strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--params_from", required=True, help="a workdir whose newest checkpoint holds the parameters")
  parser.add_argument("--steps", type=int, default=3, help="GRPO steps (the first compiles)")
  parser.add_argument("--eval_tasks", type=int, default=128, help="held-out iid tasks (0: no evaluation)")
  parser.add_argument("--eval_chunk", type=int, default=8, help="tasks per evaluation call (the grid's chunk)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cache", action="store_true", help="keep JAX's persistent compilation cache on")
  parser.add_argument("--json", default="", help="write the figures here")
  args = parser.parse_args()
  if not os.path.isdir(os.path.join(args.params_from, "checkpoints")):
    sys.exit(f"--params_from={args.params_from!r} has no checkpoints/ folder: pass a training run's workdir")
  if not args.cache:
    os.environ["ENVACE_JAX_COMPILATION_CACHE"] = "off"
  common.quiet_libraries()
  monitoring.register_event_duration_secs_listener(_on_duration)

  config = common.config_file("testbed")
  config.seed = args.seed
  config.train.sft_warmup_steps = 0
  config.train.steps = max(args.steps, 1)  # the config needs one; the loop below runs --steps
  config.train.eval_tasks = args.eval_tasks
  config.eval.fidelity = config.eval.fidelity_gold = config.eval.reward_gap = False  # success only: the grid's
  with tempfile.TemporaryDirectory() as workdir:
    trainer, load_s, _ = _timed(lambda: train.Trainer(config, workdir))
    params, step = _checkpoint_params(args.params_from, trainer.state.params)
    trainer.state = trainer.state.replace(params=params)
    steps = []
    for s in range(1, args.steps + 1):
      m, wall, compiled = _timed(lambda s=s: trainer.step(s))
      steps.append(
        {
          "step": s,
          "wall_s": wall,
          "compile_s": compiled,
          "reward": m.get("reward/mean"),
          "generated_tokens": m.get("rollout/generated_tokens"),
          "trained_tokens": m.get("update/tokens"),
        }
      )
      print(f"step {s}: {wall:.1f} s (compiling {compiled:.1f} s), reward {m.get('reward/mean')}", flush=True)
    evaluation = None
    if args.eval_tasks:
      tasks, successes, walls, compiles = trainer.eval_tasks(), [], [], []
      trainer._sync_samplers()
      for i in range(0, len(tasks), args.eval_chunk):  # chunks as the evidence grid evaluates (experiments/evidence.py)
        key = jax.random.fold_in(jax.random.key(args.seed), i)
        summary, wall, compiled = _timed(
          lambda i=i, key=key: heldout.committed_execution(
            config, tasks[i : i + args.eval_chunk], trainer.samplers, trainer.model.tokenizer, key
          )
        )
        successes.append(summary["eval/pass^1"] * len(tasks[i : i + args.eval_chunk]))
        walls.append(wall)
        compiles.append(compiled)
        print(f"evaluation chunk {i // args.eval_chunk}: {wall:.1f} s (compiling {compiled:.1f} s)", flush=True)
      wall = sum(walls)
      evaluation = {
        "tasks": len(tasks),
        "chunk": args.eval_chunk,
        "wall_s": wall,
        "compile_s": sum(compiles),
        "chunk_wall_s": walls,
        "tasks_per_min": len(tasks) / (wall / 60),
        "tasks_per_min_after_first_chunk": (len(tasks) - args.eval_chunk) / (sum(walls[1:]) / 60)
        if walls[1:]
        else None,
        "successes": sum(successes),
      }
      print(
        f"evaluation: {len(tasks)} tasks in {wall:.1f} s, {evaluation['tasks_per_min']:.2f} tasks/min, "
        f"{evaluation['successes']:.0f} successes",
        flush=True,
      )
  later = [s["wall_s"] for s in steps[1:]]
  record = {
    "commit": _commit(),
    "params_from": f"{args.params_from} (step {step})",
    "seed": args.seed,
    "cache": args.cache,
    "trainer_s": load_s,
    "steps": steps,
    "step_s_after_first": float(np.mean(later)) if later else None,
    "evaluation": evaluation,
    "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    "load_avg": os.getloadavg(),
  }
  print(json.dumps(record, indent=1))
  if args.json:
    common.write_json(args.json, record)


if __name__ == "__main__":
  main()
