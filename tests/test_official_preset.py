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


def _rows() -> list[list[str]]:
  """The departures table's rows as cells (header and rule rows dropped)."""
  lines = [line for line in TABLE.read_text().splitlines() if line.startswith("|")]
  rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
  return [r for r in rows[2:] if r and not set(r[0]) <= {"-", ":"}]


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
  rows = _rows()
  assert len(rows) >= 15, len(rows)
  header = [c.strip().lower() for c in TABLE.read_text().split("\n| ", 1)[1].split("\n")[0].strip("| ").split("|")]
  assert header[-1].startswith("setting"), header
  for row in rows:
    assert len(row) == len(header), row
    assert all(row), f"an empty cell in {row}"
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


@pytest.mark.parametrize("name,arg", [("tau2", "mock+official"), ("bfcl", "official"), ("tiny", "official")])
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


def test_an_unknown_preset_is_named():
  with pytest.raises(ValueError, match=r"unknown config preset 'offical' .*known: \['official', 'paper'\]"):
    _load("tau2").get_config("airline+offical")
