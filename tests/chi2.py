"""Two-sample chi-square check shared by the end-to-end sampling tests (a module, not tests)."""

import numpy as np


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


def assert_sampling_matches_vanilla(target, drafter, dparams, vocab):
  """Tokens 2-3 sampled 6000 times (T=1, top-k 8): speculative vs vanilla, same distribution,
  with some drafts accepted (tau > 1)."""
  from eagle_jax.generate import generate
  from eagle_jax.sampling import SamplingParams
  from eagle_jax.speculative import speculative_generate

  params = SamplingParams(temperature=1.0, top_k=8)
  prompts = [[1, 2, 3, 1, 2]] * 6000
  ref = generate(target, prompts, max_new_tokens=3, params=params, seed=1, stop_ids=())
  got = speculative_generate(target, drafter, dparams, prompts, max_new_tokens=3, params=params,
                             seed=2, stop_ids=())
  pair = lambda g: np.array([t[1] * vocab + t[2] for t in g.tokens])
  assert_same_distribution(pair(ref), pair(got), vocab * vocab)
  assert got.tau > 1.0
