"""Prompt lookup decoding: draft the continuation of the latest earlier n-gram match.

Training-free and deterministic. With static shapes: the history buffer has a fixed length,
every start position is compared at once, and a row without a match drafts nothing (all
nodes invalid), which lets the loop fall back to a plain decode step.

**Cost-aware widths** (``widths`` with ``costs``). A match is not worth verifying when its
continuation is unlikely to be accepted: on a CPU a target pass over 4-9 tokens costs 1.7-2.4
one-token passes. Each row keeps acceptance statistics per bucket (the matched n-gram length,
and whether the last step's tokens followed the last proposed continuation, i.e. the row is
copying): of the continuations proposed in that bucket, how many matched at least j tokens of
what the target then emitted. These are checked against the emitted text whether or not they
were drafted (one pending "shadow" continuation per row, resolved over the following steps),
so a bucket that stopped drafting keeps learning. Each step a row drafts the width ``w`` (from
``widths``, or nothing) maximising expected tokens per cost, ``(1 + E[min(accepted, w)]) /
costs[w]``, against ``1 / 1`` for a plain step; ``costs`` are verify costs relative to a
one-token pass, measured on the machine (:func:`eagle_jax.decoding.costs.verify_cost_curve`). Output
stays exactly the target's: only what is drafted changes, never how it is verified.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from eagle_jax.decoding.costs import verify_cost_curve
from eagle_jax.decoding.protocol import Accepted, ChainDrafter, Draft, is_width_ladder
from eagle_jax.drafters.kinds import DrafterKind, check_nonnegative, option
from eagle_jax.errors import EagleJaxError


def check_widths(widths: tuple[int, ...], gamma: int) -> None:
  """One-line user error unless ``widths`` is empty or ascends from >= 1 to ``gamma``."""
  if widths and not is_width_ladder(tuple(widths), gamma):
    raise EagleJaxError(f"prompt lookup widths {list(widths)} must ascend from >= 1 to gamma={gamma}")


@flax.struct.dataclass
class PLDState:
  history_BxH: jax.Array  # prompt and every emitted token; ends with the current root
  length_B: jax.Array
  # cost-aware widths only (zero-size otherwise): acceptance statistics per bucket
  seen_BxK: jax.Array  # resolved continuations per bucket (prior included)
  reach_BxKxG: jax.Array  # of those, how many matched >= j + 1 emitted tokens
  shadow_BxG: jax.Array  # the pending continuation being checked against emitted tokens
  shadow_len_B: jax.Array  # its length; 0 = none pending
  shadow_hit_B: jax.Array  # its tokens matched so far
  shadow_bucket_B: jax.Array
  last_BxG: jax.Array  # the continuation proposed for the current step (drafted or not)
  last_len_B: jax.Array
  copying_B: jax.Array  # the last step's emitted tokens all followed its proposed continuation


def _leading_true(x_BxK: jax.Array) -> jax.Array:
  return jnp.sum(jnp.cumprod(x_BxK.astype(jnp.int32), axis=1), axis=1)


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(ChainDrafter):
  gamma: int = 8  # chain length
  max_ngram: int = 3
  min_ngram: int = 1
  widths: tuple[int, ...] = ()  # cost-aware draft widths (ascending, ending at gamma); () = off
  costs: tuple[float, ...] = ()  # verify cost of each width + the root, over a one-token pass
  prior_count: float = 2.0  # pseudo-observations per bucket before any is resolved
  prior_alpha: float = 0.7  # prior P(matched >= j tokens) = prior_alpha ** j

  def __post_init__(self):
    if self.gamma < 1 or not 1 <= self.min_ngram <= self.max_ngram:
      raise EagleJaxError(f"prompt lookup needs gamma >= 1 and 1 <= min_ngram <= max_ngram; got "
                          f"gamma={self.gamma}, min_ngram={self.min_ngram}, max_ngram={self.max_ngram}")
    check_widths(self.widths, self.gamma)
    if len(self.costs) != len(self.widths) or any(c <= 0 for c in self.costs):
      raise EagleJaxError(f"prompt lookup needs one positive verify cost per width; got widths "
                          f"{list(self.widths)}, costs {list(self.costs)}")

  @property
  def adaptive(self) -> bool:
    return bool(self.widths)

  @property
  def num_buckets(self) -> int:
    return 2 * (self.max_ngram - self.min_ngram + 1) if self.adaptive else 0

  def init(self, dparams, prompt_BxP, lengths_B, features_BxPxD, first_B, cache_len):
    b, p = prompt_BxP.shape
    hist = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(prompt_BxP)
    hist = hist.at[jnp.arange(b), lengths_B].set(first_B)
    k, g = self.num_buckets, self.gamma if self.adaptive else 0
    prior_G = self.prior_count * self.prior_alpha ** jnp.arange(1, g + 1, dtype=jnp.float32)
    zeros_B = jnp.zeros((b,), jnp.int32)
    return PLDState(
        history_BxH=hist, length_B=lengths_B + 1,
        seen_BxK=jnp.full((b, k), self.prior_count, jnp.float32),
        reach_BxKxG=jnp.broadcast_to(prior_G, (b, k, g)),
        shadow_BxG=jnp.zeros((b, g), jnp.int32), shadow_len_B=zeros_B, shadow_hit_B=zeros_B,
        shadow_bucket_B=zeros_B, last_BxG=jnp.zeros((b, g), jnp.int32), last_len_B=zeros_B,
        copying_B=jnp.zeros((b,), bool))

  def _match(self, hist_H, length):
    """Start of the continuation after the latest match of the longest n-gram, its size, and
    the matched n-gram length (0: no match)."""
    h = hist_H.shape[0]
    pos_H = jnp.arange(h)
    best_start, best_count, best_n = jnp.int32(0), jnp.int32(0), jnp.int32(0)
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
      best_n = jnp.where(found, n, best_n)
    return best_start, best_count, best_n

  def _widths(self, state: PLDState, count_B, bucket_B):
    """Per row, the width with the most expected tokens per cost (0 = a plain step)."""
    b = count_B.shape[0]
    rows = jnp.arange(b)
    p_BxG = state.reach_BxKxG[rows, bucket_B] / state.seen_BxK[rows, bucket_B][:, None]
    p_BxG = jnp.where(jnp.arange(self.gamma)[None, :] < count_B[:, None], p_BxG, 0.0)
    expected_BxG = 1.0 + jnp.cumsum(p_BxG, axis=1)  # tokens from a draft of width j + 1
    widths_W = jnp.asarray(self.widths, jnp.int32)
    value_BxW = expected_BxG[:, widths_W - 1] / jnp.asarray(self.costs, jnp.float32)[None, :]
    value_BxW = jnp.concatenate([jnp.ones((b, 1), jnp.float32), value_BxW], 1)
    best_B = jnp.argmax(value_BxW, axis=1)
    return jnp.where(best_B > 0, widths_W[jnp.maximum(best_B - 1, 0)], 0)

  def propose(self, dparams, state: PLDState, root_B, key, params):
    b = root_B.shape[0]
    start_B, count_B, n_B = jax.vmap(self._match)(state.history_BxH, state.length_B)
    idx_BxN = jnp.clip(start_B[:, None] + jnp.arange(self.gamma)[None, :], 0,
                       state.history_BxH.shape[1] - 1)
    tokens = jnp.take_along_axis(state.history_BxH, idx_BxN, axis=1)
    width_B = count_B
    if self.adaptive:
      bucket_B = 2 * jnp.maximum(n_B - self.min_ngram, 0) + state.copying_B.astype(jnp.int32)
      width_B = jnp.minimum(self._widths(state, count_B, bucket_B), count_B)
      new_B = (state.shadow_len_B == 0) & (count_B > 0)
      state = state.replace(
          shadow_BxG=jnp.where(new_B[:, None], tokens, state.shadow_BxG),
          shadow_len_B=jnp.where(new_B, count_B, state.shadow_len_B),
          shadow_hit_B=jnp.where(new_B, 0, state.shadow_hit_B),
          shadow_bucket_B=jnp.where(new_B, bucket_B, state.shadow_bucket_B),
          last_BxG=tokens, last_len_B=count_B)
    draft = Draft(tokens_BxN=tokens,
                  parents_BxN=self.chain_parents(b),
                  valid_BxN=jnp.arange(self.gamma)[None, :] < width_B[:, None], q_BxNxV=None)
    return draft, state

  def update(self, dparams, state: PLDState, accepted: Accepted):
    b, k = accepted.tokens_BxK.shape
    dst = state.length_B[:, None] + jnp.arange(k)[None, :]
    dst = jnp.where(jnp.arange(k)[None, :] < accepted.count_B[:, None], dst, state.history_BxH.shape[1])
    hist = state.history_BxH.at[jnp.arange(b)[:, None], dst].set(accepted.tokens_BxK, mode="drop")
    state = state.replace(history_BxH=hist, length_B=state.length_B + accepted.count_B)
    return self._learn(state, accepted) if self.adaptive else state

  def _learn(self, state: PLDState, accepted: Accepted) -> PLDState:
    """Checks the last proposed and the pending continuations against the emitted tokens."""
    tokens_BxK, count_B = accepted.tokens_BxK, accepted.count_B
    k, g = tokens_BxK.shape[1], self.gamma
    j_K = jnp.arange(k)[None, :]
    emitted_BxK = j_K < count_B[:, None]

    def followed(cont_BxG, offset_B, length_B):
      """Emitted tokens (leading run) that equal ``cont[offset + j]`` within its length."""
      idx_BxK = offset_B[:, None] + j_K
      cont_BxK = jnp.take_along_axis(cont_BxG, jnp.clip(idx_BxK, 0, g - 1), axis=1)
      return _leading_true(emitted_BxK & (idx_BxK < length_B[:, None]) & (cont_BxK == tokens_BxK))

    run_last = followed(state.last_BxG, jnp.zeros_like(count_B), state.last_len_B)
    copying_B = jnp.where(count_B > 0, (state.last_len_B > 0) & (
        run_last >= jnp.minimum(count_B, state.last_len_B)), state.copying_B)
    hit_B = state.shadow_hit_B + followed(state.shadow_BxG, state.shadow_hit_B, state.shadow_len_B)
    pending_B = (state.shadow_len_B > 0) & (count_B > 0)
    resolved_B = pending_B & ((hit_B - state.shadow_hit_B < count_B) | (hit_B >= state.shadow_len_B))
    add_BxK = jax.nn.one_hot(state.shadow_bucket_B, self.num_buckets) * resolved_B[:, None]
    reached_BxG = (hit_B[:, None] >= jnp.arange(1, g + 1)[None, :]).astype(jnp.float32)
    return state.replace(
        seen_BxK=state.seen_BxK + add_BxK,
        reach_BxKxG=state.reach_BxKxG + add_BxK[:, :, None] * reached_BxG[:, None, :],
        shadow_len_B=jnp.where(resolved_B, 0, state.shadow_len_B),
        shadow_hit_B=jnp.where(resolved_B, 0, jnp.where(pending_B, hit_B, state.shadow_hit_B)),
        copying_B=copying_B)


# -- the kinds: pld (cost-aware widths) and pld-static (every match at full gamma) -----------

_GAMMA = "draft length (chain)"


@dataclasses.dataclass(frozen=True)
class PldStaticOptions:
  gamma: int = option(8, _GAMMA)
  pld_min_ngram: int = option(2, "shortest n-gram matched")
  pld_max_ngram: int = option(3, "longest n-gram matched (tried first)")

  def __post_init__(self):
    check_nonnegative(self, "gamma", "pld_min_ngram", "pld_max_ngram")


@dataclasses.dataclass(frozen=True)
class PldOptions(PldStaticOptions):
  pld_widths: tuple[int, ...] = option((), "draft widths it chooses from by cost, e.g. 3,8 "
                                       "(default: 3 and gamma)")

  def __post_init__(self):
    super().__post_init__()
    check_widths(self.pld_widths, self.gamma)


def build_pld(target, options: PldStaticOptions, context=None) -> tuple:
  """Prompt lookup: ``pld`` picks its draft width from verify costs measured on this machine
  and the acceptance it has seen; ``pld-static`` drafts every match at full ``gamma``."""
  gamma = options.gamma or 8
  widths = ()
  if isinstance(options, PldOptions):
    widths = options.pld_widths or tuple(sorted({min(3, gamma), gamma}))
  check_widths(widths, gamma)  # before timing verify passes for them
  PromptLookupDrafter(gamma=gamma, min_ngram=options.pld_min_ngram, max_ngram=options.pld_max_ngram)
  costs = ()
  if widths:
    curve = verify_cost_curve(target, sizes=(1,) + tuple(w + 1 for w in widths))
    costs = tuple(round(curve[w + 1] / curve[1], 3) for w in widths)
  return PromptLookupDrafter(gamma=gamma, min_ngram=options.pld_min_ngram,
                             max_ngram=options.pld_max_ngram, widths=tuple(widths),
                             costs=costs), None


# the reference implementation (apoorvumang/prompt-lookup-decoding): n-grams of 3 down to 1,
# 10 drafted tokens per match
_PAPER = {"gamma": 10, "pld_min_ngram": 1, "pld_max_ngram": 3}
_PAPER_SOURCE = ("prompt lookup decoding's reference code (apoorvumang/prompt-lookup-decoding): "
                 "max_ngram_size 3, num_pred_tokens 10")
PLD = DrafterKind("pld", "prompt lookup, draft width chosen by measured verify cost",
                  PldOptions, build_pld, paper={**_PAPER, "pld_widths": (10,)},
                  paper_source=_PAPER_SOURCE)
PLD_STATIC = DrafterKind("pld-static", "prompt lookup, every match drafted at full gamma",
                         PldStaticOptions, build_pld, paper=_PAPER, paper_source=_PAPER_SOURCE)
