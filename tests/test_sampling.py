import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.errors import EagleJaxError
from eagle_jax.decoding.sampling import SamplingParams, greedy_token, probabilities, process_logits, sample


def _reference_filter(logits, temperature, top_k, top_p):
  """Straightforward numpy version of temperature -> top-k -> top-p (Hugging Face order)."""
  x = logits / temperature
  if top_k:
    x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
  if top_p < 1:
    order = np.argsort(-x)
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    keep = np.zeros_like(x, bool)
    mass = 0.0
    for i, idx in enumerate(order):
      if mass < top_p:
        keep[idx] = True
      mass += p[i]
    x = np.where(keep, x, -np.inf)
  return x


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5)])
def test_process_logits_matches_reference(t, k, p):
  logits = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32) * 2
  ours = np.asarray(process_logits(jnp.asarray(logits), SamplingParams(t, p, k)))
  for r in range(3):
    np.testing.assert_allclose(ours[r], _reference_filter(logits[r], t, k, p), rtol=1e-6)


def test_sample_distribution_chi_square():
  """100k vmapped draws match the processed softmax (chi-square, fixed seed)."""
  logits = jnp.asarray(np.random.default_rng(1).standard_normal(12).astype(np.float32))
  params = SamplingParams(temperature=0.8, top_p=0.9)
  n = 100_000
  keys = jax.random.split(jax.random.key(0), n)
  draws = jax.vmap(lambda k: sample(k, logits[None], params)[0])(keys)
  counts = np.bincount(np.asarray(draws), minlength=12)
  p = np.asarray(probabilities(logits[None], params))[0]
  support = p > 0
  assert counts[~support].sum() == 0
  chi2 = (((counts - n * p) ** 2)[support] / (n * p[support])).sum()
  assert chi2 < 35.0, chi2  # df <= 11: p-value ~ 2e-4


def test_greedy_is_argmax():
  logits = jnp.array([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
  assert sample(jax.random.key(0), logits, SamplingParams()).tolist() == [1, 0]


def test_greedy_token_equals_argmax():
  """The max-then-smallest-index form gives jnp.argmax's answer, ties (first index), rows of
  -inf and NaN (the first NaN) included, at any leading shape."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((4, 5, 1000)).astype(np.float32)
  x[0, 0, [7, 400, 999]] = 50.0  # a tie: the first wins
  x[0, 1] = -np.inf
  x[0, 2, [10, 600]] = np.nan
  x[0, 3, 999] = np.inf
  x[1] = np.round(x[1])  # many ties
  ours = np.asarray(jax.jit(greedy_token)(jnp.asarray(x)))
  assert ours.dtype == np.int32
  np.testing.assert_array_equal(ours, np.asarray(jnp.argmax(jnp.asarray(x), -1)))
  assert ours[0, 0] == 7 and ours[0, 2] == 10 and ours[0, 1] == 0


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_params(kw):
  with pytest.raises(EagleJaxError):
    SamplingParams(**kw)
