"""Mesh construction, logical-axis rules, and the sharded forward pass against the unsharded one on 8 CPU devices."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from envace_jax.model import config as config_lib
from envace_jax.model import transformer
from envace_jax.sampling import sharding

TINY = config_lib.PRESETS["tiny"]
# 6 query heads shard over tensor=2, 3 KV heads do not: exercises the replicate-instead fallback inside attention.
TINY_KV3 = TINY.replace(num_heads=6, num_kv_heads=3)

needs_8 = pytest.mark.skipif(
  len(jax.devices()) != 8,
  reason=f"needs 8 devices (conftest.py sets --xla_force_host_platform_device_count=8); have {len(jax.devices())}",
)


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) != 8:
    pytest.skip(f"needs 8 devices for a 2x2x2 mesh; have {len(jax.devices())}")
  return sharding.make_mesh(data=2, fsdp=2, tensor=2)


# ---------------------------------------------------------------------------------------------------------------------
# make_mesh


@needs_8
def test_make_mesh_fills_remaining_devices():
  mesh = sharding.make_mesh()
  assert mesh.axis_names == sharding.MESH_AXES
  assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
  mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@needs_8
def test_make_mesh_on_given_devices():
  mesh = sharding.make_mesh(data=2, tensor=2, devices=jax.devices()[:4])
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
  assert set(mesh.devices.flat) == set(jax.devices()[:4])


@needs_8
@pytest.mark.parametrize(
  "sizes, match",
  [
    (dict(data=3), r"3 devices, but 8 devices exist"),
    (dict(data=2, fsdp=2, tensor=4), r"= 16 devices, but 8 devices exist"),
    (dict(data=-1, fsdp=3), r"does not divide the 8 devices"),
    (dict(data=-1, fsdp=-1), r"at most one axis may be -1"),
    (dict(data=0), r"positive int"),
    (dict(tensor=2.0), r"positive int"),
  ],
)
def test_make_mesh_errors(sizes, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(**sizes)


@needs_8
def test_mesh_from_config():
  cfg = ml_collections.ConfigDict({"data": 2, "fsdp": 1, "tensor": 4})
  assert dict(sharding.mesh_from_config(cfg).shape) == {"data": 2, "fsdp": 1, "tensor": 4}
  assert dict(sharding.mesh_from_config({"tensor": 2}).shape) == {"data": 4, "fsdp": 1, "tensor": 2}
  with pytest.raises(ValueError, match=r"unknown keys \['tensr'\]"):
    sharding.mesh_from_config({"tensr": 2})


# ---------------------------------------------------------------------------------------------------------------------
# Rules


def test_rules_map_logical_names(mesh):
  assert sharding.logical_to_spec(("layers", "embed", "heads", "head_dim"), (2, 64, 4, 16), mesh) == P(
    None, "fsdp", "tensor", None
  )
  assert sharding.logical_to_spec(P("vocab", "embed"), (512, 64), mesh) == P("tensor", "fsdp")
  assert sharding.logical_to_spec(("batch",), (8, 5), mesh) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec((), (8, 5), mesh) == P(None, None)
  assert sharding.logical_to_sharding(("mlp", "embed"), (128, 64), mesh) == NamedSharding(mesh, P("tensor", "fsdp"))


def test_rules_never_reuse_a_mesh_axis(mesh):
  # batch takes fsdp, so embed (also fsdp) is replicated.
  assert sharding.logical_to_spec(("batch", None, "embed"), (4, 3, 64), mesh) == P(("data", "fsdp"), None, None)
  rules = (("a", "tensor"), ("b", "tensor"))
  assert sharding.logical_to_spec(("a", "b"), (4, 4), mesh, rules) == P("tensor", None)


def test_rules_fall_back_to_next_rule_then_replicate(mesh):
  rules = (("x", ("data", "fsdp")), ("x", "tensor"), ("y", None))
  assert sharding.logical_to_spec(("x",), (8,), mesh, rules) == P(("data", "fsdp"))
  assert sharding.logical_to_spec(("x",), (6,), mesh, rules) == P("tensor")  # 6 % 4 != 0, 6 % 2 == 0
  assert sharding.logical_to_spec(("x", "y"), (3, 8), mesh, rules) == P(None, None)


def test_rules_errors(mesh):
  with pytest.raises(ValueError, match=r"'nope' has no rule"):
    sharding.logical_to_spec(("nope",), (4,), mesh)
  with pytest.raises(ValueError, match=r"mesh axes \['expert'\] not in the mesh"):
    sharding.logical_to_spec(("x",), (4,), mesh, (("x", "expert"),))
  with pytest.raises(ValueError, match=r"more entries than the array has dimensions"):
    sharding.logical_to_spec(("embed", "mlp"), (4,), mesh)


def test_indivisible_dimension_is_replicated_and_logged_once(mesh, caplog, monkeypatch):
  monkeypatch.setattr(sharding, "_logged", set())  # an earlier test in this process may have logged it already
  caplog.set_level(logging.INFO)
  shape = (30, 576, 9, 64)  # SmolLM2's q_proj: 9 heads over tensor=2
  for _ in range(2):
    spec = sharding.logical_to_spec(("layers", "embed", "heads", "head_dim"), shape, mesh)
    assert spec == P(None, "fsdp", None, None)
  messages = [
    r.getMessage() for r in caplog.records if "not divisible" in r.getMessage() and "(30, 576, 9, 64)" in r.getMessage()
  ]
  assert len(messages) == 1, messages


@needs_8
def test_smollm2_shardings_on_tensor_2():
  """SmolLM2's 9 query / 3 KV heads cannot split over tensor=2: heads replicate, the rest still shards."""
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  config = config_lib.PRESETS["smollm2-135m"]
  shardings = sharding.param_shardings(config, mesh)
  attn, mlp = shardings["layers"]["attn"], shardings["layers"]["mlp"]
  assert attn["q_proj"].spec == P(None, "fsdp", None, None)
  assert attn["k_proj"].spec == P(None, "fsdp", None, None)
  assert attn["o_proj"].spec == P(None, None, None, "fsdp")
  assert mlp["gate_proj"].spec == P(None, "fsdp", "tensor")
  assert mlp["down_proj"].spec == P(None, "tensor", "fsdp")
  assert shardings["embed"].spec == P("tensor", "fsdp")  # 49152 % 2 == 0, 576 % 2 == 0
  assert "lm_head" not in shardings  # tied


def test_batch_and_replicated(mesh):
  assert sharding.batch_size_multiple(mesh) == 4
  assert sharding.batch_sharding(mesh, 3).spec == P(("data", "fsdp"), None, None)
  assert sharding.replicated(mesh).spec == P()
  with pytest.raises(ValueError, match="leading batch axis"):
    sharding.batch_sharding(mesh, 0)


def test_shard_params_rejects_mismatched_trees(mesh):
  shardings = sharding.param_shardings(TINY, mesh)
  with pytest.raises(ValueError, match="different tree structures"):
    sharding.shard_params({"embed": jnp.zeros((512, 64))}, shardings)


@needs_8
def test_a_sampler_reads_float32_master_weights_as_a_cast_copy_on_their_shardings(mesh):
  """bfloat16 compute over float32 master weights (issue 40): the sampler holds a bfloat16 copy, each leaf on its
  master's sharding, refreshed by each assignment (an update's new arrays) without compiling the cast again; off the
  mesh the copy stays on the master's device; a sampler computing in the master's dtype reads the arrays themselves."""
  from envace_jax.runtime import CompileClock
  from envace_jax.sampling.sampler import Sampler

  config = TINY.replace(dtype="bfloat16", scan_layers=False)  # param_dtype float32: the master
  master = _init_params(config, jax.random.key(0))
  on_mesh = sharding.shard_params(master, sharding.param_shardings(config, mesh))
  updated = jax.tree.map(lambda x: x + 1e-3, on_mesh)  # an update's output: new arrays on the same shardings

  def check_copy(copy, of):
    for c, m in zip(jax.tree.leaves(copy), jax.tree.leaves(of), strict=True):
      assert c.dtype == jnp.bfloat16 and c.sharding == m.sharding
      np.testing.assert_array_equal(np.asarray(c), np.asarray(m.astype(jnp.bfloat16)))

  sampler = Sampler(config, on_mesh, mesh=mesh)
  check_copy(sampler.params, on_mesh)
  assert sampler.params["lm_head"].sharding.spec == P("fsdp", "tensor")
  with CompileClock() as clock:
    sampler.params = updated
  assert clock.programs_since(0) == 0
  check_copy(sampler.params, updated)

  device = jax.devices()[3]
  off_mesh = jax.device_put(master, device)
  check_copy(Sampler(config, off_mesh).params, off_mesh)

  for held, placement in ((on_mesh, mesh), (off_mesh, None)):
    same = Sampler(config.replace(dtype="float32"), held, mesh=placement)
    assert all(a is b for a, b in zip(jax.tree.leaves(same.params), jax.tree.leaves(held), strict=True))


# ---------------------------------------------------------------------------------------------------------------------
# The sharded forward pass equals the unsharded one

B, T, S = 4, 8, 24
_reference_apply = jax.jit(transformer.apply, static_argnames="config")
_init_params = jax.jit(transformer.init_params, static_argnames="config")  # jitted: op-by-op init is ~3x slower on CPU


def _inputs(config, seed):
  keys = jax.random.split(jax.random.key(seed), 2)
  tokens = np.asarray(jax.random.randint(keys[0], (B, T), 0, config.vocab_size), np.int32)
  roles = np.asarray(jax.random.randint(keys[1], (B, T), 0, config.num_roles), np.int32)
  return tokens, roles


@pytest.fixture(scope="module", params=["tiny", "tiny-kv3"])
def setup(request, mesh):
  """(config, unsharded params, sharded params, sharded forward) — jitted once per config, shared by the tests."""
  config = {"tiny": TINY, "tiny-kv3": TINY_KV3}[request.param]
  params = _init_params(config, jax.random.key(0))
  # Role embeddings start at zero; make them count so the sharded role lookup is exercised.
  params["role_embed"] = 0.02 * jax.random.normal(jax.random.key(1), params["role_embed"].shape)
  sharded = sharding.shard_params(params, sharding.param_shardings(config, mesh))
  return config, params, sharded, sharding.sharded_apply(config, mesh)


def test_params_are_sharded(setup, mesh):
  config, params, sharded, _ = setup
  q = sharded["layers"]["attn"]["q_proj"]  # [L, D, N, H]
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)
  L, D, N, H = q.shape
  assert {s.data.shape for s in q.addressable_shards} == {(L, D // 2, N // 2, H)}
  k = sharded["layers"]["attn"]["k_proj"]  # [L, D, K, H]
  kv_split = config.num_kv_heads % 2 == 0
  assert k.sharding.spec == P(None, "fsdp", "tensor" if kv_split else None, None)
  assert {s.data.shape for s in k.addressable_shards} == {(L, D // 2, config.num_kv_heads // (2 if kv_split else 1), H)}
  assert sharded["lm_head"].sharding.spec == P("fsdp", "tensor")
  assert sharded["role_embed"].sharding.spec == P(None, "fsdp")
  np.testing.assert_array_equal(np.asarray(q), np.asarray(params["layers"]["attn"]["q_proj"]))


def test_sharded_forward_matches_unsharded(setup):
  config, params, sharded, forward = setup
  tokens, roles = _inputs(config, seed=2)
  ref, _ = _reference_apply(config, params, tokens, roles)
  logits, cache = forward(sharded, tokens, roles)
  assert cache is None
  assert logits.shape == (B, T, config.vocab_size) and logits.dtype == jnp.float32
  assert logits.sharding.spec == P(("data", "fsdp"), None, None)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-5, rtol=0)


def test_sharded_prefill_through_cache_matches_unsharded(setup, mesh):
  """Two chunks through the KV cache (the second with padding), sharded vs unsharded: logits and cache contents."""
  config, params, sharded, forward = setup
  chunks = [_inputs(config, seed=3), _inputs(config, seed=4)]
  valids = [np.ones((B, T), bool), np.arange(T)[None, :] < np.array([[T], [3], [0], [5]])]
  ref_cache = transformer.init_cache(config, B, S)
  cache = sharding.init_sharded_cache(config, mesh, B, S)
  assert cache.k.sharding.spec == P(
    None, ("data", "fsdp"), "tensor" if config.num_kv_heads % 2 == 0 else None, None, None
  )
  for (tokens, roles), valid in zip(chunks, valids, strict=True):
    ref, ref_cache = _reference_apply(config, params, tokens, roles, None, ref_cache, valid)
    logits, cache = forward(sharded, tokens, roles, None, cache, valid)
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(ref)[valid], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [2 * T, T + 3, T, T + 5])
  np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(ref_cache.lengths))
  np.testing.assert_allclose(np.asarray(cache.k), np.asarray(ref_cache.k), atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(cache.v), np.asarray(ref_cache.v), atol=1e-5, rtol=0)
  expected = sharding.cache_shardings(config, mesh, cache)
  assert cache.k.sharding == expected.k and cache.lengths.sharding == expected.lengths
  assert cache.lengths.sharding.spec == P(("data", "fsdp"))


def test_sharded_apply_rejects_indivisible_batch(setup):
  config, _, sharded, forward = setup
  tokens = np.zeros((3, T), np.int32)
  with pytest.raises(ValueError, match=r"batch size 3 is not divisible by the 4 batch shards.*pad the batch"):
    forward(sharded, tokens)


def test_cache_shardings_checks_shape(mesh):
  cache = jax.eval_shape(lambda: transformer.init_cache(TINY, 4, 8))
  assert sharding.cache_shardings(TINY, mesh, cache).k.spec == P(None, ("data", "fsdp"), "tensor", None, None)
  with pytest.raises(ValueError, match=r"expected 2 layers of \[B, K=3, S, H=16\]"):
    sharding.cache_shardings(TINY_KV3, mesh, cache)
  unrolled = TINY.replace(scan_layers=False)
  per_layer = sharding.cache_shardings(unrolled, mesh, jax.eval_shape(lambda: transformer.init_cache(unrolled, 4, 8)))
  assert len(per_layer.k) == 2 and per_layer.k[1].spec == P(("data", "fsdp"), "tensor", None, None)


@needs_8
def test_a_paged_decode_step_moves_no_page_between_devices():
  """A decode step over a paged cache on a 2x2x2 mesh (rows and pages over data x fsdp, `paged.Shards`): no
  collective XLA compiles carries page contents (a shape with the page's slots and KV heads, Z = 8 then K or 2K,
  and the head dim last), which GSPMD's own partitioning of the page gathers does (a masked gather on every device,
  then an all-reduce of f32[B, Z, K, H]): the pages are written and attended where they lie."""
  import re

  from envace_jax.model import paged

  config = config_lib.get_model_config("tiny").replace(scan_layers=False)
  z, k, h = 8, config.num_kv_heads, config.head_dim
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  params = jax.eval_shape(lambda: transformer.unstack_layers(transformer.init_params(config, jax.random.key(0))))
  pool = paged.PagePool(64, z, shards=4, rows=8)
  for r in range(8):
    pool.grow(r, 12)
  cache = paged.init_cache(config, pool, range(8), 4, shards=sharding.paged_shards(mesh))
  c_shardings = sharding.cache_shardings(config, mesh, cache)
  assert c_shardings.pools[0].spec == P(("data", "fsdp")) and c_shardings.table.spec == P(("data", "fsdp"))
  step = jax.jit(
    lambda p, c, t: transformer.apply(config, p, t, cache=c),
    in_shardings=(sharding.param_shardings(config, mesh), c_shardings, sharding.batch_sharding(mesh, 2)),
  )
  text = step.lower(params, cache, jnp.ones((8, 1), jnp.int32)).compile().as_text()
  shapes = re.findall(r"= \w+\[([\d,]*)\]\S* (?:all-gather|all-to-all|collective-permute|all-reduce)", text)
  pages = [s for s in shapes if s.endswith(f",{h}") and (f"{z},{k}," in s or f"{z},{2 * k}," in s)]
  assert shapes and not pages, pages
