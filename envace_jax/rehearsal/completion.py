"""One-shot generations from chat prompts, batched, with the shared system prompt prefilled once.

The rollout (`unfold`) keeps growing views; test-time rehearsal and the world-model fidelity probe also need plain
"render this chat, write one message" generations: self-assessments, the rehearsal memory, the user's opening message,
the rehearsing role's prediction of a real tool response. Their prompts mostly start with the same long system
message (τ² airline's policy is ≈5k SmolLM2 tokens), so `complete` groups prompts by that first message, prefills it
once per group and forks the KV cache over the group (the sampler's group prefix sharing), then generates every row in
one batched call.
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
    key: a ``jax.random.key`` (unused by greedy sampling).
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
  order = list(groups.items())
  size = max(len(members) for _, members in order)
  mult = sampler.batch_multiple
  n_groups = -(-len(order) // mult) * mult
  context = getattr(getattr(sampler, "config", None), "max_seq_len", None)
  # Rounded up to a power of two: calls whose prompts differ in length (every fidelity chunk, every assessment)
  # reuse the same compiled programs instead of compiling their own.
  longest = next_pow2(max(len(ids) for ids, _ in rendered) + max_new_tokens)
  capacity = min(longest, context) if context else longest
  cache = sampler.init_cache(batch=n_groups, capacity=capacity)
  heads = [list(prefix) for prefix, _ in order] + [[]] * (n_groups - len(order))
  head_roles = [list(rendered[members[0]][1][: len(prefix)]) for prefix, members in order]
  head_roles += [[]] * (n_groups - len(order))
  if any(heads):
    cache, _, fitted, count = sampler.prefill(cache, heads, head_roles)
    stats["prefill_tokens"] += count
    fitted = np.asarray(fitted)
  else:
    fitted = np.zeros(n_groups, bool)
  cache = sampler.fork(cache, size)
  rows = n_groups * size
  row_prompts, row_roles = [[] for _ in range(rows)], [[] for _ in range(rows)]
  active, placed = np.zeros(rows, bool), {}
  for g, (prefix, members) in enumerate(order):
    skip = len(prefix) if fitted[g] else 0  # a prefix that did not fit was not prefilled: the row fails below
    for j, i in enumerate(members):
      ids, roles = rendered[i]
      row = g * size + j
      row_prompts[row], row_roles[row], active[row] = ids[skip:], roles[skip:], True
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
