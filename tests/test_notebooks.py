"""Every notebook in notebooks/ runs top to bottom in a fresh kernel of this environment, at its smallest settings.

Convention: with ``ENVACE_NOTEBOOK_SMALL=1`` a notebook picks its smallest settings (a tiny model, few steps), so the
whole notebook runs in minutes on 2 CPU cores. The kernel is ipykernel's ``python3`` in this environment (the
kernelspec ``pip install ipykernel`` puts under ``sys.prefix``; jupyter_client starts its ``python`` as
``sys.executable``), started in the notebook's folder as Jupyter does.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 1200  # one cell; the quickstart's training cell is the longest
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _kernel_env(tmp_dir: pathlib.Path) -> dict[str, str]:
  """This process's environment with ENVACE_NOTEBOOK_SMALL=1 and TMPDIR=tmp_dir (a notebook's temporary runs land in
  pytest's tmp_path, which pytest prunes), without the 8 fake CPU devices tests/conftest.py asks XLA for: the
  notebook sees the machine as a user's kernel would."""
  env = dict(os.environ, ENVACE_NOTEBOOK_SMALL="1", TMPDIR=str(tmp_dir))
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  return env


def _failure(path: pathlib.Path, nb, offset: int) -> str:
  """The first cell with an error output (numbered from 1 among the notebook's own cells, markdown included): its
  source and the error without terminal colours."""
  for index, cell in enumerate(nb.cells):
    for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
      if output.output_type == "error":
        trace = _ANSI.sub("", "\n".join(output.get("traceback", [])))
        return (
          f"{path.name}: cell {index - offset + 1} of {len(nb.cells) - offset} failed\n"
          f"--- source ---\n{cell.source}\n--- error ---\n"
          f"{output.ename}: {output.evalue}\n{trace}"
        )
  return f"{path.name}: the kernel failed outside a cell"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  # First, a cell of ours: the kernel is this environment's Python (not another kernelspec named python3).
  check = nbformat.v4.new_code_cell(
    f"import sys\nassert sys.prefix == {sys.prefix!r}, f'the python3 kernel runs {{sys.executable}}, not this venv'"
  )
  nb.cells.insert(0, check)
  client = nbclient.NotebookClient(
    nb,
    kernel_name="python3",
    timeout=CELL_TIMEOUT_S,
    resources={"metadata": {"path": str(path.parent)}},  # the kernel's working directory
  )
  failure = None
  try:
    client.execute(env=_kernel_env(tmp_path))
  except nbclient.exceptions.CellExecutionError:
    failure = _failure(path, nb, offset=1)
  except nbclient.exceptions.CellTimeoutError as e:
    failure = f"{path.name}: a cell ran past {CELL_TIMEOUT_S} s: {e}"
  if failure:  # outside the except: the report is the cell and its error, not nbclient's chained traceback
    pytest.fail(failure, pytrace=False)
