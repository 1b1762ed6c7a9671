"""What a training run saved, read back without its config file (each checkpoint carries its config).

    python -m envace_jax.inspect_checkpoint WORKDIR          # every saved step: config, parameters, role embeddings, …
    python -m envace_jax.inspect_checkpoint WORKDIR --step 2 # one step
    python -m envace_jax.inspect_checkpoint WORKDIR --json   # the same, as JSON

WORKDIR is a training ``--workdir``, its ``checkpoints`` folder or one step's folder (`resolve_workdir`). The report
gives each step's `describe_checkpoint` (config, parameter arrays, role-embedding norms, optimizer step, the step's
scalars; a tree per role side by side), then the main scalars per step from ``WORKDIR/metrics.jsonl`` and the
held-out evaluation from ``WORKDIR/eval.jsonl``.

The functions are the notebook's (``notebooks/inspect_checkpoint.ipynb``) too:

    descriptions = describe_checkpoints(workdir)          # one dict per step (JSON-able)
    records = metrics.read_jsonl(workdir)
    print(format_report(descriptions, records))
    steps, values = metric_series(records, "reward/mean")

Restoring reads every saved array (parameters and optimizer state) onto the first local device: inspect a
checkpoint on a machine that could hold it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from envace_jax import metrics as metrics_lib
from envace_jax.checkpoint import CHECKPOINT_SUBDIR, Checkpointer, CheckpointError
from envace_jax.model import transformer
from envace_jax.model.roles import Role
from envace_jax.rl import grpo

# Per-step scalars the table shows (those a run logged; the rest are in the JSON and in TensorBoard).
MAIN_METRICS = (
  "reward/mean",
  "update/loss",
  "update/grad_norm",
  "update/entropy",
  "update/approx_kl",
  "rollout/tool_call_validity",
  "rollout/rehearsed_json_validity",
  "time/step_s",
)
EVAL_JSONL = "eval.jsonl"  # heldout.write_summary: one line per held-out evaluation
SHARED_TREE = "policy"  # the name of the one parameter tree of envace / grpo_real_env runs
ROLE_TREES = tuple(grpo.ROLE_TREES)  # the trees of a run with a tree per role (policy.Policy): ("act", "rehearse")


# ---------------------------------------------------------------------------------------------------------------------
# Finding the checkpoints


def resolve_workdir(path: str | os.PathLike) -> tuple[str, int | None]:
  """The training workdir ``path`` points into, and the step when ``path`` is one step's folder.

  Accepts the workdir itself, its ``checkpoints`` folder, or ``checkpoints/<step>``.

  Raises:
    CheckpointError: ``path`` does not exist, or holds no ``checkpoints`` folder (the message says what to pass).
  """
  path = os.path.abspath(os.fspath(path))
  if not os.path.exists(path):
    raise CheckpointError(
      f"{path} does not exist. Pass a training --workdir: the directory given to "
      "`python -m envace_jax.main --workdir=DIR` (it holds checkpoints/ and metrics.jsonl)."
    )
  if not os.path.isdir(path):
    raise CheckpointError(f"{path} is a file; pass a training --workdir (a directory holding checkpoints/).")
  if os.path.isdir(os.path.join(path, CHECKPOINT_SUBDIR)):
    return path, None
  if os.path.basename(path) == CHECKPOINT_SUBDIR:
    return os.path.dirname(path), None
  parent, name = os.path.split(path)
  if os.path.basename(parent) == CHECKPOINT_SUBDIR and name.isdigit():
    return os.path.dirname(parent), int(name)
  logged = len(metrics_lib.read_jsonl(path))
  hint = (
    f" Its metrics.jsonl logs {logged} steps: the run has not saved a checkpoint yet (saves happen every "
    "config.train.checkpoint_every steps and at the last step)."
    if logged
    else " Pass a training --workdir: the directory given to `python -m envace_jax.main --workdir=DIR`."
  )
  raise CheckpointError(f"{path} holds no {CHECKPOINT_SUBDIR}/ folder, so no checkpoint.{hint}")


def checkpoint_steps(workdir: str | os.PathLike) -> list[int]:
  """Every finished checkpoint's step in ``workdir`` (or the one step ``workdir`` names), oldest first. Lists the
  step folders only: opens no checkpoint manager.

  Raises:
    CheckpointError: no such directory, no ``checkpoints`` folder, no finished checkpoint in it, or ``workdir`` names
      a step that was not saved.
  """
  import orbax.checkpoint as ocp

  workdir, only = resolve_workdir(workdir)
  directory = os.path.join(workdir, CHECKPOINT_SUBDIR)
  steps = sorted(ocp.path.step.checkpoint_steps(directory))
  if not steps:
    raise CheckpointError(
      f"{directory} holds no finished checkpoint (a save that is in flight or was killed mid-way leaves only a tmp "
      "folder). Wait for the run's first save, or inspect another workdir."
    )
  if only is not None:
    if only not in steps:
      raise CheckpointError(f"no checkpoint of step {only} in {workdir}; saved steps: {steps}")
    return [only]
  return steps


# ---------------------------------------------------------------------------------------------------------------------
# Reading one step


def _key_name(entry: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _flatten(tree: Any) -> list[tuple[str, Any]]:
  """(path joined with "/", leaf) for every array of ``tree``, in tree order (sorted dict keys)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [("/".join(_key_name(e) for e in path), leaf) for path, leaf in flat]


def split_trees(tree: Any) -> dict[str, Any]:
  """{tree name: tree}: ``{"act": ..., "rehearse": ...}`` as they are for the params or optimizer state of a run
  with a tree per role, otherwise ``{"policy": tree}``."""
  if isinstance(tree, Mapping) and set(tree) == set(ROLE_TREES):
    return {name: tree[name] for name in ROLE_TREES}
  return {SHARED_TREE: tree}


def l2_norm(array: Any) -> float:
  """The L2 (Frobenius) norm of all of ``array``'s values, accumulated in float64 (any real dtype, bfloat16 too)."""
  values = np.asarray(array).astype(np.float64).ravel()
  return float(np.sqrt(np.dot(values, values)))


def param_table(params: Any) -> dict[str, list[dict[str, Any]]]:
  """One row per parameter array, per tree; layers saved apart (``layers_0 ..``, as the train state holds them) are
  shown stacked, one row per array of all layers.

  Args:
    params: a parameter tree (nested dicts of arrays), or ``{"act": tree, "rehearse": tree}`` (a tree per role).

  Returns:
    {tree name ("policy", or "act" and "rehearse"): [{"path": "layers/attn/q_proj", "shape": [L, D, N, H],
    "dtype": "float32", "size": number of values, "norm": L2 norm}, ...]} in tree order.
  """
  out = {}
  for name, tree in split_trees(transformer.stack_tree(params)).items():
    rows = []
    for path, leaf in _flatten(tree):
      array = np.asarray(leaf)
      rows.append(
        {
          "path": path,
          "shape": list(array.shape),
          "dtype": str(array.dtype),
          "size": int(array.size),
          "norm": l2_norm(array),
        }
      )
    out[name] = rows
  return out


def role_names(num_roles: int) -> list[str]:
  """Names of the role-embedding rows: ``Role`` member names, then "role_<i>" for rows ``Role`` does not know."""
  return [Role(i).name if i < len(Role) else f"role_{i}" for i in range(num_roles)]


def role_embedding_norms(params: Any) -> dict[str, dict[str, float]]:
  """L2 norm of each role's row of ``role_embed``, per tree.

  Args:
    params: as for ``param_table``; each tree's ``role_embed`` is [num_roles, d_model] (zero-initialised: a row stays
      near 0 until tokens of that role carry gradient).

  Returns:
    {tree name: {"SYSTEM": norm, "USER": ..., "ACT": ..., "REHEARSE": ..., "OBSERVATION": ...}}; a tree without
    ``role_embed`` is left out.

  Raises:
    ValueError: a ``role_embed`` that is not two-dimensional.
  """
  out = {}
  for name, tree in split_trees(params).items():
    if not isinstance(tree, Mapping) or "role_embed" not in tree:
      continue
    table = np.asarray(tree["role_embed"]).astype(np.float64)
    if table.ndim != 2:
      raise ValueError(f"{name}/role_embed has shape {table.shape}; expected [num_roles, d_model]")
    out[name] = {role: l2_norm(row) for role, row in zip(role_names(table.shape[0]), table, strict=True)}
  return out


def optimizer_steps(opt_state: Any) -> dict[str, int | None]:
  """The optimizer's update count per tree: the largest ``count`` in its state (AdamW's, after
  ``clip_by_global_norm``), or None when the state has no count. A role's own tree that had no trained token in a
  step is not stepped, so its count can be below the run's step."""
  out = {}
  for name, tree in split_trees(opt_state).items():
    counts = [int(np.asarray(leaf)) for path, leaf in _flatten(tree) if path.rsplit("/", 1)[-1] == "count"]
    out[name] = max(counts) if counts else None
  return out


def _time(seconds: Any) -> str | None:
  if not isinstance(seconds, int | float) or not math.isfinite(seconds):
    return None
  return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _describe(ckpt: Checkpointer, workdir: str, step: int) -> dict[str, Any]:
  meta = ckpt.read_meta(step)
  restored = ckpt.restore(step)
  opt_leaves = [np.asarray(leaf) for _, leaf in _flatten(restored.opt_state)]
  config = restored.config.to_dict()
  return {
    "workdir": workdir,
    "step": restored.step,
    "saved_at": _time(meta.get("time")),
    "versions": meta.get("versions") or {},
    "config": config,
    "mode": (config.get("grpo") or {}).get("mode"),
    "trees": list(split_trees(restored.params)),
    "params": param_table(restored.params),
    "role_embedding_norms": role_embedding_norms(restored.params),
    "optimizer_steps": optimizer_steps(restored.opt_state),
    "optimizer_state": {
      "arrays": len(opt_leaves),
      "values": int(sum(a.size for a in opt_leaves)),
      "bytes": int(sum(a.nbytes for a in opt_leaves)),
    },
    "data_state": restored.data_state,
    "rng_impl": (meta.get("rng") or {}).get("impl"),
    "metrics": dict(restored.metrics),
  }


def describe_checkpoints(workdir: str | os.PathLike, steps: Sequence[int] | None = None) -> list[dict[str, Any]]:
  """``describe_checkpoint`` of several steps, opening the checkpoints once.

  Args:
    workdir: as for ``resolve_workdir``.
    steps: the steps to describe; None: every saved step (or the one step ``workdir`` names).

  Raises:
    CheckpointError: as for ``checkpoint_steps``, or a requested step that was not saved.
  """
  saved = checkpoint_steps(workdir)
  workdir, _ = resolve_workdir(workdir)
  wanted = saved if steps is None else [int(s) for s in steps]
  missing = [s for s in wanted if s not in saved]
  if missing:
    raise CheckpointError(f"no checkpoint of step {missing[0]} in {workdir}; saved steps: {saved}")
  with Checkpointer(workdir, max_to_keep=None, read_only=True) as ckpt:
    return [_describe(ckpt, workdir, step) for step in wanted]


def describe_checkpoint(workdir: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
  """Everything one checkpoint holds, as plain JSON-able values (it restores every array to compute the norms).

  Args:
    workdir: as for ``resolve_workdir``.
    step: the step; None: the latest (or the step ``workdir`` names).

  Returns:
    {"workdir",
     "step": updates done,
     "saved_at": UTC time,
     "versions": {"jax", "orbax"},
     "config": the saved config as a dict,
     "mode": its grpo.mode,
     "trees": the parameter trees' names ("policy", or "act" and "rehearse"),
     "params": ``param_table``,
     "role_embedding_norms": ``role_embedding_norms``,
     "optimizer_steps": ``optimizer_steps``,
     "optimizer_state": {"arrays", "values", "bytes"},
     "data_state": the data position (``TaskStream.state()``) or None,
     "rng_impl": the RNG key's implementation,
     "metrics": the scalars saved with the step}.

  Raises:
    CheckpointError: as for ``checkpoint_steps``, or ``step`` was not saved.
  """
  if step is None:
    step = checkpoint_steps(workdir)[-1]
  (description,) = describe_checkpoints(workdir, [step])
  return description


# ---------------------------------------------------------------------------------------------------------------------
# The run's logs


def read_eval_jsonl(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """Every held-out evaluation of a training run (``workdir/eval.jsonl``; [] when there is none), oldest first."""
  return metrics_lib.read_jsonl(workdir, EVAL_JSONL)


def metric_series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps: int64[N], values: float64[N]) of ``key`` over the records that logged it (``metrics.read_jsonl``)."""
  rows = [(r["step"], r[key]) for r in records if key in r]
  steps = np.asarray([s for s, _ in rows], np.int64)
  return steps, np.asarray([v for _, v in rows], np.float64)


def metrics_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """{"steps": how many steps were logged, "first_step", "last_step", "last": the last step's record} (the
  first three are 0, None, None and "last" is {} when nothing was logged)."""
  if not records:
    return {"steps": 0, "first_step": None, "last_step": None, "last": {}}
  return {
    "steps": len(records),
    "first_step": records[0]["step"],
    "last_step": records[-1]["step"],
    "last": dict(records[-1]),
  }


def _number(value: Any) -> str:
  if isinstance(value, bool) or not isinstance(value, int | float):
    return str(value)
  return f"{value:.4g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1, indent: str = "  ") -> list[str]:
  """Text columns: the first ``left`` left-aligned (names), the rest right-aligned (numbers)."""
  widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]

  def line(cells):
    return (
      indent
      + "  ".join(
        str(c).ljust(w) if i < left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
      ).rstrip()
    )

  return [line(header)] + [line(r) for r in rows]


def metrics_table(records: Sequence[Mapping[str, Any]], keys: Sequence[str] = MAIN_METRICS, max_rows: int = 12) -> str:
  """The ``keys`` the run logged (of ``records``, from ``metrics.read_jsonl``), one row per step: the last
  ``max_rows`` steps. "" when nothing was logged."""
  if not records:
    return ""
  keys = [k for k in keys if any(k in r for r in records)]
  shown = list(records[-max_rows:])
  rows = [[str(r["step"])] + [_number(r[k]) if k in r else "-" for k in keys] for r in shown]
  lines = _table(["step", *keys], rows)
  if len(shown) < len(records):
    lines.insert(1, f"  ... ({len(records) - len(shown)} earlier steps not shown)")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# The report


def _flat_config(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
  out = []
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping) and value:
      out.extend(_flat_config(value, name + "."))
    else:
      out.append((name, value))
  return out


def format_config(config: Mapping[str, Any]) -> str:
  """The config as ``dotted.key = value`` lines, in the saved order."""
  return "\n".join(f"  {k} = {v!r}" for k, v in _flat_config(config))


def format_params(table: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
  """``param_table``'s rows as text, one line per array; several trees with the same arrays side by side (a norm
  column per tree), otherwise one block per tree."""
  names = list(table)
  layouts = {name: [(r["path"], r["shape"], r["dtype"]) for r in table[name]] for name in names}
  lines = []
  if all(layouts[n] == layouts[names[0]] for n in names):
    totals = [f"{n}: global L2 norm {math.sqrt(sum(r['norm'] ** 2 for r in table[n])):.6g}" for n in names]
    count = sum(r["size"] for r in table[names[0]])
    lines.append(f"parameters: {len(table[names[0]])} arrays, {count:,} values per tree; " + "; ".join(totals))
    rows = [
      [path, f"{dtype}[{', '.join(map(str, shape))}]"] + [f"{table[n][i]['norm']:.6g}" for n in names]
      for i, (path, shape, dtype) in enumerate(layouts[names[0]])
    ]
    header = ["path", "dtype[shape]"] + [f"L2 norm ({n})" if len(names) > 1 else "L2 norm" for n in names]
    lines.extend(_table(header, rows, left=2))
    return "\n".join(lines)
  return "\n".join(format_params({n: table[n]}) for n in names)


def format_role_norms(norms: Mapping[str, Mapping[str, float]]) -> str:
  """``role_embedding_norms`` as a table: a row per role, a column per tree."""
  if not norms:
    return "  (no role_embed parameter)"
  names = list(norms)
  roles = list(norms[names[0]])
  rows = [[role] + [f"{norms[n].get(role, float('nan')):.6g}" for n in names] for role in roles]
  return "\n".join(_table(["role", *names], rows))


def format_step(description: Mapping[str, Any], show_config: bool = True) -> str:
  """One ``describe_checkpoint`` result as text."""
  d = description
  lines = [
    f"== step {d['step']} (saved {d['saved_at'] or '?'}; "
    + ", ".join(f"{k} {v}" for k, v in d["versions"].items())
    + ") =="
  ]
  if show_config:
    lines += ["config:", format_config(d["config"])]
  steps = d["optimizer_steps"]
  shown = ", ".join(f"{n} {s}" for n, s in steps.items()) if len(steps) > 1 else str(next(iter(steps.values())))
  lines.append(f"optimizer step (AdamW count): {shown}; updates done (checkpoint step): {d['step']}")
  o = d["optimizer_state"]
  lines.append(f"optimizer state: {o['arrays']} arrays, {o['values']:,} values, {o['bytes'] / 2**20:.1f} MiB")
  if d["data_state"]:
    ds = d["data_state"]
    lines.append("data position: " + ", ".join(f"{k} {v}" for k, v in ds.items()))
  lines.append(format_params(d["params"]))
  lines.append("role embeddings (role_embed rows), L2 norm per role:")
  lines.append(format_role_norms(d["role_embedding_norms"]))
  if d["metrics"]:
    lines.append("scalars saved with the step:")
    main = [k for k in MAIN_METRICS if k in d["metrics"]]
    lines.append("  " + ", ".join(f"{k} {_number(d['metrics'][k])}" for k in main or sorted(d["metrics"])))
  return "\n".join(lines)


def format_report(
  descriptions: Sequence[Mapping[str, Any]],
  records: Sequence[Mapping[str, Any]] = (),
  eval_records: Sequence[Mapping[str, Any]] = (),
) -> str:
  """The whole report: each step (``describe_checkpoints``; the config once when every step has the same), the
  table of ``metrics_table(records)`` and the last held-out evaluation of ``eval_records``."""
  if not descriptions:
    return "no checkpoint described"
  first = descriptions[0]
  same_config = all(d["config"] == first["config"] for d in descriptions)
  lines = [f"{first['workdir']}: checkpoints of steps {[d['step'] for d in descriptions]}, mode {first['mode']}"]
  if same_config:
    lines += ["config (saved with the checkpoints):", format_config(first["config"])]
  for d in descriptions:
    lines += ["", format_step(d, show_config=not same_config)]
  lines.append("")
  if records:
    summary = metrics_summary(records)
    lines.append(f"metrics.jsonl: {summary['steps']} steps logged ({summary['first_step']}..{summary['last_step']})")
    lines.append(metrics_table(records))
  else:
    lines.append("metrics.jsonl: nothing logged")
  if eval_records:
    last = eval_records[-1]
    lines.append(f"held-out evaluation after step {last['step']} (eval.jsonl):")
    lines.append("  " + ", ".join(f"{k} {_number(v)}" for k, v in last.items() if k != "step"))
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m envace_jax.inspect_checkpoint DIR [--step N] [--json]``; returns the exit status (1 on a
  CheckpointError, whose message is printed on stderr)."""
  parser = argparse.ArgumentParser(
    prog="python -m envace_jax.inspect_checkpoint",
    description="Print what a training run's checkpoints hold: config, parameters, role embeddings, metrics.",
  )
  parser.add_argument("workdir", help="a training --workdir (or its checkpoints/ folder, or one step's folder)")
  parser.add_argument("--step", type=int, default=None, help="describe only this step (default: every saved step)")
  parser.add_argument("--json", action="store_true", help="print JSON instead of text")
  args = parser.parse_args(argv)

  from absl import logging

  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  try:
    workdir, _ = resolve_workdir(args.workdir)
    descriptions = describe_checkpoints(args.workdir, None if args.step is None else [args.step])
  except CheckpointError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  finally:
    logging.set_verbosity(verbosity)
  records = metrics_lib.read_jsonl(workdir)
  eval_records = read_eval_jsonl(workdir)
  try:
    _print(args.json, workdir, descriptions, records, eval_records)
  except BrokenPipeError:  # `... | head`: the reader left; say nothing more
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  return 0


def _print(as_json: bool, workdir: str, descriptions, records, eval_records) -> None:
  if as_json:
    out = {
      "workdir": workdir,
      "checkpoints": descriptions,
      "metrics": metrics_summary(records),
      "eval": eval_records[-1] if eval_records else None,
    }
    print(json.dumps(metrics_lib.to_json_safe(out), indent=1, allow_nan=False))
  else:
    print(format_report(descriptions, records, eval_records))


if __name__ == "__main__":
  sys.exit(main())
