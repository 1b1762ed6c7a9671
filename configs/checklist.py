"""Training on checklist-format data (the paper's training-data format, envs/checklist.py):

  python -m envace_jax.main --config=configs/checklist.py --config.env.data_path=/data/train.jsonl \
    --config.reward.judge_url=http://127.0.0.1:30000/v1 --config.reward.judge_model=NAME --workdir=DIR

``env.data_path`` (a file or a folder) is required; ``configs/checklist.py:/data/train.jsonl`` sets it too. User
turns and tool results are logged in the data: REHEARSE is grounded on them, and env_mode="real" replays them.
Tasks without a split are in "train". Evaluate the trained checkpoint with configs/tau2.py or configs/bfcl.py.

The reward is the paper's: the LLM checklist judge over the data's checklists (``reward.kind="judge"``, with the
official judging semantics of ``config/defaults.py``'s ``reward.*``), so ``reward.judge_url`` and
``reward.judge_model`` are required (the start-up check names them); ``--config.reward.kind=rule`` trains offline on
the logged gold calls and well-formedness instead, leaving the checklists unscored.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

_spec = importlib.util.spec_from_file_location("envace_configs_base", pathlib.Path(__file__).with_name("base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Checklist data at ``arg`` or ``--config.env.data_path`` (config_check refuses an empty path)."""
  arg, presets = base.presets.split(arg)
  c = base.get_config()
  c.env.benchmark = "checklist"
  c.env.domain = ""  # unused: the data path names the dataset
  c.env.data_path = arg or ""
  c.env.split = "train"
  c.env.eval_split = "train"  # checklist data is training data; evaluate on a benchmark config instead
  c.rollout.user_capacity = 1024  # unused: user turns come from the data
  c.reward.kind = "judge"  # the paper's reward: the checklist judge (needs reward.judge_url and reward.judge_model)
  return base.presets.apply(c, presets)
