"""envace_jax/compilation_cache.py: where the persistent cache lives, how it is turned off, and that a second process
loads what the first compiled instead of compiling it again."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from envace_jax import compilation_cache


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
import jax, jax.numpy as jnp
from envace_jax import compilation_cache, runtime
compilation_cache.enable(min_compile_seconds=0.0)
x = jnp.ones((64, 32)).block_until_ready()
with runtime.CompileClock() as clock:
  jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0))(x).block_until_ready()
print(clock.programs_since(0), clock.hits, clock.misses, 0 < clock.since(0, backend_only=True) <= clock.since(0))
print("HIT" if clock.hits else "MISS")
"""


def test_second_process_loads_the_first_ones_program(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update({compilation_cache.ENV_VAR: str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"})
  runs = [
    subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, check=True).stdout
    for _ in range(2)
  ]
  # runtime.CompileClock counts the program either way, and which of the two the cache answered
  assert [r.strip().splitlines()[-2:] for r in runs] == [["1 0 1 True", "MISS"], ["1 1 0 True", "HIT"]]
  assert any(p.name.startswith("jit_") for p in (tmp_path / "cache").iterdir())


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
  for i, name in enumerate(["old", "mid", "new"]):
    path = tmp_path / f"jit_{name}-cache"
    path.write_bytes(b"x" * 100)
    os.utime(path, (1_000_000 + i, 1_000_000 + i))
  assert compilation_cache.prune(str(tmp_path), max_bytes=250) == 100
  assert sorted(p.name for p in tmp_path.iterdir()) == ["jit_mid-cache", "jit_new-cache"]
  assert compilation_cache.prune(str(tmp_path), max_bytes=250) == 0
  assert compilation_cache.prune(str(tmp_path), max_bytes=0) == 200 and not list(tmp_path.iterdir())
