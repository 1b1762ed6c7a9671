"""Decode and update speed of random-init Qwen3-shaped models on one accelerator, against the device's peaks.

    python experiments/device_check.py [--dry] [--out FILE.json]

Run by ``experiments/device_check.sh`` (which adds ``--mode=plan`` and the tiny main job). On an accelerator:
Qwen3-1.7B and Qwen3-8B shapes (``model/config.py`` presets) in bfloat16, weights random (the cost does not depend on
their values). ``--dry``: the ``tiny`` preset in float32 with small shapes, to check the script, not the machine; on a
CPU backend without ``--dry`` it exits with status 1 and one line (a CPU build of JAX measures nothing of interest).
Printed per model (and written to ``--out``):

  * decode: one token per row for B rows whose histories span S slots, best of ``--repeats`` runs of ``--steps``
    greedy steps after a compiled warm-up (`bench_paged.greedy_decode`: ``transformer.apply`` in a ``fori_loop``),
    in two cache layouts:
      ``dense``: a `kvcache.KVCache` of S slots per row (the sampler's per-layer layout, every slot attended);
      ``rollout``: what a rollout decodes over (`rehearsal/unfold.py` forks each task's opening G ways with
        `Sampler.fork` and ``rollout.kv_page_size``): B / G tasks whose first S / 2 slots (the opening) are a shared
        prefix level, stored and attended once per task, and each row's own S / 2 slots in pages of a
        `paged.PagedKVCache` (`ROLLOUT`: G and the page size);
    tok/s = B * steps / seconds. HBM fraction = bytes read per step / step seconds / the device's peak bandwidth,
    bytes per step = the parameters a step reads (all but the role embeddings and an untied input embedding, row
    lookups) + the keys and values of every slot stored (dense: 2 * L * B * K * H * S elements; rollout: the same
    with B / G rows of the opening and B rows of the own slots). Below 1 by what the step does besides reading (the
    head's argmax, launches, the attention's own arithmetic, a paged row's page gathers). Decode runs once per
    attention implementation for the first model (on an accelerator the backend's pick, "auto", and the reference;
    dry, "auto" and "xla" over the dense cache), so what a kernel buys (and the cost of transposing the cached keys
    for cuDNN, model/attention.py) shows up here. "same tokens": whether the B x steps greedy tokens equal those of
    the table's first line (dense, "auto"): every layout and implementation attends over the same histories (zeros),
    so False is a kernel's error or, in bfloat16, a near-tie of random logits decided by rounding;
  * update: loss and gradient of one training row of T tokens, half of them trained, as ``bench_update.py`` builds it
    (``rl.logprobs.target_logprobs``, per-layer remat), best of ``--repeats``. MFU = 6 * N * T / seconds / the
    device's peak dense bfloat16 FLOP/s, N = the parameters that multiply (all but the lookup tables): the
    model-FLOPs convention (Kaplan et al. 2020; PaLM's MFU, Chowdhery et al. 2022), which counts neither attention's
    score FLOPs nor remat's recomputation.

Peaks (vendor datasheets, dense bfloat16 without sparsity; `PEAKS`) are looked up by a substring of
``jax.devices()[0].device_kind``; an unknown device prints its rates without fractions.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from envace_jax.model import config as model_config  # noqa: E402
from envace_jax.model import paged, transformer  # noqa: E402
from envace_jax.rl import logprobs  # noqa: E402
from experiments import bench_paged, bench_update  # noqa: E402

# (substring of device_kind, HBM bytes/s, dense bfloat16 FLOP/s); first match wins, so the specific names come first.
PEAKS = (
  ("H200", 4.8e12, 989e12),
  ("H100 PCIe", 2.0e12, 756e12),
  ("H100", 3.35e12, 989e12),  # SXM
  ("A100-SXM4-40GB", 1.555e12, 312e12),
  ("A100", 2.039e12, 312e12),  # 80 GB SXM
  ("B200", 8.0e12, 2250e12),
  ("TPU v6 lite", 1.64e12, 918e12),  # v6e
  ("TPU v5 lite", 0.819e12, 197e12),  # v5e
  ("TPU v5", 2.765e12, 459e12),  # v5p
  ("TPU v4", 1.2e12, 275e12),
)

# (preset, batch B, cache slots S, training row T) per mode.
SHAPES = {
  "accelerator": (("qwen3-1.7b", 16, 4096, 4096), ("qwen3-8b", 16, 4096, 4096)),
  "dry": (("tiny", 2, 64, 512),),
}
# (rows per task G, page size Z) of the rollout layout per mode; G divides the batch. configs: rollout.kv_page_size.
ROLLOUT = {"accelerator": (4, 64), "dry": (2, 16)}


def peaks(kind: str) -> tuple[float, float] | None:
  """(HBM bytes/s, bfloat16 FLOP/s) of a ``device_kind``, or None when `PEAKS` does not know it."""
  return next(((bw, flops) for name, bw, flops in PEAKS if name in kind), None)


def _best(fn, repeats: int, prepare=lambda: ()) -> float:
  """Least wall seconds of ``repeats`` calls of fn(*prepare()) (prepared outside the timed region; each call blocks
  until its results are ready)."""
  best = float("inf")
  for _ in range(repeats):
    args = jax.block_until_ready(prepare())
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def multiplying_params(config: model_config.ModelConfig, params) -> int:
  """Parameters a token's forward multiplies by: all but the role embeddings and an untied input embedding (row
  lookups)."""
  lookups = config.num_roles * config.d_model + (0 if config.tie_embeddings else config.vocab_size * config.d_model)
  return transformer.param_count(params) - lookups


# bench_paged's greedy decode loop; the cache is donated (the 8B model's is ~10 GB).
_decode = jax.jit(bench_paged.greedy_decode, static_argnames=("config", "steps"), donate_argnames="cache")


def dense_cache(config, batch: int, slots: int, steps: int) -> tuple[transformer.KVCache, int]:
  """(A `kvcache.KVCache` of ``batch`` rows and ``slots`` slots filled to ``slots - steps - 1``, its stored slots
  per layer). Zeros: the cost does not depend on the values."""
  empty = transformer.init_cache(config, batch, slots)
  return empty.replace(lengths=jnp.full((batch,), slots - steps - 1, jnp.int32)), batch * slots


def rollout_cache(config, batch: int, slots: int, steps: int, group: int, page_size: int):
  """(The rollout's cache, its stored slots per layer): ``batch / group`` tasks, each a prefix level row holding an
  opening of ``slots // 2`` tokens, continued by ``group`` rows (`Sampler.fork`'s layout) whose own ``slots -
  slots // 2`` slots are pages of one pool (a `paged.PagePool` gives each row its pages, as `rehearsal/unfold.py`
  reserves them before a generation), filled to ``slots - steps - 1`` in all. Raises ValueError when ``group`` does
  not divide ``batch`` or the own slots cannot hold ``steps + 1`` tokens."""
  opening, own = slots // 2, slots - slots // 2
  if batch % group or own < steps + 1:
    raise ValueError(f"rollout_cache: batch={batch} over group={group}, {own} own slots for {steps} steps")
  prefix = transformer.init_cache(config, batch // group, opening)
  prefix = prefix.replace(lengths=jnp.full((batch // group,), opening, jnp.int32))
  width = -(-own // page_size)
  pool = paged.PagePool(batch * width, page_size)
  for row in range(batch):
    pool.grow(row, own)
  cache = paged.init_cache(config, pool, range(batch), width)
  cache = cache.replace(lengths=jnp.full((batch,), own - steps - 1, jnp.int32), prefix=prefix)
  return cache, (batch // group) * opening + batch * width * page_size


def decode(config, params, cache, stored_slots: int, steps: int, repeats: int) -> dict:
  """Decode seconds per step over ``cache`` (copied afresh for each run: `_decode` donates it), and the bytes a step
  reads: the multiplying parameters and ``stored_slots`` keys and values per layer."""
  batch = int(cache.lengths.shape[0])
  first = jnp.ones((batch,), jnp.int32)
  fresh = lambda: (jax.tree.map(jnp.copy, cache),)  # noqa: E731
  tokens = []
  run = lambda cache: tokens.append(_decode(config, params, cache, first, steps)[0]) or tokens[-1]  # noqa: E731
  compile_s = _best(run, 1, fresh)  # the first call compiles
  step_s = _best(run, repeats, fresh) / steps
  itemsize = jnp.dtype(config.dtype).itemsize
  weight_bytes = multiplying_params(config, params) * jnp.dtype(config.param_dtype).itemsize
  kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * stored_slots * itemsize
  return {
    "batch": batch,
    "slots": int(cache.filled()[0]) + steps + 1,  # a row's history after the steps
    "step_ms": step_s * 1e3,
    "tok_s": batch / step_s,
    "bytes_per_step": weight_bytes + kv_bytes,
    "compile_s": compile_s,
    "tokens": np.asarray(tokens[-1]).tolist(),
  }


def update(config, params, t: int, repeats: int) -> dict:
  """Seconds of one training row's loss and gradient (`bench_update.row`, remat per layer)."""
  batch = bench_update.row(t)
  grad = jax.jit(jax.grad(lambda p: jnp.sum(logprobs.target_logprobs(config, p, batch, remat=True)[0])))
  compile_s = _best(lambda: grad(params), 1)  # the first call compiles
  seconds = _best(lambda: grad(params), repeats)
  return {"tokens": t, "seconds": seconds, "flops": 6 * multiplying_params(config, params) * t, "compile_s": compile_s}


def check(dry: bool, steps: int, repeats: int) -> dict:
  """Every model of the mode's `SHAPES`: decode per cache layout and attention variant, and the update, with
  fractions of the peaks."""
  device = jax.devices()[0]
  peak = peaks(device.device_kind)
  dtype = "float32" if dry else "bfloat16"
  variants = ("auto", "xla") if jax.default_backend() == "cpu" else ("auto", "reference")
  report = {"device": device.device_kind, "backend": jax.default_backend(), "peaks": peak, "models": []}
  mode = "dry" if dry else "accelerator"
  group, page_size = ROLLOUT[mode]
  for i, (name, batch, slots, t) in enumerate(SHAPES[mode]):
    config = model_config.get_model_config(name, dtype=dtype, param_dtype=dtype)
    params = jax.jit(transformer.init_params, static_argnames="config")(config, jax.random.key(0))
    entry = {"model": name, "params": transformer.param_count(params), "decode": {"dense": {}, "rollout": {}}}
    entry["update"] = update(config, params, t, repeats)
    per_layer = transformer.unstack_layers(params)
    del params
    per_layer_config = config.replace(scan_layers=False)  # the samplers' layout
    for layout in entry["decode"]:
      if layout == "dense":
        cache, stored = dense_cache(per_layer_config, batch, slots, steps)
      else:
        cache, stored = rollout_cache(per_layer_config, batch, slots, steps, group, page_size)
      # The comparison once (each program compiles apart); a dry run's rollout only once ("xla" routes no cache
      # with a prefix: the same reference as "auto" on CPU).
      for variant in variants if i == 0 and not (dry and layout == "rollout") else variants[:1]:
        layered = per_layer_config.replace(attention=variant)
        entry["decode"][layout][variant] = decode(layered, per_layer, cache, stored, steps, repeats)
      del cache
    del per_layer
    rows = [row for rows in entry["decode"].values() for row in rows.values()]
    first = rows[0].pop("tokens")  # the dense cache through the backend's pick
    for row in rows[1:]:
      row["same_tokens"] = row.pop("tokens") == first
    if peak:
      for row in rows:
        row["hbm_fraction"] = row["bytes_per_step"] / (row["step_ms"] / 1e3) / peak[0]
      entry["update"]["mfu"] = entry["update"]["flops"] / entry["update"]["seconds"] / peak[1]
    report["models"].append(entry)
    print_model(entry)
  return report


def print_model(entry: dict) -> None:
  fraction = lambda row, key: f"{row[key]:.2f}" if key in row else "–"  # noqa: E731
  print(f"\n{entry['model']}: {entry['params'] / 1e9:.2f}B parameters")
  print("| cache | attention | B | S | ms/step | tok/s | GB read/step | HBM fraction | compile s | same tokens |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for layout, rows in entry["decode"].items():
    for variant, row in rows.items():
      print(
        f"| {layout} | {variant} | {row['batch']} | {row['slots']} | {row['step_ms']:.2f} | {row['tok_s']:.0f} | "
        f"{row['bytes_per_step'] / 1e9:.2f} | {fraction(row, 'hbm_fraction')} | {row['compile_s']:.0f} | "
        f"{row.get('same_tokens', '(first)')} |"
      )
  u = entry["update"]
  print(
    f"update: T={u['tokens']} in {u['seconds']:.3f} s ({u['tokens'] / u['seconds']:.0f} tok/s), "
    f"{u['flops'] / u['seconds'] / 1e12:.1f} model TFLOP/s, MFU {fraction(u, 'mfu')} (compile {u['compile_s']:.0f} s)",
    flush=True,
  )


CPU_REFUSAL = (
  "device check: JAX's backend is cpu, not an accelerator (JAX's CPU build, or no device visible; install the "
  "accelerator build: make install EXTRAS=cuda12, or tpu); pass --dry to check the script on CPU"
)


def main(argv=None) -> None:
  """Runs the check (``argv`` as the command line's); exits with status 1 and `CPU_REFUSAL` on a CPU backend
  without ``--dry``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dry", action="store_true", help="tiny shapes, to check the script (the only mode on CPU)")
  parser.add_argument("--steps", type=int, default=None, help="decode steps per timed run (default 32; dry 4)")
  parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 3; dry 1)")
  parser.add_argument("--out", default="", help="write the report as JSON here")
  args = parser.parse_args(argv)
  if not args.dry and jax.default_backend() == "cpu":
    sys.exit(CPU_REFUSAL)
  dry = args.dry
  steps = args.steps or (4 if dry else 32)
  repeats = args.repeats or (1 if dry else 3)
  device = jax.devices()[0]
  print(f"device check: {len(jax.devices())} × {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  print("dry run: tiny shapes, the script's plumbing only" if dry else "Qwen3-1.7B and Qwen3-8B shapes, bfloat16")
  peak = peaks(device.device_kind)
  if peak:
    print(f"peaks: {peak[0] / 1e12:.2f} TB/s HBM, {peak[1] / 1e12:.0f} TFLOP/s dense bfloat16 (datasheet)")
  report = check(dry, steps, repeats)
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
