"""A pure-functional Flax (linen) decoder for the Llama, Qwen2 and Qwen3 families, with role embeddings.

    logits, cache = apply(config, params, tokens, roles, positions, cache=None, valid=None)

Shapes (B batch, T new tokens, S cache capacity, L layers, D model, N query heads, K KV heads, G = N / K,
H head dim, F MLP width, V vocab, R roles): `apply`'s arguments; the cache is a `kvcache.KVCache`.

Its keys are stored transposed, [.., B, K, H, S], and its values [.., B, K, S, H]: the layouts the two attention
matmuls read in place (scores = q @ k contracts k's second-to-last axis, out = probs @ v contracts v's). Keys stored
[B, K, S, H] made XLA copy every layer's keys to [B, K, H, S] at every decode step (a full read and write of the key
cache, ~7% of a SmolLM2 step at 322 slots and growing with capacity).

Shared prefixes (``KVCache.prefix``) and paged caches (`paged.PagedKVCache`) need the per-layer layout: a query
attends over its own slots (or pages) and, one einsum per prefix level, over its prefix row's filled slots together
with the other rows of its group (`_attend_prefix`), and the parts merge by log-sum-exp (`kvcache.merge_parts`).
Positions continue after the prefixes' tokens (``KVCache.offsets``).

Role embeddings (paper §3.1): a learned table ``role_embed[R, D]`` added to the token embedding, zero-initialised so
a pretrained model gives exactly its own logits at step 0. ``roles=None`` skips the table altogether.

Attention masks, worked example. Without a cache a query at chunk index i sees chunk keys j <= i with valid[j].
With a cache, sequence b's valid new tokens are written to slots lengths[b], lengths[b] + 1, ... in chunk order,
and a query in slot s sees every filled slot <= s. For lengths = [3, 0] and valid = [[1, 1, 0], [1, 1, 1]]:
row 0 writes slots 3, 4 (its padding is dropped, not written) and its queries see slots 0..3 and 0..4; row 1 writes
slots 0, 1, 2. Slot order, not position, is the causal order; positions only drive the rotary embedding.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from envace_jax.model import attention, kvcache, paged
from envace_jax.model.config import ModelConfig
from envace_jax.model.kvcache import KVCache, gather_levels, init_cache  # noqa: F401  (re-exported: transformer.KVCache)

Params = Any


def _param(module: nn.Module, name: str, init, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> jax.Array:
  """A parameter carrying logical-axis names (see sampling/sharding.py for the mesh rules)."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, module.config.param_dtype)


_dense_init = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
  """x / rms(x) * scale over the last axis, computed in float32 (as Llama/Qwen do), cast back to x's dtype."""

  config: ModelConfig
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis_name,))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.rms_norm_eps)
    return scale.astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """float32[H / 2] inverse frequencies of the rotary embedding, with Llama-3 or linear scaling if configured.

  Source: Su et al. 2021 (RoFormer); the scaling rules are Hugging Face's ``_compute_llama3_parameters`` and
  ``_compute_linear_scaling_rope_parameters``.
  """
  h = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  if not config.rope_scaling:
    return inv_freq
  scaling = dict(config.rope_scaling)
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind == "linear":
    return inv_freq / scaling["factor"]
  if kind == "llama3":
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)
  return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates x: dtype[B, T, heads, H] by positions int32[B, T] (Hugging Face's rotate-half layout)."""
  angles = positions[:, :, None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


# Query-block size for attention over long self-contained sequences (no cache): see Attention.
ATTENTION_BLOCK = 512
# Key-block size for a multi-token chunk attending over a long cache (prefill; `_attend_key_blocks`), used when it
# attends over more than two blocks. Prefill of SmolLM2 at context 4096 on a 2-core CPU (tok/s, best of 3,
# interleaved): dense 244, blocks of 512: 294, 256: 341, 128: 312; at context 256 the dense path is faster.
KEY_BLOCK = 256


def _attend(q_bkgth, k_bkhs, v_bksh, mask_bts, head_dim: int):
  """Softmax attention: q [B, K, G, T, H] over keys [B, K, H, S] and values [B, K, S, H], mask bool[B, T, S]."""
  scores_bkgts = jnp.einsum("bkgth,bkhs->bkgts", q_bkgth, k_bkhs, preferred_element_type=jnp.float32)
  scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts * (head_dim**-0.5), kvcache.MASKED)
  probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(q_bkgth.dtype)
  return jnp.einsum("bkgts,bksh->bkgth", probs_bkgts, v_bksh)


def _static_loops() -> bool:
  """Whether the key-block loops (`_attention_part`) run a static trip count: on every backend but the CPU
  (`attention.current_backend`, so an `attention.backend` block traces another backend's loops). A ``fori_loop``
  whose bound is read from data lowers to a ``while`` whose condition XLA:GPU copies to the host each iteration; with
  Python bounds it lowers to a ``scan``. The CPU keeps the data-dependent bound, which skips the blocks past the last
  one any query sees."""
  return attention.current_backend() != "cpu"


def _key_blocks(q_len: int, kv_len: int) -> int | None:
  """The key block of a multi-token chunk over ``kv_len`` cached slots (`KEY_BLOCK`, when it attends over more than
  two blocks and they tile the slots), or None: one matmul (a decode step, T == 1, always)."""
  if q_len > 1 and kv_len > 2 * KEY_BLOCK and kv_len % KEY_BLOCK == 0:
    return KEY_BLOCK
  return None


def _attention_part(
  q_bk_h, k_bkhs, v_bksh, visible, scale: float, block: int | None = None, static: bool | None = None
):
  """`kvcache.softmax_part`'s triple of the queries over one key set, to merge with other sets' (`kvcache.combine`):
  as one matmul, or given ``block``, one key block of ``block`` slots at a time with a running max and sum (the online
  softmax of FlashAttention, Dao et al. 2022), so that the float32 scores alive are [B, K, *Q, block], not
  [B, K, *Q, S].

  Args:
    q_bk_h: dtype[B, K, *Q, H], one or two query axes Q (`_attend`'s [G, T], `_attend_prefix`'s [m*G*T]).
    k_bkhs: dtype[B, K, H, S] and v_bksh: dtype[B, K, S, H] (S a multiple of ``block``), read in their stored layout.
    visible: bool, broadcastable to [B, K, *Q, S]: which keys each query sees.
    scale: multiplies the scores (head_dim**-0.5).
    block: None, or the key block (`_key_blocks`).
    static: loop over all S / block blocks, masked (True), or only up to the last block any query sees (False: a
      trip count read from data); None: `_static_loops`. The results are the same either way (a block no query sees
      adds exact zeros).
  Returns:
    (float32 max [B, K, *Q], float32 sum [B, K, *Q], float32 weighted values [B, K, *Q, H]); a query that sees no
    key gets (``kvcache.MASKED``, 0, 0).
  """
  mid = "gt"[: q_bk_h.ndim - 3]
  score_spec, value_spec = f"bk{mid}h,bkhs->bk{mid}s", f"bk{mid}s,bksh->bk{mid}h"
  if block is None:
    scores = jnp.einsum(score_spec, q_bk_h, k_bkhs, preferred_element_type=jnp.float32) * scale
    return kvcache.softmax_part(scores, visible, v_bksh, value_spec)
  s = k_bkhs.shape[-1]
  last_axis = visible.ndim - 1

  def body(j, carry):  # carry: the triple over the blocks so far
    k_blk = jax.lax.dynamic_slice_in_dim(k_bkhs, j * block, block, axis=3)
    v_blk = jax.lax.dynamic_slice_in_dim(v_bksh, j * block, block, axis=2)
    seen = jax.lax.dynamic_slice_in_dim(visible, j * block, block, axis=last_axis)
    scores = jnp.einsum(score_spec, q_bk_h, k_blk, preferred_element_type=jnp.float32) * scale
    return kvcache.combine(carry, kvcache.softmax_part(scores, seen, v_blk, value_spec))

  rows = q_bk_h.shape[:-1]
  init = (
    jnp.full(rows, kvcache.MASKED, jnp.float32),
    jnp.zeros(rows, jnp.float32),
    jnp.zeros(q_bk_h.shape, jnp.float32),
  )
  if _static_loops() if static is None else static:
    return jax.lax.fori_loop(0, s // block, body, init)
  seen = jnp.any(visible, axis=tuple(range(last_axis)))  # [S]: slots some query attends to
  last = jnp.max(jnp.where(seen, jnp.arange(s), -1))
  return jax.lax.fori_loop(0, (last + block) // block, body, init)


def _online_softmax(q_bkgth, k_bkhs, v_bksh, mask_bts, scale: float, block: int):
  """Softmax attention one key block of ``block`` slots at a time (`_attention_part`).

  Shapes as `_attend`'s, S a multiple of ``block``. Returns (float32 out [B, K, G, T, H], float32 log-sum-exp of the
  scaled scores [B, K, G, T]); a query that sees no key gets out 0 and log-sum-exp ``kvcache.MASKED``.
  """
  best, total, acc = _attention_part(q_bkgth, k_bkhs, v_bksh, mask_bts[:, None, None], scale, block)
  lse = jnp.where(total > 0, best + jnp.log(jnp.where(total > 0, total, 1.0)), kvcache.MASKED)
  return acc / jnp.where(total > 0, total, 1.0)[..., None], lse


def _attend_key_blocks(q_bkgth, k_bkhs, v_bksh, mask_bts, head_dim: int, block: int):
  """`_attend` one key block at a time (`_online_softmax`): the temporaries are [B, K, G, T, block] instead of
  [B, K, G, T, S], and a chunk early in a long cache reads only the filled blocks. A query that sees no key gets zeros
  (padding; `_attend` gives the mean of the values there: both are meaningless and never used)."""
  out, _ = _online_softmax(q_bkgth, k_bkhs, v_bksh, mask_bts, head_dim**-0.5, block)
  return out.astype(q_bkgth.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled_attention(q_bkgth, k_bkhs, v_bksh, mask_bts, head_dim: int, q_block: int, k_block: int):
  """Differentiable attention of a long self-contained sequence (training rows), tile by tile: the forward and the
  backward hold one [B, K, G, q_block, k_block] tile of scores at a time, not a layer's [.., T, T] scores and
  probabilities (the backward of FlashAttention, Dao et al. 2022: it keeps each query's log-sum-exp and recomputes
  the tile's probabilities). Exact up to float rounding; tiles no query sees are skipped (the masked upper triangle
  of causal rows).

  Shapes as `_attend`'s with T a multiple of ``q_block`` and S of ``k_block``; a query that sees no key gets zeros.
  """
  return _tiled_forward(q_bkgth, k_bkhs, v_bksh, mask_bts, head_dim, q_block, k_block)[0]


def _tiled_forward(q_bkgth, k_bkhs, v_bksh, mask_bts, head_dim, q_block, k_block):
  b, k, g, t, h = q_bkgth.shape

  def body(i, carry):
    out, lse = carry
    q_i = jax.lax.dynamic_slice_in_dim(q_bkgth, i * q_block, q_block, axis=3)
    mask_i = jax.lax.dynamic_slice_in_dim(mask_bts, i * q_block, q_block, axis=1)
    out_i, lse_i = _online_softmax(q_i, k_bkhs, v_bksh, mask_i, head_dim**-0.5, k_block)
    out = jax.lax.dynamic_update_slice_in_dim(out, out_i.astype(out.dtype), i * q_block, axis=3)
    return out, jax.lax.dynamic_update_slice_in_dim(lse, lse_i, i * q_block, axis=3)

  init = (jnp.zeros_like(q_bkgth), jnp.zeros((b, k, g, t), jnp.float32))
  out, lse = jax.lax.fori_loop(0, t // q_block, body, init)
  return out, (q_bkgth, k_bkhs, v_bksh, mask_bts, out, lse)


def _tiled_backward(head_dim, q_block, k_block, residuals, d_out):
  q_bkgth, k_bkhs, v_bksh, mask_bts, out, lse = residuals
  t, s = q_bkgth.shape[3], k_bkhs.shape[3]
  scale = head_dim**-0.5
  # FlashAttention's D_i = sum_h dO_ih O_ih, so that dS = P * (dP - D) without the full softmax Jacobian.
  delta = jnp.einsum("bkgth,bkgth->bkgt", d_out, out, preferred_element_type=jnp.float32)
  b = mask_bts.shape[0]
  tiles = jnp.reshape(mask_bts, (b, t // q_block, q_block, s // k_block, k_block)).any(axis=(0, 2, 4))  # [nq, nk]
  rows = jnp.arange(t // q_block)

  def key_body(j, carry):  # one key block: its dK, dV over the query blocks that see it; dQ accumulated
    dq, dk, dv = carry
    k_j = jax.lax.dynamic_slice_in_dim(k_bkhs, j * k_block, k_block, axis=3)
    v_j = jax.lax.dynamic_slice_in_dim(v_bksh, j * k_block, k_block, axis=2)
    seen = jax.lax.dynamic_index_in_dim(tiles, j, axis=1, keepdims=False)
    first = jnp.min(jnp.where(seen, rows, t // q_block))
    last = jnp.max(jnp.where(seen, rows, -1))

    def query_body(i, inner):
      dq, dk_j, dv_j = inner
      at = i * q_block
      q_i = jax.lax.dynamic_slice_in_dim(q_bkgth, at, q_block, axis=3)
      do_i = jax.lax.dynamic_slice_in_dim(d_out, at, q_block, axis=3)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, at, q_block, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, at, q_block, axis=3)
      mask = jax.lax.dynamic_slice(mask_bts, (0, at, j * k_block), (b, q_block, k_block))[:, None, None]
      scores = jnp.einsum("bkgth,bkhs->bkgts", q_i, k_j, preferred_element_type=jnp.float32) * scale
      probs = jnp.where(mask, jnp.exp(scores - lse_i[..., None]), 0.0)
      dv_j += jnp.einsum("bkgts,bkgth->bksh", probs.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32)
      d_probs = jnp.einsum("bkgth,bksh->bkgts", do_i, v_j, preferred_element_type=jnp.float32)
      d_scores = (probs * (d_probs - delta_i[..., None]) * scale).astype(q_i.dtype)
      dq_i = jnp.einsum("bkgts,bkhs->bkgth", d_scores, k_j, preferred_element_type=jnp.float32)
      dq = jax.lax.dynamic_update_slice_in_dim(
        dq, jax.lax.dynamic_slice_in_dim(dq, at, q_block, axis=3) + dq_i, at, axis=3
      )
      dk_j += jnp.einsum("bkgts,bkgth->bkhs", d_scores, q_i, preferred_element_type=jnp.float32)
      return dq, dk_j, dv_j

    zeros_k = jnp.zeros(k_j.shape, jnp.float32)
    zeros_v = jnp.zeros(v_j.shape, jnp.float32)
    dq, dk_j, dv_j = jax.lax.fori_loop(first, last + 1, query_body, (dq, zeros_k, zeros_v))
    dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j.astype(dk.dtype), j * k_block, axis=3)
    return dq, dk, jax.lax.dynamic_update_slice_in_dim(dv, dv_j.astype(dv.dtype), j * k_block, axis=2)

  init = (jnp.zeros(q_bkgth.shape, jnp.float32), jnp.zeros_like(k_bkhs), jnp.zeros_like(v_bksh))
  dq, dk, dv = jax.lax.fori_loop(0, s // k_block, key_body, init)
  return dq.astype(q_bkgth.dtype), dk, dv, None


_tiled_attention.defvjp(_tiled_forward, _tiled_backward)


def _attend_prefix(q_bkgth, k_pkhs, v_pksh, visible_ps, head_dim: int, block: int | None = None):
  """The queries' share of attention over a shared prefix: rows b*m .. b*m+m-1 (m = B / P) all read prefix row b,
  as one [m*G*T, H] x [H, S] matmul per (prefix, KV head), so the prefix's keys and values are read once for its m
  rows; given ``block`` (`_key_blocks`), one key block at a time (`_attention_part`).

  Args:
    q_bkgth: dtype[B, K, G, T, H]. k_pkhs: dtype[P, K, H, S], v_pksh: dtype[P, K, S, H], P dividing B.
    visible_ps: bool[P, S], the prefix slots its rows see (its filled ones). head_dim: H.
  Returns:
    `kvcache.softmax_part`'s triple, with leading axes [B, K, G, T].
  """
  b, k, g, t, h = q_bkgth.shape
  p = k_pkhs.shape[0]
  # The group's queries as one [P, K, m*G*T, H] operand, so both matmuls read the prefix in its stored layout (as
  # `_attend` does); an einsum over the 6-d query let XLA transpose (copy) the prefix's keys and values instead.
  q_pkqh = q_bkgth.reshape(p, b // p, k, g * t, h).transpose(0, 2, 1, 3, 4).reshape(p, k, -1, h)
  part = _attention_part(q_pkqh, k_pkhs, v_pksh, visible_ps[:, None, None, :], head_dim**-0.5, block)
  unflat = lambda x: x.reshape(p, k, b // p, g, t, *x.shape[3:]).swapaxes(1, 2).reshape(b, k, g, t, *x.shape[3:])  # noqa: E731
  return tuple(unflat(x) for x in part)


class Attention(nn.Module):
  """Grouped-query self-attention with optional q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3).

  ``mask``: an `attention.CausalMask` for self-attention without a cache, an `attention.CacheMask` over a cache (its
  ``dense`` bool[B, T, S], None for pages), or a bool[B, T, S]. `attention.select` picks the kernel per call (cuDNN
  on GPU, Pallas on TPU where they express it; model/attention.py); the branches after the kernels' are the
  reference.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x_btd, positions, layer, cache, write_slots, mask, prefixes=(), pages=None, shards=None):
    cfg = self.config
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dtype = x_btd.dtype
    q_weight_dnh = _param(self, "q_proj", _dense_init, (d, n, h), ("embed", "heads", "head_dim"))
    k_weight_dkh = _param(self, "k_proj", _dense_init, (d, k, h), ("embed", "kv_heads", "head_dim"))
    v_weight_dkh = _param(self, "v_proj", _dense_init, (d, k, h), ("embed", "kv_heads", "head_dim"))
    o_weight_nhd = _param(self, "o_proj", _dense_init, (n, h, d), ("heads", "head_dim", "embed"))
    q_btnh = jnp.einsum("btd,dnh->btnh", x_btd, q_weight_dnh.astype(dtype))
    k_btkh = jnp.einsum("btd,dkh->btkh", x_btd, k_weight_dkh.astype(dtype))
    v_btkh = jnp.einsum("btd,dkh->btkh", x_btd, v_weight_dkh.astype(dtype))
    if cfg.qkv_bias:
      q_btnh += _param(self, "q_bias", nn.initializers.zeros, (n, h), ("heads", "head_dim")).astype(dtype)
      k_btkh += _param(self, "k_bias", nn.initializers.zeros, (k, h), ("kv_heads", "head_dim")).astype(dtype)
      v_btkh += _param(self, "v_bias", nn.initializers.zeros, (k, h), ("kv_heads", "head_dim")).astype(dtype)
    if cfg.qk_norm:
      q_btnh = RMSNorm(cfg, axis_name="head_dim", name="q_norm")(q_btnh)
      k_btkh = RMSNorm(cfg, axis_name="head_dim", name="k_norm")(k_btkh)
    inv_freq = rope_inv_freq(cfg)
    q_btnh = apply_rope(q_btnh, positions, inv_freq)
    k_btkh = apply_rope(k_btkh, positions, inv_freq)

    b, t = x_btd.shape[:2]
    causal_valid = mask.valid if isinstance(mask, attention.CausalMask) else None
    chunk = mask if isinstance(mask, attention.CacheMask) else None
    mask = attention.dense(mask)
    backend = attention.current_backend()
    impl = attention.select(
      cfg.attention,
      backend,
      jnp.dtype(dtype).name,
      h,
      t,
      pages[0].shape[1] * cache.shape[1] if pages is not None else mask.shape[-1],
      cached=cache is not None,
      causal_mask=causal_valid is not None,
      prefix_levels=len(prefixes),
      paged=pages is not None,
    )
    k_bkth, v_bkth = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)
    if pages is not None:  # ``cache`` is this layer's page pool, ``write_slots`` its flat slots (`paged`)
      table, kv_lens, q_slots = pages
      cache = paged.write(cache, write_slots, k_btkh, v_btkh, shards)  # per shard on a mesh (`paged.Shards`)
    elif cache is not None:
      # Write the new keys/values into their slots (padding carries slot S and is dropped), then attend over the
      # whole cache. ``layer`` indexes a stacked cache; None means this layer's own arrays. The index arrays are
      # split by a slice, so for k[.., B, K, H, S] the written block is still laid out [B, K, T, H] (NumPy rules).
      k_cache, v_cache = cache
      rows = jnp.arange(b)[:, None, None]
      heads = jnp.arange(k)[None, :, None]
      slots = write_slots[:, None, :]
      k_where = (rows, heads, slice(None), slots)
      v_where = (rows, heads, slots)
      if layer is not None:
        k_where, v_where = (layer, *k_where), (layer, *v_where)
      k_cache = k_cache.at[k_where].set(k_bkth.astype(k_cache.dtype), mode="drop")
      v_cache = v_cache.at[v_where].set(v_bkth.astype(v_cache.dtype), mode="drop")
      cache = (k_cache, v_cache)
      if layer is not None:
        k_cache = jax.lax.dynamic_index_in_dim(k_cache, layer, axis=0, keepdims=False)
        v_cache = jax.lax.dynamic_index_in_dim(v_cache, layer, axis=0, keepdims=False)
      k_bkhs, v_bksh = k_cache.astype(dtype), v_cache.astype(dtype)
      attend = mask.shape[-1]  # the caller may attend over a prefix of the slots that holds every filled one
      if attend < k_bkhs.shape[-1]:
        k_bkhs, v_bksh = k_bkhs[..., :attend], v_bksh[:, :, :attend]
    else:
      k_bkhs, v_bksh = k_bkth.transpose(0, 1, 3, 2), v_bkth

    if impl == attention.PALLAS_TPU and cache is None:
      out_btnh = attention.tpu_flash(q_btnh, k_btkh, v_btkh, causal_valid)
    elif impl != attention.REFERENCE and cache is None:
      out_btnh = attention.dot_product(q_btnh, k_btkh, v_btkh, mask, impl, causal=True)
    elif (
      impl == attention.PALLAS_TPU
      and pages is not None
      and not prefixes
      and shards is None
      and paged.kernel_applies(backend, heads=(n, k, cache.dtype))
    ):  # pages alone: the ragged paged attention kernel reads them in place (it returns no log-sum-exp to merge)
      out_btnh = paged.kernel_attention(q_btnh, cache, *pages, chunk.valid)
    elif impl != attention.REFERENCE:  # over a cache: own slots or pages, the chunk, prefix levels (attention.py)
      if pages is not None:  # the rows' pages gathered into one contiguous view (attention.py says why)
        if shards is None:
          kv = jnp.take(cache, pages[0], axis=0, mode="clip")  # [B, W, Z, 2K, H]; P (no page): masked by length
        else:  # each shard gathers its rows' pages from its own block: no page leaves its device
          local = lambda pool, table: jnp.take(pool, shards.local(table, cache.shape[0]), axis=0, mode="clip")  # noqa: E731
          kv = shards.map(local, cache, pages[0])
        kv = kv.reshape(b, -1, k, 2, h).astype(dtype)
        own_k, own_v = kv[:, :, :, 0], kv[:, :, :, 1]
      else:
        own_k, own_v = k_bkhs.transpose(0, 3, 1, 2), v_bksh.swapaxes(1, 2)
      if t == 1:  # the new token is in the own slots: one part over them
        parts = [attention.rows_part(impl, q_btnh, own_k, own_v, chunk.lengths + chunk.valid[:, 0])]
      else:  # the slots filled before, and the chunk over itself
        parts = [attention.rows_part(impl, q_btnh, own_k, own_v, chunk.lengths)]
        parts.append(attention.chunk_part(impl, q_btnh, k_btkh, v_btkh, chunk.valid))
      for pk, pv, seen in prefixes:
        lengths = jnp.sum(seen, axis=1, dtype=jnp.int32)
        parts.append(
          attention.rows_part(
            impl, q_btnh, pk.transpose(0, 3, 1, 2).astype(dtype), pv.swapaxes(1, 2).astype(dtype), lengths
          )
        )
      out_btnh = attention.merge(parts, dtype)
    if impl != attention.REFERENCE:
      return out_btnh.reshape(b, t, n * h) @ o_weight_nhd.reshape(n * h, d).astype(dtype), cache

    q_bkgth = q_btnh.reshape(b, t, k, cfg.num_groups, h).transpose(0, 2, 3, 1, 4)
    block = ATTENTION_BLOCK
    if pages is not None:  # own pages and each shared prefix attended apart, merged by log-sum-exp
      parts = [paged.attention_part(q_bkgth, cache, table, kv_lens, q_slots, shards, static=_static_loops())]
      parts += [
        _attend_prefix(q_bkgth, pk.astype(dtype), pv.astype(dtype), seen, h, _key_blocks(t, pk.shape[-1]))
        for pk, pv, seen in prefixes
      ]
      out_bkgth = kvcache.merge_parts(parts, dtype)
    elif prefixes:  # own slots and each shared prefix attended apart, merged by log-sum-exp
      parts = [_attention_part(q_bkgth, k_bkhs, v_bksh, mask[:, None, None], h**-0.5, _key_blocks(t, k_bkhs.shape[-1]))]
      parts += [
        _attend_prefix(q_bkgth, pk.astype(dtype), pv.astype(dtype), seen, h, _key_blocks(t, pk.shape[-1]))
        for pk, pv, seen in prefixes
      ]
      out_bkgth = kvcache.merge_parts(parts, dtype)
    elif cache is None and t > block and t % block == 0:
      # Long self-contained sequences (training rows): tile by tile, skipping the tiles of the masked upper triangle,
      # one tile of scores alive at a time in the forward and the backward.
      out_bkgth = _tiled_attention(q_bkgth, k_bkhs, v_bksh, mask, h, block, math.gcd(block, KEY_BLOCK))
    elif cache is not None and _key_blocks(t, k_bkhs.shape[-1]):
      out_bkgth = _attend_key_blocks(q_bkgth, k_bkhs, v_bksh, mask, h, KEY_BLOCK)
    else:
      out_bkgth = _attend(q_bkgth, k_bkhs, v_bksh, mask, h)
    # As one [B, T, N*H] @ [N*H, D] matmul: an einsum over (n, h) let XLA transpose the weight (a copy of o_proj
    # per layer and step) to match the activations' head order, rather than the other way round.
    out_btf = out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n * h)
    out_btd = out_btf @ o_weight_nhd.reshape(n * h, d).astype(dtype)
    return out_btd, cache


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_btd):
    cfg, dtype = self.config, x_btd.dtype
    gate_df = _param(self, "gate_proj", _dense_init, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))
    up_df = _param(self, "up_proj", _dense_init, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))
    down_fd = _param(self, "down_proj", _dense_init, (cfg.mlp_dim, cfg.d_model), ("mlp", "embed"))
    hidden_btf = jax.nn.silu(x_btd @ gate_df.astype(dtype)) * (x_btd @ up_df.astype(dtype))
    return hidden_btf @ down_fd.astype(dtype)


class DecoderLayer(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). Scanned over layers (params stacked on axis 0)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, carry, layer, positions, write_slots, mask, prefixes=(), pages=None, shards=None):
    x_btd, cache = carry
    attn_out, cache = Attention(self.config, name="attn")(
      RMSNorm(self.config, name="attn_norm")(x_btd), positions, layer, cache, write_slots, mask, prefixes, pages, shards
    )
    x_btd = x_btd + attn_out
    x_btd = x_btd + Mlp(self.config, name="mlp")(RMSNorm(self.config, name="mlp_norm")(x_btd))
    return (x_btd, cache), None


def _trace_settings() -> tuple:
  """What a layer's trace reads besides its arguments: the attention backend (`attention.current_backend`), the
  block sizes and the loops' kind (module globals that tests set). Part of `_decoder_layer`'s key, so a change of any
  of them traces the layer anew."""
  return attention.current_backend(), KEY_BLOCK, ATTENTION_BLOCK, _static_loops()


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _decoder_layer(config, shards, settings, layer_params, carry, positions, write_slots, mask, prefixes, pages):
  """One `DecoderLayer` of the per-layer layout as its own jitted function: the L calls of one forward share a single
  trace and a single lowered function, so tracing and lowering a sampler program costs about one layer's, not L
  layers' (SmolLM2's 30: a prefill program's trace 0.50 -> 0.15 s, experiments/results/2026-12-06_programs_per_run.md);
  XLA inlines the calls, so the compiled program and its outputs are the unrolled one's. ``settings``
  (`_trace_settings`, read at trace time) is part of the key, so an `attention.backend` block or a changed block size
  gets its own trace; inside an `attention.recording` block the layers are traced one by one instead, so each records
  its call.

  Returns:
    (x dtype[B, T, D], the layer's cache after the write: its pool, or its (k, v)).
  """
  (x_btd, written), _ = DecoderLayer(config).apply(
    {"params": layer_params}, carry, None, positions, write_slots, mask, prefixes, pages, shards
  )
  return x_btd, written


class Transformer(nn.Module):
  """The decoder. ``__call__(tokens, roles, positions, cache, valid) -> (logits, cache)``; see the module doc."""

  config: ModelConfig

  @nn.compact
  def __call__(
    self,
    tokens,
    roles=None,
    positions=None,
    cache: KVCache | None = None,
    valid=None,
    logits_index=None,
    attend_len=None,
  ):
    cfg = self.config
    b, t = tokens.shape
    dtype = jnp.dtype(cfg.dtype)
    if valid is None:
      valid = jnp.ones((b, t), bool)
    valid = valid.astype(bool)
    # Slot (cache) or chunk index (no cache) of each valid token, in chunk order.
    rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    pages = shards = None
    if isinstance(cache, paged.PagedKVCache):
      shards = cache.shards  # a paged cache split over a mesh's batch axes: its pages written and read per shard
      if cfg.scan_layers:
        raise ValueError("a PagedKVCache needs the per-layer layout (scan_layers=False).")
      pool_pages, page_size = cache.pools[0].shape[:2]
      q_slots = paged.row_slots(cache.lengths, valid)
      write_slots = paged.flat_slots(cache.table, q_slots, valid, pool_pages, page_size)
      new_lengths = cache.lengths + valid.sum(axis=1, dtype=jnp.int32)
      read = cache.table if attend_len is None else cache.trimmed(min(attend_len, cache.capacity)).table
      pages, levels = (read, new_lengths, q_slots), cache.levels()
      mask = attention.CacheMask(dense=None, lengths=cache.lengths, valid=valid)
      default_positions = cache.offsets()[:, None] + cache.lengths[:, None] + rank
      layer_cache = (cache.pools, None)  # a layer's pool holds its keys and values
    elif cache is not None:
      write_slots = jnp.where(valid, cache.lengths[:, None] + rank, cache.capacity)  # S: dropped on write
      new_lengths = cache.lengths + valid.sum(axis=1, dtype=jnp.int32)
      slots = jnp.arange(cache.capacity if attend_len is None else min(attend_len, cache.capacity))
      mask = (slots[None, None, :] <= write_slots[:, :, None]) & (slots[None, None, :] < new_lengths[:, None, None])
      mask = attention.CacheMask(dense=mask, lengths=cache.lengths, valid=valid)
      levels = cache.levels()
      if levels and cfg.scan_layers:
        raise ValueError("a KVCache with a prefix needs the per-layer layout (scan_layers=False).")
      default_positions = cache.offsets()[:, None] + cache.lengths[:, None] + rank
      layer_cache = (cache.k, cache.v)
    else:
      write_slots, levels = None, []
      mask = attention.CausalMask.of(valid)
      default_positions = rank
      layer_cache = None
    if positions is None:
      positions = jnp.maximum(default_positions, 0)

    embed_vd = _param(self, "embed", _dense_init, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
    x_btd = jnp.take(embed_vd, tokens, axis=0).astype(dtype)
    role_embed_rd = _param(self, "role_embed", nn.initializers.zeros, (cfg.num_roles, cfg.d_model), ("roles", "embed"))
    if roles is not None:
      x_btd = x_btd + jnp.take(role_embed_rd, roles, axis=0).astype(dtype)

    if cfg.scan_layers:
      layers = nn.scan(
        DecoderLayer,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )(cfg, name="layers")
      (x_btd, layer_cache), _ = layers((x_btd, layer_cache), jnp.arange(cfg.num_layers), positions, write_slots, mask)
    else:
      per_layer = []
      seen = [jnp.arange(c.capacity)[None, :] < c.lengths[:, None] for c in levels]  # [P, S] per prefix level
      settings = _trace_settings()  # the same for every layer of this trace
      for i in range(cfg.num_layers):
        if pages is not None:
          carry = (x_btd, layer_cache[0][i])
        else:
          carry = (x_btd, None if cache is None else (layer_cache[0][i], layer_cache[1][i]))
        prefixes = tuple((c.k[i], c.v[i], visible) for c, visible in zip(levels, seen, strict=True))
        if self.is_initializing() or attention.is_recording():
          layer = DecoderLayer(cfg, name=f"layers_{i}")
          (x_btd, written), _ = layer(carry, None, positions, write_slots, mask, prefixes, pages, shards)
        else:  # every layer runs one traced function (`_decoder_layer`)
          layer_params = nn.meta.unbox(self.variables["params"][f"layers_{i}"])
          x_btd, written = _decoder_layer(
            cfg, shards, settings, layer_params, carry, positions, write_slots, mask, prefixes, pages
          )
        per_layer.append(written)
      if pages is not None:
        layer_cache = tuple(per_layer), None
      elif cache is not None:
        layer_cache = tuple(c[0] for c in per_layer), tuple(c[1] for c in per_layer)
    if logits_index is not None:  # only the positions asked for reach the [D, V] head (prefill needs one per row)
      x_btd = jnp.take_along_axis(x_btd, logits_index[:, :, None], axis=1)
    x_btd = RMSNorm(cfg, name="final_norm")(x_btd)
    if cfg.tie_embeddings:
      logits_btv = jnp.einsum("btd,vd->btv", x_btd, embed_vd.astype(dtype), preferred_element_type=jnp.float32)
    else:
      head_dv = _param(self, "lm_head", _dense_init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
      logits_btv = jnp.einsum("btd,dv->btv", x_btd, head_dv.astype(dtype), preferred_element_type=jnp.float32)
    if pages is not None:
      cache = cache.replace(pools=layer_cache[0], lengths=new_lengths)
    elif cache is not None:
      cache = KVCache(k=layer_cache[0], v=layer_cache[1], lengths=new_lengths, prefix=cache.prefix)
    return logits_btv.astype(jnp.float32), cache


def unstack_layers(params: Params) -> Params:
  """A scanned model's params (``layers/...`` stacked on axis 0) as separate ``layers_0 .. layers_{L-1}`` trees,
  for a config with ``scan_layers=False``. Trees already unstacked are returned as they are."""
  if "layers" not in params:
    return params
  stacked = params["layers"]
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  out = {name: value for name, value in params.items() if name != "layers"}
  out.update({f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)})
  return out


def stack_layers(params: Params) -> Params:
  """Inverse of ``unstack_layers``: ``layers_0 .. layers_{L-1}`` -> ``layers`` stacked on a leading axis."""
  names = sorted((n for n in params if n.startswith("layers_")), key=lambda n: int(n.split("_")[1]))
  if not names:
    return params
  out = {name: value for name, value in params.items() if not name.startswith("layers_")}
  out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[n] for n in names))
  return out


def _is_layer_tree(x: Any) -> bool:
  return isinstance(x, dict) and ("layers" in x or "layers_0" in x)


def stack_tree(tree: Any) -> Any:
  """`stack_layers` applied to every parameter-shaped dict in ``tree`` (a parameter tree, a per-role mapping of
  them, an optimizer state whose moments mirror the parameters): the scanned (training and checkpoint) layout."""
  return jax.tree.map(lambda x: stack_layers(x) if _is_layer_tree(x) else x, tree, is_leaf=_is_layer_tree)


def unstack_tree(tree: Any) -> Any:
  """`unstack_layers` applied to every parameter-shaped dict in ``tree`` (see `stack_tree`): the sampler's layout,
  which is also the train state's (samplers read the train state's arrays without a copy)."""
  return jax.tree.map(lambda x: unstack_layers(x) if _is_layer_tree(x) else x, tree, is_leaf=_is_layer_tree)


# `init_params`' host copies of small random models, by (config, key): tests and smoke runs build the same random
# model many times per process (the test suite: 207 builds, 82 of its ~1,600 worker-seconds, 2026-12-07), and each
# eager build runs flax's init, whose layer scan compiles anew every time.
_INIT_MEMO: collections.OrderedDict[tuple, Params] = collections.OrderedDict()
_INIT_MEMO_ENTRIES = 4
_INIT_MEMO_MAX_BYTES = 64 << 20  # the tiny presets are ~13 MB; a real-sized random model is built once
_INIT_MEMO_LOCK = threading.Lock()


def init_params(config: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (normal(0.02) projections, unit norms, zero role embeddings), as plain arrays.

  Outside a trace, an uncommitted concrete key's result for a model of at most 64 MiB is kept on the host (the last
  4, by config, key and ``jax_threefry_partitionable``), so the same call again returns new device arrays with the
  same values, bit for bit, without running the init.

  Args:
    key: a ``jax.random.key``.
  Returns:
    The parameter tree: ``embed[V, D]``, ``role_embed[R, D]``, ``layers/...`` stacked on a leading L axis (or
    ``layers_0 .. layers_{L-1}`` when ``config.scan_layers`` is False), ``final_norm/scale[D]`` and, when untied,
    ``lm_head[D, V]``.
  """
  memo = None
  # None for a committed key (a fresh init follows its device) or under a trace (a concrete key closed over by a jit:
  # its data is a tracer there, and the init is traced, not baked in)
  data = None if isinstance(key, jax.core.Tracer) or getattr(key, "committed", False) else jax.random.key_data(key)
  if data is not None and not isinstance(data, jax.core.Tracer):
    memo = (config, str(jax.random.key_impl(key)), data.tobytes(), jax.config.jax_threefry_partitionable)
  if memo is not None:
    with _INIT_MEMO_LOCK:
      host = _INIT_MEMO.get(memo)
      if host is not None:
        _INIT_MEMO.move_to_end(memo)
    if host is not None:
      return jax.tree.map(lambda x: jnp.array(x, copy=True), host)  # not the host copy: donated later
  tokens = jnp.zeros((1, 1), jnp.int32)
  params = nn.unbox(Transformer(config).init(key, tokens, tokens)["params"])
  if memo is not None and sum(x.nbytes for x in jax.tree.leaves(params)) <= _INIT_MEMO_MAX_BYTES:
    host = jax.tree.map(np.array, params)  # a copy: the arrays returned may be donated
    with _INIT_MEMO_LOCK:
      _INIT_MEMO[memo] = host
      while len(_INIT_MEMO) > _INIT_MEMO_ENTRIES:
        _INIT_MEMO.popitem(last=False)
  return params


# `logical_axes` and `abstract_params` trace the model's initialiser (≈0.1-0.3 s each); the shardings of the sampler,
# the train state and the weights loaders ask for them many times per run with the same config. Their trees are kept
# per (config, jax_enable_x64) and each call gets its own copy of the nesting (the leaves are immutable).
def _copy_nesting(tree):
  return {k: _copy_nesting(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


@functools.lru_cache(maxsize=16)
def _logical_axes(config: ModelConfig, x64: bool) -> Params:
  tokens = jnp.zeros((1, 1), jnp.int32)
  abstract = jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0), tokens, tokens))
  return nn.get_partition_spec(abstract)["params"]


@functools.lru_cache(maxsize=16)
def _abstract_params(config: ModelConfig, x64: bool) -> Params:
  return jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))


def logical_axes(config: ModelConfig) -> Params:
  """A tree like ``init_params``' whose leaves are ``PartitionSpec``s of logical axis names (no compute)."""
  return _copy_nesting(_logical_axes(config, jax.config.jax_enable_x64))


def abstract_params(config: ModelConfig) -> Params:
  """``jax.eval_shape`` of ``init_params(config, key)``: a tree of ``jax.ShapeDtypeStruct`` (no compute)."""
  return _copy_nesting(_abstract_params(config, jax.config.jax_enable_x64))


def apply(
  config: ModelConfig,
  params: Params,
  tokens: jax.Array,
  roles: jax.Array | None = None,
  positions: jax.Array | None = None,
  cache: KVCache | None = None,
  valid: jax.Array | None = None,
  logits_index: jax.Array | None = None,
  attend_len: int | None = None,
) -> tuple[jax.Array, KVCache | None]:
  """One forward pass. See the module docstring for shapes and masking.

  Args:
    params: the tree from ``init_params`` or ``weights.load_*``.
    tokens: int32[B, T].
    roles: int32[B, T] role ids (roles.Role), or None to add no role embedding.
    positions: int32[B, T] rotary positions; default: each valid token's index in its sequence (continuing from
      ``cache.lengths`` when a cache is given).
    cache: a KVCache (or a `paged.PagedKVCache`) to append the valid tokens to and attend over, or None for a
      self-contained forward.
    valid: bool[B, T], False for padding; default all True.
    logits_index: int32[B, I] chunk indices to compute logits at (the head costs T*D*V: prefill wants one per
      row); default all T.
    attend_len: with a cache: attend over slots [0, attend_len) only (a static int that must cover every row's
      filled slots after this call: the sampler passes a bucketed bound), so attention costs what the history
      holds, not the cache's capacity. Default: every slot.
  Returns:
    (logits float32[B, T or I, V], the updated cache or None). Logits at padding positions are meaningless.
  """
  return Transformer(config).apply({"params": params}, tokens, roles, positions, cache, valid, logits_index, attend_len)


def param_count(params: Params) -> int:
  """Total number of parameter elements."""
  return sum(x.size for x in jax.tree.leaves(params))
