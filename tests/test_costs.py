"""The predicted-speedup model shared by ``bench spec``, the experiment tables and the sweeps."""

import pytest

from eagle_jax.decoding.costs import chain_tokens, predict_speedup
from eagle_jax.drafters.draft_model.train import predicted_speedup


def test_chain_prediction_reduces_to_the_reference_formula():
  # 6 accepted of 3 + 1 + 4 tried (a step tries its accepted tokens and the first rejected one)
  acc, dep = [2, 0, 4], [4, 4, 4]
  alpha = 6 / (3 + 1 + 4)
  # verifying 5 tokens as dear as 1 (the formula's assumption), draft = 4 x 0.1 target steps
  curve = {1: 10.0, 2: 10.0, 8: 10.0}
  speedup, a = predict_speedup(acc, dep, curve, widths=(4,), draft_ms=4.0, chain=True)
  assert a == pytest.approx(alpha)
  assert speedup == pytest.approx(predicted_speedup(alpha, 4, 0.1))
  assert chain_tokens(1.0, 4) == 5.0 and chain_tokens(0.0, 4) == 1.0


def test_undrafted_steps_are_decode_steps_that_still_pay_the_draft():
  acc, dep = [2, 0, 4, 0], [4, 4, 4, 0]
  curve = {1: 10.0, 4: 16.0, 8: 24.0}  # c(5) = 18 by interpolation
  e = chain_tokens(6 / 8, 4)
  speedup, _ = predict_speedup(acc, dep, curve, widths=(4,), draft_ms=1.0, chain=True)
  assert speedup == pytest.approx((3 * e + 1) * 10.0 / (3 * (18.0 + 1.0) + 10.0 + 1.0))


def test_each_step_verifies_the_smallest_width_of_the_ladder_holding_its_draft():
  curve = {1: 10.0, 2: 11.0, 4: 13.0, 8: 21.0, 16: 37.0}  # c(3) = 12, c(9) = 23
  # a 2-token draft verifies width 2 (3 tokens), a 5-token one width 8 (9 tokens)
  speedup, _ = predict_speedup([1, 5], [2, 5], curve, widths=(2, 8), draft_ms=0.0, chain=False)
  assert speedup == pytest.approx((2 + 6) * 10.0 / (12.0 + 23.0))


def test_trees_use_the_measured_tokens_and_their_full_node_budget():
  curve = {1: 10.0, 16: 30.0, 36: 50.0}  # 25 nodes + root: c(26) = 40
  speedup, alpha = predict_speedup([3, 1, 0], [4, 2, 1], curve, widths=(25,), draft_ms=5.0, chain=False)
  assert speedup == pytest.approx((4 + 2 + 1) * 10.0 / (3 * 45.0))
  assert alpha == pytest.approx(4 / (4 + 2 + 1))
  assert predict_speedup([], [], curve, widths=(25,), draft_ms=5.0, chain=False) == (None, None)


def test_nothing_drafted_has_no_acceptance_rate():
  curve = {1: 10.0, 4: 16.0}
  speedup, alpha = predict_speedup([0, 0], [0, 0], curve, widths=(3,), draft_ms=1.0, chain=True)
  assert alpha is None and speedup == pytest.approx(10.0 / 11.0)


def test_costs_outside_the_curve_or_the_ladder_are_refused_not_clamped():
  curve = {1: 10.0, 4: 16.0, 8: 24.0}
  with pytest.raises(ValueError, match="the verify widths are \\[4\\]"):
    predict_speedup([1], [6], curve, widths=(4,), draft_ms=0.0, chain=False)
  with pytest.raises(ValueError, match="the verify widths are \\[\\]"):
    predict_speedup([1], [2], curve, widths=(), draft_ms=0.0, chain=False)
  with pytest.raises(ValueError, match="curve ends at 8 tokens"):
    predict_speedup([1], [2], curve, widths=(2, 8), draft_ms=0.0, chain=False)
  # a ladder the curve covers (8 + 1 = 9 > 8 above; 7 + 1 = 8 here) is fine
  assert predict_speedup([1], [2], curve, widths=(7,), draft_ms=0.0, chain=False)[0] > 0


def test_speedup_ceiling_is_the_best_fully_accepted_pass_on_the_curve():
  from eagle_jax.decoding.costs import speedup_ceiling

  # 4 tokens for 6 ms beats 2 for 4 ms and 8 for 16 ms, against 1 token for 3 ms
  curve = {1: 3.0, 2: 4.0, 4: 6.0, 8: 16.0}
  assert speedup_ceiling(curve) == {"speedup": 2.0, "tokens_per_pass": 4}
  # a pass whose every extra token costs a full step pays nothing: the ceiling is vanilla itself
  assert speedup_ceiling({1: 2.0, 2: 4.0, 4: 8.0}) == {"speedup": 1.0, "tokens_per_pass": 1}
  with pytest.raises(ValueError, match="c\\(1\\)"):
    speedup_ceiling({2: 4.0, 4: 6.0})
  # no drafter's prediction exceeds it: every drafted token accepted, no draft cost, widest pass
  ladder = (1, 3, 7)
  best, _ = predict_speedup([3] * 5, [3] * 5, curve, widths=ladder, draft_ms=0.0, chain=False)
  assert best <= speedup_ceiling(curve)["speedup"]
