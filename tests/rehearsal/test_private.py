"""Test-time private rehearsal: the real environment is untouched until the committed execution, sequential
rehearsals see the earlier ones and their assessments, the memory respects its bound, the committed run acts on it.

The policy is a `ContextSampler` (no model): each generation is chosen from what the row's context says, so the
tests follow the real data flow (views, prompts, caches as token lists) on the real τ² mock domain.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from envace_jax.envs import tau2
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Tokenizer
from envace_jax.rehearsal import private
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rehearsal.trajectory import Termination
from tests.rehearsal.stand_ins import ContextSampler

CALL_CREATE = tool_format.render_tool_call("create_task", {"user_id": "user_1", "title": "Important Meeting"})
RESPONSE = '<tool_response>\n{"task_id": "task_2", "title": "Important Meeting", "status": "pending"}\n</tool_response>'
FIRST = "Please create a task 'Important Meeting' for user_1."
DONE = "I created the task 'Important Meeting' for user_1."
CONFIG = UnfoldConfig.from_config(
  group_size=1, max_turns=3, act_capacity=4096, rehearse_capacity=4096, user_capacity=4096
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer) -> Tokenizer:
  return smollm2_tokenizer  # the tokenizer only: no test here runs SmolLM2's weights


@pytest.fixture(scope="module")
def task():
  return next(t for t in tau2.load_tasks("mock", "base") if t.id == "create_task_1")


def _after_system(context: str) -> str:
  return context.split("<|im_end|>", 1)[1] if "<|im_end|>" in context else context


class Policy(ContextSampler):
  """Acts (call, then report), rehearses the create_task response, imagines the user, assesses and memorizes.
  Assessments are numbered so a test can find each one in later contexts."""

  def __init__(self, tokenizer, memory_text="Call create_task for user_1 titled 'Important Meeting', then confirm."):
    self.assessments = 0
    self.memory_text = memory_text
    super().__init__(tokenizer, self.answer)

  def answer(self, role, context):
    if role == Role.REHEARSE:
      return RESPONSE
    if role == Role.USER:
      return "Thanks! ###STOP###" if DONE in _after_system(context) else FIRST
    if private.ASSESS_PROMPT in context:
      self.assessments += 1
      return f" failure\nWhat went wrong: mistake number {self.assessments}\nKey tool results: create_task"
    if private.MEMORY_PROMPT in context:
      return self.memory_text
    return DONE if '"task_id"' in _after_system(context) else CALL_CREATE


class User(ContextSampler):
  """The evaluation's user simulator (the reference sampler): opens with the request, stops once it is done."""

  def __init__(self, tokenizer):
    super().__init__(tokenizer, lambda role, context: "Thanks! ###STOP###" if DONE in context else FIRST)


class CountingEnv(tau2.Tau2Env):
  def __init__(self):
    super().__init__("mock")
    self.calls = []

  def reset(self, task):
    self.calls.append("reset")
    super().reset(task)

  def execute(self, call):
    self.calls.append(call.name)
    return super().execute(call)


def test_rehearsal_never_touches_the_real_environment(tokenizer, task, monkeypatch):
  envs = [CountingEnv() for _ in range(2)]
  for env in envs:
    tau2.Tau2Env.reset(env, task)  # a real DB to hash, without counting
  before = [env.state_hash() for env in envs]
  touched = []
  monkeypatch.setattr(tau2.Tau2Env, "execute", lambda self, call: touched.append(call))  # any real env, anywhere
  policy, user = Policy(tokenizer), User(tokenizer)
  cfg = private.PrivateRehearsalConfig.from_config(mode="parallel", num_rehearsals=3)
  heads = private.openings([task], 2, tokenizer, CONFIG, jax.random.key(0), user_sampler=user)
  prepared = [private.Prepared(task, trial, heads[trial]) for trial in range(2)]
  private.rehearse(prepared, policy, tokenizer, CONFIG, cfg, jax.random.key(1))
  # Rehearsal happened: every rehearsal called create_task and got REHEARSE's imagined response.
  for item in prepared:
    assert len(item.rehearsals) == 3 and item.memory
    for r in item.rehearsals:
      assert r.trajectory.counts["tool_calls"] == 1 and r.trajectory.counts["generations_rehearse"] == 1
      assert r.trajectory.messages[:2] == list(item.opening) and r.assessment.startswith("Outcome: failure")
  # ... and nothing real was called or changed.
  assert touched == [] and all(env.calls == [] for env in envs)
  assert [env.state_hash() for env in envs] == before
  monkeypatch.undo()
  committed = private.commit(prepared, policy, tokenizer, CONFIG, jax.random.key(2), envs, reference_sampler=user)
  assert all(env.calls == ["reset", "create_task"] for env in envs)
  for traj, env in zip(committed, envs, strict=True):
    assert traj.termination == Termination.USER_STOP and env.evaluate(traj.messages).reward == 1.0


def test_rehearsals_see_only_what_the_agent_knows(tokenizer, task):
  heads = private.openings([task], 1, tokenizer, CONFIG, jax.random.key(0), user_sampler=User(tokenizer))
  assert [m.content for m in heads[0]] == [CONFIG.greeting, FIRST]
  seen = private.rehearsal_task(task, heads[0])
  assert seen.gold_actions == () and seen.reference_interactions == () and seen.communicate_info == ()
  assert task.user_scenario not in seen.user_scenario and FIRST in seen.user_scenario
  assert seen.system_prompt == task.system_prompt and seen.tools == task.tools


def test_scenario_opening_needs_no_user_for_the_first_message(tokenizer, task):
  config = dataclasses.replace(CONFIG, scenario_opening=True)
  heads = private.openings([task], 2, tokenizer, config, jax.random.key(0))  # no user sampler, no simulator
  assert [[m.content for m in head] for head in heads] == [[CONFIG.greeting, task.user_scenario]] * 2
  with pytest.raises(private.PrivateRehearsalError, match="user simulator"):
    private.openings([task], 1, tokenizer, CONFIG, jax.random.key(0))


def test_sequential_rehearsal_sees_earlier_rehearsals_and_assessments(tokenizer, task):
  policy = Policy(tokenizer)
  cfg = private.PrivateRehearsalConfig.from_config(mode="sequential", num_rehearsals=3, digest_max_tokens=200)
  heads = private.openings([task], 1, tokenizer, CONFIG, jax.random.key(0), user_sampler=User(tokenizer))
  item = private.Prepared(task, 0, heads[0])
  private.rehearse([item], policy, tokenizer, CONFIG, cfg, jax.random.key(1))
  assert len(item.rehearsals) == 3
  act_contexts = [c for role, c, _ in policy.seen if role == Role.ACT and private.ASSESS_PROMPT not in c]
  for n, r in enumerate(item.rehearsals):
    system = r.trajectory.task.system_prompt
    assert r.assessment.startswith(f"Outcome: failure\nWhat went wrong: mistake number {n + 1}")
    if n == 0:
      assert r.account == "" and private.ACCOUNT_HEADER not in system
      continue
    assert system.startswith(task.system_prompt) and private.ACCOUNT_HEADER in system
    for k in range(n):  # every earlier rehearsal, with its transcript and its assessment
      assert f"## Rehearsal {k + 1}\n" in r.account and item.rehearsals[k].assessment in r.account
      assert "Agent calls create_task(" in r.account
    assert f"## Rehearsal {n + 1}\n" not in r.account and f"mistake number {n + 1}" not in r.account
    # The agent's actual context (its ACT view) held that account.
    assert any(r.account in c and FIRST in c for c in act_contexts)
  # The memory prompt saw all three with their assessments.
  memory_prompt = next(c for role, c, _ in policy.seen if private.MEMORY_PROMPT in c)
  assert all(f"mistake number {k}" in memory_prompt for k in (1, 2, 3))


def test_memory_respects_its_token_bound_and_reaches_the_committed_agent(tokenizer, task):
  long = "Remember: " + "ask for the user id, check the title, call create_task, confirm. " * 20
  policy, user = Policy(tokenizer, memory_text=long), User(tokenizer)
  cfg = private.PrivateRehearsalConfig.from_config(mode="parallel", num_rehearsals=2, memory_max_tokens=12)
  envs = [tau2.Tau2Env("mock")]
  out = private.run([task], policy, tokenizer, CONFIG, cfg, jax.random.key(0), envs, reference_sampler=user)
  (item,) = out.prepared
  assert 0 < item.memory_tokens <= 12 and len(tokenizer.encode(item.memory)) == item.memory_tokens
  assert item.memory.startswith("Remember:")
  committed_system = out.committed[0].task.system_prompt
  assert committed_system.endswith(f"{private.MEMORY_HEADER}\n{item.memory}")
  acted = [c for role, c, _ in policy.seen if role == Role.ACT and private.MEMORY_HEADER in c]
  assert acted, "the committed execution's agent must see the memory in its context"
  costs = private.summary_costs(out.costs)
  assert costs["cost/rehearsal/generated_tokens"] > 0 and costs["cost/memory/generated_tokens"] <= 12 + 1
  assert costs["cost/execution/generated_tokens"] > 0 and costs["cost/opening/generated_tokens"] > 0


def test_mode_off_commits_from_the_same_opening_without_memory(tokenizer, task):
  runs = {}
  for mode in ("off", "parallel"):
    cfg = private.PrivateRehearsalConfig.from_config(mode=mode, num_rehearsals=2)
    envs = [tau2.Tau2Env("mock")]
    runs[mode] = private.run(
      [task], Policy(tokenizer), tokenizer, CONFIG, cfg, jax.random.key(0), envs, reference_sampler=User(tokenizer)
    )
  off, parallel = runs["off"].prepared[0], runs["parallel"].prepared[0]
  assert off.opening == parallel.opening and off.rehearsals == [] and off.memory == ""
  assert runs["off"].committed[0].task.system_prompt == task.system_prompt
  assert runs["off"].costs["rehearsal"].generated_tokens == 0


def test_bad_settings_are_refused():
  with pytest.raises(private.PrivateRehearsalError, match="mode='both'"):
    private.PrivateRehearsalConfig.from_config(mode="both")
  with pytest.raises(private.PrivateRehearsalError, match="num_rehearsals must be a positive int"):
    private.PrivateRehearsalConfig.from_config(mode="parallel", num_rehearsals=0)
  with pytest.raises(private.PrivateRehearsalError, match="one ToolEnv per"):
    private.run(
      [], None, None, CONFIG, private.PrivateRehearsalConfig.from_config(mode="off"), jax.random.key(0), [object()]
    )


def test_a_history_ending_in_the_users_stop_marker_ends_at_once(tokenizer, task):
  from envace_jax.envs.base import ChatMessage
  from envace_jax.rehearsal.unfold import unfold

  history = (ChatMessage("assistant", "Hi!"), ChatMessage("user", "Never mind. ###STOP###"))
  config = dataclasses.replace(CONFIG, env_mode="rehearse")
  out = unfold([task], Policy(tokenizer), tokenizer, config, jax.random.key(0), reference_sampler=User(tokenizer),
               histories=[history])  # fmt: skip
  (traj,) = out.trajectories
  assert traj.termination == Termination.USER_STOP and traj.messages == list(history) and traj.rows == {}


# ---------------------------------------------------------------------------------------------------------------------
# The test-time controls (experiments/evidence.py, claim 4)


def test_no_world_model_withholds_every_imagined_result_from_assessments_accounts_and_memory(tokenizer, task):
  policy = Policy(tokenizer)
  cfg = private.PrivateRehearsalConfig.from_config(mode="sequential", num_rehearsals=2, control="no_world_model")
  heads = private.openings([task], 1, tokenizer, CONFIG, jax.random.key(0), user_sampler=User(tokenizer))
  item = private.Prepared(task, 0, heads[0])
  private.rehearse([item], policy, tokenizer, CONFIG, cfg, jax.random.key(1))
  # The same rehearsals as the method's: REHEARSE imagined the create_task response in each ...
  assert [r.trajectory.counts["generations_rehearse"] for r in item.rehearsals] == [1, 1]
  assert all('"task_id"' in r.trajectory.messages[3].content for r in item.rehearsals)
  # ... and nothing after them saw it: the assessments, the second rehearsal's account, the memory prompt.
  later = [c for _, c, _ in policy.seen if private.ASSESS_PROMPT in c or private.MEMORY_PROMPT in c]
  later.append(item.rehearsals[1].account)
  assert len(later) == 4
  for context in later:
    assert f"Tool result: {private.WITHHELD}" in context and "Agent calls create_task(" in context
    assert '"task_id"' not in context
  assert item.memory


class DraftPolicy(ContextSampler):
  """Writes plan k on row k of a draft batch, judges plan 1 a success and the others failures; acts as `Policy`."""

  def __init__(self, tokenizer):
    self.policy = Policy(tokenizer)
    super().__init__(tokenizer, self.answer, by_row=True)

  def answer(self, role, context, row):
    if private.DRAFT_PROMPT in context:
      return f"Plan {row}: call create_task for user_1 titled 'Important Meeting', then confirm."
    if private.DRAFT_ASSESS_PROMPT in context:
      return " success\nWhat went wrong: nothing" if "Plan 1:" in context else " failure\nWhat went wrong: a lot"
    return self.policy.answer(role, context)


def test_drafts_commit_the_best_assessed_plan_without_imagining_anything(tokenizer, task):
  policy = DraftPolicy(tokenizer)
  cfg = private.PrivateRehearsalConfig.from_config(mode="parallel", num_rehearsals=3, control="drafts")
  envs = [tau2.Tau2Env("mock")]
  out = private.run([task], policy, tokenizer, CONFIG, cfg, jax.random.key(0), envs, reference_sampler=User(tokenizer))
  (item,) = out.prepared
  assert [d.text.split(":")[0] for d in item.drafts] == ["Plan 0", "Plan 1", "Plan 2"] and item.rehearsals == []
  assert [d.assessment.split("\n")[0] for d in item.drafts] == ["Outcome: failure", "Outcome: success"] + [
    "Outcome: failure"
  ]
  assert item.memory == item.drafts[1].text and item.memory_tokens == len(tokenizer.encode(item.memory))
  assert out.committed[0].task.system_prompt.endswith(f"{private.DRAFT_HEADER}\n{item.memory}")
  # A draft's prompt: the policy, the tools, the request; no REHEARSE generation before the committed execution.
  drafts = [c for role, c, _ in policy.seen if private.DRAFT_PROMPT in c]
  tools = tool_format.render_tools_block(task.tools)
  assert len(drafts) == 3 and all(FIRST in c and tools in c and task.system_prompt in c for c in drafts)
  assert not any(role == Role.REHEARSE for role, _, _ in policy.seen)
  costs = private.summary_costs(out.costs)
  assert costs["cost/rehearsal/generated_tokens"] > 0 and costs["cost/assessment/generated_tokens"] > 0
  assert costs["cost/memory/generated_tokens"] == 0  # the chosen draft is the memory: nothing condensed
  assert envs[0].evaluate(out.committed[0].messages).reward == 1.0


def test_a_draft_assessment_ranks_success_over_partial_over_the_rest():
  rank = private._outcome_rank
  assert [rank("Outcome: success"), rank("Outcome: Partial."), rank("Outcome: failure"), rank("")] == [2, 1, 0, 0]
  with pytest.raises(private.PrivateRehearsalError, match="control='both'"):
    private.PrivateRehearsalConfig.from_config(mode="parallel", control="both")
