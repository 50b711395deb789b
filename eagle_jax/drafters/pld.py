"""Prompt lookup decoding: draft the continuation of the latest earlier n-gram match.

Training-free and deterministic. With static shapes: the history buffer has a fixed length,
every start position is compared at once, and a row without a match drafts nothing (all
nodes invalid), which lets the loop fall back to a plain decode step.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from eagle_jax.drafters.base import Accepted, ChainDrafter, Draft
from eagle_jax.errors import EagleJaxError


@flax.struct.dataclass
class PLDState:
  history_BxH: jax.Array  # prompt and every emitted token; ends with the current root
  length_B: jax.Array


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(ChainDrafter):
  gamma: int = 8  # chain length
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if self.gamma < 1 or not 1 <= self.min_ngram <= self.max_ngram:
      raise EagleJaxError(f"prompt lookup needs gamma >= 1 and 1 <= min_ngram <= max_ngram; got "
                          f"gamma={self.gamma}, min_ngram={self.min_ngram}, max_ngram={self.max_ngram}")

  def init(self, dparams, prompt_BxP, lengths_B, features_BxPxD, first_B, cache_len):
    b, p = prompt_BxP.shape
    hist = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(prompt_BxP)
    hist = hist.at[jnp.arange(b), lengths_B].set(first_B)
    return PLDState(history_BxH=hist, length_B=lengths_B + 1)

  def _match(self, hist_H, length):
    """Start of the continuation after the latest match of the longest n-gram, and its size."""
    h = hist_H.shape[0]
    pos_H = jnp.arange(h)
    best_start, best_count = jnp.int32(0), jnp.int32(0)
    for n in range(self.min_ngram, self.max_ngram + 1):  # longer n-grams override shorter
      suffix = jax.lax.dynamic_slice(hist_H, (jnp.maximum(length - n, 0),), (n,))
      ok_H = jnp.ones((h,), bool)
      for i in range(n):
        ok_H &= jnp.roll(hist_H, -i) == suffix[i]
      cont_H = pos_H + n  # first continuation token
      ok_H &= (cont_H < length) & (length >= n)
      start = jnp.max(jnp.where(ok_H, cont_H, -1))
      found = start >= 0
      count = jnp.where(found, jnp.minimum(self.gamma, length - start), 0)
      best_start = jnp.where(found, start, best_start)
      best_count = jnp.where(found, count, best_count)
    return best_start, best_count

  def propose(self, dparams, state: PLDState, root_B, key, params):
    b = root_B.shape[0]
    start_B, count_B = jax.vmap(self._match)(state.history_BxH, state.length_B)
    idx_BxN = jnp.clip(start_B[:, None] + jnp.arange(self.gamma)[None, :], 0,
                       state.history_BxH.shape[1] - 1)
    tokens = jnp.take_along_axis(state.history_BxH, idx_BxN, axis=1)
    draft = Draft(tokens_BxN=tokens,
                  parents_BxN=self.chain_parents(b),
                  valid_BxN=jnp.arange(self.gamma)[None, :] < count_B[:, None], q_BxNxV=None)
    return draft, state

  def update(self, dparams, state: PLDState, accepted: Accepted):
    b, k = accepted.tokens_BxK.shape
    dst = state.length_B[:, None] + jnp.arange(k)[None, :]
    dst = jnp.where(jnp.arange(k)[None, :] < accepted.count_B[:, None], dst, state.history_BxH.shape[1])
    hist = state.history_BxH.at[jnp.arange(b)[:, None], dst].set(accepted.tokens_BxK, mode="drop")
    return PLDState(history_BxH=hist, length_B=state.length_B + accepted.count_B)
