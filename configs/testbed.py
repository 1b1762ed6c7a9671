"""The testbed (docs/testbed.md): python -m envace_jax.main --config=configs/testbed.py:cpu --workdir=DIR

The argument is the level (envs/testbed.py `LEVELS`): "cpu" (default: SmolLM2-135M on a CPU, ≈0.75k-token ACT prompts,
tasks of at most 4 ACT generations) or "full" (both tool classes' whole function lists, up to 3 turns: for Qwen3 on an
accelerator); or "main", the README's main job (level cpu with `MAIN`'s sizes). Training draws from the "train" split;
evaluation runs on "iid" (seen templates, unseen entities), and `--config.env.eval_split=compositional` or `=rules`
evaluates the other held-out splits:

  for s in iid compositional rules; do
    python -m envace_jax.main --config=configs/testbed.py --mode=eval --workdir=DIR --config.env.eval_split=$s
  done

User turns are logged in the tasks (no user simulator); the real tools are BFCL's MessageAPI and TicketAPI.
The run starts with the supervised warm-up (the tasks' reference conversations, both roles), then world-rehearsal
GRPO at B=4 × G=4. REHEARSE trains without grounding (the tasks' real responses are not in its view), the view it
has on a held-out task; experiments/testbed_calibration.py measures the levels.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

_spec = importlib.util.spec_from_file_location("envace_configs_base", pathlib.Path(__file__).with_name("base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


# "main" is the README's main job (`make run`): level cpu, 16 held-out iid tasks before and after training, sized for
# about 20 minutes on 2 CPU cores (18:02 with a cold compilation cache, 19:36 with a fresh clone's install, 2026-12-06):
# 6 warm-up steps (the calibrated 10 took 33 minutes), one GRPO step, and the evaluations' success and gold-call
# fidelity only (the reward gap and the committed calls' fidelity took 190 s and 127 s of each 16-task evaluation,
# 2026-12-05). docs/getting-started.md shows what it prints.
MAIN = {
  "train.sft_warmup_steps": 6,
  "train.steps": 7,
  "train.eval_tasks": 16,
  "train.checkpoint_every": 7,
  "eval.reward_gap": False,
  "eval.fidelity": False,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The testbed at level ``arg`` (default "cpu"), or ``main`` (level cpu with `MAIN`); an unknown level is reported
  by config_check."""
  arg, presets = base.presets.split(arg)
  main, arg = arg == "main", ("cpu" if arg == "main" else arg)
  c = base.get_config()
  c.env.benchmark = "testbed"
  c.env.domain = arg or "cpu"
  c.env.split = "train"
  c.env.eval_split = "iid"
  c.train.tasks_per_step = 4
  c.train.group_size = 4
  # 10 steps (40 demonstrations) put SmolLM2's iid success inside 15-60% (experiments/results/testbed_calibration.md)
  c.train.sft_warmup_steps = 10
  c.train.steps = 20  # the warm-up, then 10 GRPO steps
  c.train.checkpoint_every = 10
  c.train.eval_tasks = 32
  c.train.eval_every = 0
  c.train.eval_at_start = True
  c.eval.tasks = 128
  c.grpo.learning_rate = 2e-5
  c.grpo.sft_learning_rate = 1e-4
  c.grpo.dynamic_sampling = True
  c.grpo.dynamic_sampling_max_draws = 1
  c.rollout.grounding_max_tokens = 0
  c.rollout.user_capacity = 256  # unused: user turns come from the data
  if c.env.domain == "full":
    c.rollout.max_turns = 12
    c.rollout.act_capacity = 6144
    c.rollout.rehearse_capacity = 6144
    c.rollout.act_max_new_tokens = 256
    c.rollout.rehearse_max_new_tokens = 256
  else:
    c.rollout.max_turns = 4
    c.rollout.act_capacity = 2048
    c.rollout.rehearse_capacity = 2048
    c.rollout.act_max_new_tokens = 96
    c.rollout.rehearse_max_new_tokens = 128
  if main:
    c.update_from_flattened_dict(MAIN)
  return base.presets.apply(c, presets)
