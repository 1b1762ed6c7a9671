"""The self-unfolded rollout: token bookkeeping, batching, continuation, prefix sharing, faults, modes.

Two stand-ins for the policy sampler:
  * `ForcingSampler` wraps the real `Sampler` (a tiny random model with SmolLM2's vocabulary): ACT generations are
    scripted (so trajectories call tools and REHEARSE runs) and written into the real KV cache with ``prefill``; every
    other row is sampled by the real sampler. The bookkeeping tests run on it and compare rows with the real caches.
  * `ScriptedSampler` has no model at all: its "cache" holds token lists, generations are scripted texts encoded
    canonically. Behaviour tests (faults, modes, replay, external user) run on it in milliseconds.
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import json
import pathlib
import threading

import jax
import numpy as np
import pytest

from envace_jax.envs import bfcl, checklist, registry, tau2
from envace_jax.model import paged, tool_format, transformer
from envace_jax.model.config import get_model_config
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import IM_END, ChatTemplateError, Message, Tokenizer
from envace_jax.rehearsal import demonstration, views
from envace_jax.rehearsal.trajectory import Termination
from envace_jax.rehearsal.unfold import UnfoldConfig, UnfoldConfigError, unfold
from envace_jax.rehearsal.users import ExternalUserConfig, UserEndpointError, UserSimulator
from envace_jax.sampling.sampler import Sampler, SamplingParams
from tests.conftest import jit_apply
from tests.rehearsal.stand_ins import ForcingSampler, ScriptedSampler

CHECKLIST_FIXTURE = pathlib.Path(__file__).parents[1] / "envs" / "data" / "checklist_fixture.jsonl"
CALL_GET_USERS = tool_format.render_tool_call("get_users", {})
CALL_CREATE = tool_format.render_tool_call("create_task", {"user_id": "user_1", "title": "Important Meeting"})


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer) -> Tokenizer:
  return smollm2_tokenizer  # the tokenizer only; the one test that runs SmolLM2 takes its weights itself


@pytest.fixture(scope="module")
def mock_tasks():
  return tau2.load_tasks("mock", "base")


def _task(tasks, task_id):
  return next(t for t in tasks if t.id == task_id)


# ---------------------------------------------------------------------------------------------------------------------
# Real-sampler bookkeeping.


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
  """A tiny random model over SmolLM2's vocabulary (generations are noise; the bookkeeping is real)."""
  config = get_model_config("tiny", vocab_size=tokenizer.vocab_size, max_seq_len=4096)
  return config, transformer.init_params(config, jax.random.key(0))


def _sampler(tiny_model, tokenizer) -> Sampler:
  config, params = tiny_model
  return Sampler(
    config, params, eos_ids=tokenizer.eos_ids, token_bytes=tokenizer.token_bytes(), pad_id=tokenizer.pad_id
  )


REAL = UnfoldConfig.from_config(
  group_size=2,
  max_turns=3,
  act_max_new_tokens=48,
  rehearse_max_new_tokens=12,
  user_max_new_tokens=8,
  act_capacity=1024,
  rehearse_capacity=1024,
  user_capacity=512,
)


def _act_script(row, k):
  """Trajectory 0 calls a tool, then replies; trajectory 1 writes a malformed call first (so at step 2 one row
  needs ACT and another REHEARSE: one batched call must serve both), then calls, then replies."""
  plans = {0: [CALL_GET_USERS, "Here you go.", "Bye."], 1: ["<tool_call>\n{oops\n</tool_call>", CALL_CREATE, "Done."]}
  plan = plans[row % 2]
  return plan[min(k, len(plan) - 1)]


@pytest.fixture(scope="module")
def real_run(tiny_model, tokenizer, mock_tasks):
  tasks = [_task(mock_tasks, "create_task_1"), _task(mock_tasks, "update_task_with_message_history")]
  n = len(tasks) * REAL.group_size
  policy = ForcingSampler(_sampler(tiny_model, tokenizer), tokenizer, lambda role, i, k: _act_script(i, k), n)
  reference = ForcingSampler(_sampler(tiny_model, tokenizer), tokenizer, lambda role, i, k: None, n)
  out = unfold(tasks, policy, tokenizer, REAL, jax.random.key(0), reference_sampler=reference, return_caches=True)
  return out, policy, reference, tasks


def _fresh_kv(tiny_model, tokens, roles):
  """Keys of layer 0 after prefilling ``tokens`` into an empty cache: [K, H, T]."""
  config, params = tiny_model
  cache = transformer.init_cache(config.replace(scan_layers=False), 1, len(tokens))
  unrolled = config.replace(scan_layers=False)
  _, cache = jit_apply(
    unrolled, transformer.unstack_layers(params), np.asarray([tokens]), np.asarray([roles]), cache=cache
  )
  return np.asarray(cache.k[0][0])


def test_training_rows_are_exactly_the_kv_cache_rows(real_run, tiny_model):
  out, _, _, _ = real_run
  n = len(out.trajectories)
  policy = out.caches["policy"].flatten()  # each row's opening levels copied in front of its own slots
  policy_lengths = np.asarray(policy.lengths)
  checked = collections.Counter()
  for traj in out.trajectories:
    i = traj.group * REAL.group_size + traj.sample
    for role, row in traj.rows.items():
      slot = out.policy_roles.index(Role(role))
      assert len(row.tokens) == policy_lengths[slot * n + i], (i, role)
      if traj.sample == 0:  # the real keys of this cache row equal those of a fresh prefill of the row's ids and roles
        got = np.asarray(policy.k[0][slot * n + i])[..., : len(row.tokens)]
        np.testing.assert_allclose(got, _fresh_kv(tiny_model, row.tokens, row.roles), atol=2e-4)
        checked[role] += 1
  assert checked[int(Role.ACT)] == 2 and checked[int(Role.REHEARSE)] == 2
  assert all(Role.USER not in t.rows for t in out.trajectories)  # the reference plays the user: no policy row


@pytest.mark.slow
def test_a_share_of_the_batch_samples_the_whole_batchs_rows(real_run, tiny_model, tokenizer):
  """The second task alone with ``first_trajectory=G`` (a second process's share, `distributed.share`) gives the
  whole run's trajectories G..2G-1: the same group, row indices and tokens (the sampled REHEARSE rows included: their
  keys fold in the global index); its logprobs to float rounding (another batch). From index 0 it samples others."""
  out, _, _, tasks = real_run
  g = REAL.group_size

  def alone(first):
    policy = ForcingSampler(_sampler(tiny_model, tokenizer), tokenizer, lambda role, i, k: _act_script(i, k), g)
    reference = ForcingSampler(_sampler(tiny_model, tokenizer), tokenizer, lambda role, i, k: None, g)
    return unfold(tasks[1:], policy, tokenizer, REAL, jax.random.key(0), reference_sampler=reference,
                  first_trajectory=first).trajectories  # fmt: skip

  share, whole = alone(g), out.trajectories[g:]
  assert [t.group for t in share] == [1] * g and [t.sample for t in share] == list(range(g))
  for ours, theirs in zip(share, whole, strict=True):
    assert ours.rows.keys() == theirs.rows.keys() and int(Role.REHEARSE) in ours.rows
    for role, row in ours.rows.items():
      want = theirs.rows[role]
      assert row.trajectory == want.trajectory and row.trajectory >= g
      for field in ("tokens", "roles", "loss_mask"):
        np.testing.assert_array_equal(getattr(row, field), getattr(want, field), err_msg=field)
      np.testing.assert_allclose(row.logprobs, want.logprobs, atol=1e-5)
  local = alone(0)
  assert any(
    not np.array_equal(a.rows[int(Role.REHEARSE)].tokens, b.rows[int(Role.REHEARSE)].tokens)
    for a, b in zip(local, whole, strict=True)
  )
  with pytest.raises(UnfoldConfigError, match="first_trajectory=1 must be a non-negative multiple of group_size=2"):
    unfold(tasks[1:], None, tokenizer, REAL, jax.random.key(0), first_trajectory=1)


def test_loss_mask_roles_and_logprobs_are_the_samplers(real_run):
  out, policy, _, _ = real_run
  n = len(out.trajectories)
  for traj in out.trajectories:
    i = traj.group * REAL.group_size + traj.sample
    for role, row in traj.rows.items():
      slot = out.policy_roles.index(Role(role))
      gens = [c[slot * n + i] for c in policy.calls if slot * n + i in c]
      assert row.num_generations == len(gens) == traj.generations(role)
      np.testing.assert_array_equal(row.tokens[row.loss_mask], [t for g in gens for t in g[2]])
      np.testing.assert_array_equal(row.logprobs[row.loss_mask], np.float32([x for g in gens for x in g[3]]))
      assert np.all(row.logprobs[~row.loss_mask] == 0)
      assert np.all(row.roles[row.loss_mask] == role)  # generated tokens carry the generating role
      assert row.roles[0] == Role.SYSTEM
  act = out.trajectories[0].rows[int(Role.ACT)]
  rehearse = out.trajectories[0].rows[int(Role.REHEARSE)]
  # The rehearsed response reaches the agent as an OBSERVATION, like a real tool's output; no REHEARSE id in its view.
  assert Role.OBSERVATION in set(act.roles[~act.loss_mask]) and Role.REHEARSE not in set(act.roles)
  # The environment's view shows the agent's call (ACT, not trained there) and its own generated response.
  assert Role.ACT in set(rehearse.roles[~rehearse.loss_mask]) and Role.USER in set(rehearse.roles)


def test_one_batched_policy_call_per_step_serves_act_and_rehearse(real_run):
  out, policy, reference, _ = real_run
  assert out.stats["policy_calls"] == len(policy.calls) <= out.stats["steps"]
  assert out.stats["reference_calls"] == len(reference.calls)
  roles_per_call = [{r for r, *_ in c.values()} for c in policy.calls]
  assert {Role.ACT, Role.REHEARSE} in roles_per_call  # one call, rows of both roles
  assert all(r <= {Role.ACT, Role.REHEARSE} for r in roles_per_call)
  assert all({r for r, *_ in c.values()} == {Role.USER} for c in reference.calls)


def _common_start(a, b) -> int:
  """Leading positions where training rows a and b have the same token and role ids."""
  n = min(len(a.tokens), len(b.tokens))
  differ = np.flatnonzero((a.tokens[:n] != b.tokens[:n]) | (a.roles[:n] != b.roles[:n]))
  return int(differ[0]) if differ.size else n


def test_continuation_prefills_only_new_tokens_and_openings_once_per_task(real_run):
  """Every token in the caches was prefilled once: each role's opening part common to both tasks (its system
  prompt) once, in a cache of those parts alone (one row per role), copied to each task's row; then each task's
  rest of its openings, forked G ways; then only new prompt tokens."""
  out, policy, reference, tasks = real_run
  g, b = REAL.group_size, len(tasks)
  reused = 0
  for sampler, name, roles in ((policy, "policy", out.policy_roles), (reference, "reference", (Role.USER,))):
    common, rest = sampler.prefills[0], sampler.prefills[1]
    assert len(common) == len(roles)  # one row per role
    assert len(rest) == len(roles) * b  # one row per (role, task), not per trajectory
    openings = []
    for r, role in enumerate(roles):
      root = common[r]
      assert root >= 64 and all(n > 0 for n in rest[r * b : (r + 1) * b])
      if role != Role.USER:  # the common part ends exactly where the two tasks' rows part
        assert root == _common_start(*(out.trajectories[t * g].rows[int(role)] for t in range(b)))
      openings += [root + n for n in rest[r * b : (r + 1) * b]]
      reused += root * (b - 1)
    generated = sum(len(x[2]) for c in sampler.calls for x in c.values())
    continued = sum(x[1] for c in sampler.calls for x in c.values())
    cache = out.caches[name]
    assert int(np.sum(cache.filled())) == g * sum(openings) + continued + generated  # every row's whole history
    # Stored once: the common parts in one row per role, each task's rest in one row, each trajectory's own tokens.
    levels = [cache, *cache.levels()]
    assert [int(c.lengths.shape[0]) for c in levels] == [len(roles) * b * g, len(roles) * b, len(roles)]
    assert [int(np.sum(c.lengths)) for c in levels] == [continued + generated, sum(rest), sum(common)]
  assert out.stats["prefill_tokens_shared"] == sum(sum(p[0]) + sum(p[1]) for p in (policy.prefills, reference.prefills))
  assert out.stats["prefill_tokens_reused"] == reused
  # Own slots in pages of 64: each row ends holding the pages its tokens fill (ended trajectories keep theirs with
  # return_caches); each pool is a quarter of every row at the largest capacity, which held them (no growth).
  allocated = stored = 0
  for name, full in (("policy", REAL.act_capacity), ("reference", REAL.user_capacity)):
    cache, z = out.caches[name], REAL.kv_page_size
    rows, levels = int(cache.lengths.shape[0]), sum(level.stored_slots() for level in cache.levels()[:1])
    assert cache.pools[0].shape[:2] == (-(-rows * (full // z) // 4), z)
    assert cache.stored_slots() == levels + z * int(np.sum(-(-np.asarray(cache.lengths) // z)))
    allocated, stored = allocated + cache.allocated_slots(), stored + cache.stored_slots()
  assert "kv_pool_growths" not in out.stats
  assert out.stats["kv_slots"] == allocated and stored <= out.stats["kv_slots_held"] <= allocated
  assert allocated < out.stats["kv_slots_dense"]
  assert out.stats["prefill_tokens"] == sum(x[1] for s in (policy, reference) for c in s.calls for x in c.values())
  for t in range(b):  # the G rows of a task start with the same opening
    n = policy.prefills[0][0] + policy.prefills[1][t]  # ACT: the common part, then task t's rest
    rows = [out.trajectories[t * g + s].rows[int(Role.ACT)].tokens for s in range(g)]
    assert all(np.array_equal(rows[0][:n], r[:n]) for r in rows)


def test_faults_are_recorded_and_history_is_shown(real_run, tokenizer):
  out, _, _, tasks = real_run
  t1 = out.trajectories[1]
  assert t1.counts["malformed_act"] == 1 and t1.events[0]["kind"] == "bad_json"
  assert [t.termination for t in out.trajectories[:2]] == [Termination.MAX_TURNS] * 2
  # The task with a logged history has a long ACT view: its second trajectory runs out of its 1024-token budget.
  assert {t.termination for t in out.trajectories[2:]} <= {Termination.MAX_TURNS, Termination.CONTEXT_EXHAUSTED}
  history = tau2.initial_conversation(tasks[1])
  assert [m.role for m in out.trajectories[2].messages[: len(history)]] == [m.role for m in history]
  for traj, view_set in zip(out.trajectories, out.views, strict=True):
    for view in view_set.values():  # random generations: texts agree (tokens differ where BPE is non-canonical)
      assert tokenizer.decode(view.tokens) == tokenizer.render_text(view.messages, tools=view.tools)
      assert view.cached == len(traj.rows[int(view.role)].tokens) if int(view.role) in traj.rows else True


def test_context_exhausted_ends_cleanly(tiny_model, tokenizer, mock_tasks):
  """A small ACT budget on the real sampler: the view fills up while generating; the trajectory ends cleanly with its
  row exactly the cache row. A budget below the opening ends it before anything is sampled."""
  task = _task(mock_tasks, "create_task_1")
  policy = ForcingSampler(_sampler(tiny_model, tokenizer), tokenizer, lambda role, i, k: None, 2)
  opening = views.View(tokenizer, views.ChatFormat.of(tokenizer), Role.ACT, task.tools)
  opening.append(Message("system", task.system_prompt), Message("assistant", REAL.greeting))
  config = dataclasses.replace(
    REAL, user_mode="policy", act_capacity=len(opening) + 80, user_max_new_tokens=8, act_max_new_tokens=200
  )
  out = unfold([task], policy, tokenizer, config, jax.random.key(3), return_caches=True)
  assert out.stats["policy_calls"] == len(policy.calls) > 0  # the stat counts the sampler's generate calls
  lengths = np.asarray(out.caches["policy"].filled())
  for i, traj in enumerate(out.trajectories):
    assert traj.termination == Termination.CONTEXT_EXHAUSTED
    assert traj.events[-1] == {
      "type": "end",
      "termination": "context_exhausted",
      "view": "act",
      "detail": "the view filled up while generating",
    }
    act = traj.rows[int(Role.ACT)]
    assert len(act.tokens) == config.act_capacity == lengths[i] and act.num_generations == 1
    assert traj.messages[-1].role == "assistant" and not traj.messages[-1].tool_calls
  tiny = dataclasses.replace(config, act_capacity=len(opening) // 2)  # the opening itself does not fit
  calls = len(policy.calls)
  out = unfold([task], policy, tokenizer, tiny, jax.random.key(3))
  assert all(t.termination == Termination.CONTEXT_EXHAUSTED and not t.rows for t in out.trajectories)
  assert len(policy.calls) == calls and "policy_calls" not in out.stats  # nothing was sampled


class _RecordedPool(paged.PagePool):
  """A `paged.PagePool` that keeps a list of its instances, the sizes it grew to and the pages each release gave
  back."""

  made: list = []

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.released, self.sizes = 0, [self.num_pages]
    _RecordedPool.made.append(self)

  def extend(self, num_pages):
    self.sizes.append(num_pages)
    super().extend(num_pages)

  def release(self, row):
    self.released += len(self.pages[row])
    super().release(row)


_PAGES = 32  # a pool's first size: each size it doubles to compiles the sampler's programs again


@pytest.mark.parametrize("user_mode", ["policy", "reference"])
def test_continuous_batching_and_paged_views_give_the_lockstep_dense_trajectories(
  tiny_model, tokenizer, mock_tasks, user_mode, monkeypatch
):
  """The real sampler, sampled at temperature 1, generations of ragged lengths (ids below 2000 end one too, as an
  eos would), the user played by the policy (a view in its stream) or the reference (queued, run together):
  continuous batching and lockstep give the same trajectories (each generation is keyed by trajectory, role and
  index, not by step): messages, terminations, training rows (ids, roles, logprobs <= 1e-4); continuous batching
  spends fewer decode row-steps (a row that ends its generation starts the next one at once). One of the two runs
  holds each view's own slots in pages of 16 from pools of 32 (policy user: the continuous run; reference user: the
  lockstep run, the reference's cache paged too), the other dense rows: a pool grows when a generation finds too
  few free pages, every ended trajectory gives its pages back (none held at the end), and the pools hold fewer
  slots than a dense row per view."""
  tasks = [_task(mock_tasks, "create_task_1"), _task(mock_tasks, "update_task_with_message_history")]
  config, params = tiny_model
  monkeypatch.setattr(paged, "PagePool", _RecordedPool)
  _RecordedPool.made = []
  outs = {}
  for continuous in (False, True):
    policy, reference = (
      Sampler(config, params, eos_ids=[*tokenizer.eos_ids, *range(2000)], token_bytes=tokenizer.token_bytes(),
              pad_id=tokenizer.pad_id)
      for _ in range(2)
    )  # fmt: skip
    paging = dict(kv_page_size=16, kv_pages=_PAGES) if continuous == (user_mode == "policy") else dict(kv_page_size=0)
    rollout = dataclasses.replace(REAL, user_mode=user_mode, continuous_batching=continuous, **paging)
    outs[continuous] = unfold(tasks, policy, tokenizer, rollout, jax.random.key(5), reference_sampler=reference)
  lockstep, continuous = outs[False], outs[True]
  assert [t.termination for t in continuous.trajectories] == [t.termination for t in lockstep.trajectories]
  for a, b in zip(continuous.trajectories, lockstep.trajectories, strict=True):
    assert a.messages == b.messages and a.counts == b.counts
    assert a.rows.keys() == b.rows.keys() and a.rows
    for role, row in a.rows.items():
      np.testing.assert_array_equal(row.tokens, b.rows[role].tokens)
      np.testing.assert_array_equal(row.roles, b.rows[role].roles)
      np.testing.assert_allclose(row.logprobs, b.rows[role].logprobs, atol=1e-4)
  generated = sum(v for k, v in lockstep.stats.items() if k.startswith("generated_tokens_"))
  assert generated == sum(v for k, v in continuous.stats.items() if k.startswith("generated_tokens_"))
  # The reference user runs in rounds of its own either way: no fewer row-steps there, never more.
  fewer = continuous.stats["decode_row_steps"] < lockstep.stats["decode_row_steps"]
  assert generated <= continuous.stats["decode_row_steps"] <= lockstep.stats["decode_row_steps"]
  assert fewer or user_mode == "reference"
  paged_run = continuous if user_mode == "policy" else lockstep
  pools = _RecordedPool.made
  assert len(pools) == (1 if user_mode == "policy" else 2)  # the policy's cache, and the reference's
  assert paged_run.stats["kv_pool_growths"] >= 1 and pools[0].num_pages > _PAGES
  # A pool doubles from kv_pages (each size is another size of every sampler program, the same in every rollout
  # with as many rows), up to every row at the largest capacity (then its last size).
  # Rows: the policy's cache, views x tasks x G (ACT, REHEARSE and a policy-played USER); the reference's, USER's.
  mosts = [3 * 2 * 2 * 1024 // 16] if user_mode == "policy" else [2 * 2 * 2 * 1024 // 16, 2 * 2 * 512 // 16]
  for pool, most in zip(pools, mosts, strict=True):
    ladder = [_PAGES * 2**k for k in range(10) if _PAGES * 2**k < most] + [most]
    assert pool.sizes == sorted(set(pool.sizes)) and all(size in ladder for size in pool.sizes), pool.sizes
  assert all(pool.allocated() == 0 and not pool.pages for pool in pools)  # every page given back
  assert all(pool.released > 0 for pool in pools)
  # kv_slots: the levels and the pools' pages; kv_slots_held: the levels and the most pages held at once.
  peak = (paged_run.stats["kv_slots_held"] - paged_run.stats["kv_slots"]) // 16 + sum(p.num_pages for p in pools)
  assert 0 < peak <= sum(p.num_pages for p in pools) and paged_run.stats["kv_slots"] < paged_run.stats["kv_slots_dense"]


# ---------------------------------------------------------------------------------------------------------------------
# Scripted behaviour (no model).

FAST = UnfoldConfig.from_config(
  group_size=2, max_turns=4, act_capacity=8192, rehearse_capacity=8192, user_capacity=8192
)
RESPONSE = '<tool_response>\n{"task_id": "task_2", "title": "Important Meeting", "status": "pending"}\n</tool_response>'


def _scripted(tokenizer, tasks, config, plans, **kwargs):
  """unfold with `ScriptedSampler`s: ``plans[role]`` is a list of texts by generation index (the last repeats) or a
  callable ``(trajectory, k) -> text``."""
  n = len(tasks) * config.group_size

  def script(role, i, k):
    plan = plans[role]
    return plan(i, k) if callable(plan) else plan[min(k, len(plan) - 1)]

  policy, reference = ScriptedSampler(tokenizer, script, n), ScriptedSampler(tokenizer, script, n)
  kwargs.setdefault("reference_sampler", reference)
  out = unfold(tasks, policy, tokenizer, config, jax.random.key(0), return_caches=True, **kwargs)
  return out, policy, reference


def test_finished_views_equal_rendering_their_messages(tokenizer, mock_tasks):
  """With canonical generations a view's ids and roles are exactly the template's rendering of its messages, and the
  training row is exactly its cache row (here the fake cache keeps ids and roles)."""
  tasks = [_task(mock_tasks, "create_task_1"), _task(mock_tasks, "update_task_with_message_history")]
  plans = {
    Role.ACT: [CALL_CREATE, "I created the task 'Important Meeting'.", "Anything else?"],
    Role.REHEARSE: [RESPONSE],
    Role.USER: ["Please create a task 'Important Meeting' for user_1.", "Great, thanks!", "###STOP###"],
  }
  out, policy, _ = _scripted(tokenizer, tasks, dataclasses.replace(FAST, user_mode="policy"), plans)
  assert out.policy_roles == (Role.ACT, Role.REHEARSE, Role.USER)
  assert any(Role.USER in {r for r, *_ in c.values()} for c in policy.calls)  # the policy plays the user too
  cache, n = out.caches["policy"], len(out.trajectories)
  for i, (traj, view_set) in enumerate(zip(out.trajectories, out.views, strict=True)):
    assert traj.termination == Termination.USER_STOP and traj.messages[-1].content == "###STOP###"
    for role, view in view_set.items():
      ids, roles = tokenizer.render(view.messages, tools=view.tools)
      assert view.tokens == ids.tolist() and view.roles == roles.tolist(), (i, role)
      row = traj.rows[int(role)]
      slot = out.policy_roles.index(role)
      assert row.tokens.tolist() == cache.tokens[slot * n + i] and row.roles.tolist() == cache.roles[slot * n + i]
      assert view.tokens[: len(row.tokens)] == row.tokens.tolist()
      if role != Role.REHEARSE:  # ended by their own generation: the uncached tail is the template's closing "\n"
        assert tokenizer.decode(view.tokens[len(row.tokens) :]) == "\n"
  first = out.trajectories[0]
  assert [m.role for m in first.messages] == ["assistant", "user", "assistant", "tool"] + ["assistant", "user"] * 2
  assert (
    first.messages[3].content == json.dumps({"task_id": "task_2", "title": "Important Meeting", "status": "pending"})
    and first.messages[3].tool_call_id == first.messages[2].tool_calls[0].id
  )


@pytest.mark.parametrize("on_malformed", ["continue", "end"])
def test_malformed_act_output_is_recorded_not_raised(tokenizer, mock_tasks, on_malformed):
  plans = {
    Role.ACT: [
      '<tool_call>\n{"name": "get_users"' + IM_END,
      tool_format.render_tool_call("fly_to_the_moon", {}),
      "<tool_call>\n[1, 2]\n</tool_call>",
      "Sorry about that.",
    ],
    Role.USER: ["Hi, create a task please.", "###STOP###"],
  }
  config = dataclasses.replace(FAST, on_malformed=on_malformed)
  out, _, _ = _scripted(tokenizer, [_task(mock_tasks, "create_task_1")], config, plans)
  for traj, view_set in zip(out.trajectories, out.views, strict=True):
    kinds = [e["kind"] for e in traj.events if e["type"] == "malformed_act"]
    if on_malformed == "end":
      assert traj.termination == Termination.MALFORMED and kinds == ["unterminated"]
      continue
    assert kinds == ["unterminated", "unknown_tool", "bad_json"] and traj.termination == Termination.USER_STOP
    assert traj.counts["malformed_act"] == 3 and traj.counts["unknown_tool"] == 1
    feedback = [m.content for m in view_set[Role.ACT].messages if m.role == "tool"]
    assert len(feedback) == 3 and all(f.startswith("Error: ") for f in feedback)
    assert not any(m.role == "tool" for m in traj.messages)  # no tool message without a call in the conversation


@pytest.mark.parametrize("policy", ["as_is", "error", "end"])
def test_invalid_rehearsed_json_is_recorded(tokenizer, mock_tasks, policy):
  plans = {
    Role.ACT: [CALL_GET_USERS, "Done."],
    Role.REHEARSE: ["<tool_response>\nthe users are alice and bob\n</tool_response>"],
    Role.USER: ["List the users.", "###STOP###"],
  }
  config = dataclasses.replace(FAST, on_invalid_rehearsal=policy)
  out, _, _ = _scripted(tokenizer, [_task(mock_tasks, "create_task_1")], config, plans)
  for traj, view_set in zip(out.trajectories, out.views, strict=True):
    assert traj.counts["invalid_rehearsed_json"] == 1
    tool = next(m for m in traj.messages if m.role == "tool")
    assert tool.content == view_set[Role.ACT].messages[-1 if policy == "end" else -2].content
    if policy == "as_is":
      assert tool.content == "the users are alice and bob" and not tool.is_error
    else:
      assert tool.is_error == (policy == "error")
    assert traj.termination == (Termination.MALFORMED if policy == "end" else Termination.USER_STOP)


def test_rehearsed_error_text_is_a_valid_error_observation(tokenizer, mock_tasks):
  plans = {
    Role.ACT: [CALL_GET_USERS, "Done."],
    Role.REHEARSE: ["<tool_response>\nError: the database is read-only\n</tool_response>"],
    Role.USER: ["List the users.", "###STOP###"],
  }
  out, _, _ = _scripted(tokenizer, [_task(mock_tasks, "create_task_1")], FAST, plans)
  tool = next(m for m in out.trajectories[0].messages if m.role == "tool")
  assert tool.is_error and "invalid_rehearsed_json" not in out.trajectories[0].counts


def test_parallel_calls_are_rehearsed_one_by_one_in_order(tokenizer, mock_tasks):
  responses = {0: '<tool_response>\n{"users": ["user_1"]}\n</tool_response>', 1: RESPONSE}
  plans = {
    Role.ACT: ["Let me look.\n" + CALL_GET_USERS + "\n" + CALL_CREATE + IM_END, "All done."],
    Role.REHEARSE: lambda i, k: responses[k % 2],
    Role.USER: ["Create it.", "###STOP###"],
  }
  config = dataclasses.replace(FAST, parallel_calls=True)
  out, policy, _ = _scripted(tokenizer, [_task(mock_tasks, "create_task_1")], config, plans)
  traj, view_set = out.trajectories[0], out.views[0]
  call_message = next(m for m in traj.messages if m.tool_calls)
  assert [c.name for c in call_message.tool_calls] == ["get_users", "create_task"] and call_message.content
  tools = [m for m in traj.messages if m.role == "tool"]
  assert [m.tool_call_id for m in tools] == [c.id for c in call_message.tool_calls]
  assert "user_1" in tools[0].content and "task_2" in tools[1].content
  env_view = view_set[Role.REHEARSE].messages
  first = next(i for i, m in enumerate(env_view) if m.content == CALL_GET_USERS)
  tail = [(m.role, m.author, m.content[:16]) for m in env_view[first : first + 4]]
  assert tail == [
    ("user", Role.ACT, CALL_GET_USERS[:16]),
    ("assistant", Role.REHEARSE, responses[0][:16]),
    ("user", Role.ACT, CALL_CREATE[:16]),
    ("assistant", Role.REHEARSE, responses[1][:16]),
  ]
  assert env_view[first - 1].content == "Agent: Let me look." and env_view[first + 4].content == "Agent: All done."
  assert traj.rows[int(Role.REHEARSE)].num_generations == 2 and traj.counts["tool_calls"] == 2


class CountingTau2Env(tau2.Tau2Env):
  def __init__(self, domain):
    super().__init__(domain)
    self.executed, self.resets = 0, 0

  def reset(self, task):
    self.resets += 1
    super().reset(task)

  def execute(self, call):
    self.executed += 1
    return super().execute(call)


def test_rehearse_mode_never_touches_the_real_environment(tokenizer, mock_tasks, monkeypatch):
  task = _task(mock_tasks, "create_task_1")
  env = CountingTau2Env("mock")
  env.reset(task)
  before = env.state_hash()
  executed = []
  original = tau2.Tau2Env.execute
  monkeypatch.setattr(tau2.Tau2Env, "execute", lambda self, call: executed.append(call) or original(self, call))
  plans = {Role.ACT: [CALL_CREATE, "Created."], Role.REHEARSE: [RESPONSE], Role.USER: ["Create it.", "###STOP###"]}
  out, _, _ = _scripted(tokenizer, [task], FAST, plans, envs=[env, env])
  assert all(t.counts["tool_calls"] == 1 and t.generations(Role.REHEARSE) == 1 for t in out.trajectories)
  assert env.executed == 0 and env.resets == 1 and executed == [] and env.state_hash() == before


def test_real_mode_executes_calls_on_the_environment(tokenizer, mock_tasks):
  task = _task(mock_tasks, "create_task_1")
  envs = [CountingTau2Env("mock") for _ in range(FAST.group_size)]
  plans = {
    Role.ACT: [CALL_CREATE, "I created the task 'Important Meeting' for user_1."],
    Role.USER: ["Please create a task 'Important Meeting' for user_1.", "###STOP###"],
  }
  config = dataclasses.replace(FAST, env_mode="real")
  out, policy, _ = _scripted(tokenizer, [task], config, plans, envs=envs)
  assert out.policy_roles == (Role.ACT,)
  assert all({r for r, *_ in c.values()} == {Role.ACT} for c in policy.calls)
  for traj, env, view_set in zip(out.trajectories, envs, out.views, strict=True):
    assert env.resets == 1 and env.executed == 1 and set(traj.rows) == {int(Role.ACT)}
    observation = next(m for m in view_set[Role.ACT].messages if m.role == "tool")
    assert observation.author == Role.OBSERVATION and '"task_id"' in observation.content
    assert env.evaluate(traj.messages).reward == 1.0  # the benchmark's own evaluator replays the conversation


def test_logged_user_turns_are_replayed_checklist(tokenizer):
  tasks = checklist.load_tasks(CHECKLIST_FIXTURE)
  weather = tool_format.render_tool_call("get_weather", {"city": "Paris", "unit": "C"})
  plans = {
    Role.ACT: lambda i, k: weather if i == 0 and k == 0 else "Here is what I found.",
    Role.REHEARSE: ['<tool_response>\n{"city": "Paris", "temp": 12}\n</tool_response>'],
  }
  out, policy, _ = _scripted(tokenizer, tasks, dataclasses.replace(FAST, group_size=1), plans, reference_sampler=None)
  assert out.policy_roles == (Role.ACT, Role.REHEARSE)  # no user generation at all
  for traj, task in zip(out.trajectories, tasks, strict=True):
    assert traj.termination == Termination.USER_TURNS_DONE
    assert [m.content for m in traj.messages if m.role == "user"] == list(task.user_turns)
    assert traj.counts["user_turns"] == len(task.user_turns) and traj.generations(Role.USER) == 0
    assert traj.messages[0].role == "user"  # no greeting: the logged conversation opens with the user
  env_system = out.views[0][Role.REHEARSE].messages[0].content
  assert views.GROUNDING_HEADER in env_system and '"temp": 12, "sky": "cloudy"' in env_system  # the logged result
  assert views.TOOLS_HEADER in env_system and "You may call one function" not in env_system  # not the agent's block


def test_logged_user_turns_are_replayed_bfcl_real_env(tokenizer):
  task = bfcl.load_tasks("multi_turn_base")[0]
  plans = {Role.ACT: lambda i, k: tool_format.render_tool_call("ls", {}) if k % 2 == 0 else "Done."}
  config = dataclasses.replace(FAST, group_size=1, env_mode="real", max_turns=20)
  out, _, _ = _scripted(tokenizer, [task], config, plans, envs=[bfcl.BfclEnv()], reference_sampler=None)
  traj = out.trajectories[0]
  assert traj.termination == Termination.USER_TURNS_DONE and traj.counts["user_turns"] == len(task.user_turns)
  observations = [m for m in traj.messages if m.role == "tool"]
  assert len(observations) == len(task.user_turns) and "current_directory_content" in observations[0].content


def test_agent_stop_marker_max_turns_and_grounding_budget(tokenizer, mock_tasks):
  task = _task(mock_tasks, "create_task_1")
  plans = {Role.ACT: ["Goodbye ###DONE###"], Role.USER: ["Hello."]}
  config = dataclasses.replace(FAST, agent_stop_markers=("###DONE###",), grounding_max_tokens=0)
  out, _, _ = _scripted(tokenizer, [task], config, plans)
  traj = out.trajectories[0]
  assert traj.termination == Termination.AGENT_STOP and traj.counts["grounding_dropped"] == 1
  assert views.GROUNDING_HEADER not in out.views[0][Role.REHEARSE].messages[0].content
  out, _, _ = _scripted(
    tokenizer, [task], dataclasses.replace(FAST, max_turns=2), {Role.ACT: ["Hm."], Role.USER: ["Hi"]}
  )
  assert all(t.termination == Termination.MAX_TURNS and t.counts["turns"] == 2 for t in out.trajectories)


def test_context_exhausted_before_prefill_scripted(tokenizer, mock_tasks):
  task = _task(mock_tasks, "create_task_1")
  plans = {Role.ACT: ["word " * 30], Role.USER: ["Hello."]}
  out, policy, _ = _scripted(tokenizer, [task], dataclasses.replace(FAST, act_capacity=700), plans)
  for traj in out.trajectories:
    assert traj.termination == Termination.CONTEXT_EXHAUSTED
    assert traj.events[-1]["view"] == "act"
    assert len(traj.rows.get(int(Role.ACT), np.zeros(0)).tokens if traj.rows else []) <= 700


def test_config_validation_and_from_dict():
  with pytest.raises(UnfoldConfigError, match="group_size"):
    UnfoldConfig.from_config(group_size=0)
  with pytest.raises(UnfoldConfigError, match="user_mode"):
    UnfoldConfig.from_config(user_mode="oracle")
  with pytest.raises(UnfoldConfigError, match="on_invalid_rehearsal"):
    UnfoldConfig.from_config(on_invalid_rehearsal="ignore")
  with pytest.raises(UnfoldConfigError, match="continuous_batching must be True or False, got 'no'"):
    UnfoldConfig.from_config(continuous_batching="no")
  with pytest.raises(UnfoldConfigError, match="scenario"):
    UnfoldConfig.from_config(user_prompt="{user}")
  with pytest.raises(UnfoldConfigError, match="unknown UnfoldConfig keys"):
    UnfoldConfig.from_dict({"groups": 2})
  config = UnfoldConfig.from_config(
    group_size=3, act_sampling={"temperature": 0.7, "top_p": 0.9}, agent_stop_markers=["###END###"]
  )
  assert config.act_sampling == SamplingParams(0.7, 0.9) and config.agent_stop_markers == ("###END###",)


def test_unfold_refuses_missing_samplers_and_envs(tokenizer, mock_tasks):
  task = _task(mock_tasks, "create_task_1")
  policy = ScriptedSampler(tokenizer, lambda *a: "x", 2)
  with pytest.raises(UnfoldConfigError, match="reference_sampler"):
    unfold([task], policy, tokenizer, FAST, jax.random.key(0))
  with pytest.raises(UnfoldConfigError, match="external_user"):
    unfold(
      [task], policy, tokenizer, dataclasses.replace(FAST, user_mode="external", external_user=None), jax.random.key(0)
    )
  with pytest.raises(UnfoldConfigError, match="one ToolEnv per trajectory"):
    unfold([task], policy, tokenizer, dataclasses.replace(FAST, env_mode="real", user_mode="policy"), jax.random.key(0))


def test_parse_act_and_rehearsal():
  out = views.parse_act("a\n" + CALL_GET_USERS + "\nb\n" + CALL_CREATE, ["get_users", "create_task"], parallel=True)
  assert [c.name for c in out.calls] == ["get_users", "create_task"] and out.reply == "a\nb" and out.error is None
  out = views.parse_act(CALL_GET_USERS + CALL_CREATE, ["get_users", "create_task"], parallel=False)
  assert out.error.kind == tool_format.ParseErrorKind.MULTIPLE_CALLS and not out.calls
  out = views.parse_act(CALL_GET_USERS + "<tool_call>\n{", ["get_users"], parallel=True)
  assert out.error.kind == tool_format.ParseErrorKind.UNTERMINATED and out.error.message.startswith("call 2")
  assert views.parse_rehearsal('<tool_response>\n{"a": 1}\n</tool_response>') == views.RehearsedResponse(
    '{"a": 1}', True
  )
  assert not views.parse_rehearsal('{"a": 1}').valid  # no tags
  assert views.parse_rehearsal("<tool_response>\n[1,").reason.startswith("no </tool_response>")
  assert views.parse_rehearsal("<tool_response>Error: no</tool_response>", accept_error_text=False).reason.startswith(
    "not JSON"
  )


def test_external_user_over_http(tokenizer, mock_tasks):
  requests = []
  replies = ["Hi, I need a task created.", "###STOP###"]

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      requests.append((self.path, body))
      if "fail" in body["model"]:
        self.send_response(503)
        self.end_headers()
        return
      text = replies[sum(1 for m in body["messages"] if m["role"] == "assistant")]
      payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(payload)))
      self.end_headers()
      self.wfile.write(payload)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    task = _task(mock_tasks, "create_task_1")
    config = dataclasses.replace(
      FAST,
      user_mode="external",
      external_user=ExternalUserConfig(base_url=base, model="sim", api_key_env="", max_retries=0),
    )
    out, policy, _ = _scripted(tokenizer, [task], config, {Role.ACT: ["Sure, which title?"]}, reference_sampler=None)
    assert out.stats["external_requests"] == 4 and out.policy_roles == (Role.ACT, Role.REHEARSE)
    for traj in out.trajectories:
      assert traj.termination == Termination.USER_STOP and Role.USER not in traj.rows
      assert [m.content for m in traj.messages if m.role == "user"] == replies
    path, last = requests[-1]
    assert path == "/v1/chat/completions" and last["model"] == "sim"
    assert [m["role"] for m in last["messages"]] == ["system", "user", "assistant", "user"]
    assert task.user_scenario in last["messages"][0]["content"]
    assert last["messages"][1]["content"] == FAST.greeting and last["messages"][3]["content"] == "Sure, which title?"

    failing = dataclasses.replace(config, external_user=dataclasses.replace(config.external_user, model="fail"))
    out, _, _ = _scripted(tokenizer, [task], failing, {Role.ACT: ["Sure."]}, reference_sampler=None)
    assert all(t.termination == Termination.USER_ERROR and t.counts["user_error"] == 1 for t in out.trajectories)
  finally:
    server.shutdown()
    server.server_close()
  with pytest.raises(UserEndpointError, match="base_url"):
    _scripted(
      tokenizer,
      [task],
      dataclasses.replace(config, external_user=ExternalUserConfig(base_url="", model="", api_key_env="")),
      {Role.ACT: ["x"]},
    )


def test_any_user_simulator_can_play_the_user(tokenizer, mock_tasks):
  class Scripted(UserSimulator):
    def __init__(self):
      self.seen = []

    def reply(self, messages):
      self.seen.append(messages)
      return "Create 'Important Meeting' for user_1." if len(self.seen) <= 2 else "Thanks! ###STOP###"

  user = Scripted()
  config = dataclasses.replace(FAST, user_mode="external")
  plans = {Role.ACT: ["On it."]}
  out, _, _ = _scripted(tokenizer, [_task(mock_tasks, "create_task_1")], config, plans, user_simulator=user)
  assert all(t.termination == Termination.USER_STOP for t in out.trajectories) and len(user.seen) == 4
  assert user.seen[-1][-1] == {"role": "user", "content": "On it."}


def test_scenario_opening_tells_the_agent_the_task_as_the_warm_up_does(tokenizer, mock_tasks):
  """rollout.scenario_opening: the user's first message is the scenario itself (the simulated user speaks only from
  its second turn), in every view; the agent's first prompt is token for token the warm-up demonstration's."""
  task = _task(mock_tasks, "create_task_1")
  config = dataclasses.replace(FAST, scenario_opening=True, user_mode="policy")
  plans = {Role.ACT: [CALL_CREATE, "Done."], Role.REHEARSE: [RESPONSE], Role.USER: ["###STOP###"]}
  out, _, _ = _scripted(tokenizer, [task], config, plans)
  for traj, view_set in zip(out.trajectories, out.views, strict=True):
    opening = [("assistant", FAST.greeting), ("user", task.user_scenario)]
    assert [(m.role, m.content) for m in traj.messages[:2]] == opening
    assert traj.counts["scenario_opening"] == 1 and traj.counts["generations_user"] == 1  # only the stop
    assert traj.termination == Termination.USER_STOP and traj.messages[-1].content == "###STOP###"
    user_view = view_set[Role.USER].messages
    assert user_view[2] == Message("assistant", task.user_scenario, author=Role.USER)  # the user's own message
  env = tau2.Tau2Env("mock")
  demo = demonstration.demonstration(
    config,
    task,
    registry.get(task.benchmark).reference_conversation(task, env),
    tokenizer,
    views.ChatFormat.of(tokenizer),
    0,
  )

  def first_prompt(row):
    return row.tokens[: int(np.argmax(row.loss_mask))].tolist()

  rollout_prompt = first_prompt(out.trajectories[0].rows[int(Role.ACT)])
  assert rollout_prompt == first_prompt(demo.rows[int(Role.ACT)])
  assert task.user_scenario in tokenizer.decode(rollout_prompt)
  # Without it the simulated user writes the first message (here its stop marker).
  out, _, _ = _scripted(tokenizer, [task], dataclasses.replace(config, scenario_opening=False), plans)
  assert out.trajectories[0].messages[1].content == "###STOP###"


def test_chat_format_refuses_templates_that_rewrite_content(tokenizer):
  fmt = views.ChatFormat.of(tokenizer)
  assert tokenizer.decode(fmt.header) == "<|im_start|>assistant\n" and fmt.trailer == "<|im_end|>\n"
  assert fmt.close_after_eos == {tokenizer.eos_ids[0]: tuple(tokenizer.encode("\n"))}
  rewriting = tokenizer.with_chat_template(
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
  )
  with pytest.raises(ChatTemplateError, match="verbatim"):
    views.ChatFormat.of(rewriting)


def _recomputed_logprobs(config, params, row) -> np.ndarray:
  """log p(token t | tokens < t) of a row under ``params`` (a full forward), at the row's generated tokens."""
  logits, _ = jit_apply(config, params, np.asarray([row.tokens]), np.asarray([row.roles]))
  logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1)
  positions = np.flatnonzero(row.loss_mask)
  return np.asarray(logp[positions - 1, row.tokens[positions]])


@pytest.mark.slow
def test_per_role_samplers_generate_each_role_with_its_own_parameters(tiny_model, tokenizer, mock_tasks):
  """The per_role ablation: ACT rows come from the ACT parameters, REHEARSE rows from the REHEARSE parameters, in one
  shared cache."""
  config, act_params = tiny_model
  rehearse_params = transformer.init_params(config, jax.random.key(1))
  tasks = [_task(mock_tasks, "create_task_1")]
  n = len(tasks) * REAL.group_size
  act = ForcingSampler(_sampler(tiny_model, tokenizer), tokenizer, lambda role, i, k: _act_script(i, k), n)
  rehearse = ForcingSampler(_sampler((config, rehearse_params), tokenizer), tokenizer, lambda role, i, k: None, n)
  reference = ForcingSampler(_sampler(tiny_model, tokenizer), tokenizer, lambda role, i, k: None, n)
  policy = {Role.ACT: act, Role.REHEARSE: rehearse}
  out = unfold(tasks, policy, tokenizer, REAL, jax.random.key(0), reference_sampler=reference)
  assert rehearse.calls and all(r == Role.REHEARSE for c in rehearse.calls for r, *_ in c.values())
  assert all(r == Role.ACT for c in act.calls for r, *_ in c.values())
  rows = [t.rows[int(Role.REHEARSE)] for t in out.trajectories if int(Role.REHEARSE) in t.rows]
  assert rows
  for row in rows:
    np.testing.assert_allclose(
      row.logprobs[row.loss_mask], _recomputed_logprobs(config, rehearse_params, row), atol=1e-4
    )
    assert not np.allclose(row.logprobs[row.loss_mask], _recomputed_logprobs(config, act_params, row), atol=1e-2)


def test_an_opening_that_does_not_fit_beside_shared_ones(tokenizer, mock_tasks):
  """Two tasks share a long ACT opening part (stored once for both) and a third's ACT opening is over act_capacity:
  the third's trajectories end with context_exhausted before anything is sampled, the others run, and the
  bookkeeping check accepts the unfilled view's row (which continues the shared level all the same)."""
  tasks = [_task(mock_tasks, t) for t in ("create_task_1", "update_task_with_message_history", "impossible_task_1")]
  plans = {Role.ACT: ["Done."], Role.REHEARSE: [RESPONSE], Role.USER: ["Please help.", "###STOP###"]}
  config = dataclasses.replace(FAST, act_capacity=760, max_turns=1, user_mode="policy")
  out, policy, _ = _scripted(tokenizer, tasks, config, plans)
  assert len(policy.prefills[0]) == len(out.policy_roles)  # the common parts, one row per role
  for t, traj in enumerate(out.trajectories):
    assert (traj.termination == Termination.CONTEXT_EXHAUSTED) == (t // config.group_size == 1), t
  assert out.trajectories[2].events[-1]["detail"] == "the opening does not fit the view"
