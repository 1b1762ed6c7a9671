"""Checklist-format loading (CM2 records -> Task), its validation errors, and ChecklistEnv's replay and scoring."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from envace_jax.envs import checklist
from envace_jax.envs.base import ChatMessage, EnvError, Observation, ReferenceInteraction, RewardInfo, Task, ToolCall

FIXTURE = Path(__file__).parent / "data" / "checklist_fixture.jsonl"


def _records() -> list[dict]:
  return [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]


def _write_jsonl(path: Path, records) -> Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  return path


def test_fixture_loads_into_tasks():
  weather, football, chitchat = checklist.load_tasks(FIXTURE)

  assert [t.id for t in (weather, football, chitchat)] == ["weather-001", "football-002", "chitchat-003"]
  assert {t.benchmark for t in (weather, football, chitchat)} == {"checklist"}
  assert (weather.domain, football.domain, chitchat.domain) == ("weather", "checklist", "smalltalk")
  assert (weather.split, football.split, chitchat.split) == ("train", "train", "test")
  assert weather.system_prompt.startswith("You are a weather assistant")
  assert football.system_prompt == ""
  assert weather.user_turns == (
    "What's the weather in Paris and in Oslo right now, in Celsius?",
    "And the 3-day forecast for Oslo?",
  )
  assert weather.tool_names == ("get_weather", "get_forecast")
  assert chitchat.tool_names == ("lookup_phone",)  # a bare {"name": ...} spec is wrapped
  assert chitchat.tools[0]["type"] == "function"

  # Results arrive out of order (call_2 before call_1): matched by tool_call_id, kept in call order.
  assert [(r.name, dict(r.arguments), json.loads(r.result)["temp"] if "temp" in r.result else None)
          for r in weather.reference_interactions[:2]] == [
    ("get_weather", {"city": "Paris", "unit": "C"}, 12),
    ("get_weather", {"city": "Oslo", "unit": "C"}, -3),
  ]  # fmt: skip
  assert [(g.name, dict(g.arguments)) for g in weather.gold_actions] == [
    ("get_weather", {"city": "Paris", "unit": "C"}),
    ("get_weather", {"city": "Oslo", "unit": "C"}),
    ("get_forecast", {"city": "Oslo", "days": 3}),  # arguments given as an object, not a JSON string
  ]
  assert all(g.requestor == "assistant" and g.compare_args is None for g in weather.gold_actions)

  # CM2 logs: no tool_call_id (positional), a failed attempt that is grounding but not gold.
  assert [(dict(r.arguments), r.is_error) for r in football.reference_interactions] == [
    ({"teamid": "1234", "limit": 2}, True),
    ({"teamid": 1234, "limit": 2}, False),
  ]
  assert [dict(g.arguments) for g in football.gold_actions] == [{"teamid": 1234, "limit": 2}]
  assert chitchat.gold_actions == () and chitchat.reference_interactions == ()

  assert weather.criteria["turn_steps"] == [5, 4]
  turn0 = weather.criteria["checklists"][0][0]
  assert [i["id"] for i in turn0] == ["C0", "C1", "C2"]
  assert turn0[2]["dependence"] == ["C0", "C1"] and turn0[2]["weight"] == 0.5
  assert set(turn0[0]) == {
    "id", "question", "focus_on", "pass_condition", "failure_examples", "evidence", "required_for_next_turn",
    "dependence", "weight",
  }  # fmt: skip
  # CM2's labelling layout ({"checklist", "dependence", "weight"}) is merged into the items.
  (items,) = football.criteria["checklists"][0]
  assert [(i["id"], i["weight"], i["dependence"]) for i in items] == [("C0", 0.3, []), ("C1", 0.7, ["C0"])]
  assert len(chitchat.criteria["checklists"]) == 2  # two annotations
  assert chitchat.criteria["checklists"][1][0][1]["required_for_next_turn"] is False


def test_tasks_roundtrip_through_json():
  for task in checklist.load_tasks(FIXTURE):
    assert Task.from_json(task.to_json()) == task


def test_json_list_single_record_and_folder(tmp_path):
  records = _records()
  (tmp_path / "a.json").write_text(json.dumps(records[:2], indent=2), encoding="utf-8")
  (tmp_path / "b.json").write_text(json.dumps(records[2], indent=2), encoding="utf-8")  # one pretty record
  (tmp_path / "notes.txt").write_text("ignored", encoding="utf-8")
  assert [t.id for t in checklist.load_tasks(tmp_path / "a.json")] == ["weather-001", "football-002"]
  assert [t.id for t in checklist.load_tasks(tmp_path)] == ["weather-001", "football-002", "chitchat-003"]
  assert checklist.load_tasks(tmp_path / "a.json", domain="mine", split="dev")[1].split == "dev"
  assert checklist.load_tasks(tmp_path / "a.json", domain="mine")[1].domain == "mine"


def _drop_tool_message(r):
  del r["messages"][3]


def _drop_key(key):
  return lambda r: r.pop(key)


def _set(path, value):
  def mutate(r):
    target = r
    for key in path[:-1]:
      target = target[key]
    target[path[-1]] = value

  return mutate


def _item(r, turn=0, k=0):
  return r["checklists"][0][turn][k]


MALFORMED = {
  "missing uuid": (_drop_key("uuid"), "missing key 'uuid'"),
  "missing messages": (_drop_key("messages"), "missing key 'messages'"),
  "missing tools": (_drop_key("tools"), "missing key 'tools'"),
  "missing checklists": (_drop_key("checklists"), "missing key 'checklists'"),
  "empty uuid": (_set(["uuid"], ""), "'uuid' must be a non-empty string"),
  "weights do not sum to 1": (lambda r: _item(r).update(weight=0.3), "weights sum to 1.05"),
  "weights off by more than 1e-6": (lambda r: _item(r).update(weight=0.25 + 2e-6), "not 1 (tolerance 1e-06)"),
  "evidence turn": (lambda r: _item(r)["evidence"][0].update(turn=5), "evidence points to turn 5"),
  "evidence negative turn": (lambda r: _item(r)["evidence"][0].update(turn=-1), "evidence points to turn -1"),
  "evidence step": (lambda r: _item(r, 1)["evidence"][0].update(step=4), "step 4 of turn 1, which has 4 steps"),
  "evidence turn not int": (lambda r: _item(r)["evidence"][0].update(turn="0"), "'turn' must be an integer"),
  "tool call without result": (_drop_tool_message, "tool call without result: get_weather(id='call_2')"),
  "tool call without result at the end": (
    lambda r: r["messages"].__delitem__(slice(8, None)),
    "tool call without result: get_forecast(id='call_3')",
  ),
  "tool message without call": (
    lambda r: r["messages"].insert(5, {"role": "tool", "content": "{}"}),
    "messages[5]: tool message answers no pending tool call",
  ),
  "unknown tool_call_id": (_set(["messages", 3, "tool_call_id"], "call_9"), "tool_call_id 'call_9' matches no"),
  "arguments not JSON": (
    _set(["messages", 2, "tool_calls", 0, "function", "arguments"], "{city: Paris"),
    "messages[2].tool_calls[0] (get_weather): arguments are not valid JSON",
  ),
  "arguments not an object": (
    _set(["messages", 2, "tool_calls", 0, "function", "arguments"], "[1, 2]"),
    "arguments must be a JSON object",
  ),
  "call without name": (_set(["messages", 2, "tool_calls", 0, "function"], {}), "is not a tool call with a function"),
  "repeated call ids": (_set(["messages", 2, "tool_calls", 1, "id"], "call_1"), "repeated tool call ids"),
  "checklist turn count": (lambda r: r["checklists"][0].pop(), "one checklist per user turn (2), got 1"),
  "checklists not a list": (_set(["checklists"], {"C0": 1}), "'checklists' must be a non-empty list"),
  "empty turn": (_set(["checklists", 0, 1], []), "a turn's checklist must be a non-empty list"),
  "item missing question": (
    lambda r: _item(r).pop("question"),
    "checklists[0][0][0] (id 'C0'): missing key 'question'",
  ),
  "item missing weight": (lambda r: _item(r).pop("weight"), "missing key 'weight'"),
  "negative weight": (lambda r: _item(r).update(weight=-0.25), "weight must be a finite number >= 0"),
  "boolean weight": (lambda r: _item(r).update(weight=True), "weight must be a finite number >= 0"),
  "repeated item id": (lambda r: _item(r, 0, 1).update(id="C0"), "repeated item ids"),
  "unknown dependence": (lambda r: _item(r, 0, 2).update(dependence=["C7"]), "depends on ['C7']"),
  "failure_examples not a list": (lambda r: _item(r).update(failure_examples="x"), "failure_examples must be a list"),
  "required_for_next_turn not bool": (
    lambda r: _item(r).update(required_for_next_turn="yes"),
    "required_for_next_turn must be a boolean",
  ),
  "system not first": (
    lambda r: r["messages"].insert(2, {"role": "system", "content": "x"}),
    "messages[2]: a system message may only be the first message",
  ),
  "starts with assistant": (
    lambda r: r["messages"].insert(1, {"role": "assistant", "content": "hi"}),
    "must start with a user message",
  ),
  "unknown role": (_set(["messages", 1, "role"], "human"), "messages[1]: role must be one of"),
  "no messages": (_set(["messages"], []), "'messages' must be a non-empty list"),
  "no user message": (_set(["messages"], [{"role": "system", "content": "x"}]), "has no user message"),
  "content not a string": (_set(["messages", 1, "content"], ["a"]), "content must be a string"),
  "tools not a list": (_set(["tools"], {"get_weather": {}}), "'tools' must be a list"),
  "tool without name": (_set(["tools", 0], {"type": "function", "function": {}}), "tools[0] is not an OpenAI"),
  "tool declared twice": (lambda r: r["tools"].append(copy.deepcopy(r["tools"][0])), "declared twice"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_record_raises_env_error_naming_it(case, tmp_path):
  mutate, problem = MALFORMED[case]
  records = _records()
  mutate(records[0])
  path = _write_jsonl(tmp_path / "data.jsonl", records)
  with pytest.raises(EnvError) as e:
    checklist.load_tasks(path)
  message = str(e.value)
  assert f"{path}:1" in message  # the record's position ...
  if "uuid" in records[0] and records[0]["uuid"]:
    assert "record 'weather-001'" in message  # ... and its uuid when it has one
  assert problem in message


def test_labelling_layout_turn_without_weight_for_an_item(tmp_path):
  records = _records()
  del records[1]["checklists"][0][0]["weight"]["C1"]
  with pytest.raises(EnvError, match=r"record 'football-002' at .*data.jsonl:2: .*\(id 'C1'\): missing key 'weight'"):
    checklist.load_tasks(_write_jsonl(tmp_path / "data.jsonl", records))


def test_file_level_errors(tmp_path):
  with pytest.raises(EnvError, match="does not exist"):
    checklist.load_tasks(tmp_path / "nope.jsonl")
  (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
  with pytest.raises(EnvError, match="holds no"):
    checklist.load_tasks(tmp_path / "empty.jsonl")
  lines = FIXTURE.read_text(encoding="utf-8").splitlines()
  (tmp_path / "bad.jsonl").write_text(lines[0] + "\n{not json\n", encoding="utf-8")
  with pytest.raises(EnvError, match=r"bad.jsonl:2: not valid JSON"):
    checklist.load_tasks(tmp_path / "bad.jsonl")
  (tmp_path / "list.jsonl").write_text(lines[0] + "\n[1, 2]\n", encoding="utf-8")
  with pytest.raises(EnvError, match=r"record at .*list.jsonl:2: expected a JSON object, got list"):
    checklist.load_tasks(tmp_path / "list.jsonl")
  dup = _write_jsonl(tmp_path / "dup.jsonl", [_records()[0], _records()[0]])
  with pytest.raises(EnvError, match=r"record 'weather-001' at .*dup.jsonl:2: uuid already used by .*dup.jsonl:1"):
    checklist.load_tasks(dup)


def test_skip_invalid_skips_only_malformed_records(tmp_path):
  records = _records()
  records[1]["checklists"][0][0]["weight"]["C1"] = 0.5
  path = _write_jsonl(tmp_path / "data.jsonl", records)
  with pytest.raises(EnvError, match="football-002"):
    checklist.load_tasks(path)
  assert [t.id for t in checklist.load_tasks(path, skip_invalid=True)] == ["weather-001", "chitchat-003"]


# ------------------------------------------------------------------------------------------------- ChecklistEnv


def test_env_replays_logged_results_and_refuses_the_rest():
  weather, football, _ = checklist.load_tasks(FIXTURE)
  env = checklist.ChecklistEnv()
  with pytest.raises(EnvError, match="reset"):
    env.execute(ToolCall("get_weather", {"city": "Paris"}))
  env.reset(weather)
  before = env.state_hash()
  # Argument order is irrelevant and 3 == 3.0 (decoded JSON compared with Python ==, as τ² does).
  assert env.execute(ToolCall("get_forecast", {"days": 3.0, "city": "Oslo"})) == Observation(
    '{"days": ["snow", "snow", "sun"]}'
  )
  assert env.state_hash() != before
  missing = env.execute(ToolCall("get_weather", {"city": "Paris"}))  # unit missing: not the logged call
  assert missing.is_error and missing.text.startswith("Error: no logged result for this call: get_weather(")
  assert env.execute(ToolCall("get_forecast", {"city": "Oslo", "days": "3"})).is_error  # "3" != 3
  unknown = env.execute(ToolCall("book_flight", {}))
  assert unknown.is_error and "unknown tool 'book_flight'" in unknown.text

  env.reset(football)
  assert env.state_dict() == {"task": "football-002", "replayed": {}}
  failed = env.execute(ToolCall("get_last_games", {"teamid": "1234", "limit": 2}))
  assert failed.is_error and "Expected integer" in failed.text  # the logged failure replays as an error
  ok = env.execute(ToolCall("get_last_games", {"teamid": 1234, "limit": 2}))
  assert not ok.is_error and "Oregon" in ok.text


def test_env_replays_repeated_calls_in_logged_order_then_repeats_the_last():
  task = Task(
    id="t",
    benchmark="checklist",
    domain="d",
    split="train",
    system_prompt="",
    tools=({"type": "function", "function": {"name": "next_page"}},),
    reference_interactions=tuple(ReferenceInteraction("next_page", {"cursor": 1}, f"page {k}") for k in (1, 2)),
  )
  env = checklist.ChecklistEnv()
  env.reset(task)
  texts = [env.execute(ToolCall("next_page", {"cursor": 1})).text for _ in range(3)]
  assert texts == ["page 1", "page 2", "page 2"]
  env.reset(task)  # fresh state
  assert env.execute(ToolCall("next_page", {"cursor": 1})).text == "page 1"


def test_env_rejects_other_benchmarks_and_evaluates_with_its_scorer():
  weather = checklist.load_tasks(FIXTURE)[0]
  env = checklist.ChecklistEnv()
  with pytest.raises(EnvError, match="'tau2'"):
    env.reset(Task.from_dict({**weather.to_dict(), "benchmark": "tau2"}))
  env.reset(weather)
  with pytest.raises(EnvError, match="no scorer.*rule_checklist.*ChecklistJudge"):
    env.evaluate([])

  from envace_jax.rl import rewards

  env = checklist.ChecklistEnv(scorer=rewards.rule_checklist)
  env.reset(weather)
  conversation = [
    ChatMessage("user", weather.user_turns[0]),
    ChatMessage("assistant", "", tool_calls=(ToolCall("get_weather", {"city": "Paris", "unit": "C"}, "c1"),)),
    ChatMessage("tool", "{}", tool_call_id="c1", name="get_weather"),
    ChatMessage("assistant", "Paris: 12 °C."),
  ]
  info = env.evaluate(conversation)
  # 1 of 3 gold actions + well-formed, equal weights: 2 / 4.
  assert info.reward == 0.5 and info.valid
  assert info.breakdown["action[0]:get_weather"] == 1.0 and info.breakdown["action[1]:get_weather"] == 0.0
  assert info.info["unscored_checklist_items"] == 5

  seen = []
  env = checklist.ChecklistEnv(scorer=lambda task, conv: seen.append((task.id, len(conv))) or RewardInfo(0.25))
  env.reset(weather)
  assert env.evaluate(conversation).reward == 0.25 and seen == [("weather-001", 4)]
