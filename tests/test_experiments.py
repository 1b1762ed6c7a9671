"""The shared experiment helpers (experiments/common.py), a smoke run of experiments/learning_check.py on the tiny
model and the dry run of experiments/device_check.sh (experiments/evidence.py has its own tests:
tests/test_evidence.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import ml_collections
import pytest

from experiments import common


def test_overrides_parse_as_the_main_job_parses_them():
  """Experiments take ``--config.KEY=VALUE`` through ml_collections' config_flags, the parser of
  ``python -m envace_jax.main``: each field's own type; a tuple field gets the text as one item (split at commas by
  the config check, as for the main job)."""
  c = ml_collections.ConfigDict({"a": {"f": 1.0, "i": 2, "b": True, "t": ("act", "rehearse"), "s": "x"}})
  extra = ["--config.a.f=1e-5", "--config.a.i=7", "--config.a.b=false", "--config.a.t=act,user", "--config.a.s=y"]
  overrides, rest = common.split_overrides([*extra, "--steps=2"])
  assert rest == ["--steps=2"] and overrides[0] == ("a.f", "1e-5")
  assert common.apply_flags(c, overrides) is c
  assert c.a.to_dict() == {"f": 1e-5, "i": 7, "b": False, "t": ("act,user",), "s": "y"}
  with pytest.raises(ValueError, match="--config.a.i=1.5"):
    common.apply_flags(c, [("a.i", "1.5")])
  with pytest.raises(ValueError, match="no config field for an override in \\['--config.a.missing=1'\\]"):
    common.apply_flags(c, [("a.missing", "1")])
  common.apply_overrides(c, {"a.t": ("act",), "a.i": 3})
  assert c.a.t == ("act",) and c.a.i == 3
  with pytest.raises(KeyError, match="no config field 'a.typo'"):
    common.apply_overrides(c, {"a.typo": 1})
  config = common.make_config("tiny", "mock", 3, "/tmp/d")
  assert config.seed == 3 and config.env.domain == "mock" and config.model == "tiny"
  assert common.mean_std([0.0, 1.0]) == pytest.approx((0.5, math.sqrt(0.5)))
  one = common.mean_std([0.5, float("nan")])  # one finite value: no spread
  assert one[0] == 0.5 and math.isnan(one[1])
  assert common.pm(0.25, 0.05) == "25.0 ± 5.0" and common.pm(float("nan"), 0.0) == "-"
  assert common.pm(0.25, float("nan")) == "25.0" and common.pm(0.25, 0.05, 1.0, 3) == "0.250 ± 0.050"


@pytest.mark.slow
def test_learning_check_smoke_run(tmp_path, data_dir, capsys, monkeypatch):
  """experiments/learning_check.py on the tiny model: a warm-up step, a GRPO step, the fixed set before and after,
  the verdict and the PNG. The random tiny model's first warm-up NLL is that of a near-uniform next-token
  distribution, ln(vocab size). The printed table and verdict are checked against the per-seed numbers `run_seed`
  returned: with one GRPO step the last step is the first, so "last > first" is false and the check must fail."""
  from experiments import learning_check

  seeds = {}
  run_seed = learning_check.run_seed
  monkeypatch.setattr(learning_check, "run_seed", lambda a, seed: seeds.setdefault(seed, run_seed(a, seed)))
  out_png = tmp_path / "learning_check.png"
  args = ["--model=tiny", "--steps=1", "--seeds=0", "--sft-steps=1", "--max-new-tokens=16", "--fixed-group=2"]
  args += ["--task-ids=create_task_1,update_task_1", "--tasks=1"]
  code = learning_check.main([*args, f"--data-dir={data_dir}", f"--out={out_png}"])
  out = capsys.readouterr().out
  (nll, curve, before, after) = seeds[0]
  assert len(nll) == 1 and nll[0] == pytest.approx(math.log(49152), abs=0.1)
  assert len(curve) == 1 and not math.isnan(before) and not math.isnan(after)
  lines = out.splitlines()
  warm_up = lines.index("warm-up NLL per step (nats per trained token, before each update):")
  assert lines[warm_up + 1] == f"   0 | {nll[0]:5.3f}"
  grpo = lines.index("GRPO training reward per step (on-policy, a new key each step):")
  assert lines[grpo + 1 : grpo + 4] == ["seed |     1", f"   0 | {curve[0]:5.2f}", f" all | {curve[0]:5.2f}"]
  fixed = lines.index("  seed | before  after   gain")
  assert lines[fixed + 1] == f"     0 | {before:6.3f} {after:6.3f} {after - before:+6.3f}"
  improved = after > before
  assert lines[fixed + 2] == f"fixed set, after > before the GRPO steps for every seed: {'yes' if improved else 'no'}"
  assert lines[fixed + 3] == (
    f"training reward, mean over seeds, last GRPO step > first: {curve[0]:.3f} vs {curve[0]:.3f}: no"
  )
  assert code == 1 and lines[fixed + 4] == "learning check: FAILED"
  assert out_png.stat().st_size > 0


def test_device_check_peaks_by_device_kind():
  """experiments/device_check.py's datasheet table: the specific names win over the family's."""
  from experiments import device_check

  assert device_check.peaks("NVIDIA H200") == (4.8e12, 989e12)
  assert device_check.peaks("NVIDIA H100 PCIe") == (2.0e12, 756e12)
  assert device_check.peaks("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
  assert device_check.peaks("TPU v5 lite") == (0.819e12, 197e12)
  assert device_check.peaks("TPU v5") == (2.765e12, 459e12)
  assert device_check.peaks("cpu") is None


def test_device_check_refuses_a_cpu_backend(tmp_path):
  """experiments/device_check.sh without --dry on a CPU backend (JAX's CPU build here) stops before any step with
  status 1 and one line on stderr, creating nothing; device_check.py does the same."""
  from experiments import device_check
  from tests.test_train import ROOT

  env = {**os.environ, "PYTHON": sys.executable}
  script = str(ROOT / "experiments" / "device_check.sh")
  out = tmp_path / "out"
  run = subprocess.run(["bash", script, str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert run.returncode == 1 and run.stdout == "" and not out.exists()
  (line,) = run.stderr.splitlines()
  assert line.startswith("device_check.sh: JAX's backend is cpu") and "EXTRAS=cuda12" in line and "--dry" in line
  with pytest.raises(SystemExit) as exit:
    device_check.main(["--out", str(out / "device_check.json")])
  assert exit.value.code == device_check.CPU_REFUSAL and not out.exists()


@pytest.mark.slow
def test_device_check_dry_run(tmp_path, data_dir):
  """experiments/device_check.sh --dry: the same three steps with tiny shapes (decode over a dense cache and over a
  rollout's prefix level and pages, with the reference and through jax.nn, the update, a tiny plan, a one-step main
  job). Every decode gives the same greedy tokens (float32: the layouts and implementations agree), and the bytes a
  step reads are the multiplying parameters and the stored slots' keys and values."""
  from envace_jax import metrics
  from experiments import device_check
  from tests.test_train import ROOT

  env = {**os.environ, "PYTHON": sys.executable, "DATA_DIR": str(data_dir)}
  script = str(ROOT / "experiments" / "device_check.sh")
  cmd = ["bash", script, "--dry", str(tmp_path)]
  run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  assert run.stdout.startswith("dry run (--dry)")
  report = json.loads((tmp_path / "device_check.json").read_text())
  (model,) = report["models"]
  name, batch, slots, t = device_check.SHAPES["dry"][0]
  group, page_size = device_check.ROLLOUT["dry"]
  assert model["model"] == name and report["peaks"] is None
  assert {layout: sorted(rows) for layout, rows in model["decode"].items()} == {
    "dense": ["auto", "xla"],
    "rollout": ["auto"],
  }
  # The tiny preset's multiplying parameters: 2 layers of q, o (4 heads x 16 x 64), k, v (2 heads), the MLP
  # (3 x 64 x 128) and two norms (64), the final norm, the untied 64 x 512 head; not the embedding tables.
  layer = 2 * 4 * 16 * 64 + 2 * 2 * 16 * 64 + 3 * 64 * 128 + 2 * 64
  weights = 2 * layer + 64 + 64 * 512
  # Stored slots per layer: dense B x S; rollout B / G openings of S / 2 slots and B rows of S / 2 own slots in pages.
  own_pages = -(-(slots - slots // 2) // page_size)
  stored = {"dense": batch * slots, "rollout": batch // group * (slots // 2) + batch * own_pages * page_size}
  kv_per_slot = 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 KV heads x 16, float32
  for layout, rows in model["decode"].items():
    for variant, row in rows.items():
      assert row["batch"] == batch and row["slots"] == slots and row["tok_s"] > 0 and "hbm_fraction" not in row
      assert row["bytes_per_step"] == 4 * weights + kv_per_slot * stored[layout]
      assert row.get("same_tokens", (layout, variant) == ("dense", "auto")) is True, (layout, variant)
  assert model["update"]["flops"] == 6 * t * weights
  assert "Memory plan per device: tiny" in run.stdout and "KV cache: policy" in run.stdout
  assert [row["step"] for row in metrics.read_jsonl(tmp_path / "tiny_run")] == [1]
