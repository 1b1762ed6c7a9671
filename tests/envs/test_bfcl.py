"""BFCL v4 multi-turn adapter against the real bfcl-eval package: data, backends and checker, no mocks."""

import ast
import copy
import json
import re

import pytest

pytest.importorskip("bfcl_eval")

from envace_jax.envs import bfcl  # noqa: E402
from envace_jax.envs.base import ChatMessage, EnvError, Task, ToolCall  # noqa: E402

_MULTI_TURN_UTILS = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils"


@pytest.fixture(scope="module")
def tasks_by_category():
  cache = {}

  def get(category):
    if category not in cache:
      cache[category] = bfcl.load_tasks(category)
    return cache[category]

  return get


@pytest.fixture(scope="module")
def base_tasks(tasks_by_category):
  return tasks_by_category("multi_turn_base")


def _by_id(tasks, task_id):
  return next(t for t in tasks if t.id == task_id)


def _bfcl_execute(calls, task, model_name):
  """BFCL's own executor on fresh instances (a unique model name, so its global instance cache starts empty)."""
  utils = pytest.importorskip(_MULTI_TURN_UTILS)
  try:
    return utils.execute_multi_turn_func_call(
      calls,
      task.criteria["initial_config"],
      task.criteria["involved_classes"],
      model_name,
      task.id,
      long_context=task.criteria["long_context"],
    )
  finally:
    for key in [k for k in vars(utils) if k.startswith(model_name)]:
      del vars(utils)[key]


# --- tasks -----------------------------------------------------------------------------------------------------------


def test_multi_turn_base_has_200_tasks(base_tasks):
  assert len(base_tasks) == 200
  assert len({t.id for t in base_tasks}) == 200
  for t in base_tasks:
    assert (t.benchmark, t.domain, t.split) == ("bfcl", "multi_turn_base", "test")
    assert t.system_prompt == bfcl.system_prompt() and "At each turn" in t.system_prompt
    assert len(t.user_turns) == len(t.criteria["ground_truth"]) >= 1
    assert all(isinstance(u, str) and u for u in t.user_turns)
    assert len(t.gold_actions) == sum(len(turn) for turn in t.criteria["ground_truth"])


def test_task_json_round_trip(base_tasks, tasks_by_category):
  for t in (base_tasks[0], tasks_by_category("multi_turn_miss_func")[0]):
    assert Task.from_json(t.to_json()) == t


def test_tool_schema_shape(base_tasks):
  allowed = {"string", "integer", "number", "boolean", "array", "object"}

  def check_types(props):
    for p in props.values():
      assert p["type"] in allowed, p
      if "properties" in p:
        check_types(p["properties"])
      if "items" in p:
        assert p["items"]["type"] in allowed

  for t in base_tasks:
    owners = bfcl._method_owners(t.criteria["involved_classes"])
    assert set(t.tool_names) == set(owners), t.id  # exactly the public methods of the involved classes
    for tool in t.tools:
      assert tool["type"] == "function"
      fn = tool["function"]
      assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", fn["name"])
      assert isinstance(fn["description"], str) and fn["description"]
      assert fn["parameters"]["type"] == "object"
      assert set(fn["parameters"].get("required", [])) <= set(fn["parameters"]["properties"])
      check_types(fn["parameters"]["properties"])
  cd = next(tool["function"] for tool in base_tasks[0].tools if tool["function"]["name"] == "cd")
  assert cd["parameters"]["properties"]["folder"]["type"] == "string"
  assert cd["parameters"]["required"] == ["folder"]


def test_tool_conversion_matches_bfcl_convert_to_tool(tasks_by_category):
  """Our port equals the package's `convert_to_tool(..., GORILLA_TO_OPENAPI, OPENAI_COMPLETIONS)`. Its module imports
  tree-sitter parsers that the `bfcl` extra does not install, so the two functions are loaded from its source."""
  import bfcl_eval.model_handler as handler_pkg
  from bfcl_eval.constants.enums import ModelStyle
  from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
  from bfcl_eval.utils import load_dataset_entry

  path = handler_pkg.__path__[0] + "/utils.py"
  tree = ast.parse(open(path, encoding="utf-8").read())
  wanted = [
    n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("_cast_to_openai_type", "convert_to_tool")
  ]
  assert len(wanted) == 2
  namespace = {"copy": copy, "re": re, "json": json, "ModelStyle": ModelStyle, "GORILLA_TO_OPENAPI": GORILLA_TO_OPENAPI}
  exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), namespace)  # noqa: S102
  convert = namespace["convert_to_tool"]
  for category in ("multi_turn_base", "multi_turn_miss_func"):
    entries = load_dataset_entry(category)
    tasks = {t.id: t for t in tasks_by_category(category)}
    for e in entries[::10]:
      assert list(tasks[e["id"]].tools) == convert(e["function"], GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)
      for turn, docs in e.get("missed_function", {}).items():
        expected = convert(docs, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)
        assert tasks[e["id"]].criteria["tools_added"][turn] == expected


def test_ground_truth_positional_arguments_are_bound_to_names(tasks_by_category):
  t = _by_id(tasks_by_category("multi_turn_miss_func"), "multi_turn_miss_func_0")
  assert t.criteria["ground_truth"][3] == ["sort('final_report.pdf')"]
  sort = [g for g in t.gold_actions if g.name == "sort"]
  assert [g.arguments for g in sort] == [{"file_name": "final_report.pdf"}]
  assert bfcl.parse_call("cd(folder='document')").arguments == {"folder": "document"}
  with pytest.raises(EnvError, match="cannot parse"):
    bfcl.parse_call("cd(folder=os.getcwd())")


def test_miss_func_holds_out_a_function_until_its_turn(tasks_by_category):
  tasks = tasks_by_category("multi_turn_miss_func")
  assert len(tasks) == 200
  for t in tasks:
    ((turn, names),) = t.criteria["missed_function"].items()
    turn = int(turn)
    assert not set(names) & set(t.tool_names)
    before = {tool["function"]["name"] for tool in bfcl.tools_at_turn(t, turn - 1)}
    after = {tool["function"]["name"] for tool in bfcl.tools_at_turn(t, turn)}
    assert after - before == set(names)
    assert "I have updated some more functions you can choose from" in t.user_turns[turn]
    assert all(f'"name": "{n}"' in t.user_turns[turn] for n in names)
    assert t.criteria["ground_truth"][turn - 1] == []  # the turn the model cannot do yet


def test_unknown_and_out_of_scope_categories_raise():
  with pytest.raises(EnvError, match="multi_turn_base"):
    bfcl.load_tasks("multi_turn_nope")
  with pytest.raises(EnvError, match="live web"):
    bfcl.load_tasks("web_search_base")
  with pytest.raises(EnvError, match="embedding model"):
    bfcl.load_tasks("memory_vector")
  with pytest.raises(EnvError, match="out of scope"):
    bfcl.load_tasks("memory_kv")
  with pytest.raises(EnvError, match="not a BFCL"):
    bfcl.BfclEnv().reset(Task("x", "tau2", "retail", "test", "", ()))


# --- environment -----------------------------------------------------------------------------------------------------


def test_reset_gives_fresh_backends(base_tasks):
  t = base_tasks[0]  # GorillaFileSystem + TwitterAPI
  env = bfcl.BfclEnv()
  env.reset(t)
  initial = env.state_hash()
  assert not env.execute(ToolCall("mkdir", {"dir_name": "brand_new"})).is_error
  twitter = t.criteria["initial_config"]["TwitterAPI"]
  login = ToolCall("authenticate_twitter", {"username": twitter["username"], "password": twitter["password"]})
  assert env.execute(login).text == '{"authentication_status": true}'
  assert "brand_new" in json.dumps(env.state_dict())
  assert env.state_hash() != initial
  other = bfcl.BfclEnv()
  other.reset(t)
  assert other.state_hash() == initial  # a second env is untouched
  env.reset(t)
  assert env.state_hash() == initial  # and so is this one after reset
  assert "brand_new" not in env.execute(ToolCall("ls", {})).text
  assert t.criteria["initial_config"] == bfcl.load_tasks()[0].criteria["initial_config"]  # the task is untouched


def test_state_dict_is_json(tasks_by_category):
  for category in bfcl.CATEGORIES:
    t = tasks_by_category(category)[0]
    env = bfcl.BfclEnv()
    env.reset(t)
    state = env.state_dict()
    assert set(state) == set(t.criteria["involved_classes"])
    assert json.loads(json.dumps(state, allow_nan=False)) == state


def test_bad_calls_become_error_observations(base_tasks):
  env = bfcl.BfclEnv()
  with pytest.raises(EnvError, match="reset"):
    env.execute(ToolCall("ls", {}))
  env.reset(base_tasks[0])
  before = env.state_hash()
  cases = {
    "unknown tool": (ToolCall("format_disk", {}), "name 'format_disk' is not defined"),
    "unexpected argument": (ToolCall("cd", {"folder": "document", "force": True}), "unexpected keyword argument"),
    "missing argument": (ToolCall("cd", {}), "missing 1 required positional argument: 'folder'"),
    "wrong type": (ToolCall("cd", {"folder": 5}), "'int' object has no attribute"),
    "not an object": (ToolCall("cd", ["document"]), "arguments must be an object"),
    "backend error": (ToolCall("cd", {"folder": "nowhere"}), "No such file or directory"),
  }
  for what, (call, text) in cases.items():
    obs = env.execute(call)
    assert obs.is_error, what
    assert text in obs.text, (what, obs.text)
    if what != "backend error":
      assert obs.text.startswith("Error during execution: "), what  # BFCL's executor wording
  assert env.state_hash() == before
  ok = env.execute(ToolCall("cd", {"folder": "document"}))
  assert not ok.is_error and json.loads(ok.text) == {"current_working_directory": "document"}


def test_execute_matches_bfcl_executor_on_ground_truth(tasks_by_category):
  """Our observations and final state equal those of BFCL's `execute_multi_turn_func_call` for the ground truth."""
  for category in ("multi_turn_base", "multi_turn_long_context"):
    for t in tasks_by_category(category)[::7]:
      env = bfcl.BfclEnv()
      messages = bfcl.oracle_conversation(t, env)
      ours = [m.content for m in messages if m.role == "tool"]
      theirs, instances = _bfcl_execute([c for turn in t.criteria["ground_truth"] for c in turn], t, "envace_test_x")
      assert ours == theirs, t.id
      assert env.state_dict() == {k: bfcl._public_state(v) for k, v in instances.items()}, t.id


# --- evaluation ------------------------------------------------------------------------------------------------------


def test_oracle_scores_one_and_truncations_score_zero(base_tasks):
  env = bfcl.BfclEnv()
  for t in base_tasks[:5]:
    conversation = bfcl.oracle_conversation(t, env)
    result = env.evaluate(conversation)
    assert result.reward == 1.0 and result.valid, (t.id, result.info)
    assert env.evaluate(conversation).reward == 1.0  # a second check starts from fresh instances too
    # Cut short: the last user turn never happened (BFCL: force-terminated).
    last_user = max(i for i, m in enumerate(conversation) if m.role == "user")
    cut = env.evaluate(conversation[:last_user])
    assert cut.reward == 0.0 and cut.info["error_type"] == "multi_turn:force_terminated"
    # The last turn's user message arrived but the agent did nothing.
    silent = env.evaluate(conversation[: last_user + 1])
    if t.criteria["ground_truth"][-1]:
      assert silent.reward == 0.0 and silent.info["error_type"] == "multi_turn:empty_turn_model_response", t.id


def test_wrong_arguments_fail_the_state_check(base_tasks):
  t = base_tasks[0]
  env = bfcl.BfclEnv()
  conversation = bfcl.oracle_conversation(t, env)
  i = next(i for i, m in enumerate(conversation) if m.role == "assistant" and m.tool_calls)
  calls = list(conversation[i].tool_calls)
  j = next(k for k, c in enumerate(calls) if c.name == "mkdir")
  calls[j] = ToolCall("mkdir", {"dir_name": "not_temp"}, calls[j].id)
  wrong = [*conversation[:i], ChatMessage("assistant", tool_calls=tuple(calls)), *conversation[i + 1 :]]
  result = env.evaluate(wrong)
  assert result.reward == 0.0 and result.valid
  assert result.info["error_type"] == "multi_turn:instance_state_mismatch"
  json.dumps(result.info)
  assert env.evaluate(conversation).reward == 1.0  # the failed check left nothing behind for the next one


def test_checker_leaves_no_cached_instances(base_tasks):
  utils = pytest.importorskip(_MULTI_TURN_UTILS)
  before = set(vars(utils))
  env = bfcl.BfclEnv()
  env.evaluate(bfcl.oracle_conversation(base_tasks[3], env))
  assert set(vars(utils)) == before
  assert not [k for k in vars(utils) if k.startswith("envace_")]


def test_unsafe_calls_are_not_evaluated_by_the_checker(base_tasks, tmp_path):
  """BFCL's checker `eval`s call strings: a tool named like a builtin must not reach it."""
  target = tmp_path / "pwned.txt"
  for call in (
    ToolCall("open", {"file": str(target), "mode": "w"}),
    ToolCall("cd", {"folder='x'), open('" + str(target) + "', 'w'": 1}),
    ToolCall("__import__('os').system", {}),
  ):
    assert bfcl.render_call(call) == bfcl._UNRENDERABLE_CALL
  t = base_tasks[0]
  env = bfcl.BfclEnv()
  conversation = bfcl.oracle_conversation(t, env)
  evil = ChatMessage("assistant", tool_calls=(ToolCall("open", {"file": str(target), "mode": "w"}),))
  assert env.evaluate([*conversation, evil]).reward == 1.0
  assert not target.exists()
  assert bfcl.render_call(ToolCall("mv", {"source": "a", "destination": float("inf")})) == (
    "mv(source='a', destination=float('inf'))"
  )


def test_long_context_checker_does_not_leak_between_trajectories(tasks_by_category):
  """TravelAPI shares the long-context credit cards with its module: a booking replayed by the checker must not
  change them for later trajectories (nor may a booking in our env)."""
  from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context

  pristine = copy.deepcopy(long_context.CREDIT_CARD_EXTENSION)
  t = _by_id(tasks_by_category("multi_turn_long_context"), "multi_turn_long_context_151")
  env = bfcl.BfclEnv()
  conversation = bfcl.oracle_conversation(t, env)
  env.reset(t)
  fresh_state = env.state_hash()
  booking = ToolCall(
    "book_flight",
    {
      "access_token": t.criteria["initial_config"]["TravelAPI"]["access_token"],
      "card_id": "1234567812345678",  # a long-context extension card
      "travel_date": "2024-12-01",
      "travel_from": "SFO",
      "travel_to": "LAX",
      "travel_class": "economy",
    },
  )
  assert '"booking_status": true' in env.execute(booking).text
  assert long_context.CREDIT_CARD_EXTENSION == pristine
  first_user = next(i for i, m in enumerate(conversation) if m.role == "user")
  with_booking = [*conversation[: first_user + 1], ChatMessage("assistant", tool_calls=(booking,))]
  with_booking += conversation[first_user + 1 :]
  assert env.evaluate(with_booking).reward == 0.0
  assert long_context.CREDIT_CARD_EXTENSION == pristine
  env.reset(t)
  assert env.state_hash() == fresh_state
  assert env.evaluate(conversation).reward == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("category", bfcl.CATEGORIES)
def test_full_oracle(category):
  results = bfcl.run_oracle(category)
  assert len(results) == 200
  failed = {t.id: r.info for t, r in results if r.reward != 1.0}
  assert not failed


def test_oracle_cli(capsys):
  assert bfcl._main(["--category=multi_turn_base", "--oracle", "--limit=3"]) == 0
  out = capsys.readouterr().out
  assert "multi_turn_base_2" in out and "oracle reward: 3/3" in out


def test_a_non_string_tool_name_is_an_error_observation(base_tasks):
  env = bfcl.BfclEnv()
  env.reset(base_tasks[0])
  obs = env.execute(ToolCall(["cd"], {}))
  assert obs.is_error and "is not defined" in obs.text
