import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.model.checkpoints import abstract_model
from eagle_jax.model.config import ModelConfig, RopeScaling
from eagle_jax.model.transformer import KVCache, causal_mask


def _tokens(b, t, vocab=128, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def _positions(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


def test_real_size_shapes_with_eval_shape():
  cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                    tie_word_embeddings=True)
  model = abstract_model(cfg)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == cfg.num_params == 134_515_008
  cache = jax.eval_shape(lambda: KVCache.init(cfg, 2, 256))
  assert cache.k[0].shape == (2, 3, 256, 64) and len(cache.k) == 30


@pytest.mark.parametrize("overrides", [
    dict(), dict(num_kv_heads=1), dict(num_kv_heads=4), dict(attention_bias=True),
    dict(tie_word_embeddings=True),
    dict(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
])
def test_cache_matches_no_cache(tiny, overrides):
  model = tiny(**overrides)
  b, t = 2, 12
  toks = _tokens(b, t)
  full = model(toks, _positions(b, t)).logits_BxTxV
  cache = KVCache.init(model.config, b, 32)
  out = model(toks[:, :5], _positions(b, 5), cache)
  pieces = [out.logits_BxTxV]
  cache = out.cache
  for i in range(5, t):  # then one token at a time
    out = model(toks[:, i:i + 1], cache.lengths_B[:, None], cache)
    pieces.append(out.logits_BxTxV)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(pieces, 1), full, atol=1e-5, rtol=1e-5)
  assert cache.lengths_B.tolist() == [t, t]


def test_fresh_cache_prompt_pass_equals_reading_the_empty_cache(tiny):
  """``fresh_cache`` skips attending to the empty cache; logits, written K/V and lengths are
  those of the pass that reads it (every slot masked), and decoding goes on identically."""
  model = tiny()
  b, t = 2, 7
  toks = _tokens(b, t)
  cache = KVCache.init(model.config, b, 16)
  valid = jnp.array([7, 4])
  read = model(toks, _positions(b, t), cache, num_valid_B=valid)
  fresh = model(toks, _positions(b, t), cache, num_valid_B=valid, fresh_cache=True)
  np.testing.assert_allclose(fresh.logits_BxTxV, read.logits_BxTxV, atol=1e-6)
  for a, c in zip(jax.tree.leaves(fresh.cache), jax.tree.leaves(read.cache)):
    np.testing.assert_allclose(a, c, atol=1e-6)
  nxt = jnp.array([[3], [9]])
  step = lambda c: model(nxt, c.lengths_B[:, None], c).logits_BxTxV
  np.testing.assert_allclose(step(fresh.cache), step(read.cache), atol=1e-6)


def test_tree_mask_equals_separate_branches(tiny):
  """A tree fed in one pass (ancestor mask, depth positions) == each branch run alone."""
  model = tiny()
  prefix = _tokens(1, 6)
  cache = model(prefix, _positions(1, 6), KVCache.init(model.config, 1, 32)).cache
  # tree: node0 (root child), node1 (child of 0), node2 (sibling of 0), node3 (child of 2)
  tree_tokens = jnp.array([[7, 9, 11, 13]])
  parent = [-1, 0, -1, 2]
  depth = jnp.array([[0, 1, 0, 1]])
  mask = np.eye(4, dtype=bool)
  for i, p in enumerate(parent):
    while p >= 0:
      mask[i, p] = True
      p = parent[p]
  tree = model(tree_tokens, 6 + depth, cache, mask_BxTxT=jnp.asarray(mask)[None], num_valid_B=jnp.array([0]))
  assert tree.cache.lengths_B.tolist() == [6]
  for branch, nodes in [([7, 9], [0, 1]), ([11, 13], [2, 3])]:
    ref = model(jnp.concatenate([prefix, jnp.array([branch])], 1), _positions(1, 8)).logits_BxTxV
    np.testing.assert_allclose(tree.logits_BxTxV[0, nodes], ref[0, 6:], atol=1e-5, rtol=1e-5)


def test_ragged_rows_match_single_rows(tiny):
  model = tiny()
  lens = [3, 9, 6]
  toks = _tokens(3, 9, seed=1)
  cache = KVCache.init(model.config, 3, 24)
  out = model(toks, _positions(3, 9), cache, num_valid_B=jnp.array(lens))
  assert out.cache.lengths_B.tolist() == lens
  step = model(jnp.array([[5], [6], [7]]), out.cache.lengths_B[:, None], out.cache)
  for r, n in enumerate(lens):
    alone = model(jnp.concatenate([toks[r:r + 1, :n], jnp.array([[5 + r]])], 1), _positions(1, n + 1))
    np.testing.assert_allclose(out.logits_BxTxV[r, :n], alone.logits_BxTxV[0, :n], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(step.logits_BxTxV[r, 0], alone.logits_BxTxV[0, n], atol=1e-5, rtol=1e-5)


def test_layer_hiddens_and_top_hidden(tiny):
  model = tiny(num_layers=3)
  toks = _tokens(1, 4)
  out = model(toks, _positions(1, 4), return_layers=(0, 1, 3))
  assert len(out.layer_hiddens) == 3
  np.testing.assert_allclose(out.layer_hiddens[0], model.embed[...][toks], atol=0)
  np.testing.assert_allclose(model.final_norm(out.layer_hiddens[2]), out.hidden_BxTxD, atol=1e-6)
  np.testing.assert_allclose(model.lm_logits(out.hidden_BxTxD), out.logits_BxTxV, atol=1e-6)


def test_causal_mask_shape():
  m = causal_mask(3)
  assert m.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_long_causal_pass_in_blocks_equals_full_attention(tiny):
  """Over more new tokens than ops.CAUSAL_BLOCK, a causal pass (implied, or a segment mask
  declared causal) computes attention a query block at a time: same logits as the full
  computation, and greedy_tokens (chunked LM head) equals the argmax of those logits."""
  from eagle_jax.training.features import segment_mask
  from eagle_jax.model.ops import CAUSAL_BLOCK

  model = tiny()
  b, t = 2, CAUSAL_BLOCK + 37
  toks, pos = _tokens(b, t), _positions(b, t)
  seg = jnp.asarray(np.where(np.arange(t) < 50, 1, 2)[None].repeat(b, 0))
  for mask in (jnp.broadcast_to(causal_mask(t), (b, t, t)), segment_mask(seg)):
    full = model(toks, pos, mask_BxTxT=mask)  # not declared causal: the full T x T scores
    blocked = model(toks, pos, mask_BxTxT=mask, causal=True)
    np.testing.assert_allclose(np.asarray(blocked.logits_BxTxV), np.asarray(full.logits_BxTxV),
                               rtol=1e-5, atol=1e-5)
  implied = model(toks, pos)
  np.testing.assert_allclose(np.asarray(implied.logits_BxTxV),
                             np.asarray(model(toks, pos, mask_BxTxT=jnp.broadcast_to(causal_mask(t), (b, t, t))).logits_BxTxV),
                             rtol=1e-5, atol=1e-5)
  greedy = model.greedy_tokens(implied.hidden_BxTxD, chunk=48)  # b * t is not a multiple of 48
  assert greedy.shape == (b, t) and greedy.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(greedy), np.asarray(jnp.argmax(implied.logits_BxTxV, -1)))


def test_writing_past_the_cache_end_is_refused(tiny):
  """K/V past the last slot would be dropped and the history silently cut."""
  from eagle_jax.errors import EagleJaxError

  model = tiny()
  cache = KVCache.init(model.config, 1, 8)
  tokens = jnp.ones((1, 10), jnp.int32)
  with pytest.raises(EagleJaxError, match="10 new tokens after 0 cached ones overflow a 8-slot"):
    model(tokens, jnp.arange(10)[None], cache)
  out = model(tokens[:, :6], jnp.arange(6)[None], cache)
  with pytest.raises(EagleJaxError, match="3 new tokens after 6 cached ones"):
    model(tokens[:, :3], 6 + jnp.arange(3)[None], out.cache)
