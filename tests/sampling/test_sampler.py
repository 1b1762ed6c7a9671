"""The sampler: token-exact against transformers' greedy generate, logprobs, continuation, forks, stops, buckets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax.model import transformer
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message, Tokenizer
from envace_jax.sampling import stopping
from envace_jax.sampling.sampler import GREEDY, Sampler, SamplingParams
from envace_jax.sampling.stopping import FinishReason
from tests.conftest import jit_apply, tiny_hf_pair

torch = pytest.importorskip("torch")

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2], list(range(30, 70))]  # ragged: 7, 2 and 40 tokens


def _hf_greedy(model, prompt, max_new_tokens, eos_token_id=None):
  """transformers' greedy generate on one unpadded prompt -> the new ids (eos included if it stopped there)."""
  with torch.no_grad():
    out = model.generate(
      torch.tensor([prompt]),
      max_new_tokens=max_new_tokens,
      do_sample=False,
      eos_token_id=eos_token_id,
      pad_token_id=0,
      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
  new = out[0, len(prompt) :].tolist()
  if eos_token_id is not None and eos_token_id in new:
    new = new[: new.index(eos_token_id) + 1]
  return new


@pytest.fixture(scope="module", params=["llama", "qwen3-qknorm"])
def tiny(request, tmp_path_factory):
  return tiny_hf_pair(request.param, tmp_path_factory.mktemp(request.param))


def test_greedy_equals_transformers_generate_tiny(tiny):
  model, config, params = tiny
  sampler = Sampler(config, params)
  cache = sampler.init_cache(batch=len(PROMPTS), capacity=128)
  out, _ = sampler.generate(cache, PROMPTS, Role.USER, role=Role.ACT, key=jax.random.key(0), max_new_tokens=64)
  for b, prompt in enumerate(PROMPTS):
    assert out.finish_reasons[b] == FinishReason.LENGTH
    assert out.row(b) == _hf_greedy(model, prompt, 64), f"row {b}"


@pytest.mark.slow
def test_greedy_equals_transformers_generate_smollm2(smollm2, hf_smollm2):
  tokenizer = Tokenizer.from_hf_dir(smollm2.path)
  chats = [
    [Message("user", "What is the capital of France?")],
    [Message("system", "You are a travel agent."), Message("user", "Suggest one city to visit in Japan and why.")],
    [Message("user", "Write a haiku about the sea.")],
  ]
  prompts = [tokenizer.render(chat, add_generation_prompt=True)[0].tolist() for chat in chats]
  sampler = Sampler(smollm2.config, smollm2.params, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
  cache = sampler.init_cache(batch=3, capacity=256)
  out, _ = sampler.generate(cache, prompts, Role.USER, role=Role.ACT, key=jax.random.key(0), max_new_tokens=32)
  for b, prompt in enumerate(prompts):
    assert out.row(b) == _hf_greedy(hf_smollm2, prompt, 32, eos_token_id=tokenizer.eos_ids[0]), f"prompt {b}"
  assert "Paris" in tokenizer.decode(out.row(0))


@pytest.fixture(scope="module")
def tiny_with_roles():
  """The tiny preset with random weights and a non-zero role table, so role ids change the logits."""
  from envace_jax.model.config import PRESETS

  config = PRESETS["tiny"]
  params = transformer.init_params(config, jax.random.key(0))
  params = jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, params)  # peaked, so greedy has no near-ties
  params["role_embed"] = jax.random.normal(jax.random.key(1), params["role_embed"].shape)
  return config, params


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_k=20)])
def test_logprobs_equal_full_forward(tiny_with_roles, sampling):
  """Returned logprobs == log_softmax(full forward over prompt + completion) at temperature 1, roles included."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  cache = sampler.init_cache(batch=3, capacity=96)
  out, _ = sampler.generate(
    cache,
    PROMPTS,
    Role.USER,
    role=[Role.ACT, Role.REHEARSE, Role.ACT],
    key=jax.random.key(7),
    max_new_tokens=24,
    sampling=sampling,
  )
  for b, (prompt, gen_role) in enumerate(zip(PROMPTS, [Role.ACT, Role.REHEARSE, Role.ACT], strict=True)):
    ids = prompt + out.row(b)
    roles = [Role.USER] * len(prompt) + [gen_role] * out.lengths[b]
    logits, _ = jit_apply(config, params, jnp.asarray([ids]), jnp.asarray([roles]))
    logp = jax.nn.log_softmax(logits[0], axis=-1)
    positions = np.arange(len(prompt) - 1, len(ids) - 1)
    expected = np.asarray(logp[positions, np.asarray(out.row(b))])
    np.testing.assert_allclose(out.logprobs[b, : out.lengths[b]], expected, atol=1e-4)
    assert np.all(out.logprobs[b, out.lengths[b] :] == 0)


def test_generated_role_changes_the_sample(tiny_with_roles):
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  outs = []
  for role in (Role.ACT, Role.REHEARSE):
    cache = sampler.init_cache(batch=1, capacity=64)
    out, _ = sampler.generate(cache, PROMPTS[:1], Role.USER, role=role, key=jax.random.key(0), max_new_tokens=16)
    outs.append(out.row(0))
  assert outs[0] != outs[1]


def test_same_key_same_output_and_batch_independence(tiny_with_roles):
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  hot = SamplingParams(temperature=1.0)

  def run(prompts, key, row_ids=None):
    cache = sampler.init_cache(batch=len(prompts), capacity=96)
    kw = dict(role=Role.ACT, key=key, max_new_tokens=20, sampling=hot, row_ids=row_ids)
    return sampler.generate(cache, prompts, Role.USER, **kw)[0]

  a, b = run(PROMPTS, jax.random.key(3)), run(PROMPTS, jax.random.key(3))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert run(PROMPTS, jax.random.key(4)).row(0) != a.row(0)
  alone = run(PROMPTS[2:], jax.random.key(3), row_ids=[2])  # row 2 sampled alone, same identity
  assert alone.row(0) == a.row(2)


def test_continuation_equals_one_call_and_prefills_only_new_tokens(tiny_with_roles):
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  prompt_a, prompt_b = PROMPTS[0], [11, 12, 13, 14, 15]
  hot = SamplingParams(temperature=0.8, top_p=0.95)
  cache = sampler.init_cache(batch=1, capacity=128)
  first, cache = sampler.generate(
    cache, [prompt_a], Role.USER, role=Role.ACT, key=jax.random.key(1), max_new_tokens=12, sampling=hot
  )
  second, cache = sampler.generate(
    cache, [prompt_b], Role.OBSERVATION, role=Role.ACT, key=jax.random.key(2), max_new_tokens=12, sampling=hot
  )
  assert second.prefill_tokens == len(prompt_b)  # turns before B are never prefilled again
  ids = prompt_a + first.row(0) + prompt_b
  roles = [Role.USER] * len(prompt_a) + [Role.ACT] * first.lengths[0] + [Role.OBSERVATION] * len(prompt_b)
  fresh = sampler.init_cache(batch=1, capacity=128)
  whole, whole_cache = sampler.generate(
    fresh, [ids], [roles], role=Role.ACT, key=jax.random.key(2), max_new_tokens=12, sampling=hot
  )
  assert whole.prefill_tokens == len(ids)
  assert whole.row(0) == second.row(0)
  np.testing.assert_allclose(whole.logprobs, second.logprobs, atol=1e-5)
  assert int(cache.lengths[0]) == int(whole_cache.lengths[0]) == len(ids) + second.lengths[0]


def test_group_fork_equals_separate_prefills(tiny_with_roles):
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  hot = SamplingParams(temperature=1.0)
  kw = dict(role=Role.ACT, key=jax.random.key(5), max_new_tokens=16, sampling=hot)
  separate, _ = sampler.generate(sampler.init_cache(4, 96), [PROMPTS[2]] * 4, Role.USER, **kw)
  cache, _, _, count = sampler.prefill(sampler.init_cache(1, 96), [PROMPTS[2][:-1]], Role.USER)
  assert count == len(PROMPTS[2]) - 1  # prefilled once
  forked = sampler.fork(cache, 4, capacity=32)
  assert forked.prefix.lengths.shape == (1,) and forked.stored_slots() == 64 + 4 * 32  # the prefix stored once
  shared, after = sampler.generate(forked, [PROMPTS[2][-1:]] * 4, Role.USER, **kw)
  np.testing.assert_array_equal(shared.tokens, separate.tokens)
  np.testing.assert_allclose(shared.logprobs, separate.logprobs, atol=1e-5)
  np.testing.assert_array_equal(after.filled(), len(PROMPTS[2]) + shared.lengths)
  assert len({tuple(shared.row(b)) for b in range(4)}) > 1  # the G samples differ


def test_a_prefix_prefilled_once_and_copied_equals_each_rows_own_prefill(tiny_with_roles):
  """Two rows start with the same prefix: prefilled once in a one-row cache, copied with ``copy_rows`` (row 2, an
  index past the last row, is empty), then each row's own rest; the cache equals prefilling each row whole."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  prefix = PROMPTS[2]
  rows = [prefix + [5, 6, 7], prefix + [9], [11, 12]]
  whole, _, _, _ = sampler.prefill(sampler.init_cache(3, 64), rows, Role.USER)
  small, _, _, count = sampler.prefill(sampler.init_cache(1, 64), [prefix], Role.USER)
  copied = sampler.copy_rows(small, [0, 0, 1])
  assert count == len(prefix) and np.asarray(copied.lengths).tolist() == [len(prefix), len(prefix), 0]
  copied, _, _, _ = sampler.prefill(copied, [r[len(prefix) :] for r in rows[:2]] + [rows[2]], Role.USER)
  np.testing.assert_array_equal(copied.lengths, whole.lengths)
  for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(whole), strict=True):  # unwritten slots: zeros in both
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)


def _same_turns(sampler, dense, other, turns):
  """Greedy turns (prompts, max_new) on a dense cache and another layout: the same tokens, logprobs (<= 1e-4) and
  finish reasons each turn. Returns (the last turn's output, both caches)."""
  for i, (prompts, max_new) in enumerate(turns):
    kw = dict(role=Role.ACT, key=jax.random.key(i), max_new_tokens=max_new)
    want, dense = sampler.generate(dense, prompts, Role.OBSERVATION, **kw)
    got, other = sampler.generate(other, prompts, Role.OBSERVATION, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
    assert got.finish_reasons == want.finish_reasons
  return got, dense, other


def test_nested_shared_prefixes_equal_the_dense_path(tiny_with_roles):
  """A prefix common to two rows (prefilled once), each row's own rest, then G = 3 forks, as unfold lays out its
  openings: two turns of greedy decoding with ragged prompts give the dense path's tokens, logprobs (<= 1e-4),
  finish reasons (context_exhausted when the forks' own slots run out) and histories, while every prefix token is
  stored once."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  common, rests, g, own = PROMPTS[2], [[5, 6, 7], [9, 10, 11]], 3, 20
  rows = [common + r for r in rests for _ in range(g)]
  dense = sampler.init_cache(len(rows), len(rows[0]) - 1 + own)  # the same room after each opening
  dense, _, _, _ = sampler.prefill(dense, [r[:-1] for r in rows], Role.USER)
  small, _, _, _ = sampler.prefill(sampler.init_cache(1, 64), [common], Role.USER)
  tasks = sampler.fork(small, len(rests), capacity=8)
  tasks, _, _, _ = sampler.prefill(tasks, [r[:-1] for r in rests], Role.USER)
  shared = sampler.fork(tasks, g, capacity=own)
  assert [int(c.lengths.sum()) for c in (shared, *shared.levels())] == [0, 4, len(common)]
  turns = [([r[-1:] for r in rows], 8), ([[2, 3], [4], [2, 3, 4], [5], [6, 7], [8]], 12)]
  got, dense, shared = _same_turns(sampler, dense, shared, turns)
  assert FinishReason.CONTEXT_EXHAUSTED in got.finish_reasons
  np.testing.assert_array_equal(shared.filled(), dense.lengths)
  flat, n = shared.flatten(), dense.capacity  # the same keys and values, slot for slot (unwritten: zeros in both)
  for a, b in zip(flat.k, dense.k, strict=True):
    np.testing.assert_allclose(np.asarray(a)[..., :n], np.asarray(b), atol=1e-4)
  for a, b in zip(flat.v, dense.v, strict=True):
    np.testing.assert_allclose(np.asarray(a)[:, :, :n], np.asarray(b), atol=1e-4)


def test_samplers_of_the_same_settings_share_their_programs(tiny_with_roles):
  """``share_programs`` (the default): a second sampler with the same settings and other weights traces nothing and
  samples what a sampler with programs of its own samples; other eos ids, or a sampler made inside an
  `attention.recording` block, get programs of their own; a shared program keeps no weights alive."""
  from envace_jax import runtime
  from envace_jax.model import attention

  config, params = tiny_with_roles
  runtime.forget_shared_programs()  # what this process's earlier tests built is not what this test counts
  other = jax.tree.map(lambda x: x * 1.5, params)
  kw = dict(role=Role.ACT, key=jax.random.key(5), max_new_tokens=6, sampling=SamplingParams(temperature=1.0))
  run = lambda s, p: s.generate(s.init_cache(2, 32), [PROMPTS[0], PROMPTS[1]], Role.USER, **kw)[0].tokens  # noqa: E731
  first = Sampler(config, params)
  run(first, params)
  traced = dict(first.compile_counts)
  assert traced == {"prefill": 1, "decode": 1, "admit": 1}
  second = Sampler(config, other)
  got = run(second, other)
  assert second.compile_counts is first.compile_counts and second.compile_counts == traced  # nothing traced again
  alone = Sampler(config, other, share_programs=False)
  np.testing.assert_array_equal(got, run(alone, other))
  assert alone.compile_counts == traced and alone._jitted is not first._jitted
  assert not np.array_equal(got, run(first, params))  # the weights are the second sampler's own
  assert Sampler(config, params, eos_ids=(3,))._jitted is not first._jitted
  with attention.recording() as calls:
    run(Sampler(config, params), params)
  assert calls  # its own programs, traced inside the block
  assert "_params" not in vars(first._programs.holder)


def test_prompt_buckets_bound_compilations(tiny_with_roles):
  config, params = tiny_with_roles
  sampler = Sampler(config, params, prefill_chunk=32, min_bucket=8, share_programs=False)
  for length in (3, 5, 8, 9, 14, 16, 20, 31, 32, 33, 50, 64, 70):
    cache = sampler.init_cache(batch=2, capacity=128)
    prompts = [list(range(1, length + 1)), [7]]
    sampler.generate(cache, prompts, Role.USER, role=Role.ACT, key=jax.random.key(0), max_new_tokens=3)
  # Prefill (`Sampler.chunk_sizes`: 20 tokens run as 16 + 8, 50 as 32 + 16 + 8): (chunk bucket, attended slots)
  # pairs (8|16|32, 32) for the first chunk, then (8, 32), (8, 64), (16, 64), (32, 64) and (8, 128) for later chunks.
  # Decode: one new-token bucket (4) x attended slots 32, 64, 128. Admit (each generate is a stream run to its end):
  # one, the decode state's shapes never change here.
  assert sampler.compile_counts == {"prefill": 8, "decode": 3, "admit": 1}


def test_chunk_sizes_pad_under_min_bucket_with_power_of_two_chunks(tiny_with_roles):
  """The rest after whole chunks is rounded up to ``min_bucket`` and split into powers of two, largest first: a
  chunk's token-rows are what it computes, so 138 tokens run as 128 + 16, not one 256-token chunk."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params, prefill_chunk=512, min_bucket=16)
  expected = {0: [], 1: [16], 17: [32], 138: [128, 16], 512: [512], 793: [512, 256, 32]}
  expected[1000] = [512, 256, 128, 64, 32, 16]
  assert {n: sampler.chunk_sizes(n) for n in expected} == expected
  for n in range(0, 1100, 7):
    sizes = sampler.chunk_sizes(n)
    assert n <= sum(sizes) < n + 16 and all(s & (s - 1) == 0 and 16 <= s <= 512 for s in sizes)
    assert sizes == sorted(sizes, reverse=True)


def test_attention_over_a_bucket_of_the_cache_equals_the_whole_cache(tiny_with_roles):
  """Calls attend over a power-of-two prefix of the slots that covers every row's history: the same tokens and
  logprobs as a cache 16x larger, whose other slots are never read."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params, prefill_chunk=16, min_bucket=8)
  kw = dict(role=Role.ACT, key=jax.random.key(1), max_new_tokens=12, sampling=SamplingParams(temperature=1.0))
  prompts = [PROMPTS[0], PROMPTS[1][:5]]
  outs = []
  for capacity in (64, 1024):
    out, cache = sampler.generate(sampler.init_cache(2, capacity), prompts, Role.USER, **kw)
    out2, _ = sampler.generate(cache, [PROMPTS[2][:7], [3]], Role.USER, **kw)  # a continuation turn
    outs.append((out, out2))
  for small, large in zip(*outs, strict=True):
    np.testing.assert_array_equal(small.tokens, large.tokens)
    np.testing.assert_allclose(small.logprobs, large.logprobs, atol=1e-5)


def _unstopped_run(config, params):
  """12 greedy tokens for PROMPTS[0] with no EOS or stop string: the run the stopping tests cut short."""
  sampler = Sampler(config, params)
  out, _ = sampler.generate(
    sampler.init_cache(1, 64), PROMPTS[:1], Role.USER, role=Role.ACT, key=jax.random.key(0), max_new_tokens=12
  )
  return out


def test_stops_eos_length_and_context(tiny_with_roles):
  config, params = tiny_with_roles
  free = _unstopped_run(config, params)
  eos = free.row(0)[5]
  sampler = Sampler(config, params, eos_ids=[eos], pad_id=0)
  first_eos = free.row(0).index(eos)
  cache = sampler.init_cache(batch=3, capacity=len(PROMPTS[0]) + 4)
  out, cache = sampler.generate(
    cache,
    [PROMPTS[0], PROMPTS[0][:3], list(range(1, 40))],
    Role.USER,
    role=Role.ACT,
    key=jax.random.key(0),
    max_new_tokens=[12, 2, 5],
  )
  # Row 0: EOS (kept) unless the cache fills first; row 1: its own max_new_tokens; row 2: prompt does not fit.
  if first_eos < 4:
    assert out.finish_reasons[0] == FinishReason.STOP and out.row(0) == free.row(0)[: first_eos + 1]
  else:
    assert out.finish_reasons[0] == FinishReason.CONTEXT_EXHAUSTED and out.lengths[0] == 4
  assert out.finish_reasons[1] == FinishReason.LENGTH and out.lengths[1] == 2
  assert out.finish_reasons[2] == FinishReason.CONTEXT_EXHAUSTED and out.lengths[2] == 0
  assert int(cache.lengths[2]) == 0  # nothing of the oversized prompt was written
  assert int(cache.lengths[1]) == 3 + 2


def test_context_exhausted_keeps_every_token_in_the_cache(tiny_with_roles):
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  cache = sampler.init_cache(batch=1, capacity=12)
  out, cache = sampler.generate(cache, PROMPTS[:1], Role.USER, role=Role.ACT, key=jax.random.key(0), max_new_tokens=50)
  assert out.finish_reasons == [FinishReason.CONTEXT_EXHAUSTED]
  assert out.lengths[0] == 12 - len(PROMPTS[0]) and int(cache.lengths[0]) == 12
  again, _ = sampler.generate(cache, [[1]], Role.USER, role=Role.ACT, key=jax.random.key(0), max_new_tokens=5)
  assert again.finish_reasons == [FinishReason.CONTEXT_EXHAUSTED] and again.lengths[0] == 0


def test_stop_string_ends_on_the_token_that_completes_it(tiny_with_roles):
  """Token bytes are made up so a stop string can start and end in the middle of tokens."""
  config, params = tiny_with_roles
  token_bytes = [f"{i:03d}|".encode() for i in range(config.vocab_size)]  # every token: 4 bytes
  free = _unstopped_run(config, params)
  text = b"".join(token_bytes[t] for t in free.row(0))
  stop = text[4 * 3 + 2 : 4 * 5 + 1].decode()  # from inside token 3 to inside token 5
  sampler = Sampler(config, params, token_bytes=token_bytes)
  out, _ = sampler.generate(
    sampler.init_cache(1, 64),
    PROMPTS[:1],
    Role.USER,
    role=Role.ACT,
    key=jax.random.key(0),
    max_new_tokens=12,
    stop_strings=("never-generated", stop),
  )
  first_end = text.find(stop.encode()) + len(stop)  # the first occurrence may come earlier if tokens repeat
  assert out.finish_reasons == [FinishReason.STOP]
  assert out.row(0) == free.row(0)[: -(-first_end // 4)]
  # The host's matcher (the server's, for per-request stop strings) ends at the same token.
  assert stopping.stop_end(free.row(0), token_bytes, (b"never-generated", stop.encode())) == len(out.row(0))


def test_push_and_match_windows():
  """The device's matcher reports a stop string on the token that completes it, whatever the tokens it spans; the
  host's (`stopping.stop_end`) ends the ids at the same token."""
  token_bytes = [b"</tool", b"_call>", b"x", b">\n", b"</tool_call>", b"l>", b"_cal"]
  table, lengths = (jnp.asarray(a) for a in stopping.token_byte_table(token_bytes))
  stops = (b"</tool_call>",)
  width = stopping.buffer_width(table.shape[1], stops)
  for sequence, expect in [([2, 0, 1], [0, 0, 1]), ([4], [1]), ([0, 6, 5], [0, 0, 1]), ([2, 3, 2], [0, 0, 0])]:
    buffer = stopping.init_buffer(1, width)
    hits = []
    for token in sequence:
      buffer, hit = stopping.push_and_match(buffer, jnp.asarray([token]), table, lengths, stops)
      hits.append(int(hit[0]))
    assert hits == expect, (sequence, hits)
    assert stopping.stop_end(sequence, token_bytes, stops) == (hits.index(1) + 1 if 1 in hits else None)
  assert stopping.stop_end([2, 0, 1, 4], token_bytes, (b"l>", b"x</")) == 2  # the earliest-ending of two


def test_bad_input_names_the_fix(tiny_with_roles):
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  with pytest.raises(ValueError, match="context"):
    sampler.init_cache(batch=1, capacity=config.max_seq_len + 1)
  with pytest.raises(ValueError, match="one \\(possibly empty\\) per row"):
    sampler.generate(
      sampler.init_cache(2, 32), [[1]], Role.USER, role=Role.ACT, key=jax.random.key(0), max_new_tokens=2
    )
  with pytest.raises(ValueError, match="token_bytes"):
    sampler.generate(
      sampler.init_cache(1, 32),
      [[1]],
      Role.USER,
      role=Role.ACT,
      key=jax.random.key(0),
      max_new_tokens=2,
      stop_strings=("x",),
    )


def test_sharded_sampler_equals_unsharded(tiny_with_roles):
  """Mesh 2x2x2 on 8 fake CPU devices: identical greedy tokens, logprobs to 1e-5, cache per its shardings."""
  from envace_jax.sampling import sharding

  if len(jax.devices()) != 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by tests/conftest.py)")
  config, params = tiny_with_roles
  prompts = PROMPTS + [[9, 8, 7, 6]]  # 4 rows: a multiple of the data x fsdp batch shards
  kw = dict(role=[Role.ACT, Role.REHEARSE, Role.ACT, Role.ACT], key=jax.random.key(0), max_new_tokens=24)
  plain = Sampler(config, params)
  ref, ref_cache = plain.generate(plain.init_cache(4, 96), prompts, Role.USER, **kw)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  sharded = Sampler(config, params, mesh=mesh)
  assert "tensor" in sharded.params["layers_0"]["attn"]["q_proj"].sharding.spec
  out, cache = sharded.generate(sharded.init_cache(4, 96), prompts, Role.USER, **kw)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  assert out.finish_reasons == ref.finish_reasons
  assert cache.k[0].sharding.spec[0] == ("data", "fsdp")
  # Cached keys of generated tokens carry the float32 rounding of every earlier step, summed in another order on the
  # mesh, through this peaked (x5) model: they agree to ~1e-4 relative (tokens and logprobs are checked above).
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
  jax.tree.map(close, cache.k, ref_cache.k)
  # A continuation turn on the mesh reuses the sharded cache.
  more, cache = sharded.generate(cache, [[5]] * 4, Role.OBSERVATION, **kw)
  again, ref_cache = plain.generate(ref_cache, [[5]] * 4, Role.OBSERVATION, **kw)
  np.testing.assert_array_equal(more.tokens, again.tokens)
  # Forked two ways: the 4 histories become a prefix level, its rows split over the batch shards like the forks'.
  kw = dict(kw, role=Role.ACT, max_new_tokens=8)
  forked, cache = sharded.generate(sharded.fork(cache, 2, capacity=16), [[6]] * 8, Role.OBSERVATION, **kw)
  want, _ = plain.generate(plain.fork(ref_cache, 2, capacity=16), [[6]] * 8, Role.OBSERVATION, **kw)
  np.testing.assert_array_equal(forked.tokens, want.tokens)
  assert cache.prefix.k[0].sharding.spec[0] == ("data", "fsdp") and cache.prefix.lengths.shape == (4,)


@pytest.mark.parametrize("route", ["reference", "xla"])
def test_paged_rows_on_a_mesh_equal_one_device(tiny_with_roles, route):
  """Mesh 2x2x2 on 8 fake CPU devices: 4 tasks' openings forked 2 ways into pages, as unfold lays them out, the pool
  one shard per batch shard (data x fsdp = 4) and grown mid-run (`paged.PagedKVCache.extended`): two turns give
  the one-device paged run's greedy tokens exactly; every row's pages are of its shard, the pools split over the
  batch axes, and the histories (`dense`) equal the one-device ones. ``route="xla"``: the mesh sampler's attention
  takes the accelerators' route (own pages gathered inside each shard, prefix levels and chunk as parts merged by
  log-sum-exp; `transformer.Attention`) in its CPU-runnable form, against the one-device reference."""
  from envace_jax.model import attention, paged
  from envace_jax.sampling import sharding

  if len(jax.devices()) != 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by tests/conftest.py)")
  config, params = tiny_with_roles
  mesh_config = config.replace(attention=route)
  openings, g, own, z = PROMPTS + [[9, 8, 7, 6]], 2, 24, 4
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  turns = [([[o[-1]] for o in openings for _ in range(g)], 10), ([[5], [6, 7], [8], [9], [], [3, 4], [2], [1]], 6)]
  runs, calls = {}, []
  mine = dict(share_programs=False)  # programs traced in this test, so that `recording` sees their calls
  samplers = (("one", Sampler(config, params, **mine)), ("mesh", Sampler(mesh_config, params, mesh=mesh, **mine)))
  for name, sampler in samplers:
    tasks, _, _, _ = sampler.prefill(sampler.init_cache(4, 64), [o[:-1] for o in openings], Role.USER)
    pool = paged.PagePool(8, z, shards=sampler.batch_multiple, rows=8)
    cache = sampler.fork(tasks, g, capacity=own, pages=pool)
    tokens = []
    for i, (prompts, max_new) in enumerate(turns):
      needs = [(r, pool.lengths.get(r, 0) + len(p) + max_new) for r, p in enumerate(prompts) if p]
      if pool.pages_needed(needs):  # the first turn: 8 pages cannot hold 8 rows of 11 slots
        size = pool.num_pages + pool.pages_needed(needs)
        pool.extend(size)
        cache = cache.extended(size)
      for r, n in needs:
        pool.grow(r, n)
      cache = cache.replace(table=jnp.asarray(pool.table(range(8), own // z)))
      kw = dict(role=Role.ACT, key=jax.random.key(i), max_new_tokens=max_new)
      with attention.recording() as recorded:
        out, cache = sampler.generate(cache, prompts, Role.OBSERVATION, **kw)
      calls += recorded if name == "mesh" else []
      tokens.append(out.tokens)
    runs[name] = (tokens, cache, pool)
  assert calls and {c.impl for c in calls if c.paged} == {route}  # traced here (a new config: new programs)
  (want, one, _), (got, sharded, pool) = runs["one"], runs["mesh"]
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)
  # Shard s holds rows 2s and 2s + 1; the fullest shards' rows hold 1 + 10 + 2 + 6 slots (5 pages) each: 10 pages.
  assert pool.shards == 4 and pool.num_pages == 4 * 10 and pool.allocated() == 7 * 5 + 3
  assert all(page // 10 == r // 2 for r, pages in pool.pages.items() for page in pages)  # shard s: pages 10s ..
  assert sharded.pools[0].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
  assert sharded.prefix.k[0].sharding.spec[0] == ("data", "fsdp")
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)  # noqa: E731
  jax.tree.map(close, (sharded.dense().k, sharded.lengths), (one.dense().k, one.lengths))


def test_out_of_range_input_is_refused_before_the_cache_is_touched(tiny_with_roles):
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  cache = sampler.init_cache(1, 32)
  kw = dict(key=jax.random.key(0), max_new_tokens=2)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    sampler.generate(cache, [[1, 2]], Role.USER, role=Role.ACT, key=jax.random.key(0), max_new_tokens=0)
  with pytest.raises(ValueError, match=f"prompt ids must be integers in \\[0, {config.vocab_size}\\)"):
    sampler.generate(cache, [[1, config.vocab_size]], Role.USER, role=Role.ACT, **kw)
  with pytest.raises(ValueError, match="role ids must be integers"):
    sampler.generate(cache, [[1, 2]], 99, role=Role.ACT, **kw)
  with pytest.raises(ValueError, match="role must be a role id"):
    sampler.generate(cache, [[1, 2]], Role.USER, role=-1, **kw)
  out, _ = sampler.generate(cache, [[1, 2]], Role.USER, role=Role.ACT, **kw)  # the cache was never donated
  assert out.lengths[0] == 2


def test_continuous_batching_equals_each_generation_alone(tiny_with_roles):
  """A `Stream` over a forked prefix cache: a row freed by a finished generation is admitted with its next prompt
  while the others keep decoding. Every generation equals that generation run alone (only its row active, same
  key): tokens, logprobs (<= 1e-4), finish reasons (eos, length, context_exhausted); and since no row waits for
  another, the loop ran exactly as many iterations as the busiest row needed (its generations back to back, plus
  one for a context_exhausted check)."""
  config, params = tiny_with_roles
  ends = range(config.vocab_size // 32)  # ~1 in 32 tokens ends one
  sampler = Sampler(config, params, eos_ids=ends, share_programs=False)
  sampling = SamplingParams(temperature=1.0)
  own = 24

  def forked():
    base, _, _, _ = sampler.prefill(sampler.init_cache(2, 64), [PROMPTS[0], PROMPTS[2]], Role.USER)
    return sampler.fork(base, 2, capacity=own)  # rows 0, 1 continue PROMPTS[0]; rows 2, 3 PROMPTS[2]

  # Per row, its generations in order: (prompt, max_new); row 3's last one outgrows its own slots.
  plans = {0: [([1, 2, 3], 6), ([4], 9), ([5, 6], 4)], 1: [([7], 3), ([8, 9], 12)], 2: [([10], 16)], 3: [([11], 4)]}
  plans[3].append(([12, 13], own))
  key = lambda row, k: jax.random.fold_in(jax.random.key(7), 10 * row + k)  # noqa: E731
  rows = len(plans)

  def admit(stream, starts):
    prompts = [plans[r][k][0] if r in starts else [] for r, k in ((r, starts.get(r)) for r in range(rows))]
    max_new = [plans[r][starts[r]][1] if r in starts else 1 for r in range(rows)]
    keys = jnp.stack([key(r, starts.get(r, 0)) for r in range(rows)])
    stream.admit(prompts, [[int(Role.OBSERVATION)] * len(p) for p in prompts], role=Role.ACT, keys=keys,
                 max_new_tokens=max_new)  # fmt: skip

  stream = sampler.stream(forked(), num_new=own, sampling=sampling)
  got, nxt = {}, dict.fromkeys(plans, 0)
  admit(stream, nxt)
  while stream.live.any():
    starts = {}
    for f in stream.advance(until=1):
      got[(f.row, nxt[f.row])] = f
      nxt[f.row] += 1
      if nxt[f.row] < len(plans[f.row]):
        starts[f.row] = nxt[f.row]
    if starts:
      admit(stream, starts)
  assert len(got) == sum(map(len, plans.values()))
  assert sampler.compile_counts["admit"] == 1  # every admission the same shapes: one trace

  alone = forked()
  busiest = 0
  for row, plan in plans.items():
    steps = 0
    for k, (prompt, max_new) in enumerate(plan):
      prompts = [prompt if r == row else [] for r in range(rows)]
      keys = jnp.stack([key(row, k)] * rows)
      want, alone = sampler.generate(alone, prompts, Role.OBSERVATION, role=Role.ACT, key=keys,
                                     max_new_tokens=max_new, sampling=sampling)  # fmt: skip
      f = got[(row, k)]
      assert f.tokens == want.row(row) and f.finish == want.finish_reasons[row], (row, k)
      np.testing.assert_allclose(f.logprobs, want.logprobs[row, : want.lengths[row]], atol=1e-4)
      steps += len(f.tokens) + (f.finish == FinishReason.CONTEXT_EXHAUSTED)
    busiest = max(busiest, steps)
  reasons = {f.finish for f in got.values()}
  assert {FinishReason.STOP, FinishReason.LENGTH, FinishReason.CONTEXT_EXHAUSTED} <= reasons, reasons
  assert stream.decode_steps == busiest
  np.testing.assert_array_equal(stream.cache.filled(), alone.filled())


def test_a_chunk_that_writes_few_rows_runs_on_those_rows_alone(tiny_with_roles):
  """Prefill of 2 of 8 forked rows (a shared prefix level) computes on a bucket of 2 gathered rows, then puts their
  slots back, and so does the decode of those 2 rows: logits after each prompt, the histories (keys and values slot
  for slot) and a greedy continuation equal the full-batch path's. Gathering: a one-device mesh (the main job's on
  one device); the full path: rows split over a data axis of 2 devices, which never gathers."""
  from envace_jax.sampling import sharding

  if len(jax.devices()) < 2:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by tests/conftest.py)")
  config, params = tiny_with_roles
  one, two = (sharding.make_mesh(data=n, devices=jax.devices()[:n]) for n in (1, 2))
  gathered = Sampler(config, params, mesh=one, share_programs=False)  # its own programs: `_jitted` says which ran
  full = Sampler(config, params, mesh=two, share_programs=False)
  prompts = [[], [4, 5, 6], [], [], [], [], [7] * 20, []]
  got, want = [], []
  for sampler, out in ((gathered, got), (full, want)):
    base, _, _, _ = sampler.prefill(sampler.init_cache(2, 64), [PROMPTS[0], PROMPTS[2]], Role.USER)
    cache, logits, fitted, count = sampler.prefill(sampler.fork(base, 4, capacity=128), prompts, Role.OBSERVATION)
    gen, cache = sampler.generate(cache, [p[-1:] for p in prompts], Role.OBSERVATION, role=Role.ACT,
                                  key=jax.random.key(0), max_new_tokens=6)  # fmt: skip
    out += [np.asarray(logits)[[1, 6]], np.asarray(fitted), count, gen.tokens, cache.flatten()]
  kinds = lambda s: {k[0] for k in s._jitted}  # noqa: E731
  assert {"prefill_rows", "decode_rows"} <= kinds(gathered) and not {"prefill_rows", "decode_rows"} & kinds(full)
  np.testing.assert_allclose(got[0], want[0], atol=1e-5)
  np.testing.assert_array_equal(got[1], want[1])
  assert got[2] == want[2] == 23
  np.testing.assert_array_equal(got[3], want[3])
  np.testing.assert_array_equal(got[4].lengths, want[4].lengths)
  # Float32 rounding of two program shapes (2 gathered rows, 4 rows a device) in keys and values of magnitude up to
  # ~5 (the peaked weights): 1.1e-5 apart at most when a 20-token prompt runs as 16 + 8 tokens.
  for a, b in zip((*got[4].k, *got[4].v), (*want[4].k, *want[4].v), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_a_chunk_that_writes_one_group_runs_on_its_rows_with_their_prefix_once(tiny_with_roles):
  """Two openings (40 and 30 tokens) forked into 2 tasks each (their own prompts), each task into 2 rows: two prefix
  levels, the openings' 64 slots longer than the chunks' attended slots (prefill_chunk 16), so gathering rows one by
  one (a prefix copy per row) is refused. A prefill that writes one row of the first task and one of the third runs
  on those tasks' 4 rows alone, with one copy of each task's prefix rows; the logits after each prompt, the histories
  and a greedy continuation equal the full-batch path's (a data axis of 2 devices, which never gathers). Rows of all
  four tasks make the whole batch: that chunk runs on all 8 rows."""
  from envace_jax.model import kvcache
  from envace_jax.sampling import sharding

  if len(jax.devices()) < 2:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by tests/conftest.py)")
  config, params = tiny_with_roles
  one, two = (sharding.make_mesh(data=n, devices=jax.devices()[:n]) for n in (1, 2))
  kw = dict(prefill_chunk=16, min_bucket=8, share_programs=False)
  gathered, full = Sampler(config, params, mesh=one, **kw), Sampler(config, params, mesh=two, **kw)
  first = [[], [4, 5, 6], [], [], [], [7] * 11, [], []]  # rows 1 and 5: tasks 0 and 2 (rows 0-1 and 4-5)
  every = [[8, 9], [], [10] * 5, [], [11], [], [12, 13], []]  # rows 0, 2, 4 and 6: every task

  def forked(sampler):
    openings, _, _, _ = sampler.prefill(sampler.init_cache(2, 64), [PROMPTS[2], PROMPTS[2][:30]], Role.USER)
    tasks = sampler.fork(openings, 2, capacity=16)
    tasks, _, _, _ = sampler.prefill(tasks, [PROMPTS[0], PROMPTS[1], [11, 12], [13]], Role.USER)
    return sampler.fork(tasks, 2, capacity=32)

  got, want = [], []
  for sampler, out in ((gathered, got), (full, want)):
    cache = forked(sampler)
    assert [level.lengths.shape[0] for level in cache.levels()] == [4, 2] and cache.prefix.prefix.capacity == 64
    if sampler is gathered:
      assert not sampler._gathers(cache, 2, 16) and sampler._groups(cache, np.array([1, 5])).tolist() == [0, 1, 4, 5]
      assert sampler._groups(cache, np.array([0, 2, 4, 6])) is None
    cache, logits, _, count = sampler.prefill(cache, first, Role.OBSERVATION)
    kinds_first = {k[0] for k in sampler._jitted}
    cache, logits2, _, count2 = sampler.prefill(cache, every, Role.OBSERVATION)
    gen, cache = sampler.generate(cache, [[3]] * 8, Role.OBSERVATION, role=Role.ACT, key=jax.random.key(0),
                                  max_new_tokens=5)  # fmt: skip
    out += [np.asarray(logits)[[1, 5]], np.asarray(logits2)[[0, 2, 4, 6]], (count, count2), gen.tokens]
    out += [cache.flatten(), kinds_first]
  assert "prefill_rows" in got[5] and "prefill_rows" not in want[5]
  np.testing.assert_allclose(got[0], want[0], atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], atol=1e-5)
  assert got[2] == want[2] == (14, 10)
  np.testing.assert_array_equal(got[3], want[3])
  np.testing.assert_array_equal(got[4].lengths, want[4].lengths)
  for a, b in zip((*got[4].k, *got[4].v), (*want[4].k, *want[4].v), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5)  # float rounding: 1 device against 2
  # Grouped, the third task's 2 rows take each level's row once (one by one: 2 copies of each).
  cache = forked(gathered)
  rows = jnp.array([4, 5], jnp.int32)
  grouped, one_by_one = kvcache.gather_levels(cache, rows, True), kvcache.gather_levels(cache, rows)
  for a, b, n in ((grouped, one_by_one, 2), (grouped.prefix, one_by_one.prefix, 30)):
    assert a.lengths.shape == (1,) and b.lengths.shape == (2,) and int(a.lengths[0]) == n
    np.testing.assert_array_equal(np.asarray(a.k[0][0]), np.asarray(b.k[0][1]))


def test_a_raw_uint32_key_is_one_key_not_one_per_row(tiny_with_roles):
  """``jax.random.PRNGKey(0)`` (uint32[2]) is the typed ``jax.random.key(0)``: each row still folds in its row id,
  so two rows with the same prompt sample differently, and exactly as with the typed key."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  kw = dict(role=Role.ACT, max_new_tokens=8, sampling=SamplingParams(temperature=1.0))
  raw, _ = sampler.generate(sampler.init_cache(2, 32), [[5, 6], [5, 6]], Role.USER, key=jax.random.PRNGKey(0), **kw)
  typed, _ = sampler.generate(sampler.init_cache(2, 32), [[5, 6], [5, 6]], Role.USER, key=jax.random.key(0), **kw)
  np.testing.assert_array_equal(raw.tokens, typed.tokens)
  assert raw.row(0) != raw.row(1)


_RESTS = [[5, 6, 7], [9, 10, 11]]  # two tasks' own prompts after PROMPTS[2]


def _dense_and_paged_forks(sampler, g: int, own: int, num_pages: int, page: int = 4):
  """PROMPTS[2] prefilled once, forked into the two tasks of `_RESTS` (all but their last token prefilled), each
  forked into G rows of ``own`` slots: dense rows, and the same rows in pages (each row's room reserved up front)
  under copies of the same prefix levels. Returns (dense, pages, pool)."""
  from envace_jax.model import paged

  small, _, _, _ = sampler.prefill(sampler.init_cache(1, 64), [PROMPTS[2]], Role.USER)
  tasks = sampler.fork(small, len(_RESTS), capacity=8)
  tasks, _, _, _ = sampler.prefill(tasks, [r[:-1] for r in _RESTS], Role.USER)
  dense = sampler.fork(tasks, g, capacity=own)
  pool = paged.PagePool(num_pages=num_pages, page_size=page)
  rows = list(range(len(_RESTS) * g))
  for r in rows:
    pool.grow(r, own)
  levels = jax.tree.map(jnp.copy, dense.prefix)  # generate donates a cache, its prefix levels too
  config = sampler.config.replace(scan_layers=False)
  pages = paged.init_cache(config, pool, rows, width=own // page).replace(prefix=levels)
  return dense, pages.replace(lengths=jnp.zeros(len(rows), jnp.int32)), pool


def test_paged_own_slots_equal_the_dense_path(tiny_with_roles):
  """Each fork's own slots in pages (`paged.PagedKVCache`, pages reserved before the turns) after the same shared
  prefix levels as `test_nested_shared_prefixes_equal_the_dense_path`: three turns of greedy decoding with ragged
  prompts give the dense path's tokens, logprobs (<= 1e-4) and finish reasons, context_exhausted when a row's pages
  are full."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  rests, g, own = _RESTS, 3, 20
  dense, pages, pool = _dense_and_paged_forks(sampler, g, own, num_pages=40)
  assert pool.allocated() == 6 * 5 and pages.capacity == own
  assert pages.stored_slots() == dense.stored_slots() == 6 * own + 2 * 8 + 64  # own pages, then the two levels
  turns = [([r[-1:] for r in rests for _ in range(g)], 8), ([[2, 3], [4], [2, 3, 4], [5], [6, 7], [8]], 12)]
  turns += [([[], [9], [], [], [], [3]], 6)]
  got, dense, pages = _same_turns(sampler, dense, pages, turns)
  assert FinishReason.CONTEXT_EXHAUSTED in got.finish_reasons
  np.testing.assert_array_equal(pages.lengths, dense.lengths)


def test_paged_rows_of_one_group_prefill_grouped_as_the_dense_rows_do(tiny_with_roles):
  """Pages under two shared prefix levels, G = 2: a turn that writes one row runs its prefill on that row's group
  alone (`Sampler._groups`: the levels' 72 slots refuse gathering row by row), on pages as on dense rows, and both
  give the same tokens, logprobs and finish reasons as each other over three turns (the dense grouped path against
  the full batch: `test_a_chunk_that_writes_one_group_runs_on_its_rows_with_their_prefix_once`)."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params, share_programs=False)
  rests, g = _RESTS, 2
  dense, pages, _ = _dense_and_paged_forks(sampler, g, own=20, num_pages=20)
  for cache in (dense, pages):
    assert not sampler._gathers(cache, 1, 32) and sampler._groups(cache, np.array([1])).tolist() == [0, 1]
    assert sampler._groups(cache, np.array([1, 3])) is None  # both groups: the whole batch
  turns = [([r[-1:] for r in rests for _ in range(g)], 6), ([[2, 3], [], [], []], 4), ([[], [9], [], [5]], 16)]
  got, dense, pages = _same_turns(sampler, dense, pages, turns)
  assert "prefill_rows" in {k[0] for k in sampler._jitted}  # the second turn's prefill ran on the group alone
  assert FinishReason.CONTEXT_EXHAUSTED in got.finish_reasons
  np.testing.assert_array_equal(pages.lengths, dense.lengths)


def test_paged_rows_work_gathered_and_with_pages_of_their_own(tiny_with_roles):
  """Rows with different numbers of pages: a row stops (context_exhausted) at its own pages, as a dense row of that
  many slots does; a turn on 2 of 4 rows runs on those rows alone (their table rows gathered, no KV copied) and
  equals the dense path."""
  from envace_jax.model import paged

  config, params = tiny_with_roles
  sampler = Sampler(config, params, share_programs=False)
  pool = paged.PagePool(num_pages=32, page_size=4)
  room = [24, 24, 12, 24]  # row 2 holds 3 pages
  for r, n in enumerate(room):
    pool.grow(r, n)
  pages = paged.init_cache(config.replace(scan_layers=False), pool, range(4), width=6)
  pages = pages.replace(lengths=jnp.zeros(4, jnp.int32))
  np.testing.assert_array_equal(pages.row_capacity(), room)
  assert pages.stored_slots() == sum(room) == 84  # the pages held, not 4 rows x 24
  dense = [sampler.init_cache(4, 24), sampler.init_cache(1, 12)]  # row 2 alone in a cache of its room
  prompts = [PROMPTS[0], PROMPTS[1], [4, 5, 6, 7], [8]]
  kw = dict(role=Role.ACT, key=jax.random.key(3), max_new_tokens=10)
  got, pages = sampler.generate(pages, prompts, Role.USER, **kw)
  want, dense[0] = sampler.generate(dense[0], prompts, Role.USER, **kw)
  alone, dense[1] = sampler.generate(dense[1], [prompts[2]], Role.USER, **kw)
  for row in (0, 1, 3):  # greedy
    assert got.row(row) == want.row(row) and got.finish_reasons[row] == want.finish_reasons[row]
  assert got.row(2) == alone.row(0)
  assert got.finish_reasons[2] == alone.finish_reasons[0] == FinishReason.CONTEXT_EXHAUSTED
  np.testing.assert_allclose(got.logprobs[2], alone.logprobs[0], atol=1e-4)
  assert int(pages.lengths[2]) == int(dense[1].lengths[0]) == 12
  kw = dict(role=Role.ACT, key=jax.random.key(4), max_new_tokens=4)
  few = [[], [9, 10], [], [11]]
  got, pages = sampler.generate(pages, few, Role.OBSERVATION, **kw)
  want, dense[0] = sampler.generate(dense[0], few, Role.OBSERVATION, **kw)
  assert {"prefill_rows", "decode_rows"} <= {k[0] for k in sampler._jitted}
  np.testing.assert_array_equal(got.tokens[[1, 3]], want.tokens[[1, 3]])
  np.testing.assert_allclose(got.logprobs[[1, 3]], want.logprobs[[1, 3]], atol=1e-4)
  np.testing.assert_array_equal(np.asarray(pages.lengths)[[0, 1, 3]], np.asarray(dense[0].lengths)[[0, 1, 3]])


def test_paged_rows_compile_one_program_for_every_history_length(tiny_with_roles):
  """Turns that grow the rows' histories across several attend buckets (`Sampler.attend_bucket`, here 8, 16, 32, 64
  slots) compile a prefill and a decode per bucket on dense rows, and one of each on pages (their attention reads
  up to the last filled page whatever the table's width); the same greedy tokens either way."""
  from envace_jax.model import paged

  config, params = tiny_with_roles
  kw = dict(prefill_chunk=8, min_bucket=8, share_programs=False)  # each its own programs and counts
  dense_sampler, paged_sampler = (Sampler(config, params, **kw) for _ in range(2))
  pool = paged.PagePool(num_pages=32, page_size=4)
  for r in range(2):
    pool.grow(r, 64)
  pages = paged.init_cache(config.replace(scan_layers=False), pool, range(2), width=16)
  pages = pages.replace(lengths=jnp.zeros(2, jnp.int32))
  dense = dense_sampler.init_cache(2, 64)
  kw = dict(role=Role.ACT, max_new_tokens=6)
  for turn in range(5):
    prompts = [[3 + turn, 4, 5, 6], [7, 8 + turn, 9, 10]]
    want, dense = dense_sampler.generate(dense, prompts, Role.USER, key=jax.random.key(turn), **kw)
    got, pages = paged_sampler.generate(pages, prompts, Role.USER, key=jax.random.key(turn), **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
  assert int(pages.lengths[0]) == int(dense.lengths[0]) == 50  # 5 turns of 4 + 6 tokens: buckets 8 .. 64
  assert dense_sampler.compile_counts["decode"] >= 3 and dense_sampler.compile_counts["prefill"] >= 3
  assert paged_sampler.compile_counts == {"prefill": 1, "decode": 1, "admit": 1}


def test_advance_in_chunks_of_steps_and_dropped_rows(tiny_with_roles):
  """``advance(max_steps=k)`` decodes at most k tokens per call (possibly handing back nothing) and ends with the
  tokens of one unbounded call; a row ended with ``drop`` stops at once, is never handed back, and leaves the
  others' tokens unchanged (the serving engine's cancellation between chunks)."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params)
  hot = SamplingParams(temperature=1.0)
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(5), jnp.arange(len(PROMPTS), dtype=jnp.uint32))
  want, _ = sampler.generate(
    sampler.init_cache(len(PROMPTS), 96), PROMPTS, Role.USER, role=Role.ACT, key=keys, max_new_tokens=12, sampling=hot
  )

  def chunked(drop_after=None):
    stream = sampler.stream(sampler.init_cache(len(PROMPTS), 96), num_new=12, sampling=hot)
    stream.admit(PROMPTS, [[int(Role.USER)] * len(p) for p in PROMPTS], role=Role.ACT, keys=keys, max_new_tokens=12)
    got, calls, steps = {}, 0, stream.decode_steps
    while stream.live.any():
      for f in stream.advance(max_steps=3):
        got[f.row] = f
      assert stream.decode_steps - steps <= 3
      steps, calls = stream.decode_steps, calls + 1
      if calls == drop_after:
        stream.drop([0, 0])
        assert not stream.live[0]
    return got, calls

  got, calls = chunked()
  assert calls >= 12 // 3
  for row in range(len(PROMPTS)):
    assert got[row].tokens == want.row(row) and got[row].finish == want.finish_reasons[row]
  got, _ = chunked(drop_after=2)
  assert 0 not in got and sorted(got) == list(range(1, len(PROMPTS)))
  for row in got:
    assert got[row].tokens == want.row(row)
  with pytest.raises(ValueError, match="max_steps must be >= 1"):
    sampler.stream(sampler.init_cache(1, 96), num_new=4).advance(max_steps=0)


def _constant_sample(logits_bv, keys, params: SamplingParams):
  """The draw of the decode program before temperature and top_p were its data: both constants of the program (one
  compiled per value). The oracle of `sample_tokens`' parity."""
  if params.temperature == 0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  x_bv = logits_bv / params.temperature
  if params.top_k:
    kth = jax.lax.top_k(x_bv, params.top_k)[0][:, -1:]
    x_bv = jnp.where(x_bv < kth, -jnp.inf, x_bv)
  if params.top_p < 1.0:
    sorted_bv = jnp.sort(x_bv, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_bv, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < params.top_p
    threshold = jnp.min(jnp.where(keep, sorted_bv, jnp.inf), axis=-1, keepdims=True)
    x_bv = jnp.where(x_bv < threshold, -jnp.inf, x_bv)
  return jax.vmap(jax.random.categorical)(keys, x_bv).astype(jnp.int32)


@pytest.mark.parametrize("top_k", [0, 20])
def test_traced_sampling_values_draw_what_constant_ones_drew(top_k):
  """Rows of mixed temperatures and top_p in one `sample_tokens` call (the values data, one program) draw exactly the
  tokens of the former program compiled for each row's values as constants (XLA turns ``x / c`` into
  ``x * (1 / c)``: `RowSampling` passes that reciprocal), over 64 draws of 8 rows; the all-greedy batch too."""
  from envace_jax.sampling.sampler import RowSampling, sample_tokens

  settings = [SamplingParams(t, p, top_k) for t, p in [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9), (0.6, 0.95), (1.3, 1.0),
                                                       (0.3, 0.5), (2.0, 0.99), (0.45, 1.0)]]  # fmt: skip
  logits = jax.random.normal(jax.random.key(0), (8, 300)) * 3
  traced = jax.jit(sample_tokens, static_argnames="top_k")
  constant = jax.jit(_constant_sample, static_argnums=2)
  draws = 0
  for seed in range(64):
    keys = jax.random.split(jax.random.key(seed + 1), 8)
    got = np.asarray(traced(logits, keys, RowSampling.of(settings), top_k=top_k))
    want = [int(constant(logits, keys, s)[b]) for b, s in enumerate(settings)]
    assert got.tolist() == want, seed
    draws += len(set(got.tolist()))
  assert draws > 64 * 4  # the rows draw different tokens: the parity is not that of one argmax
  greedy = RowSampling.of([GREEDY] * 8)
  np.testing.assert_array_equal(traced(logits, keys, greedy, top_k=top_k), jnp.argmax(logits, axis=-1))


@pytest.mark.parametrize("scale", [8.0, 0.5])
def test_nucleus_from_the_top_candidates_is_the_whole_sorts(scale):
  """`sampler._nucleus` keeps exactly the tokens the whole-vocabulary sort keeps (`_constant_sample`'s mask), both when
  every row's nucleus lies in its top `NUCLEUS_CANDIDATES` tokens (peaked logits, scale 8: the top-k path) and when
  it does not (scale 0.5: the sort), over 2,048 tokens and top_p from 0.3 to 0.99."""
  from envace_jax.sampling.sampler import NUCLEUS_CANDIDATES, _nucleus

  top_p = jnp.asarray([[0.3], [0.5], [0.9], [0.95], [0.99], [0.95], [0.7], [0.999]])
  logits = jax.random.normal(jax.random.key(3), (8, 2048)) * scale
  top = jax.lax.top_k(logits, NUCLEUS_CANDIDATES)[0]
  mass = jnp.sum(jax.nn.softmax(logits, axis=-1) * (logits >= top[:, -1:]), axis=-1)
  assert bool(jnp.all(mass[:, None] > top_p + 1e-4)) == (scale > 1)  # the case each parameter is about
  got = np.isfinite(np.asarray(jax.jit(_nucleus)(logits, top_p)))
  for b in range(8):
    sorted_b = jnp.sort(logits[b])[::-1]
    probs = jax.nn.softmax(sorted_b)
    keep = (jnp.cumsum(probs) - probs) < top_p[b, 0]
    threshold = jnp.min(jnp.where(keep, sorted_b, jnp.inf))
    np.testing.assert_array_equal(got[b], np.asarray(logits[b] >= threshold), err_msg=f"row {b}")
  assert 1 < got.sum(axis=-1).max() < 2048  # not the argmax alone, nor everything


def test_extreme_temperature_and_top_p_sample_their_limit_the_argmax():
  """A top_p below float32's resolution (1e-38, 1e-300) keeps the most likely token, and a temperature whose
  reciprocal overflows float32 (1e-39, 1e-45) or is below `MIN_TEMPERATURE` samples greedily: both limits are the
  argmax (they drew token 0 / a special token before: nothing kept, logits overflowed)."""
  from envace_jax.sampling.sampler import MIN_TEMPERATURE, RowSampling, sample_tokens

  settings = [SamplingParams(1.0, 1e-38), SamplingParams(0.7, 1e-300), SamplingParams(1e-39), SamplingParams(1e-45),
              SamplingParams(MIN_TEMPERATURE / 2, 0.5), SamplingParams(1e-37)]  # fmt: skip
  logits = jax.random.normal(jax.random.key(1), (len(settings), 300)) * 3 + 5
  for seed in range(4):
    keys = jax.random.split(jax.random.key(seed), len(settings))
    got = sample_tokens(logits, keys, RowSampling.of(settings))
    np.testing.assert_array_equal(got, jnp.argmax(logits, axis=-1))


def test_rows_of_one_stream_sample_with_their_own_values_and_compile_once(tiny_with_roles):
  """A stream whose rows each have their own temperature and top_p (`Stream.admit`'s ``sampling``) gives each row
  the tokens of a run of its setting alone, and no setting compiles the decode loop again."""
  config, params = tiny_with_roles
  sampler = Sampler(config, params, share_programs=False)
  prompts = PROMPTS + [PROMPTS[0]]
  settings = [GREEDY, SamplingParams(1.0), SamplingParams(0.7, 0.9), SamplingParams(1.4, 0.6)]
  keys = jax.random.split(jax.random.key(3), len(prompts))
  kw = dict(role=Role.ACT, key=keys, max_new_tokens=12)
  alone = [sampler.generate(sampler.init_cache(4, 96), prompts, Role.USER, sampling=s, **kw)[0] for s in settings]
  assert sampler.compile_counts["decode"] == 1
  stream = sampler.stream(sampler.init_cache(4, 96), num_new=12)
  stream.admit(prompts, Role.USER, role=Role.ACT, keys=keys, max_new_tokens=12, sampling=settings)
  got = {f.row: f.tokens for f in stream.advance()}
  assert got == {b: alone[b].row(b) for b in range(4)}
  assert len({tuple(alone[b].row(0)) for b in range(4)}) == 4  # the settings sample differently
  assert sampler.compile_counts["decode"] == 1
  with pytest.raises(ValueError, match="top_k is the stream's"):
    sampler.stream(sampler.init_cache(4, 96), num_new=4).admit(
      prompts, Role.USER, role=Role.ACT, keys=keys, max_new_tokens=4, sampling=SamplingParams(top_k=5)
    )
