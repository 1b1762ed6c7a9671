"""The training forward: logprobs of the trained tokens, with per-layer rematerialisation.

``target_logprobs`` runs the decoder and the vocabulary head only at the positions that predict trained tokens
(``TrainBatch.target_index``); ``recompute_logprobs`` lays them out like the sampler's logprobs.

Memory (compiled on CPU, SmolLM2-135M, float32, one row, loss and gradient): 4096 tokens with 2000 trained need
0.60 GiB of temporaries with remat and 7.5 GiB without; 6144 tokens with 6000 trained, 0.90 GiB vs 11.7 GiB. The
attention of a training row is tiled in its forward and backward (``transformer._tiled_attention``), so no layer holds
a T x T score matrix; what grows with T is every layer's saved input and one layer's recomputed activations.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from envace_jax.model import attention, transformer
from envace_jax.model.config import ModelConfig
from envace_jax.rl.batch import TrainBatch


def training_hidden(
  config: ModelConfig,
  params: Any,
  tokens: jax.Array,
  roles: jax.Array,
  valid: jax.Array,
  index: jax.Array,
  remat: bool,
  positions: jax.Array | None = None,
  segments: jax.Array | None = None,
  parents: jax.Array | None = None,
) -> jax.Array:
  """The decoder's final-normed hidden states at chosen positions, with per-layer rematerialisation.

  The same computation as ``transformer.apply(config, params, tokens, roles, valid=valid, logits_index=index)`` up
  to the vocabulary head (no cache; positions are each valid token's index), built from the transformer's own
  ``DecoderLayer`` and ``RMSNorm`` modules so each layer can sit inside its own ``jax.checkpoint``: the backward
  then keeps only every layer's input x [B, T, D] and recomputes one layer at a time.
  A single checkpoint around ``transformer.apply`` saves nothing: its backward recomputes every layer at once.
  ``tests/rl/test_grpo.py`` checks the parity with ``transformer.apply`` for every family switch and both layouts.

  Args:
    params: one tree, layers stacked (``layers``) or not (``layers_0 ..``: stacked here, one copy).
    tokens, roles: int32[B, T]; valid: bool[B, T].
    index: int32[B, I] positions whose hidden states are wanted.
    remat: checkpoint each layer.
    positions: int32[B, T] rotary positions; default: each valid token's index.
    segments, parents: int32[B, T] packed-row segments and their parents (``TrainBatch``): query q sees key k <= q
      iff valid[k] and segments[k] in (0, segments[q], parents[q]). Still lower-triangular, so the block-wise causal
      attention of long rows stays exact. Default (None): plain causal rows.
  Returns:
    dtype[B, I, D] (``config.dtype``).
  """
  dtype = jnp.dtype(config.dtype)
  valid = valid.astype(bool)
  if positions is None:
    positions = jnp.maximum(jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)
  mask = attention.CausalMask.of(valid)  # [B, T(query), T(key)]; the Pallas TPU kernel reads its structure
  if segments is not None:
    seen = (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None])
    if parents is not None:
      seen = seen | (segments[:, None, :] == parents[:, :, None])
    mask = mask.dense & seen
  x_btd = jnp.take(params["embed"], tokens, axis=0).astype(dtype)
  x_btd = x_btd + jnp.take(params["role_embed"], roles, axis=0).astype(dtype)
  layer = transformer.DecoderLayer(config)

  def run(x_btd, layer_params):
    (x_btd, _), _ = layer.apply({"params": layer_params}, (x_btd, None), None, positions, None, mask)
    return x_btd

  if remat:
    run = jax.checkpoint(run)
  # Always one scan over stacked layers: unrolled, XLA schedules the recomputations early and saves nothing.
  stacked = transformer.stack_layers(params)["layers"]  # a no-op for the scanned (training) layout
  x_btd, _ = jax.lax.scan(lambda x, p: (run(x, p), None), x_btd, stacked)
  x_bid = jnp.take_along_axis(x_btd, index[:, :, None], axis=1)
  return transformer.RMSNorm(config).apply({"params": params["final_norm"]}, x_bid)


def _head_logprobs(
  config: ModelConfig, params: Any, x_bid: jax.Array, targets_bi: jax.Array, chunk: int, remat: bool
) -> tuple[jax.Array, jax.Array]:
  """(logp, entropy) float32[B, I] of ``targets`` from hidden states, the [B, c, V] logits made c positions at a
  time (c = gcd(I, chunk)), each chunk rematerialised in the backward when ``remat``."""
  dtype = jnp.dtype(config.dtype)
  if config.tie_embeddings:
    weight, spec = params["embed"], "bcd,vd->bcv"
  else:
    weight, spec = params["lm_head"], "bcd,dv->bcv"

  def piece(weight, x_bcd, targets_bc):
    logits = jnp.einsum(spec, x_bcd, weight.astype(dtype), preferred_element_type=jnp.float32).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, targets_bc[..., None], axis=-1)[..., 0] - lse
    z, lse_c = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse)
    entropy = lse_c - jnp.sum(jnp.exp(z - lse_c[..., None]) * z, axis=-1)
    return logp, entropy

  b, i, d = x_bid.shape
  c = math.gcd(i, chunk)
  if c == i:
    return piece(weight, x_bid, targets_bi)
  if remat:
    piece = jax.checkpoint(piece)
  xs = x_bid.reshape(b, i // c, c, d).swapaxes(0, 1)
  ts = targets_bi.reshape(b, i // c, c).swapaxes(0, 1)
  _, (logp, entropy) = jax.lax.scan(lambda _, xt: (None, piece(weight, *xt)), None, (xs, ts))
  return logp.swapaxes(0, 1).reshape(b, i), entropy.swapaxes(0, 1).reshape(b, i)


def target_logprobs(
  config: ModelConfig, params: Any, batch: TrainBatch, remat: bool = False, head_chunk: int = 512
) -> tuple[jax.Array, jax.Array]:
  """Logprobs and policy entropies at the trained tokens of a [B, ...] batch.

  Only the I target positions reach the vocabulary head (the hidden state at ``source_index`` predicts the token at
  ``target_index``). Logits and their logsumexp are float32.

  Args:
    params: one parameter tree (either layer layout).
    batch: a TrainBatch with [B, ...] fields.
    remat: per-layer and per-head-chunk rematerialisation (only matters under differentiation).
    head_chunk: target positions per [B, c, V] logits block.
  Returns:
    (logp float32[B, I], entropy float32[B, I]); both meaningless where ``target_mask`` is False. The entropy
    H = logsumexp(z) - sum softmax(z) * z of the full next-token distribution carries no gradient.
  """
  x_bid = training_hidden(
    config,
    params,
    batch.tokens,
    batch.roles,
    batch.valid,
    batch.source_index,
    remat,
    positions=batch.positions,
    segments=batch.segments,
    parents=batch.parents,
  )
  targets = jnp.take_along_axis(batch.tokens, batch.target_index, axis=1)
  return _head_logprobs(config, params, x_bid, targets, head_chunk, remat)


_RECOMPUTE_FIELDS = tuple("tokens roles valid positions segments parents target_index source_index target_mask".split())


@functools.partial(jax.jit, static_argnames="config")
def _recompute(config, params, fields):
  unused = ("loss_mask", "old_logprobs", "ref_logprobs", "row_role", "target_advantages", "target_weights")
  batch = TrainBatch(**fields, **dict.fromkeys(unused))
  logp, _ = target_logprobs(config, params, batch)
  b = batch.tokens.shape[0]
  rows = jnp.arange(b)[:, None]
  values = jnp.where(batch.target_mask, logp, 0.0)
  return jnp.zeros(batch.tokens.shape, jnp.float32).at[rows, batch.target_index].add(values)


def recompute_logprobs(config: ModelConfig, params: Any, batch: TrainBatch) -> jax.Array:
  """Logprobs of the trained tokens under ``params``, in the row layout of ``batch.old_logprobs`` (jitted).

  Used for the step-0 check (equal to the sampler's logprobs) and for the reference policy. Packed rows stay packed:
  the result lines up with their ``old_logprobs`` and ``loss_mask``.

  Args:
    config: the model config (either layer layout of params works).
    params: one parameter tree (with a tree per role, pass that role's).
    batch: [B, ...] or [K, M, ...] TrainBatch.
  Returns:
    float32[..., T] with the same leading shape as ``batch.tokens``: logp of token t given what it attends to
    (tokens < t; in a packed suffix, the prefix and the suffix's earlier tokens) where ``loss_mask``, 0 elsewhere.
  """
  lead, t = batch.tokens.shape[:-1], batch.tokens.shape[-1]
  flat = lambda x: jnp.asarray(x).reshape(-1, x.shape[-1])
  out = _recompute(config, params, {name: flat(getattr(batch, name)) for name in _RECOMPUTE_FIELDS})
  return out.reshape(*lead, t)


def with_ref_logprobs(config: ModelConfig, ref_params: Any, batch: TrainBatch) -> TrainBatch:
  """``batch`` with ``ref_logprobs`` computed by a forward of the reference params (no gradient flows to them)."""
  return batch.replace(ref_logprobs=np.asarray(recompute_logprobs(config, ref_params, batch)))
