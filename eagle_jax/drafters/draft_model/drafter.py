"""Classic speculative decoding with a smaller draft model (or the target's own first layers).

The draft model has its own KV cache. Invariant between steps: its cache holds every emitted
token except ``pending`` (at most gamma + 1 tokens, ending with the root). ``propose`` runs the
pending tokens through the draft in one forward, then drafts a chain of gamma tokens one at a
time (argmax when greedy; sampled from q, with q returned, when sampling). ``update`` keeps the
draft's cache entries of accepted tokens and marks the rest pending.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.decoding.generate import prefill
from eagle_jax.decoding.protocol import Accepted, ChainDrafter, Draft
from eagle_jax.decoding.sampling import probabilities, sample
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.checkpoints import abstract_model
from eagle_jax.model.transformer import KVCache, Transformer


@flax.struct.dataclass
class DraftModelState:
  cache: KVCache
  pending_BxK: jax.Array
  num_pending_B: jax.Array


def self_draft_model(target: Transformer, num_layers: int) -> Transformer:
  """The target's first ``num_layers`` layers with its final norm and LM head (shared weights)."""
  if not 1 <= num_layers <= target.config.num_layers:
    raise EagleJaxError(
        f"self-draft layers must be in [1, {target.config.num_layers}], got {num_layers}")
  config = dataclasses.replace(target.config, num_layers=num_layers)
  draft = abstract_model(config, target.embed.dtype)
  draft.embed = target.embed
  for i in range(num_layers):
    draft.layers[i] = target.layers[i]
  draft.final_norm = target.final_norm
  draft.lm_head = target.lm_head
  draft.embed_blocks = target.embed_blocks  # a tied LM head's integer blocks (CPU kernel)
  return draft


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(ChainDrafter):
  """Drafts a chain of ``gamma`` tokens with ``graphdef`` (weights passed as ``dparams``)."""

  graphdef: nnx.GraphDef
  gamma: int = 4
  always_drafts = True  # a full chain every step (not a dataclass field)

  @classmethod
  def create(cls, draft: Transformer, gamma: int = 4, target_vocab: int | None = None):
    if target_vocab is not None and draft.config.vocab_size != target_vocab:
      raise EagleJaxError(f"draft model vocabulary ({draft.config.vocab_size}) differs from the "
                          f"target's ({target_vocab}); the draft must share the target's tokenizer")
    if gamma < 1:
      raise EagleJaxError(f"gamma must be >= 1, got {gamma}")
    graphdef, state = nnx.split(draft)
    return cls(graphdef=graphdef, gamma=gamma), state

  def init(self, dparams, prompt_BxP, lengths_B, features_BxPxD, first_B, cache_len):
    model = nnx.merge(self.graphdef, dparams)
    b = prompt_BxP.shape[0]
    cache = KVCache.init(model.config, b, cache_len, model.embed.dtype)
    cache = prefill(model, prompt_BxP, lengths_B, cache)[0].cache  # its logits are dead code
    pending = jnp.zeros((b, self.gamma + 1), jnp.int32).at[:, 0].set(first_B)
    return DraftModelState(cache=cache, pending_BxK=pending, num_pending_B=jnp.ones((b,), jnp.int32))

  def propose(self, dparams, state: DraftModelState, root_B, key, params):
    model = nnx.merge(self.graphdef, dparams)
    b, k = state.pending_BxK.shape
    pos = state.cache.lengths_B[:, None] + jnp.arange(k)[None, :]
    out = model(state.pending_BxK, pos, state.cache, num_valid_B=state.num_pending_B, with_logits=False)
    last = jnp.take_along_axis(out.hidden_BxTxD, jnp.maximum(state.num_pending_B - 1, 0)[:, None, None], 1)
    logits_BxV = model.lm_logits(last[:, 0])
    cache, tokens, qs = out.cache, [], []
    keys = jax.random.split(key, self.gamma)
    for i in range(self.gamma):
      if i:
        step = model(tokens[-1][:, None], cache.lengths_B[:, None], cache)
        cache, logits_BxV = step.cache, step.logits_BxTxV[:, 0]
      tokens.append(sample(keys[i], logits_BxV, params))
      if not params.greedy:
        qs.append(probabilities(logits_BxV, params))
    draft = Draft(tokens_BxN=jnp.stack(tokens, 1),
                  parents_BxN=self.chain_parents(b),
                  valid_BxN=jnp.ones((b, self.gamma), bool),
                  q_BxNxV=None if params.greedy else jnp.stack(qs, 1))
    # entries for drafts 1..gamma-1 are in the cache beyond the committed length
    base_B = state.cache.lengths_B + state.num_pending_B
    return draft, DraftModelState(cache=cache.replace(lengths_B=base_B), pending_BxK=state.pending_BxK,
                                  num_pending_B=state.num_pending_B)

  def update(self, dparams, state: DraftModelState, accepted: Accepted):
    b, k = accepted.tokens_BxK.shape
    # accepted drafts that the draft model already processed stay in its cache
    in_cache_B = jnp.clip(accepted.count_B - 1, 0, self.gamma - 1)
    num_pending_B = jnp.maximum(accepted.count_B - in_cache_B, 0)
    idx = jnp.clip(in_cache_B[:, None] + jnp.arange(self.gamma + 1)[None, :], 0, k - 1)
    pending = jnp.take_along_axis(accepted.tokens_BxK, idx, axis=1)
    cache = state.cache.replace(lengths_B=state.cache.lengths_B + in_cache_B)
    return DraftModelState(cache=cache, pending_BxK=pending, num_pending_B=num_pending_B)
