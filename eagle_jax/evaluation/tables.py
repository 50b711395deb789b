"""Experiment summaries and paper-style tables (``eagle-jax table RESULTS_DIR...``).

Layout of Table 1 of the EAGLE-2 paper: rows are methods, columns are speedup and tau at each
temperature; ``per_category`` adds one table per temperature with a column per category.
Speedup = the method's tokens/s over vanilla's on the same prompts at the same temperature,
both timed by one process (at T=0 the outputs are identical, so this is also the ratio of
seconds).
"""

from __future__ import annotations

import json
import os

from eagle_jax.configs import to_dict
from eagle_jax.decoding.costs import curve_from_json, predict_speedup, speedup_ceiling
from eagle_jax.decoding.speculative import acceptance_rates, tau
from eagle_jax.errors import EagleJaxError

TAU = "tokens per target forward (verify) pass, bonus token included, prefill excluded"


def tau_of(records) -> float | None:
  """:func:`eagle_jax.decoding.speculative.tau` of run records (None without verify steps,
  i.e. vanilla)."""
  value = tau([r["accepted"] for r in records])
  return None if value != value else round(value, 3)


def tokens_per_s(records) -> float:
  """Generated tokens over decoding seconds (compilation excluded) of run records."""
  return sum(r["new_tokens"] for r in records) / max(sum(r["seconds"] for r in records), 1e-9)


def _cell(records, vanilla):
  return {"tau": tau_of(records), "tokens_per_s": round(tokens_per_s(records), 2),
          "speedup": round(tokens_per_s(records) / tokens_per_s(vanilla), 3)}


def _predicted(records, costs, name, free_draft: bool = False, alpha: bool = False):
  """Speedup predicted from the records' measured acceptance and the run's measured costs
  (:func:`eagle_jax.decoding.costs.predict_speedup`), with ``free_draft`` as if drafting cost
  nothing; with ``alpha`` instead the per-token acceptance a chain's prediction used (the
  i.i.d. alpha). None for vanilla or without costs."""
  if name not in costs.get("draft_ms", {}):
    return None
  nodes = costs["num_nodes"][name]
  speedup, iid = predict_speedup(
      [a for r in records for a in r["accepted"]], [d for r in records for d in r["drafted_depth"]],
      curve_from_json(costs.get("verify_cost_ms")),
      widths=costs.get("widths", {}).get(name, [nodes]),
      draft_ms=0.0 if free_draft else costs["draft_ms"][name],
      chain=costs.get("chain", {}).get(name, False))
  value = iid if alpha else speedup
  return None if value is None else round(value, 3)


def _ceiling(costs):
  """:func:`eagle_jax.decoding.costs.speedup_ceiling` of the run's verify-cost curve; None without one."""
  curve = curve_from_json(costs.get("verify_cost_ms"))
  return speedup_ceiling(curve) if 1 in curve else None


def _same_run(records, vanilla) -> bool:
  """Whether each record's vanilla (paired record by record, or the whole unit) was timed by the
  process that timed the record."""
  if len(records) == len(vanilla):
    return all(r.get("session") == v.get("session") for r, v in zip(records, vanilla))
  return {r.get("session") for r in records} == {r.get("session") for r in vanilla}


def summarize(cfg, units: dict, checkpoints: dict, costs: dict, baselines: dict | None = None) -> dict:
  """``summary.json`` of an experiment from its records (``units[(method, T)]``).
  ``baselines[(method, T)]``: the vanilla records that method is compared with, record by record
  (default: the current vanilla's)."""
  van = cfg.vanilla.name
  methods = {}
  for m in cfg.methods:
    per_t = {}
    for temp in cfg.eval.temperatures:
      recs = units[(m.name, temp)]
      vrecs = (baselines or {}).get((m.name, temp)) or units[(van, temp)]
      entry = _cell(recs, vrecs)
      alphas = acceptance_rates([r["accepted"] for r in recs], [r["drafted_depth"] for r in recs],
                                costs.get("max_depth", {}).get(m.name))
      ref = {(r["id"], r["turn"]): r["token_ids"] for r in vrecs}
      mismatches = sum(r["token_ids"] != ref[(r["id"], r["turn"])] for r in recs)
      cats = sorted({r["category"] for r in recs})
      entry.update({
          "n_alpha": [None if a != a else round(a, 3) for a in alphas],
          "seconds": round(sum(r["seconds"] for r in recs), 3),
          "new_tokens": sum(r["new_tokens"] for r in recs),
          "greedy_mismatches": mismatches if temp == 0 and m.name != van else None,
          # each record against vanilla's timed by the same process (records from before
          # sessions were kept count as one process)
          "same_run": _same_run(recs, vrecs),
          "predicted_speedup": _predicted(recs, costs, m.name),
          "predicted_speedup_free_draft": _predicted(recs, costs, m.name, free_draft=True),
          "alpha_iid": _predicted(recs, costs, m.name, alpha=True),
          "num_nodes": costs.get("num_nodes", {}).get(m.name),
          "tree": costs.get("tree", {}).get(m.name),
          "per_category": {c: _cell([r for r in recs if r["category"] == c],
                                    [r for r in vrecs if r["category"] == c]) for c in cats}})
      per_t[f"T{temp}"] = entry
    methods[m.name] = {"drafter": m.kind, "checkpoint": checkpoints.get(m.name),
                       "budget": m.budget, **per_t}
    if m.published:
      methods[m.name]["published"] = m.published_figures()
  ev = cfg.eval
  return {"name": cfg.name, "model": cfg.model, "methods": methods,
          "settings": {**to_dict(ev), "temperatures": list(ev.temperatures), "tau": TAU,
                       "speedup": "tokens/s over vanilla's, same prompts, same run (same_run false: "
                                  "vanilla was timed by another run)",
                       "verify_cost_ms": costs.get("verify_cost_ms"),
                       "speedup_ceiling": _ceiling(costs),
                       "prompts": f"{ev.prompts}: {ev.num_questions or 'all'} questions, turns "
                                  f"{list(ev.turns)}"}}


def read_summary(folder: str) -> dict:
  path = os.path.join(folder, "summary.json")
  if not os.path.isfile(path):
    raise EagleJaxError(f"{folder}: no summary.json (run the experiment with eagle-jax run CONFIG)")
  try:
    with open(path) as f:
      summary = json.load(f)
  except (OSError, ValueError) as e:
    raise EagleJaxError(f"{path}: unreadable summary ({e}); re-run the experiment") from None
  if not isinstance(summary, dict) or not {"name", "methods", "settings"} <= set(summary):
    raise EagleJaxError(f"{path}: not an eagle-jax run summary (no 'name', 'methods' or "
                        "'settings'); re-run the experiment with eagle-jax run CONFIG")
  methods, settings = summary["methods"], summary["settings"]
  if not (isinstance(methods, dict) and all(isinstance(m, dict) for m in methods.values())
          and isinstance(settings, dict) and isinstance(settings.get("temperatures"), list)):
    raise EagleJaxError(f"{path}: malformed run summary ('methods' must map names to entries, "
                        "'settings.temperatures' must be a list); re-run the experiment")
  return summary


def _fmt(x, suffix=""):
  return "-" if x is None else f"{x:.2f}{suffix}"


def _rows(summaries):
  """(label, method entry, temperatures) for every method of every summary."""
  multi = len(summaries) > 1
  for s in summaries:
    temps = [f"T{t}" for t in s["settings"]["temperatures"]]
    for name, entry in s["methods"].items():
      yield (f"{s['name']}/{name}" if multi else name), entry, temps


def _paper_temps(summaries, temps) -> list[str]:
  """The temperatures some method of ``summaries`` has a published figure at (paper columns)."""
  return [t for t in temps if any(t in e.get("published", {}) for _, e, _ in _rows(summaries))]


def _paper(e, t, times="x") -> str:
  """A method's published "speedup / tau" at ``t`` ("-" for a figure the paper does not give)."""
  p = e.get("published", {}).get(t)
  return "-" if p is None else f"{_fmt(p.get('speedup'), times)} / {_fmt(p.get('tau'))}"


def _sources(summaries) -> list[str]:
  return list(dict.fromkeys(p["source"] for _, e, _ in _rows(summaries)
                            for p in e.get("published", {}).values()))


ALPHA_DEPTHS = 6  # n-alpha columns of the acceptance tables (n = 1..6, as EAGLE reports them)


def _acceptance(summaries, t):
  """Rows ``[label, budget, tau, 1-alpha, ..., 6-alpha]`` (strings) of the acceptance table at
  ``t``; vanilla, which drafts nothing, is left out."""
  rows = []
  for label, e, _ in _rows(summaries):
    cell = e.get(t) or {}
    if cell.get("tau") is None:  # vanilla
      continue
    alphas = list(cell.get("n_alpha") or [])[:ALPHA_DEPTHS]
    alphas += [None] * (ALPHA_DEPTHS - len(alphas))
    rows.append([label, e.get("budget") or "-", _fmt(cell["tau"])] + [_fmt(a) for a in alphas])
  return rows


def render_markdown(summaries: list[dict], per_category: bool = False,
                    acceptance: bool = False) -> str:
  temps = list(dict.fromkeys(t for _, _, ts in _rows(summaries) for t in ts))
  paper = _paper_temps(summaries, temps)
  head = ["Method"] + [f"{c} ({t.replace('T', 'T=')})" for t in temps for c in ("Speedup", "τ")]
  head += [f"Paper ({t.replace('T', 'T=')})" for t in paper]
  lines = ["| " + " | ".join(head + ["Notes"]) + " |", "|" + "---|" * (len(head) + 1)]
  for label, e, _ in _rows(summaries):
    cells = []
    for t in temps:
      cells += [_fmt(e.get(t, {}).get("speedup"), "x"), _fmt(e.get(t, {}).get("tau"))]
    cells += [_paper(e, t) for t in paper]
    bad = [f"{t}: {e[t]['greedy_mismatches']} greedy mismatches vs vanilla" for t in temps
           if (e.get(t) or {}).get("greedy_mismatches")]
    bad += [f"{t}: vanilla timed in another run" for t in temps
            if (e.get(t) or {}).get("same_run") is False]
    lines.append("| " + " | ".join([label] + cells + ["; ".join(bad) or ""]) + " |")
  s0 = summaries[0]["settings"]
  lines.append(f"\nτ: {TAU}. Speedup: tokens/s over vanilla's on the same prompts in the same run "
               "(unless the Notes say otherwise). "
               f"Prompts: {s0.get('prompts')}; max_new_tokens {s0.get('max_new_tokens')}, "
               f"batch {s0.get('batch_size')}.")
  if paper:
    lines.append("Paper: the published speedup / τ of the method's setting (its own hardware "
                 "and target), from " + "; ".join(_sources(summaries)) + ".")
  if acceptance:
    alpha_head = [f"{n}-α" for n in range(1, ALPHA_DEPTHS + 1)]
    for t in temps:
      lines += ["", f"Acceptance, {t.replace('T', 'T=')}: τ and n-α (the acceptance rate at draft "
                "depth n given depths 1..n-1 were accepted; - where no draft reached depth n):", "",
                "| " + " | ".join(["Method", "Budget", "τ"] + alpha_head) + " |",
                "|" + "---|" * (3 + ALPHA_DEPTHS)]
      lines += ["| " + " | ".join(r) + " |" for r in _acceptance(summaries, t)]
  if per_category:
    for t in temps:
      cats = sorted({c for _, e, _ in _rows(summaries) for c in e.get(t, {}).get("per_category", {})})
      lines += ["", f"Per category, {t.replace('T', 'T=')} (speedup / τ):", "",
                "| Method | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
      for label, e, _ in _rows(summaries):
        pc = e.get(t, {}).get("per_category", {})
        lines.append("| " + " | ".join([label] + [
            f"{_fmt(pc.get(c, {}).get('speedup'), 'x')} / {_fmt(pc.get(c, {}).get('tau'))}" for c in cats]) + " |")
  return "\n".join(lines)


def render_latex(summaries: list[dict], per_category: bool = False,
                 acceptance: bool = False) -> str:
  temps = list(dict.fromkeys(t for _, _, ts in _rows(summaries) for t in ts))
  paper = _paper_temps(summaries, temps)
  esc = lambda s: s.replace("_", r"\_").replace("%", r"\%")
  out = [r"\begin{tabular}{l" + "cc" * len(temps) + "c" * len(paper) + "}", r"\toprule",
         " & " + " & ".join([rf"\multicolumn{{2}}{{c}}{{$T={t[1:]}$}}" for t in temps]
                            + [f"Paper $T={t[1:]}$" for t in paper]) + r" \\",
         "Method & " + " & ".join(["Speedup & $\\tau$"] * len(temps) + ["Speedup / $\\tau$"] * len(paper))
         + r" \\", r"\midrule"]
  for label, e, _ in _rows(summaries):
    cells = []
    for t in temps:
      cells += [_fmt(e.get(t, {}).get("speedup"), r"$\times$"), _fmt(e.get(t, {}).get("tau"))]
    cells += [_paper(e, t, r"$\times$") for t in paper]
    out.append(esc(label) + " & " + " & ".join(cells) + r" \\")
  out += [r"\bottomrule", r"\end{tabular}"]
  if acceptance:
    for t in temps:
      out += ["", rf"% acceptance, $T={t[1:]}$: $\tau$ and $n$-$\alpha$",
              r"\begin{tabular}{ll" + "c" * (1 + ALPHA_DEPTHS) + "}", r"\toprule",
              "Method & Budget & $\\tau$ & " + " & ".join(
                  f"${n}$-$\\alpha$" for n in range(1, ALPHA_DEPTHS + 1)) + r" \\", r"\midrule"]
      out += [" & ".join(esc(c) for c in r) + r" \\" for r in _acceptance(summaries, t)]
      out += [r"\bottomrule", r"\end{tabular}"]
  if per_category:
    for t in temps:
      cats = sorted({c for _, e, _ in _rows(summaries) for c in e.get(t, {}).get("per_category", {})})
      out += ["", rf"% per category, $T={t[1:]}$: speedup / $\tau$",
              r"\begin{tabular}{l" + "c" * len(cats) + "}", r"\toprule",
              "Method & " + " & ".join(esc(c) for c in cats) + r" \\", r"\midrule"]
      for label, e, _ in _rows(summaries):
        pc = e.get(t, {}).get("per_category", {})
        out.append(esc(label) + " & " + " & ".join(
            f"{_fmt(pc.get(c, {}).get('speedup'))} / {_fmt(pc.get(c, {}).get('tau'))}" for c in cats) + r" \\")
      out += [r"\bottomrule", r"\end{tabular}"]
  return "\n".join(out)


def render(folders: list[str], fmt: str = "markdown", per_category: bool = False,
           acceptance: bool = False) -> str:
  summaries = [read_summary(f) for f in folders]
  if fmt == "latex":
    return render_latex(summaries, per_category, acceptance)
  return render_markdown(summaries, per_category, acceptance)
