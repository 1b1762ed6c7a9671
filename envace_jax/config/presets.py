"""Named sets of settings a config can take on top of its own: ``--config=configs/<file>.py:<arg>+<preset>`` (or
``:<preset>`` alone), applied after the config's own values and before ``--config.*`` flags, which still win.

``official``: the semantics of the official implementation (Within-yao/EnvACE at 173e941, the verl fork the paper's
numbers come from) for every setting that has an official value. docs/departures.md lists each setting where our
defaults differ, what the official code does, and why; tests/test_official_preset.py checks that each setting it names
exists here and in ``defaults.py``, and tests/data/official/ holds the official code's outputs the preset reproduces.
The preset changes semantics only: sizes (model, batch, view capacities, token budgets) stay the config's.

``paper``: ``official`` and the paper's sizes (Qwen3-8B in bfloat16 over float32 master weights, B=16 tasks × G=4
rollouts, lr 1e-6, the official turn and token budgets); it needs ``--config.model_path=/path/to/Qwen3-8B`` and
accelerators. It is the one paper-size config: ``experiments/evidence.py --full`` is ``configs/tau2.py:<domain>+paper``,
docs/hardware.md's paper-size commands name ``+paper``, and configs/tau2.py's hardware recipes take the paper's values
from `PAPER` (tests/test_paper_config.py checks all three).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

OFFICIAL: dict[str, Any] = {
  # the update (verl/workers/actor/dp_actor.py, verl/trainer/ppo/core_algos.py): each generation weighs the same, a
  # group of one keeps its reward as advantage, a blank generation scores 0.1 less, old log-probs recomputed
  "grpo.loss_aggregation": "generation_mean",
  "grpo.lone_member_advantage": "reward",
  "reward.empty_output_penalty": 0.1,
  "grpo.old_logprobs": "recompute",
  # ACT parsing (agent_system/environments/env_package/checklist/tool_parser.py, envs.py): the official rules, a
  # malformed call ends the episode, several calls per message
  "rollout.act_parser": "official",
  "rollout.on_malformed": "end",
  "rollout.parallel_calls": True,
  # REHEARSE (agent_system/agent/agents/checklist/tool_simulator_agent.py, simulate_core/_builders.py): a fresh
  # prompt per call with every reference interaction and /think, the <execution_result> contract, a broken or error
  # result ends the episode, the calls of one message rehearsed independently
  "rollout.rehearse_context": "per_call",
  "rollout.grounding_max_tokens": -1,
  "rollout.rehearse_think": True,
  "rollout.rehearsal_format": "execution_result",
  "rollout.on_invalid_rehearsal": "end",
  "rollout.on_rehearsed_error": "end",
  "rollout.parallel_rehearsal": "independent",
  # held-out sampling (examples/drmas_trainer/run_checklist_share.sh: val_kwargs). Training samples REHEARSE as ACT,
  # at verl's rollout defaults (1.0, 1.0) like ours: the run's co-trained simulator (TOOL_RETURN_MODE=agent) generates
  # through the actor's rollout; tool_temperature / tool_top_p only reach an external simulator server (mcp_tool.py).
  "eval.sampling.temperature": 0.6,
  "eval.sampling.top_p": 0.95,
  "eval.sampling.top_k": 0,
  # the checklist judge (agent_system/environments/env_package/checklist/interaction.py, checklist_reward.py, envs.py)
  "reward.judge_granularity": "step",
  "reward.required_items": "end",
  "reward.unfinished_turn": "zero",
  "reward.judge_schema": "official",
  "reward.judge_transcript": "official",
  "reward.judge_temperature": 0.6,
  "reward.judge_top_p": 0.8,
  "reward.judge_max_tokens": 6000,
  "reward.judge_max_retries": 4,
  "reward.judge_timeout_s": 120.0,
}

PAPER: dict[str, Any] = {
  **OFFICIAL,
  "model": "qwen3-8b",
  "tokenizer": "",
  "chat_template": "chatml",  # append-only views; Qwen3's own template rewrites earlier turns (docs/departures.md)
  "dtype": "bfloat16",
  "param_dtype": "float32",
  "train.tasks_per_step": 16,
  "train.group_size": 4,
  "grpo.learning_rate": 1e-6,
  "grpo.use_kl": False,
  # env.checklist.max_assistant_turns; env.max_steps=200 micro-steps bounds ACT + REHEARSE generations together
  "rollout.max_turns": 30,
  # data.max_response_length: tokens of one generation, whichever role writes it (the user simulator's too)
  "rollout.act_max_new_tokens": 8000,
  "rollout.rehearse_max_new_tokens": 8000,
  "rollout.user_max_new_tokens": 8000,
  # env.checklist.max_model_len: a view's whole sequence
  "rollout.act_capacity": 20000,
  "rollout.rehearse_capacity": 20000,
  "rollout.user_capacity": 20000,
}

PRESETS: Mapping[str, Mapping[str, Any]] = {"official": OFFICIAL, "paper": PAPER}


def split(arg: str | None) -> tuple[str | None, tuple[str, ...]]:
  """A config argument ``"<arg>+<preset>+..."`` as (arg, presets); an argument that is only a preset name gives
  (None, (name,)); empty names (a trailing "+") are dropped. Names are not checked here (`apply` records them,
  ``config_check`` names an unknown one)."""
  if not arg:
    return arg, ()
  head, *tail = arg.split("+")
  if head in PRESETS:
    return None, only(arg)
  return head or None, only("+".join(tail))


def only(arg: str | None) -> tuple[str, ...]:
  """The presets of a config that takes no argument of its own (configs/base.py, configs/tiny.py): every
  ``+``-separated name of ``arg``, known or not (an unknown one is reported, never ignored)."""
  return tuple(name for name in (arg or "").split("+") if name)


def apply(config: ml_collections.ConfigDict, names: Sequence[str]) -> ml_collections.ConfigDict:
  """``config`` with the settings of each known preset in ``names`` (in order), set in place, and ``names`` recorded
  in ``config.presets`` (comma-separated), where ``config_check.validate`` reports an unknown one in one line before
  the run starts; returns ``config``."""
  for name in names:
    if name in PRESETS:
      config.update_from_flattened_dict(dict(PRESETS[name]))
  config.presets = ",".join(names)
  return config
