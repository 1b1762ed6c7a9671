"""Entry point: python -m envace_jax.main --config=configs/tau2.py --workdir=DIR [--mode=train|eval|demo|plan]

Parses flags and hands over; nothing else lives here. ``train`` (the default) runs world-rehearsal training and a
held-out evaluation (``train.train_and_evaluate``); ``eval`` evaluates the latest checkpoint in DIR with the config
saved with it (``--config`` is then optional; ``--config.KEY=VALUE`` flags override it), or, when DIR holds none, the
base weights of ``--config``'s model (said in one line), with test-time private rehearsal off / parallel / sequential
(``evaluate.run``); ``demo`` samples one ACT turn on real weights; ``plan`` prints each device's memory for the run
from its compiled programs, with no weights loaded (``plan.run``; ``--device_memory_gb`` to compare with a device JAX
reports no limit for, ``--opening_tokens`` for the openings a task's rollouts share).

Across processes (JAX's multi-controller runtime, ``distributed.py``): start the same command on every host with
``--coordinator=HOST:PORT --num_processes=N --process_id=I`` (or ``--distributed`` to take them from the cluster:
Cloud TPU, SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``); the processes join before any device is touched. Training
only: the other modes run in one process.

Output (``console.py``): warnings, the progress bar with a line per step, and the held-out table; absl's
``--verbosity=0`` (INFO) or ``--verbosity=1`` (DEBUG) brings back every library's log. A bad config value prints one
line per problem (the key, its value, the valid values) and exits with status 2, before anything loads; a usage error
(a missing flag, a config file that does not load, a ``--config.KEY`` that names no setting, a workdir that is a
file) prints one line and exits with status 1.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags

# --config's value when none is given: the defaults, so that --mode=eval's --config.KEY=VALUE flags parse against
# them; every other mode asks for --config.
_DEFAULTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", "defaults.py")
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  _DEFAULTS_FILE,
  "Config file, e.g. configs/tau2.py (or configs/tau2.py:retail). Needed by every mode but --mode=eval on a workdir "
  "with a checkpoint, which uses the run's own config stored with it (--config.KEY=VALUE flags override it); the "
  "default shown only parses those flags.",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs (a checkpoint resumes).")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "demo", "plan"], "What to run.")
_DEVICE_GB = flags.DEFINE_float(
  "device_memory_gb", 0.0, "--mode=plan: device memory in GB to compare with (0: the limit JAX reports, if any)."
)
_PLAN_BACKEND = flags.DEFINE_enum(
  "plan_backend", "", ["", "cpu", "gpu", "tpu"], "--mode=plan: the backend planned for (default: this process's)."
)
_OPENING = flags.DEFINE_integer(
  "opening_tokens", 0, "--mode=plan: tokens of each view's opening, stored once for a task's G rollouts (0: none)."
)
_COORDINATOR = flags.DEFINE_string("coordinator", "", "Multi-process: HOST:PORT of process 0's coordination service.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Multi-process: the number of processes (0: single).")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "Multi-process: this process's index, 0 .. num_processes-1.")
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed", False, "Multi-process with the coordinator, count and index jax.distributed detects (TPU, SLURM)."
)
_HEARTBEAT = flags.DEFINE_integer(
  "heartbeat_timeout_s", 100, "Multi-process: seconds without a peer's heartbeat before every process ends."
)


def _usage(message: str) -> SystemExit:
  """A usage error: one line on stderr, exit status 1 (absl's UsageError would print every flag's help first)."""
  return SystemExit(f"envace_jax.main: {message} (--helpshort lists the flags)")


def _load_config():
  """``--config``'s value (ml_collections loads the file at parsing and hands a stand-in that raises on any use when it
  did not load).

  Raises:
    SystemExit: the file does not load (`_usage`, with the loader's own reason).
  """
  config = _CONFIG.value
  if type(config).__name__ == "_ErrorConfig":
    reason = " ".join(" ".join(str(config._error).splitlines()[1:]).split()) or str(config._error)
    raise _usage(f"--config does not load: {reason}")
  return config


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag or a ``--config.KEY`` the config lacks as one line (`_usage`).

  Raises:
    SystemExit: naming the flag, or the key with ml_collections' "Did you mean" suggestion.
  """
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise _usage(str(e)) from None
  except (AttributeError, KeyError) as e:  # ml_collections: KeyError("'stepz'\nDid you mean "steps" ...?"), wrapped
    message = e
    while isinstance(message, BaseException) and message.args:
      message = message.args[0]
    raise _usage(f"a --config.KEY flag names no setting of the config: {' '.join(str(message).split())}") from None


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise _usage(f"unexpected arguments: {argv[1:]}")
  from envace_jax import config_check, console, distributed

  config_given = flags.FLAGS["config"].present > 0
  if not config_given and _MODE.value != "eval":
    raise _usage(f"--mode={_MODE.value} needs --config=FILE (e.g. configs/tau2.py)")
  config = _load_config()
  if _WORKDIR.value and os.path.exists(_WORKDIR.value) and not os.path.isdir(_WORKDIR.value):
    raise _usage(f"--workdir={_WORKDIR.value} is a file, not a directory")
  multi = _DISTRIBUTED.value or _COORDINATOR.value or _NUM_PROCESSES.value or _PROCESS_ID.value >= 0
  if multi and _MODE.value != "train":
    raise _usage(f"--mode={_MODE.value} runs in one process; only --mode=train runs across processes")
  try:  # first: nothing may touch a device before the processes join
    joined = distributed.initialize(
      _COORDINATOR.value,
      _NUM_PROCESSES.value,
      _PROCESS_ID.value,
      auto=_DISTRIBUTED.value,
      heartbeat_timeout_s=_HEARTBEAT.value,
    )
  except ValueError as e:
    raise _usage(str(e)) from None

  console.setup(verbosity_given=flags.FLAGS["verbosity"].present > 0)
  from envace_jax import compilation_cache

  compilation_cache.enable()  # before the first compile (envace_jax/compilation_cache.py: where, how to turn it off)
  try:
    if _MODE.value == "demo":
      from envace_jax import demo

      demo.run(config, _WORKDIR.value)
    elif _MODE.value == "train":
      if not _WORKDIR.value:
        raise _usage("--mode=train needs --workdir=DIR (checkpoints, metrics.jsonl, TensorBoard events)")
      config_check.validate(config)  # before the training loop's imports: a bad value costs seconds
      from envace_jax import train

      train.train_and_evaluate(config, _WORKDIR.value)
    elif _MODE.value == "eval":
      from envace_jax import evaluate

      try:  # the run's own config where the workdir holds a checkpoint, with the --config.KEY flags given
        config = evaluate.command_config(config, _WORKDIR.value, flags.FLAGS["config"].override_values, config_given)
      except ValueError as e:
        raise _usage(str(e)) from None
      config_check.validate(config)
      evaluate.run(config, _WORKDIR.value)
    elif _MODE.value == "plan":
      from envace_jax import plan

      plan.run(config, _DEVICE_GB.value, _OPENING.value, _PLAN_BACKEND.value)
  except config_check.ConfigError as e:
    console.config_error(e)
  except Exception as e:  # noqa: BLE001 - re-raised unless it is a CheckpointError
    checkpoint = sys.modules.get("envace_jax.checkpoint")  # imported by whatever raised one
    if checkpoint is None or not isinstance(e, checkpoint.CheckpointError):
      raise
    # A checkpoint that is damaged with nothing to fall back to, or of another config: its message, no traceback.
    raise SystemExit(f"envace_jax.main: {e}") from None
  if joined:
    import jax

    jax.distributed.shutdown()  # waits for every process to get here (shutdown_timeout_seconds)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
