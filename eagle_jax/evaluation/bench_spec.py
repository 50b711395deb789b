"""``eagle-jax bench spec``: every drafter on the same MT-bench prompts, in one run.

Reports per method tokens/s, speedup over our vanilla decode, tau (tokens per target pass,
bonus included), n-alpha, per-category figures, whether greedy outputs equal vanilla's, the
measured verify-cost curve (ms per target pass for 1..64 tree nodes) and the speedup predicted
from measured acceptance and cost (:func:`eagle_jax.decoding.costs.predict_speedup`: for chains the
i.i.d. formula E = (1 - a^(g+1)) / (1 - a) at the measured a; for trees the measured tau), also
with the draft costing nothing, beside the ceiling a perfect free drafter would reach on the
curve (:func:`eagle_jax.decoding.costs.speedup_ceiling`).
"""

from __future__ import annotations

import collections
import functools
import time

import jax
import numpy as np

from eagle_jax.decoding.costs import (
  predict_speedup,
  sizes_up_to,
  speedup_ceiling,
  verify_cost_curve,
)
from eagle_jax.decoding.generate import generate
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.speculative import (
  acceptance_rates,
  is_chain,
  loop_widths,
  speculative_generate,
  verify_widths,
)
from eagle_jax.drafters.eagle.tune import draft_cost_ms
from eagle_jax.drafters.factory import (
  EAGLE_VERSION,
  DrafterOptions,
  find_checkpoint,
  make_drafter,
  method_spec,
)
from eagle_jax.evaluation.prompts import load_mtbench, pick_questions
from eagle_jax.model.registry import load_model


def _hf_prompt_lookup(folder, prompts, max_new_tokens):
  # import time: torch and transformers take about 4 s to import; only the reference needs them
  import torch  # noqa: I001 (import time)
  from transformers import AutoModelForCausalLM  # (import time, above)

  hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  hf.generation_config.eos_token_id = None
  out = {}
  with torch.inference_mode():
    for name, extra in [("hf_greedy", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10})]:
      hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, **extra)
      t = time.perf_counter()
      for p in prompts:
        ids = torch.tensor([p])
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                    do_sample=False, **extra)
      out[name] = round(len(prompts) * max_new_tokens / (time.perf_counter() - t), 2)
  return out


def _timed_runs(runs: dict, prompts, max_new_tokens: int, repeats: int) -> dict:
  """Per method, one generation per prompt: the fastest of ``repeats`` timed runs.

  Methods are interleaved prompt by prompt (and repeats round by round), so a change in the
  machine's speed during the benchmark hits every method alike, and the fastest run drops a
  run slowed by other work; every prompt-length bucket is compiled before timing starts.
  """
  for run in runs.values():
    seen = set()
    for p in prompts:
      if len(p) // 64 not in seen:
        seen.add(len(p) // 64)
        run(p, max_new_tokens)
  best = {name: [None] * len(prompts) for name in runs}
  for _ in range(max(repeats, 1)):
    for i, p in enumerate(prompts):
      for name, run in runs.items():
        g = run(p, max_new_tokens)
        if best[name][i] is None or g.seconds < best[name][i].seconds:
          best[name][i] = g
  return best


def bench_spec(model: str, methods=("vanilla", "pld", "pld-static", "self-draft"), num_prompts: int = 16,
               max_new_tokens: int = 128, temperature: float = 0.0,
               options: DrafterOptions = DrafterOptions(), with_hf: bool = True,
               repeats: int = 2) -> dict:
  lm = load_model(model)
  target = lm.model
  questions = pick_questions(load_mtbench(), num_prompts)
  prompts = [lm.tokenizer.chat_prompt(q.turns[0]) for q in questions]
  params = SamplingParams(temperature=temperature)
  drafters, runs, specs = {}, {}, {name: method_spec(name, options) for name in methods}
  for name in methods:
    kind, opts = specs[name]
    drafter, dparams = drafters[name] = make_drafter(kind, target, opts, model)
    if drafter is None:
      runs[name] = lambda p, n: generate(target, [p], max_new_tokens=n, params=params, stop_ids=())
    else:
      runs[name] = lambda p, n, d=drafter, dp=dparams: speculative_generate(
          target, d, dp, [p], max_new_tokens=n, params=params, stop_ids=())
  # the printed grid, extended past the largest tree here (n nodes + the root) so that its cost
  # is interpolated, never clamped to the grid's end
  largest = max((d.num_nodes for d, _ in drafters.values() if d is not None), default=0)
  sizes = {1, 2, 4, 8, 16, 26, 32, 64}
  sizes |= {max(sizes_up_to(largest))} if largest + 1 > max(sizes) else set()
  curve = verify_cost_curve(target, sizes=tuple(sorted(sizes)))
  timed = _timed_runs(runs, prompts, max_new_tokens, repeats)
  results, vanilla_tokens = {}, None
  for name in sorted(methods, key=lambda n: specs[n][0] != "vanilla"):  # speedups need vanilla first
    drafter, dparams = drafters[name]
    kind, opts = specs[name]
    gens = timed[name]
    secs = sum(g.seconds for g in gens)
    tokens = [g.tokens[0] for g in gens]
    row = {"tokens_per_s": round(sum(g.num_new[0] for g in gens) / secs, 2), "seconds": round(secs, 3)}
    cats = collections.defaultdict(list)
    for q, g in zip(questions, gens):
      cats[q.category].append(g)
    if drafter is None:
      vanilla_tokens, vanilla_secs = tokens, {c: sum(g.seconds for g in gs) for c, gs in cats.items()}
      vanilla_total = secs
      row["per_category"] = {c: {"tokens_per_s": round(sum(g.num_new[0] for g in gs) / vanilla_secs[c], 2)}
                             for c, gs in cats.items()}
    else:
      accepted = [g.accepted[0] for g in gens]
      drafted = [g.drafted_depth[0] for g in gens]
      gamma = drafter.max_depth
      draft_ms = draft_cost_ms(drafter, dparams, target, prompts[0])
      predict = functools.partial(
          predict_speedup, [a for r in accepted for a in r], [d for r in drafted for d in r], curve,
          widths=verify_widths(drafter), chain=is_chain(drafter))
      predicted, alpha = predict(draft_ms=draft_ms)
      free_draft, _ = predict(draft_ms=0.0)  # the same acceptance, drafting at no cost
      if kind in EAGLE_VERSION or kind in ("medusa", "draft-model"):
        row["checkpoint"] = opts.draft_model or find_checkpoint(kind, opts.runs_dir, model)
      tree = getattr(drafter, "tree", "chain")
      widths, steps = verify_widths(drafter), loop_widths(drafter)
      if tree == "chain":  # at batch 1 a chain's drafted depth is its verified width
        used = collections.Counter(next((w for w in steps if w >= d), steps[0])
                                   for row_d in drafted for d in row_d)
        row["steps_by_width"] = {str(w): used[w] for w in steps}
      if getattr(drafter, "costs", ()):
        row["width_costs"] = dict(zip(map(str, widths), drafter.costs))
      row["tree"] = (f"chain of {drafter.num_nodes}" if tree == "chain" and len(widths) == 1 else
                     f"chain of {', '.join(map(str, widths))} (cost-aware)" if tree == "chain" else
                     f"static {drafter.num_nodes} nodes, depth {drafter.max_depth}" if tree is not None
                     else f"dynamic top_k={drafter.top_k} depth={drafter.depth} "
                          f"total_tokens={drafter.total_tokens}")
      if getattr(drafter, "draft_vocab", 0):
        row["tree"] += f", {drafter.draft_vocab}-token draft vocab"
      row.update({
          "speedup": round(vanilla_total / secs, 3) if vanilla_tokens else None,
          "tau": round(float(np.mean([a for r in accepted for a in r]) + 1), 3),
          "n_alpha": [None if a != a else round(a, 3) for a in acceptance_rates(accepted, drafted, gamma)],
          "alpha_iid": None if alpha is None else round(alpha, 3),
          "predicted_speedup": None if predicted is None else round(predicted, 3),
          "predicted_speedup_free_draft": None if free_draft is None else round(free_draft, 3),
          "draft_ms": round(draft_ms, 2),
          "greedy_matches_vanilla": None if vanilla_tokens is None or temperature > 0 else sum(
              a == b for a, b in zip(tokens, vanilla_tokens)),
          "per_category": {c: {
              "tokens_per_s": round(sum(g.num_new[0] for g in gs) / sum(g.seconds for g in gs), 2),
              "speedup": round(vanilla_secs[c] / sum(g.seconds for g in gs), 3) if vanilla_tokens else None,
              "tau": round(float(np.mean([a for g in gs for a in g.accepted[0]]) + 1), 3)}
              for c, gs in cats.items()},
      })
    results[name] = row
  out = {"methods": results, "verify_cost_ms": curve, "speedup_ceiling": speedup_ceiling(curve)}
  if with_hf:
    out["transformers_tok_s"] = _hf_prompt_lookup(lm.folder, prompts, max_new_tokens)
  out["settings"] = {
      "model": model, "timing": f"fastest of {max(repeats, 1)} runs per prompt and method, methods "
      "interleaved prompt by prompt", "prompts": f"MT-bench first turns, {len(prompts)} questions, "
      f"{-(-len(prompts) // 8)} per category", "max_new_tokens": max_new_tokens,
      "temperature": temperature, "batch": 1, "eos": "ignored (fixed length)",
      "options": {k: v for k, v in vars(options).items()},
      "tau": "tokens per target verify pass, bonus token included, prefill excluded",
      "speedup": "our vanilla seconds / method seconds, same prompts, same run",
      "predicted_speedup": "eagle_jax.decoding.costs.predict_speedup: tokens per step (chains: the i.i.d. "
      "formula at the measured alpha; trees: measured) over c(verified width + 1) + timed draft "
      "update + propose, a step that drafted nothing costing c(1) + the draft, against c(1) per token",
      "predicted_speedup_free_draft": "the same with a draft costing nothing: what the method's "
      "acceptance allows on this machine's verify costs",
      "speedup_ceiling": "eagle_jax.decoding.costs.speedup_ceiling: a perfect, free drafter, n tokens "
      "accepted per c(n), at the best n on the curve: what this machine's verify costs allow",
      "jax_version": jax.__version__, "backend": jax.default_backend()}
  return out
