"""EAGLE draft heads (EAGLE-1 and EAGLE-3) in Flax NNX.

A head predicts the target's next top-level feature from ``concat(embed(token_{t+1}),
feature_t)`` with one decoder layer of the target's own architecture (:class:`DecoderLayer`,
first input norm skipped) and reads tokens off it with an LM head:

- **EAGLE-1**: feature = the target's top hidden state (after the final norm); the head's
  output goes straight into the target's frozen LM head.
- **EAGLE-3**: feature = ``fuse(concat(norm(low), norm(mid), norm(high)))`` of three target
  layers (``Linear(3h -> h)``); when drafting deeper the head's own output is fed back instead;
  either passes ``hidden_norm`` before ``fc``.
  The output passes a norm and a trainable LM head over a reduced draft vocabulary; ``d2t``
  maps draft ids to target ids.

The target's embedding and LM head are never copied into the head: they arrive as
:class:`Frozen` arrays at call time (for a tied model both are the same array).

Attention: the head has one layer of K/V. Callers give ``visible_BxTxS`` (which of the S slots
each new input sees once the new K/V are written) and the slots the new K/V go to, so the same
code serves causal training, training-time-test unrolling and tree drafting.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.errors import EagleJaxError
from eagle_jax.model.blocks import Blocks
from eagle_jax.model.config import ModelConfig
from eagle_jax.model.ops import linear
from eagle_jax.model.transformer import (
  AttnBias,
  DecoderLayer,
  Linear,
  RMSNorm,
  Transformer,
  blocks_of,
  empty_kv,
  rope_tables,
)


@dataclasses.dataclass(frozen=True)
class EagleHeadConfig:
  version: int  # 1 or 3
  target: ModelConfig
  fuse_layers: tuple[int, ...] = ()  # EAGLE-3: Hugging Face hidden_states indices (low, mid, high)
  draft_vocab: int = 0  # EAGLE-3: reduced vocabulary size (0 = the target's)

  def __post_init__(self):
    if self.version not in (1, 3):
      raise EagleJaxError(f"EAGLE version must be 1 or 3, got {self.version}")
    if self.version == 3 and len(self.fuse_layers) < 2:
      raise EagleJaxError("EAGLE-3 needs at least two fuse_layers (low, mid, high)")
    if self.version == 1 and (self.fuse_layers or self.draft_vocab):
      raise EagleJaxError("EAGLE-1 uses the target's top feature and full vocabulary "
                          "(fuse_layers and draft_vocab are EAGLE-3 options)")
    for i in self.fuse_layers:
      if not 0 <= i <= self.target.num_layers:
        raise EagleJaxError(f"fuse layer {i} outside [0, {self.target.num_layers}]")

  @property
  def vocab(self) -> int:
    return self.draft_vocab or self.target.vocab_size

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """What the engine must hand the drafter: () = the top hidden state."""
    return self.fuse_layers

  def to_dict(self) -> dict:
    return {"version": self.version, "target": self.target.to_hf_dict(),
            "fuse_layers": list(self.fuse_layers), "draft_vocab": self.draft_vocab}

  @classmethod
  def from_dict(cls, d: dict) -> "EagleHeadConfig":
    return cls(version=int(d["version"]), target=ModelConfig.from_hf_dict(d["target"]),
               fuse_layers=tuple(d["fuse_layers"]), draft_vocab=int(d["draft_vocab"]))


def default_fuse_layers(num_layers: int) -> tuple[int, int, int]:
  """Low, middle and high target layers, as EAGLE-3's reference code picks them."""
  return (2, num_layers // 2, num_layers - 3)


@flax.struct.dataclass
class Frozen:
  """The target's token embedding ``[V, D]`` and LM head ``[V, D]`` (frozen, shared).

  For drafting over a reduced vocabulary with the target's own head (EAGLE-1/2, as FR-Spec
  does), ``draft_head_KxD`` holds the LM-head rows of the ``K`` target ids in ``d2t_K``, copied
  once when the drafter is built (a gather inside the jitted step would copy them every step).
  ``*_blocks``: the same heads as integer blocks where the target has them (GGUF checkpoints;
  :mod:`eagle_jax.kernels` reads them for passes over 1-16 rows).
  """

  embed_VxD: jax.Array
  lm_head_VxD: jax.Array
  draft_head_KxD: jax.Array | None = None
  d2t_K: jax.Array | None = None
  lm_head_blocks: Blocks | None = None
  draft_head_blocks: Blocks | None = None

  @classmethod
  def of(cls, target: Transformer, draft_ids=None) -> "Frozen":
    """``draft_ids``: target ids the drafter may propose (None = the whole vocabulary)."""
    if target.lm_head is None:
      head, blocks = target.embed[...], blocks_of(target.embed_blocks)
    else:
      head, blocks = target.lm_head.weight[...], blocks_of(target.lm_head.blocks)
    if draft_ids is None:
      return cls(embed_VxD=target.embed[...], lm_head_VxD=head, lm_head_blocks=blocks)
    ids = jnp.asarray(draft_ids, jnp.int32)
    if ids.ndim != 1 or ids.size == 0 or int(ids.min()) < 0 or int(ids.max()) >= head.shape[0]:
      raise EagleJaxError(f"draft vocabulary must be 1 to {head.shape[0]} target ids in "
                          f"[0, {head.shape[0]})")
    return cls(embed_VxD=target.embed[...], lm_head_VxD=head, draft_head_KxD=head[ids], d2t_K=ids,
               lm_head_blocks=blocks, draft_head_blocks=None if blocks is None else blocks.take(ids))

  def target_logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    return linear(hidden_BxTxD, self.lm_head_VxD, self.lm_head_blocks).astype(jnp.float32)

  def draft_logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    """Logits over the draft vocabulary (the whole target vocabulary if none was chosen)."""
    if self.draft_head_KxD is None:
      return self.target_logits(hidden_BxTxD)
    return linear(hidden_BxTxD, self.draft_head_KxD, self.draft_head_blocks).astype(jnp.float32)


class EagleHead(nnx.Module):

  def __init__(self, config: EagleHeadConfig, *, rngs: nnx.Rngs, d2t=None, lm_head_init=None):
    c, d = config, config.target.hidden_size
    self.config = config
    v3 = c.version == 3
    # EAGLE-3 reads raw residual streams (rms in the hundreds, outlier dims in the 10^4s for
    # SmolLM2): each is RMS-normalised before fusion, and every step's input feature (fused, or
    # the head's own previous output) passes a norm, as in EAGLE-3's reference design.
    self.fuse_norms = nnx.List([RMSNorm(d, c.target.rms_norm_eps) for _ in c.fuse_layers]) if v3 else None
    self.fuse = Linear(len(c.fuse_layers) * d, d, bias=False, rngs=rngs) if v3 else None
    self.hidden_norm = RMSNorm(d, c.target.rms_norm_eps) if v3 else None
    self.fc = Linear(2 * d, d, bias=True, rngs=rngs)
    self.layer = DecoderLayer(c.target, rngs=rngs, skip_input_norm=True)
    self.norm = RMSNorm(d, c.target.rms_norm_eps) if c.version == 3 else None
    if c.version == 3:
      d2t = jnp.arange(c.vocab, dtype=jnp.int32) if d2t is None else jnp.asarray(d2t, jnp.int32)
      if d2t.shape != (c.vocab,):
        raise EagleJaxError(f"d2t map has shape {d2t.shape}, expected ({c.vocab},)")
      self.d2t = nnx.Variable(d2t)  # not a Param: never trained
      self.lm_head = Linear(d, c.vocab, bias=False, rngs=rngs)
      if lm_head_init is not None:  # start from the target's LM head rows of the draft vocab
        self.lm_head.weight[...] = jnp.asarray(lm_head_init)[d2t]
    else:
      self.d2t = None
      self.lm_head = None

  def fuse_features(self, f_BxTxF: jax.Array) -> jax.Array:
    """Target features as the engine hands them -> the head's input feature ``[.., D]``."""
    if self.fuse is None:
      return f_BxTxF
    parts = jnp.split(f_BxTxF, len(self.fuse_norms), axis=-1)
    return self.fuse(jnp.concatenate([n(p) for n, p in zip(self.fuse_norms, parts)], axis=-1))

  def __call__(self, tokens_BxT, feature_BxTxD, positions_BxT, visible_BxTxS, frozen: Frozen,
               kv, slots_BxT, fresh_cache: bool = False):
    """One head step over T inputs; returns ``(output_BxTxD, new (k, v))``. ``fresh_cache``:
    ``kv`` holds nothing yet (the prompt pass), so attention skips reading it, as the target's
    prompt pass does."""
    if self.hidden_norm is not None:
      feature_BxTxD = self.hidden_norm(feature_BxTxD)
    e_BxTxD = jnp.take(frozen.embed_VxD, tokens_BxT, axis=0).astype(feature_BxTxD.dtype)
    x_BxTxD = self.fc(jnp.concatenate([e_BxTxD, feature_BxTxD], axis=-1))
    cos, sin = rope_tables(self.config.target, positions_BxT, x_BxTxD.dtype)
    bias = AttnBias.from_slots(visible_BxTxS, slots_BxT)
    if fresh_cache:
      bias = bias.replace(cache_BxTxS=None)
    return self.layer(x_BxTxD, cos, sin, bias, kv, slots_BxT)

  def logits(self, out_BxTxD: jax.Array, frozen: Frozen) -> jax.Array:
    """Draft logits over the draft vocabulary (fp32): EAGLE-3's own, else the target head's
    rows that ``frozen`` carries."""
    if self.lm_head is None:
      return frozen.draft_logits(out_BxTxD)
    return self.lm_head(self.norm(out_BxTxD)).astype(jnp.float32)

  def to_target(self, draft_ids, frozen: Frozen):
    """Draft-vocabulary ids -> target token ids."""
    if self.lm_head is not None:
      return self.d2t[...][draft_ids]
    return draft_ids if frozen.d2t_K is None else frozen.d2t_K[draft_ids]

  def init_kv(self, batch: int, slots: int, dtype=jnp.float32):
    return empty_kv(self.config.target, batch, slots, dtype)
