"""A resumed run ends where the uninterrupted run ends, bit for bit; and the training loop on a device mesh.

Interrupted in-process (the uninterrupted run's workdir is copied as a kill right before a checkpoint save would leave
it, and a fresh Trainer resumes on the copy) in the warm-up, per_role, dynamic sampling, grpo_real_env and eval_every
configurations; SIGKILLed in a subprocess while orbax commits a checkpoint; from a checkpoint an earlier version of the
code wrote; and the loop on a 2x2x2 mesh of 8 fake devices against the same loop on one device.

The tiny random model never calls a tool, so every rollout of a task gets the same checklist reward, every advantage
is 0 and an RL update moves nothing (AdamW's weight decay at lr 1e-6 is below float32's resolution): parameters
that "match" would prove nothing. ``shaped_rollout`` therefore replaces each training trajectory's reward by a
deterministic function of the tokens it generated, so advantages are non-zero, every step has a gradient and a later
step samples from visibly updated weights; a resumed run that sampled anything else would get other rewards.

The suite's persistent compilation cache (tests/conftest.py) lets the killed subprocess load the uninterrupted run's
executables instead of compiling them again. A resumed run still compiles its own: its restored arrays are committed
to a device, a fresh run's are not, and that changes the programs' cache keys.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import metrics, runtime, train
from envace_jax.config import defaults
from envace_jax.envs import datasets
from envace_jax.rl import grpo
from envace_jax.sampling import sampler as sampler_lib
from envace_jax.sampling import sharding
from tests.test_train import _adam_counts, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What the machine and the process decide, the only metrics two runs may disagree on: wall-clock values (time, time/*,
# */tokens_per_s, cost/*/seconds), the resident set (memory/*) and the programs compiled (compile/*: a resumed
# process compiles again what the interrupted one had compiled).
WALL_CLOCK = re.compile(r"(^|/)time(/|$)|tokens_per_s$|seconds|^memory/|^compile/")


# Task ids whose trajectories all get reward 0.25 under ``shaped_rollout``: groups without signal, for dynamic sampling.
CONSTANT_REWARD_TASKS: set[str] = set()


def shaped_rollout(rollout):
  """``Trainer.rollout`` whose trajectories' rewards are (sum of their generated token ids mod 101) / 100: varied
  within a group and a function of what was sampled (see the module docstring); 0.25 for the tasks in
  ``CONSTANT_REWARD_TASKS``."""

  def shaped(self, tasks, key, group_size=None):
    trajectories, stats = rollout(self, tasks, key, group_size)
    for traj in trajectories:
      generated = sum(int(row.tokens[row.loss_mask].sum()) for row in traj.rows.values())
      reward = 0.25 if traj.task.id in CONSTANT_REWARD_TASKS else (generated % 101) / 100
      traj.reward = dataclasses.replace(traj.reward, reward=reward)
    return trajectories, stats

  return shaped


@pytest.fixture
def shaped_rewards(monkeypatch):
  monkeypatch.setattr(train.Trainer, "rollout", shaped_rollout(train.Trainer.rollout))


# ---------------------------------------------------------------------------------------------------------------------
# What two runs that must be equal are compared on


def _same(x, y) -> bool:
  return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def _deterministic(row: dict) -> dict:
  return {k: v for k, v in row.items() if not WALL_CLOCK.search(k)}


def assert_same_rows(rows, expected) -> None:
  """Same steps, same keys, same values (NaN equal to NaN), wall-clock keys aside."""
  assert [r["step"] for r in rows] == [r["step"] for r in expected]
  for row, want in zip(rows, expected, strict=True):
    got, want = _deterministic(row), _deterministic(want)
    assert got.keys() == want.keys(), (row["step"], sorted(got.keys() ^ want.keys()))
    differ = {k: (got[k], want[k]) for k in got if not _same(got[k], want[k])}
    assert not differ, (row["step"], differ)


def assert_same_trees(tree, expected, name: str) -> None:
  """Same structure (optax namedtuples included), every leaf bitwise equal."""
  assert jax.tree.structure(tree) == jax.tree.structure(expected), name
  flat, _ = jax.tree_util.tree_flatten_with_path(expected)
  for (path, want), got in zip(flat, jax.tree.leaves(tree), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{name}{jax.tree_util.keystr(path)}")


def assert_same_state(trainer: train.Trainer, expected: train.Trainer) -> None:
  """Parameters, the whole optimizer state, the update count, the RNG key and the data position."""
  assert_same_trees(trainer.state.params, expected.state.params, "params")
  assert_same_trees(trainer.state.opt_state, expected.state.opt_state, "opt_state")
  assert int(trainer.state.step) == int(expected.state.step)
  assert str(jax.random.key_impl(trainer.key)) == str(jax.random.key_impl(expected.key))
  np.testing.assert_array_equal(jax.random.key_data(trainer.key), jax.random.key_data(expected.key))
  assert trainer.stream.state() == expected.stream.state()


def assert_same_workdir(workdir, expected) -> None:
  """metrics.jsonl and eval.jsonl rows, the retained checkpoints and the last one's saved metadata."""
  assert_same_rows(metrics.read_jsonl(workdir), metrics.read_jsonl(expected))
  assert_same_rows(metrics.read_jsonl(workdir, "eval.jsonl"), metrics.read_jsonl(expected, "eval.jsonl"))
  ours, theirs = (checkpoint_lib.Checkpointer(d, read_only=True) for d in (workdir, expected))
  assert ours.all_steps() == theirs.all_steps()
  meta, want = ours.read_meta(), theirs.read_meta()
  assert (meta["step"], meta["rng"], meta["data_state"]) == (want["step"], want["rng"], want["data_state"])
  assert_same_rows([{"step": 0, **meta["metrics"]}], [{"step": 0, **want["metrics"]}])


def moved_from(params, initial) -> bool:
  """Whether any parameter of ``params`` differs from ``initial`` (a tree of the same structure)."""
  pairs = zip(jax.tree.leaves(params), jax.tree.leaves(initial), strict=True)
  return any(np.any(np.asarray(a) != np.asarray(b)) for a, b in pairs)


# ---------------------------------------------------------------------------------------------------------------------
# 1. Interrupted in-process, resumed by a fresh Trainer


def copy_when_saving(trainer: train.Trainer, at_save: int, to) -> None:
  """Makes ``trainer`` copy its workdir to ``to`` when step ``at_save`` is about to be checkpointed, after step
  ``at_save - 1``'s save has committed: the copy is the workdir a kill between the two leaves (step ``at_save - 1``'s
  checkpoint is the last, step ``at_save``'s metrics row, and its evaluation's, already written). The run goes on.

  The copy stands for a second, interrupted run of the same config: that run would write the same files up to that
  point (the same deterministic steps; the resumed run checks everything it reads from them), at the cost of running
  the first ``at_save`` steps again."""
  save = trainer.ckpt.save

  def copy_then_save(step, **kwargs):
    if step == at_save:
      trainer.ckpt.wait()
      shutil.copytree(trainer.workdir, to)
    return save(step, **kwargs)

  trainer.ckpt.save = copy_then_save


_FAST = {"grpo.learning_rate": 1e-3}  # with the shaped rewards, an update moves the policy a visible amount
RESUMES = {
  # Two parameter trees, each with its own AdamW state. Interrupted after step 1, the warm-up's only step: step 2,
  # the first RL step, resets both trees' AdamW states and switches their injected learning rate from the warm-up's
  # in the resumed process. Dynamic sampling is on and step 2's first task gets one reward for both rollouts, so the
  # resumed process draws another task (the stream position and the key of the extra batch come from the restore).
  "per_role_warmup_dynamic_sampling": {
    "train.steps": 2,
    "train.sft_warmup_steps": 1,
    "grpo.sft_learning_rate": 1e-2,
    "grpo.mode": "per_role",
    "grpo.dynamic_sampling": True,
    "train.eval_tasks": 0,
  },
  # Plain GRPO against the real tools (fresh environments per rollout in the resumed process), plain AdamW state;
  # step 2 evaluates on a held-out task (eval_every=2) in the resumed process, step 3 does not, then the final
  # evaluation. The evaluation's fidelity and reward-gap probes are off: they cost compiles and no resume logic.
  "grpo_real_env_eval_every": {
    "train.steps": 3,
    "grpo.mode": "grpo_real_env",
    "rollout.env_mode": "real",
    "grpo.trained_roles": ("act",),
    "train.eval_every": 2,
    "train.eval_tasks": 1,
    "eval.fidelity": False,
    "eval.fidelity_gold": False,
    "eval.reward_gap": False,
  },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_interrupted_run_resumes_bit_for_bit(tmp_path, data_dir, shaped_rewards, monkeypatch, name):
  """Stopped after step 1's checkpoint with step 2 already logged (the uninterrupted run's workdir at that moment,
  `copy_when_saving`), resumed by a new Trainer: parameters, every leaf of the optimizer state, the update count, the
  RNG key, the data position, every metrics row (the evaluation of step 2 included), the final evaluation and the
  last checkpoint's metadata equal the uninterrupted run's."""
  overrides = RESUMES[name]
  config = tiny_config(data_dir, **_FAST, **overrides)
  steps, warmup = overrides["train.steps"], overrides.get("train.sft_warmup_steps", 0)
  if config.grpo.dynamic_sampling:  # the first RL step's task: no signal
    stream = datasets.TaskStream(runtime.training_tasks(config), config.train.tasks_per_step, config.seed)
    first_rl = [stream.next_batch() for _ in range(warmup + 1)][-1][0].id
    monkeypatch.setattr(sys.modules[__name__], "CONSTANT_REWARD_TASKS", {first_rl})
  whole = train.Trainer(config, str(tmp_path / "whole"))
  workdir = tmp_path / "interrupted"
  copy_when_saving(whole, at_save=2, to=workdir)
  whole_result = whole.run()

  assert checkpoint_lib.Checkpointer(workdir, read_only=True).all_steps() == [1]
  assert [r["step"] for r in metrics.read_jsonl(workdir)] == [1, 2]  # step 2 was logged, never checkpointed

  resumed = train.Trainer(config, str(workdir))
  assert resumed.start_step == 1
  result = resumed.run()

  assert_same_state(resumed, whole)
  assert_same_workdir(workdir, tmp_path / "whole")
  assert (result["eval"] is None) == (whole_result["eval"] is None)
  assert_same_rows([{"step": steps, **(result["eval"] or {})}], [{"step": steps, **(whole_result["eval"] or {})}])
  # What makes the comparison mean something: the weights moved, the RL steps had a gradient, and the switches
  # that fall across the restart happened in the resumed process.
  rows = metrics.read_jsonl(workdir)
  trees = resumed.state.params.values() if config.grpo.mode == "per_role" else [resumed.state.params]
  assert all(moved_from(tree, resumed.model.params) for tree in trees)
  assert all(r["update/grad_norm"] > 0 for r in rows[warmup:]), [r.get("update/grad_norm") for r in rows]
  if warmup:  # per_role: ACT stepped at step 2 only, from the fresh state; REHEARSE (the tiny model calls no tool,
    # so RL has no REHEARSE row) stepped in the warm-up, then reset and never stepped again
    assert "sft/nll" in rows[0] and "sft/nll" not in rows[1]
    assert {n: _adam_counts(resumed.state.opt_state[n]) for n in ("act", "rehearse")} == {"act": {1}, "rehearse": {0}}
  if config.grpo.dynamic_sampling:  # the resumed process redrew the first RL step's group without signal
    assert [rows[warmup][f"dynamic_sampling/{k}"] for k in ("dropped_groups", "extra_draws", "groups")] == [1, 1, 1]
  if config.train.eval_every:  # step 2's evaluation, redone by the resumed run; the final one after step 3
    assert [any(k.startswith("eval/") for k in r) for r in rows] == [False, True, False]
    assert [r["step"] for r in metrics.read_jsonl(workdir, "eval.jsonl")] == [steps]


# ---------------------------------------------------------------------------------------------------------------------
# 2. SIGKILL while orbax commits a checkpoint

# Runs the main job with two test-only changes: the shaped rewards, and orbax's commit of step HANG_STEP's checkpoint
# (the rename of its tmp folder to the step's folder, after every item is written) held forever once it has written
# HANG_MARKER.
_MAIN_WITH_A_HANGING_SAVE = """
import asyncio, os, pathlib, runpy, sys
from orbax.checkpoint._src.path import atomicity
from envace_jax import train
from tests.test_resume import shaped_rollout

train.Trainer.rollout = shaped_rollout(train.Trainer.rollout)
finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def hang_before_commit(self, *args, **kwargs):
  if self.get_final().name == os.environ["HANG_STEP"]:
    pathlib.Path(os.environ["HANG_MARKER"]).write_text(str(self.get()))
    await asyncio.sleep(3600)
  return await finalize(self, *args, **kwargs)

atomicity.AtomicRenameTemporaryPath.finalize = hang_before_commit
sys.argv[0] = "envace_jax.main"
runpy.run_module("envace_jax.main", run_name="__main__", alter_sys=True)
"""


def _wait_for(condition, proc, log, what: str, timeout: float = 600) -> None:
  deadline = time.time() + timeout
  while not condition():
    if proc.poll() is not None:
      raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
    if time.time() > deadline:
      raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
    time.sleep(0.1)


@pytest.mark.slow
def test_killed_during_a_checkpoint_save_resumes_bit_for_bit(tmp_path, data_dir, shaped_rewards):
  """The main job (a subprocess) is SIGKILLed while orbax commits step 2's checkpoint, with step 2 logged and step 3
  waiting for that save before its update (`Trainer.finish_save`): the workdir then holds step 1 and step 2's unfinished
  tmp folder, which is no checkpoint. A new run resumes from step 1, removes the tmp folder, redoes steps 2 and 3, and
  ends with the uninterrupted run's parameters and optimizer state (in memory and in the step-3 checkpoint) and its
  metrics rows [1, 2, 3]."""
  overrides = {"train.steps": 3, "train.eval_tasks": 0, **_FAST}
  config = tiny_config(data_dir, **overrides)
  whole = train.Trainer(config, str(tmp_path / "whole"))
  whole.run()

  killed, marker, log = tmp_path / "killed", tmp_path / "hanging_save", tmp_path / "main.log"
  cmd = [
    sys.executable,
    "-c",
    _MAIN_WITH_A_HANGING_SAVE,
    f"--config={ROOT / 'configs' / 'tiny.py'}",
    f"--workdir={killed}",
    f"--config.env.data_dir={data_dir}",
    *(f"--config.{k}={v}" for k, v in overrides.items()),
  ]
  env = {**os.environ, "HANG_STEP": "2", "HANG_MARKER": str(marker)}
  with open(log, "wb") as out:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
  try:
    _wait_for(marker.exists, proc, log, "step 2's save reached its commit")
    rows = lambda: [r["step"] for r in metrics.read_jsonl(killed)]  # noqa: E731
    _wait_for(lambda: rows() == [1, 2], proc, log, "step 2 was logged")  # step 3's update waits for the save
    tmp = pathlib.Path(marker.read_text())
    assert tmp.is_dir() and (tmp / "state").is_dir()  # every item written, only the commit missing
    proc.send_signal(signal.SIGKILL)
    killed_at = time.time()
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  listed = sorted(os.listdir(killed / checkpoint_lib.CHECKPOINT_SUBDIR))
  assert listed == ["1", tmp.name] and tmp.name.startswith("2.orbax-checkpoint-tmp"), listed
  assert checkpoint_lib.Checkpointer(killed, read_only=True).all_steps() == [1]

  resumed = train.Trainer(config, str(killed))
  assert resumed.start_step == 1
  resumed.run()
  assert sorted(os.listdir(killed / checkpoint_lib.CHECKPOINT_SUBDIR)) == ["2", "3"]  # keep_checkpoints=2
  assert_same_state(resumed, whole)
  assert_same_workdir(killed, tmp_path / "whole")
  on_disk = [checkpoint_lib.Checkpointer(d, read_only=True).restore(3) for d in (killed, tmp_path / "whole")]
  assert_same_trees(on_disk[0].params, on_disk[1].params, "params")
  assert_same_trees(on_disk[0].opt_state, on_disk[1].opt_state, "opt_state")
  rows = metrics.read_jsonl(killed)
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert rows[0]["time"] < killed_at < rows[1]["time"]  # the killed run's row 2 was dropped and redone
  assert moved_from(resumed.state.params, resumed.model.params) and all(r["update/grad_norm"] > 0 for r in rows)


# ---------------------------------------------------------------------------------------------------------------------
# 3. A checkpoint written by an earlier version of the code

# Step 1 of configs/tiny.py's two-step run (no held-out evaluation) as commit fa2e314 wrote it, the last commit before
# the settings' defaults moved to envace_jax/config/defaults.py and the parameter trees to envace_jax/policy.py:
#   python -m envace_jax.main --config=configs/tiny.py --workdir=W --config.train.steps=2 --config.train.eval_tasks=0
# config.json and meta.json are W/checkpoints/1/{config,meta}/metadata verbatim; arrays.json is
# Checkpointer(W).saved_arrays(1) (the arrays themselves, 23 MB, are not committed).
EARLIER = ROOT / "tests" / "data" / "checkpoint_fa2e314"


@pytest.mark.slow
def test_a_checkpoint_written_by_an_earlier_version_resumes(tiny_run, tmp_path):
  """fa2e314's step-1 checkpoint of the run that tests/conftest.py's ``tiny_run`` makes today: the same config (the
  data directory aside; the settings added since at their defaults, as ``serve.load`` completes a stored config), RNG
  key and data position, and the same arrays (tree, shapes, dtypes). With its config and meta items verbatim and
  today's step-1 arrays in place of its own, a new Trainer resumes it at step 1 and ends as ``tiny_run`` ends: the
  step-2 metrics row and checkpoint, parameters and optimizer state bitwise."""
  source, config = tiny_run
  earlier = {name: json.loads((EARLIER / f"{name}.json").read_text()) for name in ("config", "meta", "arrays")}
  today = checkpoint_lib.Checkpointer(source, read_only=True)
  arrays = {name: [list(shape), str(dtype)] for name, (shape, dtype) in today.saved_arrays(1).items()}
  assert arrays == earlier["arrays"]
  stored = today.read_config(1).to_dict()
  stored["env"]["data_dir"] = earlier["config"]["env"]["data_dir"]
  # The settings added since at their defaults, except those whose default changed what runs do
  # (defaults.EARLIER_BEHAVIOUR): at the value that keeps what the earlier version did.
  completed = defaults.completed(earlier["config"])
  for dotted, value in defaults.EARLIER_BEHAVIOUR.items():
    *path, key = dotted.split(".")
    node, now = completed, stored
    for part in path:
      node, now = node[part], now[part]
    assert node[key] == value != now[key], dotted
    node[key] = now[key]
  assert stored == completed.to_dict()
  meta = today.read_meta(1)
  assert (meta["step"], meta["rng"], meta["data_state"]) == (1, earlier["meta"]["rng"], earlier["meta"]["data_state"])

  workdir = tmp_path / "run"
  step = workdir / checkpoint_lib.CHECKPOINT_SUBDIR / "1"
  shutil.copytree(pathlib.Path(source) / checkpoint_lib.CHECKPOINT_SUBDIR / "1", step)
  for item in ("config", "meta"):
    (step / item / "metadata").write_text(json.dumps(earlier[item]))
  assert checkpoint_lib.Checkpointer(workdir, read_only=True).read_config(1).env.data_dir != config.env.data_dir

  resumed = train.Trainer(config, str(workdir))
  assert resumed.start_step == 1
  resumed.run()
  assert_same_rows(metrics.read_jsonl(workdir), metrics.read_jsonl(source)[1:])
  want = today.restore(2)
  for name, tree in (("params", resumed.state.params), ("opt_state", resumed.state.opt_state)):
    pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(getattr(want, name)), strict=True)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs), name
  assert int(resumed.state.step) == 2


# ---------------------------------------------------------------------------------------------------------------------
# 4. The training loop on a mesh

_MESH = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}  # batch shards: data x fsdp = 4
# B x G = 4 rollout rows and micro-batches of 4 rows divide the 4 batch shards; the B = 2 openings, prefilled once per
# task before the fork, do not: unfold pads their cache with empty rows.
_ON_MESH = {
  "train.steps": 2,
  "train.eval_tasks": 0,
  "train.tasks_per_step": 2,
  "train.group_size": 2,
  "grpo.micro_batch_size": 4,
  # The parameters move ~1e-4 while the layouts' rollout logprobs differ by float rounding (one process prefills the
  # two tasks' shared opening once, two processes one each), which AdamW's first steps (g / (|g| + eps)) turn into
  # parameter differences of about lr x 2e-3.
  "grpo.learning_rate": 1e-4,
  "rollout.max_turns": 1,  # the user's opening, then one ACT generation: both samplers decode on the mesh
  # 6 new tokens each (tiny's 16 before): each decode step is a round of collectives, over gloo in the two-process
  # runs; the test alone 223 -> 193 CPU-s (2026-12-07).
  "rollout.user_max_new_tokens": 6,
  "rollout.act_max_new_tokens": 6,
}


def _one_device_mesh(config):
  """What the Trainer builds instead of ``runtime.make_mesh(config)`` to run on one device: a config cannot ask
  for it while 8 devices are visible (the mesh spans them all)."""
  return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _placement(tree) -> list[tuple[str, jax.sharding.Sharding, int]]:
  """(path, sharding, rank) of every array of ``tree``, kept apart from the arrays (donated buffers die)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path), x.sharding, x.ndim) for path, x in flat]


def _assert_placed(placement, shardings, name: str) -> None:
  """Every array of a ``_placement`` is laid out as the matching leaf of the tree ``shardings`` says."""
  for (path, got, ndim), want in zip(placement, jax.tree.leaves(shardings), strict=True):
    assert got.is_equivalent_to(want, ndim), (name + path, got, want)


def _recorded_run(config, workdir, single_device: bool):
  """Runs ``config`` with the shaped rewards. Returns the trainer, each step's trajectories, each ``generate`` call
  as (sampler, its params' placement, the KV cache's placement as passed in and as returned, the cache shardings
  the rules give on the sampler's mesh), and the shape [K, M, T] of each update's batch."""
  rollouts, generations, batches = [], [], []
  rollout, generate = shaped_rollout(train.Trainer.rollout), sampler_lib.Sampler.generate
  advance = sampler_lib.Stream.advance

  def recording_rollout(self, tasks, key, group_size=None):
    trajectories, stats = rollout(self, tasks, key, group_size)
    rollouts.append(trajectories)
    return trajectories, stats

  def recording_generate(self, cache, *args, **kwargs):
    params, before = _placement(self.params), _placement(cache)  # the cache is donated
    expected = sharding.cache_shardings(self.config, self.mesh, cache) if self.mesh is not None else None
    out, new = generate(self, cache, *args, **kwargs)
    generations.append((self, params, before, _placement(new), expected))
    return out, new

  def recording_advance(self, until=None):  # the policy's continuously batched decode loop
    sampler = self.sampler
    params, before = _placement(sampler.params), _placement(self.cache)
    expected = sharding.cache_shardings(sampler.config, sampler.mesh, self.cache) if sampler.mesh is not None else None
    out = advance(self, until)
    generations.append((sampler, params, before, _placement(self.cache), expected))
    return out

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train.Trainer, "rollout", recording_rollout)
    patch.setattr(sampler_lib.Sampler, "generate", recording_generate)
    patch.setattr(sampler_lib.Stream, "advance", recording_advance)
    if single_device:
      patch.setattr(runtime, "make_mesh", _one_device_mesh)
    trainer = train.Trainer(config, str(workdir))
    update = trainer.update
    trainer.update = lambda state, batch: (batches.append(np.shape(batch.tokens)), update(state, batch))[1]
    trainer.run()
  return trainer, rollouts, generations, batches


def _devices(placement) -> set:
  return {d for _, s, _ in placement for d in s.device_set}


@pytest.mark.slow
def test_training_loop_on_a_2x2x2_mesh_matches_one_device_and_two_processes(tmp_path, data_dir):
  """Two steps of the Trainer on a (data 2, fsdp 2, tensor 2) mesh of 8 fake CPU devices: the sampler's parameters
  and every KV cache it decodes into, and the train state's parameters and AdamW moments, are sharded over the mesh
  as the logical-axis rules say. The same two steps on one device sample the same tokens (same keys; the logits
  differ by float rounding only), and end with parameters equal to 1e-5 (each moved ~2e-4 from the initial weights).
  The same two steps of ``python -m envace_jax.main`` on 2 processes x 4 devices end with the mesh run's parameters
  to 1e-6, and resume bit for bit (tests/test_multihost.py's `check_two_processes`).
  """
  single, single_rollouts, single_calls, single_batches = _recorded_run(
    tiny_config(data_dir, **_ON_MESH), tmp_path / "one", single_device=True
  )
  meshed, rollouts, calls, batches = _recorded_run(
    tiny_config(data_dir, **_ON_MESH, **_MESH), tmp_path / "mesh", single_device=False
  )

  # One device: the update off the mesh; the state, the sampler's parameters and its caches on device 0.
  assert single.mesh.size == 1 and single.update_mesh is None
  assert _devices(_placement(single.state)) == {jax.devices()[0]}
  assert {d for _, *placements, _ in single_calls for p in placements for d in _devices(p)} == {jax.devices()[0]}

  # The mesh: the sampler (the policy's and the reference user's) decodes on it, parameters and every KV cache
  # sharded by the rules; the update takes micro-batches of 4 rows (one per batch shard) and returns the state
  # sharded by the rules.
  mesh = meshed.mesh
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2} and meshed.update_mesh is mesh
  assert all(s.mesh is mesh for s in meshed.samplers.values())
  assert {id(s) for s, *_ in calls} == {id(s) for s in meshed.samplers.values()}
  paged_calls = 0
  for s, params, before, after, expected in calls:
    _assert_placed(params, sharding.param_shardings(s.config, mesh), "sampler params")
    embed = dict((path, sh) for path, sh, _ in params)["['embed']"]  # [vocab, embed]: over tensor and fsdp
    assert embed.spec == PartitionSpec("tensor", "fsdp") and len(embed.device_set) == 8
    _assert_placed(before, expected, "cache passed in")
    _assert_placed(after, expected, "cache returned")
    placed = dict((path, sh) for path, sh, _ in after)
    if ".pools[0]" in placed:  # pages (rollout.kv_page_size): rows and pages together over data x fsdp (paged.Shards)
      assert placed[".pools[0]"].is_equivalent_to(NamedSharding(mesh, PartitionSpec(("data", "fsdp"))), 4)
      paged_calls += 1
    else:  # dense rows: [B, K, S, H] rows over data x fsdp, heads over tensor
      assert placed[".v[0]"].is_equivalent_to(NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "tensor")), 4)
  assert paged_calls  # the views' own slots are pages on the mesh too
  assert batches and {m for _, m, _ in batches} == {4} and single_batches == batches
  state_shardings = grpo.train_state_shardings(meshed.model.config, meshed.grpo_cfg, mesh)
  _assert_placed(_placement(meshed.state.params), state_shardings.params, "params")
  _assert_placed(_placement(meshed.state.opt_state), state_shardings.opt_state, "opt_state")
  up = meshed.state.params["layers_0"]["mlp"]["up_proj"]  # [embed, mlp]: the state holds its layers apart
  assert up.sharding.spec == PartitionSpec("fsdp", "tensor") and len(up.sharding.device_set) == 8
  (_, mu), *_ = optax.tree_utils.tree_get_all_with_path(meshed.state.opt_state, "mu")
  assert mu["layers_0"]["mlp"]["up_proj"].sharding.spec == up.sharding.spec  # AdamW's moments sharded like params
  # The policy sampler samples the state's own (sharded) arrays: no copy on the mesh either.
  policy = jax.tree.leaves(meshed.samplers["policy"].params)
  assert all(a is b for a, b in zip(policy, jax.tree.leaves(meshed.state.params), strict=True))

  # The same rollouts: every row's tokens, roles and loss mask exactly, the sampler's logprobs to float rounding.
  assert len(rollouts) == len(single_rollouts) == 2
  for step, (ours, theirs) in enumerate(zip(rollouts, single_rollouts, strict=True), 1):
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs, strict=True):
      assert a.rows.keys() == b.rows.keys() and a.reward.reward == b.reward.reward, step
      for role in a.rows:
        for field in ("tokens", "roles", "loss_mask"):
          np.testing.assert_array_equal(getattr(a.rows[role], field), getattr(b.rows[role], field), err_msg=field)
        np.testing.assert_allclose(a.rows[role].logprobs, b.rows[role].logprobs, atol=1e-5)
  # Then the parameters after two sharded updates equal the single-device ones.
  leaves = zip(jax.tree.leaves(single.state.params), jax.tree.leaves(single.model.params), strict=True)
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in leaves)
  assert moved > 1e-4, moved  # so that agreeing to 1e-5 says something about the updates
  for a, b in zip(jax.tree.leaves(meshed.state.params), jax.tree.leaves(single.state.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)

  # The mesh run (1 process x 8 devices) is the two-process main job's reference.
  from tests.test_multihost import check_two_processes

  check_two_processes({**_ON_MESH, **_MESH}, tmp_path / "mesh", tmp_path, data_dir)
