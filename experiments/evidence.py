"""Evidence at a scale a 2-core CPU affords: does world rehearsal train a better agent on tasks it never trained on?

    python experiments/evidence.py                        # the default grid, run (or resumed) in full
    python experiments/evidence.py --methods=base,warmup  # only these methods' cells (a session's share)
    python experiments/evidence.py --methods=             # run nothing: gather the finished cells, write the JSON
    python experiments/evidence.py --smoke --workdir=DIR  # pipeline check: the tiny model on τ² mock, ≈1 min
    python experiments/evidence.py --results-page         # docs/results.md's results section, from the committed JSON
    python experiments/evidence.py --update-results-page  # ... written into docs/results.md between its markers
    python experiments/evidence.py --full --model-path=/path/to/Qwen3-8B --workdir=/ckpt/evidence   # paper sizes

Protocol. SmolLM2-135M-Instruct on τ²-bench mock with held-out tasks, as τ²'s airline and retail train/test splits hold
out tasks, not tools: trained on one task of each template (``create_task_1``, ``create_task_1_with_env_assertions``,
``update_task_1``, ``impossible_task_1``), judged only on the four tasks that continue a logged conversation about
``task_2`` and ask to mark it completed (``update_task_with_*``; configs/tau2.py's ``MOCK_TRAIN_IDS`` /
``MOCK_HELDOUT_IDS``). Their openings, initial states and gold calls (``update_task_status`` on ``task_2``) never occur
in training; the JSON lists both id sets and a test checks they are disjoint. (An earlier grid held out every "update a
task" task, so their tool was never seen called: the warm-up alone took held-out gold-call JSON validity from 0.75 to
0.25 and no method could earn a held-out reward, so the other three claims could not be tested.)

Why mock and not airline, retail or BFCL: measured on this 2-core machine (``--domain=airline --train-split=train
--eval-split=test --train-ids= --heldout=1``, the base policy), one held-out airline task costs 195 s of committed
execution and 165 s for REHEARSE on its 4 gold calls, and its reward-gap rollout ran for over 8 minutes; the default
grid (18 cells, 3 seeds) would need well over 8 CPU-hours for its evaluations alone. Worse, airline's tool responses
are 650-1300 characters of JSON (≈ 250-500 SmolLM2 tokens), so at the 96 new tokens a CPU step affords every
rehearsed response is truncated and fidelity cannot move. BFCL's multi-turn views are as long as airline's (median
5.3k SmolLM2 tokens vs 4.9k) and have no official split. Mock's system prompt is ≈0.5k tokens and its responses are
short records, so the grid fits the budget with 3 seeds per method. ``--domain=airline --train-split=train
--eval-split=test --train-ids= --heldout=4`` runs the airline protocol (its own test split held out) where compute
allows.

Methods (one config each; everything else, seeds included, is shared, except where said):
  base             the initial weights, no training;
  warmup           the supervised warm-up alone (``train.sft_warmup_steps``: the reference conversations of the train
                   split's tasks, gold calls for ACT and the real tools' responses for REHEARSE), one pass over the four
                   training tasks;
  warmup_grounded  the same warm-up with REHEARSE's grounding (the task's reference interactions in its view,
                   ``rollout.grounding_max_tokens``, as the paper trains it; the defaults' 1024 tokens);
  envace           the warm-up, then world-rehearsal GRPO (``grpo.mode=envace``: REHEARSE answers every tool call);
  grpo_real_env    plain GRPO against the real tools, ACT trained only, in the warm-up too (``grpo.trained_roles``
                   holds for every step): REHEARSE's weights, shared with ACT, are never trained for it;
  per_role         the warm-up, then EnvACE, with separate ACT and REHEARSE parameters from the start (so its
                   warm-up ends elsewhere than ``warmup``'s).
Every method but ``warmup_grounded`` trains REHEARSE without grounding (``--grounding=0``), the view it has when it
rehearses a held-out task, which has no reference interactions. A τ² task's reference interactions are its gold calls
executed for real, so a grounded REHEARSE is trained to copy the response from its context; measured on one seed
before this grid, after the same four warm-up steps REHEARSE then wrote invalid JSON for all 3 held-out gold calls
(the call's arguments with a stray brace), where without grounding all 3 were valid with key F1 0.95 (base: valid,
key F1 0.36). ``warmup_grounded`` keeps that contrast in the grid.
GRPO steps use dynamic sampling (``grpo.dynamic_sampling``): a group whose rollouts all got one reward is replaced by
another task's group, up to ``--max-draws`` extra batches per step; the fraction of groups without signal is reported.
The user's first message is the task's scenario (``rollout.scenario_opening``, in training and evaluation): SmolLM2 as
the user simulator rarely states the request (experiments/learning_check.py).

Each cell (method, seed) trains with ``train.train_and_evaluate`` into ``--workdir/METHOD/seedS`` (a killed run
resumes from its checkpoint) and is evaluated with ``heldout.evaluate_policy``: committed execution on the held-out
tasks against the real tools and τ²'s evaluator (reward, pass^1, tool-call validity), REHEARSE's fidelity on the
held-out gold calls (``fidelity_gold/*``) and on the committed runs' real calls, and the rehearsal-vs-real reward gap
(the committed runs' messages and rewards go to ``heldout_transcripts.json`` there, for reading). The same
evaluation key per seed for every method, so all methods meet the same openings. Every cell asked for is
trained and evaluated first; then the cells of ``--test-time-methods`` run private rehearsal for every N of ``--ns``
(N > 0) in both modes, before the same committed execution (N = 0 is the plain evaluation). A cell's record is
``cell.json`` in its workdir, rewritten as each test-time row is added, so a killed run loses at most one
evaluation. ``--out-dir/evidence.json`` is rewritten after every cell and row and holds every record, so it is also
where a later session resumes from when the workdir is gone (the committed file: its cells are read back, and a
trained cell that still lacks test-time rows is trained again first, deterministically, from its config).

Output: the tables (mean ± sample std over seeds, n = seeds), ``--out-dir/evidence.json`` (every cell, the protocol, the
aggregate rows, which cells of the grid are still missing) and three PNGs there (held-out metrics per method with error
bars; learning curves: training reward per role per step, held-out gold-call fidelity and reward at base / after the
warm-up / after GRPO; test-time pass^1 and cost vs N). ``--results-page`` prints docs/results.md's results section
from that JSON (a test checks that the page holds exactly it). ``--smoke`` is the pipeline check the tests run (the
tiny random model on τ² mock, whose one split is cut into train and held-out ids here; the base and EnvACE cells: its
numbers say nothing about the method). ``--full`` takes the paper's sizes (the ``paper`` preset,
``configs/tau2.py:<domain>+paper``: Qwen3-8B computing in bfloat16, B=16 × G=4, lr 1e-6, 30 turns, 8000-token
generations, the official semantics) for an accelerator, in place of ``--tasks``, ``--group``, ``--lr``,
``--max-turns`` and ``--max-new-tokens``; ``--steps``, ``--heldout`` and the rest still apply, and any config value
can be set as for ``python -m envace_jax.main`` (``--config.KEY=VALUE``, e.g. ``grpo.micro_batch_size`` for the
accelerator's memory).

Budget: the default grid is sized for about 8 CPU-hours on 2 cores, run in parts (``--methods``, ``--seeds``) across
sessions.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import pathlib
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/evidence.py` puts experiments/ first on the path, not the root
  sys.path.insert(0, str(ROOT))

from experiments import common  # noqa: E402

RESULTS_DIR = ROOT / "experiments" / "results"
RESULTS_FILE = "evidence.json"
PNGS = {"ablation": "evidence_ablation.png", "curves": "evidence_curves.png", "test_time": "evidence_test_time.png"}
CELL_FILE = "cell.json"
TRANSCRIPTS_FILE = "heldout_transcripts.json"  # the committed executions of the evaluation, for reading
RESULTS_PAGE = ROOT / "docs" / "results.md"  # the results section's page (README.md summarises it)
RESULTS_BEGIN, RESULTS_END = "<!-- evidence.py --results-page: begin -->", "<!-- evidence.py --results-page: end -->"

METHODS = ("base", "warmup", "warmup_grounded", "envace", "grpo_real_env", "per_role")
WARMUP_ONLY = ("warmup", "warmup_grounded")
LABELS = {
  "base": "base policy",
  "warmup": "warm-up only",
  "warmup_grounded": "warm-up only, grounded REHEARSE",
  "envace": "EnvACE",
  "grpo_real_env": "GRPO (real env)",
  "per_role": "per-role",
}
PAPER_TAU2_AVG = {"envace": 36.7, "grpo_real_env": 31.2, "per_role": 35.5}  # Qwen3-8B, τ² pass^1 (%), the paper's
MODES = ("parallel", "sequential")

# The evaluation numbers a cell keeps (heldout.evaluate_policy's keys) and the table's columns.
KEPT = (
  "reward",
  "pass^1",
  "tool_call_validity",
  "tool_calls",
  "act_rehearse_format",
  "reward/invalid",
  "reward/scoring_errors",
  "fidelity_gold/calls",
  "fidelity_gold/json_valid",
  "fidelity_gold/key_f1",
  "fidelity_gold/value_accuracy",
  "fidelity_gold/error_agreement",
  "fidelity/calls",
  "fidelity/json_valid",
  "gap/rehearsed_reward",
  "gap/real_reward",
  "gap/gap",
)
COLUMNS = {  # JSON key -> table header
  "fidelity_gold/json_valid": "fidelity: JSON valid",
  "fidelity_gold/key_f1": "fidelity: key F1",
  "reward": "reward",
  "pass^1": "pass^1",
  "tool_call_validity": "tool-call validity",
  "tool_calls": "tool calls per trial",  # validity counts replies as well-formed: 1.0 with no call at all
  "act_rehearse_format": "ACT turns in REHEARSE's format",  # the agent writing a <tool_response> block
  "gap/gap": "reward gap",
}
# The curves PNG's held-out panels: base -> warm-up -> GRPO.
STAGE_KEYS = {"fidelity_gold/key_f1": "gold-call fidelity (key F1)", "reward": "reward"}
# Per GRPO step, from metrics.jsonl: the learning curves and the fraction of groups without signal.
CURVE_KEYS = ("reward/mean", "reward/act/mean", "reward/rehearse/mean", "sft/nll", "rollout/groups_without_signal")

_MAIN_JOB = common.config_file("tau2", "mock_heldout")  # configs/tau2.py's MOCK_TRAIN_IDS / MOCK_HELDOUT_IDS
# The default grid (SmolLM2 on mock, split by template) and the smoke run (tiny on mock). ``train_ids``: the train
# split's task ids used ("" = all of it); ``heldout``: how many test tasks (the first ones), or the ids themselves.
DEFAULTS: dict[str, dict[str, Any]] = {
  "default": dict(
    model="smollm2", domain="mock", train_split="base", eval_split="base",
    train_ids=_MAIN_JOB.env.train_task_ids, heldout=_MAIN_JOB.env.eval_task_ids,  # the main job's template split
    methods=",".join(METHODS), seeds="0,1,2", sft_steps=4, steps=4, tasks=1, group=4, lr=2e-5, sft_lr=1e-4,
    max_draws=1, trials=1, test_time_methods="base,envace", ns="0,2", max_turns=3, max_new_tokens=96, grounding=0,
  ),
  "smoke": dict(
    model="tiny", domain="mock", train_split="base", eval_split="base",
    train_ids="create_task_1,update_task_1,impossible_task_1", heldout="update_task_with_initialization_data",
    methods="base,envace", seeds="0", sft_steps=1, steps=1, tasks=1, group=2, lr=1e-5, sft_lr=1e-4,
    max_draws=1, trials=1, test_time_methods="envace", ns="0,1", max_turns=2, max_new_tokens=16, grounding=0,
  ),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Cells


def cell_config(args, method: str, seed: int):
  """The run config of one cell: the model's τ² config, the protocol's splits and ids, the budget, the method."""
  c = common.make_config(args.model, args.domain, seed, args.data_dir, full=args.full, model_path=args.model_path)
  c.env.split, c.env.eval_split = args.train_split, args.eval_split
  c.env.train_task_ids = args.train_ids
  c.env.eval_task_ids = args.heldout if isinstance(args.heldout, str) else ""
  trained = method not in ("base", *WARMUP_ONLY)
  c.train.sft_warmup_steps = 0 if method == "base" else args.sft_steps
  c.train.steps = c.train.sft_warmup_steps + (args.steps if trained else 0)
  if not args.full:  # --full keeps the paper preset's B, G and learning rate
    c.train.tasks_per_step, c.train.group_size, c.grpo.learning_rate = args.tasks, args.group, args.lr
  c.train.checkpoint_every = 1
  c.train.keep_checkpoints = 1
  c.train.eval_every = 0
  c.train.eval_tasks = 0  # evaluated below, the same way for every method
  c.grpo.sft_learning_rate = args.sft_lr
  c.grpo.dynamic_sampling = True
  c.grpo.dynamic_sampling_max_draws = args.max_draws
  c.rollout.scenario_opening = True
  if method != "warmup_grounded":  # it keeps the defaults' grounding, as the paper trains REHEARSE
    c.rollout.grounding_max_tokens = args.grounding
  if not args.full:  # --full keeps the paper preset's turns and 8000-token generations
    c.rollout.max_turns = args.max_turns
    for role in ("act", "rehearse", "user"):
      c.rollout[f"{role}_max_new_tokens"] = args.max_new_tokens
  c.eval.tasks = -1 if isinstance(args.heldout, str) else args.heldout
  c.eval.num_trials = args.trials
  c.eval.fidelity = c.eval.fidelity_gold = c.eval.reward_gap = True
  if trained:
    common.apply_overrides(c, common.TRAINING_MODES[method])
  elif method in WARMUP_ONLY:  # the warm-up trains both roles of the one policy, as EnvACE's does
    c.grpo.mode = "envace"
  common.apply_flags(c, args.overrides)
  return c


_EVALUATION_KEYS = ("full", "model", "domain", "eval_split", "heldout", "trials", "max_turns", "max_new_tokens")
_WARMUP_KEYS = ("train_split", "train_ids", "sft_steps", "sft_lr", "tasks", "grounding")
_RL_KEYS = ("steps", "group", "lr", "max_draws")


def budget(args, method: str | None = None) -> dict[str, Any]:
  """What must match for a saved cell of ``method`` to be reused: the settings it depends on (the base policy's
  cell only on the evaluation's, the warm-up's also on the warm-up's); ``None``: every setting (the protocol)."""
  keys = _EVALUATION_KEYS
  if method != "base":
    keys += _WARMUP_KEYS
  if method not in ("base", *WARMUP_ONLY):
    keys += _RL_KEYS
  return {**{k: getattr(args, k) for k in keys}, "overrides": [list(o) for o in args.overrides]}


def _curve(workdir: pathlib.Path) -> list[dict[str, float]]:
  from envace_jax import metrics

  rows = metrics.read_jsonl(workdir) if (workdir / "metrics.jsonl").exists() else []
  return [{"step": r["step"], **{k: r[k] for k in CURVE_KEYS if k in r}} for r in rows]


def cell_dir(args, method: str, seed: int) -> pathlib.Path:
  return pathlib.Path(args.workdir) / method / f"seed{seed}"


def committed_cells(args, out_dir: pathlib.Path) -> dict[tuple[str, int], dict[str, Any]]:
  """The cells of ``out_dir/evidence.json`` (the committed results) made with this run's budget, by (method, seed):
  a session whose workdir is gone resumes the grid from them."""
  path = out_dir / RESULTS_FILE
  cells = common.read_json(path).get("cells", []) if path.exists() else []
  return {
    (c["method"], c["seed"]): c
    for c in cells
    if c["method"] in METHODS and not common.budget_mismatch(c["budget"], budget(args, c["method"]))
  }


def run_cell(args, method: str, seed: int, committed: Mapping[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
  """Trains (unless ``base``) and evaluates one cell on the held-out tasks into ``cell_dir/cell.json``, or reads its
  record back (the workdir's, else the committed one, which is copied there). Raises SystemExit for a workdir cell
  made with another budget."""
  from envace_jax import train

  workdir = cell_dir(args, method, seed)
  path = workdir / CELL_FILE
  cell = _saved(args, path, method) if path.exists() else committed.get((method, seed))
  if cell is not None:
    print(f"{method} seed {seed}: saved", flush=True)
    if not path.exists():
      common.write_json(path, cell)
    return cell
  config = cell_config(args, method, seed)
  start = time.perf_counter()
  print(f"{method} seed {seed}: {config.train.steps} training steps, then the held-out evaluation", flush=True)
  if config.train.steps:
    train.train_and_evaluate(config, str(workdir))
  cell = _evaluate(args, config, method, seed, workdir, train_s=time.perf_counter() - start)
  common.write_json(path, cell)
  return cell


def _evaluate(args, config, method: str, seed: int, workdir: pathlib.Path, train_s: float) -> dict[str, Any]:
  """The cell's held-out evaluation (``heldout.evaluate_policy`` with the seed's evaluation key, the same openings
  for every method) as its record, printed in one line."""
  from envace_jax import evaluate, heldout

  tasks = evaluate.eval_tasks(config)
  model, samplers, step = evaluate.load_policy(config, str(workdir), len(tasks) * args.trials)
  start = time.perf_counter()
  summary, run = heldout.evaluate_policy(
    config, tasks, samplers, model.tokenizer, evaluate.eval_key(seed), num_trials=args.trials
  )
  common.write_json(workdir / TRANSCRIPTS_FILE, [_transcript(t) for t in run.committed])
  cell = {
    "method": method,
    "seed": seed,
    "checkpoint_step": step,
    "heldout_task_ids": [t.id for t in tasks],
    "eval": {k: float(summary[k]) for k in KEPT if k in summary},
    "eval_seconds": {  # per phase: opening, execution, fidelity, fidelity_gold, gap, ...
      k.removeprefix("cost/").removesuffix("/seconds"): float(v)
      for k, v in summary.items()
      if k.startswith("cost/") and k.endswith("/seconds")
    },
    "curve": _curve(workdir),
    "train_s": train_s,
    "eval_s": time.perf_counter() - start,
    "budget": budget(args, method),
  }
  ev = cell["eval"]
  print(
    f"{method} seed {seed}: held-out reward {ev['reward']:.3f}, pass^1 {ev['pass^1']:.3f}, gold-call fidelity "
    f"(JSON valid) {ev.get('fidelity_gold/json_valid', math.nan):.3f}; train {train_s:.0f} s, evaluation "
    f"{cell['eval_s']:.0f} s",
    flush=True,
  )
  return cell


def _transcript(traj) -> dict[str, Any]:
  reward = traj.reward
  return {
    "task": traj.task.id,
    "trial": traj.sample,
    "reward": None if reward is None or not reward.valid else reward.reward,
    "messages": [m.to_dict() for m in traj.messages],
  }


def _saved(args, path: pathlib.Path, method: str) -> dict[str, Any]:
  """The cell saved at ``path``. Raises SystemExit for one made with another budget."""
  cell = common.read_json(path)
  stale = common.budget_mismatch(cell["budget"], budget(args, method))
  if stale:
    raise SystemExit(f"{path} was made with another budget ({'; '.join(stale)}); use a fresh --workdir")
  return cell


def test_time_wanted(args) -> list[tuple[str, int]]:
  """The (mode, N) rows of a test-time grid: N = 0 (the plain evaluation) and every N of ``--ns``, in both modes."""
  return [(mode, n) for mode in MODES for n in sorted({0, *args.ns})]


def run_test_time(args, method: str, seed: int, on_row) -> dict[str, Any]:
  """The test-time grid of a cell made by `run_cell`: rows {mode, N, pass^1, reward, rehearsal_tokens (generated by
  rehearsals, assessments and the memory, per task and trial), seconds}, each added to the cell's ``cell.json`` as it
  is made (then ``on_row()``), so a rerun makes only the missing ones. N = 0 is the cell's evaluation; N > 0 runs
  private rehearsal (``eval.rehearsal_n`` = N) before the same committed execution, with the same key.

  A trained cell whose checkpoint is not in its workdir (its record came from the committed JSON) is trained again
  first, as its config says (the record says so: ``retrained_for_test_time``)."""
  from envace_jax import evaluate, heldout, train

  workdir = cell_dir(args, method, seed)
  cell = common.read_json(workdir / CELL_FILE)
  rows = {(r["mode"], r["N"]): r for r in cell.get("test_time", [])}
  todo = [w for w in test_time_wanted(args) if w not in rows]
  if not todo:
    return cell
  config = cell_config(args, method, seed)
  tasks = evaluate.eval_tasks(config)
  items = len(tasks) * args.trials
  model = samplers = None
  for mode, n in todo:
    if n == 0:
      ev = cell["eval"]
      row = {"mode": mode, "N": 0, "pass^1": ev["pass^1"], "reward": ev["reward"], "rehearsal_tokens": 0.0}
    else:
      if samplers is None:
        model, samplers, step = evaluate.load_policy(config, str(workdir), items)
        if step != cell["checkpoint_step"]:
          print(
            f"{method} seed {seed}: no checkpoint of step {cell['checkpoint_step']} here; training again", flush=True
          )
          train.train_and_evaluate(config, str(workdir))
          model, samplers, _ = evaluate.load_policy(config, str(workdir), items)
          cell["retrained_for_test_time"] = True
      c = copy.deepcopy(config)
      c.eval.rehearsal_n = n
      start = time.perf_counter()
      summary, _ = heldout.evaluate_policy(
        c, tasks, samplers, model.tokenizer, evaluate.eval_key(seed), mode=mode, num_trials=args.trials,
        fidelity=False, gap=False, gold=False,
      )  # fmt: skip
      tokens = sum(summary.get(f"cost/{p}/generated_tokens", 0.0) for p in ("rehearsal", "assessment", "memory"))
      row = {"mode": mode, "N": n, "pass^1": float(summary["pass^1"]), "reward": float(summary["reward"])}
      row.update(rehearsal_tokens=tokens / items, seconds=time.perf_counter() - start)
      print(f"{method} seed {seed}: test-time {mode} N={n}: pass^1 {row['pass^1']:.3f}, {row['seconds']:.0f} s",
            flush=True)  # fmt: skip
    rows[(mode, n)] = row
    cell["test_time"] = sorted(rows.values(), key=lambda r: (MODES.index(r["mode"]), r["N"]))
    common.write_json(workdir / CELL_FILE, cell)
    on_row()
  return cell


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation, tables, figures, the results page


def aggregate(cells: Sequence[Mapping[str, Any]], methods: Sequence[str]) -> list[dict[str, Any]]:
  """One row per method with cells: ``n`` seeds and (mean, sample std) over them of every kept evaluation number, and
  of the fraction of GRPO groups without signal (``rollout/groups_without_signal`` over the cell's RL steps)."""
  rows = []
  for method in methods:
    mine = [c for c in cells if c["method"] == method]
    if not mine:
      continue
    row: dict[str, Any] = {"method": method, "n": len(mine), "seeds": sorted(c["seed"] for c in mine)}
    for key in KEPT:
      row[key] = common.mean_std([c["eval"].get(key, math.nan) for c in mine])
    no_signal = [np.mean(v) for v in (_rl_values(c, "rollout/groups_without_signal") for c in mine) if v]
    row["groups_without_signal"] = common.mean_std(no_signal)
    rows.append(row)
  return rows


def _rl_values(cell: Mapping[str, Any], key: str) -> list[float]:
  """``key`` at each GRPO step of the cell's curve (the warm-up's steps have no rollout)."""
  return [r[key] for r in cell["curve"] if key in r and "sft/nll" not in r]


def aggregate_test_time(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """One row per (method, mode, N) over the cells with a test-time grid: n, pass^1 and rehearsal tokens (mean, std)."""
  groups: dict[tuple[str, str, int], list[Mapping[str, Any]]] = {}
  for c in cells:
    for r in c.get("test_time", []):
      groups.setdefault((c["method"], r["mode"], r["N"]), []).append(r)
  out = []
  for (method, mode, n), rs in sorted(groups.items(), key=lambda kv: (METHODS.index(kv[0][0]), *kv[0][1:])):
    out.append({
      "method": method, "mode": mode, "N": n, "n": len(rs),
      "pass^1": common.mean_std([r["pass^1"] for r in rs]), "reward": common.mean_std([r["reward"] for r in rs]),
      "rehearsal_tokens": common.mean_std([r["rehearsal_tokens"] for r in rs]),
    })  # fmt: skip
  return out


def _pm(value: Sequence[float], percent: bool) -> str:
  mean, std = value
  if not np.isfinite(mean):
    return "-"
  return common.pm(mean, std, 100.0, 1) if percent else common.pm(mean, std, 1.0, 3)


def evidence_table(result: Mapping[str, Any]) -> str:
  """The held-out table (markdown): one row per method, the paper's τ² average beside it."""
  head = ["method", "n", *COLUMNS.values(), "groups without signal", "paper τ² avg (Qwen3-8B)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in result["rows"]:
    cells = [LABELS[r["method"]], str(r["n"])]
    cells += [_pm(r[k], percent=k == "pass^1") for k in COLUMNS]
    cells.append(_pm(r["groups_without_signal"], percent=False))
    paper = PAPER_TAU2_AVG.get(r["method"])
    cells.append(f"{paper:.1f}" if paper is not None else "–")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def test_time_table(result: Mapping[str, Any]) -> str:
  """pass^1 (%) per (method, mode) and N (markdown), and the rehearsal tokens per task and trial."""
  ns = sorted({r["N"] for r in result["test_time"]})
  head = ["method", "mode", "n", *(f"N={n}" for n in ns), *(f"tokens N={n}" for n in ns if n)]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  keys = dict.fromkeys((r["method"], r["mode"]) for r in result["test_time"])
  for method, mode in keys:
    by_n = {r["N"]: r for r in result["test_time"] if (r["method"], r["mode"]) == (method, mode)}
    n = min(r["n"] for r in by_n.values())
    cells = [LABELS[method], mode, str(n)]
    cells += [_pm(by_n[k]["pass^1"], percent=True) if k in by_n else "-" for k in ns]
    cells += [f"{by_n[k]['rehearsal_tokens'][0]:.0f}" if k in by_n else "-" for k in ns if k]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def results_section(result: Mapping[str, Any]) -> str:
  """docs/results.md's results section, between the two markers, from ``evidence.json``'s content."""
  p = result["protocol"]
  done, grid = len(result["cells"]), len(result["cells"]) + len(result["missing"])
  grounding = f"with {p['grounding']} tokens of grounding" if p.get("grounding") else "without grounding"
  lines = [
    RESULTS_BEGIN,
    f"Held-out evidence (`python experiments/evidence.py`; {done} of {grid} cells of the grid done). "
    f"{p['model']} on τ² {p['domain']}: trained on {len(p['train_task_ids'])} tasks of the `{p['train_split']}` "
    f"split ({_ids(p['train_task_ids'])}), judged on {len(p['heldout_task_ids'])} tasks of `{p['eval_split']}` it "
    f"never trained on ({_ids(p['heldout_task_ids'])}; {p['trials']} trial{'s' if p['trials'] != 1 else ''} each), "
    f"mean ± std over seeds (n). Budget per trained cell: {p['sft_steps']} warm-up steps, "
    f"then {p['steps']} GRPO steps of B={p['tasks']} × G={p['group']} with dynamic sampling; REHEARSE trains "
    f"{grounding}, as it rehearses a held-out task, except in the grounded warm-up; GRPO (real env) trains ACT "
    "alone, in its warm-up too, so its REHEARSE (the shared weights) is never trained. Fidelity is REHEARSE's "
    "prediction of the real response to the held-out tasks' gold calls; pass^1 in %; tool-call validity: the "
    "fraction of ACT's generations that are well-formed (a parseable call or a plain reply); groups without signal: "
    "the fraction of a GRPO step's groups whose rollouts all got one reward (dynamic sampling replaces them).",
    "",
    evidence_table(result),
  ]
  if result["test_time"]:
    lines += ["", "Test-time private rehearsal on the same held-out tasks (pass^1 in %; N = 0: no rehearsal):", ""]
    lines.append(test_time_table(result))
  not_run = [*result["missing"], *result.get("missing_test_time", [])]
  if not_run:
    lines += ["", "Not run yet: " + ", ".join(not_run) + "."]
  lines += ["", *(f"![{name}](../experiments/results/{file})" for name, file in PNGS.items()), RESULTS_END]
  return "\n".join(lines)


def _ids(ids: Sequence[str], shown: int = 6) -> str:
  text = ", ".join(f"`{i}`" for i in ids[:shown])
  return text + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def plot(result: Mapping[str, Any], out_dir: pathlib.Path) -> None:
  """The three PNGs of ``PNGS`` in ``out_dir``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows, cells = result["rows"], result["cells"]
  fig, axes = plt.subplots(1, len(COLUMNS), figsize=(3.0 * len(COLUMNS), 3.6))
  for ax, (key, title) in zip(axes, COLUMNS.items(), strict=True):
    means = [r[key][0] for r in rows]
    stds = [r[key][1] for r in rows]
    ax.bar(range(len(rows)), np.nan_to_num(means), yerr=np.nan_to_num(stds), capsize=3, color="tab:blue")
    ax.set_xticks(range(len(rows)), [LABELS[r["method"]] for r in rows], rotation=40, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
  fig.suptitle(textwrap.fill(_title(result), 140), fontsize=8)
  fig.tight_layout()
  fig.savefig(out_dir / PNGS["ablation"], dpi=110)
  plt.close(fig)

  fig, (ax, *stage_axes) = plt.subplots(1, 3, figsize=(15, 3.8))
  for method in (m for m in METHODS if any(c["method"] == m for c in cells)):
    mine = [c for c in cells if c["method"] == method]
    for key, style in (("reward/act/mean", "-"), ("reward/rehearse/mean", "--")):
      steps = sorted({r["step"] for c in mine for r in c["curve"] if key in r})
      if steps:
        ys = [np.nanmean([r[key] for c in mine for r in c["curve"] if r["step"] == s and key in r]) for s in steps]
        ax.plot(steps, ys, style, marker="o", label=f"{LABELS[method]} {key.split('/')[1].upper()}")
  ax.set(xlabel="step", ylabel="training reward (rule checklist)", title="training reward per role, mean over seeds")
  _legend(ax)
  # Held-out numbers along a GRPO cell's path: the base weights, the warm-up it starts from, after its GRPO steps.
  # Only EnvACE starts from the ``warmup`` cell's weights (grpo_real_env warms up ACT alone, per_role two trees).
  for bx, (key, what) in zip(stage_axes, STAGE_KEYS.items(), strict=True):
    for method in ("envace", "grpo_real_env", "per_role"):
      path = ("base", "warmup", method) if method == "envace" else ("base", None, method)
      pts = [(stage, r) for stage, m in enumerate(path) for r in rows if r["method"] == m]
      if any(r["method"] == method for _, r in pts):
        mean_std = np.array([r[key] for _, r in pts], np.float64)  # [stages, (mean, std)]
        bx.errorbar([stage for stage, _ in pts], mean_std[:, 0], yerr=np.nan_to_num(mean_std[:, 1]), marker="o",
                    capsize=3, label=LABELS[method])  # fmt: skip
    bx.set_xticks([0, 1, 2], ["base", "after warm-up", "after GRPO"])
    bx.set(ylabel=f"held-out {what}", title=f"held-out {what}, mean ± std over seeds")
    _legend(bx)
  fig.tight_layout()
  fig.savefig(out_dir / PNGS["curves"], dpi=110)
  plt.close(fig)

  fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
  keys = dict.fromkeys((r["method"], r["mode"]) for r in result["test_time"])
  for method, mode in keys:
    rs = sorted((r for r in result["test_time"] if (r["method"], r["mode"]) == (method, mode)), key=lambda r: r["N"])
    label = f"{LABELS[method]}, {mode}"
    pass1 = np.array([r["pass^1"] for r in rs], np.float64)  # [N values, (mean, std)]
    ax.errorbar([r["N"] for r in rs], 100 * pass1[:, 0], yerr=100 * np.nan_to_num(pass1[:, 1]), marker="o", capsize=3,
                label=label)  # fmt: skip
    bx.plot([r["N"] for r in rs], [r["rehearsal_tokens"][0] for r in rs], marker="o", label=label)
  ax.set(xlabel="N rehearsals", ylabel="held-out pass^1 (%)", title="test-time private rehearsal")
  bx.set(xlabel="N rehearsals", ylabel="tokens per task and trial", title="rehearsal cost")
  for a in (ax, bx):
    _legend(a)
  fig.tight_layout()
  fig.savefig(out_dir / PNGS["test_time"], dpi=110)
  plt.close(fig)


def _legend(ax) -> None:
  if ax.get_legend_handles_labels()[0]:  # a partial grid may have nothing to label yet
    ax.legend(fontsize=7)


def _title(result: Mapping[str, Any]) -> str:
  p = result["protocol"]
  return (
    f"{p['model']} on τ² {p['domain']}, held-out {len(p['heldout_task_ids'])} tasks of {p['eval_split']} × "
    f"{p['trials']} trial; {p['sft_steps']} warm-up + {p['steps']} GRPO steps of B={p['tasks']} × G={p['group']}; "
    "mean ± std over seeds"
  )


# ---------------------------------------------------------------------------------------------------------------------
# Main


def protocol(args) -> dict[str, Any]:
  """The grid's definition, with the train and held-out task ids resolved from the prepared splits.

  Raises:
    SystemExit: a held-out id among the training ids (the protocol would not be held out).
  """
  from envace_jax import evaluate, runtime

  c = cell_config(args, "envace", args.seeds[0])
  source = runtime.training_tasks(c)
  train_ids = [source[i].id for i in range(len(source))]
  heldout_ids = [t.id for t in evaluate.eval_tasks(c)]
  overlap = sorted(set(train_ids) & set(heldout_ids))
  if overlap:
    raise SystemExit(f"held-out tasks {overlap} are also training tasks; change --heldout or --train-ids")
  return {
    **budget(args),
    "methods": list(args.methods),
    "seeds": list(args.seeds),
    "test_time_methods": list(args.test_time_methods),
    "ns": list(args.ns),
    "train_task_ids": train_ids,
    "heldout_task_ids": heldout_ids,
  }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="the pipeline check: tiny model on τ² mock")
  parser.add_argument("--full", action="store_true", help="the paper's sizes (Qwen3-8B; needs --model-path)")
  parser.add_argument("--model-path", default="", help="--full: local Hugging Face directory of Qwen3-8B")
  parser.add_argument("--results-page", action="store_true", help="print the results section from --out-dir's JSON")
  parser.add_argument(
    "--update-results-page", action="store_true", help="--results-page, written between docs/results.md's markers"
  )
  parser.add_argument("--workdir", default="/tmp/envace_evidence", help="one subfolder per cell; a rerun resumes")
  parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="evidence.json and the PNGs")
  parser.add_argument("--data-dir", default=common.DEFAULT_DATA_DIR)
  parser.add_argument(
    "--compile-cache",
    default=None,
    help="JAX compilation cache folder (default: the user's, envace_jax/compilation_cache.py; 'none': off)",
  )
  for name, value in DEFAULTS["default"].items():  # default None: filled from DEFAULTS below
    kind = str if name == "heldout" else type(value)  # heldout: a count of test tasks, or the ids themselves
    parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"default {value!r}")
  args, extra = parser.parse_known_args(argv)
  args.overrides, rest = common.split_overrides(extra)
  if rest:
    parser.error(f"unrecognized arguments: {' '.join(rest)} (config values: --config.KEY=VALUE)")
  if args.full and not args.model_path:
    parser.error("--full needs --model-path=/path/to/Qwen3-8B (a local Hugging Face directory)")
  for name, value in DEFAULTS["smoke" if args.smoke else "default"].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.model not in common.MODELS:
    parser.error(f"--model={args.model!r}: choose one of {', '.join(common.MODELS)} (or --full)")
  args.heldout = int(args.heldout) if str(args.heldout).lstrip("-").isdigit() else str(args.heldout)
  args.methods, args.test_time_methods = map(common.parse_names, (args.methods, args.test_time_methods))
  for name in ("methods", "test_time_methods"):
    unknown = set(getattr(args, name)) - set(METHODS)
    if unknown:
      parser.error(f"--{name.replace('_', '-')}: unknown {sorted(unknown)}; valid: {', '.join(METHODS)}")
  args.seeds, args.ns = common.parse_ints(args.seeds), common.parse_ints(args.ns)
  return args


def main(argv: Sequence[str]) -> dict[str, Any]:
  """Runs (or resumes) the cells asked for: first every cell's training and held-out evaluation (`run_cell`), then
  the test-time grids (`run_test_time`), rewriting ``--out-dir/evidence.json`` and the PNGs after every cell and row
  (`write_results`); then prints the tables. With ``--results-page``: prints the results section only.

  Returns:
    evidence.json's content (`write_results`).
  """
  args = parse_args(argv)
  out_dir = pathlib.Path(args.out_dir)
  if args.results_page or args.update_results_page:
    result = common.read_json(out_dir / RESULTS_FILE)
    section = results_section(result)
    print(section)
    if args.update_results_page:
      path = RESULTS_PAGE
      text = path.read_text(encoding="utf-8")
      begin, end = text.index(RESULTS_BEGIN), text.index(RESULTS_END) + len(RESULTS_END)
      path.write_text(text[:begin] + section + text[end:], encoding="utf-8")
    return result
  common.use_compilation_cache(args.compile_cache)
  common.quiet_libraries()
  if args.smoke:
    print(common.TINY_CAVEAT, flush=True)
  start = time.perf_counter()
  proto = protocol(args)
  committed = committed_cells(args, out_dir)
  save = functools.partial(write_results, args, proto, out_dir, committed)
  for seed in args.seeds:
    for method in args.methods:
      run_cell(args, method, seed, committed)
      save()
  for seed in args.seeds:
    for method in (m for m in args.methods if m in args.test_time_methods):
      run_test_time(args, method, seed, save)
  result = save()
  print()
  print(_title(result))
  print(evidence_table(result))
  if result["test_time"]:
    print(test_time_table(result))
  for key in ("missing", "missing_test_time"):
    if result[key]:
      print(f"not run yet: {', '.join(result[key])}")
  print(f"saved {out_dir / RESULTS_FILE} and {', '.join(PNGS.values())} there; {time.perf_counter() - start:.0f} s")
  return result


def write_results(args, proto, out_dir: pathlib.Path, committed) -> dict[str, Any]:
  """Gathers every finished cell of the whole grid (`grid`; other sessions' parts included: a cell's workdir record,
  else its committed one) and writes ``out_dir/evidence.json`` and the PNGs.

  Returns:
    {"protocol", "cells" (grid order), "rows" (`aggregate`), "test_time" (`aggregate_test_time`), "missing": the
    grid's cells not made yet ("METHOD/seedS"), "missing_test_time": its test-time rows not made yet ("METHOD/seedS
    MODE N=n")}.
  """
  methods, seeds, test_time_methods = grid(args)
  cells, missing, missing_rows = [], [], []
  for seed in seeds:
    for method in methods:
      path = cell_dir(args, method, seed) / CELL_FILE
      cell = common.read_json(path) if path.exists() else committed.get((method, seed))
      if cell is None or common.budget_mismatch(cell["budget"], budget(args, method)):
        missing.append(f"{method}/seed{seed}")
        continue
      cells.append(cell)
      if method in test_time_methods:
        made = {(r["mode"], r["N"]) for r in cell.get("test_time", [])}
        missing_rows += [f"{method}/seed{seed} {m} N={n}" for m, n in test_time_wanted(args) if (m, n) not in made]
  cells.sort(key=lambda c: (METHODS.index(c["method"]), c["seed"]))
  result = {
    "protocol": {**proto, "methods": methods, "seeds": seeds, "test_time_methods": test_time_methods},
    "cells": cells,
    "rows": aggregate(cells, methods),
    "test_time": aggregate_test_time(cells),
    "missing": missing,
    "missing_test_time": missing_rows,
  }
  out_dir.mkdir(parents=True, exist_ok=True)
  common.write_json(out_dir / RESULTS_FILE, result)
  plot(result, out_dir)
  return result


def grid(args) -> tuple[list[str], list[int], list[str]]:
  """The grid's methods and its test-time methods (in ``METHODS`` order), and its seeds: the defaults' (the smoke
  run's with ``--smoke``) and any other asked for."""
  defaults = DEFAULTS["smoke" if args.smoke else "default"]
  methods = set(common.parse_names(defaults["methods"])) | set(args.methods)
  seeds = set(common.parse_ints(defaults["seeds"])) | set(args.seeds)
  test_time = set(common.parse_names(defaults["test_time_methods"])) | set(args.test_time_methods)
  return [m for m in METHODS if m in methods], sorted(seeds), [m for m in METHODS if m in test_time & methods]


if __name__ == "__main__":
  main(sys.argv[1:])
