"""Prompt lookup's cost-aware widths: what it drafts is learned from what the target emits.

The drafter runs here against a known continuation, as greedy verification would: a step
accepts the leading drafted tokens that equal the continuation, then emits the next one.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decoding.protocol import Accepted
from eagle_jax.drafters.pld import PromptLookupDrafter
from eagle_jax.errors import EagleJaxError
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.speculative import verify_widths


def _run(drafter, prompt, truth, steps):
  """Per step: the width drafted and the tokens accepted, with ``truth`` as the target's text."""
  g = drafter.gamma
  state = drafter.init(None, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), None,
                       jnp.asarray([truth[0]]), 256)
  pos, log = 1, []
  for _ in range(steps):
    draft, state = drafter.propose(None, state, jnp.asarray([truth[pos - 1]]), None, SamplingParams())
    width = int(draft.valid_BxN[0].sum())
    tokens = np.asarray(draft.tokens_BxN[0])[:width].tolist()
    a = 0
    while a < width and tokens[a] == truth[pos + a]:
      a += 1
    emitted = truth[pos:pos + a + 1]
    acc = Accepted(tokens_BxK=jnp.asarray([emitted + [0] * (g + 1 - len(emitted))]),
                   count_B=jnp.asarray([len(emitted)]), features_BxKxD=jnp.zeros((1, g + 1, 1)))
    state = drafter.update(None, state, acc)
    pos += len(emitted)
    log.append((width, a))
  return log


def _drafter(**kw):
  return PromptLookupDrafter(gamma=6, min_ngram=1, max_ngram=2, widths=(2, 6), costs=(1.6, 2.2),
                             **{"prior_alpha": 0.5, **kw})


def test_stops_drafting_what_is_never_accepted():
  # token 5 recurs with a fresh continuation each time: every lookup proposes the wrong text
  truth = [t for i in range(60) for t in (5, 100 + i)]
  log = _run(_drafter(), [1, 2, 3], truth, steps=80)
  assert all(a == 0 for _, a in log)
  assert log[-40:] == [(0, 0)] * 40  # after a few resolved continuations it drafts nothing


def test_drafts_full_width_while_copying():
  # the reply copies a 40-token span of the prompt
  span = list(range(10, 50))
  log = _run(_drafter(), [1, 2] + span + [3], span, steps=8)
  assert all(0 < w == a for w, a in log)  # drafts from the first step on, all accepted
  assert log[0][0] == 2  # the prior alone favours the short width
  assert log[4:] == [(6, 6)] * 4  # two resolved 6-token continuations later: the full width


def test_keeps_learning_without_drafting():
  """Continuations are checked against what was emitted even when they were not drafted."""
  # first 30 steps: lookups are always wrong (it stops drafting); then a copied span: the
  # pending (undrafted) continuations turn out right, and it drafts again
  wrong = [t for i in range(30) for t in (5, 100 + i)]
  span = list(range(10, 40))
  prompt = [1] + span + [2]
  log = _run(_drafter(prior_count=1.0), prompt, wrong + span * 2, steps=70)
  assert log[30:40] == [(0, 0)] * 10
  assert any(w > 0 and a > 0 for w, a in log[40:])


def test_without_widths_drafts_every_match_at_gamma():
  truth = [t for i in range(30) for t in (5, 100 + i)]
  log = _run(PromptLookupDrafter(gamma=6, min_ngram=1, max_ngram=2), [1, 2, 3], truth, steps=30)
  # after a 5: the 2 tokens after the previous 5, never accepted, drafted to the end
  assert set(log[4:]) == {(0, 0), (2, 0)} and (2, 0) in log[-4:]


@pytest.mark.parametrize("kw, msg", [
    (dict(widths=(3, 5), costs=(1.0, 1.0)), "must ascend from >= 1 to gamma=6"),
    (dict(widths=(6, 3), costs=(1.0, 1.0)), "must ascend"),
    (dict(widths=(3, 6), costs=(1.0,)), "one positive verify cost per width"),
    (dict(widths=(3, 6), costs=(1.0, 0.0)), "one positive verify cost per width"),
])
def test_bad_widths_are_one_line_errors(kw, msg):
  with pytest.raises(EagleJaxError, match=msg):
    PromptLookupDrafter(gamma=6, **kw)


def test_engine_checks_width_ladders():
  assert verify_widths(_drafter()) == (2, 6)
  assert verify_widths(PromptLookupDrafter(gamma=4)) == (4,)

  class Bad:
    num_nodes, widths = 4, (2, 3)

  with pytest.raises(ValueError, match="must ascend"):
    verify_widths(Bad())
