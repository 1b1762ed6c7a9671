"""Entry point: python -m envace_jax.main --config=configs/base.py --mode=demo

Parses flags and hands over; nothing else lives here. Modes arrive with the issues that build them: ``demo`` (the
sampler on real weights) today; ``train`` and ``eval`` with role-wise GRPO and committed execution.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py (or file.py:arg).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")
_MODE = flags.DEFINE_enum("mode", "demo", ["demo"], "What to run.")
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _MODE.value == "demo":
    from envace_jax import demo

    demo.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
