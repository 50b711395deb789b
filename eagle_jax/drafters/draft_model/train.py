"""A classic draft model (small Llama sharing the target's tokenizer) distilled from the target.

:class:`DistillTask` is a :class:`~eagle_jax.training.trainer.Task` on feature-cache rows: the draft reads
the packed rows (block-diagonal causal attention, cached positions) and at position t learns the
target's next-token distribution ``softmax(hidden[t] @ lm_head^T)`` (soft cross entropy). The
trained module is a plain :class:`~eagle_jax.model.transformer.Transformer`: save it with
:func:`~eagle_jax.model.checkpoints.save_hf_folder` and draft with
:class:`~eagle_jax.drafters.draft_model.drafter.DraftModelDrafter`.

Choosing a size: :func:`time_draft_sizes` measures the draft/target decode-step cost ratio c of
candidate shapes; :func:`predicted_speedup` turns c and a per-token acceptance a into the
expected speedup of chain drafting.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.decoding.costs import chain_tokens, fastest_ms
from eagle_jax.decoding.sampling import greedy_token
from eagle_jax.drafters.eagle.head import Frozen
from eagle_jax.drafters.eagle.train import _shift
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.config import ModelConfig
from eagle_jax.model.transformer import KVCache, Transformer
from eagle_jax.training.features import segment_mask
from eagle_jax.training.trainer import at_positions, sample_positions


@dataclasses.dataclass(frozen=True)
class DraftModelConfig:
  num_layers: int = 4
  hidden_size: int = 256
  intermediate_size: int = 768
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  embed_init: Literal["pca", "random"] = "pca"
  positions_per_row: int = 128  # loss positions sampled per row (0 = all)
  eval_steps: int = 4  # greedy chain length of the held-out tau_proxy

  def validate(self):
    for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                 "head_dim", "eval_steps"):
      if getattr(self, name) < 1:
        raise EagleJaxError(f"draft model {name} must be >= 1, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise EagleJaxError(f"draft model num_heads ({self.num_heads}) must be a multiple of "
                          f"num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise EagleJaxError(f"draft model head_dim must be even (RoPE), got {self.head_dim}")
    if self.embed_init not in ("pca", "random"):
      raise EagleJaxError(f"draft model embed_init must be 'pca' or 'random', got {self.embed_init!r}")
    if self.positions_per_row < 0:
      raise EagleJaxError(f"draft model positions_per_row must be >= 0, got {self.positions_per_row}")

  def model_config(self, target: ModelConfig) -> ModelConfig:
    """A tied-embedding Llama with the target's vocabulary, RoPE, norm eps and special ids."""
    self.validate()
    if self.embed_init == "pca" and self.hidden_size > min(target.hidden_size, target.vocab_size):
      raise EagleJaxError(f"draft hidden_size {self.hidden_size} exceeds the target's "
                          f"{target.hidden_size}: 'pca' embed_init needs fewer dims; use 'random'")
    return ModelConfig(
        vocab_size=target.vocab_size, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size, num_layers=self.num_layers,
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        rms_norm_eps=target.rms_norm_eps, tie_word_embeddings=True, attention_bias=False,
        max_position_embeddings=target.max_position_embeddings, architecture="llama",
        bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids)


def pca_embedding(e_VxD: np.ndarray, k: int, max_rows: int = 32768, seed: int = 0) -> np.ndarray:
  """Centred ``e_VxD`` projected on its top ``k`` principal directions ``[V, k]``, rescaled to
  the RMS of ``e_VxD``. The directions are the right singular vectors of the centred matrix,
  computed as eigenvectors of its ``[D, D]`` Gram matrix over at most ``max_rows`` random rows
  (for SmolLM2's 49152 x 576 embedding: 1.3 s on 2 CPU cores, an SVD of 8192 rows takes 10 s)."""
  e_VxD = np.asarray(e_VxD, np.float32)
  c_VxD = e_VxD - e_VxD.mean(0)
  sub = c_VxD
  if len(c_VxD) > max_rows:
    sub = c_VxD[np.sort(np.random.default_rng(seed).choice(len(c_VxD), max_rows, replace=False))]
  _, vecs_DxD = np.linalg.eigh((sub.T @ sub).astype(np.float64))  # ascending eigenvalues
  p_VxK = c_VxD @ vecs_DxD[:, ::-1][:, :k].astype(np.float32)
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
  return p_VxK * (rms(e_VxD) / max(rms(p_VxK), 1e-12))


def init_draft_model(config: ModelConfig, target_embed_VxD, rngs: nnx.Rngs,
                     embed_init: str = "pca") -> Transformer:
  """A fresh draft; with ``"pca"`` its (tied) embedding is :func:`pca_embedding` of the target's.

  Why: a tied target's logits are ``h . e_v``; the mean embedding adds the same ``h . mu`` to
  every token (softmax ignores it) and the top principal directions carry most of the rest, so
  ``E_pca`` keeps the target's token geometry at the draft's width: through the tied head the
  draft starts with related tokens close in both input and output space instead of a random
  code book it must first untangle (tests: held-out cross entropy at step 0 is far lower). For
  an untied target the embedding still gives the input side the target's token similarities.
  """
  model = Transformer(config, rngs=rngs)
  if embed_init == "pca":
    model.embed[...] = jnp.asarray(pca_embedding(np.asarray(target_embed_VxD, np.float32),
                                                 config.hidden_size), model.embed.dtype)
  elif embed_init != "random":
    raise EagleJaxError(f"embed_init must be 'pca' or 'random', got {embed_init!r}")
  return model


@dataclasses.dataclass(frozen=True)
class DistillTask:
  """Distils ``target`` (``frozen`` = its embedding and LM head) into a draft of ``config``."""

  config: DraftModelConfig
  target: ModelConfig
  frozen: Frozen
  keys: ClassVar[tuple[str, ...]] = ("tokens", "positions", "segments", "loss_mask",
                                     "target_argmax", "hidden")

  def __post_init__(self):
    self.config.model_config(self.target)  # validates

  @classmethod
  def of(cls, target: Transformer, config: DraftModelConfig = DraftModelConfig()) -> "DistillTask":
    return cls(config=config, target=target.config, frozen=Frozen.of(target))

  def init_module(self, rngs: nnx.Rngs) -> Transformer:
    return init_draft_model(self.config.model_config(self.target), self.frozen.embed_VxD, rngs,
                            self.config.embed_init)

  def loss(self, module: Transformer, frozen: Frozen, batch, key, train):
    return distill_loss(module, frozen, batch, key, train=train,
                        positions_per_row=self.config.positions_per_row,
                        eval_steps=self.config.eval_steps)


def distill_loss(draft: Transformer, frozen: Frozen, batch, key, *, train: bool,
                 positions_per_row: int, eval_steps: int):
  """Soft cross entropy of the draft against the target's next-token distribution.

  Position t (the draft has read tokens ..t) is scored against ``softmax(hidden[t] @ W^T)``,
  the distribution of token t+1, when ``valid[t] = segments[t] > 0 & loss_mask[t]``. This is
  EAGLE's convention (eagle_train.py scores the distribution of ``hidden[u]``, u = t+1, when
  ``loss_mask[u]``): a distribution counts when the last token it conditions on is an
  assistant token, so the set of scored target distributions is the same for both drafters
  (the distribution after a reply's last token is included; the one predicting a reply's
  first token from the prompt is not).

  Metrics: ``acc_0`` (draft argmax == ``target_argmax``), ``ce_0``; when ``train`` is False
  also ``tau_proxy``: 1 + the expected length of a greedy chain of ``eval_steps`` drafts from
  t, teacher forced (step j hits when the draft's argmax at t+j equals ``target_argmax[t+j]``
  and, for j > 0, the data token t+j is ``target_argmax[t+j-1]``), over positions whose whole
  chain is valid and in one conversation.
  """
  tokens, pos, seg, am = batch["tokens"], batch["positions"], batch["segments"], batch["target_argmax"]
  valid_BxT = (seg > 0) & batch["loss_mask"]
  h_BxTxD = draft(tokens, pos, None, mask_BxTxT=segment_mask(seg), with_logits=False,
                  causal=True).hidden_BxTxD
  teacher_BxTxD = jax.lax.stop_gradient(batch["hidden"])
  if train:
    idx_BxN, w_BxN = sample_positions(key, valid_BxT, positions_per_row)
    h_BxNxD, teacher_BxNxD, am_BxN = (at_positions(x, idx_BxN)
                                      for x in (h_BxTxD, teacher_BxTxD, am))
  else:
    h_BxNxD, teacher_BxNxD, am_BxN = h_BxTxD, teacher_BxTxD, am
    w_BxN = valid_BxT.astype(jnp.float32)
  logits_BxNxV = draft.lm_logits(h_BxNxD)
  p_BxNxV = jax.nn.softmax(frozen.target_logits(teacher_BxNxD), -1)
  ce_BxN = -(p_BxNxV * jax.nn.log_softmax(logits_BxNxV, -1)).sum(-1)
  denom = jnp.maximum(w_BxN.sum(), 1.0)
  ce = (ce_BxN * w_BxN).sum() / denom
  draft_am_BxN = jnp.argmax(logits_BxNxV, -1)
  metrics = {"ce_0": ce, "acc_0": ((draft_am_BxN == am_BxN) * w_BxN).sum() / denom}
  if not train:  # every position is evaluated: N == T
    accept_BxT, chain_BxT = jnp.ones(seg.shape, bool), jnp.zeros(seg.shape, jnp.float32)
    valid_all_BxT = valid_BxT
    for j in range(eval_steps):
      valid_all_BxT &= (_shift(seg, j) == seg) & _shift(valid_BxT, j, False)
      hit = _shift(draft_am_BxN, j) == _shift(am, j)
      follows = (_shift(tokens, j) == _shift(am, j - 1)) if j else True
      accept_BxT = accept_BxT & hit & follows
      chain_BxT = chain_BxT + accept_BxT
    wa = valid_all_BxT.astype(jnp.float32)
    metrics["tau_proxy"] = 1.0 + (chain_BxT * wa).sum() / jnp.maximum(wa.sum(), 1.0)
  return ce, metrics


def predicted_speedup(alpha: float, gamma: int, c: float) -> float:
  """Expected speedup of chain drafting: ``(1 - a^(g+1)) / ((1 - a)(g c + 1))`` for i.i.d.
  per-token acceptance ``a``, ``g`` drafts per step, draft/target step cost ratio ``c``."""
  if not 0.0 <= alpha <= 1.0 or gamma < 1 or c < 0:
    raise EagleJaxError(f"need 0 <= alpha <= 1, gamma >= 1, c >= 0 (got {alpha}, {gamma}, {c})")
  return chain_tokens(alpha, gamma) / (gamma * c + 1.0)


def _decode_step_ms(model: Transformer, steps: int, context: int, repeats: int) -> float:
  """Fastest ms (after a warm-up) of one batch-1 one-token decode step: ``steps`` chained steps
  (argmax fed back, KV cache carried, as when drafting) after ``context`` cached tokens, in one
  jitted call."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, cache, tok_1x1):
    m = nnx.merge(graphdef, state)

    def body(_, carry):
      cache, tok_1x1 = carry
      out = m(tok_1x1, cache.lengths_B[:, None], cache)
      return out.cache, greedy_token(out.logits_BxTxV)

    return jax.lax.fori_loop(0, steps, body, (cache, tok_1x1))[1]

  cache = KVCache.init(model.config, 1, context + steps, model.embed.dtype)
  cache = cache.replace(lengths_B=jnp.array([context], jnp.int32))
  return fastest_ms(run, state, cache, jnp.ones((1, 1), jnp.int32), repeats=repeats) / steps


def time_draft_sizes(target: Transformer, configs: dict[str, DraftModelConfig], gamma: int = 4,
                     repeats: int = 5, context: int = 192) -> dict:
  """Per candidate draft shape: ``{"params", "draft_ms", "ratio_c"}`` (random weights, the
  target's dtype), plus ``"target_ms"``; ms = one decode step, timed over ``gamma`` chained
  steps after ``context`` cached tokens (see :func:`_decode_step_ms`)."""
  if gamma < 1:
    raise EagleJaxError(f"--gamma must be >= 1 (draft steps timed per call), got {gamma}")
  out: dict = {"target_ms": _decode_step_ms(target, gamma, context, repeats)}
  for name, cfg in configs.items():
    draft = Transformer(dataclasses.replace(cfg, embed_init="random").model_config(target.config),
                        rngs=nnx.Rngs(0), param_dtype=target.embed.dtype)
    ms = _decode_step_ms(draft, gamma, context, repeats)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(draft, nnx.Param)))
    out[name] = {"params": int(params), "draft_ms": ms, "ratio_c": ms / out["target_ms"]}
  return out
