"""Two-sample chi-square check shared by the end-to-end sampling tests (a module, not tests)."""

import contextlib
import functools

import numpy as np

VOCAB = 12  # small, so that 6000 samples fill the 144 cells of a (token 2, token 3) pair


def chi2_statistic(a, b, cells):
  """Two-sample chi-square of samples ``a`` and ``b`` (ints < cells): ``(statistic, limit)``,
  ``limit`` about the 99.99th percentile of the statistic when both come from one distribution."""
  ca, cb = np.bincount(a, minlength=cells), np.bincount(b, minlength=cells)
  keep = (ca + cb) >= 10
  na, nb = ca.sum(), cb.sum()
  ca, cb = ca[keep], cb[keep]
  chi2 = ((np.sqrt(nb / na) * ca - np.sqrt(na / nb) * cb) ** 2 / (ca + cb)).sum()
  dof = keep.sum() - 1
  # 99.99th percentile of chi-square(dof) is below dof + 4.5 * sqrt(2 dof) + 10 for these sizes
  return float(chi2), float(dof + 4.5 * np.sqrt(2 * dof) + 10)


def assert_same_distribution(a, b, cells):
  """Samples ``a`` and ``b`` (ints < cells) from one distribution, at about the 99.99% level."""
  chi2, limit = chi2_statistic(a, b, cells)
  assert chi2 < limit, (chi2, limit)


@functools.cache
def sampling_target():
  """The tiny target every end-to-end sampling test drafts for (one object per process, so that
  its vanilla sample below is drawn once)."""
  from flax import nnx

  from eagle_jax.model.config import tiny_config
  from eagle_jax.model.transformer import Transformer

  return Transformer(tiny_config(vocab_size=VOCAB), rngs=nnx.Rngs(0))


PROMPT = (1, 2, 3, 1, 2)


@functools.cache
def lookup_prompt():
  """:data:`PROMPT` followed by the target's greedy continuation of it (8 tokens): prompt
  lookup finds the text the target is likely to sample next, so some of its drafts are
  accepted (after :data:`PROMPT` alone it drafts tokens the target's top-k excludes)."""
  from eagle_jax.decoding.generate import generate

  return PROMPT + tuple(generate(sampling_target(), [list(PROMPT)], max_new_tokens=8,
                                 stop_ids=()).tokens[0])


def _setting(prompt=PROMPT):
  from eagle_jax.decoding.sampling import SamplingParams

  return dict(prompts=[list(prompt)] * 6000, max_new_tokens=3,
              params=SamplingParams(temperature=1.0, top_k=8), stop_ids=())


def _pairs(gen):
  return np.array([t[1] * VOCAB + t[2] for t in gen.tokens])


@functools.cache
def _vanilla_pairs(prompt=PROMPT):
  from eagle_jax.decoding.generate import generate

  return _pairs(generate(sampling_target(), seed=1, **_setting(prompt)))


def sampling_statistic(drafter, dparams, prompt=PROMPT):
  """Tokens 2-3 sampled 6000 times (T=1, top-k 8) from :func:`sampling_target` after
  ``prompt`` (a tuple), speculative against vanilla: ``(statistic, limit, generation)`` of
  :func:`chi2_statistic`. The vanilla sample of a prompt is drawn once per process and
  compared with every drafter's."""
  from eagle_jax.decoding.speculative import speculative_generate

  got = speculative_generate(sampling_target(), drafter, dparams, seed=2, **_setting(prompt))
  return (*chi2_statistic(_vanilla_pairs(prompt), _pairs(got), VOCAB * VOCAB), got)


def assert_sampling_matches_vanilla(drafter, dparams, expect_accepts=True, prompt=PROMPT):
  """Speculative vs vanilla sampling (:func:`sampling_statistic`), same distribution; with
  ``expect_accepts`` some drafts were accepted (tau > 1)."""
  chi2, limit, got = sampling_statistic(drafter, dparams, prompt)
  assert chi2 < limit, (chi2, limit)
  assert got.tau > 1.0 or not expect_accepts, got.tau


@contextlib.contextmanager
def verify_replaced(broken):
  """The speculative loop verifies with ``broken`` (same signature as
  :func:`eagle_jax.decoding.verify.verify`) inside the block: a control the sampling check
  must reject. The loop's compiled programs are dropped on entry and exit, so that neither
  side reuses a program compiled with the other verify step."""
  import importlib

  speculative = importlib.import_module("eagle_jax.decoding.speculative")
  compiled = importlib.import_module("eagle_jax.decoding.generate")._COMPILED

  def drop():
    for key in [k for k in compiled if k[0] is speculative._spec_jit]:
      del compiled[key]
    speculative._spec_jit.clear_cache()

  real = speculative.verify
  drop()
  speculative.verify = broken
  try:
    yield
  finally:
    speculative.verify = real
    drop()


def accept_every_draft(logits_BxMxV, tokens_BxM, parents_BxM, valid_BxM, q_BxMxV, key, params,
                       max_depth):
  """A broken verify step for chain drafts: every drafted token is accepted, then the bonus is
  sampled from the target at the chain's end (the output follows the draft model)."""
  import jax.numpy as jnp

  from eagle_jax.decoding.sampling import sample
  from eagle_jax.decoding.verify import Verdict

  b, d = tokens_BxM.shape[0], max(max_depth, 1)
  n_B = valid_BxM.sum(1).astype(jnp.int32) - 1  # a chain: its valid nodes are slots 1..n
  path_BxD = jnp.broadcast_to(jnp.arange(1, d + 1, dtype=jnp.int32), (b, d))
  return Verdict(path_BxD=path_BxD, num_accepted_B=n_B,
                 bonus_B=sample(key, logits_BxMxV[jnp.arange(b), n_B], params))


def bonus_without_residual(logits_BxMxV, tokens_BxM, parents_BxM, valid_BxM, q_BxMxV, key, params,
                           max_depth):
  """A subtly broken verify step: the right accepted path, but after a rejection the bonus is
  sampled from the target's distribution instead of the residual ``max(p - q, 0)``."""
  import jax
  import jax.numpy as jnp

  from eagle_jax.decoding.sampling import sample
  from eagle_jax.decoding.verify import verify

  v = verify(logits_BxMxV, tokens_BxM, parents_BxM, valid_BxM, q_BxMxV, key, params, max_depth)
  a_B = v.num_accepted_B
  last_B = jnp.where(a_B > 0, jnp.take_along_axis(v.path_BxD, jnp.maximum(a_B - 1, 0)[:, None], 1)[:, 0], 0)
  p_logits_BxV = logits_BxMxV[jnp.arange(tokens_BxM.shape[0]), last_B]
  return v.replace(bonus_B=sample(jax.random.fold_in(key, 1), p_logits_BxV, params))
