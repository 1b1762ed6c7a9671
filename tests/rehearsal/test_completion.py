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
from envace_jax.rehearsal.completion import complete
from envace_jax.sampling.sampler import Sampler
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
  sampler = Sampler(config, params, pad_id=smollm2_tokenizer.pad_id)  # no eos: every row generates max_new_tokens
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
