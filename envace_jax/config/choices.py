"""The values of each enumerated config key, declared once: the start-up check (``config_check``) and the modules
that read the key both import them from here, and importing this module costs nothing (``main`` validates a config
before the training stack loads)."""

GRPO_MODES = ("envace", "per_role", "grpo_real_env")  # grpo.mode (rl/grpo.py)
KL_ESTIMATORS = ("low_var_kl", "k1", "k2")  # grpo.kl_estimator (rl/grpo.py: kl_penalty)
WEIGHTINGS = ("row", "trajectory")  # grpo.weighting (rl/advantages.py)
OLD_LOGPROBS = ("sampler", "recompute")  # grpo.old_logprobs (train.py)
BASELINE_GROUPS = ("task_role", "task")  # grpo.baseline_groups (rl/advantages.py)
LONE_MEMBER_ADVANTAGES = ("zero", "reward")  # grpo.lone_member_advantage (rl/advantages.py)
LOSS_AGGREGATIONS = ("generation_mean", "token_mean")  # grpo.loss_aggregation (rl/grpo.py)
ENV_MODES = ("rehearse", "real")  # rollout.env_mode (rehearsal/episode.py)
USER_MODES = ("reference", "policy", "external")  # rollout.user_mode
MALFORMED_POLICIES = ("continue", "end")  # rollout.on_malformed
ACT_PARSERS = ("ours", "official")  # rollout.act_parser (rehearsal/views.py: parse_act)
INVALID_REHEARSAL_POLICIES = ("as_is", "error", "end")  # rollout.on_invalid_rehearsal
REHEARSAL_FORMATS = ("tool_response", "execution_result")  # rollout.rehearsal_format (rehearsal/views.py)
REHEARSED_ERROR_POLICIES = ("continue", "end")  # rollout.on_rehearsed_error
REHEARSE_CONTEXTS = ("trajectory", "per_call")  # rollout.rehearse_context (rehearsal/episode.py)
PARALLEL_REHEARSALS = ("sequential", "independent")  # rollout.parallel_rehearsal
REHEARSAL_MODES = ("off", "parallel", "sequential")  # eval.rehearsal (rehearsal/private.py)
REHEARSAL_USERS = ("policy", "reference")  # eval.rehearsal_user
REHEARSAL_CONTROLS = ("none", "no_world_model", "drafts")  # eval.rehearsal_control (rehearsal/private.py)
DTYPES = ("float32", "bfloat16", "float16")  # dtype, param_dtype (model/config.py)
ATTENTION = ("auto", "reference", "xla", "cudnn", "pallas_tpu")  # ModelConfig.attention (model/attention.py)
MESH_AXES = ("data", "fsdp", "tensor")  # mesh.* (sampling/sharding.py)
VIEWS = ("act", "rehearse", "user")  # rollout.<view>_capacity, rollout.<view>_sampling
ROLES = VIEWS  # grpo.trained_roles: a role is trained on its view's rows
REWARD_KINDS = ("rule", "judge")  # reward.kind (scoring.py)
ARG_KEYS = ("strict", "tau2")  # reward.arg_keys (rl/rewards.py)
JUDGE_GRANULARITIES = ("step", "turn")  # reward.judge_granularity (rl/judge.py)
JUDGE_SCHEMAS = ("official", "analysis")  # reward.judge_schema (rl/judge.py)
JUDGE_TRANSCRIPTS = ("ours", "official")  # reward.judge_transcript (rl/judge.py)
UNFINISHED_TURNS = ("zero", "judge")  # reward.unfinished_turn (rl/judge.py)
REQUIRED_ITEMS = ("end", "ignore")  # reward.required_items (scoring.py: turn_gate)
CHAT_TEMPLATES = ("", "chatml")  # chat_template (model/tokenizer.py)


def parse_names(value) -> tuple[str, ...]:
  """Names from "act,rehearse" or ("act", "rehearse") (items may themselves hold commas), stripped, in order, without
  repeats: grpo.trained_roles, eval.rehearsal. Checks nothing: ``config_check.validate`` does."""
  items = [value] if isinstance(value, str) else list(value)
  names: list[str] = []
  for item in items:
    for name in str(item).split(","):
      name = name.strip()
      if name and name not in names:
        names.append(name)
  return tuple(names)
