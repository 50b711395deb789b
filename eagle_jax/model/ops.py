"""The plain operations the model computes, in pure JAX: the reference every backend can run.

The model calls :func:`linear`, :func:`rms_norm`, :func:`attend` and :func:`greedy_token`, with
no argument that belongs to one platform. A plug-in (:class:`Plugin`: the CPU kernels of
:mod:`eagle_jax.kernels`, installed by :mod:`eagle_jax.model`) may supply a faster
implementation of an operation for one platform. It is consulted only where it can run: while
tracing with that platform as JAX's default backend, outside :func:`reference_only`, and only for
operands its predicate accepts; only then is it asked whether it is ready (the CPU kernels are
built with the C++ compiler on that first use). The operation then stages out
``jax.lax.platform_dependent(<platform>=implementation, default=reference)``, so a computation
lowered for another platform still runs the reference.

Deferred norm: a layer hands :class:`Normed` (an RMSNorm not yet applied) to the products that
read the norm's output; :func:`linear` passes it to an implementation that applies the norm
itself (the CPU block kernel does, one operation where XLA's CPU backend emits four small ones)
and applies :func:`rms_norm` first everywhere else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping

import flax
import jax
import jax.numpy as jnp

from eagle_jax import parallel


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One platform's implementation of an operation.

  ``accepts(*operands, **static)``: whether it computes the operation for these operands,
  judged at trace time from their shapes and dtypes (cheap; the plug-in's readiness is asked
  separately). ``run(reference, *operands, **static)``: computes it; ``reference`` is the
  operation's pure-JAX reference, for the rules the implementation defines by it (gradients,
  batching it does not handle itself)."""

  accepts: Callable[..., bool]
  run: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Plugin:
  """Implementations of operations for one platform (a JAX platform name such as ``"cpu"``).
  ``ready()``: whether they can run (it may build them); asked the first time one of them
  applies, never while lowering for another platform."""

  platform: str
  ready: Callable[[], bool]
  implementations: Mapping[str, Implementation]


_PLUGINS: dict[str, Plugin] = {}  # by platform
# True within reference_only() (in this thread); part of jax.jit's cache key
_REFERENCE_ONLY = jax.make_user_context(default_value=False)


def install(plugin: Plugin) -> None:
  """Makes ``plugin``'s implementations the ones staged out for its platform (replacing an
  earlier plug-in for the same platform)."""
  _PLUGINS[plugin.platform] = plugin


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
  """Within it, operations trace their pure-JAX reference alone: no plug-in is consulted (and
  none is built). For lowering for other platforms than the one running (``jax.export`` for
  GPUs or TPUs from a CPU host) and for checks against the reference. It is part of
  ``jax.jit``'s cache key: a function traced outside it is traced again inside it, and the
  other way round."""
  with _REFERENCE_ONLY(True):
    yield


def _implementation(op: str, operands: tuple, static: dict) -> tuple[str, Implementation] | None:
  """The platform and implementation that computes ``op`` for these operands, if any."""
  if _REFERENCE_ONLY.value or parallel.spans_devices():  # a mesh: single-device kernels step aside
    return None
  plugin = _PLUGINS.get(jax.default_backend())
  impl = None if plugin is None else plugin.implementations.get(op)
  if impl is None or not impl.accepts(*operands, **static) or not plugin.ready():
    return None
  return plugin.platform, impl


def _apply(op: str, reference: Callable, *operands, **static):
  """``reference(*operands, **static)``, or where a plug-in's implementation accepts the
  operands, that implementation on its platform and the reference elsewhere."""
  found = _implementation(op, operands, static)
  if found is None:
    return reference(*operands, **static)
  platform, impl = found
  return jax.lax.platform_dependent(
      *operands, default=functools.partial(reference, **static),
      **{platform: functools.partial(impl.run, reference, **static)})


def rms_norm(x, weight, eps: float):
  """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, in float32 (RMSNorm)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(x.dtype)


@flax.struct.dataclass
class Normed:
  """``rms_norm(x, weight, eps)``, not yet computed: what a layer hands to the products that
  read a norm's output (:func:`linear` applies it, or lets a platform implementation apply it
  inside the product). ``shape`` and ``dtype`` are those of the normed value."""

  x: jax.Array
  weight: jax.Array
  eps: float = flax.struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.x.shape

  @property
  def dtype(self):
    return self.x.dtype

  def value(self) -> jax.Array:
    return rms_norm(self.x, self.weight, self.eps)


def linear_reference(x_XxI, w_OxI, blocks=None, norm_weight=None, *, eps: float | None = None):
  """``x @ w^T`` over the last axis of ``x`` (``w`` in the ``[out, in]`` layout), ``x`` first
  normed (:func:`rms_norm` with ``norm_weight`` and ``eps``) where ``norm_weight`` is given.
  ``blocks`` (the same weight as integer blocks, :class:`~eagle_jax.model.blocks.Blocks`) are
  not read: ``w`` is their float32 expansion."""
  if norm_weight is not None:
    x_XxI = rms_norm(x_XxI, norm_weight, eps)
  return jnp.einsum("...i,oi->...o", x_XxI, w_OxI)


def linear(x_XxI: jax.Array | Normed, w_OxI: jax.Array, blocks=None) -> jax.Array:
  """``x @ w^T`` over the last axis of ``x`` (:func:`linear_reference`); ``x`` may be a
  :class:`Normed` value. ``blocks``: the same weight as integer blocks, which a platform
  implementation may read instead of ``w``."""
  if isinstance(x_XxI, Normed):
    operands = (x_XxI.x, w_OxI, blocks, x_XxI.weight)
    if _implementation("linear", operands, {"eps": x_XxI.eps}) is not None:
      return _apply("linear", linear_reference, *operands, eps=x_XxI.eps)
    x_XxI = x_XxI.value()
  return _apply("linear", linear_reference, x_XxI, w_OxI, blocks, None, eps=None)


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


CAUSAL_BLOCK = 128  # query rows per block of a causal attention over many new tokens


def attend_causal_blocks(q_BxKxMxDh, parts, block: int = CAUSAL_BLOCK):
  """:func:`attend_reference` where the last part (the new tokens) hides every later token
  from each query (a causal mask, possibly narrower: packed segments, padding): queries are
  taken ``block`` new tokens at a time, each block against the earlier parts and the new
  tokens up to its own last one, so the hidden upper triangle is neither computed nor
  exponentiated. The skipped scores would get weight exactly 0, so the result is the same up
  to summation order.

  Why: for long prompts (feature extraction's 512-token rows, chunked prefill, distillation)
  XLA's CPU backend computes the full ``T x T`` scores and their exponentials; in blocks the
  scores of a block stay in cache."""
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


def _attend(q_BxKxMxDh, parts, *, causal: bool):
  if causal and parts[-1][2].shape[1] > CAUSAL_BLOCK:
    return attend_causal_blocks(q_BxKxMxDh, parts)
  return attend_reference(q_BxKxMxDh, parts)


def attend(q_BxKxMxDh, parts, causal: bool = False):
  """:func:`attend_reference`'s result. ``causal``: the new-token part (the last) hides every
  later token from each query; over more than :data:`CAUSAL_BLOCK` new tokens the queries then
  go in blocks (:func:`attend_causal_blocks`)."""
  return _apply("attend", _attend, q_BxKxMxDh, parts, causal=causal)


def greedy_token(logits_XxV: jax.Array) -> jax.Array:
  """``jnp.argmax`` over the last axis (the first index of the largest entry, or of the first
  NaN), ``int32``, computed as a maximum and then the smallest index that reaches it.

  Why: XLA's CPU backend lowers ``argmax`` to a reduction over (value, index) pairs that it
  does not vectorise, paid by every decode step and by every node of a verify pass over the
  default model's 49,152 logits; these two plain reductions take a fraction of that time."""
  v = logits_XxV.shape[-1]
  top_Xx1 = jnp.max(logits_XxV, axis=-1, keepdims=True)  # NaN if any entry is NaN
  hit_XxV = (logits_XxV == top_Xx1) | jnp.isnan(logits_XxV)
  return jnp.min(jnp.where(hit_XxV, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
