"""The sampler demo: one ACT turn with a tool schema on real weights, G samples sharing one prefill.

Loads the configured model (offline), renders a system prompt with the tools and a user turn, prefills it once,
forks the cache G ways, samples until ``</tool_call>`` or ``<|im_end|>``, and parses each sample into a tool call,
a reply or a typed parse error. With the ``tiny`` preset (random weights, no tokenizer) it samples from random ids.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import logging

from envace_jax import runtime
from envace_jax.model import tool_format, transformer
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message
from envace_jax.sampling import sharding
from envace_jax.sampling.sampler import Sampler, SamplingParams


def load_model(cfg):
  """(ModelConfig, params, Tokenizer or None) for the config's model (``runtime.load_model``), offline."""
  model = runtime.load_model(cfg)
  return model.config, model.params, model.tokenizer


def run(cfg, workdir: str | None = None) -> list[dict]:
  """Runs the demo and prints each sample; returns one dict per sample (text, tokens, finish reason, action)."""
  del workdir  # the demo writes nothing
  start = time.perf_counter()
  model_config, params, tokenizer = load_model(cfg)
  load_s = time.perf_counter() - start
  group = cfg.demo.num_samples
  mesh = sharding.mesh_from_config(cfg.mesh)
  if group % sharding.batch_size_multiple(mesh):
    mesh = None  # the batch cannot be split evenly: run on one device
  sampler = Sampler(
    model_config,
    params,
    eos_ids=tokenizer.eos_ids if tokenizer else (),
    token_bytes=tokenizer.token_bytes() if tokenizer else None,
    pad_id=(tokenizer.pad_id or 0) if tokenizer else 0,
    mesh=mesh,
    **runtime.sampler_options(cfg),
  )
  tools = json.loads(cfg.demo.tools_json)
  if tokenizer:
    chat = [Message("system", cfg.demo.system), Message("user", cfg.demo.user)]
    ids, roles = tokenizer.render(chat, tools=tools, add_generation_prompt=True)
  else:
    ids = np.asarray(jax.random.randint(jax.random.key(cfg.seed), (24,), 0, model_config.vocab_size), np.int32)
    roles = np.full_like(ids, int(Role.USER))
  # Group prefix sharing: prefill all but the last prompt token once, fork G ways, feed the last token per row.
  cache = sampler.init_cache(batch=1, capacity=cfg.sampler.capacity)
  cache, _, fitted, _ = sampler.prefill(cache, [ids[:-1]], [roles[:-1]])
  if not fitted[0]:
    raise ValueError(
      f"the {len(ids)}-token prompt does not fit sampler.capacity={cfg.sampler.capacity}; "
      "raise --config.sampler.capacity."
    )
  cache = sampler.fork(cache, group)
  if mesh is not None:
    cache = jax.device_put(cache, sharding.cache_shardings(sampler.config, mesh, cache))
  sampling = SamplingParams(cfg.sampler.temperature, cfg.sampler.top_p, cfg.sampler.top_k)
  if sampling.temperature == 0 and group > 1:
    sampling = SamplingParams(temperature=0.7, top_p=0.95)  # G greedy samples would all be equal
    print(f"{group} samples of one prompt: sampling at temperature 0.7, top-p 0.95 instead of greedy")
  start = time.perf_counter()
  out, _ = sampler.generate(
    cache,
    [ids[-1:]] * group,
    [roles[-1:]] * group,
    role=Role.ACT,
    key=jax.random.key(cfg.seed),
    max_new_tokens=cfg.sampler.max_new_tokens,
    sampling=sampling,
    stop_strings=(tool_format.TOOL_CALL_CLOSE,) if tokenizer else (),
  )
  sample_s = time.perf_counter() - start
  print(f"model {cfg.model}: {transformer.param_count(params) / 1e6:.1f}M params, loaded in {load_s:.1f} s")
  print(f"prompt {len(ids)} tokens (prefilled once for {group} samples); sampled in {sample_s:.1f} s (with compile)")
  results = []
  for b in range(group):
    row = out.row(b)
    text = tokenizer.decode(row) if tokenizer else " ".join(map(str, row))
    action = tool_format.parse_action(text, known_tools=[t["function"]["name"] for t in tools]) if tokenizer else None
    print(f"--- sample {b}: {len(row)} tokens, finish={out.finish_reasons[b]}")
    print(text)
    if action is not None:
      print(f"=> {action.kind}: {action.call or action.error or action.reply!r}")
    results.append(dict(text=text, tokens=row, finish=str(out.finish_reasons[b]), action=action))
  logging.info("demo done: %d samples", group)
  return results
