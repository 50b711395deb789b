"""EAGLE drafting: a trained head (:mod:`eagle_jax.drafters.eagle.head`) drafts token trees.

State between steps (:class:`EagleState`): the head's own one-layer KV cache holding one entry
per committed target position ``u`` (input ``(token_{u+1}, feature_u)``), and ``frontier``,
the head's output at the last entry: its prediction of the feature that follows the root.

- ``init`` runs the head over the prompt's (token, target feature) pairs.
- ``propose`` expands a tree from the frontier. Static trees (EAGLE-1's 25-node default, any
  choice list, chains) take the top-k ranks the tree names at each depth. Dynamic trees
  (EAGLE-2) expand the ``top_k`` best nodes per depth, scored by the product of draft
  probabilities along their path, and keep the ``total_tokens`` best nodes overall, best
  first (so slot ``i`` is the node a budget of ``i`` nodes would keep last). Tree
  nodes attend to the committed entries plus their ancestors; their K/V go to scratch slots
  past the committed ones.
- ``update`` appends the accepted tokens with the target's features at their positions.

Drafts are deterministic (top-k, ``q = None``): the engine's verify step handles them
losslessly at any temperature.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.decoding.protocol import Accepted, Draft
from eagle_jax.decoding.tree import TreeSpec
from eagle_jax.drafters.eagle.head import EagleHead, Frozen
from eagle_jax.errors import EagleJaxError


@flax.struct.dataclass
class EagleState:
  kv: tuple[jax.Array, jax.Array]  # [B, K, S, Dh] each
  lengths_B: jax.Array  # committed entries
  frontier_BxD: jax.Array


def _visibility(lengths_B, scratch_BxTxE, num_slots):
  """``[B, T, S]``: committed slots, plus scratch slots ``lengths + e`` where allowed."""
  rel_BxS = jnp.arange(num_slots)[None, :] - lengths_B[:, None]
  e = scratch_BxTxE.shape[-1]
  in_scratch_BxS = (rel_BxS >= 0) & (rel_BxS < e)
  idx = jnp.broadcast_to(jnp.clip(rel_BxS, 0, e - 1)[:, None, :],
                         scratch_BxTxE.shape[:2] + (num_slots,))
  scratch_ok = jnp.take_along_axis(scratch_BxTxE, idx, axis=2) & in_scratch_BxS[:, None, :]
  return (rel_BxS < 0)[:, None, :] | scratch_ok


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
  """EAGLE-1/3 head drafting a static tree (``tree``) or an EAGLE-2 dynamic tree (``tree=None``)."""

  graphdef: nnx.GraphDef
  tree: TreeSpec | None = None
  top_k: int = 10
  depth: int = 6
  total_tokens: int = 60
  feature_layers: tuple[int, ...] = ()  # target layers the engine hands over; () = top hidden
  draft_vocab: int = 0  # size of the EAGLE-1/2 draft vocabulary (0 = the target's whole)
  always_drafts = True  # static trees are all valid; a dynamic tree keeps its best depth-1 node

  def __post_init__(self):
    if self.tree is None:
      pool = self.top_k + (self.depth - 1) * self.top_k ** 2
      if self.top_k < 1 or self.depth < 1 or not 1 <= self.total_tokens <= pool:
        raise EagleJaxError(f"dynamic tree: need top_k >= 1, depth >= 1 and 1 <= total_tokens <= "
                            f"{pool} (top_k={self.top_k}, depth={self.depth}, "
                            f"total_tokens={self.total_tokens})")

  @classmethod
  def create(cls, head: EagleHead, target, tree: TreeSpec | None = None, draft_ids=None,
             **dynamic):
    """Returns ``(drafter, dparams)``; ``dparams`` = (head weights, target's frozen arrays).

    ``draft_ids``: an EAGLE-1 head drafts only these target ids, through their rows of the
    target's LM head (see :func:`eagle_jax.drafters.eagle.train.top_tokens`); None = every id.
    """
    for what in ("hidden_size", "vocab_size"):
      trained, given = getattr(head.config.target, what), getattr(target.config, what)
      if trained != given:
        raise EagleJaxError(f"EAGLE head was trained for a different target ({what} {trained} "
                            f"vs {given})")
    if draft_ids is not None and head.lm_head is not None:
      raise EagleJaxError("an EAGLE-3 head drafts over the vocabulary it was trained with; "
                          "a draft vocabulary applies to EAGLE-1/2 heads")
    if "depth" in dynamic and "total_tokens" in dynamic:  # n nodes are never deeper than n
      dynamic["depth"] = min(dynamic["depth"], dynamic["total_tokens"])
    graphdef, state = nnx.split(head)
    frozen = Frozen.of(target, draft_ids)
    size = 0 if frozen.d2t_K is None else int(frozen.d2t_K.shape[0])
    vocab = size or head.config.draft_vocab or target.config.vocab_size  # ids a depth ranks
    widest = (int(tree.ranks.max()) + 1 if tree is not None and tree.num_nodes
              else dynamic.get("top_k", cls.top_k))
    if widest > vocab:
      raise EagleJaxError(f"the draft ranks {widest} tokens per node (top_k or the tree's "
                          f"ranks) but its vocabulary holds {vocab}")
    return (cls(graphdef=graphdef, tree=tree, feature_layers=head.config.feature_layers,
                draft_vocab=size, **dynamic), (state, frozen))

  @property
  def num_nodes(self) -> int:
    return self.tree.num_nodes if self.tree is not None else self.total_tokens

  @property
  def max_depth(self) -> int:
    return self.tree.max_depth if self.tree is not None else self.depth

  @property
  def scratch(self) -> int:
    if self.tree is not None:
      return self.tree.num_nodes
    return max((self.depth - 1) * self.top_k, 1)

  # -- protocol ---------------------------------------------------------------------------

  def init(self, dparams, prompt_BxP, lengths_B, features_BxPxF, first_B, cache_len):
    head, frozen = nnx.merge(self.graphdef, dparams[0]), dparams[1]
    b, p = prompt_BxP.shape
    rows = jnp.arange(b)
    tokens = jnp.concatenate([prompt_BxP[:, 1:], jnp.zeros((b, 1), prompt_BxP.dtype)], 1)
    tokens = tokens.at[rows, lengths_B - 1].set(first_B)
    num_slots = cache_len + self.scratch + self.max_depth + 1
    kv = head.init_kv(b, num_slots, features_BxPxF.dtype)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    mask = jnp.arange(num_slots)[None, None, :] <= jnp.arange(p)[None, :, None]
    out, kv = head(tokens, head.fuse_features(features_BxPxF), pos,
                   jnp.broadcast_to(mask, (b, p, num_slots)), frozen, kv, pos, fresh_cache=True)
    frontier = out[rows, lengths_B - 1]
    return EagleState(kv=kv, lengths_B=lengths_B.astype(jnp.int32), frontier_BxD=frontier)

  def update(self, dparams, state: EagleState, accepted: Accepted):
    head, frozen = nnx.merge(self.graphdef, dparams[0]), dparams[1]
    b, k = accepted.tokens_BxK.shape
    num_slots = state.kv[0].shape[2]  # [B, K, S, Dh]
    pos = state.lengths_B[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    mask = jnp.arange(num_slots)[None, None, :] <= pos[:, :, None]
    out, kv = head(accepted.tokens_BxK, head.fuse_features(accepted.features_BxKxD), pos,
                   mask, frozen, state.kv, pos)
    count = accepted.count_B
    last = out[jnp.arange(b), jnp.maximum(count - 1, 0)]
    return EagleState(kv=kv, lengths_B=state.lengths_B + count,
                      frontier_BxD=jnp.where((count > 0)[:, None], last, state.frontier_BxD))

  def propose(self, dparams, state: EagleState, root_B, key, params):
    head, frozen = nnx.merge(self.graphdef, dparams[0]), dparams[1]
    if self.tree is not None:
      return self._propose_static(head, frozen, state), state
    return self._propose_dynamic(head, frozen, state), state

  # -- drafting ---------------------------------------------------------------------------

  def _step(self, head, frozen, state, kv, tokens_BxT, feats_BxTxD, depth, scratch_slots_BxT,
            scratch_vis_BxTxE):
    """Runs tree nodes at ``depth`` through the head; returns outputs, logits, new kv."""
    num_slots = kv[0].shape[2]  # [B, K, S, Dh]
    pos = state.lengths_B[:, None] - 1 + depth + jnp.zeros_like(tokens_BxT)
    vis = _visibility(state.lengths_B, scratch_vis_BxTxE, num_slots)
    out, kv = head(tokens_BxT, feats_BxTxD, pos, vis, frozen, kv,
                   state.lengths_B[:, None] + scratch_slots_BxT)
    return out, head.logits(out, frozen), kv

  def _propose_static(self, head, frozen, state):
    tree = self.tree
    b = state.lengths_B.shape[0]
    parents, ranks, depths, anc = tree.parents, tree.ranks, tree.depths, tree.ancestor_mask
    has_child = np.zeros(tree.num_nodes + 1, bool)
    has_child[parents[1:]] = True
    tokens_BxM = jnp.zeros((b, tree.num_nodes + 1), jnp.int32)
    logits = {0: head.logits(state.frontier_BxD[:, None], frozen)}  # slot -> [B, 1, V] rows
    outs = {0: state.frontier_BxD[:, None]}
    kv = state.kv
    for d in range(1, tree.max_depth + 1):
      slots = np.nonzero(depths == d)[0]
      prev = np.nonzero(depths == d - 1)[0]
      prev_expanded = [s for s in prev if has_child[s]]
      par_logits = jnp.concatenate([logits[s] for s in prev_expanded], 1)  # [B, n_prev, V]
      kmax = int(ranks[slots].max()) + 1
      top_BxnxK = jax.lax.top_k(par_logits, kmax)[1]
      par_local = np.array([prev_expanded.index(parents[s]) for s in slots])
      tok = head.to_target(top_BxnxK[:, par_local, ranks[slots]], frozen)
      tokens_BxM = tokens_BxM.at[:, slots].set(tok)
      expand = np.array([s for s in slots if has_child[s]])
      if expand.size == 0:
        break
      sel = np.array([list(slots).index(s) for s in expand])
      feats = jnp.concatenate([outs[parents[s]] for s in expand], 1)
      vis = jnp.broadcast_to(jnp.asarray(anc[expand][:, 1:]), (b, expand.size, tree.num_nodes))
      out, lg, kv = self._step(head, frozen, state, kv, tok[:, sel], feats, d,
                               jnp.broadcast_to(jnp.asarray(expand - 1), (b, expand.size)), vis)
      for i, s in enumerate(expand):
        outs[s], logits[s] = out[:, i:i + 1], lg[:, i:i + 1]
    return Draft(tokens_BxN=tokens_BxM[:, 1:],
                 parents_BxN=jnp.broadcast_to(jnp.asarray(parents[1:]), (b, tree.num_nodes)),
                 valid_BxN=jnp.ones((b, tree.num_nodes), bool), q_BxNxV=None)

  def _propose_dynamic(self, head, frozen, state):
    k, depth, n = self.top_k, self.depth, self.total_tokens
    b = state.lengths_B.shape[0]
    e = self.scratch
    rows = jnp.arange(b)[:, None]
    logp = jax.nn.log_softmax(head.logits(state.frontier_BxD, frozen), -1)
    score_Bxk, idx_Bxk = jax.lax.top_k(logp, k)
    pool_tok, pool_score = [head.to_target(idx_Bxk, frozen)], [score_Bxk]
    pool_par = [jnp.full((b, k), -1, jnp.int32)]
    # the nodes expanded at this depth: tokens, pool index, parent feature, scratch ancestry
    tok, pool_idx = pool_tok[0], jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    feats = jnp.broadcast_to(state.frontier_BxD[:, None], (b, k, state.frontier_BxD.shape[-1]))
    anc = jnp.zeros((b, k, e), bool)
    kv, size = state.kv, k
    for d in range(1, depth):
      slots = jnp.broadcast_to(jnp.arange((d - 1) * k, d * k, dtype=jnp.int32), (b, k))
      anc = anc.at[rows, jnp.arange(k)[None], slots].set(True)
      out, lg, kv = self._step(head, frozen, state, kv, tok, feats, d, slots, anc)
      child_score, child_idx = jax.lax.top_k(jax.nn.log_softmax(lg, -1), k)  # [B, k, k]
      cum = (score_Bxk[:, :, None] + child_score).reshape(b, k * k)
      pool_tok.append(head.to_target(child_idx, frozen).reshape(b, k * k))
      pool_score.append(cum)
      pool_par.append(jnp.repeat(pool_idx, k, axis=1))
      best_score, best = jax.lax.top_k(cum, k)  # expand the best k children next
      parent_local = best // k
      tok = jnp.take_along_axis(pool_tok[-1], best, 1)
      feats = jnp.take_along_axis(out, parent_local[:, :, None], 1)
      anc = jnp.take_along_axis(anc, parent_local[:, :, None], 1)
      pool_idx, score_Bxk = size + best, best_score
      size += k * k
    tokens_P, score_P, par_P = (jnp.concatenate(x, 1) for x in (pool_tok, pool_score, pool_par))
    depth_P = jnp.asarray(np.repeat(np.arange(1, depth + 1), [k] + [k * k] * (depth - 1)))
    # best first: a child never scores above its parent, and on ties the shallower node wins,
    # so this order is topological and the first n' slots are the tree a budget of n' keeps
    sel = jax.lax.top_k(score_P - 1e-5 * depth_P, n)[1]
    inv = jnp.zeros_like(par_P).at[rows, sel].set(jnp.arange(1, n + 1, dtype=jnp.int32)[None])
    par = jnp.take_along_axis(par_P, sel, 1)
    parent_slot = jnp.where(par < 0, 0, jnp.take_along_axis(inv, jnp.maximum(par, 0), 1))
    valid = (par < 0) | (parent_slot > 0)
    return Draft(tokens_BxN=jnp.take_along_axis(tokens_P, sel, 1), parents_BxN=parent_slot,
                 valid_BxN=valid, q_BxNxV=None)
