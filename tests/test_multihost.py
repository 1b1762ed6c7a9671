"""Multi-host path: the whole main job through ``python -m envace_jax.main`` on two processes (jax.distributed over
127.0.0.1, gloo, 4 CPU devices each), against the same two steps of the Trainer on one process with 8 devices
(tests/test_resume.py's mesh test, which calls `check_two_processes` here with its run); and a process that dies."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np

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


# ---------------------------------------------------------------------------------------------------------------------
# The whole main job on 2 processes x 4 devices

# envace_jax.main with the shaped rewards of tests/test_resume.py (every step has a gradient: see its docstring).
_MAIN = """
import runpy, sys
from envace_jax import train
from tests.test_resume import shaped_rollout

train.Trainer.rollout = shaped_rollout(train.Trainer.rollout)
sys.argv[0] = "envace_jax.main"
runpy.run_module("envace_jax.main", run_name="__main__", alter_sys=True)
"""


def _launch(workdir, data_dir, processes: int, log_dir, job: dict) -> list[tuple[subprocess.Popen, pathlib.Path]]:
  """Starts the main job (configs/tiny.py with the overrides ``job``) in ``processes`` processes with 8 /
  ``processes`` CPU devices each; (process, its log)."""
  env = _env()
  others = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).split()
  env["XLA_FLAGS"] = " ".join([*others, f"--xla_force_host_platform_device_count={8 // processes}"])
  cmd = [
    sys.executable,
    "-c",
    _MAIN,
    f"--config={ROOT / 'configs' / 'tiny.py'}",
    f"--workdir={workdir}",
    f"--config.env.data_dir={data_dir}",
    *(f"--config.{k}={v}" for k, v in job.items()),
  ]
  if processes > 1:
    cmd += [f"--coordinator=127.0.0.1:{_free_port()}", f"--num_processes={processes}"]
  out = []
  for i in range(processes):
    log = pathlib.Path(log_dir) / f"{pathlib.Path(workdir).name}.{i}.log"
    with open(log, "wb") as f:
      rank = [f"--process_id={i}"] if processes > 1 else []
      out.append((subprocess.Popen([*cmd, *rank], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT), log))
  return out


def _finish(procs, timeout: float = 600) -> None:
  """Waits for every process of a `_launch`; fails with their logs' tails unless all exit 0."""
  try:
    for p, _ in procs:
      p.wait(timeout=timeout)
  finally:
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  tails = "\n---\n".join(
    f"{log.name} (rc {p.returncode}):\n{log.read_text(errors='replace')[-3000:]}" for p, log in procs
  )
  assert all(p.returncode == 0 for p, _ in procs), tails


def check_two_processes(job: dict, reference, tmp_path, data_dir) -> None:
  """Two steps of ``python -m envace_jax.main`` (configs/tiny.py with ``job``'s overrides, tests/test_resume.py's
  shaped rewards) on 2 processes x 4 CPU devices (gloo) sample the rewards of ``reference`` (the same two steps of
  the Trainer on 1 process x 8 devices: its workdir) and end with its parameters to 1e-6 (step 2 alone moved them by
  more than 1e-5); process 0 alone writes the metrics; one process reads its checkpoint. The run's workdir as a kill
  right after step 1's checkpoint leaves it (step 2's checkpoint gone, its metrics row written), resumed by 2 new
  processes, ends bit for bit where the uninterrupted run did: parameters, AdamW state, metrics rows."""
  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax import metrics
  from tests.test_resume import assert_same_rows, assert_same_trees

  _finish(_launch(tmp_path / "two", data_dir, 2, tmp_path, job))
  one, two = (checkpoint_lib.Checkpointer(d, read_only=True) for d in (reference, tmp_path / "two"))
  assert one.all_steps() == two.all_steps() == [1, 2]
  single, multi = one.restore(2), two.restore(2)
  rows_one, rows_two = metrics.read_jsonl(reference), metrics.read_jsonl(tmp_path / "two")
  assert [r["step"] for r in rows_two] == [1, 2]  # once each: process 0 wrote them
  for a, b in zip(rows_one, rows_two, strict=True):  # the same rows were sampled: the same shaped rewards
    assert (a["reward/mean"], a["reward/std"], a["update/grad_norm"] > 0) == (b["reward/mean"], b["reward/std"], True)
  flat_one, flat_two = jax.tree.leaves(single.params), jax.tree.leaves(multi.params)
  for a, b in zip(flat_two, flat_one, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
  step_1 = jax.tree.leaves(two.restore(1).params)
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(flat_two, step_1, strict=True))
  assert moved > 1e-5, moved  # step 2's update, by more than the tolerance
  # One process reads the two processes' checkpoint, as --mode=eval and envace_jax.serve do (eval_shape's target has
  # no sharding: the first device, not the writers' topology).
  from envace_jax import evaluate, runtime
  from tests.test_train import tiny_config

  config = tiny_config(data_dir, **job)
  params, step = evaluate.restore_policy(config, runtime.load_model(config), str(tmp_path / "two"))
  assert step == 2
  assert_same_trees(params, multi.params, "params read by one process")

  resumed = tmp_path / "resumed"
  shutil.copytree(tmp_path / "two", resumed)
  shutil.rmtree(resumed / checkpoint_lib.CHECKPOINT_SUBDIR / "2")
  assert checkpoint_lib.Checkpointer(resumed, read_only=True).all_steps() == [1]
  _finish(_launch(resumed, data_dir, 2, tmp_path, job))
  again = checkpoint_lib.Checkpointer(resumed, read_only=True).restore(2)
  assert_same_trees(again.params, multi.params, "params")
  assert_same_trees(again.opt_state, multi.opt_state, "opt_state")
  rows = metrics.read_jsonl(resumed)
  assert_same_rows(rows, rows_two)
  assert rows[0]["time"] == rows_two[0]["time"] != rows[1]["time"]  # step 2 was redone by the resumed run


def test_a_dead_process_ends_its_peer(tmp_path):
  """Process 1 of 2 is SIGKILLed while process 0 waits for it in `distributed.allgather_objects` (where a training
  step waits for its peers' rollouts): process 0 ends within seconds of the heartbeat timeout (5 s here), with JAX's
  error naming the task that stopped sending heartbeats, instead of hanging."""
  coordinator = f"127.0.0.1:{_free_port()}"
  logs = [tmp_path / f"{i}.log" for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    args = [f"--process_id={i}", "--num_processes=2", f"--coordinator={coordinator}", "--heartbeat_timeout_s=5"]
    with open(log, "wb") as f:
      cmd = [sys.executable, str(WORKER), *args]
      procs.append(subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT))
  try:
    deadline = time.time() + 300
    while not all("joined" in log.read_text(errors="replace") for log in logs):
      assert time.time() < deadline and all(p.poll() is None for p in procs), [x.read_text() for x in logs]
      time.sleep(0.2)
    time.sleep(1)  # process 0 is in the gather
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    procs[0].wait(timeout=120)
    waited = time.time() - killed_at
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  log = logs[0].read_text(errors="replace")
  assert procs[0].returncode != 0 and "gather returned" not in log, log[-3000:]
  assert "stopped sending heartbeats" in log and waited < 30, (waited, log[-3000:])
