"""Held-out sampling (issue 41, item 10): the policy's generations in an evaluation use ``eval.sampling``, by default
the official validation sampling (``tests/data/official/eval_sampling.json``: temperature 0.6, top_p 0.95, no
top-k); temperature 1.0 and top_p 1.0 give ours before (the training rollouts' sampling)."""

from __future__ import annotations

import json
import pathlib

import jax
import pytest

from envace_jax import config_check, heldout
from envace_jax.config import defaults
from envace_jax.envs import tau2
from envace_jax.rehearsal import private
from envace_jax.rehearsal.unfold import UnfoldConfig
from envace_jax.sampling.sampler import SamplingParams

OFFICIAL = json.loads((pathlib.Path(__file__).parent / "data" / "official" / "eval_sampling.json").read_text())


def test_the_default_is_the_official_validation_sampling_for_act_and_rehearse():
  config = defaults.get_config()
  want = SamplingParams(OFFICIAL["temperature"], OFFICIAL["top_p"], max(OFFICIAL["top_k"], 0))  # -1: no top-k
  ucfg = heldout.evaluation_unfold_config(config, {"reference": None})
  assert ucfg.act_sampling == ucfg.rehearse_sampling == want == SamplingParams(0.6, 0.95, 0)
  assert ucfg.user_sampling == SamplingParams(**config.rollout.user_sampling)  # the user is no policy generation
  training = UnfoldConfig.from_config(config)
  assert training.act_sampling == training.rehearse_sampling == SamplingParams(1.0, 1.0, 0)  # rollouts: unchanged


def test_temperature_1_restores_the_rollouts_sampling_and_bad_values_name_the_key():
  config = defaults.get_config()
  config.eval.sampling.update(temperature=1.0, top_p=1.0)
  ucfg = heldout.evaluation_unfold_config(config, {})
  assert ucfg.act_sampling == ucfg.rehearse_sampling == UnfoldConfig.from_config(config).act_sampling
  config.eval.sampling.update(temperature=-0.1, top_p=0.0, top_k=-1)  # verl writes no top-k as -1; ours is 0
  with pytest.raises(config_check.ConfigError) as err:
    config_check.validate(config, weights=False)
  assert [p for p in err.value.problems if p.startswith("eval.sampling")] == [
    "eval.sampling.temperature=-0.1 must be >= 0 (0: greedy)",
    "eval.sampling.top_p=0.0 must be in (0, 1]",
    "eval.sampling.top_k=-1 must be >= 0",
  ]


def test_evaluate_policy_runs_the_committed_execution_with_it(monkeypatch):
  """`heldout.evaluate_policy` hands the committed execution (``private.run``) the evaluation's sampling."""
  seen = []

  def run(tasks, policy, tokenizer, ucfg, *args, **kwargs):
    seen.append(ucfg)
    raise StopIteration

  monkeypatch.setattr(private, "run", run)
  config = defaults.get_config()
  config.env.domain, config.env.split = "mock", "base"
  task = next(t for t in tau2.load_tasks("mock", "base") if t.id == "create_task_1")
  with pytest.raises(StopIteration):
    heldout.evaluate_policy(config, [task], {"policy": None, "reference": None}, None, jax.random.key(0))
  assert seen[0].act_sampling == seen[0].rehearse_sampling == SamplingParams(0.6, 0.95, 0)
