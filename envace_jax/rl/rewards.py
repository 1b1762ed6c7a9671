"""Checklist rewards for a trajectory, rule-based (the offline default).

`rule_checklist` scores a `Task` and a conversation (`base.ChatMessage`s) into a `base.RewardInfo`, for rehearsed
trajectories, which have no real DB to compare; benchmark-free (reads the task's fields, never a benchmark's code).
The paper's LLM checklist judge lives in `rl/judge.py`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from envace_jax.config import defaults
from envace_jax.envs.base import ChatMessage, GoldAction, RewardInfo, Task, ToolCall, json_layout

# ----------------------------------------------------------------------------------------------- rule checklist


class RewardConfigError(ValueError):
  """A reward configuration is invalid (negative weight, unknown mode, bad judge settings, missing API key)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuleChecklistConfig:
  """Weights and matching rules of `rule_checklist`. ``malformed_penalty`` and ``arg_keys`` are run settings
  (``config.reward``, `from_config`; no defaults here); the weights are the checklist's own (1 each).

  Attributes:
    action_weight: weight of each gold-action item.
    communicate_weight: weight of each `communicate_info` item.
    well_formed_weight: weight of the well-formedness item.
    malformed_penalty: the well-formedness item scores max(0, 1 - malformed_penalty * malformed_outputs): 1.0 (the
      default) is binary (any malformed output fails it), 0.25 a graded variant that reaches 0 at four.
    arg_keys: which arguments a gold action without `compare_args` compares. "strict": all of them, on both sides
      (full equality). "tau2": exactly τ²'s rule, only the keys the *call* has, so a call that omits gold arguments
      (even a call with no arguments) still matches — exact parity with τ²'s ACTION check, but a reward a policy can
      exploit by leaving arguments out. Every τ² airline gold action states exactly the tool's required arguments,
      so "strict" fails only calls that τ² would accept while missing a required argument.
  """

  malformed_penalty: float
  arg_keys: Literal["strict", "tau2"]
  action_weight: float = 1.0
  communicate_weight: float = 1.0
  well_formed_weight: float = 1.0

  @classmethod
  def from_config(cls, config=None, **overrides) -> RuleChecklistConfig:
    """``config.reward.malformed_penalty`` and ``.arg_keys``, then ``overrides``; config None: the defaults.

    Raises:
      RewardConfigError: an invalid value.
    """
    r = defaults.or_defaults(config).reward
    return cls(**{"malformed_penalty": r.malformed_penalty, "arg_keys": r.arg_keys, **overrides})

  def __post_init__(self):
    for name in ("action_weight", "communicate_weight", "well_formed_weight", "malformed_penalty"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise RewardConfigError(f"RuleChecklistConfig.{name} must be a finite number >= 0, got {value!r}")
    if self.arg_keys not in ("strict", "tau2"):
      raise RewardConfigError(f"RuleChecklistConfig.arg_keys must be 'strict' or 'tau2', got {self.arg_keys!r}")


def action_matches(gold: GoldAction, call: ToolCall, arg_keys: Literal["strict", "tau2"] = "strict") -> bool:
  """Whether `call` satisfies `gold`, compared as τ²-bench compares them.

  Mirrors `tau2.data_model.tasks.Action.compare_with_tool_call` (used by `tau2/evaluator/evaluator_action.py`,
  `ActionEvaluator.evaluate_actions`): names must be equal; the compared keys are `gold.compare_args` when given,
  otherwise the call's own keys ("tau2") or the union of both sides' keys ("strict", see `RuleChecklistConfig`);
  no keys to compare -> match; otherwise the two argument dicts restricted to those keys must be equal under
  Python `==` of the decoded JSON values. That is all the normalisation τ² does: 1 == 1.0 and True == 1 match, while
  "1" != 1, "ABC" != "abc", list order matters and dict key order does not. A key missing on one side makes the
  restricted dicts differ. The only addition here is `base.json_layout` (tuples -> lists, mappings -> dicts), so a
  `Mapping` or tuple built in Python compares as its JSON would.

  The gold action's `requestor` is not looked at, as in τ².
  """
  if gold.name != call.name or not isinstance(call.arguments, Mapping):
    return False  # a call whose arguments are not an object matches no gold action
  call_args, gold_args = json_layout(call.arguments), json_layout(gold.arguments)
  if gold.compare_args is not None:
    keys = set(gold.compare_args)
  elif arg_keys == "tau2":
    keys = set(call_args)
  else:
    keys = set(call_args) | set(gold_args)
  if not keys:
    return True
  return {k: v for k, v in call_args.items() if k in keys} == {k: v for k, v in gold_args.items() if k in keys}


_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def visible_text(content: str) -> str:
  """An assistant message's user-visible text: the content without `<think>...</think>` blocks."""
  return _THINK_RE.sub("", content)


def info_communicated(info: str, conversation: Sequence[ChatMessage]) -> bool:
  """Whether an assistant message told the user `info`, by τ²-bench's rule.

  Mirrors `tau2/evaluator/evaluator_communicate.py`, `CommunicateEvaluator.evaluate_communicate_info`: only assistant
  messages with non-blank text count, and the test is `info.lower() in content.lower().replace(",", "")` — commas are
  removed from the message but not from `info` (so "1000" matches "$1,000", and an info containing a comma never
  matches). One addition: `<think>` blocks are removed first, since private reasoning is not told to the user.
  """
  needle = info.lower()
  for message in conversation:
    if message.role != "assistant":
      continue
    text = visible_text(message.content)
    if text.strip() and needle in text.lower().replace(",", ""):
      return True
  return False


def match_gold_actions(
  golds: Sequence[GoldAction], calls: Sequence[ToolCall], arg_keys: Literal["strict", "tau2"] = "strict"
) -> list[int | None]:
  """One-to-one matching of gold actions to calls: for each gold action, the index of its call (None: unmatched).

  Each call satisfies at most one gold action and each gold action is matched at most once, so calling a tool twice
  does not pass one gold action twice, and two equal gold actions need two calls (τ² itself lets one call satisfy
  any number of gold actions). The rule: gold actions in order each take the earliest free call that matches
  (greedy); only when none is free may an earlier gold action be moved to another free call it also matches to make
  room (Kuhn's augmenting paths). The result is a largest possible matching, and equals plain greedy-in-order
  whenever greedy already finds one, which is the case unless candidate sets overlap (e.g. `compare_args` subsets).
  """
  ok = [[action_matches(g, c, arg_keys) for c in calls] for g in golds]
  owner: list[int | None] = [None] * len(calls)  # call -> gold

  def assign(g: int, seen: set[int]) -> bool:
    candidates = [c for c in range(len(calls)) if ok[g][c] and c not in seen]
    for c in sorted(candidates, key=lambda c: (owner[c] is not None, c)):  # free calls first, then in order
      seen.add(c)
      if owner[c] is None or assign(owner[c], seen):
        owner[c] = g
        return True
    return False

  for g in range(len(golds)):
    assign(g, set())
  result: list[int | None] = [None] * len(golds)
  for c, g in enumerate(owner):
    if g is not None:
      result[g] = c
  return result


def rule_checklist(
  task: Task,
  conversation: Sequence[ChatMessage],
  malformed_outputs: int = 0,
  config: RuleChecklistConfig | None = None,
) -> RewardInfo:
  """The offline checklist reward: weighted fraction of the task's rule items that the conversation passes.

  Items (breakdown keys): `action[i]:<name>` for each assistant-side gold action (user-side ones, e.g. τ² telecom's,
  are the user simulator's to take and are skipped), passed when `match_gold_actions` pairs it with one of the
  assistant's tool calls (`action_matches`, τ²'s comparison); `communicate[i]` for each `task.communicate_info`
  string (`info_communicated`, τ²'s rule); `well_formed`, scoring max(0, 1 - malformed_penalty * malformed_outputs).
  Each item weighs its kind's weight; reward = sum(weight * score) / sum(weight). Group keys `action` and
  `communicate` give each group's fraction passed. A task with no gold actions and no communicate_info is scored
  by well-formedness alone; if every item weighs 0, the reward is 1.0 (nothing to check, as τ²'s evaluators score a
  task without criteria). Checklist items in `task.criteria["checklists"]` need the LLM judge and are not scored
  here (their count is in `info["unscored_checklist_items"]`).

  Args:
    malformed_outputs: how many generations of the trajectory could not be parsed (recorded during the rollout).
    config: weights and matching rules; default `RuleChecklistConfig.from_config()` (the run defaults').

  Returns:
    RewardInfo with reward in [0, 1], per-item and per-group breakdown, and the matched call per action item in
    `info["matched_calls"]` (index into the assistant's tool calls, in conversation order).

  Raises:
    ValueError: `malformed_outputs` is negative.
  """
  config = config or RuleChecklistConfig.from_config()
  if malformed_outputs < 0:
    raise ValueError(f"malformed_outputs must be >= 0, got {malformed_outputs}")
  calls = [c for m in conversation if m.role == "assistant" for c in m.tool_calls]
  golds = [g for g in task.gold_actions if g.requestor == "assistant"]
  matched = match_gold_actions(golds, calls, config.arg_keys)

  items: list[tuple[str, float, float]] = []  # (key, weight, score)
  breakdown: dict[str, float] = {}
  action_keys = [f"action[{i}]:{g.name}" for i, g in enumerate(golds)]
  for key, m in zip(action_keys, matched, strict=True):
    items.append((key, config.action_weight, float(m is not None)))
  communicate = [float(info_communicated(info, conversation)) for info in task.communicate_info]
  for i, score in enumerate(communicate):
    items.append((f"communicate[{i}]", config.communicate_weight, score))
  items.append(("well_formed", config.well_formed_weight, max(0.0, 1.0 - config.malformed_penalty * malformed_outputs)))

  for key, _, score in items:
    breakdown[key] = score
  if golds:
    breakdown["action"] = sum(m is not None for m in matched) / len(golds)
  if communicate:
    breakdown["communicate"] = sum(communicate) / len(communicate)
  total = math.fsum(w for _, w, _ in items)
  reward = math.fsum(w * s for _, w, s in items) / total if total > 0 else 1.0
  checklists = task.criteria.get("checklists") or []
  info: dict[str, Any] = {
    "matched_calls": {k: m for k, m in zip(action_keys, matched, strict=True) if m is not None},
    "tool_calls": len(calls),
    "malformed_outputs": malformed_outputs,
    "user_actions_skipped": len(task.gold_actions) - len(golds),
    "unscored_checklist_items": sum(len(turn) for annotation in checklists[:1] for turn in annotation),
  }
  if total <= 0:
    info["note"] = "every item weighs 0: nothing to check, reward 1.0"
  return RewardInfo(reward=reward, breakdown=breakdown, info=info)
