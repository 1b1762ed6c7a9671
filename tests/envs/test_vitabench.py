"""VitaBench: loading our fixture (the real task-file layout) through a stand-in for the `vita` package, malformed
records, tool execution on a fresh copy of each task's DB, the all-rubrics-met score through the checklist judge,
the config's start-up checks and the prepared dataset."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import pathlib
import sys
from typing import Any

import pytest
from absl import flags
from ml_collections import config_flags

from envace_jax import config_check
from envace_jax.envs import datasets, registry, vitabench
from envace_jax.envs.base import ChatMessage, EnvError, RewardInfo, Task, ToolCall

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = pathlib.Path(__file__).parent / "data" / "vitabench"  # laid out as the clone's data/vita folder
TASK_FILE = DATA / "domains" / "delivery" / "tasks_en.json"
RUBRICS_1 = [
  "The rice noodle restaurant must support Dine-in available",
  "The rice noodle product must not contain fried side dishes",
  "The delivery address should be Yunnan University Affiliated Hospital",
]


def _fn(name: str, **props: str) -> dict[str, Any]:
  properties = {k: {"type": v} for k, v in props.items()}
  return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


class FakeRunner:
  """A stand-in for vita's delivery toolkit over one DB copy (three tools, enough to test the adapter)."""

  def __init__(self, environment: dict[str, Any]):
    self.db = environment

  def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    if name == "get_delivery_store_info":
      store = self.db["stores"].get(arguments["store_id"])
      if store is None:
        raise ValueError(f"Store {arguments['store_id']} not found")
      return json.dumps(store), False
    if name == "create_delivery_order":
      order_id = f"{self.db['user_id']}-{len(self.db['orders']) + 1}"
      self.db["orders"][order_id] = {"store_id": arguments["store_id"], "status": "unpaid"}
      return json.dumps({"order_id": order_id}), False
    if name == "cancel_delivery_order":
      order = self.db["orders"][arguments["order_id"]]
      if order["status"] == "cancelled":
        return f"Order {arguments['order_id']} is already cancelled", False  # vita returns assertion text
      order["status"] = "cancelled"
      return f"Order {arguments['order_id']} has been cancelled.", False
    raise AssertionError(name)

  def state(self) -> Any:
    return self.db


class FakeBackend:
  """Implements `vitabench.Backend` without the `vita` package."""

  TOOLS = [
    _fn("cancel_delivery_order", order_id="string"),
    _fn("create_delivery_order", user_id="string", store_id="string"),
    _fn("get_delivery_store_info", store_id="string"),
  ]

  def __init__(self):
    self.started: list[tuple[str, dict]] = []

  def tool_schemas(self, domain, environment):
    if "stores" not in environment:
      raise ValueError("1 validation error for DeliveryDB: stores Field required")  # as vita's pydantic would
    return copy.deepcopy(self.TOOLS)

  def agent_policy(self, time):
    return f"# Environment\n- Current time: {time}"

  def start(self, domain, environment):
    self.started.append((domain, environment))
    return FakeRunner(environment)


def _tasks() -> list[Task]:
  return vitabench.load_tasks(DATA, "delivery", backend=FakeBackend())


def _records() -> list[dict]:
  return json.loads(TASK_FILE.read_text(encoding="utf-8"))


def test_fixture_loads_into_tasks():
  rice, cancel = _tasks()
  record = _records()[0]
  assert [t.id for t in (rice, cancel)] == ["10711001", "10711002"]
  assert {(t.benchmark, t.domain, t.split) for t in (rice, cancel)} == {("vitabench", "delivery", "test")}
  assert rice.system_prompt == "# Environment\n- Current time: 2025-06-21 11:20:00 Saturday"
  assert cancel.system_prompt.endswith("2024-05-12 16:19:36 Sunday")
  assert rice.tool_names == ("cancel_delivery_order", "create_delivery_order", "get_delivery_store_info")
  assert '"occupation": "Doctor"' in rice.user_scenario and record["instructions"] in rice.user_scenario
  assert rice.user_stop_markers == ("###STOP###",) and rice.user_turns == ()
  assert rice.gold_actions == () and rice.reference_interactions == ()
  # VitaBench's rubric list: state rubrics, then overall rubrics, each once.
  assert rice.criteria["rubrics"] == RUBRICS_1 == rice.criteria["nl_assertions"]
  assert cancel.criteria["rubrics"] == ["The order D20240512001 must be cancelled"]  # expected_states: null
  assert rice.criteria["environment"] == record["environment"]
  assert rice.criteria["vita_domain"] == "delivery" and rice.criteria["language"] == "english"
  assert rice.criteria["expected_states"][0]["required_orders"][0]["store_id"] == "S001"
  for task in (rice, cancel):
    assert Task.from_json(task.to_json()) == task


def test_data_path_layouts(tmp_path):
  clone = tmp_path / "vitabench"
  target = clone / "data" / "vita" / "domains" / "delivery" / "tasks_en.json"
  target.parent.mkdir(parents=True)
  target.write_bytes(TASK_FILE.read_bytes())
  for path in (clone, clone / "data" / "vita", clone / "data" / "vita" / "domains", target.parent, target):
    assert vitabench.find_task_file(path, "delivery") == target
  with pytest.raises(EnvError, match=r"no VitaBench instore task file \(tasks_en.json\)"):
    vitabench.find_task_file(clone, "instore")
  with pytest.raises(EnvError, match=r"\(tasks.json\).*git clone https://github.com/meituan-longcat/vitabench"):
    vitabench.find_task_file(clone, "delivery", language="chinese")
  with pytest.raises(EnvError, match="unknown VitaBench domain 'food'"):
    vitabench.find_task_file(clone, "food")
  with pytest.raises(EnvError, match="does not exist"):
    vitabench.find_task_file(tmp_path / "nope", "delivery")
  cross = vitabench.load_tasks(target, "cross_domain", backend=FakeBackend())  # a file: read as the domain's tasks
  assert cross[0].domain == "cross_domain" and cross[0].criteria["vita_domain"] == "delivery,instore,ota"


def test_missing_vita_package_is_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "vita", None)  # import vita fails even where it is installed
  with pytest.raises(EnvError, match=r"`vita` cannot be imported.*pip install -e"):
    vitabench.load_tasks(DATA, "delivery")


# ------------------------------------------------------------------------------------------ malformed records


def _set(path, value):
  def mutate(r):
    target = r
    for key in path[:-1]:
      target = target[key]
    target[path[-1]] = value

  return mutate


MALFORMED = {
  "missing id": (lambda r: r.pop("id"), "missing key 'id'"),
  "bad id": (_set(["id"], True), "'id' must be a non-empty string or an integer"),
  "missing environment": (lambda r: r.pop("environment"), "missing key 'environment'"),
  "environment not an object": (_set(["environment"], []), "'environment' (the task's database) must be an object"),
  "bad time": (_set(["environment", "time"], "2025-06-21"), "environment.time must be a time like"),
  "missing user_scenario": (lambda r: r.pop("user_scenario"), "missing key 'user_scenario'"),
  "no user_profile": (_set(["user_scenario"], {"persona": "x"}), "'user_scenario' must be an object with a"),
  "missing instructions": (lambda r: r.pop("instructions"), "missing key 'instructions'"),
  "empty instructions": (_set(["instructions"], " "), "'instructions' (the user's goal) must be a non-empty string"),
  "message history": (_set(["message_history"], [{"role": "user", "content": "hi"}]), "'message_history' is not"),
  "criteria not an object": (_set(["evaluation_criteria"], ["r"]), "'evaluation_criteria' must be an object or null"),
  "expected_states not a list": (
    _set(["evaluation_criteria", "expected_states"], {"a": 1}),
    "evaluation_criteria.expected_states must be a list of objects",
  ),
  "state rubric not a string": (
    _set(["evaluation_criteria", "expected_states"], [{"required_orders": [], "state_rubrics": [1]}]),
    "evaluation_criteria.expected_states[0].state_rubrics must be a list of strings",
  ),
  "overall rubrics not a list": (
    _set(["evaluation_criteria", "overall_rubrics"], "one rubric"),
    "evaluation_criteria.overall_rubrics must be a list of strings",
  ),
  "DB the toolkit refuses": (
    lambda r: r["environment"].pop("stores"),
    "VitaBench cannot build the delivery tools over this task's environment: 1 validation error",
  ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_record_raises_env_error_naming_it(case, tmp_path):
  mutate, problem = MALFORMED[case]
  records = _records()
  mutate(records[1])
  path = tmp_path / "tasks_en.json"
  path.write_text(json.dumps(records), encoding="utf-8")
  with pytest.raises(EnvError) as e:
    vitabench.load_tasks(path, "delivery", backend=FakeBackend())
  message = str(e.value)
  assert f"{path}[1]" in message  # the file and the record's index ...
  if isinstance(records[1].get("id"), str):
    assert "record '10711002'" in message  # ... and its id
  assert problem in message


def test_file_level_errors(tmp_path):
  path = tmp_path / "tasks_en.json"
  path.write_text("[{", encoding="utf-8")
  with pytest.raises(EnvError, match="not valid JSON"):
    vitabench.load_tasks(path, backend=FakeBackend())
  path.write_text('"tasks"', encoding="utf-8")
  with pytest.raises(EnvError, match="a JSON list of tasks, got str"):
    vitabench.load_tasks(path, backend=FakeBackend())
  path.write_text("[]", encoding="utf-8")
  with pytest.raises(EnvError, match="holds no records"):
    vitabench.load_tasks(path, backend=FakeBackend())
  path.write_text(json.dumps([_records()[0], 7]), encoding="utf-8")
  with pytest.raises(EnvError, match=r"record at .*tasks_en.json\[1\]: expected a JSON object, got int"):
    vitabench.load_tasks(path, backend=FakeBackend())
  path.write_text(json.dumps([_records()[0], _records()[0]]), encoding="utf-8")
  with pytest.raises(EnvError, match=r"record '10711001' at .*\[1\]: id already used by the record at .*\[0\]"):
    vitabench.load_tasks(path, backend=FakeBackend())


# ------------------------------------------------------------------------------------------------ VitaBenchEnv


def test_env_runs_tools_on_a_fresh_copy_of_the_task_db():
  rice, cancel = _tasks()
  backend = FakeBackend()
  env = vitabench.VitaBenchEnv(backend=backend)
  with pytest.raises(EnvError, match="reset"):
    env.execute(ToolCall("get_delivery_store_info", {"store_id": "S001"}))
  with pytest.raises(EnvError, match="'tau2'"):
    env.reset(Task.from_dict({**rice.to_dict(), "benchmark": "tau2"}))
  env.reset(cancel)
  assert backend.started[-1][0] == "delivery"
  before = env.state_hash()
  store = env.execute(ToolCall("get_delivery_store_info", {"store_id": "S001"}))
  assert not store.is_error and json.loads(store.text)["tags"] == ["Dine-in available", "Quick service"]
  assert env.state_hash() == before  # a read leaves the DB as it was
  done = env.execute(ToolCall("cancel_delivery_order", {"order_id": "D20240512001"}))
  assert done.text == "Order D20240512001 has been cancelled." and not done.is_error
  assert env.state_dict()["orders"]["D20240512001"]["status"] == "cancelled" and env.state_hash() != before
  missing = env.execute(ToolCall("get_delivery_store_info", {"store_id": "S999"}))
  assert missing.is_error and missing.text == "Error: Store S999 not found"  # a raising tool is an observation
  bad_args = env.execute(ToolCall("get_delivery_store_info", {}))
  assert bad_args.is_error and "store_id" in bad_args.text
  unknown = env.execute(ToolCall("book_flight", {}))
  assert unknown.is_error and unknown.text == "Error: Tool 'book_flight' not found."
  # The task's own DB is untouched, and the next trajectory starts from it again.
  assert cancel.criteria["environment"]["orders"]["D20240512001"]["status"] == "paid"
  env.reset(cancel)
  assert env.state_dict()["orders"]["D20240512001"]["status"] == "paid" and env.state_hash() == before


def test_evaluate_is_all_rubrics_met_and_invalid_without_a_judge():
  rice, _ = _tasks()
  conversation = [ChatMessage("assistant", "Hello, how can I help you?"), ChatMessage("user", "Rice noodles please")]
  env = vitabench.VitaBenchEnv(backend=FakeBackend())
  env.reset(rice)
  unjudged = env.evaluate(conversation)
  assert not unjudged.valid and math.isnan(unjudged.reward) and "--config.reward.kind=judge" in unjudged.info["error"]

  seen = []

  def fraction(value):
    return lambda task, conv: seen.append((task.criteria["nl_assertions"], len(conv))) or RewardInfo(value)

  total = 0.0
  for _ in range(10):  # ten equal weights of 0.1 sum to 0.9999999999999999: still "every rubric met"
    total += 0.1
  for score, reward in ((1.0, 1.0), (total, 1.0), (2 / 3, 0.0), (0.0, 0.0)):
    env = vitabench.VitaBenchEnv(scorer=fraction(score), backend=FakeBackend())
    env.reset(rice)
    info = env.evaluate(conversation)
    assert info.valid and info.reward == reward and info.breakdown["rubric_score"] == score
  assert seen[0] == (RUBRICS_1, 2)
  broken = vitabench.VitaBenchEnv(
    scorer=lambda t, c: RewardInfo(math.nan, valid=False, info={"error": "judge down"}), backend=FakeBackend()
  )
  broken.reset(rice)
  assert broken.evaluate(conversation).info == {"error": "judge down"}  # an invalid judgement stays invalid

  no_rubrics = Task.from_dict({**rice.to_dict(), "criteria": {**rice.criteria, "rubrics": [], "nl_assertions": []}})
  env.reset(no_rubrics)
  assert env.evaluate(conversation).reward == 1.0  # VitaBench scores a task without rubrics 1


def test_checklist_judge_scores_the_rubrics(monkeypatch):
  """rl.judge.ChecklistJudge as the scorer: one verdict per rubric (its derived checklist), no network."""
  from envace_jax.rl import judge

  rice, _ = _tasks()
  assert [item["pass_condition"] for item in judge.derived_checklist(rice)] == RUBRICS_1
  with judge.ChecklistJudge(
    judge.JudgeConfig.from_config(base_url="http://127.0.0.1:9/v1", model="m", max_concurrency=1)
  ) as j:
    conversation = [ChatMessage("user", "Mild rice noodles to the hospital, please")]
    env = vitabench.VitaBenchEnv(scorer=j, backend=FakeBackend())
    env.reset(rice)
    monkeypatch.setattr(j, "judge", lambda prompt, stop=None: judge.Verdict(True, "ok"))
    assert env.evaluate(conversation).reward == 1.0
    monkeypatch.setattr(j, "judge", lambda prompt, stop=None: judge.Verdict("fried" not in prompt, ""))
    info = env.evaluate(conversation)
    assert info.reward == 0.0 and info.breakdown["rubric_score"] == pytest.approx(2 / 3) and info.valid


def test_make_env_wires_the_judge_of_the_config():
  from envace_jax import scoring
  from envace_jax.rl import judge

  rice, _ = _tasks()
  config = _load_config("vitabench.py")
  env = scoring.make_env(config, rice)
  assert isinstance(env, vitabench.VitaBenchEnv) and env._scorer is None
  config.reward.judge_url, config.reward.judge_model = "http://127.0.0.1:9/v1", "judge-model"
  env = scoring.make_env(config, rice)
  assert isinstance(env._scorer, judge.ChecklistJudge) and env._scorer is scoring.make_env(config, rice)._scorer


# ----------------------------------------------------------------------------------------- config and dataset


def _load_config(spec: str, *overrides: str):
  argv = ["main", f"--config={ROOT / 'configs' / spec}", *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


def _problems(config) -> list[str]:
  with pytest.raises(config_check.ConfigError) as e:
    config_check.validate(config)
  return e.value.problems


@pytest.fixture
def vita_installed(monkeypatch):
  """config_check sees a `vita` package (without importing one)."""
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vita" else real(name, *a))


def test_config_without_data_says_what_to_download(vita_installed):
  problems = _problems(_load_config("vitabench.py"))
  assert problems[0].startswith("env.data_path is required for env.benchmark='vitabench'")
  assert "git clone https://github.com/meituan-longcat/vitabench" in problems[0]
  assert "--config.env.data_path=/path/to/vitabench" in problems[0]
  assert any(p.startswith("reward.judge_url=''") for p in problems)  # the rubric judge is required too


def test_config_with_data_and_judge_validates(vita_installed):
  judge_flags = ("--config.reward.judge_url=http://127.0.0.1:8000/v1", "--config.reward.judge_model=judge")
  config = _load_config("vitabench.py", f"--config.env.data_path={DATA}", *judge_flags)
  config_check.validate(config)
  assert (config.env.benchmark, config.env.domain, config.reward.kind) == ("vitabench", "delivery", "judge")
  (problem,) = _problems(_load_config("vitabench.py:ota", f"--config.env.data_path={DATA}", *judge_flags))
  assert "no VitaBench ota task file (tasks_en.json)" in problem
  (problem,) = _problems(_load_config("vitabench.py:food", f"--config.env.data_path={DATA}", *judge_flags))
  assert "env.domain='food' is not a vitabench domain" in problem
  (problem,) = _problems(_load_config("vitabench.py", f"--config.env.data_path={DATA}", "--config.reward.kind=rule"))
  assert "scored by an LLM judge over its rubrics" in problem


def test_config_without_vita(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vita" else real(name, *a))
  judge_flags = ("--config.reward.judge_url=http://127.0.0.1:8000/v1", "--config.reward.judge_model=judge")
  (problem,) = _problems(_load_config("vitabench.py", f"--config.env.data_path={DATA}", *judge_flags))
  assert problem.startswith("the package `vita` (VitaBench's tools) is not installed") and "pip install -e" in problem


def test_prepared_dataset_roundtrip(tmp_path, monkeypatch):
  monkeypatch.setattr(
    datasets, "_load_vitabench_tasks", lambda path, domain: vitabench.load_tasks(path, domain, backend=FakeBackend())
  )
  config = registry.get("vitabench").source_config("delivery", str(DATA))
  assert config == f"delivery:{DATA}"
  datasets.prepare("vitabench", config, tmp_path)
  source = datasets.load("vitabench", config, "test", tmp_path)
  assert list(source) == _tasks()
  with pytest.raises(EnvError, match="no VitaBench ota task file"):
    datasets.builder("vitabench", f"ota:{DATA}", tmp_path)
