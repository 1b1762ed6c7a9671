"""FinMCP-Bench (evaluation; user-supplied data, envs/finmcp.py):

  python -m envace_jax.main --config=configs/finmcp.py --config.env.data_path=/path/to/FinMCP-Bench --workdir=DIR

The argument is the sample type: "all" (default), "single_tool", "multi_tool" or "multi_turn". FinMCP-Bench is not
on PyPI: download it from huggingface.co/datasets/DianJin/FinMCP-Bench and point ``env.data_path`` at the file or
folder (``env.data_dir`` is where prepared datasets are cached, not the raw data). Its tools are live MCP servers this
project does not reach, so rollouts rehearse them (``rollout.env_mode="rehearse"``, grounded on the logged results)
and scoring is offline: TF1, tool precision and recall of the called tool names against the reference. User turns are
logged in the data (no user simulator).
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

_spec = importlib.util.spec_from_file_location("envace_configs_base", pathlib.Path(__file__).with_name("base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """FinMCP-Bench samples of type ``arg`` (default "all"); the data path comes from ``--config.env.data_path``."""
  arg, presets = base.presets.split(arg)
  c = base.get_config()
  c.env.benchmark = "finmcp"
  c.env.domain = arg or "all"
  c.env.data_path = ""  # required: the downloaded FinMCP-Bench file or folder
  c.env.split = "test"  # the only split
  c.env.eval_split = "test"
  c.rollout.env_mode = "rehearse"  # no live MCP servers: REHEARSE stands in for them
  c.rollout.user_capacity = 1024  # unused: user turns come from the data
  return base.presets.apply(c, presets)
