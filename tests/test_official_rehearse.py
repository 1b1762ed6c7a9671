"""The REHEARSE task against the official implementation (issue 41 items 6, 7, 9): the fixtures in
tests/data/official/ hold outputs we authored and what the official functions gave for them (run outside the
repository; each file's "source" names the function). The official settings must reproduce every value; ours keep
our behaviour."""

from __future__ import annotations

import json
import pathlib

import jax
import pytest

from envace_jax.config import defaults
from envace_jax.envs import tau2
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.rehearsal import views
from envace_jax.rehearsal.trajectory import Termination
from envace_jax.rehearsal.unfold import UnfoldConfig, unfold
from tests.rehearsal.stand_ins import ScriptedSampler

DATA = pathlib.Path(__file__).parent / "data" / "official"
OUTPUTS = json.loads((DATA / "rehearse_output.json").read_text())
CALL = tool_format.render_tool_call("get_users", {})
EXEC = "\n<execution_result>\n{}\n</execution_result>"

OFFICIAL = {"rehearsal_format": "execution_result", "on_invalid_rehearsal": "end", "on_rehearsed_error": "end"}
"""The official REHEARSE output contract and its terminations, as rollout settings."""


def test_the_settings_exist_with_our_defaults():
  c = defaults.get_config().rollout
  assert (c.rehearsal_format, c.on_invalid_rehearsal, c.on_rehearsed_error) == ("tool_response", "as_is", "continue")
  assert UnfoldConfig.from_config(**OFFICIAL).rehearsal_format == "execution_result"


def test_the_fixture_covers_every_parser_outcome():
  codes = {c["code"] for c in OUTPUTS["cases"]}
  assert len(OUTPUTS["cases"]) >= 10 and "173e941" in OUTPUTS["source"]
  assert codes >= {None, "EMPTY_SIMULATOR_OUTPUT", "NO_EXECUTION_RESULT_TAG_FOUND", "EXECUTION_RESULT_TAG_MALFORMED",
                   "SIMULATOR_JSON_DECODE_ERROR", "INVALID_EXECUTION_RESULT_TYPE"}  # fmt: skip
  assert any(c["ends_episode"] and c["code"] is None for c in OUTPUTS["cases"])  # the simulator's own error object


@pytest.mark.parametrize("case", OUTPUTS["cases"], ids=[c["name"] for c in OUTPUTS["cases"]])
def test_execution_result_parses_as_the_official_parser(case):
  """Code, observation text and whether the episode ends, exactly as the official parser and env give them."""
  got = views.parse_rehearsal(case["output"], rehearsal_format="execution_result")
  assert got.code == (case["code"] or "")
  assert got.valid == (case["code"] is None)
  if case["observation"] is not None:
    assert got.content == case["observation"]
  else:  # our error object: the official layout and code (the message wording is ours)
    assert json.loads(got.content)["error_tool_call"]["code"] == case["code"]
  # Officially a tool message holding an error_tool_call object ends the episode; with OFFICIAL both kinds end it.
  assert got.is_error == case["ends_episode"]


def test_tool_response_keeps_our_contract():
  """Ours accepts what the official contract rejects (an empty object, scalars, error text) and rejects its tags."""
  for body in ("{}", "42", '"done"', "null"):
    got = views.parse_rehearsal(tool_format.render_tool_response(body))
    assert got.valid and not got.is_error and got.content == body and got.code == ""
  assert views.parse_rehearsal(tool_format.render_tool_response("Error: no such user")).is_error
  assert not views.parse_rehearsal(EXEC.replace("{}", '{"a": 1}')).valid
  assert not views.parse_rehearsal("<tool_response>\n{}", rehearsal_format="tool_response").valid


# ---------------------------------------------------------------------------------------------------------------------
# Rollouts (scripted sampler: no model).


@pytest.fixture(scope="module")
def task():
  return next(t for t in tau2.load_tasks("mock", "base") if t.id == "create_task_1")


def _run(tokenizer, task, rehearsals, **settings):
  config = UnfoldConfig.from_config(
    group_size=2, max_turns=4, act_capacity=8192, rehearse_capacity=8192, user_capacity=8192, **settings
  )
  plans = {
    Role.ACT: [CALL, CALL, "Done."],
    Role.REHEARSE: rehearsals,
    Role.USER: ["List the users.", "###STOP###"],
  }

  def script(role, i, k):
    return plans[role][min(k, len(plans[role]) - 1)]

  n = config.group_size
  policy, reference = ScriptedSampler(tokenizer, script, n), ScriptedSampler(tokenizer, script, n)
  return unfold([task], policy, tokenizer, config, jax.random.key(0), reference_sampler=reference), policy


@pytest.mark.parametrize("name", ["simulator_error", "empty_object", "no_tag"])
def test_official_settings_end_the_trajectory_on_an_error(smollm2_tokenizer, task, name):
  """Officially a rehearsed error object, or an output the parser rejects, ends the episode; the caller's last tool
  message holds the error object. Ours shows it to the agent (or the body, for an invalid one) and goes on."""
  case = next(c for c in OUTPUTS["cases"] if c["name"] == name)
  out, _ = _run(smollm2_tokenizer, task, [case["output"]], **OFFICIAL)
  assert UnfoldConfig.from_config(**OFFICIAL).stop_strings(Role.REHEARSE) == ()  # officially it ends at its eos
  for traj in out.trajectories:
    assert traj.termination == Termination.MALFORMED
    kind = "rehearsed_error" if case["code"] is None else "invalid_rehearsal"
    assert traj.events[-1]["kind"] == kind and traj.counts["generations_rehearse"] == 1
    last = traj.messages[-1]
    assert last.role == "tool" and last.is_error and "error_tool_call" in json.loads(last.content)
    if case["observation"] is not None:
      assert last.content == case["observation"]
  ours = _run(smollm2_tokenizer, task, [case["output"]], rehearsal_format="execution_result")[0]
  assert all(t.termination == Termination.USER_STOP for t in ours.trajectories)
  assert all(t.counts["generations_rehearse"] == 2 for t in ours.trajectories)


def test_official_settings_continue_on_a_valid_result(smollm2_tokenizer, task):
  good = "<think>two users</think>" + EXEC.replace("{}", '{"users": ["u1", "u2"]}')
  out, _ = _run(smollm2_tokenizer, task, [good], **OFFICIAL)
  for traj, view_set in zip(out.trajectories, out.views, strict=True):
    assert traj.termination == Termination.USER_STOP
    tools = [m for m in traj.messages if m.role == "tool"]
    assert [m.content for m in tools] == ['{"users": ["u1", "u2"]}'] * 2 and not any(m.is_error for m in tools)
    rehearse = view_set[Role.REHEARSE]
    assert views.EXECUTION_RESULT_PROMPT in rehearse.messages[0].content
    assert [m.content for m in rehearse.messages if m.author == Role.REHEARSE] == [good] * 2  # as sampled
