"""Hardware-aware EAGLE-2 tree budget: pick ``total_tokens`` and ``depth`` for this machine.

EAGLE-2's reference code tunes ``total_token`` by timing generation. Timing every setting means
compiling every setting, so we predict instead, from three measurements on this machine:

1. **Acceptance at every budget from one run per depth.** The dynamic drafter lays out its
   nodes best first (:mod:`eagle_jax.drafters.eagle.drafter`): the tree a budget of ``n`` nodes keeps
   is exactly slots ``1..n``. Under greedy verification the accepted path is the target's own
   continuation, so with budget ``n`` a step accepts the leading path nodes whose slots are
   ``<= n``: exact per step. One greedy run with the largest budget, recording each step's
   accepted slots, estimates tau(n) for every ``n`` at once (an estimate over a whole run: a
   smaller budget would verify from different roots; on tiny models it was exact from n = 3
   and within 0.3% below).
2. **Verify cost** c(n + 1): one target forward over ``n`` nodes plus the root
   (:func:`eagle_jax.decoding.costs.verify_cost_curve`).
3. **Draft cost** d(depth): the head's propose + update, timed jitted.

Predicted tokens/s(n, depth) = tau(n) / (c(n + 1) + d(depth)); the best pair wins. Prompts are
held-out ShareGPT first turns by default (not the evaluation set).

An EAGLE-1/2 head may also draft over a reduced vocabulary, the most frequent training-reply
tokens through their rows of the target's LM head (as FR-Spec does): on a small target the
full LM head is most of the draft cost. Each size is one more axis of the same search.
"""

from __future__ import annotations

import numpy as np

from eagle_jax.decoding.costs import draft_cost_ms
from eagle_jax.decoding.speculative import speculative_generate
from eagle_jax.drafters.eagle.drafter import EagleDrafter


def tau_by_budget(accepted_slots, max_nodes: int) -> np.ndarray:
  """``tau[n]`` for n = 0..max_nodes from per-step accepted slot paths of a best-first tree."""
  steps = [path for row in accepted_slots for path in row]
  tau = np.ones(max_nodes + 1)
  if not steps:
    return tau
  for n in range(1, max_nodes + 1):
    tau[n] = 1 + np.mean([sum(1 for s in path if s <= n) for path in steps])
  return tau


def tune_budget(head, target, prompts, *, curve: dict[int, float], top_k: int = 8,
                depths=(4, 5, 6, 7), max_nodes: int = 64, max_new_tokens: int = 64,
                top_ks=None, draft_vocabs: dict | None = None) -> dict:
  """Best ``(top_k, depth, total_tokens)`` by predicted tokens/s, with the tables behind it.

  ``draft_vocabs`` maps sizes to draft vocabularies (target ids) to try as well (EAGLE-1/2
  heads; size 0 = the whole vocabulary, always tried).
  """
  best, table = None, {}
  for size, ids in {0: None, **(draft_vocabs or {})}.items():
    for k in (top_ks or (top_k,)):
      shallow_ms = {}  # a budget of n < depth nodes drafts n levels whatever the depth: time it once
      for depth in depths:
        key = f"top_k={k},depth={depth}" + (f",draft_vocab={size}" if size else "")
        table[key] = _tune_setting(head, target, prompts, curve, k, depth, max_nodes,
                                   max_new_tokens, ids, shallow_ms)
        top = max(table[key]["rows"], key=lambda r: r["tokens_per_s"])
        if best is None or top["tokens_per_s"] > best["tokens_per_s"]:
          best = dict(top, depth=depth, top_k=k, draft_vocab=size)
  vanilla = 1000 / curve[1]
  return {"top_k": best["top_k"], "depth": best["depth"], "total_tokens": best["total_tokens"],
          "draft_vocab": best["draft_vocab"],
          "predicted_tau": best["tau"], "predicted_tokens_per_s": best["tokens_per_s"],
          "vanilla_tokens_per_s": round(vanilla, 2),
          "predicted_speedup": round(best["tokens_per_s"] / vanilla, 3),
          "verify_cost_ms": curve, "by_setting": table,
          "method": "greedy run at the largest budget per (top_k, depth, draft vocabulary); tau(n) "
                    "from best-first slots; cost = verify c(n+1) + timed draft propose/update"}


def _tune_setting(head, target, prompts, curve, k, depth, max_nodes, max_new_tokens, ids,
                  shallow_ms: dict) -> dict:
  """Predicted tokens/s at every budget n for one (top_k, depth, draft vocabulary).

  ``shallow_ms`` caches the draft cost of budgets ``n`` below the depth, shared by the depths of
  one (top_k, draft vocabulary): such a drafter is clamped to ``n`` levels, the same program
  whatever the depth asked for.
  """
  pool = k + (depth - 1) * k ** 2
  n_max = min(max_nodes, pool, max(curve) - 1)
  drafter, dparams = EagleDrafter.create(head, target, None, draft_ids=ids, top_k=k, depth=depth,
                                         total_tokens=n_max)
  gen = speculative_generate(target, drafter, dparams, prompts, max_new_tokens=max_new_tokens,
                             stop_ids=())
  tau = tau_by_budget(gen.accepted_slots, n_max)
  d_ms = draft_cost_ms(drafter, dparams, target, prompts[0])
  # a budget of n < depth nodes drafts only n levels (EagleDrafter clamps the depth): time the
  # drafter that will run, not the full-depth one
  shallow = {}
  for n in range(1, min(depth, n_max + 1)):
    if n not in shallow_ms:
      d, dp = EagleDrafter.create(head, target, None, draft_ids=ids, top_k=k, depth=n, total_tokens=n)
      shallow_ms[n] = draft_cost_ms(d, dp, target, prompts[0])
    shallow[n] = shallow_ms[n]
  xs = sorted(curve)
  rows = []
  for n in range(1, n_max + 1):
    cost = float(np.interp(n + 1, xs, [curve[x] for x in xs])) + shallow.get(n, d_ms)
    rows.append({"total_tokens": n, "tau": round(float(tau[n]), 3),
                 "ms_per_step": round(cost, 2), "tokens_per_s": round(1000 * tau[n] / cost, 2)})
  return {"draft_ms": round(d_ms, 2), "draft_ms_by_budget": {n: round(v, 2) for n, v in shallow.items()},
          "rows": rows}
