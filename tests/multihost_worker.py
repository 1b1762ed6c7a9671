"""Two GRPO update steps of the tiny config on a 2x2x2 mesh, in one process or one of several (jax.distributed).

    python tests/multihost_worker.py --out=FILE [--process_id=i --num_processes=n --coordinator=127.0.0.1:PORT]

With ``--peer_dies`` it only joins and waits in `distributed.allgather_objects`, which process 1 never joins (the
test kills it).

Every process builds the same batch and the same initial parameters from fixed seeds and places them on the global
mesh with ``jax.make_array_from_callback`` (each process fills only its addressable shards). Process 0 writes the
final parameters to ``--out`` (.npz). Used by tests/test_multihost.py; not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def build_rows(vocab: int, seed: int = 0):
  """Eight deterministic training rows (ACT and REHEARSE, ragged lengths, known advantages)."""
  import numpy as np

  from envace_jax.model.roles import Role
  from envace_jax.rehearsal.trajectory import TrainingRow

  rng = np.random.default_rng(seed)
  rows, advantages = [], []
  for i in range(8):
    n = int(rng.integers(24, 60))
    prompt = n // 2
    role = Role.ACT if i % 2 == 0 else Role.REHEARSE
    roles = np.full(n, int(Role.USER), np.int32)
    roles[prompt:] = int(role)
    mask = np.zeros(n, bool)
    mask[prompt:] = True
    logprobs = np.where(mask, -rng.uniform(0.5, 8.0, n), 0.0).astype(np.float32)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    rows.append(TrainingRow(tokens, roles, mask, logprobs, int(role), i, 1))
    advantages.append(float(rng.normal()))
  return rows, advantages


def run(out: str) -> None:
  import jax
  import numpy as np

  from envace_jax.model import transformer
  from envace_jax.model.config import get_model_config
  from envace_jax.rl import grpo
  from envace_jax.rl.batch import collate, split_micro_batches
  from envace_jax.sampling import sharding

  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  model_config = get_model_config("tiny", vocab_size=49152)  # configs/tiny.py: the tiny preset, SmolLM2's vocabulary
  cfg = grpo.GrpoConfig.from_config(learning_rate=1e-3, micro_batch_size=4)
  params = transformer.unstack_tree(transformer.init_params(model_config, jax.random.key(0)))  # the state's layout
  state = grpo.init_train_state(cfg, params)
  rows, advantages = build_rows(model_config.vocab_size)
  batch = split_micro_batches(collate(rows, advantages, trained_roles=cfg.trained_roles, length_bucket=64), 4)

  def place(tree, shardings):
    host = jax.tree.map(np.asarray, tree)
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), host, shardings)

  state = place(state, grpo.train_state_shardings(model_config, cfg, mesh))
  batch = place(batch, grpo.train_batch_shardings(mesh))
  step = grpo.make_update_step(model_config, cfg, mesh=mesh)
  for _ in range(2):
    state, _ = step(state, batch)
  from jax.experimental import multihost_utils

  gathered = multihost_utils.process_allgather(state.params, tiled=True)
  if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(gathered)[0]}
    moved = jax.tree.map(lambda new, old: float(np.max(np.abs(np.asarray(new) - np.asarray(old)))), gathered, params)
    np.savez(out, **flat, __moved__=np.asarray(max(jax.tree.leaves(moved))))


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--num_processes", type=int, default=1)
  parser.add_argument("--coordinator", default="")
  parser.add_argument("--local_devices", type=int, default=8)
  parser.add_argument("--peer_dies", action="store_true", help="process 0 waits in a gather that process 1 never joins")
  parser.add_argument("--heartbeat_timeout_s", type=int, default=100)
  args = parser.parse_args(argv)
  # The caller's other XLA flags stay (the suite's backend optimisation level, tests/conftest.py).
  others = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
  os.environ["XLA_FLAGS"] = " ".join([*others, f"--xla_force_host_platform_device_count={args.local_devices}"])
  import jax

  from envace_jax import distributed

  if args.num_processes > 1:
    distributed.initialize(
      args.coordinator, args.num_processes, args.process_id, heartbeat_timeout_s=args.heartbeat_timeout_s
    )
  if args.peer_dies:
    print("joined", jax.device_count(), flush=True)
    if args.process_id == 1:
      time.sleep(600)  # until killed
    distributed.allgather_objects("never gathered")
    print("gather returned", flush=True)
    return
  assert jax.device_count() == 8, jax.devices()
  run(args.out)
  if args.num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1:])
