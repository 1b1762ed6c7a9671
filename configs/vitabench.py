"""VitaBench (evaluation; user-supplied data and tools, envs/vitabench.py):

  python -m envace_jax.main --config=configs/vitabench.py:cross_domain --config.env.data_path=/path/to/vitabench \
    --config.reward.judge_url=http://127.0.0.1:8000/v1 --config.reward.judge_model=NAME --mode=eval --workdir=DIR

The argument is the domain: "delivery" (default), "instore", "ota" or "cross_domain" (the paper's VitaBench number).
VitaBench is not on PyPI: clone github.com/meituan-longcat/vitabench, ``pip install -e`` it (its tools run each task's
own database) and point ``env.data_path`` at the clone (or its data/vita/domains folder, or one tasks_en.json). Note:
``env.data_dir`` is where prepared datasets are cached, not the raw data. Tasks are scored by an LLM judge over their
rubrics (``reward.kind="judge"``: set ``reward.judge_url`` and ``reward.judge_model``); config_check says what is
missing before anything loads. VitaBench has only test tasks; the user is simulated from the task's persona and goal.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

_spec = importlib.util.spec_from_file_location("envace_configs_base", pathlib.Path(__file__).with_name("base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """VitaBench on the domain ``arg`` (default "delivery"); data path and judge come from flags."""
  arg, presets = base.presets.split(arg)
  c = base.get_config()
  c.env.benchmark = "vitabench"
  c.env.domain = arg or "delivery"
  c.env.data_path = ""  # required: the VitaBench clone (or its data/vita/domains folder, or one task file)
  c.env.split = "test"  # the only split
  c.env.eval_split = "test"
  c.reward.kind = "judge"  # the rubric judge; judge_url / judge_model are required
  return base.presets.apply(c, presets)
