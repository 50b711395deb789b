"""``eagle-jax bench spec``: drafters against vanilla on the same MT-bench first turns, in one run.

A front end of the experiment runner (:func:`eagle_jax.evaluation.runner.run_config`): it builds
an experiment of the given methods (fixed-length generations, batch 1, the fastest of
``repeats`` runs per prompt, methods interleaved prompt by prompt so a change in the machine's
speed hits every method alike), runs it in a scratch results folder, and prints the runner's
summary per method: tokens/s, speedup over vanilla, tau, n-alpha, per-category figures,
whether greedy outputs equal vanilla's, the measured verify-cost curve (ms per target pass
for 1..64 tree nodes), the speedup predicted from measured acceptance and cost
(:func:`eagle_jax.decoding.costs.predict_speedup`), also with the draft costing nothing, and
the ceiling a perfect free drafter would reach on the curve
(:func:`eagle_jax.decoding.costs.speedup_ceiling`).
"""

from __future__ import annotations

import collections
import re
import tempfile
import time

import jax

from eagle_jax.decoding.costs import curve_from_json, speedup_ceiling
from eagle_jax.drafters import registry
from eagle_jax.drafters.kinds import flag_for
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation.prompts import load_mtbench, pick_questions
from eagle_jax.evaluation.runner import EvalConfig, ExperimentConfig, MethodConfig, run_config
from eagle_jax.parallel import MeshSpec, is_writer, parse_mesh
from eagle_jax.model.registry import load_model

GRID = (1, 2, 4, 8, 16, 26, 32, 64)  # verify-cost sizes always printed


def _hf_prompt_lookup(folder, prompts, max_new_tokens):
  import torch  # import time: about 2.6 s; only the transformers reference needs it
  from transformers import AutoModelForCausalLM  # import time: about 1.4 s

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


def methods_for(specs, options: dict, checkpoint: str | None,
                budget: str = "tuned") -> dict[str, MethodConfig]:
  """Experiment methods from ``--methods`` specs (``eagle2:draft_vocab=8192:top_k=4``): the
  common flags (``options``, ``checkpoint``) apply to every method whose kind reads them, a
  spec's own settings override them; ``budget`` (``tuned`` or ``paper``) applies to all. A
  common flag no method reads is an error."""
  unread = set(options) - {k for s in specs for k in _reads(registry.method_spec(s)[0])}
  if unread:
    raise EagleJaxError(f"{', '.join(sorted(flag_for(k) for k in unread))}: not used "
                        f"by any of the methods {', '.join(specs)}")
  out = {}
  for spec in specs:
    kind, values = registry.method_spec(spec)
    reads = _reads(kind)
    merged = {k: v for k, v in options.items() if k in reads} | values
    ckpt = merged.pop("checkpoint", None) or (checkpoint if registry.get(kind).weights else None)
    name = re.sub(r"[^A-Za-z0-9_.+=:-]", "-", spec)
    out[spec] = MethodConfig(name=name, drafter=kind, checkpoint=ckpt or "", budget=budget,
                             **merged)
    out[spec].options()  # a bad combination fails before anything runs
  if registry.VANILLA.name not in [m.kind for m in out.values()]:
    raise EagleJaxError("--methods must include vanilla (the speedup and greedy-match baseline)")
  return out


def _reads(kind: str) -> set[str]:
  return {f for f in registry.option_fields() if kind in registry.readers(f)}


def bench_spec(model: str, methods=("vanilla", "pld", "pld-static", "self-draft"), num_prompts: int = 16,
               max_new_tokens: int = 128, temperature: float = 0.0, options: dict | None = None,
               checkpoint: str | None = None, runs_dir: str = "runs", with_hf: bool = True,
               repeats: int = 2, progress: bool = False, budget: str = "tuned", mesh=None,
               dtype: str | None = None) -> dict:
  specs = list(dict.fromkeys(methods))
  by_spec = methods_for(specs, options or {}, checkpoint, budget)
  ev = EvalConfig(prompts="mtbench", num_questions=num_prompts, turns=(1,),
                  temperatures=(temperature,), batch_size=1, max_new_tokens=max_new_tokens,
                  stop_at_eos=False, repeats=max(repeats, 1), interleave=True)
  with tempfile.TemporaryDirectory(prefix="bench-spec-") as scratch:
    cfg = ExperimentConfig(name="bench-spec", methods=tuple(by_spec.values()), model=model,
                           runs_dir=runs_dir, results_dir=scratch, eval=ev,
                           mesh=parse_mesh(mesh) or MeshSpec(), dtype=dtype or "")
    summary, units, costs = run_config(cfg, progress=progress, curve_sizes=GRID)
  t = f"T{temperature}"
  results = {}
  for spec in sorted(specs, key=lambda s: by_spec[s].kind != registry.VANILLA.name):
    m = by_spec[spec]
    entry, recs = summary["methods"][m.name], units[(m.name, temperature)]
    cell = entry[t]
    row = {"tokens_per_s": cell["tokens_per_s"], "seconds": cell["seconds"]}
    if m.kind == registry.VANILLA.name:
      row["per_category"] = {c: {"tokens_per_s": v["tokens_per_s"]} for c, v in cell["per_category"].items()}
      results[spec] = row
      continue
    if entry["checkpoint"]:
      row["checkpoint"] = entry["checkpoint"]
    widths = costs["loop_widths"][m.name]
    # at batch 1 a chain's drafted depth is its verified width; a tree with one verify width
    # runs it whenever it drafted anything (and the plain step otherwise)
    if costs["chain"][m.name] or len(costs["widths"][m.name]) == 1:
      used = collections.Counter(next((w for w in widths if w >= d), widths[0])
                                 for r in recs for d in r["drafted_depth"])
      row["steps_by_width"] = {str(w): used[w] for w in widths}
    if m.name in costs.get("width_costs", {}):
      row["width_costs"] = costs["width_costs"][m.name]
    row.update({
        "tree": cell["tree"], "speedup": cell["speedup"], "tau": cell["tau"],
        "n_alpha": cell["n_alpha"], "alpha_iid": cell["alpha_iid"],
        "predicted_speedup": cell["predicted_speedup"],
        "predicted_speedup_free_draft": cell["predicted_speedup_free_draft"],
        "draft_ms": round(costs["draft_ms"][m.name], 2),
        "greedy_matches_vanilla": (None if cell["greedy_mismatches"] is None
                                   else len(recs) - cell["greedy_mismatches"]),
        "per_category": cell["per_category"]})
    results[spec] = row
  curve = curve_from_json(costs["verify_cost_ms"])
  out = {"methods": results, "verify_cost_ms": curve, "speedup_ceiling": speedup_ceiling(curve)}
  if with_hf and is_writer():  # several processes: process 0 times the reference
    lm = load_model(model)
    questions = pick_questions(load_mtbench(), num_prompts)
    prompts = [lm.tokenizer.chat_prompt(q.turns[0]) for q in questions]
    out["transformers_tok_s"] = _hf_prompt_lookup(lm.folder, prompts, max_new_tokens)
  out["settings"] = {
      "model": model, "timing": f"fastest of {max(repeats, 1)} runs per prompt and method, methods "
      "interleaved prompt by prompt (eagle_jax.evaluation.runner, eval.repeats and eval.interleave)",
      "prompts": f"MT-bench first turns, {num_prompts} questions, {-(-num_prompts // 8)} per category",
      "max_new_tokens": max_new_tokens, "temperature": temperature, "batch": 1,
      "eos": "ignored (fixed length)", "options": dict(options or {}), "budget": budget,
      "tau": summary["settings"]["tau"],
      "speedup": "our vanilla seconds / method seconds, same prompts, same run",
      "predicted_speedup": "eagle_jax.decoding.costs.predict_speedup: tokens per step (chains: the "
      "i.i.d. formula at the measured alpha; trees: measured) over c(verified width + 1) + timed "
      "draft update + propose, a step that drafted nothing costing c(1) + the draft, against c(1) "
      "per token",
      "predicted_speedup_free_draft": "the same with a draft costing nothing: what the method's "
      "acceptance allows on this machine's verify costs",
      "speedup_ceiling": "eagle_jax.decoding.costs.speedup_ceiling: a perfect, free drafter, n "
      "tokens accepted per c(n), at the best n on the curve: what this machine's verify costs allow",
      "jax_version": jax.__version__, "backend": jax.default_backend()}
  return out
