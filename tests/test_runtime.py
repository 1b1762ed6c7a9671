"""Host memory helpers of `envace_jax.runtime`: the resident-set figures and glibc's trim."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from envace_jax import runtime

# Run in a fresh interpreter: the measurement must not see pytest's or other tests' heaps.
_SCRIPT = textwrap.dedent(
  """
  import json, numpy as np
  from envace_jax import runtime
  before = runtime.host_memory_gib()["memory/host_rss_gib"]
  chunks = [np.ones(64 * 1024 // 8) for _ in range(4096)]  # 256 MiB of 64 KiB blocks: heap, below mmap's threshold
  top = np.ones(64 * 1024 // 8)  # a live block above them keeps the heap's top from shrinking on free
  grown = runtime.host_memory_gib()
  del chunks
  freed = runtime.host_memory_gib()["memory/host_rss_gib"]
  runtime.release_host_memory()
  trimmed = runtime.host_memory_gib()["memory/host_rss_gib"]
  print(json.dumps({"before": before, "grown": grown, "freed": freed, "trimmed": trimmed}))
  """
)


@pytest.mark.skipif(runtime._malloc_trim() is None, reason="glibc's malloc_trim is not available here")
def test_release_host_memory_returns_freed_heap_pages():
  import json

  out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True)
  r = json.loads(out.stdout.strip().splitlines()[-1])
  mib = 2**10
  grown = r["grown"]["memory/host_rss_gib"]
  assert (grown - r["before"]) * mib == pytest.approx(256, abs=24)  # the resident set counts the touched blocks
  assert (r["grown"]["memory/host_peak_gib"] - grown) * mib > -4  # the kernel updates the high-water mark lazily
  assert (r["freed"] - r["before"]) * mib > 200  # free() kept them: they sit below a live block
  assert (r["freed"] - r["trimmed"]) * mib > 200  # the trim gave them back


_PROGRAMS_SCRIPT = textwrap.dedent(
  """
  import json, jax, jax.numpy as jnp, numpy as np
  from envace_jax import runtime
  from envace_jax.model import transformer
  from envace_jax.model.config import PRESETS
  config = PRESETS["tiny"]
  params = transformer.init_params(config, jax.random.key(0))
  forward = jax.jit(lambda p, t: transformer.apply(config, p, t)[0][:, -1])
  tokens = lambda n: jnp.arange(4 * n, dtype=jnp.int32).reshape(4, n) % config.vocab_size
  first = np.asarray(forward(params, tokens(64)))
  rss = lambda: runtime.host_memory_gib()["memory/host_rss_gib"] * 1024
  runtime.release_host_memory(staging=True)
  before = rss()
  for n in range(80, 80 + 16 * 8, 16):  # 8 programs more
    forward(params, tokens(n)).block_until_ready()
  runtime.release_host_memory()
  held, programs = rss(), forward._cache_size()
  runtime.release_host_memory(programs=True)
  dropped, left = rss(), forward._cache_size()
  again = np.asarray(forward(params, tokens(64)))
  print(json.dumps({"before": before, "held": held, "dropped": dropped, "programs": programs, "left": left,
                    "same": bool((again == first).all())}))
  """
)


def test_release_host_memory_can_drop_the_compiled_programs():
  """With ``programs`` the release drops the compiled programs and the host memory they hold (a few MiB each for the
  tiny model's forward, tens of MiB for SmolLM2's); a call after it compiles (or reads back) its program again and
  gives the same values. In a fresh interpreter: the figures must not see other tests' programs."""
  import json

  out = subprocess.run([sys.executable, "-c", _PROGRAMS_SCRIPT], capture_output=True, text=True, check=True)
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert (r["programs"], r["left"], r["same"]) == (9, 0, True)
  grown = r["held"] - r["before"]
  assert grown > 8  # MiB: 8 programs held
  assert r["held"] - r["dropped"] > 0.75 * grown, r  # and given back


def test_release_host_memory_keeps_the_compiled_programs():
  """The release drops JAX's tracing and lowering caches, not the compiled programs: a sampler call with shapes
  seen before neither traces nor compiles its prefill and decode again (`Sampler.compile_counts` counts traces; only
  eager operations' small programs compile again) and gives the same tokens."""
  import jax
  import numpy as np

  from envace_jax.model import transformer
  from envace_jax.model.config import PRESETS
  from envace_jax.sampling.sampler import Sampler, SamplingParams

  config = PRESETS["tiny"]
  sampler = Sampler(config, transformer.init_params(config, jax.random.key(0)), share_programs=False)
  kw = dict(role=1, key=jax.random.key(0), max_new_tokens=5, sampling=SamplingParams(temperature=0.7))
  run = lambda: sampler.generate(sampler.init_cache(batch=2, capacity=64), [[3, 4, 5], [6, 7]], 0, **kw)[0]  # noqa: E731
  first = run()
  traces = dict(sampler.compile_counts)
  runtime.release_host_memory(staging=True)  # the tiny model's programs compile in under _LARGE_COMPILE_S
  again = run()
  assert sampler.compile_counts == traces == {"prefill": 1, "decode": 1, "admit": 1}
  np.testing.assert_array_equal(again.tokens, first.tokens)
  np.testing.assert_array_equal(again.logprobs, first.logprobs)


def test_release_host_memory_drops_the_caches_only_after_a_large_compile(monkeypatch):
  """The caches go only when a program that took ``_LARGE_COMPILE_S`` or more compiled (or was read from the
  persistent cache) since they last went (eager operations' programs would compile again for nothing otherwise), or
  when asked."""
  calls = []
  monkeypatch.setattr(runtime, "_clear_staging_caches", lambda: calls.append(1))
  runtime.release_host_memory()
  calls.clear()
  runtime.release_host_memory()
  assert calls == []  # nothing large compiled since
  runtime._count_large_compile(runtime._BACKEND_COMPILE, 0.0, runtime._LARGE_COMPILE_S / 2)
  runtime.release_host_memory()
  assert calls == []  # an eager operation's compile
  runtime._count_large_compile(runtime._BACKEND_COMPILE, 0.0, runtime._LARGE_COMPILE_S)
  runtime.release_host_memory()
  runtime.release_host_memory()
  assert calls == [1]  # once for the large compile
  runtime.release_host_memory(staging=True)
  assert calls == [1, 1]
  # A program read from the persistent compilation cache: JAX reports the compile time it saved.
  runtime._count_large_load(runtime._COMPILE_TIME_SAVED, runtime._LARGE_COMPILE_S / 2)
  runtime.release_host_memory()
  assert calls == [1, 1]
  runtime._count_large_load(runtime._COMPILE_TIME_SAVED, runtime._LARGE_COMPILE_S)
  runtime.release_host_memory()
  assert calls == [1, 1, 1]


def test_compile_clock_counts_each_new_program_once_and_its_seconds():
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np

  unique = float(time.time_ns() % 1_000_003)  # a program no earlier test traced in this process
  f = jax.jit(lambda x: jnp.sin(x) * unique + 1)
  with runtime.CompileClock() as clock:
    mark = clock.mark()
    f(np.ones(7, np.float32)).block_until_ready()
    one = clock.mark()
    assert clock.programs_since(mark) == 1 and clock.since(mark) > 0
    f(np.ones(7, np.float32)).block_until_ready()  # cached in memory: nothing traced or compiled
    assert clock.mark() == one
    f(np.ones(9, np.float32)).block_until_ready()  # a new shape: traced, lowered and compiled again
    assert clock.programs_since(mark) == 2 and clock.programs_since(one) == 1
  f(np.ones(11, np.float32)).block_until_ready()  # closed: no longer listening
  assert clock.programs_since(mark) == 2
  clock.close()  # a second close does nothing


def test_compile_clock_attributes_programs_to_the_innermost_phase():
  """`CompileClock.phase`: each compile counts for the innermost phase open when it ran, ``other`` outside any; the
  per-phase counts sum to `programs_since` (train.py's ``compile/programs/<phase>``)."""
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np

  unique = float(time.time_ns() % 1_000_003)
  f = jax.jit(lambda x: jnp.cos(x) * unique - 2)
  with runtime.CompileClock() as clock:
    mark = clock.mark()
    with clock.phase("rollout"):
      f(np.ones(3, np.float32)).block_until_ready()
      with clock.phase("update"):
        f(np.ones(4, np.float32)).block_until_ready()
        f(np.ones(5, np.float32)).block_until_ready()
      f(np.ones(3, np.float32)).block_until_ready()  # cached: nothing
      f(np.ones(6, np.float32)).block_until_ready()  # the outer phase again
    f(np.ones(7, np.float32)).block_until_ready()
    assert clock.programs_by_phase_since(mark) == {"rollout": 2, "update": 2, runtime.OUTSIDE_PHASES: 1}
    assert clock.programs_since(mark) == 5


def test_a_sampler_off_the_mesh_warns_naming_the_values(caplog):
  """B x G rows that do not split over the mesh's batch shards (data x fsdp) put the sampler on one device, with a
  WARNING naming the rows, the shards and the mesh sizes; rows that split sample on the mesh, without one, with
  ``config.sampler``'s prompt-chunk sizes."""
  import logging

  import jax
  import ml_collections

  from envace_jax.model.config import get_model_config
  from envace_jax.sampling import sharding

  if len(jax.devices()) != 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by tests/conftest.py)")
  config = ml_collections.ConfigDict({"sampler": {"prefill_chunk": 16, "min_bucket": 8}})
  model = runtime.Model(config=get_model_config("tiny"), params=None, tokenizer=None, source="abstract")
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  caplog.set_level(logging.INFO)
  assert runtime.make_sampler(config, model, None, mesh, rows=6).mesh is None
  (warning,) = [r for r in caplog.records if "sampler on one device" in r.getMessage()]
  assert warning.levelno == logging.WARNING
  assert warning.getMessage() == (
    "sampler on one device of the 8-device mesh: its 6 rows (tasks x group_size) do not split over the 4 batch "
    "shards (mesh.data=2 x mesh.fsdp=2); make the rows a multiple of 4 to sample on the whole mesh"
  )
  caplog.clear()
  sampler = runtime.make_sampler(config, model, None, mesh, rows=8)
  assert sampler.mesh is mesh and (sampler.prefill_chunk, sampler.min_bucket) == (16, 8)  # config.sampler's sizes
  assert not [r for r in caplog.records if "sampler on one device" in r.getMessage()]
