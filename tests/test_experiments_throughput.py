"""experiments/throughput.py on the tiny model: its token counts are the rollout's, its ratios are real numbers."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest

from envace_jax import runtime
from envace_jax.model.roles import Role
from experiments import throughput


def test_flop_formulas_on_known_counts():
  assert throughput.train_flops(1_000_000, 10) == 6e7
  assert throughput.forward_flops(1_000_000, 10) == 2e7
  split = throughput.ParamSplit(total=1_300, layers=1_000, head=200)
  # the layers over every row token, the head over the trained tokens only
  assert split.update_flops(row_tokens=50, trained_tokens=5) == 6 * 1_000 * 50 + 6 * 200 * 5
  assert split.reference_flops(row_tokens=50, trained_tokens=5) == 2 * 1_000 * 50 + 2 * 200 * 5
  assert throughput.prefill_limit(split, peak_flops=2e6) == 1_000.0  # 2e6 / (2 x 1000)
  assert throughput.decode_limit(weight_bytes=4_000, bandwidth=8e6, rows=4) == 8_000.0  # 4 x 8e6 / 4000
  assert throughput.mfu(flops=1e9, seconds=2.0, peak_flops=1e9) == 0.5


def test_param_split_of_the_tiny_model():
  import jax

  from envace_jax.model import config as config_lib
  from envace_jax.model import transformer

  config = config_lib.get_model_config("tiny")
  params = jax.eval_shape(functools.partial(transformer.init_params, config), jax.random.key(0))
  split = throughput.ParamSplit.of(config, params)
  assert "lm_head" in params  # the tiny preset's head is untied: a lookup table and a head
  lookups = params["embed"].size + params["role_embed"].size + (params["lm_head"].size if "lm_head" in params else 0)
  assert split.total == transformer.param_count(params) == split.layers + lookups
  assert split.head == config.vocab_size * config.d_model


def test_config_overrides_keep_types():
  args, rest = throughput.parse_args(["--model=tiny", "--config.grpo.learning_rate=3e-5", "--config.grpo.remat=false"])
  config = throughput.load_config(args, rest)
  assert config.grpo.learning_rate == 3e-5 and config.grpo.remat is False
  assert config.train.steps == args.steps + 1  # the warm-up step, then the timed ones
  with pytest.raises(SystemExit):
    throughput.parse_args(["--model=tiny", "--bogus=1"])


@pytest.mark.slow
def test_tiny_run_counts_what_the_rollout_generated(tmp_path):
  out, out_json = tmp_path / "throughput.png", tmp_path / "throughput.json"
  runtime.forget_shared_programs()  # step 1 compiles, as in a new process, whatever this worker built before
  report = throughput.main(
    [
      "--model=tiny",
      "--steps=1",
      "--group=2",
      f"--out={out}",
      f"--json={out_json}",
      f"--data-dir={tmp_path / 'tfds'}",
      "--matmul-size=256",
      "--bandwidth-gib=0.05",
    ]
  )
  assert len(report.steps) == 2 and [s.step for s in report.steps] == [1, 2]
  for rec in report.steps:
    trajectories = rec.trajectory_list
    assert rec.trajectories == len(trajectories) == 2  # B=1 x G=2
    for role in throughput.ROLES:  # unfold's stats == the tokens the trajectories hold
      assert rec.generated[role] == sum(t.counts.get(f"tokens_{role}", 0) for t in trajectories)
    rows = [row for t in trajectories for row in t.rows.values()]
    assert rec.generated["act"] + rec.generated["rehearse"] == sum(r.num_trained_tokens for r in rows)
    assert sum(rec.generated.values()) > 0 and rec.prefilled > rec.prefilled_shared > 0
    # the update trained exactly the loss-masked tokens of the valid trajectories' trained roles
    trained = sum(
      r.num_trained_tokens
      for t in trajectories
      if t.reward is not None and t.reward.valid
      for role, r in t.rows.items()
      if role in (int(Role.ACT), int(Role.REHEARSE))  # the default trained roles
    )
    assert not rec.skipped and rec.trained_tokens == trained > 0
    assert 0 < rec.row_tokens <= rec.padded_tokens
    assert 0 <= rec.rollout_compile_s <= rec.rollout_s and 0 <= rec.update_compile_s <= rec.update_s
    assert rec.rollout_cpu_s > 0 and rec.update_cpu_s > 0
  assert report.steps[0].rollout_compile_s > 0 and report.steps[0].update_compile_s > 0  # the warm-up compiles

  rows = {r.phase: r for r in report.rows}
  timed = report.steps[1]
  assert rows["rollout: generated"].tokens == sum(timed.generated.values())
  assert rows["rollout: prefilled"].tokens == timed.prefilled
  assert rows["update: fwd+bwd+AdamW (MFU)"].tokens == timed.row_tokens
  assert rows["update: trained tokens"].tokens == timed.trained_tokens
  for r in report.rows:
    assert math.isfinite(r.tok_s) and r.tok_s > 0, r
    if not r.phase.endswith("tokens") and not r.phase.startswith("step"):
      assert math.isfinite(r.limit) and r.limit > 0 and math.isfinite(r.ratio) and r.ratio > 0, r
  # the decode limit is B x G rows at the measured bandwidth over the weight bytes
  m = report.machine
  assert rows["rollout: generated"].limit == pytest.approx(2 * m.bandwidth / report.weight_bytes)
  flops = report.params.update_flops(timed.row_tokens, timed.trained_tokens)
  assert rows["update: fwd+bwd+AdamW (MFU)"].ratio == pytest.approx(flops / timed.update_run_s / m.peak_flops)

  saved = json.loads(out_json.read_text())
  assert [r["tokens"] for r in saved["rows"]] == [r.tokens for r in report.rows]
  assert np.allclose(
    [r["ratio"] for r in saved["rows"] if r["ratio"] == r["ratio"]],
    [r.ratio for r in report.rows if r.ratio == r.ratio],
  )
  assert out.stat().st_size > 0
