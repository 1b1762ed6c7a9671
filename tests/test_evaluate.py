"""pass^k as τ²-bench defines it: per task C(c, k) / C(n, k), averaged over tasks."""

from __future__ import annotations

import pytest

from envace_jax import evaluate


def test_pass_hat_k_hand_computed():
  # One task, c = 2 successes of n = 4 trials: pass^1 = 2/4, pass^2 = C(2,2)/C(4,2) = 1/6, pass^3 = 0.
  assert evaluate.pass_hat_k([2], 4, 1) == pytest.approx(0.5)
  assert evaluate.pass_hat_k([2], 4, 2) == pytest.approx(1 / 6)
  assert evaluate.pass_hat_k([2], 4, 3) == 0.0
  # Averaged over tasks: (C(4,2)/C(4,2) + C(1,2)/C(4,2)) / 2 = (1 + 0) / 2.
  assert evaluate.pass_hat_k([4, 1], 4, 2) == pytest.approx(0.5)


@pytest.mark.parametrize("successes,n,k", [([1], 2, 0), ([1], 2, 3), ([3], 2, 1), ([-1], 2, 1)])
def test_pass_hat_k_rejects_bad_counts(successes, n, k):
  with pytest.raises(ValueError, match="pass\\^k|success counts"):
    evaluate.pass_hat_k(successes, n, k)
