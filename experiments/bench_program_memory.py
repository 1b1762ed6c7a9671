"""Host memory held by SmolLM2's sampler programs compiled in the process against the same programs read back from the
executables folder (`compilation_cache.PersistentProgram`): the question behind the main job's warm-cache peak RSS
(issue 43; experiments/results/2026-12-07_initial_evaluation.md).

    python experiments/bench_program_memory.py [--out FILE.json]

Two fresh processes share one new compilation-cache folder: the first compiles (and writes) every program, the second
reads them all back. Each loads configs/testbed.py:main's model and sampler, runs four `Sampler.generate` calls
(rows x prompt tokens x cache slots: 16 x 700 x 1024, 16 x 130 x 1024, 16 x 1000 x 2048, 32 x 200 x 2048; 4 new
tokens each: the rollout's prefill chunk sizes and cache shapes), drops every array, waits for the device, collects
garbage and trims the C heap (glibc `malloc_trim`), then reads /proc/self/smaps: resident MiB of `[heap]`, anonymous
mappings and file-backed ones. Then it drops the programs (`PersistentProgram.forget_all`, `jax.clear_caches`) and
reads the same again: the difference is the memory the programs hold. A third process reads every file of the folder
back (`compilation_cache.read_executable`) and runs none: what loading alone holds. About 6 CPU-minutes on 2 cores,
6.5 GB peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_SHAPES = ((16, 700, 1024), (16, 130, 1024), (16, 1000, 2048), (32, 200, 2048))

_CHILD = """
import ctypes, gc, importlib.util, json, time
import jax, numpy as np
from envace_jax import compilation_cache, runtime
spec = importlib.util.spec_from_file_location("testbed", "configs/testbed.py")
testbed = importlib.util.module_from_spec(spec); spec.loader.exec_module(testbed)
config = testbed.get_config("main")
compilation_cache.enable()
libc = ctypes.CDLL("libc.so.6")

def resident():
  gc.collect(); jax.effects_barrier(); time.sleep(2); gc.collect(); libc.malloc_trim(0)
  out, kind = {"heap": 0, "anon": 0, "file": 0}, None
  for line in open("/proc/self/smaps"):
    parts = line.split()
    if parts[0] == "Rss:":
      out[kind] += int(parts[1]) / 1024
    elif "-" in parts[0] and not parts[0].endswith(":"):
      path = parts[5] if len(parts) > 5 else ""
      kind = "heap" if path == "[heap]" else "file" if path.startswith("/") else "anon"
  out["total"] = sum(out.values())
  return out

model = runtime.load_model(config)
sampler = runtime.make_sampler(config, model, model.params, None, 16)
rng = np.random.default_rng(0)
seconds = []
for rows, length, slots in SHAPES:
  t = time.perf_counter()
  cache = sampler.init_cache(rows, slots)
  prompts = [list(rng.integers(100, 1000, length - i % 7)) for i in range(rows)]
  out, cache = sampler.generate(cache, prompts, [[1] * len(p) for p in prompts], role=1, key=jax.random.key(0),
                                max_new_tokens=4)
  jax.block_until_ready(cache)
  del cache, out
  seconds.append(time.perf_counter() - t)
held = resident()
compilation_cache.PersistentProgram.forget_all()
jax.clear_caches()
dropped = resident()
print(json.dumps({"seconds": seconds, "programs": dict(sampler.compile_counts), "with_programs": held,
                  "without": dropped, "programs_mib": {k: held[k] - dropped[k] for k in held}}))
"""


_LOAD_ONLY = """
import ctypes, gc, json, os, sys, time
from envace_jax import compilation_cache
libc = ctypes.CDLL("libc.so.6")

def resident():
  gc.collect(); time.sleep(2); libc.malloc_trim(0)
  return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))

folder, held = sys.argv[1], []
before = resident()
for name in sorted(os.listdir(folder)):
  with open(os.path.join(folder, name), "rb") as f:
    held.append(compilation_cache.read_executable(f.read())[0])
print(json.dumps({"programs": len(held), "programs_mib": {"total": resident() - before}}))
"""


def _run(cache: str, load_only: bool = False) -> dict:
  env = dict(os.environ, ENVACE_JAX_COMPILATION_CACHE=cache, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  child = [_LOAD_ONLY, os.path.join(cache, "executables")] if load_only else [_CHILD.replace("SHAPES", repr(_SHAPES))]
  out = subprocess.run([sys.executable, "-c", *child], env=env, cwd=root, check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="", help="also write the two processes' figures here (JSON)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as cache:
    result = {"compiled": _run(cache), "read_back": _run(cache), "read_not_run": _run(cache, load_only=True)}
    files = os.path.join(cache, "executables")
    result["executables_mib"] = sum(os.path.getsize(os.path.join(files, f)) for f in os.listdir(files)) / 2**20
  print(f"SmolLM2 sampler programs, {os.cpu_count()} CPUs; executables on disk: {result['executables_mib']:.1f} MiB")
  print(f"{'process':<10} {'programs':>28} {'calls s':>22} {'held MiB: total':>16} {'anon':>6} {'heap':>6} {'file':>6}")
  for name in ("compiled", "read_back"):
    r = result[name]
    held, calls = r["programs_mib"], " ".join(f"{s:.1f}" for s in r["seconds"])
    counts = " ".join(f"{k} {v}" for k, v in sorted(r["programs"].items()))
    print(
      f"{name:<10} {counts:>28} {calls:>22} {held['total']:>16.0f} {held['anon']:>6.0f} {held['heap']:>6.0f} "
      f"{held['file']:>6.0f}"
    )
  r = result["read_not_run"]
  print(f"read back, none run: {r['programs']} programs hold {r['programs_mib']['total']:.0f} MiB")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
