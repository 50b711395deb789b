"""CPU kernels for matrix products over a few rows (``x [..., in] @ w[out, in]^T``, 1-32 rows).

Why: at batch 1 a target pass over one token is a matrix-vector product per weight matrix, which
XLA's CPU backend streams at memory speed; over 2-16 tokens (a verify pass over a small draft
tree or chain, a draft model's step over several rows) XLA switches to a general matrix-matrix
routine that is 2-3x slower per byte of weights at these shapes, so verifying even two tokens
cost about twice a one-token pass. ``small_matmul.cc`` reads each weight row once for all rows
of ``x`` and splits the output rows over one thread per core (its own small worker pool).

How it is used: :func:`linear` is the product every :class:`eagle_jax.model.transformer.Linear` and the tied
LM head run. It calls a kernel (an XLA FFI custom call) only for float32 activations, 2-16 rows
(1-32 with integer blocks, below), when lowering for the CPU (``jax.lax.platform_dependent``; GPUs and TPUs get ``einsum``); gradients
use ``einsum`` (``jax.custom_vjp``); ``jax.vmap`` over ``x`` is supported. The kernel is
compiled with the machine's C++ compiler (``$CXX``, default ``g++``; ``-O3 -march=native``)
on first use into ``<cache dir>/kernels/`` (``EAGLE_JAX_CACHE``, see
:func:`eagle_jax.paths.cache_dir`), keyed by its source, jaxlib's version and the CPU; where it
cannot be built, a one-line notice says why and ``einsum`` is used. ``EAGLE_JAX_CPU_KERNELS=0``
turns it off (the A/B switch for benchmarks).

Integer weights: a checkpoint stored in GGUF's block formats (Q4_0, Q4_1, Q8_0: 32 weights per
block, ``w = scale * q + offset``) keeps those blocks next to its float32 weights (:class:`Blocks`,
set on a :class:`~eagle_jax.model.transformer.Linear` by the loader). For 1-32 rows :func:`linear` then
reads the blocks instead of the float32 matrix: a quarter (8-bit) or about a sixth (4-bit) of the
bytes, expanded in registers to exactly the float32 weights the checkpoint's own dequantization
gives, so results equal the float32 product up to summation order. Each
output is summed in the same order whatever the number of rows, so a token's logits have the
same bits in a one-token decode step and in a verify pass over a tree.

Input norm: :func:`linear`'s ``norm`` (an RMSNorm's weight and epsilon, :class:`Norm`) is
applied to ``x`` before the product. The block kernel computes it itself (a row's squares summed
in a fixed order, so again the same bits alone or among other rows); every other path applies
:func:`rms_norm` in JAX first. Why: XLA's CPU backend runs an RMSNorm over one token as four
separate small operations, each paying its own dispatch; handing each decoder layer's two norms
to the products that read them cut the time a decode step spends outside the kernels from 0.644
to 0.468 ms (one-off, default model, 2-core EPYC, one process alternating the two forms,
medians of 12 steps each).

Timing: :func:`time_inside` reports the wall time spent inside each kernel, which
``eagle-jax bench decode`` uses to split a decode step.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import math
import os
import platform
import shlex
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from eagle_jax.paths import cache_dir

MIN_ROWS, MAX_ROWS = 2, 16  # float32: one row is XLA's own fast matrix-vector product
# Integer blocks up to this many rows (a verify pass over EAGLE's 25-node tree is 26): the kernel
# takes them in passes of up to 8 rows, still fewer bytes and less time than XLA's float32
# product (one-off, default model, 2-core EPYC: a 26-node pass 98 ms through XLA, 66 ms here).
BLOCK_MAX_ROWS = 32
BLOCK = 32  # weights per integer block, along the input axis
_TARGET = "eagle_jax_small_matmul"
_BLOCK_TARGET = "eagle_jax_block_matmul"
_ATTEND_TARGET = "eagle_jax_attend"
_SOURCE = os.path.join(os.path.dirname(__file__), "small_matmul.cc")


def _cpu_id() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      lines = [l for l in f if l.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def _build() -> str:
  cxx = shlex.split(os.environ.get("CXX", "g++"))
  flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
           "-I" + jax.ffi.include_dir()]
  with open(_SOURCE, "rb") as f:
    key = hashlib.sha1(f.read() + repr((cxx, flags, jax.__version__, jaxlib.__version__,
                                        _cpu_id())).encode()).hexdigest()[:16]
  folder = os.path.join(cache_dir(), "kernels")
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f"small_matmul-{key}.so")
  with open(path + ".lock", "w") as lock:  # concurrent first uses (two test workers) build once
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.isfile(path):
      tmp = f"{path}.tmp{os.getpid()}"
      proc = subprocess.run(cxx + flags + [_SOURCE, "-o", tmp, "-lpthread"],
                            capture_output=True, text=True)
      if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"{shlex.join(cxx)} exited with {proc.returncode} building {_SOURCE}"
                           + (f": {last}" if last else ""))
      os.replace(tmp, path)
  return path


_lib: ctypes.CDLL | None = None  # the loaded kernels, once available() has registered them


@functools.cache
def available() -> bool:
  """Whether the kernel is built and registered (built on the first call)."""
  global _lib
  if os.environ.get("EAGLE_JAX_CPU_KERNELS", "1") == "0":
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(_build())
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.EagleJaxSmallMatmul), platform="cpu")
    jax.ffi.register_ffi_target(_BLOCK_TARGET, jax.ffi.pycapsule(lib.EagleJaxBlockMatmul), platform="cpu")
    jax.ffi.register_ffi_target(_ATTEND_TARGET, jax.ffi.pycapsule(lib.EagleJaxAttend), platform="cpu")
  except (OSError, RuntimeError, AttributeError) as e:
    print(f"[eagle_jax] small-matmul CPU kernel unavailable, using XLA's dot: {e}", file=sys.stderr)
    return False
  _lib = lib
  return True


KERNELS = ("float_products", "block_products", "attention")  # the kernels time_inside reports


def time_inside() -> dict[str, tuple[int, float]] | None:
  """Per CPU kernel (:data:`KERNELS`: float32 products, integer-block products, attention), its
  calls and the wall seconds spent inside them since the process loaded the kernels, or None
  where they are not in use. Two readings around a computation give the time it spent in each
  kernel (``eagle-jax bench decode`` splits a decode step so); each call adds two clock reads."""
  if not available():
    return None
  out = (ctypes.c_int64 * (2 * len(KERNELS)))()
  _lib.EagleJaxTimeInside(out)
  return {name: (out[2 * k + 1], out[2 * k] / 1e9) for k, name in enumerate(KERNELS)}


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
    stays float32. For weights trained here (drafter heads) that the kernel should read at a
    quarter of the bytes; :meth:`dequantize` gives the weight it then multiplies by."""
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


def _einsum(x, w):
  return jnp.einsum("...i,oi->...o", x, w)


def rms_norm(x, weight, eps: float):
  """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, in float32 (RMSNorm)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(x.dtype)


@flax.struct.dataclass
class Norm:
  """An RMSNorm applied to a product's input (:func:`linear`'s ``norm``)."""

  weight: jax.Array
  eps: float = flax.struct.field(pytree_node=False)


def _weights_stay_shared(kernel, reference):
  """``kernel(x, w, *rest)`` under ``jax.vmap``: batching ``x`` alone keeps one weight matrix
  (the batch becomes leading rows of ``x``, which the kernels take); batching the weights
  (``w`` or ``rest``, e.g. a vmap over several heads' parameters) runs ``reference`` (the same
  function in plain JAX, float32 weights) per weight instead, as the kernels multiply by one
  matrix."""
  batched_kernel = jax.custom_batching.custom_vmap(kernel)

  @batched_kernel.def_vmap
  def _rule(axis_size, in_batched, x, w, *rest):
    if any(jax.tree.leaves(in_batched[1:])):
      axes = [jax.tree.map(lambda b: 0 if b else None, b) for b in in_batched]
      return jax.vmap(reference, in_axes=tuple(axes), axis_size=axis_size)(x, w, *rest), True
    return batched_kernel(x, w, *rest), True

  return batched_kernel


def _small_ffi(x, w):
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), x.dtype)
  return jax.ffi.ffi_call(_TARGET, out)(x, w)


_ffi = _weights_stay_shared(_small_ffi, _einsum)


@jax.custom_vjp
def _small_matmul(x, w):
  return jax.lax.platform_dependent(x, w, cpu=_ffi, default=_einsum)


def _fwd(x, w):
  return _small_matmul(x, w), (x, w)


def _bwd(res, g):
  x, w = res
  return jnp.einsum("...o,oi->...i", g, w), jnp.einsum("...o,...i->oi", g, x)


_small_matmul.defvjp(_fwd, _bwd)


def _zero_cotangent(a):
  if jnp.issubdtype(a.dtype, jnp.floating):
    return jnp.zeros_like(a)
  return np.zeros(a.shape, jax.dtypes.float0)


@functools.cache
def _block_matmul(eps: float | None):
  """``(x, w, blocks, norm_weight) -> rms_norm(x) @ w^T`` (no norm where ``eps`` is None),
  read from ``blocks`` on the CPU, the norm computed in the kernel; ``w`` (the same weight in
  float32) and plain JAX elsewhere and for gradients."""

  def reference(x, w, blocks, norm_w):
    return _einsum(x if eps is None else rms_norm(x, norm_w, eps), w)

  def call(x, w, blocks, norm_w):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (blocks.shape[0],), x.dtype)
    return jax.ffi.ffi_call(_BLOCK_TARGET, out)(
        x, blocks.q_OxQ, blocks.scale_OxN, blocks.offset_OxN, norm_w,
        eps=np.float32(0.0 if eps is None else eps))

  ffi = _weights_stay_shared(call, reference)

  @jax.custom_vjp
  def matmul(x, w, blocks, norm_w):
    return jax.lax.platform_dependent(x, w, blocks, norm_w, cpu=ffi, default=reference)

  def fwd(x, w, blocks, norm_w):
    return matmul(x, w, blocks, norm_w), (x, w, blocks, norm_w)

  def bwd(res, g):
    x, w, blocks, norm_w = res
    _, vjp = jax.vjp(lambda x, w, n: reference(x, w, blocks, n), x, w, norm_w)
    gx, gw, gn = vjp(g)
    return gx, gw, jax.tree.map(_zero_cotangent, blocks), gn

  matmul.defvjp(fwd, bwd)
  return matmul


_NO_NORM = np.zeros((0,), np.float32)


def uses_kernel(x_shape, x_dtype, w_shape, w_dtype, blocks: Blocks | None = None) -> bool:
  """Whether :func:`linear` takes a kernel for these operands (when lowered for the CPU): the
  integer-block one for 1-32 rows where ``blocks`` are given, else the float32 one for 2-16."""
  rows = math.prod(x_shape[:-1])
  if x_dtype != jnp.float32 or len(w_shape) != 2:
    return False
  if blocks is not None and tuple(blocks.shape) == tuple(w_shape):
    return 1 <= rows <= BLOCK_MAX_ROWS and available()
  return MIN_ROWS <= rows <= MAX_ROWS and w_dtype == jnp.float32 and available()


def linear(x_XxI: jax.Array, w_OxI: jax.Array, blocks: Blocks | None = None,
           norm: Norm | None = None) -> jax.Array:
  """``x @ w^T`` over the last axis of ``x`` (``w`` in the ``[out, in]`` layout). ``blocks``:
  the same weight as integer blocks, read instead of ``w`` by the CPU kernel for 1-32 rows.
  ``norm``: an RMSNorm applied to ``x`` first; the block kernel computes it itself (one
  operation where XLA's CPU backend emits four small ones), elsewhere it is :func:`rms_norm`."""
  if uses_kernel(x_XxI.shape, x_XxI.dtype, w_OxI.shape, w_OxI.dtype, blocks):
    if blocks is not None and tuple(blocks.shape) == tuple(w_OxI.shape):
      norm_w = _NO_NORM if norm is None else norm.weight.astype(jnp.float32)
      return _block_matmul(None if norm is None else float(norm.eps))(x_XxI, w_OxI, blocks, norm_w)
  if norm is not None:
    x_XxI = rms_norm(x_XxI, norm.weight, norm.eps)
  if uses_kernel(x_XxI.shape, x_XxI.dtype, w_OxI.shape, w_OxI.dtype):
    return _small_matmul(x_XxI, w_OxI)
  return _einsum(x_XxI, w_OxI)


HIDDEN = -1e37  # an additive attention bias at or below this hides the slot (weight exactly 0)


def attend_reference(q_BxKxMxDh, parts):
  """Attention of query rows ``m = g * T + t`` (query head ``g`` of kv head ``k``, new token ``t``)
  to one or more parts ``(keys [B, K, S, Dh], values [B, K, S, Dh], bias [B, T or 1, S])``
  under one softmax (a shared max, exponentials per part, normalised once), without joining
  the parts. ``q`` is already scaled. Returns ``[B, K, M, Dh]``."""
  b, kh, m, _ = q_BxKxMxDh.shape
  t = parts[-1][2].shape[1]

  def scores(keys_BxKxSxDh, bias_BxTxS):
    s_BxKxMxS = jnp.einsum("bkmd,bksd->bkms", q_BxKxMxDh, keys_BxKxSxDh.astype(q_BxKxMxDh.dtype))
    s = s_BxKxMxS.reshape(b, kh, m // t, t, -1).astype(jnp.float32) + bias_BxTxS[:, None, None]
    return s.reshape(b, kh, m, -1)

  scored = [(scores(keys, bias), values) for keys, values, bias in parts]
  max_BxKxMx1 = jax.lax.stop_gradient(
      functools.reduce(jnp.maximum, [sc.max(-1, keepdims=True) for sc, _ in scored]))
  out_BxKxMxDh, denom_BxKxMx1 = 0.0, 0.0
  for sc, values_BxKxSxDh in scored:
    e_BxKxMxS = jnp.exp(sc - max_BxKxMx1)
    denom_BxKxMx1 = denom_BxKxMx1 + e_BxKxMxS.sum(-1, keepdims=True)
    out_BxKxMxDh = out_BxKxMxDh + jnp.einsum(
        "bkms,bksd->bkmd", e_BxKxMxS.astype(q_BxKxMxDh.dtype), values_BxKxSxDh.astype(q_BxKxMxDh.dtype))
  return (out_BxKxMxDh / denom_BxKxMx1).astype(q_BxKxMxDh.dtype)


def _attend_ffi(q, kc, vc, bc, kn, vn, bn):
  return jax.ffi.ffi_call(_ATTEND_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                          vmap_method="sequential")(q, kc, vc, bc, kn, vn, bn)


def _attend_ref2(q, kc, vc, bc, kn, vn, bn):
  return attend_reference(q, [(kc, vc, bc), (kn, vn, bn)])


@jax.custom_vjp
def _attend_kernel(q, kc, vc, bc, kn, vn, bn):
  return jax.lax.platform_dependent(q, kc, vc, bc, kn, vn, bn, cpu=_attend_ffi, default=_attend_ref2)


def _attend_fwd(*args):
  return _attend_kernel(*args), args


def _attend_bwd(args, g):
  return jax.vjp(_attend_ref2, *args)[1](g)


_attend_kernel.defvjp(_attend_fwd, _attend_bwd)


CAUSAL_BLOCK = 128  # query rows per block of a causal attention over many new tokens


def attend_causal_blocks(q_BxKxMxDh, parts, block: int = CAUSAL_BLOCK):
  """:func:`attend_reference` where the last part (the new tokens) hides every later token
  from each query (a causal mask, possibly narrower: packed segments, padding): queries are
  taken ``block`` new tokens at a time, each block against the earlier parts and the new
  tokens up to its own last one, so the hidden upper triangle is neither computed nor
  exponentiated. The skipped scores would get weight exactly 0, so the result is the same up
  to summation order.

  Why: for long prompts (feature extraction's 512-token rows, chunked prefill, distillation)
  XLA's CPU backend computes the full ``T x T`` scores and their exponentials; in a one-off
  timing (2-core EPYC, 8 rows x 512 tokens, the default model's heads) one layer's attention
  took 145 ms that way and 49 ms in blocks of 128, which kept the scores in cache."""
  b, kh, m, dh = q_BxKxMxDh.shape
  t = parts[-1][2].shape[1]
  g = m // t
  q_BxKxGxTxDh = q_BxKxMxDh.reshape(b, kh, g, t, dh)
  outs = []
  for start in range(0, t, block):
    stop = min(start + block, t)
    q_blk = q_BxKxGxTxDh[:, :, :, start:stop].reshape(b, kh, g * (stop - start), dh)
    blk_parts = [(k, v, bias if bias.shape[1] == 1 else bias[:, start:stop]) for k, v, bias in parts[:-1]]
    k_new, v_new, bias_new = parts[-1]
    blk_parts.append((k_new[:, :, :stop], v_new[:, :, :stop], bias_new[:, start:stop, :stop]))
    outs.append(attend_reference(q_blk, blk_parts).reshape(b, kh, g, stop - start, dh))
  return jnp.concatenate(outs, axis=3).reshape(b, kh, m, dh)


def attend(q_BxKxMxDh, parts, causal: bool = False):
  """:func:`attend_reference`'s result; on the CPU, for float32, a cache part and a new-token
  part over at most :data:`MAX_ROWS` new tokens (decode steps, verify passes), the attention
  kernel computes it (head dims of 16-128 in steps of 16): each key and value row read once in
  place, slots whose bias is at or below :data:`HIDDEN` skipped. Gradients use the reference.
  ``causal``: the new-token part hides every later token from each query; over more than
  :data:`CAUSAL_BLOCK` new tokens the queries then go in blocks (:func:`attend_causal_blocks`),
  on every backend.

  Why: XLA's CPU backend sends both products of such an attention to a general matrix library
  that transposes the cached keys every call; in the default model's decode loop (one-off
  timing, 2-core EPYC) a step took 8.4-9.0 ms with it and 6.2-7.3 ms with the kernel for a
  192-slot cache, 11-12 ms and 7-9.5 ms for 832 slots."""
  arrays = [q_BxKxMxDh] + [x for part in parts for x in part]
  if (len(parts) == 2 and parts[1][2].shape[1] <= MAX_ROWS and q_BxKxMxDh.ndim == 4
      and q_BxKxMxDh.shape[-1] % 16 == 0 and q_BxKxMxDh.shape[-1] <= 128
      and all(x.dtype == jnp.float32 for x in arrays) and available()):
    (kc, vc, bc), (kn, vn, bn) = parts
    return _attend_kernel(q_BxKxMxDh, kc, vc, bc, kn, vn, bn)
  if causal and parts[-1][2].shape[1] > CAUSAL_BLOCK:
    return attend_causal_blocks(q_BxKxMxDh, parts)
  return attend_reference(q_BxKxMxDh, parts)
