"""Self-unfolded rollout: B tasks x G trajectories, ACT / REHEARSE / USER, one generation at a time each (paper
§3.1-3.2).

Each live trajectory needs exactly one generation at a time:

  * ACT: the agent's next message (a reply or a tool call), parsed host side (`views.parse_act`);
  * REHEARSE: the pending tool call's response, imagined by the policy (`views.parse_rehearsal` checks its JSON);
    parallel calls of one ACT message are rehearsed one by one, in order. With ``rehearse_context="per_call"`` each
    call gets a fresh REHEARSE view (`Episode.rehearse_next`): its cache row restarts from the shared opening
    (`_Unfolder._rewind`) and the previous call's view becomes a training row of its own. With ``env_mode="real"`` the
    calls run on
    a `ToolEnv` instead (one per trajectory, host side) and there is no REHEARSE view: the same code path serves the
    ``grpo_real_env`` baseline and evaluation's committed execution;
  * USER: the user simulator's next message (``user_mode``; an external one is `users.ExternalUser`). Tasks with
    logged user turns (BFCL, checklist format) replay them instead and end with ``USER_TURNS_DONE`` when they run out.

The ACT, REHEARSE (and policy-USER) views of all trajectories are rows of one KV cache, with a role id per row, and
their generations share the policy's decode loop: a `sampler.Stream` with ``continuous_batching``, else lockstep
rounds of one ``Sampler.generate`` per distinct ``SamplingParams``, each run to its longest generation. Either way a
generation's key is fold_in(key, trajectory, role, the view's generation index), so both give the same trajectories
(up to float rounding: the batches differ). A call's stop strings are the union of its roles' (ACT: ``</tool_call>``,
REHEARSE: ``</tool_response>``): a row that writes the other role's closing tag stops there, with output that is
malformed for its own role anyway. Each view's opening is prefilled and stored once and continued by its task's G
rows (`_Unfolder._prefill_openings`).

Row layout of the policy cache, N = B*G trajectories (task-major, n = b*G + g): row ``slot * N + n`` where ``slot``
is the view's index in ``policy_roles`` (ACT first); the reference cache has the USER view of trajectory n in row n.

Host-side faults (malformed ACT output, unknown tools, invalid rehearsed JSON) are counted on the trajectory, logged
in its events, and end it or not as configured: never an exception. `Trajectory.messages` is the conversation in
OpenAI layout for rewards and evaluators: it omits the error feedback shown to the agent after malformed output (a
tool message without a call would not replay), and may end with an unanswered call when a trajectory ends while its
call is being rehearsed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from envace_jax.envs.base import ChatMessage, Task, ToolEnv
from envace_jax.model import paged
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message, Tokenizer
from envace_jax.rehearsal import views
from envace_jax.rehearsal.episode import ROLE_NAMES, Episode, UnfoldConfig, UnfoldConfigError
from envace_jax.rehearsal.trajectory import Termination, Trajectory, common_prefix_length
from envace_jax.rehearsal.users import ExternalUser, UserSimulator, UserSimulatorError
from envace_jax.sampling.sampler import SamplingParams, next_pow2

__all__ = ["UnfoldConfig", "UnfoldConfigError", "UnfoldOutput", "unfold"]


SHARED_OPENING_MIN = 64
"""The shortest common start of a role's openings across tasks (tokens) that `_Unfolder` prefills once per step."""


@dataclasses.dataclass
class UnfoldOutput:
  """What `unfold` returns.

  Attributes:
    trajectories: B*G trajectories, task-major (index b*G + g), each with its training rows (the views the policy
      sampled: ACT, REHEARSE in rehearse mode, USER when the policy plays the user).
    stats: numbers for metrics: ``steps`` (rounds of the loop: a lockstep step, or one decode call of the stream),
      ``policy_calls``, ``reference_calls``, ``external_requests``, ``prefill_tokens_shared`` (the openings: each
      role's part common to all tasks once, each task's rest once, shared by its G trajectories),
      ``prefill_tokens_reused`` (opening tokens another task's row holds instead), ``prefill_tokens``
      (continuations), ``kv_slots`` (key/value slots the caches allocate, per layer: `KVCache.stored_slots`, or a
      paged cache's pool and levels), ``kv_slots_held`` (per cache, the most that held tokens or reserved room at
      once, summed over the caches: a paged cache's peak pages and its levels; ``kv_slots`` for a dense one),
      ``kv_slots_dense`` (what one row per view at its largest capacity would), ``kv_pool_growths`` (times a page
      pool grew), ``decode_row_steps`` (rows computed x iterations, summed over the decode loops,
      `sampler.Stream.row_steps`: generated tokens over it is the slot utilisation),
      ``generated_tokens_{act,rehearse,user}``, ``time_{setup,policy,reference,external,host,total}_s``,
      ``terminated_<reason>``.
    views: per trajectory, its token views by role (`views.View`: the messages each role saw, and its tokens
      including the not-yet-cached tail), for inspection and tests.
    caches: with ``return_caches``: {"policy": KVCache, "reference": KVCache} (rows as in the module docstring).
    policy_roles: the views held by the policy cache, in slot order.
  """

  trajectories: list[Trajectory]
  stats: dict[str, float]
  views: list[dict[Role, views.View]] = dataclasses.field(default_factory=list)
  caches: dict[str, Any] | None = None
  policy_roles: tuple[Role, ...] = ()


@dataclasses.dataclass
class _Job:
  """One pending generation: the trajectory, the role, its prompt (ids, roles) and its new-token budget."""

  episode: Episode
  role: Role
  ids: list[int]
  roles: list[int]
  max_new: int


class _Unfolder:
  """The rollout loop's state: samplers, caches, trajectories in flight, statistics."""

  def __init__(
    self, tasks, policy, tokenizer, config, reference, envs, user, histories=None, keep_pages=False, first_trajectory=0
  ):
    self.tasks, self.policy, self.tokenizer, self.cfg = list(tasks), policy, tokenizer, config
    self.histories = [tuple(h) for h in histories] if histories is not None else [()] * len(self.tasks)
    self.reference, self.envs, self.user = reference, envs, user
    self.format = views.ChatFormat.of(tokenizer)
    self.eos = tuple(tokenizer.eos_ids)
    self.n = len(self.tasks) * config.group_size
    self.first = first_trajectory  # trajectory n's index in the whole batch: first + n (its generations' keys)
    simulated = any(not t.user_turns for t in self.tasks)
    roles = [Role.ACT] + ([Role.REHEARSE] if config.env_mode == "rehearse" else [])
    self.user_on = {"policy": "policy", "reference": "reference"}.get(config.user_mode) if simulated else None
    if self.user_on == "policy":
      roles.append(Role.USER)
    self.policy_roles = tuple(roles)
    self.stops = tuple(sorted({s for r in self.policy_roles for s in config.stop_strings(r)}))
    self.caches: dict[str, Any] = {}
    # Paged own slots (config.kv_page_size): per cache name, its pool and the most pages it may grow to. Pool row i
    # is cache row i. With keep_pages, ended trajectories keep theirs (for return_caches).
    self.pages: dict[str, tuple[paged.PagePool, int]] = {}
    self.keep_pages, self.released, self.peak = keep_pages, set(), collections.Counter()  # peak: pages held at once
    self.stats: collections.Counter = collections.Counter()
    self.gate = None  # the required-item gate each episode calls before a later logged user turn (`unfold`)

  # ------------------------------------------------------------------------------------------------ setup

  def setup(self) -> list[Episode]:
    """Renders each task's opening once, prefills it once per task, forks the caches G ways."""
    g = self.cfg.group_size
    user_view = self.user_on is not None
    openings = [
      Episode.opening(self.cfg, task, b, self.tokenizer, self.format, user_view, self.histories[b])
      for b, task in enumerate(self.tasks)
    ]
    if self.policy_roles:
      self.caches["policy"] = self._prefill_openings(self.policy, openings, self.policy_roles, "policy")
    if self.user_on == "reference":
      self.caches["reference"] = self._prefill_openings(self.reference, openings, (Role.USER,), "reference")
    for name, cache in self.caches.items():
      roles = self.policy_roles if name == "policy" else (Role.USER,)
      self.stats["kv_slots_dense"] += int(cache.lengths.shape[0]) * max(self.cfg.capacity(r) for r in roles)
    episodes = [o.copy(b * g + s, s) for b, o in enumerate(openings) for s in range(g)]
    for ep in episodes:
      ep.gate = self.gate
    for b, o in enumerate(openings):
      for role, view in o.views.items():
        if view.cached == 0 and o.live:
          logging.warning(
            "task %s: the %s view's opening is %d tokens, over %s_capacity=%d; its trajectories end with "
            "context_exhausted",
            self.tasks[b].id, ROLE_NAMES[role], len(view), ROLE_NAMES[role], self.cfg.capacity(role),
          )  # fmt: skip
    for ep in episodes:
      for role, view in ep.views.items():
        if view.cached == 0 and ep.live:  # the opening did not fit: never prefilled
          ep.end(Termination.CONTEXT_EXHAUSTED, view=ROLE_NAMES[role], detail="the opening does not fit the view")
      if self.cfg.env_mode == "real" and ep.traj.termination is None:
        ep.env = self.envs[ep.index]
        ep.env.reset(ep.traj.task)
    return episodes

  def _prefill_openings(self, sampler, openings: list[Episode], roles: Sequence[Role], name: str):
    """Prefills every task's view openings (all but their last token) once and forks the cache G ways.

    Three levels, each the ``prefix`` of the next (`Sampler.fork`: stored once, attended once per step by the rows
    that continue it): a role's part common to all tasks' openings (when ``SHARED_OPENING_MIN`` tokens or more:
    ACT's policy and tool schemas, REHEARSE's instructions and schemas), prefilled once for all tasks; each task's
    rest, once for its G trajectories; each trajectory's own slots, as many as its role's capacity leaves after the
    opening (the most over the views), or with ``kv_page_size`` pages of a pool (``name``'s in ``self.pages``),
    none held yet, that a row gets as it needs them. When the roles' rows do not split over a mesh's batch shards,
    the common part is instead copied into each task's row (``copy_rows``). With one sampler per role (a tree per
    role, `policy.Policy`) each sampler prefills its own roles' rows.
    """
    b = len(openings)
    prompts, prompt_roles = [], []
    for role in roles:
      for o in openings:
        view = o.views.get(role)
        fits = view is not None and len(view) + 1 <= self.cfg.capacity(role)
        prompts.append(list(view.tokens[:-1]) if fits else [])
        prompt_roles.append(list(view.roles[:-1]) if fits else [])
    samplers = [sampler_for(sampler, roles[row // b]) for row in range(len(prompts))]
    first = samplers[0]
    nest = len(roles) % first.batch_multiple == 0  # one row per role in the common parts' cache
    views_rows = len(prompts)
    pad = -views_rows % first.batch_multiple  # on a mesh the rows must split over its batch shards: empty rows
    prompts, prompt_roles = prompts + [[]] * pad, prompt_roles + [[]] * pad
    shared = np.zeros(len(prompts), np.int64)  # tokens of each row's opening prefilled once for all its tasks
    lead: dict[int, int] = {}  # role -> the row (its first task's) whose opening prefix is prefilled for all
    for r in range(len(roles)):
      rows = [row for row in range(r * b, (r + 1) * b) if prompts[row]]
      root = common_prefix_length([prompts[row] for row in rows], [prompt_roles[row] for row in rows])
      if len(rows) > 1 and root >= SHARED_OPENING_MIN:
        shared[rows], lead[r] = root, rows[0]
    rest = [p[n:] for p, n in zip(prompts, shared, strict=True)]
    rest_roles = [p[n:] for p, n in zip(prompt_roles, shared, strict=True)]
    full = max(self.cfg.capacity(r) for r in roles)
    slots = lambda n: min(next_pow2(n, 1), full)  # noqa: E731  (few compiled shapes; a prompt fits its capacity)
    longest = slots(max(map(len, prompts)))
    if lead:  # the common parts in a cache of their own
      heads = [lead.get(r) for r in range(len(roles))] if nest else list(lead.values())
      m = len(heads) + (-len(heads) % first.batch_multiple)
      small = first.init_cache(batch=m, capacity=slots(int(shared.max())) if nest else longest)
      parts = [[xs[h][: shared[h]] if h is not None else [] for h in heads] for xs in (prompts, prompt_roles)]
      parts = [p + [[]] * (m - len(heads)) for p in parts]
      owners = [samplers[r * b] for r in range(len(roles))] if nest else [samplers[h] for h in heads]
      small, _ = self._prefill_rows(small, owners, *parts)
      if nest:
        cache = first.fork(small, b, capacity=slots(max(map(len, rest))))
      else:
        slot = {r: i for i, r in enumerate(lead)}  # role -> its row in the small cache
        cache = first.copy_rows(small, [slot[row // b] if shared[row] else m for row in range(len(prompts))])
      self.stats["prefill_tokens_reused"] += int(shared.sum() - shared[list(lead.values())].sum())
    else:
      cache = first.init_cache(batch=len(prompts), capacity=longest)
    cache, fitted = self._prefill_rows(cache, samplers, rest, rest_roles)
    for row in range(len(samplers)):
      if prompts[row] and (fitted[row] or not rest[row]):
        openings[row % b].views[roles[row // b]].cached = len(prompts[row])
    # Each rollout's own slots: what the roomiest view has left after its opening, rounded up to an eighth of the
    # largest capacity so that the programs compile for at most 8 sizes.
    own = max(self.cfg.capacity(roles[row // b]) - len(prompts[row]) for row in range(views_rows))
    eighth = -(-full // 8)
    own = min(full, -(-max(own, 1) // eighth) * eighth)
    z = self.cfg.kv_page_size
    if z:
      # Pages: the table spans the largest capacity and the pool's sizes (rollout.kv_pages, `_reserve`) are run
      # constants, not this batch's openings, so every rollout with as many rows compiles the same programs (a row
      # holds only its pages; `_schedule` keeps a view within its capacity). On a mesh, one shard of the pool per
      # batch shard (`Sampler.fork`): its sizes are multiples of the shards.
      rows, shards = len(prompts) * self.cfg.group_size, first.batch_multiple
      most = rows * -(-full // z)
      size = min(self.cfg.kv_pages or -(-most // 4), most)
      pool = paged.PagePool(size + (-size % shards), z, shards=shards, rows=rows)
      forked = first.fork(cache, self.cfg.group_size, capacity=full, pages=pool)
      if isinstance(forked, paged.PagedKVCache):  # a sampler without paged caches (a test's stand-in) ignores pool
        self.pages[name] = (pool, most)
      return forked
    return first.fork(cache, self.cfg.group_size, capacity=own)

  def _prefill_rows(self, cache, samplers: Sequence[Any], prompts, prompt_roles) -> tuple[Any, np.ndarray]:
    """``prefill`` of each row's prompt by that row's sampler (``samplers[row]``); rows past ``samplers`` (padding)
    are left empty."""
    fitted = np.zeros(len(prompts), bool)
    by_sampler: dict[int, tuple[Any, set[int]]] = {}
    for row, s in enumerate(samplers):
      by_sampler.setdefault(id(s), (s, set()))[1].add(row)
    for s, mine in by_sampler.values():
      own = lambda xs, mine=mine: [x if i in mine else [] for i, x in enumerate(xs)]  # noqa: E731
      if not any(own(prompts)):
        continue
      cache, _, ok, count = s.prefill(cache, own(prompts), own(prompt_roles))
      self.stats["prefill_tokens_shared"] += count
      fitted |= np.asarray(ok, bool)
    return cache, fitted

  # ------------------------------------------------------------------------------------------------ the loop

  def _schedule(self, episodes: list[Episode]) -> tuple[list[_Job], list[_Job], list[Episode]]:
    """(policy jobs, reference jobs, trajectories waiting for the external user) of this step."""
    policy, reference, external = [], [], []
    for ep in episodes:
      role = ep.need
      if ep.traj.termination is not None:
        continue
      if role == Role.ACT and ep.views[Role.ACT].generations >= self.cfg.max_turns:
        ep.end(Termination.MAX_TURNS)
        continue
      if role == Role.USER and ep.user_chat is not None:
        external.append(ep)
        continue
      view = ep.views[role]
      ids, roles = view.prompt()
      room = self.cfg.capacity(role) - view.cached - len(ids)
      if room < 1:
        ep.end(Termination.CONTEXT_EXHAUSTED, view=ROLE_NAMES[role], detail="the next prompt does not fit")
        continue
      job = _Job(ep, role, ids, roles, min(self.cfg.max_new_tokens(role), room))
      (reference if role == Role.USER and self.user_on == "reference" else policy).append(job)
    return policy, reference, external

  def _generate(self, name: str, sampler, roles: Sequence[Role], jobs: list[_Job], key) -> list[tuple]:
    """Runs ``jobs`` as rows of the ``name`` cache to their end (lockstep): one ``generate`` per distinct (sampler,
    sampling params)."""
    by_params: dict[tuple[int, SamplingParams], list[_Job]] = {}
    samplers = {}
    for job in jobs:
      s = sampler_for(sampler, job.role)
      samplers[id(s)] = s
      by_params.setdefault((id(s), self.cfg.sampling(job.role)), []).append(job)
    rows = int(self.caches[name].lengths.shape[0])  # len(roles) * n, and the padding rows at the end on a mesh
    results = []
    for (sampler_id, sampling), group in by_params.items():
      sampler = samplers[sampler_id]
      placed = [(job, self._row(roles, job)) for job in group]
      self.caches[name] = self._reserve(name, placed, self._rewind(name, placed, self.caches[name]))
      prompts, prompt_roles, gen_roles, max_new, active = self._rows(roles, rows, placed)
      start = time.perf_counter()
      out, cache = sampler.generate(
        self.caches[name],
        prompts,
        prompt_roles,
        role=gen_roles,
        key=_job_keys(key, rows, placed, self.first),
        max_new_tokens=max_new,
        sampling=sampling,
        stop_strings=self.stops if name == "policy" else self.cfg.stop_strings(Role.USER),
        active=active,
      )
      self.caches[name] = self._settle(name, [row for _, row in placed], cache)
      self.stats[f"time_{name}_s"] += time.perf_counter() - start
      self.stats[f"{name}_calls"] += 1
      self.stats["prefill_tokens"] += out.prefill_tokens
      self.stats["decode_row_steps"] += out.decode_row_steps
      for job, row in placed:
        n = int(out.lengths[row])
        results.append((job, out.tokens[row, :n].tolist(), out.logprobs[row, :n].tolist(), out.finish_reasons[row]))
    return results

  # ------------------------------------------------------------------------------------------------ pages

  def _rewind(self, name: str, placed: list[tuple[_Job, int]], cache):
    """The cache with the row of each placed job whose view was replaced by a fresh copy of its opening
    (``Episode.rewind``: a per-call REHEARSE view) cut back to that many tokens, which its shared opening levels hold:
    its own slots emptied (a paged row's pages given back). The row's earlier generations stay in its finished
    view's training row; the next prompt is written over them."""
    cuts = {row: job.episode.rewind.pop(job.role) for job, row in placed if job.role in job.episode.rewind}
    if not cuts:
      return cache
    if not hasattr(cache, "offsets"):  # a test's stand-in cache (token lists)
      return cache.rewound(cuts)
    offsets = cache.host_offsets()
    lengths = np.array(jax.device_get(cache.lengths))
    for row, keep in cuts.items():
      if keep < offsets[row]:
        raise RuntimeError(f"rollout bug: row {row} cannot keep {keep} tokens, its opening levels hold {offsets[row]}")
      lengths[row] = keep - offsets[row]
    cache = cache.replace(lengths=jax.device_put(lengths.astype(np.int32), cache.lengths.sharding))
    if name in self.pages:
      pool, _ = self.pages[name]
      copies = [c for row in cuts if row in pool.pages for c in pool.shrink(row, int(lengths[row]))]
      if copies:
        cache = cache.replace(pools=tuple(paged.copy_pages(p, copies) for p in cache.pools))
      cache = self._table(name, cache)
    return cache

  def _reserve(self, name: str, placed: list[tuple[_Job, int]], cache):
    """The cache with each placed (job, row) given the pages for its prompt and new-token budget; when the pool has
    too few free, it first doubles (`paged.PagedKVCache.extended`) until they fit, up to its most, every row at the
    largest capacity (which holds any jobs). A dense cache is returned as it is."""
    if name not in self.pages or not placed:
      return cache
    pool, most = self.pages[name]
    needs = [(row, pool.lengths.get(row, 0) + len(job.ids) + job.max_new) for job, row in placed]
    short = pool.pages_needed(needs)
    if short > 0:
      size = pool.num_pages
      while size - pool.num_pages < short and size < most:
        size = min(2 * size, most)
      if size - pool.num_pages < short:
        raise RuntimeError(f"rollout bug: a pool of {size} pages, every row's most, has too few free.")
      logging.info("the %s cache's KV page pool grows from %d to %d pages", name, pool.num_pages, size)
      pool.extend(size)
      cache = cache.extended(size)
      self.stats["kv_pool_growths"] += 1
    for row, need in needs:
      pool.grow(row, need)
    self.peak[name] = max(self.peak[name], pool.allocated())
    return self._table(name, cache)

  def _settle(self, name: str, rows: Sequence[int], cache):
    """Gives back the pages past the filled slots of ``rows`` (their generations ended) in a paged cache."""
    if name not in self.pages or not rows:
      return cache
    pool, _ = self.pages[name]
    lengths = np.asarray(jax.device_get(cache.lengths))
    copies = [c for row in rows for c in pool.shrink(row, int(lengths[row]))]  # none: rows never share pages here
    if copies:
      cache = cache.replace(pools=tuple(paged.copy_pages(p, copies) for p in cache.pools))
    return self._table(name, cache)

  def _table(self, name: str, cache):
    pool, _ = self.pages[name]
    table = pool.table(range(int(cache.lengths.shape[0])), int(cache.table.shape[1]))
    return cache.replace(table=jax.device_put(table, cache.table.sharding))  # split over a mesh like the old one

  def _release(self, episodes: list[Episode], stream) -> None:
    """Gives back every page of the trajectories that ended (their views' rows in every paged cache)."""
    ended = [ep.index for ep in episodes if ep.traj.termination is not None and ep.index not in self.released]
    if self.keep_pages or not ended or not self.pages:
      return
    self.released.update(ended)
    for name, (pool, _) in self.pages.items():
      slots = len(self.policy_roles) if name == "policy" else 1
      for row in (slot * self.n + i for slot in range(slots) for i in ended):
        if row in pool.pages:
          pool.release(row)
      if name == "policy" and stream is not None:
        stream.set_cache(self._table(name, stream.cache))
      else:
        self.caches[name] = self._table(name, self.caches[name])

  def _row(self, roles: Sequence[Role], job: _Job) -> int:
    return roles.index(job.role) * self.n + job.episode.index

  def _rows(self, roles: Sequence[Role], rows: int, placed: list[tuple[_Job, int]]):
    """Per cache row: (prompts, prompt roles, generated role id, new-token budget, active) of the ``placed`` jobs."""
    prompts, prompt_roles = [[] for _ in range(rows)], [[] for _ in range(rows)]
    gen_roles, max_new, active = np.full(rows, int(roles[0]), np.int32), np.ones(rows, np.int32), np.zeros(rows, bool)
    for job, row in placed:
      prompts[row], prompt_roles[row], gen_roles[row], max_new[row] = job.ids, job.roles, int(job.role), job.max_new
      active[row] = True
    return prompts, prompt_roles, gen_roles, max_new, active

  def _open_stream(self):
    """The policy's `Stream` when continuous batching applies (one sampler and one sampling setting for every policy
    role), else None (lockstep)."""
    if not (self.cfg.continuous_batching and self.policy_roles):
      return None
    samplers = {id(sampler_for(self.policy, r)) for r in self.policy_roles}
    settings = {self.cfg.sampling(r) for r in self.policy_roles}
    if len(samplers) > 1 or len(settings) > 1:
      return None
    num_new = max(self.cfg.max_new_tokens(r) for r in self.policy_roles)
    sampler = sampler_for(self.policy, self.policy_roles[0])
    return sampler.stream(self.caches.pop("policy"), num_new=num_new, sampling=settings.pop(), stop_strings=self.stops)

  def _admit(self, stream, jobs: list[_Job], key, running: dict[int, _Job]) -> None:
    """Starts ``jobs`` in the stream's rows (their views' rows are free: a trajectory has one generation at a time)."""
    if not jobs:
      return
    rows = int(stream.cache.lengths.shape[0])
    placed = [(job, self._row(self.policy_roles, job)) for job in jobs]
    stream.set_cache(self._reserve("policy", placed, self._rewind("policy", placed, stream.cache)))
    prompts, prompt_roles, gen_roles, max_new, active = self._rows(self.policy_roles, rows, placed)
    start = time.perf_counter()
    keys = _job_keys(key, rows, placed, self.first)
    stream.admit(prompts, prompt_roles, role=gen_roles, keys=keys, max_new_tokens=max_new, active=active)
    self.stats["time_policy_s"] += time.perf_counter() - start
    running.update((row, job) for job, row in placed)

  def _advance(self, stream, running: dict[int, _Job]) -> list[tuple]:
    """Decodes the stream until one of its generations ends; those finished (their rows free again)."""
    start, before = time.perf_counter(), stream.row_steps
    finished = stream.advance(until=1)
    stream.set_cache(self._settle("policy", [f.row for f in finished], stream.cache))
    self.stats["time_policy_s"] += time.perf_counter() - start
    self.stats["policy_calls"] += 1
    self.stats["decode_row_steps"] += stream.row_steps - before
    return [(running.pop(f.row), f.tokens, f.logprobs, f.finish) for f in finished]

  def run(self, key) -> list[Episode]:
    start = time.perf_counter()
    episodes = self.setup()
    self.stats["time_setup_s"] += time.perf_counter() - start
    workers = self.cfg.external_user.max_concurrency if self.cfg.external_user else 8
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="user") if self.user else None
    stream = self._open_stream()
    running: dict[int, _Job] = {}  # stream row -> its generation
    queued: list[_Job] = []  # the reference user's generations not run yet
    waiting: dict[int, tuple[Episode, concurrent.futures.Future]] = {}  # trajectory -> the external user's reply
    try:
      rounds = 0
      while True:
        host = time.perf_counter()
        busy = {job.episode.index for job in (*running.values(), *queued)} | set(waiting)
        policy_jobs, reference_jobs, external = self._schedule([ep for ep in episodes if ep.index not in busy])
        # External users are asked first, so their requests overlap the device work.
        for ep in external:
          waiting[ep.index] = (ep, pool.submit(self.user.reply, _chat(ep.user_chat)))
        self.stats["external_requests"] += len(external)
        self.stats["time_host_s"] += time.perf_counter() - host
        queued += reference_jobs
        if not (policy_jobs or queued or running or waiting):
          break
        results = []
        if stream is not None:
          self._admit(stream, policy_jobs, key, running)
        elif policy_jobs:
          results += self._generate("policy", self.policy, self.policy_roles, policy_jobs, key)
        # The reference user's generations (other weights, another cache) run together, to their end: at once in
        # lockstep, else when the policy has no generation left in flight. A decode step costs about the same for
        # one row as for all, so the user's turns are batched rather than run as they come.
        if queued and (stream is None or not running):
          results += self._generate("reference", self.reference, (Role.USER,), queued, key)
          queued = []
        if running:
          results += self._advance(stream, running)
        # Lockstep waits for every reply; continuous batching takes the ones in, and waits only when idle.
        replies = self._replies(waiting, wait_all=stream is None, wait_one=not (results or running))
        host = time.perf_counter()
        for job, ids, logprobs, finish in results:
          job.episode.record(job.role, ids, logprobs, finish, self.eos)
          self.stats[f"generated_tokens_{ROLE_NAMES[job.role]}"] += len(ids)
        for ep, text, error in replies:
          if error is not None:
            ep.traj.count("user_error")
            ep.end(Termination.USER_ERROR, detail=str(error))
          else:
            ep.traj.count("generations_user")
            ep.after_user(text)
        self._release(episodes, stream)
        self.stats["time_host_s"] += time.perf_counter() - host
        rounds += 1
      self._release(episodes, stream)  # those that ended when scheduled (max_turns, a prompt that does not fit)
    finally:
      if stream is not None:
        self.caches["policy"] = stream.cache
        self.stats["prefill_tokens"] += stream.prefill_tokens
      if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    self.stats["steps"] = rounds
    for name, cache in self.caches.items():  # per layer
      if name in self.pages:  # the levels and the pool's pages; the levels and the most pages held at once
        unheld = self.pages[name][0].num_pages - self.peak[name]
        self.stats["kv_slots"] += cache.allocated_slots()
        self.stats["kv_slots_held"] += cache.allocated_slots() - unheld * cache.page_size
      else:
        self.stats["kv_slots"] += cache.stored_slots()
        self.stats["kv_slots_held"] += cache.stored_slots()
    self._check_caches(episodes)
    return episodes

  def _replies(self, waiting: dict, wait_all: bool, wait_one: bool) -> list[tuple]:
    """(episode, reply text or None, UserSimulatorError or None) of the external users' replies collected: all of
    them (``wait_all``), or those already in, waiting for the first when ``wait_one`` and none is."""
    if not waiting:
      return []
    start = time.perf_counter()
    futures = [f for _, f in waiting.values()]
    if wait_all:
      concurrent.futures.wait(futures)
    elif wait_one:
      concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
    replies = []
    for index in [i for i, (_, f) in waiting.items() if f.done()]:
      ep, future = waiting.pop(index)
      try:
        replies.append((ep, future.result(), None))
      except UserSimulatorError as e:
        replies.append((ep, None, e))
    self.stats["time_external_s"] += time.perf_counter() - start
    return replies

  def _check_caches(self, episodes: list[Episode]) -> None:
    """Every view's bookkeeping must match its cache row's length (a rollout bug otherwise)."""
    for name, cache in self.caches.items():
      roles = self.policy_roles if name == "policy" else (Role.USER,)
      lengths = cache.host_filled()
      for ep in episodes:
        for slot, role in enumerate(roles):
          view = ep.views.get(role)
          if view is not None and view.cached == 0:  # never prefilled (its opening did not fit); it may continue a
            continue  # shared level all the same
          if role in ep.rewind:  # a fresh per-call view whose prompt never went out (the trajectory ended first)
            continue
          held = view.cached if view is not None else 0
          if int(lengths[slot * self.n + ep.index]) != held:
            raise RuntimeError(
              f"rollout bookkeeping bug: trajectory {ep.index} {ROLE_NAMES[role]} view holds {held} tokens, its "
              f"cache row {int(lengths[slot * self.n + ep.index])}"
            )


@jax.jit
def _fold_keys(key, trajectory, role, generation):
  fold = lambda k, *ids: functools.reduce(jax.random.fold_in, ids, k)  # noqa: E731
  return jax.vmap(fold, (None, 0, 0, 0))(key, trajectory, role, generation)


def _job_keys(key, rows: int, placed: Sequence[tuple[_Job, int]], first: int = 0) -> jax.Array:
  """key[rows]: the key of each placed job's generation in its row, fold_in(key, trajectory, role, the view's
  generation index), the trajectory counted in the whole batch (``first`` + its index in this call): a generation's
  sample depends on what it is, not on the step, the batch or the process it runs in."""
  ids = np.zeros((3, rows), np.uint32)
  for job, row in placed:
    ids[:, row] = first + job.episode.index, int(job.role), job.episode.generation_index(job.role)
  return _fold_keys(key, *ids)


def sampler_for(sampler, role: Role):
  """The sampler generating ``role``: ``sampler`` itself, or its entry for ``role`` when it is a mapping Role ->
  sampler (`policy.Policy.by_role` of a policy with a tree per role).

  Raises:
    UnfoldConfigError: the mapping has no sampler for ``role``.
  """
  if isinstance(sampler, Mapping):
    if role not in sampler:
      raise UnfoldConfigError(f"no sampler for role {ROLE_NAMES[role]}: the per-role samplers cover {list(sampler)}")
    return sampler[role]
  return sampler


def generated_tokens(stats: Mapping[str, float]) -> float:
  """Tokens an ``unfold`` call sampled, all roles together (the sum of its ``generated_tokens_<role>`` stats)."""
  return sum(stats.get(f"generated_tokens_{name}", 0) for name in ROLE_NAMES.values())


def _chat(messages: Sequence[Message]) -> list[dict[str, str]]:
  return [{"role": m.role, "content": m.content} for m in messages]


def unfold(
  tasks: Sequence[Task],
  policy_sampler,
  tokenizer: Tokenizer,
  config: UnfoldConfig,
  key: jax.Array,
  *,
  reference_sampler=None,
  envs: Sequence[ToolEnv] | None = None,
  user_simulator: UserSimulator | None = None,
  histories: Sequence[Sequence[ChatMessage]] | None = None,
  return_caches: bool = False,
  first_trajectory: int = 0,
  turn_gate=None,
) -> UnfoldOutput:
  """Self-unfolds ``config.group_size`` trajectories of each task (see the module docstring).

  Args:
    tasks: the B tasks.
    policy_sampler: a `Sampler` with the policy's parameters (ACT, REHEARSE and a policy-played USER), or a
      mapping role -> `Sampler` when the roles have separate parameters (`policy.Policy.by_role`): all of them share
      one cache (same model shape), each generating its own roles' rows.
    tokenizer: the policy's tokenizer (chat template, eos ids); its vocabulary must be the model's.
    key: a ``jax.random.key`` (each generation's: `_job_keys`).
    reference_sampler: a `Sampler` with the frozen reference parameters; needed for ``user_mode="reference"`` when a
      task has no logged user turns.
    envs: B*G `ToolEnv`s (task-major), needed for ``env_mode="real"``; each is ``reset`` with its task. Ignored in
      rehearse mode: nothing real is called.
    user_simulator: for ``user_mode="external"``: the user (default ``ExternalUser(config.external_user)``).
    histories: per task, messages that already happened (after the benchmark's initial conversation), shared by its
      G trajectories; e.g. the greeting and the real user's first message before a committed execution
      (`rehearsal.private`). Tasks with logged user turns take none.
    return_caches: keep the final KV caches in the output (tests, inspection).
    first_trajectory: where these B*G trajectories start in a batch split across processes (a multiple of G;
      `distributed.share`): trajectory n is counted ``first_trajectory + n`` in its generations' keys and its rows'
      ``trajectory``, and its ``group`` is ``first_trajectory // G + b``, so the rows equal the whole batch's.
    turn_gate: ``(trajectory, finished turn) -> Termination | None``, called before each later logged user turn is
      replayed (`scoring.turn_gate`: the required-item gate); None: every logged turn is replayed.

  Returns:
    `UnfoldOutput`: B*G trajectories (task-major) with termination, messages, counts, events and one `TrainingRow`
    per view the policy generated in (none for a view without generations), and stats.

  Raises:
    UnfoldConfigError: no tasks, a missing reference sampler, environments or external user, a task with neither
      user turns nor a user scenario, ``histories`` not one per task (or given to a task with logged user turns),
      ``first_trajectory`` not a multiple of G.
    users.UserEndpointError: the external user's endpoint is misconfigured.
    tokenizer.ChatTemplateError: the chat template cannot keep views append-only.
  """
  if not tasks:
    raise UnfoldConfigError("unfold needs at least one task")
  if not isinstance(config, UnfoldConfig):
    raise UnfoldConfigError(f"config must be an UnfoldConfig, got {type(config).__name__}")
  n = len(tasks) * config.group_size
  if first_trajectory % config.group_size or first_trajectory < 0:
    raise UnfoldConfigError(
      f"first_trajectory={first_trajectory} must be a non-negative multiple of group_size={config.group_size}"
    )
  if histories is not None and len(histories) != len(tasks):
    raise UnfoldConfigError(f"histories must have one entry per task: {len(tasks)}, got {len(histories)}")
  simulated = any(not t.user_turns for t in tasks)
  if simulated and config.user_mode == "reference" and reference_sampler is None:
    raise UnfoldConfigError(
      "user_mode='reference' needs reference_sampler (a Sampler with the frozen initial parameters); or set "
      "user_mode='policy' / 'external'"
    )
  if config.env_mode == "real" and (envs is None or len(envs) != n):
    got = "none" if envs is None else len(envs)
    raise UnfoldConfigError(f"env_mode='real' needs one ToolEnv per trajectory: {n} (B*G), got {got}")
  owned = None
  if simulated and config.user_mode == "external" and user_simulator is None:
    if config.external_user is None:
      raise UnfoldConfigError(
        "user_mode='external' needs UnfoldConfig.external_user (an ExternalUserConfig) or a user_simulator"
      )
    user_simulator = owned = ExternalUser(config.external_user)
  user = user_simulator if simulated and config.user_mode == "external" else None
  start = time.perf_counter()
  runner = _Unfolder(
    tasks,
    policy_sampler,
    tokenizer,
    config,
    reference_sampler,
    envs,
    user,
    histories,
    keep_pages=return_caches,
    first_trajectory=first_trajectory,
  )
  runner.gate = turn_gate
  try:
    episodes = runner.run(key)
  finally:
    if owned is not None:
      owned.close()
  trajectories = []
  for ep in episodes:
    traj = ep.traj
    traj.counts["turns"] = ep.views[Role.ACT].generations
    traj.counts["unencodable_chars"] = sum(view.unencodable for view in ep.views.values())
    sampled = [role for role in runner.policy_roles if role in ep.views and ep.views[role].generations]
    traj.rows = {int(role): ep.views[role].training_row(first_trajectory + ep.index) for role in sampled}
    traj.extra_rows = [view.training_row(first_trajectory + ep.index) for view in ep.finished]
    traj.group += first_trajectory // config.group_size
    trajectories.append(traj)
    runner.stats[f"terminated_{traj.termination.value}"] += 1
  runner.stats["time_total_s"] = time.perf_counter() - start
  stats = {k: float(v) for k, v in runner.stats.items()}
  caches = runner.caches if return_caches else None
  return UnfoldOutput(trajectories, stats, [ep.views for ep in episodes], caches, runner.policy_roles)
