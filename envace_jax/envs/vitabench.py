"""VitaBench (He et al. 2025, arXiv 2509.26490; github.com/meituan-longcat/vitabench, MIT) as `Task`s: each task's
own database, the benchmark's real tools run on it, and its rubric score through an injected LLM judge.

The data is not on PyPI: the user clones the repository (`DOWNLOAD_HINT`). Its task files are
`data/vita/domains/<domain>/tasks_en.json` (English) and `tasks.json` (Chinese) for the domains delivery, instore,
ota and cross_domain (`vita.utils.utils.get_task_file_path`). A task file is a JSON list of records as
`vita.data_model.tasks.Task` defines them (fields read here; others are kept in `criteria["record"]`)::

  {"id": "10711001", "domain": "delivery", "message_history": [],
   "environment": {"time": "2025-06-21 11:20:00", "user_id": "U000001", "orders": {...}, "stores": {...},
                   "weather": [...], "location": [...], "user_historical_behaviors": {...}},   # the task's own DB
   "user_scenario": {"user_profile": {"occupation": "Doctor", ...}},                        # the user's persona
   "instructions": "It's pouring rain outside ... order some mild rice noodles ...",       # the USER's goal
   "evaluation_criteria": {"expected_states": [{"required_orders": [...], "optional_orders": [...],
                                                 "state_rubrics": ["The restaurant must ...", ...]}],
                           "overall_rubrics": ["...", ...]}}

The tools are not in the task files: VitaBench's 66 tools are Python methods of its toolkits (fuzzy search over the
DB, geodesic delivery times, order creation, ...; `vita/domains/*/tools.py`). Re-implementing them would be another
benchmark, so they run through the installed `vita` package (`VitaBackend`); any `Backend` can stand in for it (the
tests use a small fake).

Mapping to `Task` (benchmark "vitabench", split "test": VitaBench has no training split): `system_prompt` is
VitaBench's agent policy at the task's time and weekday (`vita.agent.llm_agent.LLMAgent.system_prompt`); `tools` the
domain toolkit's OpenAI schemas; `user_scenario` the persona and instructions (`user_scenario_text`);
`user_stop_markers` ("###STOP###",); `criteria`: "environment" (the DB, copied fresh at every `reset`), "rubrics" and
"nl_assertions" (both `rubrics(evaluation_criteria)`: `rl.judge.ChecklistJudge` judges one item each),
"expected_states", "vita_domain", "language", "record". No gold actions or reference interactions: VitaBench logs
none (REHEARSE is not grounded on this benchmark).

Scoring (`VitaBenchEnv.evaluate`, as `evaluator_traj.py`): `rl.judge.ChecklistJudge` asks one question per rubric
over the whole conversation, where VitaBench's own judge slides a 10-message window and carries rubric states across
windows; the rubric set and the success rule are the same.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from envace_jax.envs.base import ChatMessage, EnvError, Observation, RewardInfo, Task, ToolCall, ToolEnv

BENCHMARK = "vitabench"
DOMAINS = ("delivery", "instore", "ota", "cross_domain")
LANGUAGES = ("english", "chinese")
TASK_FILES = {"english": "tasks_en.json", "chinese": "tasks.json"}
STOP = "###STOP###"  # vita.user.base.STOP, also the agent's end marker in VitaBench's agent policy
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
SUCCESS_TOLERANCE = 1e-6  # a rubric score within this of 1 counts as "every rubric met"
DOWNLOAD_HINT = (
  "VitaBench's tasks and tools are not on PyPI: git clone https://github.com/meituan-longcat/vitabench, "
  "pip install -e the clone (its tools run the tasks; vita reads src/vita/models.yaml at import, see its README), "
  "and pass --config.env.data_path=/path/to/vitabench (the clone, its data/vita/domains folder, or one tasks_en.json)"
)
_CROSS_DOMAINS = "delivery,instore,ota"  # how VitaBench's runner names the merged environment of cross_domain tasks
_WEEKDAYS = {
  "english": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
  "chinese": tuple(f"星期{d}" for d in "一二三四五六日"),
}

Scorer = Callable[[Task, Sequence[ChatMessage]], RewardInfo]


class Runner(Protocol):
  """One trajectory's live tools over one copy of a task's DB."""

  def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    """Runs a tool: (response text, is_error). May raise; `VitaBenchEnv.execute` turns exceptions into errors."""

  def state(self) -> Any:
    """The DB as JSON-compatible data."""


class Backend(Protocol):
  """What the adapter needs from VitaBench's code (`VitaBackend`), so that a stand-in can replace it."""

  def tool_schemas(self, domain: str, environment: Mapping[str, Any]) -> list[dict[str, Any]]:
    """OpenAI function schemas of the domain's toolkit (the DB is needed to build a toolkit, not to list it)."""

  def agent_policy(self, time: str) -> str:
    """The agent's system prompt at `time` ("2025-06-21 11:20:00 Saturday")."""

  def start(self, domain: str, environment: dict[str, Any]) -> Runner:
    """Fresh tools over `environment` (the caller's copy: the runner may mutate it)."""


def find_task_file(path: str | Path, domain: str, language: str = "english") -> Path:
  """The task file of `domain` under `path` (any layout `load_tasks` accepts).

  Raises:
    EnvError: unknown domain or language; nothing at `path`; no task file of that domain and language under it.
  """
  if domain not in DOMAINS:
    raise EnvError(f"unknown VitaBench domain {domain!r}; choose one of {list(DOMAINS)}")
  if language not in LANGUAGES:
    raise EnvError(f"unknown VitaBench language {language!r}; choose one of {list(LANGUAGES)}")
  path = Path(path).expanduser()
  if path.is_file():
    return path
  if not path.is_dir():
    raise EnvError(f"VitaBench data {str(path)!r} does not exist. {DOWNLOAD_HINT}")
  name = TASK_FILES[language]
  candidates = [path / name, path / domain / name, path / "domains" / domain / name]
  candidates.append(path / "data" / "vita" / "domains" / domain / name)
  for candidate in candidates:
    if candidate.is_file():
      return candidate
  looked = ", ".join(str(c) for c in candidates)
  raise EnvError(f"no VitaBench {domain} task file ({name}) under {str(path)!r} (looked for {looked}). {DOWNLOAD_HINT}")


def load_tasks(
  path: str | Path, domain: str = "delivery", *, language: str = "english", backend: Backend | None = None
) -> list[Task]:
  """Loads one domain's VitaBench tasks as `Task`s, validating every record.

  Args:
    path: the clone, its `data/vita/domains` folder, a domain folder, or a task file (a JSON list of records).
    domain: one of `DOMAINS` (which task file to read, and which toolkit builds the tools).
    language: "english" (`tasks_en.json`) or "chinese" (`tasks.json`); also the tools' and the policy's language.
    backend: builds tool schemas and the agent policy; default `VitaBackend(language)` (needs `vita` installed).

  Returns:
    The tasks in file order.

  Raises:
    EnvError: no task file; a file that is not a JSON list; a malformed record (the message names the file, the
      record's index and id, and the problem); two records with one id; `vita` missing (with the install line).
  """
  file = find_task_file(path, domain, language)
  backend = backend if backend is not None else VitaBackend(language)
  tasks: list[Task] = []
  seen: dict[str, str] = {}
  for where, record in _read_records(file):
    task = record_to_task(record, where=where, domain=domain, language=language, backend=backend)
    if task.id in seen:
      raise EnvError(f"record {task.id!r} at {where}: id already used by the record at {seen[task.id]}")
    seen[task.id] = where
    tasks.append(task)
  if not tasks:
    raise EnvError(f"VitaBench task file {str(file)!r} holds no records")
  return tasks


def _read_records(file: Path) -> Iterator[tuple[str, Any]]:
  """(position `file[index]`, record) for a JSON list; one JSON object counts as a list of one."""
  try:
    data = json.loads(file.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise EnvError(f"{file}: not valid JSON ({e})") from e
  if isinstance(data, Mapping):
    data = [data]
  if not isinstance(data, list):
    raise EnvError(f"{file}: a VitaBench task file is a JSON list of tasks, got {type(data).__name__}")
  for i, record in enumerate(data):
    yield f"{file}[{i}]", record


def rubrics(criteria: Any) -> list[str]:
  """VitaBench's rubric list from `evaluation_criteria` (state rubrics of each expected state, then the overall
  rubrics, each once, in that order: `TrajectoryEvaluator._initialize_rubric_states`). [] for None."""
  out: list[str] = []
  if not isinstance(criteria, Mapping):
    return out
  texts = [r for s in criteria.get("expected_states") or () for r in s.get("state_rubrics") or ()]
  for rubric in texts + list(criteria.get("overall_rubrics") or ()):
    if rubric not in out:
      out.append(rubric)
  return out


def weekday(time: str, language: str = "english") -> str:
  """The weekday of a "%Y-%m-%d %H:%M:%S" time in VitaBench's wording (`vita.utils.utils.get_weekday`)."""
  return _WEEKDAYS[language][datetime.datetime.strptime(time, TIME_FORMAT).weekday()]


def user_scenario_text(profile: Mapping[str, Any], instructions: str) -> str:
  """What the user simulator is told: the persona, then the instructions (VitaBench's user prompt gets the same
  two fields)."""
  persona = json.dumps(profile, ensure_ascii=False, indent=1)
  return f"Your persona:\n{persona}\n\nYour instructions:\n{instructions}"


def record_to_task(
  record: Any, *, where: str = "<record>", domain: str = "delivery", language: str = "english", backend: Backend
) -> Task:
  """Validates one VitaBench record and maps it to a `Task` (see the module docstring).

  Raises:
    EnvError: the record is malformed; the message starts with `record '<id>' at <where>`.
  """
  if not isinstance(record, Mapping):
    raise EnvError(f"record at {where}: expected a JSON object, got {type(record).__name__}")
  raw_id = record.get("id")
  task_id = str(raw_id) if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) else ""
  name = f"record {task_id!r} at {where}" if task_id else f"record at {where}"

  def fail(problem: str) -> EnvError:
    return EnvError(f"{name}: {problem}")

  for key in ("id", "environment", "user_scenario", "instructions"):
    if key not in record:
      raise fail(f"missing key {key!r}")
  if not task_id:
    raise fail(f"'id' must be a non-empty string or an integer, got {raw_id!r}")
  env = record["environment"]
  if not isinstance(env, Mapping):
    raise fail(f"'environment' (the task's database) must be an object, got {type(env).__name__}")
  time = env.get("time")
  try:
    datetime.datetime.strptime(time, TIME_FORMAT)
  except (TypeError, ValueError):
    raise fail(f"environment.time must be a time like '2025-06-21 11:20:00', got {time!r}") from None
  scenario = record["user_scenario"]
  profile = scenario.get("user_profile") if isinstance(scenario, Mapping) else None
  if not isinstance(profile, Mapping):
    raise fail("'user_scenario' must be an object with a 'user_profile' object (the user's persona)")
  instructions = record["instructions"]
  if not isinstance(instructions, str) or not instructions.strip():
    raise fail("'instructions' (the user's goal) must be a non-empty string")
  if record.get("message_history"):
    raise fail("a non-empty 'message_history' is not supported (VitaBench's released tasks start empty)")
  criteria = record.get("evaluation_criteria")
  if criteria is not None and not isinstance(criteria, Mapping):
    raise fail(f"'evaluation_criteria' must be an object or null, got {type(criteria).__name__}")
  criteria = criteria or {}
  states = criteria.get("expected_states")
  if states is not None:
    if not isinstance(states, list) or not all(isinstance(s, Mapping) for s in states):
      raise fail("evaluation_criteria.expected_states must be a list of objects")
    for i, state in enumerate(states):
      if not _strings(state.get("state_rubrics", [])):
        raise fail(f"evaluation_criteria.expected_states[{i}].state_rubrics must be a list of strings")
  if not _strings(criteria.get("overall_rubrics") or []):
    raise fail("evaluation_criteria.overall_rubrics must be a list of strings")
  vita_domain = _CROSS_DOMAINS if domain == "cross_domain" else domain
  try:
    tools = backend.tool_schemas(vita_domain, env)
    policy = backend.agent_policy(f"{time} {weekday(time, language)}")
  except EnvError:
    raise
  except Exception as e:  # noqa: BLE001 — vita's own validation of the DB (pydantic) names the bad field
    raise fail(f"VitaBench cannot build the {vita_domain} tools over this task's environment: {e}") from e
  rubric_list = rubrics(criteria)
  return Task(
    id=task_id,
    benchmark=BENCHMARK,
    domain=domain,
    split="test",
    system_prompt=policy,
    tools=tuple(tools),
    user_scenario=user_scenario_text(profile, instructions),
    user_stop_markers=(STOP,),
    criteria={
      "environment": dict(env),
      "rubrics": rubric_list,
      "nl_assertions": rubric_list,
      "expected_states": list(states or []),
      "vita_domain": vita_domain,
      "language": language,
      "record": {k: v for k, v in record.items() if k not in ("environment", "evaluation_criteria")},
    },
  )


def _strings(value: Any) -> bool:
  return isinstance(value, list) and all(isinstance(x, str) for x in value)


class VitaBackend:
  """VitaBench's own code (the `vita` package of a clone, `pip install -e`): toolkits, tool schemas, agent policy.

  Environments are built as VitaBench's runner builds them (`vita.run._run_task_internal`): a single domain through
  its registered `get_environment(environment, language)`, cross_domain through `get_cross_environment`. vita keeps
  stores, products and locations in per-thread registries and the current time in a module global; like its runner,
  `start` clears the registries and sets the time first, so trajectories of one thread must not interleave calls to
  environments of different tasks (each committed execution runs its trajectory's calls in order).

  Not exercised by this repository's tests (vita is not installable from PyPI); the adapter's contract with it is
  `Backend`.

  Args:
    language: "english" or "chinese" (tool descriptions and the policy).
  """

  def __init__(self, language: str = "english"):
    self.language = language
    self._vita: dict[str, Any] | None = None

  def _modules(self) -> dict[str, Any]:
    if self._vita is None:
      try:
        self._vita = {
          "registry": importlib.import_module("vita.registry"),
          "environment": importlib.import_module("vita.environment.environment"),
          "tasks": importlib.import_module("vita.data_model.tasks"),
          "utils": importlib.import_module("vita.utils.utils"),
        }
      except Exception as e:  # noqa: BLE001 — ImportError, or vita's FileNotFoundError for a missing models.yaml
        raise EnvError(
          f"the VitaBench package `vita` cannot be imported ({type(e).__name__}: {e}). {DOWNLOAD_HINT}"
        ) from e
    return self._vita

  def _environment(self, domain: str, environment: Mapping[str, Any]) -> Any:
    vita = self._modules()
    for cls in (vita["tasks"].StoreBaseModel, vita["tasks"].ProductBaseModel):
      clear = getattr(cls, "clear_thread_data", None)
      if clear is not None:
        clear()
    if "," in domain:
      env = vita["environment"].get_cross_environment(domain, dict(environment), self.language)
    else:
      env = vita["registry"].registry.get_env_constructor(domain)(dict(environment), self.language)
    vita["utils"].global_time = env.tools.db.time
    return env

  def tool_schemas(self, domain: str, environment: Mapping[str, Any]) -> list[dict[str, Any]]:
    env = self._environment(domain, copy.deepcopy(dict(environment)))
    return [tool.openai_schema for tool in sorted(env.get_tools(), key=lambda t: t.name)]

  def agent_policy(self, time: str) -> str:
    return self._modules()["environment"].get_agent_policy(self.language).format(time=time)

  def start(self, domain: str, environment: dict[str, Any]) -> Runner:
    return _VitaRunner(self._environment(domain, environment))


class _VitaRunner:
  """Calls on one vita `Environment` (`Environment.get_response` without its traceback printing)."""

  def __init__(self, env: Any):
    self._env = env

  def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    try:
      response = self._env.use_tool(name, **arguments)
    except Exception as e:  # noqa: BLE001 — vita reports tool failures as "Error: ..." tool messages
      return f"Error: {e}", True
    return type(self._env).to_json_str(response), False

  def state(self) -> Any:
    return self._env.tools.db.model_dump(mode="json")


class VitaBenchEnv(ToolEnv):
  """One VitaBench trajectory: the task's DB (a fresh copy per `reset`), its real tools, its rubric score.

  Args:
    scorer: the rubric judge, `(task, conversation) -> RewardInfo` with reward = fraction of rubrics met (e.g.
      `rl.judge.ChecklistJudge`); None: `evaluate` returns an invalid `RewardInfo` (the reason in `info`).
    backend: runs the tools; default `VitaBackend` in the task's language, made at the first `reset`.
  """

  def __init__(self, scorer: Scorer | None = None, backend: Backend | None = None):
    self._scorer = scorer
    self._backend = backend
    self._task: Task | None = None
    self._runner: Runner | None = None

  def reset(self, task: Task) -> None:
    """Starts a trajectory of `task` on a fresh copy of its DB. Raises `EnvError` for another benchmark's task or a
    missing `vita`."""
    if task.benchmark != BENCHMARK:
      raise EnvError(f"VitaBenchEnv runs {BENCHMARK!r} tasks; task {task.id!r} is from {task.benchmark!r}")
    if self._backend is None:
      self._backend = VitaBackend(task.criteria.get("language", "english"))
    self._runner = self._backend.start(task.criteria["vita_domain"], copy.deepcopy(dict(task.criteria["environment"])))
    self._task = task

  def _require(self) -> tuple[Task, Runner]:
    if self._task is None or self._runner is None:
      raise EnvError("VitaBenchEnv: call reset(task) first")
    return self._task, self._runner

  def execute(self, call: ToolCall) -> Observation:
    """Runs `call` on the task's tools. Unknown tools and tool failures are error `Observation`s."""
    task, runner = self._require()
    if call.name not in task.tool_names:
      return Observation(f"Error: Tool '{call.name}' not found.", is_error=True)
    try:
      text, is_error = runner.call(call.name, dict(call.arguments))
    except Exception as e:  # noqa: BLE001 — a bad call is an observation, never a crash (ToolEnv.execute)
      return Observation(f"Error: {e}", is_error=True)
    return Observation(text, is_error)

  def evaluate(self, conversation: Sequence[ChatMessage]) -> RewardInfo:
    """VitaBench's reward: 1 when the scorer finds every rubric met, else 0; "rubric_score" (the fraction met) and
    the scorer's own breakdown alongside. Raises `EnvError` only before `reset`."""
    task, _ = self._require()
    items = task.criteria.get("rubrics") or []
    if not items:
      return RewardInfo(1.0, {"rubric_score": 1.0}, info={"note": "no rubrics to evaluate (VitaBench scores 1)"})
    if self._scorer is None:
      reason = (
        "VitaBench is scored by an LLM judge over its rubrics and no judge is configured: set "
        "--config.reward.kind=judge --config.reward.judge_url=URL --config.reward.judge_model=NAME"
      )
      return RewardInfo(math.nan, valid=False, info={"error": reason})
    judged = self._scorer(task, conversation)
    if not judged.valid:
      return judged
    score = float(judged.reward)
    met = score >= 1.0 - SUCCESS_TOLERANCE
    breakdown = {**judged.breakdown, "rubric_score": score}
    return RewardInfo(1.0 if met else 0.0, breakdown, info={**judged.info, "rubrics": len(items)})

  def state_dict(self) -> Any:
    """The DB of the current trajectory (orders created, paid, cancelled, ...)."""
    _, runner = self._require()
    return runner.state()
