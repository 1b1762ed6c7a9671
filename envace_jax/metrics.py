"""Per-step scalars to TensorBoard and to ``workdir/metrics.jsonl``, a progress bar and one line per step.

    start = restored_step + 1 if restored_step is not None else 1
    with MetricsWriter(workdir, total_steps=config.train.steps, start_step=start) as writer:
      for step in range(start, config.train.steps + 1):
        ...
        writer.write(step, {"reward/mean": 0.4, "loss": 1.3, "malformed_act": 2})
    rows = read_jsonl(workdir)  # [{"step": 1, "time": 1718000000.0, "reward/mean": 0.4, ...}, ...]

Steps count updates: step s is logged (and checkpointed) after the s-th update, so a run's steps are 1..N and a
resumed run starts at the checkpoint's step + 1 (``start_step``: a resumed run never shows a step twice). Write a
step once, with all its scalars (merge evaluation scalars into the step's dict).

``metrics.jsonl`` holds one JSON object per line: ``step`` (int), ``time`` (Unix wall time, seconds) and every
scalar of that step. Non-finite floats are written as the strings "NaN", "Infinity" and "-Infinity" (standard JSON
has no NaN; jq, pandas and browsers read the file as is) and ``read_jsonl`` turns them back into floats.

Only process 0 writes (multi-host runs log once).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_SUBDIR = "tensorboard"
_RESERVED = ("step", "time")
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def to_json_safe(value: Any) -> Any:
  """``value`` with numpy/JAX scalars made Python numbers and non-finite floats made strings, recursively.

  Mappings become dicts (keys as str), sequences lists; a 0-d array becomes its scalar; other arrays become
  (nested) lists. The result passes ``json.dumps(..., allow_nan=False)``.

  Raises:
    TypeError: a value JSON cannot hold (an object that is not a number, string, bool, None, mapping, sequence or
      array).
  """
  if value is None or isinstance(value, str | bool):
    return value
  if isinstance(value, np.bool_):
    return bool(value)
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    f = float(value)
    if math.isfinite(f):
      return f
    return "NaN" if math.isnan(f) else ("Infinity" if f > 0 else "-Infinity")
  if isinstance(value, Mapping):
    return {str(k): to_json_safe(v) for k, v in value.items()}
  if hasattr(value, "__array__") and hasattr(value, "shape"):  # numpy and JAX arrays
    array = np.asarray(value)
    return to_json_safe(array.item() if array.ndim == 0 else array.tolist())
  if isinstance(value, Sequence):
    return [to_json_safe(v) for v in value]
  raise TypeError(f"cannot write a {type(value).__name__} as JSON: {value!r}")


def from_json_safe(value: Any) -> Any:
  """Inverse of ``to_json_safe`` for floats: the strings "NaN", "Infinity", "-Infinity" become floats, recursively."""
  if isinstance(value, str):
    return _NONFINITE.get(value, value)
  if isinstance(value, dict):
    return {k: from_json_safe(v) for k, v in value.items()}
  if isinstance(value, list):
    return [from_json_safe(v) for v in value]
  return value


def scalar(name: str, value: Any) -> float | int:
  """A metric value as a Python int or float (bools count as ints).

  Raises:
    ValueError: ``value`` is not a real number or a one-element array (the message names the metric).
  """
  if isinstance(value, bool | np.bool_):
    return int(value)
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  if hasattr(value, "__array__") and hasattr(value, "shape"):
    array = np.asarray(value)
    if array.size == 1 and (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
      return scalar(name, array.reshape(()).item())
  raise ValueError(f"metric {name!r} must be a real number (or a one-element array), got {type(value).__name__}")


def jsonl_path(workdir: str | os.PathLike) -> str:
  """``workdir/metrics.jsonl``."""
  return os.path.join(os.fspath(workdir), JSONL_NAME)


def read_jsonl(workdir: str | os.PathLike, name: str = JSONL_NAME) -> list[dict[str, Any]]:
  """Every step logged under ``workdir`` (in ``workdir/name``: the training metrics by default; ``"eval.jsonl"``
  for the held-out evaluations), oldest first: dicts with ``step``, ``time`` and the scalars.

  Non-finite floats come back as floats. A missing file gives []. A line that does not parse (the tail of a run
  killed mid-write) is skipped with a warning.
  """
  path = os.path.join(os.fspath(workdir), name)
  if not os.path.exists(path):
    return []
  rows = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        logging.warning("%s line %d is not JSON (a run killed mid-write?); skipped", path, number)
        continue
      rows.append(from_json_safe(row))
  return rows


def print_line(text: str) -> None:
  """Writes ``text`` and a newline to stdout at once (flushed), with tqdm's bars cleared first and redrawn below it,
  so a line never lands inside a progress bar (in a terminal and in a notebook alike)."""
  import tqdm

  with tqdm.tqdm.external_write_mode(file=sys.stdout):
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


BOOTSTRAP_RESAMPLES = 2000  # `interval95`'s resamples: the held-out tables' intervals (fixed seed: reproducible)


def interval95(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float]:
  """The percentile-bootstrap 95% interval of the mean of ``values`` (resampled with replacement, ``resamples``
  times, generator seeded with ``seed``): (lo, hi); (NaN, NaN) for no value. The held-out tables' intervals over
  tasks (pass^1) and over calls (fidelity); experiments/evidence.py adds the seeds' level."""
  x = np.asarray(values, np.float64)
  if x.size == 0:
    return float("nan"), float("nan")
  means = x[np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
  lo, hi = np.percentile(means, [2.5, 97.5])
  return float(lo), float(hi)


def _num(value: Any, spec: str) -> str:
  """``value`` formatted with ``spec``; "-" for a missing value or NaN (a metric undefined at that step)."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return "-"
  return format(value, spec)


def step_line(step: int, total: int | None, values: Mapping[str, float]) -> str:
  """One step's console line: "step S/N:" and those of its scalars a newcomer watches, when the step has them.

  In order: the reward ("reward/mean" ± "reward/std", or "reward"), invalid trajectories and scoring errors when
  nonzero ("reward/invalid", "reward/scoring_errors"), dynamic sampling's outcome when it drew extra batches
  ("dynamic_sampling/extra_draws", "groups", "fallback"), the warm-up's "sft/nll", the update's loss, ACT's mean
  |advantage| ("adv/act/abs_mean": 0 means GRPO had no signal), KL, entropy and gradient norm ("update/*", or a plain
  "loss"), a skipped update ("update/skipped"), tool-call validity, an in-run held-out reward ("eval/reward"), and
  the step's seconds ("time/step_s"), with the part spent compiling when it is 0.05 s or more ("time/compile_s").

    step_line(1, 2, {"reward/mean": 0.5, "reward/std": 0.0, "update/loss": 0.0123, "time/step_s": 18.1})
    # 'step 1/2: reward 0.500 ± 0.000, loss 0.0123, 18.1 s'
  """
  get = values.get
  parts = []
  if "reward/mean" in values:
    reward = f"reward {_num(get('reward/mean'), '.3f')}"
    parts.append(reward + (f" ± {_num(get('reward/std'), '.3f')}" if "reward/std" in values else ""))
  elif "reward" in values:
    parts.append(f"reward {_num(get('reward'), '.3f')}")
  for key, label in (("reward/invalid", "invalid"), ("reward/scoring_errors", "scoring errors")):
    if get(key):
      parts.append(f"{label} {_num(get(key), '.0f')}")
  if get("dynamic_sampling/extra_draws"):
    draws = f"{_num(get('dynamic_sampling/extra_draws'), '.0f')} extra batch(es)"
    if get("dynamic_sampling/fallback"):
      parts.append(f"no group with signal after {draws}: first batch trained")
    else:
      parts.append(f"{_num(get('dynamic_sampling/groups'), '.0f')} group(s) with signal after {draws}")
  for key, label, spec in (
    ("sft/nll", "warm-up NLL", ".3f"),
    ("update/loss", "loss", ".3g"),
    ("loss", "loss", ".3g"),
    ("adv/act/abs_mean", "ACT |advantage|", ".3g"),
    ("update/kl", "KL", ".3g"),
    ("update/entropy", "entropy", ".3g"),
    ("update/grad_norm", "grad norm", ".3g"),
    ("rollout/tool_call_validity", "tool-call validity", ".2f"),
    ("eval/reward", "held-out reward", ".3f"),
  ):
    if key in values and not (key == "loss" and "update/loss" in values):
      parts.append(f"{label} {_num(get(key), spec)}")
  if get("update/skipped"):
    parts.append("update skipped")
  if "time/step_s" in values:
    compiling = f" ({_num(get('time/compile_s'), '.1f')} s compiling)" if get("time/compile_s", 0) >= 0.05 else ""
    parts.append(f"{_num(get('time/step_s'), '.1f')} s{compiling}")
  head = f"step {step}" + (f"/{total}" if total else "")
  return f"{head}: {', '.join(parts)}" if parts else head


def format_eval_summary(summary: Mapping[str, float], step: int) -> str:
  """The training run's held-out evaluation (``heldout.committed_execution``'s ``eval/*`` scalars, also appended to
  ``workdir/eval.jsonl``) as a short table: pass^k, reward, invalid trajectories, scoring errors, turns and tool
  calls; REHEARSE's fidelity on the committed runs' real tool calls and on the benchmark's gold calls (when
  measured); the rehearsal-vs-real reward gap (when measured). A NaN (nothing to measure) shows as "-".

  Raises:
    KeyError: ``summary`` lacks "eval/tasks" or "eval/trials".
  """
  g = summary.get
  tasks, trials = int(summary["eval/tasks"]), int(summary["eval/trials"])
  passes = sorted((k for k in summary if re.fullmatch(r"eval/pass\^\d+", k)), key=lambda k: int(k.rsplit("^", 1)[1]))
  lines = [
    f"held-out evaluation after step {step}: {tasks} task{'s' * (tasks != 1)} x {trials} "
    f"trial{'s' * (trials != 1)} against the real tools, scored by the benchmark",
  ]
  cols = [(k.removeprefix("eval/"), _num(g(k), ".3f")) for k in passes] + [
    ("reward", _num(g("eval/reward"), ".3f")),
    ("invalid", _num(g("eval/reward/invalid"), ".0f")),
    ("scoring errors", _num(g("eval/reward/scoring_errors"), ".0f")),
    ("turns", _num(g("eval/turns"), ".2f")),
    ("tool calls", _num(g("eval/tool_calls"), ".2f")),
  ]
  widths = [max(len(name), len(value)) for name, value in cols]
  lines.append("  " + "  ".join(f"{name:>{w}}" for (name, _), w in zip(cols, widths, strict=True)))
  lines.append("  " + "  ".join(f"{value:>{w}}" for (_, value), w in zip(cols, widths, strict=True)))
  measures = ("json_valid", "exact_match", "key_f1", "value_accuracy", "error_agreement")
  sources = (("committed runs' calls", "fidelity"), ("gold calls", "fidelity_gold"))
  rows = [(label, prefix) for label, prefix in sources if f"eval/{prefix}/calls" in summary]
  if rows:
    lines.append(f"  {'REHEARSE fidelity on':<22}  calls   json  exact  keyF1  value  error")
    for label, prefix in rows:
      cells = "  ".join(f"{_num(g(f'eval/{prefix}/{m}'), '.2f'):>5}" for m in measures)
      lines.append(f"  {label:<22}  {_num(g(f'eval/{prefix}/calls'), '.0f'):>5}  {cells}")
  if "eval/gap/gap" in summary:
    lines.append(
      f"  rehearsal-vs-real reward gap {_num(g('eval/gap/gap'), '.3f')}: rehearsed "
      f"{_num(g('eval/gap/rehearsed_reward'), '.3f')} (rule checklist, {_num(g('eval/gap/trajectories'), '.0f')} "
      f"trajectories), real {_num(g('eval/gap/real_reward'), '.3f')} (benchmark)"
    )
  return "\n".join(lines)


_CHANGE_ROWS = (
  ("pass^1", "eval/pass^1", ".3f"),
  ("fidelity on gold calls: exact match", "eval/fidelity_gold/exact_match", ".2f"),
  ("reward", "eval/reward", ".3f"),
  ("tool-call validity", "eval/tool_call_validity", ".2f"),
  ("tool calls per trial", "eval/tool_calls", ".2f"),
  ("fidelity on gold calls: JSON valid", "eval/fidelity_gold/json_valid", ".2f"),
  ("fidelity on gold calls: key F1", "eval/fidelity_gold/key_f1", ".2f"),
  ("fidelity on gold calls: value accuracy", "eval/fidelity_gold/value_accuracy", ".2f"),
  ("rehearsal-vs-real reward gap", "eval/gap/gap", ".3f"),
)


def format_eval_change(initial: Mapping[str, float], final: Mapping[str, float], step: int) -> str:
  """The held-out evaluation of the initial weights (``train.eval_at_start``: step 0 of ``eval.jsonl``) beside the
  one after step ``step``, one line per headline number both hold (`format_eval_summary`'s keys), with its 95%
  interval ``[lo, hi]`` where the summary has one (``KEY/lo``, ``KEY/hi``: pass^1 over tasks, fidelity over calls;
  `interval95`); "-" for NaN."""
  rows = [(name, key, fmt) for name, key, fmt in _CHANGE_ROWS if key in initial and key in final]
  width = max(len(name) for name, _, _ in rows) if rows else 0
  lines = [f"held-out, initial weights vs after step {step}:"]

  def cell(summary, key, fmt):
    value = _num(summary[key], fmt)
    if f"{key}/lo" in summary and not math.isnan(summary[key]):
      value += f" [{_num(summary[f'{key}/lo'], fmt)}, {_num(summary[f'{key}/hi'], fmt)}]"
    return value

  for name, key, fmt in rows:
    lines.append(f"  {name:<{width}}  {cell(initial, key, fmt):>6} -> {cell(final, key, fmt)}")
  return "\n".join(lines)


def _truncate_jsonl(path: str, start_step: int) -> int:
  """Drops lines with step >= start_step (and unparseable ones); returns how many lines were dropped."""
  if not os.path.exists(path):
    return 0
  kept, dropped = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        step = json.loads(line)["step"]
      except (json.JSONDecodeError, KeyError, TypeError):
        dropped += 1
        continue
      if isinstance(step, int) and step < start_step:
        kept.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  if dropped:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(tmp, path)
  return dropped


class MetricsWriter:
  """Writes each step's scalars to TensorBoard, to ``workdir/metrics.jsonl`` and to a tqdm progress bar.

  Args:
    workdir: the run's directory (created if missing). TensorBoard events go to ``workdir/tensorboard``.
    total_steps: the run's last step, for the progress bar's ETA (None: no ETA).
    start_step: the first step this run writes: 1 for a fresh run (an earlier log in ``workdir`` is then dropped),
      the restored checkpoint's step + 1 after a resume. Earlier JSONL lines with step >= start_step (written after
      the last checkpoint, about to be redone) are dropped, and TensorBoard hides events from that step on
      (tensorboardX's ``purge_step``).
    tensorboard: write TensorBoard event files.
    progress: show a progress bar (on stderr) and each step's ``step_line`` (on stdout, above the bar).
    progress_keys: scalars shown on the bar when a step has them (the first present of "reward/mean", "reward" is
      shown as "reward"; a supervised warm-up step shows its "sft/nll").
    is_primary: whether this process writes; default ``jax.process_index() == 0``.

  Raises:
    ValueError: negative start_step or total_steps.
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    total_steps: int | None = None,
    start_step: int = 1,
    tensorboard: bool = True,
    progress: bool = True,
    progress_keys: Sequence[str] = ("reward/mean", "reward", "sft/nll", "loss"),
    is_primary: bool | None = None,
  ):
    if start_step < 0:
      raise ValueError(f"start_step must be >= 0, got {start_step}")
    if total_steps is not None and total_steps < 0:
      raise ValueError(f"total_steps must be >= 0 or None, got {total_steps}")
    if is_primary is None:
      import jax

      is_primary = jax.process_index() == 0
    self.workdir = os.fspath(workdir)
    self.is_primary = is_primary
    self.progress_keys = tuple(progress_keys)
    self._file = None
    self._tb = None
    self._bar = None
    self._last_step: int | None = None
    self._total = total_steps
    if not is_primary:
      return
    os.makedirs(self.workdir, exist_ok=True)
    path = jsonl_path(self.workdir)
    dropped = _truncate_jsonl(path, start_step)
    if dropped:
      logging.info("%s: dropped %d lines at step >= %d (resuming there)", path, dropped, start_step)
    self._file = open(path, "a", encoding="utf-8")
    if tensorboard:
      import tensorboardX

      # tensorboardX names event files by the second and the host: a unique suffix keeps a quick restart from
      # overwriting the previous run's file.
      self._tb = tensorboardX.SummaryWriter(
        os.path.join(self.workdir, TENSORBOARD_SUBDIR),
        purge_step=start_step,
        filename_suffix=f".{os.getpid()}.{time.time_ns()}",
      )
    if progress:
      import tqdm

      done = max(start_step - 1, 0)  # steps already completed by earlier runs
      self._bar = tqdm.tqdm(total=total_steps, initial=done, desc="train", unit="step", dynamic_ncols=True)

  def write(self, step: int, scalars: Mapping[str, Any]) -> dict[str, Any]:
    """Logs one step: a JSONL line, TensorBoard scalars, its console line and the progress bar advanced to ``step``.

    Args:
      step: the step these scalars belong to (ints; a step may be written once).
      scalars: metric name -> real number or one-element array (JAX arrays are fetched). Names may use "/" to
        group them in TensorBoard ("reward/mean").

    Returns:
      The JSONL record written (with Python floats; non-finite values as floats).

    Raises:
      ValueError: a non-scalar value, a metric named "step" or "time", or a step not after the previous one.
    """
    step = int(step)
    if self._last_step is not None and step <= self._last_step:
      raise ValueError(f"step {step} written after step {self._last_step}; steps must increase")
    values = {}
    for name, value in scalars.items():
      if name in _RESERVED:
        raise ValueError(f"metric name {name!r} is reserved in metrics.jsonl; rename it")
      values[str(name)] = scalar(name, value)
    record = {"step": step, "time": time.time(), **values}
    self._last_step = step
    if not self.is_primary:
      return record
    self._file.write(json.dumps(to_json_safe(record), allow_nan=False) + "\n")
    self._file.flush()
    if self._tb is not None:
      for name, value in values.items():
        self._tb.add_scalar(name, value, global_step=step, walltime=record["time"])
      self._tb.flush()
    if self._bar is not None:
      shown = {}
      for key in self.progress_keys:
        label = "reward" if key.startswith("reward") else key
        if key in values and label not in shown:
          shown[label] = f"{values[key]:.4g}"
      self._bar.set_postfix(shown, refresh=False)
      self._bar.update(max(step - self._bar.n, 0))
      print_line(step_line(step, self._total, values))
    return record

  def close(self) -> None:
    """Flushes and closes the files and the bar (idempotent)."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._file is not None:
      self._file.close()
      self._file = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
