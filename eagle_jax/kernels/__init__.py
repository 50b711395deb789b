"""C++ kernels for the CPU (XLA FFI custom calls): the CPU implementations of the model's
products and attention (:mod:`eagle_jax.model.ops`), installed by :mod:`eagle_jax.model`.

This package imports nothing from the model: it exposes :data:`IMPLEMENTATIONS` (for each
operation, a predicate on the operands it accepts and the function computing it from its
operands and the operation's pure-JAX reference) and :func:`available`; :mod:`eagle_jax.model`
installs them as the ``"cpu"`` plug-in of :mod:`eagle_jax.model.ops`, which consults them only
while tracing with the CPU as JAX's default backend (never for lowering elsewhere) and stages
each out under ``jax.lax.platform_dependent`` with the reference as the default branch.

Products over a few rows (``x [..., in] @ w[out, in]^T``): at batch 1 a target pass over one
token is a matrix-vector product per weight matrix, which XLA's CPU backend streams at memory
speed; over 2-16 tokens (a verify pass over a small draft tree or chain, a draft model's step
over several rows) XLA switches to a general matrix-matrix routine that is several times slower
per byte of weights at these shapes. ``small_matmul.cc`` reads each weight row once for all rows
of ``x`` and splits the output rows over one thread per core (its own small worker pool;
``EAGLE_JAX_KERNEL_THREADS`` sets the count). The float32 kernel takes float32 operands over
2-16 rows.

Integer weights: where a weight also has integer blocks (GGUF's Q4_0, Q4_1, Q8_0 layouts; any
object with arrays ``q_OxQ``, ``scale_OxN``, ``offset_OxN`` as
:class:`eagle_jax.model.blocks.Blocks` holds them) of its shape, the block kernel reads them
instead of the float32 matrix for 1-32 rows: a quarter (8-bit) or about a sixth (4-bit) of the
bytes, expanded in registers to exactly the float32 weights the checkpoint's own dequantization
gives, so results equal the float32 product up to summation order. Each output is summed in
the same order whatever the number of rows, so a token's logits have the same bits in a
one-token decode step and in a verify pass over a tree. It also applies the product's input
RMSNorm where the operation hands it one (a row's squares summed in a fixed order, so again the
same bits alone or among other rows): XLA's CPU backend runs an RMSNorm over one token as four
separate small operations, each paying its own dispatch.

Attention: for float32, a cache part and a new-token part over at most :data:`MAX_ROWS` new
tokens (decode steps, verify passes) and head dims of 16-128 in steps of 16, the attention
kernel reads each key and value row once in place and skips slots whose bias is at or below
:data:`HIDDEN`; XLA's CPU backend sends both products of such an attention to a general matrix
library that transposes the cached keys every call.

Gradients use the reference (``jax.custom_vjp``); ``jax.vmap`` over the activations keeps one
weight matrix for the kernels, while batched weights run the reference per weight.

Building: on first use (:func:`available`) the source is compiled with the machine's C++
compiler (``$CXX``, default ``g++``; ``-O3 -march=native``) into ``<cache dir>/kernels/``
(``EAGLE_JAX_CACHE``, see :func:`eagle_jax.paths.cache_dir`), keyed by its source, jaxlib's
version and the CPU; where it cannot be built, a one-line notice says why and the reference is
used. ``EAGLE_JAX_CPU_KERNELS=0`` turns the kernels off (the A/B switch for benchmarks).

Timing: :func:`time_inside` reports the wall time spent inside each kernel, which
``eagle-jax bench decode --json`` uses to split a decode step.
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

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from eagle_jax.paths import cache_dir

PLATFORM = "cpu"  # the JAX platform these kernels run on
MIN_ROWS, MAX_ROWS = 2, 16  # float32: one row is XLA's own fast matrix-vector product
# Integer blocks up to this many rows (a verify pass over EAGLE's 25-node tree is 26): the kernel
# takes them in passes of up to 8 rows, still fewer bytes and less time than XLA's float32 product.
BLOCK_MAX_ROWS = 32
BLOCK = 32  # weights per integer block, along the input axis (GGUF's)
HIDDEN = -1e37  # an additive attention bias at or below this hides the slot (weight exactly 0)
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
  """Whether the kernels are switched on, built and registered (built on the first call)."""
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
  kernel (``eagle-jax bench decode --json`` splits a decode step so); each call adds two clock
  reads."""
  if jax.default_backend() != PLATFORM or not available():
    return None
  out = (ctypes.c_int64 * (2 * len(KERNELS)))()
  _lib.EagleJaxTimeInside(out)
  return {name: (out[2 * k + 1], out[2 * k] / 1e9) for k, name in enumerate(KERNELS)}


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


def _zero_cotangent(a):
  if jnp.issubdtype(a.dtype, jnp.floating):
    return jnp.zeros_like(a)
  return np.zeros(a.shape, jax.dtypes.float0)


def _blocks_fit(blocks, w_OxI) -> bool:
  return (blocks is not None and len(w_OxI.shape) == 2
          and (blocks.q_OxQ.shape[0], blocks.scale_OxN.shape[1] * BLOCK) == tuple(w_OxI.shape))


@functools.cache
def _float_product(reference):
  """``(x, w) -> x @ w^T`` by the float32 kernel; gradients by ``reference``."""

  def ref(x, w):
    return reference(x, w, None, None, eps=None)

  def call(x, w):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), x.dtype)
    return jax.ffi.ffi_call(_TARGET, out)(x, w)

  ffi = _weights_stay_shared(call, ref)

  @jax.custom_vjp
  def product(x, w):
    return ffi(x, w)

  def fwd(x, w):
    return ffi(x, w), (x, w)

  def bwd(res, g):
    return jax.vjp(ref, *res)[1](g)

  product.defvjp(fwd, bwd)
  return product


_NO_NORM = np.zeros((0,), np.float32)


@functools.cache
def _block_product(reference, eps: float | None):
  """``(x, w, blocks, norm_weight) -> rms_norm(x) @ w^T`` (no norm where ``eps`` is None) read
  from ``blocks`` by the block kernel, the norm computed in it; gradients and batched weights by
  ``reference`` (from ``w``, the same weight in float32)."""

  def ref(x, w, blocks, norm_w):
    return reference(x, w, blocks, None if eps is None else norm_w, eps=eps)

  def call(x, w, blocks, norm_w):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (blocks.q_OxQ.shape[0],), x.dtype)
    return jax.ffi.ffi_call(_BLOCK_TARGET, out)(
        x, blocks.q_OxQ, blocks.scale_OxN, blocks.offset_OxN, norm_w,
        eps=np.float32(0.0 if eps is None else eps))

  ffi = _weights_stay_shared(call, ref)

  @jax.custom_vjp
  def product(x, w, blocks, norm_w):
    return ffi(x, w, blocks, norm_w)

  def fwd(x, w, blocks, norm_w):
    return ffi(x, w, blocks, norm_w), (x, w, blocks, norm_w)

  def bwd(res, g):
    x, w, blocks, norm_w = res
    _, vjp = jax.vjp(lambda x, w, n: ref(x, w, blocks, n), x, w, norm_w)
    gx, gw, gn = vjp(g)
    return gx, gw, jax.tree.map(_zero_cotangent, blocks), gn

  product.defvjp(fwd, bwd)
  return product


def linear_accepts(x_XxI, w_OxI, blocks, norm_weight, *, eps) -> bool:
  """Whether a kernel computes :func:`eagle_jax.model.ops.linear` for these operands: the block
  kernel for float32 ``x`` over 1-:data:`BLOCK_MAX_ROWS` rows where ``blocks`` of ``w``'s shape
  are given (with or without an input norm), else the float32 kernel for float32 operands over
  :data:`MIN_ROWS`-:data:`MAX_ROWS` rows without an input norm."""
  rows = math.prod(x_XxI.shape[:-1])
  if x_XxI.dtype != jnp.float32 or len(w_OxI.shape) != 2:
    return False
  if _blocks_fit(blocks, w_OxI):
    return 1 <= rows <= BLOCK_MAX_ROWS
  return norm_weight is None and MIN_ROWS <= rows <= MAX_ROWS and w_OxI.dtype == jnp.float32


def linear(reference, x_XxI, w_OxI, blocks, norm_weight, *, eps):
  """:func:`eagle_jax.model.ops.linear` by a kernel, for operands :func:`linear_accepts`."""
  if _blocks_fit(blocks, w_OxI):
    norm_w = _NO_NORM if norm_weight is None else norm_weight.astype(jnp.float32)
    return _block_product(reference, None if norm_weight is None else float(eps))(
        x_XxI, w_OxI, blocks, norm_w)
  return _float_product(reference)(x_XxI, w_OxI)


def attend_accepts(q_BxKxMxDh, parts, *, causal) -> bool:
  """Whether the attention kernel computes :func:`eagle_jax.model.ops.attend` for these
  operands: float32, a cache part and a new-token part over at most :data:`MAX_ROWS` new
  tokens, head dims of 16-128 in steps of 16."""
  arrays = [q_BxKxMxDh] + [x for part in parts for x in part]
  return (len(parts) == 2 and parts[1][2].shape[1] <= MAX_ROWS and q_BxKxMxDh.ndim == 4
          and q_BxKxMxDh.shape[-1] % 16 == 0 and q_BxKxMxDh.shape[-1] <= 128
          and all(x.dtype == jnp.float32 for x in arrays))


@functools.cache
def _attention(reference, causal: bool):
  """``(q, keys, values and bias of the cache, of the new tokens) -> attention`` by the kernel
  (one call per batch element under ``jax.vmap``); gradients by ``reference``."""

  def ref(q, kc, vc, bc, kn, vn, bn):
    return reference(q, [(kc, vc, bc), (kn, vn, bn)], causal=causal)

  def call(q, kc, vc, bc, kn, vn, bn):
    return jax.ffi.ffi_call(_ATTEND_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")(q, kc, vc, bc, kn, vn, bn)

  @jax.custom_vjp
  def attention(*args):
    return call(*args)

  def fwd(*args):
    return call(*args), args

  def bwd(args, g):
    return jax.vjp(ref, *args)[1](g)

  attention.defvjp(fwd, bwd)
  return attention


def attend(reference, q_BxKxMxDh, parts, *, causal):
  """:func:`eagle_jax.model.ops.attend` by the kernel, for operands :func:`attend_accepts`."""
  (kc, vc, bc), (kn, vn, bn) = parts
  return _attention(reference, causal)(q_BxKxMxDh, kc, vc, bc, kn, vn, bn)


# operation name -> (accepts(*operands, **static), run(reference, *operands, **static))
IMPLEMENTATIONS = {"linear": (linear_accepts, linear), "attend": (attend_accepts, attend)}
