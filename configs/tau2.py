"""τ²-bench training: python -m envace_jax.main --config=configs/tau2.py:retail --workdir=DIR

The argument is the domain: "airline" (default), "retail" or "mock". Telecom does not fit SmolLM2's context and is not
supported by the τ² adapter (score it with tau2's own orchestrator).

"mock_heldout" is τ² mock with held-out tasks (the README's main job before the testbed's), the protocol of
experiments/evidence.py (trained on one task of each template, evaluated on the four tasks that continue a logged
conversation, which it never trains on), with what SmolLM2-135M needs to learn within 30 minutes on 2 CPU cores: the
supervised warm-up, the scenario as the user's first message, REHEARSE without grounding, dynamic sampling, and the
initial weights evaluated too, so the log ends with the held-out numbers before and after training.

The defaults (base.py) train SmolLM2-135M on 2 CPU cores in well under 30 minutes: 2 steps of 1 task × 2 rollouts,
at most 4 agent turns of ≤ 96 tokens. Airline and retail system prompts are ≈ 5k SmolLM2 tokens, so the ACT view
takes the whole 8192-token context. The paper-size run (Qwen3-8B on accelerators) is the ``paper`` preset,
``--config=configs/tau2.py:airline+paper --config.model_path=/path/to/Qwen3-8B`` (envace_jax/config/presets.py:PAPER);
`RECIPES` below are plans sized for H200s (docs/hardware.md).
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

# Load base.py beside this file by path, so the config works from any working directory (config_flags loads
# files by path; `configs` is not an installed package).
_spec = importlib.util.spec_from_file_location("envace_configs_base", pathlib.Path(__file__).with_name("base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


# τ² mock's held-out split (mock has one 9-task split), like airline's and retail's own train/test: the same tools,
# tasks never trained on. Training has one task of each template (create a task, with and without env assertions;
# mark task_1 completed; an impossible request); held out are the four tasks that continue a logged conversation about
# task_2 and ask to mark it completed, so ACT must take the id from a context it never trained on. create_task_1_nl_eval
# is left out: it has no gold action, so its reference conversation has no assistant turn to learn from.
MOCK_TRAIN_IDS = ("create_task_1", "create_task_1_with_env_assertions", "update_task_1", "impossible_task_1")
MOCK_HELDOUT_IDS = (
  "update_task_with_message_history",
  "update_task_with_initialization_data",
  "update_task_with_initialization_actions",
  "update_task_with_history_and_env_assertions",
)


# Recipes sized by the memory plan (experiments/recipes.py writes their tables to experiments/results/plan_*.md):
# τ² airline with the paper's values of `PAPER_KEYS`, read from the +paper preset (envace_jax/config/presets.py:PAPER,
# the one paper-size config: bf16 compute over fp32 master weights, lr 1e-6, ChatML, the model's own tokenizer), our
# semantics, the default view capacities (ACT 8192, REHEARSE 6144) and a reference user of 6144 slots (its view holds
# the whole conversation; the plan assumes a 5000-token opening shared by a task's rollouts in every view). Pass the
# weights with --config.model_path=/path/to/Qwen3-... . tests/test_paper_config.py lists every key where a recipe
# differs from configs/tau2.py:airline+paper.
PAPER_KEYS = ("tokenizer", "chat_template", "dtype", "param_dtype", "grpo.learning_rate")
_PAPER = base.presets.PAPER
RECIPES = {
  # One H200: Qwen3-1.7B EnvACE, the largest B×G the plan fits (experiments/results/plan_h200_qwen3_1p7b.md).
  "h200_qwen3_1p7b": {"model": "qwen3-1.7b", "mesh.data": 1, "mesh.fsdp": 1, "train.tasks_per_step": 4,
                      "train.group_size": _PAPER["train.group_size"], "grpo.micro_batch_size": 1},
  # 8 H200s: the paper's Qwen3-8B at B=16 × G=4, fully sharded (experiments/results/plan_h200x8_qwen3_8b.md).
  "h200x8_qwen3_8b": {**{k: _PAPER[k] for k in ("model", "train.tasks_per_step", "train.group_size")},
                      "mesh.data": 1, "mesh.fsdp": 8, "grpo.micro_batch_size": 8},
}  # fmt: skip


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """τ² training on the domain ``arg`` (default "airline"), or a recipe of `RECIPES` (τ² airline); an unknown domain
  is reported by config_check."""
  arg, presets = base.presets.split(arg)
  recipe = RECIPES.get(arg)
  arg = "airline" if recipe is not None else arg
  c = base.get_config()
  c.env.benchmark = "tau2"
  c.env.domain = {"mock_heldout": "mock"}.get(arg, arg or "airline")
  if recipe is not None:
    c.update_from_flattened_dict({k: _PAPER[k] for k in PAPER_KEYS})
    c.rollout.user_capacity = 6144
    c.update_from_flattened_dict(recipe)
  if c.env.domain == "mock":
    # The mock domain has one split, "base" (9 tasks), and a ≈0.5k-token system prompt.
    c.env.split = "base"
    c.env.eval_split = "base"
    c.rollout.act_capacity = 2048
    c.rollout.rehearse_capacity = 2048
    c.rollout.user_capacity = 1024
  if arg == "mock_heldout":
    c.env.train_task_ids = ",".join(MOCK_TRAIN_IDS)
    c.env.eval_task_ids = ",".join(MOCK_HELDOUT_IDS)
    c.train.eval_tasks = -1  # all four
    c.train.eval_at_start = True
    c.train.sft_warmup_steps = 4  # one pass over the four training tasks (B=1; the stream permutes each epoch)
    c.train.steps = 7  # the warm-up, then 3 GRPO steps
    c.train.group_size = 4
    c.train.checkpoint_every = 1
    c.grpo.learning_rate = 2e-5
    c.grpo.sft_learning_rate = 1e-4
    c.grpo.dynamic_sampling = True
    c.grpo.dynamic_sampling_max_draws = 1
    c.rollout.scenario_opening = True
    # REHEARSE trains without the reference interactions, as it rehearses held-out tasks (which have none): with them
    # it learns to copy the logged response and writes invalid JSON for an unseen call (experiments/evidence.py).
    c.rollout.grounding_max_tokens = 0
    c.rollout.max_turns = 3
    c.rollout.user_max_new_tokens = 96
  return base.presets.apply(c, presets)
