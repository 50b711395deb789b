"""A CPU kernel for matrix products over a few rows (``x [..., in] @ w[out, in]^T``, 2-16 rows).

Why: at batch 1 a target pass over one token is a matrix-vector product per weight matrix, which
XLA's CPU backend streams at memory speed; over 2-16 tokens (a verify pass over a small draft
tree or chain, a draft model's step over several rows) XLA switches to a general matrix-matrix
routine that is 2-3x slower per byte of weights at these shapes, so verifying even two tokens
cost about twice a one-token pass. ``small_matmul.cc`` reads each weight row once for all rows
of ``x`` and splits the output rows over one thread per core (its own small worker pool).

How it is used: :func:`linear` is the product every :class:`eagle_jax.model.Linear` and the tied
LM head run. It calls the kernel (an XLA FFI custom call) only for float32, 2-16 rows, when
lowering for the CPU (``jax.lax.platform_dependent``; GPUs and TPUs get ``einsum``); gradients
use ``einsum`` (``jax.custom_vjp``); ``jax.vmap`` over ``x`` is supported. The kernel is
compiled with the machine's C++ compiler (``$CXX``, default ``g++``; ``-O3 -march=native``)
on first use into ``<cache dir>/kernels/`` (``EAGLE_JAX_CACHE``, see
:func:`eagle_jax.registry.cache_dir`), keyed by its source, jaxlib's version and the CPU; where it
cannot be built, a one-line notice says why and ``einsum`` is used. ``EAGLE_JAX_CPU_KERNELS=0``
turns it off (the A/B switch for benchmarks).
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

MIN_ROWS, MAX_ROWS = 2, 16  # one row is XLA's own fast matrix-vector product
_TARGET = "eagle_jax_small_matmul"
_SOURCE = os.path.join(os.path.dirname(__file__), "small_matmul.cc")


def _cpu_id() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      lines = [l for l in f if l.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def _build() -> str:
  from eagle_jax.registry import cache_dir

  cxx = shlex.split(os.environ.get("CXX", "g++"))
  flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
           "-I" + jax.ffi.include_dir()]
  with open(_SOURCE, "rb") as f:
    key = hashlib.sha1(f.read() + repr((cxx, flags, jax.__version__, _cpu_id())).encode()).hexdigest()[:16]
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


@functools.cache
def available() -> bool:
  """Whether the kernel is built and registered (built on the first call)."""
  if os.environ.get("EAGLE_JAX_CPU_KERNELS", "1") == "0":
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(_build())
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.EagleJaxSmallMatmul), platform="cpu")
  except (OSError, RuntimeError, AttributeError) as e:
    print(f"[eagle_jax] small-matmul CPU kernel unavailable, using XLA's dot: {e}", file=sys.stderr)
    return False
  return True


def _einsum(x, w):
  return jnp.einsum("...i,oi->...o", x, w)


def _ffi(x, w):
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), x.dtype)
  return jax.ffi.ffi_call(_TARGET, out, vmap_method="expand_dims")(x, w)


@jax.custom_vjp
def _small_matmul(x, w):
  return jax.lax.platform_dependent(x, w, cpu=_ffi, default=_einsum)


def _fwd(x, w):
  return _small_matmul(x, w), (x, w)


def _bwd(res, g):
  x, w = res
  return jnp.einsum("...o,oi->...i", g, w), jnp.einsum("...o,...i->oi", g, x)


_small_matmul.defvjp(_fwd, _bwd)


def uses_kernel(x_shape, x_dtype, w_shape, w_dtype) -> bool:
  """Whether :func:`linear` takes the kernel for these operands (when lowered for the CPU)."""
  rows = math.prod(x_shape[:-1])
  return (MIN_ROWS <= rows <= MAX_ROWS and len(w_shape) == 2 and x_dtype == jnp.float32
          and w_dtype == jnp.float32 and available())


def linear(x_XxI: jax.Array, w_OxI: jax.Array) -> jax.Array:
  """``x @ w^T`` over the last axis of ``x`` (``w`` in the ``[out, in]`` layout)."""
  if uses_kernel(x_XxI.shape, x_XxI.dtype, w_OxI.shape, w_OxI.dtype):
    return _small_matmul(x_XxI, w_OxI)
  return _einsum(x_XxI, w_OxI)
