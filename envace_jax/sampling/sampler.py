"""Batched sampling with a KV cache: jitted chunked prefill, a jitted ``while_loop`` decode, multi-turn continuation.

    sampler = Sampler(config, params, eos_ids=tokenizer.eos_ids, token_bytes=tokenizer.token_bytes())
    cache = sampler.init_cache(batch=B, capacity=S)
    out, cache = sampler.generate(cache, prompts, prompt_roles, role=Role.ACT, key=jax.random.key(0),
                                  max_new_tokens=256, stop_strings=("</tool_call>",))
    # next turn: append only the new tokens; turns 1..k-1 are never prefilled again
    out, cache = sampler.generate(cache, next_prompts, next_roles, role=Role.ACT, key=jax.random.key(1), ...)

The cache is the state of each sequence (its own tokens live in slots 0..lengths-1, after its prefix levels'), so a
caller keeps one cache per role view and appends to it. ``fork`` continues each row in G rows that share its storage:
G samples of one prompt prefill and store it once.

Shapes: B sequences, P prompt-chunk bucket, N new-token bucket, V vocab, S cache capacity.

Invariants:
  * Every returned token is in the cache: a sequence stops with ``CONTEXT_EXHAUSTED`` rather than sample a token it
    has no slot for, and a prompt that does not fit is not written at all (no silent truncation).
  * Logprobs are those of the unmodified policy (temperature 1, no top-k/top-p): the numbers the trainer recomputes.
  * Randomness is keyed by (call key, row id, token index), so a sequence's sample does not depend on what else is in
    the batch, and an identical key gives identical output.
  * Compilations are bounded: prompt chunks are bucketed to powers of two up to ``prefill_chunk``, new-token counts
    to powers of two; ``compile_counts`` reports how many traces each jitted function took.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envace_jax.model import transformer
from envace_jax.model.config import ModelConfig
from envace_jax.sampling import sharding, stopping
from envace_jax.sampling.stopping import FinishReason

KVCache = transformer.KVCache


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the next token is drawn. Static: each distinct value compiles the decode loop once.

  Attributes:
    temperature: 0 for greedy (argmax); otherwise logits are divided by it.
    top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0: off).
    top_k: keep the k most likely tokens (0: off).
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ValueError(f"invalid {self}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0.")


GREEDY = SamplingParams(temperature=0.0)


def sample_tokens(logits_bv: jax.Array, keys: jax.Array, params: SamplingParams) -> jax.Array:
  """Draws one token per row.

  Args:
    logits_bv: float32[B, V].
    keys: per-row ``jax.random.key``s, key[B].
    params: see SamplingParams.
  Returns:
    int32[B] token ids.
  """
  if params.temperature == 0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  x_bv = logits_bv / params.temperature
  if params.top_k:
    kth = jax.lax.top_k(x_bv, params.top_k)[0][:, -1:]
    x_bv = jnp.where(x_bv < kth, -jnp.inf, x_bv)
  if params.top_p < 1.0:
    sorted_bv = jnp.sort(x_bv, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_bv, axis=-1)
    # Keep a token if the mass strictly before it is below top_p (so the most likely token is always kept).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < params.top_p
    threshold = jnp.min(jnp.where(keep, sorted_bv, jnp.inf), axis=-1, keepdims=True)
    x_bv = jnp.where(x_bv < threshold, -jnp.inf, x_bv)
  return jax.vmap(jax.random.categorical)(keys, x_bv).astype(jnp.int32)


@struct.dataclass
class _DecodeState:
  """The while_loop carry. Shapes: B rows, N new-token slots, W stop-string bytes."""

  step: jax.Array  # int32[], iterations so far
  logits: jax.Array  # float32[B, V], next-token logits of each row
  cache: KVCache
  tokens: jax.Array  # int32[B, N]
  logprobs: jax.Array  # float32[B, N]
  lengths: jax.Array  # int32[B], tokens generated so far
  done: jax.Array  # bool[B]
  finish: jax.Array  # int32[B], FinishReason
  stop_buffer: jax.Array  # int16[B, W]


@dataclasses.dataclass
class SampleOutput:
  """What one ``generate`` call produced (host numpy).

  Attributes:
    tokens: int32[B, N] sampled ids; entries at index >= lengths[b] are ``pad_id``.
    logprobs: float32[B, N] log p(token) under the unmodified policy; 0 past lengths[b].
    lengths: int32[B] tokens generated per row.
    finish_reasons: one FinishReason per row (NONE for rows not asked to generate).
    prefill_tokens: prompt tokens this call wrote to the cache (all rows together).
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[FinishReason]
  prefill_tokens: int

  def row(self, b: int) -> list[int]:
    """Row b's generated ids, without padding."""
    return self.tokens[b, : self.lengths[b]].tolist()


def _check_rows(prompts: Sequence[Sequence[int]], cache: KVCache) -> int:
  """B, the cache's rows; raises ValueError unless there is one prompt per row."""
  b = cache.lengths.shape[0]
  if len(prompts) != b:
    raise ValueError(f"got {len(prompts)} prompts for a cache of {b} rows; pass one (possibly empty) per row.")
  return b


def _next_pow2(n: int, minimum: int) -> int:
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


class Sampler:
  """Prefill and decode for one model; holds its jitted functions and their compile counts.

  Args:
    config: the model config.
    params: the parameter tree (assign ``sampler.params`` to use new weights; no recompilation), or None for a
      sampler whose programs are only lowered with abstract parameters (``envace_jax/plan.py``).
    eos_ids: ids that end a sequence (finish reason STOP), e.g. ``Tokenizer.eos_ids``.
    token_bytes: bytes per id (``Tokenizer.token_bytes()``); needed only for stop strings.
    pad_id: id written past each row's end in outputs.
    prefill_chunk: prompt tokens per prefill call (bounds attention memory to B*N*chunk*S floats).
    min_bucket: the smallest prompt-chunk bucket.
    mesh: optional ``jax.sharding.Mesh`` (see sharding.make_mesh): params are placed by ``rules``, caches and the
      batch split over the batch axes, and both jitted functions get explicit in/out shardings.
    rules: logical-axis rules (default ``sharding.LOGICAL_RULES``).
  """

  def __init__(
    self,
    config: ModelConfig,
    params,
    *,
    eos_ids: Sequence[int] = (),
    token_bytes: Sequence[bytes] | None = None,
    pad_id: int = 0,
    prefill_chunk: int = 512,
    min_bucket: int = 16,
    mesh: jax.sharding.Mesh | None = None,
    rules=sharding.LOGICAL_RULES,
  ):
    if prefill_chunk & (prefill_chunk - 1) or min_bucket & (min_bucket - 1):
      raise ValueError(f"prefill_chunk={prefill_chunk} and min_bucket={min_bucket} must be powers of two.")
    # Sampling runs the layers unrolled: slicing a layer out of stacked weights copies it on CPU and GPU, which
    # tripled the memory traffic of a decode step. Callers pass either layout of params.
    self.config = config.replace(scan_layers=False)
    self.mesh, self.rules = mesh, rules
    self._param_shardings = sharding.param_shardings(self.config, mesh, rules) if mesh is not None else None
    if params is not None:
      self.params = params
    self.eos_ids = jnp.asarray(list(eos_ids) or [-1], jnp.int32)
    self.pad_id = pad_id
    self.prefill_chunk = prefill_chunk
    self.min_bucket = min(min_bucket, prefill_chunk)
    self._byte_table = None
    if token_bytes is not None:
      table, lengths = stopping.token_byte_table(token_bytes)
      self._byte_table = (jnp.asarray(table), jnp.asarray(lengths))
    self.compile_counts = {"prefill": 0, "decode": 0}
    self._jitted = {}

  @property
  def batch_multiple(self) -> int:
    """What every cache's batch (rows) must be a multiple of: the mesh's batch shards, 1 off the mesh."""
    return sharding.batch_size_multiple(self.mesh, self.rules) if self.mesh is not None else 1

  @property
  def params(self):
    """The parameter tree sampled from, layers unstacked (``layers_0 ..``). Assigning new weights (either layout)
    unstacks them and re-places them on the mesh; nothing recompiles."""
    return self._params

  @params.setter
  def params(self, params):
    params = transformer.unstack_layers(params)
    self._params = sharding.shard_params(params, self._param_shardings) if self.mesh is not None else params

  def _jit(self, kind: str, cache: KVCache):
    """The jitted prefill or decode function; on a mesh, with explicit shardings for this cache's shape."""
    shapes = tuple((c.lengths.shape[0], c.capacity) for c in (cache, *cache.levels()))
    key = (kind, shapes if self.mesh is not None else None)
    if key in self._jitted:
      return self._jitted[key]
    fn, static = (self._prefill_chunk, (8,)) if kind == "prefill" else (self._decode_loop, (7, 8, 9, 10))
    kwargs = {}
    if self.mesh is not None:
      c = sharding.cache_shardings(self.config, self.mesh, cache, self.rules)
      rows1, rows2 = (sharding.batch_sharding(self.mesh, n, self.rules) for n in (1, 2))
      if kind == "prefill":  # params, cache, last_logits, tokens, roles, valid, last_index, is_last
        kwargs = dict(in_shardings=(self._param_shardings, c, rows2, rows2, rows2, rows2, rows1, rows1))
        kwargs["out_shardings"] = (c, rows2)
      else:  # params, cache, logits, active, max_new, row_keys, gen_roles
        kwargs = dict(in_shardings=(self._param_shardings, c, rows2, rows1, rows1, rows1, rows1))
        kwargs["out_shardings"] = (rows2, rows2, rows1, rows1, c)
    self._jitted[key] = jax.jit(fn, static_argnums=static, donate_argnums=(1,), **kwargs)
    return self._jitted[key]

  # ------------------------------------------------------------------------------------------------ caches

  def init_cache(self, batch: int, capacity: int) -> KVCache:
    """An empty cache of B=batch rows and S=capacity slots (at most the model's context length).

    Raises:
      ValueError: capacity exceeds ``config.max_seq_len``; on a mesh, batch is not a multiple of the batch shards.
    """
    if capacity > self.config.max_seq_len:
      raise ValueError(
        f"capacity={capacity} exceeds the model's context of {self.config.max_seq_len} tokens; use a smaller "
        "capacity (sequences that outgrow it finish with context_exhausted)."
      )
    if self.mesh is not None:
      return sharding.init_sharded_cache(self.config, self.mesh, batch, capacity, rules=self.rules)
    return transformer.init_cache(self.config, batch, capacity)

  def fork(self, cache: KVCache, group_size: int, capacity: int | None = None) -> KVCache:
    """A cache of B*G rows where rows b*G .. b*G+G-1 continue row b's history (group prefix sharing).

    The new rows share row b's storage: ``cache``, cut to a power-of-two bucket of its longest row (few shapes to
    compile), becomes the new cache's ``prefix``, and each new row owns ``capacity`` empty slots (default:
    ``cache``'s capacity). Row b's tokens are stored once and attended once per step for its G rows. A row's
    context is then its history plus ``capacity``; the caller keeps it within the model's (unfold's views stop at
    their role's capacity).

    Raises:
      ValueError: on a mesh, B*G is not a multiple of the batch shards.
    """
    capacity = cache.capacity if capacity is None else int(capacity)
    longest = int(np.asarray(jax.device_get(cache.lengths)).max(initial=0))
    parent = cache.trimmed(min(cache.capacity, _next_pow2(longest, self.min_bucket)))
    if self.mesh is not None:
      parent = jax.device_put(parent, sharding.cache_shardings(self.config, self.mesh, parent, self.rules))
    child = self.init_cache(batch=int(cache.lengths.shape[0]) * group_size, capacity=capacity)
    return child.replace(prefix=parent)

  def copy_rows(self, cache: KVCache, source: Sequence[int]) -> KVCache:
    """A cache whose row i is a copy of row ``source[i]`` of ``cache``, or empty where ``source[i]`` is past its last
    row (B' = len(source) rows, placed on the mesh like any cache of B' rows): a prefix prefilled once in one row,
    given to every row that starts with it.

    Raises:
      ValueError: on a mesh, B' is not a multiple of the batch shards.
    """
    out = cache.take(np.asarray(source, np.int32))
    if self.mesh is not None:
      if len(source) % self.batch_multiple:
        raise ValueError(f"copy_rows: {len(source)} rows do not split over {self.batch_multiple} batch shards.")
      out = jax.device_put(out, sharding.cache_shardings(self.config, self.mesh, out, self.rules))
    return out

  # ------------------------------------------------------------------------------------------------ jitted parts

  def _prefill_chunk(self, params, cache, last_logits, tokens, roles, valid, last_index, is_last, attend):
    """Writes one bucketed chunk of prompt tokens and keeps the logits after each row's final prompt token.

    tokens/roles: int32[B, P]; valid: bool[B, P]; last_index: int32[B] chunk index of the row's final prompt
    token; is_last: bool[B] whether that token is in this chunk. last_logits: float32[B, V], carried.
    Static: attend, the cache slots attended over (``attend_bucket``).
    """
    self.compile_counts["prefill"] += 1  # runs once per trace
    logits, cache = transformer.apply(
      self.config,
      params,
      tokens,
      roles,
      cache=cache,
      valid=valid,
      logits_index=last_index[:, None],
      attend_len=attend,
    )
    return cache, jnp.where(is_last[:, None], logits[:, 0], last_logits)

  def _decode_loop(
    self, params, cache, logits, active, max_new, row_keys, gen_roles, num_new, sampling, stop_strings, attend
  ):
    """The decode ``while_loop``: runs until every row is done (at most N steps).

    active: bool[B] rows to generate for; max_new: int32[B]; row_keys: key[B]; gen_roles: int32[B] role id given
    to each row's generated tokens. Static: num_new (N), sampling, stop_strings, attend (cache slots attended over:
    covers every live row's history plus N new tokens).
    Returns (tokens int32[B, N], logprobs float32[B, N], lengths int32[B], finish int32[B], cache).
    """
    self.compile_counts["decode"] += 1  # runs once per trace
    b = logits.shape[0]
    capacity = cache.capacity
    width = stopping.buffer_width(self._byte_table[0].shape[1], stop_strings) if stop_strings else 0
    rows = jnp.arange(b)
    prefix = cache.prefix  # read, never written: kept out of the loop's carry

    def cond(s: _DecodeState):
      return jnp.any(~s.done) & (s.step < num_new)

    def body(s: _DecodeState):
      live = ~s.done
      can = live & (s.cache.lengths < capacity)  # a slot is left for the token about to be sampled
      keys = jax.vmap(jax.random.fold_in)(row_keys, s.lengths)
      token = sample_tokens(s.logits, keys, sampling)
      logprob = jnp.take_along_axis(jax.nn.log_softmax(s.logits, axis=-1), token[:, None], axis=-1)[:, 0]
      slot = jnp.where(can, s.lengths, num_new)  # out of range: dropped
      tokens = s.tokens.at[rows, slot].set(token, mode="drop")
      logprobs = s.logprobs.at[rows, slot].set(logprob, mode="drop")
      lengths = s.lengths + can
      buffer, hit = s.stop_buffer, jnp.zeros((b,), bool)
      if stop_strings:
        buffer, hit = stopping.push_and_match(s.stop_buffer, token, *self._byte_table, stop_strings)
        buffer = jnp.where(can[:, None], buffer, s.stop_buffer)
      stop = can & (jnp.isin(token, self.eos_ids) | hit)
      length = can & ~stop & (lengths >= max_new)
      exhausted = live & ~can
      finish = jnp.where(stop, int(FinishReason.STOP), s.finish)
      finish = jnp.where(length, int(FinishReason.LENGTH), finish)
      finish = jnp.where(exhausted, int(FinishReason.CONTEXT_EXHAUSTED), finish)
      # Every sampled token is written to the cache, so a later turn continues right after it; the logits it
      # yields matter only to rows still live.
      new_logits, cache = transformer.apply(
        self.config,
        params,
        token[:, None],
        gen_roles[:, None],
        cache=s.cache.replace(prefix=prefix),
        valid=can[:, None],
        attend_len=attend,
      )
      return _DecodeState(
        step=s.step + 1,
        logits=new_logits[:, 0],
        cache=cache.replace(prefix=None),
        tokens=tokens,
        logprobs=logprobs,
        lengths=lengths,
        done=s.done | stop | length | exhausted,
        finish=finish,
        stop_buffer=buffer,
      )

    state = _DecodeState(
      step=jnp.zeros((), jnp.int32),
      logits=logits,
      cache=cache.replace(prefix=None),
      tokens=jnp.full((b, num_new), self.pad_id, jnp.int32),
      logprobs=jnp.zeros((b, num_new), jnp.float32),
      lengths=jnp.zeros((b,), jnp.int32),
      done=~active,
      finish=jnp.zeros((b,), jnp.int32),
      stop_buffer=stopping.init_buffer(b, width),
    )
    state = jax.lax.while_loop(cond, body, state)
    return state.tokens, state.logprobs, state.lengths, state.finish, state.cache.replace(prefix=prefix)

  # ------------------------------------------------------------------------------------------------ host side

  def attend_bucket(self, n: int) -> int:
    """Cache slots a call attends over: ``n`` (the most slots any row of the call fills) rounded up to a power of
    two, at least ``prefill_chunk``; the caller caps it at the capacity. Attention then costs what the histories
    hold, not the cache's capacity, with O(log capacity) compiled variants."""
    return _next_pow2(n, self.prefill_chunk)

  def prefill(self, cache: KVCache, prompts: Sequence[Sequence[int]], prompt_roles, active=None):
    """Appends each row's new prompt tokens to its cache, in bucketed chunks.

    Args:
      cache: B rows.
      prompts: B sequences of new token ids (may be empty for rows not generating).
      prompt_roles: B sequences of role ids (same lengths as prompts), or one role id for every token.
      active: bool[B] rows to prefill (default: rows with a non-empty prompt).
    Returns:
      (cache, last_logits float32[B, V] after each row's final prompt token, fitted bool[B], prefilled token count).
      A row whose prompt does not fit in its remaining slots is not written (fitted False).
    Raises:
      ValueError: wrong number of prompts or roles, or an active row with an empty prompt.
    """
    b = _check_rows(prompts, cache)
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    active = lengths > 0 if active is None else np.asarray(active, bool)
    if np.any(active & (lengths == 0)):
      raise ValueError(
        "an active row has an empty prompt: a row needs at least one new token to condition on (in chat formats, "
        "the turn header)."
      )
    if np.isscalar(prompt_roles) or isinstance(prompt_roles, int):
      prompt_roles = [np.full(n, int(prompt_roles), np.int32) for n in lengths]
    for p, r in zip(prompts, prompt_roles, strict=True):
      if len(p) != len(r):
        raise ValueError(f"a prompt of {len(p)} tokens has {len(r)} role ids; give one role id per token.")
    vocab, num_roles = self.config.vocab_size, self.config.num_roles
    for row in np.flatnonzero(active):
      ids, ids_roles = np.asarray(prompts[row]), np.asarray(prompt_roles[row])
      if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(
          f"row {row}: prompt ids must be integers in [0, {vocab}); check the tokenizer matches the model."
        )
      if ids_roles.dtype.kind not in "iu" or ids_roles.min() < 0 or ids_roles.max() >= num_roles:
        raise ValueError(f"row {row}: role ids must be integers in [0, {num_roles}) (roles.Role).")
    filled = np.asarray(jax.device_get(cache.lengths))
    fitted = active & (filled + lengths <= cache.capacity)
    lengths = np.where(fitted, lengths, 0)
    total = int(lengths.max(initial=0))
    last_logits = jnp.zeros((b, self.config.vocab_size), jnp.float32)
    for start in range(0, total, self.prefill_chunk):
      size = _next_pow2(min(self.prefill_chunk, total - start), self.min_bucket)
      tokens = np.full((b, size), self.pad_id, np.int32)
      roles = np.zeros((b, size), np.int32)
      for row in np.flatnonzero(lengths > start):
        piece = slice(start, min(start + size, lengths[row]))
        tokens[row, : piece.stop - start] = np.asarray(prompts[row][piece])
        roles[row, : piece.stop - start] = np.asarray(prompt_roles[row][piece])
      valid = np.arange(size)[None, :] < (lengths - start)[:, None]
      last = lengths - 1 - start
      is_last = (lengths > 0) & (last >= 0) & (last < size)
      writing = lengths > start
      attend = self.attend_bucket(int(np.max(filled + np.minimum(lengths, start + size), where=writing, initial=1)))
      cache, last_logits = self._jit("prefill", cache)(
        self.params,
        cache,
        last_logits,
        tokens,
        roles,
        valid,
        np.clip(last, 0, size - 1).astype(np.int32),
        is_last,
        min(attend, cache.capacity),
      )
    return cache, last_logits, fitted, int(lengths.sum())

  def generate(
    self,
    cache: KVCache,
    prompts: Sequence[Sequence[int]],
    prompt_roles,
    *,
    role: int | Sequence[int],
    key: jax.Array,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams = GREEDY,
    stop_strings: Sequence[str] = (),
    active=None,
    row_ids=None,
  ) -> tuple[SampleOutput, KVCache]:
    """Appends each row's new prompt tokens, then samples until every row stops.

    Args:
      cache: B rows (from ``init_cache``, ``fork`` or an earlier call); donated: use the returned cache.
      prompts, prompt_roles, active: as in ``prefill``.
      role: role id of the generated tokens, one for all rows or int[B] (ACT and REHEARSE rows share a call).
      key: a ``jax.random.key``; row b's t-th token uses fold_in(fold_in(key, row_ids[b]), t).
      max_new_tokens: per row or one for all.
      sampling: SamplingParams (default greedy).
      stop_strings: texts that end a row when its generated bytes complete one (the token is kept).
      row_ids: int[B] identities for the key schedule (default 0..B-1).
    Returns:
      (SampleOutput, the cache holding each row's prompt and generated tokens).
    Raises:
      ValueError: see ``prefill``; stop strings without ``token_bytes``.
    """
    if stop_strings and self._byte_table is None:
      raise ValueError("stop_strings need token_bytes: build the Sampler with token_bytes=tokenizer.token_bytes().")
    b = _check_rows(prompts, cache)
    active = np.asarray([len(p) > 0 for p in prompts]) if active is None else np.asarray(active, bool)
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (b,))
    if np.any(max_new[active] < 1):
      raise ValueError(f"max_new_tokens must be >= 1 for every active row, got {max_new_tokens}.")
    gen_roles = np.broadcast_to(np.asarray(role, np.int32), (b,))
    if np.any((gen_roles < 0) | (gen_roles >= self.config.num_roles)):
      raise ValueError(f"role must be a role id in [0, {self.config.num_roles}) (roles.Role), got {role}.")
    cache, logits, fitted, prefilled = self.prefill(cache, prompts, prompt_roles, active)
    num_new = _next_pow2(int(max_new[active].max(initial=1)), 1)
    row_ids = np.arange(b) if row_ids is None else np.asarray(row_ids)
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.asarray(row_ids, jnp.uint32))
    stops = tuple(s.encode("utf-8") for s in stop_strings)
    filled = np.asarray(jax.device_get(cache.lengths))
    attend = min(self.attend_bucket(int(np.max(filled + num_new, where=fitted, initial=1))), cache.capacity)
    tokens, logprobs, lengths, finish, cache = self._jit("decode", cache)(
      self.params, cache, logits, fitted, max_new, row_keys, gen_roles, num_new, sampling, stops, attend
    )
    tokens, logprobs, lengths, finish = jax.device_get((tokens, logprobs, lengths, finish))
    finish = np.where(active & ~fitted, int(FinishReason.CONTEXT_EXHAUSTED), finish)
    reasons = [FinishReason(int(f)) for f in finish]
    out = SampleOutput(np.asarray(tokens), np.asarray(logprobs), np.asarray(lengths), reasons, prefilled)
    return out, cache
