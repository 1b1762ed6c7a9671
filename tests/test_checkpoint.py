"""Checkpointer: bit-exact round trips (AdamW state, typed keys, per-role trees), sharded restore, retention,
intervals, self-describing configs, and a clear error for a checkpoint of another model."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from envace_jax import checkpoint
from envace_jax.checkpoint import Checkpointer, CheckpointError
from envace_jax.model import transformer


def _params(key, d=8, f=16, vocab=32):
  k = jax.random.split(key, 4)
  return {
    "embed": {"embedding": jax.random.normal(k[0], (vocab, d), jnp.float32)},
    "layers": {
      "mlp": {"wi": jax.random.normal(k[1], (2, d, f), jnp.float32), "wo": jax.random.normal(k[2], (2, f, d))},
      "norm": {"scale": jax.random.normal(k[3], (2, d)).astype(jnp.bfloat16)},
    },
    "roles": {"embedding": jnp.zeros((5, d), jnp.float32)},
  }


def _optimizer():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))


def _trained_state(params, steps=2):
  """(params, opt_state) after a few AdamW updates, so the moments and the count are not trivial."""
  opt = _optimizer()
  opt_state = opt.init(params)
  for i in range(steps):
    grads = jax.tree.map(lambda p, s=i + 1: jnp.sin(p.astype(jnp.float32) * s).astype(p.dtype), params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, opt_state


def _config(model="tiny"):
  c = ml_collections.ConfigDict()
  c.model = model
  c.model_path = ""
  c.grpo = ml_collections.ConfigDict({"mode": "envace", "lr": 1e-6})
  c.train = ml_collections.ConfigDict({"checkpoint_every": 1, "keep_checkpoints": 2})
  return c


def _assert_bitwise_equal(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def _abstract(params, opt_state):
  return {"params": jax.eval_shape(lambda: params), "opt_state": jax.eval_shape(lambda: opt_state)}


def test_round_trip_is_bit_exact(tmp_path):
  params, opt_state = _trained_state(_params(jax.random.key(0)))
  rng = jax.random.split(jax.random.key(7))[1]
  data = {"seed": 3, "batch_size": 2, "position": 6, "num_tasks": 9}
  metrics = {"reward/mean": 0.25, "loss": math.nan, "grad_norm": math.inf, "malformed_act": 2}
  with Checkpointer(tmp_path, config=_config()) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(3, params=params, opt_state=opt_state, rng=rng, data_state=data, metrics=metrics)
  with Checkpointer(tmp_path) as ckpt:  # a fresh manager, as after a restart
    assert ckpt.latest_step() == 3
    restored = ckpt.restore(abstract_state=_abstract(params, opt_state))
  assert restored.step == 3
  _assert_bitwise_equal(restored.params, params)
  _assert_bitwise_equal(restored.opt_state, opt_state)  # optax namedtuples, int32 count, bfloat16 moments
  assert isinstance(restored.opt_state[1][0], optax.ScaleByAdamState)
  assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(rng))
  np.testing.assert_array_equal(jax.random.uniform(restored.rng, (4,)), jax.random.uniform(rng, (4,)))
  assert restored.data_state == data
  assert restored.metrics["reward/mean"] == 0.25 and restored.metrics["malformed_act"] == 2
  assert math.isnan(restored.metrics["loss"]) and restored.metrics["grad_norm"] == math.inf
  assert restored.config.model == "tiny" and restored.config.grpo.lr == 1e-6


def test_a_checkpoint_with_stacked_layers_restores_with_the_layers_apart(tmp_path):
  """Checkpoints written before the train state held its layers apart (``layers`` stacked, AdamW's moments too)
  restore onto a per-layer target (``layers_0``, ``layers_1``, as the train state now holds them): the same values,
  per_role trees included; a per-layer checkpoint round-trips as it is."""
  params, opt_state = _trained_state(_params(jax.random.key(0)))
  params = {"act": params, "rehearse": jax.tree.map(lambda x: x * 2, params)}
  opt_state = {"act": opt_state, "rehearse": opt_state}
  rng = jax.random.key(3)
  with Checkpointer(tmp_path / "stacked") as ckpt:
    ckpt.save(1, params=params, opt_state=opt_state, rng=rng)
  apart = transformer.unstack_tree({"params": params, "opt_state": opt_state})
  assert set(apart["params"]["act"]) == {"embed", "roles", "layers_0", "layers_1"}
  assert set(apart["opt_state"]["rehearse"][1][0].mu) == {"embed", "roles", "layers_0", "layers_1"}
  with Checkpointer(tmp_path / "stacked") as ckpt:
    restored = ckpt.restore(abstract_state=_abstract(apart["params"], apart["opt_state"]))
  _assert_bitwise_equal(restored.params, apart["params"])
  _assert_bitwise_equal(restored.opt_state, apart["opt_state"])
  with Checkpointer(tmp_path / "apart") as ckpt:
    ckpt.save(1, params=apart["params"], opt_state=apart["opt_state"], rng=rng)
    again = ckpt.restore(abstract_state=_abstract(apart["params"], apart["opt_state"]))
  _assert_bitwise_equal(again.params, apart["params"])


def test_per_role_params_and_other_key_impl(tmp_path):
  params = {"act": _params(jax.random.key(1)), "rehearse": _params(jax.random.key(2))}
  params, opt_state = _trained_state(params, steps=1)
  rng = jax.random.key(5, impl="rbg")
  with Checkpointer(tmp_path, config=_config()) as ckpt:
    ckpt.save(1, params=params, opt_state=opt_state, rng=rng)
    restored = ckpt.restore(1, abstract_state=_abstract(params, opt_state))
  _assert_bitwise_equal(restored.params, params)
  _assert_bitwise_equal(restored.opt_state, opt_state)
  assert str(jax.random.key_impl(restored.rng)) == "rbg"
  np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(rng))
  assert restored.data_state is None


def test_restore_onto_a_2x2x2_mesh(tmp_path):
  assert jax.device_count() >= 8, "tests/conftest.py sets 8 fake CPU devices"
  params, opt_state = _trained_state(_params(jax.random.key(0)))
  with Checkpointer(tmp_path, config=_config()) as ckpt:
    ckpt.save(1, params=params, opt_state=opt_state, rng=jax.random.key(0))
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=jax.devices()[:8])

  def spec(x):
    # Shard the last two dimensions where they divide (the layer-stacked weights), replicate the rest.
    if x.ndim >= 2 and x.shape[-2] % 2 == 0 and x.shape[-1] % 2 == 0:
      return NamedSharding(mesh, PartitionSpec(*([None] * (x.ndim - 2)), "fsdp", "tensor"))
    return NamedSharding(mesh, PartitionSpec())

  abstract = _abstract(params, opt_state)
  shardings = jax.tree.map(spec, abstract)
  with Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(abstract_state=checkpoint.with_shardings(abstract, shardings))
  _assert_bitwise_equal(restored.params, params)
  _assert_bitwise_equal(restored.opt_state, opt_state)
  got = jax.tree.leaves(restored.params["layers"]["mlp"]["wi"])[0]
  assert got.sharding == shardings["params"]["layers"]["mlp"]["wi"]
  assert len(got.addressable_shards) == 8 and got.addressable_shards[0].data.shape == (2, 4, 8)
  mu = restored.opt_state[1][0].mu["layers"]["mlp"]["wo"]
  assert mu.sharding == shardings["opt_state"][1][0].mu["layers"]["mlp"]["wo"]


def test_retention_interval_and_force(tmp_path):
  params, opt_state = _trained_state(_params(jax.random.key(0)), steps=1)
  state = dict(params=params, opt_state=opt_state, rng=jax.random.key(0))
  with Checkpointer(tmp_path, config=_config(), max_to_keep=2, save_every=2) as ckpt:
    written = [ckpt.save(step, **state) for step in range(1, 6)]
    assert written == [False, True, False, True, False]
    assert not ckpt.should_save(5) and ckpt.should_save(6)
    assert ckpt.save(5, **state, force=True)  # the last step of a run
    assert ckpt.all_steps() == [4, 5]
    assert ckpt.latest_step() == 5
    with pytest.raises(CheckpointError, match="no checkpoint of step 2"):
      ckpt.restore(2, abstract_state=_abstract(params, opt_state))


def test_read_only_readers_leave_a_save_in_progress_alone(tmp_path):
  """A reader (eval, inspect) of a live run must not delete the writer's unfinished save; only a writer cleans up."""
  params, opt_state = _trained_state(_params(jax.random.key(0)), steps=1)
  state = dict(params=params, opt_state=opt_state, rng=jax.random.key(0))
  with Checkpointer(tmp_path, config=_config()) as ckpt:
    ckpt.save(1, **state)
  in_progress = tmp_path / checkpoint.CHECKPOINT_SUBDIR / "2.orbax-checkpoint-tmp-1234567"
  in_progress.mkdir()
  with Checkpointer(tmp_path, read_only=True) as reader:
    assert reader.all_steps() == [1]
    restored = reader.restore(abstract_state=_abstract(params, opt_state))
    _assert_bitwise_equal(restored.params, params)
    with pytest.raises(CheckpointError, match="read-only"):
      reader.save(2, **state, force=True)
  assert in_progress.is_dir()
  empty = tmp_path / "never_trained"  # a workdir without checkpoints: nothing is created
  with Checkpointer(empty, read_only=True) as reader:
    assert reader.latest_step() is None
  assert not empty.exists()
  Checkpointer(tmp_path).close()  # the writer, on start-up, removes what a killed save left
  assert not in_progress.exists()


def test_from_config_reads_train_section(tmp_path):
  config = _config()
  config.train.checkpoint_every = 3
  ckpt = Checkpointer.from_config(tmp_path, config)
  assert ckpt.should_save(3) and not ckpt.should_save(4)
  ckpt.close()


def test_config_and_meta_read_without_arrays(tmp_path):
  params, opt_state = _trained_state(_params(jax.random.key(0)), steps=1)
  with Checkpointer(tmp_path, config=_config("smollm2-135m")) as ckpt:
    ckpt.save(2, params=params, opt_state=opt_state, rng=jax.random.key(0), metrics={"reward/mean": 1.0})
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.read_config().model == "smollm2-135m"
    meta = ckpt.read_meta(2)
    assert meta["step"] == 2 and meta["metrics"] == {"reward/mean": 1.0}
    arrays = ckpt.saved_arrays()
    assert arrays["params/embed/embedding"] == ((32, 8), np.dtype("float32"))
    assert arrays["params/layers/norm/scale"][1] == np.dtype("bfloat16")
    assert any(name.startswith("opt_state/1/0/mu/") for name in arrays)
    # Without a target everything lands on one device; the optimizer state comes back as plain containers.
    restored = ckpt.restore()
  _assert_bitwise_equal(restored.params, params)
  np.testing.assert_array_equal(restored.opt_state[1][0]["count"], opt_state[1][0].count)


def test_incompatible_model_names_the_arrays_and_settings(tmp_path):
  params, opt_state = _trained_state(_params(jax.random.key(0)), steps=1)
  with Checkpointer(tmp_path, config=_config("tiny")) as ckpt:
    ckpt.save(1, params=params, opt_state=opt_state, rng=jax.random.key(0))
  wider = _params(jax.random.key(0), d=12)
  wider_opt = _optimizer().init(wider)
  with Checkpointer(tmp_path, config=_config("smollm2-135m")) as ckpt:
    with pytest.raises(CheckpointError) as err:
      ckpt.restore(abstract_state=_abstract(wider, wider_opt))
  message = str(err.value)
  assert "incompatible config" in message
  assert "params/embed/embedding: checkpoint (32, 8) float32, this run (32, 12) float32" in message
  assert "model: checkpoint 'tiny', this run 'smollm2-135m'" in message
  assert "fresh --workdir" in message


def test_per_role_checkpoint_into_shared_params_fails_clearly(tmp_path):
  params = {"act": _params(jax.random.key(1)), "rehearse": _params(jax.random.key(2))}
  opt_state = _optimizer().init(params)
  with Checkpointer(tmp_path, config=_config()) as ckpt:
    ckpt.save(1, params=params, opt_state=opt_state, rng=jax.random.key(0))
    shared = _params(jax.random.key(1))
    with pytest.raises(CheckpointError, match="params/act/embed/embedding: in the checkpoint"):
      ckpt.restore(abstract_state=_abstract(shared, _optimizer().init(shared)))


def test_dtype_change_is_refused(tmp_path):
  params, opt_state = _trained_state(_params(jax.random.key(0)), steps=1)
  with Checkpointer(tmp_path, config=_config()) as ckpt:
    ckpt.save(1, params=params, opt_state=opt_state, rng=jax.random.key(0))
    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), jax.eval_shape(lambda: params))
    with pytest.raises(CheckpointError, match="checkpoint \\(32, 8\\) float32, this run \\(32, 8\\) bfloat16"):
      ckpt.restore(abstract_state={"params": bf16, "opt_state": jax.eval_shape(lambda: opt_state)})


def test_bad_arguments(tmp_path):
  params, opt_state = _trained_state(_params(jax.random.key(0)), steps=1)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError, match="no checkpoint in"):
      ckpt.restore()
    with pytest.raises(TypeError, match="jax.random.key"):
      ckpt.save(1, params=params, opt_state=opt_state, rng=jax.random.PRNGKey(0))
    ckpt.save(1, params=params, opt_state=opt_state, rng=jax.random.key(0))
    with pytest.raises(ValueError, match="opt_state"):
      ckpt.restore(abstract_state={"params": params})
  with pytest.raises(ValueError, match="save_every"):
    Checkpointer(tmp_path, save_every=0)
