"""FinMCP-Bench: loading (our fixture in the assumed layout), malformed records, offline TF1 / precision / recall
against hand-computed values, FinMcpEnv, the config's start-up checks and the prepared dataset."""

from __future__ import annotations

import copy
import json
import math
import pathlib

import pytest
from absl import flags
from ml_collections import config_flags

from envace_jax import config_check
from envace_jax.envs import datasets, finmcp, registry
from envace_jax.envs.base import ChatMessage, EnvError, Task, ToolCall

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = pathlib.Path(__file__).parent / "data" / "finmcp_fixture.jsonl"


def _records() -> list[dict]:
  return [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]


def _write_jsonl(path: pathlib.Path, records) -> pathlib.Path:
  path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
  return path


def _assistant(*names: str) -> ChatMessage:
  return ChatMessage("assistant", "", tool_calls=tuple(ToolCall(n, {}, f"c{i}") for i, n in enumerate(names)))


def test_fixture_loads_into_tasks():
  single, multi, turns = finmcp.load_tasks(FIXTURE)
  assert [t.id for t in (single, multi, turns)] == ["fin-single-001", "fin-multi-002", "3"]  # int id -> "3"
  assert {(t.benchmark, t.domain, t.split) for t in (single, multi, turns)} == {("finmcp", "all", "test")}
  assert single.system_prompt.startswith("你是且慢的理财助手") and multi.system_prompt == ""
  assert single.user_turns == ("易方达蓝筹精选（005827）今天的净值是多少？",)
  assert len(turns.user_turns) == 2  # multi-turn: both user messages are replayed
  assert single.tool_names == ("search_fund", "get_fund_nav", "get_fund_holdings")
  # MCP specs ({"name", "description", "inputSchema"}) become OpenAI function specs.
  assert turns.tool_names == ("get_index_quote", "get_market_news")
  assert turns.tools[0]["type"] == "function" and turns.tools[0]["function"]["parameters"]["required"] == ["index_code"]

  # Parallel calls answered out of order (c before b): matched by tool_call_id, kept in call order.
  assert [(r.name, dict(r.arguments), json.loads(r.result)) for r in multi.reference_interactions] == [
    ("search_fund", {"keyword": "招商中证白酒"},
     {"results": [{"fund_code": "161725", "name": "招商中证白酒指数(LOF)A"}]}),
    ("get_fund_nav", {"fund_code": "161725"}, {"fund_code": "161725", "nav": 0.8123}),  # arguments given as an object
    ("get_fund_holdings", {"fund_code": "161725"}, {"holdings": [{"name": "贵州茅台", "weight": 15.2},
                                                                 {"name": "五粮液", "weight": 14.8}]}),
  ]  # fmt: skip
  assert [g.name for g in multi.gold_actions] == multi.criteria["reference_tools"]
  assert multi.criteria == {
    "reference_tools": ["search_fund", "get_fund_nav", "get_fund_holdings"],
    "type": "multi_tool",
    "scenario": "基金分析",
    "sub_scenario": "持仓分析",
  }
  # No tool_call_id: results answer the oldest pending call.
  assert turns.criteria["reference_tools"] == ["get_index_quote", "get_index_quote", "get_market_news"]
  assert json.loads(turns.reference_interactions[2].result) == {"news": ["央行开展逆回购操作"]}
  for task in (single, multi, turns):
    assert Task.from_json(task.to_json()) == task


def test_domain_selects_a_sample_type():
  assert [t.id for t in finmcp.load_tasks(FIXTURE, "multi_turn")] == ["3"]
  assert {t.domain for t in finmcp.load_tasks(FIXTURE, "single_tool")} == {"single_tool"}
  with pytest.raises(EnvError, match="unknown FinMCP-Bench domain 'mixed'"):
    finmcp.load_tasks(FIXTURE, "mixed")


# --------------------------------------------------------------------------------------------------- scoring


def test_tool_scores_match_hand_computed_values():
  single, multi, turns = finmcp.load_tasks(FIXTURE)
  # multi: reference {search_fund, get_fund_nav, get_fund_holdings}; called {search_fund, get_fund_nav x2}.
  # Multiset overlap = 1 + 1 = 2: P = 2/3, R = 2/3, F1 = 2/3. Sets: P = 2/2, R = 2/3, F1 = 2*(2/3)/(5/3) = 0.8.
  called = ["search_fund", "get_fund_nav", "get_fund_nav"]
  s = finmcp.tool_scores(called, multi.criteria["reference_tools"])
  assert s["tool_precision"] == pytest.approx(2 / 3) and s["tool_recall"] == pytest.approx(2 / 3)
  assert s["tool_f1"] == pytest.approx(2 / 3) and s["name_sequence_match"] == 0.0
  s = finmcp.tool_scores(called, multi.criteria["reference_tools"], count_repeats=False)
  assert (s["tool_precision"], s["tool_recall"], s["tool_f1"]) == pytest.approx((1.0, 2 / 3, 0.8))
  # multi-turn: reference [quote, quote, news]; called [quote, news]: overlap 2, P = 1, R = 2/3, F1 = 0.8.
  s = finmcp.tool_scores(["get_index_quote", "get_market_news"], turns.criteria["reference_tools"])
  assert (s["tool_precision"], s["tool_recall"], s["tool_f1"]) == pytest.approx((1.0, 2 / 3, 0.8))
  # single: no call at all: P = R = F1 = 0.
  assert finmcp.tool_scores([], single.criteria["reference_tools"])["tool_f1"] == 0.0

  # The benchmark's TF1 is the mean over samples: (2/3 + 0.8 + 0) / 3; P (2/3 + 1 + 0) / 3; R (2/3 + 2/3 + 0) / 3.
  per_sample = [
    finmcp.tool_scores(called, multi.criteria["reference_tools"]),
    finmcp.tool_scores(["get_index_quote", "get_market_news"], turns.criteria["reference_tools"]),
    finmcp.tool_scores([], single.criteria["reference_tools"]),
  ]
  mean = finmcp.mean_scores(per_sample)
  assert mean["tool_f1"] == pytest.approx((2 / 3 + 0.8) / 3) == pytest.approx(0.4888888888888889)
  assert mean["tool_precision"] == pytest.approx(5 / 9) and mean["tool_recall"] == pytest.approx(4 / 9)
  assert math.isnan(finmcp.mean_scores([])["tool_f1"])


def test_tool_score_edge_cases():
  assert finmcp.tool_scores([], []) == {
    "tool_precision": 1.0,
    "tool_recall": 1.0,
    "tool_f1": 1.0,
    "name_sequence_match": 1.0,
  }
  assert finmcp.tool_scores(["a"], [])["tool_f1"] == 0.0  # calls where the reference has none
  assert finmcp.tool_scores(["b"], ["a"])["tool_f1"] == 0.0  # no overlap
  order = finmcp.tool_scores(["b", "a"], ["a", "b"])
  assert order["tool_f1"] == 1.0 and order["name_sequence_match"] == 0.0  # F1 ignores order, the sequence match not


def test_env_scores_offline_and_refuses_live_execution():
  single, multi, _ = finmcp.load_tasks(FIXTURE)
  env = finmcp.FinMcpEnv()
  with pytest.raises(EnvError, match="reset"):
    env.execute(ToolCall("get_fund_nav", {"fund_code": "005827"}))
  with pytest.raises(EnvError, match="'checklist'"):
    env.reset(Task.from_dict({**single.to_dict(), "benchmark": "checklist"}))
  env.reset(multi)
  obs = env.execute(ToolCall("get_fund_nav", {"fund_code": "161725"}))
  assert obs.is_error and obs.text == finmcp.LIVE_EXECUTION_ERROR and "env_mode='rehearse'" in obs.text
  unknown = env.execute(ToolCall("buy_fund", {}))
  assert unknown.is_error and "unknown tool 'buy_fund'" in unknown.text
  assert env.state_dict() == {"task": "fin-multi-002", "calls": 2}

  conversation = [
    ChatMessage("user", multi.user_turns[0]),
    _assistant("search_fund"),
    ChatMessage("tool", "{}", tool_call_id="c0", name="search_fund"),
    _assistant("get_fund_nav", "get_fund_nav"),
    ChatMessage("assistant", "净值 0.8123。"),
  ]
  info = env.evaluate(conversation)
  assert info.valid and info.reward == pytest.approx(2 / 3)
  assert info.breakdown["tool_precision"] == pytest.approx(2 / 3) and info.breakdown["tool_recall"] == pytest.approx(
    2 / 3
  )
  assert info.info["called"] == ["search_fund", "get_fund_nav", "get_fund_nav"]
  # The reference conversation itself scores 1.
  replay = [ChatMessage("user", multi.user_turns[0]), _assistant(*multi.criteria["reference_tools"])]
  assert env.evaluate(replay).reward == 1.0
  env.reset(single)
  assert env.evaluate([ChatMessage("user", "hi"), ChatMessage("assistant", "你好")]).reward == 0.0


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
  "empty id": (_set(["id"], ""), "'id' must be a non-empty string or an integer"),
  "missing messages": (lambda r: r.pop("messages"), "missing key 'messages'"),
  "missing tools": (lambda r: r.pop("tools"), "missing key 'tools' (and no shared tools.json"),
  "unknown type": (_set(["type"], "chitchat"), "'type' must be one of"),
  "no messages": (_set(["messages"], []), "'messages' must be a non-empty list"),
  "call without result": (lambda r: r["messages"].pop(3), "tool call without result: get_fund_nav"),
  "arguments not JSON": (
    _set(["messages", 2, "tool_calls", 0, "function", "arguments"], "{fund_code: 005827"),
    "messages[2].tool_calls[0] (get_fund_nav): arguments are not valid JSON",
  ),
  "arguments not an object": (
    _set(["messages", 2, "tool_calls", 0, "function", "arguments"], "[1]"),
    "arguments must be a JSON object, got list",
  ),
  "call without name": (_set(["messages", 2, "tool_calls", 0, "function"], {}), "is not a tool call with a function"),
  "undeclared tool": (
    _set(["messages", 2, "tool_calls", 0, "function", "name"], "buy_fund"),
    "the reference calls tools the record does not declare: ['buy_fund']",
  ),
  "tool message without call": (
    lambda r: r["messages"].insert(2, {"role": "tool", "content": "{}"}),
    "messages[2]: tool message answers no pending tool call",
  ),
  "unknown tool_call_id": (_set(["messages", 3, "tool_call_id"], "zz"), "tool_call_id 'zz' matches no pending call"),
  "system not first": (
    lambda r: r["messages"].insert(2, {"role": "system", "content": "x"}),
    "messages[2]: a system message may only be the first message",
  ),
  "starts with assistant": (
    lambda r: r["messages"].insert(1, {"role": "assistant", "content": "您好"}),
    "must start with a user message",
  ),
  "unknown role": (_set(["messages", 1, "role"], "human"), "messages[1]: role must be one of"),
  "content not a string": (_set(["messages", 1, "content"], ["x"]), "messages[1]: content must be a string"),
  "no user message": (_set(["messages"], [{"role": "system", "content": "x"}]), "has no user message"),
  "tools not a list": (_set(["tools"], {"get_fund_nav": {}}), "'tools' must be a list"),
  "tool without name": (_set(["tools", 0], {"description": "x"}), "tools[0] is not a tool spec with a name"),
  "tool declared twice": (lambda r: r["tools"].append(copy.deepcopy(r["tools"][0])), "declared twice"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_record_raises_env_error_naming_it(case, tmp_path):
  mutate, problem = MALFORMED[case]
  records = _records()
  mutate(records[0])
  path = _write_jsonl(tmp_path / "data.jsonl", records)
  with pytest.raises(EnvError) as e:
    finmcp.load_tasks(path)
  message = str(e.value)
  assert f"{path}:1" in message  # the record's position ...
  if records[0].get("id"):
    assert "record 'fin-single-001'" in message  # ... and its id
  assert problem in message


def test_file_level_errors_and_skip_invalid(tmp_path):
  with pytest.raises(EnvError, match="does not exist.*huggingface.co/datasets/DianJin/FinMCP-Bench"):
    finmcp.load_tasks(tmp_path / "nope.jsonl")
  (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
  with pytest.raises(EnvError, match="holds no"):
    finmcp.load_tasks(tmp_path / "empty.jsonl")
  lines = FIXTURE.read_text(encoding="utf-8").splitlines()
  (tmp_path / "bad.jsonl").write_text(lines[0] + "\n{not json\n", encoding="utf-8")
  with pytest.raises(EnvError, match=r"bad.jsonl:2: not valid JSON"):
    finmcp.load_tasks(tmp_path / "bad.jsonl")
  (tmp_path / "list.jsonl").write_text(lines[0] + "\n[1]\n", encoding="utf-8")
  with pytest.raises(EnvError, match=r"record at .*list.jsonl:2: expected a JSON object, got list"):
    finmcp.load_tasks(tmp_path / "list.jsonl")
  dup = _write_jsonl(tmp_path / "dup.jsonl", [_records()[0], _records()[0]])
  with pytest.raises(EnvError, match=r"record 'fin-single-001' at .*dup.jsonl:2: id already used by .*dup.jsonl:1"):
    finmcp.load_tasks(dup)
  records = _records()
  del records[1]["tools"]
  path = _write_jsonl(tmp_path / "some_bad.jsonl", records)
  assert [t.id for t in finmcp.load_tasks(path, skip_invalid=True)] == ["fin-single-001", "3"]


def test_folder_with_a_shared_tools_file(tmp_path):
  records = _records()
  tools = records[0]["tools"]
  for r in records[:2]:
    del r["tools"]  # both use the folder's tools.json
  (tmp_path / "a.json").write_text(json.dumps(records[:2], ensure_ascii=False), encoding="utf-8")  # a JSON list
  _write_jsonl(tmp_path / "b.jsonl", records[2:])
  (tmp_path / "tools.json").write_text(json.dumps({"tools": tools}, ensure_ascii=False), encoding="utf-8")
  tasks = finmcp.load_tasks(tmp_path)
  assert [t.id for t in tasks] == ["fin-single-001", "fin-multi-002", "3"]  # tools.json is not read as samples
  assert tasks[0].tool_names == ("search_fund", "get_fund_nav", "get_fund_holdings")
  assert tasks[2].tool_names == ("get_index_quote", "get_market_news")  # its own tools win


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


def test_config_without_data_says_what_to_download():
  (problem,) = _problems(_load_config("finmcp.py"))
  assert problem.startswith("env.data_path is required for env.benchmark='finmcp'")
  assert "huggingface.co/datasets/DianJin/FinMCP-Bench" in problem and "--config.env.data_path=" in problem
  assert "does not exist" in _problems(_load_config("finmcp.py", "--config.env.data_path=/no/such/finmcp"))[0]


def test_config_with_data_validates_and_refuses_what_cannot_run():
  config = _load_config("finmcp.py:multi_turn", f"--config.env.data_path={FIXTURE}")
  config_check.validate(config)
  assert (config.env.benchmark, config.env.domain, config.rollout.env_mode) == ("finmcp", "multi_turn", "rehearse")
  assert registry.get("finmcp").source_config(config.env.domain, config.env.data_path) == f"multi_turn:{FIXTURE}"
  from envace_jax import runtime

  assert runtime.dataset_config(config) == f"multi_turn:{FIXTURE}"  # what training and --mode=eval prepare
  data = f"--config.env.data_path={FIXTURE}"
  (problem,) = _problems(_load_config("finmcp.py:mixed", data))
  assert "env.domain='mixed' is not a finmcp domain" in problem
  problems = _problems(
    _load_config("finmcp.py", data, "--config.rollout.env_mode=real", "--config.grpo.mode=grpo_real_env")
  )
  assert any("live MCP servers" in p for p in problems)
  (problem,) = _problems(_load_config("finmcp.py", data, "--config.rollout.user_mode=policy",
                                      "--config.grpo.trained_roles=act,user"))  # fmt: skip
  assert "finmcp replays logged user turns" in problem
  (problem,) = _problems(_load_config("finmcp.py", data, "--config.env.split=train"))
  assert problem == "env.split='train': finmcp has only the split 'test'"


def test_prepared_dataset_roundtrip(tmp_path):
  config = registry.get("finmcp").source_config("all", str(FIXTURE))
  builder = datasets.prepare("finmcp", config, tmp_path)
  assert list(builder.info.splits) == ["test"]
  source = datasets.load("finmcp", config, "test", tmp_path)
  assert list(source) == finmcp.load_tasks(FIXTURE)
  with pytest.raises(EnvError, match="'DOMAIN:PATH'"):
    datasets.builder("finmcp", str(FIXTURE), tmp_path)
