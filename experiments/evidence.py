"""The paper's four claims on the testbed (docs/testbed.md), with paired seeds and intervals.

    python experiments/evidence.py                              # the default grid, run (or resumed) in full
    python experiments/evidence.py --methods=envace --seeds=1   # a share of it (a session's, a second machine's)
    python experiments/evidence.py --methods=                   # run nothing: gather the finished chunks
    python experiments/evidence.py --methods=warmup --seeds=7 --workdir=DIR --chunks=experiments/results/evidence_unheld
                                     # a seed the grid does not hold: judged against the grid's interval (--replication)
    python experiments/evidence.py --smoke --workdir=DIR --chunks=DIR2 --out-dir=DIR3   # pipeline check, tiny model
    python experiments/evidence.py --results-page               # docs/results.md's section, from the committed JSON
    python experiments/evidence.py --update-results-page        # ... written between docs/results.md's markers

Protocol. SmolLM2-135M-Instruct on the testbed at level ``cpu`` (configs/testbed.py): generated tasks over BFCL's
real MessageAPI and TicketAPI, trained on the ``train`` split, judged on the first ``--tasks`` tasks of each held-out
split (``iid``: seen templates, unseen entities; ``compositional``: unseen combinations; ``rules``: unseen
preconditions; envs/testbed.py). The same tasks, and the same evaluation key per seed, for every method: differences
between methods are paired by seed and by task.

Methods (the paper's claims, section 5, and their ablations):
  base           the initial weights, no training;
  warmup         the supervised warm-up alone: ``--sft-steps`` steps of B=4 reference conversations (gold calls for
                 ACT, the real tools' responses for REHEARSE), both roles; trained once per seed, its checkpoint is
                 where every RL method starts (``train.init_from``), so the RL methods differ only after it;
  envace         then world-rehearsal GRPO, ``--steps`` steps of B=4 x G=4 (REHEARSE answers every tool call, both
                 roles trained, role-wise baseline);
  grpo_real_env  then plain GRPO against the real tools, ACT trained (REHEARSE, in the shared weights, keeps the
                 warm-up's training);
  per_role       then EnvACE with separate ACT and REHEARSE parameters, both copies of the warm-up's;
  role_agnostic  then EnvACE with one baseline per task over both roles' outputs (``grpo.baseline_groups="task"``,
                 the official ``group_by_agent_id=False``).
Everything else is configs/testbed.py's (dynamic sampling, no grounding for REHEARSE, learning rates).

Evaluation, per (cell, split), in chunks of ``--chunk`` tasks (one JSON file each, written when it finishes, under
``--chunks/METHOD/seedS/SPLIT/``; a rerun evaluates only the missing ones, and a finished chunk must have evaluated
the same parameters, `testbed_calibration.check_digest`):
  success   committed execution on the real tools, 1 trial, rehearsal off (`testbed_calibration.success_chunk`);
            per task 0/1, and tool-call validity;
  fidelity  REHEARSE's greedy prediction of the real response to every gold call of the first ``--fidelity-tasks``
            tasks (`testbed_calibration.fidelity_chunk`): exact match, key F1, error agreement, JSON validity;
  gap       WM2Real: a self-unfolded rollout (REHEARSE answers every call) of each of the first ``--gap-tasks``
            tasks, scored by the rule checklist (what EnvACE trains on) and replayed on the real tools
            (`scoring.reward_gap_pairs`): per task the rehearsed reward, the real reward and their difference.
  test time (claim 4; the cells of ``--test-time-methods`` on ``--test-time-splits``' first ``--test-time-tasks``
            tasks): for each N of ``--ns``, private rehearsal (parallel, sequential) and its two controls under the
            same generation cap (rehearsal/private.py ``control``; the tokens each spent are in the table):
            ``no_world_model``, the same rehearsals with the imagined tool results withheld from the assessments and
            the memory; ``drafts``, N plans written with no tool result, the best assessed one in the memory's place.
            Each with the success chunk's key: the same openings, so N = 0 is the success evaluation of the same
            tasks. A method runs the variants its claims compare (`test_time_variants`): the base policy parallel
            rehearsal alone.
Chunk keys are `testbed_calibration`'s (``fold_in(fold_in(eval_key(seed), phase), chunk)``), so the calibration's
chunks of the same weights are this grid's.

Aggregation (`interval`, `paired`): per (method, split, metric) the mean over seeds of each seed's mean over items,
the interquartile mean over seeds (the 25%-trimmed mean of the seeds' means: with 3 seeds it trims nothing; rliable's
``aggregate_iqm`` trims over every (seed, task) score instead, which for 0/1 task successes says little), and a 95%
interval from a two-level bootstrap (``BOOTSTRAP_RESAMPLES`` resamples, fixed seed): seeds drawn with replacement,
then within each drawn seed its items (tasks or calls), so both seed and item variation widen it. Paired
differences between two methods use the items both evaluated, per seed. rliable is not used: its 1.2.0 needs
``arch<8``, whose 7.2.0 does not import under pandas 3 (a ``deprecate_kwarg`` TypeError). Each claim's verdict reads
the paired difference pooled over the splits (every split's items, each seed a stratum): supported where the
interval is above 0, contradicted where below, unresolved where it holds 0; a verdict on fewer than 3 seeds is
provisional (the page says so). Claim 4's differences are paired the same way, pooled over the test-time splits.

Output: ``--out-dir/evidence.json`` (the protocol with the task ids of every split, every cell's per-item values and
costs, the aggregate rows, the test-time rows, the paired differences, the verdicts, what is missing), the PNGs
there, and ``--results-page``, docs/results.md's results section generated from that JSON (a test checks the page
holds it).

Budget (measured 2026-12-05 on 2 vCPUs, SmolLM2 float32): success ≈ 1 CPU-min per 8 tasks, fidelity ≈ 1.5 CPU-min
per 8 tasks (≈ 15 calls), WM2Real ≈ 1.5-2.5 CPU-min per 8 tasks, the warm-up ≈ 28 CPU-min per seed; evidence.json's
``cpu_minutes`` gives each cell's (training included). Host memory: a GRPO cell peaks near 17 GB (SmolLM2, B=4 x
G=4, no remat), so on a 23 GB machine nothing heavy runs beside the grid, and each method runs in a process of its
own (``--methods=envace``, then ``--methods=grpo_real_env``, ...): one process running the EnvACE cell, its
evaluation, then the GRPO-real cell held 21.2 GB (2026-12-06). The default grid is 6 methods x 3 seeds x
3 splits plus the test-time part. Planned for 15 CPU-hours, it costs about twice that (2026-12-06): the 14 cells
finished by then took 15.3 CPU-hours (base ≈ 0.6 a seed, warm-up ≈ 1.0, an RL cell 1.0-1.6, in evidence.json), and
the test-time part, at about 8 CPU-min per 8-task chunk at N = 2 (one chunk measured) and about twice that at N = 4,
adds some 12 for EnvACE's 48 chunks and base's 12. Every method and seed is an acceptance item of the issue, so the
grid keeps them; a further cut would go methods first, then seeds below 5, then tasks.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/evidence.py` puts experiments/ first on the path, not the root
  sys.path.insert(0, str(ROOT))

from experiments import common  # noqa: E402
from experiments import testbed_calibration as calibration  # noqa: E402

RESULTS_DIR = ROOT / "experiments" / "results"
RESULTS_FILE = "evidence.json"
CHUNKS_DIR = RESULTS_DIR / "evidence_chunks"
PNGS = {"bars": "evidence_bars.png", "curves": "evidence_curves.png", "test_time": "evidence_test_time.png"}
CELL_FILE = "cell.json"  # beside a cell's chunks: its training record (budget, steps, costs, curve)
# An evaluation process that holds more than this after a chunk drops its compiled programs (GiB; `evaluate_cell`).
PROGRAMS_GIB = 8.0
RESULTS_PAGE = ROOT / "docs" / "results.md"
RESULTS_BEGIN, RESULTS_END = "<!-- evidence.py --results-page: begin -->", "<!-- evidence.py --results-page: end -->"

METHODS = ("base", "warmup", "envace", "grpo_real_env", "per_role", "role_agnostic")
RL_METHODS = ("envace", "grpo_real_env", "per_role", "role_agnostic")
# Config overrides of each RL method, after the shared warm-up: common.TRAINING_MODES' three, and the role-agnostic
# baseline (EnvACE with one baseline per task over both roles' outputs).
TRAINING: dict[str, dict[str, Any]] = {
  **common.TRAINING_MODES,
  "role_agnostic": {**common.TRAINING_MODES["envace"], "grpo.baseline_groups": "task"},
}
LABELS = {
  "base": "base",
  "warmup": "warm-up",
  "envace": "EnvACE",
  "grpo_real_env": "GRPO (real tools)",
  "per_role": "per-role",
  "role_agnostic": "role-agnostic baseline",
}
PHASES = {"success": 1, "fidelity": 2, "gap": 3}  # the chunk key's stream (1, 2: testbed_calibration's)
# metric -> (phase, the per-item value's name, table header)
METRICS = {
  "success": ("success", "success", "success"),
  "exact_match": ("fidelity", "exact_match", "fidelity: exact match"),
  "key_f1": ("fidelity", "key_f1", "fidelity: key F1"),
  "error_agreement": ("fidelity", "error_agreement", "fidelity: error agreement"),
  "wm2real_gap": ("gap", "gap", "WM2Real: rehearsed − real reward"),
  "wm2real_real": ("gap", "real", "WM2Real: real reward of the rehearsed run"),
}
# The claims (paper section 5): (claim, A, B, metric): "A's metric exceeds B's", decided on the pooled splits.
CLAIMS = (
  ("1. fidelity rises with world-rehearsal training", "envace", "warmup", "exact_match"),
  ("1. fidelity rises with the warm-up", "warmup", "base", "exact_match"),
  ("2. held-out success: EnvACE > base", "envace", "base", "success"),
  ("2. held-out success: EnvACE > GRPO on the real tools", "envace", "grpo_real_env", "success"),
  ("2. held-out success: EnvACE > its warm-up", "envace", "warmup", "success"),
  ("3. shared parameters: EnvACE > per-role", "envace", "per_role", "success"),
  ("3. role-wise baseline: EnvACE > role-agnostic", "envace", "role_agnostic", "success"),
)
# Test-time variants (claim 4): name -> (eval.rehearsal mode, eval.rehearsal_control); N = 0 is the success chunk.
TEST_TIME = {
  "parallel": ("parallel", "none"),
  "sequential": ("sequential", "none"),
  "no_world_model": ("parallel", "no_world_model"),
  "drafts": ("parallel", "drafts"),
}
# (claim, method, variant A, N of A, variant B, N of B): "A's success exceeds B's"; ("off", 0) is rehearsal off.
TEST_TIME_CLAIMS = (
  ("4. private rehearsal helps the trained policy (parallel)", "envace", "parallel", "max", "off", 0),
  ("4. private rehearsal helps the trained policy (sequential)", "envace", "sequential", "max", "off", 0),
  ("4. private rehearsal helps the base policy (parallel; the paper: ≈ 0)", "base", "parallel", "max", "off", 0),
  ("4. imagining the tools helps: rehearsal > rehearsal without them", "envace", "parallel", "max", "no_world_model",
   "max"),
  ("4. imagining the tools helps: rehearsal > best of N drafts", "envace", "parallel", "max", "drafts", "max"),
)  # fmt: skip
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0

DEFAULTS: dict[str, dict[str, Any]] = {
  "default": dict(
    model="smollm2-135m", level="cpu", methods=",".join(METHODS), seeds="0,1,2", splits="iid,compositional,rules",
    sft_steps=10, steps=5, tasks=32, fidelity_tasks=16, gap_tasks=16, chunk=8,
    test_time_methods="base,envace", test_time_splits="iid", test_time_tasks=16, ns="2,4",
    replication=str(RESULTS_DIR / "evidence_unheld"),
  ),
  "smoke": dict(
    model="tiny", level="cpu", methods="base,warmup,envace", seeds="0", splits="iid,rules",
    sft_steps=1, steps=1, tasks=2, fidelity_tasks=1, gap_tasks=1, chunk=2,
    test_time_methods="envace", test_time_splits="iid", test_time_tasks=1, ns="1", replication="",
  ),
}  # fmt: skip
_BUDGET_KEYS = ("model", "level", "sft_steps", "steps", "overrides")
# --smoke's sizes (a pipeline check, cheap enough for the test suite): B=2 x G=2, 2 turns of 16 new tokens.
SMOKE_SIZES = {
  "train.tasks_per_step": 2,
  "train.group_size": 2,
  "rollout.max_turns": 2,
  "rollout.act_max_new_tokens": 16,
  "rollout.rehearse_max_new_tokens": 16,
  "eval.assessment_max_tokens": 16,
  "eval.memory_max_tokens": 16,
}


# ---------------------------------------------------------------------------------------------------------------------
# Cells: training


def cell_config(args, method: str, seed: int):
  """The run config of one cell: configs/testbed.py at ``--level`` with ``seed``, the warm-up's steps, then the
  method's GRPO steps from the warm-up's checkpoint (``train.init_from``); no evaluation inside the run."""
  c = calibration.make_config(args.level, seed, args.model)
  c.train.eval_tasks = 0
  c.train.eval_at_start = False
  c.train.sft_warmup_steps = 0 if method == "base" else args.sft_steps
  c.train.steps = c.train.sft_warmup_steps + (args.steps if method in RL_METHODS else 0)
  # A killed warm-up loses at most 4 of its steps, a killed GRPO run none (its steps are the slow ones).
  c.train.checkpoint_every = 1 if method in RL_METHODS else 5
  c.train.keep_checkpoints = 1  # SmolLM2 with AdamW's state: 1.6 GB a checkpoint
  # 135M parameters fit without recomputing layers, faster on a CPU; host memory peaks near 12 GB in the warm-up and
  # 17-21 GB in a GRPO step (role_agnostic seed 2: 21.1 GB), 21.7 GB in per_role's; a GRPO cell beside other jobs is
  # killed for memory on a 23 GB machine (2026-12-05 beside the main job and the tests, 2026-12-07 per_role beside a
  # test batch).
  c.grpo.remat = False
  if args.smoke:
    common.apply_overrides(c, SMOKE_SIZES)
  if method in RL_METHODS:
    common.apply_overrides(c, TRAINING[method])
    c.train.init_from = str(cell_dir(args, "warmup", seed))
  common.apply_flags(c, args.overrides)
  return c


def cell_dir(args, method: str, seed: int) -> pathlib.Path:
  return pathlib.Path(args.workdir) / method / f"seed{seed}"


def chunk_dir(args, method: str, seed: int) -> pathlib.Path:
  return pathlib.Path(args.chunks) / method / f"seed{seed}"


def budget(args) -> dict[str, Any]:
  """What a cell's training depends on beyond its method and seed; a saved cell made with another is not reused."""
  return {k: ([list(o) for o in args.overrides] if k == "overrides" else getattr(args, k)) for k in _BUDGET_KEYS}


def train_cell(args, method: str, seed: int) -> dict[str, Any]:
  """Trains the cell into its workdir unless its last step is saved there (an RL cell trains its seed's warm-up
  first); writes and returns its record (``CELL_FILE`` beside its chunks): budget, checkpoint step, wall and CPU
  seconds of the training done now, and the curve of its metrics.jsonl."""
  from envace_jax import train

  path = chunk_dir(args, method, seed) / CELL_FILE
  record = common.read_json(path) if path.exists() else None
  if record is not None:
    stale = common.budget_mismatch(record["budget"], budget(args))
    if stale:
      raise SystemExit(f"{path} was made with another budget ({'; '.join(stale)}); use fresh --workdir and --chunks")
  config = cell_config(args, method, seed)
  workdir = cell_dir(args, method, seed)
  step = config.train.steps or None
  if step is not None and step not in calibration.checkpoint_steps(workdir):
    if method in RL_METHODS:
      train_cell(args, "warmup", seed)
    print(f"{method} seed {seed}: training to step {step} in {workdir}", flush=True)
    wall, cpu = time.perf_counter(), time.process_time()
    train.train_and_evaluate(config, str(workdir))
    costs = (record or {}).get("train_costs", []) + [
      {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "date": calibration._now()}
    ]
  else:
    if step is not None:
      _check_trained(config, workdir, step)
    if record is not None:
      return record
    outside = workdir / "train_cost.json"  # trained outside this script (testbed_calibration.py writes it)
    costs = [common.read_json(outside)] if outside.exists() else []
  record = {
    "method": method,
    "seed": seed,
    "budget": budget(args),
    "checkpoint_step": step,
    "init_from": config.train.init_from or None,
    "train_costs": costs,
    "curve": _curve(workdir),
  }
  common.write_json(path, record)
  return record


_TRAINED_KEYS = (  # what a checkpoint found in a cell's workdir must have been trained with (`_check_trained`)
  "model", "seed", "train.sft_warmup_steps", "train.steps", "train.tasks_per_step", "train.group_size",
  "train.init_from", "grpo.mode", "grpo.baseline_groups", "grpo.trained_roles", "grpo.learning_rate",
  "grpo.sft_learning_rate", "rollout.env_mode",
)  # fmt: skip


def _check_trained(config, workdir: pathlib.Path, step: int) -> None:
  """Stops when the checkpoint of ``step`` in ``workdir`` was trained with other settings than ``config`` (a
  workdir reused with another budget: its step would be taken for this cell's).

  Raises:
    SystemExit: naming the first settings that differ.
  """
  from envace_jax import checkpoint as checkpoint_lib

  with checkpoint_lib.Checkpointer(workdir, read_only=True) as ckpt:
    saved = ckpt.read_config(step)

  def flat(c, key: str) -> str:  # a key the saved config lacks (an older version's) reads as unset
    node = c
    for part in key.split("."):
      node = node.get(part) if hasattr(node, "get") else None
    return json.dumps(None if node in ("", None) else node, default=list)

  differ = [
    f"{k}: saved {flat(saved, k)}, now {flat(config, k)}" for k in _TRAINED_KEYS if flat(saved, k) != flat(config, k)
  ]
  if differ:
    raise SystemExit(
      f"{workdir} step {step} was trained with other settings ({'; '.join(differ)}); use a fresh --workdir"
    )


def _curve(workdir: pathlib.Path) -> list[dict[str, float]]:
  """Per step of the cell's own run (an RL cell logs only its GRPO steps): reward per role, NLL, signal."""
  keys = ("reward/mean", "reward/act/mean", "reward/rehearse/mean", "sft/nll", "rollout/groups_without_signal")
  path = workdir / "metrics.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
  return [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows]


# ---------------------------------------------------------------------------------------------------------------------
# Cells: evaluation


def gap_chunk(config, tasks, samplers, tokenizer, key) -> dict:
  """WM2Real on ``tasks``: one self-unfolded rollout each (`heldout.rehearsed_runs`), its rule-checklist reward and
  the real tools' reward of replaying it (`scoring.reward_gap_pairs`); one row per task."""
  from envace_jax import heldout, scoring
  from envace_jax import policy as policy_lib

  wall, cpu = time.perf_counter(), time.process_time()
  ucfg = heldout.evaluation_unfold_config(config, samplers)
  policy = policy_lib.Policy.from_config(config).by_role(samplers)
  out = heldout.rehearsed_runs(ucfg, tasks, policy, tokenizer, samplers, key, num_trials=1)
  pairs = scoring.reward_gap_pairs(config, [t.task for t in out.trajectories], out.trajectories)
  rows = [
    {
      "task": traj.task.id,
      "rehearsed": r,
      "real": q,
      "gap": None if r is None else r - q,
      "scoring_error": error,
      "tool_calls": int(traj.counts.get("tool_calls", 0)),
    }
    for traj, (r, q, error) in zip(out.trajectories, pairs, strict=True)
  ]
  return {"rows": rows, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def test_time_chunk(config, tasks, samplers, tokenizer, key, variant: str, n: int) -> dict:
  """Private rehearsal (or a control, ``TEST_TIME[variant]``) with N = ``n`` before the committed execution of
  ``tasks``, with the success chunk's key (the same openings, so N = 0 is that chunk): per task success, and the
  tokens each phase generated."""
  from envace_jax import heldout, scoring

  mode, control = TEST_TIME[variant]
  c = copy.deepcopy(config)
  c.eval.rehearsal_n, c.eval.rehearsal_control = n, control
  wall, cpu = time.perf_counter(), time.process_time()
  summary, result = heldout.evaluate_policy(
    c, tasks, samplers, tokenizer, key, mode=mode, num_trials=1, fidelity=False, gap=False, gold=False
  )
  rows = [
    {
      "task": traj.task.id,
      "reward": float(traj.reward.reward),
      "valid": bool(traj.reward.valid),
      "success": int(bool(traj.reward.valid) and scoring.is_success(traj.reward.reward)),
      "memory_tokens": item.memory_tokens,
    }
    for traj, item in zip(result.committed, result.prepared, strict=True)
  ]
  tokens = {p: summary.get(f"cost/{p}/generated_tokens", 0.0) for p in ("rehearsal", "assessment", "memory")}
  return {
    "rows": rows,
    "generated_tokens": tokens,
    "wall_s": time.perf_counter() - wall,
    "cpu_s": time.process_time() - cpu,
  }


def test_time_variants(method: str) -> list[str]:
  """The `TEST_TIME` variants a test-time method runs: those its `TEST_TIME_CLAIMS` compare (the trained policy: all
  four; the base policy: parallel rehearsal only, 4 of its 16 chunks at the defaults, about 6 CPU-hours fewer over 3
  seeds), in `TEST_TIME`'s order."""
  named = {v for claim in TEST_TIME_CLAIMS if claim[1] == method for v in (claim[2], claim[4])}
  return [v for v in TEST_TIME if v in named]


def _test_time_phases(args, method: str) -> list[tuple[str, str, int]]:
  """(phase name, variant, N) of the cell's test-time chunks (none unless ``method`` is a test-time method): its
  `test_time_variants`, each at every N of ``--ns``."""
  if method not in args.test_time_methods:
    return []
  return [(f"testtime_{v}_n{n}", v, n) for v in test_time_variants(method) for n in args.ns]


def _chunk_files(args, method: str, seed: int, split: str, phase: str, n: int) -> list[tuple[int, int, pathlib.Path]]:
  """(lo, hi, path) of each chunk of ``n`` tasks of a (cell, split, phase), ``--chunk`` tasks a chunk."""
  d = chunk_dir(args, method, seed) / split
  return [(lo, hi, d / f"{phase}_{lo:04d}_{hi:04d}.json") for lo, hi in calibration._chunks(n, args.chunk)]


def _read_chunks(args, method: str, seed: int, split: str, phase: str) -> list[dict]:
  """The finished chunks of a (cell, split, phase) that this grid's chunking names (a file of another ``--chunk``
  or task count beside them is not read)."""
  files = _chunk_files(args, method, seed, split, phase, _phase_tasks(args, phase))
  return [json.loads(path.read_text()) for _, _, path in files if path.exists()]


def _phase_tasks(args, phase: str) -> int:
  if phase.startswith("testtime_"):
    return min(args.test_time_tasks, args.tasks)
  return {"success": args.tasks, "fidelity": args.fidelity_tasks, "gap": args.gap_tasks}[phase]


def evaluate_cell(args, method: str, seed: int, test_time: bool = False) -> None:
  """Every missing (split, phase, chunk) file of the cell, after training it if needed: its success, fidelity and
  WM2Real chunks, or with ``test_time`` its test-time chunks; the policy is loaded once, at the cell's checkpoint step
  (the base weights for ``base``).

  Raises:
    SystemExit: a finished chunk of the cell evaluated other parameters (`testbed_calibration.check_digest`).
  """
  import jax

  from envace_jax import evaluate, runtime

  config = cell_config(args, method, seed)
  functions = {"success": calibration.success_chunk, "fidelity": calibration.fidelity_chunk, "gap": gap_chunk}
  phases = [] if test_time else [(p, functions[p], PHASES[p], args.splits) for p in PHASES]
  for name, variant, n in _test_time_phases(args, method) if test_time else []:  # the success chunks' keys
    fn = functools.partial(test_time_chunk, variant=variant, n=n)
    phases.append((name, fn, PHASES["success"], [s for s in args.test_time_splits if s in args.splits]))
  plan = []  # every split's success first, then fidelity, then WM2Real: the headline numbers first
  for phase, fn, stream, splits in phases:
    for split in splits:
      config.env.eval_split = split
      n = min(_phase_tasks(args, phase), len(runtime.evaluation_tasks(config, -1)))
      for c, (lo, hi, path) in enumerate(_chunk_files(args, method, seed, split, phase, n)):
        if not path.exists():
          plan.append((split, phase, fn, stream, c, lo, hi, path))
  record = train_cell(args, method, seed)
  if not plan:
    return
  print(f"{method} seed {seed}: {len(plan)} chunks to evaluate", flush=True)
  step = record["checkpoint_step"]
  unknown = [
    p
    for p in sorted(chunk_dir(args, method, seed).glob("*/*.json"))
    if "params_sha256" not in json.loads(p.read_text())
  ]
  if unknown:
    raise SystemExit(f"{unknown[0]} does not say which parameters it evaluated (no params_sha256); delete it")
  model, samplers, digest = calibration.load(config, cell_dir(args, method, seed), step)
  calibration.check_digest(chunk_dir(args, method, seed), digest, f"{method} seed {seed} step {step}")
  base_key = evaluate.eval_key(seed)
  with runtime.CompileClock() as clock:
    for split, phase, fn, stream, c, lo, hi, path in plan:
      config.env.eval_split = split
      tasks = runtime.evaluation_tasks(config, hi)[lo:hi]
      key = jax.random.fold_in(jax.random.fold_in(base_key, stream), c)
      mark = clock.mark()
      out = fn(config, tasks, samplers, model.tokenizer, key)
      out["compile_s"], out["programs"] = clock.since(mark), clock.programs_since(mark)
      # The chunk's temporaries go back to the OS before the next one, and its compiled programs too once the process
      # holds more than PROGRAMS_GIB: keeping every program, per_role seed 2's evaluation grew from 7.3 to 16.7 GB
      # over 22 chunks and failed its 23rd for memory; dropping them after every chunk, EnvACE's test-time chunks
      # spent 69-90 s of their 340-415 s reading them back (2026-12-07).
      runtime.release_host_memory()
      if runtime.host_memory_gib()["memory/host_rss_gib"] > PROGRAMS_GIB:
        runtime.release_host_memory(programs=True)
      out.update(runtime.host_memory_gib())  # after the release: what the process holds, and its peak so far
      out.update(cell=f"{method}_s{seed}", split=split, phase=phase, tasks=[t.id for t in tasks], step=step)
      out.update(date=calibration._now(), params_sha256=digest["sha256"], params_norms=digest["norms"])
      calibration._dump(path, out)
      print(f"{method} seed {seed} {split} {phase} [{lo}:{hi}] cpu {out['cpu_s']:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Gathering and statistics


def item_values(chunks: Sequence[Mapping[str, Any]], metric: str) -> dict[str, float | None]:
  """One value per item of ``metric`` over a (cell, split)'s chunks of its phase: by task id, or by "task#message"
  for a gold call; None where it does not apply (an error agreement on a call both sides answered, an invalid
  trajectory).

  Raises:
    ValueError: two rows of one item (a fidelity row without its call's ``message``, or overlapping chunks).
  """
  phase, name, _ = METRICS[metric]
  out = {}
  for chunk in chunks:
    for row in chunk["rows"]:
      item = f"{row['task']}#{row['message']}" if phase == "fidelity" else row["task"]
      if item in out:
        raise ValueError(f"{chunk.get('split')} {chunk.get('phase')}: item {item} twice; its chunks overlap")
      value = row.get(name)
      out[item] = None if value is None else float(value)
  return out


def _resampled_means(values: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
  return values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)


def interval(per_seed: Sequence[Sequence[float]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED):
  """Mean over seeds of each seed's mean over its items, the IQM over seeds (25%-trimmed mean of the seeds' means:
  see the module docstring) and the two-level bootstrap's 95% percentile interval of the mean: seeds drawn with
  replacement, then each drawn seed's items drawn with replacement.

  Args:
    per_seed: one sequence of item values per seed (a seed without items is left out).
  Returns:
    {"mean", "iqm", "lo", "hi", "seeds", "items" (per seed)}; NaNs when there is no item.
  """
  from scipy import stats

  groups = [np.asarray(v, np.float64) for v in per_seed if len(v)]
  if not groups:
    nan = float("nan")
    return {"mean": nan, "iqm": nan, "lo": nan, "hi": nan, "seeds": 0, "items": []}
  rng = np.random.default_rng(seed)
  means = np.asarray([g.mean() for g in groups])
  drawn = rng.integers(0, len(groups), size=(resamples, len(groups)))  # [resamples, seeds drawn]
  seed_means = np.empty(drawn.shape, np.float64)  # each drawn seed's items resampled on their own
  for j in range(len(groups)):
    for s, g in enumerate(groups):
      rows = np.flatnonzero(drawn[:, j] == s)
      seed_means[rows, j] = _resampled_means(g, rows.size, rng)
  replicate = seed_means.mean(axis=1)
  lo, hi = np.percentile(replicate, [2.5, 97.5])
  return {
    "mean": float(means.mean()),
    "iqm": float(stats.trim_mean(means, 0.25)),
    "lo": float(lo),
    "hi": float(hi),
    "seeds": len(groups),
    "items": [int(g.size) for g in groups],
  }


def paired(a: Mapping[int, Mapping[str, float | None]], b: Mapping[int, Mapping[str, float | None]]) -> dict:
  """`interval` of A − B over the (seed, item) pairs both have a value for: ``a`` and ``b`` map seed -> item ->
  value (`item_values`)."""
  diffs = []
  for seed in sorted(set(a) & set(b)):
    common_items = [i for i in a[seed] if i in b[seed] and a[seed][i] is not None and b[seed][i] is not None]
    diffs.append([a[seed][i] - b[seed][i] for i in common_items])
  return interval(diffs)


def verdict(diff: Mapping[str, Any]) -> str:
  if diff["seeds"] == 0 or not np.isfinite(diff["lo"]):
    return "not run"
  if diff["lo"] > 0:
    return "supported"
  if diff["hi"] < 0:
    return "contradicted"
  return "unresolved"


def gather(args) -> dict[str, Any]:
  """Every finished chunk and cell record of the grid under ``--chunks``: the cells (per split and metric, the
  per-item values), the aggregate rows, the paired differences and the claims' verdicts, the costs, what is
  missing."""
  methods, seeds = grid(args)
  cells, missing = [], []
  for method in methods:
    for seed in seeds:
      d = chunk_dir(args, method, seed)
      record = common.read_json(d / CELL_FILE) if (d / CELL_FILE).exists() else {}
      splits = {}
      for split in args.splits:
        per_phase = {p: _read_chunks(args, method, seed, split, p) for p in PHASES}
        done = {p: sum(len(ch["tasks"]) for ch in chs) for p, chs in per_phase.items()}
        wanted = {p: _phase_tasks(args, p) for p in PHASES}
        if any(done[p] < wanted[p] for p in PHASES):
          missing.append(f"{method}/seed{seed}/{split}: " + ", ".join(f"{p} {done[p]}/{wanted[p]}" for p in PHASES))
        splits[split] = {
          "values": {m: item_values(per_phase[METRICS[m][0]], m) for m in METRICS},
          "tool_call_validity": _validity(per_phase["success"]),
          "cpu_s": {p: sum(ch["cpu_s"] for ch in chs) for p, chs in per_phase.items()},
        }
        for name, _, _ in _test_time_phases(args, method) if split in args.test_time_splits else []:
          chunks = _read_chunks(args, method, seed, split, name)
          done_tasks, wanted_tasks = sum(len(ch["tasks"]) for ch in chunks), _phase_tasks(args, name)
          if done_tasks < wanted_tasks:
            missing.append(f"{method}/seed{seed}/{split}: {name} {done_tasks}/{wanted_tasks}")
          splits[split].setdefault("test_time", {})[name] = {
            "values": {r["task"]: float(r["success"]) for ch in chunks for r in ch["rows"]},
            "generated_tokens": sum(sum(ch["generated_tokens"].values()) for ch in chunks),
            "cpu_s": sum(ch["cpu_s"] for ch in chunks),
          }
          splits[split]["cpu_s"][name] = splits[split]["test_time"][name]["cpu_s"]
      cpu = sum(c["cpu_s"] for c in record.get("train_costs", [])) + sum(
        sum(s["cpu_s"].values()) for s in splits.values()
      )
      cells.append({"method": method, "seed": seed, **{k: record.get(k) for k in ("checkpoint_step", "init_from",
                    "train_costs", "curve")}, "splits": splits, "cpu_minutes": cpu / 60})  # fmt: skip
  rows = []
  for method in methods:
    mine = [c for c in cells if c["method"] == method]
    for split in [*args.splits, "pooled"]:
      row = {"method": method, "split": split}
      for metric in METRICS:
        row[metric] = interval([_items(c, split, metric) for c in mine])
      rows.append(row)
  diffs = []
  for claim, a, b, metric in CLAIMS:
    if a not in methods or b not in methods:
      continue
    for split in [*args.splits, "pooled"]:
      d = paired(*(_by_seed(cells, m, split, metric) for m in (a, b)))
      diffs.append({"claim": claim, "a": a, "b": b, "metric": metric, "split": split, **d, "verdict": verdict(d)})
  test_time, top = [], max(args.ns)
  for method in (m for m in methods if m in args.test_time_methods):
    for split in args.test_time_splits:
      off = _test_time_by_seed(cells, method, [split], "off", 0)
      off = {seed: dict(list(v.items())[: _phase_tasks(args, "testtime_")]) for seed, v in off.items()}
      none = interval([])
      test_time.append(
        {
          "method": method,
          "split": split,
          "variant": "off",
          "N": 0,
          "success": _interval_of(off),
          "vs_off": none,
          "tokens_per_task": 0.0,
        }
      )  # fmt: skip  N = 0: the success evaluation of the test-time tasks
      for variant in test_time_variants(method):
        for n in args.ns:
          mine = _test_time_by_seed(cells, method, [split], variant, n)
          tokens = [_test_time_part(c, split, f"testtime_{variant}_n{n}") for c in cells if c["method"] == method]
          tokens = [t["generated_tokens"] / len(t["values"]) for t in tokens if t and t["values"]]
          test_time.append({
            "method": method, "split": split, "variant": variant, "N": n,
            "success": _interval_of(mine),
            "vs_off": paired(mine, off),
            "tokens_per_task": float(np.mean(tokens)) if tokens else float("nan"),
          })  # fmt: skip
  for claim, method, va, na, vb, nb in TEST_TIME_CLAIMS:  # pooled over the test-time splits
    if method not in methods or method not in args.test_time_methods:
      continue
    na, nb = (top if x == "max" else x for x in (na, nb))
    a, b = (_test_time_by_seed(cells, method, args.test_time_splits, v, n) for v, n in ((va, na), (vb, nb)))
    d = paired(a, b)
    names = {"a": f"{method} {va} N={na}", "b": f"{method} {vb} N={nb}"}
    diffs.append({"claim": claim, **names, "metric": "success", "split": "pooled", **d, "verdict": verdict(d)})
  return {
    "cells": cells,
    "rows": rows,
    "differences": diffs,
    "test_time": test_time,
    "replication": replication(args, methods, seeds, rows),
    "missing": missing,
  }


def replication(args, methods, seeds, rows) -> list[dict[str, Any]]:
  """Issue 44's check that the grid's intervals predict a new run: each cell under ``--replication`` (a folder of
  chunks laid out as ``--chunks``, of a method of the grid run with a seed it does not hold, in a workdir of its own:
  ``--seeds=S --chunks=DIR --workdir=ANOTHER``), per split and metric with finished chunks: its mean over items
  (the same chunks, tasks and keys' scheme as the grid's cells), the grid's interval for that method, and whether
  the mean lies inside it."""
  if not args.replication:
    return []
  out = []
  grid_rows = {(r["method"], r["split"]): r for r in rows}
  unheld = copy.copy(args)  # the same grid, its chunks read from --replication
  unheld.chunks = args.replication
  for d in sorted(pathlib.Path(args.replication).glob("*/seed*")):
    method, seed = d.parent.name, int(d.name.removeprefix("seed"))
    if method not in methods or seed in seeds:
      continue
    for split in args.splits:
      for metric, (phase, _, _) in METRICS.items():
        values = item_values(_read_chunks(unheld, method, seed, split, phase), metric)
        items = [v for v in values.values() if v is not None]
        if not items:
          continue
        ref = grid_rows[(method, split)][metric]
        value = float(np.mean(items))
        out.append({
          "method": method, "seed": seed, "split": split, "metric": metric, "value": value, "items": len(items),
          "grid": {k: ref[k] for k in ("mean", "lo", "hi", "seeds")},
          "inside": bool(ref["seeds"]) and ref["lo"] <= value <= ref["hi"],
        })  # fmt: skip
  return out


def _interval_of(by_seed: Mapping[int, Mapping[str, float | None]]) -> dict:
  """`interval` of seed -> item -> value (Nones left out)."""
  return interval([[v for v in values.values() if v is not None] for values in by_seed.values()])


def _test_time_part(cell: Mapping[str, Any], split: str, name: str) -> Mapping[str, Any] | None:
  return cell["splits"].get(split, {}).get("test_time", {}).get(name)


def _test_time_by_seed(cells, method: str, splits, variant: str, n: int) -> dict[int, dict[str, float | None]]:
  """Per seed, "split/task" -> success of ``method`` at test time on ``splits`` (``variant`` "off": the success
  chunks)."""
  out = {}
  for c in cells:
    if c["method"] != method:
      continue
    values = {}
    for split in (s for s in splits if s in c["splits"]):
      if variant == "off":
        part = c["splits"][split]["values"]["success"]
      else:
        part = (_test_time_part(c, split, f"testtime_{variant}_n{n}") or {}).get("values", {})
      values.update({f"{split}/{task}": v for task, v in part.items()})
    if values:
      out[c["seed"]] = values
  return out


def _validity(chunks) -> float | None:
  """Tool-call validity over a (cell, split)'s success chunks: each chunk's, weighted by its tool calls."""
  pairs = [(ch["summary"].get("tool_call_validity"), sum(r["tool_calls"] for r in ch["rows"])) for ch in chunks]
  total = sum(n for v, n in pairs if v is not None)
  return sum(v * n for v, n in pairs if v is not None) / total if total else None


def _items(cell: Mapping[str, Any], split: str, metric: str) -> list[float]:
  splits = cell["splits"].values() if split == "pooled" else [cell["splits"][split]]
  return [v for s in splits for v in s["values"][metric].values() if v is not None]


def _by_seed(cells, method: str, split: str, metric: str) -> dict[int, dict[str, float | None]]:
  out = {}
  for c in cells:
    if c["method"] == method:
      names = list(c["splits"]) if split == "pooled" else [split]
      out[c["seed"]] = {f"{s}/{i}": v for s in names for i, v in c["splits"][s]["values"][metric].items()}
  return {s: v for s, v in out.items() if v}


def grid(args) -> tuple[list[str], list[int]]:
  """The grid's methods and seeds: the defaults' (the smoke run's with ``--smoke``) and any others asked for."""
  defaults = DEFAULTS["smoke" if args.smoke else "default"]
  methods = set(common.parse_names(defaults["methods"])) | set(args.methods)
  seeds = set(common.parse_ints(defaults["seeds"])) | set(args.seeds)
  return [m for m in METHODS if m in methods], sorted(seeds)


def protocol(args) -> dict[str, Any]:
  """The grid's definition with the task ids of the train split and of each held-out split's evaluated tasks."""
  from envace_jax import runtime

  c = cell_config(args, "warmup", 0)
  source = runtime.training_tasks(c)
  keys = (
    "tasks",
    "fidelity_tasks",
    "gap_tasks",
    "chunk",
    "test_time_methods",
    "test_time_splits",
    "test_time_tasks",
    "ns",
  )
  out = {**budget(args), **{k: getattr(args, k) for k in keys}}
  out["train_tasks"] = len(source)
  out["heldout_task_ids"] = {}
  for split in args.splits:
    c.env.eval_split = split
    out["heldout_task_ids"][split] = [t.id for t in runtime.evaluation_tasks(c, args.tasks)]
  out["bootstrap"] = {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED, "kind": "stratified: seeds, items"}
  return out


# ---------------------------------------------------------------------------------------------------------------------
# Tables, figures, the results page


def _ci(x: Mapping[str, Any], percent: bool = True) -> str:
  if not x["seeds"]:
    return "–"
  s = 100.0 if percent else 1.0
  return f"{x['mean'] * s:.1f} [{x['lo'] * s:.1f}, {x['hi'] * s:.1f}]"


def table(result: Mapping[str, Any], split: str) -> str:
  """One split's markdown table: a row per method, mean over seeds [95% interval], in %."""
  head = ["method", "seeds", *(METRICS[m][2] for m in METRICS)]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in (r for r in result["rows"] if r["split"] == split):
    seeds = row["success"]["seeds"]
    lines.append("| " + " | ".join([LABELS[row["method"]], str(seeds), *(_ci(row[m]) for m in METRICS)]) + " |")
  return "\n".join(lines)


def claims_table(result: Mapping[str, Any]) -> str:
  head = ["claim", "metric", "A − B, pooled splits (points, 95% interval)", "seeds", "verdict"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for d in (d for d in result["differences"] if d["split"] == "pooled"):
    provisional = " (provisional: < 3 seeds)" if 0 < d["seeds"] < 3 else ""
    lines.append(
      f"| {d['claim']} | {METRICS[d['metric']][2]} | {_ci(d)} | {d['seeds']} | {d['verdict']}{provisional} |"
    )
  return "\n".join(lines)


def test_time_table(result: Mapping[str, Any]) -> str:
  """The test-time rows (markdown): success at N and its paired difference from rehearsal off (N = 0, the success
  evaluation of the same tasks), in %, and the tokens generated before the committed execution per task."""
  head = ["method", "split", "variant", "N", "success", "− rehearsal off (points)", "seeds", "tokens per task"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in result.get("test_time", []):
    tokens = f"{r['tokens_per_task']:.0f}" if np.isfinite(r["tokens_per_task"]) else "–"
    cells = [LABELS[r["method"]], r["split"], r["variant"], str(r["N"]), _ci(r["success"]), _ci(r["vs_off"])]
    lines.append("| " + " | ".join([*cells, str(r["success"]["seeds"]), tokens]) + " |")
  return "\n".join(lines)


def replication_table(result: Mapping[str, Any]) -> str:
  head = ["method", "seed", "split", "metric", "items", "this seed", "the grid (seeds)", "inside"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in result.get("replication", []):
    grid_ci = f"{_ci(r['grid'])} ({r['grid']['seeds']})"
    cells = [LABELS[r["method"]], str(r["seed"]), r["split"], METRICS[r["metric"]][2], str(r["items"])]
    lines.append("| " + " | ".join([*cells, f"{100 * r['value']:.1f}", grid_ci, "yes" if r["inside"] else "no"]) + " |")
  return "\n".join(lines)


def results_section(result: Mapping[str, Any]) -> str:
  """docs/results.md's results section (between the markers), from evidence.json's content."""
  p = result["protocol"]
  splits = list(p["heldout_task_ids"])
  lines = [
    RESULTS_BEGIN,
    f"Evidence on the testbed (`python experiments/evidence.py`; protocol in its docstring): {p['model']} at level "
    f"`{p['level']}`, {p['sft_steps']} warm-up steps shared by every RL method of a seed, then {p['steps']} GRPO steps "
    f"of B=4 × G=4. Per held-out split: success on the first {p['tasks']} tasks, fidelity on every gold call of the "
    f"first {p['fidelity_tasks']}, WM2Real on the first {p['gap_tasks']}. Mean over seeds of each seed's mean, "
    "[95% stratified-bootstrap interval], in %.",
  ]
  for split in splits:
    lines += ["", f"**{split}**", "", table(result, split)]
  lines += ["", "Claims (paired by seed and item; verdict from the interval):", "", claims_table(result)]
  p_tt = p.get("test_time_tasks")
  if any(r["success"]["seeds"] for r in result.get("test_time", [])):
    lines += [
      "",
      f"Test time (claim 4) on the first {p_tt} tasks of {', '.join(p['test_time_splits'])}: private rehearsal "
      "(parallel, sequential) and its two controls under the same generation cap: `no_world_model` (the same "
      "rehearsals, the imagined tool results withheld from the assessments and the memory) and `drafts` (N plans "
      "written without tool results, the best assessed one committed with); the same openings as the success "
      "evaluation, which is N = 0.",
      "",
      test_time_table(result),
    ]
  else:
    lines += ["", "Claim 4 (test-time private rehearsal and its two controls): not run yet."]
  if result.get("replication"):
    lines += [
      "",
      "A seed the grid does not hold, run as one more cell in a folder of its own (`--replication`): its mean per "
      "split against the grid's interval for that method, in %.",
      "",
      replication_table(result),
    ]
  if result["missing"]:
    lines += ["", f"Not finished: {len(result['missing'])} entries of evidence.json's `missing` (cell, split: phases)."]
  cpu = sum(c["cpu_minutes"] for c in result["cells"])
  lines += ["", f"CPU time of the finished parts: {cpu / 60:.1f} CPU-hours (per cell in evidence.json)."]
  lines += ["", *(f"![{name}](../experiments/results/{file})" for name, file in PNGS.items()), RESULTS_END]
  return "\n".join(lines)


def plot(result: Mapping[str, Any], out_dir: pathlib.Path) -> None:
  """``PNGS`` in ``out_dir``: success and fidelity per method and split with intervals; the RL methods' training
  reward per GRPO step (mean over seeds, the seeds' range as a band)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  splits = list(result["protocol"]["heldout_task_ids"])
  methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
  shown = ("success", "exact_match", "wm2real_gap")
  fig, axes = plt.subplots(len(shown), len(splits), figsize=(4 * len(splits), 3.2 * len(shown)), squeeze=False)
  for i, metric in enumerate(shown):
    for j, split in enumerate(splits):
      ax = axes[i][j]
      rows = [next(r for r in result["rows"] if r["method"] == m and r["split"] == split) for m in methods]
      mean = np.array([r[metric]["mean"] for r in rows], np.float64) * 100
      err = np.array([[r[metric]["mean"] - r[metric]["lo"], r[metric]["hi"] - r[metric]["mean"]] for r in rows]).T
      ax.bar(range(len(rows)), np.nan_to_num(mean), yerr=np.nan_to_num(err * 100), capsize=3, color="tab:blue")
      ax.set_xticks(range(len(rows)), [LABELS[m] for m in methods], rotation=35, ha="right", fontsize=7)
      ax.set_title(f"{split}: {METRICS[metric][2]} (%)", fontsize=8)
  fig.tight_layout()
  fig.savefig(out_dir / PNGS["bars"], dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 3.6))
  for method in (m for m in methods if m in RL_METHODS):
    curves = [[r for r in c["curve"] or [] if "reward/act/mean" in r] for c in result["cells"] if c["method"] == method]
    curves = [cv for cv in curves if cv]
    if not curves:
      continue
    steps = sorted({r["step"] for cv in curves for r in cv})
    ys = np.array(
      [[next((r["reward/act/mean"] for r in cv if r["step"] == s), np.nan) for s in steps] for cv in curves]
    )
    line = ax.plot(steps, np.nanmean(ys, axis=0), marker="o", label=f"{LABELS[method]} ({len(curves)} seeds)")[0]
    ax.fill_between(steps, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=line.get_color(), alpha=0.2)
  ax.set(xlabel="step (after the warm-up's)", ylabel="training reward, ACT", title="GRPO training reward per step")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out_dir / PNGS["curves"], dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  for (method, split, variant), rs in _grouped(r for r in result["test_time"] if r["variant"] != "off").items():
    off = [r for r in result["test_time"] if (r["method"], r["split"], r["variant"]) == (method, split, "off")]
    pts = [(r["N"], r["success"]) for r in off + rs if r["success"]["seeds"]]  # N = 0 on the same tasks
    if pts:
      ns, mean = [n for n, _ in pts], np.array([x["mean"] for _, x in pts]) * 100
      err = np.array([[x["mean"] - x["lo"], x["hi"] - x["mean"]] for _, x in pts]).T * 100
      ax.errorbar(ns, mean, yerr=err, marker="o", capsize=3, label=f"{LABELS[method]}, {variant} ({split})")
  ax.set(xlabel="N (0: rehearsal off)", ylabel="held-out success (%)", title="test-time private rehearsal and controls")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(out_dir / PNGS["test_time"], dpi=100)
  plt.close(fig)


def _grouped(rows) -> dict[tuple[str, str, str], list[Mapping[str, Any]]]:
  out: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
  for r in rows:
    out.setdefault((r["method"], r["split"], r["variant"]), []).append(r)
  return out


def write_results(args) -> dict[str, Any]:
  """Gathers the grid (`gather`) and writes ``--out-dir``/evidence.json and the PNGs; returns the JSON's content."""
  result = {"protocol": protocol(args), **gather(args)}
  methods, seeds = grid(args)
  result["protocol"].update(methods=methods, seeds=seeds, splits=list(args.splits))
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  common.write_json(out_dir / RESULTS_FILE, result)
  plot(result, out_dir)
  return result


# ---------------------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="the pipeline check: the tiny random model")
  parser.add_argument("--results-page", action="store_true", help="print the results section from --out-dir's JSON")
  parser.add_argument("--update-results-page", action="store_true", help="... written into docs/results.md")
  parser.add_argument("--workdir", default="/tmp/envace_evidence", help="checkpoints, one folder per cell")
  parser.add_argument("--chunks", default=str(CHUNKS_DIR), help="the evaluation's chunk files, one folder per cell")
  parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="evidence.json and the PNGs")
  parser.add_argument("--compile-cache", default=None, help="JAX compilation cache folder ('none': off)")
  for name, value in DEFAULTS["default"].items():
    parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None, help=f"default {value!r}")
  args, extra = parser.parse_known_args(argv)
  args.overrides, rest = common.split_overrides(extra)
  if rest:
    parser.error(f"unrecognized arguments: {' '.join(rest)} (config values: --config.KEY=VALUE)")
  for name, value in DEFAULTS["smoke" if args.smoke else "default"].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.methods, args.splits = common.parse_names(args.methods), common.parse_names(args.splits)
  args.test_time_methods = common.parse_names(args.test_time_methods)
  args.test_time_splits = common.parse_names(args.test_time_splits)
  for name in ("methods", "test_time_methods"):
    unknown = set(getattr(args, name)) - set(METHODS)
    if unknown:
      parser.error(f"--{name.replace('_', '-')}: unknown {sorted(unknown)}; valid: {', '.join(METHODS)}")
  args.seeds, args.ns = common.parse_ints(args.seeds), common.parse_ints(args.ns)
  if any(n < 1 for n in args.ns):
    parser.error(f"--ns={args.ns}: every N must be >= 1 (N = 0, rehearsal off, is the success evaluation)")
  return args


def main(argv: Sequence[str]) -> dict[str, Any]:
  """Trains and evaluates the cells asked for (seed-major: each seed's warm-up is trained once and then shared), then
  runs the test-time part of the test-time methods' cells, rewriting evidence.json and the PNGs after each cell;
  prints the tables. ``--results-page``: the section only.

  Returns:
    evidence.json's content.
  """
  args = parse_args(argv)
  out_dir = pathlib.Path(args.out_dir)
  if args.results_page or args.update_results_page:
    result = common.read_json(out_dir / RESULTS_FILE)
    section = results_section(result)
    print(section)
    if args.update_results_page:
      text = RESULTS_PAGE.read_text(encoding="utf-8")
      begin, end = text.index(RESULTS_BEGIN), text.index(RESULTS_END) + len(RESULTS_END)
      RESULTS_PAGE.write_text(text[:begin] + section + text[end:], encoding="utf-8")
    return result
  common.use_compilation_cache(args.compile_cache)
  common.quiet_libraries()
  if args.smoke:
    print("CAVEAT: --smoke runs the tiny random model: its numbers check the pipeline, not the method.", flush=True)
  start = time.perf_counter()
  for seed in args.seeds:  # claims 1-3 first, for every seed; test time (the costliest part per cell) after
    for method in args.methods:
      evaluate_cell(args, method, seed)
      write_results(args)
  for seed in args.seeds:
    for method in (m for m in args.methods if m in args.test_time_methods):
      evaluate_cell(args, method, seed, test_time=True)
      write_results(args)
  result = write_results(args)
  for split in [*args.splits, "pooled"]:
    print(f"\n{split}\n{table(result, split)}")
  print("\n" + claims_table(result))
  if result["test_time"]:
    print("\n" + test_time_table(result))
  if result["missing"]:
    print(f"not finished: {len(result['missing'])} (cell, split) parts")
  print(f"saved {out_dir / RESULTS_FILE} and {', '.join(PNGS.values())}; {time.perf_counter() - start:.0f} s")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
