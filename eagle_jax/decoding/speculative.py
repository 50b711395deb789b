"""The compiled speculative loop: draft -> verify -> update in one ``lax.while_loop``.

Every drafter plugs into the same verify step (:mod:`eagle_jax.decoding.verify`), so acceptance figures
are comparable and outputs are the target's. Statistics per step and row: the number of
accepted draft tokens (-1 once the row has finished) and the depth drafted below the accepted
path's end (the deepest drafted node in the subtree of the last accepted node).

Verify widths: a drafter may declare a ladder of node counts (``widths``, ascending, the largest
= ``num_nodes``; default ``(num_nodes,)``). Each step the loop verifies the smallest width that
holds every active row's valid nodes, and takes plain one-token decode steps while no row has
a draft: each width's target pass is its own inner ``while_loop`` that runs once or not at all
in a step, followed by one shared tail (emit, drafter update, propose), so a drafter that
drafts little pays for a small target pass, and one that drafts nothing costs (almost)
nothing. A drafter that declares ``always_drafts`` (every step has a valid node in every row)
gets no plain-step loop: one copy fewer of the target forward to compile, for a loop that
would never run.

Counting convention: **tau** = tokens emitted per target verify pass, *including* the target's
bonus token (accepted drafts + 1), averaged over verify passes; the prefill pass that emits
the first token is not counted. **n-alpha** = P(draft token at depth n accepted | depths
1..n-1 accepted and a depth-n token was drafted under the accepted depth-(n-1) node; in a
tree, a depth-n node on a rejected branch is no attempt at depth n). A step cut short by
``max_new_tokens`` or a stop token counts only what it emitted: its accepted drafts are those
emitted, and its drafted depth is capped there, so an accepted draft past the cut is neither
counted in tau nor taken as a rejection in n-alpha (the steps' tokens add up to the new tokens
after the first).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.decoding.generate import (
  _is_stop,
  features_of,
  prepare_prompts,
  run_compiled,
  run_prefill,
)
from eagle_jax.decoding.protocol import Accepted, Draft, is_width_ladder
from eagle_jax.decoding.sampling import SamplingParams, sample
from eagle_jax.decoding.tree import tree_structure
from eagle_jax.decoding.verify import Verdict, commit, verify
from eagle_jax.model.transformer import KVCache, Transformer


@dataclasses.dataclass
class SpecGeneration:
  tokens: list[list[int]]
  num_new: list[int]
  accepted: list[list[int]]  # per row: accepted draft tokens at each verify step
  # per row and verify step: the deepest drafted node at or below the accepted path's end
  # (a chain: its length; 0: nothing drafted)
  drafted_depth: list[list[int]]
  accepted_slots: list[list[tuple[int, ...]]]  # per row and step: tree slots of the accepted path
  seconds: float
  compile_seconds: float

  @property
  def tokens_per_s(self) -> float:
    return sum(self.num_new) / max(self.seconds, 1e-9)

  @property
  def tau(self) -> float:
    return tau(self.accepted)

  def n_alpha(self, max_n: int | None = None) -> list[float]:
    return acceptance_rates(self.accepted, self.drafted_depth, max_n)


def tau(accepted) -> float:
  """Tokens per target verify pass, the bonus token included, the prefill excluded: 1 + the
  mean accepted draft tokens per step, from per-row lists of per-step accepted counts (NaN
  without a verify step)."""
  steps = [a for row in accepted for a in row]
  return float(np.mean(steps) + 1) if steps else float("nan")


def acceptance_rates(accepted, drafted, max_n=None) -> list[float]:
  """n-alpha for n = 1..max_n from per-step accepted counts and drafted depths."""
  acc = np.array([a for row in accepted for a in row], np.int64)
  dep = np.array([d for row in drafted for d in row], np.int64)
  max_n = max_n or (int(dep.max()) if dep.size else 0)
  out = []
  for n in range(1, max_n + 1):
    tried = ((acc >= n - 1) & (dep >= n)).sum()
    out.append(float(((acc >= n) & (dep >= n)).sum() / tried) if tried else float("nan"))
  return out


@flax.struct.dataclass
class _Pass:
  """This step's target pass (``done`` once a width ran it), for the step's shared tail."""
  done: jax.Array
  verdict: Verdict
  emitted_BxK: jax.Array
  features_BxKxF: jax.Array
  depth_B: jax.Array


@flax.struct.dataclass
class _SpecState:
  cache: KVCache
  root_B: jax.Array
  out_BxN: jax.Array
  num_new_B: jax.Array
  done_B: jax.Array
  step: jax.Array
  key: jax.Array
  dstate: Any
  draft: Draft  # proposed for the next step
  accepted_BxS: jax.Array
  depth_BxS: jax.Array
  path_BxSxD: jax.Array
  pass_: _Pass


def verify_widths(drafter) -> tuple[int, ...]:
  """The drafter's ladder of verify widths (ascending, ending at ``num_nodes``)."""
  widths = tuple(getattr(drafter, "widths", ()) or (drafter.num_nodes,))
  if not is_width_ladder(widths, drafter.num_nodes):
    raise ValueError(f"drafter widths {widths} must ascend from >= 1 to num_nodes={drafter.num_nodes}")
  return widths


def is_chain(drafter) -> bool:
  """Whether every draft of ``drafter`` is a chain (one node per depth): chain drafters, and
  static trees as deep as they have nodes; dynamic trees (``tree=None``) are not."""
  tree = getattr(drafter, "tree", "chain")
  return isinstance(tree, str) or (tree is not None and drafter.num_nodes == drafter.max_depth)


def loop_widths(drafter) -> tuple[int, ...]:
  """The widths the compiled loop has a step for: 0 (a plain decode step) unless the drafter
  declares ``always_drafts``, then its verify widths."""
  return (() if getattr(drafter, "always_drafts", False) else (0,)) + verify_widths(drafter)


def _target_pass(model, cache, root_B, draft: Draft, key, params, max_depth, layers=()):
  """One target forward over [root, draft nodes], the verdict, and the committed cache.

  Returns the cache with the accepted path committed, the verdict, the emitted tokens
  (accepted drafts then the bonus), the target features before each emitted token, and the
  depth drafted per row.
  """
  b, n = draft.tokens_BxN.shape
  tokens_BxM = jnp.concatenate([root_B[:, None], draft.tokens_BxN], 1)
  parents_BxM = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), draft.parents_BxN], 1)
  valid_BxM = jnp.concatenate([jnp.ones((b, 1), bool), draft.valid_BxN], 1)
  mask_BxMxM, depth_BxM = tree_structure(parents_BxM, valid_BxM)
  if n == 0:  # nothing drafted: a plain decode step, no tree bookkeeping
    out = model(root_B[:, None], cache.lengths_B[:, None], cache, return_layers=layers)
    feats_BxTxF = features_of(out, layers)
    bonus_B = sample(key, out.logits_BxTxV[:, 0], params)
    verdict = Verdict(path_BxD=jnp.zeros((b, max_depth), jnp.int32),
                      num_accepted_B=jnp.zeros((b,), jnp.int32), bonus_B=bonus_B)
    emitted_BxK = jnp.zeros((b, max_depth + 1), jnp.int32).at[:, 0].set(bonus_B)
    features_BxKxD = jnp.zeros((b, max_depth + 1, feats_BxTxF.shape[-1]),
                               feats_BxTxF.dtype).at[:, 0].set(feats_BxTxF[:, 0])
    return out.cache, verdict, emitted_BxK, features_BxKxD, jnp.zeros((b,), jnp.int32)
  out = model(tokens_BxM, cache.lengths_B[:, None] + depth_BxM, cache, mask_BxTxT=mask_BxMxM,
              num_valid_B=jnp.zeros((b,), jnp.int32), return_layers=layers)
  q = None
  if draft.q_BxNxV is not None:
    q = jnp.concatenate([jnp.zeros_like(draft.q_BxNxV[:, :1]), draft.q_BxNxV], 1)
  verdict = verify(out.logits_BxTxV, tokens_BxM, parents_BxM, valid_BxM, q, key, params, max_depth)
  d = verdict.path_BxD.shape[1]
  a_B = verdict.num_accepted_B
  path_tokens = jnp.take_along_axis(tokens_BxM, verdict.path_BxD, 1)
  emitted_BxK = jnp.concatenate([path_tokens, jnp.zeros((b, 1), jnp.int32)], 1)
  emitted_BxK = jnp.where(jnp.arange(d + 1)[None] < a_B[:, None], emitted_BxK, 0)
  emitted_BxK = emitted_BxK.at[jnp.arange(b), a_B].set(verdict.bonus_B)
  slots_BxK = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), verdict.path_BxD], 1)
  features_BxKxD = jnp.take_along_axis(features_of(out, layers), slots_BxK[:, :, None], 1)
  # the deepest drafted node at or below the accepted path's end (a chain: its length). n-alpha
  # counts depth a + 1 as tried only if something was drafted below the accepted node: in a
  # tree, a deeper node on another branch is no attempt at that depth.
  last_B = jnp.where(a_B > 0, jnp.take_along_axis(verdict.path_BxD, jnp.maximum(a_B - 1, 0)[:, None], 1)[:, 0], 0)
  below_BxM = valid_BxM & jnp.take_along_axis(mask_BxMxM, last_B[:, None, None], 2)[..., 0]
  depth_drafted_B = jnp.max(jnp.where(below_BxM, depth_BxM, 0), axis=1)
  return commit(out.cache, verdict), verdict, emitted_BxK, features_BxKxD, depth_drafted_B


@functools.partial(jax.jit, static_argnames=("graphdef", "drafter", "max_new_tokens", "cache_len",
                                             "params", "pad_id"))
def _spec_jit(state, dparams, tokens_BxP, lengths_B, cache, feats_BxPxF, logits_BxV, key, stop_S, *,
              graphdef, drafter, max_new_tokens, cache_len, params, pad_id):
  """The loop after the prompt pass (``cache``, features and last-token logits from
  :func:`~eagle_jax.decoding.generate.run_prefill`)."""
  model = nnx.merge(graphdef, state)
  b = tokens_BxP.shape[0]
  d = max(drafter.max_depth, 1)
  layers = tuple(drafter.feature_layers)
  key, sub = jax.random.split(key)
  first_B = sample(sub, logits_BxV, params)
  dstate = drafter.init(dparams, tokens_BxP, lengths_B, feats_BxPxF, first_B, cache_len)
  key, k_draft = jax.random.split(key)
  draft, dstate = drafter.propose(dparams, dstate, first_B, k_draft, params)
  s = _SpecState(
      cache=cache, root_B=first_B,
      out_BxN=jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first_B),
      num_new_B=jnp.ones((b,), jnp.int32),
      done_B=_is_stop(first_B, stop_S) | (max_new_tokens <= 1),
      step=jnp.int32(0), key=key, dstate=dstate, draft=draft,
      accepted_BxS=jnp.full((b, max_new_tokens), -1, jnp.int32),
      depth_BxS=jnp.zeros((b, max_new_tokens), jnp.int32),
      path_BxSxD=jnp.zeros((b, max_new_tokens, d), jnp.int32),
      pass_=_Pass(done=jnp.bool_(False),
                  verdict=Verdict(path_BxD=jnp.zeros((b, d), jnp.int32),
                                  num_accepted_B=jnp.zeros((b,), jnp.int32),
                                  bonus_B=jnp.zeros((b,), jnp.int32)),
                  emitted_BxK=jnp.zeros((b, d + 1), jnp.int32),
                  features_BxKxF=jnp.zeros((b, d + 1, feats_BxPxF.shape[-1]), feats_BxPxF.dtype),
                  depth_B=jnp.zeros((b,), jnp.int32)))

  def verify_width(s: _SpecState, width: int, key) -> _SpecState:
    """The target pass over the first ``width`` nodes of ``s.draft`` (0: a plain decode step),
    its verdict parked in ``s.pass_`` for the step's shared tail.

    The barrier keeps the pass inside its loop: the state it reads is loop-invariant there, and
    XLA otherwise hoists every width's first-layer work (embedding, norm, the first products,
    attention among the new tokens) out into the step, computing all widths every step."""
    s = jax.lax.optimization_barrier(s)
    active_B = ~s.done_B
    draft = jax.tree.map(lambda x: x[:, :width], s.draft)
    cache, verdict, emitted_BxK, feats, depth_B = _target_pass(
        model, s.cache, s.root_B, draft, key, params, d, layers)
    cache = cache.replace(lengths_B=jnp.where(active_B, cache.lengths_B, s.cache.lengths_B))
    return s.replace(cache=cache, pass_=_Pass(
        done=jnp.bool_(True), verdict=verdict, emitted_BxK=emitted_BxK,
        features_BxKxF=feats.astype(s.pass_.features_BxKxF.dtype), depth_B=depth_B))

  def tail(s: _SpecState, k_draft) -> _SpecState:
    """Emit the verified tokens, update the drafter, draft again: one copy for every width."""
    active_B = ~s.done_B
    verdict, emitted_BxK, depth_B = s.pass_.verdict, s.pass_.emitted_BxK, s.pass_.depth_B
    k = emitted_BxK.shape[1]
    count_B = verdict.num_accepted_B + 1
    # stop at the first stop token and at max_new_tokens
    idx_K = jnp.arange(k)[None, :]
    is_stop_BxK = _is_stop(emitted_BxK, stop_S) & (idx_K < count_B[:, None])
    first_stop_B = jnp.where(is_stop_BxK.any(1), jnp.argmax(is_stop_BxK, 1) + 1, k + 1)
    keep_B = jnp.minimum(jnp.minimum(count_B, first_stop_B), max_new_tokens - s.num_new_B)
    keep_B = jnp.where(active_B, keep_B, 0)
    dst = jnp.where(idx_K < keep_B[:, None], s.num_new_B[:, None] + idx_K, max_new_tokens)
    out_BxN = s.out_BxN.at[jnp.arange(b)[:, None], dst].set(emitted_BxK, mode="drop")
    num_new_B = s.num_new_B + keep_B
    done_B = s.done_B | (first_stop_B <= count_B) | (num_new_B >= max_new_tokens)
    accepted = Accepted(tokens_BxK=emitted_BxK, count_B=jnp.where(active_B, count_B, 0),
                        features_BxKxD=s.pass_.features_BxKxF)
    dstate = drafter.update(dparams, s.dstate, accepted)
    next_draft, dstate = drafter.propose(dparams, dstate, verdict.bonus_B, k_draft, params)
    step_col = jnp.minimum(s.step, max_new_tokens - 1)
    # statistics of what was emitted: a step cut by max_new_tokens or a stop token emitted only
    # keep_B - 1 accepted drafts (and no bonus); its depths past the cut were not tried
    cut_B = keep_B < count_B
    counted_B = jnp.where(cut_B, keep_B - 1, verdict.num_accepted_B)
    depth_B = jnp.where(cut_B, jnp.minimum(depth_B, keep_B - 1), depth_B)
    return s.replace(
        root_B=verdict.bonus_B, out_BxN=out_BxN, num_new_B=num_new_B, done_B=done_B,
        step=s.step + 1, dstate=dstate, draft=next_draft,
        accepted_BxS=s.accepted_BxS.at[:, step_col].set(jnp.where(active_B, counted_B, -1)),
        depth_BxS=s.depth_BxS.at[:, step_col].set(jnp.where(active_B, depth_B, 0)),
        path_BxSxD=s.path_BxSxD.at[:, step_col].set(jnp.where(
            jnp.arange(d)[None] < counted_B[:, None], verdict.path_BxD, 0)))

  rungs = loop_widths(drafter)
  rungs_R = jnp.asarray(rungs, jnp.int32)

  def cond(s):
    return ~jnp.all(s.done_B)

  def rung(s):
    """Index of the smallest width holding every active row's valid nodes (with no valid node,
    the plain step, or the smallest width where the loop has none)."""
    slots_BxN = jnp.arange(1, s.draft.valid_BxN.shape[1] + 1)[None, :]
    need = jnp.max(jnp.where(s.draft.valid_BxN & ~s.done_B[:, None], slots_BxN, 0))
    return jnp.sum(rungs_R < need)

  def body(s):
    # One step: the target pass of the width the draft needs, then the shared tail. Each width's
    # pass sits in its own while_loop that runs once or not at all (rather than a lax.switch,
    # which would copy the cache); the tail (bookkeeping, drafter update and propose) is
    # compiled once, not once per width.
    key, k_draft, k_verify = jax.random.split(s.key, 3)
    s = s.replace(key=key, pass_=s.pass_.replace(done=jnp.bool_(False)))
    for r, width in enumerate(rungs):
      s = jax.lax.while_loop(lambda s, r=r: ~s.pass_.done & (rung(s) == r),
                             lambda s, width=width: verify_width(s, width, k_verify), s)
    return tail(s, k_draft)

  s = jax.lax.while_loop(cond, body, s)
  return s.out_BxN, s.num_new_B, s.accepted_BxS, s.depth_BxS, s.path_BxSxD



def speculative_generate(model: Transformer, drafter, dparams, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int = 128, params: SamplingParams = SamplingParams(),
                         seed: int = 0, stop_ids: Sequence[int] | None = None,
                         max_cache_len: int | None = None, pad_id: int = 0,
                         prompt_width: int = 0) -> SpecGeneration:
  """Speculative decoding of each prompt; output distributed exactly as :func:`generate`'s
  (``prompt_width``: as for :func:`~eagle_jax.decoding.generate.generate`)."""
  tokens_BxP, lengths_B, cache_len, stop = prepare_prompts(
      model, prompts, max_new_tokens, max_cache_len, stop_ids, pad_id, draft_nodes=drafter.num_nodes,
      prompt_width=prompt_width)
  graphdef, state = nnx.split(model)
  (cache, feats_BxPxF, logits_BxV), compile0, run0 = run_prefill(
      graphdef, state, tokens_BxP, lengths_B, cache_len, tuple(drafter.feature_layers))
  args = (state, dparams, jnp.asarray(tokens_BxP), jnp.asarray(lengths_B), cache, feats_BxPxF,
          logits_BxV, jax.random.key(seed), jnp.asarray(stop))
  statics = dict(graphdef=graphdef, drafter=drafter, max_new_tokens=max_new_tokens,
                 cache_len=cache_len, params=params, pad_id=pad_id)
  (out_BxN, num_new_B, acc_BxS, dep_BxS, path_BxSxD), compile_s, run_s = run_compiled(
      _spec_jit, args, statics)
  compile_s, run_s = compile0 + compile_s, run0 + run_s
  acc = [[int(a) for a in row if a >= 0] for row in acc_BxS]
  dep = [[int(d) for d, a in zip(drow, arow) if a >= 0] for drow, arow in zip(dep_BxS, acc_BxS)]
  paths = [[tuple(int(x) for x in p[:a]) for p, a in zip(prow, arow) if a >= 0]
           for prow, arow in zip(path_BxSxD, acc_BxS)]
  return SpecGeneration(tokens=[out_BxN[i, :n].tolist() for i, n in enumerate(num_new_B)],
                        num_new=num_new_B.tolist(), accepted=acc, drafted_depth=dep,
                        accepted_slots=paths,
                        seconds=run_s, compile_seconds=compile_s)
