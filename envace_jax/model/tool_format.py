"""Tool use in the Hermes / Qwen2.5 convention: render schemas, calls and responses; parse the agent's output.

The text formats (what the model reads and writes):

  * Tool schemas, OpenAI function JSON ``{"type": "function", "function": {"name", "description", "parameters"}}``,
    one per line inside ``<tools></tools>`` in the system message, with the instructions Qwen2.5's chat template
    writes (``render_tools_block``). Schemas are rendered as compact JSON (no spaces after separators): a τ² airline
    schema set is ~5k SmolLM2 tokens and context is scarce.
  * A tool call in assistant content: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
  * A tool result: ``<tool_response>\\n...\\n</tool_response>``.

``parse_action`` turns one ACT generation into an ``Action``: a tool call, a plain reply, or a typed parse error. It
never raises on model output: malformed output is data (recorded on the trajectory and scored; docs/method.md,
"How a training step runs", step 3). ``parse_action_official`` applies the official EnvACE implementation's rules
instead (setting ``rollout.act_parser``; tests/data/official/act_parse.json holds the official parser's outputs).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from envace_jax.model import sanitize

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

# Qwen2.5's wording (its chat template, `tools` branch), so a Qwen model sees what it was trained on, except that
# an ACT turn holds at most one call (parse_action reports several as MULTIPLE_CALLS; paper §3.1: one a_t per turn).
_TOOLS_PREAMBLE = (
  "# Tools\n\nYou may call one function per turn to assist with the user query.\n\n"
  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_POSTAMBLE = (
  "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
  '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
  "</tool_call>"
)


def compact_json(value: Any) -> str:
  """JSON without spaces after separators, non-ASCII kept as is. Raises ``TypeError`` for non-JSON values."""
  return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render_tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
  """The ``# Tools`` section for a system message: instructions and one compact JSON schema per line.

  Args:
    tools: OpenAI function schemas ``{"type": "function", "function": {"name", "description", "parameters"}}``,
      rendered as given.

  Returns:
    The block, without leading blank lines; the caller joins it to the system prompt with ``"\\n\\n"``.

  Raises:
    TypeError: a schema is not JSON-serialisable.
  """
  return _TOOLS_PREAMBLE + "".join("\n" + compact_json(dict(tool)) for tool in tools) + _TOOLS_POSTAMBLE


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
  """``<tool_call>\\n{"name": name, "arguments": {...}}\\n</tool_call>`` in Qwen2.5's spacing (``", "``/``": "``).

  Raises:
    TypeError: ``arguments`` is not JSON-serialisable.
  """
  body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
  return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def render_tool_response(content: str) -> str:
  """``<tool_response>\\ncontent\\n</tool_response>``: a tool's result as the model reads it."""
  return f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"


class ParseErrorKind(enum.Enum):
  """Why an ACT generation is not a usable tool call. Counted in metrics by name."""

  BAD_JSON = "bad_json"  # the call body is not JSON, or not a JSON object
  MISSING_NAME = "missing_name"  # no "name", or it is not a non-empty string
  UNKNOWN_TOOL = "unknown_tool"  # "name" is not one of the known tools
  ARGUMENTS_NOT_OBJECT = "arguments_not_object"  # "arguments" is neither an object nor a string encoding one
  UNTERMINATED = "unterminated"  # "<tool_call>" without a following "</tool_call>"
  MULTIPLE_CALLS = "multiple_calls"  # more than one "<tool_call>" in one turn
  # Only under the official rules (`parse_action_official`):
  NO_TOOL_CALL_FOUND = "no_tool_call_found"  # "<tool_call>" appears, but no "\n<tool_call>\n...\n</tool_call>" block
  NO_ARGUMENTS = "no_arguments"  # a call without non-null "parameters" or "arguments" (or not a JSON object at all)
  NON_SERIALIZABLE_ARGUMENTS = "non_serializable_arguments"  # the arguments cannot be written back as JSON

  @property
  def official_code(self) -> str | None:
    """The official parser's error code for this kind (None: a kind only our rules report)."""
    return _OFFICIAL_CODES.get(self)


# The official parser's codes (tool_parser.py, parse_tool_calls) for the kinds `parse_action_official` reports.
_OFFICIAL_CODES = {
  ParseErrorKind.NO_TOOL_CALL_FOUND: "NO_TOOL_CALL_FOUND",
  ParseErrorKind.BAD_JSON: "JSON_DECODE_ERROR",
  ParseErrorKind.MISSING_NAME: "INVALID_TOOL_NAME",
  ParseErrorKind.NO_ARGUMENTS: "NO_ARGUMENTS",
  ParseErrorKind.NON_SERIALIZABLE_ARGUMENTS: "NON_SERIALIZABLE_ARGUMENTS",
}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed tool call: the tool's name and its arguments (a JSON object)."""

  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParseError:
  """A malformed tool call: its ``kind``, a message for humans, and the raw generation."""

  kind: ParseErrorKind
  message: str
  raw: str


@dataclasses.dataclass(frozen=True)
class Action:
  """What one ACT generation asks for.

  Exactly one of three shapes:
    * ``kind == "tool_call"``: ``call`` is set, ``error`` is None; ``reply`` is any text outside the call block.
    * ``kind == "reply"``: ``call`` and ``error`` are None; ``reply`` is the (stripped) text.
    * ``kind == "error"``: ``error`` is set, ``call`` is None; ``reply`` is the text before the first ``<tool_call>``.
  """

  kind: Literal["tool_call", "reply", "error"]
  call: ToolCall | None = None
  reply: str = ""
  error: ParseError | None = None


def _error(kind: ParseErrorKind, message: str, raw: str, reply: str) -> Action:
  return Action(kind="error", reply=reply, error=ParseError(kind=kind, message=message, raw=raw))


def _loads(text: str) -> tuple[bool, Any]:
  """``(True, value)`` when ``text`` is JSON, else ``(False, reason)``. Never raises."""
  try:
    return True, json.loads(text)
  except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so is an over-long integer
    return False, str(e)[:200]


def _strip_fence(body: str) -> str:
  """Drop a Markdown code fence around the call body (```json ... ```), which small models like to add."""
  if body.startswith("```") and body.endswith("```") and len(body) >= 6:
    inner = body[3:-3]
    newline = inner.find("\n")
    return (inner[newline + 1 :] if newline >= 0 else inner).strip()
  return body


def parse_action(text: str, known_tools: Collection[str] | None = None) -> Action:
  """Parse one ACT generation (decoded text, stop tokens excluded) into an ``Action``. Never raises on any string.

  Rules, in order: no ``<tool_call>`` -> a reply; more than one -> MULTIPLE_CALLS; no ``</tool_call>`` after it ->
  UNTERMINATED; the body (optionally in a Markdown code fence) must be a JSON object (BAD_JSON) with a non-empty
  string ``"name"`` (MISSING_NAME) among ``known_tools`` when given (UNKNOWN_TOOL); ``"arguments"`` (or
  ``"parameters"``) must be an object or a string that decodes to one (ARGUMENTS_NOT_OBJECT); absent means ``{}``.

  Args:
    text: the generation.
    known_tools: tool names the environment offers; None accepts any name.
  """
  start = text.find(TOOL_CALL_OPEN)
  if start < 0:
    return Action(kind="reply", reply=text.strip())
  before = text[:start].strip()
  body_start = start + len(TOOL_CALL_OPEN)
  n_open = text.count(TOOL_CALL_OPEN)
  if n_open > 1:
    return _error(ParseErrorKind.MULTIPLE_CALLS, f"{n_open} tool calls in one turn; make exactly one", text, before)
  end = text.find(TOOL_CALL_CLOSE, body_start)
  if end < 0:
    return _error(ParseErrorKind.UNTERMINATED, f"{TOOL_CALL_OPEN} is never closed by {TOOL_CALL_CLOSE}", text, before)
  after = text[end + len(TOOL_CALL_CLOSE) :].strip()
  reply = "\n".join(part for part in (before, after) if part)

  ok, obj = _loads(_strip_fence(text[body_start:end].strip()))
  if not ok:
    return _error(ParseErrorKind.BAD_JSON, f"tool call body is not JSON: {obj}", text, before)
  if not isinstance(obj, dict):
    return _error(ParseErrorKind.BAD_JSON, f"tool call must be a JSON object, got {type(obj).__name__}", text, before)
  name = obj.get("name")
  if not isinstance(name, str) or not name.strip():
    return _error(ParseErrorKind.MISSING_NAME, 'tool call has no "name" string', text, before)
  name = name.strip()
  if known_tools is not None and name not in known_tools:
    return _error(ParseErrorKind.UNKNOWN_TOOL, f"unknown tool {name!r}", text, before)

  arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
  if isinstance(arguments, str):
    ok, decoded = _loads(arguments)
    arguments = decoded if ok else arguments
  if not isinstance(arguments, dict):
    message = f'"arguments" of {name!r} must be a JSON object, got {type(arguments).__name__}'
    return _error(ParseErrorKind.ARGUMENTS_NOT_OBJECT, message, text, before)
  return Action(kind="tool_call", call=ToolCall(name=name, arguments=arguments), reply=reply)


# ---------------------------------------------------------------------------------------------------------------------
# The official EnvACE rules (Within-yao/EnvACE, agent_system/environments/env_package/checklist/tool_parser.py,
# `parse_tool_calls`, and how envs.py `ChecklistEnv.async_step` records the message), written from their behaviour.

OFFICIAL_CALL_OPEN = "\n" + TOOL_CALL_OPEN + "\n"  # a block starts exactly so: a newline on both sides of the tag
OFFICIAL_CALL_CLOSE = "\n" + TOOL_CALL_CLOSE


@dataclasses.dataclass(frozen=True)
class OfficialCall:
  """A call as the official rules read it: its name (stripped) and its arguments as JSON text: ``json.dumps`` of any
  non-null JSON value (an object, but also a string, list or number), non-ASCII kept, refused code points replaced."""

  name: str
  arguments_json: str


@dataclasses.dataclass(frozen=True)
class OfficialAction:
  """One ACT generation under the official rules.

  Attributes:
    calls: the calls, in order (empty when ``error`` is set); one message may hold several.
    content: the assistant message's content as the official env records it: the text before the first
      ``"\\n<tool_call>\\n"`` when there are calls (text after the blocks is dropped), else the whole text.
    error: the first problem found; any problem voids every call of the message.
  """

  calls: tuple[OfficialCall, ...]
  content: str
  error: ParseError | None = None


def parse_action_official(text: str) -> OfficialAction:
  """Parse one ACT generation by the official rules. Never raises on any string.

  Rules, in order: no ``<tool_call>`` anywhere -> a reply; the blocks are the ``"\\n<tool_call>\\n" body
  "\\n</tool_call>"`` spans, left to right (a tag without those exact newlines, e.g. at the very start of the text,
  is not a block; an unterminated block is none either), and none -> NO_TOOL_CALL_FOUND; each stripped body must be
  JSON (BAD_JSON; no code fences), a list of calls or one call; each call's arguments are ``"parameters"`` unless that
  is absent or null, then ``"arguments"``, and neither -> NO_ARGUMENTS (also for a call that is not an object); then a
  non-empty string ``"name"`` (MISSING_NAME). Names are not checked against the task's tools. An empty list is no
  call and no error. The first problem voids the whole message.

  Departure, on purpose: a body the official parser would raise on (an integer of more than 4300 digits, nesting
  deeper than Python's recursion limit) is BAD_JSON here.
  """
  if TOOL_CALL_OPEN not in text:
    return OfficialAction(calls=(), content=text)
  bodies, at = [], 0
  while (start := text.find(OFFICIAL_CALL_OPEN, at)) >= 0:
    end = text.find(OFFICIAL_CALL_CLOSE, start + len(OFFICIAL_CALL_OPEN))
    if end < 0:
      break
    bodies.append(text[start + len(OFFICIAL_CALL_OPEN) : end])
    at = end + len(OFFICIAL_CALL_CLOSE)

  def error(kind: ParseErrorKind, message: str) -> OfficialAction:
    return OfficialAction(calls=(), content=text, error=ParseError(kind=kind, message=message, raw=text))

  if not bodies:
    return error(ParseErrorKind.NO_TOOL_CALL_FOUND, f"no call block {OFFICIAL_CALL_OPEN!r} ... {OFFICIAL_CALL_CLOSE!r}")
  calls = []
  for body in bodies:
    ok, parsed = _loads(body.strip())
    if not ok:
      return error(ParseErrorKind.BAD_JSON, f"tool call body is not JSON: {parsed}")
    for item in parsed if isinstance(parsed, list) else [parsed]:
      is_object = isinstance(item, dict)
      arguments = item.get("parameters") if is_object else None
      if arguments is None and is_object:
        arguments = item.get("arguments")
      if arguments is None:
        return error(ParseErrorKind.NO_ARGUMENTS, 'a tool call without "parameters" or "arguments"')
      try:
        arguments_json = sanitize.sanitize(json.dumps(arguments, ensure_ascii=False))
      except (TypeError, ValueError, RecursionError) as e:
        return error(ParseErrorKind.NON_SERIALIZABLE_ARGUMENTS, f"arguments are not serialisable: {e}"[:200])
      name = item.get("name")
      if not isinstance(name, str) or not name.strip():
        return error(ParseErrorKind.MISSING_NAME, 'tool call has no "name" string')
      calls.append(OfficialCall(name=name.strip(), arguments_json=arguments_json))
  if not calls:
    return OfficialAction(calls=(), content=text)
  return OfficialAction(calls=tuple(calls), content=text[: text.find(OFFICIAL_CALL_OPEN)])
