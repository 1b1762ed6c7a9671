"""A damaged checkpoint (issue 46): each form of damage is one line naming the step, the file and what is wrong; a
restore falls back to the newest older step that reads, unless asked not to; an intact checkpoint of another config
is told apart from a damaged one; and training resumed from the fallback step ends as a run resumed from that step
without damage does. ``--mode=eval`` (`evaluate.restore_policy`) and ``serve --checkpoint`` (`serve.load`, which
calls it) fall back the same.

The damage: a data file of the arrays removed, or cut in half (TensorStore's NOT_FOUND / OUT_OF_RANGE), a JSON item's
metadata removed (orbax: a FileNotFoundError), and the array index ``state/_METADATA`` removed (orbax: an empty tree,
which the compatibility check took for another config's 67 arrays).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import evaluate, runtime, serve, train
from envace_jax.checkpoint import Checkpointer, DamagedCheckpointError, IncompatibleCheckpointError
from envace_jax.model import transformer
from tests.test_checkpoint import _abstract, _assert_bitwise_equal, _config, _params, _trained_state
from tests.test_resume import assert_same_state, assert_same_workdir, moved_from, shaped_rollout


def _data_file(step_dir: pathlib.Path) -> pathlib.Path:
  """The largest data file of a step's arrays (orbax's OCDBT store: ``state/d/<hash>``)."""
  return max((step_dir / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)


def _remove(path: pathlib.Path) -> None:
  path.unlink()


def _cut_in_half(path: pathlib.Path) -> None:
  os.truncate(path, path.stat().st_size // 2)


# name -> (the file damaged, relative to the step's folder, or a function of the folder; the damage; what is wrong)
DAMAGE = {
  "data file removed": (_data_file, _remove, "missing (NOT_FOUND"),
  "data file cut in half": (_data_file, _cut_in_half, "truncated (OUT_OF_RANGE"),
  "meta metadata removed": ("meta/metadata", _remove, "missing"),
  "config metadata removed": ("config/metadata", _remove, "missing"),
  "state/_METADATA removed": ("state/_METADATA", _remove, "missing"),
  "state/_METADATA cut in half": ("state/_METADATA", _cut_in_half, "not valid JSON"),
}


def damage(workdir, step: int, name: str) -> str:
  """Damages checkpoint ``step`` of ``workdir`` as DAMAGE[name] says; returns the file's path in the step's folder."""
  step_dir = pathlib.Path(workdir) / checkpoint_lib.CHECKPOINT_SUBDIR / str(step)
  which, how, _ = DAMAGE[name]
  path = which(step_dir) if callable(which) else step_dir / which
  how(path)
  return path.relative_to(step_dir).as_posix()


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
  """(workdir, {step: (params, opt_state)}): steps 1 and 2 of a small AdamW state, each step's arrays its own."""
  workdir = tmp_path_factory.mktemp("two_steps")
  states = {}
  with Checkpointer(workdir, config=_config(), max_to_keep=None, async_save=False) as ckpt:
    for step in (1, 2):
      states[step] = _trained_state(_params(jax.random.key(0)), steps=step)
      ckpt.save(step, params=states[step][0], opt_state=states[step][1], rng=jax.random.key(step))
  return workdir, states


def _copy(two_steps, tmp_path):
  workdir, states = two_steps
  shutil.copytree(workdir, tmp_path / "run")
  return tmp_path / "run", states


def _warnings(caplog) -> list[str]:
  return [
    r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "checkpoint step" in r.getMessage()
  ]


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_step_falls_back_to_the_step_before_it_in_one_line(two_steps, tmp_path, caplog, name):
  workdir, states = _copy(two_steps, tmp_path)
  path = damage(workdir, 2, name)
  what = DAMAGE[name][2]
  directory = workdir / checkpoint_lib.CHECKPOINT_SUBDIR
  abstract = _abstract(*states[1])

  with Checkpointer(workdir, read_only=True) as ckpt:
    with caplog.at_level(logging.WARNING):
      restored = ckpt.restore(abstract_state=abstract, fallback=True)
    assert restored.step == 1
    _assert_bitwise_equal(restored.params, states[1][0])
    _assert_bitwise_equal(restored.opt_state, states[1][1])
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(jax.random.key(1)))
    assert list(restored.damaged) == [2] and restored.damaged[2].startswith(f"{path}: {what}")
    # One line for the damaged step (the step, the file, what is wrong), one saying which step is restored instead.
    damaged_line, instead = _warnings(caplog)
    assert damaged_line.startswith(f"checkpoint step 2 in {directory} is damaged: {path}: {what}")
    assert (
      instead == f"checkpoint step 1 in {directory} restored instead of the damaged step 2: the newest step that reads"
    )
    assert "\n" not in damaged_line and "tensorstore_spec" not in damaged_line and "incompatible" not in damaged_line

    # Asked not to fall back: that one line is the error, with the setting that would have.
    with pytest.raises(DamagedCheckpointError) as err:
      ckpt.restore(abstract_state=abstract, fallback=False, fallback_setting="train.checkpoint_fallback")
  message = str(err.value)
  assert message.startswith(f"checkpoint step 2 in {directory} is damaged: {path}: {what}") and "\n" not in message
  assert "train.checkpoint_fallback is off, so no older step is tried" in message
  assert (err.value.step, err.value.path) == (2, path)
  assert not isinstance(err.value, IncompatibleCheckpointError)


def test_no_step_reads_is_one_line_listing_each(two_steps, tmp_path):
  workdir, states = _copy(two_steps, tmp_path)
  removed = damage(workdir, 2, "data file removed")
  damage(workdir, 1, "meta metadata removed")
  with Checkpointer(workdir, read_only=True) as ckpt, pytest.raises(DamagedCheckpointError) as err:
    ckpt.restore(abstract_state=_abstract(*states[1]), fallback=True)
  message = str(err.value)
  assert "\n" not in message
  assert message.startswith(
    f"no checkpoint in {workdir / 'checkpoints'} reads (step 2: {removed}: missing (NOT_FOUND: reading array "
  )
  assert "; step 1: meta/metadata: missing); start afresh in another workdir" in message


def test_readers_of_one_item_report_damage_in_one_line(two_steps, tmp_path):
  """read_config / read_meta / saved_arrays (inspect_checkpoint, serve's config) name the damage too."""
  workdir, _ = _copy(two_steps, tmp_path)
  damage(workdir, 2, "config metadata removed")
  with Checkpointer(workdir, read_only=True) as ckpt:
    for read in (ckpt.read_config, ckpt.read_meta, ckpt.saved_arrays):
      with pytest.raises(
        DamagedCheckpointError, match=r"^checkpoint step 2 in .* is damaged: config/metadata: missing$"
      ):
        read(2)
    step, config, damaged = ckpt.read_newest(ckpt.read_config)
    assert (step, config.model, damaged) == (1, "tiny", {2: "config/metadata: missing"})
    assert ckpt.read_meta(1)["step"] == 1


def test_another_configs_checkpoint_is_not_damage_and_does_not_fall_back(two_steps, tmp_path):
  """The arrays of step 2 read but do not fit: IncompatibleCheckpointError at once, even with fallback on, and its
  message says it is not damage; with state/_METADATA gone the same target is damage (above), not another config."""
  workdir, states = _copy(two_steps, tmp_path)
  params, opt_state = states[1]
  other = jax.tree.map(lambda x: jnp.zeros((3, *x.shape[1:]), x.dtype) if x.ndim == 2 else x, params)
  with Checkpointer(workdir, read_only=True) as ckpt, pytest.raises(IncompatibleCheckpointError) as err:
    ckpt.restore(abstract_state={"params": other, "opt_state": opt_state}, fallback=True)
  message = str(err.value)
  assert message.startswith(f"the checkpoint of step 2 in {workdir / 'checkpoints'} reads, but was made with an ")
  assert "incompatible config (not damage: another model, mode or dtype)" in message
  assert "damaged" not in message


def test_set_aside_moves_the_damaged_steps_away(two_steps, tmp_path):
  workdir, states = _copy(two_steps, tmp_path)
  damage(workdir, 2, "data file cut in half")
  with Checkpointer(workdir, max_to_keep=None) as ckpt:
    restored = ckpt.restore(abstract_state=_abstract(*states[1]), fallback=True)
    target = ckpt.set_aside(restored.damaged)
    assert target == str(workdir / checkpoint_lib.DAMAGED_SUBDIR)
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    assert sorted(os.listdir(target)) == ["2"]
    # Step 2 saves afresh; a second damaged step 2 set aside gets a suffix.
    assert ckpt.save(2, params=states[2][0], opt_state=states[2][1], rng=jax.random.key(2))
    ckpt.wait()
    assert ckpt.restore(abstract_state=_abstract(*states[2])).step == 2
    ckpt.set_aside([2])
    assert sorted(os.listdir(target)) == ["2", "2.1"]
  with Checkpointer(workdir, read_only=True) as ckpt, pytest.raises(checkpoint_lib.CheckpointError, match="read-only"):
    ckpt.set_aside([1])


# ---------------------------------------------------------------------------------------------------------------------
# Training, --mode=eval and serve --checkpoint on a damaged copy of tests/conftest.py's ``tiny_run`` (steps 1 and 2)


def _tiny_copies(tiny_run, tmp_path, *names: str) -> list[pathlib.Path]:
  source, _ = tiny_run
  copies = [tmp_path / name for name in names]
  for copy in copies:
    shutil.copytree(source, copy)  # the session's run is shared: damage copies only
  return copies


@pytest.fixture
def shaped_rewards(monkeypatch):
  """tests/test_resume.py's rewards that depend on the tokens sampled, so that an update moves the parameters."""
  monkeypatch.setattr(train.Trainer, "rollout", shaped_rollout(train.Trainer.rollout))


@pytest.mark.slow
def test_training_resumed_from_the_fallback_step_ends_as_an_undamaged_resume_from_it(
  tiny_run, tmp_path, shaped_rewards, capsys
):
  """Step 2's largest data file cut in half: with train.checkpoint_fallback=False the Trainer stops with the one
  line; by default it resumes step 1, moves step 2 to damaged_checkpoints/, redoes
  step 2 and ends as a Trainer resumed from the same run with step 2 simply absent: metrics rows, parameters (moved by
  the shaped rewards of tests/test_resume.py), optimizer state, RNG key, data position, checkpoints."""
  _, config = tiny_run
  damaged, clean = _tiny_copies(tiny_run, tmp_path, "damaged", "clean")
  path = damage(damaged, 2, "data file cut in half")
  shutil.rmtree(clean / checkpoint_lib.CHECKPOINT_SUBDIR / "2")
  step1 = Checkpointer(clean, read_only=True).restore(1).params

  strict = config.copy_and_resolve_references()
  strict.train.checkpoint_fallback = False
  with pytest.raises(DamagedCheckpointError, match=r"train.checkpoint_fallback is off, so no older step is tried"):
    train.Trainer(strict, str(damaged))
  assert sorted(os.listdir(damaged / checkpoint_lib.CHECKPOINT_SUBDIR)) == ["1", "2"]  # nothing moved

  resumed = train.Trainer(config, str(damaged))
  assert (
    resumed.start_step == 1 and list(resumed.damaged) == [2] and resumed.damaged[2].startswith(f"{path}: truncated")
  )
  moved = damaged / checkpoint_lib.DAMAGED_SUBDIR / "2"
  assert (moved / path).stat().st_size == (
    tiny_run[0] / checkpoint_lib.CHECKPOINT_SUBDIR / "2" / path
  ).stat().st_size // 2
  assert sorted(os.listdir(damaged / checkpoint_lib.CHECKPOINT_SUBDIR)) == ["1"]
  resumed.run()
  expected = train.Trainer(config, str(clean))
  assert expected.start_step == 1 and expected.damaged == {}
  expected.run()

  out = capsys.readouterr().out
  assert f"resumed from step 1 in {damaged / 'checkpoints'} (step 2 did not read: {path}: truncated (" in out
  assert moved_from(resumed.state.params, step1)
  assert_same_state(resumed, expected)
  assert_same_workdir(damaged, clean)  # metrics.jsonl rows, checkpoints [1, 2], step 2's saved meta
  with Checkpointer(damaged, read_only=True) as ckpt:
    assert ckpt.restore(2).damaged == {}  # the new step 2 reads


def _serve_falls_back_and_eval_stops(workdir: pathlib.Path):
  """serve.load on ``workdir`` (step 2 damaged) serves step 1's parameters; `evaluate.restore_policy` with
  ``train.checkpoint_fallback`` off raises: its ``pytest.raises`` info."""
  want = Checkpointer(workdir, read_only=True).restore(1).params
  config, _, samplers, name = serve.load(str(workdir), None, rows=1)
  assert name == "run-step1" and config.train.checkpoint_fallback is True
  _assert_bitwise_equal(samplers["policy"].params, want)
  model = runtime.load_model(config)
  model = dataclasses.replace(model, params=transformer.unstack_tree(model.params))
  config.train.checkpoint_fallback = False
  with pytest.raises(DamagedCheckpointError) as err:
    evaluate.restore_policy(config, model, str(workdir))
  return err


def test_eval_and_serve_restore_the_step_that_reads(tiny_run, tmp_path):
  """serve.load (``serve --checkpoint``) reads the config and restores the policy through `evaluate.restore_policy`
  (``--mode=eval``'s): both pass over the damaged step 2 and serve step 1's parameters; asked not to, one line."""
  (workdir,) = _tiny_copies(tiny_run, tmp_path, "run")
  path = damage(workdir, 2, "data file removed")
  err = _serve_falls_back_and_eval_stops(workdir)
  assert str(err.value).startswith(f"checkpoint step 2 in {workdir / 'checkpoints'} is damaged: {path}: missing (")
  assert "train.checkpoint_fallback is off" in str(err.value) and "\n" not in str(err.value)
  with pytest.raises(DamagedCheckpointError, match="--checkpoint_fallback is off"):
    serve.load(str(workdir / "."), None, rows=1, fallback=False)


def test_a_training_runs_parameter_file_cut_in_half_falls_back(tiny_run, tmp_path):
  """A training run keeps its large arrays in ``state/ocdbt.process_0/d/``; orbax wraps TensorStore's error for a shard
  of those in a bare ``Exception`` (a newcomer found it escaped the fallback with a 170-line traceback): step 2's
  largest data file cut in half is one line naming the array, and ``serve --checkpoint`` / ``--mode=eval`` restore
  step 1."""
  (workdir,) = _tiny_copies(tiny_run, tmp_path, "run")
  step_dir = workdir / checkpoint_lib.CHECKPOINT_SUBDIR / "2"
  largest = max((step_dir / "state" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
  _cut_in_half(largest)
  message = str(_serve_falls_back_and_eval_stops(workdir).value)
  # TensorStore's message for such a shard names the array, not the file: the line names the step's item and the array.
  directory = workdir / checkpoint_lib.CHECKPOINT_SUBDIR
  assert message.startswith(f"checkpoint step 2 in {directory} is damaged: state: truncated (OUT_OF_RANGE")
  assert "reading array params." in message and "\n" not in message and "tensorstore_spec" not in message
