"""The protocol every benchmark adapter speaks: `Task`, `ToolEnv`, tool calls, observations, rewards.

Benchmarks are model-free: text and tool calls go in, observations and rewards come out; the rehearsal package turns
sampled text into `ToolCall`s and `ChatMessage`s.

A conversation is a list of `ChatMessage` in the OpenAI chat layout (system / user / assistant with tool calls /
tool), the lingua franca of every benchmark we support.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal


def json_layout(value: Any) -> Any:
  """Mappings -> dicts, tuples -> lists: the layout JSON decoding produces, so ``==`` means JSON equality (values
  themselves are not coerced). Used to compare tool-call arguments."""
  if isinstance(value, Mapping):
    return {k: json_layout(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [json_layout(v) for v in value]
  return value


class EnvError(Exception):
  """A benchmark cannot be used as configured: unknown domain or split, missing data, unsupported feature.

  Raised at start-up (task loading, `reset`), never for a bad tool call during a rollout: those become error
  `Observation`s.
  """


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One function call by the agent (or one gold action).

  Attributes:
    name: tool (function) name as in the task's tool schemas.
    arguments: JSON-compatible keyword arguments.
    id: call id linking the call to its tool message ("" when the benchmark has none).
  """

  name: str
  arguments: Mapping[str, Any]
  id: str = ""

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, "arguments": dict(self.arguments), "id": self.id}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ToolCall:
    return cls(name=d["name"], arguments=dict(d.get("arguments") or {}), id=d.get("id", ""))


ChatRole = Literal["system", "user", "assistant", "tool"]
CHAT_ROLES = typing.get_args(ChatRole)


@dataclasses.dataclass(frozen=True)
class Observation:
  """A tool's response as the agent sees it.

  Attributes:
    text: the response text (JSON for structured results, the benchmark's error text for failures).
    is_error: True when the tool layer refused the call (unknown tool, bad arguments, a raised tool error).
  """

  text: str
  is_error: bool = False


@dataclasses.dataclass(frozen=True)
class ChatMessage:
  """One message of a conversation, OpenAI chat layout.

  Attributes:
    role: "system", "user", "assistant" or "tool".
    content: message text ("" for an assistant message that only calls tools).
    tool_calls: the assistant's calls, in order (assistant only).
    tool_call_id: for role "tool": the id of the call this message answers.
    name: for role "tool": the tool's name.
    is_error: for role "tool": the observation was an error.
  """

  role: ChatRole
  content: str = ""
  tool_calls: tuple[ToolCall, ...] = ()
  tool_call_id: str = ""
  name: str = ""
  is_error: bool = False

  def to_dict(self) -> dict[str, Any]:
    return {
      "role": self.role,
      "content": self.content,
      "tool_calls": [c.to_dict() for c in self.tool_calls],
      "tool_call_id": self.tool_call_id,
      "name": self.name,
      "is_error": self.is_error,
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ChatMessage:
    return cls(
      role=d["role"],
      content=d.get("content") or "",
      tool_calls=tuple(ToolCall.from_dict(c) for c in d.get("tool_calls") or ()),
      tool_call_id=d.get("tool_call_id", ""),
      name=d.get("name", ""),
      is_error=bool(d.get("is_error", False)),
    )


@dataclasses.dataclass(frozen=True)
class ReferenceInteraction:
  """A logged (tool, arguments, result): grounding for the rehearsing role (docs/method.md, a training step, step 1).

  For τ² it is produced by replaying a gold action on a fresh environment at data-preparation time; for the
  checklist format it is a logged tool result of the reference conversation.
  """

  name: str
  arguments: Mapping[str, Any]
  result: str
  is_error: bool = False

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, "arguments": dict(self.arguments), "result": self.result, "is_error": self.is_error}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ReferenceInteraction:
    return cls(d["name"], dict(d.get("arguments") or {}), d["result"], bool(d.get("is_error", False)))


@dataclasses.dataclass(frozen=True)
class GoldAction:
  """An action the agent is expected to take, as the benchmark states it.

  Attributes:
    name: tool name.
    arguments: the gold arguments.
    compare_args: the argument names the benchmark compares (None: all of them), e.g. τ²'s `Action.compare_args`.
    requestor: who takes it: "assistant" or "user" (τ² telecom has user-side actions).
  """

  name: str
  arguments: Mapping[str, Any]
  compare_args: tuple[str, ...] | None = None
  requestor: str = "assistant"

  def to_dict(self) -> dict[str, Any]:
    return {
      "name": self.name,
      "arguments": dict(self.arguments),
      "compare_args": None if self.compare_args is None else list(self.compare_args),
      "requestor": self.requestor,
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> GoldAction:
    ca = d.get("compare_args")
    compare_args = None if ca is None else tuple(ca)
    return cls(d["name"], dict(d.get("arguments") or {}), compare_args, d.get("requestor", "assistant"))


@dataclasses.dataclass(frozen=True)
class Task:
  """One benchmark task, everything a rollout and its reward need, JSON-serialisable (`to_dict`/`from_dict`).

  Attributes:
    id: the benchmark's task id (unique within benchmark/domain).
    benchmark: "tau2", "bfcl", "checklist", ...
    domain: e.g. "airline", "retail", "multi_turn_base".
    split: "train", "test", ... as the benchmark defines it ("all" when it has no split).
    system_prompt: the agent's policy / instructions (without the tool schemas).
    tools: OpenAI function schemas ({"type": "function", "function": {name, description, parameters}}).
    user_scenario: what the user simulator is told (τ²'s user instructions); "" when user turns are logged.
    user_turns: logged user messages, replayed in order instead of a simulator (BFCL, checklist format).
    gold_actions: the actions the benchmark expects (for the rule checklist reward).
    communicate_info: strings the agent must tell the user (τ²'s `communicate_info`).
    reference_interactions: grounding for REHEARSE (see `ReferenceInteraction`).
    criteria: benchmark-specific evaluation data (JSON-compatible), e.g. τ²'s evaluation_criteria, checklists.
    user_stop_markers: strings with which the user simulator ends the conversation.
  """

  id: str
  benchmark: str
  domain: str
  split: str
  system_prompt: str
  tools: tuple[Mapping[str, Any], ...]
  user_scenario: str = ""
  user_turns: tuple[str, ...] = ()
  gold_actions: tuple[GoldAction, ...] = ()
  communicate_info: tuple[str, ...] = ()
  reference_interactions: tuple[ReferenceInteraction, ...] = ()
  criteria: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  user_stop_markers: tuple[str, ...] = ()

  @property
  def tool_names(self) -> tuple[str, ...]:
    return tuple(t["function"]["name"] if "function" in t else t["name"] for t in self.tools)

  def to_dict(self) -> dict[str, Any]:
    return {
      "id": self.id,
      "benchmark": self.benchmark,
      "domain": self.domain,
      "split": self.split,
      "system_prompt": self.system_prompt,
      "tools": [dict(t) for t in self.tools],
      "user_scenario": self.user_scenario,
      "user_turns": list(self.user_turns),
      "gold_actions": [a.to_dict() for a in self.gold_actions],
      "communicate_info": list(self.communicate_info),
      "reference_interactions": [r.to_dict() for r in self.reference_interactions],
      "criteria": dict(self.criteria),
      "user_stop_markers": list(self.user_stop_markers),
    }

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Task:
    return cls(
      id=d["id"],
      benchmark=d["benchmark"],
      domain=d["domain"],
      split=d["split"],
      system_prompt=d["system_prompt"],
      tools=tuple(d["tools"]),
      user_scenario=d.get("user_scenario", ""),
      user_turns=tuple(d.get("user_turns", ())),
      gold_actions=tuple(GoldAction.from_dict(a) for a in d.get("gold_actions", ())),
      communicate_info=tuple(d.get("communicate_info", ())),
      reference_interactions=tuple(ReferenceInteraction.from_dict(r) for r in d.get("reference_interactions", ())),
      criteria=dict(d.get("criteria", {})),
      user_stop_markers=tuple(d.get("user_stop_markers", ())),
    )

  @classmethod
  def from_json(cls, text: str) -> Task:
    return cls.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True)
class RewardInfo:
  """A trajectory's score.

  Attributes:
    reward: in [0, 1], the benchmark's own reward where it has one.
    breakdown: named components in [0, 1] (e.g. τ²'s DB / ACTION / COMMUNICATE), for metrics.
    valid: False when the score could not be computed (e.g. an LLM-judge transport failure); an invalid trajectory
      is excluded from the update, never scored 0 (``reward`` is then NaN).
    info: anything else worth logging (JSON-compatible). ``info["scoring_error"]`` says why, when the scorer itself
      failed (the checker crashed, the judge gave no verdict); `envace_jax/scoring.py` counts those.
  """

  reward: float
  breakdown: Mapping[str, float] = dataclasses.field(default_factory=dict)
  valid: bool = True
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class ToolEnv(abc.ABC):
  """One benchmark environment instance: real tools with state, and the benchmark's evaluator.

  Usage per trajectory: `reset(task)` (fresh state — no state leaks between trajectories), then `execute` for each
  tool call of the committed execution, then `evaluate(conversation)`. Rollouts with world rehearsal never call
  `execute`: the rehearsing role stands in for it.
  """

  @abc.abstractmethod
  def reset(self, task: Task) -> None:
    """Start a fresh trajectory of `task` (fresh DB / backend state). Raises `EnvError` for a task it cannot run."""

  @abc.abstractmethod
  def execute(self, call: ToolCall) -> Observation:
    """Run `call` on the real tool. Never raises for a bad call: unknown tool, bad or mistyped arguments and tool
    errors come back as `Observation(text, is_error=True)` with the tool layer's own message."""

  @abc.abstractmethod
  def evaluate(self, conversation: Sequence[ChatMessage]) -> RewardInfo:
    """Score the conversation of the current trajectory with the benchmark's own evaluator."""

  def answer(self, call: ToolCall) -> ChatMessage:
    """`execute(call)` as the conversation records it: the tool message answering ``call`` (its id and name, the
    real text, ``is_error``)."""
    obs = self.execute(call)
    return ChatMessage("tool", obs.text, tool_call_id=call.id, name=call.name, is_error=obs.is_error)

  def state_hash(self) -> str:
    """A hash of the environment's mutable state (the DB), to prove that something did not touch it."""
    return hashlib.sha256(json.dumps(self.state_dict(), sort_keys=True, default=str).encode()).hexdigest()

  def state_dict(self) -> Any:
    """The mutable state as JSON-compatible data. Adapters override it."""
    raise NotImplementedError(f"{type(self).__name__} does not expose its state")
