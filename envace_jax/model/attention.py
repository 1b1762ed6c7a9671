"""Which kernel computes a layer's attention, per backend, and the wrappers of the accelerator kernels.

`transformer.Attention` asks `select` once per call (at trace time, so the choice is static) and runs one of:

  ``reference``   the transformer's own paths (`transformer._attend`, `_tiled_attention`, `_attend_key_blocks`, the
                  log-sum-exp merges of shared prefixes and pages): the CPU's only path, every backend's fallback.
  ``cudnn``       ``jax.nn.dot_product_attention(implementation="cudnn")``: cuDNN's fused flash attention (GPU).
  ``xla``         the same calls with ``implementation="xla"``: JAX's own einsums, the same on every backend. Only
                  when forced (``ModelConfig.attention="xla"``): the CPU tests check the cuDNN routes through it.
  ``pallas_tpu``  ``jax.experimental.pallas.ops.tpu.flash_attention``, the Pallas TPU kernel JAX ships (and its
                  ``ragged_paged_attention`` for pages without prefix levels).

``ModelConfig.attention="auto"`` (the run config's ``attention``) picks by the backend (`current_backend`:
``jax.default_backend()`` unless a `backend` block names another); any other value forces that implementation wherever
it can express the call (below), and the reference elsewhere. `recording` collects each selection as a `Call` (what
tests and the plan read to say which kernel every call of a program uses).

Where a kernel applies (everything else stays on the reference, on every backend):
  * Self-attention without a cache (training rows, a whole-prompt forward): the mask is lower-triangular (a query
    sees no later key; `transformer.Transformer` and `rl.logprobs.training_hidden` build it so), so the kernels run
    causal (cuDNN skips the tiles above the diagonal) and the mask restricts that further. cuDNN takes any bool mask
    (``jax.nn.dot_product_attention`` turns it into an additive bias dtype[B, 1, T, S], a full [T, S] per row: memory
    that the reference's tiled path does not hold) and needs T and S even (its backward with a bias) and a
    half-precision dtype. The Pallas TPU kernel expresses only causal & valid keys (`CausalMask`: its segment ids are
    1 for every query and valid[k] for key k), not the segments of packed training rows (a suffix also sees its
    parent's segment, ``rl/batch.py``), and needs T a multiple of its 128-token blocks; it has no grouped-query
    layout, so each KV head is repeated G times (keys and values G times larger while the kernel runs).
  * Every call over a cache (the rollouts' prefill chunks and decode steps, over own slots or pages, with or
    without shared-prefix levels; `transformer.Attention`): a softmax split over key sets, one kernel call per set
    that returns its log-sum-exp, the sets merged by max and sum (`merge`, `kvcache.merge_parts`; FlashAttention's
    merge, vLLM's cascade attention, MaxText's decode over parts). The sets:
      - own slots (`rows_part`): slots below lengths[b], a padding mask by length (no bias). A decode step's own
        slots include its new token; a chunk of T > 1 tokens reads the slots filled before it here, and
      - the chunk over itself (`chunk_part`), causal & valid (a [B, 1, T, T] bias: the chunk's size, not the cache's);
      - each prefix level (`rows_part` with m = B / P rows per prefix row): the m rows' m * T queries as one kernel
        row over their prefix row, so its keys and values are read once for them, not once per row (Hydragen).
    GPU, ``cudnn``: cuDNN's flash attention with its log-sum-exp (`_with_lse`) for every set (half precision, head
    dim a multiple of 8 up to 128). cuDNN reads [B, S, K, H]: XLA transposes the cache's keys ([B, K, H, S]) and
    values ([B, K, S, H]) for each call. Pages: the call's rows' pages are gathered into a contiguous view (one
    [B, W * Z, 2K, H] copy per layer, of the pages the call's table names: ``attend_len`` trims it), then as own
    slots. Chosen over the Pallas GPU ``paged_attention`` because that kernel reads pools laid out [K, P, Z, H] (ours
    are the TPU kernel's [P, Z, 2K, H]: converting copies the whole pool every step) and returns no log-sum-exp to
    merge a prefix with; cuDNN's own paged mode is not reachable through ``jax.nn``. The ``xla`` form reads the
    log-sum-exp in the compute dtype (``jax.nn`` casts it): bfloat16 merges on the tiny model are within 0.003 of
    the reference's logits, as bfloat16 compute itself; cuDNN's is kept in float32.
    TPU, ``pallas_tpu``: the Pallas TPU flash kernel's forward with its residuals (`_tpu_flash_lse`) for every set;
    KV heads as its heads and each head's G query heads folded into its query rows (no repeat), except the chunk
    over itself (causal: heads repeated, the chunk only). Keys are padded to its 128-key blocks (a copy where the
    cache's slots are not a multiple of 128) and the mask given as segment ids. Pages without prefix levels go to
    JAX's ragged paged attention kernel (`paged.kernel_attention`, under ``jit``: it reads the pages in place),
    where its tiling takes the heads (`paged.kernel_applies`), off a mesh; pages with prefix levels, or split over
    a mesh, are gathered as on GPU (the ragged kernel returns no log-sum-exp).
    On a mesh (`paged.Shards`: rows and their pages split over the batch axes together) each shard gathers its
    rows' pages from its own block of the pool inside ``jax.shard_map``: no page leaves its device.
    No loop in these routes: a decode step has no ``while`` (the kernels' grids iterate). Where the reference serves
    a call on GPU or TPU (a float32 run on GPU, say), its loop over pages runs over the table's static width
    (`paged.attention_part` with ``static``): XLA:GPU would copy a data-dependent trip count to the host every
    iteration. The CPU's reference loops to the longest row, as before.

A query that sees no key (padding) gets the mean of the values from the reference's `_attend` and from the ``xla``
and ``cudnn`` implementations (every logit equally masked), zeros from the reference's tiled paths; both are
meaningless and never read.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import struct

from envace_jax.config.choices import ATTENTION
from envace_jax.model import kvcache

REFERENCE, XLA, CUDNN, PALLAS_TPU = ATTENTION[1:]
# cuDNN's flash attention takes head dims that are multiples of 8 up to 128 on every supported GPU (256 from Hopper
# on: jax/_src/cudnn/fused_attention_stablehlo.py, check_is_flash_attention).
_CUDNN_MAX_HEAD_DIM = 128
_HALF = ("bfloat16", "float16")
# The Pallas TPU kernel's default blocks (jax.experimental.pallas.ops.tpu.flash_attention.BlockSizes.get_default).
TPU_BLOCK = 128


@struct.dataclass
class CausalMask:
  """A self-attention mask with its structure: query i sees key j iff j <= i and valid[j].

  Attributes:
    dense: bool[B, T, T], that mask (what the reference paths read).
    valid: bool[B, T], the keys that may be seen.
  """

  dense: jax.Array
  valid: jax.Array

  @classmethod
  def of(cls, valid: jax.Array) -> CausalMask:
    t = valid.shape[1]
    idx = jnp.arange(t)
    return cls(dense=(idx[None, None, :] <= idx[None, :, None]) & valid[:, None, :], valid=valid)


@struct.dataclass
class CacheMask:
  """The mask of a chunk over a KV cache with its structure (what the kernels' routes read instead of a dense mask):
  row b's valid new tokens fill own slots lengths[b], lengths[b] + 1, ... in chunk order, and each sees the row's
  own slots up to its own (and every filled slot of the row's prefix levels).

  Attributes:
    dense: bool[B, T, S], that mask over a dense cache's S attended slots (what the reference reads); None for pages.
    lengths: int32[B], own slots filled before the call.
    valid: bool[B, T], the chunk's tokens that are written (False: padding).
  """

  dense: jax.Array | None
  lengths: jax.Array
  valid: jax.Array


def dense(mask) -> jax.Array:
  """bool[B, T, S] of a bool array, a `CausalMask` or a `CacheMask` (None for pages)."""
  return mask.dense if isinstance(mask, (CausalMask, CacheMask)) else mask


@dataclasses.dataclass(frozen=True)
class Call:
  """One attention call as `select` saw it at trace time (`recording`).

  Attributes:
    kind: "train" (self-attention without a cache: training rows, a whole-sequence forward), "prefill" (a chunk of
      several tokens over a cache) or "decode" (one token per row over a cache).
    impl: what `select` returned ("reference", "xla", "cudnn", "pallas_tpu").
    backend: the backend name selection read (`current_backend`).
    prefix_levels: shared-prefix levels the call attends over (``KVCache.prefix``); 0 without.
    paged: the call's own slots live in pages (`paged.PagedKVCache`).
    dtype: the compute dtype's name. q_len, kv_len: T and S of the call.
  """

  kind: str
  impl: str
  backend: str
  prefix_levels: int = 0
  paged: bool = False
  dtype: str = ""
  q_len: int = 0
  kv_len: int = 0


_recordings: list[list[Call]] = []
_backends: list[str] = []


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
  """Yields a list to which every `select` inside the block appends its `Call` (nested blocks each get every call).

  Selection happens while a function is traced, and JAX caches traces by function (``jax.jit``, and
  ``jax.make_jaxpr`` of the same function object): a cache hit records nothing. Trace a function object not traced
  before with the same argument shapes (a new lambda or ``functools.partial``) inside the block.
  """
  calls: list[Call] = []
  _recordings.append(calls)
  try:
    yield calls
  finally:
    del _recordings[next(i for i, x in enumerate(_recordings) if x is calls)]  # by identity: lists compare equal


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
  """Selection inside the block reads ``name`` ("cpu", "gpu", "tpu") instead of ``jax.default_backend()``.

  For tests and plans that trace (not run) the programs a GPU or TPU would compile: the routed kernels do not run on
  another backend. Like `recording`, it acts at trace time and is not part of JAX's cache key: a function traced
  outside the block keeps the program it got there, so trace a new function object inside it.

  JAX checks cuDNN's version when a cuDNN attention call is traced (``check_cudnn_version`` in
  jax/_src/cudnn/fused_attention_stablehlo.py), so on a machine without cuDNN a "gpu"/"cuda" block stands in
  `_TRACED_CUDNN_VERSION` for it: the calls trace (``jax.make_jaxpr``, ``jax.eval_shape``) but cannot compile there.
  """
  _backends.append(name)
  stub = contextlib.nullcontext()
  if name in ("gpu", "cuda") and jax.default_backend() != "gpu":
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    stub = _patched(cudnn, "check_cudnn_version", lambda: _TRACED_CUDNN_VERSION)
  try:
    with stub:
      yield
  finally:
    _backends.pop()


# The cuDNN version a traced-only "gpu" `backend` block reports (9.10: what jax-cuda12 wheels of JAX 0.10 bundle).
_TRACED_CUDNN_VERSION = 91000


@contextlib.contextmanager
def _patched(module, name: str, value) -> Iterator[None]:
  old = getattr(module, name)
  setattr(module, name, value)
  try:
    yield
  finally:
    setattr(module, name, old)


def is_recording() -> bool:
  """Whether a `recording` block is open (the per-layer layout then traces every layer itself, so each records)."""
  return bool(_recordings)


def current_backend() -> str:
  """The backend selection reads: the innermost `backend` block's name, else ``jax.default_backend()``."""
  return _backends[-1] if _backends else jax.default_backend()


def _cudnn_fits(dtype: str, head_dim: int, q_len: int, kv_len: int, cached: bool) -> bool:
  if dtype not in _HALF or head_dim % 8 or head_dim > _CUDNN_MAX_HEAD_DIM:
    return False
  return cached or (q_len % 2 == 0 and kv_len % 2 == 0)


def select(
  setting: str,
  backend: str,
  dtype: str,
  head_dim: int,
  q_len: int,
  kv_len: int,
  *,
  cached: bool,
  causal_mask: bool,
  prefix_levels: int = 0,
  paged: bool = False,
) -> str:
  """The implementation of one attention call (see the module docstring).

  Args:
    setting: ``ModelConfig.attention``: "auto" or an implementation to force where it can express the call.
    backend: `current_backend()`: "cpu", "gpu" (or "cuda") or "tpu".
    dtype: the compute dtype's name.
    head_dim: H. q_len, kv_len: T and S of the call (S: the attended slots with a cache).
    cached: the call attends over a KV cache (False: self-attention without a cache).
    causal_mask: the mask is a `CausalMask` (causal & valid keys), which the Pallas TPU kernel can express.
    prefix_levels: the cache's shared-prefix levels (``KVCache.prefix``). paged: its own slots are in pages.
  Returns:
    One of "reference", "xla", "cudnn", "pallas_tpu"; recorded as a `Call` in every open `recording`.
  Raises:
    ValueError: an unknown ``setting``.
  """
  if setting not in ATTENTION:
    raise ValueError(f"attention={setting!r}; use one of {ATTENTION}.")
  impl = _select(setting, backend, dtype, head_dim, q_len, kv_len, cached, causal_mask, prefix_levels, paged)
  kind = "train" if not cached else "decode" if q_len == 1 else "prefill"
  call = Call(kind, impl, backend, prefix_levels, paged, dtype, q_len, kv_len)
  for calls in _recordings:
    calls.append(call)
  return impl


def _select(setting, backend, dtype, head_dim, q_len, kv_len, cached, causal_mask, prefix_levels, paged) -> str:
  del prefix_levels, paged  # a cached call takes the same kernels with or without them (`cached_attention`)
  if setting == REFERENCE:
    return REFERENCE
  if setting == "auto":
    setting = {"gpu": CUDNN, "cuda": CUDNN, "tpu": PALLAS_TPU}.get(backend, REFERENCE)
  if setting == CUDNN and not _cudnn_fits(dtype, head_dim, q_len, kv_len, cached):
    return REFERENCE
  if setting == PALLAS_TPU and cached and head_dim > TPU_BLOCK and head_dim % TPU_BLOCK:
    return REFERENCE
  if setting == PALLAS_TPU and not cached and (not causal_mask or q_len % TPU_BLOCK or kv_len % TPU_BLOCK):
    return REFERENCE
  return setting


def dot_product(q_btnh, k_bskh, v_bskh, mask_bts, implementation: str, causal: bool) -> jax.Array:
  """``jax.nn.dot_product_attention`` with our grouped-query layout and mask.

  Args:
    q_btnh: dtype[B, T, N, H] queries, query head n = k * G + g reading KV head k (as ``jax.nn`` groups them).
    k_bskh, v_bskh: dtype[B, S, K, H].
    mask_bts: bool[B, T, S], True where a query sees a key.
    implementation: "xla" or "cudnn".
    causal: the mask is lower-triangular (T == S): tell the kernel, which may then skip the tiles above the diagonal.
  Returns:
    dtype[B, T, N, H].
  """
  return jax.nn.dot_product_attention(
    q_btnh, k_bskh, v_bskh, mask=mask_bts[:, None], is_causal=causal, implementation=implementation
  )


def tpu_flash(q_btnh, k_btkh, v_btkh, valid_bt, kernel: Callable | None = None) -> jax.Array:
  """Causal self-attention over the valid keys by the Pallas TPU kernel (T a multiple of `TPU_BLOCK`).

  Args:
    q_btnh: dtype[B, T, N, H]; k_btkh, v_btkh: dtype[B, T, K, H]; valid_bt: bool[B, T] (`CausalMask.valid`).
    kernel: the kernel (default: ``jax.experimental.pallas.ops.tpu.flash_attention.flash_attention``, TPU only);
      tests pass the same module's pure-JAX ``mha_reference``, which runs anywhere.
  Returns:
    dtype[B, T, N, H].
  """
  from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

  kernel = kernel or pallas_flash.flash_attention
  n, k, h = q_btnh.shape[2], k_btkh.shape[2], q_btnh.shape[3]
  heads = lambda x: jnp.repeat(x, n // k, axis=2).transpose(0, 2, 1, 3)  # noqa: E731  [B, N, T, H], head n reads n // G
  segments = pallas_flash.SegmentIds(q=jnp.ones(valid_bt.shape, jnp.int32), kv=valid_bt.astype(jnp.int32))
  out = kernel(
    q_btnh.transpose(0, 2, 1, 3), heads(k_btkh), heads(v_btkh), None, segments, causal=True, sm_scale=h**-0.5
  )
  return out.transpose(0, 2, 1, 3)


# ------------------------------------------------------------------------------------------------ cached calls


def _tpu_flash_lse(q_bnqh, k_bnsh, v_bnsh, q_segments, kv_segments, causal: bool):
  """The Pallas TPU flash kernel's forward with its residuals (``_flash_attention`` with ``save_residuals``, as its
  own backward calls it: jax/experimental/pallas/ops/tpu/flash_attention.py), padded to its blocks: keys to a
  multiple of `TPU_BLOCK` (padding keys get segment 0, seen by no query), queries to one query block (a multiple of
  8) or a multiple of 128, and for ``causal`` (queries and keys the same rows) both alike.
  Returns (out dtype[B, N, Q, H], float32 log-sum-exp of the scaled scores [B, N, Q])."""
  from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

  b, n, q_len, h = q_bnqh.shape
  s = k_bnsh.shape[2]
  block_q = TPU_BLOCK if causal else min(TPU_BLOCK, -(-q_len // 8) * 8)
  q_pad, s_pad = -(-q_len // block_q) * block_q - q_len, -(-s // TPU_BLOCK) * TPU_BLOCK - s
  if causal:  # the kernel's causal mask compares query and key indices (T = S here): pad both alike
    q_pad = s_pad
  pad = lambda x, n, axis: x if not n else jnp.pad(x, [(0, n if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
  segments = pallas_flash.SegmentIds(q=pad(q_segments, q_pad, 1), kv=pad(kv_segments, s_pad, 1))
  blocks = pallas_flash.BlockSizes(block_q=block_q, block_k_major=TPU_BLOCK, block_k=TPU_BLOCK, block_b=1)
  q, k, v = pad(q_bnqh, q_pad, 2), pad(k_bnsh, s_pad, 2), pad(v_bnsh, s_pad, 2)
  out, total, best = pallas_flash._flash_attention(q, k, v, None, segments, True, causal, h**-0.5, blocks, False)
  lse = best + jnp.log(jnp.where(total > 0, total, 1.0))
  return out[:, :, :q_len], lse[:, :, :q_len]


def _clean(out, lse, seen):
  """A part's (out, lse) where queries that see no key of it get out 0 and lse ``kvcache.MASKED`` (the kernels give
  such rows anything from a mean of the values to NaN, and a log-sum-exp anywhere from -inf to +inf)."""
  return jnp.where(seen[..., None], out.astype(jnp.float32), 0.0), jnp.where(
    seen, lse.astype(jnp.float32), kvcache.MASKED
  )


def _with_lse(impl: str, q_btnh, k_bskh, v_bskh, *, lengths=None, mask=None):
  """``jax.nn.dot_product_attention(..., return_residual=True)`` with a padding mask by key lengths int32[B] or a
  causal bool mask [B, T, S]: (out dtype[B, T, N, H], log-sum-exp [B, T, N]). For cuDNN it calls the function
  ``jax.nn`` calls (jax/_src/cudnn/fused_attention_stablehlo.py, with the arguments ``jax.nn`` gives it) to keep
  cuDNN's float32 log-sum-exp: ``jax.nn`` casts it to the compute dtype, and a bfloat16 log-sum-exp is off by up to
  |lse| * 2^-9, which scales a part's weight in the merge by up to exp of that (~1.6% at lse = 8). ``xla`` keeps
  ``jax.nn``'s cast (the CPU tests' bfloat16 tolerance covers it)."""
  if impl != CUDNN:
    if lengths is not None:
      return jax.nn.dot_product_attention(
        q_btnh, k_bskh, v_bskh, key_value_seq_lengths=lengths, implementation=impl, return_residual=True
      )
    return jax.nn.dot_product_attention(
      q_btnh, k_bskh, v_bskh, mask=mask[:, None], is_causal=True, implementation=impl, return_residual=True
    )
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  b, t, _, h = q_btnh.shape
  if lengths is not None:
    q_lengths = jnp.full((b,), t, jnp.int32)
    out, stat = cudnn.dot_product_attention(
      q_btnh, k_bskh, v_bskh, None, None, q_lengths, lengths, scale=h**-0.5, mask_type=cudnn.MaskType.PADDING,
      return_residual=True,
    )  # fmt: skip
  else:
    out, stat = cudnn.dot_product_attention(
      q_btnh, k_bskh, v_bskh, None, mask[:, None], scale=h**-0.5, mask_type=cudnn.MaskType.CAUSAL,
      return_residual=True,
    )  # fmt: skip
  return out, stat.transpose(0, 2, 1)  # cuDNN's residual is [B, N, T] whatever the layout (as jax.nn reads it)


def rows_part(impl: str, q_btnh, k_bskh, v_bskh, lengths):
  """Queries over rows of keys where key slot s of row r is seen iff s < lengths[r], by the kernel ``impl``: one
  part of a softmax split over key sets, merged with the others by `merge`.

  Args:
    impl: "xla" or "cudnn" (`_with_lse`: a padding mask by key lengths, no bias), or "pallas_tpu"
      (`_tpu_flash_lse`, the mask as segment ids).
    q_btnh: dtype[B, T, N, H] queries; query row b reads key row b // m (m = B / R: the m rows that continue one
      shared prefix row read it together, their m * T queries as one kernel row: its keys are read once for them).
    k_bskh, v_bskh: dtype[R, S, K, H] (R divides B). lengths: int32[R].
  Returns:
    (float32 out [B, T, N, H], float32 log-sum-exp of the scaled scores [B, T, N]); a query that sees no key gets
    out 0 and log-sum-exp ``kvcache.MASKED``.
  """
  b, t, n, h = q_btnh.shape
  r, s, k, _ = k_bskh.shape
  m, g = b // r, n // k
  if impl == PALLAS_TPU:  # KV heads as the kernel's heads, each one's m * T * G queries as its rows: no repeat
    q = q_btnh.reshape(r, m, t, k, g, h).transpose(0, 3, 1, 2, 4, 5).reshape(r, k, m * t * g, h)
    kv_segments = (jnp.arange(s)[None, :] < lengths[:, None]).astype(jnp.int32)
    q_segments = jnp.ones((r, m * t * g), jnp.int32)
    out, lse = _tpu_flash_lse(
      q, k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3), q_segments, kv_segments, False
    )
    out = out.reshape(r, k, m, t, g, h).transpose(0, 2, 3, 1, 4, 5).reshape(b, t, n, h)
    lse = lse.reshape(r, k, m, t, g).transpose(0, 2, 3, 1, 4).reshape(b, t, n)
  else:
    out, lse = _with_lse(impl, q_btnh.reshape(r, m * t, n, h), k_bskh, v_bskh, lengths=lengths)
    out, lse = out.reshape(b, t, n, h), lse.reshape(b, t, n)
  seen = jnp.broadcast_to(jnp.repeat(lengths > 0, m, total_repeat_length=b)[:, None, None], (b, t, n))
  return _clean(out, lse, seen)


def chunk_part(impl: str, q_btnh, k_btkh, v_btkh, valid):
  """A chunk's queries over its own keys, causal over the chunk's order and restricted to its valid keys (the new
  tokens' share of a prefill over a cache: they fill the row's next slots in that order). As `rows_part`, with
  keys and values dtype[B, T, K, H] and valid bool[B, T]; "xla"/"cudnn" take the mask as a [B, 1, T, T] bias (a
  chunk's size, not the cache's), "pallas_tpu" repeats each KV head G times (the kernel's causal mask needs
  query and key rows alike)."""
  b, t, n, h = q_btnh.shape
  mask = CausalMask.of(valid).dense
  if impl == PALLAS_TPU:
    heads = lambda x: jnp.repeat(x, n // x.shape[2], axis=2).transpose(0, 2, 1, 3)  # noqa: E731  [B, N, T, H]
    ones = jnp.ones((b, t), jnp.int32)
    out, lse = _tpu_flash_lse(heads(q_btnh), heads(k_btkh), heads(v_btkh), ones, valid.astype(jnp.int32), True)
    out, lse = out.transpose(0, 2, 1, 3), lse.transpose(0, 2, 1)
  else:
    out, lse = _with_lse(impl, q_btnh, k_btkh, v_btkh, mask=mask)
  return _clean(out, lse, jnp.broadcast_to(mask.any(-1)[:, :, None], (b, t, n)))


def merge(parts, dtype) -> jax.Array:
  """Softmax attention over the union of the parts' key sets from their (out, log-sum-exp) pairs, by max and sum
  (`kvcache.merge_parts`: a part is the triple (lse, 1, out)). Returns dtype[B, T, N, H]."""
  if len(parts) == 1:
    return parts[0][0].astype(dtype)
  return kvcache.merge_parts([(lse, jnp.ones_like(lse), out) for out, lse in parts], dtype)
