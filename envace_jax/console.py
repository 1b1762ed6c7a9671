"""What ``python -m envace_jax.main`` prints, and how absl's ``--verbosity`` brings the rest back
(docs/getting-started.md).

    console.setup(verbosity_given=flags.FLAGS["verbosity"].present > 0)   # in main(), after absl parsed the flags
    console.config_error(error)                                            # one line per problem, exit status 2

By default the job prints warnings and errors of every library, the progress bar and each step's line
(``metrics.MetricsWriter``), and the held-out table. ``absl.app.run`` itself would turn an unset ``--verbosity`` into
0 (INFO), so ``setup`` sets it back to -1 (WARNING) when the flag was not given.

The libraries log three ways, and ``setup`` treats each:
  * python ``logging`` (orbax, TFDS, JAX, tensorboardX and our own ``absl.logging``): absl's handler on the root
    logger, at the root level that ``--verbosity`` sets. ``setup`` wraps that handler so that a line clears the
    progress bar and redraws it below (tqdm's ``external_write_mode``), and sends Python ``warnings`` there too.
  * loguru (τ², the ``tau2`` package): its default handler writes DEBUG and up to stderr; ``setup`` replaces it with
    a sink into python logging at the same level, so ``--verbosity`` governs it and its lines look like the rest.
  * TFDS while ``envace_jax/envs/datasets.py`` prepares a dataset (once per ``env.data_dir``): below INFO its
    progress bars are off (``tfds.disable_progress_bar``) and its two printed lines ("Downloading and preparing
    dataset Unknown size ...", "Dataset ... downloaded and prepared to ...", printed unconditionally by
    ``DatasetBuilder._log_download_bytes`` / ``_log_download_done``; nothing is downloaded) become INFO log lines.
Below INFO, warnings that say nothing about the run are also dropped: those starting with ``BENIGN`` (tensorboardX's
NaN warning: ``metrics.py`` writes NaN for a metric undefined at a step) and τ²'s import-time notices about its own
LLM setup ("No .env file found", "Sonnet thinking is disabled").

Only the command line calls ``setup``: the library and the notebooks keep every library's own logging set-up.
"""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

from absl import flags
from absl import logging as absl_logging

QUIET_VERBOSITY = -1  # absl's WARNING
# How the warnings dropped below INFO begin: tensorboardX's x2num.py; orbax's checkpoint_manager.py, that a read-only
# manager (`--mode=eval`'s) neither saves nor deletes; τ² airline's tools.py, at every cancel_reservation call, gold
# or the policy's, that its simulated DB does not release seats.
BENIGN = (
  "NaN or Inf found in input tensor.",
  "CheckpointManagerOptions.read_only=True, setting ",
  "Given directory is read only=",
  "Seats release not implemented for cancellation",
)


class _AboveBars(logging.Handler):
  """Emits each record through ``inner`` with tqdm's bars cleared first and redrawn after, so a log line never lands
  in the middle of a progress bar."""

  def __init__(self, inner: logging.Handler):
    super().__init__()
    self.inner = inner

  def emit(self, record: logging.LogRecord) -> None:
    import tqdm

    if record.name == "py.warnings":  # captureWarnings' text ends with a newline: no blank line after it
      record.msg, record.args = record.getMessage().rstrip("\n"), ()
    with tqdm.tqdm.external_write_mode(file=sys.stderr):
      self.inner.handle(record)


class _ToPythonLogging(logging.Handler):
  """A loguru sink (loguru calls ``handle`` with a ``LogRecord``): hands each record to the python logger of the
  same name, whose handlers are the root's."""

  def emit(self, record: logging.LogRecord) -> None:
    logging.getLogger(record.name).handle(record)


def _not_benign(record: logging.LogRecord) -> bool:
  return not record.getMessage().startswith(BENIGN)


def _not_tau2_import_notice(record: dict) -> bool:
  """False for what a ``tau2`` module logs while it is imported (function ``<module>``)."""
  return not (record["name"] or "").startswith("tau2.") or record["function"] != "<module>"


def setup(verbosity_given: bool) -> int:
  """Sets up the command line's output (see the module docstring). Call once, after absl parsed the flags.

  Args:
    verbosity_given: whether ``--verbosity`` (or ``-v``) was on the command line; if not, the level is WARNING.

  Returns:
    The python logging level in force (``logging.WARNING`` by default, ``logging.INFO`` for ``--verbosity=0``).
  """
  if not verbosity_given:
    flags.FLAGS.verbosity = QUIET_VERBOSITY  # absl sets the root logger's level from the flag
  root = logging.getLogger()
  level = root.getEffectiveLevel()
  quiet = level > logging.INFO
  absl_handler = absl_logging.get_absl_handler()
  if absl_handler in root.handlers:
    root.removeHandler(absl_handler)
    handler = _AboveBars(absl_handler)
    if quiet:
      handler.addFilter(_not_benign)
    root.addHandler(handler)
  logging.captureWarnings(True)  # Python's warnings (as its filters let through) as log records, above the bar too
  if quiet:
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    builder = tfds.core.DatasetBuilder
    if hasattr(builder, "_log_download_bytes") and hasattr(builder, "_log_download_done"):  # TFDS 4.9
      builder._log_download_bytes = lambda self: absl_logging.info("preparing %s in %s", self.name, self.data_dir)
      builder._log_download_done = lambda self: absl_logging.info("prepared %s in %s", self.name, self.data_dir)
  try:
    from loguru import logger
  except ImportError:  # no τ² installed: nothing logs with loguru
    return level
  logger.remove()
  logger.add(_ToPythonLogging(), level=level, format="{message}", filter=_not_tau2_import_notice if quiet else None)
  return level


def config_error(error: Exception) -> NoReturn:
  """Prints a bad config's problems, one line each (``config_check.ConfigError.problems``), to stderr and exits with
  status 2, without a traceback."""
  problems = getattr(error, "problems", None) or [str(error)]
  for problem in problems:
    print(f"invalid config: {problem}", file=sys.stderr, flush=True)
  sys.exit(2)
