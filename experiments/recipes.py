"""The recipes' memory plans: ``configs/tau2.py``'s `RECIPES`, planned for H200s (``--mode=plan``'s `plan.plan`), each
table written to ``experiments/results/plan_<recipe>.json`` and ``.md``.

    python experiments/recipes.py [--recipe=h200_qwen3_1p7b] [--search]

Runs on this machine's CPU with as many fake devices as the recipe's mesh has (one process per recipe): the
programs are compiled for the CPU with its reference attention; the GPU's cuDNN training bias is added analytically
and the usable memory is JAX's pool, 0.75 of the device's 141 GB (`plan.usable_memory`). Each view's opening (τ²
airline's system prompt and tool schemas, ≈ 5k tokens) is shared by a task's G rollouts (``OPENING_TOKENS``).
``--search`` plans each of ``CANDIDATES`` (largest first) until one fits, and records every one tried (an 8B plan
compiles big programs: minutes each here). The markdown also gives the prefill's temporaries over the shared openings
against a prefill without them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
H200_GB = 141.0
OPENING_TOKENS = 5000
CANDIDATES = ((16, 4), (8, 4), (4, 4), (2, 4), (1, 4))  # (B, G), largest first: G stays the paper's 4


def _tau2():
  spec = importlib.util.spec_from_file_location("tau2_config", ROOT / "configs" / "tau2.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _markdown(name: str, result, tried, seconds: float, commit: str) -> str:
  from envace_jax import plan  # noqa: PLC0415

  gib = lambda n: f"{n / plan.GIB:.2f}"  # noqa: E731
  bt = result["batch"]
  lines = [
    f"# Memory plan: `configs/tau2.py:{name}`",
    "",
    f"{result['model']} on {result['devices']} (mesh {result['mesh']}), B×G = {bt['tasks']}×{bt['group']}, "
    f"micro-batches of {bt['micro_batch']} rows × {bt['micro_batch_tokens']} tokens, openings of "
    f"{OPENING_TOKENS} tokens shared by a task's rollouts. Figures per device from XLA's memory analysis of the "
    f"programs compiled for {result['compiled_for']} (reference attention), parts marked analytic added for the "
    f"GPU. Planned at commit {commit} in {seconds:.0f} s (`python experiments/recipes.py --recipe={name}`).",
    "",
    "| part | phase | GiB | what |",
    "|---|---|---:|---|",
  ]
  lines += [f"| {p.name} | {p.phase} | {gib(p.bytes)} | {p.detail} |" for p in result["parts"]]
  lines.append(f"| **persistent** | | {gib(result['persistent_bytes'])} | |")
  lines += [f"| phase total | {phase} | {gib(size)} | |" for phase, size in result["phases"].items()]
  lines.append(f"| **peak** (persistent + the largest phase) | | **{gib(result['peak_bytes'])}** | |")
  shared, alone = result["programs"]["prefill (policy)"], result["programs"]["prefill (policy, no openings)"]
  lines += [
    "",
    f"Prefill temporaries over the shared openings: {gib(shared['temp'])} GiB, {shared['temp'] / alone['temp']:.2f}× "
    f"the {gib(alone['temp'])} GiB of a prefill whose rows own every slot (no prefix).",
  ]
  verdict = "fits" if result["fits"] else "does NOT fit"
  lines += [
    "",
    f"Usable device memory: {gib(result['device_bytes'])} GiB ({result['device_source']}): **{verdict}** "
    f"({100 * result['peak_bytes'] / result['device_bytes']:.0f}% of it).",
    "",
    "Attention kernel of each call, by backend (traced with `attention.backend`):",
    "",
  ]
  for backend, by_program in result["attention"].items():
    lines.append(f"- {backend}: " + "; ".join(f"{p}: {', '.join(c) or 'no call'}" for p, c in by_program.items()))
  if len(tried) > 1:
    lines += ["", "B×G tried, largest first:", ""]
    lines += [f"- {b}×{g}: peak {gib(peak)} GiB, {'fits' if fits else 'does not fit'}" for b, g, peak, fits in tried]
  return "\n".join(lines) + "\n"


def plan_recipe(name: str, search: bool) -> dict:
  """Plans recipe ``name`` (with ``search``: down `CANDIDATES` until one fits) and writes its JSON and markdown.
  JAX must not be initialised yet: the fake CPU devices are set to the recipe's mesh first."""
  config = _tau2().get_config(name)
  devices = math.prod(config.mesh[axis] for axis in ("data", "fsdp", "tensor"))
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  from envace_jax import plan  # noqa: PLC0415  (after XLA_FLAGS)

  b0, g0 = config.train.tasks_per_step, config.train.group_size
  candidates = list(CANDIDATES) if search else [(b0, g0)]
  tried, start = [], time.time()
  for b, g in candidates:
    config.train.tasks_per_step, config.train.group_size = b, g
    result = plan.plan(config, H200_GB, OPENING_TOKENS, backend="gpu", compare_openings=True)
    tried.append((b, g, result["peak_bytes"], result["fits"]))
    print(f"{name}: B×G = {b}×{g}: peak {result['peak_bytes'] / plan.GIB:.2f} GiB, fits={result['fits']}", flush=True)
    if result["fits"]:
      break
  seconds = time.time() - start
  if (b, g) != (b0, g0):
    print(f"{name}: the recipe says B×G = {b0}×{g0}; the plan's largest that fits is {b}×{g}: set configs/tau2.py")
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
  RESULTS.mkdir(parents=True, exist_ok=True)
  out = {**plan.as_json(result), "recipe": name, "opening_tokens": OPENING_TOKENS, "device_memory_gb": H200_GB,
         "tried": tried, "seconds": seconds, "commit": commit.strip()}  # fmt: skip
  (RESULTS / f"plan_{name}.json").write_text(json.dumps(out, indent=1) + "\n")
  (RESULTS / f"plan_{name}.md").write_text(_markdown(name, result, tried, seconds, commit.strip()))
  print(plan.format_plan(result))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipe", action="append", help="a configs/tau2.py RECIPES name (default: all)")
  parser.add_argument("--search", action="store_true", help="down CANDIDATES until a B×G fits")
  args = parser.parse_args()
  names = args.recipe or list(_tau2().RECIPES)
  if len(names) == 1:
    plan_recipe(names[0], args.search)
    return
  for name in names:  # one process each: the device count is fixed when JAX starts
    subprocess.run([sys.executable, __file__, f"--recipe={name}"] + ["--search"] * args.search, check=True)


if __name__ == "__main__":
  main()
