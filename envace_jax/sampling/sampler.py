"""Batched sampling with a KV cache: jitted chunked prefill, a jitted ``while_loop`` decode, multi-turn continuation.

    sampler = Sampler(config, params, eos_ids=tokenizer.eos_ids, token_bytes=tokenizer.token_bytes())
    cache = sampler.init_cache(batch=B, capacity=S)
    out, cache = sampler.generate(cache, prompts, prompt_roles, role=Role.ACT, key=jax.random.key(0),
                                  max_new_tokens=256, stop_strings=("</tool_call>",))
    # next turn: append only the new tokens; turns 1..k-1 are never prefilled again
    out, cache = sampler.generate(cache, next_prompts, next_roles, role=Role.ACT, key=jax.random.key(1), ...)

The cache is the state of each sequence (its own tokens live in slots 0..lengths-1, after its prefix levels'), so a
caller keeps one cache per role view and appends to it. ``fork`` continues each row in G rows that share its storage.
``stream`` batches continuously (``generate`` is a stream run to its end):

    stream = sampler.stream(cache, num_new=256, sampling=params, stop_strings=stops)
    stream.admit(prompts, prompt_roles, role=roles, keys=row_keys, max_new_tokens=budgets)
    for done in stream.advance(until=1):   # decode until a generation ends; the others keep their state
      ...                                  # then admit that row's next prompt, advance again

Shapes: B sequences, P prompt-chunk bucket, N new-token bucket, V vocab, S cache capacity.

Invariants:
  * Every returned token is in the cache: a sequence stops with ``CONTEXT_EXHAUSTED`` rather than sample a token it
    has no slot for, and a prompt that does not fit is not written at all (no silent truncation).
  * Logprobs are those of the unmodified policy (temperature 1, no top-k/top-p): the numbers the trainer recomputes.
  * Randomness is keyed by (row key, token index), a row's key being the call's key folded with the row id or given
    per row, so a sequence's sample does not depend on what else is in the batch, nor on when it was admitted to a
    stream, and an identical key gives identical output.
  * Work follows the live rows: unless the batch is split over devices, a prefill chunk or a decode loop that
    touches few rows of a large cache runs on a power-of-two bucket of them, gathered and put back, when the prefix
    copies that takes are no longer than the rows' own attended slots (a long shared opening stays shared); else a
    prefill chunk runs on the whole groups of rows that share their openings, when those are fewer than the batch,
    copying each group's prefix rows once.
  * Sampling values are data: temperature and top_p are each row's inputs of the decode program (`RowSampling`), so
    a new value compiles nothing and rows of one stream may differ; a row samples the tokens a program compiled
    for its own values would (greedy rows the argmax, sampled rows bit for bit).
  * Compilations are bounded: prompt chunks are bucketed to powers of two up to ``prefill_chunk``, new-token counts
    and gathered rows to powers of two, the slots a dense cache attends over too (a paged cache needs no such
    bucket: one program serves every history length); ``compile_counts`` reports how many programs each jitted
    function made (prefill, decode, and a stream's admit): traced, or read back untraced from the compilation
    cache's executables (`compilation_cache.PersistentProgram`). Samplers of the same settings in one process share
    their programs (``share_programs``), so a second one traces and compiles nothing it has seen.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envace_jax import compilation_cache
from envace_jax.model import attention, kvcache, paged, transformer
from envace_jax.model.config import ModelConfig
from envace_jax.sampling import sharding, stopping
from envace_jax.sampling.stopping import FinishReason

KVCache = transformer.KVCache


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the next token is drawn. temperature and top_p are values the decode program reads (`RowSampling`): one
  compiled program serves all of them, and the rows of one stream may each have their own (`Stream.admit`); top_k is
  static: each distinct value compiles the decode loop once.

  Attributes:
    temperature: 0 for greedy (argmax); otherwise logits are divided by it. Below `MIN_TEMPERATURE` it samples
      greedily too (the limit: logits divided by it would overflow float32).
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
MIN_TEMPERATURE = 1e-4  # below it a row is greedy: logits of ~1e2 / 1e-4 stay far inside float32's range
# The nucleus is looked for among each row's most likely NUCLEUS_CANDIDATES tokens (`jax.lax.top_k`), and the whole
# vocabulary is sorted only when their mass falls short of a row's top_p: on 2 CPU cores the sort of 8 rows of
# SmolLM2's 49,152 logits took 119 ms a decode step, the top 256 2 ms (experiments/results/2026-12-05_eval_speed.md).
NUCLEUS_CANDIDATES = 256


@struct.dataclass
class RowSampling:
  """Each row's temperature and top_p as the decode program reads them: traced, so a new value compiles nothing.

  Attributes:
    greedy: bool[B], temperature below `MIN_TEMPERATURE` (argmax).
    inv_temperature: float32[B], 1 / temperature rounded to float32 on the host (1 for greedy rows): the number XLA
      multiplies by where the temperature is a constant of the program (its simplifier turns ``x / c`` into
      ``x * (1 / c)``), so a row samples the tokens a program compiled for its temperature would.
    top_p: float32[B] (1: off).
  """

  greedy: jax.Array
  inv_temperature: jax.Array
  top_p: jax.Array

  @classmethod
  def of(cls, params: Sequence[SamplingParams]) -> RowSampling:
    """One row per `SamplingParams`, as host (numpy) arrays."""
    temperature = np.asarray([p.temperature for p in params], np.float32).reshape(-1)
    greedy = temperature < MIN_TEMPERATURE  # logits / such a temperature overflow float32: its limit, the argmax
    inv = np.float32(1) / np.where(greedy, np.float32(1), temperature)
    return cls(greedy, inv.astype(np.float32), np.asarray([p.top_p for p in params], np.float32).reshape(-1))


def sample_tokens(
  logits_bv: jax.Array, keys: jax.Array, sampling: RowSampling | SamplingParams, top_k: int = 0
) -> jax.Array:
  """Draws one token per row.

  Args:
    logits_bv: float32[B, V].
    keys: per-row ``jax.random.key``s, key[B].
    sampling: each row's temperature and top_p (`RowSampling`, B rows), or one `SamplingParams` for every row (its
      top_k then replaces ``top_k``).
    top_k: keep the k most likely tokens of every row (0: off); static.
  Returns:
    int32[B] token ids. A row draws exactly what a program compiled for its own values would: greedy rows take the
    argmax, the others divide by their temperature, keep their top_k then their top_p mass and draw with their key.
    Work a batch does not need is skipped (``lax.cond``): the draw when every row is greedy, the nucleus when no row
    has top_p < 1, and the sort of the whole vocabulary when every row's nucleus lies in its top
    `NUCLEUS_CANDIDATES` tokens (`_nucleus`).
  """
  if isinstance(sampling, SamplingParams):
    sampling, top_k = RowSampling.of([sampling] * logits_bv.shape[0]), sampling.top_k
  greedy = jnp.asarray(sampling.greedy)
  top_p = jnp.asarray(sampling.top_p)[:, None]
  greedy_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)

  def draw(nucleus: bool):
    # Each branch holds the operations of the former program compiled for its case, in its order.
    def sample(x_bv):
      x_bv = x_bv * jnp.asarray(sampling.inv_temperature)[:, None]
      if top_k:
        kth = jax.lax.top_k(x_bv, top_k)[0][:, -1:]
        x_bv = jnp.where(x_bv < kth, -jnp.inf, x_bv)
      if nucleus:
        x_bv = jnp.where(top_p < 1.0, _nucleus(x_bv, top_p), x_bv)
      return jax.vmap(jax.random.categorical)(keys, x_bv).astype(jnp.int32)

    return sample

  def drawn(x_bv):
    return jax.lax.cond(jnp.any(top_p < 1.0), draw(True), draw(False), x_bv)

  return jnp.where(greedy, greedy_b, jax.lax.cond(jnp.all(greedy), lambda x: greedy_b, drawn, logits_bv))


def _nucleus(x_bv: jax.Array, top_p: jax.Array) -> jax.Array:
  """``x_bv`` (float32[B, V], logits after temperature and top-k) with every token outside its row's nucleus set to
  -inf: the smallest set of most likely tokens whose probability reaches ``top_p`` (float32[B, 1]); a token is kept
  when the mass strictly before it, in descending order, is below top_p, so the most likely token always is (even
  for a top_p below float32's resolution), and so is every token tied with the last one kept.

  The descending order is needed only as far as the nucleus reaches: the top `NUCLEUS_CANDIDATES` tokens when their
  mass reaches every row's top_p (a trained model's usual case), else the whole sorted row (a flat distribution).
  Both give the set of the whole sort, up to float32 rounding of the mass at the set's edge.
  """
  v = x_bv.shape[-1]

  # The row maximum from its own reduction: taken as ``top_bv[:, :1]`` XLA:CPU fused the top-k into both uses and
  # ran 63 ms, not 2 (8 x 49,152 logits; experiments/results/2026-12-05_eval_speed.md).
  m = jnp.max(x_bv, axis=-1, keepdims=True)
  z = jnp.sum(jnp.exp(x_bv - m), axis=-1, keepdims=True)  # the softmax's denominator, shared by both paths

  def threshold(top_bv):  # top_bv: a row's k most likely logits, descending
    probs = jnp.exp(top_bv - m) / z
    keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p).at[:, 0].set(True)
    return jnp.min(jnp.where(keep, top_bv, jnp.inf), axis=-1, keepdims=True), jnp.sum(probs, axis=-1, keepdims=True)

  def whole(_):
    return threshold(jnp.sort(x_bv, axis=-1)[:, ::-1])[0]

  if v <= NUCLEUS_CANDIDATES:
    cut = whole(None)
  else:
    cut, mass = threshold(jax.lax.top_k(x_bv, NUCLEUS_CANDIDATES)[0])
    # The candidates hold a row's nucleus when their mass reaches its top_p (the next token's mass before it is then
    # >= top_p); a margin of 1e-4 keeps rounding of that comparison from cutting a nucleus short. Rows without a
    # nucleus (top_p 1) need nothing.
    held = (mass >= jnp.minimum(top_p + 1e-4, 1.0)) | (top_p >= 1.0)
    cut = jax.lax.cond(jnp.all(held), lambda _: cut, whole, None)
  return jnp.where(x_bv < cut, -jnp.inf, x_bv)


@struct.dataclass
class _DecodeState:
  """Each row's decoding state: the decode loop's carry, kept between calls by a `Stream`. Shapes: B rows, N
  new-token slots, W stop-string bytes. A row is live from its admission until its generation ends (``done``)."""

  logits: jax.Array  # float32[B, V], next-token logits of each row
  cache: KVCache
  tokens: jax.Array  # int32[B, N], generated since the row's admission
  logprobs: jax.Array  # float32[B, N]
  lengths: jax.Array  # int32[B], tokens generated since the row's admission
  done: jax.Array  # bool[B]
  finish: jax.Array  # int32[B], FinishReason
  stop_buffer: jax.Array  # int16[B, W], each row's last generated bytes (stop strings)


@dataclasses.dataclass
class SampleOutput:
  """What one ``generate`` call produced (host numpy).

  Attributes:
    tokens: int32[B, N] sampled ids; entries at index >= lengths[b] are ``pad_id``.
    logprobs: float32[B, N] log p(token) under the unmodified policy; 0 past lengths[b].
    lengths: int32[B] tokens generated per row.
    finish_reasons: one FinishReason per row (NONE for rows not asked to generate).
    prefill_tokens: prompt tokens this call wrote to the cache (all rows together).
    decode_row_steps: rows computed x iterations of the decode loop (the live rows only, in a power-of-two bucket of
      them, unless the batch is split over devices: then every row).
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[FinishReason]
  prefill_tokens: int
  decode_row_steps: int = 0

  def row(self, b: int) -> list[int]:
    """Row b's generated ids, without padding."""
    return self.tokens[b, : self.lengths[b]].tolist()


def _check_rows(prompts: Sequence[Sequence[int]], cache: KVCache) -> int:
  """B, the cache's rows; raises ValueError unless there is one prompt per row."""
  b = cache.lengths.shape[0]
  if len(prompts) != b:
    raise ValueError(f"got {len(prompts)} prompts for a cache of {b} rows; pass one (possibly empty) per row.")
  return b


def next_pow2(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= ``n``, at least ``minimum``: the buckets that keep compiled shapes few."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def _placing(jitted, in_shardings):
  """``jitted`` with its positional host arrays (numpy) put on their ``in_shardings`` first: in a multi-process run
  jit refuses a host array for a sharded input, even on this process's own devices (`distributed.process_mesh`)."""

  def call(*args, **kwargs):
    placed = [
      jax.device_put(a, s) if isinstance(a, np.ndarray | np.generic) else a
      for a, s in zip(args, in_shardings, strict=False)
    ]
    return jitted(*placed, *args[len(placed) :], **kwargs)

  call.lower = jitted.lower  # plan.py lowers the programs itself
  return call


@dataclasses.dataclass
class _Programs:
  """The jitted functions of one set of sampler settings: bound to ``holder`` (a sampler without parameters), with
  their trace counts."""

  holder: Sampler
  counts: dict[str, int]
  jitted: dict


# Sampler settings -> their programs, for `Sampler(share_programs=True)`.
_SHARED = compilation_cache.SharedPrograms()


class Sampler:
  """Prefill and decode for one model; holds its jitted functions (shared, by default) and their compile counts.

  Args:
    params: the parameter tree (assign ``sampler.params`` to use new weights; no recompilation), or None for a
      sampler whose programs are only lowered with abstract parameters (``envace_jax/plan.py``).
    eos_ids: ids that end a sequence (finish reason STOP), e.g. ``Tokenizer.eos_ids``.
    token_bytes: bytes per id (``Tokenizer.token_bytes()``); needed only for stop strings.
    pad_id: id written past each row's end in outputs.
    prefill_chunk: prompt tokens per prefill call (bounds attention memory to B*N*chunk*S floats).
    min_bucket: the smallest prompt-chunk bucket.
    mesh: optional ``jax.sharding.Mesh`` (see sharding.make_mesh): params are placed by ``rules``, caches and the
      batch split over the batch axes, and every jitted function gets explicit in/out shardings.
    rules: logical-axis rules (default ``sharding.LOGICAL_RULES``).
    share_programs: use the jitted programs of the process's other samplers with the same model config, mesh,
      rules, eos ids, pad id, token bytes and attention backend (`_SHARED`): a Trainer's policy and reference-user
      samplers, a second Trainer, an evaluation after training trace, lower and load each program once per process.
      Their ``compile_counts`` is then one dict, counting the traces of them all. False (and inside an
      `attention.recording` block): programs and counts of its own.
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
    share_programs: bool = True,
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
    self._byte_table, table_digest = None, None
    if token_bytes is not None:
      table, lengths = stopping.token_byte_table(token_bytes)
      self._byte_table = (jnp.asarray(table), jnp.asarray(lengths))
      table_digest = hashlib.sha256(table.tobytes() + lengths.tobytes()).hexdigest()
    # What the jitted functions read when traced besides their arguments: ``self``'s settings (the byte table by its
    # digest) and the attention backend selection reads (`attention.backend`). A sampler made inside an
    # `attention.recording` block traces its own programs, so that the block records them.
    signature = (
      type(self), self.config, mesh, rules, tuple(np.asarray(self.eos_ids).tolist()), pad_id, table_digest,
      attention.current_backend(),
    )  # fmt: skip
    share = share_programs and not attention.is_recording()
    self._signature = signature if share else None  # None: no executables written or read (`PersistentProgram`)
    self._programs = _SHARED.get(self._signature, self._holder_programs)
    self.compile_counts, self._jitted = self._programs.counts, self._programs.jitted

  def _holder_programs(self) -> _Programs:
    """A new set of programs, bound to a copy of this sampler without parameters: a shared program keeps no
    weights alive."""
    holder = copy.copy(self)
    holder.__dict__.pop("_params", None)
    holder.compile_counts, holder._jitted = {"prefill": 0, "decode": 0, "admit": 0}, {}
    return _Programs(holder, holder.compile_counts, holder._jitted)

  @property
  def batch_multiple(self) -> int:
    """What every cache's batch (rows) must be a multiple of: the mesh's batch shards, 1 off the mesh."""
    return sharding.batch_size_multiple(self.mesh, self.rules) if self.mesh is not None else 1

  @property
  def params(self):
    """The parameter tree sampled from, layers unstacked (``layers_0 ..``), in the compute dtype
    (``config.dtype``). Assigning new weights (either layout) unstacks them, re-places them on the mesh and, where
    their dtype is not the compute dtype (float32 master weights, bfloat16 compute), makes a cast copy on the same
    shardings (`sharding.cast`); weights already in the compute dtype are used as they are, no copy. Nothing
    recompiles.

    Why a copy (XLA's ``cost_analysis()`` "bytes accessed" of one decode step compiled for CPU, bfloat16 compute,
    4 rows x 256 slots): reading float32 weights and casting each at use accessed 336 MiB for a 4-layer
    Qwen3-shaped model of 76 MiB float32 weights and 1.81 GiB for SmolLM2-135M (513 MiB), against 274 MiB and
    1.40 GiB from the bfloat16 copy (-18% and -23%); a decode step is bound by these bytes."""
    return self._params

  @params.setter
  def params(self, params):
    params = transformer.unstack_layers(params)
    if self.mesh is not None:
      params = sharding.shard_params(params, self._param_shardings)
    self._params = None  # the previous cast copy goes before the next is made
    self._params = sharding.cast(params, self.config.dtype)

  def _jit(self, kind: str, cache: KVCache):
    """The jitted prefill, decode or admit function; on a mesh, with explicit shardings for this cache's shape."""
    shapes = tuple((c.lengths.shape[0], c.capacity) for c in (cache, *cache.levels()))
    # On a mesh a program's shardings follow the cache's shapes; admit never takes the cache, so one jit serves all
    # (a jit per cache shape would compile it again for each, and again after `runtime.release_host_memory`).
    key = (kind, shapes if self.mesh is not None and kind != "admit" else None)
    if key in self._jitted:
      return self._jitted[key]
    holder = self._programs.holder
    fn, static, donate = {
      "prefill": (holder._prefill_chunk, ("attend",), ("cache",)),
      "prefill_rows": (holder._prefill_rows, ("attend", "grouped"), ("cache",)),  # batch_multiple 1: not split
      "decode": (holder._decode_loop, ("top_k", "stop_strings", "attend"), ("state",)),
      "decode_rows": (holder._decode_rows, ("top_k", "stop_strings", "attend"), ("state",)),  # likewise
      "admit": (holder._admit_rows, (), ("state",)),
    }[kind]
    kwargs = {}
    if self.mesh is not None:
      c = sharding.cache_shardings(self.config, self.mesh, cache, self.rules)
      rows1, rows2 = (sharding.batch_sharding(self.mesh, n, self.rules) for n in (1, 2))
      state = _DecodeState(
        logits=rows2, cache=c, tokens=rows2, logprobs=rows2, lengths=rows1, done=rows1, finish=rows1, stop_buffer=rows2
      )
      scalar = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      rows_sampling = RowSampling(rows1, rows1, rows1)
      if kind == "prefill":  # params, cache, last_logits, tokens, roles, valid, last_index, is_last
        kwargs = dict(in_shardings=(self._param_shardings, c, rows2, rows2, rows2, rows2, rows1, rows1))
        kwargs["out_shardings"] = (c, rows2)
      elif kind == "decode":  # params, state, max_new, row_keys, gen_roles, until, sampling, limit
        kwargs = dict(in_shardings=(self._param_shardings, state, rows1, rows1, rows1, scalar, rows_sampling, scalar))
        kwargs["out_shardings"] = (state, scalar)
      elif kind == "prefill_rows":  # as prefill, with the rows (int32[B']) after last_logits; B' rows unsplit
        kwargs = dict(in_shardings=(self._param_shardings, c, rows2, rows1, rows2, rows2, rows2, rows1, rows1))
        kwargs["out_shardings"] = (c, rows2)
      elif kind == "decode_rows":  # as decode, with the rows after the state
        kwargs = dict(
          in_shardings=(self._param_shardings, state, rows1, rows1, rows1, rows1, scalar, rows_sampling, scalar)
        )
        kwargs["out_shardings"] = (state, scalar)
      else:  # state without its cache, last_logits, admitted, fitted
        state = state.replace(cache=None)
        kwargs = dict(in_shardings=(state, rows2, rows1, rows1), out_shardings=state)
    jitted = jax.jit(fn, static_argnames=static, donate_argnames=donate, **kwargs)
    # A later process with these settings loads the executables instead of tracing them (counted as a trace).
    counts, counted = self.compile_counts, {"prefill_rows": "prefill", "decode_rows": "decode"}.get(kind, kind)
    jitted = compilation_cache.PersistentProgram(
      jitted, f"sampler_{kind}", self._signature and (self._signature, key, donate), static,
      on_load=lambda: counts.__setitem__(counted, counts[counted] + 1),
    )  # fmt: skip
    if kwargs and jax.process_count() > 1:  # jit takes no host array for a sharded input there: place them first
      jitted = _placing(jitted, kwargs["in_shardings"])
    self._jitted[key] = jitted
    return jitted

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

  def fork(self, cache: KVCache, group_size: int, capacity: int | None = None, pages=None) -> KVCache:
    """A cache of B*G rows where rows b*G .. b*G+G-1 continue row b's history (group prefix sharing).

    The new rows share row b's storage: ``cache``, cut to a power-of-two bucket of its longest row (few shapes to
    compile), becomes the new cache's ``prefix``, and each new row owns ``capacity`` empty slots (default:
    ``cache``'s capacity). Row b's tokens are stored once and attended once per step for its G rows. A row's
    context is then its history plus ``capacity``; the caller keeps it within the model's (unfold's views stop at
    their role's capacity).

    With ``pages`` (a `paged.PagePool`), the new rows' own slots are pages of that pool instead: a
    `paged.PagedKVCache` whose row i is pool row i, holding the pages the pool gives it (none for a new row) and
    addressing up to ``capacity`` slots (rounded up to whole pages); the caller grows rows before they write. On a
    mesh the pool has one shard per batch shard (``PagePool(..., shards=batch_multiple, rows=B*G)``) and the cache
    splits its rows and pages over them (`paged.Shards`: a row's pages on its device).

    Raises:
      ValueError: capacity exceeds the model's context; on a mesh, B*G is not a multiple of the batch shards, or
        ``pages`` has not as many shards.
    """
    capacity = cache.capacity if capacity is None else int(capacity)
    longest = int(np.asarray(jax.device_get(cache.lengths)).max(initial=0))
    parent = cache.trimmed(min(cache.capacity, next_pow2(longest, self.min_bucket)))
    if self.mesh is not None:
      parent = jax.device_put(parent, sharding.cache_shardings(self.config, self.mesh, parent, self.rules))
    rows = int(cache.lengths.shape[0]) * group_size
    if capacity > self.config.max_seq_len:
      raise ValueError(f"fork: capacity={capacity} exceeds the model's context of {self.config.max_seq_len} tokens.")
    if pages is not None:
      width = -(-capacity // pages.page_size)
      if self.mesh is None:
        return paged.init_cache(self.config, pages, range(rows), width).replace(prefix=parent)
      if rows % self.batch_multiple:
        raise ValueError(f"fork: {rows} rows do not split over {self.batch_multiple} batch shards.")
      shards = sharding.paged_shards(self.mesh, self.rules)
      cache = paged.init_cache(self.config, pages, range(rows), width, shards=shards).replace(prefix=parent)
      return jax.device_put(cache, sharding.cache_shardings(self.config, self.mesh, cache, self.rules))
    return self.init_cache(batch=rows, capacity=capacity).replace(prefix=parent)

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

  def _prefill_rows(
    self, params, cache, last_logits, rows, tokens, roles, valid, last_index, is_last, attend, grouped=False
  ):
    """`_prefill_chunk` on B' rows of the cache (rows: int32[B'], B or more for padding; the chunk's arrays have B'
    rows): their histories are gathered (`KVCache.gather`, the first ``attend`` own slots; static ``grouped``: whole
    groups, their prefix levels copied once per group), written, and put back."""
    self.compile_counts["prefill"] += 1  # runs once per trace
    part = cache.gather(rows, attend, grouped)
    logits, part = transformer.apply(
      self.config, params, tokens, roles, cache=part, valid=valid, logits_index=last_index[:, None], attend_len=attend
    )
    mine = jnp.take(last_logits, rows, axis=0, mode="fill", fill_value=0)
    new = jnp.where(is_last[:, None], logits[:, 0], mine)
    return cache.put(rows, part), last_logits.at[rows].set(new, mode="drop")

  def _decode_loop(
    self, params, state, max_new, row_keys, gen_roles, until, sampling, top_k, stop_strings, attend, limit=None
  ):
    """The decode ``while_loop``: every live row samples a token per iteration until ``until`` of them have finished
    in this call, or all have, or ``limit`` iterations ran (at most N iterations: a row's budget is at most N).

    state: `_DecodeState` (B rows, N = its tokens' width); max_new: int32[B]; row_keys: key[B]; gen_roles: int32[B]
    role id given to each row's generated tokens; until: int32[]; sampling: `RowSampling` (B rows); limit: int32[] or
    None (no limit). Static: top_k, stop_strings, attend (cache slots attended over: covers every live row's history
    plus what it may still generate).
    Returns (state, iterations int32[]).
    """
    self.compile_counts["decode"] += 1  # runs once per trace
    b, num_new = state.tokens.shape
    capacity = state.cache.row_capacity()  # int32[B]
    rows = jnp.arange(b)
    prefix = state.cache.prefix  # read, never written: kept out of the loop's carry
    done_at_entry = state.done

    def cond(carry):
      step, s = carry
      more = jnp.any(~s.done) & (step < num_new) & (jnp.sum(s.done & ~done_at_entry) < until)
      return more if limit is None else more & (step < limit)

    def body(carry):
      step, s = carry
      live = ~s.done
      can = live & (s.cache.lengths < capacity)  # a slot is left for the token about to be sampled
      keys = jax.vmap(jax.random.fold_in)(row_keys, s.lengths)
      token = sample_tokens(s.logits, keys, sampling, top_k)
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
      return step + 1, _DecodeState(
        logits=new_logits[:, 0],
        cache=cache.replace(prefix=None),
        tokens=tokens,
        logprobs=logprobs,
        lengths=lengths,
        done=s.done | stop | length | exhausted,
        finish=finish,
        stop_buffer=buffer,
      )

    start = (jnp.zeros((), jnp.int32), state.replace(cache=state.cache.replace(prefix=None)))
    steps, state = jax.lax.while_loop(cond, body, start)
    return state.replace(cache=state.cache.replace(prefix=prefix)), steps

  def _decode_rows(
    self, params, state, rows, max_new, row_keys, gen_roles, until, sampling, top_k, stop_strings, attend, limit=None
  ):
    """`_decode_loop` on B' rows of ``state`` (rows: int32[B'], B or more for padding; max_new, row_keys, gen_roles,
    sampling given for those rows): their states and histories (the first ``attend`` own slots) are gathered,
    decoded, and put back, so the loop reads and computes the live rows only."""
    pick = lambda x: jnp.take(x, rows, axis=0, mode="fill", fill_value=0)  # noqa: E731
    bare = state.replace(cache=None)
    part = jax.tree.map(pick, bare).replace(  # padding rows: done, so the loop leaves them alone
      cache=state.cache.gather(rows, attend), done=jnp.take(state.done, rows, mode="fill", fill_value=True)
    )
    part, steps = self._decode_loop(
      params, part, max_new, row_keys, gen_roles, until, sampling, top_k, stop_strings, attend, limit
    )
    put = lambda x, y: x.at[rows].set(y, mode="drop")  # noqa: E731
    merged = jax.tree.map(put, bare, part.replace(cache=None))
    return merged.replace(cache=state.cache.put(rows, part.cache)), steps

  def _initial_state(
    self, cache: KVCache, num_new: int, stops: tuple[bytes, ...], place=jax.device_put
  ) -> _DecodeState:
    """The decode state of a stream over ``cache`` before any admission: every row done, ``num_new`` token slots,
    a stop buffer as wide as ``stops`` need (0 without); each field built on the host and put on the device(s) by
    ``place``. Abstract with ``jax.eval_shape`` (the memory plan)."""
    b = cache.lengths.shape[0]
    width = stopping.buffer_width(self._byte_table[0].shape[1], stops) if stops else 0
    host = _DecodeState(  # numpy: no fill program to compile per shape
      logits=np.zeros((b, self.config.vocab_size), np.float32),
      cache=None,
      tokens=np.full((b, num_new), self.pad_id, np.int32),
      logprobs=np.zeros((b, num_new), np.float32),
      lengths=np.zeros(b, np.int32),
      done=np.ones(b, bool),
      finish=np.zeros(b, np.int32),
      stop_buffer=np.full((b, width), -1, np.int16),
    )
    return jax.tree.map(place, host).replace(cache=cache)

  def _admit_rows(self, state, last_logits, admitted, fitted):
    """Resets the ``admitted`` rows of ``state`` (without its cache) for a new generation that starts from
    ``last_logits``; an admitted row whose prompt did not fit is done at once (``CONTEXT_EXHAUSTED``)."""
    self.compile_counts["admit"] += 1  # runs once per trace
    a, ok = admitted[:, None], admitted & fitted
    return state.replace(
      logits=jnp.where(ok[:, None], last_logits, state.logits),
      tokens=jnp.where(a, self.pad_id, state.tokens),
      logprobs=jnp.where(a, 0.0, state.logprobs),
      lengths=jnp.where(admitted, 0, state.lengths),
      done=jnp.where(admitted, ~ok, state.done),
      finish=jnp.where(admitted, jnp.where(ok, 0, int(FinishReason.CONTEXT_EXHAUSTED)), state.finish),
      stop_buffer=jnp.where(a, jnp.int16(-1), state.stop_buffer),
    )

  # ------------------------------------------------------------------------------------------------ host side

  def _gathers(self, cache: KVCache, n: int, attend: int) -> bool:
    """Whether work on ``n`` rows of ``cache`` runs on a gathered bucket of them (`KVCache.gather`): when the batch is
    not split over devices, the bucket is smaller than the batch, and the copies of the prefix levels each gathered
    row takes (the levels are shared, the copies are not) are no longer than its own ``attend`` slots."""
    prefix = sum(level.capacity for level in cache.levels())
    return self.batch_multiple == 1 and next_pow2(n, 1) < int(cache.lengths.shape[0]) and prefix <= attend

  def _groups(self, cache: KVCache, some: np.ndarray) -> np.ndarray | None:
    """The rows of the whole groups that hold rows ``some`` (int[n]), in order, where the rows of one group share a
    row of every prefix level (R = B / the most rows a level has, consecutive rows; `kvcache.gather_levels` with
    ``grouped``), if a chunk on them gathers: the batch is not split over devices, R is a power of two, and the
    groups' bucket is smaller than the batch. None otherwise. A prefill chunk costs its rows times its tokens, so
    a rollout whose later turns write one view of each trajectory (half the rows of the policy's stream) runs them
    alone, at the cost of one copy of each of their groups' prefix rows
    (experiments/results/2026-12-06_grpo_step_profile.md)."""
    b = int(cache.lengths.shape[0])
    if not cache.levels() or self.batch_multiple != 1:
      return None
    size = kvcache.finest_group(cache)
    rows = (np.unique(some // size)[:, None] * size + np.arange(size)[None, :]).reshape(-1)
    if size & (size - 1) or next_pow2(len(rows), 1) >= b:
      return None
    return rows

  @staticmethod
  def _attended(cache, attend: int) -> int:
    """The static ``attend`` a call compiles for: ``attend`` on a dense cache; a paged cache's whole table, since
    its pages are read only up to the last one any row fills whatever the table's width (`paged.attention_part`),
    so one program serves every history length."""
    return cache.capacity if isinstance(cache, paged.PagedKVCache) else attend

  def attend_bucket(self, n: int) -> int:
    """Cache slots a call attends over: ``n`` (the most slots any row of the call fills) rounded up to a power of
    two, at least ``prefill_chunk``; the caller caps it at the capacity. Attention then costs what the histories
    hold, not the cache's capacity, with O(log capacity) compiled variants."""
    return next_pow2(n, self.prefill_chunk)

  def chunk_sizes(self, total: int) -> list[int]:
    """The prompt-chunk sizes `prefill` runs to write ``total`` tokens (the longest row's), in order: whole
    ``prefill_chunk`` chunks, then the rest rounded up to a multiple of ``min_bucket`` as powers of two, largest
    first. A chunk computes every row it runs on for all its tokens, so a rest of 138 tokens runs as 128 + 16 rather
    than 256: the padding is under ``min_bucket`` tokens per row, with no chunk size outside the power-of-two buckets
    (a rollout's prefill computed 3.3 token-rows per prompt token with one rounded-up chunk,
    experiments/results/2026-12-06_grpo_step_profile.md)."""
    sizes = [self.prefill_chunk] * (total // self.prefill_chunk)
    rest = -(-(total % self.prefill_chunk) // self.min_bucket) * self.min_bucket
    while rest:
      sizes.append(1 << (rest.bit_length() - 1))
      rest -= sizes[-1]
    return sizes

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
    fitted = active & (filled + lengths <= cache.host_row_capacity())
    lengths = np.where(fitted, lengths, 0)
    total = int(lengths.max(initial=0))
    last_logits = jnp.zeros((b, self.config.vocab_size), jnp.float32)
    starts = np.cumsum([0, *self.chunk_sizes(total)])
    for start, size in zip(starts[:-1].tolist(), np.diff(starts).tolist(), strict=True):
      writing = lengths > start
      attend = self.attend_bucket(int(np.max(filled + np.minimum(lengths, start + size), where=writing, initial=1)))
      # A chunk that writes few rows runs on those rows alone when `_gathers` allows (module docstring, invariants),
      # else on the whole groups of rows that hold them (`_groups`) when those are fewer than the batch.
      some = np.flatnonzero(writing)
      compact = self._gathers(cache, len(some), min(attend, cache.capacity))
      groups = None if compact else self._groups(cache, some)
      grouped = groups is not None
      if grouped:
        some, compact = groups, True
      rows = np.concatenate([some, np.full(next_pow2(len(some), 1) - len(some), b)]) if compact else np.arange(b)
      n = np.where(rows < b, lengths[np.minimum(rows, b - 1)], 0)  # prompt tokens of each computed row
      tokens = np.full((len(rows), size), self.pad_id, np.int32)
      roles = np.zeros((len(rows), size), np.int32)
      for j in np.flatnonzero(n > start):
        piece = slice(start, min(start + size, n[j]))
        tokens[j, : piece.stop - start] = np.asarray(prompts[rows[j]][piece])
        roles[j, : piece.stop - start] = np.asarray(prompt_roles[rows[j]][piece])
      valid = np.arange(size)[None, :] < (n - start)[:, None]
      last = n - 1 - start
      is_last = (n > 0) & (last >= 0) & (last < size)
      clipped = np.clip(last, 0, size - 1).astype(np.int32)
      chunk = (tokens, roles, valid, clipped, is_last, self._attended(cache, min(attend, cache.capacity)))
      if compact:
        cache, last_logits = self._jit("prefill_rows", cache)(
          self.params, cache, last_logits, rows.astype(np.int32), *chunk, grouped
        )
      else:
        cache, last_logits = self._jit("prefill", cache)(self.params, cache, last_logits, *chunk)
    return cache, last_logits, fitted, int(lengths.sum())

  def stream(
    self,
    cache: KVCache,
    *,
    num_new: int,
    sampling: SamplingParams = GREEDY,
    stop_strings: Sequence[str] = (),
  ) -> Stream:
    """A `Stream` over ``cache`` (donated: read the cache back from ``stream.cache``): continuous batching, where a
    row starts its next generation as soon as it is free instead of when every row of a call has finished.

    num_new: the most tokens any generation of the stream may ask for (rounded up to a power of two: the width of
    the decode state, one compiled shape). sampling: the rows' default (`Stream.admit` may give each row its own
    temperature and top_p); its top_k is every row's. Raises ValueError: stop strings without ``token_bytes``.
    """
    if stop_strings and self._byte_table is None:
      raise ValueError("stop_strings need token_bytes: build the Sampler with token_bytes=tokenizer.token_bytes().")
    return Stream(self, cache, next_pow2(num_new, 1), sampling, tuple(s.encode("utf-8") for s in stop_strings))

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
    """Appends each row's new prompt tokens, then samples until every row stops (a `Stream` run to its end).

    Args:
      cache: B rows (from ``init_cache``, ``fork`` or an earlier call); donated: use the returned cache.
      prompts, prompt_roles, active: as in ``prefill``.
      role: role id of the generated tokens, one for all rows or int[B] (ACT and REHEARSE rows share a call).
      key: a ``jax.random.key``: row b's t-th token uses fold_in(fold_in(key, row_ids[b]), t); or key[B], one per
        row (row b's t-th token uses fold_in(key[b], t)).
      max_new_tokens: per row or one for all.
      sampling: SamplingParams (default greedy).
      stop_strings: texts that end a row when its generated bytes complete one (the token is kept).
      row_ids: int[B] identities for the key schedule (default 0..B-1); unused when ``key`` is one per row.
    Returns:
      (SampleOutput, the cache holding each row's prompt and generated tokens).
    Raises:
      ValueError: see ``prefill`` and `Stream.admit`; stop strings without ``token_bytes``.
    """
    b = _check_rows(prompts, cache)
    active = np.asarray([len(p) > 0 for p in prompts]) if active is None else np.asarray(active, bool)
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (b,))
    if not jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(key)  # a raw uint32 key (jax.random.PRNGKey), or one per row
    if jnp.ndim(key) == 0:
      row_ids = np.arange(b) if row_ids is None else np.asarray(row_ids)
      key = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.asarray(row_ids, jnp.uint32))
    stream = self.stream(
      cache, num_new=int(max_new[active].max(initial=1)), sampling=sampling, stop_strings=stop_strings
    )
    stream.admit(prompts, prompt_roles, role=role, keys=key, max_new_tokens=max_new, active=active)
    tokens = np.full((b, stream.num_new), self.pad_id, np.int32)
    logprobs = np.zeros((b, stream.num_new), np.float32)
    lengths, reasons = np.zeros(b, np.int32), [FinishReason.NONE] * b
    for f in stream.advance():
      n = len(f.tokens)
      tokens[f.row, :n], logprobs[f.row, :n], lengths[f.row], reasons[f.row] = f.tokens, f.logprobs, n, f.finish
    out = SampleOutput(tokens, logprobs, lengths, reasons, stream.prefill_tokens, stream.row_steps)
    return out, stream.cache


@dataclasses.dataclass
class Finished:
  """A generation a `Stream` completed: its row, its ids and logprobs exactly as sampled, and why it ended."""

  row: int
  tokens: list[int]
  logprobs: list[float]
  finish: FinishReason


class Stream:
  """Continuous batching over one cache (vLLM's and levanter's scheduling, our own code): a free row is admitted
  with its next prompt (`admit`: prefilled, then live), `advance` decodes every live row until some of them finish
  and hands those back, free again, while the others keep their state (logits, tokens so far, stop-string bytes)
  for the next call.

  Built by `Sampler.stream`. Attributes: ``num_new`` (N, the decode state's width); counters since creation:
  ``prefill_tokens``, ``decode_steps`` (loop iterations), ``row_steps`` (as `SampleOutput.decode_row_steps`) and
  ``generated_tokens``; ``live``: bool[B], rows admitted and not yet handed back; ``sampling``: the rows' default
  `SamplingParams` (its top_k is every row's).
  """

  def __init__(self, sampler: Sampler, cache: KVCache, num_new: int, sampling: SamplingParams, stops):
    self.sampler, self.num_new, self.sampling, self.stops = sampler, num_new, sampling, stops
    b = int(cache.lengths.shape[0])
    self._sampling = RowSampling.of([sampling] * b)  # each row's, host arrays; set on admission
    place = jax.device_put
    if sampler.mesh is not None:  # every field split over the rows like the cache's, from the host
      place = lambda x: jax.device_put(x, sharding.batch_sharding(sampler.mesh, x.ndim, sampler.rules))  # noqa: E731
    self._state = sampler._initial_state(cache, num_new, stops, place)
    self.live = np.zeros(b, bool)
    self._max_new = np.ones(b, np.int32)
    self._roles = np.zeros(b, np.int32)
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))  # the PRNG implementation's key data
    self._keys = np.zeros((b, *key.shape), key.dtype)  # replaced row by row on admission
    self.prefill_tokens = self.decode_steps = self.row_steps = self.generated_tokens = 0

  @property
  def cache(self) -> KVCache:
    """The cache: every admitted row's prompt and the tokens it generated so far."""
    return self._state.cache

  def set_cache(self, cache) -> None:
    """Replaces the cache by one holding the same rows and histories in other storage: a paged cache whose table
    (the caller's `paged.PagePool` grew rows before admitting them, or shrank finished ones) or pools
    (`paged.PagedKVCache.extended`) changed. A live row must keep the pages it writes."""
    self._state = self._state.replace(cache=cache)

  def admit(self, prompts, prompt_roles, *, role, keys, max_new_tokens, active=None, sampling=None) -> np.ndarray:
    """Prefills the new prompt of each ``active`` row (default: rows with a non-empty prompt) and makes it live.

    Args:
      prompts, prompt_roles: B sequences each, as in `Sampler.prefill` (rows not admitted: empty).
      role: role id of each admitted row's generated tokens, one for all rows or int[B].
      keys: key[B]: row b's t-th generated token uses fold_in(keys[b], t).
      max_new_tokens: per row or one for all; at most ``num_new``.
      sampling: the admitted rows' `SamplingParams`, one for all or one per row (B, None for rows not admitted);
        default: the stream's. Their temperature and top_p are the program's data: nothing compiles for new values.
    Returns:
      fitted: bool[B], the admitted rows whose prompt fitted (one that did not is handed back by the next
      `advance` with ``CONTEXT_EXHAUSTED`` and no tokens).
    Raises:
      ValueError: an admitted row is live already; a budget below 1 or over ``num_new``; a role id out of range;
        a sampling whose top_k is not the stream's; see `Sampler.prefill`.
    """
    sampler = self.sampler
    b = _check_rows(prompts, self._state.cache)
    active = np.asarray([len(p) > 0 for p in prompts]) if active is None else np.asarray(active, bool)
    if np.any(active & self.live):
      raise ValueError(f"rows {np.flatnonzero(active & self.live).tolist()} are still generating: admit free rows.")
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (b,))
    if np.any(max_new[active] < 1):
      raise ValueError(f"max_new_tokens must be >= 1 for every admitted row, got {max_new_tokens}.")
    if np.any(max_new[active] > self.num_new):
      raise ValueError(f"max_new_tokens must be at most the stream's num_new={self.num_new}, got {max_new_tokens}.")
    roles = np.broadcast_to(np.asarray(role, np.int32), (b,))
    if np.any((roles < 0) | (roles >= sampler.config.num_roles)):
      raise ValueError(f"role must be a role id in [0, {sampler.config.num_roles}) (roles.Role), got {role}.")
    per_row = [sampling] * b if sampling is None or isinstance(sampling, SamplingParams) else list(sampling)
    if len(per_row) != b:
      raise ValueError(f"sampling: got {len(per_row)} settings for {b} rows; give one, or one per row.")
    per_row = [self.sampling if p is None or not a else p for p, a in zip(per_row, active, strict=True)]
    if any(p.top_k != self.sampling.top_k for p in per_row):
      raise ValueError(f"sampling: top_k is the stream's ({self.sampling.top_k}) for every row (static).")
    cache, logits, fitted, count = sampler.prefill(self._state.cache, prompts, prompt_roles, active)
    bare = self._state.replace(cache=None)
    state = sampler._jit("admit", cache)(bare, logits, active, fitted)
    self._state = state.replace(cache=cache)
    self._max_new = np.where(active, max_new, self._max_new)
    self._roles = np.where(active, roles, self._roles)
    self._sampling = jax.tree.map(lambda new, old: np.where(active, new, old), RowSampling.of(per_row), self._sampling)
    self._keys = np.where(active.reshape(-1, *[1] * (self._keys.ndim - 1)), jax.random.key_data(keys), self._keys)
    self.live |= active
    self.prefill_tokens += count
    return active & fitted

  def _placed(self, values):
    """``values`` (host arrays of one entry per row, or a tree of them) on the decode program's row sharding where
    the sampler has a mesh (a multi-process run's jit takes no host array for a sharded input); as they are
    otherwise."""
    if self.sampler.mesh is None:
      return values
    return jax.device_put(values, sharding.batch_sharding(self.sampler.mesh, 1, self.sampler.rules))

  def drop(self, rows) -> None:
    """Ends the generations of ``rows`` (int[k]; those not live are ignored) without handing them back: they stop
    decoding at once and are free (a later `admit` appends to their histories, as after a finished generation)."""
    rows = np.asarray([r for r in np.asarray(rows, np.int64).reshape(-1) if self.live[r]], np.int32)
    if len(rows):
      done = np.asarray(jax.device_get(self._state.done)).copy()
      done[rows] = True
      self._state = self._state.replace(done=jnp.asarray(self._placed(done)))
      self.live[rows] = False

  def peek(self, rows) -> list[list[int]]:
    """The ids each of ``rows`` (int[k], live) generated so far in its current generation, without handing it back:
    what a caller matches on the host between `advance` calls (the server's per-request stop strings)."""
    tokens, lengths = jax.device_get((self._state.tokens, self._state.lengths))
    return [tokens[r, : int(lengths[r])].tolist() for r in np.asarray(rows, np.int64).reshape(-1)]

  def advance(self, until: int | None = None, max_steps: int | None = None) -> list[Finished]:
    """Decodes the live rows until at least ``until`` of them (default: all) have finished, or for ``max_steps``
    tokens (default: no bound; then the list may be empty), and hands back every finished one (its row is free
    again).

    Raises ValueError: ``until`` or ``max_steps`` below 1.
    """
    if until is not None and until < 1:
      raise ValueError(f"until must be >= 1 (rows to wait for), got {until}.")
    if max_steps is not None and max_steps < 1:
      raise ValueError(f"max_steps must be >= 1 (decode steps), got {max_steps}.")
    limit = np.int32(self.num_new if max_steps is None else min(max_steps, self.num_new))
    sampler, state = self.sampler, self._state
    done = np.asarray(jax.device_get(state.done))
    running = self.live & ~done
    waiting = int(running.sum()) if until is None else min(until, int(self.live.sum())) - int((self.live & done).sum())
    if running.any() and waiting > 0:
      own, made = jax.device_get((state.cache.lengths, state.lengths))
      reach = np.max(np.asarray(own) + self._max_new - np.asarray(made), where=running, initial=1)
      attend = min(sampler.attend_bucket(int(reach)), state.cache.capacity)
      b = len(self.live)
      some = np.flatnonzero(running)
      m = next_pow2(len(some), 1)
      compact = sampler._gathers(state.cache, len(some), attend)
      attend = sampler._attended(state.cache, attend)
      top_k = self.sampling.top_k
      if compact:
        rows = np.concatenate([some, np.full(m - len(some), b)]).astype(np.int32)
        at = np.minimum(rows, b - 1)  # padding rows take row b-1's inputs and stay done
        keys = jax.random.wrap_key_data(jax.device_put(self._keys[at]))
        values = self._placed(jax.tree.map(lambda x: x[at], self._sampling))
        state, steps = sampler._jit("decode_rows", state.cache)(
          sampler.params, state, rows, self._max_new[at], keys, self._roles[at], np.int32(waiting), values, top_k,
          self.stops, attend, limit,
        )  # fmt: skip
      else:
        keys = jax.random.wrap_key_data(jax.device_put(self._keys))
        state, steps = sampler._jit("decode", state.cache)(
          sampler.params, state, self._max_new, keys, self._roles, np.int32(waiting), self._placed(self._sampling),
          top_k, self.stops, attend, limit,
        )  # fmt: skip
        m = b
      self._state = state
      self.decode_steps += int(steps)
      self.row_steps += m * int(steps)
    tokens, logprobs, lengths, done, finish = jax.device_get(
      (state.tokens, state.logprobs, state.lengths, state.done, state.finish)
    )
    out = []
    for row in np.flatnonzero(self.live & np.asarray(done)):
      n = int(lengths[row])
      out.append(
        Finished(int(row), tokens[row, :n].tolist(), logprobs[row, :n].tolist(), FinishReason(int(finish[row])))
      )
      self.live[row] = False
      self.generated_tokens += n
    return out
