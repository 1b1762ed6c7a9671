"""experiments/testbed_calibration.py: the bootstrap intervals and the gathering of finished chunk files into the
committed JSON and table (the model runs themselves are the experiment, not tested here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import testbed_calibration as cal


def test_bootstrap_interval_of_a_half():
  """100 values half ones: mean 0.5, a 95% interval about ±1.96·0.05 wide; None left out; empty is NaN; fixed seed."""
  ci = cal.bootstrap([0, 1] * 50 + [None])
  assert ci["n"] == 100 and ci["mean"] == 0.5
  assert 0.38 < ci["lo"] < 0.42 and 0.58 < ci["hi"] < 0.62
  assert cal.bootstrap([0, 1] * 50) == {k: ci[k] for k in ci}  # same seed, same interval
  assert cal.bootstrap([1.0, 1.0]) == {"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": 2}
  empty = cal.bootstrap([None])
  assert empty["n"] == 0 and empty["mean"] != empty["mean"]


def _chunk(path, phase, rows, tasks, **extra):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"rows": rows, "tasks": tasks, "wall_s": 60.0, "cpu_s": 120.0, "phase": phase, **extra}))


def test_write_gathers_chunks_into_json_and_table(tmp_path):
  """Two success chunks (3 of 4 tasks succeed) and one fidelity chunk of a warm-up cell at K=5 become the split's
  numbers; the base cell without files has no split; costs add up."""
  d = tmp_path / "chunks" / "warmup_s0" / "cal_k5" / "iid"
  ok = {"valid": True, "tool_calls": 1, "turns": 1}
  _chunk(
    d / "success_0000_0002.json",
    "success",
    [{"task": "a", "success": 1, **ok}, {"task": "b", "success": 1, **ok}],
    ["a", "b"],
    params_sha256="ab" * 32,
  )
  _chunk(
    d / "success_0002_0004.json",
    "success",
    [{"task": "c", "success": 1, **ok}, {"task": "d", "success": 0, **ok}],
    ["c", "d"],
  )
  pair = {"json_valid": True, "exact_match": True, "key_f1": 1.0, "value_accuracy": None, "error_agreement": True}
  miss = {"json_valid": False, "exact_match": False, "key_f1": 0.0, "value_accuracy": None, "error_agreement": False}
  _chunk(
    d / "fidelity_0000_0004.json", "fidelity", [{"task": "a", **pair}, {"task": "b", **miss}], ["a", "b", "c", "d"],
    gold_calls=2, stats={"generated_tokens": 10.0},
  )  # fmt: skip
  (tmp_path / "chunks" / "base_s0").mkdir()
  (tmp_path / "chunks" / "warmup_s0" / "train_cost.json").write_text(
    json.dumps({"steps": 5, "wall_s": 600.0, "cpu_s": 1200.0, "command": "x"})
  )
  logged = [{"step": k, "sft/nll": 1.0 / k, "time/step_s": 30.0 * k, "time/compile_s": 5.0} for k in (1, 2, 3, 4, 5, 6)]
  (tmp_path / "chunks" / "warmup_s0" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in logged))
  out, md = tmp_path / "cal.json", tmp_path / "cal.md"
  cal.main(
    [f"--chunks={tmp_path / 'chunks'}", "--report_steps=5", "--splits=iid", "--write", f"--out={out}", f"--out_md={md}"]
  )
  result = json.loads(out.read_text())
  assert result["warmup_steps"] == [5] and result["level"] == "cpu" and result["sft_learning_rate"] == 1e-4
  assert result["cells"]["base_s0"]["splits"] == {}
  log = result["cells"]["warmup_s0_k5"]["warmup_log"]
  assert log["steps"] == [1, 2, 3, 4, 5] and log["nll_before"][1] == 0.5 and log["compile_s"] == 25.0
  s = result["cells"]["warmup_s0_k5"]["splits"]["iid"]
  assert s["success"]["mean"] == 0.75 and s["success"]["tasks"] == 4 and s["success"]["cpu_s"] == 240.0
  assert s["fidelity"]["calls"] == 2 and s["fidelity"]["gold_calls"] == 2 and s["fidelity"]["tasks"] == 4
  assert s["fidelity"]["exact_match"]["mean"] == 0.5 and s["fidelity"]["value_accuracy"]["n"] == 0
  assert result["cells"]["warmup_s0_k5"]["params_sha256"] == ["ab" * 32]
  text = md.read_text()
  assert "| warmup_s0_k5 | iid | 75.0 [" in text and "| 2 | 6.0 |" in text  # (240 + 120) CPU-s = 6 min
  assert "warm-up: 5 steps, wall 10.0 min, CPU 20.0 min" in text
  assert "steps 1-5 took 7.5 min wall (compiling 25 s" in text and "1.000, 0.500, 0.333, 0.250, 0.200" in text
  with pytest.raises(SystemExit):
    cal.main([f"--root={tmp_path / 'root'}", "--models=other", "--no_train"])


def test_chunks_of_other_parameters_stop_the_run(tmp_path):
  """A finished chunk that evaluated other parameters (leaf norms off by more than NORMS_RTOL) stops the run; the same
  SHA-256, norms within rounding (a retrained warm-up), or a chunk from before digests were kept, pass."""
  params = {"a": np.full(3, 2.0, np.float32), "b": np.ones(4, np.float32)}
  digest = cal.params_digest(params)
  assert len(digest["sha256"]) == 64 and digest["norms"] == pytest.approx([np.sqrt(12.0), 2.0])
  d = tmp_path / "cal_k10"
  _chunk(d / "iid" / "success_0000_0008.json", "success", [], [], params_sha256="ab" * 32, params_norms=[3.4641, 2.0])
  _chunk(d / "rules" / "success_0000_0008.json", "success", [], [])
  cal.check_digest(d, digest, "warmup_s0 step 10")  # another SHA-256, the norms within 1e-3
  moved = cal.params_digest({"a": np.full(3, 2.01, np.float32), "b": np.ones(4, np.float32)})
  assert moved["sha256"] != digest["sha256"]
  with pytest.raises(SystemExit, match=r"iid/success_0000_0008.json evaluated other parameters than warmup_s0 step 10 "
                     r"holds \(leaf norms differ by 0.005 relative, more than 0.001\)"):  # fmt: skip
    cal.check_digest(d, moved, "warmup_s0 step 10")


def test_committed_table_and_docs_are_the_committed_json():
  """experiments/results/testbed_calibration.md is `table` of the committed JSON, and every interval docs/testbed.md
  quotes ("31.2 [12.5, 56.2]") is one of that table's."""
  import re

  results = cal.ROOT / "experiments" / "results"
  result = json.loads((results / "testbed_calibration.json").read_text(encoding="utf-8"))
  table = (results / "testbed_calibration.md").read_text(encoding="utf-8")
  assert cal.table(result) == table
  quoted = re.findall(r"\d+\.\d \[\d+\.\d, \d+\.\d\]", (cal.ROOT / "docs" / "testbed.md").read_text(encoding="utf-8"))
  assert quoted and all(q in table for q in quoted), [q for q in quoted if q not in table]
