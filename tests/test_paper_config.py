"""The paper-size config is one place, the ``paper`` preset (envace_jax/config/presets.py:PAPER): configs/tau2.py's
hardware recipes take the paper's values from it (and differ from it only in the keys listed here), and every
paper-size command in README.md and docs/ (the ``--mode=plan`` example included) names it or such a recipe. Nothing
here loads a model."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from envace_jax.config import doc, presets
from tests.test_docs import commands

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The paper's sizes: what `paper` sets beyond the official semantics.
SIZES = {k: v for k, v in presets.PAPER.items() if k not in presets.OFFICIAL}


def _tau2():
  spec = importlib.util.spec_from_file_location("tau2_paper_config", ROOT / "configs" / "tau2.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_paper_preset_holds_the_papers_sizes():
  """The paper: Qwen3-8B, B=16 × G=4, lr 1e-6, 30 turns, 8000 new tokens a generation (every role)."""
  assert {k: SIZES[k] for k in ("model", "train.tasks_per_step", "train.group_size", "grpo.learning_rate")} == {
    "model": "qwen3-8b", "train.tasks_per_step": 16, "train.group_size": 4, "grpo.learning_rate": 1e-6}  # fmt: skip
  assert SIZES["rollout.max_turns"] == 30
  assert [SIZES[f"rollout.{r}_max_new_tokens"] for r in ("act", "rehearse", "user")] == [8000] * 3


# Where each recipe departs from configs/tau2.py:airline+paper: the official semantics (the recipes keep ours), the
# budgets and view capacities its memory plan sized (experiments/results/plan_<recipe>.md), the mesh and micro-batch.
_RECIPE_KEYS = {
  *presets.OFFICIAL,
  "presets",
  "rollout.max_turns",
  *(f"rollout.{r}_{what}" for r in ("act", "rehearse", "user") for what in ("capacity", "max_new_tokens")),
  "mesh.data",
  "mesh.fsdp",
  "grpo.micro_batch_size",
}
DEPARTURES = {
  # a smaller model on one H200 (the defaults' mesh and micro-batch), the B that fits it
  "h200_qwen3_1p7b": (_RECIPE_KEYS - {"mesh.fsdp", "grpo.micro_batch_size"}) | {"model", "train.tasks_per_step"},
  "h200x8_qwen3_8b": _RECIPE_KEYS,
}


@pytest.mark.parametrize("name", sorted(DEPARTURES))
def test_the_recipes_take_the_papers_values_from_the_preset(name):
  tau2 = _tau2()
  paper = doc._flat(tau2.get_config("airline+paper"))
  recipe = doc._flat(tau2.get_config(name))
  assert set(paper) == set(recipe)
  differ = {k for k in paper if paper[k] != recipe[k]}
  # every listed key but the semantics that happen to agree: the recipe keeps our defaults there
  assert differ <= DEPARTURES[name] and DEPARTURES[name] - differ <= set(presets.OFFICIAL), (
    sorted(differ - DEPARTURES[name]),
    sorted(DEPARTURES[name] - differ - set(presets.OFFICIAL)),
  )
  assert set(tau2.RECIPES) == set(DEPARTURES)


def test_every_paper_size_command_shown_names_the_preset_or_a_recipe():
  """A command of README.md or docs/*.md that runs Qwen3-8B names ``+paper`` or a configs/tau2.py recipe (a line of
  the notebooks' text that sets one, too); the ``--mode=plan`` example of docs/hardware.md names ``+paper``."""
  recipes = set(_tau2().RECIPES)
  found, plans = [], []
  for where, _, args in commands():
    spec = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), "")
    if not any("qwen3-8b" in a.lower() for a in args):
      continue
    arg, names = presets.split(spec.partition(":")[2])
    found.append(where)
    assert "paper" in names or arg in recipes, f"{where}: {spec}"
    if where.startswith("docs/hardware.md") and "--mode=plan" in args and "paper" in names:
      plans.append(where)
  assert len(found) >= 6 and plans, (found, plans)
  # The notebooks' text too: a line that sets a Qwen3-8B config names the preset or a recipe.
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    for line in path.read_text(encoding="utf-8").splitlines():
      if "--config" in line and "qwen3-8b" in line.lower():
        assert "+paper" in line or any(f":{r}" in line for r in recipes), f"{path.name}: {line.strip()}"
