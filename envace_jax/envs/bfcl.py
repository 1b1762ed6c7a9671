"""BFCL v4 multi-turn (Berkeley Function-Calling Leaderboard) over the real `bfcl-eval` package.

Everything benchmark-specific comes from the package: the task files (`bfcl_eval/data/BFCL_v4_multi_turn_*.json`,
`possible_answer/`, `multi_turn_func_doc/`) through `bfcl_eval.utils.load_dataset_entry` / `load_ground_truth_entry`,
the executable backends (GorillaFileSystem, TwitterAPI, TradingBot, TravelAPI, MessageAPI, TicketAPI, MathAPI,
VehicleControlAPI) and the checker (`bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker`: state + response
checks after every turn). Nothing here re-implements a tool or a check. Install: `INSTALL_HINT`
(docs/troubleshooting.md: why `--no-deps`).

How the BFCL harness maps onto `Task` / `ToolEnv`:
- Categories: `CATEGORIES` (multi_turn_base, _miss_func, _miss_param, _long_context). BFCL has no train split: every
  task is `split="test"`.
- `system_prompt`: the instructions of BFCL's prompting mode (classic style: persona, task, multi-turn behaviour)
  without its output-format paragraph (our chat template renders tool calls) and without the function list (that is
  `Task.tools`). BFCL's function-calling mode sends no system prompt at all.
- `tools`: BFCL's function docs of the involved classes (with the package's "Python 3 syntax" hint) as OpenAI
  function schemas, converted as BFCL's OpenAI-completions handler does (`_to_openai_tools`). The `response` key (the
  return schema) is kept, as BFCL sends it.
- `user_turns`: one string per turn (every turn of these categories has exactly one user message; several would be
  joined with a blank line). miss_func: a function held out until turn k is absent from `Task.tools`; turn k has no
  user message in the data, and BFCL's handler injects "I have updated some more functions ..." (its prompting mode
  prefixes the function docs). `user_turns[k]` is that prompting-mode text, with the added tools as OpenAI schemas in
  JSON, so a model that only reads messages learns them; `criteria["tools_added"]` and `tools_at_turn` give them to a
  function-calling renderer. miss_param needs no special handling (the user supplies the missing value later).
- `gold_actions`: the possible-answer calls of all turns, in order, parsed with `ast` (positional arguments bound to
  names with the backend method's signature). Per-turn strings stay in `criteria["ground_truth"]` for the checker.

Out of scope: web_search_* and memory_* (`_OUT_OF_SCOPE`); the single-turn AST categories are not multi-turn.

Oracle: `python -m envace_jax.envs.bfcl --category=multi_turn_base --oracle` replays the ground truth through this
adapter and scores it with the package's checker.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import copy
import importlib
import inspect
import json
import keyword
import math
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from envace_jax.envs import registry
from envace_jax.envs.base import ChatMessage, EnvError, GoldAction, Observation, RewardInfo, Task, ToolCall, ToolEnv

BENCHMARK = "bfcl"
CATEGORIES = tuple(registry.BENCHMARKS[BENCHMARK].packaged_splits)
_OUT_OF_SCOPE = {
  "web_search_base": "needs the live web (SerpAPI and page fetches)",
  "web_search_no_snippet": "needs the live web (SerpAPI and page fetches)",
  "memory_kv": "needs BFCL's prerequisite memory conversations and their on-disk memory snapshots",
  "memory_vector": "needs a downloaded sentence-transformers embedding model (and faiss)",
  "memory_rec_sum": "needs BFCL's prerequisite memory conversations and their on-disk memory snapshots",
}
INSTALL_HINT = 'pip install --no-deps bfcl-eval==2026.3.23 && pip install -e ".[bfcl]"'

# Stands in for a call that cannot be rendered safely as a BFCL call string (a name that is not a plain identifier or
# would resolve to a builtin / a module global of BFCL's executor, or non-identifier argument names). The checker's
# `eval` of it fails with a NameError, which is what BFCL's own executor reports for an unknown function.
_UNRENDERABLE_CALL = "_envace_unrenderable_tool_call()"


def _import_bfcl(module: str) -> Any:
  """Imports a `bfcl_eval` module, or raises `EnvError` that says how to install it."""
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    raise EnvError(
      f"BFCL needs the bfcl-eval package and the `bfcl` extra (missing module {e.name!r}): {INSTALL_HINT}"
    ) from e


def _check_category(category: str) -> None:
  if category in _OUT_OF_SCOPE:
    raise EnvError(
      f"BFCL category {category!r} is out of scope: it {_OUT_OF_SCOPE[category]}. Use one of {CATEGORIES}."
    )
  if category not in CATEGORIES:
    raise EnvError(f"unknown BFCL multi-turn category {category!r}; valid: {CATEGORIES}")


def system_prompt() -> str:
  """The agent's instructions (module docstring, `system_prompt`), from `bfcl_eval.constants.default_prompts`."""
  style = _import_bfcl("bfcl_eval.constants.default_prompts").PROMPT_STYLE_TEMPLATES["classic"]
  return f"{style['persona']} {style['task']}\n\n{style['multiturn_behavior']}"


# ---------------------------------------------------------------------------------------------------------------------
# Function docs -> OpenAI tool schemas


def _cast_to_openai_type(properties: dict[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
  """Port of `bfcl_eval.model_handler.utils._cast_to_openai_type` (mutates and returns `properties`)."""
  for key, value in properties.items():
    if "type" not in value:
      properties[key]["type"] = "string"
    else:
      var_type = value["type"]
      if var_type == "float":
        properties[key]["format"] = "float"
        properties[key]["description"] += " This is a float type value."
      properties[key]["type"] = mapping.get(var_type, "string")
    if properties[key]["type"] in ("array", "object"):
      if "properties" in properties[key]:
        properties[key]["properties"] = _cast_to_openai_type(properties[key]["properties"], mapping)
      elif "items" in properties[key]:
        items = properties[key]["items"]
        items["type"] = mapping[items["type"]]
        if items["type"] == "array" and "items" in items:
          items["items"]["type"] = mapping[items["items"]["type"]]
        elif items["type"] == "object" and "properties" in items:
          items["properties"] = _cast_to_openai_type(items["properties"], mapping)
  return properties


def _to_openai_tools(functions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """BFCL function docs -> OpenAI tool schemas, as `convert_to_tool(functions, GORILLA_TO_OPENAPI,
  ModelStyle.OPENAI_COMPLETIONS)` in `bfcl_eval.model_handler.utils` does (that module imports tree-sitter parsers,
  so the OpenAI-completions branch is ported here; `tests/envs/test_bfcl.py` checks parity with the original)."""
  mapping = _import_bfcl("bfcl_eval.constants.type_mappings").GORILLA_TO_OPENAPI
  tools = []
  for item in copy.deepcopy(list(functions)):
    item["name"] = item["name"].replace(".", "_")  # OpenAI names match ^[a-zA-Z0-9_-]{1,64}$
    item["parameters"]["type"] = "object"
    item["parameters"]["properties"] = _cast_to_openai_type(item["parameters"]["properties"], mapping)
    tools.append({"type": "function", "function": item})
  return tools


def tools_at_turn(task: Task, turn: int) -> tuple[Mapping[str, Any], ...]:
  """The tool schemas the agent has at user turn `turn` (0-based): `task.tools` plus the miss_func tools added at or
  before that turn (`criteria["tools_added"]`, keyed by the turn as a string, as BFCL's `missed_function`)."""
  added = task.criteria.get("tools_added", {})
  extra = [t for k in sorted(added, key=int) if int(k) <= turn for t in added[k]]
  return tuple(task.tools) + tuple(extra)


# ---------------------------------------------------------------------------------------------------------------------
# Backends


def _backend_class(class_name: str) -> type:
  config = _import_bfcl("bfcl_eval.constants.executable_backend_config")
  if class_name not in config.CLASS_FILE_PATH_MAPPING:
    raise EnvError(f"unknown BFCL backend class {class_name!r}; known: {sorted(config.CLASS_FILE_PATH_MAPPING)}")
  return getattr(_import_bfcl(config.CLASS_FILE_PATH_MAPPING[class_name]), class_name)


def _public_methods(cls: type) -> list[str]:
  """The methods BFCL's executor exposes to the model: public (no leading underscore) methods of the class."""
  return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if not name.startswith("_")]


def _method_owners(involved_classes: Sequence[str]) -> dict[str, type]:
  """Method name -> backend class, for the task's involved classes (later classes win a clash, as in BFCL)."""
  owners: dict[str, type] = {}
  for class_name in involved_classes:
    cls = _backend_class(class_name)
    for name in _public_methods(cls):
      owners[name] = cls
  return owners


def _make_instances(involved_classes: Sequence[str], initial_config: Mapping[str, Any], long_context: bool) -> dict:
  """Fresh backend instances, set up as BFCL's `execute_multi_turn_func_call` does (stateless classes get no
  scenario), then deep-copied so that nothing aliases the backends' module-level data (the long-context extensions
  are shared dicts)."""
  stateless = _import_bfcl("bfcl_eval.constants.executable_backend_config").STATELESS_CLASSES
  instances = {}
  for class_name in involved_classes:
    instance = _backend_class(class_name)()
    if class_name not in stateless:
      instance._load_scenario(copy.deepcopy(dict(initial_config.get(class_name, {}))), long_context=long_context)
    instances[class_name] = copy.deepcopy(instance)
  return instances


def _format_result(result: Any) -> str:
  """A backend's return value as BFCL's executor turns it into text: str as is, dict as JSON (or `str` when not
  serialisable), anything else `str`."""
  if type(result) is str:  # noqa: E721 (BFCL's exact test)
    return result
  if type(result) is dict:  # noqa: E721
    try:
      return json.dumps(result)
    except (TypeError, ValueError):
      return str(result)
  return str(result)


class _Cycle(Exception):
  """A back-reference met while converting state to JSON."""


def _jsonable(value: Any, _path: tuple[int, ...] = ()) -> Any:
  """Backend state as JSON-compatible data: containers recursively, objects as their public attributes (the ones
  BFCL's state checker compares), back-references to an enclosing object (a directory's parent) left out."""
  if value is None or isinstance(value, bool | int | float | str):
    return value
  if id(value) in _path:
    raise _Cycle
  path = (*_path, id(value))
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v, path) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_jsonable(v, path) for v in value]
  if isinstance(value, set | frozenset):
    return [_jsonable(v, path) for v in sorted(value, key=repr)]
  if hasattr(value, "__dict__"):
    out = {}
    for k, v in vars(value).items():
      if k.startswith("_"):
        continue
      with contextlib.suppress(_Cycle):
        out[k] = _jsonable(v, path)
    return out
  return str(value)


def _public_state(instance: Any) -> dict[str, Any]:
  return {k: _jsonable(v) for k, v in vars(instance).items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------------------------------------------
# Ground truth <-> ToolCall


def parse_call(text: str, owners: Mapping[str, type] | None = None) -> GoldAction:
  """Parses one BFCL ground-truth call string, e.g. "cd(folder='document')", into a `GoldAction`.

  Args:
    text: a Python call with literal arguments, as in `possible_answer/BFCL_v4_multi_turn_*.json`.
    owners: method name -> backend class (`_method_owners`), used to bind positional arguments to their names
      ("sort('final_report.pdf')" -> {"file_name": "final_report.pdf"}).

  Raises:
    EnvError: not a single call with literal arguments, or positional arguments for a method not in `owners`.
  """
  try:
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
      raise ValueError("not a call of a plain name")
    name = node.func.id
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
  except (SyntaxError, ValueError) as e:
    raise EnvError(f"cannot parse BFCL ground-truth call {text!r}: {e}") from e
  if args:
    if not owners or name not in owners:
      raise EnvError(f"ground-truth call {text!r} has positional arguments and {name!r} is not a known method")
    try:
      bound = inspect.signature(getattr(owners[name], name)).bind(None, *args, **kwargs)
    except TypeError as e:
      raise EnvError(f"ground-truth call {text!r} does not fit {name}'s signature: {e}") from e
    kwargs = dict(list(bound.arguments.items())[1:])  # drop `self`
  return GoldAction(name=name, arguments=kwargs)


def _literal(value: Any) -> str:
  """A JSON-compatible value as a Python literal for a BFCL call string."""
  if value is None or isinstance(value, bool):
    return repr(value)
  if isinstance(value, int):
    return repr(int(value))
  if isinstance(value, float):
    return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
  if isinstance(value, str):
    return repr(value)
  if isinstance(value, list | tuple):
    return "[" + ", ".join(_literal(v) for v in value) + "]"
  if isinstance(value, Mapping):
    return "{" + ", ".join(f"{_literal(str(k))}: {_literal(v)}" for k, v in value.items()) + "}"
  return repr(str(value))


def _unsafe_names() -> frozenset[str]:
  """Names that BFCL's executor would resolve when it `eval`s a call string (its module globals and the builtins)."""
  utils = _import_bfcl("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils")
  return frozenset(vars(builtins)) | frozenset(vars(utils))


def _is_identifier(name: Any) -> bool:
  return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def render_call(call: ToolCall, known: frozenset[str] | set[str] = frozenset()) -> str:
  """A `ToolCall` as the call string BFCL's checker executes, e.g. "cd(folder='document')".

  A call that could not be rendered safely for the checker's `eval` (see `_UNRENDERABLE_CALL`) becomes a call of an
  undefined name: it fails there with an error result, as an unknown function does in BFCL. `known` names (the
  task's methods) are always rendered.
  """
  name, arguments = call.name, call.arguments
  if not isinstance(arguments, Mapping) or not all(_is_identifier(k) for k in arguments):
    return _UNRENDERABLE_CALL
  if name not in known and (not _is_identifier(name) or name in _unsafe_names()):
    return _UNRENDERABLE_CALL
  return f"{name}(" + ", ".join(f"{k}={_literal(v)}" for k, v in arguments.items()) + ")"


# ---------------------------------------------------------------------------------------------------------------------
# Tasks


def _entry_to_task(entry: Mapping[str, Any], ground_truth: Sequence[Sequence[str]], category: str) -> Task:
  prompts = _import_bfcl("bfcl_eval.constants.default_prompts")
  involved = list(entry["involved_classes"])
  owners = _method_owners(involved)
  tools_added = {k: _to_openai_tools(docs) for k, docs in entry.get("missed_function", {}).items()}
  user_turns = []
  for turn, messages in enumerate(entry["question"]):
    if str(turn) in tools_added:
      if messages:
        raise EnvError(f"{entry['id']}: miss_func turn {turn} has a user message; BFCL expects none")
      functions = json.dumps(tools_added[str(turn)], ensure_ascii=False)
      user_turns.append(prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=functions))
      continue
    if not messages or any(m["role"] != "user" for m in messages):
      raise EnvError(f"{entry['id']}: turn {turn} is not user messages: {messages!r}")
    user_turns.append("\n\n".join(m["content"] for m in messages))
  if len(ground_truth) != len(user_turns):
    raise EnvError(f"{entry['id']}: {len(user_turns)} user turns but {len(ground_truth)} ground-truth turns")
  gold = tuple(parse_call(c, owners) for turn in ground_truth for c in turn)
  return Task(
    id=entry["id"],
    benchmark=BENCHMARK,
    domain=category,
    split="test",
    system_prompt=system_prompt(),
    tools=tuple(_to_openai_tools(entry["function"])),
    user_turns=tuple(user_turns),
    gold_actions=gold,
    criteria={
      "category": category,
      "initial_config": copy.deepcopy(entry.get("initial_config", {})),
      "involved_classes": involved,
      "ground_truth": [list(turn) for turn in ground_truth],
      "long_context": "long_context" in category,
      "missed_function": {k: [d["name"] for d in v] for k, v in entry.get("missed_function", {}).items()},
      "tools_added": tools_added,
    },
  )


def load_tasks(category: str = "multi_turn_base") -> list[Task]:
  """Loads one BFCL v4 multi-turn category as `Task`s, in the package's order.

  Args:
    category: one of `CATEGORIES`.

  Returns:
    One `Task` per entry of `bfcl_eval/data/BFCL_v4_<category>.json` (200 each), built as the module docstring says.

  Raises:
    EnvError: unknown or out-of-scope category; bfcl-eval or the `bfcl` extra not installed; data and possible
      answers that do not line up.
  """
  _check_category(category)
  utils = _import_bfcl("bfcl_eval.utils")
  entries = utils.load_dataset_entry(category)
  answers = {a["id"]: a["ground_truth"] for a in utils.load_ground_truth_entry(category)}
  missing = [e["id"] for e in entries if e["id"] not in answers]
  if missing:
    raise EnvError(f"BFCL {category}: no possible answer for {missing[:5]} ({len(missing)} in all)")
  return [_entry_to_task(e, answers[e["id"]], category) for e in entries]


# ---------------------------------------------------------------------------------------------------------------------
# Environment


@contextlib.contextmanager
def _checker_run() -> Iterator[str]:
  """A model name unique to one checker run, and removal of the backend instances the checker caches under it.

  BFCL's `execute_multi_turn_func_call` keeps instances in its module globals keyed by model name and test id, so a
  second check of the same task under the same name would continue from the first one's state.
  """
  utils = _import_bfcl("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils")
  model_name = f"envace_{uuid.uuid4().hex}"
  try:
    yield model_name
  finally:
    for key in [k for k in vars(utils) if k.startswith(model_name)]:
      del vars(utils)[key]


@contextlib.contextmanager
def _long_context_data_restored() -> Iterator[None]:
  """Restores, in place, the long-context extension data that the backends share with their instances.

  In long-context mode TravelAPI merges the module-level `CREDIT_CARD_EXTENSION` / `BOOKING_RECORD_EXTENSION` dicts
  into its state without copying, so a booking replayed by BFCL's checker changes them for every later instance (and
  trajectory) in the process. `BfclEnv.reset` copies its own instances; this guards the checker's.
  """
  data = _import_bfcl("bfcl_eval.eval_checker.multi_turn_eval.func_source_code.long_context")
  saved = {k: copy.deepcopy(v) for k, v in vars(data).items() if not k.startswith("_") and isinstance(v, dict | list)}
  try:
    yield
  finally:
    for k, v in saved.items():
      target = vars(data)[k]
      if isinstance(target, dict):
        target.clear()
        target.update(v)
      else:
        target[:] = v


class BfclEnv(ToolEnv):
  """A BFCL multi-turn environment: the task's real backend instances, and the package's multi-turn checker.

  `evaluate` re-runs the conversation's calls with BFCL's checker on instances of its own (as BFCL scores a model), so
  a score does not depend on this env's instances.
  """

  def __init__(self) -> None:
    self._task: Task | None = None
    self._instances: dict[str, Any] = {}
    self._methods: dict[str, Any] = {}

  def reset(self, task: Task) -> None:
    """Fresh backend instances for `task`. Raises `EnvError` for a task that is not a BFCL multi-turn task."""
    if task.benchmark != BENCHMARK or "involved_classes" not in task.criteria:
      raise EnvError(f"task {task.id!r} is not a BFCL multi-turn task (benchmark {task.benchmark!r})")
    self._instances = _make_instances(
      task.criteria["involved_classes"],
      task.criteria.get("initial_config", {}),
      task.criteria.get("long_context", False),
    )
    self._methods = {}
    for instance in self._instances.values():
      for name in _public_methods(type(instance)):
        self._methods[name] = getattr(instance, name)
    self._task = task

  def _require_task(self) -> Task:
    if self._task is None:
      raise EnvError("BfclEnv: call reset(task) first")
    return self._task

  def execute(self, call: ToolCall) -> Observation:
    """Runs `call` on the backend instance that owns the method. Never raises for a bad call: an unknown function,
    bad or mistyped arguments and backend exceptions come back as `Observation(is_error=True)` with BFCL's executor
    text ("Error during execution: ..."); a backend's own error result (a dict with an "error" key) is passed through
    as text, with `is_error=True`. Raises `EnvError` only when `reset` was not called."""
    self._require_task()
    method = self._methods.get(call.name) if isinstance(call.name, str) else None
    if method is None:
      return Observation(f"Error during execution: name {call.name!r} is not defined", is_error=True)
    if not isinstance(call.arguments, Mapping):
      return Observation(f"Error during execution: arguments must be an object, got {call.arguments!r}", is_error=True)
    try:
      result = method(**copy.deepcopy(dict(call.arguments)))
    except Exception as e:  # noqa: BLE001 - any backend failure is the model's observation, as in BFCL
      return Observation(f"Error during execution: {e}", is_error=True)
    return Observation(_format_result(result), is_error=isinstance(result, dict) and "error" in result)

  def evaluate(self, conversation: Sequence[ChatMessage]) -> RewardInfo:
    """Scores the conversation with BFCL's `multi_turn_checker` (state and execution-response checks after each turn).

    The calls of each assistant message form one step of the user turn they follow (calls before the first user
    message are ignored); they are rendered as BFCL call strings (`render_call`). A conversation whose number of
    user turns differs from the task's fails as BFCL's "multi_turn:force_terminated" (a trajectory cut short, e.g. by
    the context budget). reward is 1.0 when the checker passes, else 0.0; `info` carries the checker's error type and
    message; `valid=False` only when the checker itself crashed.
    """
    task = self._require_task()
    ground_truth = task.criteria["ground_truth"]
    turns: list[list[list[str]]] = []
    known = frozenset(_method_owners(task.criteria["involved_classes"]))
    for message in conversation:
      if message.role == "user":
        turns.append([])
      elif message.role == "assistant" and message.tool_calls and turns:
        turns[-1].append([render_call(c, known) for c in message.tool_calls])
    breakdown_fail = {"multi_turn": 0.0}
    if len(turns) != len(ground_truth):
      return RewardInfo(
        0.0,
        breakdown_fail,
        info={
          "error_type": "multi_turn:force_terminated",
          "error_message": f"the conversation has {len(turns)} user turns, the task {len(ground_truth)}",
        },
      )
    checker = _import_bfcl("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")
    test_entry = {
      "id": task.id,
      "initial_config": copy.deepcopy(dict(task.criteria.get("initial_config", {}))),
      "involved_classes": list(task.criteria["involved_classes"]),
    }
    try:
      guard = _long_context_data_restored() if task.criteria.get("long_context") else contextlib.nullcontext()
      with guard, _checker_run() as model_name:
        result = checker.multi_turn_checker(turns, ground_truth, test_entry, task.domain, model_name)
    except Exception as e:  # noqa: BLE001 - a checker crash is not the agent's fault: exclude, do not score 0
      info = {"error_type": "checker_crash", "error_message": repr(e), "scoring_error": f"BFCL's checker: {e!r}"}
      return RewardInfo(math.nan, breakdown_fail, valid=False, info=info)
    if result.get("valid"):
      return RewardInfo(1.0, {"multi_turn": 1.0}, info={"calls": turns})
    details = result.get("details", {})
    info = {
      "error_type": result.get("error_type", ""),
      "error_message": result.get("error_message", ""),
      "calls": turns,
      "details": _jsonable({k: details[k] for k in ("differences", "missing_items") if k in details}),
    }
    return RewardInfo(0.0, breakdown_fail, info=info)

  def state_dict(self) -> dict[str, Any]:
    """The backends' state as BFCL's state checker sees it (public attributes per class), JSON-compatible."""
    self._require_task()
    return {name: _public_state(instance) for name, instance in self._instances.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Oracle


def oracle_conversation(task: Task, env: BfclEnv) -> list[ChatMessage]:
  """Replays the ground truth of `task` through `env` (reset here): per turn the user message, one assistant message
  with that turn's ground-truth calls, and their tool results. Turns without ground truth get no assistant call."""
  env.reset(task)
  owners = _method_owners(task.criteria["involved_classes"])
  messages = [ChatMessage("system", task.system_prompt)]
  for turn, (user_text, calls) in enumerate(zip(task.user_turns, task.criteria["ground_truth"], strict=True)):
    messages.append(ChatMessage("user", user_text))
    if not calls:
      continue
    tool_calls = tuple(
      ToolCall(g.name, g.arguments, id=f"call_{turn}_{i}") for i, g in enumerate(parse_call(c, owners) for c in calls)
    )
    messages.append(ChatMessage("assistant", tool_calls=tool_calls))
    messages += [env.answer(call) for call in tool_calls]
  return messages


def run_oracle(category: str, limit: int | None = None) -> list[tuple[Task, RewardInfo]]:
  """Oracle conversations of a category's tasks (the first `limit`), each scored by BFCL's checker."""
  env = BfclEnv()
  results = []
  for task in load_tasks(category)[:limit]:
    results.append((task, env.evaluate(oracle_conversation(task, env))))
  return results


def _main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m envace_jax.envs.bfcl", description=__doc__.splitlines()[0])
  parser.add_argument("--category", default="multi_turn_base", choices=CATEGORIES)
  parser.add_argument("--oracle", action="store_true", help="replay the ground truth and score it with BFCL's checker")
  parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")
  args = parser.parse_args(argv)
  if not args.oracle:
    tasks = load_tasks(args.category)
    print(f"{args.category}: {len(tasks)} tasks, {sum(len(t.user_turns) for t in tasks)} user turns")
    return 0
  start = time.perf_counter()
  results = run_oracle(args.category, args.limit)
  print(f"{'task':<32} {'turns':>5} {'calls':>5} {'reward':>6}  error")
  for task, reward in results:
    error = "" if reward.reward == 1.0 else f"{reward.info.get('error_type')}: {reward.info.get('error_message')}"
    print(f"{task.id:<32} {len(task.user_turns):>5} {len(task.gold_actions):>5} {reward.reward:>6.1f}  {error}")
  passed = sum(r.reward == 1.0 for _, r in results)
  print(f"oracle reward: {passed}/{len(results)}  ({time.perf_counter() - start:.1f} s)")
  return 0 if passed == len(results) else 1


if __name__ == "__main__":
  raise SystemExit(_main())
