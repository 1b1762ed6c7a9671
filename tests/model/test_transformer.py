"""The decoder against transformers+torch (the reference) on tiny random Llama / Qwen2 / Qwen3 models."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax.model import attention as attention_lib
from envace_jax.model import config as config_lib
from envace_jax.model import kvcache, transformer, weights
from envace_jax.model.roles import Role
from tests.conftest import TINY_HF_FAMILIES, jit_apply, tiny_hf_pair, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(TINY_HF_FAMILIES))
def tiny_pair(request, tmp_path_factory):
  """(hf_model, our config, our params) for one family, all weights random (biases and norms included)."""
  return tiny_hf_pair(request.param, tmp_path_factory.mktemp(request.param))


def _tokens(shape, vocab, seed=0):
  return np.asarray(jax.random.randint(jax.random.key(seed), shape, 0, vocab), np.int32)


def test_logits_match_transformers(tiny_pair):
  model, config, params = tiny_pair
  tokens = _tokens((2, 40), config.vocab_size)
  ours, _ = jit_apply(config, params, tokens)
  ref = torch_logits(model, tokens)
  assert ours.dtype == jnp.float32 and ours.shape == ref.shape
  np.testing.assert_array_less(np.abs(np.asarray(ours) - ref).max(), 1e-4)


def test_config_read_from_hf(tiny_pair):
  model, config, _ = tiny_pair
  family = model.config.model_type
  assert config.family == family
  assert config.qkv_bias == (family == "qwen2")
  assert config.qk_norm == (family == "qwen3")
  assert config.tie_embeddings == model.config.tie_word_embeddings
  assert config.head_dim == getattr(model.config, "head_dim", 16)


def test_export_reloads_in_transformers(tiny_pair, tmp_path):
  model, config, params = tiny_pair
  weights.save_hf_dir(config, params, tmp_path)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  tokens = _tokens((2, 24), config.vocab_size, seed=1)
  ours, _ = jit_apply(config, params, tokens)
  assert np.abs(torch_logits(reloaded, tokens) - np.asarray(ours)).max() <= 1e-4
  # And our own loader reads the export back exactly.
  _, again = weights.load_hf_dir(tmp_path)
  jax.tree.map(np.testing.assert_array_equal, again, params)


def test_zero_role_embeddings_are_bit_identical(tiny_pair):
  _, config, params = tiny_pair
  tokens = _tokens((2, 16), config.vocab_size, seed=2)
  roles = np.asarray(jax.random.randint(jax.random.key(3), tokens.shape, 0, len(Role)), np.int32)
  without, _ = jit_apply(config, params, tokens)
  with_zero, _ = jit_apply(config, params, tokens, roles)
  np.testing.assert_array_equal(np.asarray(without), np.asarray(with_zero))
  table = jax.random.normal(jax.random.key(4), params["role_embed"].shape) * 0.5
  changed, _ = jit_apply(config, {**params, "role_embed": table}, tokens, roles)
  assert np.abs(np.asarray(changed) - np.asarray(without)).max() > 1e-3


def test_role_embedding_is_added_to_token_embedding():
  """Role r on every token == the same tokens with the role vector folded into every token embedding."""
  config = config_lib.PRESETS["tiny"]
  params = transformer.init_params(config, jax.random.key(0))
  table = jax.random.normal(jax.random.key(1), params["role_embed"].shape)
  tokens = _tokens((1, 8), config.vocab_size)
  roles = np.full_like(tokens, int(Role.REHEARSE))
  ours, _ = jit_apply(config, {**params, "role_embed": table}, tokens, roles)
  folded = {**params, "embed": params["embed"] + table[int(Role.REHEARSE)]}
  ref, _ = jit_apply(config, folded, tokens)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-5)


def test_cached_chunks_equal_one_forward(tiny_pair):
  _, config, params = tiny_pair
  tokens = _tokens((3, 30), config.vocab_size, seed=5)
  full, _ = jit_apply(config, params, tokens)
  cache = transformer.init_cache(config, batch=3, capacity=48)
  pieces = []
  for start, stop in [(0, 11), (11, 12), (12, 30)]:
    logits, cache = jit_apply(config, params, tokens[:, start:stop], cache=cache)
    pieces.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), np.asarray(full), atol=2e-5)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [30, 30, 30])


def test_padding_never_changes_a_sequence(tiny_pair):
  """Left- or right-padded rows, with or without a cache, give the unpadded row's logits."""
  _, config, params = tiny_pair
  seq = _tokens((1, 9), config.vocab_size, seed=6)
  ref, _ = jit_apply(config, params, seq)
  pad = np.zeros((1, 4), np.int32)
  left = np.concatenate([pad, seq], axis=1)
  right = np.concatenate([seq, pad], axis=1)
  valid_left = np.concatenate([np.zeros((1, 4), bool), np.ones((1, 9), bool)], axis=1)
  out, _ = jit_apply(config, params, left, valid=valid_left)
  np.testing.assert_allclose(np.asarray(out)[:, 4:], ref, atol=2e-5)
  cache = transformer.init_cache(config, batch=1, capacity=16)
  out, cache = jit_apply(config, params, right, cache=cache, valid=valid_left[:, ::-1])
  np.testing.assert_allclose(np.asarray(out)[:, :9], ref, atol=2e-5)
  assert int(cache.lengths[0]) == 9  # padding is never written to the cache


def test_logical_axes_mirror_params():
  config = config_lib.PRESETS["tiny"]
  params = transformer.init_params(config, jax.random.key(0))
  axes = transformer.logical_axes(config)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=is_spec)
  assert tuple(axes["layers"]["attn"]["q_proj"]) == ("layers", "embed", "heads", "head_dim")
  assert tuple(axes["embed"]) == ("vocab", "embed")
  assert not np.any(np.asarray(params["role_embed"]))  # zero-initialised


def test_abstract_trees_are_traced_once_per_config_and_each_call_gets_its_own():
  """`logical_axes` and `abstract_params` keep their trees per config: equal to tracing the initialiser, traced once
  (a second call is a cache hit), and a caller that edits its tree's nesting leaves the next call's intact."""
  config = config_lib.PRESETS["tiny"].replace(num_layers=3)  # a config no other test of this process asks for
  traced = jax.eval_shape(functools.partial(transformer.init_params, config), jax.random.key(0))
  shapes = transformer.abstract_params(config)
  assert jax.tree.structure(shapes) == jax.tree.structure(traced)
  assert jax.tree.leaves(shapes) == jax.tree.leaves(traced)  # ShapeDtypeStructs: shape and dtype
  axes = transformer.logical_axes(config)
  leaves = jax.tree.leaves(shapes)
  shapes["embed"] = axes["embed"] = None  # the caller's own nesting
  again = transformer.abstract_params(config)
  assert all(a is b for a, b in zip(jax.tree.leaves(again)[1:], leaves[1:], strict=True))  # not traced again
  assert again["embed"] == traced["embed"] and tuple(transformer.logical_axes(config)["embed"]) == ("vocab", "embed")
  two = transformer.abstract_params(config.replace(num_layers=2))["layers"]["mlp"]["up_proj"]
  assert two.shape[0] == 2 and again["layers"]["mlp"]["up_proj"].shape[0] == 3


def test_init_params_again_gives_the_same_values_in_new_buffers(monkeypatch):
  """`init_params`' host memo: the same (config, key) again returns the first call's values bit for bit (also for a
  raw uint32 key with the same data), in new device buffers, so donating one call's arrays (as the update step does)
  leaves the next call's intact; another key runs the init; under tracing (a key made there or closed over) and for a
  key committed to a device (the result follows it) nothing is looked up or kept; a model over the size limit is not
  kept."""
  monkeypatch.setattr(transformer, "_INIT_MEMO", type(transformer._INIT_MEMO)())
  runs, init = [], transformer.Transformer.init
  monkeypatch.setattr(transformer.Transformer, "init", lambda self, *a, **k: (runs.append(1), init(self, *a, **k))[1])
  config = config_lib.PRESETS["tiny"]
  first = transformer.init_params(config, jax.random.key(5))
  want, embed = [np.array(x) for x in jax.tree.leaves(first)], np.array(first["embed"])
  jax.jit(lambda p: jax.tree.map(lambda x: x * 0, p), donate_argnums=0)(first)  # first's buffers are given away
  again = transformer.init_params(config, jax.random.PRNGKey(5))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), want, strict=True))
  third = transformer.init_params(config, jax.random.key(5))
  pointers = lambda tree: {x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}
  assert not pointers(third) & pointers(again)
  assert len(runs) == len(transformer._INIT_MEMO) == 1
  other = transformer.init_params(config, jax.random.key(6))
  assert not np.array_equal(np.asarray(other["embed"]), embed)
  jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(7)))
  assert len(runs) == 3 and len(transformer._INIT_MEMO) == 2
  closed_over = jax.random.key(5)  # concrete, but its data is a tracer inside the jit: traced, not looked up
  traced = jax.jit(lambda: transformer.init_params(config, closed_over))()
  np.testing.assert_allclose(np.asarray(traced["embed"]), embed, rtol=0, atol=1e-7)  # XLA fuses the draw and scale
  placed = transformer.init_params(config, jax.device_put(jax.random.key(5), jax.devices()[1]))  # follows its key
  assert placed["embed"].devices() == {jax.devices()[1]} and np.array_equal(np.asarray(placed["embed"]), embed)
  assert len(runs) == 5 and len(transformer._INIT_MEMO) == 2
  monkeypatch.setattr(transformer, "_INIT_MEMO_MAX_BYTES", 0)
  transformer.init_params(config, jax.random.key(8))
  assert len(runs) == 6 and len(transformer._INIT_MEMO) == 2


def test_config_errors_name_the_fix():
  with pytest.raises(config_lib.ConfigError, match="num_kv_heads"):
    config_lib.PRESETS["tiny"].replace(num_kv_heads=3)
  with pytest.raises(config_lib.ConfigError, match="model_type"):
    config_lib.ModelConfig.from_hf_config({"model_type": "gpt2"})
  with pytest.raises(config_lib.ConfigError, match="preset"):
    config_lib.get_model_config("no-such-model")


def test_sharded_and_bfloat16_checkpoints_load(tmp_path):
  """A sharded safetensors index and a bfloat16 checkpoint load to the same values transformers holds."""
  model, config, params = tiny_hf_pair("qwen2-bias", tmp_path / "f32")
  model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
  assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
  _, sharded = weights.load_hf_dir(tmp_path / "sharded")
  jax.tree.map(np.testing.assert_array_equal, sharded, params)
  model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
  _, half = weights.load_hf_dir(tmp_path / "bf16")
  assert half["embed"].dtype == jnp.float32  # the config's param_dtype
  expected = model.model.embed_tokens.weight.float().detach().numpy()
  np.testing.assert_array_equal(np.asarray(half["embed"]), expected)


def test_missing_tensor_names_it(tmp_path):
  _, config, params = tiny_hf_pair("llama", tmp_path / "model")
  state = weights.hf_state_from_params(config, params)
  del state["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(weights.WeightsError, match="model.layers.1.mlp.up_proj.weight"):
    weights.params_from_hf_state(config, state.__getitem__)


def test_unrolled_layers_equal_scanned(tiny_pair):
  """scan_layers=False (the sampler's layout) gives the scanned model's logits, with and without a cache."""
  _, config, params = tiny_pair
  unrolled = config.replace(scan_layers=False)
  per_layer = transformer.unstack_layers(params)
  assert "layers" not in per_layer and f"layers_{config.num_layers - 1}" in per_layer
  jax.tree.map(np.testing.assert_array_equal, transformer.stack_layers(per_layer), params)
  tokens = _tokens((2, 20), config.vocab_size, seed=8)
  ref, _ = jit_apply(config, params, tokens)
  out, _ = jit_apply(unrolled, per_layer, tokens)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
  cache = transformer.init_cache(unrolled, batch=2, capacity=32)
  assert isinstance(cache.k, tuple) and cache.k[0].shape == (2, config.num_kv_heads, config.head_dim, 32)
  assert cache.v[0].shape == (2, config.num_kv_heads, 32, config.head_dim) and cache.capacity == 32
  first, cache = jit_apply(unrolled, per_layer, tokens[:, :13], cache=cache)
  second, cache = jit_apply(unrolled, per_layer, tokens[:, 13:], cache=cache)
  np.testing.assert_allclose(np.concatenate([first, second], axis=1), np.asarray(ref), atol=2e-5)
  # The L layers are L calls of one traced function (`transformer._decoder_layer`): one trace per program.
  step = lambda p, c: transformer.apply(unrolled, p, tokens[:, :1], cache=c)  # noqa: E731
  layers = [e for e in jax.make_jaxpr(step)(per_layer, cache).eqns if e.params.get("name") == "_decoder_layer"]
  assert len(layers) == config.num_layers and len({id(e.params["jaxpr"]) for e in layers}) == 1


def test_blockwise_causal_attention_equals_dense(monkeypatch):
  """Long cache-free sequences attend query block by query block (skipping the masked upper triangle): the logits
  equal the dense computation, with padding and a role table."""
  config = config_lib.get_model_config("tiny")
  params = transformer.init_params(config, jax.random.key(3))
  params["role_embed"] = jax.random.normal(jax.random.key(4), params["role_embed"].shape) * 0.1
  tokens = _tokens((2, 32), config.vocab_size, seed=5)
  roles = np.asarray(np.arange(64).reshape(2, 32) % 5, np.int32)
  valid = np.arange(32)[None, :] < np.array([[32], [19]])
  apply = lambda: np.asarray(transformer.apply(config, params, tokens, roles, valid=valid)[0])
  monkeypatch.setattr(transformer, "ATTENTION_BLOCK", 1 << 20)
  dense = apply()
  monkeypatch.setattr(transformer, "ATTENTION_BLOCK", 8)
  blocked = apply()
  np.testing.assert_allclose(blocked[valid], dense[valid], atol=1e-5, rtol=0)


def test_key_blocked_attention_equals_dense():
  """The online softmax over key blocks gives `_attend`'s output for every query that sees a key: ragged histories,
  a causal chunk, a row with no visible key (padding: zeros), and blocks past every filled slot skipped."""
  b, k, g, t, h, s = 3, 2, 2, 5, 8, 32
  keys = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(keys[0], (b, k, g, t, h))
  kk = jax.random.normal(keys[1], (b, k, h, s))
  v = jax.random.normal(keys[2], (b, k, s, h))
  filled = np.array([3, 11, 0])  # slots already in each row's cache; the chunk's t tokens follow
  slots = np.arange(s)[None, None, :]
  query_slot = filled[:, None, None] + np.arange(t)[None, :, None]
  mask = slots <= query_slot
  mask[2] = False  # a padding row: no query of it sees anything
  dense = np.asarray(transformer._attend(q, kk, v, mask, h))
  blocked = np.asarray(transformer._attend_key_blocks(q, kk, v, mask, h, block=4))
  np.testing.assert_allclose(blocked[:2], dense[:2], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(blocked[2], 0.0)


def test_tiled_attention_equals_dense_with_gradients():
  """Training rows' tiled attention (one tile of scores at a time, forward and backward) gives `_attend`'s outputs
  and the gradients of q, k and v autodiff takes through `_attend`: packed segments that see their parent, a padding
  tail, a row that is all padding (out and gradients 0), and a key block no query of a query block sees skipped."""
  b, k, g, t, h = 3, 2, 2, 16, 8
  keys = jax.random.split(jax.random.key(11), 4)
  q = jax.random.normal(keys[0], (b, k, g, t, h))
  kk = jax.random.normal(keys[1], (b, k, h, t))
  v = jax.random.normal(keys[2], (b, k, t, h))
  d_out = jax.random.normal(keys[3], (b, k, g, t, h))
  idx = np.arange(t)
  segments = np.array([[0] * 3 + [1] * 5 + [2] * 5 + [0] * 3, [0] * 16, [0] * 16])  # row 0: a prompt, 2 children
  parents = np.zeros_like(segments)
  valid = np.array([idx < 13, idx < 16, idx < 0])
  seen = (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None])
  seen |= segments[:, None, :] == parents[:, :, None]
  seen[0, 8:, 3:8] = False  # segment 2 does not see its sibling, segment 1
  mask = (idx[None, None, :] <= idx[None, :, None]) & valid[:, None, :] & seen
  loss = lambda fn: lambda q, kk, v: jnp.vdot(jnp.where(valid[:, None, None, :, None], fn(q, kk, v), 0.0), d_out)  # noqa: E731
  dense_fn = lambda q, kk, v: transformer._attend(q, kk, v, mask, h)  # noqa: E731
  tiled_fn = lambda q, kk, v: transformer._tiled_attention(q, kk, v, mask, h, 8, 4)  # noqa: E731
  dense, tiled = dense_fn(q, kk, v), tiled_fn(q, kk, v)
  where_valid = valid[:, None, None, :, None]
  np.testing.assert_allclose(np.where(where_valid, tiled, 0.0), np.where(where_valid, dense, 0.0), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(tiled)[2], 0.0)
  dense_grads = jax.grad(loss(dense_fn), argnums=(0, 1, 2))(q, kk, v)
  tiled_grads = jax.jit(jax.grad(loss(tiled_fn), argnums=(0, 1, 2)))(q, kk, v)
  for name, want, got in zip("qkv", dense_grads, tiled_grads, strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5, err_msg=name)
  assert np.abs(np.asarray(dense_grads[1])[0]).sum() > 1.0  # the comparison is not between zeros


def _loops(fn, *args) -> set[str]:
  """The loop primitives at the top of ``fn``'s jaxpr: "while" (a trip count read from data) or "scan" (static)."""
  return {e.primitive.name for e in jax.make_jaxpr(fn)(*args).eqns} & {"while", "scan"}


def test_prefix_attention_in_key_blocks_equals_one_matmul():
  """`_attend_prefix` one key block at a time gives the one-matmul attention (out and log-sum-exp to 1e-5) for m = 2
  rows per prefix row, ragged prefix rows and one with nothing filled (its rows: sum 0, out 0), both with the trip
  count read from data (a ``while`` that skips the blocks past the last filled slot, the CPU's) and static (a ``scan``
  over every block, masked: what a GPU or TPU traces), which agree to 1e-6."""
  p, m, k, g, t, h, s = 2, 2, 2, 2, 3, 8, 32
  keys = jax.random.split(jax.random.key(12), 3)
  q = jax.random.normal(keys[0], (p * m, k, g, t, h))
  kk = jax.random.normal(keys[1], (p, k, h, s))
  v = jax.random.normal(keys[2], (p, k, s, h))
  visible = np.arange(s)[None, :] < np.array([[13], [0]])

  def attend(block):  # (out, log-sum-exp, sum) of the triple, and the loop it ran
    fn = lambda *a: transformer._attend_prefix(*a, h, block)  # noqa: E731
    best, total, acc = fn(q, kk, v, visible)
    out = kvcache.merge_parts([(best, total, acc)], jnp.float32)
    return (
      np.asarray(out),
      np.asarray(best + jnp.log(jnp.where(total > 0, total, 1.0))),
      np.asarray(total),
      _loops(fn, q, kk, v, visible),
    )

  want_out, want_lse, want_total, none = attend(None)
  dynamic_out, dynamic_lse, dynamic_total, dynamic = attend(4)
  with attention_lib.backend("tpu"):
    static_out, static_lse, static_total, static = attend(4)
  assert (none, dynamic, static) == (set(), {"while"}, {"scan"})
  np.testing.assert_allclose(dynamic_out, want_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(dynamic_lse[:m], want_lse[:m], atol=1e-5, rtol=0)
  np.testing.assert_allclose(static_out, dynamic_out, atol=1e-6, rtol=0)
  np.testing.assert_allclose(static_lse, dynamic_lse, atol=1e-6, rtol=0)
  for total in (want_total, dynamic_total, static_total):  # the rows of the empty prefix row see nothing
    assert (total[:m] > 0).all() and (total[m:] == 0).all()
  for out in (want_out, dynamic_out, static_out):
    np.testing.assert_array_equal(out[m:], 0.0)


def test_prefix_attention_in_key_blocks_holds_one_block_of_scores():
  """Compiled (XLA's memory_analysis on CPU, nothing allocated), `_attend_prefix` over 1024 prefix slots in key blocks
  of 64 holds less than a quarter of one float32 score matrix [P, K, m*G*T, S] in temporaries; the one-matmul version
  holds more than the whole matrix."""
  p, m, k, g, t, h, s = 2, 2, 2, 2, 16, 8, 1024
  spec = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  args = spec(p * m, k, g, t, h), spec(p, k, h, s), spec(p, k, s, h), spec(p, s, dtype=bool)

  def temp(block):
    fn = jax.jit(functools.partial(transformer._attend_prefix, head_dim=h, block=block))
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

  scores = p * k * m * g * t * s * 4
  blocked, whole = temp(64), temp(None)
  assert blocked < scores // 4 and whole > scores, (blocked, whole, scores)


def test_prefill_over_a_shared_prefix_in_key_blocks_equals_one_matmul(monkeypatch):
  """A chunk attending over a shared prefix level (2 ragged rows, 4 rows continuing them) and its own slots, both
  longer than two key blocks: the logits and the cache equal one matmul over each, with the blocks' trip count read
  from data (CPU) or static (other backends)."""
  config = config_lib.get_model_config("tiny").replace(scan_layers=False)
  params = transformer.unstack_layers(transformer.init_params(config, jax.random.key(13)))
  opening = _tokens((2, 20), config.vocab_size, seed=14)
  prefix = transformer.init_cache(config, batch=2, capacity=32)
  _, prefix = jit_apply(config, params, opening, cache=prefix, valid=np.arange(20)[None, :] < np.array([[20], [7]]))
  tokens = _tokens((4, 12), config.vocab_size, seed=15)
  valid = np.arange(12)[None, :] < np.array([[12], [5], [12], [1]])

  def run():  # a new function object (JAX caches traces by function); KEY_BLOCK, the loops' kind: read when tracing
    cache = transformer.init_cache(config, batch=4, capacity=32).replace(prefix=prefix)
    logits, cache = jax.jit(functools.partial(transformer.apply), static_argnames="config")(
      config, params, tokens, cache=cache, valid=valid
    )
    return np.asarray(logits), cache

  monkeypatch.setattr(transformer, "KEY_BLOCK", 1 << 20)
  dense, dense_cache = run()
  monkeypatch.setattr(transformer, "KEY_BLOCK", 8)
  blocked, blocked_cache = run()
  monkeypatch.setattr(transformer, "_static_loops", lambda: True)  # a GPU's or TPU's loops, with the CPU's routing
  static, static_cache = run()
  np.testing.assert_allclose(blocked[valid], dense[valid], atol=2e-5, rtol=0)
  assert np.abs(blocked[valid] - dense[valid]).max() > 0  # another program ran: the blocks' rounding differs
  np.testing.assert_allclose(static[valid], blocked[valid], atol=1e-6, rtol=0)
  jax.tree.map(functools.partial(np.testing.assert_allclose, atol=2e-5, rtol=0), blocked_cache, dense_cache)
  jax.tree.map(functools.partial(np.testing.assert_allclose, atol=2e-5, rtol=0), static_cache, dense_cache)


def test_prefill_over_key_blocks_equals_dense(tiny_pair, monkeypatch):
  """A cached multi-token chunk over a long cache attends key block by key block: the logits and the cache equal
  the dense computation's, for ragged rows continuing a history."""
  _, config, params = tiny_pair
  tokens = _tokens((2, 40), config.vocab_size, seed=9)
  valid = np.arange(40)[None, :] < np.array([[40], [23]])

  def run():  # a new function object: JAX caches traces by function, and KEY_BLOCK is read when tracing
    apply = jax.jit(functools.partial(transformer.apply), static_argnames="config")
    cache = transformer.init_cache(config, batch=2, capacity=64)
    first, cache = apply(config, params, tokens[:, :9], cache=cache)
    second, cache = apply(config, params, tokens[:, 9:], cache=cache, valid=valid[:, 9:])
    return np.concatenate([first, second], axis=1), cache

  monkeypatch.setattr(transformer, "KEY_BLOCK", 1 << 20)
  dense, dense_cache = run()
  monkeypatch.setattr(transformer, "KEY_BLOCK", 8)
  blocked, blocked_cache = run()
  np.testing.assert_allclose(blocked[valid], dense[valid], atol=2e-5, rtol=0)
  assert np.abs(blocked[valid] - dense[valid]).max() > 0  # another program ran: the blocks' rounding differs
  jax.tree.map(functools.partial(np.testing.assert_allclose, atol=2e-5, rtol=0), blocked_cache, dense_cache)
