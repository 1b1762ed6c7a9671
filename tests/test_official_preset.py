"""The `official` preset and docs/departures.md: every setting the departures table names exists in
envace_jax/config/defaults.py, the preset sets it to the official value the table gives, and every config takes the
preset (envace_jax/config/presets.py)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest

from envace_jax import config_check
from envace_jax.config import defaults, presets

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "departures.md"
SETTING = re.compile(r"`([a-z_]+(?:\.[a-z_]+)+)=([^`]*)`")


def _tables() -> list[list[list[str]]]:
  """docs/departures.md's tables whose last column is the setting, as rows of cells (header and rule dropped)."""
  tables, current = [], []
  for line in TABLE.read_text().splitlines() + [""]:
    if line.startswith("|"):
      current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    elif current:
      tables.append(current)
      current = []
  return [t[2:] for t in tables if t[0][-1].lower().startswith("setting")]


def _rows() -> list[list[str]]:
  return [row for table in _tables() for row in table]


def _value(text: str):
  """A table value as Python: a literal where it parses (numbers, True, strings in quotes), else the bare word."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _lookup(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def test_the_table_has_a_row_per_departure_and_names_its_settings():
  tables = _tables()
  assert [len(t) >= 10 for t in tables] == [True, True], [len(t) for t in tables]
  for table in tables:
    for row in table:
      assert len(row) == len(table[0]) and all(row), row
      assert SETTING.search(row[-1]) or row[-1].lower().startswith("none"), row


def test_every_setting_the_table_names_exists_in_the_defaults_and_the_preset_sets_it():
  """A setting the table names is a key of defaults.get_config(); the official value it gives is the `paper`
  preset's (the `official` one's for semantics; budgets are sizes, set by `paper` only), and the `official` preset
  sets nothing the table does not name."""
  config = defaults.get_config()
  named = {}
  for row in _rows():
    for key, value in SETTING.findall(row[-1]):
      named[key] = _value(value)
      _lookup(config, key)  # raises KeyError for a setting that does not exist
  for key, value in named.items():
    assert presets.PAPER.get(key) == value, (key, presets.PAPER.get(key), value)
  assert set(presets.OFFICIAL) <= set(named), sorted(set(presets.OFFICIAL) - set(named))


def _load(name: str):
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", ROOT / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
  "name,arg", [("tau2", "mock+official"), ("bfcl", "official"), ("tiny", "official"), ("testbed", "cpu+official")]
)
def test_every_config_takes_the_preset_and_validates(name, arg):
  config = _load(name).get_config(arg)
  for key, value in presets.OFFICIAL.items():
    assert _lookup(config, key) == value, key
  config_check.validate(config)


def test_the_paper_preset_sets_the_papers_sizes_and_asks_for_the_weights():
  config = _load("tau2").get_config("airline+paper")
  assert (config.model, config.train.tasks_per_step, config.train.group_size) == ("qwen3-8b", 16, 4)
  with pytest.raises(config_check.ConfigError, match="model_path"):
    config_check.validate(config)


@pytest.mark.parametrize(
  "name,arg,unknown",
  [("tau2", "airline+offical", "offical"), ("tiny", "offical", "offical"), ("base", "official+offical+", "offical")],
)
def test_an_unknown_preset_stops_the_run_in_one_line(name, arg, unknown):
  config = _load(name).get_config(arg)
  with pytest.raises(config_check.ConfigError) as err:
    config_check.validate(config)
  assert [p for p in err.value.problems if p.startswith("presets")] == [
    f"presets: unknown preset {unknown!r} (--config=FILE:ARG+PRESET, or FILE:PRESET for a config that takes no ARG); "
    "known: 'official', 'paper'"
  ]


def test_base_and_tiny_take_the_preset_and_record_it():
  for name in ("base", "tiny"):
    config = _load(name).get_config("official")
    assert config.presets == "official" and config.rollout.act_parser == "official", name
  assert _load("tau2").get_config("mock+").presets == "" and _load("tau2").get_config("mock+paper").presets == "paper"
