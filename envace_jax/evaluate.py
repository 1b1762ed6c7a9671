"""Evaluation by committed execution: the policy acts against the benchmark's real tools, the benchmark scores it.

Used at the end of every training run (and every ``train.eval_every`` steps). Only this phase touches real tools:
each trajectory gets a fresh environment (``ToolEnv.reset``), its tool calls are executed for real, and the
benchmark's own evaluator (τ²: ``evaluate_simulation``; BFCL: its multi-turn checker) gives the reward.

pass^k is τ²-bench's: per task with c successes (reward 1) in n trials, C(c, k) / C(n, k), averaged over tasks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from envace_jax import config_check
from envace_jax.envs.base import RewardInfo, Task, ToolEnv
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rehearsal.unfold import unfold


def make_env(config, task: Task) -> ToolEnv:
  """A real environment for ``task``'s benchmark (not yet reset; ``unfold`` resets it).

  Raises:
    config_check.ConfigError: a benchmark without real tools to execute against.
  """
  if task.benchmark == "tau2":
    from envace_jax.envs import tau2

    return tau2.Tau2Env(task.domain)
  if task.benchmark == "bfcl":
    from envace_jax.envs import bfcl

    return bfcl.BfclEnv()
  if task.benchmark == "checklist":
    from envace_jax.envs import checklist
    from envace_jax.rl import rewards

    return checklist.ChecklistEnv(scorer=rewards.rule_checklist)
  raise config_check.ConfigError([f"benchmark {task.benchmark!r} has no real environment to evaluate against"])


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


def committed_execution(
  config, tasks: Sequence[Task], samplers: Mapping[str, Any], tokenizer, key: jax.Array, num_trials: int = 1
) -> dict[str, float]:
  """Runs ``num_trials`` committed executions of each task against the real tools and scores them.

  Args:
    config: the run config (rollout settings; ``env_mode`` is forced to "real").
    tasks: held-out tasks.
    samplers: {"policy": Sampler (acts), optional "reference": Sampler (the user simulator)}.
    tokenizer: the policy's tokenizer.
    key: a ``jax.random.key``.
    num_trials: n trials per task (k of pass^k up to n).
  Returns:
    {"eval/reward": mean reward, "eval/pass^1".."eval/pass^n", "eval/tasks", "eval/trials", "eval/invalid",
    "eval/turns"}.
  """
  fields = config_check.unfold_fields(config)
  fields.update(group_size=num_trials, env_mode="real")
  if fields["user_mode"] == "policy" and "reference" in samplers:
    fields["user_mode"] = "reference"  # the evaluation's user should not be the policy under test
  ucfg = UnfoldConfig.from_dict(fields)
  envs = [make_env(config, task) for task in tasks for _ in range(num_trials)]
  policy = samplers["policy"]  # committed execution: only ACT (and a policy-played user) generate
  out = unfold(tasks, policy, tokenizer, ucfg, key, reference_sampler=samplers.get("reference"), envs=envs)
  rewards, invalid = [], 0
  successes = [0] * len(tasks)
  for i, traj in enumerate(out.trajectories):
    try:
      info = envs[i].evaluate(traj.messages)
    except Exception as e:  # noqa: BLE001 — see scoring_failure
      info = scoring_failure(traj, e)
    traj.reward = info
    if not info.valid:
      invalid += 1
      continue
    rewards.append(info.reward)
    successes[i // num_trials] += int(info.reward >= 1.0 - 1e-6)
  summary = {
    "eval/reward": float(np.mean(rewards)) if rewards else float("nan"),
    "eval/tasks": float(len(tasks)),
    "eval/trials": float(num_trials),
    "eval/invalid": float(invalid),
    "eval/turns": float(np.mean([t.counts.get("generations_act", 0) for t in out.trajectories])),
  }
  for k in range(1, num_trials + 1):
    summary[f"eval/pass^{k}"] = pass_hat_k(successes, num_trials, k)
  return summary


def scoring_failure(trajectory, error: Exception) -> RewardInfo:
  """The reward of a trajectory its scorer raised on (e.g. arguments nested too deep for the benchmark's checker):
  0, recorded on the trajectory (``counts["scoring_error"]``, ``events``) and logged, so one bad model output never
  stops a training step or an evaluation."""
  trajectory.count("scoring_error")
  trajectory.events.append({"scoring_error": f"{type(error).__name__}: {error}"[:2000]})
  logging.warning("task %s: scoring failed (%s: %s); reward 0", trajectory.task.id, type(error).__name__, error)
  return RewardInfo(reward=0.0, info={"scoring_error": f"{type(error).__name__}: {error}"[:2000]})


def write_summary(workdir: str, step: int, summary: Mapping[str, float]) -> str:
  """Appends ``{"step": step, **summary}`` to ``workdir/eval.jsonl``; returns the path."""
  path = os.path.join(workdir, "eval.jsonl")
  os.makedirs(workdir, exist_ok=True)
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({"step": int(step), **{k: float(v) for k, v in summary.items()}}) + "\n")
  return path
