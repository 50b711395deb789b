"""The lossless verify step: score a drafted tree in one target pass and accept a path.

Greedy (T = 0): follow the children whose token equals the target's argmax at their parent.
Sampling: recursive rejection sampling over siblings (SpecInfer / EAGLE). At the current node
with target distribution p, children x are tried in slot order; x is accepted with probability
min(1, p(x) / q(x)); on rejection p <- normalize(max(p - q, 0)). If every child is rejected
(or the node is a leaf) the bonus token is drawn from p. ``q`` is the draft distribution each
node was drawn from (siblings drawn i.i.d. from their parent's q). A deterministic draft
(``q is None``: the tokens are a function of the context, e.g. top-k or n-gram lookup; siblings
distinct) is the special case q = one-hot(x): accept with probability p(x), remove x from p.
Both keep the output distribution exactly the target's.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from eagle_jax.decoding.sampling import SamplingParams, greedy_token, process_logits
from eagle_jax.model.transformer import KVCache


@flax.struct.dataclass
class Verdict:
  path_BxD: jax.Array  # accepted node slots (1..M-1), depth order; entries >= num_accepted unused
  num_accepted_B: jax.Array  # accepted draft tokens (the bonus token not counted)
  bonus_B: jax.Array  # the target's own token after the accepted path


def _verify_row(logits_MxV, tokens_M, parents_M, valid_M, q_MxV, key, params: SamplingParams,
                max_depth: int):
  m, v = logits_MxV.shape
  is_child_MxM = (parents_M[None, :] == jnp.arange(m)[:, None]) & valid_M[None, :]
  num_children_M = is_child_MxM.sum(-1)
  greedy = params.greedy
  if greedy:
    target_M = greedy_token(logits_MxV)
    p0 = jnp.zeros((v,), jnp.float32)  # unused
  else:
    probs_MxV = jax.nn.softmax(process_logits(logits_MxV, params), axis=-1)
    p0 = probs_MxV[0]
  key_u, key_bonus = jax.random.split(key)
  u_M = jax.random.uniform(key_u, (m,))

  def body(j, c):
    cur, p, rejected, finished, path, depth = c
    x = tokens_M[j]
    cand = valid_M[j] & (parents_M[j] == cur) & ~finished
    if greedy:
      accept = cand & (x == target_M[cur])
    else:
      qx = 1.0 if q_MxV is None else q_MxV[j, x]
      accept = cand & (u_M[j] * qx < p[x])
      q = jax.nn.one_hot(x, v, dtype=p.dtype) if q_MxV is None else q_MxV[j]
      resid = jnp.maximum(p - q, 0.0)
      total = resid.sum()
      resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p)
      p = jnp.where(accept, probs_MxV[j], jnp.where(cand, resid, p))
    reject = cand & ~accept
    new_cur = jnp.where(accept, j, cur)
    path = jnp.where(accept, path.at[jnp.minimum(depth, max_depth - 1)].set(j), path)
    depth = depth + accept.astype(jnp.int32)
    rejected = jnp.where(accept, 0, rejected + reject.astype(jnp.int32))
    finished = finished | (accept & (num_children_M[j] == 0)) | (
        reject & (rejected >= num_children_M[cur]))
    return new_cur, p, rejected, finished, path, depth

  init = (jnp.int32(0), p0, jnp.int32(0), num_children_M[0] == 0,
          jnp.zeros((max_depth,), jnp.int32), jnp.int32(0))
  cur, p, _, _, path, depth = jax.lax.fori_loop(1, m, body, init)
  if greedy:
    bonus = target_M[cur]
  else:
    bonus = jax.random.categorical(key_bonus, jnp.log(p))
  return path, depth, bonus.astype(jnp.int32)


def verify(logits_BxMxV, tokens_BxM, parents_BxM, valid_BxM, q_BxMxV, key, params: SamplingParams,
           max_depth: int) -> Verdict:
  """Chooses the accepted path and bonus token for each row (see the module docstring).

  ``logits_BxMxV`` are the target's logits at every slot (slot 0 = root). ``q_BxMxV`` is
  the draft distribution each node was drawn from, or None for a deterministic draft.
  """
  b = tokens_BxM.shape[0]
  keys = jax.random.split(key, b)
  q_axis = None if q_BxMxV is None else 0
  path, depth, bonus = jax.vmap(_verify_row, in_axes=(0, 0, 0, 0, q_axis, 0, None, None))(
      logits_BxMxV, tokens_BxM, parents_BxM, valid_BxM, q_BxMxV, keys, params, max(max_depth, 1))
  return Verdict(path_BxD=path, num_accepted_B=depth, bonus_B=bonus)


def commit(cache: KVCache, verdict: Verdict) -> KVCache:
  """Moves the accepted path's K/V to contiguous slots after the root and advances lengths.

  The verify forward wrote slot j of the tree at cache slot ``lengths + j`` (root at
  ``lengths``) without advancing; the root stays, accepted nodes move to ``lengths + 1 + i``.
  """
  b, d = verdict.path_BxD.shape
  start_Bx1 = cache.lengths_B[:, None]
  src_BxD = start_Bx1 + verdict.path_BxD
  keep_BxD = jnp.arange(d)[None, :] < verdict.num_accepted_B[:, None]
  dst_BxD = jnp.where(keep_BxD, start_Bx1 + 1 + jnp.arange(d)[None, :], cache.max_len)
  rows = jnp.arange(b)[:, None]
  move = lambda x: x.at[rows, :, dst_BxD].set(x[rows, :, src_BxD], mode="drop")  # [B, K, S, Dh]
  return KVCache(k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v),
                 lengths_B=cache.lengths_B + 1 + verdict.num_accepted_B)
