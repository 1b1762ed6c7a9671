"""envace_jax.inspect_checkpoint: what it reports equals what the checkpoint holds (shapes, dtypes, norms, role
embeddings, optimizer step, config), for a shared tree and per_role's two trees; clear errors for a workdir without
checkpoints."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from envace_jax import inspect_checkpoint as ckpt_inspect
from envace_jax import metrics
from envace_jax.checkpoint import Checkpointer, CheckpointError
from envace_jax.model import config as model_config_lib
from envace_jax.model import transformer
from envace_jax.model.roles import Role
from envace_jax.rl import grpo
from tests.test_checkpoint import _config, _params, _trained_state
from tests.test_train import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _leaves(tree):
  """{"layers/attn/q_proj": array} of a parameter tree (dict keys joined with "/")."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {"/".join(str(k.key) for k in path): np.asarray(leaf) for path, leaf in flat}


def _check_against_restored(description, restored_params):
  """Every reported row (shape, dtype, norm) and role-embedding norm equals numpy's on the restored arrays (layers
  saved apart are reported stacked)."""
  trees = ckpt_inspect.split_trees(transformer.stack_tree(restored_params))
  assert list(description["params"]) == list(trees)
  for name, tree in trees.items():
    leaves = _leaves(tree)
    rows = description["params"][name]
    assert [r["path"] for r in rows] == sorted(leaves)
    for row in rows:
      leaf = leaves[row["path"]]
      assert row["shape"] == list(leaf.shape) and row["dtype"] == str(leaf.dtype) and row["size"] == leaf.size
      np.testing.assert_allclose(row["norm"], np.linalg.norm(leaf.astype(np.float64).ravel()), rtol=1e-12)
    if "role_embed" in tree:
      table = np.asarray(tree["role_embed"], np.float64)
      expected = {Role(i).name: float(np.linalg.norm(table[i])) for i in range(table.shape[0])}
      assert description["role_embedding_norms"][name].keys() == expected.keys()
      np.testing.assert_allclose(
        list(description["role_embedding_norms"][name].values()), list(expected.values()), rtol=1e-12
      )


def _printed_norms(text, path):
  """The norms on the report's line for ``path`` (a line per array: path, dtype[shape], a norm per tree)."""
  (line,) = [x for x in text.splitlines() if x.split() and x.split()[0] == path]
  return [float(v) for v in line.split("]", 1)[1].split()]


# -- errors ------------------------------------------------------------------------------------------------------------


def test_missing_or_empty_workdirs_fail_clearly_and_create_nothing(tmp_path, capsys):
  missing = tmp_path / "nope"
  empty = tmp_path / "empty"
  empty.mkdir()
  no_saves = tmp_path / "no_saves"
  (no_saves / "checkpoints").mkdir(parents=True)
  cases = [
    (missing, "does not exist. Pass a training --workdir"),
    (empty, "holds no checkpoints/ folder, so no checkpoint"),
    (no_saves, "holds no finished checkpoint"),
  ]
  for path, message in cases:
    with pytest.raises(CheckpointError, match=message):
      ckpt_inspect.describe_checkpoints(path)
    assert ckpt_inspect.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
  assert not missing.exists() and os.listdir(empty) == []  # inspecting creates no folder

  # A run that logged steps but has not saved yet is told so.
  with metrics.MetricsWriter(empty, tensorboard=False, progress=False) as writer:
    writer.write(1, {"reward/mean": 0.5})
  with pytest.raises(CheckpointError, match="logs 1 steps: the run has not saved a checkpoint yet"):
    ckpt_inspect.checkpoint_steps(empty)


# -- synthetic checkpoints (fast) --------------------------------------------------------------------------------------


def test_shared_tree_with_bfloat16_and_no_role_embed(tmp_path, capsys):
  """test_checkpoint's tree: a bfloat16 leaf (norm accumulated in float64) and no ``role_embed`` parameter."""
  params, opt_state = jax.jit(_trained_state, static_argnames="steps")(_params(jax.random.key(0)), steps=3)
  with Checkpointer(tmp_path, config=_config()) as ckpt:
    ckpt.save(3, params=params, opt_state=opt_state, rng=jax.random.key(1), metrics={"reward/mean": 0.75})
  d = ckpt_inspect.describe_checkpoint(tmp_path)
  _check_against_restored(d, params)
  assert d["step"] == 3 and d["optimizer_steps"] == {"policy": 3} and d["trees"] == ["policy"]
  assert d["role_embedding_norms"] == {} and d["metrics"] == {"reward/mean": 0.75}
  assert d["config"] == _config().to_dict()
  rows = {r["path"]: r for r in d["params"]["policy"]}
  assert rows["layers/norm/scale"]["dtype"] == "bfloat16" and rows["layers/norm/scale"]["norm"] > 0

  assert ckpt_inspect.main([str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "(no role_embed parameter)" in out and "optimizer step (AdamW count): 3" in out
  (norm,) = _printed_norms(out, "layers/norm/scale")
  np.testing.assert_allclose(norm, rows["layers/norm/scale"]["norm"], rtol=1e-5)


def _per_role_state():
  """grpo's per_role state of the tiny preset after AdamW steps: the ACT tree stepped twice, the REHEARSE tree once,
  role-embedding gradients that differ per role (jit this: eager op-by-op takes seconds)."""
  cfg = grpo.GrpoConfig.from_config(mode="per_role", learning_rate=1e-2)
  params = transformer.init_params(model_config_lib.get_model_config("tiny", scan_layers=True), jax.random.key(0))
  state = grpo.init_train_state(cfg, params)
  opt = grpo.make_optimizer(cfg)
  new_params, new_opt = dict(state.params), dict(state.opt_state)
  for name, updates in (("act", 2), ("rehearse", 1)):
    for i in range(updates):
      grads = jax.tree.map(lambda p, s=i + 1: jnp.sin(p * s + 1.0), new_params[name])
      # Adam's step is about lr per coordinate whatever the gradient's scale: row r has 4r + 1 nonzero coordinates.
      roles, width = grads["role_embed"].shape
      grads["role_embed"] = (jnp.arange(width)[None, :] <= 4 * jnp.arange(roles)[:, None]).astype(jnp.float32)
      step, new_opt[name] = opt.update(grads, new_opt[name], new_params[name])
      new_params[name] = optax.apply_updates(new_params[name], step)
  return new_params, new_opt


def test_per_role_checkpoint_reports_both_trees(tmp_path, capsys):
  """grpo's own per_role state (``_per_role_state``): two trees side by side, per-tree optimizer steps."""
  new_params, new_opt = jax.jit(_per_role_state)()
  config = tiny_config(tmp_path / "tfds", **{"grpo.mode": "per_role"})
  with Checkpointer(tmp_path, config=config) as ckpt:
    ckpt.save(2, params=new_params, opt_state=new_opt, rng=jax.random.key(0))

  d = ckpt_inspect.describe_checkpoint(tmp_path / "checkpoints" / "2")  # a step's folder works too
  _check_against_restored(d, new_params)
  assert d["mode"] == "per_role" and d["trees"] == ["act", "rehearse"]
  assert d["optimizer_steps"] == {"act": 2, "rehearse": 1}
  assert d["config"] == json.loads(config.to_json_best_effort())
  act_norms = list(d["role_embedding_norms"]["act"].values())
  assert list(d["role_embedding_norms"]["act"]) == [r.name for r in Role] and len(set(act_norms)) == len(Role)

  assert ckpt_inspect.main([str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "optimizer step (AdamW count): act 2, rehearse 1" in out
  for name in ("act", "rehearse"):
    assert f"L2 norm ({name})" in out
  for path in ("role_embed", "layers/attn/q_proj", "embed"):
    rows = [{r["path"]: r for r in d["params"][n]}[path]["norm"] for n in ("act", "rehearse")]
    np.testing.assert_allclose(_printed_norms(out, path), rows, rtol=1e-5)
  role_line = next(x for x in out.splitlines() if x.split()[:1] == ["ACT"])
  np.testing.assert_allclose(
    [float(v) for v in role_line.split()[1:]],
    [d["role_embedding_norms"][n]["ACT"] for n in ("act", "rehearse")],
    rtol=1e-5,
  )


# -- a real tiny run (slow) --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_run_report_matches_the_restored_checkpoint(tiny_run, capsys):
  workdir, config = tiny_run
  descriptions = ckpt_inspect.describe_checkpoints(workdir)
  assert [d["step"] for d in descriptions] == [1, 2]
  for d in descriptions:
    with Checkpointer(workdir) as ckpt:
      restored = ckpt.restore(d["step"])
    _check_against_restored(d, restored.params)
    assert d["optimizer_steps"] == {"policy": d["step"]}  # every step trained ACT tokens
    assert d["config"] == json.loads(config.to_json_best_effort())
    assert d["mode"] == "envace" and d["data_state"]["position"] == d["step"]
    (row,) = [r for r in d["params"]["policy"] if r["path"] == "role_embed"]
    assert row["shape"] == [len(Role), model_config_lib.get_model_config("tiny").d_model] and row["dtype"] == "float32"
  records = metrics.read_jsonl(workdir)
  assert descriptions[-1]["metrics"]["reward/mean"] == records[-1]["reward/mean"]
  steps, rewards = ckpt_inspect.metric_series(records, "reward/mean")
  assert steps.tolist() == [1, 2] and rewards.tolist() == [r["reward/mean"] for r in records]

  # The command line: one process, no config file, no log spam; the text and the JSON carry the same values.
  proc = subprocess.run(
    [sys.executable, "-m", "envace_jax.inspect_checkpoint", str(workdir)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr
  assert "Traceback" not in proc.stderr and "I1" not in proc.stderr  # absl INFO lines start with I<date>
  out = proc.stdout
  assert "checkpoints of steps [1, 2], mode envace" in out and "  model = 'tiny'" in out
  assert out.count("== step ") == 2 and "metrics.jsonl: 2 steps logged (1..2)" in out
  last = out.split("== step 2")[1]
  for row in descriptions[-1]["params"]["policy"]:
    (norm,) = _printed_norms(last, row["path"])
    np.testing.assert_allclose(norm, row["norm"], rtol=1e-5)
  for role in Role:
    line = next(x for x in last.splitlines() if x.split()[:1] == [role.name])
    np.testing.assert_allclose(float(line.split()[1]), descriptions[-1]["role_embedding_norms"]["policy"][role.name])
  table = out.split("metrics.jsonl:")[1].splitlines()[1:]  # after "2 steps logged": the header, then a row per step
  assert table[0].split()[:2] == ["step", "reward/mean"]
  table_row = next(x for x in table if x.split()[:1] == ["2"])
  assert f"{records[-1]['reward/mean']:.4g}" == table_row.split()[1]

  assert ckpt_inspect.main([str(workdir), "--step", "2", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["checkpoints"] == [metrics.to_json_safe(descriptions[-1])]
  assert report["metrics"]["steps"] == 2 and report["metrics"]["last"]["step"] == 2 and report["eval"] is None
