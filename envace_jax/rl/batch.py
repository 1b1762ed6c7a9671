"""Training rows padded into static-shape arrays: ``TrainBatch``, ``collate`` and micro-batches (host numpy).

Every generation of a trajectory view is one ``TrainingRow`` (rehearsal/trajectory.py): one packed token sequence
with the role of every token, a loss mask and the sampler's logprobs. ``collate`` pads B rows to a bucketed length
T and lists each row's trained positions (I of them, bucketed) so only those reach the vocabulary head;
``split_micro_batches`` cuts the rows into K micro-batches of exactly M rows, so the update's shapes stay static.
Frozen roles keep their tokens as context and get loss mask 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import struct

from envace_jax.rehearsal.trajectory import TrainingRow


@struct.dataclass
class TrainBatch:
  """Padded training rows. ``collate`` gives [B, ...] arrays; ``split_micro_batches`` adds a leading K axis.

  Attributes (per row; B rows, T tokens, I trained-token slots):
    tokens: int32[B, T] ids, padded with pad_id.
    roles: int32[B, T] role id of every token.
    valid: bool[B, T] False on padding (and on every token of a padding row).
    loss_mask: bool[B, T] trained tokens: the row's generated tokens, of a trained role, of a valid trajectory
      (position 0 is never trained: nothing predicts it).
    old_logprobs: float32[B, T] the sampler's logprob of each token (meaningful where loss_mask).
    ref_logprobs: float32[B, T] the reference policy's logprobs (0 unless ``with_ref_logprobs`` filled them).
    advantages: float32[B] the row's advantage (0 for padding rows and frozen roles).
    row_role: int32[B] the role that generated in the row (padding rows: the micro-batch's role, or -1).
    target_index: int32[B, I] positions t of the trained tokens, ascending (padding: 0). The logits at t - 1
      predict token t, so only these I positions reach the vocabulary head.
    target_mask: bool[B, I] True on real entries of target_index.
  """

  tokens: Any
  roles: Any
  valid: Any
  loss_mask: Any
  old_logprobs: Any
  ref_logprobs: Any
  advantages: Any
  row_role: Any
  target_index: Any
  target_mask: Any

  @property
  def num_tokens(self) -> int:
    """Trained tokens in the batch (host)."""
    return int(np.sum(np.asarray(self.target_mask)))


def bucket_length(n: int, step: int, minimum: int = 16) -> int:
  """n rounded up to a power of two (at least ``minimum``) while below ``step``, else to a multiple of ``step``."""
  if n <= step:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())
  return -(-int(n) // step) * step


def collate(
  rows: Sequence[TrainingRow],
  advantages: Sequence[float] | np.ndarray,
  *,
  trained_roles: Sequence[int],
  row_valid: Sequence[bool] | np.ndarray | None = None,
  length_bucket: int = 512,
  pad_id: int = 0,
) -> TrainBatch:
  """Pads rows into a ``TrainBatch`` of host numpy arrays [B, T].

  T is ``bucket_length(max row length, length_bucket)`` and I (at most T) ``bucket_length(most trained tokens in a
  row, length_bucket)``.

  Args:
    rows: B training rows (``TrainingRow``: one packed view of one trajectory).
    advantages: float[B], each row's advantage (``advantages_nr[row.trajectory, row.role]``).
    trained_roles: role ids that are trained; a row of another role, and any token whose role id is not trained,
      keeps its tokens (they are context) but gets loss_mask 0: frozen roles contribute nothing to the loss.
    row_valid: bool[B]; False rows (e.g. of an invalid trajectory) are kept as fully masked rows. Default all True.
    length_bucket: see ``bucket_length``.
    pad_id: the id written into padding.
  Raises:
    ValueError: no rows, or advantages / row_valid not of length B.
  """
  b = len(rows)
  if b == 0:
    raise ValueError("collate: no rows; a step needs at least one training row.")
  adv = np.asarray(advantages, np.float32).reshape(-1)
  row_valid = np.ones(b, bool) if row_valid is None else np.asarray(row_valid, bool).reshape(-1)
  if adv.shape != (b,) or row_valid.shape != (b,):
    raise ValueError(f"collate: {b} rows need {b} advantages and row_valid; got {adv.shape} and {row_valid.shape}.")
  t = bucket_length(max(len(r.tokens) for r in rows), length_bucket)
  trained = np.asarray(sorted(int(r) for r in trained_roles), np.int32)
  tokens = np.full((b, t), pad_id, np.int32)
  roles = np.zeros((b, t), np.int32)
  valid = np.zeros((b, t), bool)
  loss_mask = np.zeros((b, t), bool)
  old = np.zeros((b, t), np.float32)
  row_role = np.asarray([int(r.role) for r in rows], np.int32)
  for i, row in enumerate(rows):
    n = len(row.tokens)
    tokens[i, :n], roles[i, :n], valid[i, :n] = row.tokens, row.roles, True
    old[i, :n] = row.logprobs
    if row_valid[i] and row.role in trained:
      loss_mask[i, :n] = np.asarray(row.loss_mask, bool) & np.isin(roles[i, :n], trained)
  loss_mask[:, 0] = False
  adv = np.where(loss_mask.any(axis=1), adv, 0.0).astype(np.float32)
  counts = loss_mask.sum(axis=1)
  width = min(bucket_length(int(counts.max()), length_bucket), t)
  target_index = np.zeros((b, width), np.int32)
  target_mask = np.arange(width)[None, :] < counts[:, None]
  for i in range(b):
    target_index[i, : counts[i]] = np.flatnonzero(loss_mask[i])
  return TrainBatch(
    tokens=tokens,
    roles=roles,
    valid=valid,
    loss_mask=loss_mask,
    old_logprobs=old,
    ref_logprobs=np.zeros((b, t), np.float32),
    advantages=adv,
    row_role=row_role,
    target_index=target_index,
    target_mask=target_mask,
  )


def split_micro_batches(
  batch: TrainBatch, micro_batch_size: int, *, by_role: bool = False, num_micro_batches: int | None = None
) -> TrainBatch:
  """Splits a [B, ...] batch into K micro-batches of exactly ``micro_batch_size`` rows: [K, M, ...] host arrays.

  The last micro-batch (of each role, with ``by_role``) is filled with padding rows: valid and loss_mask all False,
  advantage 0, so they add nothing to any sum. Row order is kept within a role.

  Args:
    batch: from ``collate``.
    micro_batch_size: M.
    by_role: every micro-batch holds rows of one ``row_role`` (needed by mode "per_role"); padding rows take it.
    num_micro_batches: pad with all-padding micro-batches up to this K, so the step's shapes stay static.
  Raises:
    ValueError: micro_batch_size < 1, or the rows need more than num_micro_batches micro-batches.
  """
  if micro_batch_size < 1:
    raise ValueError(f"micro_batch_size={micro_batch_size}; it must be >= 1.")
  host = jax.tree.map(np.asarray, batch)
  row_role = host.row_role
  keys = sorted(set(row_role.tolist())) if by_role else [None]
  chunks: list[tuple[list[int], int]] = []  # (row indices, -1 for padding), role of the chunk
  for key in keys:
    idx = np.flatnonzero(row_role == key).tolist() if by_role else list(range(len(row_role)))
    for start in range(0, len(idx), micro_batch_size):
      piece = idx[start : start + micro_batch_size]
      chunks.append((piece + [-1] * (micro_batch_size - len(piece)), key if by_role else -1))
  if num_micro_batches is not None:
    if len(chunks) > num_micro_batches:
      raise ValueError(
        f"the batch needs {len(chunks)} micro-batches of {micro_batch_size} rows, more than "
        f"num_micro_batches={num_micro_batches}; raise it or the micro-batch size."
      )
    fill = keys[0] if by_role else -1
    chunks += [([-1] * micro_batch_size, fill)] * (num_micro_batches - len(chunks))
  index = np.asarray([c[0] for c in chunks], np.int64)  # [K, M]
  pad = index < 0
  safe = np.where(pad, 0, index)

  def take(x, fill):
    out = x[safe]
    return np.where(pad.reshape(pad.shape + (1,) * (x.ndim - 1)), np.asarray(fill, x.dtype), out)

  chunk_role = np.asarray([c[1] for c in chunks], np.int32)[:, None]
  return TrainBatch(
    tokens=take(host.tokens, 0),
    roles=take(host.roles, 0),
    valid=take(host.valid, False),
    loss_mask=take(host.loss_mask, False),
    old_logprobs=take(host.old_logprobs, 0.0),
    ref_logprobs=take(host.ref_logprobs, 0.0),
    advantages=take(host.advantages, 0.0),
    row_role=np.where(pad, chunk_role, host.row_role[safe]).astype(np.int32),
    target_index=take(host.target_index, 0),
    target_mask=take(host.target_mask, False),
  )
