"""One of two processes that join (jax.distributed) and wait in `distributed.allgather_objects`, which process 1
never joins (tests/test_multihost.py kills it):

    python tests/multihost_worker.py --process_id=i --num_processes=2 --coordinator=127.0.0.1:PORT

Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--coordinator", required=True)
  parser.add_argument("--heartbeat_timeout_s", type=int, default=100)
  args = parser.parse_args(argv)
  # One CPU device; the caller's other XLA flags stay (the suite's backend optimisation level, tests/conftest.py).
  others = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
  os.environ["XLA_FLAGS"] = " ".join([*others, "--xla_force_host_platform_device_count=1"])
  import jax

  from envace_jax import distributed

  distributed.initialize(
    args.coordinator, args.num_processes, args.process_id, heartbeat_timeout_s=args.heartbeat_timeout_s
  )
  print("joined", jax.device_count(), flush=True)
  if args.process_id == 1:
    time.sleep(600)  # until killed
  distributed.allgather_objects("never gathered")
  print("gather returned", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
