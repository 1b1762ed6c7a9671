"""World-model fidelity metrics on hand-built (rehearsed, real) response pairs, and the REHEARSE views they probe."""

from __future__ import annotations

import math

import pytest

from envace_jax.envs.base import ChatMessage, Task, ToolCall
from envace_jax.model.roles import Role
from envace_jax.rehearsal import fidelity, views
from envace_jax.rehearsal.trajectory import Trajectory


def _rehearsed(body: str) -> str:
  return f"<tool_response>\n{body}\n</tool_response>"


def test_identical_json_up_to_layout_matches_exactly():
  f = fidelity.compare(_rehearsed('{"b": [1, 2], "a": "x"}'), '{"a":"x","b":[1,2]}', False)
  assert f == fidelity.ResponseFidelity(True, True, 1.0, 1.0, True)


def test_partial_overlap_key_f1_and_value_accuracy():
  # predicted leaves {$.a, $.b.c}; real leaves {$.a, $.b.c, $.d}: precision 2/2, recall 2/3 -> F1 0.8;
  # shared values: a equal, b.c differs -> 1/2.
  f = fidelity.compare(_rehearsed('{"a": 1, "b": {"c": 2}}'), '{"a": 1, "b": {"c": 3}, "d": 4}', False)
  assert not f.exact_match and f.json_valid and f.error_agreement
  assert f.key_f1 == pytest.approx(0.8) and f.value_accuracy == pytest.approx(0.5)


def test_lists_are_indexed_paths():
  # $[0].id vs {$[0].id, $[1].id}: P = 1, R = 1/2 -> F1 2/3; the shared value is equal.
  f = fidelity.compare(_rehearsed('[{"id": 1}]'), '[{"id": 1}, {"id": 2}]', False)
  assert f.key_f1 == pytest.approx(2 / 3) and f.value_accuracy == 1.0 and not f.exact_match


def test_disjoint_keys_give_zero_f1_and_no_value_accuracy():
  f = fidelity.compare(_rehearsed('{"x": 1}'), '{"y": 1}', False)
  assert f.key_f1 == 0.0 and f.value_accuracy is None


def test_error_texts_agree_without_structure():
  f = fidelity.compare(_rehearsed("Error: reservation not found"), "Error: Reservation ABC not found", True)
  assert f == fidelity.ResponseFidelity(True, False, None, None, True)
  same = fidelity.compare(_rehearsed("Error: User not found"), "Error: User not found", True)
  assert same.exact_match and same.error_agreement


def test_success_predicted_for_a_real_error_disagrees():
  f = fidelity.compare(_rehearsed('{"status": "ok"}'), "Error: User not found", True)
  assert f.json_valid and not f.error_agreement and not f.exact_match and f.key_f1 is None


def test_invalid_prediction_scores_zero_structure():
  f = fidelity.compare('{"a": 1}', '{"a": 1}', False)  # no <tool_response> tags: invalid, as in rollouts
  assert not f.json_valid and f.key_f1 == 0.0 and f.value_accuracy is None and f.error_agreement
  g = fidelity.compare(_rehearsed("{not json"), '{"a": 1}', False)
  assert not g.json_valid and g.key_f1 == 0.0


def test_scalars_and_empty_containers_are_leaves():
  assert fidelity.leaf_paths(5) == {"$": 5}
  assert fidelity.leaf_paths({"a": [], "b": {}}) == {"$.a": [], "$.b": {}}
  assert fidelity.compare(_rehearsed("5"), "5", False).exact_match


def test_summarize_averages_where_defined():
  pairs = [
    fidelity.ResponseFidelity(True, True, 1.0, 1.0, True),
    fidelity.ResponseFidelity(True, False, 0.8, 0.5, True),
    fidelity.ResponseFidelity(True, False, None, None, True),
    fidelity.ResponseFidelity(False, False, 0.0, None, False),
  ]
  s = fidelity.summarize(pairs)
  assert s["fidelity/calls"] == 4 and s["fidelity/json_valid"] == 0.75 and s["fidelity/exact_match"] == 0.25
  assert s["fidelity/key_f1"] == pytest.approx(1.8 / 3) and s["fidelity/key_f1_calls"] == 3
  assert s["fidelity/value_accuracy"] == pytest.approx(0.75) and s["fidelity/value_calls"] == 2
  assert s["fidelity/error_agreement"] == 0.75
  # The 95% interval of exact match (1 of 4 calls): a resample's mean is k/4 with k ~ Binomial(4, 1/4), whose CDF
  # 0.32, 0.74, 0.95, 0.996 puts the 2.5th and 97.5th percentiles at 0 and 3/4.
  assert (s["fidelity/exact_match/lo"], s["fidelity/exact_match/hi"]) == (0.0, 0.75)
  assert math.isnan(fidelity.summarize([])["fidelity/key_f1"]) and math.isnan(
    fidelity.summarize([])["fidelity/key_f1/lo"]
  )


def test_probes_rebuild_the_rehearse_view_with_real_results():
  task = Task("t", "tau2", "mock", "test", "policy", tools=({"type": "function", "function": {"name": "f"}},))
  first, second = ToolCall("f", {"x": 1}, id="c0"), ToolCall("f", {"x": 2}, id="c1")
  messages = [
    ChatMessage("assistant", "Hi! How can I help you today?"),
    ChatMessage("user", "Do it twice."),
    ChatMessage("assistant", "On it.", tool_calls=(first, second)),
    ChatMessage("tool", '{"y": 1}', tool_call_id="c0", name="f"),
    ChatMessage("tool", "Error: no", tool_call_id="c1", name="f", is_error=True),
  ]
  found = fidelity.probes([Trajectory(task, 0, 0, messages)])
  assert [(p.trajectory, p.message) for p in found] == [(0, 3), (0, 4)]
  one, two = found
  assert one.view[0].role == "system" and "# Tools you implement" in one.view[0].content
  assert [m.content for m in one.view[1:]] == [
    "Agent: Hi! How can I help you today?",
    "User: Do it twice.",
    "Agent: On it.",
    views.rehearse_call("f", {"x": 1}).content,
  ]
  # The second call's view holds the first call with its real result (an OBSERVATION), then the second call.
  assert two.view[-3].content == views.rehearse_call("f", {"x": 1}).content
  assert two.view[-2].author == Role.OBSERVATION and '{"y": 1}' in two.view[-2].content
  assert two.view[-1].content == views.rehearse_call("f", {"x": 2}).content and two.real.is_error


def test_calls_of_the_benchmarks_logged_history_are_not_probed():
  from envace_jax.envs import tau2

  task = next(t for t in tau2.load_tasks("mock", "base") if tau2.initial_conversation(t))
  logged = list(tau2.initial_conversation(task))
  assert any(m.role == "tool" for m in logged)
  call = ToolCall("get_users", {}, id="call_0")
  run = [ChatMessage("assistant", "", tool_calls=(call,)), ChatMessage("tool", "[]", tool_call_id="call_0")]
  found = fidelity.probes([Trajectory(task, 0, 0, logged + run)])
  assert [p.message for p in found] == [len(logged) + 1]  # only this run's call, with the logged ones as context
  assert all(m in found[0].view for m in views.rehearse_history(logged)[:1])


def test_gold_calls_run_for_real_after_the_opening_and_are_probed(smollm2_tokenizer):
  """The benchmark's gold calls, executed on a fresh real environment after each task's opening, are probed like a
  committed run's calls: a REHEARSE that predicts the first task's response exactly and misses the second's keys."""
  import jax

  from envace_jax.envs import tau2
  from tests.rehearsal.stand_ins import ContextSampler

  tokenizer = smollm2_tokenizer
  by_id = {t.id: t for t in tau2.load_tasks("mock", "base")}
  picked = [by_id["create_task_1"], by_id["create_task_1_nl_eval"], by_id["update_task_1"]]  # the middle: no gold
  opening = (ChatMessage("assistant", "Hi! How can I help you today?"), ChatMessage("user", "Please help me."))
  runs = fidelity.gold_trajectories([(t, opening) for t in picked], lambda task: tau2.Tau2Env("mock"))
  assert [(r.task.id, r.group) for r in runs] == [("create_task_1", 0), ("update_task_1", 2)]
  reals = []
  for run in runs:
    gold = run.task.gold_actions[0]
    assert run.messages[:-2] == [*tau2.initial_conversation(run.task), *opening]
    call, result = run.messages[-2:]
    assert call.tool_calls == (ToolCall(gold.name, dict(gold.arguments), id="gold_0"),)
    # The real response: the same gold action on an independently reset environment (τ²'s oracle replay).
    oracle = tau2.oracle_conversation(tau2.Tau2Env("mock"), run.task)
    assert result.content == next(m.content for m in oracle if m.role == "tool") and not result.is_error
    reals.append(result.content)

  first_call = views.rehearse_call(runs[0].messages[-2].tool_calls[0].name, picked[0].gold_actions[0].arguments)

  def rehearse(role, context):
    assert role == Role.REHEARSE
    return _rehearsed(reals[0] if first_call.content.strip() in context else '{"unknown": 1}')

  sampler = ContextSampler(tokenizer, rehearse)
  pairs, texts, _ = fidelity.measure(sampler, tokenizer, runs, key=jax.random.key(0), max_new_tokens=256)
  assert len(texts) == 2 and len(sampler.seen) == 2
  assert pairs[0] == fidelity.ResponseFidelity(True, True, 1.0, 1.0, True)
  assert not pairs[1].exact_match and pairs[1].key_f1 == 0.0 and pairs[1].value_accuracy is None
  summary = fidelity.summarize(pairs, "fidelity_gold/")
  assert summary["fidelity_gold/calls"] == 2 and summary["fidelity_gold/exact_match"] == 0.5
  assert summary["fidelity_gold/key_f1"] == 0.5 and summary["fidelity_gold/value_accuracy"] == 1.0
