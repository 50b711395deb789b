"""Medusa heads with tiny models: lossless greedy and sampling, drafting, training, tree budget."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import tiny_training
from chi2 import assert_sampling_matches_vanilla, sampling_target
from eagle_jax.drafters.medusa.drafter import MedusaDrafter
from eagle_jax.errors import EagleJaxError
from eagle_jax.training.features import FeatureShards
from eagle_jax.decoding.generate import generate
from eagle_jax.drafters.medusa.heads import (MedusaConfig, MedusaHeads, MedusaTask, best_tree, expected_tau,
                              rank_accuracies, tune_tree)
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.speculative import speculative_generate
from eagle_jax.training.trainer import LoopConfig, OptimConfig, train
from eagle_jax.decoding.tree import MEDUSA_DEFAULT_CHOICES, TreeSpec

PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9, 10, 11, 12, 7, 8, 9], [20, 21], [30, 31, 32, 33, 30]]


def make_heads(target, seed=1, num_heads=4):
  """Heads with random (non-zero) residual blocks, output layers from the target's LM head."""
  cfg = MedusaConfig(num_heads=num_heads, hidden_size=target.config.hidden_size,
                     vocab_size=target.config.vocab_size)
  heads = MedusaHeads(cfg, rngs=nnx.Rngs(seed), lm_head_VxD=target.embed[...])
  w = heads.res_w_KxLxDxD
  w.value = 0.3 * jax.random.normal(jax.random.key(seed), w.shape) / np.sqrt(w.shape[-1])
  return heads


def test_heads_for_another_vocabulary_are_refused(tiny):
  """Heads with a larger vocabulary would draft ids the target lacks (and at T > 0 accept them)."""
  target = tiny()
  wide = tiny(vocab_size=target.config.vocab_size * 2)
  with pytest.raises(EagleJaxError, match="vocab_size"):
    MedusaDrafter.create(make_heads(wide), TreeSpec.chain(3), target)


TREES = {"default63": TreeSpec.from_choices(MEDUSA_DEFAULT_CHOICES), "chain3": TreeSpec.chain(3)}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("stop", [(), (5,)])
def test_greedy_equals_vanilla_tiny(tiny, tree, stop):
  target = tiny()
  drafter, dparams = MedusaDrafter.create(make_heads(target), TREES[tree], target)
  ref = generate(target, PROMPTS, max_new_tokens=30, stop_ids=stop)
  ragged = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=30, stop_ids=stop)
  assert ragged.tokens == ref.tokens and ragged.num_new == ref.num_new
  alone = speculative_generate(target, drafter, dparams, PROMPTS[1:2], max_new_tokens=30, stop_ids=stop)
  assert alone.tokens[0] == ref.tokens[1]


def test_propose_takes_each_heads_ranks(tiny):
  target = tiny()
  heads = make_heads(target, seed=2)
  tree = TreeSpec.from_choices(MEDUSA_DEFAULT_CHOICES)
  drafter, dparams = MedusaDrafter.create(heads, tree, target)
  feats = jax.random.normal(jax.random.key(0), (2, 5, target.config.hidden_size))
  state = drafter.init(dparams, jnp.zeros((2, 5), jnp.int32), jnp.array([5, 3]), feats,
                       jnp.array([1, 1]), 32)
  np.testing.assert_array_equal(state.feature_BxD, feats[jnp.arange(2), jnp.array([4, 2])])
  draft, _ = drafter.propose(dparams, state, jnp.array([1, 1]), jax.random.key(0), SamplingParams())
  order = np.argsort(-np.asarray(heads(state.feature_BxD)), -1)  # [B, K, V]
  for b in range(2):
    for slot, path in enumerate(tree.choices):
      assert int(draft.tokens_BxN[b, slot]) == order[b, len(path) - 1, path[-1]]
  assert draft.q_BxNxV is None


def test_8bit_heads_and_shallow_trees(tiny):
  """quantize8 rounds each head's output layer to 8-bit blocks (float32 weights = their
  expansion, so logits match the plain product); a call for the first k heads equals the
  first k of all; a shallow tree's draft reads only those heads; drafting with 8-bit heads
  stays lossless."""
  target = tiny()
  heads = make_heads(target, seed=3)
  x = jax.random.normal(jax.random.key(1), (3, target.config.hidden_size))
  before = np.asarray(heads(x))
  heads.quantize8()
  assert heads.out_blocks is not None and len(heads.out_blocks.get_value()) == 4
  after = np.asarray(heads(x))
  w = np.asarray(heads.out_KxVxD[...])
  np.testing.assert_allclose(after, np.einsum("bkd,kvd->bkv", np.asarray(heads.features(x)), w),
                             rtol=1e-5, atol=1e-5)
  assert np.abs(after - before).max() < 0.05 * np.abs(before).max()  # rounding, not garbage
  np.testing.assert_allclose(np.asarray(heads(x, 2)), after[:, :2], rtol=1e-6, atol=1e-6)
  heads.quantize8()  # a second call changes nothing
  np.testing.assert_array_equal(np.asarray(heads(x)), after)
  drafter, dparams = MedusaDrafter.create(heads, TreeSpec.chain(2), target)
  hlo = jax.jit(lambda d, f: drafter.propose(d, f, jnp.array([1]), jax.random.key(0), SamplingParams())
                ).lower(dparams, drafter.init(dparams, jnp.zeros((1, 2), jnp.int32), jnp.array([2]),
                                              jnp.zeros((1, 2, target.config.hidden_size)),
                                              jnp.array([1]), 16)).as_text()
  assert hlo.count("eagle_jax_block_matmul") == 2  # heads 0 and 1 only
  ref = generate(target, PROMPTS, max_new_tokens=24)
  for tree in TREES.values():
    drafter, dparams = MedusaDrafter.create(heads, tree, target)
    assert speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=24).tokens == ref.tokens


def test_tree_deeper_than_heads_is_refused(tiny):
  target = tiny()
  with pytest.raises(EagleJaxError, match="only 2 heads"):
    MedusaDrafter.create(make_heads(target, num_heads=2), TreeSpec.chain(3), target)


def test_sampling_is_lossless():
  """Sampled continuations (tokens 2-3): Medusa speculative vs vanilla, two-sample chi-square."""
  target = sampling_target()
  tree = TreeSpec.from_choices(best_tree(np.full((3, 4), 0.2), 12)[0])
  drafter, dparams = MedusaDrafter.create(make_heads(target, seed=4, num_heads=3), tree, target)
  assert_sampling_matches_vanilla(drafter, dparams)


def test_best_tree_is_ancestor_closed_and_optimal():
  acc = np.array([[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]])
  choices, probs = best_tree(acc, 10)
  TreeSpec.from_choices(choices)  # parents precede children
  assert probs == sorted(probs, reverse=True)
  assert choices[0] == (0,) and probs[0] == 0.5
  assert expected_tau(acc, choices) == pytest.approx(1 + sum(probs))
  # no other 10-node tree built from these ranks does better, e.g. the first 10 default nodes
  assert expected_tau(acc, choices) >= expected_tau(acc, MEDUSA_DEFAULT_CHOICES[:10])
  assert expected_tau(acc, TreeSpec.chain(3).choices) == pytest.approx(1 + 0.5 + 0.15 + 0.03)


def test_tune_tree_trades_acceptance_for_verify_cost():
  acc = np.array([[0.6, 0.2, 0.1], [0.4, 0.1, 0.05]])
  flat = tune_tree(1.0, acc, {1: 10.0, 2: 10.0, 64: 10.0}, max_nodes=8)  # free verification
  assert flat["total_tokens"] == 8
  steep = tune_tree(1.0, acc, {1: 10.0, 2: 20.0, 64: 640.0}, max_nodes=8)
  assert steep["total_tokens"] < 8
  assert steep["tree"][0] == [0]


def test_training_learns_and_reports_rank_accuracies(tmp_path):
  tiny_training.make_features(str(tmp_path / "f"))
  data = FeatureShards(str(tmp_path / "f"))
  target = tiny_training.target()
  cfg = MedusaConfig(num_heads=3, hidden_size=target.config.hidden_size,
                     vocab_size=target.config.vocab_size)
  task = MedusaTask(config=cfg, lm_head_VxD=np.asarray(target.embed[...]), positions_per_row=8,
                    eval_positions=16, eval_ranks=4)
  loop = LoopConfig(epochs=6, batch_rows=2, seed=0, log_every=5, eval_every=0, eval_rows=8,
                    ckpt_every=100)
  before = train(task, data, data, str(tmp_path / "r0"), LoopConfig(epochs=0.01, batch_rows=2),
                 OptimConfig(lr=1e-9, warmup_steps=0), progress=False).last_eval
  after = train(task, data, data, str(tmp_path / "r1"), loop, OptimConfig(lr=3e-3, warmup_steps=2),
                progress=False).last_eval
  assert after["heldout_loss"] < before["heldout_loss"]
  assert after["heldout_acc_0"] > before["heldout_acc_0"]
  acc = rank_accuracies(after, 3, 4)
  assert acc[0][0] == after["heldout_acc_0"] and sum(acc[1]) <= 1.0 + 1e-6
  with pytest.raises(EagleJaxError, match="heldout_rank"):
    rank_accuracies(after, 4, 4)


def test_tune_tree_prices_each_tree_at_its_depth():
  """With draft costs by depth, a deeper tree pays for the heads it adds."""
  acc = np.array([[0.6, 0.3, 0.1], [0.5, 0.1, 0.05]])
  curve = {1: 10.0, 2: 10.0, 64: 10.0}  # free verification
  assert tune_tree({1: 1.0, 2: 1.0}, acc, curve, max_nodes=8)["total_tokens"] == 8
  cheap_shallow = tune_tree({1: 1.0, 2: 50.0}, acc, curve, max_nodes=8)
  assert cheap_shallow["tree"] == [[0], [1], [2]] and cheap_shallow["total_tokens"] == 3
  assert cheap_shallow["predicted_tau"] == pytest.approx(2.0)
  assert {r["depth"] for r in cheap_shallow["rows"]} == {1, 2}
