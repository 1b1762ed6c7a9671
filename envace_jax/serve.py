"""An OpenAI-compatible chat endpoint for a trained checkpoint or base weights, so that a benchmark's own harness (τ²'s
runner, BFCL's, VitaBench's: all speak the OpenAI chat API through LiteLLM) evaluates our policy.

    python -m envace_jax.serve --checkpoint=WORKDIR            # the latest step; the stored config says the model
    python -m envace_jax.serve --model=smollm2-135m [--config=configs/tau2.py] [--host=0.0.0.0 --port=8000]

Routes (FastAPI on uvicorn): ``GET /v1/models`` lists the one served model; ``POST /v1/chat/completions`` takes
``model``, ``messages`` (system / developer / user / assistant with ``tool_calls`` / tool), ``tools``,
``tool_choice`` ("auto" or "none"), ``temperature``, ``top_p``, ``max_tokens`` (or ``max_completion_tokens``),
``stop``, ``n``, ``seed`` and ``stream`` (the finished message sent as server-sent events: a content chunk and a
finish chunk per choice, the usage with ``stream_options.include_usage``, ``[DONE]``; not token by token). Other
fields are ignored, as OpenAI-compatible servers do.

Mapping: tools render into the prompt as the tokenizer's chat template does in training (``tool_format``); an
assistant message's ``tool_calls`` render as our ``<tool_call>`` blocks and ``tool`` messages as tool results
(``views.act_messages``); a generation's ``<tool_call>`` blocks become OpenAI ``tool_calls`` (``views.parse_act``,
several allowed with ``rollout.parallel_calls``; one that does not parse is returned as text). ACT generates with
the policy's ACT tree ("policy" sampler) and the rollout's ACT stop strings; ``usage`` counts the prompt once and
every choice's tokens.

Extension field ``"rehearsal": {"mode": "parallel"|"sequential"|"off", "n": N}``: test-time private rehearsal
(paper §4, ``rehearsal/private.py``) before answering. The request is a task whose policy is its system message and
whose tools are its tools; N imagined continuations of its conversation (imagined tool results from the REHEARSE
tree, an imagined user told the first user message), a self-assessment of each and the rehearsal memory are
generated, and the answer is generated with the memory appended to the system message (``private.MEMORY_HEADER``).
The response's ``rehearsal`` field holds the memory and the tokens the rehearsal generated (requests rehearsed in one
batch share its cost equally). Budgets are ``config.eval``'s; while a rehearsal runs, other requests are served
between its decode chunks (Batching).

Batching (`Engine`): one worker thread does every piece of JAX work, in turns. Requests wait in a queue; the worker
takes all that arrived, rehearses those that ask for it (one `private.rehearse` per rehearsal setting), and starts
them as runs: one ``Sampler.stream`` per distinct stop strings, at most ``max_batch`` rows each (a request with ``n``
choices is n rows), its rows prefilled at once, each with its request's temperature and top_p (data of the decode
program, `sampler.RowSampling`: a value the server has not seen compiles nothing). Rows and cache slots are padded to
powers of two, so few programs compile. The runs then decode in turns of ``--decode_chunk`` steps (default
`DECODE_CHUNK`); between turns the worker takes new requests (a new run, at most `MAX_RUNS` at once; the others wait
for one to end) and answers every request whose rows have finished. So a short request that arrives while a long one
generates starts after at most one turn of each run, and is answered long before it. A rehearsal decodes in chunks
of ``--decode_chunk`` steps too, and after each the runs take a turn (new requests start; another rehearsal waits
for this one to end).

Limits (the server cannot be stalled or taken down by one request):
  * body size: ``--max_body_bytes`` (default `MAX_BODY_BYTES`, 4 MiB): a 413 ``request_too_large`` from the
    ``Content-Length`` or, for a chunked body, as soon as the bytes read pass it; nothing is parsed (`Guard`).
  * stop strings: at most 4, each at most `MAX_STOP_BYTES` (64) bytes: a 400 naming ``stop[i]``.
  * JSON nesting: `MAX_JSON_DEPTH` (64) levels of arrays and objects, in the body and in a tool call's
    ``arguments``: a 400 ``json_too_deep`` (``param``: the arguments' field). NaN and Infinity are refused (400), and
    so is a number that overflows to it (``1e999``).
  * parsing, validation and tokenizing run in a worker thread, off the event loop; a prompt whose text is bytes
    enough to be over the context for any tokenization (over ``2 x`` the longest token's bytes per context token)
    is refused (400 ``context_length_exceeded``) without tokenizing it, and one over `PRECOUNT_BYTES` of text is
    counted first with the tokenizer's batch call, which releases the GIL (its single-text call, which the chat
    template's rendering uses, holds it: 4 s for 2 MB with SmolLM2's), so only a prompt that fits is rendered.
  * queue: ``--max_queue`` (default `MAX_QUEUE`) requests waiting or generating; one more is a 429
    ``rate_limit_exceeded`` with ``Retry-After`` (`RETRY_AFTER_S`).
  * cancellation: a request whose client disconnects (checked every `DISCONNECT_POLL_S` while it waits; a streamed
    answer counts, since it is sent when finished) is dropped before it starts, or its rows stop decoding at the end
    of the current turn (at most ``--decode_chunk`` steps).
  * any exception that escapes a route is a JSON 500 (``server_error``) and is logged; the connection stays usable.
  * sampling values: temperature and top_p are data of the compiled programs: a value the server has not seen
    compiles nothing (before, each new pair compiled the decode loop, 10-16 s on CPU, stalling every request).
  * rehearsals: a rehearsing request gives the runs a turn after each ``--decode_chunk`` steps of its own decoding,
    and stops at the next one once its client is gone.
  Not bounded: a rehearsal's prefills, the host work between its generations and the programs it compiles the first
  time are not divided into turns; one rehearsal at a time (another waits for it to end, while plain requests are
  served); a run's rows are not refilled while it decodes (a new request starts a new run instead); a new set of stop
  strings compiles (they are static in the stop matcher's program) while every request waits.

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for malformed JSON, a bad field or
tool schema (JSON Schema, ``jsonschema``), text the tokenizer cannot take (a lone surrogate such as the JSON escape
``"\\ud800"``, NUL or a Unicode noncharacter: ``model/sanitize.py``) in a message, a tool call's arguments, a tool
schema or ``stop`` (``param`` names the field, e.g. ``messages[1].content``, ``stop[0]``), a content part that is not
text, a ``stream`` that is not a boolean, a ``tool`` message that answers no call of the assistant message before it or
one answered already, two calls of one message with the same id, a conversation the chat template cannot render, or a
context that does not fit (``context_length_exceeded``); 401 for a missing or wrong ``--api_key`` (compared in constant
time; with ``WWW-Authenticate: Bearer``); 404 for another model name; 413 for a body over the limit; 429 for a full
queue; 500 for a failure inside the engine or the server. The server keeps serving after each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import fastapi
import jax
import numpy as np
from fastapi import responses

from envace_jax import policy as policy_lib
from envace_jax.config.choices import REHEARSAL_MODES
from envace_jax.envs.base import ChatMessage, Task
from envace_jax.envs.base import ToolCall as EnvToolCall
from envace_jax.model import sanitize
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import ChatTemplateError, Tokenizer
from envace_jax.rehearsal import private, views
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.sampling.sampler import Sampler, SamplingParams, next_pow2
from envace_jax.sampling.stopping import FinishReason

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
MIN_CAPACITY = 512  # a batch's cache slots per row: a power of two >= its longest prompt + budget, at least this
# The longest stop string (UTF-8 bytes): the stop matcher's program unrolls one step per byte, so a megabyte stop string
# would compile for minutes and hold up every request (a newcomer's finding).
MAX_STOP_BYTES = 64
MAX_JSON_DEPTH = 64  # the deepest nesting of arrays and objects a request body (or a tool call's arguments) may have
MAX_QUEUE = 256  # --max_queue's default: requests waiting or generating; one more is a 429 with Retry-After
RETRY_AFTER_S = 1  # the Retry-After of that 429
DECODE_CHUNK = 8  # --decode_chunk's default: decode steps between the engine's looks at new and abandoned requests
MAX_RUNS = 4  # batches generating at once (each its own cache), decoded in turns of DECODE_CHUNK steps
DISCONNECT_POLL_S = 0.1  # how often a waiting request checks that its client is still connected
MAX_BODY_BYTES = 4 * 2**20  # --max_body_bytes's default: a request body over it is a 413 (OpenAI caps far lower)
PRECOUNT_BYTES = 16 * 2**10  # messages with more text are counted (GIL released) before the template renders them
DRAIN_BYTES = 64 * 2**20  # a refused body is read and dropped up to this, so the client reads the 413, not a reset


class ApiError(Exception):
  """A request the server refuses: HTTP ``status`` and OpenAI's error fields."""

  def __init__(
    self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None, headers=None
  ):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
    self.headers: dict[str, str] = dict(headers or {})

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------------------------------
# Requests: OpenAI's JSON -> what the engine needs.


@dataclasses.dataclass(frozen=True)
class RehearsalRequest:
  """The ``rehearsal`` extension field: a mode of ``eval.rehearsal`` and N rehearsals."""

  mode: str
  n: int


@dataclasses.dataclass
class Job:
  """One chat completion request, rendered.

  Attributes:
    messages: the conversation (ACT's view), system messages first as sent.
    tools: OpenAI function schemas rendered into the prompt (empty with ``tool_choice="none"``).
    prompt: int32[T] ids of the rendered prompt (generation header included); roles: int32[T] their role ids.
    max_tokens: the generation budget of each choice (tokens); n: choices (rows).
    sampling: `SamplingParams`; stops: the client's stop strings (cut from the text); act_stops: the rollout's ACT
      stop strings (kept, as in training).
    seed: the client's seed, or None (then the engine's counter picks the keys).
    rehearsal: the extension field, or None; rehearsal_info: what the rehearsal made (``Choice.rehearsal``).
  """

  messages: list[ChatMessage]
  tools: list[dict[str, Any]]
  prompt: np.ndarray
  roles: np.ndarray
  max_tokens: int
  n: int
  sampling: SamplingParams
  stops: tuple[str, ...]
  act_stops: tuple[str, ...]
  seed: int | None
  rehearsal: RehearsalRequest | None
  rehearsal_info: dict[str, Any] | None = None
  future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
  cancelled: bool = False  # set by `Engine.cancel` (its client went away): its rows stop at the next decode chunk


def json_too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
  """Whether JSON-like ``value`` nests arrays and objects deeper than ``limit`` levels (``{"a": [1]}`` is 2 deep).
  Iterative: no recursion however deep ``value`` is."""
  stack = [(value, 1)]
  while stack:
    item, depth = stack.pop()
    if isinstance(item, Mapping):
      children = item.values()
    elif isinstance(item, list | tuple):
      children = item
    else:
      continue
    if depth > limit:
      return True
    stack.extend((child, depth + 1) for child in children)
  return False


def _no_constant(name: str):
  raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _finite(text: str) -> float:
  value = float(text)
  if not np.isfinite(value):
    raise ValueError(f"the number {text[:32]} overflows to infinity (JSON numbers must be finite)")
  return value


def parse_json(text: str | bytes, what: str, param: str | None = None) -> Any:
  """``text`` parsed as strict JSON: no NaN or Infinity (nor a number that overflows to it, such as ``1e999``), at
  most `MAX_JSON_DEPTH` levels of nesting.

  Raises:
    ApiError: 400 naming ``what`` (e.g. "the request body") and ``param``: ``text`` is not JSON, holds NaN,
      Infinity or a number beyond float64's range, or nests deeper than the limit (code ``json_too_deep``; before,
      parsing ran out of stack, a RecursionError, and it was a 500).
  """
  deep = ApiError(
    400,
    f"{what} nests arrays and objects deeper than {MAX_JSON_DEPTH} levels, the limit; send flatter JSON",
    param=param,
    code="json_too_deep",
  )
  try:
    value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
  except RecursionError:
    raise deep from None
  except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError, NaN/Infinity
    raise ApiError(400, f"{what} is not valid JSON: {e}", param=param) from e
  if json_too_deep(value):
    raise deep
  return value


def check_text(value: Any, where: str) -> None:
  """Refuses text the tokenizer would not read as sent: every string in ``value`` (JSON-like data: mapping keys and
  values, list items, recursively) must be free of `sanitize.UNENCODABLE` code points, which the rollouts replace with
  U+FFFD. Raises ApiError (400) whose ``param`` is the JSON path of the first such string (``where`` for ``value``
  itself, e.g. ``messages[1].content``, ``stop[0]``)."""
  if isinstance(value, str):
    problem = sanitize.describe(value)
    if problem is not None:
      message = f"{where}: {problem}, which the model's tokenizer cannot encode; send valid Unicode text"
      raise ApiError(400, message, param=where, code="invalid_text")
  elif isinstance(value, Mapping):
    for key, item in value.items():
      check_text(key, f"{where} (a key)")
      check_text(item, f"{where}.{key}")
  elif isinstance(value, list | tuple):
    for i, item in enumerate(value):
      check_text(item, f"{where}[{i}]")


def _text_content(content: Any, where: str) -> str:
  """A message's content: a string, None, or a list of text parts. Raises ApiError (400, ``param`` ``where``,
  e.g. ``messages[1].content``) otherwise."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for k, part in enumerate(content):
      if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        message = f"{where}[{k}]: only text content parts ({{'type': 'text', 'text': ...}}) are supported"
        raise ApiError(400, message, param=where)
      parts.append(part["text"])
    return "".join(parts)
  raise ApiError(400, f"{where}: content must be a string, null or a list of text parts", param=where)


def parse_messages(raw: Any) -> list[ChatMessage]:
  """OpenAI chat messages as `ChatMessage`s ("developer" is a system message; an assistant's ``tool_calls``, whose
  ``function.arguments`` is a JSON object string, strict JSON as `parse_json` reads it, become calls); a ``tool``
  message must answer one of the calls of the assistant message before it (after other tool messages), by its
  ``tool_call_id``, as OpenAI requires, and answer each call once; an assistant message's calls have distinct ids.
  Raises ApiError (400) naming the bad message or field."""
  if not isinstance(raw, list) or not raw:
    raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
  out = []
  answerable: set[str] | None = None  # the ids of the last assistant message's tool calls not answered yet
  answered: dict[str, int] = {}  # id -> the tool message that answered it, since that assistant message
  for i, m in enumerate(raw):
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
      raise ApiError(400, f"{where} must be an object", param=where)
    role = m.get("role")
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant", "tool"):
      raise ApiError(400, f"{where}.role={role!r}; valid: system, developer, user, assistant, tool", param=where)
    content = _text_content(m.get("content"), f"{where}.content")
    calls = []
    if role == "assistant" and not isinstance(m.get("tool_calls") or [], list):
      raise ApiError(400, f"{where}.tool_calls must be a list of tool calls", param=where)
    for j, call in enumerate(m.get("tool_calls") or () if role == "assistant" else ()):
      fn = call.get("function") if isinstance(call, Mapping) else None
      name = fn.get("name") if isinstance(fn, Mapping) else None
      if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.tool_calls[{j}] needs function.name", param=where)
      arguments = fn.get("arguments") or "{}"
      field = f"{where}.tool_calls[{j}].function.arguments"
      if isinstance(arguments, str):
        arguments = parse_json(arguments, field, param=field)
      if not isinstance(arguments, Mapping):
        raise ApiError(400, f"{field} must be a JSON object", param=field)
      check_text(arguments, f"{where}.tool_calls[{j}].function.arguments")  # escapes inside the JSON string
      call_id = str(call.get("id") or "")
      twice = next((k for k, c in enumerate(calls) if call_id and c.id == call_id), None)
      if twice is not None:
        message = (
          f"{where}.tool_calls[{j}].id={call_id!r} is the id of {where}.tool_calls[{twice}] too; ids must differ"
        )
        raise ApiError(400, message, param=f"{where}.tool_calls[{j}].id")
      calls.append(EnvToolCall(name, dict(arguments), call_id))
    if role == "tool":
      if answerable is None:
        message = f"{where}: a 'tool' message must follow an assistant message with 'tool_calls' (it answers one)"
        raise ApiError(400, message, param=where)
      call_id = m.get("tool_call_id")
      if isinstance(call_id, str) and call_id in answered:
        message = f"{where}.tool_call_id={call_id!r} answers a call that messages[{answered[call_id]}] answered already"
        raise ApiError(400, message, param=f"{where}.tool_call_id")
      if not isinstance(call_id, str) or call_id not in answerable:
        known = ", ".join(sorted(repr(c) for c in answerable))
        message = f"{where}.tool_call_id={call_id!r} names none of the preceding assistant message's calls ({known})"
        raise ApiError(400, message, param=f"{where}.tool_call_id")
      answerable.discard(call_id)
      answered[call_id] = i
    else:
      answerable, answered = ({c.id for c in calls} if calls else None), {}
    out.append(ChatMessage(role, content, tool_calls=tuple(calls), tool_call_id=str(m.get("tool_call_id") or "")))
  return out


def check_tools(raw: Any) -> list[dict[str, Any]]:
  """OpenAI function tools, checked: ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``
  with a valid name and ``parameters`` a valid JSON Schema object. Raises ApiError (400) naming the bad tool."""
  import jsonschema

  if raw is None:
    return []
  if not isinstance(raw, list):
    raise ApiError(400, "'tools' must be a list of function tools", param="tools")
  names = set()
  for i, tool in enumerate(raw):
    where = f"tools[{i}]"
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
      raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
      raise ApiError(400, f"{where}.function.name={name!r} must match {TOOL_NAME.pattern}", param=where)
    if name in names:
      raise ApiError(400, f"{where}: tool {name!r} is given twice", param=where)
    names.add(name)
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
      raise ApiError(400, f"{where}.function.parameters must be a JSON Schema of type 'object'", param=where)
    try:
      jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
      raise ApiError(400, f"{where}.function.parameters is not a valid JSON Schema: {e.message}", param=where) from e
  return [dict(t) for t in raw]


def _number(body: Mapping[str, Any], name: str, default, low, high, kind=float):
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
    raise ApiError(400, f"'{name}' must be a{'n integer' if kind is int else ' number'}, got {value!r}", param=name)
  if not low <= value <= high:
    raise ApiError(400, f"'{name}'={value} is out of range [{low}, {high}]", param=name)
  return kind(value)


# ---------------------------------------------------------------------------------------------------------------------
# The engine: one thread, batched sampler calls.


class Engine:
  """Renders requests and answers them in batched sampler calls on one worker thread (module docstring).

  Args:
    samplers: the policy's samplers (`policy.Policy.samplers`: "policy", and "rehearse" for a REHEARSE tree of its
      own) and "reference" (the base weights), as `evaluate.load_policy` gives them.
    tokenizer: renders the chats.
    config: the run config (``rollout``: ACT's stop strings and the rehearsal's rollout; ``eval``: the rehearsal's
      budgets).
    max_batch: the most rows of one sampler call (a power of two).
    default_max_tokens: a request's budget when it gives none (clipped to what its context leaves).
    seed: the seed of the keys of requests without one.

    max_queue: requests waiting or generating at most (`submit` refuses one more: 429).
    decode_chunk: decode steps per turn of a run (between looks at new and abandoned requests).
    max_runs: runs decoding at once (each its own cache); more requests wait for one to end.

  Attributes:
    stats: counters since start: "sampler_calls" (runs started: ``Sampler.stream`` batches answering requests),
      "rows" (their rows, padding excluded), "requests", "rehearsals" (`private.rehearse` calls), "cancelled"
      (requests abandoned by their client before their answer), "dropped_rows" (rows of those stopped while
      decoding), "decode_chunks" (turns), "rehearsal_turns" (turns the runs took between a rehearsal's chunks).
  """

  def __init__(
    self,
    samplers,
    tokenizer: Tokenizer,
    config,
    *,
    max_batch: int = 32,
    default_max_tokens: int = 512,
    seed: int = 0,
    max_queue: int = MAX_QUEUE,
    decode_chunk: int = DECODE_CHUNK,
    max_runs: int = MAX_RUNS,
  ):
    if max_batch < 1 or max_batch & (max_batch - 1):
      raise ValueError(f"max_batch={max_batch} must be a power of two")
    if max_queue < 1 or decode_chunk < 1 or max_runs < 1:
      raise ValueError(f"max_queue={max_queue}, decode_chunk={decode_chunk}, max_runs={max_runs} must be >= 1")
    self.max_queue, self.decode_chunk, self.max_runs = max_queue, decode_chunk, max_runs
    self._pending = 0  # submitted, not yet resolved
    self._lock = threading.Lock()
    self.samplers, self.tokenizer, self.config = dict(samplers), tokenizer, config
    self.policy = policy_lib.Policy.from_config(config)
    self.sampler = self.samplers["policy"]
    self.context = int(self.sampler.config.max_seq_len)
    self.max_batch, self.default_max_tokens = max_batch, default_max_tokens
    self.unfold_config = UnfoldConfig.from_config(config, group_size=1)
    self.act_stops = tuple(self.unfold_config.stop_strings(Role.ACT))
    # A token stands for at most this many bytes: a text of B bytes is at least B / (2 * this) tokens (2: room for a
    # normalizer that composes characters), which refuses a huge prompt without tokenizing it.
    self.token_bytes = max(1, *(len(b) for b in tokenizer.token_bytes()))
    self._key = jax.random.key(seed)
    self._counter = 0
    self.stats = {
      "sampler_calls": 0,
      "rows": 0,
      "requests": 0,
      "rehearsals": 0,
      "cancelled": 0,
      "dropped_rows": 0,
      "decode_chunks": 0,
      "rehearsal_turns": 0,
    }
    self._queue: queue.Queue[Job | None] = queue.Queue()
    self._runs: list[_Run] = []  # generating (the worker thread's)
    self._waiting: list[Job] = []  # taken from the queue, not started yet
    self._closing = False
    self._thread = threading.Thread(target=self._loop, name="envace-serve-engine", daemon=True)
    self._thread.start()

  # -- the request side (any thread)

  def job(self, body: Mapping[str, Any]) -> Job:
    """A request's body (model already checked) as a `Job`, rendered. Raises ApiError (400)."""
    for name in ("messages", "tools", "stop"):
      check_text(body.get(name), name)
    messages = parse_messages(body.get("messages"))
    tool_choice = body.get("tool_choice") or "auto"
    if tool_choice not in ("auto", "none"):
      raise ApiError(400, f"tool_choice={tool_choice!r} is not supported; valid: 'auto', 'none'", param="tool_choice")
    tools = check_tools(body.get("tools"))
    if not isinstance(body.get("stream", False), bool | None):
      raise ApiError(400, f"'stream' must be a boolean, got {body['stream']!r}", param="stream")
    if tool_choice == "none":
      tools = []
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
      raise ApiError(400, "'top_p' must be > 0", param="top_p")
    n = _number(body, "n", 1, 1, self.max_batch, int)
    seed = _number(body, "seed", None, -(2**63), 2**64 - 1, int)
    stop = body.get("stop")
    stops = tuple(stop) if isinstance(stop, list) else () if stop is None else (stop,)  # checked as strings below
    if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
      raise ApiError(400, "'stop' must be a non-empty string or a list of at most 4 of them", param="stop")
    for i, s in enumerate(stops):
      if len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
        where = f"stop[{i}]" if isinstance(stop, list) else "stop"
        raise ApiError(400, f"{where!r} is longer than {MAX_STOP_BYTES} bytes (the server's limit)", param=where)
    rehearsal = body.get("rehearsal")
    if rehearsal is not None:
      mode = rehearsal.get("mode") if isinstance(rehearsal, Mapping) else None
      count = rehearsal.get("n", self.config.eval.rehearsal_n) if isinstance(rehearsal, Mapping) else None
      if mode not in REHEARSAL_MODES or isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
        raise ApiError(
          400,
          f"'rehearsal' must be {{'mode': one of {list(REHEARSAL_MODES)}, 'n': 1..64}}, got {rehearsal!r}",
          param="rehearsal",
        )
      rehearsal = None if mode == "off" else RehearsalRequest(mode, count)
    # A prompt far over the context is refused before the chat template renders it (its tokenizer call holds the
    # GIL: seconds for megabytes, during which the event loop stalls): first by its bytes, then by counting the
    # tokens of its texts with the backend's batch call, which releases the GIL. An assistant's text may be dropped
    # by the template, so only the others count (a huge one is refused only when rendered); each text may merge
    # with the template's text around it (2 tokens).
    texts = [m.content for m in messages if m.role != "assistant" and m.content]
    # Tool calls' arguments and the tool schemas are always rendered (a newcomer's 3.5 MB of either took 35-40 s).
    texts += [json.dumps(dict(c.arguments), ensure_ascii=False) for m in messages for c in m.tool_calls]
    texts += [json.dumps(tools, ensure_ascii=False)] if tools else []
    size = sum(len(t.encode("utf-8", "replace")) for t in texts)
    least = size // (2 * self.token_bytes)
    if least <= self.context and size > PRECOUNT_BYTES:
      counted = self.tokenizer.backend.encode_batch([sanitize.sanitize(t) for t in texts], add_special_tokens=False)
      least = sum(len(e.ids) for e in counted) - 2 * len(texts)
    if least > self.context:
      raise ApiError(
        400,
        f"This model's maximum context length is {self.context} tokens. However, your messages hold at least "
        f"{least} tokens ({size} bytes of text). Please reduce the length of the messages.",
        param="messages",
        code="context_length_exceeded",
      )
    prompt, roles = self.render(messages, tools)
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    room = self.context - len(prompt)
    if budget is None:
      budget = min(self.default_max_tokens, room)
    elif isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
      raise ApiError(400, f"'max_tokens' must be a positive integer, got {budget!r}", param="max_tokens")
    if room < 1 or budget > room:
      raise ApiError(
        400,
        f"This model's maximum context length is {self.context} tokens. However, you requested "
        f"{len(prompt) + max(int(budget), 1)} tokens ({len(prompt)} in the messages, {max(int(budget), 0)} in the "
        "completion). Please reduce the length of the messages or completion.",
        param="messages",
        code="context_length_exceeded",
      )
    return Job(
      messages,
      tools,
      prompt,
      roles,
      int(budget),
      n,
      SamplingParams(temperature, top_p),
      stops,
      self.act_stops if tools else (),
      seed,
      rehearsal,
    )

  def render(self, messages: Sequence[ChatMessage], tools) -> tuple[np.ndarray, np.ndarray]:
    """(ids, roles), int32[T]: ACT's view of ``messages`` with ``tools``, generation header included."""
    chat = [m for message in messages for m in views.act_messages(message)]
    try:
      return self.tokenizer.render(chat, tools=tools or None, add_generation_prompt=True, generation_role=Role.ACT)
    except ChatTemplateError as e:
      raise ApiError(400, f"the chat template cannot render these messages: {e}", param="messages") from e

  def submit(self, job: Job) -> concurrent.futures.Future:
    """Queues ``job``; its future resolves to a list of ``n`` `Choice`s (or an exception; it is cancelled after
    `cancel`).

    Raises:
      ApiError: 429 with ``Retry-After`` when ``max_queue`` requests are waiting or generating already.
    """
    with self._lock:
      if self._pending >= self.max_queue:
        raise ApiError(
          429,
          f"the server is busy: {self._pending} requests are waiting or generating, its limit (--max_queue); retry "
          f"after {RETRY_AFTER_S} s",
          type="rate_limit_error",
          code="rate_limit_exceeded",
          headers={"Retry-After": str(RETRY_AFTER_S)},
        )
      self._pending += 1
    job.future.add_done_callback(self._resolved)
    self._queue.put(job)
    return job.future

  def _resolved(self, future) -> None:
    with self._lock:
      self._pending -= 1

  @property
  def pending(self) -> int:
    """Requests submitted and not yet answered (waiting or generating)."""
    return self._pending

  def cancel(self, job: Job) -> None:
    """Abandons ``job`` (its client went away): dropped before it starts, or its rows stop decoding at the next
    chunk boundary (at most ``decode_chunk`` steps); its future is cancelled."""
    job.cancelled = True

  def close(self) -> None:
    """Stops the worker after the jobs already queued."""
    self._queue.put(None)
    self._thread.join()

  # -- the worker thread

  def _loop(self) -> None:
    """Turns (`_turn`) until `close`: a request that arrives while others generate starts after at most one turn of
    each run, and a rehearsal gives the runs their turns between its own decode chunks."""
    while True:
      self._turn()
      if self._closing and not self._runs and not self._waiting:
        return

  def _turn(self, rehearsing: bool = False) -> None:
    """One turn: takes the new jobs (waits for one when there is nothing else to do, unless ``rehearsing``), starts
    the waiting ones as new runs (at most ``max_runs`` at once; while ``rehearsing``, those that ask for a rehearsal
    wait for the current one to end), and decodes each run for ``decode_chunk`` steps, dropping abandoned rows."""
    items = []
    try:
      idle = not (self._runs or self._waiting or self._closing or rehearsing)
      items.append(self._queue.get() if idle else self._queue.get_nowait())
      while True:
        items.append(self._queue.get_nowait())
    except queue.Empty:
      pass
    for item in items:
      if item is None:
        self._closing = True
      else:
        self._waiting.append(item)
    self._waiting = [j for j in self._waiting if not self._abandoned(j)]
    if self._waiting and len(self._runs) < self.max_runs:
      ready = [j for j in self._waiting if not (rehearsing and j.rehearsal is not None)]
      self._waiting = [j for j in self._waiting if rehearsing and j.rehearsal is not None]
      self._serve(ready)
    for run in self._runs:
      self._step(run)
    self._runs = [run for run in self._runs if not run.over]

  def _abandoned(self, job: Job) -> bool:
    """Whether ``job`` was cancelled (its future then is)."""
    if job.cancelled and not job.future.done():
      job.future.cancel()
      self.stats["cancelled"] += 1
    return job.cancelled

  def _serve(self, jobs: list[Job]) -> None:
    """Starts the runs of the ``jobs`` that need no rehearsal, then rehearses the others (the runs take their turns
    meanwhile: `_rehearse`) and starts theirs."""
    self.stats["requests"] += len(jobs)
    self._runs.extend(self._runs_of([j for j in jobs if j.rehearsal is None]))
    rehearsed = [j for j in jobs if j.rehearsal is not None]
    if not rehearsed:
      return
    try:
      self._rehearse(rehearsed)
    except Exception as e:  # noqa: BLE001 -- reported to each request, the engine keeps serving
      for j in rehearsed:
        if not j.future.done():
          j.future.set_exception(e)
    self._runs.extend(self._runs_of([j for j in rehearsed if not j.future.done() and not self._abandoned(j)]))

  def _runs_of(self, jobs: list[Job]) -> list[_Run]:
    """The runs answering ``jobs``: one per distinct stop strings (each row has its own temperature and top_p), at
    most ``max_batch`` rows each, started now."""
    groups: dict[tuple[str, ...], list[Job]] = {}
    for j in jobs:
      groups.setdefault(j.act_stops + j.stops, []).append(j)
    runs = []
    for stops, members in groups.items():
      batch: list[Job] = []
      for j in members:
        if sum(x.n for x in batch) + j.n > self.max_batch:
          runs.append(self._start(batch, stops))
          batch = []
        batch.append(j)
      if batch:
        runs.append(self._start(batch, stops))
    return runs

  def _rehearse(self, jobs: list[Job]) -> None:
    """Private rehearsal for ``jobs`` (one `private.rehearse` per setting); re-renders each with its memory. Its
    samplers (`_Interleaved`) decode ``decode_chunk`` steps at a time and give the other runs a turn after each
    (`_turn`, ``rehearsing``); a setting whose every request was abandoned stops at its next chunk."""
    by_setting: dict[RehearsalRequest, list[Job]] = {}
    for j in jobs:
      by_setting.setdefault(j.rehearsal, []).append(j)
    for setting, members in by_setting.items():

      def between(members=members):
        if all(j.cancelled for j in members):
          raise _Abandoned
        self.stats["rehearsal_turns"] += 1
        self._turn(rehearsing=True)

      wrapped = {}  # one wrapper per sampler: the rollout groups its roles by sampler identity
      samplers = {
        name: wrapped.setdefault(id(s), _Interleaved(s, between, self.decode_chunk))
        for name, s in self.samplers.items()
      }
      prepared = []
      for j in members:
        system = "\n\n".join(m.content for m in j.messages if m.role == "system")
        opening = tuple(m for m in j.messages if m.role != "system")
        task = Task("request", "serve", "serve", "serve", system, tuple(j.tools))
        prepared.append(private.Prepared(task, 0, opening))
      cfg = private.PrivateRehearsalConfig.from_config(self.config, mode=setting.mode, num_rehearsals=setting.n)
      costs = {k: private.PhaseCost() for k in ("rehearsal", "assessment", "memory")}
      try:
        private.rehearse(
          prepared,
          self.policy.by_role(samplers),
          self.tokenizer,
          self.unfold_config,
          cfg,
          self._next_key(),
          reference_sampler=samplers.get("reference"),
          costs=costs,
        )
      except _Abandoned:
        continue  # its requests are cancelled (`_abandoned`)
      self.stats["rehearsals"] += 1
      generated = sum(c.generated_tokens for c in costs.values()) / len(members)
      for j, item in zip(members, prepared, strict=True):
        note = f"{private.MEMORY_HEADER}\n{item.memory}"
        first = next((i for i, m in enumerate(j.messages) if m.role == "system"), None)
        if first is None:
          j.messages.insert(0, ChatMessage("system", note))
        else:
          j.messages[first] = dataclasses.replace(j.messages[first], content=f"{j.messages[first].content}\n\n{note}")
        j.prompt, j.roles = self.render(j.messages, j.tools)
        j.max_tokens = min(j.max_tokens, self.context - len(j.prompt))
        j.rehearsal_info = {
          "mode": setting.mode,
          "n": setting.n,
          "memory": item.memory,
          "memory_tokens": item.memory_tokens,
          "generated_tokens": int(generated),
        }
        if j.max_tokens < 1:
          j.future.set_exception(
            ApiError(
              400,
              f"the messages with the rehearsal memory fill the model's context of {self.context} "
              "tokens; shorten the messages or lower eval.memory_max_tokens",
              code="context_length_exceeded",
            )
          )

  def _next_key(self) -> jax.Array:
    self._counter += 1
    return jax.random.fold_in(self._key, self._counter)

  def _start(self, jobs: list[Job], stops: tuple[str, ...]) -> _Run:
    """A run over every choice of ``jobs``: a `Sampler.stream` on a cache of its own, every row admitted (prefilled)
    now with its job's temperature and top_p (the decode program's data: a new value compiles nothing). On failure
    the jobs get the exception and the run is over."""
    rows = [(j, c) for j in jobs for c in range(j.n)]
    run = _Run(jobs, rows)
    try:
      mult = self.sampler.batch_multiple
      b = -(-next_pow2(len(rows)) // mult) * mult
      longest = max(len(j.prompt) + j.max_tokens for j in jobs)
      capacity = min(next_pow2(longest, MIN_CAPACITY), self.context)
      prompts = [j.prompt for j, _ in rows] + [[]] * (b - len(rows))
      roles = [j.roles for j, _ in rows] + [[]] * (b - len(rows))
      budgets = [j.max_tokens for j, _ in rows] + [1] * (b - len(rows))
      keys = []
      for j, c in rows:
        base = jax.random.key(j.seed % 2**32) if j.seed is not None else self._next_key()
        keys.append(jax.random.fold_in(base, c))
      keys += [jax.random.key(0)] * (b - len(rows))
      cache = self.sampler.init_cache(batch=b, capacity=capacity)
      run.stream = self.sampler.stream(cache, num_new=max(budgets), stop_strings=stops)
      run.stream.admit(
        prompts,
        roles,
        role=int(Role.ACT),
        keys=jax.numpy.stack(keys),
        max_new_tokens=budgets,
        active=[r < len(rows) for r in range(b)],
        sampling=[j.sampling for j, _ in rows] + [None] * (b - len(rows)),
      )
      self.stats["sampler_calls"] += 1
      self.stats["rows"] += len(rows)
    except Exception as e:  # noqa: BLE001 -- reported to each request, the engine keeps serving
      run.fail(e)
    return run

  def _step(self, run: _Run) -> None:
    """One turn of ``run``: drops the rows of abandoned jobs, decodes the others for ``decode_chunk`` steps, and
    answers every job whose rows have all finished."""
    if run.over:
      return
    try:
      gone = [r for r, (j, _) in enumerate(run.rows) if j.cancelled and run.stream.live[r]]
      if gone:
        run.stream.drop(gone)
        self.stats["dropped_rows"] += len(gone)
      for j in run.jobs:
        self._abandoned(j)
      if run.stream.live.any():
        for f in run.stream.advance(max_steps=self.decode_chunk):
          run.finished[f.row] = f
        self.stats["decode_chunks"] += 1
      for j in run.jobs:
        rows = run.rows_of[id(j)]
        if not j.future.done() and all(r in run.finished for r in rows):
          answer = [self._choice(j, c, run.finished[r].tokens, run.finished[r].finish) for c, r in enumerate(rows)]
          j.future.set_result(answer)
      if not run.stream.live.any():
        run.fail(RuntimeError("the generation ended without an answer"))  # no job is left unanswered
    except Exception as e:  # noqa: BLE001 -- reported to each request, the engine keeps serving
      run.fail(e)

  def _choice(self, job: Job, index: int, ids: list[int], finish: FinishReason) -> Choice:
    """One generated row as an OpenAI choice: text cut at the client's stop strings, tool calls parsed."""
    eos = set(self.tokenizer.eos_ids)
    text = self.tokenizer.decode(ids[:-1] if ids and ids[-1] in eos else ids)
    reason = "length" if finish in (FinishReason.LENGTH, FinishReason.CONTEXT_EXHAUSTED) else "stop"
    cuts = [text.find(s) for s in job.stops if s in text]
    if cuts:
      text, reason = text[: min(cuts)], "stop"
    calls: list[dict[str, Any]] = []
    if job.tools:
      names = [t["function"]["name"] for t in job.tools]
      act = views.parse_act(text, names, self.unfold_config.parallel_calls, self.unfold_config.act_parser)
      if act.error is None and act.calls:
        calls = [
          {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            # Arguments decoded from escapes such as \ud800 as the official parser gives them (U+FFFD): a lone
            # surrogate cannot be sent as UTF-8.
            "function": {"name": c.name, "arguments": sanitize.sanitize(json.dumps(c.arguments, ensure_ascii=False))},
          }
          for c in act.calls
        ]
        text, reason = act.reply, "tool_calls"
    return Choice(index, text, calls, reason, len(ids), job.rehearsal_info)


class _Abandoned(Exception):
  """Raised between a rehearsal's decode chunks when every request it rehearses for was abandoned: it stops."""


class _Interleaved:
  """``inner`` (a `Sampler`, or a stand-in with ``stream``) whose generations decode ``chunk`` steps at a time and
  call ``between()`` after each chunk that leaves them unfinished: a rehearsal's sampler, so that the engine's
  runs take their turns while it generates. Everything else is ``inner``'s; tokens are those ``inner`` samples."""

  generate = Sampler.generate  # a `Stream` run to its end: this object's stream, so chunked too

  def __init__(self, inner, between, chunk: int):
    self.inner, self.between, self.chunk = inner, between, chunk

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def stream(self, cache, **kwargs) -> _InterleavedStream:
    return _InterleavedStream(self.inner.stream(cache, **kwargs), self.between, self.chunk)


class _InterleavedStream:
  """A `Stream` whose `advance` decodes ``chunk`` steps at a time, calling ``between()`` after each chunk that did
  not end the call."""

  def __init__(self, inner, between, chunk: int):
    self.inner, self.between, self.chunk = inner, between, chunk

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def advance(self, until: int | None = None, max_steps: int | None = None) -> list:
    """As `Stream.advance`: the rows that finished once ``until`` of them (default: all) have, or after
    ``max_steps`` steps."""
    out, left = [], max_steps
    while True:
      steps = self.chunk if left is None else min(self.chunk, left)
      before = self.inner.decode_steps
      out += self.inner.advance(until=None if until is None else until - len(out), max_steps=steps)
      left = None if left is None else left - (self.inner.decode_steps - before)
      if not self.inner.live.any() or (until is not None and len(out) >= until) or (left is not None and left < 1):
        return out
      self.between()


class _Run:
  """Jobs generating together on one `Stream` (`Engine._start`): ``rows`` (job, choice index) by row,
  ``rows_of`` a job's rows, ``finished`` the rows handed back; ``over`` once every job is answered."""

  def __init__(self, jobs: list[Job], rows: list[tuple[Job, int]]):
    self.jobs, self.rows, self.stream, self.finished = jobs, rows, None, {}
    self.rows_of: dict[int, list[int]] = {}  # by id(job)
    for r, (j, _) in enumerate(rows):
      self.rows_of.setdefault(id(j), []).append(r)

  @property
  def over(self) -> bool:
    return all(j.future.done() for j in self.jobs)

  def fail(self, error: Exception) -> None:
    """Gives ``error`` to every job not answered yet."""
    for j in self.jobs:
      if not j.future.done():
        j.future.set_exception(error)


@dataclasses.dataclass(frozen=True)
class Choice:
  """One answer: its index, text (None-able in the response when there are calls), OpenAI tool calls, finish reason,
  generated tokens and the rehearsal it followed (None without one)."""

  index: int
  text: str
  tool_calls: list[dict[str, Any]]
  finish_reason: Literal["stop", "length", "tool_calls"]
  tokens: int
  rehearsal: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------------------------------
# The HTTP application.


def response_body(name: str, job: Job, choices: Sequence[Choice]) -> dict[str, Any]:
  """OpenAI's ``chat.completion`` object."""
  completion = sum(c.tokens for c in choices)
  body = {
    "id": f"chatcmpl-{uuid.uuid4().hex}",
    "object": "chat.completion",
    "created": int(time.time()),
    "model": name,
    "choices": [
      {
        "index": c.index,
        "message": {
          "role": "assistant",
          "content": c.text if (c.text or not c.tool_calls) else None,
          **({"tool_calls": c.tool_calls} if c.tool_calls else {}),
        },
        "logprobs": None,
        "finish_reason": c.finish_reason,
      }
      for c in choices
    ],
    "usage": {
      "prompt_tokens": len(job.prompt),
      "completion_tokens": completion,
      "total_tokens": len(job.prompt) + completion,
    },
  }
  if choices and choices[0].rehearsal is not None:
    body["rehearsal"] = choices[0].rehearsal
  return body


def _stream_events(body: Mapping[str, Any], usage: bool):
  """The finished ``body`` as ``chat.completion.chunk`` server-sent events: per choice its role, content and tool
  calls, then its finish reason; then the usage when ``usage`` (``stream_options.include_usage``) and ``[DONE]``."""
  head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
  for choice in body["choices"]:
    message = choice["message"]
    delta = {"role": "assistant", "content": message["content"]}
    if "tool_calls" in message:
      delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
    events = [
      {"index": choice["index"], "delta": delta, "logprobs": None, "finish_reason": None},
      {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]},
    ]
    for event in events:
      yield f"data: {json.dumps(head | {'choices': [event]})}\n\n"
  if usage:
    yield f"data: {json.dumps(head | {'choices': [], 'usage': body['usage']})}\n\n"
  yield "data: [DONE]\n\n"


async def _drain(receive, budget: int) -> None:
  """Reads and drops what is left of a request body, at most ``budget`` bytes."""
  while budget > 0:
    message = await receive()
    if message["type"] != "http.request":
      return
    budget -= len(message.get("body", b""))
    if not message.get("more_body", False):
      return


class Guard:
  """The outermost layer of the app (pure ASGI, so that nothing it does buffers a body or hides a disconnect): the
  API key, compared in constant time (`hmac.compare_digest`; a 401 carries ``WWW-Authenticate: Bearer``); the body
  size limit, a 413 before any parsing, from ``Content-Length`` or, for a chunked body, as soon as the bytes read
  pass it; and a JSON 500 in OpenAI's shape for any exception that escapes the app before its response started
  (logged with its traceback), so that no request gets a plain-text 500 or a reset connection."""

  def __init__(self, app, api_key: str = "", max_body_bytes: int = MAX_BODY_BYTES):
    self.app, self.api_key, self.max_body_bytes = app, api_key.encode("utf-8"), max_body_bytes

  def too_large(self, size: int | None = None) -> ApiError:
    sent = f" ({size} bytes)" if size is not None else ""
    message = (
      f"the request body{sent} is over the server's limit of {self.max_body_bytes} bytes (--max_body_bytes); "
      "send a shorter request"
    )
    return ApiError(413, message, code="request_too_large")

  @staticmethod
  async def reply(send, error: ApiError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(error.body()).encode("utf-8")
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *headers]
    await send({"type": "http.response.start", "status": error.status, "headers": head})
    await send({"type": "http.response.body", "body": payload})

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    if self.api_key:
      header = dict(scope["headers"]).get(b"authorization", b"")
      scheme, _, given = header.partition(b" ")
      # the scheme is case-insensitive (RFC 9110); compare_digest: no timing signal of how much of the key matched
      if not (scheme.lower() == b"bearer") & hmac.compare_digest(given.strip(), self.api_key):
        message = "Incorrect API key provided: pass it as 'Authorization: Bearer KEY'."
        error = ApiError(401, message, code="invalid_api_key")
        return await self.reply(send, error, [(b"www-authenticate", b"Bearer")])
    length = dict(scope["headers"]).get(b"content-length", b"")
    if length.isdigit() and int(length) > self.max_body_bytes:
      if int(length) <= DRAIN_BYTES:
        await _drain(receive, DRAIN_BYTES)
      return await self.reply(send, self.too_large(int(length)))
    received = 0

    async def limited_receive():
      nonlocal received
      message = await receive()
      if message["type"] == "http.request":
        received += len(message.get("body", b""))
        if received > self.max_body_bytes:
          if message.get("more_body", False):
            await _drain(receive, DRAIN_BYTES)
          raise self.too_large()  # the route's ApiError handler answers it
      return message

    started = False

    async def watched_send(message):
      nonlocal started
      started = started or message["type"] == "http.response.start"
      await send(message)

    try:
      await self.app(scope, limited_receive, watched_send)
    except ApiError as e:  # raised outside a route (its handler answers those)
      if not started:
        await self.reply(send, e, [(k.lower().encode(), v.encode()) for k, v in e.headers.items()])
    except Exception as e:  # noqa: BLE001 -- one request failed; the server and the connection keep serving
      logging.exception("envace_jax.serve: %s %s failed", scope.get("method"), scope.get("path"))
      if not started:
        error = ApiError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error")
        await self.reply(send, error)


def make_app(engine: Engine, name: str, api_key: str = "", max_body_bytes: int = MAX_BODY_BYTES):
  """The FastAPI app serving ``engine`` as model ``name``; every request must carry ``Bearer api_key`` when it is
  set, and a body of at most ``max_body_bytes`` (`Guard`). Parsing, validation and tokenizing run in a worker
  thread, so the event loop answers other requests (``/v1/models``) meanwhile."""
  app = fastapi.FastAPI(title="envace-jax", docs_url=None, redoc_url=None, openapi_url=None)
  created = int(time.time())

  app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

  @app.exception_handler(ApiError)
  async def api_error(request, error: ApiError):
    return responses.JSONResponse(error.body(), status_code=error.status, headers=error.headers)

  @app.exception_handler(404)
  async def not_found(request, error):
    return responses.JSONResponse(ApiError(404, f"no route {request.url.path}").body(), status_code=404)

  @app.exception_handler(405)
  async def not_allowed(request, error):
    message = f"{request.method} is not allowed on {request.url.path}"
    return responses.JSONResponse(ApiError(405, message).body(), status_code=405)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "envace-jax"}]}

  @app.post("/v1/chat/completions")
  async def chat(request: fastapi.Request):
    body = await asyncio.to_thread(parse_json, await request.body(), "the request body")
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") != name:
      raise ApiError(
        404,
        f"The model {body.get('model')!r} does not exist; this server serves {name!r}.",
        param="model",
        code="model_not_found",
      )
    try:
      job = await asyncio.to_thread(engine.job, body)
    except ApiError:
      raise
    except Exception as e:  # noqa: BLE001 -- a malformed field that no check names: still the client's error
      raise ApiError(400, f"invalid request: {type(e).__name__}: {e}") from e
    waiter = asyncio.wrap_future(engine.submit(job))  # ApiError 429 when the queue is full
    try:
      while not waiter.done():  # the client may leave meanwhile: then the engine drops the request's rows
        await asyncio.wait([waiter], timeout=DISCONNECT_POLL_S)
        if not waiter.done() and await request.is_disconnected():
          engine.cancel(job)
          return responses.Response(status_code=499)  # nginx's "client closed request": nobody reads it
      choices = waiter.result()
    except asyncio.CancelledError:  # the server cancelled this handler (shutdown, or a disconnect it saw first)
      engine.cancel(job)
      raise
    except ApiError:
      raise
    except Exception as e:  # noqa: BLE001 -- the engine failed this request; say so and keep serving
      raise ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error") from e
    out = response_body(name, job, choices)
    if body.get("stream"):
      options = body.get("stream_options")
      usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
      return responses.StreamingResponse(_stream_events(out, usage), media_type="text/event-stream")
    return out

  return app


# ---------------------------------------------------------------------------------------------------------------------
# The command line.


def load(checkpoint: str | None, model: str | None, config=None, rows: int = 32, fallback: bool = True):
  """(config, tokenizer, samplers, served name) of ``checkpoint`` (a run's workdir: its latest step, with the config
  stored in it) or of ``model``'s base weights (a preset name or a weights path; ``config`` gives the other settings,
  default the defaults; "tiny" takes SmolLM2's tokenizer). ``rows``: the samplers' largest batch
  (`runtime.make_sampler`). ``fallback`` (``--checkpoint_fallback``): a latest step that does not read is reported in
  one line (a warning) and the newest older step that reads is served (`checkpoint.Checkpointer.read_newest`).

  Raises:
    ValueError: neither or both of ``checkpoint`` and ``model``. checkpoint.CheckpointError: ``checkpoint`` is not a
      directory, holds no checkpoint, or one of another model; or its latest step is damaged and ``fallback`` is
      off, or no step reads (checkpoint.DamagedCheckpointError, one line).
  """
  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax import evaluate
  from envace_jax.config import defaults

  if bool(checkpoint) == bool(model):
    raise ValueError("give exactly one of --checkpoint=WORKDIR (a trained run) or --model=NAME|PATH (base weights)")
  if checkpoint:
    if not os.path.isdir(checkpoint):
      raise checkpoint_lib.CheckpointError(f"--checkpoint={checkpoint} is not a directory: give a run's workdir")
    found = evaluate.stored_config(checkpoint, fallback, "--checkpoint_fallback")  # new settings: their defaults
    if found is None:
      raise checkpoint_lib.CheckpointError(f"{checkpoint} holds no checkpoint; train one with envace_jax.main")
    config, _ = found
    config.train.checkpoint_fallback = fallback  # the restore below (`evaluate.restore_policy`) falls back the same
  else:
    config = defaults.or_defaults(config).copy_and_resolve_references()
    if os.path.exists(model):
      config.model_path = model
    else:
      config.model = model
    if config.model == "tiny" and not config.tokenizer:
      config.tokenizer = "smollm2-135m"
    name = os.path.basename(os.path.normpath(model))
  loaded, samplers, step = evaluate.load_policy(config, checkpoint, rows, "--checkpoint_fallback")
  if checkpoint:
    name = f"{os.path.basename(os.path.normpath(checkpoint))}-step{step}"  # the step restored
  return config, loaded.tokenizer, samplers, name


def main(argv: list[str]) -> None:
  """``python -m envace_jax.serve``: loads the weights, then serves until interrupted."""
  import uvicorn
  from absl import app as absl_app
  from absl import flags

  if len(argv) > 1:
    raise absl_app.UsageError(f"Unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax import compilation_cache

  compilation_cache.enable()

  try:
    config, tokenizer, samplers, name = load(f.checkpoint, f.model, f.config, f.max_batch, f.checkpoint_fallback)
  except (ValueError, checkpoint_lib.CheckpointError) as e:  # what to serve is wrong: one line, no traceback
    raise SystemExit(f"envace_jax.serve: {e}") from None
  engine = Engine(
    samplers,
    tokenizer,
    config,
    max_batch=f.max_batch,
    default_max_tokens=f.max_tokens,
    seed=config.seed,
    max_queue=f.max_queue,
    decode_chunk=f.decode_chunk,
  )
  app = make_app(engine, f.served_name or name, f.api_key, max_body_bytes=f.max_body_bytes)
  uvicorn.run(app, host=f.host, port=f.port, log_level="info")


def define_flags() -> None:
  """The command line's flags (defined only when run as a program: ``envace_jax.main`` defines --config too)."""
  from absl import flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", None, "With --model: a config file for the other settings (rollout, eval).")
  flags.DEFINE_string("checkpoint", None, "A training run's workdir: serve its latest checkpoint.")
  flags.DEFINE_boolean(
    "checkpoint_fallback", True, "A latest checkpoint that does not read: serve the newest older one that reads."
  )
  flags.DEFINE_string("model", None, "Serve base weights: a preset (smollm2-135m, tiny, ...) or a weights path.")
  flags.DEFINE_string("served_name", "", "The model name clients send ('': the workdir or model name).")
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind (0.0.0.0: every interface).")
  flags.DEFINE_integer("port", 8000, "TCP port.")
  flags.DEFINE_string("api_key", "", "When set, every request must send 'Authorization: Bearer API_KEY'.")
  flags.DEFINE_integer("max_batch", 32, "The most rows (choices) of one sampler call; a power of two.")
  flags.DEFINE_integer("max_tokens", 512, "A request's generation budget when it sets no max_tokens.")
  flags.DEFINE_integer("max_body_bytes", MAX_BODY_BYTES, "A request body over this many bytes is refused (413).")
  flags.DEFINE_integer("max_queue", MAX_QUEUE, "Requests waiting or generating at most; one more gets a 429.")
  flags.DEFINE_integer(
    "decode_chunk", DECODE_CHUNK, "Decode steps between looks at new and abandoned requests (fairness vs overhead)."
  )


if __name__ == "__main__":
  from absl import app as absl_app

  define_flags()
  absl_app.run(main)
