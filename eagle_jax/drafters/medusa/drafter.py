"""Medusa drafting: trained heads (:mod:`eagle_jax.drafters.medusa.heads`) fill a static cartesian top-k tree.

State: the target's top feature at the position before the root (the one whose LM head chose
the root). A node at depth ``d`` with rank ``r`` (tree choice ``(..., r)``) is head ``d-1``'s
``r``-th most likely token; siblings are distinct by construction, and the same head ranks are
reused under every parent (the tree is a cartesian product pruned to a node budget). Drafts
are deterministic (``q = None``): the engine's verify step is lossless for them at any
temperature. No lossy "typical acceptance" exists here.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.decoding.protocol import Accepted, Draft
from eagle_jax.decoding.tree import TreeSpec
from eagle_jax.drafters.medusa.heads import MedusaHeads
from eagle_jax.errors import EagleJaxError


@flax.struct.dataclass
class MedusaState:
  feature_BxD: jax.Array


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
  graphdef: nnx.GraphDef
  tree: TreeSpec
  feature_layers: tuple[int, ...] = ()  # the top hidden state
  always_drafts = True  # the whole static tree every step (not a dataclass field)

  @classmethod
  def create(cls, heads: MedusaHeads, tree: TreeSpec, target=None):
    if tree.max_depth > heads.config.num_heads:
      raise EagleJaxError(f"Medusa tree is {tree.max_depth} deep but there are only "
                          f"{heads.config.num_heads} heads")
    for what in ("hidden_size", "vocab_size"):
      trained = getattr(heads.config, what)
      if target is not None and getattr(target.config, what) != trained:
        raise EagleJaxError(f"Medusa heads were trained for a different target ({what} "
                            f"{trained} vs {getattr(target.config, what)})")
    graphdef, state = nnx.split(heads)
    return cls(graphdef=graphdef, tree=tree), state

  @property
  def num_nodes(self) -> int:
    return self.tree.num_nodes

  @property
  def max_depth(self) -> int:
    return self.tree.max_depth

  def init(self, dparams, prompt_BxP, lengths_B, features_BxPxD, first_B, cache_len):
    last = jnp.take_along_axis(features_BxPxD, (lengths_B - 1)[:, None, None], 1)[:, 0]
    return MedusaState(feature_BxD=last)

  def propose(self, dparams, state: MedusaState, root_B, key, params):
    heads = nnx.merge(self.graphdef, dparams)
    tree = self.tree
    b = state.feature_BxD.shape[0]
    logits_BxKxV = heads(state.feature_BxD, tree.max_depth)  # only the heads the tree reaches
    top_BxKxR = jax.lax.top_k(logits_BxKxV, int(tree.ranks.max()) + 1)[1]
    tokens_BxN = top_BxKxR[:, tree.depths[1:] - 1, tree.ranks[1:]]
    return Draft(tokens_BxN=tokens_BxN.astype(jnp.int32),
                 parents_BxN=jnp.broadcast_to(jnp.asarray(tree.parents[1:]), (b, tree.num_nodes)),
                 valid_BxN=jnp.ones((b, tree.num_nodes), bool), q_BxNxV=None), state

  def update(self, dparams, state: MedusaState, accepted: Accepted):
    idx = jnp.maximum(accepted.count_B - 1, 0)[:, None, None]
    last = jnp.take_along_axis(accepted.features_BxKxD, idx, 1)[:, 0]
    return MedusaState(feature_BxD=jnp.where((accepted.count_B > 0)[:, None], last, state.feature_BxD))
