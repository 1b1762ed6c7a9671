"""The three views of a self-unfolded trajectory and how their prompts are rendered (paper §3).

A trajectory is seen three ways, each an append-only chat that one role continues:

  * ACT (the agent): system = the task's policy + tool schemas; then the conversation: user messages (USER), the
    agent's own messages (ACT), tool results (OBSERVATION, whether rehearsed or real: the agent cannot tell).
  * REHEARSE (the environment): system = `REHEARSE_PROMPT` + the tool schemas + the task's reference interactions
    (grounding, budgeted); then "User: ..." / "Agent: ..." lines of the dialogue (USER / ACT), each pending call as
    its own message (ACT), and its own responses (REHEARSE), ``<tool_response>`` blocks (``rollout.rehearsal_format``:
    `render_rehearsal`). With ``rollout.rehearse_context="per_call"`` instead one fresh view per call: the
    instructions, then `per_call_prompt` (the official simulator prompt's structure).
  * USER (the user simulator): system = `USER_PROMPT` with the task's scenario; the agent's replies as the other
    party's messages (ACT), its own messages (USER). Tool traffic is not shown to the user.

`View` keeps one view's messages and its KV-cache row's tokens: rendered from messages, generated exactly as sampled,
and the template's closing tokens after each generation (`ChatFormat`). Invariant, tested: a view's ``tokens`` equal
``Tokenizer.render`` of its ``messages`` wherever the sampler's tokenisation of a generated message is the canonical
one; otherwise they differ only inside generated spans, which decode to the same text
(``decode(tokens) == render_text(messages)``).

Assumption (checked once by `ChatFormat.of`): the chat template writes an assistant message as ``header + content +
trailer`` with the content verbatim (ChatML as SmolLM2 and Qwen2.5 use, Llama 3). Templates that strip or rewrite
content would break token alignment and raise `ChatTemplateError`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from envace_jax.envs.base import ChatMessage, Task
from envace_jax.model import sanitize, tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import ChatTemplateError, Message, Tokenizer
from envace_jax.rehearsal.trajectory import TrainingRow

REHEARSE_PROMPT = (
  "You are the environment behind a set of tools: you do not talk to anyone, you execute the function calls an "
  "agent makes and return their results. The tools you implement are listed below. For each function call, reply "
  f"with exactly what the real tool returns, as JSON inside {tool_format.TOOL_RESPONSE_OPEN}"
  f"{tool_format.TOOL_RESPONSE_CLOSE} tags, e.g.\n{tool_format.TOOL_RESPONSE_OPEN}\n"
  '{"status": "ok"}\n'
  f"{tool_format.TOOL_RESPONSE_CLOSE}\nIf a call cannot succeed (unknown ids, missing or invalid arguments, an action "
  "the system forbids), return the error the tool would raise, as text starting with 'Error:'. Stay consistent with "
  "the data and with your earlier results. Lines starting with 'User:' and 'Agent:' show the conversation between "
  "the user and the agent, for context."
)
"""The environment's instructions (REHEARSE view system message, before the tool schemas and the grounding)."""

EXECUTION_RESULT_OPEN = "<execution_result>"
EXECUTION_RESULT_CLOSE = "</execution_result>"

EXECUTION_RESULT_PROMPT = (
  "You simulate the tools listed below. You never talk to a person: for each function call an agent makes, you "
  "decide what the real tool would return. Write your answer as one non-empty JSON object or array between "
  f"{EXECUTION_RESULT_OPEN} and {EXECUTION_RESULT_CLOSE}, each tag on its own line, e.g.\n{EXECUTION_RESULT_OPEN}\n"
  '{"status": "ok"}\n'
  f"{EXECUTION_RESULT_CLOSE}\nWhen the call cannot run (an unknown id, a missing or invalid argument, an action the "
  'system forbids), answer with the object {"error_tool_call": {"code": "...", "message": "..."}} instead. Stay '
  "consistent with the data and with your earlier results. Lines starting with 'User:' and 'Agent:' show the "
  "conversation between the user and the agent, for context."
)
"""Our instructions for ``rollout.rehearsal_format="execution_result"`` (the official output contract, our wording)."""

TOOLS_HEADER = "# Tools you implement\n\nOne function schema per line:\n<tools>"

GROUNDING_HEADER = (
  "# Reference interactions\n\nLogged calls to these tools with the real system's results; keep your results "
  "consistent with this data:"
)

USER_PROMPT = (
  "You are playing a user who contacts an agent (a customer-service assistant). Follow the scenario below: say only "
  "what a real user in it would say, one message at a time, revealing information only when asked; never invent "
  "facts the scenario does not give. When your goal is reached, or the conversation cannot go on, reply with "
  "{stop_markers} alone to end the conversation.\n\n<scenario>\n{scenario}\n</scenario>"
)
"""The user simulator's system message; formatted with ``scenario`` and ``stop_markers`` (the task's markers)."""

DEFAULT_STOP_MARKERS = ("###STOP###",)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """How the chat template frames a generated (assistant) message: ``header + content + trailer``.

  Attributes:
    header: int32[H] ids of the generation prompt (e.g. ChatML ``<|im_start|>assistant\\n``).
    trailer: text the template writes after the content (ChatML ``<|im_end|>\\n``).
    close_after_eos: eos id -> ids still to append when the generation ended with that eos (ChatML: ``\\n``); an eos
      the trailer does not start with is content, and the whole trailer follows.
    close_ids: ids to append when the generation ended without an eos (stop string, length): the whole trailer.
  """

  header: np.ndarray
  trailer: str
  close_after_eos: Mapping[int, tuple[int, ...]]
  close_ids: tuple[int, ...]

  @classmethod
  def of(cls, tokenizer: Tokenizer) -> ChatFormat:
    """Probes the tokenizer's template with a two-message conversation.

    Raises:
      ChatTemplateError: the template does not write a generated message verbatim between a fixed header and
        trailer (see the module docstring).
    """
    probe = [Message("system", "S"), Message("user", "U")]
    base_ids, _ = tokenizer.render(probe)
    gen_ids, _ = tokenizer.render(probe, add_generation_prompt=True)
    base_text = tokenizer.render_text(probe)
    header_text = tokenizer.render_text(probe, add_generation_prompt=True)[len(base_text) :]
    marker = "Probe content 7"
    turn = tokenizer.render_text([*probe, Message("assistant", marker)])[len(base_text) :]
    if gen_ids[: len(base_ids)].tolist() != base_ids.tolist() or not turn.startswith(header_text + marker):
      raise ChatTemplateError(
        "the chat template does not render an assistant message as header + content + trailer with the content "
        "verbatim; the rollout cannot keep generated tokens aligned with it (use with_chat_template(None): ChatML)"
      )
    trailer = turn[len(header_text) + len(marker) :]
    close_after_eos = {}
    for eos in tokenizer.eos_ids:
      text = tokenizer.decode([eos])
      if text and trailer.startswith(text):
        close_after_eos[eos] = tuple(tokenizer.encode(trailer[len(text) :]))
    header = np.asarray(gen_ids[len(base_ids) :], np.int32)
    return cls(
      header=header, trailer=trailer, close_after_eos=close_after_eos, close_ids=tuple(tokenizer.encode(trailer))
    )


class View:
  """One role's append-only view of one trajectory: its messages and its KV-cache row's token bookkeeping.

  Attributes:
    role: the role generating in this view (Role.ACT, Role.REHEARSE or Role.USER).
    tools: tool schemas rendered into the system message (None: no tools block).
    messages: what the view shows, as the chat template reads it (generated messages with their decoded content).
    tokens, roles, loss_mask, logprobs: per token (lists), see `TrainingRow`.
    cached: ``tokens[:cached]`` are in the KV cache; ``tokens[cached:]`` go out with the next prompt.
    generations: number of generations recorded.
    unencodable: code points of the tool schemas and appended messages that the tokenizer took as U+FFFD (lone
      surrogates, NUL, noncharacters: `sanitize`); the messages keep the text as given. Generated text is not
      counted (its tokens are kept as sampled).
  """

  def __init__(self, tokenizer: Tokenizer, chat_format: ChatFormat, role: Role, tools: Sequence[Mapping] | None):
    self.tokenizer, self.format, self.role, self.tools = tokenizer, chat_format, Role(role), tools
    self.messages: list[Message] = []
    self.tokens: list[int] = []
    self.roles: list[int] = []
    self.loss_mask: list[bool] = []
    self.logprobs: list[float] = []
    self.cached = 0
    self.generations = 0
    self.unencodable = sanitize.count(list(tools)) if tools else 0

  def copy(self) -> View:
    """An independent copy (the G rollouts of a task start from copies of one rendered view)."""
    other = copy.copy(self)
    for name in ("messages", "tokens", "roles", "loss_mask", "logprobs"):
      setattr(other, name, list(getattr(self, name)))
    return other

  def __len__(self) -> int:
    return len(self.tokens)

  def _extend(self, ids, roles, trained: bool = False, logprobs=None) -> None:
    ids = [int(i) for i in ids]
    self.tokens += ids
    self.roles += [int(r) for r in roles]
    self.loss_mask += [trained] * len(ids)
    self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)

  def append(self, *messages: Message) -> None:
    """Renders ``messages`` after the view's (``render`` for the first, ``render_turn`` after); not yet cached.

    Raises:
      ChatTemplateError: the template is not append-only for these messages.
    """
    for m in messages:
      if self.messages:
        ids, roles = self.tokenizer.render_turn(self.messages, m, tools=self.tools)
      else:
        ids, roles = self.tokenizer.render([m], tools=self.tools)
      self._extend(ids, roles)
      self.messages.append(m)
      self.unencodable += sanitize.count(m.content)

  def prompt(self) -> tuple[list[int], list[int]]:
    """The next generation's prompt: the uncached tokens and the generation header (int[P] ids, int[P] roles)."""
    header = self.format.header.tolist()
    return self.tokens[self.cached :] + header, self.roles[self.cached :] + [int(self.role)] * len(header)

  def record(self, ids: Sequence[int], logprobs: Sequence[float], eos_ids: Sequence[int]) -> str:
    """Records one generation whose prompt was ``prompt()``: header and generated ids are now in the cache.

    The message is closed as the template closes it (the trailer after the content, minus what an eos already
    wrote): those ids are appended uncached, with the view's role and no loss.

    Args:
      ids: int[T] generated ids exactly as sampled.
      logprobs: float[T] their sampler logprobs.
      eos_ids: the ids that end a generation (``Tokenizer.eos_ids``).

    Returns:
      The message content: the decoded ids without a closing eos.
    """
    ids = [int(i) for i in ids]
    header = self.format.header
    self._extend(header, [self.role] * len(header))
    self._extend(ids, [self.role] * len(ids), trained=True, logprobs=logprobs)
    self.cached = len(self.tokens)
    self.generations += 1
    last = ids[-1] if ids else None
    if last is not None and last in eos_ids and last in self.format.close_after_eos:
      content, close = self.tokenizer.decode(ids[:-1]), self.format.close_after_eos[last]
    else:
      content, close = self.tokenizer.decode(ids), self.format.close_ids
    self._extend(close, [self.role] * len(close))
    self.messages.append(Message("assistant", content, author=self.role))
    return content

  def training_row(self, trajectory: int) -> TrainingRow:
    """The cached tokens as a `TrainingRow` (exactly the KV-cache row's content)."""
    n = self.cached
    return TrainingRow(
      tokens=np.asarray(self.tokens[:n], np.int32),
      roles=np.asarray(self.roles[:n], np.int32),
      loss_mask=np.asarray(self.loss_mask[:n], bool),
      logprobs=np.asarray(self.logprobs[:n], np.float32),
      role=int(self.role),
      trajectory=trajectory,
      num_generations=self.generations,
    )


# ---------------------------------------------------------------------------------------------------------------------
# What each view shows.


def assistant_content(message: ChatMessage) -> str:
  """An assistant message as the agent writes it: its text, then one ``<tool_call>`` block per call."""
  parts = [message.content] if message.content else []
  parts += [tool_format.render_tool_call(c.name, c.arguments) for c in message.tool_calls]
  return "\n".join(parts)


def rehearse_system_prompt(task: Task, instructions: str, grounding: str) -> str:
  """The REHEARSE view's system message: instructions, the task's tool schemas, then the grounding block.

  The schemas are written here rather than by the tokenizer's tools block, whose instructions ("you may call one
  function ...") are the agent's, not the environment's.
  """
  schemas = "".join("\n" + tool_format.compact_json(dict(tool)) for tool in task.tools)
  parts = [instructions, TOOLS_HEADER + schemas + "\n</tools>" if task.tools else "", grounding]
  return "\n\n".join(p for p in parts if p)


def render_rehearsal(content: str, rehearsal_format: str = "tool_response") -> str:
  """A tool result as REHEARSE writes it under ``rehearsal_format`` (``rollout.rehearsal_format``):
  ``<tool_response>\\ncontent\\n</tool_response>``, or ``\\n<execution_result>\\ncontent\\n</execution_result>`` (the
  official contract, tool_simulator_agent.py's ``EXECUTION_RESULT_BOT`` / ``EOT``)."""
  if rehearsal_format == "execution_result":
    return f"\n{EXECUTION_RESULT_OPEN}\n{content}\n{EXECUTION_RESULT_CLOSE}"
  return tool_format.render_tool_response(content)


def grounding_block(
  task: Task, tokenizer: Tokenizer, max_tokens: int, rehearsal_format: str = "tool_response"
) -> tuple[str, int, int]:
  """The task's reference interactions as ``<tool_call>`` / result pairs (`render_rehearsal`), within a token budget.

  Interactions are taken in logged order; one whose rendering would exceed what is left of ``max_tokens`` is skipped
  (later, shorter ones may still fit). ``max_tokens=-1``: every interaction (the official prompt shows them all).

  Returns:
    (text, kept, dropped): the block ("" when nothing is kept or the task has none) and the interaction counts.
  """
  pieces, used, dropped = [], len(tokenizer.encode(GROUNDING_HEADER)), 0
  for ref in task.reference_interactions:
    try:
      call = tool_format.render_tool_call(ref.name, ref.arguments)
    except TypeError:
      dropped += 1
      continue
    piece = "\n" + call + "\n" + render_rehearsal(ref.result, rehearsal_format).lstrip("\n")
    n = len(tokenizer.encode(piece))
    if max_tokens >= 0 and used + n > max_tokens:
      dropped += 1
      continue
    pieces.append(piece)
    used += n
  return (GROUNDING_HEADER + "".join(pieces) if pieces else ""), len(pieces), dropped


PER_CALL_SECTIONS = (
  "# Tools of this task",
  "# Reference interactions",
  "# Conversation so far",
  "# The agent's latest message",
  "# The call to answer",
)
"""The sections of a per-call REHEARSE prompt (`per_call_prompt`), in order."""

THINK_SWITCH = "/think"
"""Appended to a REHEARSE prompt with ``rollout.rehearse_think`` (Qwen3's soft switch; simulate_core/_builders.py
appends it to every simulator prompt)."""


def serialize_history(messages: Sequence[ChatMessage]) -> str:
  """A conversation as plain text for a per-call REHEARSE prompt: one paragraph per message, "User: ...",
  "Agent: ..." (its text, then one ``<tool_call>`` block per call), "Tool[name]: ..." (results); system messages and
  empty ones are left out; "(none)" when nothing is left."""
  lines = []
  for m in messages:
    if m.role == "user" and m.content.strip():
      lines.append("User: " + m.content.strip())
    elif m.role == "assistant":
      text = assistant_content(ChatMessage("assistant", m.content.strip(), tool_calls=m.tool_calls))
      if text:
        lines.append("Agent: " + text)
    elif m.role == "tool" and m.content.strip():
      lines.append(f"Tool[{m.name}]: " + m.content.strip() if m.name else "Tool: " + m.content.strip())
  return "\n\n".join(lines) if lines else "(none)"


def tool_schema(task: Task, name: str) -> Mapping[str, Any] | None:
  """The task's schema of tool ``name`` (as listed in ``task.tools``), or None when the task has no such tool."""
  for tool in task.tools:
    if (tool["function"]["name"] if "function" in tool else tool.get("name")) == name:
      return tool
  return None


def per_call_prompt(
  task: Task,
  name: str,
  arguments: Mapping[str, Any],
  *,
  grounding: str,
  history: Sequence[ChatMessage] | None,
  latest: str | None,
  think: bool = False,
) -> str:
  """The user message of a per-call REHEARSE prompt (``rollout.rehearse_context="per_call"``), the structure of the
  official simulator prompt (simulate_core/_builders.py ``build_validation_user_prompt``; our wording): the
  `PER_CALL_SECTIONS` in order, blank-line separated, then `THINK_SWITCH` with ``think``.

  Args:
    task: its tool schemas are the first section.
    name, arguments: the call to answer (its schema is looked up in ``task.tools``; "(unknown tool)" when absent).
    grounding: the reference interactions (`grounding_block`), "" for none ("(none)" is written).
    history: the conversation before the call's message (`serialize_history`); None leaves the section out.
    latest: the agent's message holding the call, as generated; None leaves the section out.
  """
  schema = tool_schema(task, name)
  parts = [
    PER_CALL_SECTIONS[0] + "\n" + json.dumps([dict(t) for t in task.tools], ensure_ascii=False, indent=0),
    grounding or PER_CALL_SECTIONS[1] + "\n(none)",
  ]
  if history is not None:
    parts.append(PER_CALL_SECTIONS[2] + "\n" + serialize_history(history))
  if latest is not None:
    parts.append(PER_CALL_SECTIONS[3] + "\n" + latest)
  schema_text = json.dumps(dict(schema), ensure_ascii=False, indent=0) if schema is not None else "(unknown tool)"
  arguments_text = json.dumps(dict(arguments), ensure_ascii=False, indent=0)
  parts.append(f"{PER_CALL_SECTIONS[4]}\nname: {name}\nschema:\n{schema_text}\narguments:\n{arguments_text}")
  if think:
    parts.append(THINK_SWITCH)
  return "\n\n".join(parts)


def user_system_prompt(task: Task, template: str = USER_PROMPT) -> str:
  """The user simulator's system message for ``task`` (``template`` formatted with scenario and stop markers)."""
  markers = task.user_stop_markers or DEFAULT_STOP_MARKERS
  return template.format(scenario=task.user_scenario, stop_markers=" or ".join(f"'{m}'" for m in markers))


def act_messages(message: ChatMessage) -> list[Message]:
  """One conversation message as the ACT view shows it (history, replayed turns, observations)."""
  if message.role == "assistant":
    return [Message("assistant", assistant_content(message), author=Role.ACT)]
  if message.role == "tool":
    return [Message("tool", message.content, author=Role.OBSERVATION)]
  return [Message(message.role, message.content)]


def rehearse_messages(message: ChatMessage, dialogue: bool = True) -> list[Message]:
  """One conversation message as the REHEARSE view shows it: dialogue as labelled lines when ``dialogue`` (a user
  message: USER; the agent's text: ACT), nothing else. Calls enter one at a time (`rehearse_call`), each right before
  its response is generated; `rehearse_history` pairs logged calls with their results."""
  if not dialogue:
    return []
  if message.role == "user":
    return [Message("user", "User: " + message.content, author=Role.USER)]
  if message.role == "assistant" and message.content:
    return [Message("user", "Agent: " + message.content, author=Role.ACT)]
  return []


def rehearse_history(
  history: Sequence[ChatMessage], dialogue: bool = True, rehearsal_format: str = "tool_response"
) -> list[Message]:
  """A logged conversation as the REHEARSE view shows it: `rehearse_messages` per message, and each answered call as
  its call message followed by its logged result (an OBSERVATION: it is real; `render_rehearsal`). Unanswered calls
  are left out."""
  out, pending = [], []
  for m in history:
    out += rehearse_messages(m, dialogue)
    if m.role == "assistant":
      pending = list(m.tool_calls)
    elif m.role == "tool" and pending:
      call = next((c for c in pending if c.id and c.id == m.tool_call_id), pending[0])
      pending.remove(call)
      out.append(rehearse_call(call.name, call.arguments))
      out.append(Message("assistant", render_rehearsal(m.content, rehearsal_format), author=Role.OBSERVATION))
  return out


def rehearse_call(name: str, arguments: Mapping[str, Any]) -> Message:
  """A pending call in the REHEARSE view (the agent's, so ACT tokens)."""
  return Message("user", tool_format.render_tool_call(name, arguments), author=Role.ACT)


def user_messages(message: ChatMessage) -> list[Message]:
  """One conversation message as the USER view shows it: roles swapped (the simulator is the "assistant"); as in
  τ²'s orchestrator, the agent's messages that call tools (and tool results) go to the environment, not the user."""
  if message.role == "user":
    return [Message("assistant", message.content, author=Role.USER)]
  if message.role == "assistant" and message.content and not message.tool_calls:
    return [Message("user", message.content, author=Role.ACT)]
  return []


# ---------------------------------------------------------------------------------------------------------------------
# What a generation means (host side, never raises on model output).


@dataclasses.dataclass(frozen=True)
class ActOutput:
  """One ACT generation, parsed: tool calls (in order) and reply text, or a parse error (``calls`` then empty)."""

  calls: tuple[tool_format.ToolCall, ...]
  reply: str
  error: tool_format.ParseError | None = None


def parse_act(text: str, known_tools: Sequence[str] | None, parallel: bool = False, rules: str = "ours") -> ActOutput:
  """Parses an ACT generation by our rules (``tool_format.parse_action``) or the official ones (setting
  ``rollout.act_parser``).

  ``rules="ours"``: with ``parallel``, several ``<tool_call>`` blocks are allowed: each block (up to the next one) is
  parsed on its own and the text outside them joins the reply; the first malformed block makes the whole output an
  error. Without it, more than one call is ``MULTIPLE_CALLS`` (one call per turn, paper §3.1).

  ``rules="official"``: the text with its unencodable code points as U+FFFD (`sanitize.sanitize`, as the official env
  cleans the caller's text before parsing, envs.py), then ``tool_format.parse_action_official`` (several calls per
  message, in several blocks or a list; names not checked against ``known_tools``, so an unknown tool goes to REHEARSE
  or the real env's own error); the reply is the text before the first block. Then, as our tool layer takes an object:
  arguments given as a string that decodes to an object are that object (the official code hands the string itself to
  the simulator), and other non-object arguments are ``ARGUMENTS_NOT_OBJECT``. Without ``parallel``, more than one
  call is ``MULTIPLE_CALLS``.

  Raises:
    ValueError: ``rules`` is neither "ours" nor "official".
  """
  if rules == "official":
    return _parse_act_official(sanitize.sanitize(text), parallel)
  if rules != "ours":
    raise ValueError(f"parse_act rules={rules!r}; valid: ours, official")
  opens = []
  start = text.find(tool_format.TOOL_CALL_OPEN)
  while start >= 0:
    opens.append(start)
    start = text.find(tool_format.TOOL_CALL_OPEN, start + 1)
  if not parallel or len(opens) <= 1:
    action = tool_format.parse_action(text, known_tools)
    return ActOutput(calls=(action.call,) if action.call else (), reply=action.reply, error=action.error)
  replies, calls = [text[: opens[0]].strip()], []
  for i, begin in enumerate(opens):
    action = tool_format.parse_action(text[begin : opens[i + 1] if i + 1 < len(opens) else len(text)], known_tools)
    if action.error is not None:
      error = tool_format.ParseError(action.error.kind, f"call {i + 1}: {action.error.message}", text)
      return ActOutput(calls=(), reply=replies[0], error=error)
    calls.append(action.call)
    replies.append(action.reply)
  return ActOutput(calls=tuple(calls), reply="\n".join(r for r in replies if r))


def _parse_act_official(text: str, parallel: bool) -> ActOutput:
  action = tool_format.parse_action_official(text)
  reply = action.content.strip()

  def error(kind: tool_format.ParseErrorKind, message: str) -> ActOutput:
    return ActOutput(calls=(), reply=reply, error=tool_format.ParseError(kind, message, text))

  if action.error is not None:
    return ActOutput(calls=(), reply=reply, error=action.error)
  if len(action.calls) > 1 and not parallel:
    return error(tool_format.ParseErrorKind.MULTIPLE_CALLS, f"{len(action.calls)} tool calls in one turn; make one")
  calls = []
  for i, call in enumerate(action.calls):
    try:  # written by json.dumps, read as the official env reads it (envs.py); a string may hold an object
      arguments = json.loads(call.arguments_json)
      arguments = (
        json.loads(arguments) if isinstance(arguments, str) and arguments.lstrip().startswith("{") else arguments
      )
    except (ValueError, RecursionError):
      arguments = None
    if not isinstance(arguments, dict):
      kind = tool_format.ParseErrorKind.ARGUMENTS_NOT_OBJECT
      return error(kind, f'call {i + 1}: "arguments" of {call.name!r} must be a JSON object')
    calls.append(tool_format.ToolCall(name=call.name, arguments=arguments))
  return ActOutput(calls=tuple(calls), reply=reply)


@dataclasses.dataclass(frozen=True)
class RehearsedResponse:
  """One REHEARSE generation, checked.

  Attributes:
    content: what the agent is shown. ``tool_response``: the body (inside the tags when present, else the whole
      text), stripped. ``execution_result``: the parsed JSON re-serialised (``json.dumps``, non-ASCII kept), or for
      an invalid output an error object ``{"error_tool_call": {"code", "message"}}`` (`tool_error`).
    valid: the output keeps the format's contract.
    is_error: the content reports a failed call: "Error..." text (``tool_response``, when accepted), an object with
      an ``error_tool_call`` key (``execution_result``: the simulator's own, or an invalid output's).
    reason: why it is invalid ("" when valid).
    code: ``execution_result``'s error code of an invalid output (the official parser's: ``EMPTY_SIMULATOR_OUTPUT``,
      ``NO_EXECUTION_RESULT_TAG_FOUND``, ``EXECUTION_RESULT_TAG_MALFORMED``, ``SIMULATOR_JSON_DECODE_ERROR``,
      ``INVALID_EXECUTION_RESULT_TYPE``, ``NON_SERIALIZABLE_EXECUTION_RESULT``); "" otherwise.
  """

  content: str
  valid: bool
  is_error: bool = False
  reason: str = ""
  code: str = ""


def tool_error(code: str, message: str) -> str:
  """The error object a failed call's observation holds, ``{"error_tool_call": {"code": ..., "message": ...}}`` (the
  official layout, simulate_core/_error.py; ASCII-escaped JSON)."""
  return json.dumps({"error_tool_call": {"code": code, "message": message}}, ensure_ascii=True)


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_EXECUTION_RESULT = re.compile(
  re.escape(f"\n{EXECUTION_RESULT_OPEN}\n") + "(.*?)" + re.escape(f"\n{EXECUTION_RESULT_CLOSE}"), re.DOTALL
)


def parse_rehearsal(
  text: str, accept_error_text: bool = True, rehearsal_format: str = "tool_response"
) -> RehearsedResponse:
  """Checks a REHEARSE generation against ``rehearsal_format``'s contract (``rollout.rehearsal_format``).

  ``tool_response`` (ours): ``<tool_response>`` + any JSON value (or "Error..." text with ``accept_error_text``) +
  ``</tool_response>``. ``execution_result`` (the official contract, `_parse_execution_result`): ``accept_error_text``
  does not apply.
  """
  if rehearsal_format == "execution_result":
    return _parse_execution_result(text)
  stripped = text.strip()
  begin = stripped.find(tool_format.TOOL_RESPONSE_OPEN)
  body = stripped[begin + len(tool_format.TOOL_RESPONSE_OPEN) :] if begin >= 0 else stripped
  end = body.find(tool_format.TOOL_RESPONSE_CLOSE)
  body = (body[:end] if end >= 0 else body).strip()
  if begin < 0:
    return RehearsedResponse(body, False, reason=f"no {tool_format.TOOL_RESPONSE_OPEN}")
  if end < 0:
    return RehearsedResponse(body, False, reason=f"no {tool_format.TOOL_RESPONSE_CLOSE}")
  if accept_error_text and body.startswith("Error"):
    return RehearsedResponse(body, True, is_error=True)
  try:
    json.loads(body)
  except (ValueError, RecursionError) as e:
    return RehearsedResponse(body, False, reason=f"not JSON: {str(e)[:200]}")
  return RehearsedResponse(body, True)


def _parse_execution_result(text: str) -> RehearsedResponse:
  """The official simulator-output contract (agent_system/agent/agents/checklist/tool_simulator_agent.py,
  ``_parse_sim_response``), checked in its order: ``<think>...</think>`` spans are removed; blank -> empty; no
  ``<execution_result>`` anywhere -> no tag; no ``\\n<execution_result>\\n ... \\n</execution_result>`` (the first,
  shortest) -> malformed tag; the stripped block must be JSON, and a non-empty object or an array (empty allowed).
  Golden test: tests/test_official_rehearse.py."""

  def invalid(code: str, message: str) -> RehearsedResponse:
    return RehearsedResponse(tool_error(code, message), False, is_error=True, reason=f"{code}: {message}", code=code)

  text = _THINK.sub("", text)
  if not text.strip():
    return invalid("EMPTY_SIMULATOR_OUTPUT", "the output is empty")
  if EXECUTION_RESULT_OPEN not in text:
    return invalid("NO_EXECUTION_RESULT_TAG_FOUND", f"no {EXECUTION_RESULT_OPEN} in the output")
  match = _EXECUTION_RESULT.search(text)
  if match is None:
    return invalid(
      "EXECUTION_RESULT_TAG_MALFORMED", f"{EXECUTION_RESULT_OPEN} is not on its own line or is never closed"
    )
  try:
    value = json.loads(match.group(1).strip())
  except (ValueError, RecursionError) as e:
    return invalid("SIMULATOR_JSON_DECODE_ERROR", f"the result is not JSON: {str(e)[:200]}")
  if not isinstance(value, (dict, list)) or value == {}:
    got = "an empty object" if value == {} else type(value).__name__
    return invalid("INVALID_EXECUTION_RESULT_TYPE", f"the result must be a non-empty object or an array, got {got}")
  try:
    content = json.dumps(value, ensure_ascii=False)
  except (ValueError, TypeError) as e:
    return invalid("NON_SERIALIZABLE_EXECUTION_RESULT", str(e)[:200])
  return RehearsedResponse(content, True, is_error=isinstance(value, dict) and "error_tool_call" in value)
