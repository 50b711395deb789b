"""Logit processing and token sampling (greedy, temperature, top-k, top-p).

The same :func:`process_logits` is applied to target and draft distributions by the
speculative verify step, so that sampling stays lossless under top-k/top-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle_jax.errors import EagleJaxError
from eagle_jax.model.ops import greedy_token


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static (hashable) decoding settings; ``temperature == 0`` means greedy."""

  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0  # 0 = off

  def __post_init__(self):
    if self.temperature < 0:
      raise EagleJaxError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise EagleJaxError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise EagleJaxError(f"top_k must be >= 0, got {self.top_k}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def process_logits(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
  """Temperature, then top-k, then top-p (Hugging Face order); filtered entries -> -inf."""
  logits = logits_BxV.astype(jnp.float32) / params.temperature
  neg_inf = jnp.array(-jnp.inf, jnp.float32)
  if params.top_k and params.top_k < logits.shape[-1]:
    kth_B = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth_B, neg_inf, logits)
  if params.top_p < 1.0:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly better tokens
    keep = mass_before < params.top_p
    cutoff_B = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff_B, neg_inf, logits)
  return logits


def probabilities(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
  """The sampling distribution; one-hot argmax when greedy."""
  if params.greedy:
    return jax.nn.one_hot(greedy_token(logits_BxV), logits_BxV.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(process_logits(logits_BxV, params), axis=-1)


def sample(key: jax.Array, logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
  """One token per row, ``int32 [B]``."""
  if params.greedy:
    return greedy_token(logits_BxV)
  return jax.random.categorical(key, process_logits(logits_BxV, params), axis=-1).astype(jnp.int32)
