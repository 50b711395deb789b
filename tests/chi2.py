"""Two-sample chi-square check shared by the end-to-end sampling tests (a module, not tests)."""

import functools

import numpy as np

VOCAB = 12  # small, so that 6000 samples fill the 144 cells of a (token 2, token 3) pair


def assert_same_distribution(a, b, cells):
  """Samples ``a`` and ``b`` (ints < cells) from one distribution, at about the 99.99% level."""
  ca, cb = np.bincount(a, minlength=cells), np.bincount(b, minlength=cells)
  keep = (ca + cb) >= 10
  na, nb = ca.sum(), cb.sum()
  ca, cb = ca[keep], cb[keep]
  chi2 = ((np.sqrt(nb / na) * ca - np.sqrt(na / nb) * cb) ** 2 / (ca + cb)).sum()
  dof = keep.sum() - 1
  # 99.99th percentile of chi-square(dof) is below dof + 4.5 * sqrt(2 dof) + 10 for these sizes
  assert chi2 < dof + 4.5 * np.sqrt(2 * dof) + 10, (chi2, dof)


@functools.cache
def sampling_target():
  """The tiny target every end-to-end sampling test drafts for (one object per process, so that
  its vanilla sample below is drawn once)."""
  from flax import nnx

  from eagle_jax.model.config import tiny_config
  from eagle_jax.model.transformer import Transformer

  return Transformer(tiny_config(vocab_size=VOCAB), rngs=nnx.Rngs(0))


def _setting():
  from eagle_jax.decoding.sampling import SamplingParams

  return dict(prompts=[[1, 2, 3, 1, 2]] * 6000, max_new_tokens=3,
              params=SamplingParams(temperature=1.0, top_k=8), stop_ids=())


def _pairs(gen):
  return np.array([t[1] * VOCAB + t[2] for t in gen.tokens])


@functools.cache
def _vanilla_pairs():
  from eagle_jax.decoding.generate import generate

  return _pairs(generate(sampling_target(), seed=1, **_setting()))


def assert_sampling_matches_vanilla(drafter, dparams, expect_accepts=True):
  """Tokens 2-3 sampled 6000 times (T=1, top-k 8) from :func:`sampling_target`: speculative
  vs vanilla, same distribution; with ``expect_accepts`` some drafts were accepted (tau > 1).
  The vanilla sample is drawn once per process and compared with every drafter's."""
  from eagle_jax.decoding.speculative import speculative_generate

  got = speculative_generate(sampling_target(), drafter, dparams, seed=2, **_setting())
  assert_same_distribution(_vanilla_pairs(), _pairs(got), VOCAB * VOCAB)
  assert got.tau > 1.0 or not expect_accepts
