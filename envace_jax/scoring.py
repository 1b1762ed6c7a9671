"""How a trajectory gets its reward, and what a scorer's failure becomes.

Three scorers (paper §3.3; docs/method.md, "How a training step runs", step 5):
  * the benchmark's own evaluator on the real environment the trajectory ran in (τ²: ``evaluate_simulation``; BFCL:
    its multi-turn checker): committed executions, ``grpo_real_env`` rollouts, the reward gap's replay;
  * the rule checklist (`rl.rewards.rule_checklist`, ``reward.kind="rule"``) for rehearsed trajectories, which have
    no real state to check;
  * the LLM checklist judge (`rl.judge.ChecklistJudge`, ``reward.kind="judge"``).

A failure is never a valid 0:
  * **configuration errors** stop the run with a `config_check.ConfigError` that names the config key: a judge that
    refuses the configuration (`RewardConfigError`: wrong URL, model or key), a judge that cannot be reached at
    start-up, a benchmark whose evaluator cannot be set up for a task (`EnvError` from the adapter). `check_scorers`
    finds them before the first rollout; a `RewardConfigError` raised later (a key revoked mid-run) stops the run too.
  * **a model output a scorer cannot handle** (arguments nested past the checker's recursion limit, a conversation
    the τ² evaluator cannot replay, a judge reply with no verdict, a judge request refused as too large) makes the
    trajectory invalid: ``RewardInfo(reward=nan, valid=False)``, excluded from the group baselines and the loss
    (`rl.advantages`), a failed trial in pass^k (`score_committed`), and counted (`counts`, in every training
    step's metrics and every evaluation's summary).

Also here, for training's and ``--mode=eval``'s evaluations alike: `score_committed` (the benchmark's reward and
pass^k) and `reward_gap`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging

from envace_jax import config_check, metrics
from envace_jax.envs import registry
from envace_jax.envs.base import ChatMessage, EnvError, RewardInfo, Task, ToolEnv
from envace_jax.model import tool_format
from envace_jax.rehearsal.trajectory import Termination, Trajectory
from envace_jax.rl import rewards

SCORING_ERROR = "scoring_error"  # the `RewardInfo.info` key and `Trajectory.counts` key of a scorer's failure


def make_env(config, task: Task) -> ToolEnv:
  """A real environment for ``task``'s benchmark (not yet reset; ``unfold`` resets it), scored by the rule checklist
  or, for a judged benchmark, by ``config.reward``'s judge (without one its ``evaluate`` returns an invalid reward).

  Raises:
    EnvError: an unknown benchmark, or one without a real environment (`envs.registry`).
  """
  bench = registry.get(task.benchmark)
  judge = make_judge(config) if bench.judged else None
  return bench.make_env(task, rule_checklist=rewards.rule_checklist, judge=judge)


def make_judge(config):
  """The LLM checklist judge of ``config.reward`` (`JudgeConfig.from_config`; one per setting, shared by every
  caller), or None when ``reward.judge_url`` or ``reward.judge_model`` is unset.

  Raises:
    config_check.ConfigError: the judge refuses its settings (e.g. ``reward.judge_api_key_env`` names an unset
      variable); the message names the keys.
  """
  r = config.reward
  if not (r.judge_url and r.judge_model):
    return None
  try:
    from envace_jax.rl import judge

    settings = judge.JudgeConfig.from_config(config)
    if repr(settings) not in _JUDGES:
      if len(_JUDGES) >= 4:
        _JUDGES.pop(next(iter(_JUDGES)))  # the oldest
      _JUDGES[repr(settings)] = judge.ChecklistJudge(settings)
    return _JUDGES[repr(settings)]
  except rewards.RewardConfigError as e:
    raise _judge_config_error(config, e) from None


_JUDGES: dict[str, Any] = {}  # the last four judges by settings (repr of their JudgeConfig), shared by every caller


FINISHED = frozenset({Termination.USER_TURNS_DONE, Termination.AGENT_STOP, Termination.REQUIRED_FAILED})
"""Terminations that come after the agent's reply to the last user turn: that turn is finished (`score`)."""

JUDGED_TURN = "judged_turn"  # the type of a trajectory event holding a turn the gate judged (`turn_gate`)


def turn_gate(config, judge):
  """The required-item gate (``reward.required_items="end"``; official `interaction.py`): a callable
  ``gate(trajectory, turn) -> Termination | None`` that `Episode.user_turn` calls before replaying the logged user
  turn after ``turn``. When an item of ``turn`` is marked ``required_for_next_turn`` (in the annotations judged), it
  judges the finished turn now (`ChecklistJudge.judge_turn`, kept in the trajectory's events for `score`) and ends
  the trajectory with ``REQUIRED_FAILED`` when, in more than half of the annotations, a required item failed, or
  with ``JUDGE_FAILED`` when the judge gave no verdict (the reward is then invalid). None when there is nothing to
  gate: no judge, or ``reward.required_items="ignore"``.

  Raises (from the gate):
    config_check.ConfigError: the judge refuses the configuration (HTTP 3xx/401/403/404).
  """
  if judge is None or config.reward.required_items != "end":
    return None

  def gate(trajectory: Trajectory, turn: int) -> Termination | None:
    task = trajectory.task
    annotations = (task.criteria.get("checklists") or [])[: judge.config.max_annotations]
    if not any(item["required_for_next_turn"] for a in annotations for item in a[turn]):
      return None
    try:
      result = judge.judge_turn(task, trajectory.messages, turn)
    except rewards.RewardConfigError as e:
      raise _judge_config_error(config, e) from None
    trajectory.events.append({"type": JUDGED_TURN, **result})
    if result["failures"]:
      return Termination.JUDGE_FAILED
    return Termination.REQUIRED_FAILED if result["required_failed"] > result["annotations"] / 2 else None

  return gate


def _judge_config_error(config, error: Exception) -> config_check.ConfigError:
  r = config.reward
  keys = f"reward.judge_url={r.judge_url!r}, reward.judge_model={r.judge_model!r}, "
  keys += f"reward.judge_api_key_env={r.judge_api_key_env!r}"
  return config_check.ConfigError([f"{keys}: {error}"])


def rule_reward(config, task: Task, trajectory: Trajectory) -> RewardInfo:
  """The rule-checklist reward (``config.reward``'s settings) of ``trajectory``'s conversation against ``task``'s
  gold actions and required information (`rl.rewards.rule_checklist`)."""
  rule = rewards.RuleChecklistConfig.from_config(config)
  return rewards.rule_checklist(
    task, trajectory.messages, malformed_outputs=trajectory.counts.get("malformed_act", 0), config=rule
  )


def score(config, trajectory: Trajectory, *, env: ToolEnv | None = None, judge=None, task: Task | None = None):
  """The reward of one trajectory; failures as the module docstring says (never a valid 0).

  Args:
    config: the run config (``reward.*``).
    trajectory: the trajectory; its ``counts[SCORING_ERROR]`` and ``events`` record a scorer's failure.
    env: the real environment the trajectory ran in (reset with its task): scored by the benchmark's evaluator.
    judge: without ``env``: the LLM checklist judge (given the turns `turn_gate` judged during the rollout, and
      whether the last turn was finished: `FINISHED`); without both, the rule checklist.
    task: the task the rule checklist or judge compares against (default ``trajectory.task``).
  Returns:
    The `RewardInfo`; ``valid=False`` with ``info[SCORING_ERROR]`` when the scorer failed.
  Raises:
    config_check.ConfigError: the judge refuses the configuration (HTTP 3xx/401/403/404).
  """
  if trajectory.termination is not None and trajectory.termination.value == "user_error":
    return RewardInfo(reward=math.nan, valid=False, info={"reason": "the external user failed"})
  task = task or trajectory.task
  try:
    if env is not None:
      info = env.evaluate(trajectory.messages)
    elif judge is not None:
      judged = {e["turn"]: e for e in trajectory.events if e.get("type") == JUDGED_TURN}
      finished = trajectory.termination in FINISHED
      info = judge(task, trajectory.messages, last_turn_finished=finished, judged=judged)
    else:
      info = rule_reward(config, task, trajectory)
  except rewards.RewardConfigError as e:
    raise _judge_config_error(config, e) from None
  except Exception as e:  # noqa: BLE001 — a model output the scorer chokes on: invalid and counted, not a crash
    info = RewardInfo(reward=math.nan, valid=False, info={SCORING_ERROR: f"{type(e).__name__}: {e}"[:2000]})
  if not info.valid and SCORING_ERROR in info.info:
    trajectory.count(SCORING_ERROR)
    trajectory.events.append({SCORING_ERROR: info.info[SCORING_ERROR]})
    logging.warning("task %s: scoring failed, trajectory invalid: %s", task.id, info.info[SCORING_ERROR])
  return info


def counts(trajectories: Sequence[Trajectory], prefix: str = "reward/") -> dict[str, float]:
  """``{prefix}invalid`` (trajectories whose reward is missing or invalid) and ``{prefix}scoring_errors``
  (trajectories a scorer failed on) as floats."""
  invalid = sum(t.reward is None or not t.reward.valid for t in trajectories)
  errors = sum(t.counts.get(SCORING_ERROR, 0) > 0 for t in trajectories)
  return {f"{prefix}invalid": float(invalid), f"{prefix}scoring_errors": float(errors)}


def tool_call_validity(trajectories: Sequence[Trajectory]) -> float:
  """The fraction of ACT generations that were well-formed (a parseable tool call or a plain reply; not
  ``malformed_act``), over every generation of ``trajectories``; NaN when there is none."""
  acts = sum(t.counts.get("generations_act", 0) for t in trajectories)
  malformed = sum(t.counts.get("malformed_act", 0) for t in trajectories)
  return 1.0 - malformed / acts if acts else float("nan")


def act_in_rehearse_format(trajectories: Sequence[Trajectory]) -> float:
  """The fraction of ACT generations written in REHEARSE's format (the agent's message holds a ``<tool_response>``
  block; the benchmark's logged history is not counted): the shared policy answering as the environment instead of
  acting. NaN when there is no generation."""
  acts = sum(t.counts.get("generations_act", 0) for t in trajectories)
  tag = tool_format.TOOL_RESPONSE_OPEN
  confused = sum(
    tag in m.content
    for t in trajectories
    for m in t.messages[len(registry.initial_conversation(t.task)) :]
    if m.role == "assistant"
  )
  return confused / acts if acts else float("nan")


def check_scorers(config, real_tasks: Sequence[Task] = ()) -> None:
  """Start-up check of every scorer the run will use, before any rollout.

  With ``reward.kind="judge"`` the judge is built and probed with one request (`ChecklistJudge.probe`). Each task of
  ``real_tasks`` (those the benchmark's evaluator will score) gets a real environment and is reset on it, which is
  where the adapters set the benchmark up (τ²: the domain's DB and the task's evaluation criteria; BFCL: its
  backends; VitaBench: the `vita` package).

  Raises:
    config_check.ConfigError: the message names the config key (``reward.judge_*``, ``env.benchmark``).
  """
  if config.reward.kind == "judge":
    from envace_jax.rl import judge as judge_lib

    judge = make_judge(config)
    if judge is None:
      raise config_check.ConfigError(["reward.kind='judge' needs reward.judge_url and reward.judge_model"])
    try:
      judge.probe()
    except rewards.RewardConfigError as e:
      raise _judge_config_error(config, e) from None
    except judge_lib.JudgeTransportError as e:
      raise config_check.ConfigError(
        [f"reward.judge_url={config.reward.judge_url!r}: the judge cannot be reached ({e}); start it or fix the URL"]
      ) from None
  for task in real_tasks:
    try:
      env = make_env(config, task)
      env.reset(task)
    except EnvError as e:
      where = f"env.benchmark={task.benchmark!r}, env.domain={task.domain!r}"
      raise config_check.ConfigError(
        [f"{where}: the benchmark's evaluator cannot score task {task.id!r}: {e}"]
      ) from None


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


def reward_gap_pairs(config, tasks: Sequence[Task], trajectories: Sequence[Trajectory]) -> list[tuple | None]:
  """Per rehearsed trajectory: (rule-checklist reward of the rehearsal, benchmark reward of replaying its calls for
  real on a fresh environment of its task), or None where either scorer could not score it (`score`).

  Args:
    tasks: the original task of each trajectory (with its gold actions).
    trajectories: rehearsed trajectories (`heldout.rehearsed_runs`).
  Returns:
    One entry per trajectory, in order: ``(rehearsed, real, scoring_error)`` floats and a bool (a scorer failed on
    either side), or ``(None, None, scoring_error)`` for an invalid one.
  """
  out = []
  for task, traj in zip(tasks, trajectories, strict=True):
    r = score(config, traj, task=task)
    env = make_env(config, task)
    replayed = Trajectory(task, traj.group, traj.sample, replay_for_real(task, traj.messages, env))
    q = score(config, replayed, env=env)
    error = bool(traj.counts.get(SCORING_ERROR) or replayed.counts.get(SCORING_ERROR))
    out.append((r.reward, q.reward, error) if r.valid and q.valid else (None, None, error))
  return out


def reward_gap(config, tasks: Sequence[Task], trajectories: Sequence[Trajectory]) -> dict[str, float]:
  """Rule-checklist reward of rehearsed trajectories vs the benchmark reward of replaying them for real
  (`reward_gap_pairs`).

  Returns:
    {"gap/rehearsed_reward", "gap/real_reward", "gap/gap" (rehearsed - real): means over the trajectories both
    scorers accepted, "gap/trajectories": how many those are, "gap/invalid": how many either scorer could not score
    (`score`), "gap/scoring_errors": how many of those a scorer failed on}.
  """
  pairs = reward_gap_pairs(config, tasks, trajectories)
  rehearsed = [r for r, _, _ in pairs if r is not None]
  real = [q for _, q, _ in pairs if q is not None]
  mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
  return {
    "gap/rehearsed_reward": mean(rehearsed),
    "gap/real_reward": mean(real),
    "gap/gap": mean(rehearsed) - mean(real),
    "gap/trajectories": float(len(real)),
    "gap/invalid": float(len(pairs) - len(real)),
    "gap/scoring_errors": float(sum(e for _, _, e in pairs)),
  }


def is_success(reward: float) -> bool:
  """τ²-bench's success of one trial (``tau2.metrics.agent_metrics.is_successful``): |reward - 1| <= 1e-6."""
  return 1.0 - 1e-6 <= reward <= 1.0 + 1e-6


def score_committed(
  config, trajectories: Sequence[Trajectory], envs: Sequence[ToolEnv], num_tasks: int, num_trials: int
) -> dict[str, float]:
  """Scores committed executions (task-major, ``num_trials`` per task) with each one's environment's evaluator
  (`score`); sets each trajectory's ``reward``.

  An invalid trial (its scorer failed, or the external user did) is left out of the mean reward and counts as a
  failed trial in pass^k: a task's c counts its successful trials (`is_success`) out of all ``num_trials``.

  Returns:
    {"reward": mean reward of the valid trials (NaN when none is), "pass^1".."pass^n", "tasks", "trials",
    "reward/invalid", "reward/scoring_errors" (`counts`), "turns", "tool_calls" (means per trial),
    "tool_call_validity" (`tool_call_validity`), "act_rehearse_format" (`act_in_rehearse_format`)}.
  """
  rewards_ = []
  successes = [0] * num_tasks
  for i, traj in enumerate(trajectories):
    traj.reward = score(config, traj, env=envs[i])
    if traj.reward.valid:
      rewards_.append(traj.reward.reward)
      successes[i // num_trials] += int(is_success(traj.reward.reward))
  summary = {
    "reward": float(np.mean(rewards_)) if rewards_ else float("nan"),
    "tasks": float(num_tasks),
    "trials": float(num_trials),
    **counts(trajectories),
    "turns": float(np.mean([t.counts.get("generations_act", 0) for t in trajectories])),
    "tool_calls": float(np.mean([t.counts.get("tool_calls", 0) for t in trajectories])),
    "tool_call_validity": tool_call_validity(trajectories),
    "act_rehearse_format": act_in_rehearse_format(trajectories),
  }
  for k in range(1, num_trials + 1):
    summary[f"pass^{k}"] = pass_hat_k(successes, num_trials, k)
  summary["pass^1/lo"], summary["pass^1/hi"] = metrics.interval95([c / num_trials for c in successes])
  return summary
