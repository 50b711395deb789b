"""Autoregressive decoding with the whole token loop compiled (one ``lax.while_loop``).

Prompts of different lengths are right-padded into one ``[B, P]`` array; each row's
cache length starts at its own prompt length, so a row in a ragged batch decodes exactly
as it would alone. The prompt pass is a program of its own (:func:`run_prefill`) that hands
the filled cache to the token loop: vanilla decoding and every speculative drafter share it
for the same shapes, and no loop program compiles a copy of it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import parallel
from eagle_jax.decoding.sampling import SamplingParams, sample
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.transformer import KVCache, Output, Transformer

BUCKET = 64  # prompt and cache lengths are rounded up to this, to reuse compilations


@dataclasses.dataclass
class Generation:
  """Result of :func:`generate` (host numpy / python values)."""

  tokens: list[list[int]]  # new tokens per row, up to and including a stop token
  num_new: list[int]
  seconds: float  # wall time of the compiled run (prefill + decode), compile excluded
  compile_seconds: float

  @property
  def tokens_per_s(self) -> float:
    return sum(self.num_new) / max(self.seconds, 1e-9)


@flax.struct.dataclass
class _LoopState:
  cache: KVCache
  last_B: jax.Array
  out_BxN: jax.Array
  num_new_B: jax.Array
  done_B: jax.Array
  step: jax.Array
  key: jax.Array


def pad_prompts(prompts: Sequence[Sequence[int]], bucket: int = BUCKET, pad_id: int = 0,
                min_width: int = 0):
  """Right-pads prompts to a common bucketed length (at least ``min_width``):
  ``tokens [B, P]``, ``lengths [B]``."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise EagleJaxError("empty prompt: every prompt needs at least one token")
  lengths = np.array([len(p) for p in prompts], np.int32)
  width = int(-(-max(int(lengths.max()), min_width) // bucket) * bucket)
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, lengths


# prompts wider than this are prefilled in chunks of it: smaller chunks pay more per-call
# overhead, larger ones hold more attention scores at once
PREFILL_CHUNK = 128


def prefill(model: Transformer, tokens_BxP, lengths_B, cache: KVCache, return_layers=()):
  """Runs the prompts through the model into ``cache``, which must be fresh (positions start at
  0); returns (output, logits at each row's last token). A single pass does not read the
  cache's empty slots (``fresh_cache``), so its attention costs T x T, not T x (S + T).

  A prompt wider than ``PREFILL_CHUNK`` runs chunk by chunk in a ``lax.while_loop`` that stops
  after the chunk holding the longest row's last token, so its cost follows the real prompt
  length, not the padded width: one compiled program serves every prompt up to that width
  (evaluations pad to their longest prompt) without paying for the padding. The output's
  hidden states (and ``return_layers``) cover all ``P`` positions; those past a row's length
  are unspecified, as padding always was.
  """
  b, p = tokens_BxP.shape
  if p <= PREFILL_CHUNK:
    positions_BxP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = model(tokens_BxP, positions_BxP, cache, num_valid_B=lengths_B,
                return_layers=return_layers, with_logits=False, fresh_cache=True)
  else:
    out = _chunked_prefill(model, tokens_BxP, lengths_B, cache, return_layers)
  last_hidden_BxD = jnp.take_along_axis(out.hidden_BxTxD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  return out, model.lm_logits(last_hidden_BxD)


def features_of(out, layers: tuple[int, ...]) -> jax.Array:
  """A drafter's target features: the top hidden state, or chosen layers concatenated."""
  return jnp.concatenate(out.layer_hiddens, -1) if layers else out.hidden_BxTxD


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len", "layers"))
def _prefill_jit(state, tokens_BxP, lengths_B, *, graphdef, cache_len, layers):
  model = nnx.merge(graphdef, state)
  cache = KVCache.init(model.config, tokens_BxP.shape[0], cache_len, model.embed.dtype)
  out, logits_BxV = prefill(model, tokens_BxP, lengths_B, cache, return_layers=layers)
  return out.cache, features_of(out, layers), logits_BxV


def run_prefill(graphdef, state, tokens_BxP, lengths_B, cache_len: int, layers: tuple[int, ...] = ()):
  """The compiled prompt pass into a fresh cache of ``cache_len`` slots; returns ((cache,
  features ``[B, P, F]`` as :func:`features_of`, logits at each row's last token ``[B, V]``),
  compile seconds, run seconds), outputs left on the device for the loop that follows."""
  return run_compiled(_prefill_jit, (state, jnp.asarray(tokens_BxP), jnp.asarray(lengths_B)),
                      dict(graphdef=graphdef, cache_len=cache_len, layers=tuple(layers)), host=False)


def _chunked_prefill(model: Transformer, tokens_BxP, lengths_B, cache: KVCache, return_layers):
  b, p = tokens_BxP.shape
  c = PREFILL_CHUNK
  width = -(-p // c) * c  # the last chunk's padding writes past the cache, which drops it
  tokens_BxW = jnp.pad(tokens_BxP, ((0, 0), (0, width - p)))
  d = model.config.hidden_size
  dtype = model.embed.dtype
  lengths_B = lengths_B.astype(jnp.int32)

  def body(carry):
    start, cache, hidden_BxPxD, layers = carry
    positions_BxC = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (b, c))
    out = model(jax.lax.dynamic_slice_in_dim(tokens_BxW, start, c, axis=1), positions_BxC, cache,
                num_valid_B=jnp.clip(lengths_B - start, 0, c), return_layers=return_layers,
                with_logits=False)
    put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), start, axis=1)
    return (start + c, out.cache, put(hidden_BxPxD, out.hidden_BxTxD),
            tuple(put(buf, x) for buf, x in zip(layers, out.layer_hiddens)))

  zeros = jnp.zeros((b, width, d), dtype)
  carry = (jnp.int32(0), cache, zeros, tuple(zeros for _ in return_layers))
  _, cache, hidden_BxWxD, layers = jax.lax.while_loop(
      lambda carry: carry[0] < jnp.max(lengths_B), body, carry)
  return Output(logits_BxTxV=None, cache=cache, hidden_BxTxD=hidden_BxWxD[:, :p],
                layer_hiddens=tuple(x[:, :p] for x in layers))


STOP_SLOTS = 4  # stop ids travel as an array padded with -1 to a multiple of this


def stop_array(stop_ids: Sequence[int]) -> np.ndarray:
  """Stop ids as a traced argument: any set of up to 4 ids (EOS, none, custom) shares one
  compiled program, where a static tuple compiled one per set."""
  width = max(STOP_SLOTS, -(-len(stop_ids) // STOP_SLOTS) * STOP_SLOTS)
  out = np.full((width,), -1, np.int32)
  out[:len(stop_ids)] = stop_ids
  return out


def _is_stop(tok, stop_S):
  """Whether each token is one of the stop ids (``-1`` padding matches no token)."""
  return jnp.any(tok[..., None] == stop_S, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "params", "pad_id"))
def _generate_jit(state, cache, logits_BxV, key, stop_S, *, graphdef, max_new_tokens, params, pad_id):
  model = nnx.merge(graphdef, state)
  b = logits_BxV.shape[0]
  key, sub = jax.random.split(key)
  first_B = sample(sub, logits_BxV, params)
  s = _LoopState(
      cache=cache, last_B=first_B,
      out_BxN=jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first_B),
      num_new_B=jnp.ones((b,), jnp.int32), done_B=_is_stop(first_B, stop_S),
      step=jnp.array(1, jnp.int32), key=key)

  def cond(s):
    return (s.step < max_new_tokens) & ~jnp.all(s.done_B)

  def body(s):
    step_out = model(s.last_B[:, None], s.cache.lengths_B[:, None], s.cache)
    key, sub = jax.random.split(s.key)
    tok_B = jnp.where(s.done_B, pad_id, sample(sub, step_out.logits_BxTxV[:, -1], params))
    return _LoopState(
        cache=step_out.cache, last_B=tok_B, out_BxN=s.out_BxN.at[:, s.step].set(tok_B),
        num_new_B=s.num_new_B + (~s.done_B).astype(jnp.int32),
        done_B=s.done_B | _is_stop(tok_B, stop_S), step=s.step + 1, key=key)

  s = jax.lax.while_loop(cond, body, s)
  return s.out_BxN, s.num_new_B


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
             params: SamplingParams = SamplingParams(), seed: int = 0,
             stop_ids: Sequence[int] | None = None, max_cache_len: int | None = None,
             pad_id: int = 0, prompt_width: int = 0) -> Generation:
  """Decodes ``max_new_tokens`` (or until a stop token) for each prompt (token id lists).

  ``stop_ids`` defaults to the config's EOS ids; pass ``()`` to ignore EOS. The cache holds
  the longest prompt plus ``max_new_tokens``; ``max_cache_len`` (default: the model's
  context length) bounds it. Prompts are padded to a bucketed width of at least
  ``prompt_width``: evaluations pass their longest prompt so that one compilation serves all.
  """
  tokens_BxP, lengths_B, cache_len, stop = prepare_prompts(
      model, prompts, max_new_tokens, max_cache_len, stop_ids, pad_id, prompt_width=prompt_width)
  graphdef, state = nnx.split(model)
  (cache, _, logits_BxV), compile0, run0 = run_prefill(graphdef, state, tokens_BxP, lengths_B,
                                                       cache_len)
  args = (state, cache, logits_BxV, jax.random.key(seed), jnp.asarray(stop))
  statics = dict(graphdef=graphdef, max_new_tokens=max_new_tokens, params=params, pad_id=pad_id)
  (out_BxN, num_new_B), compile_s, run_s = run_compiled(_generate_jit, args, statics)
  return Generation(tokens=[out_BxN[i, :n].tolist() for i, n in enumerate(num_new_B)],
                    num_new=num_new_B.tolist(), seconds=run0 + run_s,
                    compile_seconds=compile0 + compile_s)


def prepare_prompts(model: Transformer, prompts, max_new_tokens: int, max_cache_len: int | None,
                    stop_ids, pad_id: int, draft_nodes: int = 0, prompt_width: int = 0):
  """Validates a decoding request; returns padded prompts, lengths, cache length, stop array.

  The cache holds the longest prompt, ``max_new_tokens`` and, for speculative decoding,
  room for the last step's tree and accepted path (``2 * (draft_nodes + 1)`` slots).
  """
  if max_new_tokens < 1:
    raise EagleJaxError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  limit = max_cache_len or model.config.max_position_embeddings
  if limit > model.config.max_position_embeddings:
    raise EagleJaxError(f"cache length {limit} exceeds the model's context of "
                        f"{model.config.max_position_embeddings} tokens (its sliding window, if it "
                        "has one: attention is exact only within it)")
  tokens_BxP, lengths_B = pad_prompts(prompts, pad_id=pad_id, min_width=prompt_width)
  extra = 2 * (draft_nodes + 1) if draft_nodes else 0
  need = int(lengths_B.max()) + max_new_tokens + extra
  if need > limit:
    draft = f" and a {draft_nodes}-node draft" if draft_nodes else ""
    raise EagleJaxError(
        f"prompt of {int(lengths_B.max())} tokens plus max_new_tokens={max_new_tokens}{draft} "
        f"needs {need} cache slots, more than the cache length {limit}")
  cache_len = min(tokens_BxP.shape[1] + -(-(max_new_tokens + extra) // BUCKET) * BUCKET, limit)
  # a padded width past a short cache holds only padding: trim it, so that every [B, P] prompt
  # array (the prompt pass, prompt lookup's history) fits in the cache
  tokens_BxP = tokens_BxP[:, :cache_len]
  stop = stop_array(tuple(model.config.eos_token_ids if stop_ids is None else stop_ids))
  return tokens_BxP, lengths_B, cache_len, stop


_COMPILED: dict = {}


def run_compiled(jitted, args, statics: dict, host: bool = True):
  """Compiles ``jitted`` ahead of time once per (function, argument shapes, statics), then runs
  it; returns (outputs, compile seconds, run seconds) so runs are timed without compile.
  Outputs are numpy arrays, or device arrays with ``host=False``."""
  shapes = tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(args))
  key = (jitted, jax.tree.structure(args), shapes, tuple(sorted(statics.items())), parallel.current())
  t0 = time.perf_counter()
  if key not in _COMPILED:
    _COMPILED[key] = jitted.lower(*args, **statics).compile()
  t1 = time.perf_counter()
  out = jax.block_until_ready(_COMPILED[key](*args))
  t2 = time.perf_counter()
  return (jax.tree.map(parallel.to_host, out) if host else out), t1 - t0, t2 - t1
