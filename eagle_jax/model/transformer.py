"""One Llama-family decoder in Flax NNX, with an explicit KV cache pytree.

Llama, Mistral and Qwen2 differ only by :class:`~eagle_jax.model.config.ModelConfig`
(QKV bias, tied embeddings, RoPE scaling), never by forked code.

Shape suffixes: B batch, T new tokens, S cache slots, D hidden, H query heads,
K kv heads, G query heads per kv head, Dh head dim, F ffn, V vocab, L layers.

Cache semantics: row ``b`` holds ``cache.lengths[b]`` committed tokens in slots
``0 .. lengths[b]-1`` (slot index == position for plain decoding). A forward over T new
tokens writes their K/V at slots ``lengths[b] + t`` and lets query ``t`` see every
committed slot plus the new tokens allowed by ``mask_BxTxT`` (causal by default; the
speculative verify step passes a tree's ancestor mask). ``lengths`` then advances by
``num_valid_B`` (default T); slots past ``lengths`` are garbage and get overwritten.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import parallel
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.blocks import BLOCK, Blocks
from eagle_jax.model.config import ModelConfig
from eagle_jax.model.ops import Normed, attend, greedy_token, linear, rms_norm


class WeightBlocks(nnx.Variable):
  """A weight's integer blocks (:class:`eagle_jax.model.blocks.Blocks`), kept beside its float32
  parameter when the checkpoint stores it that way; not trained, not a :class:`nnx.Param`."""


def blocks_of(variable: WeightBlocks | None) -> Blocks | None:
  return None if variable is None else variable.get_value()


def empty_kv(config: ModelConfig, batch: int, slots: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Zero keys and values of one layer, ``[B, K, S, Dh]`` each (the cache layout)."""
  z = jnp.zeros((batch, config.num_kv_heads, slots, config.head_dim), dtype)
  return z, z


@flax.struct.dataclass
class KVCache:
  """Per-layer keys/values ``[B, K, S, Dh]`` (row, kv head, slot, head dim) and the committed
  length of each row."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths_B: jax.Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
    """Empty, laid out over the current mesh if any (:data:`eagle_jax.parallel.CACHE_AXES`)."""
    zeros = tuple(parallel.constrain(empty_kv(config, batch, max_len, dtype)[0], parallel.CACHE_AXES,
                                     "KV cache") for _ in range(config.num_layers))
    return cls(k=zeros, v=zeros, lengths_B=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]


@flax.struct.dataclass
class Output:
  """What a forward pass returns.

  ``hidden_BxTxD`` is the top hidden state as fed to the LM head (after the final norm;
  Hugging Face's ``hidden_states[-1]``). ``layer_hiddens`` holds, for each index ``i`` in
  ``return_layers``, Hugging Face's ``hidden_states[i]`` (0 = embeddings, i = output of
  decoder layer i, before the final norm).
  """

  logits_BxTxV: jax.Array | None
  cache: KVCache | None
  hidden_BxTxD: jax.Array
  layer_hiddens: tuple[jax.Array, ...] = ()


def causal_mask(t: int) -> jax.Array:
  return jnp.tril(jnp.ones((t, t), dtype=bool))


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """Inverse RoPE frequencies ``[Dh/2]``, with linear or Llama-3 scaling applied."""
  dim = config.head_dim
  inv = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  s = config.rope_scaling
  if s.rope_type == "linear":
    return inv / s.factor
  if s.rope_type == "llama3":
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)
  return inv


def apply_rope(x_BxTxNxDh: jax.Array, cos_BxTxDh: jax.Array, sin_BxTxDh: jax.Array) -> jax.Array:
  half = x_BxTxNxDh.shape[-1] // 2
  rotated = jnp.concatenate([-x_BxTxNxDh[..., half:], x_BxTxNxDh[..., :half]], axis=-1)
  return x_BxTxNxDh * cos_BxTxDh[:, :, None] + rotated * sin_BxTxDh[:, :, None]


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)

  def deferred(self, x: jax.Array) -> Normed:
    """This norm of ``x``, not yet applied (:class:`~eagle_jax.model.ops.Normed`): for the
    products that read it, which apply it (a platform implementation may do so inside the
    product)."""
    return Normed(x, self.weight[...], self.eps)


class Linear(nnx.Module):
  """``y = x W^T + b`` with ``W`` stored ``[out, in]`` (Hugging Face layout).

  On XLA's CPU backend this layout is a few percent faster for the decode-time
  matrix-vector products than ``[in, out]``, and checkpoints load without transposes. The
  product is :func:`eagle_jax.model.ops.linear`; ``blocks`` (the weight's integer blocks,
  :mod:`eagle_jax.model.blocks`, set by the loader for GGUF checkpoints or by
  :func:`quantize_linears`) are handed to it, for a platform implementation that reads them
  instead of ``weight``.
  """

  def __init__(self, din: int, dout: int, *, bias: bool, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (dout, din), param_dtype))
    self.bias = nnx.Param(jnp.zeros((dout,), param_dtype)) if bias else None
    self.blocks: WeightBlocks | None = nnx.data(None)

  def __call__(self, x_BxTxI: jax.Array | Normed) -> jax.Array:
    """``x`` may be a :class:`~eagle_jax.model.ops.Normed` value (:meth:`RMSNorm.deferred`)."""
    y = linear(x_BxTxI, self.weight[...], blocks_of(self.blocks))
    return y if self.bias is None else y + self.bias[...]


def round_to_8bit(w_OxI) -> tuple[jax.Array, Blocks]:
  """A float32 weight ``[out, in]`` rounded to 8-bit blocks (:meth:`Blocks.quantize8`): the
  float32 expansion it is replaced by (so every backend computes with the same weights) and the
  blocks a platform implementation may read instead."""
  blocks = Blocks.quantize8(np.asarray(w_OxI))
  return jnp.asarray(blocks.dequantize()), jax.tree.map(jnp.asarray, blocks)


def quantize_linears(module: nnx.Module) -> int:
  """Rounds every float32 :class:`Linear` in ``module`` without integer blocks (and a width that
  is a multiple of 32) to 8-bit blocks (:meth:`eagle_jax.model.blocks.Blocks.quantize8`), and
  the tied embedding of every :class:`Transformer` in it (its LM head; the lookup then reads the
  same rounded rows): the weight becomes the blocks' float32 expansion, so every backend
  computes with the same weights, and the CPU kernels read the blocks (a quarter of the bytes)
  for passes over 1-32 rows. For drafters, whose weights need not be exact: their output is
  verified. Returns how many weights it rounded."""

  def rounded(param: nnx.Param) -> WeightBlocks | None:
    if param.dtype != jnp.float32 or param.ndim != 2 or param.shape[1] % BLOCK:
      return None
    param.value, blocks = round_to_8bit(param[...])
    return WeightBlocks(blocks)

  count = 0
  for _, node in nnx.iter_graph(module):
    if isinstance(node, Linear) and node.blocks is None:
      node.blocks = rounded(node.weight)
      count += node.blocks is not None
    elif isinstance(node, Transformer) and node.lm_head is None and node.embed_blocks is None:
      node.embed_blocks = rounded(node.embed)
      count += node.embed_blocks is not None
  return count


def shard(tree, mesh):
  """``tree`` (a model, a drafter's parameters: any pytree of NNX modules, states and arrays)
  laid out over ``mesh`` by the partition rules (:func:`eagle_jax.parallel.place`), the
  integer weight blocks of its modules dropped first (only the CPU kernels read them, and they
  step aside under a mesh); ``tree`` unchanged without a mesh."""
  if mesh is None:
    return tree
  for module in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Module)):
    if isinstance(module, nnx.Module):
      for _, node in list(nnx.iter_graph(module)):
        for attr, value in list(vars(node).items()) if isinstance(node, nnx.Module) else ():
          if isinstance(value, WeightBlocks):
            setattr(node, attr, None)
  return parallel.place(tree, mesh)


def _linear(din, dout, bias, rngs, param_dtype):
  return Linear(din, dout, bias=bias, rngs=rngs, param_dtype=param_dtype)


def qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
  """The fused q/k/v weight's row order, as indices into the rows of q, k and v stacked (Hugging
  Face's three projections one under the other): for each kv head, the rows of its
  ``num_heads / num_kv_heads`` query heads, then its key's, then its value's.

  Why grouped: a contiguous split of the rows over devices then gives each device whole kv
  groups with their query heads (tensor parallelism per head, :mod:`eagle_jax.parallel`); a
  split of q, k and v stacked would cut across the seams between them."""
  g, dh = num_heads // num_kv_heads, head_dim
  q = np.arange(num_heads * dh).reshape(num_kv_heads, g * dh)
  k = num_heads * dh + np.arange(num_kv_heads * dh).reshape(num_kv_heads, dh)
  return np.concatenate([q, k, k + num_kv_heads * dh], axis=1).reshape(-1)


def gate_up_rows(intermediate_size: int) -> np.ndarray:
  """The fused gate/up weight's row order, as indices into gate's rows stacked over up's: row
  ``2 f`` is gate's ``f``, row ``2 f + 1`` up's, so any contiguous split keeps each hidden unit's
  gate and up rows on one device."""
  f = np.arange(intermediate_size)
  return np.stack([f, f + intermediate_size], axis=1).reshape(-1)


def fused_rows(module) -> np.ndarray | None:
  """The row order (:func:`qkv_rows`, :func:`gate_up_rows`) of a fused :class:`Linear` inside
  ``module`` (an :class:`Attention`'s ``qkv`` or an :class:`MLP`'s ``gate_up``), else None."""
  if isinstance(module, Attention):
    return qkv_rows(module.num_heads, module.num_kv_heads, module.head_dim)
  if isinstance(module, MLP):
    return gate_up_rows(module.down.weight.shape[1])
  return None


# the fused row order's name, as parameter files and training checkpoints record it (under
# "fused_rows"); files and checkpoints without it stack q, k, v (gate, up) by rows
ROW_LAYOUT = "grouped"


def fused_row_orders(module) -> dict[str, np.ndarray]:
  """Flat name (``layers.0.attn.qkv.weight``) -> row order (:func:`fused_rows`) of every fused
  weight and bias inside ``module``."""
  out = {}
  for path, node in nnx.iter_graph(module):
    order = fused_rows(node)
    if order is None:
      continue
    prefix = "".join(f"{p}." for p in path)
    for name in (("qkv.weight", "qkv.bias") if isinstance(node, Attention) else ("gate_up.weight",)):
      out[prefix + name] = order
  return out


def fuse_rows(stacked, rows: np.ndarray):
  """Separate projections stacked by rows -> the fused layout (``rows`` from :func:`fused_rows`)."""
  return stacked[rows]


def unfuse_rows(fused, rows: np.ndarray):
  """The fused layout -> the projections stacked by rows again (inverse of :func:`fuse_rows`)."""
  return fused[np.argsort(rows)]


class Attention(nnx.Module):
  """Grouped-query attention with RoPE; reads and writes one layer of the KV cache."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
               input_size: int | None = None):
    """``input_size``: the width of the attention's input (default ``hidden_size``; EAGLE-3's
    draft layer reads ``2 * hidden_size``)."""
    c = config
    self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
    # q, k and v rows stacked in one matrix: one larger matvec per layer is faster when decoding.
    self.qkv = _linear(input_size or c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                       c.attention_bias, rngs, param_dtype)
    self.o = _linear(c.num_heads * c.head_dim, c.hidden_size, False, rngs, param_dtype)
    # tensor parallelism splits these by whole kv-head groups (eagle_jax.parallel)
    parallel.set_units(self.qkv.weight, (c.num_kv_heads, None))
    if self.qkv.bias is not None:
      parallel.set_units(self.qkv.bias, (c.num_kv_heads,))
    parallel.set_units(self.o.weight, (None, c.num_kv_heads))

  def __call__(self, x_BxTxD: jax.Array | Normed, cos_BxTxDh, sin_BxTxDh, bias: "AttnBias",
               kv_cache, slots_BxT):
    """Attends the T new tokens to the cache as it was (``bias.cache``) and to each other
    (``bias.new``), then writes their K/V to ``slots_BxT``. ``x`` may be a
    :class:`~eagle_jax.model.ops.Normed` value.

    The old cache and the new K/V are read separately (one softmax over both) and the write
    comes after the reads and depends on them, so XLA updates the cache in place. Writing first
    and reading the written cache made it copy every layer's K/V at every decode step.
    """
    b, t, _ = x_BxTxD.shape
    kh, g, dh = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
    # rows grouped by kv head (qkv_rows): each group's g query heads, then its key and value
    qkv_BxTxKxNxDh = self.qkv(x_BxTxD).reshape(b, t, kh, g + 2, dh)
    qk_BxTxKxNxDh = apply_rope(qkv_BxTxKxNxDh[:, :, :, :g + 1].reshape(b, t, kh * (g + 1), dh),
                               cos_BxTxDh, sin_BxTxDh).reshape(b, t, kh, g + 1, dh)
    q_BxTxKxGxDh = qk_BxTxKxNxDh[:, :, :, :g] * (1.0 / math.sqrt(dh))
    k_BxKxTxDh = qk_BxTxKxNxDh[:, :, :, g].transpose(0, 2, 1, 3)
    v_BxKxTxDh = qkv_BxTxKxNxDh[:, :, :, g + 1].transpose(0, 2, 1, 3)
    # Products are batched over (row, kv head) with the g query heads of a group and the t
    # queries as one matrix: XLA's CPU dot is far faster on that shape than with t or g batched.
    q_BxKxMxDh = q_BxTxKxGxDh.transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, dh)
    # One softmax over the parts (the old cache, the new tokens) without joining them.
    parts = [(k_BxKxTxDh, v_BxKxTxDh, bias.new_BxTxT)]
    if kv_cache is not None and bias.cache_BxTxS is not None:  # else nothing in the cache to read
      parts.insert(0, (kv_cache[0], kv_cache[1], bias.cache_BxTxS))  # [B, K, S, Dh]
    out_BxKxMxDh = attend(q_BxKxMxDh, parts, causal=bias.causal).astype(x_BxTxD.dtype)
    new_kv = None
    if kv_cache is not None:
      # Zero, but computed from the attention output: the write then depends on the reads of
      # the old cache, so XLA orders them first and updates the cache in place (without the
      # dependency it copies every layer's K/V each step to be safe).
      after_reads_Bx1 = jnp.minimum(jnp.isnan(out_BxKxMxDh[:, :1, 0, 0]), False).astype(slots_BxT.dtype)
      slots_BxT = slots_BxT + after_reads_Bx1
      rows_Bx1 = jnp.arange(b)[:, None]
      new_kv = tuple(c.at[rows_Bx1, :, slots_BxT].set(x.transpose(0, 2, 1, 3).astype(c.dtype), mode="drop")
                     for c, x in zip(kv_cache, (k_BxKxTxDh, v_BxKxTxDh)))
    out_BxTxKxGxDh = out_BxKxMxDh.reshape(b, kh, g, t, dh).transpose(0, 3, 1, 2, 4)
    return self.o(out_BxTxKxGxDh.reshape(b, t, kh * g * dh)), new_kv


class MLP(nnx.Module):
  """SwiGLU feed-forward block."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    d, f = config.hidden_size, config.intermediate_size
    self.gate_up = _linear(d, 2 * f, False, rngs, param_dtype)  # gate and up rows paired (gate_up_rows)
    self.down = _linear(f, d, False, rngs, param_dtype)
    parallel.set_units(self.gate_up.weight, (f, None))  # split by whole (gate, up) pairs

  def __call__(self, x: jax.Array | Normed):
    """``x`` may be a :class:`~eagle_jax.model.ops.Normed` value."""
    y = self.gate_up(x)
    y = y.reshape(*y.shape[:-1], -1, 2)  # [..., F, (gate, up)]
    gate, up = y[..., 0], y[..., 1]
    return self.down(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
  """Pre-norm attention + MLP block; EAGLE draft heads reuse it with ``skip_input_norm``."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
               skip_input_norm: bool = False):
    self.input_norm = None if skip_input_norm else RMSNorm(
        config.hidden_size, config.rms_norm_eps, param_dtype)
    self.attn = Attention(config, rngs=rngs, param_dtype=param_dtype)
    self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype)
    self.mlp = MLP(config, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, x_BxTxD, cos, sin, bias: "AttnBias", kv_cache=None, slots_BxT=None):
    # each norm is deferred to the products that read its output (ops.linear applies it)
    h = x_BxTxD if self.input_norm is None else self.input_norm.deferred(x_BxTxD)
    attn_out, new_kv = self.attn(h, cos, sin, bias, kv_cache, slots_BxT)
    x_BxTxD = x_BxTxD + attn_out
    return x_BxTxD + self.mlp(self.post_norm.deferred(x_BxTxD)), new_kv


def rope_tables(config: ModelConfig, positions_BxT: jax.Array, dtype):
  freqs_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * rope_inv_freq(config)
  emb = jnp.concatenate([freqs_BxTxHalf, freqs_BxTxHalf], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def bias_from_mask(mask):
  """Additive attention bias: 0 where ``mask`` is True, a large negative number elsewhere."""
  return jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)


@flax.struct.dataclass
class AttnBias:
  """What T new tokens may attend to, as additive biases (:func:`bias_from_mask`): the cache's
  S slots as they were before this call (``[B, T or 1, S]``; ``None`` without a cache, or when
  nothing in it is visible, e.g. a prompt pass into a fresh cache: attention then skips
  reading it) and the new tokens themselves (``[B, T, T]``)."""

  cache_BxTxS: jax.Array | None
  new_BxTxT: jax.Array
  # new_BxTxT hides every later new token from each one (causal, or narrower such as packed
  # segments): attention over many new tokens may skip the upper triangle (ops.attend)
  causal: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def from_slots(cls, visible_BxTxS: jax.Array, slots_BxT: jax.Array) -> "AttnBias":
    """Splits visibility over all S slots, counted after the new tokens are written to
    ``slots_BxT``, into what they see of the old cache and of each other."""
    b, t, s = visible_BxTxS.shape
    written_BxS = jnp.any(slots_BxT[:, :, None] == jnp.arange(s)[None, None, :], axis=1)
    idx_BxTxT = jnp.broadcast_to(jnp.clip(slots_BxT, 0, s - 1)[:, None, :], (b, t, t))
    new_BxTxT = jnp.take_along_axis(visible_BxTxS, idx_BxTxT, axis=2) & (slots_BxT < s)[:, None, :]
    return cls(cache_BxTxS=bias_from_mask(visible_BxTxS & ~written_BxS[:, None, :]),
               new_BxTxT=bias_from_mask(new_BxTxT))


class Transformer(nnx.Module):
  """Llama-family decoder-only language model."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.config = config
    self.embed = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype))
    self.layers = nnx.List([DecoderLayer(config, rngs=rngs, param_dtype=param_dtype)
                            for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype)
    self.lm_head = None if config.tie_word_embeddings else _linear(
        config.hidden_size, config.vocab_size, False, rngs, param_dtype)
    self.embed_blocks: WeightBlocks | None = nnx.data(None)  # as Linear.blocks (the tied head)

  def lm_logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    """Applies the LM head (tied or untied) to top hidden states; fp32 logits."""
    if self.lm_head is None:
      return linear(hidden_BxTxD, self.embed[...], blocks_of(self.embed_blocks)).astype(jnp.float32)
    return self.lm_head(hidden_BxTxD).astype(jnp.float32)

  def greedy_tokens(self, hidden_BxTxD: jax.Array, chunk: int = 128) -> jax.Array:
    """``int32 [B, T]``: the greedy token at each position (:func:`~eagle_jax.decoding.sampling.greedy_token`
    of :meth:`lm_logits`), ``chunk`` positions at a time, so the ``[B, T, V]`` logits are never
    held at once. Why: over many positions (feature extraction: 8 rows x 512 tokens, 0.8 GB of
    logits for the default model) writing and re-reading every logit costs more than the LM
    head's product; in chunks the logits stay in cache."""
    b, t, d = hidden_BxTxD.shape
    n = b * t
    pad = -n % chunk
    x_NxD = jnp.pad(hidden_BxTxD.reshape(n, d), ((0, pad), (0, 0)))
    ids = jax.lax.map(lambda x_CxD: greedy_token(self.lm_logits(x_CxD)), x_NxD.reshape(-1, chunk, d))
    return ids.reshape(-1)[:n].reshape(b, t)

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               cache: KVCache | None = None, mask_BxTxT: jax.Array | None = None,
               num_valid_B: jax.Array | None = None, return_layers: Sequence[int] = (),
               with_logits: bool = True, fresh_cache: bool = False, causal: bool = False) -> Output:
    """``fresh_cache``: ``cache`` holds nothing yet (a prompt pass), so attention reads only the
    new tokens' K/V and skips the S empty slots; they are still written to the cache.
    ``causal``: ``mask_BxTxT`` hides every later token (a causal mask, or a narrower one such as
    packed segments'), so long passes may skip the upper triangle; implied without a mask."""
    b, t = tokens_BxT.shape
    if cache is not None:  # slots past the end would be dropped silently: refuse what is known
      lengths = cache.lengths_B
      full = t if isinstance(lengths, jax.core.Tracer) else int(jnp.max(lengths)) + t
      if full > cache.max_len:
        raise EagleJaxError(f"{t} new tokens after {full - t} cached ones overflow a "
                            f"{cache.max_len}-slot KV cache")
    x_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0)
    cos, sin = rope_tables(self.config, positions_BxT, x_BxTxD.dtype)
    if mask_BxTxT is None:
      mask_BxTxT = jnp.broadcast_to(causal_mask(t), (b, t, t))
      causal = True
    cache_bias = None
    if cache is not None and not fresh_cache:  # the committed slots are visible
      cache_bias = bias_from_mask(jnp.arange(cache.max_len)[None, None, :] < cache.lengths_B[:, None, None])
    bias = AttnBias(cache_BxTxS=cache_bias, new_BxTxT=bias_from_mask(mask_BxTxT), causal=causal)
    slots_BxT = None if cache is None else cache.lengths_B[:, None] + jnp.arange(t)[None, :]
    hiddens = [x_BxTxD]
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      x_BxTxD, new_kv = layer(x_BxTxD, cos, sin, bias, kv, slots_BxT)
      if new_kv is not None:
        new_k.append(new_kv[0])
        new_v.append(new_kv[1])
      hiddens.append(x_BxTxD)
    hidden_BxTxD = self.final_norm(x_BxTxD)
    new_cache = None
    if cache is not None:
      advance = jnp.full((b,), t, jnp.int32) if num_valid_B is None else num_valid_B.astype(jnp.int32)
      new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), lengths_B=cache.lengths_B + advance)
    return Output(
        logits_BxTxV=self.lm_logits(hidden_BxTxD) if with_logits else None,
        cache=new_cache,
        hidden_BxTxD=hidden_BxTxD,
        layer_hiddens=tuple(hiddens[i] for i in return_layers),
    )
