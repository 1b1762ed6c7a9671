"""Loading straight onto the mesh (issue 40, acceptance 2): on 8 fake CPU devices with fsdp=8, each tensor is created
on its parts of the mesh, and the Trainer's train state and reference are built there, so no device ever holds more
than it holds at the end plus one tensor's part; the values are the default device's, bit for bit."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import train
from envace_jax.model import config as config_lib
from envace_jax.model import transformer, weights
from envace_jax.rl import grpo
from envace_jax.sampling import sharding
from tests.test_train import tiny_config

# fsdp=8: the 8 rollout rows and the micro-batches of 8 rows split over the 8 batch shards, so the update and the
# samplers run on the mesh and the samplers read the train state's and the reference's own arrays.
_ON_FSDP8 = {
  "mesh.data": 1,
  "mesh.fsdp": 8,
  "mesh.tensor": 1,
  "train.tasks_per_step": 4,
  "train.group_size": 2,
  "grpo.micro_batch_size": 8,
  "train.eval_tasks": 0,
}


class DeviceBytes:
  """Per-device bytes of the device buffers created since it was made (``jax.live_arrays()``' shards, each buffer
  once: a shard's ``.data`` is another array over the same buffer), recorded at each `weights.observe_loading` event.
  The arrays alive at its creation are held, so none of their buffers is reused."""

  def __init__(self):
    self._before = jax.live_arrays()
    self._known = set(self._buffers(self._before))
    self.events: list[tuple[str, dict]] = []

  @staticmethod
  def _buffers(arrays) -> dict:
    out = {}
    for x in arrays:
      if not x.is_deleted():
        for shard in x.addressable_shards:
          out[(shard.device, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return out

  def now(self) -> dict:
    held = collections.Counter()
    for (device, pointer), nbytes in self._buffers(jax.live_arrays()).items():
      if (device, pointer) not in self._known:
        held[device] += nbytes
    return held

  def __call__(self, event: str) -> None:
    self.events.append((event, self.now()))


def _bits(tree):
  return jax.tree.map(lambda x: np.asarray(x).view(np.uint8), tree)


def _assert_bitwise(got, want):
  jax.tree.map(np.testing.assert_array_equal, _bits(got), _bits(want))


def _buffers(tree) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards}


def test_a_trainer_on_fsdp8_loads_each_tensor_onto_its_parts(tmp_path, data_dir, smollm2_tokenizer):
  """A Qwen3-shaped tiny model written by `weights.save_hf_dir` (SmolLM2's vocabulary, so the run renders chats): the
  Trainer reads each tensor straight onto its 8 parts, then builds the reference and the train state on the mesh. At
  every tensor and phase no device holds more than it holds once the Trainer is built plus the largest part of one
  tensor; the train state's params and the reference equal `weights.load_hf_dir`'s, bitwise, and are laid out as
  ``grpo.train_state_shardings`` says, the reference in buffers of its own. Loading the same directory the default
  way (`weights.load_hf_dir`: the whole model on device 0) breaks that bound."""
  model_config = config_lib.PRESETS["tiny"].replace(
    family="qwen3", qk_norm=True, vocab_size=smollm2_tokenizer.vocab_size, num_layers=3
  )
  saved = tmp_path / "model"
  params = transformer.init_params(model_config, jax.random.key(7))
  weights.save_hf_dir(model_config, params, saved, tokenizer=smollm2_tokenizer)
  del params
  config = tiny_config(data_dir, model=str(saved), tokenizer="", **_ON_FSDP8)

  recorder = DeviceBytes()
  with weights.observe_loading(recorder):
    trainer = train.Trainer(config, str(tmp_path / "run"))
  final = recorder.now()
  mesh = trainer.mesh
  assert trainer.update_mesh is mesh and dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}

  leaves = jax.tree_util.tree_flatten_with_path(trainer.state.params)[0]
  placed = [event for event, _ in recorder.events]
  assert placed[: len(leaves)] == ["/".join(k.key for k in path) for path, _ in leaves]  # one event per tensor
  assert placed[len(leaves) :] == ["reference", "params policy", "optimizer state"]
  part = max(s.data.nbytes for _, x in leaves for s in x.addressable_shards)  # the largest part of one tensor
  for event, held in recorder.events:
    for device in mesh.devices.flat:
      assert held[device] <= final[device] + part, (event, device, held[device], final[device], part)

  want = transformer.unstack_layers(weights.load_hf_dir(saved)[1])
  _assert_bitwise(trainer.state.params, want)
  _assert_bitwise(trainer.ref_params, want)
  shardings = grpo.train_state_shardings(trainer.model.config, trainer.grpo_cfg, mesh)
  for got, want_sharding in zip(jax.tree.leaves(trainer.state), jax.tree.leaves(shardings), strict=True):
    assert got.sharding.is_equivalent_to(want_sharding, got.ndim), (got.sharding, want_sharding)
  assert not _buffers(trainer.ref_params) & _buffers(trainer.state.params)  # the update donates the state
  assert trainer.samplers["policy"].params is trainer.state.params or _buffers(trainer.samplers["policy"].params) == (
    _buffers(trainer.state.params)
  )

  # The same directory loaded the default way puts every tensor whole on device 0.
  default = DeviceBytes()
  _, stacked = weights.load_hf_dir(saved)
  device0 = jax.devices()[0]
  assert default.now()[device0] > final[device0] + part
  del stacked

  # Resumed from a checkpoint: restored onto the fresh state's shardings, that state released before the restore.
  trainer.ckpt.save(
    1,
    params=trainer.state.params,
    opt_state=trainer.state.opt_state,
    rng=trainer.key,
    data_state=trainer.stream.state(),
  )
  trainer.ckpt.close()
  del trainer, leaves, got
  resumed = DeviceBytes()
  restore = checkpoint_lib.Checkpointer.restore
  at_restore = []
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(
      checkpoint_lib.Checkpointer, "restore", lambda *a, **k: (at_restore.append(resumed.now()), restore(*a, **k))[1]
    )
    trainer = train.Trainer(config, str(tmp_path / "run"))
  assert trainer.start_step == 1 and len(at_restore) == 1
  _assert_bitwise(trainer.state.params, want)
  final = resumed.now()
  state = DeviceBytes._buffers(jax.tree.leaves(trainer.state))
  for device in mesh.devices.flat:
    restored = sum(n for (d, _), n in state.items() if d == device)
    assert at_restore[0][device] + restored <= final[device] + part, (
      device,
      at_restore[0][device],
      restored,
      final[device],
    )


def test_random_init_onto_the_mesh_in_per_role_mode(tmp_path, data_dir):
  """configs/tiny.py (no weights, a random preset) on fsdp=8 in per_role mode: the random init runs as one program
  whose outputs are the parameters' parts, bitwise the same program's values on one device (and within two float32
  ulps of the eager init off the mesh, where XLA fuses each normal draw with its 0.02 scale); the ACT and REHEARSE trees
  and the reference are three sets of buffers with those values; AdamW's moments are zeros laid out like their
  params."""
  config = tiny_config(data_dir, **_ON_FSDP8, **{"grpo.mode": "per_role", "grpo.trained_roles": ("act", "rehearse")})
  trainer = train.Trainer(config, str(tmp_path / "run"))
  model_config = trainer.model.config
  init = lambda: transformer.unstack_layers(transformer.init_params(model_config, jax.random.key(config.seed)))
  want = jax.jit(init)()
  trees = trainer.state.params
  assert set(trees) == set(grpo.ROLE_TREES)
  for tree in (*trees.values(), trainer.ref_params):
    _assert_bitwise(tree, want)
  eager = init()
  jax.tree.map(lambda x, y: np.testing.assert_array_max_ulp(x, y, maxulp=2), trainer.ref_params, eager)
  buffers = [_buffers(tree) for tree in (*trees.values(), trainer.ref_params)]
  assert sum(map(len, buffers)) == len(set().union(*buffers))  # no buffer shared between the three trees
  shardings = grpo.train_state_shardings(model_config, trainer.grpo_cfg, trainer.mesh)
  for got, want_sharding in zip(jax.tree.leaves(trainer.state), jax.tree.leaves(shardings), strict=True):
    assert got.sharding.is_equivalent_to(want_sharding, got.ndim), (got.sharding, want_sharding)
  moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim]
  assert moments and not any(np.any(np.asarray(m)) for m in moments)
  assert int(trainer.state.step) == 0


def test_load_hf_dir_onto_reads_each_devices_part_of_every_layout(tmp_path):
  """Every tensor layout (q/k/v/o split into heads, the MLP and the untied head transposed, biases, q/k norms) read
  onto a 2x2x2 mesh, whose 'tensor' axis splits heads and the MLP and 'fsdp' the embedding dim: `load_hf_dir`'s
  values, bitwise, on the shardings asked for. A wrong-shaped tensor is named before anything is placed."""
  mesh = sharding.make_mesh(2, 2, 2)
  tiny = config_lib.PRESETS["tiny"]
  for model_config in (tiny, tiny.replace(family="qwen2", qkv_bias=True, tie_embeddings=True, num_heads=8)):
    path = tmp_path / model_config.family
    params = transformer.init_params(model_config, jax.random.key(3))
    params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(4), x.shape), params)
    weights.save_hf_dir(model_config, params, path)
    shardings = sharding.param_shardings(model_config.replace(scan_layers=False), mesh)
    _, got = weights.load_hf_dir_onto(path, shardings)
    _assert_bitwise(got, transformer.unstack_layers(weights.load_hf_dir(path)[1]))
    for x, s in zip(jax.tree.leaves(got), jax.tree.leaves(shardings), strict=True):
      assert x.sharding == s
  spec = lambda x: tuple(x.sharding.spec)
  assert spec(got["layers_0"]["attn"]["q_proj"]) == ("fsdp", "tensor", None)
  assert spec(got["layers_1"]["attn"]["o_proj"]) == ("tensor", None, "fsdp")
  assert spec(got["layers_0"]["attn"]["k_bias"]) == ("tensor", None)

  bad = model_config.replace(mlp_dim=64)
  events = []
  with (
    weights.observe_loading(events.append),
    pytest.raises(
      weights.WeightsError, match=r"down_proj.weight' has shape \(64, 128\), the config expects \(64, 64\)"
    ),
  ):
    weights.load_hf_dir_onto(path, sharding.param_shardings(bad.replace(scan_layers=False), mesh), bad)
  assert not events
