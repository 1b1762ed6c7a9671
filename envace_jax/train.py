"""The training loop: self-unfolded rollouts → rewards → role-wise advantages → GRPO update → checkpoint, metrics.

    python -m envace_jax.main --config=configs/tau2.py --workdir=DIR

A step: docs/method.md, "How a training step runs" (paper §3). A workdir with a checkpoint resumes from it, bit for bit:
step s samples with ``fold_in(key(seed), s)`` and draws tasks from the restored ``TaskStream`` position, so a resumed
run repeats exactly what the uninterrupted run would have done. A latest checkpoint that does not read (a file
missing or cut short) is reported in one line and the newest older step that reads is resumed instead, the damaged
steps moved to ``workdir/damaged_checkpoints/`` (``train.checkpoint_fallback``; `checkpoint.Checkpointer.read_newest`).
Across processes (``--coordinator``, ...) each rolls out its share of the step's tasks and the update runs over the
global mesh (``distributed.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import config_check, distributed, heldout, metrics, runtime, scoring
from envace_jax import policy as policy_lib
from envace_jax.envs import datasets, registry
from envace_jax.envs.base import EnvError, Task
from envace_jax.model import transformer
from envace_jax.model.roles import NUM_ROLES, Role
from envace_jax.rehearsal import demonstration, views
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rehearsal.trajectory import Trajectory
from envace_jax.rehearsal.unfold import generated_tokens, unfold
from envace_jax.rl import advantages as advantages_lib
from envace_jax.rl import grpo, logprobs
from envace_jax.rl.batch import TrainBatch
from envace_jax.sampling import sharding


def rollout_metrics(trajectories: Sequence[Trajectory], stats: dict[str, float]) -> dict[str, float]:
  """Per-step rollout scalars: reward (mean and std over the valid trajectories, and as each role's rows see it),
  invalid trajectories and scoring errors (`scoring.counts`), validity rates, turns, termination reasons,
  throughput."""
  out: dict[str, float] = {}
  valid = [t for t in trajectories if t.reward is not None and t.reward.valid]
  r = np.array([t.reward.reward for t in valid], np.float64)
  out["reward/mean"] = float(r.mean()) if len(r) else float("nan")
  out["reward/std"] = float(r.std()) if len(r) else float("nan")
  out.update(scoring.counts(trajectories))
  for role in (Role.ACT, Role.REHEARSE, Role.USER):
    name = role.name.lower()
    had = [t.reward.reward for t in valid if int(role) in t.rows]
    if had:  # the reward as seen by this role's rows: each trajectory that has the role once
      out[f"reward/{name}/mean"], out[f"reward/{name}/std"] = float(np.mean(had)), float(np.std(had))
  totals = collections.Counter()
  for t in trajectories:
    totals.update(t.counts)
    totals[f"termination/{t.termination.value if t.termination else 'none'}"] += 1
  calls, acts = totals["tool_calls"], totals["generations_act"]
  out["rollout/tool_call_validity"] = scoring.tool_call_validity(trajectories)
  out["rollout/tool_calls_per_trajectory"] = calls / len(trajectories)
  rehearsed = totals["generations_rehearse"]
  out["rollout/rehearsed_json_validity"] = (
    1.0 - totals["invalid_rehearsed_json"] / rehearsed if rehearsed else float("nan")
  )
  out["rollout/turns"] = acts / len(trajectories)
  out["rollout/unencodable_chars"] = float(totals["unencodable_chars"])  # shown as U+FFFD (model/sanitize.py)
  for k, v in totals.items():
    if k.startswith("termination/"):
      out[k] = float(v)
  generated = generated_tokens(stats)
  seconds = stats.get("time_total_s", 0.0)
  out["rollout/generated_tokens"] = float(generated)
  out["rollout/prefill_tokens"] = float(stats.get("prefill_tokens", 0) + stats.get("prefill_tokens_shared", 0))
  out["rollout/prefill_tokens_reused"] = float(stats.get("prefill_tokens_reused", 0))  # shared, not prefilled
  out["rollout/kv_slots"] = float(stats.get("kv_slots", 0))
  out["rollout/kv_slots_held"] = float(stats.get("kv_slots_held", 0))
  out["rollout/kv_slots_dense"] = float(stats.get("kv_slots_dense", 0))
  # generated tokens per (row computed x decode iteration): the share of the decode's row-steps that made a token
  out["rollout/slot_utilisation"] = (
    generated / stats["decode_row_steps"] if stats.get("decode_row_steps") else float("nan")
  )
  out["rollout/tokens_per_s"] = (generated + out["rollout/prefill_tokens"]) / seconds if seconds else float("nan")
  out["time/rollout_s"] = float(seconds)
  return out


_DYNAMIC_SAMPLING_STREAM = 0xD5A  # streams of a step's key (values fixed: they decide every rollout)
_EVALUATION_STREAM = 0x5EED


@contextlib.contextmanager
def _untimed_phase(name: str) -> Iterator[dict[str, Any]]:
  """`Trainer.phase`'s default: the phase's outputs go into a dict nobody reads; nothing is timed."""
  del name
  yield {}


def group_trajectories(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
  """Trajectories by GRPO group (``Trajectory.group``), groups in order of first appearance."""
  groups: dict[int, list[Trajectory]] = {}
  for traj in trajectories:
    groups.setdefault(traj.group, []).append(traj)
  return list(groups.values())


def has_signal(group: Sequence[Trajectory]) -> bool:
  """Whether a group's valid rewards differ (two or more valid trajectories, not all the same reward). A group
  without signal gives every role of every trajectory a zero advantage, whatever the baseline's weighting; a group
  with signal may still give a role none (when the trajectories that have the role got the same reward)."""
  rewards = {t.reward.reward for t in group if t.reward is not None and t.reward.valid}
  return len(rewards) > 1


class Trainer:
  """Holds a run's state between steps. Built from a validated config; ``run()`` trains and evaluates.

  Attributes:
    model: the loaded model (``runtime.Model``); its params are the reference policy (frozen).
    state: the ``grpo.TrainState`` (params, optimizer state, step).
    stream: the ``datasets.TaskStream`` of training tasks.
    phase: what `step` wraps each of its phases in: ``phase(name)`` is a context manager yielding a dict, which the
      phase fills with what it produced. Names and what they put there: "rollout" (``trajectories``, ``stats``: the
      step's first batch), "dynamic_sampling" (``trajectories``, ``metrics``), "batch" (``advantages``, ``batch``:
      None when nothing is trainable), "old_logprobs" (``batch`` with recomputed old logprobs;
      ``grpo.old_logprobs="recompute"`` only), "reference" (``batch`` with the reference logprobs; ``grpo.use_kl``
      only),
      "update" (``metrics``). The default times nothing; ``experiments/throughput.py`` times each phase with it.
  """

  def __init__(self, config, workdir: str):
    config_check.validate(config)
    self.config, self.workdir = config, workdir
    self._eval_tasks: list[Task] | None = None
    self.train_source = runtime.training_tasks(config)  # before the model: a bad task id costs no compute
    scoring.check_scorers(config, self._scored_tasks())  # so does a scorer that cannot work
    self.grpo_cfg = grpo.GrpoConfig.from_config(config)
    self.policy = policy_lib.Policy.from_config(config)
    self.unfold_cfg = UnfoldConfig.from_config(config)
    self.mesh = runtime.make_mesh(config)
    shards = sharding.batch_size_multiple(self.mesh)
    update_mesh = self.mesh if shards > 1 and self.grpo_cfg.micro_batch_size % shards == 0 else None
    self.processes = jax.process_count()
    self.sample_mesh = self._process_mesh(update_mesh, shards)  # the mesh itself in a single-process run
    if update_mesh is None and shards > 1:  # a multi-process run refuses this (`_process_mesh`)
      logging.warning(
        "update on one device of the %d-device mesh: grpo.micro_batch_size=%d is not a multiple of its %d batch "
        "shards (mesh.data x mesh.fsdp), so the weights, the train state and AdamW's moments are whole on that "
        "device; set grpo.micro_batch_size to a multiple of %d to shard them over the mesh",
        self.mesh.size,
        self.grpo_cfg.micro_batch_size,
        shards,
        shards,
      )
    # On a mesh, every tensor is created on its own parts of the mesh, layers apart (the samplers' and the train
    # state's layout), and the train state and the reference are built there (`runtime.initial_state`): no device
    # ever holds more than its parts. Off a mesh, the stacked load on the default device.
    self.model = runtime.load_model(config, update_mesh)
    if self.model.tokenizer is None:
      raise config_check.ConfigError(
        [f"model={config.model!r} has no tokenizer; set config.tokenizer (e.g. smollm2-135m)"]
      )
    self.update = grpo.make_update_step(self.model.config, self.grpo_cfg, mesh=update_mesh)
    self.update_mesh = update_mesh
    # The reference policy (the initial weights, for the KL term or the reference user: `runtime.holds_reference`)
    # is the only tree besides the train state's, and ``self.model.params`` is it (None where the run holds none:
    # the update donates the train state, so no other name keeps the loaded arrays).
    reference = runtime.holds_reference(config)
    if update_mesh is not None:
      state, self.ref_params = runtime.initial_state(self.model, self.grpo_cfg, update_mesh, reference=reference)
    else:
      # Layers apart (the samplers' layout); the stacked load is released. With a reference the train state starts
      # as a copy (the update donates it), committed to the device, as every update's output is: the samplers'
      # programs compile once.
      params = transformer.unstack_tree(self.model.params)
      self.ref_params = params if reference else None
      state = grpo.init_train_state(self.grpo_cfg, jax.tree.map(jnp.copy, params) if reference else params)
      state = jax.device_put(state, jax.devices()[0])
      del params
    self.model = dataclasses.replace(self.model, params=self.ref_params)
    self.state = state
    del state  # the train state's only reference is self.state: a restore releases it before reading
    self.key = jax.random.key(config.seed)
    self.stream = datasets.TaskStream(self.train_source, config.train.tasks_per_step, config.seed)
    self.ckpt = checkpoint_lib.Checkpointer.from_config(workdir, config)
    self.start_step = 0
    self.damaged: dict[int, str] = {}  # the damaged steps a resume passed over (`Checkpointer.restore`)
    self.init_from: tuple[str, int] | None = None  # (workdir, step) a fresh run started from (`_start_from`)
    latest = self.ckpt.latest_step()
    if latest is not None:
      self._restore(self.ckpt, latest, fallback=config.train.checkpoint_fallback)
      logging.info("resumed from step %d in %s", self.start_step, self.ckpt.directory)
    elif config.train.init_from:
      try:
        self._start_from(config.train.init_from)
      except checkpoint_lib.CheckpointError:
        self.ckpt.close()  # this run's own checkpointer: the error stops the run before it saves anything
        raise
    rows = config.train.tasks_per_step * config.train.group_size // self.processes  # this process's share
    self.samplers = self._samplers(rows)
    self.judge = scoring.make_judge(config) if config.reward.kind == "judge" else None
    self.turn_gate = scoring.turn_gate(config, self.judge)  # required_for_next_turn items end trajectories
    self.phase: Callable[[str], AbstractContextManager[dict[str, Any]]] = _untimed_phase
    self.clock: runtime.CompileClock | None = None  # while `run` runs: its phases' compiles (`_phase`)

  def _restore(self, ckpt: checkpoint_lib.Checkpointer, latest: int, fallback: bool) -> None:
    """The whole train state of ``ckpt``'s step ``latest`` (with ``fallback``, or the newest older step that reads),
    its key and data position, restored onto the fresh state's shapes and shardings; ``start_step`` is the step
    restored."""
    # Restored onto the fresh state's shapes and shardings, that state released first (no device holds two).
    fresh, self.state = {"params": self.state.params, "opt_state": self.state.opt_state}, None
    shape_of = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
    abstract = jax.tree.map(shape_of, fresh)
    del fresh
    restored = ckpt.restore(
      latest,
      abstract_state=abstract,
      fallback=fallback,
      fallback_setting="train.checkpoint_fallback",
    )
    self.damaged = restored.damaged
    if self.processes > 1:  # every process must resume from the same step (they read one shared workdir)
      steps = distributed.allgather_objects(restored.step)
      if len(set(steps)) > 1:
        raise checkpoint_lib.CheckpointError(
          f"the processes restored different steps from {ckpt.directory} (by process: {steps}): a damaged "
          "step reads on some of them; move the damaged steps away and restart"
        )
    if restored.damaged:  # the run saves those steps afresh
      distributed.primary_first("envace_damaged_checkpoints", lambda: ckpt.set_aside(restored.damaged))
    self.state = grpo.TrainState(
      step=jnp.asarray(restored.step, jnp.int32), params=restored.params, opt_state=restored.opt_state
    )
    self.key = restored.rng
    if restored.data_state is not None:
      self.stream = datasets.TaskStream.from_state(self.train_source, restored.data_state)
    self.start_step = restored.step

  def _start_from(self, source: str) -> None:
    """A fresh run's start from the newest checkpoint of another run's workdir (``train.init_from``): its parameters
    and step, so that the run goes on from that step (e.g. GRPO after a shared supervised warm-up,
    experiments/evidence.py). A checkpoint of the same layout (both shared, or both per_role) also gives its
    optimizer state; a shared checkpoint starts a per_role run with both role trees as copies of its parameters and
    a fresh optimizer state (`init_train_state`). The key is this run's (``seed``); the task stream goes on from the
    source's position when ``seed`` and ``train.tasks_per_step`` are the source's, and starts afresh otherwise. So
    with the source's settings the run equals a resume of the source (tests/test_init_from.py).

    Raises:
      CheckpointError: naming ``train.init_from``: no checkpoint there, its newest step does not read, per_role
        parameters for a shared-policy run, an optimizer state of another structure (another
        ``grpo.sft_learning_rate`` or optimizer: set ``grpo.fresh_optimizer_after_sft`` and start a per_role run, or
        match them), or arrays of another model (`Checkpointer.restore`).
    """
    where = f"train.init_from={source!r}"
    path = os.path.expanduser(source)
    if not os.path.isdir(os.path.join(path, checkpoint_lib.CHECKPOINT_SUBDIR)):
      raise checkpoint_lib.CheckpointError(f"{where}: no checkpoints/ folder there; give the workdir of a run")
    with checkpoint_lib.Checkpointer(path, read_only=True) as src:
      step = src.latest_step()
      if step is None:
        raise checkpoint_lib.CheckpointError(f"{where}: no checkpoint in {src.directory}; give a run's workdir")
      try:
        split = any(name.startswith("params/act/") for name in src.saved_arrays(step))
        if split and not self.grpo_cfg.per_role:
          raise checkpoint_lib.IncompatibleCheckpointError(
            f"step {step} holds per_role parameters (an ACT and a REHEARSE tree); this run (grpo.mode="
            f"{self.grpo_cfg.mode!r}) has one shared tree"
          )
        if split or not self.grpo_cfg.per_role:
          self._restore(src, step, fallback=False)
        else:
          as_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
          # ACT's tree and its optimizer state: the shared run's shapes, placed as this run places them (the
          # source's optimizer state is read only to be dropped, each part on the devices of ACT's).
          abstract = {
            "params": jax.tree.map(as_abstract, self.state.params["act"]),
            "opt_state": jax.tree.map(as_abstract, self.state.opt_state["act"]),
          }
          placement = jax.tree.map(lambda x: x.sharding, self.state)
          self.state = None  # released before reading
          restored = src.restore(step, abstract_state=abstract)
          state = grpo.init_train_state(self.grpo_cfg, restored.params)
          restored.opt_state = None
          self.state = jax.device_put(state.replace(step=jnp.asarray(restored.step, jnp.int32)), placement)
          self.start_step = restored.step
          if restored.data_state is not None:
            self.stream = datasets.TaskStream.from_state(self.train_source, restored.data_state)
      except checkpoint_lib.CheckpointError as e:
        raise checkpoint_lib.CheckpointError(f"{where}: {e}") from e
    self.key = jax.random.key(self.config.seed)
    ours = {"seed": self.config.seed, "batch_size": self.config.train.tasks_per_step}
    if {k: self.stream.state()[k] for k in ours} != ours:
      logging.info(
        "train.init_from: the source's task stream was %s, this run's is %s: a fresh stream", self.stream.state(), ours
      )
      self.stream = datasets.TaskStream(self.train_source, self.config.train.tasks_per_step, self.config.seed)
    logging.info("started from step %d of %s (train.init_from)", self.start_step, src.directory)
    self.init_from = (str(src.directory), self.start_step)

  def _counted(self, name: str) -> AbstractContextManager[None]:
    """What compiles inside the block counts for ``compile/programs/<name>`` (`runtime.CompileClock.phase`)."""
    return self.clock.phase(name) if self.clock else contextlib.nullcontext()

  @contextlib.contextmanager
  def _phase(self, name: str) -> Iterator[dict[str, Any]]:
    """`phase` (``name``'s outputs, timed by whoever replaced it), `_counted`."""
    with self._counted(name), self.phase(name) as out:
      yield out

  def _process_mesh(self, update_mesh, shards: int):
    """This process's block of the mesh, where its samplers run (`distributed.process_mesh`), after checking what a
    multi-process run needs of the config.

    Raises:
      config_check.ConfigError: one message per problem, naming the key and what to set.
    """
    if self.processes == 1:
      return self.mesh
    cfg, n, problems = self.config, self.processes, []
    if cfg.train.tasks_per_step % n:
      problems.append(f"train.tasks_per_step={cfg.train.tasks_per_step} must be a multiple of the {n} processes")
    if update_mesh is None:
      problems.append(
        f"grpo.micro_batch_size={self.grpo_cfg.micro_batch_size} must be a multiple of the mesh's {shards} batch "
        f"shards (data x fsdp) in a {n}-process run: the update runs over the global mesh"
      )
    try:
      local = distributed.process_mesh(self.mesh)
    except ValueError as e:
      problems.append(str(e))
    if problems:
      raise config_check.ConfigError(problems)
    return local

  def _sampling(self, params):
    """``params`` as the samplers take them: this process's copy on its own devices (`distributed.process_local`;
    the arrays themselves in a single-process run)."""
    return distributed.process_local(params, self.sample_mesh)

  def _scored_tasks(self) -> list[Task]:
    """The tasks the benchmark's evaluator will score: every training task when rollouts run on the real tools
    (``rollout.env_mode="real"``), and the held-out evaluation tasks (``train.eval_tasks``). (The warm-up's
    reference conversations skip a task whose environment cannot be built, `demonstrations`.)"""
    source = self.train_source
    tasks = [source[i] for i in range(len(source))] if self.config.rollout.env_mode == "real" else []
    return tasks + (self.eval_tasks() if self.config.train.eval_tasks else [])

  def eval_tasks(self) -> list[Task]:
    """The held-out tasks of every evaluation: `runtime.evaluation_tasks` with ``train.eval_tasks``."""
    if self._eval_tasks is None:  # prepared and opened once per run, not at every evaluation
      self._eval_tasks = runtime.evaluation_tasks(self.config, self.config.train.eval_tasks)
    return self._eval_tasks

  # -- rollouts ----------------------------------------------------------------------------------------------------

  def _samplers(self, rows: int) -> dict[str, Any]:
    """The policy's samplers over the train state's own arrays (a cast copy where the compute dtype is not the
    master's: `Sampler.params`), and the reference user's over the reference's (on a mesh the reference tree is the
    reference sampler's placed one: one copy). The reference, only ever run forward, is held in the compute dtype
    from here on (`sharding.cast`: the loaded tree is released where it was in another dtype)."""
    cfg = self.config
    if self.ref_params is not None:
      self.ref_params = sharding.cast(self.ref_params, self.model.config.dtype)
      self.model = dataclasses.replace(self.model, params=self.ref_params)
    mesh, params = self.sample_mesh, self._sampling(self.state.params)
    out = self.policy.samplers(params, lambda p: runtime.make_sampler(cfg, self.model, p, mesh, rows))
    if runtime.reference_user(cfg):
      out["reference"] = runtime.make_sampler(cfg, self.model, self._sampling(self.ref_params), mesh, rows)
      self.ref_params = out["reference"].params
      self.model = dataclasses.replace(self.model, params=self.ref_params)
    return out

  def _sync_samplers(self, params: Any = None) -> None:
    """Points the policy samplers at the train state's current arrays, or at ``params`` (a tree in the state's
    layout) (`Policy.sync`): no copy where the sampler's placement and dtype are the state's, else a fresh cast copy.
    Called after every update: the update donates the old arrays."""
    self.policy.sync(self.samplers, self._sampling(self.state.params if params is None else params))

  def envs_for(self, tasks: Sequence[Task], group_size: int):
    """One fresh real environment per trajectory (task-major), for ``env_mode="real"``."""
    return [scoring.make_env(self.config, task) for task in tasks for _ in range(group_size)]

  def rollout(
    self, tasks: Sequence[Task], key: jax.Array, group_size: int | None = None
  ) -> tuple[list[Trajectory], dict[str, float]]:
    """B×G scored trajectories of ``tasks`` with the current policy (G = ``group_size``, default the run's).

    In a multi-process run this process unfolds and scores its share of ``tasks`` (`distributed.share`), then every
    process gets all B×G trajectories (`distributed.allgather_objects`), in task order, with each process's stats
    added up (``time_total_s``: the slowest process's).
    """
    self._sync_samplers()
    unfold_cfg = self.unfold_cfg
    if group_size is not None and group_size != unfold_cfg.group_size:
      unfold_cfg = dataclasses.replace(unfold_cfg, group_size=group_size)
    mine = distributed.share(len(tasks), self.processes)
    tasks = list(tasks)[mine.start : mine.stop]
    real = unfold_cfg.env_mode == "real"
    envs = self.envs_for(tasks, unfold_cfg.group_size) if real else None
    out = unfold(
      tasks,
      self.policy.by_role(self.samplers),
      self.model.tokenizer,
      unfold_cfg,
      key,
      reference_sampler=self.samplers.get("reference"),
      envs=envs,
      first_trajectory=mine.start * unfold_cfg.group_size,
      turn_gate=self.turn_gate,
    )
    for i, traj in enumerate(out.trajectories):
      traj.reward = scoring.score(self.config, traj, env=envs[i] if envs else None, judge=self.judge)
    runtime.release_host_memory()
    if self.processes == 1:
      return out.trajectories, out.stats
    parts = distributed.allgather_objects((out.trajectories, out.stats))
    stats = collections.Counter()
    for _, part in parts:
      stats.update(part)
    stats["time_total_s"] = max(part.get("time_total_s", 0.0) for _, part in parts)
    return [t for trajectories, _ in parts for t in trajectories], dict(stats)

  def dynamic_sampling(self, groups: Sequence[Sequence[Trajectory]], key: jax.Array):
    """DAPO's dynamic sampling (``grpo.dynamic_sampling``; Yu et al. 2025, §3.2): the step's groups with signal
    (`has_signal`), topped up from the task stream's next batches (extra batch d samples with
    ``fold_in(fold_in(key, 0xD5A), d)``). The first B groups with signal are kept in the order they were drawn,
    renumbered 0..; when no group has signal, the first batch is kept as it is (a zero advantage, as without dynamic
    sampling). The extra batches advance the task stream, which the checkpoint stores: a resumed run redraws them.

    Args:
      groups: the first batch's scored trajectories, one list per task (`group_trajectories`).
      key: the step's rollout key (the first batch used it).
    Returns:
      (trajectories to train on, metrics: ``dynamic_sampling/`` ``dropped_groups`` (groups without signal, every
      batch), ``extra_draws`` (batches rolled out after the first), ``groups`` (groups with signal trained on, <= B),
      ``surplus_groups`` (groups with signal beyond B, unused), ``fallback`` (1: no group had signal, the first
      batch is trained), ``generated_tokens`` (the extra batches'); ``time/dynamic_sampling_s``, their rollout
      seconds). ``reward/*`` and ``rollout/*`` describe the first batch only.

    In a multi-process run every process decides on the same gathered trajectories (`rollout`), so all of them roll
    out the same extra batches, each its share.
    """
    want, extra = len(groups), jax.random.fold_in(key, _DYNAMIC_SAMPLING_STREAM)
    kept = [g for g in groups if has_signal(g)]
    dropped, draws, seconds, generated = len(groups) - len(kept), 0, 0.0, 0
    while len(kept) < want and draws < self.grpo_cfg.dynamic_sampling_max_draws:
      draws += 1
      more, stats = self.rollout(self.stream.next_batch(), jax.random.fold_in(extra, draws))
      seconds += stats.get("time_total_s", 0.0)
      generated += generated_tokens(stats)
      for group in group_trajectories(more):
        if has_signal(group):
          kept.append(group)
        else:
          dropped += 1
    chosen = kept[:want] or list(groups)
    trajectories = []
    for index, group in enumerate(chosen):
      for traj in group:
        traj.group = index
        trajectories.append(traj)
    counts = {
      "dropped_groups": dropped,
      "extra_draws": draws,
      "groups": len(kept[:want]),
      "surplus_groups": len(kept[want:]),
      "fallback": not kept,
      "generated_tokens": generated,
    }
    out = {f"dynamic_sampling/{k}": float(v) for k, v in counts.items()}
    return trajectories, {**out, "time/dynamic_sampling_s": seconds}

  # -- one step: rollout, advantages, batch, (reference logprobs), update ------------------------------------------

  def advantages(self, trajectories: Sequence[Trajectory]):
    """Role-wise GRPO advantages of scored trajectories, (advantages float32[N, R'], statistics): those of their
    non-empty generations (`generation_advantages`)."""
    adv, _, stats = self.generation_advantages(trajectories)
    return adv, stats

  def generation_advantages(self, trajectories: Sequence[Trajectory]):
    """`advantages.generation_advantages` with this run's settings: (advantages float32[N, R'], empty, statistics),
    empty = (the empty generations' advantages float32[N, R'], their flags) for `training_batch`, None when
    ``reward.empty_output_penalty`` is 0 (no generation is decoded then). A generation is empty when its ids decode
    to blank text without special tokens (the official trainer's test)."""
    rewards_n, groups, generations, valid = advantages_lib.trajectory_arrays(trajectories)
    roles, penalty = self.grpo_cfg.trained_roles, self.grpo_cfg.empty_output_penalty
    counts, flags = None, None
    if penalty:
      tokenizer = self.model.tokenizer
      counts, flags = advantages_lib.empty_generations(
        trajectories, roles, lambda ids: not tokenizer.decode(ids, skip_special_tokens=True).strip()
      )
    adv, adv_empty, stats = advantages_lib.generation_advantages(
      rewards_n,
      groups,
      generations,
      valid,
      trained_roles=roles,
      weighting=self.grpo_cfg.weighting,
      std_normalize=self.grpo_cfg.std_normalize,
      eps=self.grpo_cfg.adv_eps,
      baseline_groups=self.grpo_cfg.baseline_groups,
      lone_member_advantage=self.grpo_cfg.lone_member_advantage,
      empty=counts,
      empty_penalty=penalty,
    )
    if counts is not None:
      stats["empty_generations"] = float(np.sum(np.where(valid[:, None], counts, 0)))
    return adv, (adv_empty, flags) if counts is not None and counts.any() else None, stats

  def training_batch(self, trajectories: Sequence[Trajectory], adv, empty=None) -> TrainBatch:
    """The padded update batch of the trained roles' rows (`grpo.build_batch`; ``empty`` from
    `generation_advantages`).

    Raises:
      ValueError: nothing is trainable (e.g. every trajectory invalid); `step` logs it and skips the update.
    """
    return grpo.build_batch(trajectories, adv, self.grpo_cfg, empty=empty, pad_id=self.model.tokenizer.pad_id or 0)

  def with_reference(self, batch: TrainBatch) -> TrainBatch:
    """``batch`` with the reference policy's logprobs, for the loss's KL term (`apply_update` calls it when
    ``grpo.use_kl`` is on)."""
    return logprobs.with_ref_logprobs(self.model.config, self._sampling(self.ref_params), batch)

  def finish_save(self) -> None:
    """Waits for the previous step's checkpoint save and hands the host memory it freed back to the system.

    A save holds a host copy of the state until it is written (1.5 GiB for SmolLM2-135M's parameters and AdamW
    moments) and frees it into glibc's arenas from orbax's threads: called before a forward or an update over the
    batch, so that those temporaries do not stack on the save's. A rollout still overlaps the save.
    """
    self.ckpt.wait()
    runtime.release_host_memory()

  def apply_update(self, batch: TrainBatch, supervised: bool) -> dict[str, float]:
    """One update of ``self.state`` on ``batch`` (with the reference's logprobs when the loss has a KL term), at the
    warm-up's learning rate when ``supervised``; returns the update step's metrics as floats."""
    self.finish_save()
    if self.grpo_cfg.use_kl:
      with self._phase("reference") as out:
        batch = out["batch"] = self.with_reference(batch)
    state = grpo.with_learning_rate(self.grpo_cfg, self.state, supervised=supervised)
    with self._phase("update") as out:
      self.state, update_metrics = self.update(state, batch)
      out["metrics"] = {k: float(np.asarray(v)) for k, v in jax.device_get(update_metrics).items()}
    self._sync_samplers()
    runtime.release_host_memory()
    return out["metrics"]

  # -- the supervised warm-up (train.sft_warmup_steps) ------------------------------------------------------------

  def demonstrations(self, tasks: Sequence[Task]) -> tuple[list[Trajectory], int]:
    """One demonstration per task (``rehearsal/demonstration.py``): its reference conversation replayed as rows.

    Returns:
      (trajectories, skipped): a task whose reference conversation cannot be built (e.g. a τ² task with user-side
      gold actions) is logged and skipped.
    """
    fmt = views.ChatFormat.of(self.model.tokenizer)
    out, skipped = [], 0
    for b, task in enumerate(tasks):
      try:
        env = scoring.make_env(self.config, task)
        conversation = registry.get(task.benchmark).reference_conversation(task, env)
      except EnvError as e:
        logging.warning("supervised warm-up: task %s skipped: %s", task.id, e)
        skipped += 1
        continue
      env = scoring.make_env(self.config, task) if self.unfold_cfg.env_mode == "real" else None
      out.append(
        demonstration.demonstration(self.unfold_cfg, task, conversation, self.model.tokenizer, fmt, b, env=env)
      )
    return out, skipped

  def policy_logprobs(self, batch: TrainBatch) -> np.ndarray:
    """float32[K, M, T] logprobs of ``batch``'s trained tokens under the current parameters (`Policy.logprobs`; in
    a multi-process run each process computes them all, on its own devices)."""
    return self.policy.logprobs(self.model.config, self._sampling(self.state.params), batch)

  def sft_step(self, step: int) -> dict[str, float]:
    """A supervised warm-up step: one update on the token-mean negative log-likelihood of B demonstrations.

    The update is the GRPO update step with advantage 1 and NaN ``old_logprobs`` (`grpo.logprob_sums`: the update's
    own logprobs, without their gradient), so the ratio is exactly 1 and the surrogate's gradient is that of -log p
    (docs/method.md, the warm-up), with no forward pass besides the update's. Returns ``sft/*`` metrics: ``nll``
    (the update's, before it steps; per role ``nll/<role>``), ``tokens``, ``grad_norm``, ``demonstrations``,
    ``skipped_tasks`` and the time.
    """
    start = time.perf_counter()
    tasks = self.stream.next_batch()
    trajectories, skipped = self.demonstrations(tasks)
    scalars = {"sft/demonstrations": float(len(trajectories)), "sft/skipped_tasks": float(skipped)}
    adv = np.zeros((len(trajectories), NUM_ROLES), np.float32)
    adv[:, list(self.grpo_cfg.trained_roles)] = 1.0
    try:
      batch = self.training_batch(trajectories, adv)
    except ValueError as e:  # no demonstration fits, or none has a trained role
      logging.warning("step %d: no supervised update: %s", step, e)
      scalars["update/skipped"] = 1.0
      batch = None
    if batch is not None:
      self.finish_save()
      own = np.full(np.shape(batch.old_logprobs), np.nan, np.float32)
      update_metrics = self.apply_update(batch.replace(old_logprobs=own), supervised=True)
      scalars.update(
        {f"sft/{k}": update_metrics[k] for k in ("tokens", "grad_norm", "kl", "nll") if k in update_metrics}
      )
      for role in self.grpo_cfg.trained_roles:
        name = advantages_lib.role_name(role)  # the update's own metric names (`grpo.logprob_sums`)
        if update_metrics.get(f"tokens/{name}", 0.0) > 0:
          scalars[f"sft/nll/{name}"] = update_metrics[f"nll/{name}"]
    scalars["time/step_s"] = time.perf_counter() - start
    return scalars

  def step(self, step: int) -> dict[str, float]:
    """Runs training step ``step`` (1-based: the step-th update) and returns its metrics; the first
    ``train.sft_warmup_steps`` steps are supervised (`sft_step`), and the first RL step after them starts from a fresh
    optimizer state unless ``grpo.fresh_optimizer_after_sft`` is False."""
    warmup = self.config.train.sft_warmup_steps
    if step <= warmup:
      return self.sft_step(step)
    if warmup and step == warmup + 1 and self.grpo_cfg.fresh_optimizer_after_sft:
      self.state = grpo.fresh_optimizer_state(self.grpo_cfg, self.state)
    start = time.perf_counter()
    tasks = self.stream.next_batch()
    key = jax.random.fold_in(self.key, step)
    with self._phase("rollout") as out:
      trajectories, stats = out["trajectories"], out["stats"] = self.rollout(tasks, key)
    scalars = rollout_metrics(trajectories, stats)  # the step's first batch: what the policy does on B tasks
    groups = group_trajectories(trajectories)
    scalars["rollout/groups_without_signal"] = sum(not has_signal(g) for g in groups) / len(groups)
    if self.grpo_cfg.dynamic_sampling:
      with self._phase("dynamic_sampling") as out:
        trajectories, dynamic = out["trajectories"], out["metrics"] = self.dynamic_sampling(groups, key)
      scalars.update(dynamic)
      scalars["time/rollout_s"] += dynamic["time/dynamic_sampling_s"]
    if step == self.config.train.steps:
      # The last step's rollout programs run again only in the final evaluation, which reads them back anyway (`run`):
      # the update does not hold them (`runtime.release_host_memory`).
      runtime.release_host_memory(programs=True)
    with self._phase("batch") as out:
      adv, empty, adv_stats = out["advantages"] = self.generation_advantages(trajectories)
      update_start = time.perf_counter()
      try:
        batch = self.training_batch(trajectories, adv, empty)
      except ValueError as e:  # nothing trainable this step (e.g. every trajectory invalid): log it, do not crash
        logging.warning("step %d: no update: %s", step, e)
        scalars["update/skipped"] = 1.0
        batch = None
      out["batch"] = batch
    scalars.update({k if k.startswith("adv/") else f"adv/{k}": float(v) for k, v in adv_stats.items()})
    if batch is not None:
      if self.grpo_cfg.old_logprobs == "recompute":  # verl's: the ratio's denominator from the update's own forward
        with self._phase("old_logprobs") as out:
          batch = out["batch"] = batch.replace(old_logprobs=self.policy_logprobs(batch))
      update_metrics = self.apply_update(batch, supervised=False)
      scalars.update({f"update/{k}": v for k, v in update_metrics.items()})
      trained = update_metrics.get("tokens", 0.0)
      scalars["update/tokens_per_s"] = trained / max(time.perf_counter() - update_start, 1e-9)
      scalars["update/row_tokens"] = float(np.asarray(batch.valid).sum())
    scalars["time/update_s"] = time.perf_counter() - update_start
    scalars["time/step_s"] = time.perf_counter() - start
    return scalars

  def run(self, keep_optimizer: bool = True) -> dict[str, Any]:
    """Trains ``config.train.steps`` steps (from the resumed step), then evaluates on held-out tasks.

    ``keep_optimizer=False`` (`train_and_evaluate`, the main job) frees the optimizer state before the final
    held-out evaluation, which does not read it (AdamW's two moments: twice the float32 parameters, 1.0 GiB for
    SmolLM2-135M; the main job's peak was in that evaluation, experiments/results/2026-12-07_executables.md): the
    last step's checkpoint holds it, and ``self.state.opt_state`` is None afterwards.

    Prints on process 0 (``metrics.py``): the progress bar and a line per step (a resumed run first says from which
    step), then with ``train.eval_tasks`` nonzero a line as the held-out evaluation starts and its table
    (``metrics.format_eval_summary``); with ``train.eval_at_start`` the held-out evaluation also covers the initial
    weights (step 0 of ``eval.jsonl``, its table printed) and ends with the two side by side
    (``metrics.format_eval_change``). The initial weights are evaluated after training, just before the trained
    ones (`_initial_pending`, `_initial_params`), so that the two evaluations run the same compiled programs: the
    run drops its programs where a phase ends, for memory, and an evaluation before step 1 had its programs read
    back for the last one (the main job's compile seconds: 161 -> 146 s with a cold cache, 34 -> 27.5 s with a warm
    one; experiments/results/2026-12-07_initial_evaluation.md).

    Returns:
      {"steps": last step, "last": its metrics, "eval": the evaluation summary or None}.
    """
    cfg = self.config
    total = cfg.train.steps
    last: dict[str, float] = {}
    primary = jax.process_index() == 0  # writes eval.jsonl and prints; MetricsWriter and orbax decide for themselves
    say = metrics.print_line if primary else lambda text: None
    if self.start_step:
      damaged = "".join(
        f" (step {s} did not read: {problem}; moved to {checkpoint_lib.DAMAGED_SUBDIR}/)"
        for s, problem in self.damaged.items()
      )
      if self.init_from:
        say(f"started from step {self.start_step} of {self.init_from[0]} (train.init_from)")
      else:
        say(f"resumed from step {self.start_step} in {self.ckpt.directory}{damaged}")
    writer = metrics.MetricsWriter(self.workdir, total_steps=total, start_step=self.start_step + 1)
    clock = self.clock = runtime.CompileClock()
    try:
      for step in range(self.start_step + 1, total + 1):
        mark = clock.mark()
        last = self.step(step)
        last["compile/programs"], last["time/compile_s"] = clock.programs_since(mark), clock.since(mark)
        last.update(runtime.host_memory_gib())
        if cfg.train.eval_tasks and cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < total:
          last.update(self.evaluate(step))
        # per phase, an in-run evaluation's ("eval") included
        last.update({f"compile/programs/{k}": v for k, v in clock.programs_by_phase_since(mark).items()})
        writer.write(step, last)
        self.ckpt.save(
          step,
          params=self.state.params,
          opt_state=self.state.opt_state,
          rng=self.key,
          data_state=self.stream.state(),
          metrics=last,
          force=step == total,
        )
        if step == cfg.train.sft_warmup_steps < total:
          runtime.release_host_memory(programs=True)  # the warm-up's update programs are done
      writer.close()  # the bar ends with the last step; the held-out evaluation is not a step
      self.ckpt.wait()
      summary = None
      if cfg.train.eval_tasks != 0:
        if not keep_optimizer:
          self.state = self.state.replace(opt_state=None)  # in the checkpoint just saved
        runtime.release_host_memory(programs=True)  # the training's programs are done
        if self._initial_pending():  # first: eval.jsonl's step-0 row before the trained weights' row
          say(f"evaluating the initial weights on {self._eval_count()} against the real tools...")
          initial = self.evaluate(0, self._initial_params())
          if primary:
            heldout.write_summary(self.workdir, 0, initial)
          say(metrics.format_eval_summary(initial, 0))
        say(f"evaluating on {self._eval_count()} against the real tools...")
        summary = self.evaluate(total)
        if primary:
          heldout.write_summary(self.workdir, total, summary)
        say(metrics.format_eval_summary(summary, total))
        initial = [r for r in metrics.read_jsonl(self.workdir, "eval.jsonl") if r["step"] == 0] if primary else []
        if initial and total:
          say(metrics.format_eval_change(initial[-1], summary, total))
    finally:
      clock.close()
      self.clock = None
      writer.close()
      self.ckpt.close()
    return {"steps": total, "last": last, "eval": summary}

  def _initial_pending(self) -> bool:
    """Whether the final evaluation also evaluates the initial weights (``train.eval_at_start``): a run that trains
    from the loaded model (not ``train.init_from``'s checkpoint, whose start is another run's) and whose
    ``eval.jsonl`` has no step-0 row yet (a resumed run's first process may have written it). Process 0 decides for
    every process."""
    cfg = self.config
    if not (cfg.train.eval_at_start and cfg.train.steps and not cfg.train.init_from):
      return False
    done = jax.process_index() == 0 and any(r["step"] == 0 for r in metrics.read_jsonl(self.workdir, "eval.jsonl"))
    return not distributed.allgather_objects(done)[0]

  def _initial_params(self) -> Any:
    """The weights the run started from, in the train state's layout (per_role: the same tree for both roles): the
    frozen reference where the run holds one (`runtime.holds_reference`), else the model loaded again
    (`runtime.load_model`, as the run loaded it); placed, and committed, as the train state's params are, so that the
    samplers run the programs the trained weights run (an uncommitted argument is another program: the main job's cold
    run compiled 174 programs in 195 s against 159 in 146 s)."""
    tree = self.ref_params
    if tree is None:
      tree = transformer.unstack_tree(runtime.load_model(self.config, self.update_mesh).params)
    like = self.state.params[grpo.ROLE_TREES[0]] if self.grpo_cfg.per_role else self.state.params
    tree = jax.device_put(tree, jax.tree.map(lambda x: x.sharding, like))
    return dict.fromkeys(grpo.ROLE_TREES, tree) if self.grpo_cfg.per_role else tree

  def _eval_count(self) -> str:
    n, trials = len(self.eval_tasks()), self.config.eval.num_trials
    return (
      f"{n} held-out task{'s' * (n != 1)} ({self.config.env.eval_split} split, {trials} trial{'s' * (trials != 1)} "
      "each)"
    )

  def evaluate(self, step: int, params: Any = None) -> dict[str, float]:
    """Committed execution of the current policy (or of ``params``, a tree in the train state's layout) on
    held-out tasks against the real tools (``heldout.py``), with the host memory figures after it
    (``runtime.host_memory_gib``). The key is the step's: the initial weights' evaluation is ``step=0``."""
    self._sync_samplers(params)
    with self._counted("eval"):
      summary = heldout.committed_execution(
        self.config,
        self.eval_tasks(),
        self.samplers,
        self.model.tokenizer,
        jax.random.fold_in(jax.random.fold_in(self.key, step), _EVALUATION_STREAM),
        num_trials=self.config.eval.num_trials,
      )
    return {**summary, **runtime.host_memory_gib()}  # after the evaluation: an in-run one's replace the step's


COMPILE_LOG = "compile.jsonl"  # one line per process run of a workdir: what it compiled (`train_and_evaluate`)


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Validates ``config`` (before any compute), trains, checkpoints into ``workdir`` and evaluates.

  What the whole run compiled, from the model's load to the last evaluation (`runtime.CompileClock`), is printed in
  one line and appended to ``workdir/compile.jsonl`` (process 0): programs compiled or loaded from JAX's persistent
  cache, how many the cache held (``cache_hits``) and lacked (``cache_misses``), compile seconds (tracing, lowering
  and XLA) and XLA's share of them (``backend_s``, what the cache saves), the run's wall seconds, the cache folder
  (None: off). A second run on the same machine reads its programs from the cache (docs/performance.md).

  Returns:
    `Trainer.run`'s dict with ``"compile"``: that record.

  Raises:
    config_check.ConfigError: a bad config value (the message names the key and the valid values).
  """
  start = time.perf_counter()
  with runtime.CompileClock() as clock:
    result = Trainer(config, workdir).run(keep_optimizer=False)
  record = {
    "programs": clock.programs_since(0),
    "cache_hits": clock.hits,
    "cache_misses": clock.misses,
    "compile_s": clock.since(0),
    "backend_s": clock.since(0, backend_only=True),
    "wall_s": time.perf_counter() - start,
    "cache": jax.config.jax_compilation_cache_dir or None,
  }
  if jax.process_index() == 0:
    with open(os.path.join(workdir, COMPILE_LOG), "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")
    metrics.print_line(
      f"compiled {record['programs']} programs in {record['compile_s']:.0f} s of the run's {record['wall_s']:.0f} s "
      f"(compilation cache: {record['cache'] or 'off'}, {record['cache_hits']} read from it)"
    )
  return {**result, "compile": record}
