"""Entry point: python -m envace_jax.main --config=configs/tau2.py --workdir=DIR [--mode=train|eval|demo]

Parses flags and hands over; nothing else lives here. ``train`` (the default) runs world-rehearsal training and a
held-out evaluation (``train.train_and_evaluate``); ``eval`` evaluates the latest checkpoint in DIR (or the base
weights) with test-time private rehearsal off / parallel / sequential (``evaluate.run``); ``demo`` samples one ACT
turn on real weights.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Config file, e.g. configs/tau2.py (or configs/tau2.py:retail)."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs (a checkpoint resumes).")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "demo"], "What to run.")
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _MODE.value == "demo":
    from envace_jax import demo

    demo.run(_CONFIG.value, _WORKDIR.value)
  elif _MODE.value == "train":
    if not _WORKDIR.value:
      raise app.UsageError("--mode=train needs --workdir=DIR (checkpoints, metrics.jsonl, TensorBoard events)")
    from envace_jax import train

    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  elif _MODE.value == "eval":
    from envace_jax import evaluate

    evaluate.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
