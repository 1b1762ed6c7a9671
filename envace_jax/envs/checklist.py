"""The paper's own training data: checklist-annotated tool-use conversations (the CM2 format), as `Task`s.

EnvACE (arXiv 2608.06197) trains on logged multi-turn tool-use conversations whose every user turn carries a checklist
of binary, evidence-grounded criteria, the format of CM2 (Zhang et al. 2026, "RL with Checklist Rewards for
Multi-Turn and Multi-Step Agentic Tool Use", github.com/namezhenzhang/CM2-RLCR-Tool-Agent,
`pipeline/4_checklist_labeling/checklist_data/checklist_annotated.json`). One record::

  {"uuid": "...", "domain": "sports" (optional), "split": "train" (optional),
   "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "...",
                 "tool_calls": [{"id": "...", "type": "function",
                                 "function": {"name": "...", "arguments": "{...}" or {...}}}],
                 "tool_call_id": "..." (optional)}, ...],
   "tools": [OpenAI function specs],
   "checklists": [annotation, ...]}            # several independent annotations of the same conversation
  annotation = [turn_0, turn_1, ...]           # one per user turn
  turn       = [item, ...]                     # or CM2's labelling layout {"checklist": [item, ...],
                                               #   "dependence": {id: [ids]}, "weight": {id: w}}
  item       = {"id", "question", "focus_on", "pass_condition", "failure_examples": [str],
                "evidence": [{"turn", "step", "from", "snippet"}], "required_for_next_turn": bool,
                "dependence": [ids of items of the same turn], "weight": float}

Turns and steps are CM2's: turn k is the k-th user message and everything up to the next one; step 0 is the user
message and every later message of the turn (assistant or tool) is one more step. A system message may only come
first. A tool message answers the pending call with its `tool_call_id`, or, without one (CM2 logs have none), the
oldest pending call of the preceding assistant message.

The mapping to `Task` (benchmark "checklist"): user messages -> `user_turns` (replayed, no user simulator); the system
message -> `system_prompt`; every logged (call, result) -> `reference_interactions` (the grounding for REHEARSE); the
assistant's calls whose logged result is not an error -> `gold_actions` (failed attempts in the log are not gold;
a result is an error when the tool message says `is_error` or its JSON has a truthy "error" or an "error_tool_call"
key, CM2's convention); the annotations, normalised to the item layout above with defaults filled in, ->
`criteria["checklists"]` (`rl.judge.ChecklistJudge` judges them; an item `required_for_next_turn` that fails ends
the trajectory before the next user turn, `scoring.turn_gate`), and the number of steps per turn ->
`criteria["turn_steps"]`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from absl import logging

from envace_jax.envs.base import (
  CHAT_ROLES,
  ChatMessage,
  EnvError,
  GoldAction,
  Observation,
  ReferenceInteraction,
  RewardInfo,
  Task,
  ToolCall,
  ToolEnv,
  json_layout,
)

BENCHMARK = "checklist"
WEIGHT_TOLERANCE = 1e-6  # |sum of a turn's weights - 1| allowed
_REQUIRED_RECORD_KEYS = ("uuid", "messages", "tools", "checklists")
_REQUIRED_ITEM_KEYS = ("id", "question", "focus_on", "pass_condition", "weight")

Scorer = Callable[[Task, Sequence[ChatMessage]], RewardInfo]


def load_tasks(
  path: str | Path, *, domain: str = BENCHMARK, split: str = "train", skip_invalid: bool = False
) -> list[Task]:
  """Loads checklist-format records as `Task`s, validating every record.

  Args:
    path: a JSONL file (one record per line), a JSON file (a list of records, or one record), or a folder whose
      `*.json` / `*.jsonl` files are read in name order.
    domain: `Task.domain` for records without a "domain" key.
    split: `Task.split` for records without a "split" key.
    skip_invalid: log and skip malformed records instead of raising (for large LLM-annotated corpora).

  Returns:
    The tasks, in file order.

  Raises:
    EnvError: the path does not exist or holds no records; a file is not valid JSON; a record is malformed (the
      message names the record by uuid and file position, and the problem: a missing key, weights of a turn not
      summing to 1 within 1e-6, evidence pointing to a turn or step that does not exist, a tool call without a result,
      ...); two records share a uuid. With `skip_invalid`, malformed records are skipped and only the others raise.
  """
  path = Path(path)
  if path.is_dir():
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".jsonl"))
  elif path.is_file():
    files = [path]
  else:
    raise EnvError(f"checklist data {str(path)!r} does not exist")
  tasks: list[Task] = []
  seen: dict[str, str] = {}
  for file in files:
    for where, record in _read_records(file):
      try:
        task = record_to_task(record, where=where, domain=domain, split=split)
      except EnvError as e:
        if not skip_invalid:
          raise
        logging.warning("skipping malformed checklist record: %s", e)
        continue
      if task.id in seen:
        raise EnvError(f"record {task.id!r} at {where}: uuid already used by the record at {seen[task.id]}")
      seen[task.id] = where
      tasks.append(task)
  if not tasks:
    raise EnvError(f"checklist data {str(path)!r} holds no (valid) records")
  return tasks


def _read_records(file: Path) -> Iterator[tuple[str, Any]]:
  """Yields (position, record) pairs; position is `file:line` for JSONL, `file[index]` for a JSON list."""
  text = file.read_text(encoding="utf-8")
  stripped = text.lstrip()
  if stripped.startswith("["):
    try:
      records = json.loads(text)
    except json.JSONDecodeError as e:
      raise EnvError(f"{file}: not valid JSON ({e})") from e
    for i, record in enumerate(records):
      yield f"{file}[{i}]", record
    return
  if stripped.startswith("{"):
    try:  # one pretty-printed record
      yield f"{file}", json.loads(text)
      return
    except json.JSONDecodeError:
      pass  # JSONL
  for lineno, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise EnvError(f"{file}:{lineno}: not valid JSON ({e})") from e
    yield f"{file}:{lineno}", record


def record_to_task(record: Any, *, where: str = "<record>", domain: str = BENCHMARK, split: str = "train") -> Task:
  """Validates one checklist-format record and maps it to a `Task` (see the module docstring for the mapping).

  Args:
    where: its position, for error messages (e.g. `data.jsonl:12`).
    domain: `Task.domain` when the record has no "domain".
    split: `Task.split` when the record has no "split".

  Raises:
    EnvError: the record is malformed; the message starts with `record '<uuid>' at <where>`.
  """
  if not isinstance(record, Mapping):
    raise EnvError(f"record at {where}: expected a JSON object, got {type(record).__name__}")
  uuid = record.get("uuid")
  name = f"record {uuid!r} at {where}" if isinstance(uuid, str) and uuid else f"record at {where}"
  for key in _REQUIRED_RECORD_KEYS:
    if key not in record:
      raise EnvError(f"{name}: missing key {key!r}")
  if not isinstance(uuid, str) or not uuid:
    raise EnvError(f"{name}: 'uuid' must be a non-empty string, got {uuid!r}")

  def fail(problem: str) -> EnvError:
    return EnvError(f"{name}: {problem}")

  for key in ("domain", "split"):
    if key in record and (not isinstance(record[key], str) or not record[key]):
      raise fail(f"{key!r} must be a non-empty string, got {record[key]!r}")
  tools = _parse_tools(record["tools"], fail)
  messages = record["messages"]
  if not isinstance(messages, list) or not messages:
    raise fail("'messages' must be a non-empty list")
  system_prompt, turns, interactions, gold = _parse_messages(messages, fail)
  checklists = _parse_checklists(record["checklists"], [len(t) for t in turns], fail)
  return Task(
    id=uuid,
    benchmark=BENCHMARK,
    domain=record.get("domain", domain),
    split=record.get("split", split),
    system_prompt=system_prompt,
    tools=tools,
    user_turns=tuple(t[0] for t in turns),
    gold_actions=tuple(gold),
    reference_interactions=tuple(interactions),
    criteria={"checklists": checklists, "turn_steps": [len(t) for t in turns]},
  )


def _parse_tools(tools: Any, fail: Callable[[str], EnvError]) -> tuple[dict[str, Any], ...]:
  """OpenAI function specs, each as {"type": "function", "function": {...}}; bare {"name", ...} specs are wrapped."""
  if not isinstance(tools, list):
    raise fail("'tools' must be a list of OpenAI function specs")
  out, names = [], set()
  for i, tool in enumerate(tools):
    spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
      raise fail(f"tools[{i}] is not an OpenAI function spec with a name")
    if spec["name"] in names:
      raise fail(f"tools[{i}]: tool {spec['name']!r} declared twice")
    names.add(spec["name"])
    out.append({"type": "function", "function": dict(spec)})
  return tuple(out)


def _parse_call(raw: Any, where: str, fail: Callable[[str], EnvError]) -> ToolCall:
  """An OpenAI tool call ({"id", "function": {"name", "arguments"}}, arguments a JSON string or an object)."""
  fn = raw.get("function", raw) if isinstance(raw, Mapping) else None
  if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
    raise fail(f"{where} is not a tool call with a function name")
  args = fn.get("arguments")
  if isinstance(args, str):
    try:
      args = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as e:
      raise fail(f"{where} ({fn['name']}): arguments are not valid JSON ({e})") from e
  if args is None:
    args = {}
  if not isinstance(args, Mapping):
    raise fail(f"{where} ({fn['name']}): arguments must be a JSON object, got {type(args).__name__}")
  call_id = raw.get("id") or ""
  if not isinstance(call_id, str):
    raise fail(f"{where}: call id must be a string, got {call_id!r}")
  return ToolCall(name=fn["name"], arguments=dict(args), id=call_id)


def _is_error_result(message: Mapping[str, Any]) -> bool:
  if message.get("is_error"):
    return True
  try:
    data = json.loads(message.get("content") or "")
  except (json.JSONDecodeError, TypeError):
    return False
  return isinstance(data, dict) and (bool(data.get("error")) or "error_tool_call" in data)


def _parse_messages(
  messages: list[Any], fail: Callable[[str], EnvError]
) -> tuple[str, list[list[str]], list[ReferenceInteraction], list[GoldAction]]:
  """Walks the conversation: (system prompt, turns as lists of step contents, interactions, gold actions)."""
  system_prompt = ""
  turns: list[list[str]] = []
  pending: list[tuple[int, ToolCall]] = []  # (slot, call) of the last assistant message's calls awaiting a result
  results: list[ReferenceInteraction | None] = []  # one slot per call, in call order (results may come in any order)

  def unanswered() -> EnvError:
    calls = ", ".join(f"{c.name}(id={c.id!r})" for _, c in pending)
    return fail(f"tool call without result: {calls}")

  for i, msg in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(msg, Mapping) or msg.get("role") not in CHAT_ROLES:
      role = msg.get("role") if isinstance(msg, Mapping) else msg
      raise fail(f"{where}: role must be one of {CHAT_ROLES}, got {role!r}")
    content = msg.get("content")
    if content is None:
      content = ""
    if not isinstance(content, str):
      raise fail(f"{where}: content must be a string, got {type(content).__name__}")
    role = msg["role"]
    if role == "system":
      if i != 0:
        raise fail(f"{where}: a system message may only be the first message")
      system_prompt = content
      continue
    if role != "tool" and pending:
      raise unanswered()
    if role == "user":
      turns.append([content])
      continue
    if not turns:
      raise fail(f"{where}: the conversation must start with a user message (after an optional system message)")
    turns[-1].append(content)
    if role == "assistant":
      raw_calls = msg.get("tool_calls") or []
      if not isinstance(raw_calls, list):
        raise fail(f"{where}: tool_calls must be a list")
      calls = [_parse_call(c, f"{where}.tool_calls[{j}]", fail) for j, c in enumerate(raw_calls)]
      pending = [(len(results) + j, c) for j, c in enumerate(calls)]
      results.extend([None] * len(calls))
      ids = [c.id for c in calls if c.id]
      if len(ids) != len(set(ids)):
        raise fail(f"{where}: repeated tool call ids {ids}")
      continue
    # role == "tool"
    if not pending:
      raise fail(f"{where}: tool message answers no pending tool call")
    call_id = msg.get("tool_call_id") or ""
    if call_id:
      matches = [k for k, (_, c) in enumerate(pending) if c.id == call_id]
      if not matches:
        raise fail(f"{where}: tool_call_id {call_id!r} matches no pending call of the preceding assistant message")
      slot, call = pending.pop(matches[0])
    else:
      slot, call = pending.pop(0)
    results[slot] = ReferenceInteraction(call.name, call.arguments, content, _is_error_result(msg))
  if pending:
    raise unanswered()
  if not turns:
    raise fail("the conversation has no user message")
  interactions = [r for r in results if r is not None]  # all filled: every call got its result
  gold = [GoldAction(r.name, r.arguments) for r in interactions if not r.is_error]
  return system_prompt, turns, interactions, gold


def _parse_checklists(
  raw: Any, turn_steps: list[int], fail: Callable[[str], EnvError]
) -> list[list[list[dict[str, Any]]]]:
  """Validates and normalises the annotations (see the module docstring for the layout)."""
  if not isinstance(raw, list) or not raw:
    raise fail("'checklists' must be a non-empty list of annotations (each a list of per-turn checklists)")
  out = []
  for a, annotation in enumerate(raw):
    if not isinstance(annotation, list) or len(annotation) != len(turn_steps):
      n = len(annotation) if isinstance(annotation, list) else type(annotation).__name__
      raise fail(f"checklists[{a}] must have one checklist per user turn ({len(turn_steps)}), got {n}")
    out.append([_parse_turn(turn, f"checklists[{a}][{t}]", turn_steps, fail) for t, turn in enumerate(annotation)])
  return out


def _parse_turn(turn: Any, where: str, turn_steps: list[int], fail: Callable[[str], EnvError]) -> list[dict[str, Any]]:
  dependence: Mapping[str, Any] = {}
  weights: Mapping[str, Any] = {}
  if isinstance(turn, Mapping):  # CM2's labelling layout
    if "checklist" not in turn:
      raise fail(f"{where}: missing key 'checklist'")
    dependence, weights = turn.get("dependence") or {}, turn.get("weight") or {}
    if not isinstance(dependence, Mapping) or not isinstance(weights, Mapping):
      raise fail(f"{where}: 'dependence' and 'weight' must be objects keyed by item id")
    turn = turn["checklist"]
  if not isinstance(turn, list) or not turn:
    raise fail(f"{where}: a turn's checklist must be a non-empty list of items")
  items = []
  for k, raw_item in enumerate(turn):
    iw = f"{where}[{k}]"
    if not isinstance(raw_item, Mapping):
      raise fail(f"{iw}: a checklist item must be an object")
    item = dict(raw_item)
    item_id = item.get("id")
    if isinstance(item_id, str):
      item.setdefault("weight", weights.get(item_id))
      item.setdefault("dependence", dependence.get(item_id, []))
      if item["weight"] is None:
        del item["weight"]
      iw = f"{iw} (id {item_id!r})"
    for key in _REQUIRED_ITEM_KEYS:
      if key not in item:
        raise fail(f"{iw}: missing key {key!r}")
    for key in ("id", "question", "focus_on", "pass_condition"):
      if not isinstance(item[key], str):
        raise fail(f"{iw}: {key!r} must be a string")
    weight = item["weight"]
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
      raise fail(f"{iw}: weight must be a finite number >= 0, got {weight!r}")
    failure_examples = item.get("failure_examples", [])
    if not isinstance(failure_examples, list) or not all(isinstance(x, str) for x in failure_examples):
      raise fail(f"{iw}: failure_examples must be a list of strings")
    deps = item.get("dependence", [])
    if not isinstance(deps, list) or not all(isinstance(x, str) for x in deps):
      raise fail(f"{iw}: dependence must be a list of item ids")
    required = item.get("required_for_next_turn", False)
    if not isinstance(required, bool):
      raise fail(f"{iw}: required_for_next_turn must be a boolean")
    evidence = item.get("evidence", [])
    if not isinstance(evidence, list):
      raise fail(f"{iw}: evidence must be a list")
    items.append(
      {
        "id": item["id"],
        "question": item["question"],
        "focus_on": item["focus_on"],
        "pass_condition": item["pass_condition"],
        "failure_examples": list(failure_examples),
        "evidence": [_parse_evidence(e, f"{iw}.evidence[{j}]", turn_steps, fail) for j, e in enumerate(evidence)],
        "required_for_next_turn": required,
        "dependence": list(deps),
        "weight": float(weight),
      }
    )
  ids = [it["id"] for it in items]
  if len(set(ids)) != len(ids):
    raise fail(f"{where}: repeated item ids {ids}")
  for it in items:
    unknown = [d for d in it["dependence"] if d not in ids or d == it["id"]]
    if unknown:
      raise fail(f"{where}: item {it['id']!r} depends on {unknown}, not other items of this turn ({ids})")
  total = math.fsum(it["weight"] for it in items)
  if abs(total - 1.0) > WEIGHT_TOLERANCE:
    raise fail(f"{where}: item weights sum to {total!r}, not 1 (tolerance {WEIGHT_TOLERANCE})")
  return items


def _parse_evidence(ev: Any, where: str, turn_steps: list[int], fail: Callable[[str], EnvError]) -> dict[str, Any]:
  if not isinstance(ev, Mapping):
    raise fail(f"{where}: evidence must be an object")
  for key in ("turn", "step"):
    if key not in ev:
      raise fail(f"{where}: missing key {key!r}")
    if isinstance(ev[key], bool) or not isinstance(ev[key], int):
      raise fail(f"{where}: {key!r} must be an integer, got {ev[key]!r}")
  turn, step = ev["turn"], ev["step"]
  if not 0 <= turn < len(turn_steps):
    raise fail(f"{where}: evidence points to turn {turn}, but the conversation has {len(turn_steps)} user turns")
  if not 0 <= step < turn_steps[turn]:
    raise fail(f"{where}: evidence points to step {step} of turn {turn}, which has {turn_steps[turn]} steps")
  source, snippet = ev.get("from", ""), ev.get("snippet", "")
  if not isinstance(source, str) or not isinstance(snippet, str):
    raise fail(f"{where}: 'from' and 'snippet' must be strings")
  return {"turn": turn, "step": step, "from": source, "snippet": snippet}


class ChecklistEnv(ToolEnv):
  """Replays a checklist task's logged tool results; scores with an injected scorer.

  The format has no tool backend (the logged results are all there is), so `execute` answers a call only when the
  reference conversation logged the same tool with equal arguments (Python equality of the decoded JSON, as τ²
  compares arguments: 1 == 1.0, "1" != 1). A call logged several times replays its results in logged order, then
  repeats the last. Anything else is an error `Observation`.

  Args:
    scorer: `(task, conversation) -> RewardInfo` (envs import no RL code): `rl.rewards.rule_checklist` (offline, gold
      actions only) or `rl.judge.ChecklistJudge` (the paper's LLM judge); None: `evaluate` raises `EnvError`.
  """

  def __init__(self, scorer: Scorer | None = None):
    self._scorer = scorer
    self._task: Task | None = None
    self._replayed: dict[int, int] = {}  # index of a reference interaction -> times replayed

  def reset(self, task: Task) -> None:
    """Starts a trajectory of `task`. Raises `EnvError` for a task of another benchmark."""
    if task.benchmark != BENCHMARK:
      raise EnvError(f"ChecklistEnv runs {BENCHMARK!r} tasks; task {task.id!r} is from {task.benchmark!r}")
    self._task = task
    self._replayed = {}

  def _require_task(self) -> Task:
    if self._task is None:
      raise EnvError("ChecklistEnv: call reset(task) first")
    return self._task

  def execute(self, call: ToolCall) -> Observation:
    """The logged result of an equal call, or an error `Observation`. Raises `EnvError` only before `reset`."""
    task = self._require_task()
    if call.name not in task.tool_names:
      return Observation(f"Error: unknown tool {call.name!r}; available tools: {list(task.tool_names)}", True)
    args = json_layout(call.arguments)
    logged = [
      i for i, r in enumerate(task.reference_interactions) if r.name == call.name and json_layout(r.arguments) == args
    ]
    if not logged:
      text = (
        f"Error: no logged result for this call: {call.name}({json.dumps(args, sort_keys=True, default=str)}). "
        "The checklist format has no tool backend; only calls logged in the reference conversation replay."
      )
      return Observation(text, is_error=True)
    fresh = [i for i in logged if i not in self._replayed]
    index = fresh[0] if fresh else logged[-1]
    self._replayed[index] = self._replayed.get(index, 0) + 1
    ref = task.reference_interactions[index]
    return Observation(ref.result, ref.is_error)

  def evaluate(self, conversation: Sequence[ChatMessage]) -> RewardInfo:
    """Scores `conversation` with the scorer given at construction.

    Raises:
      EnvError: before `reset`, or when no scorer was given.
    """
    task = self._require_task()
    if self._scorer is None:
      raise EnvError(
        "ChecklistEnv has no scorer: this format has no backend to evaluate against. Construct it with "
        "scorer=envace_jax.rl.rewards.rule_checklist (offline, gold actions) or "
        "scorer=envace_jax.rl.judge.ChecklistJudge(JudgeConfig.from_config(base_url=..., model=...)) (the paper's "
        "LLM judge over the checklists)."
      )
    return self._scorer(task, conversation)

  def state_dict(self) -> Any:
    """Which logged results have been replayed, and how often (the only state this environment has)."""
    return {"task": None if self._task is None else self._task.id, "replayed": dict(sorted(self._replayed.items()))}
