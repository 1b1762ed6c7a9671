"""``train.init_from``: a fresh run that starts from another run's checkpoint (experiments/evidence.py starts every RL
method from one supervised warm-up per seed).

A warm-up of one step, then a run of two steps started from it, must end where one uninterrupted two-step run ends,
bit for bit (parameters, AdamW's state, key, data position, the second step's metrics): the shaped rewards of
tests/test_resume.py make the RL step move the weights, so a start from anything else would differ. A shared
checkpoint starts a per_role run with both trees equal to its parameters and a fresh optimizer.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from envace_jax import checkpoint as checkpoint_lib
from envace_jax import config_check, metrics, train
from tests.test_resume import assert_same_rows, assert_same_state, assert_same_trees, moved_from, shaped_rollout
from tests.test_train import _adam_counts, tiny_config

_RUN = {
  "train.steps": 2,
  "train.sft_warmup_steps": 1,
  "grpo.sft_learning_rate": 1e-2,
  "grpo.learning_rate": 1e-3,
  "grpo.fresh_optimizer_after_sft": False,  # the RL step goes on with the warm-up's AdamW state: restored or not
  "train.eval_tasks": 0,
}


@pytest.fixture
def shaped_rewards(monkeypatch):
  monkeypatch.setattr(train.Trainer, "rollout", shaped_rollout(train.Trainer.rollout))


@pytest.fixture(scope="module")
def warmup(tmp_path_factory, data_dir):
  """The workdir of a one-step warm-up (step 1 saved), and its Trainer: trained once for this module's tests, which
  only read them."""
  workdir = tmp_path_factory.mktemp("init_from") / "warmup"
  trainer = train.Trainer(tiny_config(data_dir, **{**_RUN, "train.steps": 1}), str(workdir))
  trainer.run()
  return workdir, trainer


@pytest.mark.slow
def test_a_run_started_from_a_warmup_equals_the_uninterrupted_run(tmp_path, data_dir, shaped_rewards, warmup):
  config = tiny_config(data_dir, **_RUN)
  whole = train.Trainer(config, str(tmp_path / "whole"))
  whole.run()

  source, _ = warmup
  config.train.init_from = str(source)
  started = train.Trainer(config, str(tmp_path / "started"))
  assert (started.start_step, started.init_from) == (1, (str(source / "checkpoints"), 1))
  started.run()

  assert_same_state(started, whole)  # AdamW's count and moments included: step 2 stepped from the warm-up's
  assert _adam_counts(started.state.opt_state) == {2}
  rows = metrics.read_jsonl(tmp_path / "started")
  assert [r["step"] for r in rows] == [2]  # the warm-up's step is the source's, not logged again
  assert_same_rows(rows, metrics.read_jsonl(tmp_path / "whole")[1:])
  assert rows[0]["update/grad_norm"] > 0 and moved_from(started.state.params, whole.model.params)
  assert checkpoint_lib.Checkpointer(tmp_path / "started", read_only=True).all_steps() == [2]
  assert checkpoint_lib.Checkpointer(source, read_only=True).all_steps() == [1]  # the source is only read


def test_a_shared_checkpoint_starts_both_trees_of_a_per_role_run(tmp_path, data_dir, warmup):
  source, trainer = warmup
  config = tiny_config(data_dir, **{**_RUN, "grpo.mode": "per_role", "train.init_from": str(source)})
  started = train.Trainer(config, str(tmp_path / "per_role"))
  assert started.start_step == 1
  for tree in ("act", "rehearse"):
    assert_same_trees(started.state.params[tree], trainer.state.params, tree)
  assert {n: _adam_counts(started.state.opt_state[n]) for n in ("act", "rehearse")} == {"act": {0}, "rehearse": {0}}
  a, r = (jax.tree.leaves(started.state.params[n])[0] for n in ("act", "rehearse"))
  assert a.unsafe_buffer_pointer() != r.unsafe_buffer_pointer()  # two trees, each its own buffers
  assert started.stream.state() == trainer.stream.state()

  # And a per_role checkpoint cannot start a shared-policy run: one line naming the key.
  started.ckpt.save(1, params=started.state.params, opt_state=started.state.opt_state, rng=started.key, force=True)
  started.ckpt.wait()
  config = tiny_config(data_dir, **{**_RUN, "train.init_from": str(tmp_path / "per_role")})
  with pytest.raises(checkpoint_lib.CheckpointError, match=r"train.init_from=.*per_role parameters.*one shared tree"):
    train.Trainer(config, str(tmp_path / "shared"))


def test_another_seed_gets_its_own_key_and_stream_and_a_missing_source_names_the_key(tmp_path, data_dir, warmup):
  source, trainer = warmup
  config = tiny_config(data_dir, **{**_RUN, "seed": 5, "train.init_from": str(source)})
  started = train.Trainer(config, str(tmp_path / "seed5"))
  assert started.start_step == 1
  assert_same_trees(started.state.params, trainer.state.params, "params")
  np.testing.assert_array_equal(jax.random.key_data(started.key), jax.random.key_data(jax.random.key(5)))
  assert started.stream.state() == {**trainer.stream.state(), "seed": 5, "position": 0}  # a fresh stream of seed 5
  config = tiny_config(data_dir, **{"train.init_from": str(tmp_path / "nothing")})
  config_check.validate(config)  # a resumed run never reads it: only a fresh one checks (below)
  with pytest.raises(checkpoint_lib.CheckpointError, match=r"train.init_from=.*nothing.*no checkpoints/ folder"):
    train.Trainer(config, str(tmp_path / "fresh"))
