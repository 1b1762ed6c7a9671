"""experiments/evidence.py: the smoke grid (the tiny model on τ² mock, the base and EnvACE cells, one seed) end to
end, every method's config, and the aggregation by hand."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import metrics
from experiments import evidence

HELDOUT = "update_task_with_initialization_data"  # the smoke run's held-out mock task: one gold call


def _run(tmp, data_dir, *extra):
  # The script's own compile cache is off (it would point JAX's process-wide cache at a test's folder).
  args = ["--smoke", f"--workdir={tmp / 'cells'}", f"--out-dir={tmp / 'out'}", f"--data-dir={data_dir}"]
  return evidence.main([*args, "--compile-cache=none", *extra])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, data_dir):
  tmp = tmp_path_factory.mktemp("evidence")
  return tmp, _run(tmp, data_dir)


def _pass1_of_one_trial(reward: float) -> float:
  return float(abs(reward - 1.0) <= 1e-6)  # τ²'s success rule; an invalid trial's NaN fails


@pytest.mark.slow
def test_smoke_grid_cells_rows_files_and_resume(smoke, data_dir, capsys):
  """The base and EnvACE cells: trained as their configs say, evaluated on the held-out task only, aggregated over
  their one seed, written to evidence.json with the PNGs; a rerun reads every cell back."""
  tmp, result = smoke
  proto = result["protocol"]
  assert proto["train_task_ids"] == ["create_task_1", "update_task_1", "impossible_task_1"]
  assert proto["heldout_task_ids"] == [HELDOUT] and not set(proto["train_task_ids"]) & {HELDOUT}
  assert [(c["method"], c["seed"]) for c in result["cells"]] == [("base", 0), ("envace", 0)]
  assert result["missing"] == [] and proto["methods"] == ["base", "envace"] and proto["seeds"] == [0]
  cells = {c["method"]: c for c in result["cells"]}
  # base: no training; envace: the warm-up step, then 1 GRPO step.
  assert cells["base"]["checkpoint_step"] is None and cells["envace"]["checkpoint_step"] == 2
  first, second = cells["envace"]["curve"]
  assert cells["base"]["curve"] == [] and [first["step"], second["step"]] == [1, 2]
  assert "sft/nll" in first and "sft/nll" not in second and "rollout/groups_without_signal" in second
  assert metrics.read_jsonl(tmp / "cells" / "envace" / "seed0")[1]["dynamic_sampling/extra_draws"] <= 1
  for c in result["cells"]:
    ev = c["eval"]
    assert c["heldout_task_ids"] == [HELDOUT]
    assert ev["pass^1"] == _pass1_of_one_trial(ev["reward"]) and ev["reward/invalid"] == 0.0
    assert ev["fidelity_gold/calls"] == 1.0  # the held-out task's one gold call, executed for real and rehearsed
    assert 0.0 <= ev["tool_call_validity"] <= 1.0
  with checkpoint_lib.Checkpointer(tmp / "cells" / "envace" / "seed0") as ckpt:
    config = ckpt.read_config()
  assert config.env.eval_task_ids == HELDOUT and config.grpo.dynamic_sampling and config.rollout.scenario_opening

  # One seed per method: n 1, the cell's value, no std.
  for row in result["rows"]:
    cell = cells[row["method"]]
    assert row["n"] == 1 and row["seeds"] == [0]
    for key in evidence.KEPT:
      value = cell["eval"].get(key, math.nan)
      assert math.isnan(row[key][1]) and (row[key][0] == value if not math.isnan(value) else math.isnan(row[key][0]))
  # Test-time rows (the envace cell only): N = 0 is the plain evaluation; N = 1 rehearses before committing.
  assert {(r["method"], r["mode"], r["N"]) for r in result["test_time"]} == {
    ("envace", m, n) for m in evidence.MODES for n in (0, 1)
  }
  for r in result["test_time"]:
    if r["N"] == 0:
      assert r["pass^1"][0] == cells["envace"]["eval"]["pass^1"] and r["rehearsal_tokens"][0] == 0.0
    else:
      assert r["rehearsal_tokens"][0] > 0 and r["pass^1"][0] == _pass1_of_one_trial(r["reward"][0])
  saved = json.loads((tmp / "out" / evidence.RESULTS_FILE).read_text())
  assert json.dumps(saved, sort_keys=True) == json.dumps(json.loads(json.dumps(result, default=float)), sort_keys=True)
  for png in evidence.PNGS.values():
    assert (tmp / "out" / png).stat().st_size > 0

  capsys.readouterr()
  again = _run(tmp, data_dir)
  out = capsys.readouterr().out
  assert out.count(": saved") == 2
  assert json.dumps(again["rows"]) == json.dumps(result["rows"])
  # A run killed during a test-time grid: the cell's saved rows are read back and only the missing one is made again,
  # with the same key (the same numbers).
  envace = tmp / "cells" / "envace" / "seed0" / evidence.CELL_FILE
  cell = json.loads(envace.read_text())
  cell["test_time"] = cell["test_time"][:-1]
  envace.write_text(json.dumps(cell))
  resumed = _run(tmp, data_dir)
  out = capsys.readouterr().out
  assert out.count(": saved") == 2 and out.count(": test-time ") == 1 and "training again" not in out
  assert json.dumps(resumed["test_time"]) == json.dumps(result["test_time"])
  assert json.dumps(resumed["rows"]) == json.dumps(result["rows"])
  # A later session without the workdir: the cells come from the committed evidence.json; a test-time row missing
  # there is made after training the cell again (its checkpoint is gone), with the same numbers.
  committed = json.loads((tmp / "out" / evidence.RESULTS_FILE).read_text())
  envace_cell = next(c for c in committed["cells"] if c["method"] == "envace")
  envace_cell["test_time"] = envace_cell["test_time"][:-1]
  (tmp / "out" / evidence.RESULTS_FILE).write_text(json.dumps(committed))
  shutil.rmtree(tmp / "cells")
  restored = _run(tmp, data_dir)
  out = capsys.readouterr().out
  assert out.count(": saved") == 2 and out.count(": test-time ") == 1
  assert "envace seed 0: no checkpoint of step 2 here; training again" in out
  assert json.dumps(restored["test_time"]) == json.dumps(result["test_time"])
  assert [c["eval"] for c in restored["cells"]] == [c["eval"] for c in result["cells"]]
  assert next(c for c in restored["cells"] if c["method"] == "envace")["retrained_for_test_time"] is True
  evidence.main(["--results-page", f"--out-dir={tmp / 'out'}"])
  assert capsys.readouterr().out.strip() == evidence.results_section(saved)
  with pytest.raises(SystemExit, match="another budget"):
    _run(tmp, data_dir, "--steps=2")
  assert restored["missing"] == restored["missing_test_time"] == []


def test_every_method_is_one_config():
  """The five methods differ only in the warm-up, the GRPO steps and the mode (the ablations' config values)."""
  args = evidence.parse_args([])
  configs = {m: evidence.cell_config(args, m, 0) for m in evidence.METHODS}
  steps = {m: (c.train.sft_warmup_steps, c.train.steps) for m, c in configs.items()}
  assert steps == {"base": (0, 0), "warmup": (4, 4), "warmup_grounded": (4, 4), "envace": (4, 8),
                   "grpo_real_env": (4, 8), "per_role": (4, 8)}  # fmt: skip
  # REHEARSE trains without grounding, as it is evaluated, except in the grounded warm-up (the config's 1024 tokens).
  grounding = {m: c.rollout.grounding_max_tokens for m, c in configs.items()}
  assert grounding == {**dict.fromkeys(evidence.METHODS, 0), "warmup_grounded": 1024}
  modes = {m: (c.grpo.mode, c.rollout.env_mode, tuple(c.grpo.trained_roles)) for m, c in configs.items()}
  assert modes["grpo_real_env"] == ("grpo_real_env", "real", ("act",)) and modes["per_role"][0] == "per_role"
  envace = ("envace", "rehearse", configs["envace"].grpo.trained_roles)
  assert modes["envace"] == modes["warmup"] == modes["warmup_grounded"] == modes["base"] == envace
  for c in configs.values():
    where = (c.model, c.env.domain, c.env.split, c.env.eval_split, c.env.train_task_ids, c.env.eval_task_ids)
    assert where == ("smollm2-135m", "mock", "base", "base", args.train_ids, args.heldout)
    sizes = (c.eval.tasks, c.train.group_size, c.grpo.dynamic_sampling, c.rollout.scenario_opening)
    assert sizes == (-1, 4, True, True)
  # The main job's split (configs/tau2.py; tests/test_configs.py checks it): four held-out tasks, none trained on.
  assert len(args.heldout.split(",")) == 4 and not set(args.heldout.split(",")) & set(args.train_ids.split(","))


def test_bad_arguments_stop_with_the_reason(capsys):
  for argv, message in (
    (["--full"], "--full needs --model-path"),
    (["--methods=envace,ppo"], "--methods: unknown ['ppo']"),
    (["--bogus=1"], "unrecognized arguments: --bogus=1"),
    (["--model=qwen"], "--model='qwen': choose one of smollm2, tiny"),
  ):
    with pytest.raises(SystemExit) as stop:
      evidence.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err, argv
  args = evidence.parse_args(["--smoke", "--seeds=3", "--config.grpo.learning_rate=1e-5"])
  assert args.model == "tiny" and args.seeds == [3] and args.overrides == [("grpo.learning_rate", "1e-5")]
  assert evidence.grid(args) == (["base", "envace"], [0, 3], ["envace"])  # the smoke grid and the seed asked for


def test_aggregate_and_tables_by_hand():
  """Mean and sample std over seeds per method; the fraction of groups without signal over each cell's GRPO steps;
  the markdown rows."""

  def cell(method, seed, reward, fidelity, no_signal):
    curve = [{"step": 1, "sft/nll": 1.0}] + [{"step": 2 + i, "rollout/groups_without_signal": v} for i, v in
                                              enumerate(no_signal)]  # fmt: skip
    return {"method": method, "seed": seed, "eval": {"reward": reward, "pass^1": float(reward == 1.0),
            "fidelity_gold/json_valid": fidelity}, "curve": curve}  # fmt: skip

  cells = [cell("envace", 0, 1.0, 0.5, [1.0, 0.0]), cell("envace", 1, 0.0, 1.0, [0.0, 0.0])]
  (row,) = evidence.aggregate(cells, evidence.METHODS)
  assert row["method"] == "envace" and row["n"] == 2 and row["seeds"] == [0, 1]
  assert row["reward"] == pytest.approx((0.5, math.sqrt(0.5)))
  assert row["fidelity_gold/json_valid"] == pytest.approx((0.75, 0.25 * math.sqrt(2)))
  assert row["groups_without_signal"] == pytest.approx((0.25, 0.25 * math.sqrt(2)))  # cells: 0.5 and 0.0
  assert math.isnan(row["gap/gap"][0])
  table = evidence.evidence_table({"rows": [row]})
  want = "| EnvACE | 2 | 0.750 ± 0.354 | - | 0.500 ± 0.707 | 50.0 ± 70.7 | - | - | - | - | 0.250 ± 0.354 | 36.7 |"
  assert want in table


def test_results_page_section_is_the_committed_json():
  """docs/results.md's results section is exactly what ``evidence.py --results-page`` prints from the committed JSON,
  the PNGs it shows are committed, and that JSON judged only held-out tasks: the protocol's training and held-out ids
  are disjoint, and every cell was evaluated on exactly the protocol's held-out tasks."""
  result = json.loads((evidence.RESULTS_DIR / evidence.RESULTS_FILE).read_text(encoding="utf-8"))
  proto = result["protocol"]
  assert proto["heldout_task_ids"] and proto["train_task_ids"]
  assert not set(proto["train_task_ids"]) & set(proto["heldout_task_ids"])
  assert result["cells"] and all(c["heldout_task_ids"] == proto["heldout_task_ids"] for c in result["cells"])
  page = evidence.RESULTS_PAGE.read_text(encoding="utf-8")
  assert evidence.results_section(result) in page
  for png in evidence.PNGS.values():
    assert (evidence.RESULTS_DIR / png).stat().st_size > 0
