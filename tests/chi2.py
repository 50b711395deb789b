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
