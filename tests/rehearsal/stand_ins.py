"""Stand-ins for the policy sampler, shared by the rollout and private-rehearsal tests.

* `ScriptedSampler` has no model: its "cache" holds token lists, generations are scripted texts encoded canonically.
* `ForcingSampler` wraps the real `Sampler`: scripted ACT rows are written into the real KV cache with ``prefill``.
* `ContextSampler` has no model either; each generation is ``script(role, context_text)`` of the row's whole
  context, so a test can answer by what the prompt says (an assessment prompt, a memory prompt, a rehearsal).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import IM_END, Tokenizer
from envace_jax.sampling.sampler import Finished, SampleOutput, Sampler
from envace_jax.sampling.stopping import FinishReason


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
  """A scripted generation: the text's canonical ids, plus the eos unless it ends with a stop string or the eos."""
  ids = tokenizer.encode(text)
  if not text.endswith((tool_format.TOOL_CALL_CLOSE, tool_format.TOOL_RESPONSE_CLOSE, IM_END)):
    ids.append(tokenizer.eos_ids[0])
  return ids


def _finish(tokenizer, ids, max_new, stops) -> tuple[list[int], FinishReason]:
  """Cuts scripted ids where a sampler would stop: at an eos, at a completed stop string, or at max_new."""
  for i in range(len(ids)):
    if i == max_new:
      return ids[:i], FinishReason.LENGTH
    if ids[i] in tokenizer.eos_ids or any(tokenizer.decode(ids[: i + 1]).endswith(s) for s in stops):
      return ids[: i + 1], FinishReason.STOP
  return ids, FinishReason.LENGTH


class _Recorder:
  """Records every generate call: {row: (role, prompt length, ids, logprobs)} plus the prefills."""

  batch_multiple = 1  # no mesh

  def stream(self, cache, *, num_new, sampling, stop_strings):
    return _GenerateStream(self, cache, sampling, stop_strings)

  def __init__(self, tokenizer, script, n_rows_hint=None):
    self.tokenizer, self.script = tokenizer, script
    self.calls, self.prefills = [], []
    self.generation_index = collections.Counter()

  def scripted(self, role, row, n):
    """The script's ids for this row's next generation of ``role`` (trajectory index = row % n)."""
    k = self.generation_index[(row, role)]
    self.generation_index[(row, role)] += 1
    text = self.script(Role(role), row % n, k)
    return None if text is None else _encode(self.tokenizer, text)


class _GenerateStream:
  """`sampler.Stream`'s interface over a stand-in's ``generate``: the rows admitted since the last ``advance`` run
  to their end there as one call, so a scripted sampler sees the calls lockstep would make."""

  def __init__(self, owner, cache, sampling, stop_strings):
    self.owner, self.cache, self.sampling, self.stop_strings = owner, cache, sampling, stop_strings
    self.prefill_tokens = self.row_steps = 0
    self.pending = None

  def set_cache(self, cache):
    self.cache = cache

  def admit(self, prompts, prompt_roles, *, role, keys, max_new_tokens, active=None):
    active = np.asarray([len(p) > 0 for p in prompts]) if active is None else np.asarray(active, bool)
    self.pending = (prompts, prompt_roles, role, keys, max_new_tokens, active)

  def advance(self, until=None):
    if self.pending is None:
      return []
    prompts, prompt_roles, role, keys, max_new, active = self.pending
    self.pending = None
    out, self.cache = self.owner.generate(
      self.cache, prompts, prompt_roles, role=role, key=keys, max_new_tokens=max_new, sampling=self.sampling,
      stop_strings=self.stop_strings, active=active,
    )  # fmt: skip
    self.prefill_tokens += out.prefill_tokens
    return [Finished(int(b), out.row(b), out.logprobs[b, : out.lengths[b]].tolist(), out.finish_reasons[b])
            for b in np.flatnonzero(active)]  # fmt: skip


@dataclasses.dataclass
class FakeCache:
  tokens: list
  roles: list
  capacity: int

  @property
  def lengths(self):
    return np.asarray([len(t) for t in self.tokens], np.int32)

  def filled(self):
    return self.lengths

  def host_filled(self):
    return self.lengths

  def stored_slots(self):
    return len(self.tokens) * self.capacity

  def rewound(self, cuts):
    """Row -> the tokens it keeps (`unfold._Unfolder._rewind`)."""
    for row, keep in cuts.items():
      self.tokens[row], self.roles[row] = self.tokens[row][:keep], self.roles[row][:keep]
    return self


class ScriptedSampler(_Recorder):
  """No model: caches are token lists; every generation comes from ``script(role, trajectory, k) -> text``."""

  def __init__(self, tokenizer, script, n):
    super().__init__(tokenizer, script)
    self.n = n

  def init_cache(self, batch, capacity):
    return FakeCache([[] for _ in range(batch)], [[] for _ in range(batch)], capacity)

  @staticmethod
  def fork(
    cache, g, capacity=None, pages=None
  ):  # copies (no pages: a list per row); a row's room is its history's plus ``capacity`` slots, as `Sampler`'s
    rep = lambda rows: [list(r) for r in rows for _ in range(g)]  # noqa: E731
    return FakeCache(rep(cache.tokens), rep(cache.roles), cache.capacity + (capacity or cache.capacity))

  @staticmethod
  def copy_rows(cache, source):  # a source past the last row: an empty row
    row = lambda rows, i: list(rows[i]) if i < len(rows) else []  # noqa: E731
    return FakeCache([row(cache.tokens, i) for i in source], [row(cache.roles, i) for i in source], cache.capacity)

  def prefill(self, cache, prompts, prompt_roles, active=None):
    self.prefills.append([len(p) for p in prompts])
    fitted = np.zeros(len(prompts), bool)
    count = 0
    for b, (p, r) in enumerate(zip(prompts, prompt_roles, strict=True)):
      if len(p) and len(cache.tokens[b]) + len(p) <= cache.capacity and (active is None or active[b]):
        cache.tokens[b] += list(p)
        cache.roles[b] += list(r)
        fitted[b], count = True, count + len(p)
    return cache, None, fitted, count

  def generate(
    self, cache, prompts, prompt_roles, *, role, key, max_new_tokens, sampling, stop_strings, active, row_ids=None
  ):
    del key, sampling, row_ids
    role, active = np.asarray(role), np.asarray(active)
    max_new = np.broadcast_to(np.asarray(max_new_tokens), active.shape)
    cache, _, fitted, count = self.prefill(cache, prompts, prompt_roles, active)
    outs, call = {}, {}
    for b in np.flatnonzero(active & fitted):
      room = cache.capacity - len(cache.tokens[b])
      ids, finish = _finish(self.tokenizer, self.scripted(role[b], b, self.n), min(int(max_new[b]), room), stop_strings)
      if finish == FinishReason.LENGTH and len(ids) == room < max_new[b]:
        finish = FinishReason.CONTEXT_EXHAUSTED
      logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
      cache.tokens[b] += ids
      cache.roles[b] += [int(role[b])] * len(ids)
      outs[b] = (ids, logprobs, finish)
      call[int(b)] = (Role(int(role[b])), len(prompts[b]), ids, logprobs)
    self.calls.append(call)
    return _output(outs, len(prompts), count), cache


def _output(outs, rows, prefill_tokens) -> SampleOutput:
  width = max([1] + [len(ids) for ids, _, _ in outs.values()])
  tokens, logprobs = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.float32)
  lengths, finish = np.zeros(rows, np.int32), [FinishReason.NONE] * rows
  for b, (ids, lps, reason) in outs.items():
    tokens[b, : len(ids)], logprobs[b, : len(ids)], lengths[b], finish[b] = ids, lps, len(ids), reason
  return SampleOutput(tokens, logprobs, lengths, finish, prefill_tokens)


class ForcingSampler(_Recorder):
  """The real Sampler; ACT rows whose script gives a text are forced: prompt + scripted ids are prefilled into the
  real cache (with the ACT role, logprob 0), exactly where sampled ids would have gone."""

  def __init__(self, sampler: Sampler, tokenizer, script, n):
    super().__init__(tokenizer, script)
    self.sampler, self.n = sampler, n

  @property
  def batch_multiple(self):
    return self.sampler.batch_multiple

  def init_cache(self, batch, capacity):
    return self.sampler.init_cache(batch, capacity)

  def fork(self, cache, g, capacity=None, pages=None):
    return self.sampler.fork(cache, g, capacity, pages)

  def copy_rows(self, cache, source):
    return self.sampler.copy_rows(cache, source)

  def prefill(self, cache, prompts, prompt_roles, active=None):
    self.prefills.append([len(p) for p in prompts])
    return self.sampler.prefill(cache, prompts, prompt_roles, active)

  def generate(self, cache, prompts, prompt_roles, *, role, active, max_new_tokens, stop_strings, **kw):
    role, active = np.asarray(role), np.asarray(active)
    max_new = np.broadcast_to(np.asarray(max_new_tokens), active.shape)
    forced = {}
    for b in np.flatnonzero(active & (role == int(Role.ACT))):
      ids = self.scripted(role[b], b, self.n)
      if ids is not None:
        forced[b] = _finish(self.tokenizer, ids, int(max_new[b]), stop_strings)
    sampled = active.copy()
    sampled[list(forced)] = False
    outs, count = {}, 0
    if sampled.any():
      keep = lambda xs: [x if s else [] for x, s in zip(xs, sampled, strict=True)]
      out, cache = self.sampler.generate(
        cache, keep(prompts), keep(prompt_roles), role=role, active=sampled, max_new_tokens=max_new,
        stop_strings=stop_strings, **kw,
      )  # fmt: skip
      count += out.prefill_tokens
      for b in np.flatnonzero(sampled):
        outs[b] = (out.row(b), out.logprobs[b, : out.lengths[b]].tolist(), out.finish_reasons[b])
    if forced:
      fp = [list(prompts[b]) + forced[b][0] if b in forced else [] for b in range(len(prompts))]
      fr = [list(prompt_roles[b]) + [int(Role.ACT)] * len(forced[b][0]) if b in forced else [] for b in range(len(fp))]
      cache, _, fitted, _ = self.sampler.prefill(cache, fp, fr)
      assert all(fitted[b] for b in forced)
      for b, (ids, finish) in forced.items():
        outs[b] = (ids, [0.0] * len(ids), finish)
        count += len(prompts[b])
    self.calls.append({int(b): (Role(int(role[b])), len(prompts[b]), o[0], o[1]) for b, o in outs.items()})
    return _output(outs, len(prompts), count), cache


class ContextSampler(ScriptedSampler):
  """Like `ScriptedSampler`, but ``script(role, context) -> text | None`` reads the row's whole decoded context (the
  cache row plus this call's prompt); None generates a lone eos. With ``by_row``, ``script(role, context, row)`` also
  gets the cache row (e.g. the G forks of one opening share a context but not a row). Records every
  (role, context, text)."""

  def __init__(self, tokenizer, script, by_row: bool = False):
    super().__init__(tokenizer, None, 1)
    self.context_script = script if by_row else (lambda role, context, row: script(role, context))
    self.seen: list[tuple[Role, str, str]] = []

  def generate(self, cache, prompts, prompt_roles, *, role, key, max_new_tokens, sampling, stop_strings, active, **kw):
    del kw
    role_rows = np.broadcast_to(np.asarray(role), (len(prompts),))
    contexts = [self.tokenizer.decode(cache.tokens[b] + list(prompts[b])) for b in range(len(prompts))]
    pending = {}
    for b in range(len(prompts)):
      if active[b]:
        text = self.context_script(Role(int(role_rows[b])), contexts[b], b)
        self.seen.append((Role(int(role_rows[b])), contexts[b], text))
        pending[b] = text if text is not None else ""
    self.script = lambda r, t, k, pending=pending: pending.get(t)
    self.n = len(prompts)
    self.generation_index.clear()
    return super().generate(
      cache, prompts, prompt_roles, role=role_rows, key=key, max_new_tokens=max_new_tokens, sampling=sampling,
      stop_strings=stop_strings, active=active,
    )  # fmt: skip
