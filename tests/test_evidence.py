"""experiments/evidence.py: its statistics by hand, every method's config, the smoke grid end to end (the tiny model
on the testbed: the base cell and an EnvACE cell started from the seed's warm-up) with its resume, and the committed
results page."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import metrics
from experiments import evidence

_SMOKE = ["--smoke", "--methods=base,envace", "--splits=iid", "--compile-cache=none"]


def _run(tmp, *extra):
  dirs = [f"--workdir={tmp / 'cells'}", f"--chunks={tmp / 'chunks'}", f"--out-dir={tmp / 'out'}"]
  return evidence.main([*_SMOKE, *dirs, *extra])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("evidence")
  return tmp, _run(tmp)


# ---------------------------------------------------------------------------------------------------------------------
# Statistics


def test_interval_by_hand():
  # Mean over seeds of the seeds' means; IQM: the 25%-trimmed mean over seeds (4 seeds: the middle two).
  x = evidence.interval([[1, 0], [1, 1], [0, 0], [0.5, 0.5]])
  assert (x["mean"], x["iqm"], x["seeds"], x["items"]) == (0.5, 0.5, 4, [2, 2, 2, 2])
  assert evidence.interval([[0.0], [0.5], [1.0], [1.0]])["iqm"] == 0.75
  # Constant items within each seed: only the seeds vary. Two seeds at 0 and 1: a replicate's mean is 0, 1/2 or 1
  # with probability 1/4, 1/2, 1/4, so the 2.5th and 97.5th percentiles are 0 and 1.
  x = evidence.interval([[0, 0, 0], [1, 1, 1]])
  assert (x["mean"], x["lo"], x["hi"]) == (0.5, 0.0, 1.0)
  # One seed: the percentile bootstrap over its items, near the normal interval for 400 Bernoulli items.
  items = [1.0] * 120 + [0.0] * 280
  x = evidence.interval([items])
  half = 1.96 * math.sqrt(0.3 * 0.7 / 400)
  assert x["mean"] == pytest.approx(0.3) and x["lo"] == pytest.approx(0.3 - half, abs=0.006)
  assert x["hi"] == pytest.approx(0.3 + half, abs=0.006)
  assert evidence.interval([items]) == x  # a fixed bootstrap seed
  # Three seeds, the same 400 items each: the seeds add no spread, so the interval narrows (1200 items in all).
  three = evidence.interval([items] * 3)
  assert three["hi"] - three["lo"] == pytest.approx((x["hi"] - x["lo"]) / math.sqrt(3), rel=0.1)
  assert math.isnan(evidence.interval([[], []])["mean"]) and evidence.interval([])["seeds"] == 0


def test_paired_differences_use_the_items_both_methods_have():
  a = {0: {"t1": 1.0, "t2": 0.0, "t3": None}, 1: {"t1": 1.0, "t2": 1.0}, 5: {"t1": 1.0}}
  b = {0: {"t1": 0.0, "t2": 0.0, "t3": 1.0}, 1: {"t1": 1.0, "t4": 0.0}, 7: {"t1": 0.0}}
  d = evidence.paired(a, b)
  # seed 0: t1 1-0, t2 0-0 (t3: None on A's side); seed 1: t1 1-1; seeds 5 and 7 have no partner.
  assert (d["seeds"], d["items"], d["mean"]) == (2, [2, 1], 0.25)
  assert [evidence.verdict(d) for d in ({"seeds": 2, "lo": 0.01, "hi": 0.2}, {"seeds": 2, "lo": -0.2, "hi": -0.01},
          {"seeds": 2, "lo": -0.1, "hi": 0.1}, {"seeds": 0, "lo": math.nan, "hi": math.nan})] == [
    "supported", "contradicted", "unresolved", "not run"]  # fmt: skip


def test_item_values_key_calls_by_task_and_message():
  chunks = [
    {"rows": [{"task": "a", "message": 3, "exact_match": True, "error_agreement": None}]},
    {"rows": [{"task": "a", "message": 5, "exact_match": False, "error_agreement": 1.0}]},
  ]
  assert evidence.item_values(chunks, "exact_match") == {"a#3": 1.0, "a#5": 0.0}
  assert evidence.item_values(chunks, "error_agreement") == {"a#3": None, "a#5": 1.0}
  assert evidence.item_values([{"rows": [{"task": "b", "success": 1}]}], "success") == {"b": 1.0}
  # A row that names no call (an old chunk format) or overlapping chunks: one item twice, an error, not a silent loss.
  legacy = {"split": "iid", "phase": "fidelity", "rows": [{"task": "a", "exact_match": True}]}
  with pytest.raises(KeyError):
    evidence.item_values([legacy], "exact_match")
  with pytest.raises(ValueError, match="item a#3 twice"):
    evidence.item_values([chunks[0], chunks[0]], "exact_match")


# ---------------------------------------------------------------------------------------------------------------------
# Configs and arguments


def test_every_method_is_one_config():
  """The six methods differ only in their steps, the RL mode and baseline, and the warm-up they start from."""
  args = evidence.parse_args([])
  configs = {m: evidence.cell_config(args, m, 1) for m in evidence.METHODS}
  steps = {m: (c.train.sft_warmup_steps, c.train.steps) for m, c in configs.items()}
  rl = (10, 15)
  assert steps == {"base": (0, 0), "warmup": (10, 10), **dict.fromkeys(evidence.RL_METHODS, rl)}
  warmup = str(evidence.cell_dir(args, "warmup", 1))
  assert {m: c.train.init_from for m, c in configs.items()} == {
    "base": "", "warmup": "", **dict.fromkeys(evidence.RL_METHODS, warmup)}  # fmt: skip
  what = {
    m: (c.grpo.mode, c.rollout.env_mode, tuple(c.grpo.trained_roles), c.grpo.baseline_groups)
    for m, c in configs.items()
  }
  envace = ("envace", "rehearse", ("act", "rehearse"), "task_role")
  assert what == {
    "base": envace, "warmup": envace, "envace": envace,
    "grpo_real_env": ("grpo_real_env", "real", ("act",), "task_role"),
    "per_role": ("per_role", "rehearse", ("act", "rehearse"), "task_role"),
    "role_agnostic": ("envace", "rehearse", ("act", "rehearse"), "task"),
  }  # fmt: skip
  for c in configs.values():  # the testbed's own settings, the same for every method
    assert (c.model, c.env.benchmark, c.env.domain, c.env.split, c.seed) == (
      "smollm2-135m",
      "testbed",
      "cpu",
      "train",
      1,
    )
    assert (c.train.tasks_per_step, c.train.group_size, c.grpo.dynamic_sampling) == (4, 4, True)
    assert (c.rollout.grounding_max_tokens, c.train.eval_tasks) == (0, 0)


def test_each_test_time_method_runs_the_variants_its_claims_compare():
  """The trained policy runs every variant (claim 4 compares all four); the base policy parallel rehearsal alone
  (its one claim: parallel rehearsal against none), at each N of --ns: 4 chunks of 8 tasks, not 16."""
  assert evidence.test_time_variants("envace") == ["parallel", "sequential", "no_world_model", "drafts"]
  assert evidence.test_time_variants("base") == ["parallel"] and evidence.test_time_variants("per_role") == []
  args = evidence.parse_args([])
  assert evidence._test_time_phases(args, "base") == [("testtime_parallel_n2", "parallel", 2),
                                                      ("testtime_parallel_n4", "parallel", 4)]  # fmt: skip
  assert len(evidence._test_time_phases(args, "envace")) == 8 and evidence._test_time_phases(args, "warmup") == []


def test_bad_arguments_stop_with_the_reason(capsys):
  for argv, message in (
    (["--methods=envace,ppo"], "--methods: unknown ['ppo']"),
    (["--bogus=1"], "unrecognized arguments: --bogus=1"),
  ):
    with pytest.raises(SystemExit) as stop:
      evidence.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err, argv
  args = evidence.parse_args(["--smoke", "--seeds=3", "--config.grpo.learning_rate=1e-5"])
  assert args.model == "tiny" and args.seeds == [3] and args.overrides == [("grpo.learning_rate", "1e-5")]
  assert evidence.grid(args) == (["base", "warmup", "envace"], [0, 3])  # the smoke grid and the seed asked for


# ---------------------------------------------------------------------------------------------------------------------
# The smoke grid


@pytest.mark.slow
def test_smoke_grid_chunks_cells_resume_and_page(smoke, capsys):
  tmp, result = smoke
  proto = result["protocol"]
  ids = proto["heldout_task_ids"]["iid"]
  assert ids == ["tb_cpu_iid_00000", "tb_cpu_iid_00001"] and proto["splits"] == ["iid"]
  cells = {c["method"]: c for c in result["cells"]}
  assert list(cells) == ["base", "warmup", "envace"] and all(c["seed"] == 0 for c in cells.values())
  # EnvACE started from the seed's warm-up (step 1, trained as a side effect) and logged only its own GRPO step.
  envace = cells["envace"]
  assert envace["checkpoint_step"] == 2 and envace["init_from"] == str(tmp / "cells" / "warmup" / "seed0")
  assert [r["step"] for r in envace["curve"]] == [2] and "reward/act/mean" in envace["curve"][0]
  assert checkpoint_lib.Checkpointer(tmp / "cells" / "warmup" / "seed0", read_only=True).all_steps() == [1]
  assert [r["step"] for r in metrics.read_jsonl(tmp / "cells" / "warmup" / "seed0")] == [1]
  assert cells["base"]["checkpoint_step"] is None and cells["base"]["curve"] == []
  # Every chunk of the asked-for cells; the warm-up cell was trained, not evaluated: its parts are missing.
  for method in ("base", "envace"):
    split = cells[method]["splits"]["iid"]
    assert list(split["values"]["success"]) == ids
    assert list(split["values"]["wm2real_gap"]) == ids[:1]
    calls = list(split["values"]["exact_match"])
    assert calls and all(c.startswith(ids[0] + "#") for c in calls)
    files = sorted(p.name for p in (tmp / "chunks" / method / "seed0" / "iid").iterdir())
    test_time = [f"testtime_{v}_n1_0000_0001.json" for v in evidence.TEST_TIME] if method == "envace" else []
    assert files == sorted(["fidelity_0000_0001.json", "gap_0000_0001.json", "success_0000_0002.json", *test_time])
    for name in files:  # each chunk records the process's memory after it handed its temporaries back
      chunk = json.loads((tmp / "chunks" / method / "seed0" / "iid" / name).read_text())
      assert 0 < chunk["memory/host_rss_gib"] <= chunk["memory/host_peak_gib"], name
  assert result["missing"] == ["warmup/seed0/iid: success 0/2, fidelity 0/1, gap 0/1"]
  # The rows: one seed, so each interval is the bootstrap over that cell's items.
  row = next(r for r in result["rows"] if (r["method"], r["split"]) == ("envace", "iid"))
  success = list(envace["splits"]["iid"]["values"]["success"].values())
  assert row["success"]["mean"] == np.mean(success) and row["success"]["seeds"] == 1
  pooled = next(r for r in result["rows"] if (r["method"], r["split"]) == ("envace", "pooled"))
  assert pooled["success"] == row["success"]  # one split: pooled is that split
  diff = next(d for d in result["differences"] if d["split"] == "pooled" and (d["a"], d["b"]) == ("envace", "base"))
  base = list(cells["base"]["splits"]["iid"]["values"]["success"].values())
  assert diff["mean"] == pytest.approx(np.mean(success) - np.mean(base)) and diff["metric"] == "success"
  # Test time (the EnvACE cell, N = 1, the first task): each variant generated before committing, and its difference
  # from rehearsal off is paired with the success chunk's value for that task.
  off, *rows = result["test_time"]
  assert [(r["method"], r["variant"], r["N"]) for r in rows] == [("envace", v, 1) for v in evidence.TEST_TIME]
  first = envace["splits"]["iid"]["values"]["success"][ids[0]]
  assert (off["variant"], off["N"], off["success"]["mean"], off["success"]["items"]) == ("off", 0, first, [1])
  parts = envace["splits"]["iid"]["test_time"]
  for r in rows:
    part = parts[f"testtime_{r['variant']}_n1"]
    assert list(part["values"]) == ids[:1] and part["generated_tokens"] > 0 and r["tokens_per_task"] > 0
    assert r["vs_off"]["mean"] == part["values"][ids[0]] - envace["splits"]["iid"]["values"]["success"][ids[0]]
  claims = {d["claim"] for d in result["differences"] if d["claim"].startswith("4.")}
  assert len(claims) == 4  # the base cell has no test-time part in the smoke grid
  saved = json.loads((tmp / "out" / evidence.RESULTS_FILE).read_text())
  assert json.dumps(saved, sort_keys=True) == json.dumps(json.loads(json.dumps(result)), sort_keys=True)
  for png in evidence.PNGS.values():
    assert (tmp / "out" / png).stat().st_size > 0

  # A rerun trains and evaluates nothing: the same files, the same JSON.
  stamps = {p: p.stat().st_mtime_ns for p in (tmp / "chunks").rglob("*.json")}
  capsys.readouterr()
  again = _run(tmp)
  out = capsys.readouterr().out
  assert "training to step" not in out and "chunks to evaluate" not in out
  assert {p: p.stat().st_mtime_ns for p in (tmp / "chunks").rglob("*.json")} == stamps
  assert json.dumps(again["rows"]) == json.dumps(result["rows"])
  # A lost chunk is evaluated again with its own key: the same values.
  lost = tmp / "chunks" / "envace" / "seed0" / "iid" / "success_0000_0002.json"
  before = json.loads(lost.read_text())["rows"]
  lost.unlink()
  _run(tmp)
  assert json.loads(lost.read_text())["rows"] == before
  capsys.readouterr()
  evidence.main(["--results-page", f"--out-dir={tmp / 'out'}"])
  saved = json.loads((tmp / "out" / evidence.RESULTS_FILE).read_text())
  assert capsys.readouterr().out.strip() == evidence.results_section(saved)
  with pytest.raises(SystemExit, match="another budget"):
    _run(tmp, "--steps=2")


def test_a_seed_the_grid_does_not_hold_is_judged_against_the_grids_interval(smoke):
  """``--replication``: a cell of a seed outside the grid (here seed 0's EnvACE chunks copied as seed 5) gives, per
  split and metric, its mean over items, the grid's interval for that method and whether the mean is inside; a cell
  of a seed the grid holds is not a replication."""
  import shutil

  tmp, result = smoke
  unheld = tmp / "unheld"
  for seed in (5, 0):
    shutil.copytree(tmp / "chunks" / "envace" / "seed0", unheld / "envace" / f"seed{seed}", dirs_exist_ok=True)
  out = _run(tmp, "--methods=", f"--replication={unheld}", f"--out-dir={tmp / 'out_replication'}")
  rows = out["replication"]
  assert {(r["method"], r["seed"], r["split"]) for r in rows} == {("envace", 5, "iid")}
  assert {r["metric"] for r in rows} == set(evidence.METRICS)  # success, fidelity and WM2Real all finished
  values = next(c for c in result["cells"] if c["method"] == "envace")["splits"]["iid"]["values"]
  grid = {r["split"]: r for r in result["rows"] if r["method"] == "envace"}
  for r in rows:
    items = [v for v in values[r["metric"]].values() if v is not None]
    assert r["value"] == pytest.approx(np.mean(items)) and r["items"] == len(items)
    ref = grid["iid"][r["metric"]]
    assert r["grid"] == {k: ref[k] for k in ("mean", "lo", "hi", "seeds")}
    assert r["inside"] == (ref["lo"] <= r["value"] <= ref["hi"])
  assert evidence.replication_table(out) in evidence.results_section(out)


def test_results_page_section_is_the_committed_json():
  """docs/results.md's results section is exactly what ``evidence.py --results-page`` prints from the committed
  JSON, its PNGs are committed, and the held-out ids of every split are disjoint from one another."""
  result = json.loads((evidence.RESULTS_DIR / evidence.RESULTS_FILE).read_text(encoding="utf-8"))
  ids = result["protocol"]["heldout_task_ids"]
  flat = [i for split in ids.values() for i in split]
  assert flat and len(flat) == len(set(flat))
  page = evidence.RESULTS_PAGE.read_text(encoding="utf-8")
  assert evidence.results_section(result) in page
  for png in evidence.PNGS.values():
    assert (evidence.RESULTS_DIR / png).stat().st_size > 0
