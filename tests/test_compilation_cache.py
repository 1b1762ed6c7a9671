"""envace_jax/compilation_cache.py: where the persistent cache lives, how it is turned off, and that a second process
loads what the first compiled instead of compiling it again."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax import compilation_cache, runtime


@pytest.fixture
def clean_env(monkeypatch):
  """No ENVACE_JAX_COMPILATION_CACHE and no JAX cache folder (the session's is restored afterwards)."""
  monkeypatch.delenv(compilation_cache.ENV_VAR, raising=False)
  saved = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  yield monkeypatch
  jax.config.update("jax_compilation_cache_dir", saved)


def test_default_folder_is_per_user_under_xdg_cache_home(clean_env, tmp_path):
  clean_env.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compilation_cache.directory() == str(tmp_path / "envace_jax" / "jax")
  clean_env.delenv("XDG_CACHE_HOME")
  assert compilation_cache.directory() == os.path.join(os.path.expanduser("~"), ".cache", "envace_jax", "jax")


@pytest.mark.parametrize("value", ["off", "OFF", "none", "0", "false", ""])
def test_env_var_turns_it_off(clean_env, value):
  clean_env.setenv(compilation_cache.ENV_VAR, value)
  assert compilation_cache.directory() is None
  assert compilation_cache.enable() is None


def test_env_var_moves_it(clean_env, tmp_path):
  clean_env.setenv(compilation_cache.ENV_VAR, str(tmp_path / "elsewhere"))
  assert compilation_cache.directory() == str(tmp_path / "elsewhere")


def test_jax_own_setting_is_kept(clean_env, tmp_path):
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_own"))
  assert compilation_cache.directory() == str(tmp_path / "jax_own")


def test_uncreatable_folder_names_the_fix(clean_env, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  clean_env.setenv(compilation_cache.ENV_VAR, str(blocker / "cache"))
  with pytest.raises(OSError, match=compilation_cache.ENV_VAR):
    compilation_cache.enable()


_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np
from envace_jax import compilation_cache, runtime
compilation_cache.enable(min_compile_seconds=0.0)
x = jnp.ones((64, 32)).block_until_ready()
with runtime.CompileClock() as clock:
  jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0))(x).block_until_ready()
print(clock.programs_since(0), clock.hits, clock.misses, 0 < clock.since(0, backend_only=True) <= clock.since(0))
print("HIT" if clock.hits else "MISS")
"""


# Then a tiny model's sampler and update step (`compilation_cache.PersistentProgram`): what they compute, how many of
# their programs were read back without tracing, and which were traced.
_MODEL_PROGRAM = (
  _PROGRAM
  + """
from envace_jax.model import transformer
from envace_jax.model.config import PRESETS
from envace_jax.rl import grpo
from envace_jax.rl.batch import collate, split_micro_batches
from envace_jax.sampling.sampler import Sampler
from tests.rl.test_grpo import make_row
config = PRESETS["tiny"]
params = transformer.init_params(config, jax.random.key(0))
traced = []
jax.monitoring.register_event_time_span_listener(
  lambda event, *_, fun_name="", **__: traced.append(fun_name) if event.endswith("jaxpr_trace_duration") else None)
with runtime.CompileClock() as clock:
  sampler = Sampler(config, params)
  out, _ = sampler.generate(sampler.init_cache(2, 64), [[1, 2, 3], [4, 5, 6, 7, 8]], 1, role=2, key=jax.random.key(1),
                            max_new_tokens=6)
  cfg = grpo.GrpoConfig.from_config(micro_batch_size=2, learning_rate=1e-3)
  rng = np.random.default_rng(0)
  batch = collate([make_row(rng, 12, 5, 2), make_row(rng, 9, 3, 3)], [1.0, -0.5], trained_roles=cfg.trained_roles)
  state, _ = grpo.make_update_step(config, cfg)(grpo.init_train_state(cfg, params), split_micro_batches(batch, 2))
  loads = clock.loads
total = float(sum(abs(x).sum() for x in jax.tree.leaves(state.params)))
print(np.asarray(out.tokens).tolist(), sampler.compile_counts, total)
print(loads, sorted({n for n in traced if n.startswith(("_prefill", "_decode", "_admit", "micro", "finish"))}))
"""
)


def test_second_process_loads_the_first_ones_programs(tmp_path):
  """A jitted program comes back from JAX's cache. The sampler's and update's executables come back without tracing
  (`PersistentProgram`): the second process samples the same tokens and takes the same update step, traces none of
  their programs, and counts each one it read."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update({compilation_cache.ENV_VAR: str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"})
  cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  first, second = [
    subprocess.run(
      [sys.executable, "-c", _MODEL_PROGRAM], env=env, cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.splitlines()[-4:]
    for _ in range(2)
  ]
  # runtime.CompileClock counts the jitted program either way, and which of the two JAX's cache answered
  assert (first[:2], second[:2]) == (["1 0 1 True", "MISS"], ["1 1 0 True", "HIT"])
  assert any(p.name.startswith("jit_") for p in (tmp_path / "cache").iterdir())
  assert first[2] == second[2]  # the tokens, the sampler's program counts, the updated parameters
  assert first[3] == "0 ['_admit_rows', '_decode_loop', '_prefill_chunk', 'finish', 'micro']"
  assert second[3] == "5 []"  # prefill, decode, admit, the micro-batch and the optimizer step: read, not traced
  written = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / compilation_cache.EXECUTABLES).iterdir())
  assert written == ["sampler_admit", "sampler_decode", "sampler_prefill", "update_finish", "update_micro"]


def _counting(traces: list):
  def f(x, n, *, scale):
    traces.append((x.shape, n, scale))
    return (x * scale) ** n

  return f


def test_a_program_is_keyed_by_its_signature_static_arguments_and_shapes(tmp_path, monkeypatch):
  """What a later process reads back is the executable traced for the same signature, static arguments (given by
  position or by name, with their types) and argument shapes; any other call traces. A damaged file is compiled
  again. What is
  written is a fresh compile, even where JAX's caches hold the same program read back from JAX's persistent cache
  (XLA's CPU runtime writes such an executable without its code: "Function ... not found" when the copy ran)."""
  monkeypatch.setattr(compilation_cache, "_executables", str(tmp_path))
  traces = []
  x = jnp.arange(4.0)
  plain = jax.jit(_counting(traces), static_argnames=("n", "scale"))
  for _ in range(2):  # the second time from JAX's persistent cache (the session's folder), into its memory
    jax.clear_caches()
    plain(x, 2, scale=3.0)
  traces.clear()

  def program(signature=("v1",)):  # a new jax.jit, as in a new process
    jitted = jax.jit(_counting(traces), static_argnames=("n", "scale"))
    return compilation_cache.PersistentProgram(jitted, "f", signature, static_argnames=("n", "scale"))

  want = program()(x, 2, scale=3.0)
  assert len(traces) == 1 and len(list(tmp_path.iterdir())) == 1
  with runtime.CompileClock() as clock:
    got = program()(x, n=2, scale=3.0)
  assert len(traces) == 1 and clock.programs_since(0) == clock.hits == 1  # read, not traced; counted
  np.testing.assert_array_equal(got, want)
  program()(x, 3, scale=3.0)  # another static argument,
  program()(jnp.arange(5.0), 2, scale=3.0)  # another shape,
  program(("v2",))(x, 2, scale=3.0)  # another signature: each traced
  assert [t[:2] for t in traces[1:]] == [((4,), 3), ((5,), 2), ((4,), 2)] and len(list(tmp_path.iterdir())) == 4
  # Static values equal as dict keys but of other types are other programs (1, True and 1.0 scale alike here, so
  # only the traces tell them apart).
  for n in (True, 2.0):
    np.testing.assert_array_equal(program()(x, 2, scale=n), x * n * x * n)
  assert [t[2] for t in traces[4:]] == [True, 2.0]
  # Damaged files are compiled again: a flipped byte (its checksum; one such byte loaded and ran wrong, another
  # crashed the process) and a file that is not one at all.
  (first,) = [p for p in tmp_path.iterdir() if p.stat().st_mtime == min(q.stat().st_mtime for q in tmp_path.iterdir())]
  flipped = bytearray(first.read_bytes())
  flipped[len(flipped) // 2] ^= 0xFF
  first.write_bytes(bytes(flipped))
  np.testing.assert_array_equal(program()(x, 2, scale=3.0), want)
  assert len(traces) == 7 and first.read_bytes() != bytes(flipped)
  for path in tmp_path.iterdir():
    path.write_bytes(b"damaged")
  np.testing.assert_array_equal(program()(x, 2, scale=3.0), want)
  assert len(traces) == 8 and sorted(p.read_bytes() == b"damaged" for p in tmp_path.iterdir()) == [0, 1, 1, 1, 1, 1]


def test_a_changed_setting_or_a_debugging_mode_is_not_a_stored_program(tmp_path, monkeypatch):
  """A JAX setting changed in a process makes new keys from then on (the default PRNG here: a process that changed it
  had filed its programs under the unchanged key); ``jax.disable_jit`` and NaN checking run ``jax.jit``'s own way."""
  monkeypatch.setattr(compilation_cache, "_executables", str(tmp_path))
  draw = lambda seed: jax.random.uniform(jax.random.key(seed), (3,))  # noqa: E731
  program = lambda: compilation_cache.PersistentProgram(jax.jit(draw), "draw", ("v1",))  # noqa: E731
  default, impl = program()(0), jax.config.jax_default_prng_impl
  jax.config.update("jax_default_prng_impl", "rbg")  # for the process, as a script would
  try:
    np.testing.assert_array_equal(program()(0), jax.jit(draw)(0))  # not the default's file
  finally:
    jax.config.update("jax_default_prng_impl", impl)
  assert len(list(tmp_path.iterdir())) == 2
  np.testing.assert_array_equal(program()(0), default)
  with jax.disable_jit():
    np.testing.assert_array_equal(program()(0), default)
  with jax.debug_nans(True), pytest.raises(FloatingPointError):
    compilation_cache.PersistentProgram(jax.jit(jnp.log), "log", ("v1",))(jnp.array([-1.0, 1.0]))
  assert len(list(tmp_path.iterdir())) == 2


def test_a_program_without_a_stable_signature_is_plain_jit(tmp_path, monkeypatch):
  """A signature with no text that names it the same in another process (here a closure), or None, writes nothing;
  under an outer trace the program is traced into it."""
  monkeypatch.setattr(compilation_cache, "_executables", str(tmp_path))
  traces, scale = [], 2.0
  for signature in [(lambda: scale,), None]:
    jitted = jax.jit(_counting(traces), static_argnames=("n", "scale"))
    program = compilation_cache.PersistentProgram(jitted, "f", signature, static_argnames=("n", "scale"))
    assert float(program(jnp.ones(2), 1, scale=scale)[0]) == 2.0
  assert len(traces) == 2 and not list(tmp_path.iterdir())
  program = compilation_cache.PersistentProgram(jax.jit(_counting(traces), static_argnames=("n", "scale")), "f", ("v",))
  assert float(jax.jit(lambda x: program(x, 1, scale=3.0))(jnp.ones(2))[0]) == 3.0
  assert not list(tmp_path.iterdir())


def test_a_foreign_entry_does_not_stop_new_ones_being_written(tmp_path):
  """An entry written by a process that only had JAX_COMPILATION_CACHE_DIR (a test's subprocess, a notebook kernel)
  has no LRU bookkeeping; with JAX's own bound on, every later write failed ("Error writing persistent compilation
  cache entry ... -atime") and nothing new was cached."""
  folder = tmp_path / "cache"
  folder.mkdir()
  (folder / "jit_foreign-0123-cache").write_bytes(b"x" * 10)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update({compilation_cache.ENV_VAR: str(folder), "JAX_PLATFORMS": "cpu"})
  runs = [
    subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, check=True)
    for _ in range(2)
  ]
  assert not [r.stderr for r in runs if "Error writing persistent compilation cache" in r.stderr]
  assert [r.stdout.strip().splitlines()[-1] for r in runs] == ["MISS", "HIT"]


def test_prune_deletes_the_least_recently_used_files_beyond_the_bound(tmp_path):
  (tmp_path / compilation_cache.EXECUTABLES).mkdir()
  names = ["jit_old-cache", f"{compilation_cache.EXECUTABLES}/f-mid.exe", "jit_new-cache"]
  for i, name in enumerate(names):
    path = tmp_path / name
    path.write_bytes(b"x" * 100)
    os.utime(path, (1_000_000 + i, 1_000_000 + i))
  files = lambda: sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())  # noqa: E731
  assert compilation_cache.prune(str(tmp_path), max_bytes=250) == 100
  assert files() == sorted(names[1:])
  assert compilation_cache.prune(str(tmp_path), max_bytes=250) == 0
  assert compilation_cache.prune(str(tmp_path), max_bytes=0) == 200 and not files()
