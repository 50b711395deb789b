"""Medusa-1 heads on the frozen target's top feature, their training objective and tree budget.

Head ``k`` (0-based) reads the target's top hidden state ``h_t`` (as fed to its LM head, which
itself predicts token ``t+1``) and predicts token ``t+k+2``: ``k+1`` steps after the next one.
Each head is ``num_layers`` zero-initialised residual blocks ``x + SiLU(W x + b)`` and its own
output layer initialised from the target's LM head, so at step 0 every head copies the target's
next-token prediction. Heads are stored stacked (``[K, ...]``) and run as one batched einsum.

Training (:class:`MedusaTask`, on feature-cache rows): cross entropy of head ``k`` against the
target's greedy token at ``t+k+1`` (``target_argmax``; self-distillation: the heads learn what
the target will say, not what the ShareGPT text says), weighted ``decay**k``. The vocabulary-
sized output layers run only at ``positions_per_row`` sampled positions per row
(:func:`eagle_jax.training.trainer.sample_positions`). Held-out evaluation also reports ``rank{r}_{k}``:
how often the target's token is head ``k``'s ``r``-th choice, which builds the tree.

Tree budget (Medusa's own method): assuming heads err independently, a node whose path takes
ranks ``(r_1, ..., r_d)`` is accepted with probability ``prod_i acc[i-1][r_i]``; the best tree
of ``n`` nodes keeps the ``n`` most probable paths (ancestor-closed, because a child is never
more probable than its parent), and its expected tau is ``1 + sum`` of its node probabilities.
:func:`tune_tree` picks ``n`` maximising predicted tokens/s against the measured verify-cost
curve and the timed draft step.
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.decoding.tree import MEDUSA_DEFAULT_CHOICES
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.ops import linear
from eagle_jax.model.transformer import WeightBlocks, blocks_of, round_to_8bit
from eagle_jax.training.trainer import at_positions, sample_positions


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  num_heads: int = 4
  num_layers: int = 1  # residual blocks per head
  hidden_size: int = 576
  vocab_size: int = 49152

  def validate(self):
    if self.num_heads < 1 or self.num_layers < 0:
      raise EagleJaxError(f"medusa: need num_heads >= 1 and num_layers >= 0 "
                          f"(num_heads={self.num_heads}, num_layers={self.num_layers})")

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "MedusaConfig":
    return cls(**d)


class MedusaHeads(nnx.Module):

  def __init__(self, config: MedusaConfig, *, rngs: nnx.Rngs, lm_head_VxD=None):
    config.validate()
    k, l, d, v = config.num_heads, config.num_layers, config.hidden_size, config.vocab_size
    self.config = config
    self.res_w_KxLxDxD = nnx.Param(jnp.zeros((k, l, d, d), jnp.float32))  # [out, in]
    self.res_b_KxLxD = nnx.Param(jnp.zeros((k, l, d), jnp.float32))
    if lm_head_VxD is None:
      out = 0.02 * jax.random.normal(rngs.params(), (k, v, d), jnp.float32)
    else:
      out = jnp.broadcast_to(jnp.asarray(lm_head_VxD, jnp.float32)[None], (k, v, d))
    self.out_KxVxD = nnx.Param(jnp.array(out))
    self.out_blocks: WeightBlocks | None = nnx.data(None)  # per head, set by quantize8

  def quantize8(self) -> None:
    """Rounds each head's output layer to 8-bit blocks (:func:`eagle_jax.model.transformer.round_to_8bit`;
    the float32 weights become their expansion, so every backend uses the same weights), which
    the CPU kernel then reads at a quarter of the bytes: the output layers are nearly all of
    Medusa's weights (49,152 x 576 per head for the default target). For drafting only: drafts
    may change, verified outputs cannot."""
    if self.out_blocks is not None:
      return
    weights, blocks = zip(*(round_to_8bit(w) for w in np.asarray(self.out_KxVxD[...])))
    self.out_KxVxD.value = jnp.stack(weights)
    self.out_blocks = WeightBlocks(tuple(blocks))

  def features(self, h_xD: jax.Array, num_heads: int | None = None) -> jax.Array:
    """``[..., D] -> [..., K, D]``: each head's residual stack applied to the target feature
    (the first ``num_heads`` heads; all by default)."""
    k = num_heads or self.config.num_heads
    x = jnp.broadcast_to(h_xD[..., None, :], h_xD.shape[:-1] + (k, h_xD.shape[-1]))
    for i in range(self.config.num_layers):
      y = jnp.einsum("...kd,ked->...ke", x, self.res_w_KxLxDxD[:k, i]) + self.res_b_KxLxD[:k, i]
      x = x + jax.nn.silu(y)
    return x

  def __call__(self, h_xD: jax.Array, num_heads: int | None = None) -> jax.Array:
    """``[..., D] -> [..., K, V]`` fp32 logits of the first ``num_heads`` heads (all by
    default): a tree ``d`` deep needs only heads ``0..d-1``, and each head's output layer is as
    large as the target's LM head."""
    k = num_heads or self.config.num_heads
    blocks = blocks_of(self.out_blocks)
    if blocks is None:
      # float32: every head in one product, then the first k. XLA's CPU backend copies a slice
      # of the stacked weights before multiplying, which costs more than the unused heads
      x_xKxD = self.features(h_xD)
      return jnp.einsum("...kd,kvd->...kv", x_xKxD, self.out_KxVxD[...])[..., :k, :].astype(jnp.float32)
    x_xKxD = self.features(h_xD, k)  # 8-bit: each head's own blocks, only the heads asked for
    return jnp.stack([linear(x_xKxD[..., i, :], self.out_KxVxD[i], blocks[i]) for i in range(k)],
                     axis=-2).astype(jnp.float32)


def _shift(x_BxT, s, fill=0):
  """``y[:, t] = x[:, t + s]`` (``fill`` past the end)."""
  pad = jnp.full((x_BxT.shape[0], s), fill, x_BxT.dtype)
  return jnp.concatenate([x_BxT[:, s:], pad], 1)


@dataclasses.dataclass(frozen=True)
class MedusaTask:
  """A :class:`eagle_jax.training.trainer.Task` training Medusa heads on cached target features."""

  config: MedusaConfig
  lm_head_VxD: np.ndarray | None = None  # the target's LM head, copied into every head at init
  positions_per_row: int = 128
  eval_positions: int = 256
  decay: float = 0.8
  eval_ranks: int = 10
  keys = ("tokens", "segments", "loss_mask", "target_argmax", "hidden")
  frozen = None  # the heads read only cached features

  def init_module(self, rngs):
    return MedusaHeads(self.config, rngs=rngs, lm_head_VxD=self.lm_head_VxD)

  def loss(self, heads: MedusaHeads, frozen, batch, key, train):
    seg, am, tokens = batch["segments"], batch["target_argmax"], batch["tokens"]
    k_heads = self.config.num_heads
    valid = [(_shift(seg, k + 1) == seg) & (seg > 0) & _shift(batch["loss_mask"], k + 1, False)
             for k in range(k_heads)]
    idx_BxN, w0_BxN = sample_positions(key, valid[0], self.positions_per_row if train else self.eval_positions)
    row_scale_Bx1 = w0_BxN.max(1, keepdims=True)  # each pick's inverse chance of being drawn
    take = lambda x: at_positions(x, idx_BxN)
    logits_BxNxKxV = heads(take(batch["hidden"]))
    total, metrics = 0.0, {}
    run_B = jnp.ones(idx_BxN.shape, bool)  # greedy chain: every head so far hit
    chain = jnp.zeros(idx_BxN.shape, jnp.float32)
    w_chain = take(valid[-1]) * row_scale_Bx1
    for k in range(k_heads):
      lg = logits_BxNxKxV[:, :, k]
      label = take(_shift(am, k + 1))
      w = take(valid[k]) * row_scale_Bx1
      denom = jnp.maximum(w.sum(), 1.0)
      ce = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, label[..., None], -1)[..., 0]
      ce = (ce * w).sum() / denom
      hit = jnp.argmax(lg, -1) == label
      metrics[f"ce_{k}"], metrics[f"acc_{k}"] = ce, (hit * w).sum() / denom
      total = total + self.decay ** k * ce
      # the drafted chain is on the greedy path only where the data followed the target
      follows = take(_shift(tokens, k + 1) == _shift(am, k))
      run_B = run_B & hit & follows
      chain = chain + run_B
      if not train:
        top = jax.lax.top_k(lg, self.eval_ranks)[1]
        for r in range(self.eval_ranks):
          metrics[f"rank{r}_{k}"] = ((top[..., r] == label) * w).sum() / denom
    metrics["tau_proxy"] = 1.0 + (chain * w_chain).sum() / jnp.maximum(w_chain.sum(), 1.0)
    return total, metrics


def rank_accuracies(metrics: dict, num_heads: int, ranks: int = 10) -> list[list[float]]:
  """``acc[k][r]`` from held-out metrics (keys ``heldout_rank{r}_{k}``)."""
  try:
    return [[float(metrics[f"heldout_rank{r}_{k}"]) for r in range(ranks)] for k in range(num_heads)]
  except KeyError as e:
    raise EagleJaxError(f"held-out metrics lack {e.args[0]!r} (run the held-out evaluation)") from None


def best_tree(acc_KxR, num_nodes: int) -> tuple[tuple[tuple[int, ...], ...], list[float]]:
  """The ``num_nodes`` most probable paths (best first) and their acceptance probabilities."""
  acc = np.asarray(acc_KxR, np.float64)
  k_heads, ranks = acc.shape
  heap = [(-acc[0, r], (r,)) for r in range(ranks)]
  heapq.heapify(heap)
  chosen, probs = [], []
  while heap and len(chosen) < num_nodes:
    neg, path = heapq.heappop(heap)
    chosen.append(path)
    probs.append(-neg)
    if len(path) < k_heads:
      for r in range(ranks):
        heapq.heappush(heap, (neg * acc[len(path), r], path + (r,)))
  return tuple(chosen), probs


def expected_tau(acc_KxR, choices) -> float:
  """1 + the expected number of accepted nodes of a static tree, heads independent."""
  acc = np.asarray(acc_KxR, np.float64)
  total = 1.0
  for path in choices:
    if len(path) > acc.shape[0] or max(path) >= acc.shape[1]:
      continue  # beyond the measured ranks: counted as never accepted
    total += float(np.prod([acc[d, r] for d, r in enumerate(path)]))
  return total


def tune_tree(drafter_cost_ms, acc_KxR, curve: dict[int, float], max_nodes: int = 64) -> dict:
  """Node budget maximising predicted tokens/s = tau(n) / (c(n + 1) + draft cost).

  ``drafter_cost_ms``: one draft step's ms, or ms by tree depth (``{1: ..., 2: ...}``: a tree
  ``d`` deep runs only heads ``0..d-1``). With costs by depth, the best trees using only the
  first ``d`` heads are candidates too, each priced at its own depth."""
  xs = sorted(curve)
  n_max = min(max_nodes, xs[-1] - 1)
  acc = np.asarray(acc_KxR, np.float64)
  by_depth = drafter_cost_ms if isinstance(drafter_cost_ms, dict) else None
  rows, trees = [], {}
  for limit in (range(1, acc.shape[0] + 1) if by_depth else (acc.shape[0],)):
    choices, probs = best_tree(acc[:limit], n_max)
    for n in range(1, len(choices) + 1):
      depth = max(len(c) for c in choices[:n])
      if depth < limit:
        continue  # the same tree as under a smaller limit
      tau = 1 + sum(probs[:n])
      draft = by_depth[depth] if by_depth else drafter_cost_ms
      cost = float(np.interp(n + 1, xs, [curve[x] for x in xs])) + draft
      trees[(n, depth)] = choices[:n]
      rows.append({"total_tokens": n, "depth": depth, "tau": round(tau, 3),
                   "ms_per_step": round(cost, 2), "tokens_per_s": round(1000 * tau / cost, 2)})
  best = max(rows, key=lambda r: r["tokens_per_s"])
  vanilla = 1000 / curve[xs[0]] if xs[0] == 1 else float("nan")
  return {"total_tokens": best["total_tokens"],
          "tree": [list(c) for c in trees[(best["total_tokens"], best["depth"])]],
          "predicted_tau": best["tau"], "predicted_tokens_per_s": best["tokens_per_s"],
          "vanilla_tokens_per_s": round(vanilla, 2),
          "predicted_speedup": round(best["tokens_per_s"] / vanilla, 3),
          "default63_predicted_tau": round(expected_tau(acc_KxR, MEDUSA_DEFAULT_CHOICES), 3),
          "draft_ms": ({d: round(v, 2) for d, v in by_depth.items()} if by_depth
                       else round(drafter_cost_ms, 2)),
          "verify_cost_ms": curve, "rows": rows,
          "method": "Medusa tree search: paths ranked by the product of held-out per-head rank "
                    "accuracies (also within the first d heads); cost = verify c(n+1) + timed "
                    "draft step at the tree's depth"}
