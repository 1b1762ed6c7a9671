"""A policy evaluated on held-out tasks against the real tools: private rehearsal, committed execution, the
benchmark's score and pass^k, world-model fidelity, the rehearsal-vs-real reward gap.

Training calls `committed_execution` (rehearsal off) every ``train.eval_every`` steps and at the end, where
``train.eval_at_start`` adds the initial weights'; ``--mode=eval`` (``evaluate.py``) calls `evaluate_policy` once per
test-time rehearsal mode (paper §3.4: N imagined trajectories, a rehearsal memory, one committed execution). Every
trial's committed execution runs on a fresh ``ToolEnv`` and is scored by the benchmark's own evaluator
(`scoring.score_committed`); fidelity (`rehearsal.fidelity`) and the reward gap (`scoring.reward_gap`: one rehearsed
trajectory per (task, trial)) are measured alongside as ``eval.fidelity``, ``eval.fidelity_gold`` and
``eval.reward_gap`` say. Costs are wall seconds and tokens per phase; seconds include JIT compilation the first time a
shape is seen.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from envace_jax import metrics, runtime, scoring
from envace_jax import policy as policy_lib
from envace_jax.envs.base import Task
from envace_jax.model.roles import Role
from envace_jax.rehearsal import fidelity as fidelity_lib
from envace_jax.rehearsal import private
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rehearsal.unfold import sampler_for, unfold

# Streams of an evaluation's key (values fixed: changing one changes every committed result).
_FIDELITY_STREAM, _REWARD_GAP_STREAM, _GOLD_FIDELITY_STREAM = 7, 8, 9


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
    samplers: the policy's (`policy.Policy.samplers`: "policy", and "rehearse" for a REHEARSE tree of its own) and
      "reference" (the base weights: the user simulator and, by default, the opening's user).
    key: a ``jax.random.key``; every mode uses the same openings for the same key.
    mode: "off", "parallel" or "sequential".
    num_trials: n trials per task (pass^1..pass^n).
    fidelity, gap, gold: override ``config.eval.fidelity`` / ``config.eval.reward_gap`` / ``config.eval.fidelity_gold``.
  Returns:
    (summary: `scoring.score_committed`'s keys, ``fidelity/*`` (the committed runs' real
    calls), ``fidelity_gold/*`` (the benchmark's gold calls in context: `fidelity.gold_trajectories`),
    ``gap/*``, ``cost/*``, ``memory_tokens``; the `private.PrivateRun` with every rehearsal, memory and committed
    trajectory).
  """
  fidelity = config.eval.fidelity if fidelity is None else fidelity
  gap = config.eval.reward_gap if gap is None else gap
  gold = config.eval.fidelity_gold if gold is None else gold
  ucfg = evaluation_unfold_config(config, samplers)
  policy = policy_lib.Policy.from_config(config).by_role(samplers)
  envs = [scoring.make_env(config, task) for task in tasks for _ in range(num_trials)]
  result = private.run(
    tasks,
    policy,
    tokenizer,
    ucfg,
    private.PrivateRehearsalConfig.from_config(config, mode=mode),
    key,
    envs,
    num_trials=num_trials,
    reference_sampler=samplers.get("reference"),
  )
  runtime.release_host_memory()  # between phases: the committed runs' programs are done (see its docstring)
  summary = scoring.score_committed(config, result.committed, envs, len(tasks), num_trials)
  summary.update(private.summary_costs(result.costs))
  if mode != "off":
    summary["memory_tokens"] = float(np.mean([p.memory_tokens for p in result.prepared]))
  rehearse_sampler = sampler_for(policy, Role.REHEARSE)
  if fidelity:
    fidelity_key = jax.random.fold_in(key, _FIDELITY_STREAM)
    summary.update(_fidelity("fidelity", rehearse_sampler, tokenizer, result.committed, ucfg, fidelity_key))
  if gold:
    firsts = {}
    for item in result.prepared:  # one opening per task (its first trial)
      firsts.setdefault(item.task.id, (item.task, item.opening))
    gold_runs = fidelity_lib.gold_trajectories(list(firsts.values()), functools.partial(scoring.make_env, config))
    summary.update(
      _fidelity(
        "fidelity_gold", rehearse_sampler, tokenizer, gold_runs, ucfg, jax.random.fold_in(key, _GOLD_FIDELITY_STREAM)
      )
    )
  if gap:
    out = rehearsed_runs(ucfg, tasks, policy, tokenizer, samplers, key, num_trials)
    summary.update(scoring.reward_gap(config, [t.task for t in out.trajectories], out.trajectories))
    summary["cost/gap/seconds"] = float(out.stats.get("time_total_s", 0.0))
  runtime.release_host_memory()
  return summary, result


def rehearsed_runs(ucfg: UnfoldConfig, tasks: Sequence[Task], policy, tokenizer, samplers, key, num_trials: int):
  """The reward gap's rollouts (`evaluate_policy` with ``gap``): ``num_trials`` self-unfolded trajectories per task,
  REHEARSE answering every tool call (`unfold` with ``env_mode="rehearse"``), the stream of ``key`` the gap uses.

  Held-out tasks are rehearsed as training rolls out, but with no grounding (the task's reference interactions are
  its gold actions executed for real) and with the user simulator's first message even where the rollout opens with
  the user scenario: REHEARSE must see neither when the task is the one being judged.

  Args:
    ucfg: `evaluation_unfold_config`'s settings; policy: `policy.Policy.by_role` of ``samplers``.
  Returns:
    `unfold`'s output: ``trajectories`` (task-major, ``num_trials`` per task) and ``stats``.
  """
  rcfg = dataclasses.replace(
    ucfg, env_mode="rehearse", group_size=num_trials, grounding_max_tokens=0, scenario_opening=False
  )
  return unfold(
    tasks,
    policy,
    tokenizer,
    rcfg,
    jax.random.fold_in(key, _REWARD_GAP_STREAM),
    reference_sampler=samplers.get("reference"),
  )


def evaluation_unfold_config(config, samplers: Mapping[str, Any]) -> UnfoldConfig:
  """The rollout settings of an evaluation: ``config.rollout`` with one trajectory per (task, trial), ACT and
  REHEARSE sampled with ``config.eval.sampling`` (official: temperature 0.6, top_p 0.95), and the reference weights
  as the user where the run trains a policy-played user (the evaluation's user should not be the policy under
  test)."""
  user = "reference" if config.rollout.user_mode == "policy" and "reference" in samplers else config.rollout.user_mode
  sampling = config.eval.sampling.to_dict()
  return UnfoldConfig.from_config(
    config, group_size=1, user_mode=user, act_sampling=sampling, rehearse_sampling=sampling
  )


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
