"""Attention per backend (model/attention.py) on CPU: the selection, ``jax.nn.dot_product_attention`` through our
wrapper against the reference ``transformer._attend``, the model routed through it, and bfloat16 compute."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax.model import attention, transformer
from envace_jax.model import config as config_lib
from envace_jax.rl import logprobs
from tests.conftest import jit_apply

B, K, G, H = 3, 2, 3, 16


@pytest.mark.parametrize(
  "setting, backend, dtype, head_dim, q_len, kv_len, cached, causal_mask, want",
  [
    # CPU: the reference whatever the call, unless forced.
    ("auto", "cpu", "bfloat16", 128, 512, 512, False, True, "reference"),
    ("auto", "cpu", "float32", 64, 1, 300, True, False, "reference"),
    ("xla", "cpu", "float32", 64, 64, 64, False, False, "xla"),
    ("xla", "cpu", "float32", 64, 1, 300, True, False, "xla"),
    ("xla", "cpu", "float32", 64, 16, 300, True, False, "xla"),  # prefill over a cache: parts merged by lse
    ("reference", "gpu", "bfloat16", 128, 512, 512, False, True, "reference"),
    # GPU: cuDNN for half-precision self-attention (T, S even) and decode; not for float32 or odd rows.
    ("auto", "gpu", "bfloat16", 128, 512, 512, False, False, "cudnn"),
    ("auto", "cuda", "float16", 64, 1, 301, True, False, "cudnn"),
    ("auto", "gpu", "bfloat16", 128, 1, 4096, True, False, "cudnn"),
    ("auto", "gpu", "bfloat16", 128, 512, 4096, True, False, "cudnn"),
    ("auto", "gpu", "float32", 128, 512, 512, False, True, "reference"),
    ("auto", "gpu", "bfloat16", 128, 511, 511, False, True, "reference"),
    ("auto", "gpu", "bfloat16", 256, 512, 512, False, True, "reference"),
    ("auto", "gpu", "bfloat16", 100, 1, 512, True, False, "reference"),
    # TPU: the Pallas kernel for causal & valid-key self-attention in whole 128-token blocks only.
    ("auto", "tpu", "bfloat16", 128, 1024, 1024, False, True, "pallas_tpu"),
    ("auto", "tpu", "bfloat16", 128, 1024, 1024, False, False, "reference"),  # packed segments
    ("auto", "tpu", "bfloat16", 128, 1000, 1000, False, True, "reference"),
    ("auto", "tpu", "bfloat16", 128, 1, 1000, True, False, "pallas_tpu"),  # keys padded to its blocks
    ("auto", "tpu", "bfloat16", 192, 1, 1024, True, False, "reference"),  # head dim: <= 128 or a multiple
    ("pallas_tpu", "cpu", "float32", 64, 256, 256, False, True, "pallas_tpu"),
  ],
)
def test_select(setting, backend, dtype, head_dim, q_len, kv_len, cached, causal_mask, want):
  got = attention.select(setting, backend, dtype, head_dim, q_len, kv_len, cached=cached, causal_mask=causal_mask)
  assert got == want


def test_unknown_setting_is_refused():
  with pytest.raises(ValueError, match="attention='flash'"):
    attention.select("flash", "gpu", "bfloat16", 128, 8, 8, cached=False, causal_mask=True)
  with pytest.raises(config_lib.ConfigError, match="attention='flash'; use one of"):
    config_lib.PRESETS["tiny"].replace(attention="flash")


def _masks(t: int) -> dict[str, np.ndarray]:
  """bool[B, T, T] self-attention masks: left padding, and packed rows (a root, then two suffixes that each see the
  root and themselves, as rl/batch.py lays them out), both with right padding."""
  idx = np.arange(t)
  causal = idx[None, :] <= idx[:, None]
  valid = np.ones((B, t), bool)
  valid[0, :5] = False  # left padding: queries 0-4 see no key
  valid[1, t - 3 :] = False
  segments = np.zeros((B, t), np.int32)
  segments[:, t // 3 : 2 * t // 3] = 1
  segments[:, 2 * t // 3 :] = 2
  seen = (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None])
  return {
    "padded": causal[None] & valid[:, None, :],
    "packed": causal[None] & valid[:, None, :] & seen,
  }


def _inputs(t: int, s: int, dtype, seed: int = 0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q_bkgth = jax.random.normal(kq, (B, K, G, t, H), jnp.float32).astype(dtype)
  k_bkhs = jax.random.normal(kk, (B, K, H, s), jnp.float32).astype(dtype)
  v_bksh = jax.random.normal(kv, (B, K, s, H), jnp.float32).astype(dtype)
  return q_bkgth, k_bkhs, v_bksh


def _ours_via_jax_nn(q_bkgth, k_bkhs, v_bksh, mask, causal):
  """`attention.dot_product` (implementation "xla") in the transformer's layouts, output [B, K, G, T, H]."""
  b, k, g, t, h = q_bkgth.shape
  q_btnh = q_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, h)
  out = attention.dot_product(q_btnh, k_bkhs.transpose(0, 3, 1, 2), v_bksh.swapaxes(1, 2), mask, "xla", causal)
  return out.reshape(b, t, k, g, h).transpose(0, 2, 3, 1, 4)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 0.0)])
@pytest.mark.parametrize("kind", ["padded", "packed", "decode"])
def test_jax_nn_equals_attend(kind, dtype, tol):
  """Random grouped-query inputs: rows that see a key agree (float32 up to rounding; bfloat16 exactly: both round
  the same float32 softmax to bfloat16 before the value matmul); a query that sees no key gets the mean of the
  values from both (every logit equally masked)."""
  t = 24
  if kind == "decode":  # one new token per row over a cache of 40 slots, rows filled to 7, 40 and 0 slots
    lengths = np.array([7, 40, 0])
    mask = np.arange(40)[None, None, :] < lengths[:, None, None]
    q, k, v = _inputs(1, 40, dtype)
  else:
    mask = _masks(t)[kind]
    q, k, v = _inputs(t, t, dtype)
  ours = np.asarray(_ours_via_jax_nn(q, k, v, jnp.asarray(mask), causal=kind != "decode"), np.float32)
  ref = np.asarray(transformer._attend(q, k, v, jnp.asarray(mask), H), np.float32)
  seen = mask.any(-1)  # [B, T]
  assert 0 < seen.sum() < seen.size  # both kinds of rows are compared
  rows = lambda x: x.transpose(0, 3, 1, 2, 4)[seen]  # noqa: E731  [rows that see a key, K, G, H]
  np.testing.assert_allclose(rows(ours), rows(ref), atol=tol, rtol=0)
  mean_v = np.asarray(v, np.float32).mean(axis=2)  # [B, K, H]
  empty = ~seen
  for out in (ours, ref):
    got = out.transpose(0, 3, 1, 2, 4)[empty]  # [rows, K, G, H]
    want = np.broadcast_to(mean_v[:, None, :, None], (B, t if kind != "decode" else 1, K, G, H))[empty]
    np.testing.assert_allclose(got, want, atol=1e-2 if dtype == jnp.bfloat16 else 1e-6)


def test_tpu_flash_equals_attend():
  """`attention.tpu_flash` through the pure-JAX reference that ships with the Pallas TPU kernel (the same module,
  the same arguments; the kernel itself runs on TPU only): causal & valid keys, grouped-query heads repeated, equal
  to `transformer._attend` on `CausalMask`'s dense mask at every query that sees a key."""
  from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

  t = 24
  valid = np.ones((B, t), bool)
  valid[0, :5] = False
  valid[2, t - 4 :] = False
  mask = attention.CausalMask.of(jnp.asarray(valid))
  q, k, v = _inputs(t, t, jnp.float32, seed=1)
  q_btnh = q.transpose(0, 3, 1, 2, 4).reshape(B, t, K * G, H)
  got = attention.tpu_flash(q_btnh, k.transpose(0, 3, 1, 2), v.swapaxes(1, 2), mask.valid, pallas_flash.mha_reference)
  ref = transformer._attend(q, k, v, mask.dense, H).transpose(0, 3, 1, 2, 4).reshape(B, t, K * G, H)
  seen = np.asarray(mask.dense).any(-1)
  assert 0 < seen.sum() < seen.size
  np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(ref)[seen], atol=2e-6, rtol=0)


@pytest.fixture(scope="module")
def tiny():
  config = config_lib.PRESETS["tiny"]
  params = transformer.init_params(config, jax.random.key(0))
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 64), 0, config.vocab_size), np.int32)
  valid = np.ones((4, 64), bool)
  valid[0, :9] = False  # left padding
  valid[3, 50:] = False  # right padding
  return config, params, tokens, valid


def test_model_routed_through_jax_nn_equals_reference(tiny):
  """The tiny model with attention forced to ``jax.nn.dot_product_attention`` ("xla", the code path cuDNN takes on a
  GPU): the forward's logits at valid tokens, a decode step over a cache (the sampler's layer layout) and the training
  forward's gradient agree with the reference to float32 rounding (measured: max |Δ logit| 1.6e-7)."""
  config, params, tokens, valid = tiny
  routed = config.replace(attention="xla")
  ref, _ = jit_apply(config, params, tokens, valid=valid)
  got, _ = jit_apply(routed, params, tokens, valid=valid)
  np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(ref)[valid], atol=1e-5, rtol=0)

  c, p = config.replace(scan_layers=False), transformer.unstack_layers(params)  # the sampler's layout
  steps = []
  for cfg in (c, c.replace(attention="xla")):
    cache = transformer.init_cache(cfg, 4, 80)
    _, cache = jit_apply(cfg, p, tokens[:, :48], cache=cache, valid=valid[:, :48])
    logits, _ = jit_apply(cfg, p, tokens[:, 48:49], cache=cache)
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(steps[1], steps[0], atol=1e-5, rtol=0)

  def loss(cfg, p):
    index = jnp.tile(jnp.arange(64)[None], (4, 1))
    hidden = logprobs.training_hidden(cfg, p, tokens, jnp.zeros_like(tokens), valid, index, remat=True)
    return jnp.sum(jnp.where(valid[:, :, None], hidden, 0.0) ** 2)

  grads = [jax.jit(jax.grad(loss, argnums=1), static_argnums=0)(cfg, params) for cfg in (config, routed)]
  # To float32 rounding at each leaf's own scale (measured: at most 2.5e-6 of the leaf's largest entry; the leaves'
  # scales span 0.26 to 811, so one absolute tolerance would be loose for some and below rounding for others).
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads[0]), jax.tree.leaves(grads[1]), strict=True):
    scale = max(float(np.max(np.abs(a))), float(np.max(np.abs(b))))
    np.testing.assert_allclose(b, a, atol=1e-5 * scale, rtol=0, err_msg=jax.tree_util.keystr(path))


# bfloat16 compute (float32 parameters cast at use, float32 logits) against float32 compute on the tiny model,
# measured 2026-12-04 on CPU: max |Δ logit| 0.0041 (mean 0.00064; the float32 logits span -0.73 .. 0.66, so about
# one bfloat16 rounding step, 2^-8 relative), top-1 agreement 99.6% (one position in 247 flipped, whose float32
# top-1 margin was 0.0003). Tolerance: max |Δ| <= 0.01, and the top-1 token must agree wherever float32's margin
# exceeds 2 x 0.01 (a flip there would need an error above the tolerance).
BF16_MAX_ABS = 0.01


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_bfloat16_logits_match_float32(tiny, impl):
  config, params, tokens, valid = tiny
  f32, _ = jit_apply(config, params, tokens, valid=valid)
  bf16, _ = jit_apply(config.replace(dtype="bfloat16", attention=impl), params, tokens, valid=valid)
  f32, bf16 = np.asarray(f32)[valid], np.asarray(bf16)[valid]
  assert bf16.dtype == np.float32
  delta = np.abs(bf16 - f32)
  assert 0 < delta.max() <= BF16_MAX_ABS  # bfloat16 did change the compute, within the tolerance
  top2 = np.sort(f32, axis=-1)[:, -2:]
  clear = top2[:, 1] - top2[:, 0] > 2 * BF16_MAX_ABS
  assert clear.mean() > 0.5
  np.testing.assert_array_equal(bf16[clear].argmax(-1), f32[clear].argmax(-1))
  assert (bf16.argmax(-1) == f32.argmax(-1)).mean() >= 0.98


def test_recording_and_backend_name():
  """`attention.recording` collects one `Call` per layer and call at trace time, with the backend `attention.backend`
  names: a bfloat16 decode step of the tiny model over a dense cache, traced (not run) for a GPU and the CPU."""
  config = config_lib.PRESETS["tiny"].replace(scan_layers=False, dtype="bfloat16")
  params = jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0)))
  cache = jax.eval_shape(lambda: transformer.init_cache(config, 2, 16))
  # A new function per trace: jax caches traces by function, and neither setting is part of its key.
  step = lambda: lambda p, c: transformer.apply(config, p, jnp.zeros((2, 1), jnp.int32), cache=c)  # noqa: E731
  with attention.recording() as outer:
    with attention.recording() as gpu, attention.backend("gpu"):
      jax.make_jaxpr(step())(params, cache)
    with attention.recording() as cpu:
      jax.make_jaxpr(step())(params, cache)
  want = attention.Call("decode", "cudnn", "gpu", 0, False, "bfloat16", 1, 16)
  assert gpu == [want] * config.num_layers
  assert cpu == [dataclasses.replace(want, impl="reference", backend=jax.default_backend())] * config.num_layers
  assert outer == gpu + cpu
  assert attention.current_backend() == jax.default_backend()


def _forked_caches(config, params, own: int, page: int):
  """A two-level history as the rollouts lay it out: 2 task openings prefilled in a root cache (prefix level), forked
  into G = 2 rows each whose own slots are a dense `KVCache` or pages of a pool (`paged.PagedKVCache`); rows 0 and 3
  have room for fewer own slots (pages) than the others."""
  from envace_jax.model import paged

  tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 21), 0, config.vocab_size), np.int32)
  valid = np.ones((2, 21), bool)
  valid[1, 17:] = False  # openings of 21 and 17 tokens
  _, root = jit_apply(config, params, tokens, cache=transformer.init_cache(config, 2, 32), valid=valid)
  dense = transformer.init_cache(config, 4, own).replace(prefix=root)
  pool = paged.PagePool(num_pages=4 * own // page + 1, page_size=page)
  for row, room in enumerate([own - page, own, own, own - 2 * page]):
    pool.grow(row, room)
  pages = paged.init_cache(config, pool, range(4), width=own // page).replace(prefix=root)
  pages = pages.replace(lengths=jnp.zeros(4, jnp.int32))
  return dense, pages


@pytest.mark.parametrize(
  "dtype, tol, own", [("float32", 1e-6, "dense"), ("float32", 1e-6, "pages"), ("bfloat16", BF16_MAX_ABS, "pages")]
)
def test_routed_rollout_calls_equal_the_reference(tiny, dtype, tol, own):
  """The rollout's cached calls (a ragged prefill chunk over own slots or pages after a shared prefix level, then a
  decode step) routed through the kernels' parts with ``jax.nn.dot_product_attention(implementation="xla",
  return_residual=True)`` (the cuDNN route's CPU form: the same call, the same log-sum-exp merge) give the reference
  path's logits at every valid position. float32: to rounding (measured max |Δ| 1.5e-7); bfloat16: within
  `BF16_MAX_ABS` (measured 0.0028, about what bfloat16 compute itself moves them: the merge reads a bfloat16
  log-sum-exp, ``jax.nn`` casts it to the compute dtype)."""
  config, params, _, _ = tiny
  config = config.replace(scan_layers=False, dtype=dtype)
  params = transformer.unstack_layers(params)
  rng = np.random.default_rng(3)
  chunk = rng.integers(0, config.vocab_size, (4, 6)).astype(np.int32)
  valid = np.ones((4, 6), bool)
  valid[0, :2] = False  # left padding
  valid[2, 4:] = False  # right padding
  step = rng.integers(0, config.vocab_size, (4, 1)).astype(np.int32)
  cache = _forked_caches(config, params, own=16, page=4)[own == "pages"]
  got = []
  for impl in ("reference", "xla"):
    cfg = config.replace(attention=impl)
    logits, after = jit_apply(cfg, params, chunk, cache=cache, valid=valid)
    decoded, _ = jit_apply(cfg, params, step, cache=after)
    got.append((np.asarray(logits)[valid], np.asarray(decoded)))
  for ref, routed in zip(*got, strict=True):
    np.testing.assert_allclose(routed, ref, atol=tol, rtol=0)


def _union_reference(q_btnh, prefix, own, chunk):
  """NumPy softmax attention of each query over the union of its visible keys: its prefix row's first lengths
  (row b reads prefix row b // m), its own first lengths slots, and the chunk's keys causal & valid."""
  (pk, pv, plen), (ok, ov, olen), (ck, cv, valid) = prefix, own, chunk
  b, t, n, h = q_btnh.shape
  m, g = b // pk.shape[0], n // pk.shape[2]
  out = np.zeros((b, t, n, h))
  for i in range(b):
    for j in range(t):
      seen = valid[i] & (np.arange(t) <= j)
      keys = np.concatenate([pk[i // m, : plen[i // m]], ok[i, : olen[i]], ck[i, seen]])
      values = np.concatenate([pv[i // m, : plen[i // m]], ov[i, : olen[i]], cv[i, seen]])
      for head in range(n):
        scores = keys[:, head // g] @ q_btnh[i, j, head] / np.sqrt(h)
        probs = np.exp(scores - scores.max())
        out[i, j, head] = probs @ values[:, head // g] / probs.sum()
  return out


def test_kernel_parts_merge_to_the_union():
  """`attention.rows_part` (a shared prefix read by m = 2 rows each, own slots) and `attention.chunk_part`, merged
  by log-sum-exp (`attention.merge`), equal softmax attention over the union of the key sets: through
  ``jax.nn.dot_product_attention(implementation="xla", return_residual=True)`` (the cuDNN route's CPU form) and
  through the Pallas TPU flash kernel in Pallas' TPU interpret mode (``pltpu.force_tpu_interpret_mode``), key rows
  padded to its 128-key blocks. float32, to 2e-6. A row with no own slot yet (lengths 0) is exact too."""
  from jax.experimental.pallas import tpu as pltpu

  b, t, n, k, h = 4, 3, 4, 2, 16
  rng = np.random.default_rng(5)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  q = normal(b, t, n, h)
  prefix = (normal(2, 20, k, h), normal(2, 20, k, h), np.array([20, 9], np.int32))
  own = (normal(b, 12, k, h), normal(b, 12, k, h), np.array([5, 0, 12, 3], np.int32))
  valid = np.array([[1, 1, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], bool)
  chunk = (normal(b, t, k, h), normal(b, t, k, h), valid)
  want = _union_reference(q, prefix, own, chunk)

  def routed(impl):
    parts = [attention.rows_part(impl, q, *prefix), attention.rows_part(impl, q, *own)]
    parts.append(attention.chunk_part(impl, q, *chunk))
    return attention.merge(parts, jnp.float32)

  np.testing.assert_allclose(np.asarray(routed("xla")), want, atol=2e-6, rtol=0)
  with pltpu.force_tpu_interpret_mode():
    got = jax.jit(routed, static_argnums=0)("pallas_tpu")
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0)


def _whiles(jaxpr, found):
  """Every ``while`` equation in a jaxpr and its sub-jaxprs, except inside Pallas kernels (their loops run within
  the kernel on the device: no host round trip)."""
  from jax.extend.core import jaxprs_in_params

  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "while":
      found.append(eqn)
    if eqn.primitive.name == "pallas_call":
      continue
    for sub in jaxprs_in_params(eqn.params):
      _whiles(sub, found)
  return found


@pytest.mark.parametrize(
  "backend, dtype, want", [("gpu", "bfloat16", "cudnn"), ("tpu", "bfloat16", "pallas_tpu"), ("gpu", "float32", None)]
)
def test_rollout_programs_on_kernels_without_data_loops(backend, dtype, want):
  """Traced (not run) for a GPU and a TPU: a tiny bfloat16 rollout's programs as the `Sampler` compiles them (a
  prefill chunk and the decode loop over forked caches with a shared-prefix level: own slots dense and in pages)
  and the update's training forward. Every rollout prefill and decode call is on a kernel, and so is the training
  forward (its rows a multiple of 128 tokens); the decode loop's only ``while`` is the generation loop itself, and
  its body (one decode step per layer) has none (the kernels' routes have no loop; the same walk finds the paged
  reference's loop over pages, a ``while`` with a trip count read from data, in the CPU's program). A float32 run
  on GPU (cuDNN takes half precision only) is on the reference, whose loop over pages is then a static scan."""
  import functools

  from envace_jax.model import paged
  from envace_jax.rl import logprobs as logprobs_lib
  from envace_jax.sampling.sampler import RowSampling, Sampler, SamplingParams

  config = config_lib.PRESETS["tiny"].replace(dtype=dtype)
  params = jax.eval_shape(lambda: transformer.unstack_layers(transformer.init_params(config, jax.random.key(0))))
  sampler = Sampler(config, None, min_bucket=16)
  c = sampler.config
  root = jax.eval_shape(lambda: transformer.init_cache(c, 2, 128))
  dense = jax.eval_shape(lambda: transformer.init_cache(c, 4, 128)).replace(prefix=root)
  pool = paged.PagePool(num_pages=33, page_size=16)
  pages = jax.eval_shape(lambda: paged.init_cache(c, pool, range(4), width=8)).replace(prefix=root)
  rows = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct((4, *shape), dtype)  # noqa: E731
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 4))
  sampling = RowSampling.of([SamplingParams()] * 4)
  with attention.backend(backend), attention.recording() as calls:
    for cache in (dense, pages):
      prefill = functools.partial(sampler._prefill_chunk, attend=128)
      jax.make_jaxpr(prefill)(
        params, cache, rows(c.vocab_size, dtype=jnp.float32), rows(16), rows(16), rows(16, dtype=bool), rows(),
        rows(dtype=bool),
      )  # fmt: skip
      state = jax.eval_shape(lambda x: sampler._initial_state(x, 8, ()), cache).replace(cache=cache)
      decode = functools.partial(sampler._decode_loop, sampling=sampling, top_k=0, stop_strings=(), attend=128)
      jaxpr = jax.make_jaxpr(decode)(params, state, rows(), keys, rows(), jax.ShapeDtypeStruct((), jnp.int32))
      loops = _whiles(jaxpr.jaxpr, [])
      assert len(loops) == 1  # the generation loop
      assert _whiles(loops[0].params["body_jaxpr"].jaxpr, []) == []
    tokens = rows(128)
    index = jax.ShapeDtypeStruct((4, 128), jnp.int32)
    train = functools.partial(logprobs_lib.training_hidden, config, remat=True)
    jax.make_jaxpr(train)(params, tokens, tokens, rows(128, dtype=bool), index)
  kinds = {(call.kind, call.paged, call.prefix_levels) for call in calls}
  assert kinds == {
    ("prefill", False, 1),
    ("decode", False, 1),
    ("prefill", True, 1),
    ("decode", True, 1),
    ("train", False, 0),
  }
  assert {call.impl for call in calls} == {want or "reference"}
