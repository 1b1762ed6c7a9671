"""The REHEARSE task against the official implementation (issue 41 items 6, 7, 9): the fixtures in
tests/data/official/ hold outputs we authored and what the official functions gave for them (run outside the
repository; each file's "source" names the function). The official settings must reproduce every value; ours keep
our behaviour."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest

from envace_jax.config import defaults
from envace_jax.envs import tau2
from envace_jax.envs.base import ChatMessage, ReferenceInteraction, RewardInfo, Task, ToolCall
from envace_jax.model import tool_format, transformer
from envace_jax.model.config import get_model_config
from envace_jax.model.roles import Role
from envace_jax.rehearsal import views
from envace_jax.rehearsal.trajectory import Termination, TrainingRow, Trajectory
from envace_jax.rehearsal.unfold import UnfoldConfig, UnfoldConfigError, unfold
from envace_jax.rl import advantages, grpo
from envace_jax.sampling.sampler import Sampler
from tests.conftest import jit_apply
from tests.rehearsal.stand_ins import ForcingSampler, ScriptedSampler

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


class _Recording(ScriptedSampler):
  """`ScriptedSampler` that also keeps each generation's whole context as text (``prompts``: (role, text))."""

  def __init__(self, tokenizer, script, n):
    super().__init__(tokenizer, script, n)
    self.prompts = []

  def generate(self, cache, prompts, prompt_roles, *, role, active, **kw):
    for b in range(len(prompts)):
      if active[b]:
        self.prompts.append((Role(int(role[b])), self.tokenizer.decode(cache.tokens[b] + list(prompts[b]))))
    return super().generate(cache, prompts, prompt_roles, role=role, active=active, **kw)


def _run(tokenizer, task, rehearsals, acts=(CALL, CALL, "Done."), **settings):
  """unfold of ``task`` (G = 2) with scripted generations: ACT ``acts``, REHEARSE ``rehearsals`` (by generation
  index; the last repeats), the user asks once then stops."""
  config = UnfoldConfig.from_config(
    group_size=2, max_turns=4, act_capacity=8192, rehearse_capacity=8192, user_capacity=8192, **settings
  )
  plans = {
    Role.ACT: list(acts),
    Role.REHEARSE: rehearsals,
    Role.USER: ["List the users.", "###STOP###"],
  }

  def script(role, i, k):
    return plans[role][min(k, len(plans[role]) - 1)]

  n = config.group_size
  policy, reference = _Recording(tokenizer, script, n), ScriptedSampler(tokenizer, script, n)
  key = jax.random.key(0)
  return unfold([task], policy, tokenizer, config, key, reference_sampler=reference, return_caches=True), policy


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


# ---------------------------------------------------------------------------------------------------------------------
# The REHEARSE input (item 6) and parallel calls (item 9).

PROMPT = json.loads((DATA / "rehearse_prompt.json").read_text())
PER_CALL = {"rehearse_context": "per_call", "parallel_rehearsal": "independent", "rehearse_think": True}
"""The official REHEARSE input: a fresh prompt per call, calls of one message rehearsed independently, /think."""


def _sample_task() -> tuple[Task, list[ChatMessage]]:
  sample = PROMPT["sample"]
  refs = tuple(
    ReferenceInteraction(r["name"], r["arguments"], json.dumps(r["result"])) for r in sample["reference_interactions"]
  )
  task = Task("sample", "checklist", "d", "s", "", tuple(sample["tools"]), reference_interactions=refs)
  messages = []
  for m in sample["messages"]:
    calls = tuple(
      ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]), c["id"]) for c in m.get("tool_calls", ())
    )
    messages.append(ChatMessage(m["role"], m["content"], tool_calls=calls, name=m.get("name", "")))
  return task, messages


def test_per_call_prompt_has_the_official_parts_in_order(smollm2_tokenizer):
  """The parts of the official simulator prompt, in its order (tests/data/official/rehearse_prompt.json): tool
  schemas, every reference interaction, the conversation before the calls' message (no system message), the agent's
  latest text, the call's schema and arguments, /think; the sample data only in the user message."""
  task, messages = _sample_task()
  sample = PROMPT["sample"]
  grounding, kept, dropped = views.grounding_block(task, smollm2_tokenizer, 10_000)
  assert (kept, dropped) == (2, 0)
  assert views.grounding_block(task, smollm2_tokenizer, -1) == (grounding, 2, 0)  # -1: all of them (official)
  assert views.grounding_block(task, smollm2_tokenizer, 40)[1:] == (0, 2)
  call = sample["call"]
  ours = views.per_call_prompt(
    task, call["name"], call["arguments"], grounding=grounding, history=messages[:-1], latest=sample["latest"],
    think=True,
  )  # fmt: skip

  def where(m):
    return ours.rfind(m[len("last:") :]) if m.startswith("last:") else ours.find(m)

  found = {m: where(m) for m in sample["markers"]}
  assert [m for m in sorted(found, key=found.get) if found[m] >= 0] == PROMPT["marker_order"]
  assert [m for m in sample["markers"] if found[m] < 0] == PROMPT["markers_absent"]
  assert ours.endswith(PROMPT["ends_with"]) and PROMPT["messages"] == ["system", "user"]
  assert not PROMPT["system_holds_sample_data"]
  assert not views.per_call_prompt(task, "get_order", {}, grounding="", history=None, latest=None).endswith("/think")


def _parallel_run(tokenizer, task, rehearsals, **settings):
  """Each ACT message calls two tools at once; REHEARSE answers call k of the trajectory with ``rehearsals[k]``."""
  two = CALL + "\n" + tool_format.render_tool_call("create_task", {"user_id": "user_1", "title": "T"})
  return _run(tokenizer, task, rehearsals, acts=[two, "Done."], parallel_calls=True, **settings)


def _rehearse_prompts(policy) -> list[str]:
  return [text for role, text in policy.prompts if role == Role.REHEARSE]


@pytest.mark.parametrize("parallel", ["independent", "sequential"])
def test_per_call_views_and_parallel_calls(smollm2_tokenizer, task, parallel):
  """per_call: each call its own REHEARSE view (system: the instructions; user: the call's prompt), its own
  training row of one generation, its cache row restarted from the shared opening (the scripted cache holds exactly
  the last view's tokens). Call 2 of a message sees call 1's result only with "sequential"; with "independent" both
  results reach the conversation after call 2."""
  first, second = (EXEC.replace("{}", f'{{"result": "{w}"}}') for w in ("FIRST_RESULT", "SECOND_RESULT"))
  settings = {**PER_CALL, "parallel_rehearsal": parallel, "rehearsal_format": "execution_result"}
  out, policy = _parallel_run(smollm2_tokenizer, task, [first, second], **settings)
  n = len(out.trajectories)
  cache = out.caches["policy"]
  contexts = _rehearse_prompts(policy)  # each REHEARSE generation's whole context (cache row + prompt), in order
  assert len(contexts) == 2 * n and all(views.THINK_SWITCH in c for c in contexts)
  assert all(("FIRST_RESULT" in c) == (parallel == "sequential") for c in contexts[n:])  # the second calls'
  for i, (traj, view_set) in enumerate(zip(out.trajectories, out.views, strict=True)):
    assert traj.termination == Termination.USER_STOP
    assert [m.role for m in traj.messages][-5:-1] == ["assistant", "tool", "tool", "assistant"]
    assert [m.content for m in traj.messages if m.role == "tool"] == [
      '{"result": "FIRST_RESULT"}',
      '{"result": "SECOND_RESULT"}',
    ]
    rows = [r for r in traj.training_rows() if r.role == int(Role.REHEARSE)]
    assert len(rows) == 2 and all(r.num_generations == 1 for r in rows) and traj.generations(Role.REHEARSE) == 2
    view = view_set[Role.REHEARSE]
    assert [m.role for m in view.messages] == ["system", "user", "assistant"]
    assert view.messages[0].content == views.EXECUTION_RESULT_PROMPT
    prompt = view.messages[1].content
    assert ("FIRST_RESULT" in prompt) == (parallel == "sequential") and prompt.endswith(views.THINK_SWITCH)
    assert '"title": "T"' in prompt.split(views.PER_CALL_SECTIONS[4])[1]  # the second call is this view's
    slot = out.policy_roles.index(Role.REHEARSE)
    assert cache.tokens[slot * n + i] == rows[0].tokens.tolist()  # rows[0]: traj.rows, the last call's
    first_view = rows[1].tokens.tolist()
    opening = len(smollm2_tokenizer.render([view.messages[0]])[0]) - 1
    assert first_view[:opening] == rows[0].tokens.tolist()[:opening] and first_view != rows[0].tokens.tolist()


def test_independent_calls_end_after_the_message(smollm2_tokenizer, task):
  """Officially a failed call ends the episode only once the message's every call is rehearsed (and the agent's
  conversation holds all their results); ours ("sequential") ends at the failed call."""
  bad, good = "no tags at all", EXEC.replace("{}", '{"ok": 1}')
  official = {**PER_CALL, **OFFICIAL}
  out, _ = _parallel_run(smollm2_tokenizer, task, [bad, good], **official)
  for traj in out.trajectories:
    assert traj.termination == Termination.MALFORMED and traj.counts["generations_rehearse"] == 2
    tools = [m for m in traj.messages if m.role == "tool"]
    assert [json.loads(m.content).get("error_tool_call", {}).get("code") for m in tools] == [
      "NO_EXECUTION_RESULT_TAG_FOUND", None]  # fmt: skip
  out, _ = _parallel_run(smollm2_tokenizer, task, [bad, good], **{**official, "parallel_rehearsal": "sequential"})
  for traj in out.trajectories:
    assert traj.termination == Termination.MALFORMED and traj.counts["generations_rehearse"] == 1


def test_instructions_file_replaces_ours(smollm2_tokenizer, task, tmp_path):
  path = tmp_path / "instructions.txt"
  path.write_text("Answer every call as the system would.\n\n")
  out, _ = _run(smollm2_tokenizer, task, [EXEC], rehearse_instructions_file=str(path), **PER_CALL)
  assert out.views[0][Role.REHEARSE].messages[0].content == "Answer every call as the system would."
  with pytest.raises(UnfoldConfigError, match="rehearse_instructions_file"):
    UnfoldConfig.from_config(rehearse_instructions_file=str(tmp_path / "missing.txt"))
  with pytest.raises(UnfoldConfigError, match="needs rehearse_context='per_call'"):
    UnfoldConfig.from_config(parallel_rehearsal="independent")


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
  config = get_model_config("tiny", vocab_size=smollm2_tokenizer.vocab_size, max_seq_len=4096)
  return config, transformer.init_params(config, jax.random.key(0))


@pytest.mark.slow
def test_per_call_rows_are_their_kv_cache_rows(tiny, smollm2_tokenizer, task):
  """The real sampler (a tiny random model): scripted ACT messages with two calls each, REHEARSE sampled, one
  per-call view per call. Lockstep over dense rows and continuous batching over pages (16-slot pages) give the same
  trajectories (each generation keyed by its index over the trajectory's views); the rollout's own check holds every
  view's bookkeeping to its cache row, and a REHEARSE row's keys equal a fresh prefill of its last view's tokens."""
  config, params = tiny
  small = dataclasses.replace(
    task, system_prompt="Help the user.", user_turns=("List the users.",), user_scenario="",
    tools=tuple(t for t in task.tools if t["function"]["name"] in ("get_users", "create_task")),
    reference_interactions=task.reference_interactions[:1],
  )  # fmt: skip
  two = CALL + "\n" + tool_format.render_tool_call("create_task", {"user_id": "user_1", "title": "T"})
  n = 2

  def script(role, i, k):
    return [two, two, "Done."][min(k, 2)]

  outs = {}
  for continuous in (False, True):
    rollout = UnfoldConfig.from_config(
      group_size=2, max_turns=3, act_max_new_tokens=96, rehearse_max_new_tokens=6, user_max_new_tokens=6,
      act_capacity=1024, rehearse_capacity=1024, user_capacity=512, parallel_calls=True,
      continuous_batching=continuous, kv_page_size=16 if continuous else 0, kv_pages=16, **PER_CALL,
    )  # fmt: skip

    def make():
      return Sampler(config, params, eos_ids=smollm2_tokenizer.eos_ids, token_bytes=smollm2_tokenizer.token_bytes(),
                     pad_id=smollm2_tokenizer.pad_id)  # fmt: skip

    policy = ForcingSampler(make(), smollm2_tokenizer, script, n)
    outs[continuous] = unfold([small], policy, smollm2_tokenizer, rollout, jax.random.key(3), return_caches=True)
  lockstep, continuous = outs[False], outs[True]
  for a, b in zip(lockstep.trajectories, continuous.trajectories, strict=True):
    assert a.messages == b.messages and a.termination == b.termination
    assert len(a.extra_rows) >= 1 and len(a.extra_rows) == len(b.extra_rows)
    for x, y in zip(a.training_rows(), b.training_rows(), strict=True):
      np.testing.assert_array_equal(x.tokens, y.tokens)
      np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
  cache = lockstep.caches["policy"].flatten()
  slot = lockstep.policy_roles.index(Role.REHEARSE)
  unrolled = config.replace(scan_layers=False)
  for i, traj in enumerate(lockstep.trajectories):
    row = traj.rows[int(Role.REHEARSE)]
    assert int(cache.lengths[slot * n + i]) == len(row.tokens)
    fresh = transformer.init_cache(unrolled, 1, len(row.tokens))
    _, fresh = jit_apply(
      unrolled, transformer.unstack_layers(params), row.tokens[None], row.roles[None], cache=fresh
    )  # fmt: skip
    got = np.asarray(cache.k[0][slot * n + i])[..., : len(row.tokens)]
    np.testing.assert_allclose(got, np.asarray(fresh.k[0][0]), atol=2e-4)


def test_build_batch_trains_every_per_call_row():
  """A trajectory's per-call REHEARSE rows (``extra_rows``) are trained like its last one, with REHEARSE's advantage;
  the role's generations count them all."""
  task = Task("t", "tiny", "d", "s", "", ())
  trajectories = []
  for i, reward in enumerate([1.0, 0.0]):
    traj = Trajectory(task=task, group=0, sample=i, reward=RewardInfo(reward=reward))
    for role, length, into in ((Role.ACT, 6, None), (Role.REHEARSE, 9, None), (Role.REHEARSE, 5, "extra")):
      mask = np.arange(length) >= length - 2
      row = TrainingRow(np.full(length, 10 + length, np.int32), np.full(length, int(role), np.int32), mask,
                        np.zeros(length, np.float32), int(role), i, 1)  # fmt: skip
      traj.extra_rows.append(row) if into else traj.rows.__setitem__(int(role), row)
    trajectories.append(traj)
  rewards, groups, gens, valid = advantages.trajectory_arrays(trajectories)
  assert gens[:, int(Role.REHEARSE)].tolist() == [2, 2] and gens[:, int(Role.ACT)].tolist() == [1, 1]
  cfg = grpo.GrpoConfig.from_config(micro_batch_size=3, length_bucket=16)
  adv, _ = advantages.role_advantages(rewards, groups, gens, valid, trained_roles=cfg.trained_roles)
  batch = grpo.build_batch(trajectories, adv, cfg)
  assert sorted(batch.row_role.ravel().tolist()) == [int(Role.ACT)] * 2 + [int(Role.REHEARSE)] * 4
  lengths = sorted(int(v) for v in batch.valid.reshape(-1, batch.valid.shape[-1]).sum(-1))
  assert lengths == [5, 5, 6, 6, 9, 9]


def test_demonstration_in_the_official_format(smollm2_tokenizer):
  """The warm-up's demonstrations write REHEARSE's target in the chosen contract (execution_result: ended by the eos,
  as sampled) and, per call, in a view of its own."""
  from envace_jax.envs import registry
  from envace_jax.rehearsal import demonstration

  task = next(t for t in tau2.load_tasks("mock", "base") if t.id == "create_task_1")
  conversation = registry.get("tau2").reference_conversation(task, tau2.Tau2Env(task.domain))
  cfg = UnfoldConfig.from_config(
    group_size=2, act_capacity=8192, rehearse_capacity=8192, rehearsal_format="execution_result", **PER_CALL
  )
  traj = demonstration.demonstration(
    cfg, task, conversation, smollm2_tokenizer, views.ChatFormat.of(smollm2_tokenizer), 0
  )  # fmt: skip
  row = traj.rows[int(Role.REHEARSE)]
  trained = smollm2_tokenizer.decode(row.tokens[row.loss_mask])
  assert trained.startswith("\n<execution_result>\n") and trained.endswith("</execution_result><|im_end|>")
  assert views.parse_rehearsal(trained.removesuffix("<|im_end|>"), rehearsal_format="execution_result").valid
  assert traj.generations(Role.REHEARSE) == 1 + len(traj.extra_rows)
