"""Rollout scheduling and KV layout: continuous batching against lockstep, paged views against dense rows, on the
same tasks, keys and weights; a table.

    python experiments/bench_rollout.py                                   # SmolLM2-135M, τ² mock, B=1 x G=4
    python experiments/bench_rollout.py --config=airline --tasks=2 --group=4
    python experiments/bench_rollout.py --modes=dense,paged               # rollout.kv_page_size 0 against 64
    python experiments/bench_rollout.py --model=tiny --rounds=1           # smoke run, about a minute

One `train.Trainer` (the τ² mock job's rollout: ACT and REHEARSE in the policy's cache, the frozen reference as the
user) runs ``Trainer.rollout`` on its first step's B tasks, alternating ``rollout.continuous_batching``
off (lockstep: every round of generations waits for its longest) and on (`sampler.Stream`: a row whose generation
ends starts its trajectory's next one at once), ``--rounds`` times each after one warm-up rollout per mode (which
compiles). Every rollout of a round uses the same key, and the two modes must give the same trajectories (each
generation is keyed by trajectory, role and index): the script checks messages and sampled ids and stops if they
differ. ``--modes=dense,paged`` compares the KV layouts likewise (``rollout.kv_page_size`` 0 and 64). Per mode it
prints wall seconds (compilation taken out, ``runtime.CompileClock``) with the policy's and the reference user's
shares, tokens generated and prefilled, decode row-steps (rows computed x loop iterations, ``unfold``'s
``decode_row_steps``), slot utilisation (generated tokens / row-steps), decode calls, tokens per second and KV slots
per layer (allocated, and the most held at once: ``kv_slots``, ``kv_slots_held``); and how busy the machine was
(`bench_sampler.CpuMeter`: other processes slow both modes alike only on average). ``--modes=config`` times the
config as it is, so a copy of this script times a checkout from before
continuous batching (before/after in one sitting).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from envace_jax import runtime  # noqa: E402
from experiments import throughput  # noqa: E402
from experiments.bench_sampler import CpuMeter, busy_note  # noqa: E402

# Each mode's rollout settings over the config's (config: none changed).
MODES = {
  "lockstep": {"continuous_batching": False},
  "continuous": {"continuous_batching": True},
  "dense": {"kv_page_size": 0},  # one KV row per view at the roomiest view's capacity
  "paged": {"kv_page_size": 64},  # each view's own slots in pages, given back when its trajectory ends
  "config": {},
}


def _signature(trajectories) -> list:
  """What must not depend on scheduling: each trajectory's messages, termination and sampled ids per role."""
  return [
    (t.termination, [(m.role, m.content) for m in t.messages], {r: row.tokens.tolist() for r, row in t.rows.items()})
    for t in trajectories
  ]


def run(trainer, rounds: int, clock, modes: Sequence[str] = ("lockstep", "continuous")) -> dict[str, list[dict]]:
  """Per mode, one record per timed rollout: seconds, compile seconds, generated / prefilled tokens, row-steps."""
  from envace_jax.rehearsal import unfold

  tasks = trainer.stream.next_batch()  # the first step's B tasks
  base = trainer.unfold_cfg
  records: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
  for r in range(rounds + 1):  # round 0 compiles
    key = jax.random.fold_in(trainer.key, r)
    seen = None
    for mode in modes:
      trainer.unfold_cfg = dataclasses.replace(base, **MODES[mode])
      mark, start = clock.mark(), time.perf_counter()
      trajectories, stats = trainer.rollout(tasks, key)
      seconds, compiling = time.perf_counter() - start, clock.since(mark)
      signature = _signature(trajectories)
      if seen is not None and signature != seen:
        raise SystemExit(f"round {r}: mode {mode} changed the trajectories (a scheduling or KV-layout bug)")
      seen = signature
      generated = unfold.generated_tokens(stats)
      record = {
        "seconds": seconds - compiling,
        "compile_s": compiling,
        "generated": float(generated),
        "prefilled": float(stats.get("prefill_tokens", 0) + stats.get("prefill_tokens_shared", 0)),
        "row_steps": float(stats.get("decode_row_steps", 0)),
        "policy_calls": float(stats.get("policy_calls", 0)),
        "reference_calls": float(stats.get("reference_calls", 0)),
        "policy_s": float(stats.get("time_policy_s", 0)),
        "reference_s": float(stats.get("time_reference_s", 0)),
        "kv_slots": float(stats.get("kv_slots", 0)),
        "kv_slots_held": float(stats.get("kv_slots_held", stats.get("kv_slots", 0))),
      }
      utilisation = generated / max(record["row_steps"], 1)
      print(f"round {r} {mode}: {record['seconds']:.1f} s (+{compiling:.1f} s compiling), {generated:.0f} generated, "
            f"slot utilisation {utilisation:.3f}, policy {record['policy_s']:.1f} s in {record['policy_calls']:.0f} "
            f"calls, reference {record['reference_s']:.1f} s in {record['reference_calls']:.0f}",
            flush=True)  # fmt: skip
      if r:
        records[mode].append(record)
  trainer.unfold_cfg = base
  return records


def table(records: dict[str, list[dict[str, float]]]) -> list[str]:
  lines = [
    "| mode | seconds | policy / reference user s | generated | prefilled | decode row-steps | slot utilisation | "
    "policy / reference decode calls | tokens/s | KV slots per layer: allocated / most held |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for mode, rs in records.items():
    total = {k: float(np.sum([r[k] for r in rs])) for k in rs[0]}
    slots = {k: float(np.max([r[k] for r in rs])) for k in ("kv_slots", "kv_slots_held")}
    tok_s = (total["generated"] + total["prefilled"]) / total["seconds"]
    lines.append(
      f"| {mode} | {total['seconds']:.1f} | {total['policy_s']:.1f} / {total['reference_s']:.1f} | "
      f"{total['generated']:.0f} | {total['prefilled']:.0f} | {total['row_steps']:.0f} | "
      f"{total['generated'] / total['row_steps']:.3f} | {total['policy_calls']:.0f} / {total['reference_calls']:.0f} | "
      f"{tok_s:.1f} | {slots['kv_slots']:.0f} / {slots['kv_slots_held']:.0f} |"
    )
  return lines


def main(argv: Sequence[str]) -> dict[str, list[dict[str, float]]]:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
  parser.add_argument("--config", default="mock", help="τ² domain (mock, airline, retail) or configs/X.py[:arg]")
  parser.add_argument("--tasks", type=int, default=1, help="B tasks per rollout")
  parser.add_argument("--group", type=int, default=4, help="G rollouts per task")
  parser.add_argument("--rounds", type=int, default=2, help="timed rollouts per mode after the warm-up")
  parser.add_argument("--modes", default="lockstep,continuous",
                      help="comma-separated, from lockstep, continuous, dense, paged, config (the config as it is: "
                           "e.g. to time an older checkout with this script)")  # fmt: skip
  parser.add_argument("--data-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "envace_tfds"))
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.") or "=" not in a]
  if bad:
    parser.error(f"unrecognised arguments {bad}; config overrides are written --config.KEY=VALUE")
  modes = [m for m in args.modes.split(",") if m]
  if not modes or set(modes) - set(MODES):
    parser.error(f"--modes: {args.modes!r}; choose from {', '.join(MODES)}")
  args.steps = 1  # throughput.load_config's sizes
  from envace_jax import train

  config = throughput.load_config(args, rest)
  clock = runtime.CompileClock()
  meter = CpuMeter()
  try:
    with tempfile.TemporaryDirectory() as workdir:
      trainer = train.Trainer(config, workdir)
      try:
        records = run(trainer, args.rounds, clock, modes)
      finally:
        trainer.ckpt.close()
  finally:
    clock.close()
  others, stolen = meter.stop()
  print(f"{config.model}, {config.env.benchmark} {config.env.domain}, B={args.tasks} x G={args.group}, "
        f"{args.rounds} timed rollout(s) per mode; other processes used {others:.2f} cores "
        f"{busy_note(others, stolen)}")  # fmt: skip
  print("\n".join(table(records)))
  return records


if __name__ == "__main__":
  main(sys.argv[1:])
