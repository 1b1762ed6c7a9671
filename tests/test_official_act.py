"""ACT parsing against the official EnvACE code (issue 41, item 8): ``rollout.act_parser="official"`` reproduces the
official parser's calls, error codes and message content on every string of tests/data/official/act_parse.json, and
a malformed call ends the trajectory where the official env ends it; ``"ours"`` (the default) gives what is pinned
here. The fixture holds strings we wrote and what the official functions returned on them (its "source" field names
the files and the commit); no official code is in the repository."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import pytest

from envace_jax import config_check
from envace_jax.config import defaults
from envace_jax.envs import tau2
from envace_jax.envs.base import Task
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import IM_END
from envace_jax.rehearsal import views
from envace_jax.rehearsal.trajectory import Termination
from envace_jax.rehearsal.unfold import UnfoldConfig, unfold
from tests.rehearsal.stand_ins import ScriptedSampler
from tests.test_configs import load, only_problem

FIXTURE = json.loads((pathlib.Path(__file__).parent / "data" / "official" / "act_parse.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}
KNOWN = FIXTURE["known_tools"]
Kind = tool_format.ParseErrorKind


def test_the_fixture_is_the_official_codes_output_on_enough_strings():
  assert "tool_parser.py" in FIXTURE["source"] and "173e941" in FIXTURE["source"]
  assert len(CASES) == len(FIXTURE["cases"]) >= 22
  codes = {c.get("error") for c in CASES.values()}
  assert codes >= {None, "NO_TOOL_CALL_FOUND", "JSON_DECODE_ERROR", "INVALID_TOOL_NAME", "NO_ARGUMENTS"}


def _official(text: str):
  out = tool_format.parse_action_official(text)
  return [[c.name, c.arguments_json] for c in out.calls], out.error.kind.official_code if out.error else None, out


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "official_raises" not in c])
def test_official_rules_reproduce_the_official_parser(name):
  """Calls as (name, arguments JSON text) and the error code exactly, and the content the official env records."""
  case = CASES[name]
  calls, code, out = _official(case["text"])
  assert (calls, code) == (case["calls"], case["error"])
  assert out.content == case["content"]
  assert (out.error is None) or (out.error.raw == case["text"] and not out.calls)


def test_where_the_official_parser_raises_the_official_rules_report_bad_json():
  """A deliberate departure: the official parser raises on an integer of more than 4300 digits (Python's limit) or
  nesting past the recursion limit, which would stop the rollout; ours reports the block as not JSON."""
  raising = [c for c in CASES.values() if "official_raises" in c]
  assert [(c["name"], c["official_raises"]) for c in raising] == [
    ("overlong_integer", "ValueError"),
    ("deep_nesting", "RecursionError"),
  ]
  for case in raising:
    calls, code, _ = _official(case["text"])
    assert (calls, code) == ([], "JSON_DECODE_ERROR")
    assert _ours(case["text"], rules="official") == _ours(case["text"]) == Kind.BAD_JSON


def test_the_official_rules_parse_the_text_as_the_official_env_cleans_it():
  """envs.py sanitises the caller's text before parse_tool_calls: a raw NUL or noncharacter in the JSON becomes
  U+FFFD (a valid JSON string character), where the raw text would not parse."""
  text = '\n<tool_call>\n{"name": "f\ufffe", "arguments": {"a": "b\x00c"}}\n</tool_call>'
  out = views.parse_act(text, ["f"], parallel=True, rules="official")
  assert out.error is None and [(c.name, c.arguments) for c in out.calls] == [("f\ufffd", {"a": "b\ufffdc"})]
  assert views.parse_act(text, ["f"], rules="ours").error.kind == Kind.BAD_JSON


def test_the_official_parser_writes_the_replacement_character_into_the_arguments():
  assert CASES["escaped_lone_surrogate"]["calls"][0][1] == '{"order_id": "W\ufffdX", "nul": "a\\u0000b"}'


# What our rules (rollout.act_parser="ours", the default, one call per message) give on the same strings: a list of
# (name, arguments) calls, or the error kind.
OURS = {
  "plain_reply": [],
  "one_call": [["get_order", {"order_id": "W123"}]],
  "text_before_call": [["get_order", {"order_id": "W123"}]],
  "text_after_call": [["get_order", {"order_id": "W123"}]],
  "think_then_call": [["get_order", {"order_id": "W123"}]],
  "no_newline_before_open": [["get_order", {"order_id": "W123"}]],
  "inline_tags": [["get_order", {"order_id": "W123"}]],
  "no_newline_before_close": [["get_order", {"order_id": "W123"}]],
  "space_after_open": [["get_order", {"order_id": "W123"}]],
  "crlf_newlines": [["get_order", {"order_id": "W123"}]],
  "padded_body": [["get_order", {"order_id": "W123"}]],
  "list_of_calls": Kind.BAD_JSON,
  "two_blocks": Kind.MULTIPLE_CALLS,
  "two_blocks_second_unprefixed": Kind.MULTIPLE_CALLS,
  "good_then_bad_block": Kind.MULTIPLE_CALLS,
  "list_with_bad_item": Kind.BAD_JSON,
  "empty_list": Kind.BAD_JSON,
  "parameters_and_arguments": [["get_order", {"order_id": "A1"}]],
  "parameters_null_arguments_set": [["get_order", {"order_id": "A1"}]],
  "parameters_only": [["get_order", {"order_id": "P1"}]],
  "missing_arguments": [["list_orders", {}]],
  "arguments_null": Kind.ARGUMENTS_NOT_OBJECT,
  "arguments_empty_object": [["list_orders", {}]],
  "arguments_json_string": [["get_order", {"order_id": "W123"}]],
  "arguments_list": Kind.ARGUMENTS_NOT_OBJECT,
  "arguments_number": Kind.ARGUMENTS_NOT_OBJECT,
  "nested_arguments": [
    ["list_orders", {"filter": {"status": ["shipped", "pending"], "page": {"n": 2, "size": None}}, "flag": True}]
  ],  # fmt: skip
  "bad_json_missing_brace": Kind.BAD_JSON,
  "bad_json_single_quotes": Kind.BAD_JSON,
  "unterminated": Kind.UNTERMINATED,
  "code_fence": [["get_order", {"order_id": "W123"}]],
  "unknown_tool": Kind.UNKNOWN_TOOL,
  "empty_name": Kind.MISSING_NAME,
  "blank_name": Kind.MISSING_NAME,
  "name_padded": [["get_order", {"order_id": "W123"}]],
  "name_not_string": Kind.MISSING_NAME,
  "missing_name": Kind.MISSING_NAME,
  "no_name_no_arguments": Kind.MISSING_NAME,
  "json_string_body": Kind.BAD_JSON,
  "json_number_body": Kind.BAD_JSON,
  "empty_body": Kind.BAD_JSON,
  "tag_in_prose": Kind.UNTERMINATED,
  "duplicate_keys": [["get_order", {"order_id": "W1"}]],
  "non_ascii_arguments": [["get_order", {"city": "Zürich", "note": "日本"}]],
  "escaped_lone_surrogate": [["get_order", {"order_id": "W\ud800X", "nul": "a\x00b"}]],  # item 11's code points
  "nan_argument": None,  # [["get_order", {"x": nan}]]: checked below (nan != nan)
  "overlong_integer": Kind.BAD_JSON,
  "deep_nesting": Kind.BAD_JSON,
}


def _ours(text: str, parallel: bool = False, rules: str = "ours"):
  out = views.parse_act(text, KNOWN, parallel, rules)
  return out.error.kind if out.error else [[c.name, c.arguments] for c in out.calls]


@pytest.mark.parametrize("name", list(CASES))
def test_our_rules_on_the_official_strings(name):
  got = _ours(CASES[name]["text"])
  if name == "nan_argument":
    assert got[0][0] == "get_order" and list(got[0][1]) == ["x"] and got[0][1]["x"] != got[0][1]["x"]
    return
  assert got == OURS[name]


def test_how_many_strings_parse_differently():
  """Differently: other calls (name, arguments as JSON), an error on one side only, or another error code."""

  def outcome(case):
    if "official_raises" in case:
      return ("raises",)
    return (json.dumps(case["calls"], ensure_ascii=False), case["error"])

  def ours(case):
    out = views.parse_act(case["text"], KNOWN, False, "ours")
    calls = [[c.name, json.dumps(c.arguments, ensure_ascii=False)] for c in out.calls]
    return (json.dumps(calls, ensure_ascii=False), out.error.kind.official_code if out.error else None)

  differ = [n for n, c in CASES.items() if outcome(c) != ours(c)]
  assert differ == [
    *("no_newline_before_open", "inline_tags", "no_newline_before_close", "space_after_open", "crlf_newlines"),
    *("list_of_calls", "two_blocks", "two_blocks_second_unprefixed", "good_then_bad_block", "list_with_bad_item"),
    *("empty_list", "parameters_and_arguments", "missing_arguments", "arguments_null", "arguments_json_string"),
    *("arguments_list", "arguments_number", "unterminated", "code_fence", "unknown_tool", "no_name_no_arguments"),
    *("json_string_body", "json_number_body", "tag_in_prose", "escaped_lone_surrogate", "overlong_integer"),
    "deep_nesting",
  ]  # 27 of 48


def test_official_rules_in_parse_act():
  """views.parse_act under official rules: names unchecked, several calls only with parallel, a stringified
  object decoded, other non-object arguments malformed, the reply is the text before the first block."""
  text = CASES["text_before_call"]["text"]
  assert views.parse_act(text, KNOWN, False, "official") == views.ActOutput(
    calls=(tool_format.ToolCall("get_order", {"order_id": "W123"}),), reply="Let me look that up."
  )
  assert _ours(CASES["unknown_tool"]["text"], rules="official") == [["launch_rocket", {"target": "moon"}]]
  assert _ours(CASES["missing_arguments"]["text"], rules="official") == Kind.NO_ARGUMENTS
  two = [["get_order", {"order_id": "W123"}], ["cancel_order", {"order_id": "W123", "reason": "no longer needed"}]]
  for name in ("two_blocks", "list_of_calls"):
    assert _ours(CASES[name]["text"], parallel=True, rules="official") == two
    assert _ours(CASES[name]["text"], parallel=False, rules="official") == Kind.MULTIPLE_CALLS
  assert _ours(CASES["arguments_json_string"]["text"], rules="official") == [["get_order", {"order_id": "W123"}]]
  assert _ours(CASES["arguments_list"]["text"], rules="official") == Kind.ARGUMENTS_NOT_OBJECT
  assert views.parse_act(CASES["text_after_call"]["text"], KNOWN, False, "official").reply == ""
  with pytest.raises(ValueError, match="official"):
    views.parse_act("x", KNOWN, False, "strict")


# ---------------------------------------------------------------------------------------------------------------------
# Episodes: the official env's state machine (ChecklistEnv.async_step, judge stubbed) against `unfold` with scripted
# generations. REHEARSE's own output format is another setting's (its responses here are ours).

EPISODES = {e["name"]: e for e in FIXTURE["episodes"]}
RESPONSE = '<tool_response>\n{"order_id": "W123", "status": "shipped"}\n</tool_response>'
SCHEMA = {"type": "object", "properties": {"order_id": {"type": "string"}}}
OFFICIAL = dict(act_parser="official", on_malformed="end", parallel_calls=True)


def _run(tokenizer, episode, **settings):
  task = Task(
    id=episode["name"], benchmark="test", domain="orders", split="all", system_prompt="You look after orders.",
    tools=tuple({"type": "function", "function": {"name": n, "description": n, "parameters": SCHEMA}} for n in KNOWN),
    user_turns=tuple(episode["user_turns"]),
  )  # fmt: skip
  acts = [text + IM_END for who, text in episode["actions"] if who == "caller"]
  script = lambda role, i, k: acts[min(k, len(acts) - 1)] if role == Role.ACT else RESPONSE  # noqa: E731
  config = UnfoldConfig.from_config(group_size=1, max_turns=8, **settings)
  sampler = ScriptedSampler(tokenizer, script, 1)
  out = unfold(
    [task], sampler, tokenizer, config, jax.random.key(0), reference_sampler=ScriptedSampler(tokenizer, script, 1)
  )
  return out.trajectories[0], out.views[0]


def _conversation(traj):
  """The trajectory's messages in the fixture's layout (the tool results are REHEARSE's: compared by role only)."""
  out = []
  for m in traj.messages:
    row = {"role": m.role, "content": m.content}
    if m.tool_calls:
      row["tool_calls"] = [[c.name, json.dumps(dict(c.arguments), ensure_ascii=False)] for c in m.tool_calls]
    out.append(row)
  return out


def _official_conversation(episode):
  """The official env's messages without its error tool message (the trajectory records the error as its end event;
  nothing reads the message after the end); an assistant message's content stripped, as ours are, except the
  malformed one, which both keep as generated."""
  out, messages = [], episode["messages"]
  for i, m in enumerate(messages):
    malformed = i + 1 < len(messages) and messages[i + 1].get("name") == "error_tool_call"
    if m.get("name") == "error_tool_call":
      continue
    row = {
      "role": m["role"],
      "content": m["content"].strip() if m["role"] == "assistant" and not malformed else m["content"],
    }
    if m.get("tool_calls"):
      row["tool_calls"] = m["tool_calls"]
    out.append(row)
  return out


def _same_but_tool_results(ours, official):
  tools = lambda rows: [r["role"] == "tool" for r in rows]  # noqa: E731
  drop = lambda rows: [r for r in rows if r["role"] != "tool"]  # noqa: E731
  return tools(ours) == tools(official) and drop(ours) == drop(official)


@pytest.mark.parametrize("name, turn_rewards", [("malformed_after_a_judged_turn", [1.0]), ("malformed_first_call", [])])
def test_a_malformed_call_ends_the_trajectory_where_the_official_env_ends_it(smollm2_tokenizer, name, turn_rewards):
  """The trajectory ends after the malformed message, which it holds unparsed; the official env's reward for it: the
  turns judged before keep theirs, the cut turn is never judged (0)."""
  episode = EPISODES[name]
  last = episode["steps"][-1]
  assert last["done"] and last["reward"] == 0.0 and last["error_tool_call"]
  traj, view_set = _run(smollm2_tokenizer, episode, **OFFICIAL)
  assert traj.termination == Termination.MALFORMED
  end = traj.events[-1]
  assert end["type"] == "end" and Kind(end["kind"]).official_code == last["error_tool_call"]
  assert _same_but_tool_results(_conversation(traj), _official_conversation(episode))
  assert traj.messages[-1].content == episode["actions"][-1][1]  # the raw malformed text, unparsed
  callers = sum(s["agent"] == "caller" for s in episode["steps"])
  assert view_set[Role.ACT].generations == callers and traj.counts["malformed_act"] == 1
  reached = sum(m["role"] == "user" for m in episode["messages"])
  assert episode["turn_rewards"] == turn_rewards and len(turn_rewards) == reached - 1


def test_ours_by_default_shows_the_error_and_goes_on(smollm2_tokenizer):
  """The same script with the default settings and one more reply: after the unterminated call the agent sees
  "Error: ..." and answers, and the user's turns run out."""
  episode = EPISODES["malformed_after_a_judged_turn"]
  traj, view_set = _run(smollm2_tokenizer, dict(episode, actions=[*episode["actions"], ["caller", "All set."]]))
  assert traj.counts["malformed_act"] == 1 and traj.termination == Termination.USER_TURNS_DONE
  assert [e["kind"] for e in traj.events if e["type"] == "malformed_act"] == ["unterminated"]
  assert [m.content for m in view_set[Role.ACT].messages if m.role == "tool"][-1].startswith("Error: ")
  assert traj.messages[-1].content == "All set." and view_set[Role.ACT].generations == 4


@pytest.mark.parametrize("name", ["unknown_tool_goes_to_the_simulator", "two_calls_one_message"])
def test_official_calls_go_to_rehearse_as_in_the_official_env(smollm2_tokenizer, name):
  """An unknown tool name is rehearsed (the official executor hands it to the simulator); several calls in one
  message are rehearsed one by one, in order."""
  episode = EPISODES[name]
  traj, view_set = _run(smollm2_tokenizer, episode, **OFFICIAL)
  assert traj.termination == Termination.USER_TURNS_DONE and "malformed_act" not in traj.counts
  assert _same_but_tool_results(_conversation(traj), _official_conversation(episode))
  simulator_steps = sum(s["agent"] == "simulator" for s in episode["steps"])
  assert view_set[Role.REHEARSE].generations == simulator_steps == traj.counts["tool_calls"]
  assert traj.counts.get("unknown_tool", 0) == (name == "unknown_tool_goes_to_the_simulator")


def test_the_setting_is_checked_and_read():
  message = only_problem(load("tau2.py", "--config.rollout.act_parser=strict"))
  assert message.startswith("rollout.act_parser='strict' is not valid; choose one of 'ours', 'official'"), message
  config = load("tau2.py", "--config.rollout.act_parser=official")
  config_check.validate(config)
  assert UnfoldConfig.from_config(config).act_parser == "official"
  assert UnfoldConfig.from_config().act_parser == "ours"
  stored = defaults.get_config().to_dict()
  del stored["rollout"]["act_parser"]  # a checkpoint written before the setting existed
  assert defaults.completed(stored).rollout.act_parser == "ours"
  assert dataclasses.replace(UnfoldConfig.from_config(), act_parser="official").act_parser == "official"
  with pytest.raises(ValueError, match="act_parser"):
    UnfoldConfig.from_config(act_parser="strict")


def test_an_unknown_tool_goes_to_the_real_envs_own_error(smollm2_tokenizer):
  """In real mode the official rules hand an unknown name to the benchmark's tools, which answer with their error;
  the trajectory goes on."""
  task = next(t for t in tau2.load_tasks("mock", "base") if t.id == "create_task_1")
  unknown = CASES["unknown_tool"]["text"]
  plans = {Role.ACT: [unknown + IM_END, "I cannot do that."], Role.USER: ["Launch a rocket.", "###STOP###"]}
  script = lambda role, i, k: plans[role][min(k, len(plans[role]) - 1)]  # noqa: E731
  config = UnfoldConfig.from_config(group_size=1, max_turns=4, env_mode="real", **OFFICIAL)
  env = tau2.Tau2Env("mock")
  samplers = [ScriptedSampler(smollm2_tokenizer, script, 1) for _ in range(2)]
  out = unfold([task], samplers[0], smollm2_tokenizer, config, jax.random.key(0), reference_sampler=samplers[1],
               envs=[env])  # fmt: skip
  traj = out.trajectories[0]
  assert traj.termination == Termination.USER_STOP and "malformed_act" not in traj.counts
  assert traj.counts["unknown_tool"] == 1
  (tool,) = [m for m in traj.messages if m.role == "tool"]
  assert tool.is_error and tool.name == "launch_rocket" and tool.content.startswith("Error")
