"""MetricsWriter: JSONL (NaN-safe, one object per step), TensorBoard scalars, resume without duplicate steps."""

from __future__ import annotations

import json
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from envace_jax import metrics
from envace_jax.metrics import MetricsWriter, read_jsonl


def _writer(workdir, **kwargs):
  kwargs.setdefault("progress", False)
  kwargs.setdefault("is_primary", True)
  return MetricsWriter(workdir, **kwargs)


def _events(path):
  """Events of one TFRecord event file (length, length crc, data, data crc per record; crcs not checked)."""
  out = []
  with open(path, "rb") as f:
    while header := f.read(12):
      (length,) = struct.unpack("<Q", header[:8])
      event = event_pb2.Event()
      event.ParseFromString(f.read(length))
      f.read(4)
      out.append(event)
  return out


def _tensorboard_scalars(workdir, tag):
  """(step, value) of ``tag`` as TensorBoard shows them: event files in order of creation, and a SessionLog START at
  step s (tensorboardX's ``purge_step``) hides the earlier events at steps >= s (TensorBoard's EventAccumulator)."""
  logdir = os.path.join(workdir, metrics.TENSORBOARD_SUBDIR)
  files = [_events(os.path.join(logdir, name)) for name in os.listdir(logdir)]
  scalars = []
  for event in (e for events in sorted(files, key=lambda es: es[0].wall_time) for e in events):
    if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
      scalars = [(step, value) for step, value in scalars if step < event.step]
    for value in event.summary.value:
      if value.tag == tag:
        scalars.append((event.step, value.simple_value))
  return scalars


def test_jsonl_rows_have_step_time_and_scalars(tmp_path):
  with _writer(tmp_path) as w:
    w.write(1, {"reward/mean": np.float32(0.5), "loss": jnp.asarray(1.25), "malformed_act": 3, "ok": True})
    w.write(2, {"reward/mean": 0.75, "loss": 1.0})
  rows = read_jsonl(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[0]["reward/mean"] == 0.5 and rows[0]["loss"] == 1.25
  assert rows[0]["malformed_act"] == 3 and isinstance(rows[0]["malformed_act"], int) and rows[0]["ok"] == 1
  assert rows[0]["time"] <= rows[1]["time"] and abs(rows[0]["time"] - __import__("time").time()) < 60


def test_non_finite_values_are_valid_json_and_read_back(tmp_path):
  with _writer(tmp_path) as w:
    w.write(1, {"loss": math.nan, "ratio": math.inf, "kl": -math.inf, "reward": 0.0})
  with open(os.path.join(tmp_path, metrics.JSONL_NAME)) as f:
    line = f.readline()
  json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
  (row,) = read_jsonl(tmp_path)
  assert math.isnan(row["loss"]) and row["ratio"] == math.inf and row["kl"] == -math.inf and row["reward"] == 0.0


def test_tensorboard_gets_every_scalar(tmp_path):
  with _writer(tmp_path) as w:
    for step in (1, 2, 3):
      w.write(step, {"reward/mean": step / 10, "loss": 1.0 / step})
  got = _tensorboard_scalars(tmp_path, "reward/mean")
  assert [s for s, _ in got] == [1, 2, 3]
  assert [v for _, v in got] == pytest.approx([0.1, 0.2, 0.3])
  assert [s for s, _ in _tensorboard_scalars(tmp_path, "loss")] == [1, 2, 3]


def test_resume_drops_steps_at_or_after_the_resumed_step(tmp_path):
  with _writer(tmp_path) as w:
    for step in (1, 2, 3, 4):  # checkpoint at step 2, then the run died after logging 3 and 4
      w.write(step, {"reward/mean": float(step)})
  with _writer(tmp_path, start_step=3) as w:  # resumed from the checkpoint of step 2
    w.write(3, {"reward/mean": 30.0})
    w.write(4, {"reward/mean": 40.0})
  rows = read_jsonl(tmp_path)
  assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
  # TensorBoard shows each step once, with the resumed run's values (tensorboardX's purge_step).
  assert _tensorboard_scalars(tmp_path, "reward/mean") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_fresh_run_replaces_an_old_log_and_a_torn_last_line_is_skipped(tmp_path):
  with _writer(tmp_path) as w:
    w.write(1, {"loss": 1.0})
  with open(os.path.join(tmp_path, metrics.JSONL_NAME), "a") as f:
    f.write('{"step": 2, "loss": 0.')  # killed mid-write
  assert [r["step"] for r in read_jsonl(tmp_path)] == [1]
  with _writer(tmp_path, start_step=2) as w:
    w.write(2, {"loss": 0.5})
  assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path)] == [(1, 1.0), (2, 0.5)]
  with _writer(tmp_path, start_step=1, tensorboard=False) as w:  # a fresh run in the same workdir
    w.write(1, {"loss": 9.0})
  assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path)] == [(1, 9.0)]


def test_bad_values_and_order(tmp_path):
  with _writer(tmp_path, tensorboard=False) as w:
    with pytest.raises(ValueError, match="'hist' must be a real number"):
      w.write(1, {"hist": np.zeros(3)})
    with pytest.raises(ValueError, match="'step' is reserved"):
      w.write(1, {"step": 1})
    with pytest.raises(ValueError, match="must be a real number"):
      w.write(1, {"note": "text"})
    w.write(1, {"loss": 1.0})
    with pytest.raises(ValueError, match="steps must increase"):
      w.write(1, {"loss": 2.0})
  assert read_jsonl(tmp_path / "missing") == []
  with pytest.raises(ValueError, match="start_step"):
    MetricsWriter(tmp_path, start_step=-1, is_primary=True)


def test_progress_bar_shows_step_reward_and_eta(tmp_path, capsys):
  with _writer(tmp_path, total_steps=4, start_step=3, progress=True, tensorboard=False) as w:
    assert w._bar.n == 2  # two steps done before the resume
    w.write(3, {"reward/mean": 0.125, "loss": 2.0})
    assert w._bar.n == 3
    assert w._bar.postfix == "reward=0.125, loss=2"
  err = capsys.readouterr().err
  assert "3/4" in err and "<" in err  # tqdm's "elapsed<remaining"


def test_non_primary_process_writes_nothing(tmp_path):
  with MetricsWriter(tmp_path / "run", is_primary=False) as w:
    record = w.write(1, {"loss": 1.0})
  assert record["loss"] == 1.0
  assert not (tmp_path / "run").exists()


def test_to_json_safe():
  value = {"a": np.int64(3), "b": [np.float32(np.nan), (1, 2)], 4: np.arange(2), "c": jnp.float32(0.5)}
  assert metrics.to_json_safe(value) == {"a": 3, "b": ["NaN", [1, 2]], "4": [0, 1], "c": 0.5}
  assert metrics.from_json_safe(["Infinity", {"x": "-Infinity"}, "name"]) == [math.inf, {"x": -math.inf}, "name"]
  with pytest.raises(TypeError, match="object"):
    metrics.to_json_safe(object())


def test_step_line_shows_what_a_newcomer_watches_and_skips_what_is_zero():
  line = metrics.step_line(1, 2, {"reward/mean": 0.5, "reward/std": 0.0, "update/loss": 0.0123, "time/step_s": 18.1})
  assert line == "step 1/2: reward 0.500 ± 0.000, loss 0.0123, 18.1 s"
  compiled = metrics.step_line(1, 2, {"time/step_s": 18.1, "time/compile_s": 6.25, "compile/programs": 3})
  assert compiled == "step 1/2: 18.1 s (6.2 s compiling)"
  assert metrics.step_line(1, 2, {"time/step_s": 18.1, "time/compile_s": 0.04}) == "step 1/2: 18.1 s"
  quiet = {"reward/mean": 0.25, "reward/invalid": 0.0, "dynamic_sampling/extra_draws": 0.0}
  assert metrics.step_line(3, None, quiet) == "step 3: reward 0.250"
  loud = {**quiet, "reward/invalid": 1.0, "dynamic_sampling/extra_draws": 2.0, "dynamic_sampling/groups": 1.0}
  want = "step 3: reward 0.250, invalid 1, 1 group(s) with signal after 2 extra batch(es)"
  assert metrics.step_line(3, None, loud) == want
  flat = {**loud, "dynamic_sampling/groups": 0.0, "dynamic_sampling/fallback": 1.0}
  want = "step 3: reward 0.250, invalid 1, no group with signal after 2 extra batch(es): first batch trained"
  assert metrics.step_line(3, None, flat) == want
  update = {"reward/mean": 0.25, "update/loss": 0.0186, "adv/act/abs_mean": 0.25, "adv/rehearse/abs_mean": 0.222}
  assert metrics.step_line(6, 7, update) == "step 6/7: reward 0.250, loss 0.0186, ACT |advantage| 0.25"
