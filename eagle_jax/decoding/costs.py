"""Timing on this machine: the verify-cost curve and a wall-clock helper (fastest of repeats).

Every hardware-aware choice in eagle_jax (EAGLE-2 tree budgets, prompt lookup's draft widths,
the benchmarks' predicted speedups) divides acceptance by these measured costs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.decoding.generate import features_of
from eagle_jax.decoding.protocol import Accepted
from eagle_jax.decoding.sampling import SamplingParams, greedy_token
from eagle_jax.model.transformer import KVCache

_VERIFY_MS: dict = {}  # per process: (architecture, dtype, backend, prefix, repeats, n) -> ms


def fastest_ms(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
  """Fastest wall ms of ``fn(*args)`` (outputs awaited) over ``repeats`` calls, after ``warmup``
  untimed calls (the first compiles).

  The fastest call, not the median: on a shared machine other work only ever adds time, and the
  first calls after a compilation run slower, so the minimum after a warm-up is the steadiest
  estimate of the program's own cost.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return 1000 * min(times)


def curve_from_json(verify_cost_ms) -> dict[int, float]:
  """A verify-cost curve as stored in JSON (``costs.json``, whose keys are strings): ms by
  tokens in the pass; empty for None."""
  return {int(k): v for k, v in (verify_cost_ms or {}).items()}


LONG = 9  # the longer chain of forwards in one call (verify_cost_curve)


def verify_cost_curve(model, sizes=(1, 2, 4, 8, 16, 32, 64), prefix: int = 192, repeats: int = 5):
  """Fastest ms of one target forward over ``n`` tree nodes after a ``prefix``-token cache.

  Timed as the speculative loop runs it: chained inside one compiled program (the cache carried
  and updated in place, one compilation per size). One call runs the forward once, another
  ``LONG`` (9) times; the curve is their difference over ``LONG - 1``, so the cost of calling a
  compiled program from Python (for a small model on a CPU, more than the forward's own
  marginal cost) is not counted as verify cost. Each of the ``repeats`` rounds times every
  size and both chains once, and each keeps its fastest call: interleaved so that the shared
  machine's slow swings reach every size alike (timed size by size, a curve can come out
  non-monotonic). ``eagle-jax bench spec --json`` prints the curve (``verify_cost_ms``).

  Each size is timed once per process and architecture (the cost depends on shapes, not
  weights), so the tuning after every training and the experiment runner share one curve.
  """
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens, cache, chain):  # chain is traced: one compilation per size
    m = nnx.merge(graphdef, state)
    t = tokens.shape[1]

    def body(_, carry):
      tokens, cache = carry
      out = m(tokens, cache.lengths_B[:, None] + jnp.arange(t)[None], cache,
              num_valid_B=jnp.zeros((1,), jnp.int32))
      return greedy_token(out.logits_BxTxV).astype(tokens.dtype), out.cache

    return jax.lax.fori_loop(0, chain, body, (tokens, cache))

  base = (model.config, str(model.embed.dtype), jax.default_backend(), prefix, repeats)
  args = {}
  for n in sizes:
    if base + (n,) not in _VERIFY_MS:
      cache = KVCache.init(model.config, 1, prefix + 64 + n, model.embed.dtype)
      cache = cache.replace(lengths_B=jnp.array([prefix], jnp.int32))
      args[n] = (state, jnp.ones((1, n), jnp.int32), cache)
  # rounds over every size and both chain lengths, so that the machine's slow drifts (seconds
  # long on a shared host) reach all of them alike, not one size or one chain length
  best = {(n, chain): fastest_ms(forward, *a, jnp.int32(chain), repeats=1)
          for n, a in args.items() for chain in (1, LONG)}
  for _ in range(repeats - 1):
    for (n, chain), ms in best.items():
      best[n, chain] = min(ms, fastest_ms(forward, *args[n], jnp.int32(chain), repeats=1, warmup=0))
  for n in args:
    # at least 0.01 ms: a tiny model's forward can time below the noise, and costs divide
    _VERIFY_MS[base + (n,)] = max(round((best[n, LONG] - best[n, 1]) / (LONG - 1), 2), 0.01)
  return {n: _VERIFY_MS[base + (n,)] for n in sizes}


GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128)  # verify sizes (nodes incl. root)


def sizes_up_to(max_nodes: int) -> tuple[int, ...]:
  """The grid sizes up to ``max_nodes + 1`` (a tree plus its root) and the next one, so any
  tree of at most ``max_nodes`` nodes is interpolated on the curve, not clamped."""
  return tuple(n for n in GRID if n <= max_nodes + 1) + tuple(n for n in GRID if n > max_nodes + 1)[:1]


def verify_cost_up_to(model, max_nodes: int) -> dict[int, float]:
  """The verify-cost curve at :func:`sizes_up_to` ``(max_nodes)``."""
  return verify_cost_curve(model, sizes=sizes_up_to(max_nodes))


def interp_ms(curve: dict[int, float], n: float) -> float:
  """The verify-cost curve (ms by number of tokens in the pass) interpolated at ``n`` tokens."""
  xs = sorted(curve)
  return float(np.interp(n, xs, [curve[x] for x in xs]))


def chain_tokens(alpha: float, gamma: float) -> float:
  """Expected tokens per verify pass of a ``gamma``-token chain with i.i.d. per-token acceptance
  ``alpha``, bonus token included: ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (Leviathan et al.,
  arXiv:2211.17192; Chen et al., arXiv:2302.01318; see docs/methods.md)."""
  return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup_ceiling(curve: dict[int, float]) -> dict[str, float | int]:
  """The speedup over vanilla decoding that a perfect drafter costing nothing would reach with
  this verify-cost curve: a pass over ``n`` tokens (the root and ``n - 1`` drafted ones, every one
  accepted) yields ``n`` tokens for c(n) where vanilla yields one for c(1). Returns the best
  ``n`` on the curve and its ``n c(1) / c(n)``. What the hardware allows, against which
  ``predict_speedup`` shows what a drafter's acceptance and draft cost leave of it."""
  if 1 not in curve:
    raise ValueError("the verify-cost curve needs c(1), the one-token pass")
  best = max(sorted(curve), key=lambda n: n * curve[1] / curve[n])
  return {"speedup": round(best * curve[1] / curve[best], 3), "tokens_per_pass": best}


def predict_speedup(accepted, drafted, curve: dict[int, float], *, widths, draft_ms: float,
                    chain: bool) -> tuple[float | None, float | None]:
  """Speedup over vanilla decoding predicted from measured acceptance and measured costs: the one
  definition behind ``bench spec``, the experiment tables and the sweeps.

  ``accepted`` and ``drafted`` hold, per step (over every row and prompt), the accepted draft
  tokens and the drafted depth; ``curve`` is the verify-cost curve (ms by tokens in the pass,
  with 1 = a vanilla step); ``widths`` the drafter's verify-width ladder; ``draft_ms`` its timed
  draft step (update + propose), paid by every step since the drafter runs every step. A step
  that drafted nothing is a plain decode step: 1 token for c(1). One that drafted verifies the
  smallest width of the ladder holding its ``d`` nodes, c(w + 1), and yields
  - for chains, the i.i.d. expectation :func:`chain_tokens` ``(alpha, d)``, with alpha =
    accepted / tried over the drafted steps (a step tries its accepted tokens plus the first
    rejected one, capped at its depth);
  - for trees (no closed form), its measured accepted + 1.
  Vanilla yields one token per c(1). Returns ``(speedup, alpha)``: ``(None, None)`` without
  steps, alpha None when no step drafted. Costs are read off the curve, never extrapolated: a
  ladder wider than the curve covers, or a draft wider than the ladder, is a ValueError.
  """
  acc = np.asarray(list(accepted), np.int64)
  dep = np.asarray(list(drafted), np.int64)
  if not acc.size or 1 not in curve:
    return None, None
  has = dep > 0
  tried = int(np.minimum(acc[has] + 1, dep[has]).sum())
  alpha = float(acc[has].sum() / tried) if tried else None
  ladder = sorted(widths)
  if has.any():
    if not ladder or int(dep.max()) > ladder[-1]:
      raise ValueError(f"a step drafted {int(dep.max())} tokens but the verify widths are {ladder}")
    if ladder[-1] + 1 > max(curve):
      raise ValueError(f"the verify-cost curve ends at {max(curve)} tokens; the widest verify "
                       f"pass holds {ladder[-1] + 1}")
  width = lambda d: next(w for w in ladder if w >= d)
  tokens = ms = 0.0
  for a, d in zip(acc, dep):
    ms += draft_ms + (interp_ms(curve, width(d) + 1) if d > 0 else curve[1])
    tokens += (chain_tokens(alpha, d) if chain else a + 1) if d > 0 else 1
  return tokens * curve[1] / ms, alpha


def draft_cost_ms(drafter, dparams, target, prompt, repeats: int = 10) -> float:
  """Fastest ms (after a warm-up) of one ``update`` (a full accepted path) + ``propose`` of the
  drafter."""
  b, d = 1, drafter.max_depth
  p = jnp.asarray([prompt], jnp.int32)
  out = target(p, jnp.arange(p.shape[1])[None], None, return_layers=drafter.feature_layers)
  feats = features_of(out, drafter.feature_layers)
  state = drafter.init(dparams, p, jnp.array([p.shape[1]]), feats, jnp.array([1]),
                       p.shape[1] + 256)
  acc = Accepted(tokens_BxK=jnp.ones((b, d + 1), jnp.int32), count_B=jnp.array([d + 1]),
                 features_BxKxD=jnp.broadcast_to(feats[:, -1:], (b, d + 1, feats.shape[-1])))

  @jax.jit
  def step(dparams, state, acc):
    state = drafter.update(dparams, state, acc)
    return drafter.propose(dparams, state, acc.tokens_BxK[:, 0], jax.random.key(0), SamplingParams())

  return fastest_ms(step, dparams, state, acc, repeats=repeats)
