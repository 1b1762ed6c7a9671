"""Calibration of the testbed (issue 42, docs/testbed.md): SmolLM2-135M's base weights vs the supervised warm-up, on
every held-out split, with task success, REHEARSE's fidelity to the real tools, bootstrap 95% intervals and costs.

    python experiments/testbed_calibration.py --root=/tmp/tbcal --warmup_steps=K          # train if needed, evaluate
    python experiments/testbed_calibration.py --root=/tmp/tbcal --warmup_steps=K --write  # gather into results/
    python experiments/testbed_calibration.py --root=/tmp/tbcal_smoke --model=tiny --warmup_steps=1 --tasks=4 \
        --fidelity_tasks=4 --chunk=2                                                         # smoke (random tiny model)

Cells. One workdir per (model, seed) cell under ``--root``: ``base_s{seed}`` (the initial weights) and
``warmup_s{seed}`` (``python -m envace_jax.main --config=configs/testbed.py:{level}`` with ``train.steps =
train.sft_warmup_steps = K``: K supervised steps of B=4 reference conversations, both roles, on the ``train`` split,
AdamW at ``grpo.sft_learning_rate``; evaluated at checkpoint step K). Each (cell, split, phase, chunk) result is one
JSON file under ``--chunks``/``{cell}/cal/{split}/`` (``cal_k{K}/`` for the warm-up), written when it finishes, with
the digest of the parameters it evaluated (`params_digest`); a rerun skips finished files, so the run resumes. The
chunks directory is in the repository (experiments/results/testbed_calibration_chunks/) so that a calibration spread
over several machines or sessions adds up: a warm-up retrained elsewhere must reproduce the parameters of the chunks
already there up to float rounding (`check_digest`), or the run stops before evaluating. The checkpoints stay under
``--root``.

What is measured per (cell, split) (splits: envs/testbed.py ``HELDOUT_SPLITS``):
- success: committed execution without rehearsal, 1 trial, on the first ``--tasks`` tasks of the split against the
  real tools (`heldout.evaluate_policy` with mode "off", ``config.eval.sampling``), reward = `TestbedEnv.evaluate`
  (BFCL's checker and communicate_info); per task 0/1 (`scoring.is_success`).
- fidelity: REHEARSE's greedy prediction of the real response of every gold call of the first ``--fidelity_tasks``
  tasks (all by default), `fidelity.measure` / `fidelity.compare` per call. The probed trajectories are
  `fidelity.gold_trajectories` (as ``eval.fidelity_gold``): for the testbed, the tasks' reference conversations (the
  logged user turns, each gold call executed on the real classes), so REHEARSE's view holds the user's requests as
  in a rollout.
- costs: wall and process CPU seconds per phase (``time.process_time``: every thread of the process); the warm-up's
  from ``{cell}/train_cost.json``, written by this script when it trains (children's rusage), or by hand for a run
  started outside it.

``--write`` gathers the finished files into ``--out`` (JSON: per-task successes and per-call fidelity values, the
means with percentile-bootstrap 95% intervals (10k resamples, fixed seed; over tasks for success, over calls for
fidelity), counts, K, learning rate, costs, dates) and ``--out_md`` (a table). Not a timed test; one seed per cell
unless ``--seeds`` says more.

Cost (measured 2026-12-05 on 2 vCPUs shared with other jobs, SmolLM2-135M float32): the K=10 warm-up ≈ 33 min wall
(100-230 s a step, before its forward pass was removed: 44ba95f), a success chunk of 8 tasks 30-70 s wall, a fidelity
chunk of 8 tasks (13-16 gold calls) 70-140 s, loading a cell ≈ 1 min. The warm-up saves every
``train.checkpoint_every`` steps (10 in configs/testbed.py) and a killed run keeps only those: pass
``--train_flag=--config.train.checkpoint_every=5`` when the run may be cut.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import math
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

FIDELITY_METRICS = ("exact_match", "key_f1", "value_accuracy", "error_agreement", "json_valid")
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


# -- configuration ------------------------------------------------------------------------------------------------


def make_config(level: str, seed: int, model: str):
  """configs/testbed.py at ``level`` with ``seed``; ``model="tiny"`` swaps in the random tiny model (smoke runs)."""
  spec = importlib.util.spec_from_file_location("envace_configs_testbed", ROOT / "configs" / "testbed.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(level)
  c.seed = seed
  if model != "smollm2-135m":
    c.model = model
    c.tokenizer = "smollm2-135m"
    c.rollout.act_capacity = c.rollout.rehearse_capacity = 1024  # the tiny model's context
  return c


def train_command(args, seed: int, workdir: pathlib.Path) -> list[str]:
  """The warm-up's command line: K supervised steps, no evaluation, a checkpoint at step K."""
  cmd = [
    sys.executable, "-m", "envace_jax.main", f"--config={ROOT / 'configs' / 'testbed.py'}:{args.level}",
    f"--workdir={workdir}", f"--config.seed={seed}", f"--config.train.steps={args.warmup_steps}",
    f"--config.train.sft_warmup_steps={args.warmup_steps}", "--config.train.eval_tasks=0",
    "--config.train.eval_at_start=False",
  ]  # fmt: skip
  if args.model != "smollm2-135m":
    cmd += [f"--config.model={args.model}", "--config.tokenizer=smollm2-135m"]
    cmd += ["--config.rollout.act_capacity=1024", "--config.rollout.rehearse_capacity=1024"]
  return cmd + list(args.train_flag)


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
  """The steps saved under ``workdir/checkpoints`` (Orbax's numbered directories)."""
  from envace_jax import checkpoint as checkpoint_lib

  d = workdir / checkpoint_lib.CHECKPOINT_SUBDIR
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def train(args, seed: int, workdir: pathlib.Path) -> None:
  """Runs the warm-up unless ``workdir`` already holds checkpoint step K; writes ``train_cost.json``."""
  if args.warmup_steps in checkpoint_steps(workdir):
    return
  cmd = train_command(args, seed, workdir)
  print("warm-up:", " ".join(cmd), flush=True)
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  with open(workdir.parent / f"{workdir.name}.log", "w", encoding="utf-8") as log:
    subprocess.run(["nice", "-n", str(args.nice), *cmd], check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  _dump(
    workdir / "train_cost.json",
    {"steps": args.warmup_steps, "wall_s": time.perf_counter() - start, "cpu_s": cpu, "command": " ".join(cmd)},
  )


# -- evaluation -----------------------------------------------------------------------------------------------------


NORMS_RTOL = 1e-3  # two warm-ups of one recipe: the same parameters up to XLA:CPU's float rounding


def params_digest(params) -> dict:
  """Which weights a chunk evaluated: ``sha256`` (hex) of the leaves' bytes in tree order, and ``norms`` (each
  leaf's L2 norm, float64). A warm-up retrained on CPU reproduces its parameters up to float rounding, not bit for
  bit (2026-12-05: the same per-step NLL to 6 digits, another SHA-256), so chunks are matched by their norms
  (`check_digest`)."""
  import hashlib

  import jax

  h, norms = hashlib.sha256(), []
  for leaf in jax.tree.leaves(params):
    a = np.ascontiguousarray(np.asarray(leaf))
    h.update(a.tobytes())
    norms.append(float(np.sqrt(np.sum(np.square(a, dtype=np.float64)))))
  return {"sha256": h.hexdigest(), "norms": norms}


def load(config, workdir: pathlib.Path | None, step: int | None):
  """(model, samplers for `heldout.evaluate_policy`, `params_digest` of the policy) with the policy at checkpoint
  ``step`` of ``workdir`` (None: the base weights), as `evaluate.load_policy` builds them but at a given step rather
  than the latest.

  Raises:
    FileNotFoundError: ``step`` is not saved in ``workdir``.
  """
  import jax

  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax import policy as policy_lib
  from envace_jax import runtime
  from envace_jax.model import transformer
  from envace_jax.rl import grpo

  model = runtime.load_model(config)
  model = dataclasses.replace(model, params=transformer.unstack_tree(model.params))
  policy = policy_lib.Policy.from_config(config)
  if step is None:
    params = policy.initial(model.params)
  else:
    if step not in checkpoint_steps(workdir):
      raise FileNotFoundError(f"no checkpoint step {step} in {workdir} (has {checkpoint_steps(workdir)})")
    cfg = grpo.GrpoConfig.from_config(config)
    with checkpoint_lib.Checkpointer.from_config(str(workdir), config, read_only=True) as ckpt:
      target = jax.eval_shape(functools.partial(grpo.init_train_state, cfg), model.params)
      params = ckpt.restore(step, abstract_state={"params": target.params, "opt_state": target.opt_state}).params
  mesh = runtime.make_mesh(config)
  samplers = policy.samplers(params, lambda p: runtime.make_sampler(config, model, p, mesh, 1))
  samplers["reference"] = runtime.make_sampler(config, model, model.params, mesh, 1)
  return model, samplers, params_digest(params)


def _dump(path: pathlib.Path, obj) -> None:
  from envace_jax import metrics

  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(metrics.to_json_safe(obj), indent=1, allow_nan=False), encoding="utf-8")
  os.replace(tmp, path)


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
  return [(i, min(i + size, n)) for i in range(0, n, size)]


def success_chunk(config, tasks, samplers, tokenizer, key) -> dict:
  """Committed execution (rehearsal off, 1 trial) of ``tasks``: per task reward, validity, success, calls, turns."""
  from envace_jax import heldout, scoring

  wall, cpu = time.perf_counter(), time.process_time()
  summary, result = heldout.evaluate_policy(
    config, tasks, samplers, tokenizer, key, mode="off", num_trials=1, fidelity=False, gap=False, gold=False
  )
  rows = []
  for traj in result.committed:
    r = traj.reward
    rows.append(
      {
        "task": traj.task.id,
        "reward": float(r.reward),
        "valid": bool(r.valid),
        "success": int(bool(r.valid) and scoring.is_success(r.reward)),
        "tool_calls": int(traj.counts.get("tool_calls", 0)),
        "turns": int(traj.counts.get("generations_act", 0)),
      }
    )
  return {
    "rows": rows,
    "summary": summary,
    "wall_s": time.perf_counter() - wall,
    "cpu_s": time.process_time() - cpu,
  }


def fidelity_chunk(config, tasks, samplers, tokenizer, key) -> dict:
  """REHEARSE (greedy) on every gold call of ``tasks``' reference conversations: one row per call."""
  from envace_jax import heldout, scoring
  from envace_jax import policy as policy_lib
  from envace_jax.model.roles import Role
  from envace_jax.rehearsal import fidelity as fidelity_lib
  from envace_jax.rehearsal.unfold import sampler_for

  wall, cpu = time.perf_counter(), time.process_time()
  ucfg = heldout.evaluation_unfold_config(config, samplers)
  policy = policy_lib.Policy.from_config(config).by_role(samplers)
  make_env = functools.partial(scoring.make_env, config)
  trajectories = fidelity_lib.gold_trajectories([(task, ()) for task in tasks], make_env)
  found = fidelity_lib.probes(trajectories, ucfg.rehearse_prompt, ucfg.rehearse_sees_dialogue)
  pairs, texts, stats = fidelity_lib.measure(
    sampler_for(policy, Role.REHEARSE),
    tokenizer,
    trajectories,
    key=key,
    max_new_tokens=ucfg.rehearse_max_new_tokens,
    rehearse_prompt=ucfg.rehearse_prompt,
    dialogue=ucfg.rehearse_sees_dialogue,
    accept_error_text=ucfg.accept_error_text,
  )
  rows = []
  for probe, pair, text in zip(found, pairs, texts, strict=True):
    rows.append(
      {
        "task": trajectories[probe.trajectory].task.id,
        "message": probe.message,
        **dataclasses.asdict(pair),
        "real_is_error": bool(probe.real.is_error),
        "real": probe.real.content,
        "predicted": text,
      }
    )
  return {
    "rows": rows,
    "gold_calls": sum(sum(a.requestor == "assistant" for a in t.gold_actions) for t in tasks),
    "stats": stats,
    "wall_s": time.perf_counter() - wall,
    "cpu_s": time.process_time() - cpu,
  }


def check_digest(cal_dir: pathlib.Path, digest: dict, what: str) -> None:
  """Stops when a finished chunk under ``cal_dir`` evaluated parameters other than ``digest`` (`params_digest` of
  what ``what`` holds): the same SHA-256, or every leaf's norm within `NORMS_RTOL` (a retrained warm-up).

  Raises:
    SystemExit: naming the chunk, the largest relative difference of the norms and the way out.
  """
  for done in sorted(cal_dir.glob("*/*.json")):
    chunk = json.loads(done.read_text())
    if chunk.get("params_sha256", digest["sha256"]) == digest["sha256"]:
      continue
    theirs = np.asarray(chunk.get("params_norms", []), np.float64)
    ours = np.asarray(digest["norms"], np.float64)
    diff = float(np.max(np.abs(theirs - ours) / np.maximum(ours, 1e-12))) if theirs.shape == ours.shape else math.inf
    if not diff <= NORMS_RTOL:
      raise SystemExit(
        f"{done} evaluated other parameters than {what} holds (leaf norms differ by {diff:.2g} relative, more than "
        f"{NORMS_RTOL:g}): the warm-up did not reproduce them; evaluate into another --chunks directory"
      )


def evaluate_cell(args, name: str, seed: int, workdir: pathlib.Path, step: int | None) -> None:
  """Every unfinished (split, phase, chunk) file of one cell; the model is loaded once, if anything is left.

  Raises:
    SystemExit: a finished chunk of this cell evaluated other parameters (`check_digest`).
  """
  import jax

  from envace_jax import evaluate, runtime

  record = args.chunks / workdir.name
  for name_ in ("train_cost.json", "metrics.jsonl"):  # the warm-up's record, kept beside its chunks
    if (workdir / name_).exists():
      record.mkdir(parents=True, exist_ok=True)
      (record / name_).write_bytes((workdir / name_).read_bytes())
  config = make_config(args.level, seed, args.model)
  plan = []  # every split's success first, then fidelity: the headline numbers finish first
  for phase, n_phase in (("success", args.tasks), ("fidelity", args.fidelity_tasks)):
    for split in args.splits:
      config.env.eval_split = split
      n_all = len(runtime.evaluation_tasks(config, -1))
      n = n_all if n_phase < 0 else min(n_phase, n_all)
      for c, (lo, hi) in enumerate(_chunks(n, args.chunk)):
        path = eval_dir(record, step) / split / f"{phase}_{lo:04d}_{hi:04d}.json"
        if not path.exists():
          plan.append((split, phase, c, lo, hi, path))
  if not plan:
    return
  print(f"{name}: {len(plan)} chunks to evaluate", flush=True)
  wall, cpu = time.perf_counter(), time.process_time()
  model, samplers, digest = load(config, workdir if step is not None else None, step)
  check_digest(eval_dir(record, step), digest, f"{workdir} step {step}")
  _dump(record / "load_cost.json", {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})
  base_key = evaluate.eval_key(seed)
  with runtime.CompileClock() as clock:
    for split, phase, c, lo, hi, path in plan:
      config.env.eval_split = split
      tasks = runtime.evaluation_tasks(config, hi)[lo:hi]
      key = jax.random.fold_in(jax.random.fold_in(base_key, 1 if phase == "success" else 2), c)
      fn = success_chunk if phase == "success" else fidelity_chunk
      mark = clock.mark()
      out = fn(config, tasks, samplers, model.tokenizer, key)
      out["compile_s"], out["programs"] = clock.since(mark), clock.programs_since(mark)  # part of wall_s
      out.update(cell=name, split=split, phase=phase, tasks=[t.id for t in tasks], step=step, date=_now())
      out["params_sha256"], out["params_norms"] = digest["sha256"], digest["norms"]
      _dump(path, out)
      print(f"{name} {split} {phase} [{lo}:{hi}] wall {out['wall_s']:.0f}s cpu {out['cpu_s']:.0f}s", flush=True)


# -- gathering ------------------------------------------------------------------------------------------------------


def bootstrap(values, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
  """Mean of ``values`` with its percentile-bootstrap 95% interval (None entries left out); NaN when none."""
  from envace_jax import metrics

  x = np.asarray([v for v in values if v is not None], np.float64)
  lo, hi = metrics.interval95(x, resamples, seed)
  return {"mean": float(x.mean()) if x.size else float("nan"), "lo": lo, "hi": hi, "n": int(x.size)}


def eval_dir(workdir: pathlib.Path, step: int | None) -> pathlib.Path:
  """Where a cell's evaluation files go: ``cal/`` for the base weights, ``cal_k{step}/`` for a checkpoint."""
  return workdir / ("cal" if step is None else f"cal_k{step}")


def _read(workdir: pathlib.Path, split: str, phase: str) -> list[dict]:
  d = workdir / split
  return [json.loads(p.read_text()) for p in sorted(d.glob(f"{phase}_*.json"))] if d.is_dir() else []


def gather_cell(args, name: str, workdir: pathlib.Path, step: int | None) -> dict:
  """One cell's finished files (``workdir``: its directory under ``--chunks``): per split the per-task successes,
  per-call fidelity and their intervals, and the parameters' digests."""
  out = {"splits": {}, "checkpoint_step": step}
  for cost_file in ("train_cost.json", "load_cost.json"):
    if (workdir / cost_file).exists():
      out[cost_file.removesuffix(".json")] = json.loads((workdir / cost_file).read_text())
  if step is not None and (workdir / "metrics.jsonl").exists():  # the warm-up's own record of its first K steps
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in logged if "sft/nll" in m and m["step"] <= step]
    out["warmup_log"] = {
      "steps": [m["step"] for m in steps],
      "nll_before": [m["sft/nll"] for m in steps],
      "step_s": [m["time/step_s"] for m in steps],
      "compile_s": sum(m.get("time/compile_s", 0.0) for m in steps),
      "host_peak_gib": max((m.get("memory/host_peak_gib", 0.0) for m in steps), default=0.0),
    }
  digests = set()
  for split in args.splits:
    d = eval_dir(workdir, step)
    succ, fid = _read(d, split, "success"), _read(d, split, "fidelity")
    digests |= {ch["params_sha256"] for ch in succ + fid if "params_sha256" in ch}
    s = {}
    if succ:
      rows = [r for ch in succ for r in ch["rows"]]
      s["success"] = {
        **bootstrap([r["success"] for r in rows]),
        "tasks": len(rows),
        "invalid": sum(not r["valid"] for r in rows),
        "mean_tool_calls": float(np.mean([r["tool_calls"] for r in rows])),
        "per_task": {r["task"]: r["success"] for r in rows},
        "wall_s": sum(ch["wall_s"] for ch in succ),
        "cpu_s": sum(ch["cpu_s"] for ch in succ),
      }
    if fid:
      rows = [r for ch in fid for r in ch["rows"]]
      s["fidelity"] = {
        "tasks": sum(len(ch["tasks"]) for ch in fid),
        "gold_calls": sum(ch["gold_calls"] for ch in fid),
        "calls": len(rows),
        **{m: bootstrap([None if r[m] is None else float(r[m]) for r in rows]) for m in FIDELITY_METRICS},
        "per_call": {m: [r[m] for r in rows] for m in FIDELITY_METRICS},
        "call_tasks": [r["task"] for r in rows],
        "wall_s": sum(ch["wall_s"] for ch in fid),
        "cpu_s": sum(ch["cpu_s"] for ch in fid),
        "generated_tokens": sum(ch["stats"].get("generated_tokens", 0.0) for ch in fid),
      }
    if s:
      out["splits"][split] = s
  out["params_sha256"] = sorted(digests)
  return out


def _ci(d: dict | None, pct: bool = True) -> str:
  if not d or d.get("n", 0) == 0 or math.isnan(d["mean"]):
    return "-"
  f = 100.0 if pct else 1.0
  return f"{f * d['mean']:.1f} [{f * d['lo']:.1f}, {f * d['hi']:.1f}]"


def write(args) -> None:
  """Gathers every cell under ``--chunks`` into ``--out`` and ``--out_md``."""
  cells = {}
  for seed in args.seeds:
    for model in args.models:
      workdir = args.chunks / f"{model}_s{seed}"
      if not workdir.is_dir():
        continue
      for step in [None] if model == "base" else args.report_steps or [args.warmup_steps]:
        name = workdir.name if step is None else f"{workdir.name}_k{step}"
        cells[name] = {"model": model, "seed": seed, **gather_cell(args, name, workdir, step)}
  config = make_config(args.level, args.seeds[0], args.model)
  result = {
    "issue": 42,
    "what": "testbed calibration: base weights vs supervised warm-up on the held-out splits",
    "level": args.level,
    "model": args.model,
    "warmup_steps": args.report_steps or [args.warmup_steps],
    "warmup_batch": int(config.train.tasks_per_step),
    "sft_learning_rate": float(config.grpo.sft_learning_rate),
    "eval_sampling": config.eval.sampling.to_dict(),
    "fidelity_probe": "greedy REHEARSE on every gold call of the tasks' reference conversations (user turns shown)",
    "rehearse_max_new_tokens": int(config.rollout.rehearse_max_new_tokens),
    "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED, "interval": "percentile 95%"},
    "seeds": list(args.seeds),
    "command": args.command or " ".join(["python", "experiments/testbed_calibration.py", *sys.argv[1:]]),
    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs; {args.machine_note}",
    "written": _now(),
    "reward_gap": args.gap_note,
    "notes": list(args.note),
    "cells": cells,
  }
  _dump(args.out, result)
  args.out_md.write_text(table(result), encoding="utf-8")
  print(table(result))


def table(result: dict) -> str:
  """The calibration as a markdown table: success and fidelity (percent, 95% interval) and costs per (cell, split)."""
  lines = [
    f"# Testbed calibration (level {result['level']}, {result['model']})",
    "",
    f"warm-up: K={', '.join(map(str, result['warmup_steps']))} supervised steps of B={result['warmup_batch']} "
    "reference conversations "
    f"(both roles, `train` split), AdamW lr {result['sft_learning_rate']:g}. Success: committed execution, rehearsal "
    f"off, 1 trial, sampling {result['eval_sampling']}, reward = TestbedEnv.evaluate (BFCL checker + communicate). "
    f"Fidelity: {result['fidelity_probe']}. Percent, percentile-bootstrap 95% intervals "
    f"({result['bootstrap']['resamples']} resamples; success over tasks, fidelity over calls). Seeds: "
    f"{result['seeds']}.",
    "",
    "| model | split | success % (tasks) | exact % | key F1 % | value acc % | error agree % | JSON valid % | calls "
    "| eval CPU-min (success + fidelity) |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, cell in result["cells"].items():
    for split, s in cell["splits"].items():
      succ, fid = s.get("success"), s.get("fidelity", {})
      cpu = (succ or {}).get("cpu_s", 0.0) + fid.get("cpu_s", 0.0)
      lines.append(
        f"| {name} | {split} | {_ci(succ)} ({(succ or {}).get('tasks', 0)}) | "
        + " | ".join(_ci(fid.get(m)) for m in FIDELITY_METRICS)
        + f" | {fid.get('calls', 0)} | {cpu / 60:.1f} |"
      )
  lines.append("")
  for name, cell in result["cells"].items():
    tc, log = cell.get("train_cost"), cell.get("warmup_log")
    if tc:
      lines.append(
        f"- {name} warm-up: {tc['steps']} steps, wall {tc['wall_s'] / 60:.1f} min, CPU {tc['cpu_s'] / 60:.1f} min"
        + (f" ({tc['note']})" if tc.get("note") else "")
      )
    if log and log["steps"]:
      nll = ", ".join(f"{v:.3f}" for v in log["nll_before"])
      lines.append(
        f"- {name}: steps 1-{log['steps'][-1]} took {sum(log['step_s']) / 60:.1f} min wall (compiling "
        f"{log['compile_s']:.0f} s, host peak {log['host_peak_gib']:.1f} GiB); SFT NLL before each step: {nll}"
      )
  lines += ["", f"Reward gap (WM2Real): {result['reward_gap']}", "", f"Machine: {result['machine']}", ""]
  lines += [f"- {n}" for n in result.get("notes", [])] + ([""] if result.get("notes") else [])
  lines.append(f"Command: `{result['command']}`")
  return "\n".join(lines) + "\n"


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--root", type=pathlib.Path, default=pathlib.Path("/tmp/tbcal"), help="checkpoints and logs")
  p.add_argument(
    "--chunks",
    type=pathlib.Path,
    default=ROOT / "experiments" / "results" / "testbed_calibration_chunks",
    help="finished chunk files, one directory per cell (committed: a calibration adds up over sessions)",
  )
  p.add_argument("--level", default="cpu")
  p.add_argument("--model", default="smollm2-135m", help="tiny: the random tiny model (smoke runs)")
  p.add_argument("--models", default="base,warmup", type=lambda s: s.split(","))
  p.add_argument("--seeds", default="0", type=lambda s: [int(x) for x in s.split(",")])
  p.add_argument("--splits", default="iid,compositional,rules", type=lambda s: s.split(","))
  p.add_argument("--warmup_steps", type=int, default=10, help="K: supervised steps, and the checkpoint evaluated")
  p.add_argument("--tasks", type=int, default=128, help="tasks per split for success")
  p.add_argument("--fidelity_tasks", type=int, default=-1, help="tasks per split for fidelity (-1: all)")
  p.add_argument("--chunk", type=int, default=32, help="tasks per evaluation chunk (one file, one batched rollout)")
  p.add_argument("--nice", type=int, default=5)
  p.add_argument("--train_flag", action="append", default=[], help="extra flag of the warm-up's command (repeatable)")
  p.add_argument(
    "--report_steps", default=[], type=lambda s: [int(x) for x in s.split(",")], help="--write: the Ks to report"
  )
  p.add_argument("--no_train", action="store_true", help="evaluate only cells whose checkpoint exists")
  p.add_argument("--write", action="store_true", help="gather finished cells into --out / --out_md")
  p.add_argument("--out", type=pathlib.Path, default=ROOT / "experiments" / "results" / "testbed_calibration.json")
  p.add_argument("--out_md", type=pathlib.Path, default=ROOT / "experiments" / "results" / "testbed_calibration.md")
  p.add_argument("--command", default="", help="the command recorded in --out (default: this one)")
  p.add_argument("--machine_note", default="", help="load on the machine while it ran, for the record")
  p.add_argument("--note", action="append", default=[], help="a remark recorded in --out and the table (repeatable)")
  p.add_argument("--gap_note", default="not run (eval.reward_gap): no CPU time left for it in this calibration")
  args = p.parse_args(argv)
  if args.write:
    write(args)
    return
  args.root.mkdir(parents=True, exist_ok=True)
  for seed in args.seeds:
    for model in args.models:
      workdir = args.root / f"{model}_s{seed}"
      workdir.mkdir(parents=True, exist_ok=True)
      if model == "base":
        evaluate_cell(args, workdir.name, seed, workdir, None)
      elif model == "warmup":
        if args.warmup_steps not in checkpoint_steps(workdir):
          if args.no_train:
            print(f"{workdir.name}: no checkpoint step {args.warmup_steps} yet; skipped", flush=True)
            continue
          train(args, seed, workdir)
        evaluate_cell(args, workdir.name, seed, workdir, args.warmup_steps)
      else:
        raise SystemExit(f"unknown model cell {model!r}: base or warmup")


if __name__ == "__main__":
  main()
