"""Sampler throughput on SmolLM2-135M-Instruct (float32), side by side with transformers + torch ``generate``.

    python -m experiments.bench_sampler --quick     # batch {1, 8} x context {256}; ~10 minutes
    python -m experiments.bench_sampler             # batch {1, 8, 32} x context {256, 1024, 4096}; long (see below)
    python -m experiments.bench_sampler --batches 1,8 --contexts 256,1024 --repeats 3 --skip-turns

Run from the repository root (``-m`` puts it on ``sys.path``). Prints, under a header naming the machine:
  1. prefill and decode tokens/s per (batch, context), ours vs torch: greedy, float32, EOS off, the same prompt ids;
  2. this machine's memory read bandwidth and the batch-1 decode limit it implies (bandwidth / weight bytes), and
     the rate XLA's own batch-1 matvecs read the same weights at (``matvec_floor``): what any XLA decode can reach;
  3. the per-turn cost of a multi-turn conversation: continuation (keep the cache, prefill only the new turn) vs
     re-prefill (an empty cache and the whole history every turn).

How each cell is measured (both sides alike; prompts are real text tokens, tiled, each row rotated so rows differ):
  * Prefill: our ``Sampler.prefill`` of the whole prompt into an empty cache; torch's forward over the whole prompt
    (``use_cache=True``, ``logits_to_keep=1``, as ``generate`` does). prefill tok/s = B * context / seconds.
  * Decode: from that prefilled state, a 1-token prompt continuation, then ``generate`` with ``max_new_tokens=1``
    and ``=N+1`` (our ``Sampler.generate`` on a copy of the prefilled cache; torch ``generate`` with a copy of its
    prefilled ``DynamicCache``). Both runs pay the same 1-token prefill and the same first sample; the N+1 run does
    exactly N more single-token forwards and samples, so decode tok/s = B * N / (t[N+1] - t[1]). Starting from the
    prefilled state rather than calling ``generate`` on the whole prompt twice keeps the long-context prefill out
    of both runs (it would dominate the difference's noise and the runtime). Our loop also runs one forward after
    the last sampled token (so the cache holds it for the next turn): it is in both runs and cancels.
  * Our cache capacity is context + N + 2 (the prompt, the continuation token and N+1 sampled tokens). Our
    attention reads a power-of-two bucket of the filled slots capped at the capacity: here every slot.
  * Compilation is excluded: before timing, every compiled variant the timed runs use runs once on a scratch cache
    (one chunk per attention bucket the prompt reaches, as the sampler attends over a power-of-two bucket of the
    filled slots; decode with 1 and N+1 tokens from a full prompt; the turn table's whole schedule).
    ``compile_counts`` is checked afterwards and a cell that recompiled while timed is flagged. Torch gets one small
    untimed ``generate`` first.
  * Each number is the best of ``--repeats`` runs, except prefills slower than ``--max-repeat-s`` seconds, which
    are measured once (long-context prefills are minutes each on a small CPU). Cache allocation and copies are
    outside the timed region; every timed region ends with ``jax.block_until_ready`` (torch on CPU is synchronous).
  * ``same`` counts rows whose N+1 greedy tokens are identical on both sides (a check that both ran the same task).

Runtime and memory (2-core EPYC VM, 23 GiB): ``--quick`` takes about 10 minutes, the turn table about half of it. The
full grid is 221k prompt tokens per side plus warm-ups: expect 1.5-2 hours. Our prefill slows with context as
attention's share of the FLOPs grows (SmolLM2 is narrow: at context 4096 attention costs about as much as the rest of a
layer); at batch 1, ``--batches 1 --contexts 256,4096 --skip-turns`` (2026-12-02, the grid paused): 663 and 311 tok/s
(torch 582 and 408) with attention over key blocks (transformer.KEY_BLOCK, then 512; 256 since), 608 and 265 (torch 414
and 389) with dense attention over the whole bucket before it. Memory: batch 32 x context 4096 holds two 6.1 GB caches
plus the prefill's attention temporaries; at the default prefill chunk (512) it reached 21.7 GB on our side and was
killed on this 23 GB machine (with tests running alongside); ``--prefill-chunk 256`` halves the temporaries. Pass
``--results FILE`` on long runs: every cell is saved as it is measured, and a rerun with the same flags reuses them.
Run it on a quiet machine: each row and the header report how many cores other processes used (and the hypervisor
stole) while it ran, and flag anything above 0.2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import dataclasses
import gc
import io
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envace_jax.model import transformer, weights
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Tokenizer
from envace_jax.sampling.sampler import GREEDY, Sampler

# Prompt text: tiled to the context length. Real text keeps activations (and greedy argmax margins) realistic.
_TEXT = """\
The history of computing is a history of memory. Early machines stored their programs on punched cards and paper
tape, and a computation could run only as fast as the reader could feed it. Delay lines, magnetic drums and core
memory followed, each faster and denser than the last, and each changed what programmers thought was worth
computing. Today a single processor core can perform billions of arithmetic operations per second, yet it still
waits on memory: a value that is not in a cache takes hundreds of cycles to arrive. Much of the art of writing fast
software is therefore the art of moving less data, of arranging work so that what has been fetched is used many
times before it is thrown away. Language models make this trade-off plain. To produce one token, a model must read
every one of its weights; to produce a token for each of thirty-two conversations at once, it reads them once and
uses them thirty-two times. The cost of a conversation is not only its length but how it is served: whether the
history is kept and extended, or recomputed from the beginning at every turn.
"""

_PREFILL_ROLE = int(Role.USER)
_GEN_ROLE = int(Role.ACT)


def log(message: str) -> None:
  """Progress on stderr (the report goes to stdout)."""
  print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- setup


def machine_header() -> list[str]:
  import torch
  import transformers

  cpu = platform.processor() or "unknown cpu"
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  devices = ", ".join(str(d) for d in jax.devices())
  return [
    f"machine: {os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}, "
    f"python {platform.python_version()}",
    f"jax {jax.__version__} (backend {jax.default_backend()}: {devices}), numpy {np.__version__}",
    f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}",
  ]


def load_ours(prefill_chunk: int) -> tuple[Sampler, Tokenizer, int]:
  """(greedy Sampler with EOS off, tokenizer, parameter count)."""
  pretrained = weights.load_pretrained("smollm2-135m")
  tokenizer = Tokenizer.from_hf_dir(pretrained.path)
  sampler = Sampler(
    pretrained.config, pretrained.params, eos_ids=(), pad_id=tokenizer.pad_id, prefill_chunk=prefill_chunk
  )
  return sampler, tokenizer, transformer.param_count(pretrained.params)


def load_torch():
  """The transformers reference from the same GGUF (as tests/conftest.py loads it), float32, eval mode."""
  import torch
  import transformers

  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  path = weights.smollm2_gguf_path()
  with contextlib.redirect_stderr(io.StringIO()):  # the GGUF dequantisation progress bar
    model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
  return model.eval()


def text_ids(tokenizer: Tokenizer, batch: int, length: int, offset: int = 0) -> np.ndarray:
  """int32[batch, length]: the text's tokens tiled; row b starts 37*b tokens later (rows differ)."""
  base = np.asarray(tokenizer.encode(_TEXT), np.int32)
  need = offset + 37 * batch + length
  tiled = np.tile(base, need // len(base) + 1)
  return np.stack([tiled[offset + 37 * b : offset + 37 * b + length] for b in range(batch)])


def best_time(fn: Callable[[], float], repeats: int, max_repeat_s: float = float("inf")) -> float:
  """min over ``repeats`` calls of fn (each returns its own timed seconds); stops early once a run exceeds
  max_repeat_s."""
  best = float("inf")
  for _ in range(repeats):
    best = min(best, fn())
    if best > max_repeat_s:
      break
  return best


def scratch_cache(sampler: Sampler, batch: int, capacity: int, fill: int) -> transformer.KVCache:
  """An empty cache whose rows claim ``fill`` filled slots: a prefill or decode on it compiles (and runs) exactly the
  variant a real cache holding ``fill`` tokens would need (the attention bucket depends on the fill). Its contents
  are zeros: warm-up only."""
  cache = sampler.init_cache(batch, capacity)
  return transformer.KVCache(k=cache.k, v=cache.v, lengths=jnp.full_like(cache.lengths, fill))


def bucket_fills(sampler: Sampler, context: int, capacity: int) -> list[int]:
  """One fill per distinct attention bucket that prefilling ``context`` tokens chunk by chunk reaches (the fill
  before the chunk: chunk k of a prompt starts at k * prefill_chunk)."""
  fills, seen = [], set()
  for start in range(0, context, sampler.prefill_chunk):
    attend = min(sampler.attend_bucket(min(start + sampler.prefill_chunk, context)), capacity)
    if attend not in seen:
      seen.add(attend)
      fills.append(start)
  return fills


def copy_cache(cache):
  """A fresh copy of a KVCache (``generate`` donates the cache it is given)."""
  return jax.block_until_ready(jax.tree.map(jnp.copy, cache))


class CpuMeter:
  """How busy the machine was apart from this process: average cores used by other processes, and cores stolen by
  the hypervisor, between start() and stop() (from /proc/stat and os.times; NaN where /proc/stat is missing)."""

  def __init__(self):
    self._start = self._sample()

  @staticmethod
  def _sample() -> tuple[float, float, float, float]:
    own = os.times()
    try:
      with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]] + [0] * 8
      tick = os.sysconf("SC_CLK_TCK")
      user, nice, system, _, _, irq, softirq, steal = fields[:8]
      busy, stolen = (user + nice + system + irq + softirq) / tick, steal / tick
    except (OSError, ValueError):
      busy = stolen = float("nan")
    return time.perf_counter(), busy, stolen, own.user + own.system

  def stop(self) -> tuple[float, float]:
    """(other processes' cores, stolen cores) on average since construction."""
    end = self._sample()
    wall = max(end[0] - self._start[0], 1e-9)
    others = (end[1] - self._start[1] - (end[3] - self._start[3])) / wall
    return max(others, 0.0), (end[2] - self._start[2]) / wall


def busy_note(others: float, stolen: float) -> str:
  """'' on a quiet machine, else a short warning."""
  return f"(!) busy: others {others:.2f} cores, steal {stolen:.2f}" if others > 0.2 or stolen > 0.2 else ""


# ---------------------------------------------------------------------------------------------------- grid


@dataclasses.dataclass
class Cell:
  batch: int
  context: int
  new_tokens: int
  capacity: int
  ours_prefill_s: float = float("nan")
  ours_decode_s: float = float("nan")
  torch_prefill_s: float = float("nan")
  torch_decode_s: float = float("nan")
  same_rows: int = -1
  recompiled: int = 0
  others: float = float("nan")  # cores used by other processes while this cell ran (CpuMeter)
  stolen: float = float("nan")

  def tok_s(self, seconds: float, tokens: int) -> float:
    return tokens / seconds if seconds > 0 else float("nan")

  @property
  def prefill_tokens(self) -> int:
    return self.batch * self.context

  @property
  def decode_tokens(self) -> int:
    return self.batch * self.new_tokens


def bench_ours(sampler: Sampler, cell: Cell, ids: np.ndarray, cont: np.ndarray, repeats: int, max_repeat_s: float):
  """Fills cell.ours_*; returns the N+1 greedy tokens int32[B, N+1] of the last timed run."""
  b, n = cell.batch, cell.new_tokens
  prompts = [row.tolist() for row in ids]
  cont_prompts = [[int(t)] for t in cont]
  key = jax.random.key(0)

  def prefill(prompt_rows):
    cache = jax.block_until_ready(sampler.init_cache(b, cell.capacity))
    start = time.perf_counter()
    cache, logits, fitted, _ = sampler.prefill(cache, prompt_rows, _PREFILL_ROLE)
    jax.block_until_ready((cache, logits))
    assert fitted.all(), "prompt did not fit the cache"
    return time.perf_counter() - start, cache

  def decode(prefilled, max_new: int):
    cache = copy_cache(prefilled)
    start = time.perf_counter()
    out, cache = sampler.generate(
      cache, cont_prompts, _PREFILL_ROLE, role=_GEN_ROLE, key=key, max_new_tokens=max_new, sampling=GREEDY
    )
    jax.block_until_ready(cache)
    seconds = time.perf_counter() - start
    assert (out.lengths == max_new).all(), f"rows stopped early: {out.lengths} (EOS should be off)"
    return seconds, out

  # Warm-up: every compiled variant the timed runs use, each run once on a scratch cache (see `scratch_cache`): one
  # chunk per attention bucket the prompt's chunks reach, and decode with 1 and N+1 tokens from a full prompt.
  chunk = min(cell.context, sampler.prefill_chunk)
  for fill in bucket_fills(sampler, cell.context, cell.capacity):
    sampler.prefill(scratch_cache(sampler, b, cell.capacity, fill), [p[:chunk] for p in prompts], _PREFILL_ROLE)
  decode(scratch_cache(sampler, b, cell.capacity, cell.context), 1)
  decode(scratch_cache(sampler, b, cell.capacity, cell.context), n + 1)
  gc.collect()
  compiles = dict(sampler.compile_counts)

  prefilled = []

  def timed_prefill():
    seconds, cache = prefill(prompts)
    prefilled[:] = [cache]
    return seconds

  cell.ours_prefill_s = best_time(timed_prefill, repeats, max_repeat_s)
  outs = []

  def timed(max_new):
    seconds, out = decode(prefilled[0], max_new)
    outs[:] = [out]
    return seconds

  t1 = best_time(lambda: timed(1), repeats)
  t_n = best_time(lambda: timed(n + 1), repeats)
  cell.ours_decode_s = t_n - t1
  cell.recompiled += sum(sampler.compile_counts.values()) - sum(compiles.values())
  tokens = outs[0].tokens[:, : n + 1]
  del prefilled[:]
  return tokens


def bench_torch(model, cell: Cell, ids: np.ndarray, cont: np.ndarray, repeats: int, max_repeat_s: float):
  """Fills cell.torch_*; returns the N+1 greedy tokens int64[B, N+1] of the last timed run."""
  import torch

  n = cell.new_tokens
  prompt = torch.as_tensor(ids, dtype=torch.long)
  full = torch.cat([prompt, torch.as_tensor(cont, dtype=torch.long)[:, None]], dim=1)
  pad = model.generation_config.pad_token_id or 0
  kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=pad)
  with torch.no_grad():
    model.generate(full[:, :8], attention_mask=torch.ones_like(full[:, :8]), max_new_tokens=2, **kwargs)  # warm-up
    prefilled = []

    def timed_prefill():
      start = time.perf_counter()
      out = model(input_ids=prompt, attention_mask=torch.ones_like(prompt), use_cache=True, logits_to_keep=1)
      seconds = time.perf_counter() - start
      prefilled[:] = [out.cache]
      return seconds

    cell.torch_prefill_s = best_time(timed_prefill, repeats, max_repeat_s)
    outs = []

    def timed(max_new):
      cache = copy.deepcopy(prefilled[0])
      start = time.perf_counter()
      out = model.generate(full, attention_mask=torch.ones_like(full), cache=cache, max_new_tokens=max_new, **kwargs)
      seconds = time.perf_counter() - start
      assert out.shape[1] == full.shape[1] + max_new, f"generated {out.shape[1] - full.shape[1]} != {max_new} tokens"
      outs[:] = [out]
      return seconds

    t1 = best_time(lambda: timed(1), repeats)
    t_n = best_time(lambda: timed(n + 1), repeats)
  cell.torch_decode_s = t_n - t1
  tokens = outs[0][:, full.shape[1] :].numpy()
  del prefilled[:]
  return tokens


def _cell_key(batch: int, context: int, args) -> str:
  return f"B={batch} context={context} N={args.new_tokens} chunk={args.prefill_chunk} torch={not args.skip_torch}"


def load_results(path: str | None) -> dict[str, Cell]:
  """Cells measured earlier by a run with ``--results path`` (one JSON object per line), by `_cell_key`."""
  if not path or not os.path.exists(path):
    return {}
  out = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        record = json.loads(line)
        out[record.pop("key")] = Cell(**record)
  return out


def run_grid(sampler, model, tokenizer, batches, contexts, args) -> list[Cell]:
  """Measures every (batch, context) cell. With ``--results``, each measured cell is appended to that file at once
  and cells already there (same settings) are reused, so a run killed part-way (e.g. out of memory) resumes."""
  cells, done = [], load_results(args.results)
  for context in contexts:
    for batch in batches:
      n = args.new_tokens
      if _cell_key(batch, context, args) in done:
        log(f"grid B={batch} context={context}: measured earlier, read from {args.results}")
        cells.append(done[_cell_key(batch, context, args)])
        continue
      cell = Cell(batch=batch, context=context, new_tokens=n, capacity=context + n + 2)
      ids = text_ids(tokenizer, batch, context + 1)
      meter = CpuMeter()
      prompt, cont = ids[:, :context], ids[:, context]
      log(f"grid B={batch} context={context}: ours")
      ours = bench_ours(sampler, cell, prompt, cont, args.repeats, args.max_repeat_s)
      gc.collect()
      if model is not None:
        log(f"grid B={batch} context={context}: torch")
        ref = bench_torch(model, cell, prompt, cont, args.repeats, args.max_repeat_s)
        cell.same_rows = int((ours == ref).all(axis=1).sum())
        gc.collect()
      log(
        f"  ours prefill {cell.ours_prefill_s:.2f}s decode {cell.ours_decode_s:.2f}s | "
        f"torch prefill {cell.torch_prefill_s:.2f}s decode {cell.torch_decode_s:.2f}s"
      )
      cell.others, cell.stolen = meter.stop()
      cells.append(cell)
      if args.results:
        with open(args.results, "a", encoding="utf-8") as f:
          f.write(json.dumps({"key": _cell_key(batch, context, args), **dataclasses.asdict(cell)}) + "\n")
  return cells


# ---------------------------------------------------------------------------------------------------- bandwidth


def read_bandwidth(gib: float, repeats: int = 5) -> tuple[float, float]:
  """(single-thread, all-thread) memory read bandwidth in bytes/s: best-of-``repeats`` numpy sums over a
  float32 array of ``gib`` GiB (far larger than the caches); the threaded one sums one slice per CPU in parallel
  (numpy releases the GIL in reductions)."""
  array = np.full(int(gib * 2**30) // 4, 1.0, np.float32)  # written once, so every page is really mapped
  threads = os.cpu_count() or 1
  slices = np.array_split(array, threads)

  def one():
    start = time.perf_counter()
    np.sum(array)
    return time.perf_counter() - start

  def parallel(pool):
    start = time.perf_counter()
    list(pool.map(np.sum, slices))
    return time.perf_counter() - start

  one()  # warm
  single = array.nbytes / best_time(one, repeats)
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    parallel(pool)
    multi = array.nbytes / best_time(lambda: parallel(pool), repeats)
  return single, multi


def matvec_floor(params, steps: int = 16, repeats: int = 3) -> float:
  """Seconds per pass of XLA's own batch-1 matrix-vector products over every weight matrix in ``params`` (the
  sampler's tree): nothing but ``x @ W`` for each weight, in a jitted ``fori_loop`` whose passes depend on each
  other (so none is hoisted), best of ``repeats`` runs of ``steps`` passes. Each pass reads the weights once, as a
  batch-1 decode step must, so weight bytes / this time is the read rate XLA's dot kernels reach on this machine: a
  floor for any decode step compiled by XLA here, measured apart from attention, sampling and the loop's bookkeeping.
  """
  # (matrix, contracted axis): the tied embedding is the head, read as the decode reads it ("d,vd->v"); every other
  # weight is contracted over its first axis (q/k/v [D, heads, H], o [heads, H, D] and the MLP, as in the model).
  matrices, axes = [], []
  for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
    if w.ndim >= 2:
      matrices.append(w.reshape(w.shape[0], -1))
      axes.append(1 if jax.tree_util.keystr(path).endswith("['embed']") else 0)

  def run(ms, s):
    def one_pass(_, s):
      total = s
      for w, axis in zip(ms, axes, strict=True):  # a vector (perturbed by the running sum: passes chain) times W
        x = jnp.full((1, w.shape[axis]), 1.0, w.dtype) + s * 1e-30
        y = x @ w if axis == 0 else jnp.einsum("bd,vd->bv", x, w)
        total = total + jnp.sum(y) * 1e-30
      return total

    return jax.lax.fori_loop(0, steps, one_pass, s)

  run = jax.jit(run)
  run(matrices, jnp.float32(0)).block_until_ready()  # compile

  def timed():
    start = time.perf_counter()
    run(matrices, jnp.float32(0)).block_until_ready()
    return time.perf_counter() - start

  return best_time(timed, repeats) / steps


# ---------------------------------------------------------------------------------------------------- turns


@dataclasses.dataclass
class Turn:
  k: int
  history: int  # tokens of history per row before this turn's generation (prompt of the re-prefill)
  cont_s: float = float("nan")
  cont_prefilled: int = 0
  reprefill_s: float = float("nan")
  reprefill_prefilled: int = 0
  torch_cont_s: float = float("nan")
  torch_reprefill_s: float = float("nan")
  same_rows: int = -1  # rows whose re-prefill tokens equal the continuation's (ours)
  torch_same_rows: int = -1
  generated: np.ndarray | None = dataclasses.field(default=None, repr=False)  # int32[B, turn_new], continuation


def run_turns(sampler: Sampler, model, tokenizer, args) -> tuple[list[Turn], int, int, tuple[float, float]]:
  """Per-turn seconds of a k-turn conversation: continuation vs re-prefill (ours, and torch for reference).

  Each turn appends ``turn_prompt`` new tokens per row and generates ``turn_new`` (EOS off). Continuation keeps one
  cache and prefills only the new turn; re-prefill starts each turn from an empty cache with the whole history
  (the previous turns' prompts and the continuation's generated tokens), as a sampler without continuation would.
  Both use the same cache capacity (so the same per-step decode cost); allocating the empty cache is not timed.
  Returns (turns, compiles during the timed runs, capacity, CpuMeter reading of the timed runs).
  """
  b, p, g, turns_n = args.turn_batch, args.turn_prompt, args.turn_new, args.turns
  capacity = turns_n * (p + g)
  pieces = [text_ids(tokenizer, b, p, offset=1000 + 211 * k) for k in range(turns_n)]
  key = jax.random.key(1)

  def generate(cache, prompt_rows):
    start = time.perf_counter()
    out, cache = sampler.generate(cache, prompt_rows, _PREFILL_ROLE, role=_GEN_ROLE, key=key, max_new_tokens=g)
    jax.block_until_ready(cache)
    assert (out.lengths == g).all(), f"rows stopped early: {out.lengths}"
    return time.perf_counter() - start, out, cache

  # Warm-up: the whole schedule once, untimed (continuation and re-prefill), so every prompt-chunk size and attention
  # bucket the timed turns reach is compiled; the timed run below repeats it exactly (greedy, same prompts).
  log(f"turns: warm-up (B={b}, capacity {capacity}, the whole schedule once)")
  warm, history = sampler.init_cache(b, capacity), [[] for _ in range(b)]
  for k in range(turns_n):
    _, out, warm = generate(warm, [piece.tolist() for piece in pieces[k]])
    for row in range(b):
      history[row] += pieces[k][row].tolist() + out.tokens[row, :g].tolist()
    generate(sampler.init_cache(b, capacity), [h[: len(h) - g] for h in history])
  del warm
  compiles = sum(sampler.compile_counts.values())

  meter = CpuMeter()
  results, histories = [], [[] for _ in range(b)]
  cache = jax.block_until_ready(sampler.init_cache(b, capacity))
  for k in range(turns_n):
    for row in range(b):
      histories[row].extend(pieces[k][row].tolist())
    turn = Turn(k=k + 1, history=len(histories[0]))
    log(f"turns: k={turn.k} (history {turn.history} tokens/row)")
    turn.cont_s, out, cache = generate(cache, [piece.tolist() for piece in pieces[k]])
    turn.cont_prefilled = out.prefill_tokens
    generated = out.tokens[:, :g]
    empty = jax.block_until_ready(sampler.init_cache(b, capacity))
    turn.reprefill_s, re_out, _ = generate(empty, [list(h) for h in histories])
    turn.reprefill_prefilled = re_out.prefill_tokens
    turn.same_rows = int((re_out.tokens[:, :g] == generated).all(axis=1).sum())
    turn.generated = generated
    for row in range(b):
      histories[row].extend(generated[row].tolist())
    results.append(turn)
  del cache
  recompiled = sum(sampler.compile_counts.values()) - compiles

  if model is not None and not args.skip_torch_turns:
    import torch

    pad = model.generation_config.pad_token_id or 0
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=pad, max_new_tokens=g)
    with torch.no_grad():
      warm = torch.as_tensor(pieces[0], dtype=torch.long)
      model.generate(warm, attention_mask=torch.ones_like(warm), **kwargs)
      torch_cache, history = None, np.zeros((b, 0), np.int64)
      for turn, piece in zip(results, pieces, strict=True):
        log(f"turns: torch k={turn.k}")
        history = np.concatenate([history, piece], axis=1)
        ids = torch.as_tensor(history, dtype=torch.long)
        # Continuation: generate reuses the DynamicCache, which holds all but the last generated token, so it
        # processes that token and the new prompt.
        start = time.perf_counter()
        if torch_cache is None:
          from transformers import DynamicCache

          torch_cache = DynamicCache()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=torch_cache, **kwargs)
        turn.torch_cont_s = time.perf_counter() - start
        start = time.perf_counter()
        re_out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        turn.torch_reprefill_s = time.perf_counter() - start
        turn.torch_same_rows = int((re_out[:, -g:].numpy() == turn.generated).all(axis=1).sum())
        # Both sides continue from our continuation's tokens, so every run processes the same ids.
        history = np.concatenate([history, turn.generated], axis=1)
        del out
  return results, recompiled, capacity, meter.stop()


# ---------------------------------------------------------------------------------------------------- report


def _fmt(x: float, spec: str = ".1f") -> str:
  return "n/a" if x != x else format(x, spec)


def grid_report(cells: Sequence[Cell], weight_bytes: int, bandwidth: float, config) -> list[str]:
  lines = [
    "1) throughput (tok/s; greedy, float32, EOS off; ratio = ours / torch; same = rows with identical greedy tokens)",
    f"{'B':>3} {'ctx':>5} | {'prefill ours':>12} {'torch':>9} {'ratio':>6} | {'decode ours':>11} {'torch':>9} "
    f"{'ratio':>6} | {'same':>5} | target",
  ]
  for c in cells:
    po, pt = c.tok_s(c.ours_prefill_s, c.prefill_tokens), c.tok_s(c.torch_prefill_s, c.prefill_tokens)
    do, dt = c.tok_s(c.ours_decode_s, c.decode_tokens), c.tok_s(c.torch_decode_s, c.decode_tokens)
    target = ""
    if c.batch == 8:
      target = f"decode >= 1.5x torch: {'MET' if do / dt >= 1.5 else 'MISSED'}" if dt == dt else "decode >= 1.5x torch"
    same = f"{c.same_rows}/{c.batch}" if c.same_rows >= 0 else "-"
    flag = f"  (!) recompiled {c.recompiled}x while timed" if c.recompiled else ""
    flag += f"  {busy_note(c.others, c.stolen)}" if busy_note(c.others, c.stolen) else ""
    lines.append(
      f"{c.batch:>3} {c.context:>5} | {_fmt(po):>12} {_fmt(pt):>9} {_fmt(po / pt, '.2f'):>6} | {_fmt(do):>11} "
      f"{_fmt(dt):>9} {_fmt(do / dt, '.2f'):>6} | {same:>5} | {target}{flag}"
    )
  lines += [
    "",
    "   decode step analysis: ms per step (B tokens), and the time to read the weights plus this batch's KV cache",
    "   (our attention reads all `capacity` slots) once at the measured bandwidth; 'eff GB/s' = those bytes / step",
    f"{'B':>3} {'ctx':>5} {'cap':>5} | {'ours ms':>8} {'torch ms':>8} | {'weights+KV MB':>13} {'bound ms':>8} "
    f"{'ours eff GB/s':>13} {'ours/bound':>10}",
  ]
  kv_per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # k and v, float32
  for c in cells:
    ours_ms, torch_ms = 1e3 * c.ours_decode_s / c.new_tokens, 1e3 * c.torch_decode_s / c.new_tokens
    nbytes = weight_bytes + kv_per_slot * c.batch * c.capacity
    bound_ms = 1e3 * nbytes / bandwidth
    lines.append(
      f"{c.batch:>3} {c.context:>5} {c.capacity:>5} | {_fmt(ours_ms):>8} {_fmt(torch_ms):>8} | {nbytes / 1e6:>13.0f} "
      f"{bound_ms:>8.1f} {_fmt(nbytes / (ours_ms / 1e3) / 1e9, '.2f'):>13} {_fmt(ours_ms / bound_ms, '.2f'):>10}"
    )
  return lines


def bandwidth_report(single, multi, params, cells, floor_s: float) -> list[str]:
  bandwidth = max(single, multi)
  weight_bytes = params * 4
  limit = bandwidth / weight_bytes
  ours = next((c.tok_s(c.ours_decode_s, c.decode_tokens) for c in cells if c.batch == 1 and c.context == 256), None)
  lines = [
    "2) memory bandwidth and the batch-1 decode limit",
    f"   read bandwidth: {bandwidth / 1e9:.2f} GB/s (numpy sum: 1 thread {single / 1e9:.2f}, "
    f"{os.cpu_count()} threads {multi / 1e9:.2f})",
    f"   weight bytes: {params:,} params x 4 B = {weight_bytes / 1e6:.1f} MB",
    f"   batch-1 decode limit = bandwidth / weight bytes = {limit:.1f} tok/s",
    f"   XLA's batch-1 matvecs alone (every weight matrix once, nothing else): {1 / floor_s:.1f} tok/s = "
    f"{100 / floor_s / limit:.0f}% of the limit ({weight_bytes / floor_s / 1e9:.2f} GB/s): no XLA-compiled decode "
    "step is faster here",
  ]
  if ours is None:
    lines.append("   ours, batch 1 context 256: not measured (needs batch 1 and context 256 in the grid)")
  else:
    fraction = ours / limit
    lines.append(
      f"   ours, batch 1 context 256: {ours:.1f} tok/s = {100 * fraction:.0f}% of the limit | target >= 70%: "
      f"{'MET' if fraction >= 0.7 else 'MISSED'}; {100 * ours * floor_s:.0f}% of XLA's matvec rate"
    )
  return lines


def turns_report(turns: Sequence[Turn], recompiled: int, capacity: int, busy: tuple[float, float], args) -> list[str]:
  lines = [
    f"3) per-turn cost, {args.turns} turns (B={args.turn_batch}; each turn +{args.turn_prompt} prompt tokens/row, "
    f"{args.turn_new} generated, EOS off; cache capacity {capacity}; seconds per turn; 'prefilled' = "
    "SampleOutput.prefill_tokens, all rows)",
    f"{'k':>2} {'history':>7} | {'cont s':>7} {'prefilled':>9} | {'re-prefill s':>12} {'prefilled':>9} "
    f"{'same':>5} | {'torch cont s':>12} {'torch re-prefill s':>18} {'same':>5}",
  ]
  for t in turns:
    same = f"{t.same_rows}/{args.turn_batch}"
    torch_same = f"{t.torch_same_rows}/{args.turn_batch}" if t.torch_same_rows >= 0 else "-"
    lines.append(
      f"{t.k:>2} {t.history:>7} | {t.cont_s:>7.2f} {t.cont_prefilled:>9} | {t.reprefill_s:>12.2f} "
      f"{t.reprefill_prefilled:>9} {same:>5} | {_fmt(t.torch_cont_s, '.2f'):>12} "
      f"{_fmt(t.torch_reprefill_s, '.2f'):>18} {torch_same:>5}"
    )
  # Flat in k: the later half of the turns costs no more than the earlier half (each turn does the same work).
  cont, half = [t.cont_s for t in turns], max(len(turns) // 2, 1)
  growth = float(np.mean(cont[half:] or cont)) / float(np.mean(cont[:half]))
  lines += [
    f"   continuation: later-half / earlier-half mean = {growth:.2f}, max/min = {max(cont) / min(cont):.2f} | "
    f"target flat in k (growth <= 1.25): {'MET' if growth <= 1.25 else 'MISSED'}",
    f"   re-prefill: turn {turns[-1].k} / turn 1 = {turns[-1].reprefill_s / turns[0].reprefill_s:.1f}x; "
    f"all turns {sum(cont):.1f}s continuation vs {sum(t.reprefill_s for t in turns):.1f}s re-prefill",
  ]
  if busy_note(*busy):
    lines.append(f"   {busy_note(*busy)} during the turns: numbers are noisy")
  if recompiled:
    lines.append(f"   (!) {recompiled} compilations happened during the timed turns")
  return lines


# ---------------------------------------------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="batch {1, 8} x context {256}")
  parser.add_argument("--batches", type=_ints, default=None, help="comma-separated (default 1,8,32)")
  parser.add_argument("--contexts", type=_ints, default=None, help="comma-separated (default 256,1024,4096)")
  parser.add_argument("--new-tokens", type=int, default=32, help="N: decode tokens timed per cell")
  parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per measurement")
  parser.add_argument("--max-repeat-s", type=float, default=20.0, help="a prefill slower than this runs once")
  parser.add_argument("--prefill-chunk", type=int, default=512, help="Sampler.prefill_chunk")
  parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="array size for the bandwidth probe")
  parser.add_argument("--turns", type=int, default=8)
  parser.add_argument("--turn-batch", type=int, default=8)
  parser.add_argument("--turn-prompt", type=int, default=64, help="new prompt tokens per turn and row")
  parser.add_argument("--turn-new", type=int, default=16, help="generated tokens per turn and row")
  parser.add_argument("--skip-torch", action="store_true", help="ours only (no transformers reference)")
  parser.add_argument("--skip-torch-turns", action="store_true", help="no torch columns in the turn table")
  parser.add_argument("--skip-turns", action="store_true", help="no turn-cost table")
  parser.add_argument(
    "--results", default=None, help="JSON-lines file: each cell is saved when measured; a rerun reuses saved cells"
  )
  args = parser.parse_args(argv)
  args.batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
  args.contexts = args.contexts or ([256] if args.quick else [256, 1024, 4096])
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  import torch

  torch.set_num_threads(os.cpu_count() or 1)
  load_start = os.getloadavg()
  started, meter = time.perf_counter(), CpuMeter()

  log("loading our model and the transformers reference")
  sampler, tokenizer, params = load_ours(args.prefill_chunk)
  model = None if args.skip_torch else load_torch()

  log(f"bandwidth probe ({args.bandwidth_gib} GiB)")
  single, multi = read_bandwidth(args.bandwidth_gib)
  gc.collect()
  log("XLA batch-1 matvec probe")
  floor_s = matvec_floor(sampler.params)
  gc.collect()

  cells = run_grid(sampler, model, tokenizer, args.batches, args.contexts, args)
  turn_lines = []
  if not args.skip_turns:
    turns, recompiled, capacity, busy = run_turns(sampler, model, tokenizer, args)
    turn_lines = ["", *turns_report(turns, recompiled, capacity, busy, args)]

  others, stolen = meter.stop()
  bar = "=" * 118
  lines = [
    bar,
    "envace-jax Sampler vs transformers+torch generate: SmolLM2-135M-Instruct (float32, "
    f"{params / 1e6:.1f}M params, {sampler.config.num_layers} layers)",
    *machine_header(),
    f"quiet? load average (1 min) before the run {load_start[0]:.2f}; during it, other processes used "
    f"{others:.2f} cores and the hypervisor stole {stolen:.2f} on average; total {time.perf_counter() - started:.0f}s"
    + ("  (!) busy: numbers are noisy" if busy_note(others, stolen) else ""),
    f"settings: greedy, EOS off, N={args.new_tokens} decode tokens, best of {args.repeats} (prefills over "
    f"{args.max_repeat_s:.0f}s once), prefill_chunk {args.prefill_chunk}",
    bar,
    *grid_report(cells, params * 4, max(single, multi), sampler.config),
    "",
    *bandwidth_report(single, multi, params, cells, floor_s),
    *turn_lines,
    bar,
  ]
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  main()
