"""envace_jax/distributed.py in one process: the flags' checks, the task share, and the single-process identities
(the two-process runs are tests/test_multihost.py's)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from envace_jax import distributed
from envace_jax.sampling import sharding


def test_no_flags_is_a_single_process_run():
  assert distributed.initialize() is False
  assert jax.process_count() == 1


@pytest.mark.parametrize(
  "args,message",
  [
    (("127.0.0.1:1234", 2, -1), "--process_id missing"),
    (("", 2, 0), "--coordinator missing"),
    (("127.0.0.1:1234", 1, 0), "--num_processes=1: a multi-process run has at least 2 processes"),
    (("127.0.0.1:1234", 2, 2), r"--process_id=2 must be in \[0, 2\) for --num_processes=2"),
  ],
)
def test_bad_flags_fail_before_joining(args, message):
  with pytest.raises(ValueError, match=message):
    distributed.initialize(*args)


def test_share_is_contiguous_and_even():
  assert [list(distributed.share(6, 3, i)) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
  assert distributed.share(4) == range(0, 4)  # one process: everything
  with pytest.raises(ValueError, match="5 items do not split evenly over 2 processes"):
    distributed.share(5, 2, 0)


def test_single_process_identities():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  assert distributed.process_mesh(mesh) is mesh
  x = jax.device_put(np.arange(8.0), sharding.batch_sharding(mesh, 1))
  assert distributed.process_local({"x": x}, mesh)["x"] is x
  assert distributed.allgather_objects({"a": 1}) == [{"a": 1}]
  placed = distributed.place({"y": np.arange(8, dtype=np.int32)}, {"y": sharding.batch_sharding(mesh, 1)})["y"]
  assert placed.sharding == sharding.batch_sharding(mesh, 1)
  np.testing.assert_array_equal(np.asarray(placed), np.arange(8))
