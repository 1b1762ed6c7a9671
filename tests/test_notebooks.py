"""Every notebook in notebooks/ runs top to bottom in a fresh kernel of this environment, at its smallest settings, and
shows values that an independent computation in this process reproduces.

Convention: with ``ENVACE_NOTEBOOK_SMALL=1`` a notebook picks its smallest settings (a tiny model, few steps), so the
whole notebook runs in minutes on 2 CPU cores. The kernel is ipykernel's ``python3`` in this environment (the
kernelspec ``pip install ipykernel`` puts under ``sys.prefix``; jupyter_client starts its ``python`` as
``sys.executable``), started in the notebook's folder as Jupyter does.

Each notebook has a check here (``CHECKS``) that reads values from the executed notebook's printed outputs and compares
them with what this process computes from the notebook's inputs or artifacts: the shapes of a preset, a checkpoint
restored here, a reward recomputed by the benchmark's evaluator from the conversation the notebook shows. The
inspect_checkpoint notebook is given the suite's tiny run (``ENVACE_NOTEBOOK_WORKDIR``: the same config its first
cell would train, tests/conftest.py's ``tiny_run``), so the suite trains it once.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import pathlib
import pickle
import re
import sys

import jax
import nbclient
import nbformat
import numpy as np
import pytest

from envace_jax import metrics
from envace_jax.checkpoint import Checkpointer
from envace_jax.envs import tau2
from envace_jax.model import config as config_lib
from envace_jax.model import transformer
from envace_jax.rl import rewards
from tests.test_train import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 1200  # one cell; the quickstart's training cell is the longest
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_OURS = "envace_test"  # metadata key of the cells this test inserts


def _kernel_env(tmp_dir: pathlib.Path, extra: dict[str, str]) -> dict[str, str]:
  """This process's environment with ENVACE_NOTEBOOK_SMALL=1, TMPDIR=tmp_dir (a notebook's temporary runs land in
  pytest's tmp_path, which pytest prunes) and ``extra``, without the 8 fake CPU devices tests/conftest.py asks XLA
  for: the notebook sees the machine as a user's kernel would.

  The kernel keeps the suite's other XLA settings (tests/conftest.py: optimisation level 0, the legacy fusion
  emitters, Eigen on one thread) and the compilation cache's folder. With ENVACE_NOTEBOOK_SMALL=1 the notebooks
  compile only the tiny model's programs, which those settings compile fastest (the quickstart's cells 66 s with
  XLA's default emitters, 52 s with the legacy ones, 2026-12-07); XLA_FLAGS is part of a program's cache key, the
  device count is not. No value a notebook shows depends on these settings (the random model's text may differ)."""
  env = dict(os.environ, ENVACE_NOTEBOOK_SMALL="1", TMPDIR=str(tmp_dir), **extra)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = " ".join(flags.split())
  return env


def _failure(path: pathlib.Path, nb) -> str:
  """The first cell with an error output (numbered from 1 among the notebook's own cells, markdown included): its
  source and the error without terminal colours."""
  own = [id(cell) for cell in nb.cells if not cell.metadata.get(_OURS)]
  for cell in nb.cells:
    for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
      if output.output_type == "error":
        trace = _ANSI.sub("", "\n".join(output.get("traceback", [])))
        where = f"cell {own.index(id(cell)) + 1} of {len(own)}" if id(cell) in own else "a cell of this test"
        return (
          f"{path.name}: {where} failed\n--- source ---\n{cell.source}\n--- error ---\n"
          f"{output.ename}: {output.evalue}\n{trace}"
        )
  return f"{path.name}: the kernel failed outside a cell"


def _our_cell(source: str):
  cell = nbformat.v4.new_code_cell(source)
  cell.metadata[_OURS] = True
  return cell


def _execute(path: pathlib.Path, tmp_path: pathlib.Path, before: dict[str, str], env: dict[str, str]):
  """The notebook executed in a fresh kernel (``env``: variables for it), with a first cell of ours (the kernel is
  this environment's Python) and ``before``'s cells: {marker: source} puts ``source`` right before the first cell
  whose source contains marker."""
  nb = nbformat.read(path, as_version=4)
  for marker, source in before.items():
    index = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and marker in c.source)
    nb.cells.insert(index, _our_cell(source))
  check = f"import sys\nassert sys.prefix == {sys.prefix!r}, f'the kernel runs {{sys.executable}}, not this venv'"
  nb.cells.insert(0, _our_cell(check))
  client = nbclient.NotebookClient(
    nb,
    kernel_name="python3",
    timeout=CELL_TIMEOUT_S,
    resources={"metadata": {"path": str(path.parent)}},  # the kernel's working directory
  )
  failure = None
  try:
    client.execute(env=_kernel_env(tmp_path, env))
  except nbclient.exceptions.CellExecutionError:
    failure = _failure(path, nb)
  except nbclient.exceptions.CellTimeoutError as e:
    failure = f"{path.name}: a cell ran past {CELL_TIMEOUT_S} s: {e}"
  if failure:  # outside the except: the report is the cell and its error, not nbclient's chained traceback
    pytest.fail(failure, pytrace=False)
  return nb


def _printed(nb, marker: str) -> str:
  """What the first code cell whose source contains ``marker`` printed (stdout)."""
  cell = next(c for c in nb.cells if c.cell_type == "code" and marker in c.source and not c.metadata.get(_OURS))
  return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _after(text: str, prefix: str) -> str:
  """The rest of the first line of ``text`` that starts with ``prefix``."""
  return next(line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix))


def _shapes(config: config_lib.ModelConfig) -> dict[str, tuple[int, ...]]:
  """{"layers/attn/q_proj": shape, ...} of a freshly initialised model of ``config``, without computing it."""
  tree = jax.eval_shape(functools.partial(transformer.init_params, config), jax.random.key(0))
  return {"/".join(k.key for k in path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


# -- quickstart --------------------------------------------------------------------------------------------------------

_QUICKSTART_DUMP = """import pickle
with open({path!r}, "wb") as f:  # the inputs of what the test recomputes (a cell of tests/test_notebooks.py)
  pickle.dump({{
    "S": vars(S), "workroot": str(WORKROOT), "task": task,
    "demo_messages": list(trajectory.messages), "demo_malformed": trajectory.counts.get("malformed_act", 0),
    "committed_messages": list(committed.messages),
  }}, f)
"""


def _check_quickstart(nb, facts: dict) -> None:
  sizes = facts["S"]  # the notebook's S: its settings under ENVACE_NOTEBOOK_SMALL=1
  # Section 2: the model's size, as the preset's shapes give it. ENVACE_NOTEBOOK_SMALL=1: configs/tiny.py's random
  # tiny model over SmolLM2's vocabulary (the SmolLM2 sections' code, without compiling SmolLM2's 30-layer programs:
  # the test took 143 s with SmolLM2 there, 2026-12-07).
  assert sizes["demo_model"] == "tiny"
  loaded = _printed(nb, "model = runtime.load_model(demo_config)")
  preset = config_lib.get_model_config("tiny", vocab_size=49152)
  count = sum(math.prod(shape) for shape in _shapes(preset).values())
  assert loaded.splitlines()[0] == "random init (seed 0)"
  want = f"{count / 1e6:.1f}M parameters, {preset.num_layers} layers, d_model {preset.d_model}, "
  want += f"vocab {preset.vocab_size}, context {preset.max_seq_len}; loaded in "
  assert want in loaded, loaded

  # Section 3: the rule-checklist reward of the trajectory shown, recomputed from its conversation.
  unfolded = _printed(nb, "out = unfold([task], sampler")
  # configs/tiny.py, which sections 2-3 run under ENVACE_NOTEBOOK_SMALL=1: its reward settings.
  task, config = facts["task"], tiny_config(pathlib.Path(facts["workroot"]) / "tfds")
  rule = rewards.RuleChecklistConfig.from_config(config)
  reward = rewards.rule_checklist(task, facts["demo_messages"], facts["demo_malformed"], config=rule)
  assert f"rule-checklist reward {reward.reward:.2f}\n" in unfolded, unfolded
  assert ast.literal_eval(_after(unfolded, "reward items: ")) == dict(reward.breakdown)
  assert _after(unfolded, "9 mock tasks; this one: ").startswith("create_task_1, gold actions ['create_task']")
  # The model played every role: the user said something, ACT took a turn, and each training row has sampled tokens.
  assert any(m.role == "user" and m.content.strip() for m in facts["demo_messages"])
  assert ast.literal_eval(_after(unfolded, "counts: "))["turns"] >= 1
  rows = ast.literal_eval(_after(unfolded, "training rows: "))
  assert "ACT" in rows and all(int(re.fullmatch(r"\d+ tokens, (\d+) sampled", v)[1]) > 0 for v in rows.values()), rows

  # Section 4: one line per training step.
  trained = _printed(nb, "trainer = train.Trainer(train_config")
  assert re.findall(r"^step (\d+): reward", trained, re.M) == [str(s) for s in range(1, sizes["steps"] + 1)]
  shape = f"{sizes['steps']} steps of {sizes['tasks_per_step']} task(s) x G={sizes['group']} rollouts with "
  assert sizes["train_model"] == "tiny"  # ENVACE_NOTEBOOK_SMALL=1: the random tiny model of configs/tiny.py trains
  assert _after(trained, shape).startswith("random init (seed 0) in "), trained

  # Section 5: N rehearsals, a memory within its bound, and the committed run's τ² reward, recomputed by τ²-bench's
  # evaluator on a fresh mock environment from the conversation the notebook shows.
  assert f"private rehearsal (N={sizes['rehearsal_n']}, parallel)" in _printed(nb, "private_run = private.run(")
  rehearsed = _printed(nb, "private.transcript(prepared.opening)")
  assert re.findall(r"^--- rehearsal (\d+) ", rehearsed, re.M) == [str(i) for i in range(1, sizes["rehearsal_n"] + 1)]
  (memory_tokens,) = re.findall(r"^=== rehearsal memory \((\d+) tokens\) ===$", rehearsed, re.M)
  assert 0 < int(memory_tokens) <= sizes["memory"]
  env = tau2.Tau2Env("mock")
  env.reset(task)
  real = env.evaluate(facts["committed_messages"])
  calls = sum(m.role == "tool" for m in facts["committed_messages"])
  committed = _printed(nb, "act_row = committed.rows")
  want = f"{calls} real tool call(s); τ²-bench reward {real.reward:.2f} (valid: {real.valid}) {dict(real.breakdown)}"
  assert want in committed, committed

  # The last cell removes the run's directory.
  assert _printed(nb, "KEEP_WORKDIR = False") == f"{facts['workroot']}: removed\n"
  assert not pathlib.Path(facts["workroot"]).exists()


# -- inspect_checkpoint ------------------------------------------------------------------------------------------------


def _check_inspect_checkpoint(nb, facts: dict) -> None:
  run = _printed(nb, "train.train_and_evaluate(config, WORKDIR)")
  workdir = pathlib.Path(_after(run, "workdir: "))
  assert workdir == facts["workdir"]
  steps = 2  # configs/tiny.py for config.train.steps = 2, a checkpoint after every step
  assert _after(run, "checkpoints of steps: ") == str(list(range(1, steps + 1)))
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]
  with Checkpointer(workdir) as ckpt:  # restored here, independently of the notebook's kernel
    restored = ckpt.restore()
  assert restored.step == steps
  assert _after(_printed(nb, "restored = ckpt.restore()"), "step (updates done): ") == str(steps)

  # The parameter table: every array of the tiny model over SmolLM2's vocabulary, its norm recomputed here.
  shapes = _shapes(config_lib.get_model_config("tiny", vocab_size=49152))
  stacked = transformer.stack_tree(restored.params)  # saved with the layers apart, as the train state holds them
  arrays = {"/".join(k.key for k in p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(stacked)}
  assert {path: a.shape for path, a in arrays.items()} == shapes
  table = _printed(nb, "ckpt_inspect.param_table(restored.params)")
  count = sum(math.prod(s) for s in shapes.values())
  norm = math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays.values()))
  head = re.fullmatch(r"parameters: (\d+) arrays, ([\d,]+) values per tree; policy: global L2 norm ([\d.e+-]+)",
                      table.splitlines()[0])  # fmt: skip
  assert head, table.splitlines()[0]
  assert (int(head[1]), int(head[2].replace(",", ""))) == (len(shapes), count)
  np.testing.assert_allclose(float(head[3]), norm, rtol=1e-5)
  rows = {m[1]: (m[2], float(m[3])) for m in re.finditer(r"^  (\S+) +(\w+\[[\d, ]*\]) +(\S+)$", table, re.M)}
  assert set(rows) == set(shapes)
  for path, a in arrays.items():
    assert rows[path][0] == f"float32[{', '.join(map(str, a.shape))}]", path
    np.testing.assert_allclose(rows[path][1], np.linalg.norm(a.astype(np.float64)), rtol=1e-5, err_msg=path)

  # AdamW's count and the metrics table: the restored optimizer state and metrics.jsonl read here.
  counts = [int(np.asarray(x)) for p, x in jax.tree_util.tree_leaves_with_path(restored.opt_state) if "count" in str(p)]
  assert counts and set(counts) == {steps}
  optimizer = _printed(nb, "ckpt_inspect.optimizer_steps(restored.opt_state)")
  assert optimizer == f"optimizer steps: {{'policy': {steps}}}\ncheckpoint step: {steps}\n"
  records = metrics.read_jsonl(workdir)
  lines = _printed(nb, "ckpt_inspect.metrics_table(records)").splitlines()
  assert lines[0].split()[:2] == ["step", "reward/mean"]
  assert [line.split()[:2] for line in lines[1:]] == [[str(r["step"]), f"{r['reward/mean']:.4g}"] for r in records]
  assert [r["step"] for r in records] == [1, 2]


def _inspect_checkpoint_env(request) -> tuple[dict[str, str], dict]:
  """The notebook inspects tests/conftest.py's ``tiny_run`` (ENVACE_NOTEBOOK_WORKDIR), the run its first cell would
  train otherwise (configs/tiny.py, 2 steps, no evaluation): test_inspect_checkpoint.py and the notebook share one
  run."""
  workdir, _ = request.getfixturevalue("tiny_run")
  return {"ENVACE_NOTEBOOK_WORKDIR": str(workdir)}, {"workdir": workdir}


CHECKS = {  # notebook stem: ({marker: cell source with {path}} inserted before the marker, check(nb, facts), env)
  "quickstart": ({"KEEP_WORKDIR = False": _QUICKSTART_DUMP}, _check_quickstart, None),
  "inspect_checkpoint": ({}, _check_inspect_checkpoint, _inspect_checkpoint_env),
}


def test_every_notebook_has_a_check():
  assert sorted(p.stem for p in NOTEBOOKS) == sorted(CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_its_outputs(path):
  """Each notebook is committed executed top to bottom at its default settings (a reader sees what it prints without
  running it; stderr — progress bars, library logs — left out): every code cell numbered in order, no error output,
  output in half the cells or more and in the last; the install cell's one constant REPO_URL; Colab metadata, a GPU
  for the quickstart."""
  nb = json.loads(path.read_text(encoding="utf-8"))
  code = [c for c in nb["cells"] if c["cell_type"] == "code"]
  assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
  outputs = [o for c in code for o in c["outputs"]]
  assert not [o for o in outputs if o["output_type"] == "error" or o.get("name") == "stderr"]
  assert sum(bool(c["outputs"]) for c in code) >= len(code) // 2 and code[-1]["outputs"]
  install = "".join(code[0]["source"])
  assert install.count("REPO_URL = ") == 1 and "ENVACE_REPO_URL" not in install and '".[tau2,bfcl' in install
  assert "colab" in nb["metadata"] and (nb["metadata"].get("accelerator") == "GPU") == (path.stem == "quickstart")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_shows_what_it_computes(path, tmp_path, request):
  inserts, check, make_env = CHECKS[path.stem]
  env, facts = make_env(request) if make_env else ({}, {})
  facts_path = tmp_path / "facts.pickle"
  nb = _execute(path, tmp_path, {marker: src.format(path=str(facts_path)) for marker, src in inserts.items()}, env)
  if inserts:
    with facts_path.open("rb") as f:
      facts.update(pickle.load(f))
  check(nb, facts)
