"""Training rows padded into static-shape arrays: ``TrainBatch``, ``collate`` and micro-batches (host numpy).

``collate`` pads B ``TrainingRow``s (rehearsal/trajectory.py) to a bucketed length T, packing rows that share a
prefix around it (exactly), and lists each row's trained positions (I of them, bucketed) so only those reach the
vocabulary head; ``split_micro_batches`` cuts the rows into K micro-batches of exactly M rows, so the update's shapes
stay static. Frozen roles keep their tokens as context and get loss mask 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import struct

from envace_jax.rehearsal.trajectory import TrainingRow, common_prefix_length
from envace_jax.sampling.sampler import next_pow2


@struct.dataclass
class TrainBatch:
  """Padded training rows. ``collate`` gives [B, ...] arrays; ``split_micro_batches`` adds a leading K axis.

  A row is either one ``TrainingRow`` or several rows of one role packed around their shared prefix (``collate``):
  prefix + suffix_1 + ... + suffix_G, or packed across groups a tree of depth two (``segments``, ``parents``).

  Attributes (per row; B rows, T tokens, I trained-token slots):
    tokens: int32[B, T] ids, padded with pad_id.
    roles: int32[B, T] role id of every token.
    valid: bool[B, T] False on padding (and on every token of a padding row).
    positions: int32[B, T] rotary position of every token (a plain row: its index; packed: a suffix continues at
      P, P + 1, ... after a prefix of P tokens, as in its own row; padding: 0).
    segments: int32[B, T] 0 for a plain row and a packed row's root (its shared prefix), s >= 1 for the packed
      parts after it, numbered in order.
    parents: int32[B, T] the segment that a token's segment continues, besides the root: 0 except for a suffix of a
      group packed across groups, whose parent is its group's own shared part. Query q sees key k <= q iff valid[k]
      and segments[k] in (0, segments[q], parents[q]).
    loss_mask: bool[B, T] trained tokens: the row's generated tokens, of a trained role, of a valid trajectory
      (position 0, and a packed row's prefix, are never trained).
    old_logprobs: float32[B, T] the sampler's logprob of each token (meaningful where loss_mask).
    ref_logprobs: float32[B, T] the reference policy's logprobs (0 unless ``with_ref_logprobs`` filled them).
    row_role: int32[B] the role that generated in the row (padding rows: the micro-batch's role, or -1).
    target_index: int32[B, I] positions t of the trained tokens, ascending (padding: 0). Only the hidden states at
      ``source_index`` reach the vocabulary head.
    source_index: int32[B, I] the position whose hidden state predicts token target_index: target_index - 1, but
      P - 1 (the prefix's last token) for the first token of a packed suffix (padding: 0).
    target_mask: bool[B, I] True on real entries of target_index.
    target_advantages: float32[B, I] the advantage of each trained token: that of the row (of a packed suffix: of
      the row it came from); 0 on padding, frozen roles and invalid rows.
    target_weights: float32[B, I] 1 / (trained tokens of the generation the token belongs to), 0 on padding: a
      generation is a maximal run of trained tokens of a ``TrainingRow`` (one sampler output: `View.record` writes
      its ids trained and the template's framing untrained around them), so each generation's weights sum to 1.
      ``grpo.loss_aggregation="generation_mean"`` weighs each token's loss by it (see rl/grpo.py).
  """

  tokens: Any
  roles: Any
  valid: Any
  positions: Any
  segments: Any
  parents: Any
  loss_mask: Any
  old_logprobs: Any
  ref_logprobs: Any
  row_role: Any
  target_index: Any
  source_index: Any
  target_mask: Any
  target_advantages: Any
  target_weights: Any

  @property
  def num_tokens(self) -> int:
    """Trained tokens in the batch (host)."""
    return int(np.sum(np.asarray(self.target_mask)))

  @property
  def num_generations(self) -> int:
    """Generations with a trained token in the batch (host): the runs of trained tokens of its rows."""
    return int(np.round(np.sum(np.asarray(self.target_weights, np.float64))))


def generation_spans(mask: np.ndarray) -> list[tuple[int, int]]:
  """The generations of a row: the (start, stop) of each maximal run of True in ``mask`` (bool[n], a
  `TrainingRow`'s loss mask), in order."""
  edges = np.diff(np.concatenate([[0], np.asarray(mask, bool).astype(np.int8), [0]]))
  return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def generation_weights(mask: np.ndarray) -> np.ndarray:
  """Per-token weights of a row's trained tokens: 1 / (length of the run of ``mask`` the token lies in), 0 off it.

  Args:
    mask: bool[n] trained tokens of one row (a `TrainingRow`'s loss mask, as ``collate`` keeps it).
  Returns:
    float32[n]; each maximal run of True (one generation, `generation_spans`) sums to 1.
  """
  weights = np.zeros(np.shape(mask), np.float32)
  for start, stop in generation_spans(mask):
    weights[start:stop] = np.float32(1.0 / (stop - start))
  return weights


def bucket_length(n: int, step: int, minimum: int = 16) -> int:
  """n rounded up to a power of two (at least ``minimum``) while below ``step``, else to a multiple of ``step``."""
  if n <= step:
    return next_pow2(n, minimum)
  return -(-int(n) // step) * step


@dataclasses.dataclass
class _Packed:
  """One output row before padding (n tokens): a plain row, or a (group, role)'s rows packed on their prefix."""

  tokens: np.ndarray  # int32[n]
  roles: np.ndarray  # int32[n]
  positions: np.ndarray  # int32[n]
  segments: np.ndarray  # int32[n]
  parents: np.ndarray  # int32[n]
  loss_mask: np.ndarray  # bool[n]
  logprobs: np.ndarray  # float32[n]
  source: np.ndarray  # int32[n]: the position whose hidden state predicts each token
  advantages: np.ndarray  # float32[n]: each token's advantage
  weights: np.ndarray  # float32[n]: each trained token's generation weight (`generation_weights`)
  role: int


def _plain(row: TrainingRow, loss_mask: np.ndarray, advantages: np.ndarray) -> _Packed:
  n = len(row.tokens)
  return _Packed(
    tokens=np.asarray(row.tokens, np.int32),
    roles=np.asarray(row.roles, np.int32),
    positions=np.arange(n, dtype=np.int32),
    segments=np.zeros(n, np.int32),
    parents=np.zeros(n, np.int32),
    loss_mask=loss_mask,
    logprobs=np.asarray(row.logprobs, np.float32),
    source=np.maximum(np.arange(n, dtype=np.int32) - 1, 0),
    advantages=advantages,
    weights=generation_weights(loss_mask),
    role=int(row.role),
  )


def shared_prefix_length(rows: Sequence[TrainingRow], loss_masks: Sequence[np.ndarray]) -> int:
  """The packable prefix P of rows: their longest common prefix of token ids and role ids, cut before the first
  trained token of any row (``loss_masks``: bool[n_i] each), so every trained token lies in a suffix."""
  p = common_prefix_length([r.tokens for r in rows], [r.roles for r in rows])
  for mask in loss_masks:
    trained = np.flatnonzero(mask[:p])
    if trained.size:
      p = int(trained[0])
  return p


def _segment(
  row: TrainingRow,
  lo: int,
  hi: int,
  start: int,
  source0: int,
  segment: int,
  parent: int,
  mask: np.ndarray,
  advantages: np.ndarray | None,
) -> _Packed:
  """Tokens lo..hi-1 of ``row`` placed at packed positions start.., their first predicted from ``source0``."""
  n = hi - lo
  source = start + np.arange(n, dtype=np.int32) - 1
  if n:
    source[0] = source0
  return _Packed(
    tokens=np.asarray(row.tokens[lo:hi], np.int32),
    roles=np.asarray(row.roles[lo:hi], np.int32),
    positions=np.arange(lo, hi, dtype=np.int32),
    segments=np.full(n, segment, np.int32),
    parents=np.full(n, parent, np.int32),
    loss_mask=mask[lo:hi],
    logprobs=np.asarray(row.logprobs[lo:hi], np.float32),
    source=source,
    advantages=np.zeros(n, np.float32) if advantages is None else advantages[lo:hi],
    weights=generation_weights(mask)[lo:hi],
    role=int(row.role),
  )


def _pack(
  rows: Sequence[TrainingRow],
  groups: Sequence[tuple[Sequence[int], int]],
  root: int,
  loss_masks: Sequence[np.ndarray],
  advantages: Sequence[np.ndarray],
) -> _Packed:
  """Rows sharing their first ``root`` tokens as one row: the root (segment 0), then per group (row indices, P: the
  first P tokens its rows share, P >= root) the group's tokens root..P-1 as one segment (none when P == root), then
  each of its rows' remaining tokens as one segment (parent: the group's segment, else the root)."""
  first = rows[groups[0][0][0]]
  parts = [_segment(first, 0, root, 0, 0, 0, 0, np.zeros(len(first.tokens), bool), None)]
  start, segment = root, 0
  for members, p in groups:
    lead, parent, last = rows[members[0]], 0, root - 1  # last: the packed position of the shared part's last token
    if p > root:
      segment += 1
      parent = segment
      parts.append(_segment(lead, root, p, start, last, segment, 0, np.zeros(len(lead.tokens), bool), None))
      start += p - root
      last = start - 1
    for i in members:
      segment += 1
      row = rows[i]
      parts.append(_segment(row, p, len(row.tokens), start, last, segment, parent, loss_masks[i], advantages[i]))
      start += len(row.tokens) - p
  cat = lambda name: np.concatenate([getattr(x, name) for x in parts])
  fields = [f.name for f in dataclasses.fields(_Packed) if f.name != "role"]
  return _Packed(**{name: cat(name) for name in fields}, role=int(first.role))


def _packed_length(rows: Sequence[TrainingRow], units: Sequence[tuple[Sequence[int], int]], root: int) -> int:
  """Tokens of the row `_pack` makes of ``units`` (row indices, shared length) around a root of ``root`` tokens."""
  n = root
  for idx, p in units:
    p = p if len(idx) > 1 else root
    n += p - root + sum(len(rows[i].tokens) - p for i in idx)
  return n


def collate(
  rows: Sequence[TrainingRow],
  advantages: Sequence[float | np.ndarray] | np.ndarray,
  *,
  trained_roles: Sequence[int],
  row_valid: Sequence[bool] | np.ndarray | None = None,
  length_bucket: int = 512,
  pad_id: int = 0,
  pack_groups: Sequence[Any] | None = None,
  min_shared_prefix: int = 64,
  max_packed_length: int = 0,
) -> TrainBatch:
  """Pads rows into a ``TrainBatch`` of host numpy arrays [B', T], packing rows that share a prefix if asked.

  Shared-prefix packing (``pack_groups``): rows with the same group key and the same ``role`` that have trained
  tokens (the G rollouts of a task fork one prefilled opening) become one row: the shared prefix of P tokens
  (``shared_prefix_length``) once, then each row's remaining tokens as its own segment. Each suffix attends to the
  prefix and to itself at its own rotary positions, and its first token is predicted from the prefix's last hidden
  state, so every trained token's logprob, the loss and the gradients are those of the unpacked rows (up to float
  summation order), for G x (P + S) -> P + G x S tokens. A group of one row, or with P < ``min_shared_prefix``,
  stays unpacked; a packed row takes the place of its group's first row.

  Across groups (``max_packed_length`` > 0): consecutive groups (packed or lone rows) of one role whose rows all
  share a root of at least ``min_shared_prefix`` tokens join one row while it stays within ``max_packed_length``
  tokens: the root once, then per group its shared tokens past the root (a segment whose parent is the root) and its
  rows' suffixes (segments whose parent is that one). Exact in the same way; a group longer than the limit is never
  split.

  T is ``bucket_length(max row length, length_bucket)`` and I (at most T) ``bucket_length(most trained tokens in a
  row, length_bucket)``.

  Args:
    rows: B training rows (``TrainingRow``: one view of one trajectory).
    advantages: B advantages, each a row's (``advantages_nr[row.trajectory, row.role]``) or float[n] of its tokens
      (read where they are trained: e.g. one per generation).
    trained_roles: role ids that are trained; a row of another role, and any token whose role id is not trained,
      gets loss_mask 0.
    row_valid: bool[B]; False rows (e.g. of an invalid trajectory) are kept as fully masked rows. Default all True.
    length_bucket: see ``bucket_length``.
    pad_id: the id written into padding.
    pack_groups: B hashable group keys (e.g. the trajectory's task index), or None: no packing.
    min_shared_prefix: the shortest prefix worth packing (tokens, >= 1).
    max_packed_length: the longest row (tokens) that packing across groups may make; 0: no packing across groups.
  Raises:
    ValueError: no rows, advantages / row_valid / pack_groups not of length B, min_shared_prefix < 1, or
      max_packed_length < 0.
  """
  b = len(rows)
  if b == 0:
    raise ValueError("collate: no rows; a step needs at least one training row.")
  row_valid = np.ones(b, bool) if row_valid is None else np.asarray(row_valid, bool).reshape(-1)
  if len(advantages) != b or row_valid.shape != (b,):
    raise ValueError(
      f"collate: {b} rows need {b} advantages and row_valid; got {len(advantages)} and {row_valid.shape}."
    )
  adv = []  # float32[n_i] per row
  for i, (row, a) in enumerate(zip(rows, advantages, strict=True)):
    a = np.asarray(a, np.float32)
    if a.ndim and a.shape != (len(row.tokens),):
      raise ValueError(f"collate: row {i} has {len(row.tokens)} tokens but advantages of shape {a.shape}.")
    adv.append(np.broadcast_to(a, (len(row.tokens),)).copy())
  if pack_groups is not None and len(pack_groups) != b:
    raise ValueError(f"collate: {b} rows need {b} pack_groups; got {len(pack_groups)}.")
  if min_shared_prefix < 1:
    raise ValueError(f"collate: min_shared_prefix={min_shared_prefix}; it must be >= 1.")
  if max_packed_length < 0:
    raise ValueError(f"collate: max_packed_length={max_packed_length}; it must be >= 0 (0: no packing across groups).")
  trained = np.asarray(sorted(int(r) for r in trained_roles), np.int32)
  masks = []
  for i, row in enumerate(rows):
    mask = np.zeros(len(row.tokens), bool)
    if row_valid[i] and row.role in trained:
      mask = np.asarray(row.loss_mask, bool) & np.isin(np.asarray(row.roles), trained)
    mask[:1] = False  # nothing predicts position 0
    masks.append(mask)
  adv = [np.where(m, a, 0.0).astype(np.float32) for m, a in zip(masks, adv, strict=True)]

  # Units of packing, per role in row order: a group of rows sharing at least min_shared_prefix tokens, else a row.
  units: dict[int, list[tuple[list[int], int]]] = {}  # role -> [(row indices, the tokens they share)]
  if pack_groups is not None:
    members: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
      if masks[i].any():
        members.setdefault((pack_groups[i], int(row.role)), []).append(i)
    for (_, role), idx in members.items():
      p = shared_prefix_length([rows[i] for i in idx], [masks[i] for i in idx])
      if len(idx) > 1 and p >= min_shared_prefix:
        units.setdefault(role, []).append((idx, p))
      else:
        units.setdefault(role, []).extend(([i], shared_prefix_length([rows[i]], [masks[i]])) for i in idx)
  # Bins: consecutive units of a role whose common root is long enough, while the packed row stays within
  # max_packed_length tokens (0: one unit per bin).
  bins: list[tuple[list[tuple[list[int], int]], int]] = []  # (units, root)
  for role_units in units.values():
    current, root = [role_units[0]], role_units[0][1]
    for unit in role_units[1:]:
      a, c = current[0][0][0], unit[0][0]  # the first rows of the bin and of the unit
      r = min(root, unit[1], shared_prefix_length([rows[a], rows[c]], [masks[a], masks[c]]))
      n = _packed_length(rows, [*current, unit], r)
      if max_packed_length and r >= min_shared_prefix and n <= max_packed_length:
        current, root = [*current, unit], r
      else:
        bins.append((current, root))
        current, root = [unit], unit[1]
    bins.append((current, root))
  packed_at = {b[0][0][0][0]: b for b in bins if len(b[0]) > 1 or len(b[0][0][0]) > 1}  # first row -> bin
  skip = {i for groups, _ in packed_at.values() for idx, _ in groups for i in idx} - set(packed_at)
  out: list[_Packed] = []
  for i, row in enumerate(rows):
    if i in packed_at:
      groups, root = packed_at[i]
      groups = [(idx, p if len(idx) > 1 else root) for idx, p in groups]  # a lone row: all of it past the root
      out.append(_pack(rows, groups, root, masks, adv))
    elif i not in skip:
      out.append(_plain(row, masks[i], adv[i]))

  b = len(out)
  t = bucket_length(max(len(r.tokens) for r in out), length_bucket)
  tokens = np.full((b, t), pad_id, np.int32)
  roles = np.zeros((b, t), np.int32)
  valid = np.zeros((b, t), bool)
  positions = np.zeros((b, t), np.int32)
  segments = np.zeros((b, t), np.int32)
  parents = np.zeros((b, t), np.int32)
  loss_mask = np.zeros((b, t), bool)
  old = np.zeros((b, t), np.float32)
  for i, row in enumerate(out):
    n = len(row.tokens)
    tokens[i, :n], roles[i, :n], valid[i, :n] = row.tokens, row.roles, True
    positions[i, :n], segments[i, :n], parents[i, :n] = row.positions, row.segments, row.parents
    loss_mask[i, :n], old[i, :n] = row.loss_mask, row.logprobs
  counts = loss_mask.sum(axis=1)
  width = min(bucket_length(int(counts.max()), length_bucket), t)
  target_index = np.zeros((b, width), np.int32)
  source_index = np.zeros((b, width), np.int32)
  target_adv = np.zeros((b, width), np.float32)
  target_weights = np.zeros((b, width), np.float32)
  target_mask = np.arange(width)[None, :] < counts[:, None]
  for i, row in enumerate(out):
    where = np.flatnonzero(loss_mask[i])
    target_index[i, : counts[i]] = where
    source_index[i, : counts[i]] = row.source[where]
    target_adv[i, : counts[i]] = row.advantages[where]
    target_weights[i, : counts[i]] = row.weights[where]
  return TrainBatch(
    tokens=tokens,
    roles=roles,
    valid=valid,
    positions=positions,
    segments=segments,
    parents=parents,
    loss_mask=loss_mask,
    old_logprobs=old,
    ref_logprobs=np.zeros((b, t), np.float32),
    row_role=np.asarray([r.role for r in out], np.int32),
    target_index=target_index,
    source_index=source_index,
    target_mask=target_mask,
    target_advantages=target_adv,
    target_weights=target_weights,
  )


# The [.., I] fields; row_role is [..].
_TARGET_FIELDS = ("target_index", "source_index", "target_mask", "target_advantages", "target_weights")


def trimmed(batch: TrainBatch, length_bucket: int) -> TrainBatch:
  """A host [M, ...] micro-batch cut to its own lengths: T to ``bucket_length`` of its longest row, I to that of its
  most trained tokens in a row (at most T).

  The columns cut are padding in every row (rows are left-aligned, ``target_index`` < the row's length), so the
  micro-batch's logprobs, sums and gradient are those of the uncut one, at the cost of its own rows.
  """
  t = np.flatnonzero(np.asarray(batch.valid).any(axis=0))
  t = bucket_length(int(t[-1]) + 1 if t.size else 1, length_bucket)
  i = np.flatnonzero(np.asarray(batch.target_mask).any(axis=0))
  i = min(bucket_length(int(i[-1]) + 1 if i.size else 1, length_bucket), t)
  t, i = min(t, np.shape(batch.tokens)[-1]), min(i, np.shape(batch.target_index)[-1])
  cut = {f.name: getattr(batch, f.name) for f in dataclasses.fields(TrainBatch)}
  for name, x in cut.items():
    if name != "row_role":
      cut[name] = x[..., :i] if name in _TARGET_FIELDS else x[..., :t]
  return TrainBatch(**cut)


def split_micro_batches(
  batch: TrainBatch, micro_batch_size: int, *, by_role: bool = False, num_micro_batches: int | None = None
) -> TrainBatch:
  """Splits a [B, ...] batch into K micro-batches of exactly ``micro_batch_size`` rows: [K, M, ...] host arrays.

  The last micro-batch (of each role, with ``by_role``) is filled with padding rows: valid and loss_mask all False,
  advantages 0, so they add nothing to any sum. Row order is kept within a role.

  Args:
    batch: from ``collate``.
    micro_batch_size: M.
    by_role: every micro-batch holds rows of one ``row_role`` (needed when each role trains its own tree); padding
      rows take it.
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
    positions=take(host.positions, 0),
    segments=take(host.segments, 0),
    parents=take(host.parents, 0),
    row_role=np.where(pad, chunk_role, host.row_role[safe]).astype(np.int32),
    target_index=take(host.target_index, 0),
    source_index=take(host.source_index, 0),
    target_mask=take(host.target_mask, False),
    target_advantages=take(host.target_advantages, 0.0),
    target_weights=take(host.target_weights, 0.0),
  )
