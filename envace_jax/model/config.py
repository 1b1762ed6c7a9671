"""ModelConfig: the shape and numerics of a decoder, and presets for the models we use.

The Llama, Qwen2 and Qwen3 families differ only in ``qkv_bias``, ``qk_norm`` and ``tie_embeddings``. Presets:
``tiny`` (random-initialised, for CPU tests), ``smollm2-135m`` (SmolLM2-135M-Instruct, Llama family; weights.py finds
its weights) and ``qwen3-0.6b`` … ``qwen3-8b`` (the paper's backbone family; a local Hugging Face directory's
``config.json`` overrides the preset's shapes: ``get_model_config``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from envace_jax.config.choices import ATTENTION, DTYPES
from envace_jax.model.roles import NUM_ROLES

FAMILIES = ("llama", "qwen2", "qwen3")


class ConfigError(ValueError):
  """A model config is inconsistent or names something we do not support."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a decoder-only transformer. Frozen and hashable, so it can be a static jit argument.

  Attributes:
    family: "llama", "qwen2" or "qwen3".
    vocab_size: V, rows of the token embedding.
    d_model: D, the residual width.
    num_layers: L.
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads (grouped-query attention; N % K == 0).
    head_dim: H.
    mlp_dim: F, the SwiGLU hidden width.
    rope_theta: base of the rotary frequencies.
    rope_scaling: None, or a sorted tuple of (key, value) items of a Hugging Face ``rope_scaling`` dict
      (``rope_type`` "llama3" or "linear" are supported).
    rms_norm_eps: epsilon inside every RMSNorm.
    tie_embeddings: the output head reuses the token embedding (transposed).
    qkv_bias: q/k/v projections have a bias (Qwen2).
    qk_norm: per-head RMSNorm on queries and keys before the rotary embedding (Qwen3).
    num_roles: rows of the role-embedding table (see roles.py).
    max_seq_len: the model's context length, in tokens.
    dtype: compute dtype of activations ("float32" on CPU, "bfloat16" on accelerators). Logits are always float32.
    param_dtype: dtype parameters are created and stored in.
    scan_layers: run the layers as one ``nn.scan`` over parameters stacked on a leading L axis (fast to compile:
      training and checkpoints), or as L separate layers ``layers_0 .. layers_{L-1}`` (fast to run on CPU and GPU,
      where slicing a layer out of a stacked array copies it: the sampler uses this). ``transformer.unstack_layers``
      and ``stack_layers`` convert the parameter trees.
    attention: the attention kernel: "auto" (by ``jax.default_backend()``: cuDNN on GPU, Pallas on TPU, the
      reference on CPU, each where it can express the call) or one implementation forced where it can
      ("reference", "xla", "cudnn", "pallas_tpu"); see model/attention.py.
  """

  family: str
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = False
  qk_norm: bool = False
  num_roles: int = NUM_ROLES
  max_seq_len: int = 8192
  dtype: str = "float32"
  param_dtype: str = "float32"
  scan_layers: bool = True
  attention: str = "auto"

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ConfigError(f"family={self.family!r} is not supported; use one of {FAMILIES}.")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
        f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
        "grouped-query attention needs each KV head to serve a whole number of query heads."
      )
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ConfigError(f"{name}={getattr(self, name)!r}; use one of {DTYPES}.")
    if self.attention not in ATTENTION:
      raise ConfigError(f"attention={self.attention!r}; use one of {ATTENTION}.")
    if self.rope_scaling is not None:
      kind = dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type"))
      if kind not in ("llama3", "linear", "default"):
        raise ConfigError(f"rope_scaling type {kind!r} is not supported; supported: llama3, linear, default.")

  @property
  def num_groups(self) -> int:
    """G = N / K, query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes) -> ModelConfig:
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf_config(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
    """Builds a config from a Hugging Face ``config.json`` dict (LlamaConfig, Qwen2Config or Qwen3Config).

    Raises:
      ConfigError: the model_type is not llama/qwen2/qwen3, or a feature we do not implement is switched on.
    """
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
      raise ConfigError(f"config.json model_type={model_type!r} is not supported; use one of {FAMILIES}.")
    if hf.get("use_sliding_window"):
      raise ConfigError("use_sliding_window=true is not supported; every layer here attends to the full context.")
    if model_type == "llama" and hf.get("mlp_bias"):
      raise ConfigError("mlp_bias=true is not supported.")
    heads = hf["num_attention_heads"]
    # transformers >= 5 nests the rotary settings in rope_parameters; older versions use rope_theta/rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else hf.get("rope_scaling")
    fields = dict(
      family=model_type,
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope_theta),
      rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", model_type != "llama")),
      qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
      qk_norm=model_type == "qwen3",
      max_seq_len=int(hf.get("max_position_embeddings", 8192)),
    )
    fields.update(overrides)
    return cls(**fields)

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike, **overrides) -> ModelConfig:
    """Reads ``<path>/config.json``; see ``from_hf_config``."""
    with open(os.path.join(path, "config.json")) as f:
      return cls.from_hf_config(json.load(f), **overrides)

  def to_hf_config(self) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict for this config (used by ``weights.save_hf``)."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.family]
    hf = {
      "architectures": [arch],
      "model_type": self.family,
      "vocab_size": self.vocab_size,
      "hidden_size": self.d_model,
      "num_hidden_layers": self.num_layers,
      "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads,
      "head_dim": self.head_dim,
      "intermediate_size": self.mlp_dim,
      "rope_theta": self.rope_theta,
      "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
      "rope_parameters": {"rope_type": "default", **dict(self.rope_scaling or ()), "rope_theta": self.rope_theta},
      "rms_norm_eps": self.rms_norm_eps,
      "tie_word_embeddings": self.tie_embeddings,
      "max_position_embeddings": self.max_seq_len,
      "hidden_act": "silu",
      "torch_dtype": "float32",
    }
    if self.family == "llama":
      hf.update(attention_bias=self.qkv_bias, mlp_bias=False)
    if self.family == "qwen3":
      hf["attention_bias"] = False
    if self.family in ("qwen2", "qwen3"):
      hf.update(use_sliding_window=False, sliding_window=None)
    return hf


_QWEN3 = dict(family="qwen3", vocab_size=151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_seq_len=40960)

PRESETS: dict[str, ModelConfig] = {
  "tiny": ModelConfig(
    family="llama",
    vocab_size=512,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=False,
    max_seq_len=1024,
  ),
  "smollm2-135m": ModelConfig(
    family="llama",
    vocab_size=49152,
    d_model=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    mlp_dim=1536,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=True,
    max_seq_len=8192,
  ),
  "qwen3-0.6b": ModelConfig(
    **_QWEN3, d_model=1024, num_layers=28, num_heads=16, num_kv_heads=8, mlp_dim=3072, tie_embeddings=True
  ),
  "qwen3-1.7b": ModelConfig(
    **_QWEN3, d_model=2048, num_layers=28, num_heads=16, num_kv_heads=8, mlp_dim=6144, tie_embeddings=True
  ),
  "qwen3-4b": ModelConfig(
    **_QWEN3, d_model=2560, num_layers=36, num_heads=32, num_kv_heads=8, mlp_dim=9728, tie_embeddings=True
  ),
  "qwen3-8b": ModelConfig(
    **_QWEN3, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8, mlp_dim=12288, tie_embeddings=False
  ),
}


def get_model_config(name_or_dir: str, **overrides) -> ModelConfig:
  """A preset by name, or the config of a local Hugging Face directory (its ``config.json`` wins).

  Raises:
    ConfigError: neither a preset name nor a directory holding config.json.
  """
  if os.path.isfile(os.path.join(name_or_dir, "config.json")):
    return ModelConfig.from_hf_dir(name_or_dir, **overrides)
  if name_or_dir in PRESETS:
    return PRESETS[name_or_dir].replace(**overrides) if overrides else PRESETS[name_or_dir]
  raise ConfigError(f"{name_or_dir!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json.")
