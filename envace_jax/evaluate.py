"""``--mode=eval``: a checkpoint (or the base weights) evaluated on the real environments, once per test-time
rehearsal mode; a table and ``DIR/eval_results.json``.

    python -m envace_jax.main --config=configs/tau2.py --mode=eval --workdir=DIR

`run` evaluates ``eval.tasks`` tasks of ``env.eval_split``, ``eval.num_trials`` trials each, once per mode in
``eval.rehearsal`` with `heldout.evaluate_policy`. Seconds include JIT compilation, which the first mode pays most of
(compare tokens across modes, or seconds from a second run).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
from absl import logging

from envace_jax import config_check, heldout, metrics, runtime, scoring
from envace_jax import policy as policy_lib
from envace_jax.config import choices
from envace_jax.envs.base import Task
from envace_jax.model import transformer

RESULTS_FILE = "eval_results.json"


def restore_policy(
  config, model: runtime.Model, workdir: str | None, fallback_setting: str = "train.checkpoint_fallback"
) -> tuple[Any, int | None]:
  """The parameters to evaluate: the latest checkpoint's in ``workdir`` (layers apart, as the train state holds
  them), else the model's base weights (``model.params`` itself). A latest step that does not read is reported in one
  line (a warning) and the newest older step that reads is restored instead (``train.checkpoint_fallback``;
  ``fallback_setting`` is how the error names it when it is off: serve's ``--checkpoint_fallback`` sets it).

  Returns:
    (params in `policy.Policy`'s layout: one tree, or one per role tree; the restored checkpoint's step or None).
  Raises:
    checkpoint.IncompatibleCheckpointError: the checkpoint does not match the configured model.
    checkpoint.DamagedCheckpointError: the latest step does not read and ``train.checkpoint_fallback`` is off, or no
      step reads.
  """
  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax.rl import grpo

  cfg = grpo.GrpoConfig.from_config(config)
  base = policy_lib.Policy.from_config(config).initial(model.params), None
  if not workdir or not os.path.isdir(os.path.join(workdir, checkpoint_lib.CHECKPOINT_SUBDIR)):
    return base
  with checkpoint_lib.Checkpointer.from_config(workdir, config, read_only=True) as ckpt:
    step = ckpt.latest_step()
    if step is None:
      return base
    target = jax.eval_shape(functools.partial(grpo.init_train_state, cfg), model.params)  # shapes: nothing allocated
    restored = ckpt.restore(
      step,
      abstract_state={"params": target.params, "opt_state": target.opt_state},
      fallback=config.train.checkpoint_fallback,
      fallback_setting=fallback_setting,
    )
  return restored.params, restored.step


def stored_config(
  workdir: str | None, fallback: bool = True, fallback_setting: str = "train.checkpoint_fallback"
) -> tuple[Any, int] | None:
  """(config, step) of the newest checkpoint in ``workdir`` whose config reads: the config the run saved with it,
  completed with today's defaults (`defaults.completed`); None when ``workdir`` holds no checkpoint. A damaged newer
  step is passed over with a warning line (``fallback``; `checkpoint.Checkpointer.read_newest`).

  Raises:
    checkpoint.DamagedCheckpointError: the latest step does not read and ``fallback`` is off (the error names
      ``fallback_setting``), or no step reads.
  """
  from envace_jax import checkpoint as checkpoint_lib
  from envace_jax.config import defaults

  if not workdir or not os.path.isdir(os.path.join(workdir, checkpoint_lib.CHECKPOINT_SUBDIR)):
    return None
  with checkpoint_lib.Checkpointer(workdir, read_only=True) as ckpt:
    if ckpt.latest_step() is None:
      return None
    step, stored, _ = ckpt.read_newest(ckpt.read_config, fallback=fallback, fallback_setting=fallback_setting)
  return defaults.completed(stored), step


def command_config(config, workdir: str | None, overrides: Mapping[str, Any], config_given: bool = True):
  """``--mode=eval``'s config, announced in one printed line: the run's own, saved with the latest checkpoint in
  ``workdir`` that reads (a per-role or Qwen3 run restores without its training flags repeated), with the
  ``--config.KEY=VALUE`` flags given (``overrides``, flat keys) set on it; or, when ``workdir`` holds no checkpoint,
  ``config`` (``--config=FILE``, those flags already in it), whose model's base weights `run` then evaluates (and
  says so in one line).

  Raises:
    ValueError: ``workdir`` holds no checkpoint and no ``--config`` was given (``config_given``).
    checkpoint.DamagedCheckpointError: as `stored_config`.
  """
  found = stored_config(workdir)
  if found is None:
    if not config_given:
      if workdir and not os.path.exists(workdir):
        where = f"{workdir} does not exist"
      else:
        where = f"{workdir or 'no --workdir'} holds no checkpoint to read the run's config from"
      raise ValueError(f"--mode=eval: {where}; give --config=FILE to evaluate a model's base weights")
    return config
  stored, step = found
  stored.update_from_flattened_dict({k: _like(stored, k, v) for k, v in overrides.items()})
  given = ", ".join(f"{k}={v!r}" for k, v in sorted(overrides.items()))
  print(
    f"config: the run's own, saved with step {step} in {workdir}"
    + (f", with {given}" if given else "")
    + (" (--config=FILE's own values unused)" if config_given else ""),
    flush=True,
  )
  return stored


def _like(config, dotted: str, value: Any) -> Any:
  """``value`` as the type ``config`` holds at ``dotted`` where only list and tuple differ (a stored config holds
  JSON lists where the config files hold tuples)."""
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node:
      return value
    node = node[part]
  return list(value) if isinstance(node, list) and isinstance(value, tuple) else value


def eval_tasks(config) -> list[Task]:
  """``--mode=eval``'s tasks: `runtime.evaluation_tasks` with ``eval.tasks``."""
  return runtime.evaluation_tasks(config, config.eval.tasks)


def eval_modes(config) -> tuple[str, ...]:
  """``config.eval.rehearsal`` ("off,parallel,sequential" or a tuple) as mode names."""
  return choices.parse_names(config.eval.rehearsal)


def eval_key(seed: int) -> jax.Array:
  """The evaluation key of ``--mode=eval`` for ``seed``: every policy evaluated with it meets the same openings."""
  return jax.random.fold_in(jax.random.key(seed), 0xE7A1)


def load_policy(
  config, workdir: str | None, n_rows: int, fallback_setting: str = "train.checkpoint_fallback"
) -> tuple[runtime.Model, dict[str, Any], int | None]:
  """(model, samplers for `heldout.evaluate_policy` sized for ``n_rows`` rows, checkpoint step or None) of the latest
  checkpoint in ``workdir`` that reads (else the base weights; `restore_policy`).

  Raises:
    config_check.ConfigError: a model without a tokenizer. checkpoint.CheckpointError: a mismatched checkpoint, or
      a damaged one with nothing to fall back to (`restore_policy`).
  """
  model = runtime.load_model(config)
  if model.tokenizer is None:
    raise config_check.ConfigError([f"model={config.model!r} has no tokenizer; set config.tokenizer"])
  # The base weights with their layers apart (the samplers' layout), once: the reference and, without a checkpoint,
  # the policy sample the same arrays.
  model = dataclasses.replace(model, params=transformer.unstack_tree(model.params))
  params, step = restore_policy(config, model, workdir, fallback_setting)
  mesh = runtime.make_mesh(config)
  policy = policy_lib.Policy.from_config(config)
  samplers = policy.samplers(params, lambda p: runtime.make_sampler(config, model, p, mesh, n_rows))
  samplers["reference"] = runtime.make_sampler(config, model, model.params, mesh, n_rows)
  return model, samplers, step


def run(config, workdir: str | None) -> dict[str, Any]:
  """``--mode=eval``: evaluates the latest checkpoint in ``workdir`` (or the base weights) on ``env.eval_split``.

  Returns:
    {"weights", "checkpoint_step", "domain", "benchmark", "rows": one summary per rehearsal mode (with "rehearsal":
    the mode, "MODE+CONTROL" under ``eval.rehearsal_control``, and "N"), "fidelity_gold": REHEARSE on the
    benchmark's gold calls (``fidelity_gold/*``, once), "reward_gap": the gap summary}; also printed as a table and
    written to ``workdir/eval_results.json``.
  Raises:
    config_check.ConfigError: a bad config value or a scorer that cannot work (`scoring.check_scorers`), before any
      compute.
  """
  config_check.validate(config)
  tasks = eval_tasks(config)
  scoring.check_scorers(config, tasks)  # before the model loads: a misconfigured scorer costs no compute
  n = len(tasks)
  model, samplers, step = load_policy(config, workdir, n * config.eval.num_trials)
  if step is None:
    where = f"no checkpoint in {workdir}" if workdir else "no --workdir"
    print(f"{where}: evaluating the base weights of {config.model_path or config.model}", flush=True)
  key = eval_key(config.seed)
  rows, gap, gold = [], None, None
  for i, mode in enumerate(eval_modes(config)):
    logging.info("evaluating %d tasks x %d trials, rehearsal %s", n, config.eval.num_trials, mode)
    summary, _ = heldout.evaluate_policy(
      config,
      tasks,
      samplers,
      model.tokenizer,
      key,
      mode=mode,
      num_trials=config.eval.num_trials,
      # The same openings in every mode: REHEARSE on the gold calls and the reward gap are measured once.
      gap=i == 0 and config.eval.reward_gap,
      gold=i == 0 and config.eval.fidelity_gold,
    )
    if i == 0:
      gold = _pop(summary, ("fidelity_gold/", "cost/fidelity_gold/")) or None
      gap = _pop(summary, ("gap/", "cost/gap/")) or None
    control = config.eval.rehearsal_control
    label = mode if mode == "off" or control == "none" else f"{mode}+{control}"  # a control at the same budget
    summary.update(rehearsal=label, N=0 if mode == "off" else config.eval.rehearsal_n)
    rows.append(summary)
  result = {
    "weights": model.source if step is None else f"{workdir} step {step}",
    "checkpoint_step": step,
    "benchmark": config.env.benchmark,
    "domain": config.env.domain,
    "split": config.env.eval_split,
    "rows": rows,
    "fidelity_gold": gold,
    "reward_gap": gap,
  }
  print(format_table(result))
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, RESULTS_FILE), "w", encoding="utf-8") as f:
      json.dump(metrics.to_json_safe(result), f, indent=2, allow_nan=False)  # NaN as "NaN": strict JSON
  return result


def _pop(summary: dict[str, Any], prefixes: tuple[str, ...]) -> dict[str, Any]:
  return {k: summary.pop(k) for k in list(summary) if k.startswith(prefixes)}


def _f(x: Any, digits: int = 3) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def format_table(result: Mapping[str, Any]) -> str:
  """`run`'s result as text: one line per rehearsal mode (pass^k, reward, fidelity, costs), then the reward gap."""
  rows = result["rows"]
  trials = int(rows[0]["trials"]) if rows else 1
  passes = [f"pass^{k}" for k in range(1, trials + 1)]
  head = (
    f"{'domain':<10} {'rehearsal':<10} {'N':>2} {'tasks':>5} "
    + " ".join(f"{p:>7}" for p in passes)
    + f" {'reward':>6} {'invalid':>7} {'errors':>6} {'calls':>5} | "
    + f"{'json':>5} {'exact':>5} {'keyF1':>5} {'value':>5} {'error':>5} | "
    + f"{'rehearse tok':>12} {'rehearse s':>10} {'memory tok':>10} {'commit tok':>10} {'commit s':>8}"
  )
  lines = [
    f"Evaluation of {result['weights']} on {result['benchmark']} {result['domain']} ({result['split']} split); "
    "pass^k = mean over tasks of C(c,k)/C(n,k) (an invalid trial counts as failed: its scorer could not score it, "
    "or its external user failed; errors = the invalid trials whose scorer raised; reward is the mean over valid "
    "trials); fidelity = REHEARSE's prediction of each real tool response "
    "(json valid, exact match, key-set F1, value accuracy on shared keys, error agreement); costs in generated "
    "tokens and seconds (rehearse = rehearsals + assessments + memory; seconds include compilation, mostly paid by the "
    "first mode).",
    head,
    "-" * len(head),
  ]
  for r in rows:
    pre = ("rehearsal", "assessment", "memory")
    tok = sum(r.get(f"cost/{p}/generated_tokens", 0.0) for p in pre)
    sec = sum(r.get(f"cost/{p}/seconds", 0.0) for p in pre)
    lines.append(
      f"{result['domain']:<10} {r['rehearsal']:<10} {r['N']:>2} {int(r['tasks']):>5} "
      + " ".join(f"{_f(r[p]):>7}" for p in passes)
      + f" {_f(r['reward']):>6} {int(r['reward/invalid']):>7} {int(r['reward/scoring_errors']):>6} "
      + f"{_f(r['tool_calls'], 1):>5} | "
      + " ".join(
        f"{_f(r.get(f'fidelity/{m}'), 2):>5}"
        for m in ("json_valid", "exact_match", "key_f1", "value_accuracy", "error_agreement")
      )
      + f" | {tok:>12.0f} {sec:>10.1f} {_f(r.get('memory_tokens'), 0):>10} "
      + f"{r.get('cost/execution/generated_tokens', 0.0):>10.0f} {r.get('cost/execution/seconds', 0.0):>8.1f}"
    )
  calls = [int(r.get("fidelity/calls", 0)) for r in rows]
  lines.append(f"real tool calls probed for fidelity per mode: {calls}")
  gold = result.get("fidelity_gold")
  if gold:
    lines.append(
      f"REHEARSE on the benchmark's gold calls ({int(gold['fidelity_gold/calls'])} calls after the tasks' openings, "
      "executed for real): "
      + ", ".join(
        f"{m} {_f(gold.get(f'fidelity_gold/{m}'), 2)}"
        for m in ("json_valid", "exact_match", "key_f1", "value_accuracy", "error_agreement")
      )
    )
  gap = result.get("reward_gap")
  if gap:
    lines.append(
      f"rehearsal-vs-real reward gap ({int(gap['gap/trajectories'])} rehearsed trajectories, no grounding; "
      f"{int(gap['gap/invalid'])} left out as unscoreable, {int(gap['gap/scoring_errors'])} of them by a scorer "
      "error): rule checklist on the rehearsal "
      f"{_f(gap['gap/rehearsed_reward'])} vs benchmark reward of the same decisions executed for real "
      f"{_f(gap['gap/real_reward'])}: gap {_f(gap['gap/gap'])}"
    )
  return "\n".join(lines)
