"""Training objective of EAGLE heads on feature-cache rows (a :class:`~eagle_jax.training.trainer.Task`).

Row layout: packed conversations (``segments``), ``hidden`` = the target's top feature,
``layers`` = the EAGLE-3 fusion layers, ``target_argmax`` = the target's greedy next token.

Step 0 (teacher forced): at position t the head reads ``(token_{t+1}, feature_t)`` and predicts
the target's feature at t+1 and its next-token distribution (the target's LM head applied to
``hidden[t+1]``). Training-time test (EAGLE-3, ``ttt_steps > 1``): step j reads
``(token_{t+1+j}, head output of step j-1 at t)`` at position ``pos[t] + j``; its queries see
step-0 keys of positions <= t in the same conversation plus the keys of steps 1..j at t: the
same attention a tree node at depth j sees when drafting.

- EAGLE-1: SmoothL1(output_0, hidden[t+1]) + ``ce_weight`` x cross entropy against the target's
  distribution; uniform feature noise on the inputs.
- EAGLE-3: sum_j ``0.8^j`` x cross entropy over the draft vocabulary (target distribution
  restricted to it; positions whose target argmax lies outside are skipped); no regression.

Metrics: ``acc_j`` (draft argmax == target argmax at step j) and ``tau_proxy``: 1 + expected
accepted length of a greedy chain of ``eval_steps`` drafts, teacher forced on the data where
the data follows the target's argmax (a cheap held-out stand-in for tau; the real tau comes
from decoding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig, Frozen
from eagle_jax.errors import EagleJaxError
from eagle_jax.training.features import segment_mask
from eagle_jax.training.trainer import at_positions, sample_positions


def reply_token_counts(shards, vocab: int) -> np.ndarray:
  """How often each target id occurs in the training rows' assistant replies, counting both
  the reply tokens and the target's greedy predictions there."""
  counts = np.zeros(vocab, np.int64)
  for i in range(0, shards.num_rows, 64):
    r = shards.rows(range(i, min(i + 64, shards.num_rows)), ("tokens", "loss_mask", "target_argmax"))
    np.add.at(counts, r["tokens"][r["loss_mask"]], 1)
    np.add.at(counts, r["target_argmax"][r["loss_mask"]], 1)
  return counts


def top_tokens(counts: np.ndarray, size: int, always=()) -> np.ndarray:
  """The ``size`` most frequent ids of ``counts`` (ties by id; ``always`` ids forced in),
  sorted by id: a draft-to-target map."""
  if not 1 <= size <= counts.shape[0]:
    raise EagleJaxError(f"draft vocabulary size {size} outside [1, {counts.shape[0]}]")
  counts = counts.copy()
  counts[list(always)] = counts.max() + 1
  top = np.argsort(-counts, kind="stable")[:size]
  return np.sort(top).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class EagleTask:
  config: EagleHeadConfig
  frozen: Frozen
  ttt_steps: int = 1
  eval_steps: int = 4
  ce_weight: float = 0.1
  reg_weight: float = 1.0
  step_decay: float = 0.8
  feature_noise: float = 0.2
  positions_per_row: int = 0  # training: LM-head (cross entropy) positions sampled per row; 0 = all
  d2t: np.ndarray | None = None

  @property
  def keys(self):
    base = ("tokens", "positions", "segments", "loss_mask", "target_argmax", "hidden")
    return base + (("layers",) if self.config.version == 3 else ())

  def init_module(self, rngs):
    return EagleHead(self.config, rngs=rngs, d2t=self.d2t,
                     lm_head_init=self.frozen.lm_head_VxD if self.config.version == 3 else None)

  def loss(self, head: EagleHead, frozen: Frozen, batch, key, train):
    steps = self.ttt_steps if train else max(self.ttt_steps, self.eval_steps)
    return eagle_loss(head, frozen, batch, key, steps=steps, train=train, task=self)


def _shift(x_BxT, j, fill=0):
  """``y[:, t] = x[:, t + j]`` (``fill`` past the end)."""
  if j == 0:
    return x_BxT
  pad = jnp.full(x_BxT.shape[:1] + (j,) + x_BxT.shape[2:], fill, x_BxT.dtype)
  return jnp.concatenate([x_BxT[:, j:], pad], 1)


def unroll(head: EagleHead, frozen: Frozen, tokens, feat_BxTxD, pos, seg, steps: int):
  """Head outputs ``[B, T, D]`` for steps 0..steps-1 (step j reads ``token_{t+1+j}``)."""
  b, t = tokens.shape
  seg0 = segment_mask(seg)  # [B, T, T]
  eye = jnp.broadcast_to(jnp.eye(t, dtype=bool)[None], (b, t, t))
  hidden_steps = jnp.zeros((b, t, t), bool)
  kv = head.init_kv(b, steps * t, feat_BxTxD.dtype)
  outs, x = [], feat_BxTxD
  for j in range(steps):
    mask = jnp.concatenate([seg0] + [eye] * j + [hidden_steps] * (steps - 1 - j), 2)
    slots = jnp.broadcast_to(j * t + jnp.arange(t), (b, t))
    x, kv = head(_shift(tokens, 1 + j), x, pos + j, mask, frozen, kv, slots, fresh_cache=j == 0)
    outs.append(x)
  return outs


def eagle_loss(head: EagleHead, frozen: Frozen, batch, key, *, steps, train, task):
  tokens, pos, seg = batch["tokens"], batch["positions"], batch["segments"]
  hidden = batch["hidden"]
  b, t = tokens.shape
  v3 = head.config.version == 3
  feat = batch["layers"].reshape(b, t, -1) if v3 else hidden
  if train and task.feature_noise:
    amp = task.feature_noise / 2 * 512 / t
    feat = feat + jax.random.uniform(key, feat.shape, feat.dtype, -amp, amp)
  outs = unroll(head, frozen, tokens, head.fuse_features(feat), pos, seg, steps)
  if v3:
    in_vocab = jnp.zeros((frozen.lm_head_VxD.shape[0],), bool).at[head.d2t[...]].set(True)
    sub_head = frozen.lm_head_VxD[head.d2t[...]]
  valid = [(_shift(seg, 1 + j) == seg) & (seg > 0) & _shift(batch["loss_mask"], 1 + j, False)
           for j in range(steps)]
  # The vocabulary-sized products (the target's distribution and the head's logits, forward and
  # backward) cost several times the head's own layer: in training they run only at
  # ``positions_per_row`` positions per row drawn among step 0's valid ones, each weighted by
  # the inverse of its chance of being drawn (see sample_positions); the feature regression
  # and the head's layer still cover every position.
  idx_BxN, w0_BxN = sample_positions(jax.random.fold_in(key, 1), valid[0], task.positions_per_row if train else 0)
  row_scale_Bx1 = w0_BxN.max(1, keepdims=True)
  take = lambda x: at_positions(x, idx_BxN)
  total, metrics = 0.0, {}
  if not v3:  # EAGLE-1's feature regression, step 0 only, at every valid position
    w_all = valid[0].astype(jnp.float32)
    reg = jnp.abs(outs[0] - jax.lax.stop_gradient(_shift(hidden, 1)))
    reg = jnp.where(reg < 1.0, 0.5 * reg ** 2, reg - 0.5).mean(-1)
    reg = (reg * w_all).sum() / jnp.maximum(w_all.sum(), 1.0)
    metrics["reg_0"] = reg
    total = total + task.reg_weight * reg
  accept_run = jnp.ones(idx_BxN.shape, bool)
  chain_ok = jnp.zeros(idx_BxN.shape, jnp.float32)
  valid_all = jnp.ones(idx_BxN.shape, bool)
  for j, out in enumerate(outs):
    h_u = jax.lax.stop_gradient(_shift(hidden, 1 + j))
    valid_j = take(valid[j])
    valid_all = valid_all & valid_j  # chain proxy: an out-of-vocabulary target is a miss, not a skip
    logits = head.logits(take(out), frozen)
    am_u = take(_shift(batch["target_argmax"], 1 + j))
    if v3:
      p = jax.nn.softmax(jnp.einsum("btd,vd->btv", take(h_u), sub_head).astype(jnp.float32), -1)
      valid_j = valid_j & in_vocab[am_u]
    else:
      p = jax.nn.softmax(frozen.target_logits(take(h_u)), -1)
    w = valid_j * row_scale_Bx1
    denom = jnp.maximum(w.sum(), 1.0)
    ce = -(p * jax.nn.log_softmax(logits, -1)).sum(-1)
    ce = (ce * w).sum() / denom
    hit = head.to_target(jnp.argmax(logits, -1), frozen) == am_u
    metrics[f"acc_{j}"] = (hit * w).sum() / denom
    metrics[f"ce_{j}"] = ce
    if v3 and j < task.ttt_steps:
      total = total + task.step_decay ** j * ce
    elif j == 0 and not v3:
      total = total + task.ce_weight * ce
    # greedy chain proxy: step j's input token must be what greedy decoding would have fed
    follows = take(_shift(tokens, 1 + j) == _shift(batch["target_argmax"], j)) if j else True
    accept_run = accept_run & hit & follows
    chain_ok = chain_ok + accept_run
  wa = valid_all * row_scale_Bx1
  metrics["tau_proxy"] = 1.0 + (chain_ok * wa).sum() / jnp.maximum(wa.sum(), 1.0)
  return total, metrics
