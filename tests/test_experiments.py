"""Smoke runs of the experiment scripts (ablation.py, test_time_rehearsal.py, learning_check.py) on the tiny model,
asserting on the rows their ``main`` returns; and the shared helpers (experiments/common.py)."""

from __future__ import annotations

import json
import math

import ml_collections
import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import evaluate, metrics
from experiments import ablation, common, test_time_rehearsal

# The tiny smoke budget shared by the runs below: one step of B=1 x G=2, one test task, one trial. The scripts' own
# compile cache is off (it would point JAX's process-wide cache at a test's tmp dir); the suite's (tests/conftest.py)
# lets a later cell load what an earlier one compiled.
SMOKE = ["--model=tiny", "--steps=1", "--group=2", "--tasks=1", "--eval-tasks=1", "--trials=1", "--compile-cache=none"]


def _pass1_of_one_trial(reward: float) -> float:
  """pass^1 of one task with one trial (SMOKE): 1 when the trial succeeded by τ²'s rule (|reward - 1| <= 1e-6; an
  invalid trial's NaN reward fails), else 0."""
  return float(abs(reward - 1.0) <= 1e-6)


def _canonical(value) -> str:
  """JSON text with sorted keys: equal for equal values, NaN included (NaN != NaN in a plain comparison)."""
  return json.dumps(value, sort_keys=True)


def _run_ablation(tmp, data_dir, *extra):
  return ablation.main([*SMOKE, f"--workdir={tmp}", f"--data-dir={data_dir}", f"--out={tmp / 'ablation.png'}", *extra])


@pytest.fixture(scope="module")
def envace_vs_base(tmp_path_factory, data_dir):
  """EnvACE and the base policy, seed 0: (workdir, result)."""
  tmp = tmp_path_factory.mktemp("ablation")
  return tmp, _run_ablation(tmp, data_dir, "--methods=envace,base", "--seeds=0")


@pytest.mark.slow
def test_ablation_envace_vs_base_rows_and_resume(envace_vs_base, data_dir, capsys):
  """Rows = methods with (mean, std) over the seeds per domain and on average; one cell per (method, domain, seed),
  each evaluated on the same test task; a rerun reads every cell back instead of training again."""
  tmp, result = envace_vs_base
  assert [r["method"] for r in result["rows"]] == ["envace", "base"]
  assert [(c["method"], c["domain"], c["seed"]) for c in result["cells"]] == [
    ("envace", "mock", 0),
    ("base", "mock", 0),
  ]
  for cell in result["cells"]:
    assert cell["eval"]["tasks"] == 1 and cell["eval"]["trials"] == 1 and cell["eval"]["rehearsal"] == "off"
    assert cell["pass^1"] == _pass1_of_one_trial(cell["reward"]) == cell["eval"]["pass^1"]
    assert cell["reward"] == cell["eval"]["reward"] and cell["eval"]["reward/invalid"] == 0.0
    assert cell["checkpoint_step"] == (1 if cell["method"] == "envace" else None)
    cell_dir = tmp / cell["method"] / "mock" / f"seed{cell['seed']}"
    assert _canonical(json.loads((cell_dir / ablation.CELL_FILE).read_text())) == _canonical(cell)
    evaluated = json.loads((cell_dir / evaluate.RESULTS_FILE).read_text())  # what evaluate.run wrote
    assert evaluated["checkpoint_step"] == cell["checkpoint_step"]
    assert _canonical(evaluated["rows"]) == _canonical([cell["eval"]])
  for row in result["rows"]:
    (cell,) = [c for c in result["cells"] if c["method"] == row["method"]]
    assert row["seeds"] == [0] and row["mock"] == (cell["pass^1"], 0.0) and row["average"] == row["mock"]
  assert (tmp / "ablation.png").stat().st_size > 0
  saved = json.loads((tmp / "ablation.json").read_text())
  assert [r["method"] for r in saved["rows"]] == ["envace", "base"]

  capsys.readouterr()
  again = _run_ablation(tmp, data_dir, "--methods=envace,base", "--seeds=0")
  out = capsys.readouterr().out
  assert out.count(": saved, pass^1") == 2 and "EnvACE" in out and "base policy" in out and "CAVEAT" in out
  assert json.dumps(again["rows"]) == json.dumps(result["rows"])  # cells read back: the same numbers
  with pytest.raises(SystemExit, match="another budget"):  # a cell made with another budget is not reused
    _run_ablation(tmp, data_dir, "--methods=envace", "--seeds=0", "--steps=2")


def test_aggregate_mean_and_std_over_seeds():
  """Per domain: mean and sample std of the seeds' pass^1; average: over seeds of each seed's mean over domains."""
  cells = [
    {"method": "envace", "domain": d, "seed": s, "pass^1": v}
    for d, s, v in (("airline", 0, 0.2), ("airline", 1, 0.4), ("retail", 0, 0.6), ("retail", 1, 0.6))
  ]
  (row,) = ablation.aggregate(cells, ["envace"], ["airline", "retail"])
  assert row["seeds"] == [0, 1]
  assert row["airline"] == pytest.approx((0.3, 0.2 / math.sqrt(2))) and row["retail"] == pytest.approx((0.6, 0.0))
  assert row["average"] == pytest.approx((0.45, 0.1 / math.sqrt(2)))  # seed means 0.4 and 0.5
  table = ablation.format_table([row], ["airline", "retail"], "title")
  assert "30.0 ± 14.1" in table and "45.0 ± 7.1" in table and "36.7" in table


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo_real_env", "per_role"])
def test_ablation_baselines(tmp_path, data_dir, method):
  """Plain GRPO against the real tools and per-role parameters train and evaluate through the same cell code."""
  result = _run_ablation(tmp_path, data_dir, f"--methods={method}", "--seeds=0")
  ((cell,), (row,)) = result["cells"], result["rows"]
  assert row["method"] == method and cell["checkpoint_step"] == 1
  assert cell["pass^1"] == _pass1_of_one_trial(cell["reward"]) == cell["eval"]["pass^1"]
  assert row["mock"] == row["average"] == (cell["pass^1"], 0.0)  # one seed: its pass^1, std 0
  with checkpoint_lib.Checkpointer(tmp_path / method / "mock" / "seed0") as ckpt:
    config = ckpt.read_config()
    trees = {name.split("/")[1] for name in ckpt.saved_arrays() if name.startswith("params/")}
  assert config.grpo.mode == method
  if method == "per_role":
    assert trees == {"act", "rehearse"}
  else:  # the real tools answered every call: nothing rehearsed, only ACT trained
    assert config.rollout.env_mode == "real" and list(config.grpo.trained_roles) == ["act"]
    (record,) = metrics.read_jsonl(tmp_path / method / "mock" / "seed0")
    assert math.isnan(record["rollout/rehearsed_json_validity"]) and record["rollout/generated_tokens"] > 0


@pytest.mark.slow
def test_test_time_rehearsal_grid(envace_vs_base, data_dir, tmp_path):
  """Rows = {base, trained} x {parallel, sequential} x N; rehearsal off (N = 0) is one evaluation per policy, and it
  is exactly the ablation's evaluation of the same weights (same key, tasks and trials)."""
  abl_dir, abl = envace_vs_base
  result = test_time_rehearsal.main(
    [
      *SMOKE,
      "--ns=0,1",
      f"--trained-workdir={abl_dir / 'envace' / 'mock' / 'seed0'}",
      f"--workdir={tmp_path}",
      f"--data-dir={data_dir}",
      f"--out={tmp_path / 'ttr.png'}",
    ]
  )
  rows = result["rows"]
  assert len(rows) == 8
  assert {(r["policy"], r["mode"], r["N"]) for r in rows} == {
    (p, m, n) for p in ("base", "trained") for m in ("parallel", "sequential") for n in (0, 1)
  }
  cell = {(c["method"], c["seed"]): c for c in abl["cells"]}
  for r in rows:
    assert r["pass^1"] == _pass1_of_one_trial(r["reward"]) and r["execution_tokens"] > 0
    if r["N"] == 0:
      assert r["rehearsal_tokens"] == 0 and r["memory_tokens"] == 0
      same = [q for q in rows if q["policy"] == r["policy"] and q["N"] == 0]
      assert all(q["pass^1"] == r["pass^1"] and q["execution_tokens"] == r["execution_tokens"] for q in same)
      ablated = cell[("envace" if r["policy"] == "trained" else "base", 0)]
      assert r["pass^1"] == ablated["pass^1"] and r["reward"] == ablated["reward"]
      assert r["execution_tokens"] == ablated["eval"]["cost/execution/generated_tokens"]
    else:
      assert r["rehearsal_tokens"] > 0 and 0 < r["memory_tokens"] <= 16  # configs/tiny.py: memory_max_tokens 16
  assert all(r["checkpoint_step"] == 1 for r in rows if r["policy"] == "trained")
  assert (tmp_path / "ttr.png").stat().st_size > 0
  assert json.loads((tmp_path / "test_time_rehearsal.json").read_text())["rows"] == json.loads(json.dumps(rows))


def test_tiny_refuses_domains_it_cannot_hold():
  with pytest.raises(SystemExit):
    ablation.parse_args(["--model=tiny", "--domains=airline"])
  with pytest.raises(SystemExit):
    test_time_rehearsal.parse_args(["--model=tiny", "--domain=retail"])
  with pytest.raises(SystemExit):
    ablation.parse_args(["--full"])  # --full needs --model-path


def test_parse_args_defaults_and_overrides():
  args = ablation.parse_args(["--model=smollm2", "--config.grpo.learning_rate=1e-5", "--seeds=3"])
  assert args.domains == ["airline", "retail"] and args.seeds == [3] and args.methods == list(ablation.METHODS)
  assert args.overrides == [("grpo.learning_rate", "1e-5")]
  with pytest.raises(SystemExit):
    ablation.parse_args(["--bogus=1"])
  full = test_time_rehearsal.parse_args(["--full", "--model-path=/m"])
  assert full.domain == "airline" and full.ns == [0, 1, 2, 4] and full.trials == 4


def test_set_value_converts_flag_text():
  c = ml_collections.ConfigDict({"a": {"f": 1.0, "i": 2, "b": True, "t": ("act", "rehearse"), "s": "x"}})
  for key, text, want in (
    ("a.f", "1e-5", 1e-5),
    ("a.i", "7", 7),
    ("a.b", "false", False),
    ("a.t", "act", ("act",)),
    ("a.s", "y", "y"),
  ):
    common.set_value(c, key, text)
    assert c.a[key.split(".")[1]] == want
  with pytest.raises(ValueError):
    common.set_value(c, "a.i", "1.5")
  with pytest.raises(KeyError):
    common.set_value(c, "a.missing", "1")
  config = common.make_config("tiny", "mock", 3, "/tmp/d")
  assert config.seed == 3 and config.env.domain == "mock" and config.model == "tiny"
  assert common.mean_std([0.0, 1.0]) == pytest.approx((0.5, math.sqrt(0.5))) and common.mean_std([0.5]) == (0.5, 0.0)
  assert common.pm(0.25, 0.05) == "25.0 ± 5.0" and common.pm(float("nan"), 0.0) == "-"


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
