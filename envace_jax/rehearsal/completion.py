"""One-shot generations from chat prompts, batched, with the shared system prompt prefilled once.

The rollout (`unfold`) keeps growing views; test-time rehearsal and the world-model fidelity probe also need plain
"render this chat, write one message" generations: self-assessments, the rehearsal memory, the user's opening message,
the rehearsing role's prediction of a real tool response. Their prompts mostly start with the same long system
message (τ² airline's policy is ≈5k SmolLM2 tokens), so `complete` groups prompts by that first message, prefills it
once per group and forks the KV cache over the group (the sampler's group prefix sharing), then generates every row in
one batched call. A group larger than most is cut into parts (`group_size`), and a row's own cache holds only what
follows its head, so padding costs little.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message, Tokenizer
from envace_jax.sampling.sampler import GREEDY, SamplingParams, next_pow2
from envace_jax.sampling.stopping import FinishReason


@dataclasses.dataclass(frozen=True)
class Completion:
  """One generated message.

  Attributes:
    text: ``answer_prefix`` + the decoded generation (eos and the template's trailer excluded).
    ids: the generated ids (int, as sampled; the prefix's ids are not included).
    finish: why generation stopped (``CONTEXT_EXHAUSTED`` when the prompt does not fit the model's context: then
      ``text`` is just the prefix).
    prompt_tokens: the rendered prompt's length (tokens).
  """

  text: str
  ids: tuple[int, ...]
  finish: FinishReason
  prompt_tokens: int


def complete(
  sampler,
  tokenizer: Tokenizer,
  prompts: Sequence[Sequence[Message]],
  *,
  key: jax.Array,
  max_new_tokens: int,
  role: Role = Role.ACT,
  sampling: SamplingParams = GREEDY,
  answer_prefix: str = "",
  stop_strings: Sequence[str] = (),
) -> tuple[list[Completion], dict[str, float]]:
  """Generates one assistant message for each chat in ``prompts`` (one batched sampler call; prompts whose first
  message renders to the same tokens share its prefill: see the module docstring).

  Args:
    sampler: a `Sampler` (``init_cache`` / ``prefill`` / ``fork`` / ``generate``).
    tokenizer: renders the chats (its chat template) and decodes the generations.
    prompts: chats, each ending where the generated message starts.
    key: a ``jax.random.key``; prompt i samples with ``fold_in(key, i)`` whatever the grouping (unused by greedy
      sampling).
    max_new_tokens: the generation budget per prompt (tokens).
    role: the role id of the generated tokens (and of the generation header and ``answer_prefix``).
    sampling: `SamplingParams` (default greedy).
    answer_prefix: text forced at the start of every answer (e.g. "Outcome:" for a structured assessment).
    stop_strings: texts that end a generation (kept in ``text``).

  Returns:
    (one `Completion` per prompt in order, stats {"generated_tokens", "prefill_tokens", "seconds"}).

  Raises:
    ValueError: ``max_new_tokens`` < 1.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  start = time.perf_counter()
  stats = {"generated_tokens": 0.0, "prefill_tokens": 0.0, "seconds": 0.0}
  if not prompts:
    return [], stats
  forced = tokenizer.encode(answer_prefix) if answer_prefix else []
  rendered, prefixes = [], []
  for chat in prompts:
    ids, roles = tokenizer.render(list(chat), add_generation_prompt=True, generation_role=role)
    ids, roles = list(map(int, ids)) + forced, list(map(int, roles)) + [int(role)] * len(forced)
    head = list(map(int, tokenizer.render(list(chat[:1]))[0])) if len(chat) > 1 else []
    # Shared only when it is a strict token prefix of the whole prompt (ChatML: always).
    prefixes.append(tuple(head) if 0 < len(head) < len(ids) and ids[: len(head)] == head else ())
    rendered.append((ids, roles))
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, prefix in enumerate(prefixes):
    groups.setdefault(prefix, []).append(i)
  mult = sampler.batch_multiple
  size = group_size([(len(prefix), len(members)) for prefix, members in groups.items()], max_new_tokens, mult)
  order = [(prefix, members[k : k + size]) for prefix, members in groups.items() for k in range(0, len(members), size)]
  n_groups = -(-len(order) // mult) * mult
  context = getattr(getattr(sampler, "config", None), "max_seq_len", None)

  def bucket(n: int) -> int:
    # Rounded up to a power of two: calls whose prompts differ in length (every fidelity chunk, every assessment)
    # reuse the same compiled programs instead of compiling their own.
    return min(next_pow2(n), context) if context else next_pow2(n)

  heads = [list(prefix) for prefix, _ in order] + [[]] * (n_groups - len(order))
  head_roles = [list(rendered[members[0]][1][: len(prefix)]) for prefix, members in order]
  head_roles += [[]] * (n_groups - len(order))
  if any(heads):
    cache = sampler.init_cache(batch=n_groups, capacity=bucket(max(map(len, heads))))
    cache, _, fitted, count = sampler.prefill(cache, heads, head_roles)
    stats["prefill_tokens"] += count
    fitted = np.asarray(fitted)
  else:
    cache = sampler.init_cache(batch=n_groups, capacity=bucket(getattr(sampler, "min_bucket", 1)))  # holds nothing
    fitted = np.zeros(n_groups, bool)
  skips = [len(prefix) if fitted[g] else 0 for g, (prefix, _) in enumerate(order)]
  # A row's own slots hold its prompt after the shared head, then its generation (the head is the fork's prefix).
  own = max(len(rendered[i][0]) - skip for skip, (_, members) in zip(skips, order, strict=True) for i in members)
  cache = sampler.fork(cache, size, capacity=bucket(own + max_new_tokens))
  rows = n_groups * size
  row_prompts, row_roles = [[] for _ in range(rows)], [[] for _ in range(rows)]
  active, placed = np.zeros(rows, bool), {}
  # A row's random keys follow its prompt (its index in ``prompts``), not the layout: a sampled completion does not
  # depend on how the prompts were grouped (the mesh's batch_multiple, max_new_tokens).
  row_ids = np.arange(len(prompts), len(prompts) + rows)
  for g, (skip, (_, members)) in enumerate(zip(skips, order, strict=True)):
    for j, i in enumerate(members):  # a head that did not fit was not prefilled (skip 0): the row fails below
      ids, roles = rendered[i]
      row = g * size + j
      row_prompts[row], row_roles[row], active[row], row_ids[row] = ids[skip:], roles[skip:], True, i
      placed[i] = row
  out, _ = sampler.generate(
    cache,
    row_prompts,
    row_roles,
    role=int(role),
    key=key,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    stop_strings=tuple(stop_strings),
    active=active,
    row_ids=row_ids,
  )
  stats["prefill_tokens"] += out.prefill_tokens
  eos = set(tokenizer.eos_ids)
  results = []
  for i, (ids, _) in enumerate(rendered):
    row = placed[i]
    gen = [int(t) for t in out.tokens[row, : int(out.lengths[row])]]
    stats["generated_tokens"] += len(gen)
    text_ids = gen[:-1] if gen and gen[-1] in eos else gen
    results.append(
      Completion(answer_prefix + tokenizer.decode(text_ids), tuple(gen), out.finish_reasons[row], len(ids))
    )
  stats["seconds"] = time.perf_counter() - start
  return results, stats


def group_size(groups: Sequence[tuple[int, int]], max_new_tokens: int, batch_multiple: int = 1) -> int:
  """The rows per shared head that `complete` uses: its groups (prompts with one first message) are cut into parts
  of at most this many, each part a head prefilled once and forked over that many rows.

  One fork serves every head with the same number of rows, so a few large groups among small ones pad every head
  with idle rows (the world-model fidelity probe of the main job's evaluation: 28 probes under 14 heads, one of them
  holding 4, made 56 rows). The size chosen is the one that runs the fewest tokens through the model: the heads'
  prefill plus ``max_new_tokens`` per row, padded rows and heads included (ties: the larger size, sharing more).

  Args:
    groups: (head length in tokens, prompts under that head) per group; a head of 0 tokens shares nothing.
    max_new_tokens: the generation budget per row (tokens).
    batch_multiple: heads are padded to a multiple of this (the sampler's batch shards).
  Returns:
    a size in 1 .. the largest group (1 when ``groups`` is empty).
  """
  best, best_cost = 1, None
  for size in range(max((n for _, n in groups), default=1), 0, -1):
    parts = [(head, -(-n // size)) for head, n in groups]
    heads = -(-sum(k for _, k in parts) // batch_multiple) * batch_multiple
    cost = sum(head * k for head, k in parts) + heads * size * max_new_tokens
    if best_cost is None or cost < best_cost:
      best, best_cost = size, cost
  return best
