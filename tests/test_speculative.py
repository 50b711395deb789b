"""The speculative loop: greedy output equals vanilla for every drafter; sampling is lossless."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from chi2 import assert_sampling_matches_vanilla, sampling_target
from lossless import assert_greedy_matches_vanilla20
from eagle_jax.model.config import tiny_config
from eagle_jax.drafters import DraftModelDrafter, PromptLookupDrafter, self_draft_model
from eagle_jax.decoding.protocol import Draft
from eagle_jax.decoding.generate import generate
from eagle_jax.model.transformer import Transformer
from eagle_jax.decoding.speculative import acceptance_rates, speculative_generate
from eagle_jax.decoding.tree import EAGLE_DEFAULT_CHOICES, TreeSpec


@dataclasses.dataclass(frozen=True)
class RandomTreeDrafter:
  """Proposes random tokens in a static tree: a worst-case draft (stateless, deterministic)."""

  tree: TreeSpec
  vocab: int
  feature_layers = ()

  @property
  def num_nodes(self):
    return self.tree.num_nodes

  @property
  def max_depth(self):
    return self.tree.max_depth

  def init(self, dparams, prompt_BxP, lengths_B, features_BxPxD, first_B, cache_len):
    return jnp.zeros(())

  def propose(self, dparams, state, root_B, key, params):
    b, n = root_B.shape[0], self.num_nodes
    # distinct siblings: rank r of a node's parent's candidates -> (hash + r) mod vocab
    base = jax.random.randint(key, (b, n + 1), 0, self.vocab)
    parents = jnp.asarray(self.tree.parents[1:])
    tokens = (base[:, parents] + jnp.asarray(self.tree.ranks[1:])) % self.vocab
    return Draft(tokens_BxN=tokens, parents_BxN=jnp.broadcast_to(parents, (b, n)),
                 valid_BxN=jnp.ones((b, n), bool), q_BxNxV=None), state

  def update(self, dparams, state, accepted):
    return state


PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9, 10, 11, 12, 7, 8, 9], [20, 21], [30, 31, 32, 33, 30]]


def _drafters(target):
  other = Transformer(tiny_config(), rngs=nnx.Rngs(7))  # a different (bad) draft model
  return {
      "pld": (PromptLookupDrafter(gamma=4, max_ngram=2), None),
      # cost-aware widths; equal costs make wide drafts pay, so every width is exercised
      "pld-widths": (PromptLookupDrafter(gamma=4, max_ngram=2, widths=(1, 2, 4),
                                         costs=(1.0, 1.0, 1.0)), None),
      "draft-model": DraftModelDrafter.create(other, gamma=3),
      "self-draft": DraftModelDrafter.create(self_draft_model(target, 1), gamma=3),
      "random-tree": (RandomTreeDrafter(TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES), 128), None),
  }


@pytest.mark.parametrize("name", ["pld", "pld-widths", "draft-model", "self-draft", "random-tree"])
@pytest.mark.parametrize("stop", [(), (5,)])
def test_greedy_equals_vanilla_tiny(tiny, name, stop):
  target = tiny()
  drafter, dparams = _drafters(target)[name]
  ref = generate(target, PROMPTS, max_new_tokens=30, stop_ids=stop)
  ragged = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=30, stop_ids=stop)
  assert ragged.tokens == ref.tokens and ragged.num_new == ref.num_new
  alone = speculative_generate(target, drafter, dparams, PROMPTS[1:2], max_new_tokens=30, stop_ids=stop)
  assert alone.tokens[0] == ref.tokens[1]
  if name.startswith("pld"):  # the greedy replies repeat themselves: lookup drafts are accepted
    assert ragged.tau > 1.0 and alone.tau > 1.0, (ragged.accepted, alone.accepted)


@dataclasses.dataclass(frozen=True)
class AlwaysPLD(PromptLookupDrafter):
  """Prompt lookup claiming ``always_drafts`` although many of its steps draft nothing."""

  always_drafts = True


def test_always_drafting_loop_has_no_plain_step_and_stays_exact(tiny):
  from eagle_jax.drafters import EagleDrafter
  from eagle_jax.drafters.medusa.drafter import MedusaDrafter
  from eagle_jax.decoding.speculative import loop_widths

  target = tiny()
  drafter, dparams = DraftModelDrafter.create(target, gamma=3)
  assert loop_widths(drafter) == (3,)  # no plain one-token step compiled for it
  assert EagleDrafter.always_drafts and MedusaDrafter.always_drafts
  assert loop_widths(PromptLookupDrafter(gamma=4, widths=(2, 4), costs=(1.0, 1.0))) == (0, 2, 4)
  # a step with no valid node in any row (this drafter breaks its claim) verifies the smallest
  # width instead of a plain step: the output is still vanilla's
  wrong = AlwaysPLD(gamma=4, max_ngram=2, widths=(1, 4), costs=(1.0, 1.0))
  assert loop_widths(wrong) == (1, 4)
  gen = speculative_generate(target, wrong, None, PROMPTS, max_new_tokens=30)
  assert 0 in {d for row in gen.drafted_depth for d in row}  # it did draft nothing, sometimes
  assert gen.tokens == generate(target, PROMPTS, max_new_tokens=30).tokens


def test_target_drafting_for_itself_accepts_everything(tiny):
  target = tiny()
  drafter, dparams = DraftModelDrafter.create(target, gamma=4)
  gen = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=41, stop_ids=())
  assert all(a == 4 for row in gen.accepted for a in row)
  assert gen.tau == 5.0 and gen.n_alpha() == [1.0] * 4
  assert gen.tokens == generate(target, PROMPTS, max_new_tokens=41, stop_ids=()).tokens


def test_statistics_count_only_emitted_tokens(tiny):
  """A step cut by max_new_tokens or a stop token counts what it emitted, in tau and n-alpha."""
  target = tiny()
  drafter, dparams = DraftModelDrafter.create(target, gamma=4)
  # 1 + 7 x 5 + 3 tokens: the last step accepts all 4 drafts but emits 3 of them
  gen = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=39, stop_ids=())
  assert all(row[-1] == 2 and depths[-1] == 2 for row, depths in zip(gen.accepted, gen.drafted_depth))
  assert gen.n_alpha() == [1.0] * 4  # the cut is no rejection
  # a stop token in the middle of an accepted run: the steps add up to the emitted tokens
  ref = generate(target, PROMPTS, max_new_tokens=39, stop_ids=()).tokens
  stop = ref[0][12]
  gen = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=39, stop_ids=(stop,))
  for row, toks in zip(gen.accepted, gen.tokens):
    assert sum(a + 1 for a in row) == len(toks) - 1
  assert gen.tokens[0][-1] == stop and gen.n_alpha() == [1.0] * 4


def test_self_draft_shares_the_targets_lm_head_blocks(tiny):
  """A tied LM head held in integer blocks is the self-draft's LM head too (not the float path)."""
  from eagle_jax.model.transformer import quantize_linears

  target = tiny(tie_word_embeddings=True)
  quantize_linears(target)
  assert target.lm_head is None and target.embed_blocks is not None
  draft = self_draft_model(target, 1)
  assert draft.embed_blocks is target.embed_blocks
  drafter, dparams = DraftModelDrafter.create(draft, gamma=3)
  gen = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=12)
  assert gen.tokens == generate(target, PROMPTS, max_new_tokens=12).tokens


def test_acceptance_rates_counting():
  # steps: accepted 2 of depth 3, accepted 0 of depth 3, accepted 3 of 3, nothing drafted
  rates = acceptance_rates([[2, 0, 3, 0]], [[3, 3, 3, 0]])
  assert rates == [2 / 3, 2 / 2, 1 / 2]


def test_drafted_depth_counts_only_the_subtree_of_the_accepted_path(tiny):
  """A deeper node on a rejected branch is no attempt below the accepted one (n-alpha)."""
  from eagle_jax.model.transformer import KVCache
  from eagle_jax.decoding.sampling import SamplingParams
  from eagle_jax.decoding.speculative import _target_pass

  model = tiny()
  prompt = jnp.array([[3, 4, 5, 6]], jnp.int32)
  out = model(prompt[:, :3], jnp.arange(3)[None], KVCache.init(model.config, 1, 32))
  cont = model(prompt[:, 3:], jnp.array([[3]]), out.cache)
  good = int(jnp.argmax(cont.logits_BxTxV[0, -1]))
  bad = (good + 1) % model.config.vocab_size
  # slot 1: the target's token, a leaf; slot 2: a wrong sibling; slot 3: slot 2's child (depth 2)
  def depth_for(tokens, parents):
    draft = Draft(tokens_BxN=jnp.array([tokens], jnp.int32), parents_BxN=jnp.array([parents], jnp.int32),
                  valid_BxN=jnp.ones((1, len(tokens)), bool), q_BxNxV=None)
    _, verdict, _, _, depth_B = _target_pass(model, out.cache, prompt[:, 3], draft, jax.random.key(0),
                                             SamplingParams(temperature=0.0), 2)
    return int(verdict.num_accepted_B[0]), int(depth_B[0])

  assert depth_for([good, bad, 7], [0, 0, 2]) == (1, 1)  # nothing under the accepted leaf
  assert depth_for([good, bad, 7], [0, 0, 1]) == (1, 2)  # slot 3 is under it: tried at depth 2
  assert depth_for([bad, bad, 7], [0, 0, 2]) == (0, 2)  # nothing accepted: the whole tree


@pytest.mark.parametrize("name", ["draft-model", "self-draft", "target", "pld", "pld-widths"])
def test_sampling_end_to_end_matches_vanilla(name):
  """Sampled continuations (tokens 2-3) of a tiny model: spec vs vanilla, two-sample chi-square."""
  target = sampling_target()
  drafters = {
      "draft-model": lambda: DraftModelDrafter.create(
          Transformer(tiny_config(vocab_size=target.config.vocab_size), rngs=nnx.Rngs(3)), 3),
      "self-draft": lambda: DraftModelDrafter.create(self_draft_model(target, 1), 2),
      "target": lambda: DraftModelDrafter.create(target, 2),
      "pld": lambda: (PromptLookupDrafter(gamma=3, max_ngram=1), None),
      "pld-widths": lambda: (PromptLookupDrafter(gamma=3, max_ngram=1, widths=(1, 3), costs=(1.0, 1.2)), None),
  }
  drafter, dparams = drafters[name]()
  from chi2 import PROMPT, lookup_prompt

  # prompt lookup samples after a prompt that holds the target's likely continuation, so that
  # its drafts are accepted too (tau > 1)
  assert_sampling_matches_vanilla(drafter, dparams,
                                  prompt=lookup_prompt() if name.startswith("pld") else PROMPT)


@pytest.mark.parametrize("broken", ["accept_every_draft", "bonus_without_residual"])
def test_sampling_check_rejects_a_broken_verifier(broken):
  """The control of the check above: the same draft model and chi-square test, with a verify
  step that is not lossless (every draft accepted; or the bonus after a rejection sampled from
  the target's distribution instead of the residual), is rejected by a wide margin."""
  import chi2

  target = sampling_target()
  drafter, dparams = DraftModelDrafter.create(
      Transformer(tiny_config(vocab_size=target.config.vocab_size), rngs=nnx.Rngs(3)), 3)
  with chi2.verify_replaced(getattr(chi2, broken)):
    stat, limit, got = chi2.sampling_statistic(drafter, dparams)
  assert stat > 2 * limit, (stat, limit)
  assert got.tau > 1.0  # drafts were verified (and accepted) through the broken step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pld", "self-draft", "draft-model"])
def test_real_model_greedy_lossless_20_prompts(smollm, vanilla20, name):
  """20 MT-bench prompts, batch 1 and ragged batches of 4: identical to vanilla greedy (the
  shipped trained heads: tests/test_shipped_lossless.py)."""
  target = smollm.model
  if name == "pld":  # cost-aware widths, as the CLI drafts (costs as measured on a 2-core CPU)
    drafter, dparams = PromptLookupDrafter(gamma=8, max_ngram=3, widths=(3, 8), costs=(1.7, 2.3)), None
  elif name == "self-draft":
    drafter, dparams = DraftModelDrafter.create(self_draft_model(target, 6), gamma=2)
  else:  # an untrained random draft model sharing the tokenizer: the worst honest draft
    cfg = tiny_config(vocab_size=target.config.vocab_size, hidden_size=64, num_layers=2)
    drafter, dparams = DraftModelDrafter.create(Transformer(cfg, rngs=nnx.Rngs(0)), gamma=2)
  taus = assert_greedy_matches_vanilla20(target, drafter, dparams, vanilla20)
  if name == "draft-model":  # random weights over a 49k vocabulary: no draft is the target's
    assert taus == [1.0] * 5, taus
  else:  # prompt lookup, the target's own layers: drafts accepted in every batch
    assert min(taus) > 1.0, taus


def test_fastest_ms_warms_up_then_keeps_the_fastest_call(monkeypatch):
  """Two untimed calls (the first compiles), then the fastest of the timed ones."""
  from eagle_jax.decoding import costs

  clock = iter([0.0, 0.005, 1.0, 1.002, 2.0, 2.009])  # timed calls of 5, 2 and 9 ms
  monkeypatch.setattr(costs, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  calls = []
  assert costs.fastest_ms(lambda x: calls.append(x) or x, 1, repeats=3) == pytest.approx(2.0)
  assert len(calls) == 2 + 3


def test_verify_cost_curve_times_each_size_once_per_process(tiny, monkeypatch):
  """Every tuning after a training and the runner ask for the curve; each size is timed once."""
  from eagle_jax.decoding import costs

  timed = []

  order = []

  def fake_fastest_ms(fn, state, tokens, cache, chain, repeats=10, warmup=2):  # n ms per forward
    order.append((tokens.shape[1], int(chain)))
    if chain == 1 and warmup:  # a size's first call (compiles and warms up)
      timed.append(tokens.shape[1])
    return float(tokens.shape[1] * chain)

  monkeypatch.setattr(costs, "fastest_ms", fake_fastest_ms)
  monkeypatch.setattr(costs, "_VERIFY_MS", {})
  model = tiny()
  assert costs.verify_cost_curve(model, sizes=(1, 2), repeats=1) == {1: 1.0, 2: 2.0}
  assert costs.verify_cost_curve(tiny(seed=1), sizes=(2, 4), repeats=1) == {2: 2.0, 4: 4.0}
  assert timed == [1, 2, 4]  # same architecture, other weights: size 2 is not timed again
  costs.verify_cost_curve(tiny(num_layers=3), sizes=(2,), repeats=1)
  assert timed == [1, 2, 4, 2]  # another architecture is
  order.clear()
  assert costs.verify_cost_curve(tiny(num_layers=4), sizes=(1, 2), repeats=2) == {1: 1.0, 2: 2.0}
  round_ = [(1, 1), (1, costs.LONG), (2, 1), (2, costs.LONG)]
  assert order == round_ + round_  # every size and chain once per round


def test_short_cache_below_the_padded_prompt_width(tiny):
  """A 70-token prompt pads to 128 columns; a 100-slot cache still holds prompt and reply."""
  target = tiny()
  prompt = [[(5 * i) % 40 + 3 for i in range(70)]]
  want = generate(target, prompt, max_new_tokens=10, max_cache_len=100).tokens
  gen = speculative_generate(target, PromptLookupDrafter(gamma=4), None, prompt, max_new_tokens=10,
                             max_cache_len=100)
  assert gen.tokens == want
  assert gen.tau > 1.0, gen.accepted  # the reply repeats itself: lookup drafts are accepted
