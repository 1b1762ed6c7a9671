"""Training-loop throughput: rollout and update tokens/s on this machine, against its limits; a table and a PNG.

    python experiments/throughput.py              # SmolLM2-135M, τ² mock, B=1 x G=4: 1 warm-up + 2 timed steps
    python experiments/throughput.py --model=tiny --steps=1 --out=/tmp/throughput_tiny.png    # smoke run, 1-2 min
    # An accelerator: Qwen3 from a local Hugging Face directory; every --config.KEY=VALUE passes through:
    python experiments/throughput.py --config=airline --tasks=2 --group=4 --steps=2 --json=throughput.json \\
        --config.model=qwen3-8b --config.model_path=/path/to/Qwen3-8B --config.dtype=bfloat16

Cost of the CPU default (SmolLM2 float32, 2 cores): an estimated 7-9 minutes on idle cores and 8.5 GB of memory;
see "Cost" below for what was measured and under which load. The accelerator command has not been run (no
accelerator was lent while this was written). Size it by memory: the run holds float32 master weights and two
float32 AdamW moments (12 bytes a parameter), and the reference and each policy sampler's copy in the compute dtype
(2 bytes each in bfloat16): Qwen3-8B needs ~130 GB for those, more than the 75% of one 141 GB H200 JAX takes; take
``--config.model=qwen3-4b`` or shard over chips with ``--config.mesh.fsdp=N``; KV caches
add 2 x B x G rows x act_capacity (8192 on airline) x 147 KB for Qwen3-4B/8B in bfloat16 (~19 GB at B=2, G=4).

A ``train.Trainer`` (the loop of ``python -m envace_jax.main``) runs ``Trainer.step`` itself, each of its phases timed
through ``Trainer.phase`` (``--config``: a τ² domain, default mock, or a config file ``configs/X.py[:arg]``):
  rollout  ``Trainer.rollout``: B x G self-unfolded trajectories (ACT, REHEARSE and the reference-played USER) and
           their rewards. Tokens from its stats: generated (by role) and prefilled (the group-shared openings once
           per task, plus every continuation); unfold's stats do not split prefill by role. The rollout interleaves
           prefill and decode, so both counts share its seconds; "rollout: both" is the one honest ratio.
  update   advantages, ``grpo.build_batch`` (host; timed apart) and ``Trainer.update`` (forward + backward with
           remat, global-norm clip, AdamW; one jitted step). Tokens: the batch's valid tokens (the packed rows the
           forward and backward run over) and the trained tokens among them (the loss mask).
Step 1 warms up: it compiles the sampler's and the update's variants (and imports the benchmark's evaluator) and is
shown apart; steps 2..K+1 are the steady state. A timed step can still meet a new shape (a longer row, another
attention bucket) and compile it: the seconds JAX spends tracing, lowering and compiling (``jax.monitoring``'s
compile events, overlaps merged) are taken out of every phase and shown in their own column.

Limits (a ratio is measured tokens/s over the limit's tokens/s). Parameters are counted where they do matmul work:
L = the decoder layers' (every token of a forward), H = the [D, V] head's (the training forward sends only trained
positions to the head, a prefill one position per row); embedding lookups do none.
  decode   memory bandwidth: each decode step reads every weight (W bytes) once for up to B x G rows (each live
           trajectory has exactly one pending generation at a time): B x G x bandwidth / W tokens/s.
           Weights only, KV-cache reads left out: an upper limit. Bandwidth: ``bench_sampler.read_bandwidth``
           (numpy) on a CPU backend; a jitted sum over a device array elsewhere (host memory says nothing of HBM).
  prefill  compute: 2 L FLOPs per token: peak / (2 L).
  rollout  both together: the seconds both token counts need at their limits, over the seconds taken.
  update   compute: 6 L per row token + 6 H per trained token (forward 2, backward 4 per parameter and token); the
           ratio is the model FLOPs utilisation (MFU). Remat runs the forward twice, so the hardware does about 8/6
           of that (HFU, printed when remat is on).
Attention's context-dependent FLOPs are left out of both compute limits (on SmolLM2 rows of 1-2k tokens they would
add a sixth to a third), so the compute ratios understate the work done. The peak is measured, not quoted: a
jitted N x N matmul in the model's compute dtype (float32 on CPU; the model's own matmuls use the same dtype and
default precision), best of 5.

Cost (2-core EPYC VM, 23 GB), measured only on a busy machine: the default run took 22.5 minutes of wall-clock
and 784 CPU-seconds (user + system), niced, while other jobs used ~1.4 of the 2 cores; at the 1.6-2 cores JAX
keeps busy on an idle machine that is 7-9 minutes. Peak memory 8.5 GB (the weights six times, 3.2 GB, plus KV
caches, the update's gradient and activations, and XLA's compilations). Busy, per step: warm-up rollout 356 s
(110 s compiling) and update 257 s (21 s); steady rollouts ~190 s, updates 150-190 s. The tiny model: 1-2 minutes.
Prints a per-step table and the summary, saves ``--out`` (a bar chart of the ratio per phase) and, with ``--json``,
every number. Numbers taken on a busy machine are low: the per-step table and the summary say how many cores
other processes used meanwhile (``bench_sampler.CpuMeter``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/throughput.py` runs with experiments/ on sys.path, not the root
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from envace_jax import runtime  # noqa: E402
from experiments import common  # noqa: E402
from experiments.bench_sampler import CpuMeter, busy_note, read_bandwidth  # noqa: E402

ROLES = ("act", "rehearse", "user")
_USERS = {"reference": "the reference sampler", "policy": "the policy", "external": "an endpoint, not counted"}


def log(message: str) -> None:
  """Progress on stderr (the report goes to stdout)."""
  print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- limits


def train_flops(params: int, tokens: int) -> float:
  """FLOPs of a training forward + backward of ``params`` matmul parameters over ``tokens`` tokens: 6 x params x
  tokens (forward 2, backward 4 per parameter and token)."""
  return 6.0 * params * tokens


def forward_flops(params: int, tokens: int) -> float:
  """FLOPs of a forward (a prefill) of ``params`` matmul parameters over ``tokens`` tokens: 2 x params x tokens."""
  return 2.0 * params * tokens


@dataclasses.dataclass(frozen=True)
class ParamSplit:
  """Where a model's parameters do matmul work.

  Attributes:
    total: every parameter (``transformer.param_count``).
    layers: the decoder layers' and final norm's: every token of a forward multiplies them.
    head: the [D, V] output projection (the tied embedding, or ``lm_head``): the training forward sends only the
      trained positions to it, a prefill one position per row. The input embedding and the role embedding are
      lookups, no FLOPs.
  """

  total: int
  layers: int
  head: int

  @classmethod
  def of(cls, config, params) -> ParamSplit:
    """From a parameter tree (arrays, or ``jax.eval_shape``'s shapes)."""
    from envace_jax.model import transformer

    total = transformer.param_count(params)
    lookups = sum(int(params[k].size) for k in ("embed", "role_embed", "lm_head") if k in params)
    return cls(total=total, layers=total - lookups, head=config.vocab_size * config.d_model)

  def update_flops(self, row_tokens: int, trained_tokens: int) -> float:
    """A GRPO update's forward + backward: the layers over every row token, the head over the trained ones."""
    return train_flops(self.layers, row_tokens) + train_flops(self.head, trained_tokens)

  def reference_flops(self, row_tokens: int, trained_tokens: int) -> float:
    """The KL term's reference forward (no backward)."""
    return forward_flops(self.layers, row_tokens) + forward_flops(self.head, trained_tokens)


def prefill_limit(split: ParamSplit, peak_flops: float) -> float:
  """Prefill tokens/s at the compute peak (the head's one position per row left out)."""
  return peak_flops / forward_flops(split.layers, 1)


def decode_limit(weight_bytes: int, bandwidth: float, rows: int) -> float:
  """Decode tokens/s when every step reads the weights once at ``bandwidth`` bytes/s for ``rows`` sequences."""
  return rows * bandwidth / weight_bytes


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
  """Model FLOPs utilisation: useful FLOPs / seconds / peak FLOP/s."""
  return flops / seconds / peak_flops if seconds > 0 else float("nan")


def matmul_peak(n: int, dtype: str, repeats: int = 5) -> float:
  """FLOP/s of a jitted [n, n] @ [n, n] matmul in ``dtype`` on the default device: 2 n^3 / best of ``repeats``."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.dtype(dtype))
  b = jax.random.normal(kb, (n, n), jnp.dtype(dtype))
  f = jax.jit(jnp.matmul)
  f(a, b).block_until_ready()  # compile
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * n**3 / best


def device_bandwidth(gib: float, repeats: int = 5) -> float:
  """Read bandwidth of the default device in bytes/s: a jitted sum over a float32 array of ``gib`` GiB."""
  x = jnp.ones(int(gib * 2**30) // 4, jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return x.nbytes / best


@dataclasses.dataclass
class Machine:
  """What the limits are computed from."""

  cpu: str
  cores: int
  backend: str
  device_kind: str
  devices: int
  bandwidth: float  # bytes/s
  bandwidth_how: str
  peak_flops: float
  peak_how: str

  def header(self) -> list[str]:
    return [
      f"machine: {self.cpu}, {self.cores} cores, {platform.system()} {platform.release()}; jax {jax.__version__} "
      f"backend {self.backend} ({self.devices} x {self.device_kind})",
      f"measured: peak {self.peak_flops / 1e9:.1f} GFLOP/s ({self.peak_how}); read bandwidth "
      f"{self.bandwidth / 1e9:.2f} GB/s ({self.bandwidth_how})",
    ]


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine() or "unknown cpu"


def probe_machine(dtype: str, matmul_size: int, bandwidth_gib: float) -> Machine:
  backend = jax.default_backend()
  device = jax.devices()[0]
  n = matmul_size or (2048 if backend == "cpu" else 8192)
  peak = matmul_peak(n, dtype)
  if backend == "cpu":
    single, multi = read_bandwidth(bandwidth_gib)
    bandwidth, how = max(single, multi), f"numpy sum over {bandwidth_gib} GiB, bench_sampler.read_bandwidth"
  else:
    bandwidth, how = device_bandwidth(bandwidth_gib), f"jitted sum over a {bandwidth_gib} GiB device array"
  return Machine(
    cpu=cpu_name(),
    cores=os.cpu_count() or 1,
    backend=backend,
    device_kind=device.device_kind,
    devices=jax.device_count(),
    bandwidth=bandwidth,
    bandwidth_how=how,
    peak_flops=peak,
    peak_how=f"jitted {n}x{n} {dtype} matmul, best of 5",
  )


# ---------------------------------------------------------------------------------------------------- steps


@dataclasses.dataclass
class StepRecord:
  """One training step, phase by phase. Seconds are wall-clock and include compilation; ``*_compile_s`` is the
  part of them spent compiling."""

  step: int
  rollout_s: float = 0.0
  rollout_cpu_s: float = 0.0  # this process's CPU seconds (all threads): on a busy machine, what the phase cost
  rollout_compile_s: float = 0.0
  generated: dict[str, int] = dataclasses.field(default_factory=dict)  # unfold's stats, by role
  prefilled: int = 0  # unfold's stats: prefill_tokens + prefill_tokens_shared
  prefilled_shared: int = 0
  rollout_times: dict[str, float] = dataclasses.field(default_factory=dict)  # unfold's time_*_s
  sampler_compiles: int = 0  # new traces of the samplers' jitted prefill / decode / admit during this step
  trajectories: int = 0
  batch_s: float = 0.0  # advantages + build_batch (host)
  reference_s: float = 0.0  # the reference forward for the KL term (use_kl only)
  reference_compile_s: float = 0.0
  update_s: float = 0.0
  update_cpu_s: float = 0.0
  update_compile_s: float = 0.0
  row_tokens: int = 0  # valid tokens of the batch (what the forward and backward run over)
  padded_tokens: int = 0  # K x M x T
  trained_tokens: int = 0  # the update's ``tokens`` metric (loss-masked tokens)
  skipped: bool = False  # no trainable row: no update
  others: float = float("nan")  # cores other processes used during the step (bench_sampler.CpuMeter)
  stolen: float = float("nan")
  # The step's scored trajectories, for checks (not saved to JSON).
  trajectory_list: list = dataclasses.field(default_factory=list, repr=False)

  @property
  def rollout_run_s(self) -> float:
    return self.rollout_s - self.rollout_compile_s

  @property
  def update_run_s(self) -> float:
    return self.update_s - self.update_compile_s

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out.pop("trajectory_list")
    return out


def cpu_seconds() -> float:
  """User + system CPU seconds of this process so far."""
  t = os.times()
  return t.user + t.system


def sampler_compiles(trainer) -> int:
  """Traces of the trainer's samplers' programs; samplers that share their programs share one count (`Sampler`)."""
  counts = {id(s.compile_counts): s.compile_counts for s in trainer.samplers.values()}
  return sum(sum(c.values()) for c in counts.values())


class PhaseTimer:
  """`train.Trainer.phase` that times each phase: wall and CPU seconds, the seconds spent compiling (``clock``),
  and what the phase produced."""

  def __init__(self, clock: runtime.CompileClock):
    self.clock, self.phases = clock, {}

  @contextlib.contextmanager
  def __call__(self, name: str):
    out: dict[str, Any] = {}
    mark, start, cpu = self.clock.mark(), time.perf_counter(), cpu_seconds()
    yield out
    out.update(seconds=time.perf_counter() - start, cpu_s=cpu_seconds() - cpu, compile_s=self.clock.since(mark))
    self.phases[name] = out


def run_step(trainer, step: int, clock: runtime.CompileClock) -> StepRecord:
  """`Trainer.step` (the main job's step), each phase timed: rollout, advantages + batch, (reference), update."""
  rec, meter, timer = StepRecord(step=step), CpuMeter(), PhaseTimer(clock)
  compiles, untimed = sampler_compiles(trainer), trainer.phase
  trainer.phase = timer
  try:
    trainer.step(step)
  finally:
    trainer.phase = untimed
  rollout, batch = timer.phases["rollout"], timer.phases["batch"]
  trajectories, stats = rollout["trajectories"], rollout["stats"]
  rec.rollout_s, rec.rollout_compile_s, rec.rollout_cpu_s = rollout["seconds"], rollout["compile_s"], rollout["cpu_s"]
  rec.sampler_compiles = sampler_compiles(trainer) - compiles
  rec.generated = {role: int(stats.get(f"generated_tokens_{role}", 0)) for role in ROLES}
  rec.prefilled_shared = int(stats.get("prefill_tokens_shared", 0))
  rec.prefilled = int(stats.get("prefill_tokens", 0)) + rec.prefilled_shared
  rec.rollout_times = {k: float(v) for k, v in stats.items() if k.startswith("time_")}
  rec.trajectories, rec.trajectory_list = len(trajectories), trajectories
  rec.batch_s = batch["seconds"]
  if batch["batch"] is None:  # nothing trainable (every trajectory invalid): Trainer.step skipped the update
    log(f"step {step}: no update")
    rec.skipped = True
  else:
    rec.row_tokens = int(np.asarray(batch["batch"].valid).sum())
    rec.padded_tokens = int(np.asarray(batch["batch"].tokens).size)
    if "reference" in timer.phases:
      reference = timer.phases["reference"]
      rec.reference_s, rec.reference_compile_s = reference["seconds"], reference["compile_s"]
    update = timer.phases["update"]
    rec.update_s, rec.update_compile_s, rec.update_cpu_s = update["seconds"], update["compile_s"], update["cpu_s"]
    rec.trained_tokens = int(update["metrics"]["tokens"])
  rec.others, rec.stolen = meter.stop()
  return rec


# ---------------------------------------------------------------------------------------------------- report


@dataclasses.dataclass
class Row:
  """One line of the summary table."""

  phase: str
  tokens: int
  seconds: float
  limit: float = float("nan")  # tokens/s at the machine's limit; NaN: none

  @property
  def tok_s(self) -> float:
    return self.tokens / self.seconds if self.seconds > 0 else float("nan")

  @property
  def ratio(self) -> float:
    return self.tok_s / self.limit if self.limit == self.limit and self.limit > 0 else float("nan")


@dataclasses.dataclass
class Report:
  """What ``main`` measured (also what ``--json`` writes, less the trajectories)."""

  machine: Machine
  model: str
  params: ParamSplit
  weight_bytes: int
  rows_per_call: int  # B x G
  remat: bool
  user_mode: str  # who played the user (config.rollout.user_mode)
  steps: list[StepRecord]  # steps[0] is the warm-up
  rows: list[Row]  # the steady-state summary

  def to_json(self) -> dict[str, Any]:
    rows = [{**dataclasses.asdict(r), "tok_s": r.tok_s, "ratio": r.ratio} for r in self.rows]
    return {
      "machine": dataclasses.asdict(self.machine),
      "model": self.model,
      "params": dataclasses.asdict(self.params),
      "weight_bytes": self.weight_bytes,
      "rows_per_call": self.rows_per_call,
      "remat": self.remat,
      "user_mode": self.user_mode,
      "steps": [s.to_json() for s in self.steps],
      "rows": rows,
    }


def summary_rows(steps: Sequence[StepRecord], machine: Machine, split: ParamSplit, weight_bytes: int, rows: int):
  """The steady-state table over ``steps``: compile seconds are taken out of every phase."""
  gen = sum(sum(s.generated.values()) for s in steps)
  pre = sum(s.prefilled for s in steps)
  row_tokens, trained = sum(s.row_tokens for s in steps), sum(s.trained_tokens for s in steps)
  roll_s = sum(s.rollout_run_s for s in steps)
  upd_s = sum(s.update_run_s for s in steps)
  ref_s = sum(s.reference_s - s.reference_compile_s for s in steps)
  d_lim = decode_limit(weight_bytes, machine.bandwidth, rows)
  p_lim = prefill_limit(split, machine.peak_flops)
  bound_s = gen / d_lim + pre / p_lim
  # tokens/s at the peak for this mix of row and trained tokens: row tokens x peak / the update's FLOPs
  u_flops = split.update_flops(row_tokens, trained)
  u_lim = row_tokens * machine.peak_flops / u_flops if u_flops else float("nan")
  out = [
    Row("rollout: generated", gen, roll_s, d_lim),
    Row("rollout: prefilled", pre, roll_s, p_lim),
    Row("rollout: both", gen + pre, roll_s, (gen + pre) / bound_s if bound_s > 0 else float("nan")),
  ]
  if ref_s > 0:
    r_flops = split.reference_flops(row_tokens, trained)
    out.append(Row("update: reference forward (KL)", row_tokens, ref_s, row_tokens * machine.peak_flops / r_flops))
  out += [
    Row("update: fwd+bwd+AdamW (MFU)", row_tokens, upd_s, u_lim),
    Row("update: trained tokens", trained, upd_s),
    Row("step: trained tokens end to end", trained, roll_s + upd_s + ref_s + sum(s.batch_s for s in steps)),
  ]
  return out


def _fmt(x: float, spec: str = ".1f") -> str:
  return "-" if x != x else format(x, spec)


def step_table(steps: Sequence[StepRecord]) -> list[str]:
  lines = [
    "per step (seconds are wall-clock, compile included; 'comp' = the part spent compiling; 'cpu' = this process's",
    "CPU seconds, all threads; 'new jit' = new sampler traces; step 1 warms up)",
    f"{'step':>9} | {'rollout s':>9} {'comp':>6} {'cpu':>6} {'generated':>9} {'prefilled':>9} {'new jit':>7} | "
    f"{'batch s':>7} {'update s':>8} {'comp':>6} {'cpu':>6} {'rows tok':>8} {'padded':>7} {'trained':>7} | busy",
  ]
  for i, s in enumerate(steps):
    name = f"{s.step} (warm)" if i == 0 else str(s.step)
    update = "skipped: nothing to train" if s.skipped else ""
    lines.append(
      f"{name:>9} | {s.rollout_s:>9.1f} {s.rollout_compile_s:>6.1f} {s.rollout_cpu_s:>6.0f} "
      f"{sum(s.generated.values()):>9} {s.prefilled:>9} {s.sampler_compiles:>7} | {s.batch_s:>7.2f} "
      f"{s.update_s:>8.1f} {s.update_compile_s:>6.1f} {s.update_cpu_s:>6.0f} "
      f"{s.row_tokens:>8} {s.padded_tokens:>7} {s.trained_tokens:>7} | {busy_note(s.others, s.stolen) or 'quiet'}"
      + (f"  {update}" if update else "")
    )
  return lines


def summary_table(report: Report) -> list[str]:
  timed = report.steps[1:]
  lines = [
    f"steady state: steps {timed[0].step}..{timed[-1].step} ({len(timed)}), compile seconds taken out",
    f"{'phase':<34} {'tokens':>9} {'seconds':>9} {'tokens/s':>10} {'limit tok/s':>12} {'ratio':>7}",
  ]
  for r in report.rows:
    lines.append(
      f"{r.phase:<34} {r.tokens:>9} {r.seconds:>9.1f} {_fmt(r.tok_s):>10} {_fmt(r.limit):>12} {_fmt(r.ratio, '.3f'):>7}"
    )
  by_role = {role: sum(s.generated.get(role, 0) for s in timed) for role in ROLES}
  times = {k: sum(s.rollout_times.get(k, 0.0) for s in timed) for k in timed[0].rollout_times}
  update = next(r for r in report.rows if r.phase.startswith("update: fwd"))
  p = report.params
  lines += [
    "  generated by role: "
    + ", ".join(f"{role} {n}" for role, n in by_role.items())
    + f" (user: {_USERS.get(report.user_mode, report.user_mode)}; unfold's stats do not split prefill by role)"
    + ("; nothing rehearsed: no ACT tool call (or env_mode=real)" if by_role["rehearse"] == 0 else ""),
    "  rollout seconds (unfold's stats, compile included): "
    + ", ".join(f"{k[len('time_') : -len('_s')]} {v:.1f}" for k, v in times.items()),
    f"  limits: decode = {report.rows_per_call} rows (B x G) x bandwidth / {report.weight_bytes / 1e6:.1f} MB of "
    f"weights; prefill = peak / (2 x {p.layers / 1e6:.1f}M layer params); update = peak / (6 x layer params x row "
    f"tokens + 6 x {p.head / 1e6:.1f}M head params x trained tokens)",
    f"  MFU {_fmt(update.ratio, '.3f')}"
    + (f", HFU with remat (the forward runs twice: x 8/6) {_fmt(update.ratio * 8 / 6, '.3f')}" if report.remat else ""),
  ]
  compiled = sum(s.rollout_compile_s + s.update_compile_s + s.reference_compile_s for s in timed)
  if compiled > 0:
    lines.append(f"  (!) the timed steps compiled for {compiled:.1f} s (new shapes); taken out above")
  others = [s.others for s in timed if s.others == s.others]
  if others and max(others) > 0.2:
    lines.append(f"  (!) other processes used up to {max(others):.2f} cores during the timed steps: numbers are low")
  return lines


def save_plot(report: Report, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in report.rows if r.ratio == r.ratio]
  fig, ax = plt.subplots(figsize=(8, 4))
  bars = ax.bar(range(len(rows)), [r.ratio for r in rows], color=["#4c72b0"] * 3 + ["#dd8452"] * (len(rows) - 3))
  ax.bar_label(bars, [f"{r.ratio:.3f}" for r in rows])
  ax.set_xticks(range(len(rows)), [r.phase.replace(": ", ":\n") for r in rows], fontsize=8)
  ax.set_ylabel("measured / limit tokens/s")
  m = report.machine
  where = m.cpu if m.backend == "cpu" else f"{m.devices} x {m.device_kind}"
  title = f"{report.model} on {where} ({m.cores} cores): ratio to the limit, steady state"
  others = max((s.others for s in report.steps[1:] if s.others == s.others), default=0.0)
  if others > 0.2:
    title += f"\n(!) other processes used up to {others:.1f} cores meanwhile: low numbers"
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------------- config


def _load(path: pathlib.Path, arg: str | None):
  spec = importlib.util.spec_from_file_location(f"config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def load_config(args, overrides: Sequence[str]):
  """The run's config: τ² domain or config file, the script's sizes, then the ``--config.KEY=VALUE`` overrides."""
  if args.model == "tiny":
    c = _load(ROOT / "configs" / "tiny.py", None)  # τ² mock: the tiny preset's 1024-token context fits nothing else
  elif ".py" in args.config:
    path, _, arg = args.config.partition(":")
    c = _load(pathlib.Path(path), arg or None)
  else:
    c = _load(ROOT / "configs" / "tau2.py", args.config)
  c.env.data_dir = args.data_dir
  c.train.tasks_per_step = args.tasks
  c.train.group_size = args.group
  c.train.steps = args.steps + 1
  c.train.checkpoint_every = args.steps + 1
  c.train.eval_tasks = 0
  c.train.eval_every = 0
  c.train.sft_warmup_steps = 0  # every timed step is an RL step of one batch:
  c.grpo.dynamic_sampling = False
  return common.apply_flags(c, common.split_overrides(overrides)[0])


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str]):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"], help="tiny: the random tiny model")
  parser.add_argument("--config", default="mock", help="τ² domain (mock, airline, retail) or configs/X.py[:arg]")
  parser.add_argument("--steps", type=int, default=2, help="K timed steps after the warm-up step")
  parser.add_argument("--group", type=int, default=4, help="G rollouts per task")
  parser.add_argument("--tasks", type=int, default=1, help="B tasks per step")
  parser.add_argument("--out", default="throughput.png", help="PNG: ratio to the limit per phase")
  parser.add_argument("--json", default="", help="also write every number here")
  parser.add_argument("--data-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "envace_tfds"))
  parser.add_argument("--matmul-size", type=int, default=0, help="peak probe N (0: 2048 on CPU, 8192 elsewhere)")
  parser.add_argument("--bandwidth-gib", type=float, default=0.5, help="bandwidth probe array size")
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.") or "=" not in a]
  if bad:
    parser.error(f"unrecognised arguments {bad}; config overrides are written --config.KEY=VALUE")
  if args.steps < 1:
    parser.error("--steps must be >= 1 (timed steps after the warm-up)")
  if args.model == "tiny" and args.config != "mock":
    parser.error("--model=tiny runs on τ² mock only (its context is 1024 tokens)")
  return args, rest


def main(argv: Sequence[str]) -> Report:
  args, overrides = parse_args(argv)
  from envace_jax import train

  config = load_config(args, overrides)
  log("probing the machine: matmul peak and read bandwidth")
  machine = probe_machine(config.dtype, args.matmul_size, args.bandwidth_gib)
  clock = runtime.CompileClock()
  try:
    with tempfile.TemporaryDirectory() as workdir:
      log(f"building the trainer ({config.model}, {config.env.benchmark} {config.env.domain})")
      trainer = train.Trainer(config, workdir)
      try:
        policy = trainer.samplers["policy"].params  # a run without a reference holds no other tree
        split = ParamSplit.of(trainer.model.config, policy)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(policy))
        steps = []
        for step in range(1, args.steps + 2):
          log(f"step {step}/{args.steps + 1}" + (" (warm-up)" if step == 1 else ""))
          steps.append(run_step(trainer, step, clock))
      finally:
        trainer.ckpt.close()
  finally:
    clock.close()
  rows_per_call = args.tasks * args.group
  report = Report(
    machine=machine,
    model=f"{config.model}" + (f" ({config.model_path})" if config.get("model_path") else ""),
    params=split,
    weight_bytes=weight_bytes,
    rows_per_call=rows_per_call,
    remat=trainer.grpo_cfg.remat,
    user_mode=config.rollout.user_mode,
    steps=steps,
    rows=summary_rows(steps[1:], machine, split, weight_bytes, rows_per_call),
  )
  bar = "=" * 112
  lines = [
    bar,
    f"training-loop throughput: {report.model}, {split.total / 1e6:.1f}M params ({config.dtype} compute, "
    f"{weight_bytes / 1e6:.1f} MB of weights), {config.env.benchmark} {config.env.domain}, "
    f"B={args.tasks} x G={args.group}, micro-batch {trainer.grpo_cfg.micro_batch_size}, "
    f"mode {trainer.grpo_cfg.mode}",
    *machine.header(),
    bar,
    *step_table(steps),
    "",
    *summary_table(report),
    bar,
  ]
  print("\n".join(lines), flush=True)
  save_plot(report, args.out)
  print(f"saved {args.out}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(report.to_json(), f, indent=1)
    print(f"saved {args.json}")
  return report


if __name__ == "__main__":
  main(sys.argv[1:])
