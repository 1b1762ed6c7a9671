"""The main job across processes: JAX's multi-controller runtime (``jax.distributed``), one process per host.

    python -m envace_jax.main --config=... --workdir=DIR --coordinator=HOST:PORT --num_processes=N --process_id=I

Every process runs the same program (docs/scaling.md). What each one does in a training step
(`train.Trainer`):

  * draws the same B tasks from the task stream (the same seed and position everywhere) and rolls out its
    contiguous share, tasks ``[p·B/P, (p+1)·B/P)`` with their G rollouts each (`share`), on its own environments and
    user simulators, with a sampler on its own devices (`process_mesh`, `process_local`): a decode step is one
    process's program, with no collective per token, and processes never wait on each other's tool calls. A
    generation's key folds in its trajectory's index in the whole batch (``unfold``'s ``first_trajectory``), so the
    rows are the ones a single process would sample;
  * gathers every process's scored trajectories (`allgather_objects`: token ids, rewards, counts; kilobytes per
    trajectory), so each process holds the step's whole batch and runs the same host-side code on it: metrics,
    dynamic sampling's choice, GRPO's group baselines, the batch's packing into micro-batches;
  * runs the update over the global mesh: each micro-batch becomes a global array with
    ``jax.make_array_from_process_local_data`` (every process holds the whole micro-batch and each device takes its
    rows, `grpo.make_update_step`).

Process 0 writes the metrics, the evaluation records and the console; every process takes part in orbax's save and
restore (orbax's primary host writes the JSON items, each process its own array shards). The held-out evaluation
runs on every process, on the same tasks with the same keys (process-local samplers): each gets the same summary.

A process that dies stops its peers: JAX's coordination service misses its heartbeats for ``heartbeat_timeout_s``
and ends every other process with an error naming the dead task (a peer blocked in a collective may instead see
the connection close first, sooner).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

T = TypeVar("T")


def initialize(
  coordinator: str = "",
  num_processes: int = 0,
  process_id: int = -1,
  *,
  auto: bool = False,
  heartbeat_timeout_s: int = 100,
) -> bool:
  """Joins the processes of a multi-process run; call it before anything touches a device. Returns whether it did.

  Args:
    coordinator: HOST:PORT of process 0's coordination service ("" : JAX's detection).
    num_processes, process_id: this run's process count and this process's index (0 / -1: JAX's detection).
    auto: initialise even when none of the three is given: ``jax.distributed.initialize()`` then takes them from
      the cluster (Cloud TPU, SLURM, Open MPI) or ``JAX_COORDINATOR_ADDRESS``.
    heartbeat_timeout_s: seconds without a heartbeat after which a process counts as dead and its peers end.

  On CPU the cross-process collectives are gloo's (``jax_cpu_collectives_implementation``).

  Raises:
    ValueError: the three are given partly, ``num_processes`` below 2, or ``process_id`` out of range.
    RuntimeError: JAX's own errors (a backend already initialised, the coordinator unreachable after 300 s).
  """
  given = {"coordinator": bool(coordinator), "num_processes": num_processes > 0, "process_id": process_id >= 0}
  if not auto and not any(given.values()):
    return False
  if any(given.values()) and not all(given.values()):
    missing = ", ".join(f"--{k}" for k, v in given.items() if not v)
    raise ValueError(f"a multi-process run needs --coordinator, --num_processes and --process_id; {missing} missing")
  if all(given.values()):
    if num_processes < 2:
      raise ValueError(f"--num_processes={num_processes}: a multi-process run has at least 2 processes")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} must be in [0, {num_processes}) for --num_processes={num_processes}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator or None,
    num_processes if num_processes > 0 else None,
    process_id if process_id >= 0 else None,
    heartbeat_timeout_seconds=heartbeat_timeout_s,
  )
  return True


def share(n: int, processes: int | None = None, index: int | None = None) -> range:
  """This process's contiguous share of ``n`` items (e.g. a step's B tasks) among ``processes`` (default: the run's).

  Raises:
    ValueError: ``n`` is not a multiple of the number of processes.
  """
  processes = jax.process_count() if processes is None else processes
  index = jax.process_index() if index is None else index
  if n % processes:
    raise ValueError(f"{n} items do not split evenly over {processes} processes")
  per = n // processes
  return range(index * per, (index + 1) * per)


def allgather_objects(obj: T) -> list[T]:
  """Every process's ``obj`` (pickled), in process order; ``[obj]`` in a single-process run. Every process must
  call it, in the same order relative to the run's other collectives."""
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils

  data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [pickle.loads(gathered[i, : int(size)].tobytes()) for i, size in enumerate(sizes)]


def primary_first(name: str, fn: Callable[[], T]) -> T:
  """``fn()`` on process 0, then (after a barrier named ``name``) on the others: one writer for what a shared disk
  caches, e.g. a dataset prepared into a ``data_dir`` every host mounts, which the others then find ready."""
  if jax.process_count() == 1:
    return fn()
  from jax.experimental import multihost_utils

  if jax.process_index() == 0:
    out = fn()
    multihost_utils.sync_global_devices(name)
    return out
  multihost_utils.sync_global_devices(name)
  return fn()


def process_mesh(mesh: Mesh) -> Mesh:
  """This process's block of ``mesh``: the mesh's devices that it addresses, with the same axes (the data axis
  shortened by the number of processes). Its devices hold whole replicas of whatever the global mesh replicates
  over data (the parameters, `sharding.param_shardings`), so `process_local` copies nothing.

  Raises:
    ValueError: this process's devices are not a contiguous block of whole data slices of ``mesh`` (make
      ``mesh.data`` a multiple of the number of processes, with every process's devices in one block).
  """
  if jax.process_count() == 1:
    return mesh
  devices = np.asarray(mesh.devices)
  mine = np.vectorize(lambda d: d.process_index == jax.process_index())(devices)
  rows = np.flatnonzero(mine.any(axis=tuple(range(1, devices.ndim))))
  contiguous = rows.size and np.array_equal(rows, np.arange(rows[0], rows[-1] + 1))
  if not contiguous or not mine[rows].all() or mine.sum() != rows.size * devices[0].size:
    raise ValueError(
      f"mesh {dict(mesh.shape)} over {jax.process_count()} processes: process {jax.process_index()}'s devices are not "
      f"whole slices of the '{mesh.axis_names[0]}' axis; make mesh.{mesh.axis_names[0]} a multiple of "
      f"{jax.process_count()} (every process's devices together on that axis)"
    )
  return Mesh(devices[rows[0] : rows[-1] + 1], mesh.axis_names, axis_types=mesh.axis_types)


def process_local(tree: Any, local: Mesh) -> Any:
  """``tree``'s global arrays as arrays on ``local`` (`process_mesh`), built from the shards this process already
  holds: no copy, no communication. Arrays already on ``local`` (or unsharded) pass as they are.

  Raises:
    ValueError: an array's process-local shards do not make up its ``local`` layout (it is sharded across
      processes, e.g. over the data axis).
  """

  def leaf(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    target = NamedSharding(local, x.sharding.spec)
    held = {s.device: s for s in x.addressable_shards}
    shards = []
    for device, index in target.addressable_devices_indices_map(x.shape).items():
      shard = held[device]
      if _normalise(shard.index, x.shape) != _normalise(index, x.shape):
        raise ValueError(
          f"an array of shape {x.shape} sharded {x.sharding.spec} is split across processes; it has no "
          "process-local copy (shard it over axes within a process)"
        )
      shards.append(shard.data)
    return jax.make_array_from_single_device_arrays(x.shape, target, shards)

  return jax.tree.map(leaf, tree)


def _normalise(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def place(tree: Any, shardings: Any) -> Any:
  """Host values that every process holds alike, as global arrays on ``shardings`` (each process puts its devices'
  parts: ``jax.make_array_from_process_local_data`` with the whole array as the local data)."""

  def leaf(x, s):
    host = np.asarray(x)
    return jax.make_array_from_process_local_data(s, host, host.shape)

  return jax.tree.map(leaf, tree, shardings)
