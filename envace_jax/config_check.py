"""Start-up validation of a run's config (configs/*.py), before any model is loaded or any array computed.

    config_check.validate(config)   # raises ConfigError listing every bad key, its value and what is valid

The checks read files only to see that they exist (weights, checklist data) and, for a local model directory, its
``config.json`` (to compare it with the named preset and to learn the context length). Helpers here turn the
config's strings into what the training loop needs: ``weights_source``, ``tokenizer_source``. The schema itself,
with every key's meaning and default, is ``envace_jax/config/defaults.py``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from envace_jax.config.choices import (
  ACT_PARSERS,
  ARG_KEYS,
  ATTENTION,
  BASELINE_GROUPS,
  CHAT_TEMPLATES,
  DTYPES,
  ENV_MODES,
  JUDGE_GRANULARITIES,
  JUDGE_SCHEMAS,
  JUDGE_TRANSCRIPTS,
  KL_ESTIMATORS,
  LONE_MEMBER_ADVANTAGES,
  LOSS_AGGREGATIONS,
  MESH_AXES,
  OLD_LOGPROBS,
  PARALLEL_REHEARSALS,
  REHEARSAL_CONTROLS,
  REHEARSAL_FORMATS,
  REHEARSAL_USERS,
  REHEARSE_CONTEXTS,
  REHEARSED_ERROR_POLICIES,
  REQUIRED_ITEMS,
  REWARD_KINDS,
  ROLES,
  UNFINISHED_TURNS,
  USER_MODES,
  VIEWS,
  WEIGHTINGS,
  parse_names,
)
from envace_jax.config.choices import GRPO_MODES as MODES
from envace_jax.config.choices import INVALID_REHEARSAL_POLICIES as ON_INVALID_REHEARSAL
from envace_jax.config.choices import MALFORMED_POLICIES as ON_MALFORMED
from envace_jax.config.choices import REHEARSAL_MODES as REHEARSAL
from envace_jax.config.presets import PRESETS
from envace_jax.envs import registry
from envace_jax.envs.base import EnvError
from envace_jax.model import config as model_config

SMOLLM2 = "smollm2-135m"
# Architecture fields a model directory's config.json must share with the preset it is given for.
_SHAPE_FIELDS = ("family", "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")
_MISSING = object()
# The magnitude of a typical weight: the initialisers' stddev (model/transformer.py's _dense_init; Hugging Face's
# initializer_range), about the root mean square of a trained Llama's or Qwen's projection weights.
TYPICAL_WEIGHT = 0.02


class ConfigError(ValueError):
  """The run's config is invalid. ``problems`` lists each bad key with its value and the valid values."""

  def __init__(self, problems: Sequence[str]):
    self.problems = list(problems)
    lines = "\n".join(f"  - {p}" for p in self.problems)
    super().__init__(f"invalid config ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):\n{lines}")


def _choices(values: Sequence[str]) -> str:
  return ", ".join(repr(v) for v in values)


def weights_source(config) -> str | None:
  """What to pass to ``weights.load_pretrained``: ``model_path``, or ``model`` when it is "smollm2-135m" or a path;
  None for a randomly initialised preset ("tiny")."""
  if config.model_path:
    return config.model_path
  if config.model in model_config.PRESETS and config.model != SMOLLM2:
    return None
  return config.model


def tokenizer_source(config) -> str | None:
  """Where the tokenizer comes from: ``config.tokenizer``, else the weights' own; None: no tokenizer (random ids)."""
  return config.tokenizer or weights_source(config)


class _Checker:
  """Reads dotted keys of a config and collects problems instead of stopping at the first."""

  def __init__(self, config):
    self.config = config
    self.problems: list[str] = []

  def add(self, problem: str) -> None:
    self.problems.append(problem)

  def get(self, key: str, quiet: bool = False) -> Any:
    """The value of ``key``, or _MISSING (a problem is recorded unless ``quiet``: a key checked once already)."""
    value = self.config
    for part in key.split("."):
      try:
        value = value[part]
      except (KeyError, TypeError, AttributeError):
        if not quiet:
          self.add(f"{key} is missing; every config starts from envace_jax/config/defaults.py, which defines it")
        return _MISSING
    return value

  def one_of(self, key: str, choices: Sequence[str], why: str = "") -> Any:
    value = self.get(key)
    if value is not _MISSING and value not in choices:
      self.add(f"{key}={value!r} is not valid{why}; choose one of {_choices(choices)}")
    return value

  def integer(self, key: str, low: int | None = None, high: int | None = None, why: str = "") -> Any:
    value = self.get(key)
    if value is _MISSING:
      return value
    if isinstance(value, bool) or not isinstance(value, int):
      self.add(f"{key}={value!r} must be an integer")
      return _MISSING
    if low is not None and value < low or high is not None and value > high:
      bound = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in [{low}, {high}]")
      self.add(f"{key}={value} must be {bound}{why}")
      return _MISSING
    return value

  def number(self, key: str, valid: Callable[[float], bool], bound: str, why: str = "") -> Any:
    value = self.get(key)
    if value is _MISSING:
      return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
      self.add(f"{key}={value!r} must be a finite number")
      return _MISSING
    if not valid(value):
      self.add(f"{key}={value} must be {bound}{why}")
      return _MISSING
    return value

  def boolean(self, key: str) -> Any:
    value = self.get(key)
    if value is not _MISSING and not isinstance(value, bool):
      self.add(f"{key}={value!r} must be True or False")
    return value

  def text(self, key: str) -> Any:
    value = self.get(key)
    if value is not _MISSING and not isinstance(value, str):
      self.add(f"{key}={value!r} must be a string")
      return _MISSING
    return value


def _is_weights(path: str) -> bool:
  p = os.path.expanduser(path)
  return os.path.isfile(os.path.join(p, "config.json")) or (os.path.isfile(p) and p.endswith(".gguf"))


def _smollm2_problem() -> str | None:
  """Why SmolLM2's packaged weights are unavailable, or None. Finds the file; reads and hashes nothing."""
  from envace_jax.model import weights

  try:
    weights.smollm2_gguf_path(verify=False)
  except weights.WeightsError as e:
    return str(e)
  return None


def _check_model(ck: _Checker, weights: bool = True) -> int | None:
  """Checks model / model_path / tokenizer / dtypes (``weights``: that the weights exist too); returns the model's
  context length when it is known."""
  model, path, tokenizer = ck.text("model"), ck.text("model_path"), ck.text("tokenizer")
  for key in ("dtype", "param_dtype"):
    ck.one_of(key, DTYPES)
  ck.one_of("chat_template", CHAT_TEMPLATES, why=' ("": the tokenizer\'s own template)')
  ck.one_of("attention", ATTENTION)
  if model is _MISSING or path is _MISSING:
    return None
  presets = tuple(model_config.PRESETS)
  context = None
  if model in model_config.PRESETS:
    preset = model_config.PRESETS[model]
    context = preset.max_seq_len
    if model == "tiny":
      if path:
        ck.add(f"model_path={path!r} is set, but model='tiny' is randomly initialised; clear model_path")
    elif not path:
      if not weights:
        pass
      elif model == SMOLLM2:
        problem = _smollm2_problem()
        if problem:
          ck.add(f"model={model!r} has no weights: {problem}")
      else:
        ck.add(
          f"model={model!r} is a preset without bundled weights; set --config.model_path=DIR, a local Hugging Face "
          "directory of that model (config.json + *.safetensors)"
        )
    elif not _is_weights(path):
      ck.add(
        f"model_path={path!r} does not exist or holds no model; point it to a local Hugging Face directory "
        "(config.json + *.safetensors) or a .gguf file"
      )
    elif os.path.isdir(os.path.expanduser(path)):
      try:
        found = model_config.get_model_config(os.path.expanduser(path))
      except (model_config.ConfigError, KeyError, ValueError) as e:
        ck.add(f"model_path={path!r}: its config.json cannot be read as a model config: {e}")
      else:
        context = found.max_seq_len
        differ = [
          f"{f} {getattr(found, f)} (preset: {getattr(preset, f)})"
          for f in _SHAPE_FIELDS
          if getattr(found, f) != getattr(preset, f)
        ]
        if differ:
          ck.add(
            f"model_path={path!r} holds another architecture than model={model!r}: {', '.join(differ)}; "
            "set model to the matching preset"
          )
  else:
    if path:
      ck.add(f"model={model!r} is not a preset ({_choices(presets)}); with model_path set, model must name its preset")
    elif not _is_weights(model):
      ck.add(
        f"model={model!r} is neither a preset ({_choices(presets)}) nor an existing Hugging Face directory or "
        ".gguf file"
      )
    elif os.path.isdir(os.path.expanduser(model)):
      try:
        context = model_config.get_model_config(os.path.expanduser(model)).max_seq_len
      except (model_config.ConfigError, KeyError, ValueError) as e:
        ck.add(f"model={model!r}: its config.json cannot be read as a model config: {e}")
  if tokenizer is not _MISSING and tokenizer:
    if model != "tiny":
      ck.add(
        f"tokenizer={tokenizer!r} is only for the randomly initialised model='tiny'; a pretrained model uses its "
        "own tokenizer, so clear tokenizer"
      )
    elif tokenizer == SMOLLM2:
      problem = _smollm2_problem()
      if problem:
        ck.add(f"tokenizer={tokenizer!r} is not available: {problem}")
    elif not (os.path.isfile(os.path.join(os.path.expanduser(tokenizer), "tokenizer.json")) or _is_weights(tokenizer)):
      ck.add(f"tokenizer={tokenizer!r} does not exist; use {SMOLLM2!r} or a directory with tokenizer.json")
  return context


def _check_mesh(ck: _Checker) -> None:
  mesh = ck.get("mesh")
  if mesh is _MISSING:
    return
  extra = sorted(set(mesh) - set(MESH_AXES))
  if extra:
    ck.add(f"mesh has unknown axes {extra}; the axes are {_choices(MESH_AXES)}")
  sizes = [ck.get(f"mesh.{axis}") for axis in MESH_AXES]
  for axis, size in zip(MESH_AXES, sizes, strict=True):
    if size is not _MISSING and (isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1)):
      ck.add(f"mesh.{axis}={size!r} must be a positive integer, or -1 for every remaining device")
  if sizes.count(-1) > 1:
    ck.add("mesh: at most one axis may be -1 (the one that takes every remaining device)")


def _check_env(ck: _Checker) -> str | None:
  benchmark = ck.one_of("env.benchmark", tuple(registry.BENCHMARKS))
  domain, data_path = ck.text("env.domain"), ck.text("env.data_path")
  split, eval_split = ck.text("env.split"), ck.text("env.eval_split")
  data_dir = ck.text("env.data_dir")
  ck.text("env.train_task_ids")
  ck.text("env.eval_task_ids")
  if data_dir is not _MISSING and not data_dir:
    ck.add("env.data_dir is empty; set it to the folder that holds (or will hold) the prepared datasets")
  if benchmark is _MISSING or benchmark not in registry.BENCHMARKS:
    return None
  bench = registry.get(benchmark)
  if bench.data == "path":
    if data_path is not _MISSING:
      if not data_path:
        ck.add("env.data_path is required for env.benchmark='checklist': pass --config.env.data_path=FILE_OR_DIR")
      elif not os.path.exists(os.path.expanduser(data_path)):
        ck.add(f"env.data_path={data_path!r} does not exist; point it to checklist-format data (a file or a folder)")
    for key, value in (("env.split", split), ("env.eval_split", eval_split)):
      if value is not _MISSING and (not re.fullmatch(r"[A-Za-z0-9_]+", value) or value == "all"):
        ck.add(f"{key}={value!r} is not a split name; use letters, digits and _ (tasks without a split are 'train')")
    return benchmark
  if bench.data == "download":
    _check_download(ck, bench, domain, data_path, split, eval_split)
    return benchmark
  names = bench.domains()
  if domain is _MISSING:
    return benchmark
  if domain not in names:
    ck.add(f"env.domain={domain!r} is not a {bench.domain_word}; choose one of {_choices(names)}")
    return benchmark
  splits = bench.splits(domain)
  for key, value in (("env.split", split), ("env.eval_split", eval_split)):
    if value is not _MISSING and value not in splits:
      ck.add(f"{key}={value!r} is not a split of {benchmark} {domain}; choose one of {_choices(splits)}")
  return benchmark


def _check_download(ck: _Checker, bench: registry.Benchmark, domain: Any, data_path: Any, split: Any, eval_split: Any):
  """A benchmark whose data the user downloads (VitaBench, FinMCP-Bench), and the packages its tools need."""
  benchmark, domains, hint = bench.name, bench.domains(), bench.adapter().DOWNLOAD_HINT
  if domain is not _MISSING and domain not in domains:
    ck.add(f"env.domain={domain!r} is not a {bench.domain_word}; choose one of {_choices(domains)}")
  if data_path is not _MISSING:
    if not data_path:
      ck.add(f"env.data_path is required for env.benchmark={benchmark!r}. {hint}")
    elif not os.path.exists(os.path.expanduser(data_path)):
      ck.add(f"env.data_path={data_path!r} does not exist. {hint}")
    elif domain in domains:
      try:
        bench.data_files(Path(data_path).expanduser(), domain)
      except EnvError as e:
        ck.add(f"env.data_path={data_path!r}: {e}")
  for module, install in bench.requires:
    if importlib.util.find_spec(module) is None:
      ck.add(f"the package `{module}` ({bench.title}'s tools) is not installed: {install}")
  for key, value in (("env.split", split), ("env.eval_split", eval_split)):
    if value is not _MISSING and value not in bench.splits(domain):
      ck.add(f"{key}={value!r}: {benchmark} has only the split 'test'")


def _check_train(ck: _Checker, benchmark: str | None) -> None:
  steps = ck.integer("train.steps", 1)
  ck.integer("train.tasks_per_step", 1)
  ck.integer("train.group_size", 2, why=" (GRPO advantages compare each rollout with the other rollouts of its task)")
  ck.integer("train.checkpoint_every", 1)
  ck.integer("train.keep_checkpoints", 1)
  ck.boolean("train.checkpoint_fallback")
  ck.integer("train.eval_every", 0)
  ck.integer("train.eval_tasks", -1, why=" (-1: every task of eval_split, 0: no evaluation)")
  ck.boolean("train.eval_at_start")
  ck.text("train.init_from")  # a fresh run checks its checkpoint (`train.Trainer`); a resumed run never reads it
  warmup = ck.integer("train.sft_warmup_steps", 0)
  if steps is not _MISSING and warmup is not _MISSING and warmup > steps:
    ck.add(f"train.sft_warmup_steps={warmup} must be <= train.steps={steps}")
  if warmup and warmup is not _MISSING and benchmark and not registry.get(benchmark).demonstrations:
    demonstrated = [b.name for b in registry.BENCHMARKS.values() if b.demonstrations]
    ck.add(
      f"train.sft_warmup_steps={warmup} with env.benchmark={benchmark!r}: the supervised warm-up needs reference "
      f"conversations with executable gold calls, which only {_choices(demonstrated)} have; set it to 0"
    )


def _check_rollout(ck: _Checker, context: int | None) -> tuple[Any, Any]:
  ck.integer("rollout.max_turns", 1)
  env_mode = ck.one_of("rollout.env_mode", ENV_MODES)
  ck.one_of("rollout.on_malformed", ON_MALFORMED)
  ck.one_of("rollout.act_parser", ACT_PARSERS)
  ck.one_of("rollout.on_invalid_rehearsal", ON_INVALID_REHEARSAL)
  ck.one_of("rollout.rehearsal_format", REHEARSAL_FORMATS)
  ck.one_of("rollout.on_rehearsed_error", REHEARSED_ERROR_POLICIES)
  rehearse_context = ck.one_of("rollout.rehearse_context", REHEARSE_CONTEXTS)
  if ck.one_of("rollout.parallel_rehearsal", PARALLEL_REHEARSALS) == "independent" and rehearse_context == "trajectory":
    ck.add(
      "rollout.parallel_rehearsal='independent' needs rollout.rehearse_context='per_call' (one append-only REHEARSE "
      "view shows every earlier response)"
    )
  instructions = ck.text("rollout.rehearse_instructions_file")
  if isinstance(instructions, str) and instructions and not os.path.isfile(instructions):
    ck.add(f"rollout.rehearse_instructions_file={instructions!r} is not a readable file")
  for key in (
    "accept_error_text",
    "rehearse_think",
    "parallel_calls",
    "rehearse_sees_dialogue",
    "scenario_opening",
    "continuous_batching",
  ):
    ck.boolean(f"rollout.{key}")
  grounding = ck.integer("rollout.grounding_max_tokens", -1, why=" (-1: every interaction, 0: none)")
  page = ck.integer("rollout.kv_page_size", 0, why=" (0: dense rows)")
  ck.integer("rollout.kv_pages", 0, why=" (0: a quarter of every row at the largest capacity)")
  capacities = {}
  for view in VIEWS:
    capacity = ck.integer(f"rollout.{view}_capacity", 2, context, why=" (the model's context)" if context else "")
    capacities[view] = capacity
    new = ck.integer(f"rollout.{view}_max_new_tokens", 1)
    if capacity is not _MISSING and new is not _MISSING and new >= capacity:
      ck.add(
        f"rollout.{view}_max_new_tokens={new} must be < rollout.{view}_capacity={capacity} (the view also holds its "
        "prompt)"
      )
    if view == "user":
      ck.number("rollout.user_sampling.temperature", lambda t: t >= 0, ">= 0")
    else:
      why = " (G greedy rollouts of a task would be copies, with no advantage to learn from)"
      ck.number(f"rollout.{view}_sampling.temperature", lambda t: t > 0, "> 0", why)
    ck.number(f"rollout.{view}_sampling.top_p", lambda p: 0 < p <= 1, "in (0, 1]")
    ck.integer(f"rollout.{view}_sampling.top_k", 0)
  largest = max((c for c in capacities.values() if c is not _MISSING), default=None)
  if page is not _MISSING and largest is not None and page > largest:
    ck.add(
      f"rollout.kv_page_size={page} must be <= the largest view capacity ({largest}): a page past it holds slots no "
      "view can fill"
    )
  if grounding is not _MISSING and capacities["rehearse"] is not _MISSING and grounding >= capacities["rehearse"]:
    ck.add(
      f"rollout.grounding_max_tokens={grounding} must be < rollout.rehearse_capacity={capacities['rehearse']} (the "
      "grounding block sits in the REHEARSE view)"
    )
  user_mode = ck.one_of("rollout.user_mode", USER_MODES)
  url, name = ck.text("rollout.external_user.base_url"), ck.text("rollout.external_user.model")
  ck.text("rollout.external_user.api_key_env")
  if user_mode == "external":
    if url is not _MISSING and not re.match(r"https?://", url):
      ck.add(
        f"rollout.external_user.base_url={url!r}: rollout.user_mode='external' needs an http(s) API root, e.g. "
        "'http://127.0.0.1:30000/v1'"
      )
    if name is not _MISSING and not name:
      ck.add("rollout.external_user.model is empty: rollout.user_mode='external' needs the model name to request")
  return env_mode, user_mode


def _check_reward(ck: _Checker) -> None:
  kind = ck.one_of("reward.kind", REWARD_KINDS)
  ck.one_of("reward.arg_keys", ARG_KEYS)
  ck.number("reward.malformed_penalty", lambda x: x >= 0, ">= 0")
  ck.number("reward.empty_output_penalty", lambda x: x >= 0, ">= 0")
  if kind == "judge":
    url, name = ck.text("reward.judge_url"), ck.text("reward.judge_model")
    if url is not _MISSING and not re.match(r"https?://", url):
      ck.add(
        f"reward.judge_url={url!r}: reward.kind='judge' needs an http(s) API root, e.g. 'http://127.0.0.1:8000/v1' "
        "(or --config.reward.kind=rule: the offline gold-action reward, no judge)"
      )
    if name is not _MISSING and not name:
      ck.add("reward.judge_model is empty: reward.kind='judge' needs the judge's model name")
  ck.text("reward.judge_api_key_env")
  ck.number("reward.judge_temperature", lambda x: x >= 0, ">= 0")
  ck.number("reward.judge_top_p", lambda x: 0 < x <= 1, "in (0, 1]")
  ck.integer("reward.judge_max_tokens", 1)
  ck.integer("reward.judge_max_retries", 0)
  ck.number("reward.judge_timeout_s", lambda x: x > 0, "> 0")
  ck.one_of("reward.judge_schema", JUDGE_SCHEMAS)
  ck.one_of("reward.judge_granularity", JUDGE_GRANULARITIES)
  ck.one_of("reward.unfinished_turn", UNFINISHED_TURNS)
  ck.one_of("reward.required_items", REQUIRED_ITEMS)
  ck.one_of("reward.judge_transcript", JUDGE_TRANSCRIPTS)
  template = ck.text("reward.judge_prompt_file")
  if template and template is not _MISSING:
    from envace_jax.rl import judge  # httpx, no model: cheap

    try:
      judge.load_prompt_template(template)
    except ValueError as e:  # RewardConfigError
      ck.add(f"reward.judge_prompt_file={template!r}: {e}")


def smallest_learning_rate(param_dtype: str) -> float:
  """The smallest learning rate whose AdamW step still moves a weight of ``TYPICAL_WEIGHT`` stored in
  ``param_dtype``: half the dtype's spacing there (bfloat16: 2^-6 * 2^-7 / 2 = 6.1e-5; float16: 7.6e-6; float32:
  9.3e-10). An AdamW step is about the learning rate at most (exactly lr * sign(g) at step 1); a smaller one
  rounds back to the stored weight, so such a weight never trains (issue 40: bfloat16 weights at lr 1e-6 moved
  0.31% of a tiny Qwen3's weights in one update, float32 master weights 51.5%)."""
  spacing = 2.0 ** math.floor(math.log2(TYPICAL_WEIGHT)) * float(ml_dtypes.finfo(np.dtype(param_dtype)).eps)
  return spacing / 2


def _check_precision(ck: _Checker, rates: Sequence[tuple[str, Any]]) -> None:
  """A ``param_dtype`` below float32 (the master weights' dtype) must hold a step of every learning rate used."""
  dtype = ck.get("param_dtype", quiet=True)
  if dtype not in DTYPES or dtype == "float32":
    return
  low = smallest_learning_rate(dtype)
  for key, rate in rates:
    if rate is not _MISSING and 0 < rate < low:
      ck.add(
        f"param_dtype={dtype!r} cannot hold a step of {key}={rate:g}: below {low:.2g} an AdamW step rounds back to a "
        f"weight of {TYPICAL_WEIGHT} in {dtype}, so it never trains; keep param_dtype='float32' (master weights; "
        "dtype sets the compute) or raise the rate"
      )
      return


def _power_of_two(x: float) -> bool:
  return x >= 1 and x == int(x) and not int(x) & (int(x) - 1)


def _check_grpo(ck: _Checker, benchmark: str | None, env_mode: Any, user_mode: Any) -> None:
  mode = ck.one_of("grpo.mode", MODES)
  raw_roles = ck.get("grpo.trained_roles")
  roles: tuple[str, ...] = ()
  if raw_roles is not _MISSING:
    roles = parse_names(raw_roles) if isinstance(raw_roles, str | list | tuple) else ()
    unknown = [r for r in roles if r not in ROLES]
    if not roles or unknown:
      ck.add(
        f"grpo.trained_roles={raw_roles!r} must be a non-empty subset of {_choices(ROLES)}"
        + (f"; unknown: {_choices(unknown)}" if unknown else "")
      )
      roles = ()
  ck.one_of("grpo.weighting", WEIGHTINGS)
  ck.one_of("grpo.baseline_groups", BASELINE_GROUPS)
  ck.one_of("grpo.lone_member_advantage", LONE_MEMBER_ADVANTAGES)
  ck.one_of("grpo.loss_aggregation", LOSS_AGGREGATIONS)
  ck.boolean("grpo.std_normalize")
  ck.boolean("grpo.fresh_optimizer_after_sft")
  ck.number("grpo.adv_eps", lambda x: x > 0, "> 0")
  ck.number("grpo.clip_eps_low", lambda x: 0 <= x < 1, "in [0, 1)")
  ck.number("grpo.clip_eps_high", lambda x: x >= 0, ">= 0")
  ck.number("grpo.clip_ratio_c", lambda x: x > 1, "> 1")
  ck.boolean("grpo.use_kl")
  ck.number("grpo.kl_coef", lambda x: x >= 0, ">= 0")
  ck.one_of("grpo.kl_estimator", KL_ESTIMATORS)
  rate = ck.number("grpo.learning_rate", lambda x: x > 0, "> 0")
  sft_rate = ck.number("grpo.sft_learning_rate", lambda x: x >= 0, ">= 0 (0: grpo.learning_rate)")
  rates = [("grpo.learning_rate", rate)]
  if ck.get("train.sft_warmup_steps", quiet=True) not in (0, _MISSING):
    rates.append(("grpo.sft_learning_rate", sft_rate))
  _check_precision(ck, rates)
  ck.number("grpo.weight_decay", lambda x: x >= 0, ">= 0")
  for key in ("adam_b1", "adam_b2"):
    ck.number(f"grpo.{key}", lambda x: 0 <= x < 1, "in [0, 1)")
  ck.number("grpo.adam_eps", lambda x: x > 0, "> 0")
  ck.number("grpo.max_grad_norm", lambda x: x > 0, "> 0")
  ck.integer("grpo.micro_batch_size", 1)
  for key in ("length_bucket", "head_chunk"):
    if ck.integer(f"grpo.{key}", 1) is not _MISSING and not _power_of_two(ck.config.grpo[key]):
      ck.add(f"grpo.{key}={ck.config.grpo[key]} must be a power of 2")
  ck.boolean("grpo.remat")
  ck.boolean("grpo.pack_shared_prefix")
  ck.integer("grpo.min_shared_prefix", 1)
  ck.integer("grpo.max_packed_length", 0)
  ck.boolean("grpo.dynamic_sampling")
  ck.integer("grpo.dynamic_sampling_max_draws", 0)
  ck.one_of("grpo.old_logprobs", OLD_LOGPROBS)
  # How the pieces fit together.
  if mode == "grpo_real_env":
    if env_mode in ENV_MODES and env_mode != "real":
      ck.add("grpo.mode='grpo_real_env' trains against the real tools: also pass --config.rollout.env_mode=real")
    if "rehearse" in roles:
      ck.add("grpo.mode='grpo_real_env' has no REHEARSE rows: pass --config.grpo.trained_roles=act")
  elif mode in MODES and env_mode == "real":
    ck.add(
      f"grpo.mode={mode!r} rehearses the environment, but rollout.env_mode='real'; set rollout.env_mode='rehearse', "
      "or grpo.mode='grpo_real_env' for the real-environment baseline"
    )
  if mode == "per_role" and "user" in roles:
    ck.add("grpo.mode='per_role' keeps parameter trees for 'act' and 'rehearse' only; drop 'user' from trained_roles")
  bench = registry.get(benchmark) if benchmark else None
  if bench and bench.tools_unreachable and env_mode == "real":
    ck.add(
      f"rollout.env_mode='real' needs {bench.tools_unreachable}; use rollout.env_mode='rehearse' (the rehearsing role "
      "stands in for them)"
    )
  if bench and bench.judged and ck.get("reward.kind") == "rule":
    ck.add(
      f"env.benchmark={benchmark!r} is scored by an LLM judge over its rubrics (it has no gold actions): set "
      "--config.reward.kind=judge --config.reward.judge_url=URL --config.reward.judge_model=NAME"
    )
  if "user" in roles:
    if bench and bench.logged_user_turns:
      ck.add(f"grpo.trained_roles has 'user', but {benchmark} replays logged user turns: there are no USER rows")
    elif user_mode in USER_MODES and user_mode != "policy":
      ck.add(
        f"grpo.trained_roles has 'user', but rollout.user_mode={user_mode!r}: only the policy's own user turns "
        "(rollout.user_mode='policy') can be trained"
      )


def _check_eval(ck: _Checker) -> None:
  ck.integer("eval.num_trials", 1)
  tasks = ck.integer("eval.tasks", -1, why=" (-1: every task of env.eval_split)")
  if tasks == 0:
    ck.add("eval.tasks=0: --mode=eval needs at least one task; set a count or -1 (every task of env.eval_split)")
  raw = ck.get("eval.rehearsal")
  if raw is not _MISSING:
    modes = parse_names(raw) if isinstance(raw, str | tuple | list) else ()
    bad = [m for m in modes if m not in REHEARSAL]
    if not modes or bad:
      ck.add(
        f"eval.rehearsal={raw!r} is not valid; choose one or more of {_choices(REHEARSAL)}, comma-separated "
        "(e.g. --config.eval.rehearsal=off,parallel)"
      )
  ck.integer("eval.rehearsal_n", 1)
  ck.one_of("eval.rehearsal_user", REHEARSAL_USERS)
  ck.one_of("eval.rehearsal_control", REHEARSAL_CONTROLS)
  for key in ("eval.assessment_max_tokens", "eval.memory_max_tokens", "eval.digest_max_tokens"):
    ck.integer(key, 1)
  ck.boolean("eval.fidelity")
  ck.boolean("eval.fidelity_gold")
  ck.boolean("eval.reward_gap")
  ck.number("eval.sampling.temperature", lambda t: t >= 0, ">= 0", " (0: greedy)")
  ck.number("eval.sampling.top_p", lambda p: 0 < p <= 1, "in (0, 1]")
  ck.integer("eval.sampling.top_k", 0)


def validate(config, *, weights: bool = True) -> None:
  """Checks a run's config (a ``ml_collections.ConfigDict`` from configs/*.py); loads no model, computes nothing.

  Checks every key the training loop reads: enum values (modes, roles, benchmark, domain/category, splits), ranges
  (G >= 2, lr > 0, capacities within the model's context, ...), files (the module docstring), and that the settings
  fit together (grpo_real_env needs env_mode="real", a trained "user" role needs the policy to play the user, ...).
  ``weights=False`` (``--mode=plan``, which reads only shapes): a preset needs no weights on disk.

  Raises:
    ConfigError: one or more problems; ``ConfigError.problems`` lists them, each naming the key, its value and the
      valid values (or the flag that fixes it).
  """
  ck = _Checker(config)
  ck.integer("seed", 0)
  names = ck.text("presets")
  for name in names.split(",") if isinstance(names, str) and names else ():
    if name not in PRESETS:
      known = ", ".join(repr(p) for p in PRESETS)
      where = "--config=FILE:ARG+PRESET, or FILE:PRESET for a config that takes no ARG"
      ck.add(f"presets: unknown preset {name!r} ({where}); known: {known}")
  context = _check_model(ck, weights)
  _check_mesh(ck)
  for key in ("sampler.prefill_chunk", "sampler.min_bucket"):  # `Sampler` refuses other values
    value = ck.integer(key, 1)
    if value is not _MISSING and not _power_of_two(value):
      ck.add(f"{key}={value} must be a power of 2")
  benchmark = _check_env(ck)
  _check_train(ck, benchmark)
  env_mode, user_mode = _check_rollout(ck, context)
  _check_reward(ck)
  _check_grpo(ck, benchmark, env_mode, user_mode)
  _check_eval(ck)
  if ck.problems:
    raise ConfigError(ck.problems)
