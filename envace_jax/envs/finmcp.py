"""FinMCP-Bench (Zhu et al. 2026, arXiv 2603.24943; Qwen DianJin, huggingface.co/datasets/DianJin/FinMCP-Bench,
CC BY-NC-SA 4.0) as `Task`s, scored offline by tool precision / recall / F1 over the called tool names.

613 Chinese samples over 65 financial MCP tools (Qieman's servers), of three types: single tool (145), multi-tool
(249, sequential or parallel calls in one turn) and multi-turn (219). The data is not on PyPI (`DOWNLOAD_HINT`).

Format. The sample layout could not be read from a public source here (the dataset card names the sample types and
says the MCP server URL and schema come from Qieman; the paper names the metrics). This module reads the OpenAI chat
layout the dataset's reference trajectories need, one record per sample::

  {"id": "fin-0001",                                # or "uuid"; a string or an integer
   "type": "single_tool" | "multi_tool" | "multi_turn",     # optional, kept in criteria
   "scenario": "...", "sub_scenario": "...",                 # optional, kept in criteria
   "messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "...",
                 "tool_calls": [{"id": "...", "type": "function",
                                 "function": {"name": "...", "arguments": "{...}" or {...}}}],
                 "tool_call_id": "..." (optional)}, ...],
   "tools": [OpenAI function specs, or MCP tool specs {"name", "description", "inputSchema"}]}

A file is JSONL, a JSON list or one JSON object; records without "tools" take the shared list of the data folder's
`tools.json` (`load_tasks`). A tool message answers the pending call with its `tool_call_id`, or else the oldest one.

Mapping to `Task` (benchmark "finmcp", domain "all" or the sample type loaded, split "test"): the system message ->
`system_prompt`; user messages -> `user_turns` (replayed, no user simulator); every reference call -> `gold_actions`
(the reference tool names, in call order, also in `criteria["reference_tools"]`); every logged (call, result) ->
`reference_interactions` (REHEARSE's grounding: it stands in for the MCP servers).

Scoring (`tool_scores`, `FinMcpEnv.evaluate`). Per sample, over the multiset of tool names the agent called in the
whole conversation (P) and the multiset of the reference's calls (R), with overlap |P ∩ R| = Σ_name min(P[name],
R[name]): tool precision = overlap / |P|, tool recall = overlap / |R|, TF1 = their harmonic mean (0 when both are 0);
no calls on either side scores 1, calls on one side only score 0. A benchmark's TF1 is the mean of the per-sample
TF1s (`mean_scores`). The paper (arXiv 2603.24943) reports tool precision, recall, F1 and an exact-match rate; its
exact formulas were not available here, so counting repeated calls (multiset, not set) is our reading, switchable
with `count_repeats=False`. `name_sequence_match` (1 when the called names equal the reference names in order) is
ours, not the paper's EMR, which may compare arguments too. Arguments are not scored.

Execution. The tools are Qieman's live MCP servers, which this project does not reach: `FinMcpEnv.execute` answers
every call with `LIVE_EXECUTION_ERROR`, so rollouts rehearse them; `evaluate` needs no server.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
)

BENCHMARK = "finmcp"
SHARED_TOOLS_FILE = "tools.json"
SAMPLE_TYPES = ("single_tool", "multi_tool", "multi_turn")
DOMAINS = ("all", *SAMPLE_TYPES)  # env.domain: every sample, or one type
DOWNLOAD_HINT = (
  "FinMCP-Bench is not on PyPI: download it from https://huggingface.co/datasets/DianJin/FinMCP-Bench (or "
  "https://modelscope.cn/datasets/tongyi_dianjin/FinMCP-Bench) and pass --config.env.data_path=/path/to/FinMCP-Bench "
  "(a .json/.jsonl file or the folder)"
)
LIVE_EXECUTION_ERROR = (
  "Error: FinMCP-Bench's tools are live MCP servers (Qieman), which are not reachable here; live execution needs "
  "them. Run with rollout.env_mode='rehearse': the rehearsing role stands in for the servers."
)


def load_tasks(path: str | Path, domain: str = "all", *, skip_invalid: bool = False) -> list[Task]:
  """Loads FinMCP-Bench samples as `Task`s, validating every record.

  Args:
    path: a .json/.jsonl file, or a folder whose `*.json` / `*.jsonl` files are read in name order (a `tools.json`
      there is the shared tool list, not samples).
    domain: "all", or one of `SAMPLE_TYPES` to keep only the records of that "type"; becomes `Task.domain`.
    skip_invalid: log and skip malformed records instead of raising.

  Returns:
    The tasks, in file order.

  Raises:
    EnvError: the path does not exist or holds no samples; a file is not valid JSON; a malformed record (the message
      names the file and line or index, the record's id, and the problem: a missing key, a call without a result,
      arguments that are not a JSON object, a call to a tool the record does not declare, ...); a repeated id; an
      unknown domain.
  """
  if domain not in DOMAINS:
    raise EnvError(f"unknown FinMCP-Bench domain {domain!r}; choose one of {list(DOMAINS)}")
  path = Path(path).expanduser()
  shared: tuple[dict[str, Any], ...] | None = None
  if path.is_dir():
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".jsonl"))
    tools_file = path / SHARED_TOOLS_FILE
    if tools_file in files:
      files.remove(tools_file)
      shared = _read_shared_tools(tools_file)
  elif path.is_file():
    files = [path]
  else:
    raise EnvError(f"FinMCP-Bench data {str(path)!r} does not exist. {DOWNLOAD_HINT}")
  tasks: list[Task] = []
  seen: dict[str, str] = {}
  for file in files:
    for where, record in _read_records(file):
      try:
        task = record_to_task(record, where=where, shared_tools=shared, domain=domain)
      except EnvError as e:
        if not skip_invalid:
          raise
        logging.warning("skipping malformed FinMCP-Bench record: %s", e)
        continue
      if task.id in seen:
        raise EnvError(f"record {task.id!r} at {where}: id already used by the record at {seen[task.id]}")
      seen[task.id] = where
      if domain == "all" or task.criteria["type"] == domain:
        tasks.append(task)
  if not tasks:
    kind = "samples" if domain == "all" else f"samples of type {domain!r}"
    raise EnvError(f"FinMCP-Bench data {str(path)!r} holds no (valid) {kind}. {DOWNLOAD_HINT}")
  return tasks


def _read_records(file: Path) -> Iterator[tuple[str, Any]]:
  """(position, record): `file:line` for JSONL, `file[index]` for a JSON list, `file` for one JSON object."""
  text = file.read_text(encoding="utf-8")
  stripped = text.lstrip()
  if stripped.startswith(("[", "{")):
    try:
      data = json.loads(text)
    except json.JSONDecodeError:
      data = None  # JSONL (several objects), read line by line below
      if stripped.startswith("["):
        raise EnvError(f"{file}: not valid JSON") from None
    if isinstance(data, list):
      for i, record in enumerate(data):
        yield f"{file}[{i}]", record
      return
    if data is not None:
      yield str(file), data
      return
  for lineno, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise EnvError(f"{file}:{lineno}: not valid JSON ({e})") from e
    yield f"{file}:{lineno}", record


def _read_shared_tools(file: Path) -> tuple[dict[str, Any], ...]:
  try:
    data = json.loads(file.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise EnvError(f"{file}: not valid JSON ({e})") from e
  if isinstance(data, Mapping) and isinstance(data.get("tools"), list):
    data = data["tools"]  # an MCP tools/list result
  return parse_tools(data, lambda problem: EnvError(f"{file}: {problem}"))


def parse_tools(tools: Any, fail: Callable[[str], EnvError]) -> tuple[dict[str, Any], ...]:
  """OpenAI function specs from OpenAI specs ({"type": "function", "function": {...}} or bare {"name", ...}) or MCP
  tool specs ({"name", "description", "inputSchema"}: inputSchema becomes "parameters").

  Raises:
    EnvError (from `fail`): not a list, a spec without a name, a name declared twice.
  """
  if not isinstance(tools, list):
    raise fail("'tools' must be a list of tool specs (OpenAI or MCP)")
  out, names = [], set()
  for i, tool in enumerate(tools):
    spec = tool.get("function", tool) if isinstance(tool, Mapping) else None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
      raise fail(f"tools[{i}] is not a tool spec with a name")
    if spec["name"] in names:
      raise fail(f"tools[{i}]: tool {spec['name']!r} declared twice")
    names.add(spec["name"])
    spec = dict(spec)
    if "inputSchema" in spec and "parameters" not in spec:
      spec["parameters"] = spec.pop("inputSchema")
    out.append({"type": "function", "function": spec})
  return tuple(out)


def record_to_task(
  record: Any, *, where: str = "<record>", shared_tools: Sequence[Mapping] | None = None, domain: str = "all"
) -> Task:
  """Validates one FinMCP-Bench record and maps it to a `Task` (see the module docstring).

  Args:
    where: its position, for error messages (e.g. `data.jsonl:12`).
    shared_tools: the tool list for a record without "tools".
    domain: `Task.domain`.

  Raises:
    EnvError: the record is malformed; the message starts with `record '<id>' at <where>`.
  """
  if not isinstance(record, Mapping):
    raise EnvError(f"record at {where}: expected a JSON object, got {type(record).__name__}")
  raw_id = record.get("id", record.get("uuid"))
  task_id = str(raw_id) if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) else ""
  name = f"record {task_id!r} at {where}" if task_id else f"record at {where}"

  def fail(problem: str) -> EnvError:
    return EnvError(f"{name}: {problem}")

  if "id" not in record and "uuid" not in record:
    raise fail("missing key 'id'")
  if not task_id:
    raise fail(f"'id' must be a non-empty string or an integer, got {raw_id!r}")
  if "messages" not in record:
    raise fail("missing key 'messages'")
  if "tools" in record:
    tools = parse_tools(record["tools"], fail)
  elif shared_tools is not None:
    tools = tuple(shared_tools)
  else:
    raise fail(f"missing key 'tools' (and no shared {SHARED_TOOLS_FILE} next to the data)")
  sample_type = record.get("type", "")
  if sample_type and sample_type not in SAMPLE_TYPES:
    raise fail(f"'type' must be one of {list(SAMPLE_TYPES)}, got {sample_type!r}")
  messages = record["messages"]
  if not isinstance(messages, list) or not messages:
    raise fail("'messages' must be a non-empty list")
  system_prompt, user_turns, interactions = _parse_messages(messages, fail)
  declared = {t["function"]["name"] for t in tools}
  undeclared = sorted({r.name for r in interactions} - declared)
  if undeclared:
    raise fail(f"the reference calls tools the record does not declare: {undeclared}")
  return Task(
    id=task_id,
    benchmark=BENCHMARK,
    domain=domain,
    split="test",
    system_prompt=system_prompt,
    tools=tools,
    user_turns=tuple(user_turns),
    gold_actions=tuple(GoldAction(r.name, r.arguments) for r in interactions),
    reference_interactions=tuple(interactions),
    criteria={
      "reference_tools": [r.name for r in interactions],
      "type": sample_type,
      "scenario": record.get("scenario", ""),
      "sub_scenario": record.get("sub_scenario", ""),
    },
  )


def _parse_call(raw: Any, where: str, fail: Callable[[str], EnvError]) -> ToolCall:
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
  return ToolCall(fn["name"], dict(args), call_id)


def _parse_messages(
  messages: list[Any], fail: Callable[[str], EnvError]
) -> tuple[str, list[str], list[ReferenceInteraction]]:
  """(system prompt, user turns, the reference's (call, result) pairs in call order)."""
  system_prompt, user_turns = "", []
  pending: list[tuple[int, ToolCall]] = []  # (slot, call) awaiting a result
  results: list[ReferenceInteraction | None] = []
  for i, msg in enumerate(messages):
    where = f"messages[{i}]"
    role = msg.get("role") if isinstance(msg, Mapping) else None
    if role not in CHAT_ROLES:
      raise fail(f"{where}: role must be one of {CHAT_ROLES}, got {role!r}")
    content = msg.get("content")
    content = "" if content is None else content
    if not isinstance(content, str):
      raise fail(f"{where}: content must be a string, got {type(content).__name__}")
    if role != "tool" and pending:
      raise fail(f"{where}: tool call without result: {', '.join(c.name for _, c in pending)}")
    if role == "system":
      if i != 0:
        raise fail(f"{where}: a system message may only be the first message")
      system_prompt = content
    elif role == "user":
      user_turns.append(content)
    elif not user_turns:
      raise fail(f"{where}: the conversation must start with a user message (after an optional system message)")
    elif role == "assistant":
      raw_calls = msg.get("tool_calls") or []
      if not isinstance(raw_calls, list):
        raise fail(f"{where}: tool_calls must be a list")
      calls = [_parse_call(c, f"{where}.tool_calls[{j}]", fail) for j, c in enumerate(raw_calls)]
      pending = [(len(results) + j, c) for j, c in enumerate(calls)]
      results.extend([None] * len(calls))
    else:  # tool
      if not pending:
        raise fail(f"{where}: tool message answers no pending tool call")
      call_id = msg.get("tool_call_id") or ""
      matches = [k for k, (_, c) in enumerate(pending) if c.id == call_id] if call_id else [0]
      if not matches:
        raise fail(f"{where}: tool_call_id {call_id!r} matches no pending call of the preceding assistant message")
      slot, call = pending.pop(matches[0])
      results[slot] = ReferenceInteraction(call.name, call.arguments, content, bool(msg.get("is_error", False)))
  if pending:
    raise fail(f"tool call without result: {', '.join(c.name for _, c in pending)}")
  if not user_turns:
    raise fail("the conversation has no user message")
  return system_prompt, user_turns, [r for r in results if r is not None]


def called_tools(conversation: Iterable[ChatMessage]) -> list[str]:
  """The tool names of every assistant call in `conversation`, in order."""
  return [c.name for m in conversation if m.role == "assistant" for c in m.tool_calls]


def tool_scores(called: Sequence[str], reference: Sequence[str], *, count_repeats: bool = True) -> dict[str, float]:
  """Tool precision, recall and F1 of one sample (definitions in the module docstring).

  Args:
    called: the tool names the agent called, in order.
    reference: the reference's tool names, in order.
    count_repeats: multisets (a tool called twice counts twice); False compares the sets of names.

  Returns:
    {"tool_precision", "tool_recall", "tool_f1", "name_sequence_match"}, each in [0, 1].
  """
  pred = collections.Counter(called if count_repeats else set(called))
  ref = collections.Counter(reference if count_repeats else set(reference))
  n_pred, n_ref = sum(pred.values()), sum(ref.values())
  overlap = sum((pred & ref).values())
  if n_pred == 0 and n_ref == 0:
    precision = recall = f1 = 1.0
  else:
    precision = overlap / n_pred if n_pred else 0.0
    recall = overlap / n_ref if n_ref else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  return {
    "tool_precision": precision,
    "tool_recall": recall,
    "tool_f1": f1,
    "name_sequence_match": float(list(called) == list(reference)),
  }


def mean_scores(per_sample: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """The benchmark's numbers: the mean of each per-sample score (e.g. TF1 = mean "tool_f1"); NaN for no samples."""
  keys = ("tool_precision", "tool_recall", "tool_f1", "name_sequence_match")
  if not per_sample:
    return {k: math.nan for k in keys}
  return {k: math.fsum(s[k] for s in per_sample) / len(per_sample) for k in keys}


class FinMcpEnv(ToolEnv):
  """A FinMCP-Bench sample: no live tools (every call is an error observation), offline TF1 scoring.

  Args:
    count_repeats: passed to `tool_scores`.
  """

  def __init__(self, count_repeats: bool = True):
    self.count_repeats = count_repeats
    self._task: Task | None = None
    self._calls = 0

  def reset(self, task: Task) -> None:
    """Starts a trajectory of `task`. Raises `EnvError` for another benchmark's task."""
    if task.benchmark != BENCHMARK:
      raise EnvError(f"FinMcpEnv runs {BENCHMARK!r} tasks; task {task.id!r} is from {task.benchmark!r}")
    self._task = task
    self._calls = 0

  def _require(self) -> Task:
    if self._task is None:
      raise EnvError("FinMcpEnv: call reset(task) first")
    return self._task

  def execute(self, call: ToolCall) -> Observation:
    """An error observation: an unknown tool, or (for a declared one) that live execution needs the MCP servers."""
    task = self._require()
    self._calls += 1
    if call.name not in task.tool_names:
      return Observation(f"Error: unknown tool {call.name!r}; available tools: {list(task.tool_names)}", True)
    return Observation(LIVE_EXECUTION_ERROR, is_error=True)

  def evaluate(self, conversation: Sequence[ChatMessage]) -> RewardInfo:
    """Reward = TF1 of the called tool names against the reference; precision, recall and the name-sequence match
    in the breakdown. Raises `EnvError` only before `reset`."""
    task = self._require()
    called = called_tools(conversation)
    reference = list(task.criteria.get("reference_tools") or [g.name for g in task.gold_actions])
    scores = tool_scores(called, reference, count_repeats=self.count_repeats)
    return RewardInfo(scores["tool_f1"], scores, info={"called": called, "reference": reference})

  def state_dict(self) -> Any:
    """How many calls the (stateless) servers were asked for."""
    return {"task": None if self._task is None else self._task.id, "calls": self._calls}
