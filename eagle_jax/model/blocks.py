"""Integer weight blocks: a quantized storage format for ``[out, in]`` weights (GGUF's Q4_0, Q4_1
and Q8_0 layouts, and 8-bit blocks of weights trained here).

A :class:`~eagle_jax.model.transformer.Linear` keeps such blocks beside its float32 weight when
the checkpoint stores it that way (set by the loader, :mod:`eagle_jax.model.checkpoints`); the
float32 weight is their exact expansion, so every backend computes with the same weights. A
platform implementation of :func:`eagle_jax.model.ops.linear` may read the blocks instead (the
CPU kernels do: a quarter to a sixth of the bytes).
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # weights per block, along the input axis


@flax.struct.dataclass
class Blocks:
  """A weight ``[out, in]`` as integers in blocks of :data:`BLOCK` along ``in``:
  ``w[o, i] = scale[o, i // 32] * q[o, i] + offset[o, i // 32]`` in float32.

  ``q_OxQ`` is int8 ``[out, in]`` (8-bit values) or uint8 ``[out, in / 2]`` (4-bit values
  0-15, byte ``j`` of a block's 16 holding value ``j`` in its low nibble and ``j + 16`` in its
  high one, GGUF's order). Rows may be stacked (:meth:`concat`) and picked (:meth:`take`).
  """

  q_OxQ: jax.Array
  scale_OxN: jax.Array
  offset_OxN: jax.Array

  @property
  def bits(self) -> int:
    return 4 if self.q_OxQ.dtype == jnp.uint8 else 8

  @property
  def shape(self) -> tuple[int, int]:
    return self.q_OxQ.shape[0], self.scale_OxN.shape[1] * BLOCK

  @property
  def nbytes(self) -> int:
    return self.q_OxQ.nbytes + self.scale_OxN.nbytes + self.offset_OxN.nbytes

  def dequantize(self) -> np.ndarray:
    """The float32 weight ``[out, in]`` (numpy; for checks and tests)."""
    q = np.asarray(self.q_OxQ)
    if self.bits == 4:  # [O, N, 16] bytes -> [O, N, 32] values: low nibbles, then high ones
      b = q.reshape(q.shape[0], -1, BLOCK // 2)
      q = np.concatenate([b & 15, b >> 4], axis=-1)
    q = q.reshape(q.shape[0], -1, BLOCK).astype(np.float32)
    w = q * np.asarray(self.scale_OxN)[..., None] + np.asarray(self.offset_OxN)[..., None]
    return w.reshape(self.shape)

  @classmethod
  def concat(cls, parts: "list[Blocks]") -> "Blocks":
    """Rows of ``parts`` stacked (one format and width)."""
    return cls(*(np.concatenate([np.asarray(getattr(p, f)) for p in parts])
                 for f in ("q_OxQ", "scale_OxN", "offset_OxN")))

  @classmethod
  def quantize8(cls, w_OxI) -> "Blocks":
    """Symmetric 8-bit blocks of a float32 weight ``[out, in]`` (``in`` a multiple of 32), by
    GGUF's Q8_0 rule: per block ``scale = max |w| / 127``, ``q = round(w / scale)``; the scale
    stays float32. For weights trained here (drafter heads) that a platform implementation
    should read at a quarter of the bytes; :meth:`dequantize` gives the weight it then
    multiplies by."""
    w = np.asarray(w_OxI, np.float32)
    if w.ndim != 2 or w.shape[1] % BLOCK:
      raise ValueError(f"8-bit blocks need a [out, in] weight with in a multiple of {BLOCK}; got {w.shape}")
    b = w.reshape(w.shape[0], -1, BLOCK)
    scale = (np.abs(b).max(-1) / 127).astype(np.float32)
    safe = np.where(scale > 0, scale, 1).astype(np.float32)
    q = np.clip(np.rint(b / safe[..., None]), -127, 127).astype(np.int8)
    return cls(q.reshape(w.shape), scale, np.zeros_like(scale))

  def take(self, rows) -> "Blocks":
    return Blocks(self.q_OxQ[rows], self.scale_OxN[rows], self.offset_OxN[rows])
