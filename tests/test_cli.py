"""The command line, `python -m envace_jax.main` (envace_jax/main.py, envace_jax/console.py): what the tiny 2-step
run prints and writes, and a bad config value's one line and exit status 2."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import config_check, metrics, train

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _main(*args: str, timeout: float = 900) -> tuple[int, str]:
  """(exit status, stdout and stderr together as the bytes arrived, decoded) of the main job with ``args``."""
  cmd = [sys.executable, "-m", "envace_jax.main", f"--config={ROOT / 'configs' / 'tiny.py'}", *args]
  proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
  return proc.returncode, proc.stdout.decode("utf-8")


def visible_lines(text: str) -> list[str]:
  """The lines a terminal shows for ``text``: a carriage return moves back to the line's start and what follows
  overwrites it (tqdm redraws its bar so), trailing blanks dropped, no line after a final newline."""
  lines = []
  for segment in text.split("\n"):
    line: list[str] = []
    column = 0
    for char in segment:
      if char == "\r":
        column = 0
        continue
      if column < len(line):
        line[column] = char
      else:
        line.append(char)
      column += 1
    lines.append("".join(line).rstrip())
  if lines and not lines[-1]:
    lines.pop()
  return lines


def test_visible_lines_keep_what_the_last_redraw_left():
  bar = "\rtrain:   0%|  | 0/2\r            \rstep 1/2: reward 0.500\n\rtrain:  50%|# | 1/2\rtrain: 100%|##| 2/2\n"
  assert visible_lines(bar) == ["step 1/2: reward 0.500", "train: 100%|##| 2/2"]
  assert visible_lines("a\n\nb") == ["a", "", "b"]


@pytest.mark.slow
def test_tiny_run_prints_bar_step_lines_and_table_and_writes_its_files(tmp_path):
  """Rollouts, updates, checkpoints, metrics and the held-out evaluation against the real τ² tools, through the
  command line; by default it prints the step lines, the bar and the held-out table, and no library's INFO/DEBUG
  log (orbax, TFDS, JAX, τ²'s loguru)."""
  workdir = tmp_path / "run"
  code, out = _main(
    f"--workdir={workdir}",
    f"--config.env.data_dir={tmp_path / 'tfds'}",
    "--config.train.eval_tasks=1",
    "--config.train.eval_at_start=true",
  )
  assert code == 0, out
  lines = visible_lines(out)
  assert len(lines) <= 40, out

  records = metrics.read_jsonl(workdir)
  assert [r["step"] for r in records] == [1, 2]
  for key in ("reward/mean", "update/loss", "update/clip_frac_low", "update/entropy", "rollout/tool_call_validity"):
    assert key in records[-1], key
  assert records[-1]["update/tokens"] > 0
  assert checkpoint_lib.Checkpointer(workdir).all_steps() == [1, 2]
  initial, held_out = metrics.read_jsonl(workdir, "eval.jsonl")
  assert initial["step"] == 0 and held_out["step"] == 2
  for summary in (initial, held_out):
    assert summary["eval/tasks"] == 1 and summary["eval/reward/invalid"] == 0
    # One task, one trial, τ²'s reward (a product of 0/1 checks): pass^1 is that trial's success, i.e. its reward.
    assert summary["eval/reward"] in (0.0, 1.0) and summary["eval/pass^1"] == summary["eval/reward"]

  # Every visible line, in order: the two step lines, the bar, the initial weights' evaluation and its table (after
  # training: it shares the final evaluation's programs, `Trainer.run`), the final one's and its table, then both
  # side by side.
  # First, on the tests' 8 fake CPU devices: tiny's 2 rollout rows and its micro-batches of 1 row do not split over
  # the 8 batch shards, and absl's WARNINGs (shown at the default verbosity) say so, naming the values
  # (`train.Trainer`, `runtime.make_sampler`); nothing else of absl's reaches the terminal.
  off_mesh = [line for line in lines if re.match(r"W\d{4} .*on one device of the 8-device mesh", line)]
  assert any("grpo.micro_batch_size=1" in line for line in off_mesh), out
  assert any("sampler on one device of the 8-device mesh: its 2 rows" in line for line in off_mesh), out
  assert lines[: len(off_mesh)] == off_mesh, out
  lines = lines[len(off_mesh) :]
  out = "".join(line for line in out.splitlines(keepends=True) if not re.match(r"W\d{4} .*8-device mesh", line))
  for step, line in zip((1, 2), lines[:2], strict=True):
    r = records[step - 1]
    assert line.startswith(f"step {step}/2: reward {r['reward/mean']:.3f} ± {r['reward/std']:.3f}, loss "), line
    compiling = f" ({r['time/compile_s']:.1f} s compiling)" if r["time/compile_s"] >= 0.05 else ""
    want = f", tool-call validity {r['rollout/tool_call_validity']:.2f}, {r['time/step_s']:.1f} s{compiling}"
    assert line.endswith(want), line
    assert r["compile/programs"] >= 0 and r["memory/host_peak_gib"] > 0 and r["memory/host_rss_gib"] > 0
    per_phase = {k: v for k, v in r.items() if k.startswith("compile/programs/")}
    assert sum(per_phase.values()) == r["compile/programs"], r  # no in-run evaluation here
    if step == 1:  # the first step compiles the rollout's and the update's programs (or loads them from the cache)
      assert per_phase["compile/programs/rollout"] > 0 and per_phase["compile/programs/update"] > 0, r
  assert re.fullmatch(r"train: 100%\|█+\| 2/2 \[\d\d:\d\d<00:00, .*step, reward=.*\]", lines[2]), lines[2]
  task = "1 held-out task (base split, 1 trial each)"
  assert lines[3] == f"evaluating the initial weights on {task} against the real tools..."
  first = metrics.format_eval_summary(initial, 0).splitlines()
  assert lines[4 : 4 + len(first)] == first and len(first) == 7  # header, columns, values, fidelity 3, the gap
  assert first[0] == (
    "held-out evaluation after step 0: 1 task x 1 trial against the real tools, scored by the benchmark"
  )
  assert first[1].split() == ["pass^1", "reward", "invalid", "scoring", "errors", "turns", "tool", "calls"]
  assert first[2].split()[:2] == [f"{initial['eval/pass^1']:.3f}", f"{initial['eval/reward']:.3f}"]
  lines = lines[4 + len(first) :]
  assert lines[0] == f"evaluating on {task} against the real tools..."
  final = metrics.format_eval_summary(held_out, 2).splitlines()
  change = metrics.format_eval_change(initial, held_out, 2).splitlines()
  # Last, what the whole run compiled (train.train_and_evaluate's record in compile.jsonl).
  (record,) = [json.loads(line) for line in (workdir / train.COMPILE_LOG).read_text().splitlines()]
  compiled = (
    f"compiled {record['programs']} programs in {record['compile_s']:.0f} s of the run's {record['wall_s']:.0f} s "
    f"(compilation cache: {record['cache'] or 'off'}, {record['cache_hits']} read from it)"
  )
  assert lines[1:] == [*final, *change, compiled] and len(final) == 7
  assert change[0] == "held-out, initial weights vs after step 2:" and len(change) == 10  # every headline number
  with_ci = lambda s, k: [f"{s[k]:.3f}", f"[{s[k + '/lo']:.3f},", f"{s[k + '/hi']:.3f}]"]  # one task: lo = hi = value
  assert change[1].split() == ["pass^1", *with_ci(initial, "eval/pass^1"), "->", *with_ci(held_out, "eval/pass^1")]
  assert change[3].split() == ["reward", f"{initial['eval/reward']:.3f}", "->", f"{held_out['eval/reward']:.3f}"]
  # Nothing else reached the terminal, not even what the bar's redraws hid: no log line of any library.
  assert not re.search(r"(^|[\r\n])[IDW]\d{4} \d\d:\d\d", out), out  # absl's "I1201 08:37:09.864 ..." lines
  assert "| DEBUG" not in out and "| INFO" not in out and "Generating" not in out and "Downloading" not in out


@pytest.mark.parametrize("mode", ["train", "eval", "plan"])
def test_bad_config_values_print_one_line_each_and_exit_2(tmp_path, mode):
  """A bad value fails before anything loads or is prepared (no data under env.data_dir, no workdir): one line per
  bad key naming the key, its value and the valid values, exit status 2, no traceback."""
  workdir, data_dir = tmp_path / "run", tmp_path / "tfds"
  args = [f"--mode={mode}", f"--workdir={workdir}", f"--config.env.data_dir={data_dir}"]
  code, out = _main(*args, "--config.grpo.mode=ppo", timeout=300)
  modes = ", ".join(repr(m) for m in config_check.MODES)
  assert code == 2 and out.splitlines() == [f"invalid config: grpo.mode='ppo' is not valid; choose one of {modes}"]
  assert "'envace', 'per_role', 'grpo_real_env'" in out
  code, out = _main(*args, "--config.grpo.mode=ppo", "--config.rollout.env_mode=imagined", timeout=300)
  env_modes = ", ".join(repr(m) for m in config_check.ENV_MODES)
  assert code == 2 and sorted(out.splitlines()) == [
    f"invalid config: grpo.mode='ppo' is not valid; choose one of {modes}",
    f"invalid config: rollout.env_mode='imagined' is not valid; choose one of {env_modes}",
  ]
  assert "Traceback" not in out and not workdir.exists() and not data_dir.exists()


def test_usage_errors_print_one_line(tmp_path):
  """A --config.KEY that names no setting, a config file that does not load, a workdir that is a file: one line each
  naming the problem (no traceback, no flag help), exit status 1, nothing written."""
  afile = tmp_path / "afile"
  afile.write_text("not a directory")
  cases = [
    (("--config.train.stepz=1",), 'no setting of the config: \'stepz\' Did you mean "steps" instead of "stepz"?'),
    ((f"--config={tmp_path / 'nope.py'}",), f"--config does not load: Attempted [Relative path]: {tmp_path}/nope.py"),
    ((f"--workdir={afile}",), f"--workdir={afile} is a file, not a directory"),
  ]
  for args, want in cases:
    code, out = _main(*args, timeout=300)
    assert code == 1 and len(out.strip().splitlines()) == 1 and want in out, out
  assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_multi_process_flags_are_checked_before_anything_joins(tmp_path):
  """Part of --coordinator / --num_processes / --process_id, or a mode other than train across processes: a usage
  error naming what to give, exit status 1, nothing joined, prepared or written."""
  workdir = tmp_path / "run"
  code, out = _main(f"--workdir={workdir}", "--num_processes=2", timeout=300)
  assert code == 1 and "--coordinator, --process_id missing" in out and "Traceback" not in out, out
  code, out = _main("--mode=eval", "--coordinator=127.0.0.1:1", "--num_processes=2", "--process_id=0", timeout=300)
  assert code == 1 and "--mode=eval runs in one process; only --mode=train runs across processes" in out, out
  assert not workdir.exists()
