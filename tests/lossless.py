"""Greedy losslessness on the real target: 20 MT-bench prompts, batch 1 and ragged batches of 4
(the ``vanilla20`` fixture of conftest.py holds vanilla's output)."""

from eagle_jax.decoding.generate import generate
from eagle_jax.decoding.speculative import speculative_generate

MAX_NEW_TOKENS = 24


def vanilla_greedy_20(model, mtbench_prompts):
  """20 MT-bench prompts, their common padded width, and vanilla greedy output, one at a time."""
  prompts = mtbench_prompts[::4][:20]
  width = max(map(len, prompts))  # one padded shape: one compilation per decode function
  return prompts, width, [generate(model, [p], max_new_tokens=MAX_NEW_TOKENS,
                                   prompt_width=width).tokens[0] for p in prompts]


def assert_greedy_matches_vanilla20(target, drafter, dparams, vanilla20) -> list[float]:
  """Asserts speculative greedy output equals vanilla's in ragged batches of 4, then one prompt
  at a time; returns the batches' tau."""
  prompts, width, vanilla = vanilla20
  spec = lambda batch: speculative_generate(target, drafter, dparams, batch,
                                            max_new_tokens=MAX_NEW_TOKENS, prompt_width=width)
  taus = []
  for i in range(0, 20, 4):
    batch = spec(prompts[i:i + 4])
    assert batch.tokens == vanilla[i:i + 4]
    taus.append(batch.tau)
  for p, ref in zip(prompts, vanilla):
    assert spec([p]).tokens[0] == ref
  return taus
