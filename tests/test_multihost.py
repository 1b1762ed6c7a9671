"""Multi-host path: two processes (jax.distributed over 127.0.0.1, 4 CPU devices each) vs one process with 8."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
ROOT = WORKER.parents[1]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict[str, str]:
  env = dict(os.environ)  # XLA_FLAGS too: the worker replaces only its device count
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  return env


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  """2 tiny-config GRPO updates on a 2x2x2 mesh: 2 processes x 4 devices end with the 1 x 8 parameters."""
  single = tmp_path / "single.npz"
  subprocess.run([sys.executable, str(WORKER), f"--out={single}"], check=True, env=_env(), cwd=ROOT, timeout=600)
  multi = tmp_path / "multi.npz"
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(WORKER),
        f"--out={multi}",
        f"--process_id={i}",
        "--num_processes=2",
        f"--coordinator={coordinator}",
        "--local_devices=4",
      ],
      env=_env(),
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=600)
      outputs.append(out.decode(errors="replace")[-3000:])
  finally:
    for p in procs:
      p.kill()
  assert all(p.returncode == 0 for p in procs), "\n---\n".join(outputs)
  a, b = np.load(single), np.load(multi)
  assert sorted(a.files) == sorted(b.files) and len(a.files) > 5
  assert float(a["__moved__"]) > 1e-4  # the two updates changed the parameters (lr 1e-3)
  for name in a.files:
    np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-6, err_msg=name)
