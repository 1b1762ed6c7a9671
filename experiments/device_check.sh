#!/usr/bin/env bash
# One machine with one accelerator, at most 9.5 minutes: what the code reaches there.
#
#   experiments/device_check.sh [--dry] [OUTDIR]        # default OUTDIR: /tmp/envace_device_check
#
#   1. experiments/device_check.py: random-init Qwen3-1.7B- and Qwen3-8B-shaped models in bfloat16, decode tok/s and
#      its fraction of HBM bandwidth over a dense cache and over a rollout's (a shared prefix level and paged own
#      slots), with the backend's attention and with the reference, update MFU;
#   2. `python -m envace_jax.main --mode=plan`: the memory table of a Qwen3-1.7B run on this one device (a Qwen3-8B
#      run's float32 master weights and moments alone are 96 GB: one device does not hold it; see the recipes);
#   3. the tiny main job (configs/tiny.py).
# Each step has its own time limit (5 + 2 + 2.5 minutes); the output and OUTDIR/device_check.json hold the figures.
# On a CPU backend (JAX's CPU build, or no device visible) it stops at once with status 1 and one line, unless --dry:
# the same steps with tiny shapes, a tiny plan and a one-step main job without evaluation, to check the script
# (tests/test_experiments.py runs it). $PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [[ "${1:-}" == "--dry" ]]; then
  DRY=1
  shift
fi
OUTDIR=${1:-/tmp/envace_device_check}
PYTHON=${PYTHON:-python}
export LITELLM_LOCAL_MODEL_COST_MAP=True PYTHONUNBUFFERED=1
if ! backend=$("$PYTHON" -c 'import jax; print(jax.default_backend())' 2>/dev/null); then
  echo "device_check.sh: $PYTHON cannot import jax and name its backend; install the project first (make install," \
    "EXTRAS=cuda12 or tpu on an accelerator) or set PYTHON to that environment's python" >&2
  exit 1
fi
if [[ $DRY == 0 && $backend == cpu ]]; then
  echo "device_check.sh: JAX's backend is cpu, not an accelerator (JAX's CPU build, or no device visible; install" \
    "the accelerator build: make install EXTRAS=cuda12, or tpu); pass --dry to check the script on CPU" >&2
  exit 1
fi
if [[ $DRY == 1 ]]; then
  echo "dry run (--dry): tiny shapes, a tiny plan and a one-step main job"
fi
mkdir -p "$OUTDIR"

step() {  # step SECONDS NAME COMMAND...: runs and times one step; a failed or timed-out step fails the script
  local limit=$1 name=$2 start=$SECONDS
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  echo "== $name: $((SECONDS - start)) s"
}

DATA="--config.env.data_dir=${DATA_DIR:-$OUTDIR/tfds}"  # DATA_DIR: TFDS datasets prepared before
if [[ $DRY == 1 ]]; then
  step 120 "decode and update" "$PYTHON" experiments/device_check.py --dry --out "$OUTDIR/device_check.json"
  step 90 "plan" "$PYTHON" -m envace_jax.main --config=configs/tiny.py --mode=plan "$DATA"
  step 150 "tiny main job" "$PYTHON" -m envace_jax.main --config=configs/tiny.py --workdir="$OUTDIR/tiny_run" "$DATA" \
    --config.train.steps=1 --config.train.eval_tasks=0
else
  step 300 "decode and update" "$PYTHON" experiments/device_check.py --out "$OUTDIR/device_check.json"
  # Qwen3-1.7B, bfloat16 compute over float32 master weights, 2 tasks x 4 rollouts, 12k slots per view with a shared
  # 5k-token opening, on this device.
  step 120 "plan" "$PYTHON" -m envace_jax.main --config=configs/tau2.py:mock --mode=plan "$DATA" \
    --config.model=qwen3-1.7b --config.dtype=bfloat16 \
    --config.train.tasks_per_step=2 --config.train.group_size=4 --config.grpo.micro_batch_size=1 \
    --config.rollout.act_capacity=12288 --config.rollout.rehearse_capacity=12288 \
    --config.rollout.user_capacity=12288 --opening_tokens=5000
  step 150 "tiny main job" "$PYTHON" -m envace_jax.main --config=configs/tiny.py --workdir="$OUTDIR/tiny_run" "$DATA"
fi
