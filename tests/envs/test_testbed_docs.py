"""docs/testbed.md's split table is what envs/testbed.py generates (tasks, templates, gold calls, turns per task)."""

from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("bfcl_eval")

from envace_jax.envs import testbed  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "testbed.md"


def _doc_rows() -> dict[tuple[str, str], tuple[int, int, int, str]]:
  text = DOC.read_text(encoding="utf-8")
  table = text.split("<!-- testbed-splits:", 1)[1].split("\n\n", 1)[0]
  rows = {}
  for m in re.finditer(r"^\| (\w+) \| `(\w+)` \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \|$", table, re.M):
    rows[(m[1], m[2])] = (int(m[3]), int(m[4]), int(m[5]), m[6])
  return rows


def test_split_table_matches_the_generator():
  rows = _doc_rows()
  assert set(rows) == {(level, split) for level in testbed.LEVELS for split in testbed.SPLITS}
  for (level, split), row in rows.items():
    tasks = testbed.load_tasks(level, split)
    templates = {tuple(t.criteria["template"]) for t in tasks}
    turns = sum(len(t.user_turns) for t in tasks) / len(tasks)
    got = (len(tasks), len(templates), sum(len(t.gold_actions) for t in tasks), f"{turns:.2f}")
    assert got == row, f"docs/testbed.md {level}/{split}: the table says {row}, the generator gives {got}"
