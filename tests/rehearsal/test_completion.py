"""envace_jax/rehearsal/completion.py: one-shot generations on the real sampler (a tiny random model over SmolLM2's
vocabulary): the tokens are a full forward pass's greedy ones, and calls whose prompts differ in length reuse the
compiled programs (the cache's capacity is rounded up to a power of two)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from envace_jax.model import transformer
from envace_jax.model.config import get_model_config
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message
from envace_jax.rehearsal import completion
from envace_jax.rehearsal.completion import complete
from envace_jax.sampling.sampler import Sampler, SamplingParams, next_pow2
from tests.conftest import jit_apply

SYSTEM = Message("system", "You are a careful tool-using assistant. Answer briefly and in JSON when asked.")


def _greedy(config, params, ids, roles, n: int, role: Role) -> list[int]:
  """``n`` greedy tokens by full forward passes over the whole sequence (no KV cache)."""
  ids, roles, out = list(ids), list(roles), []
  for _ in range(n):
    logits, _ = jit_apply(config, params, np.asarray([ids]), np.asarray([roles]))
    token = int(np.argmax(np.asarray(logits)[0, -1]))
    out.append(token)
    ids.append(token)
    roles.append(int(role))
  return out


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
  config = get_model_config("tiny", vocab_size=smollm2_tokenizer.vocab_size, max_seq_len=1024)
  params = transformer.init_params(config, jax.random.key(3))
  # No eos: every row generates max_new_tokens. Programs of its own: the tests count its traces.
  sampler = Sampler(config, params, pad_id=smollm2_tokenizer.pad_id, share_programs=False)
  return config, params, sampler


def test_completions_are_greedy_and_prompts_of_other_lengths_compile_nothing(tiny, smollm2_tokenizer):
  config, params, sampler = tiny
  tokenizer, n = smollm2_tokenizer, 5
  first = [[SYSTEM, Message("user", "List the files.")], [SYSTEM, Message("user", "Open the door, please.")]]
  done, stats = complete(sampler, tokenizer, first, key=jax.random.key(0), max_new_tokens=n, role=Role.REHEARSE)
  for chat, c in zip(first, done, strict=True):
    ids, roles = tokenizer.render(chat, add_generation_prompt=True, generation_role=Role.REHEARSE)
    assert c.prompt_tokens == len(ids)
    assert list(c.ids) == _greedy(config, params, ids, roles, n, Role.REHEARSE)
  assert stats["generated_tokens"] == 2 * n

  traced = dict(sampler.compile_counts)
  other = [[SYSTEM, Message("user", "Lock the car doors.")], [SYSTEM, Message("user", "Hi.")]]
  lengths = [len(tokenizer.render(chat, add_generation_prompt=True)[0]) for chat in first + other]
  assert len(set(lengths)) == 4  # four prompt lengths: one capacity bucket, one prefill-chunk bucket
  complete(sampler, tokenizer, other, key=jax.random.key(0), max_new_tokens=n, role=Role.REHEARSE)
  assert sampler.compile_counts == traced


def test_a_large_group_is_cut_into_parts_and_each_prompt_gets_its_own_greedy_tokens(tiny, smollm2_tokenizer):
  _, _, sampler = tiny
  tokenizer, n = smollm2_tokenizer, 5
  short, other = Message("system", "Be brief."), Message("system", "Be kind.")
  asks = ["List the files.", "Open the door.", "Lock the car.", "Hi.", "Read the logs."]
  prompts = [[short, Message("user", a)] for a in asks[:4]] + [[other, Message("user", asks[4])]]
  head = [len(tokenizer.render([m])[0]) for m in (short, other)]
  # 4 prompts under one head, 1 under another: two 4-row forks would idle 3 rows; parts of 2 run fewer tokens.
  assert completion.group_size([(head[0], 4), (head[1], 1)], n) == 2
  done, stats = complete(sampler, tokenizer, prompts, key=jax.random.key(0), max_new_tokens=n, role=Role.REHEARSE)
  total = sum(len(tokenizer.render(p, add_generation_prompt=True, generation_role=Role.REHEARSE)[0]) for p in prompts)
  # Prefilled: the short head twice (two parts), the other once, and every prompt's own tokens after its head.
  assert stats["prefill_tokens"] == 2 * head[0] + head[1] + total - 4 * head[0] - head[1]
  for chat, c in zip(prompts, done, strict=True):
    (alone,), _ = complete(sampler, tokenizer, [chat], key=jax.random.key(0), max_new_tokens=n, role=Role.REHEARSE)
    assert c.ids == alone.ids and c.text == alone.text


def test_rows_hold_only_what_follows_their_head_and_samples_follow_the_prompt_not_the_layout(
  tiny, smollm2_tokenizer, monkeypatch
):
  _, _, sampler = tiny
  tokenizer, n = smollm2_tokenizer, 4
  policy, other = Message("system", "Answer in JSON. " * 40), Message("system", "Answer in prose. " * 40)
  asks = ["List the files.", "Hi.", "Read the logs.", "Open the door."]
  prompts = [[policy, Message("user", a)] for a in asks[:3]] + [[other, Message("user", asks[3])]]
  heads = [len(tokenizer.render([m])[0]) for m in (policy, other)]
  own = max(len(tokenizer.render(p, add_generation_prompt=True)[0]) - len(tokenizer.render(p[:1])[0]) for p in prompts)
  capacities = []
  fork = sampler.fork
  monkeypatch.setattr(
    sampler, "fork", lambda cache, g, capacity=None: capacities.append(capacity) or fork(cache, g, capacity)
  )
  kw = dict(key=jax.random.key(4), max_new_tokens=n, role=Role.REHEARSE, sampling=SamplingParams(temperature=1.0))
  assert completion.group_size([(heads[0], 3), (heads[1], 1)], n) == 3  # long heads: 2 heads x 3 rows
  shared, _ = complete(sampler, tokenizer, prompts, **kw)
  # The heads are the fork's prefix: a row's own slots are its question and its answer, rounded up to a power of two.
  assert capacities == [next_pow2(own + n)] and next_pow2(own + n) < next_pow2(heads[0] + own + n)
  # Another layout (parts of 2: the last prompt moves from row 3 to row 4) samples each prompt the same tokens.
  monkeypatch.setattr(completion, "group_size", lambda *a, **k: 2)
  apart, _ = complete(sampler, tokenizer, prompts, **kw)
  assert [c.ids for c in apart] == [c.ids for c in shared]


def test_group_size_runs_the_fewest_tokens():
  # The main job's gold-call fidelity probe (configs/testbed.py:main, 2026-12-06): 28 probes under 14 heads.
  heads = [761, 851, 687, 832, 947, 728, 556, 620, 658, 798, 825, 754, 722, 610]
  sizes = [4, 2, 2, 2, 2, 2, 1, 2, 1, 2, 2, 2, 2, 2]
  assert completion.group_size(list(zip(heads, sizes, strict=True)), 128) == 2  # 15 heads x 2 rows, not 14 x 4
  assert completion.group_size([(5000, 8)], 128) == 8  # one long head: shared by all
  assert completion.group_size([(40, 3), (40, 1)], 128) == 1  # short heads: a fork's idle rows cost more
  # Padding the heads to the batch shards counts: 2 heads x 2 rows alone, but padded to 4 heads, 4 x 1 is cheaper.
  assert completion.group_size([(300, 2), (300, 1)], 128) == 2
  assert completion.group_size([(300, 2), (300, 1)], 128, batch_multiple=4) == 1
  assert completion.group_size([], 128) == 1
