"""EAGLE drafters with tiny models: lossless greedy and sampling, drafting == training unroll."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from chi2 import assert_sampling_matches_vanilla, sampling_target
from eagle_jax.drafters.eagle.drafter import EagleDrafter
from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig, Frozen
from eagle_jax.drafters.eagle.train import unroll
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.config import tiny_config
from eagle_jax.model.transformer import Transformer
from eagle_jax.decoding.generate import generate
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.speculative import features_of, speculative_generate
from eagle_jax.decoding.tree import EAGLE_DEFAULT_CHOICES, TreeSpec

PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9, 10, 11, 12, 7, 8, 9], [20, 21], [30, 31, 32, 33, 30]]
TREES = {"static25": (TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES), {}),
         "chain4": (TreeSpec.chain(4), {}),
         "dynamic": (None, dict(top_k=3, depth=4, total_tokens=10))}


def make_head(cfg, version, seed=1, draft_vocab=0):
  if version == 1:
    hc = EagleHeadConfig(1, cfg)
    return EagleHead(hc, rngs=nnx.Rngs(seed))
  hc = EagleHeadConfig(3, cfg, fuse_layers=(0, 1, cfg.num_layers), draft_vocab=draft_vocab)
  d2t = np.sort(np.random.RandomState(seed).permutation(cfg.vocab_size)[:hc.vocab])
  return EagleHead(hc, rngs=nnx.Rngs(seed), d2t=d2t)


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("stop", [(), (5,)])
def test_greedy_equals_vanilla_tiny(tiny, version, tree, stop):
  target = tiny()
  head = make_head(target.config, version, draft_vocab=96 if version == 3 else 0)
  spec, kw = TREES[tree]
  drafter, dparams = EagleDrafter.create(head, target, spec, **kw)
  ref = generate(target, PROMPTS, max_new_tokens=30, stop_ids=stop)
  ragged = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=30, stop_ids=stop)
  assert ragged.tokens == ref.tokens and ragged.num_new == ref.num_new
  alone = speculative_generate(target, drafter, dparams, PROMPTS[1:2], max_new_tokens=30, stop_ids=stop)
  assert alone.tokens[0] == ref.tokens[1]


@pytest.mark.parametrize("version", [1, 3])
def test_head_in_8bit_blocks_stays_lossless(tiny, version):
  """head_bits=8: the head's linears read 8-bit blocks (the kernel on the CPU); drafts may
  change, the output may not."""
  from eagle_jax.kernels import BLOCK
  from eagle_jax.model.transformer import Linear, quantize_linears

  target = tiny()
  head = make_head(target.config, version, draft_vocab=96 if version == 3 else 0)
  before = {id(l): np.asarray(l.weight[...]) for _, l in nnx.iter_graph(head) if isinstance(l, Linear)}
  assert quantize_linears(head) == len(before) > 0
  for _, lin in nnx.iter_graph(head):
    if isinstance(lin, Linear):
      blocks = lin.blocks.get_value()
      np.testing.assert_array_equal(np.asarray(lin.weight[...]), blocks.dequantize())
      scale = np.repeat(np.asarray(blocks.scale_OxN), BLOCK, axis=1)
      assert (np.abs(np.asarray(lin.weight[...]) - before[id(lin)]) <= scale / 2 * (1 + 1e-5) + 1e-12).all()
  assert quantize_linears(head) == 0  # already in blocks
  drafter, dparams = EagleDrafter.create(head, target, TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES))
  ref = generate(target, PROMPTS, max_new_tokens=30, stop_ids=())
  assert speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=30,
                              stop_ids=()).tokens == ref.tokens


@pytest.mark.parametrize("version", [1, 3])
def test_chain_drafting_equals_training_unroll(tiny, version):
  """A drafted chain is what the training-time unroll predicts on the same tokens."""
  target = tiny()
  head = make_head(target.config, version, seed=2, draft_vocab=64 if version == 3 else 0)
  drafter, dparams = EagleDrafter.create(head, target, TreeSpec.chain(3))
  prompt = jnp.array([PROMPTS[1]], jnp.int32)
  length = prompt.shape[1]
  out = target(prompt, jnp.arange(length)[None], None, return_layers=drafter.feature_layers)
  feats = features_of(out, drafter.feature_layers)
  first = jnp.array([42], jnp.int32)
  state = drafter.init(dparams, prompt, jnp.array([length]), feats, first, cache_len=64)
  draft, _ = drafter.propose(dparams, state, first, jax.random.key(0), SamplingParams())
  d = draft.tokens_BxN[0]
  tokens = jnp.concatenate([prompt[0], first, d[:2]])[None]
  t = tokens.shape[1]
  pad = jnp.zeros((1, t - length, feats.shape[-1]))
  outs = unroll(head, dparams[1], tokens, head.fuse_features(jnp.concatenate([feats, pad], 1)),
                jnp.arange(t)[None], jnp.ones((1, t), jnp.int32), steps=3)
  for j in range(3):
    logits = head.logits(outs[j][:, length - 1], dparams[1])
    assert int(head.to_target(jnp.argmax(logits, -1), dparams[1])[0]) == int(d[j])
  np.testing.assert_allclose(state.frontier_BxD, outs[0][:, length - 1], atol=1e-5)


def test_head_prompt_pass_with_fresh_cache_equals_reading_it(tiny):
  """The drafter's prompt pass skips reading its empty cache: same outputs and written K/V."""
  target = tiny()
  for version in (1, 3):
    head = make_head(target.config, version, draft_vocab=64 if version == 3 else 0)
    drafter, dparams = EagleDrafter.create(head, target, TreeSpec.chain(3))
    frozen = dparams[1]
    b, p, slots = 2, 6, 16
    tokens = jax.random.randint(jax.random.key(1), (b, p), 0, 128)
    width = target.config.hidden_size * max(len(drafter.feature_layers), 1)
    feats = jax.random.normal(jax.random.key(2), (b, p, width))
    pos = jnp.broadcast_to(jnp.arange(p), (b, p))
    mask = jnp.broadcast_to(jnp.arange(slots)[None, None, :] <= jnp.arange(p)[None, :, None], (b, p, slots))
    run = lambda fresh: head(tokens, head.fuse_features(feats), pos, mask, frozen,
                             head.init_kv(b, slots), pos, fresh_cache=fresh)
    (out_f, kv_f), (out_r, kv_r) = run(True), run(False)
    np.testing.assert_allclose(out_f, out_r, atol=1e-5)
    for a, c in zip(jax.tree.leaves(kv_f), jax.tree.leaves(kv_r)):
      np.testing.assert_allclose(a, c, atol=1e-6)


def test_dynamic_tree_is_ancestor_closed_and_best_first(tiny):
  target = tiny()
  head = make_head(target.config, 1, seed=3)
  drafter, dparams = EagleDrafter.create(head, target, None, top_k=4, depth=4, total_tokens=20)
  prompt = jnp.array([PROMPTS[0], PROMPTS[0]], jnp.int32)
  out = target(prompt, jnp.broadcast_to(jnp.arange(7), (2, 7)), None)
  state = drafter.init(dparams, prompt, jnp.array([7, 5]), out.hidden_BxTxD, jnp.array([1, 2]), 64)
  draft, _ = drafter.propose(dparams, state, jnp.array([1, 2]), jax.random.key(0), SamplingParams())
  parents = np.asarray(draft.parents_BxN)
  assert np.asarray(draft.valid_BxN).all()
  assert (parents < np.arange(1, 21)[None]).all()  # topological
  # depth-1 nodes are the head's top-k children of the root, best first
  top = np.asarray(jax.lax.top_k(head.logits(state.frontier_BxD, dparams[1]), 4)[1])
  for b in range(2):
    roots = np.asarray(draft.tokens_BxN[b])[parents[b] == 0]
    assert list(roots) == list(top[b][:len(roots)])


def test_dynamic_tree_budget_is_checked(tiny):
  with pytest.raises(EagleJaxError, match="total_tokens"):
    EagleDrafter.create(make_head(tiny().config, 1), tiny(), None, top_k=2, depth=2, total_tokens=7)


def test_draft_vocabulary_and_target_are_checked(tiny):
  target = tiny()
  head = make_head(target.config, 1)
  # more candidates per node than the draft vocabulary holds: dynamic top_k, static tree ranks
  with pytest.raises(EagleJaxError, match="ranks 8 tokens per node .* holds 4"):
    EagleDrafter.create(head, target, None, draft_ids=[1, 2, 3, 4], top_k=8, depth=3, total_tokens=10)
  with pytest.raises(EagleJaxError, match="ranks 4 tokens per node .* holds 3"):
    EagleDrafter.create(head, target, TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES), draft_ids=[1, 2, 3])
  EagleDrafter.create(head, target, TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES), draft_ids=[1, 2, 3, 4])
  # a head trained for a target with another vocabulary would draft ids the target lacks
  other = tiny(vocab_size=target.config.vocab_size * 2)
  with pytest.raises(EagleJaxError, match="vocab_size"):
    EagleDrafter.create(make_head(other.config, 1), target, None, top_k=2, depth=2, total_tokens=3)


@pytest.mark.parametrize("version,tree,reduced", [(1, "static25", False), (1, "dynamic", True),
                                                   (3, "dynamic", False)])
def test_sampling_is_lossless(version, tree, reduced):
  """Sampled continuations (tokens 2-3): EAGLE speculative vs vanilla, two-sample chi-square;
  ``reduced``: the EAGLE-1 head drafts over 6 of the 12 target ids (a draft that can never
  propose half the vocabulary must still leave the output distribution exact)."""
  target = sampling_target()
  head = make_head(target.config, version, seed=4, draft_vocab=8 if version == 3 else 0)
  spec, kw = TREES[tree]
  drafter, dparams = EagleDrafter.create(head, target, spec, draft_ids=[0, 2, 3, 5, 8, 11] if reduced
                                         else None, **kw)
  assert_sampling_matches_vanilla(drafter, dparams)


@pytest.mark.parametrize("tree", ["static25", "dynamic"])
def test_reduced_draft_vocab_drafts_only_its_ids_and_stays_lossless(tiny, tree):
  """EAGLE-1/2 over a reduced vocabulary (the target's LM-head rows of chosen ids, as FR-Spec):
  every drafted token is one of the ids, the logits are the full head's at those ids, and
  greedy output still equals vanilla (ragged batch)."""
  target = tiny()
  head = make_head(target.config, 1, seed=2)
  ids = np.sort(np.random.RandomState(0).permutation(target.config.vocab_size)[:40])
  spec, kw = TREES[tree]
  drafter, dparams = EagleDrafter.create(head, target, spec, draft_ids=ids, **kw)
  full, full_params = EagleDrafter.create(head, target, spec, **kw)
  assert drafter.draft_vocab == 40 and full.draft_vocab == 0
  x = jax.random.normal(jax.random.key(1), (2, 3, target.config.hidden_size))
  np.testing.assert_allclose(head.logits(x, dparams[1]), head.logits(x, full_params[1])[..., ids],
                             rtol=1e-5, atol=1e-5)
  prompt = jnp.array([PROMPTS[0]], jnp.int32)
  out = target(prompt, jnp.arange(prompt.shape[1])[None], None)
  state = drafter.init(dparams, prompt, jnp.array([prompt.shape[1]]), out.hidden_BxTxD,
                       jnp.array([42]), cache_len=64)
  draft, _ = drafter.propose(dparams, state, jnp.array([42]), jax.random.key(0), SamplingParams())
  drafted = np.asarray(draft.tokens_BxN)[np.asarray(draft.valid_BxN)]
  assert drafted.size and set(drafted.tolist()) <= set(ids.tolist())
  ref = generate(target, PROMPTS, max_new_tokens=30, stop_ids=(5,))
  got = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=30, stop_ids=(5,))
  assert got.tokens == ref.tokens


def test_reduced_draft_vocab_errors(tiny):
  target = tiny()
  with pytest.raises(EagleJaxError, match="EAGLE-3 head drafts over the vocabulary"):
    EagleDrafter.create(make_head(target.config, 3, draft_vocab=96), target, None, draft_ids=[1, 2])
  with pytest.raises(EagleJaxError, match="draft vocabulary must be"):
    EagleDrafter.create(make_head(target.config, 1), target, None, draft_ids=[1, 500])


def test_frozen_arrays_are_the_targets(tiny):
  target = tiny(tie_word_embeddings=False)
  frozen = Frozen.of(target)
  assert frozen.embed_VxD is target.embed[...]
  assert frozen.lm_head_VxD is target.lm_head.weight[...]


def test_top_tokens_and_exported_counts(tmp_path):
  from eagle_jax.drafters.eagle.train import top_tokens
  from eagle_jax.drafters.storage import load_token_counts, save_token_counts

  counts = np.array([5, 0, 3, 9])
  assert top_tokens(counts, 2).tolist() == [0, 3]
  assert top_tokens(counts, 2, always=(1,)).tolist() == [1, 3]
  with pytest.raises(EagleJaxError, match="draft vocabulary size 5 outside"):
    top_tokens(counts, 5)
  with pytest.raises(EagleJaxError, match="token_counts.npy missing"):
    load_token_counts(str(tmp_path), 4)
  (tmp_path / "drafter.json").write_text("{}")
  save_token_counts(str(tmp_path), counts)
  assert load_token_counts(str(tmp_path), 4).tolist() == counts.tolist()
  with pytest.raises(EagleJaxError, match="4 counts, but the target has 8 tokens"):
    load_token_counts(str(tmp_path), 8)


def test_method_spec_sets_drafter_options_per_row():
  from eagle_jax.drafters.registry import get, method_spec

  assert method_spec("eagle2") == ("eagle2", {})
  name, values = method_spec("eagle2:draft_vocab=8192:top_k=4")
  assert name == "eagle2" and values == {"draft_vocab": 8192, "top_k": 4}
  opts = get(name).make_options(values)
  assert (opts.draft_vocab, opts.top_k, opts.depth) == (8192, 4, 0)
  assert method_spec("pld:pld_widths=3/8")[1] == {"pld_widths": (3, 8)}
  assert method_spec("eagle1:checkpoint=runs/x")[1] == {"checkpoint": "runs/x"}
  with pytest.raises(EagleJaxError, match="expected NAME:key=value"):
    method_spec("eagle2:vocab=3")
  with pytest.raises(EagleJaxError, match="top_k takes an integer"):
    method_spec("eagle2:top_k=many")
  with pytest.raises(EagleJaxError, match="unknown drafter 'eagle9'"):
    method_spec("eagle9:top_k=2")
  with pytest.raises(EagleJaxError, match="'eagle3:draft_vocab=8192': draft_vocab not used by eagle3"):
    method_spec("eagle3:draft_vocab=8192")
  with pytest.raises(EagleJaxError, match="top_k not used by pld"):
    method_spec("pld:top_k=4")
  with pytest.raises(EagleJaxError, match="checkpoint not used by pld"):
    method_spec("pld:checkpoint=runs/x")


def test_dynamic_tree_depth_capped_at_its_node_budget(tiny):
  """A tree of n nodes is never deeper than n: expanding further would cost draft steps whose
  nodes could never be kept."""
  target = tiny()
  head = make_head(target.config, 1)
  drafter, _ = EagleDrafter.create(head, target, None, top_k=4, depth=6, total_tokens=2)
  assert drafter.depth == drafter.max_depth == 2
  drafter, _ = EagleDrafter.create(head, target, None, top_k=4, depth=3, total_tokens=10)
  assert drafter.depth == 3


def test_budget_tuner_times_each_drafter_once(tiny, monkeypatch):
  """A budget of n nodes below the depth drafts n levels whatever depth it was asked for, so
  the tuner times that drafter once per (top_k, draft vocabulary) and gives every depth the
  same figure; each (top_k, depth) also times its full-budget drafter."""
  import eagle_jax.drafters.eagle.tune as budget

  target = tiny()
  head = make_head(target.config, 1)
  timed, real = [], budget.draft_cost_ms

  def counting(drafter, dparams, target, prompt, repeats=10):
    timed.append((drafter.top_k, drafter.depth, drafter.total_tokens))
    return real(drafter, dparams, target, prompt, repeats=1)

  monkeypatch.setattr(budget, "draft_cost_ms", counting)
  curve = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4}
  result = budget.tune_budget(head, target, PROMPTS[:1], curve=curve, top_ks=(2,), depths=(2, 3),
                              max_nodes=7, max_new_tokens=6)
  assert sorted(timed) == [(2, 1, 1), (2, 2, 2), (2, 2, 6), (2, 3, 7)]
  by = result["by_setting"]
  assert by["top_k=2,depth=2"]["draft_ms_by_budget"][1] == by["top_k=2,depth=3"]["draft_ms_by_budget"][1]
  assert set(by["top_k=2,depth=3"]["draft_ms_by_budget"]) == {1, 2}


@pytest.mark.parametrize("tree", ["static25", "dynamic"])
def test_greedy_equals_vanilla_with_a_bfloat16_target(tree):
  # parameters and activations in bfloat16, logits and the verify step in float32: the output
  # is still exactly vanilla's in the same dtype
  target = Transformer(tiny_config(), rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
  drafter, dparams = EagleDrafter.create(make_head(target.config, 1), target, TREES[tree][0],
                                         **TREES[tree][1])
  ref = generate(target, PROMPTS, max_new_tokens=24)
  out = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=24)
  assert out.tokens == ref.tokens and out.tau > 1.0
