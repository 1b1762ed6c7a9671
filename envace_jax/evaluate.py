"""Evaluation on the real environments: private rehearsal, committed execution, pass^k, world-model fidelity.

    python -m envace_jax.main --config=configs/tau2.py --mode=eval --workdir=DIR

``--mode=eval`` (`run`) loads the latest checkpoint in DIR (or the base weights when there is none) and evaluates
``eval.tasks`` tasks of ``env.eval_split``, ``eval.num_trials`` trials each, once per test-time rehearsal mode in
``eval.rehearsal`` ("off", "parallel", "sequential"; N = ``eval.rehearsal_n``; `rehearsal.private`). Every trial ends
with one committed execution against the benchmark's real tools (each trial a fresh ``ToolEnv``), scored by the
benchmark's own evaluator (τ²: ``evaluate_simulation``; BFCL: its multi-turn checker). Printed as a table and written
to ``DIR/eval_results.json``.

Training runs call `committed_execution` (rehearsal off) at the end and every ``train.eval_every`` steps.

Measured alongside (issue "world-model fidelity"), each a config switch:
  * ``eval.fidelity``: for every real tool call of the committed executions, REHEARSE's prediction of the response
    vs the real one (`rehearsal.fidelity`: JSON validity, exact match, key-set F1, value accuracy, error agreement);
  * ``eval.reward_gap``: one rehearsed trajectory per (task, trial), as training rolls them out, scored by the rule
    checklist, vs the benchmark's reward for executing the same ACT decisions (its tool calls and replies) for real
    (`replay_for_real`). ``gap = rehearsed - real``: how much the imagined world flatters the policy.

pass^k is τ²-bench's: per task with c successes (reward 1) in n trials, C(c, k) / C(n, k), averaged over tasks.

Costs are wall seconds and tokens per phase; seconds include JIT compilation the first time a shape is seen, so the
first mode of ``eval.rehearsal`` pays most of it (compare tokens across modes, or seconds from a second run).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from envace_jax import config_check, metrics, runtime, scoring
from envace_jax.envs.base import ChatMessage, Task, ToolEnv
from envace_jax.model import transformer
from envace_jax.model.roles import Role
from envace_jax.rehearsal import fidelity as fidelity_lib
from envace_jax.rehearsal import private
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rehearsal.trajectory import Trajectory
from envace_jax.rehearsal.unfold import unfold

RESULTS_FILE = "eval_results.json"


def pass_hat_k(successes: Sequence[int], trials: int, k: int) -> float:
  """τ²-bench's pass^k: mean over tasks of C(c, k) / C(n, k) (c successes of n trials).

  Raises:
    ValueError: k outside 1..n, or a success count outside 0..n.
  """
  if not 1 <= k <= trials:
    raise ValueError(f"pass^k needs 1 <= k <= n trials; got k={k}, n={trials}")
  if any(not 0 <= c <= trials for c in successes):
    raise ValueError(f"success counts must lie in 0..{trials}, got {list(successes)}")
  return float(np.mean([math.comb(c, k) / math.comb(trials, k) for c in successes])) if successes else float("nan")


def replay_for_real(task: Task, messages: Sequence[ChatMessage], env: ToolEnv) -> list[ChatMessage]:
  """The same ACT decisions executed for real: ``env`` is reset with ``task``; every tool call of the assistant
  messages runs on it, in order, and its real result replaces the rehearsed one (a call the rehearsal left
  unanswered runs too); user and assistant messages are kept as they were.

  Returns:
    the conversation with real tool results, for the benchmark's evaluator.
  """
  env.reset(task)
  out: list[ChatMessage] = []
  for m in messages:
    if m.role == "tool":
      continue
    out.append(m)
    out += [env.answer(call) for call in (m.tool_calls if m.role == "assistant" else ())]
  return out


def reward_gap(config, tasks: Sequence[Task], trajectories: Sequence[Trajectory]) -> dict[str, float]:
  """Rule-checklist reward of rehearsed trajectories vs the benchmark reward of replaying them for real.

  Args:
    tasks: the original task of each trajectory (with its gold actions).
    trajectories: rehearsed trajectories.
  Returns:
    {"gap/rehearsed_reward", "gap/real_reward", "gap/gap" (rehearsed - real): means over the trajectories both
    scorers accepted, "gap/trajectories": how many those are, "gap/invalid": how many either scorer could not score
    (`scoring.score`), "gap/scoring_errors": how many of those a scorer failed on}.
  """
  rehearsed, real, invalid, errors = [], [], 0, 0
  for task, traj in zip(tasks, trajectories, strict=True):
    r = scoring.score(config, traj, task=task)
    env = scoring.make_env(config, task)
    replayed = Trajectory(task, traj.group, traj.sample, replay_for_real(task, traj.messages, env))
    q = scoring.score(config, replayed, env=env)
    errors += bool(traj.counts.get(scoring.SCORING_ERROR) or replayed.counts.get(scoring.SCORING_ERROR))
    if r.valid and q.valid:
      rehearsed.append(r.reward)
      real.append(q.reward)
    else:
      invalid += 1
  mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
  return {
    "gap/rehearsed_reward": mean(rehearsed),
    "gap/real_reward": mean(real),
    "gap/gap": mean(rehearsed) - mean(real),
    "gap/trajectories": float(len(real)),
    "gap/invalid": float(invalid),
    "gap/scoring_errors": float(errors),
  }


def is_success(reward: float) -> bool:
  """τ²-bench's success of one trial (``tau2.metrics.agent_metrics.is_successful``): |reward - 1| <= 1e-6."""
  return 1.0 - 1e-6 <= reward <= 1.0 + 1e-6


def score_committed(
  config, trajectories: Sequence[Trajectory], envs: Sequence[ToolEnv], num_tasks: int, num_trials: int
) -> dict[str, float]:
  """Scores committed executions (task-major, ``num_trials`` per task) with each one's environment's evaluator
  (`scoring.score`); sets each trajectory's ``reward``.

  An invalid trial (its scorer failed, or the external user did) is left out of the mean reward and counts as a
  failed trial in pass^k: a task's c counts its successful trials (`is_success`) out of all ``num_trials``.

  Returns:
    {"reward": mean reward of the valid trials (NaN when none is), "pass^1".."pass^n", "tasks", "trials",
    "reward/invalid", "reward/scoring_errors" (`scoring.counts`), "turns", "tool_calls" (means per trial),
    "tool_call_validity" (`scoring.tool_call_validity`), "act_rehearse_format" (`scoring.act_in_rehearse_format`)}.
  """
  rewards_ = []
  successes = [0] * num_tasks
  for i, traj in enumerate(trajectories):
    traj.reward = scoring.score(config, traj, env=envs[i])
    if traj.reward.valid:
      rewards_.append(traj.reward.reward)
      successes[i // num_trials] += int(is_success(traj.reward.reward))
  summary = {
    "reward": float(np.mean(rewards_)) if rewards_ else float("nan"),
    "tasks": float(num_tasks),
    "trials": float(num_trials),
    **scoring.counts(trajectories),
    "turns": float(np.mean([t.counts.get("generations_act", 0) for t in trajectories])),
    "tool_calls": float(np.mean([t.counts.get("tool_calls", 0) for t in trajectories])),
    "tool_call_validity": scoring.tool_call_validity(trajectories),
    "act_rehearse_format": scoring.act_in_rehearse_format(trajectories),
  }
  for k in range(1, num_trials + 1):
    summary[f"pass^{k}"] = pass_hat_k(successes, num_trials, k)
  return summary


def _sampler_for(policy, role: Role):
  return policy[role] if isinstance(policy, Mapping) else policy


def policy_of(samplers: Mapping[str, Any]):
  """What the rollout samples the policy with: ``samplers["policy"]``, or per role when ``"rehearse"`` has its own
  parameters (the per_role ablation; the ACT tree plays a policy user)."""
  if "rehearse" not in samplers:
    return samplers["policy"]
  act = samplers["policy"]
  return {Role.ACT: act, Role.REHEARSE: samplers["rehearse"], Role.USER: act}


def rehearsal_config(config, mode: str) -> private.PrivateRehearsalConfig:
  """``config.eval``'s private-rehearsal settings with ``mode``."""
  e = config.eval
  return private.PrivateRehearsalConfig(
    mode=mode,
    num_rehearsals=e.rehearsal_n,
    assessment_max_tokens=e.assessment_max_tokens,
    memory_max_tokens=e.memory_max_tokens,
    digest_max_tokens=e.digest_max_tokens,
    user=e.rehearsal_user,
  )


def evaluate_policy(
  config,
  tasks: Sequence[Task],
  samplers: Mapping[str, Any],
  tokenizer,
  key: jax.Array,
  *,
  mode: str = "off",
  num_trials: int = 1,
  fidelity: bool | None = None,
  gap: bool | None = None,
  gold: bool | None = None,
) -> tuple[dict[str, float], private.PrivateRun]:
  """One evaluation: private rehearsal (``mode``), committed execution, the benchmark's score, fidelity, reward gap.

  Args:
    config: the run config (rollout settings; ``eval.*``).
    tasks: held-out tasks.
    samplers: {"policy": Sampler, optional "rehearse" (per_role), "reference": Sampler with the base weights (the
      user simulator and, by default, the opening's user)}.
    key: a ``jax.random.key``; every mode uses the same openings for the same key.
    mode: "off", "parallel" or "sequential".
    num_trials: n trials per task (pass^1..pass^n).
    fidelity, gap, gold: override ``config.eval.fidelity`` / ``config.eval.reward_gap`` / ``config.eval.fidelity_gold``.
  Returns:
    (summary: `score_committed`'s keys, ``fidelity/*`` (the committed runs' real
    calls), ``fidelity_gold/*`` (the benchmark's gold calls after each task's opening: `fidelity.gold_trajectories`),
    ``gap/*``, ``cost/*``, ``memory_tokens``; the `private.PrivateRun` with every rehearsal, memory and committed
    trajectory).
  """
  fidelity = config.eval.fidelity if fidelity is None else fidelity
  gap = config.eval.reward_gap if gap is None else gap
  gold = config.eval.fidelity_gold if gold is None else gold
  ucfg = evaluation_unfold_config(config, samplers)
  policy = policy_of(samplers)
  envs = [scoring.make_env(config, task) for task in tasks for _ in range(num_trials)]
  result = private.run(
    tasks,
    policy,
    tokenizer,
    ucfg,
    rehearsal_config(config, mode),
    key,
    envs,
    num_trials=num_trials,
    reference_sampler=samplers.get("reference"),
  )
  runtime.release_host_memory()  # between phases: the committed runs' programs are done (see its docstring)
  summary = score_committed(config, result.committed, envs, len(tasks), num_trials)
  summary.update(private.summary_costs(result.costs))
  if mode != "off":
    summary["memory_tokens"] = float(np.mean([p.memory_tokens for p in result.prepared]))
  rehearse_sampler = _sampler_for(policy, Role.REHEARSE)
  if fidelity:
    fidelity_key = jax.random.fold_in(key, 7)
    summary.update(_fidelity("fidelity", rehearse_sampler, tokenizer, result.committed, ucfg, fidelity_key))
  if gold:
    firsts = {}
    for item in result.prepared:  # one opening per task (its first trial)
      firsts.setdefault(item.task.id, (item.task, item.opening))
    gold_runs = fidelity_lib.gold_trajectories(list(firsts.values()), functools.partial(scoring.make_env, config))
    summary.update(_fidelity("fidelity_gold", rehearse_sampler, tokenizer, gold_runs, ucfg, jax.random.fold_in(key, 9)))
  if gap:
    # Held-out tasks are rehearsed as training rolls out, but with no grounding (the task's reference interactions
    # are its gold actions executed for real) and with the user simulator's first message even where the rollout
    # opens with the user scenario: REHEARSE must see neither when the task is the one being judged.
    rcfg = dataclasses.replace(
      ucfg, env_mode="rehearse", group_size=num_trials, grounding_max_tokens=0, scenario_opening=False
    )
    out = unfold(
      tasks, policy, tokenizer, rcfg, jax.random.fold_in(key, 8), reference_sampler=samplers.get("reference")
    )
    summary.update(reward_gap(config, [t.task for t in out.trajectories], out.trajectories))
    summary["cost/gap/seconds"] = float(out.stats.get("time_total_s", 0.0))
  runtime.release_host_memory()
  return summary, result


def evaluation_unfold_config(config, samplers: Mapping[str, Any]) -> UnfoldConfig:
  """The rollout settings of an evaluation: ``config.rollout`` with one trajectory per (task, trial), and the
  reference weights as the user where the run trains a policy-played user (the evaluation's user should not be the
  policy under test)."""
  fields = config_check.unfold_fields(config)
  fields.update(group_size=1)
  if fields["user_mode"] == "policy" and "reference" in samplers:
    fields["user_mode"] = "reference"
  return UnfoldConfig.from_dict(fields)


def _fidelity(prefix: str, sampler, tokenizer, trajectories, ucfg: UnfoldConfig, key: jax.Array) -> dict[str, float]:
  """`fidelity.measure` on every real tool response of ``trajectories``: ``{prefix}/*`` means and counts and
  ``cost/{prefix}/*``."""
  pairs, _, stats = fidelity_lib.measure(
    sampler,
    tokenizer,
    trajectories,
    key=key,
    max_new_tokens=ucfg.rehearse_max_new_tokens,
    rehearse_prompt=ucfg.rehearse_prompt,
    dialogue=ucfg.rehearse_sees_dialogue,
    accept_error_text=ucfg.accept_error_text,
  )
  return {**fidelity_lib.summarize(pairs, f"{prefix}/"), **{f"cost/{prefix}/{k}": float(v) for k, v in stats.items()}}


def committed_execution(
  config, tasks: Sequence[Task], samplers: Mapping[str, Any], tokenizer, key: jax.Array, num_trials: int = 1
) -> dict[str, float]:
  """The training run's evaluation: committed execution without rehearsal (``num_trials`` per task) against the real
  tools, with fidelity and the reward gap as ``config.eval`` says. Keys as `evaluate_policy`'s, prefixed
  ``eval/``."""
  summary, _ = evaluate_policy(config, tasks, samplers, tokenizer, key, mode="off", num_trials=num_trials)
  return {f"eval/{k}": v for k, v in summary.items()}


def write_summary(workdir: str, step: int, summary: Mapping[str, float]) -> str:
  """Appends ``{"step": step, **summary}`` to ``workdir/eval.jsonl`` as ``metrics.jsonl`` is written (NaN as the
  string "NaN"; ``metrics.read_jsonl(workdir, "eval.jsonl")`` reads it back); returns the path."""
  path = os.path.join(workdir, "eval.jsonl")
  os.makedirs(workdir, exist_ok=True)
  record = metrics.to_json_safe({"step": int(step), **{k: float(v) for k, v in summary.items()}})
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(record, allow_nan=False) + "\n")
  return path


# -------------------------------------------------------------------------------------------------------------------
# --mode=eval


def restore_policy(config, model: runtime.Model, workdir: str | None) -> tuple[Any, int | None]:
  """The parameters to evaluate: the latest checkpoint's in ``workdir`` (layers apart, as the train state holds
  them), else the model's base weights (``model.params`` itself).

  Returns:
    (params: one tree, or {"act", "rehearse"} in per_role mode; the checkpoint's step or None).
  Raises:
    checkpoint.CheckpointError: the checkpoint does not match the configured model.
  """
  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax.rl import grpo

  cfg = grpo.GrpoConfig.from_mapping(config_check.grpo_fields(config))
  base = ({name: model.params for name in grpo.ROLE_TREES} if cfg.per_role else model.params), None
  if not workdir or not os.path.isdir(os.path.join(workdir, checkpoint_lib.CHECKPOINT_SUBDIR)):
    return base
  with checkpoint_lib.Checkpointer.from_config(workdir, config, read_only=True) as ckpt:
    step = ckpt.latest_step()
    if step is None:
      return base
    target = jax.eval_shape(functools.partial(grpo.init_train_state, cfg), model.params)  # shapes: nothing allocated
    restored = ckpt.restore(step, abstract_state={"params": target.params, "opt_state": target.opt_state})
  return restored.params, step


def eval_tasks(config) -> list[Task]:
  """``--mode=eval``'s tasks: `runtime.evaluation_tasks` with ``eval.tasks``."""
  return runtime.evaluation_tasks(config, config.eval.tasks)


def eval_modes(config) -> tuple[str, ...]:
  """``config.eval.rehearsal`` ("off,parallel,sequential" or a tuple) as mode names."""
  return config_check.parse_roles(config.eval.rehearsal)


def eval_key(seed: int) -> jax.Array:
  """The evaluation key of ``--mode=eval`` for ``seed``: every policy evaluated with it meets the same openings."""
  return jax.random.fold_in(jax.random.key(seed), 0xE7A1)


def load_policy(config, workdir: str | None, n_rows: int) -> tuple[runtime.Model, dict[str, Any], int | None]:
  """(model, samplers for `evaluate_policy`, checkpoint step or None) of the latest checkpoint in ``workdir`` (else
  the base weights): "policy" (the ACT tree in per_role mode), "rehearse" (per_role only) and "reference" (the base
  weights), each sized for ``n_rows`` rows.

  Raises:
    config_check.ConfigError: a model without a tokenizer. checkpoint.CheckpointError: a mismatched checkpoint.
  """
  model = runtime.load_model(config)
  if model.tokenizer is None:
    raise config_check.ConfigError([f"model={config.model!r} has no tokenizer; set config.tokenizer"])
  # The base weights with their layers apart (the samplers' layout), once: the reference and, without a checkpoint,
  # the policy sample the same arrays.
  model = dataclasses.replace(model, params=transformer.unstack_tree(model.params))
  params, step = restore_policy(config, model, workdir)
  mesh = runtime.make_mesh(config)
  per_role = isinstance(params, Mapping) and set(params) == {"act", "rehearse"}
  samplers = {"policy": runtime.make_sampler(config, model, params["act"] if per_role else params, mesh, n_rows)}
  if per_role:
    samplers["rehearse"] = runtime.make_sampler(config, model, params["rehearse"], mesh, n_rows)
  samplers["reference"] = runtime.make_sampler(config, model, model.params, mesh, n_rows)
  return model, samplers, step


def run(config, workdir: str | None) -> dict[str, Any]:
  """``--mode=eval``: evaluates the latest checkpoint in ``workdir`` (or the base weights) on ``env.eval_split``.

  Returns:
    {"weights", "checkpoint_step", "domain", "benchmark", "rows": one summary per rehearsal mode (with "rehearsal"
    and "N"), "fidelity_gold": REHEARSE on the benchmark's gold calls (``fidelity_gold/*``, once: every mode has the
    same openings), "reward_gap": the gap summary}; also printed as a table and written to
    ``workdir/eval_results.json``.
  Raises:
    config_check.ConfigError: a bad config value or a scorer that cannot work (`scoring.check_scorers`), before any
      compute.
  """
  config_check.validate(config)
  tasks = eval_tasks(config)
  scoring.check_scorers(config, tasks)  # before the model loads: a misconfigured scorer costs no compute
  n = len(tasks)
  model, samplers, step = load_policy(config, workdir, n * config.eval.num_trials)
  key = eval_key(config.seed)
  rows, gap, gold = [], None, None
  for i, mode in enumerate(eval_modes(config)):
    logging.info("evaluating %d tasks x %d trials, rehearsal %s", n, config.eval.num_trials, mode)
    summary, _ = evaluate_policy(
      config,
      tasks,
      samplers,
      model.tokenizer,
      key,
      mode=mode,
      num_trials=config.eval.num_trials,
      # The same openings in every mode: REHEARSE on the gold calls and the reward gap are measured once.
      gap=i == 0 and config.eval.reward_gap,
      gold=i == 0 and config.eval.fidelity_gold,
    )
    if i == 0:
      gold = _pop(summary, ("fidelity_gold/", "cost/fidelity_gold/")) or None
      gap = _pop(summary, ("gap/", "cost/gap/")) or None
    summary.update(rehearsal=mode, N=0 if mode == "off" else config.eval.rehearsal_n)
    rows.append(summary)
  result = {
    "weights": model.source if step is None else f"{workdir} step {step}",
    "checkpoint_step": step,
    "benchmark": config.env.benchmark,
    "domain": config.env.domain,
    "split": config.env.eval_split,
    "rows": rows,
    "fidelity_gold": gold,
    "reward_gap": gap,
  }
  print(format_table(result))
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, RESULTS_FILE), "w", encoding="utf-8") as f:
      json.dump(metrics.to_json_safe(result), f, indent=2, allow_nan=False)  # NaN as "NaN": strict JSON
  return result


def _pop(summary: dict[str, Any], prefixes: tuple[str, ...]) -> dict[str, Any]:
  return {k: summary.pop(k) for k in list(summary) if k.startswith(prefixes)}


def _f(x: Any, digits: int = 3) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def format_table(result: Mapping[str, Any]) -> str:
  """`run`'s result as text: one line per rehearsal mode (pass^k, reward, fidelity, costs), then the reward gap."""
  rows = result["rows"]
  trials = int(rows[0]["trials"]) if rows else 1
  passes = [f"pass^{k}" for k in range(1, trials + 1)]
  head = (
    f"{'domain':<10} {'rehearsal':<10} {'N':>2} {'tasks':>5} "
    + " ".join(f"{p:>7}" for p in passes)
    + f" {'reward':>6} {'invalid':>7} {'errors':>6} {'calls':>5} | "
    + f"{'json':>5} {'exact':>5} {'keyF1':>5} {'value':>5} {'error':>5} | "
    + f"{'rehearse tok':>12} {'rehearse s':>10} {'memory tok':>10} {'commit tok':>10} {'commit s':>8}"
  )
  lines = [
    f"Evaluation of {result['weights']} on {result['benchmark']} {result['domain']} ({result['split']} split); "
    "pass^k = mean over tasks of C(c,k)/C(n,k) (an invalid trial counts as failed: its scorer could not score it, "
    "or its external user failed; errors = the invalid trials whose scorer raised; reward is the mean over valid "
    "trials); fidelity = REHEARSE's prediction of each real tool response "
    "(json valid, exact match, key-set F1, value accuracy on shared keys, error agreement); costs in generated "
    "tokens and seconds (rehearse = rehearsals + assessments + memory; seconds include compilation, mostly paid by the "
    "first mode).",
    head,
    "-" * len(head),
  ]
  for r in rows:
    pre = ("rehearsal", "assessment", "memory")
    tok = sum(r.get(f"cost/{p}/generated_tokens", 0.0) for p in pre)
    sec = sum(r.get(f"cost/{p}/seconds", 0.0) for p in pre)
    lines.append(
      f"{result['domain']:<10} {r['rehearsal']:<10} {r['N']:>2} {int(r['tasks']):>5} "
      + " ".join(f"{_f(r[p]):>7}" for p in passes)
      + f" {_f(r['reward']):>6} {int(r['reward/invalid']):>7} {int(r['reward/scoring_errors']):>6} "
      + f"{_f(r['tool_calls'], 1):>5} | "
      + " ".join(
        f"{_f(r.get(f'fidelity/{m}'), 2):>5}"
        for m in ("json_valid", "exact_match", "key_f1", "value_accuracy", "error_agreement")
      )
      + f" | {tok:>12.0f} {sec:>10.1f} {_f(r.get('memory_tokens'), 0):>10} "
      + f"{r.get('cost/execution/generated_tokens', 0.0):>10.0f} {r.get('cost/execution/seconds', 0.0):>8.1f}"
    )
  calls = [int(r.get("fidelity/calls", 0)) for r in rows]
  lines.append(f"real tool calls probed for fidelity per mode: {calls}")
  gold = result.get("fidelity_gold")
  if gold:
    lines.append(
      f"REHEARSE on the benchmark's gold calls ({int(gold['fidelity_gold/calls'])} calls after the tasks' openings, "
      "executed for real): "
      + ", ".join(
        f"{m} {_f(gold.get(f'fidelity_gold/{m}'), 2)}"
        for m in ("json_valid", "exact_match", "key_f1", "value_accuracy", "error_agreement")
      )
    )
  gap = result.get("reward_gap")
  if gap:
    lines.append(
      f"rehearsal-vs-real reward gap ({int(gap['gap/trajectories'])} rehearsed trajectories, no grounding; "
      f"{int(gap['gap/invalid'])} left out as unscoreable, {int(gap['gap/scoring_errors'])} of them by a scorer "
      "error): rule checklist on the rehearsal "
      f"{_f(gap['gap/rehearsed_reward'])} vs benchmark reward of the same decisions executed for real "
      f"{_f(gap['gap/real_reward'])}: gap {_f(gap['gap/gap'])}"
    )
  return "\n".join(lines)
