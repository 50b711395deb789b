"""EAGLE draft heads (EAGLE-1 and EAGLE-3) in Flax NNX, as the papers' reference code defines them.

- **EAGLE-1** (also EAGLE-2's weights): ``x = fc([embed(token_{t+1}) | feature_t])`` (``2h -> h``,
  bias unless the checkpoint has none), then one decoder layer of the target's architecture
  without its input norm (:class:`DecoderLayer` with ``skip_input_norm``). The feature is the
  target's top hidden state (after its final norm); the head's output is the predicted next
  feature, read into tokens by the target's own frozen LM head.
- **EAGLE-3**: the target's raw residual streams at three layers (low, mid, high; Hugging Face
  ``hidden_states`` indices) are fused, ``g = fc([low | mid | high])`` (``3h -> h``, no bias).
  The draft layer reads ``[input_layernorm(embed(token)) | hidden_norm(g)]`` (``2h`` wide) into
  q/k/v, keeps ``g`` as its residual, and ends with the usual post-attention norm and MLP:
  ``h = g + attn(...)``, ``h = h + mlp(post_norm(h))``. Draft logits are ``lm_head(norm(h))``
  over a reduced draft vocabulary whose ids map to target ids through ``d2t``. Drafting deeper
  (and training-time test) feeds ``h`` itself, un-normed, back in place of ``g``.

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
  MLP,
  Attention,
  AttnBias,
  DecoderLayer,
  Linear,
  RMSNorm,
  Transformer,
  blocks_of,
  empty_kv,
  rope_tables,
)


# The EAGLE-3 layout of this module (the published one). Heads saved without it used an
# earlier layout (per-layer fuse norms and a 2h -> h projection before the layer), which no
# longer loads: retrain them.
EAGLE3_LAYOUT = "published"


@dataclasses.dataclass(frozen=True)
class EagleHeadConfig:
  """``target``: the target's config, with the draft layer's own sizes where an imported head
  differs (its ``num_layers`` stays the target's: the fuse layers index into it)."""

  version: int  # 1 or 3
  target: ModelConfig
  fuse_layers: tuple[int, ...] = ()  # EAGLE-3: Hugging Face hidden_states indices (low, mid, high)
  draft_vocab: int = 0  # EAGLE-3: reduced vocabulary size (0 = the target's)
  bias: bool = True  # EAGLE-1: fc has a bias (some published heads have none)

  def __post_init__(self):
    if self.version not in (1, 3):
      raise EagleJaxError(f"EAGLE version must be 1 or 3, got {self.version}")
    if self.version == 3 and len(self.fuse_layers) != 3:
      raise EagleJaxError(f"EAGLE-3 fuses three target layers (low, mid, high), got "
                          f"{len(self.fuse_layers)}")
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
    out = {"version": self.version, "target": self.target.to_hf_dict(),
           "fuse_layers": list(self.fuse_layers), "draft_vocab": self.draft_vocab,
           "bias": self.bias}
    return {**out, "layout": EAGLE3_LAYOUT} if self.version == 3 else out

  @classmethod
  def from_dict(cls, d: dict, source: str = "drafter.json") -> "EagleHeadConfig":
    if int(d["version"]) == 3 and d.get("layout") != EAGLE3_LAYOUT:
      raise EagleJaxError(f"{source}: an EAGLE-3 head in an earlier layout (fuse norms and a "
                          "2h -> h projection), which no longer loads; retrain it (eagle-jax "
                          "train configs/train/eagle3-quick.yaml)")
    return cls(version=int(d["version"]), target=ModelConfig.from_hf_dict(d["target"]),
               fuse_layers=tuple(d["fuse_layers"]), draft_vocab=int(d["draft_vocab"]),
               bias=bool(d.get("bias", True)))


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
    c, d, eps = config, config.target.hidden_size, config.target.rms_norm_eps
    self.config = config
    if c.version == 1:
      self.fc = Linear(2 * d, d, bias=c.bias, rngs=rngs)
      self.layer = DecoderLayer(c.target, rngs=rngs, skip_input_norm=True)
      self.d2t = self.lm_head = None
      return
    self.fc = Linear(len(c.fuse_layers) * d, d, bias=False, rngs=rngs)
    self.input_norm = RMSNorm(d, eps)
    self.hidden_norm = RMSNorm(d, eps)
    self.attn = Attention(c.target, rngs=rngs, input_size=2 * d)
    self.post_norm = RMSNorm(d, eps)
    self.mlp = MLP(c.target, rngs=rngs)
    self.norm = RMSNorm(d, eps)
    d2t = jnp.arange(c.vocab, dtype=jnp.int32) if d2t is None else jnp.asarray(d2t, jnp.int32)
    if d2t.shape != (c.vocab,):
      raise EagleJaxError(f"d2t map has shape {d2t.shape}, expected ({c.vocab},)")
    self.d2t = nnx.Variable(d2t)  # draft id -> target id (absolute); not a Param: never trained
    self.lm_head = Linear(d, c.vocab, bias=False, rngs=rngs)
    if lm_head_init is not None:  # start from the target's LM head rows of the draft vocab
      self.lm_head.weight[...] = jnp.asarray(lm_head_init)[d2t]

  def fuse_features(self, f_BxTxF: jax.Array) -> jax.Array:
    """Target features as the engine hands them -> the head's input feature ``[.., D]``:
    EAGLE-1's top hidden state as it is, EAGLE-3's ``fc`` of the concatenated layers."""
    return f_BxTxF if self.config.version == 1 else self.fc(f_BxTxF)

  def __call__(self, tokens_BxT, feature_BxTxD, positions_BxT, visible_BxTxS, frozen: Frozen,
               kv, slots_BxT, fresh_cache: bool = False):
    """One head step over T inputs; returns ``(output_BxTxD, new (k, v))``. ``feature`` is
    :meth:`fuse_features`' output, or the head's own output of the previous depth.
    ``fresh_cache``: ``kv`` holds nothing yet (the prompt pass), so attention skips reading it,
    as the target's prompt pass does."""
    e_BxTxD = jnp.take(frozen.embed_VxD, tokens_BxT, axis=0).astype(feature_BxTxD.dtype)
    cos, sin = rope_tables(self.config.target, positions_BxT, feature_BxTxD.dtype)
    bias = AttnBias.from_slots(visible_BxTxS, slots_BxT)
    if fresh_cache:
      bias = bias.replace(cache_BxTxS=None)
    if self.config.version == 1:
      x_BxTxD = self.fc(jnp.concatenate([e_BxTxD, feature_BxTxD], axis=-1))
      return self.layer(x_BxTxD, cos, sin, bias, kv, slots_BxT)
    x_BxTx2D = jnp.concatenate([self.input_norm(e_BxTxD), self.hidden_norm(feature_BxTxD)], -1)
    attn_out, new_kv = self.attn(x_BxTx2D, cos, sin, bias, kv, slots_BxT)
    h_BxTxD = feature_BxTxD + attn_out
    return h_BxTxD + self.mlp(self.post_norm.deferred(h_BxTxD)), new_kv

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
