"""Sweeps over one setting at a time: draft budget, temperature, batch size, draft alignment.

    .venv/bin/python experiments/sweeps.py {budget,temperature,batch,alignment} \
        [--num-questions 8] [--max-new-tokens 64] [--out results] [--runs-dir runs] \
        [--methods ...] [--values ...]

Each sweep decodes the same MT-bench first turns (``questions_for(EvalConfig(num_questions=N))``,
spread over the 8 categories) with every setting, and with vanilla decoding at the same
temperature and batch size in the same process (the speedup denominator). It prints a table and
writes ``<out>/sweep-<kind>/sweep.json`` = ``{"sweep", "x", "rows", "settings"}`` (rows:
``method, x, tau, tokens_per_s, speedup, predicted_speedup, category``; ``category`` null = all
prompts) and ``<out>/sweep-<kind>/<kind>.png``; ``notebooks/sweeps.ipynb`` plots sweep.json.

Conventions (as :mod:`eagle_jax.evaluation.tables`): tau = mean accepted drafts per verify pass + 1 (bonus
token included, prefill excluded); speedup = tokens/s over vanilla's on the same prompts;
times exclude compilation. Trained drafters come from ``--runs-dir`` (the run with the most
training tokens); a missing one is a one-line error before anything is compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

import numpy as np
from flax import nnx

from eagle_jax.decoding.costs import draft_cost_ms
from eagle_jax.decoding.costs import predict_speedup, verify_cost_curve
from eagle_jax.drafters.eagle.drafter import EagleDrafter
from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.transformer import Linear, quantize_linears
from eagle_jax.drafters.registry import TRAINED
from eagle_jax.evaluation.runner import (EvalConfig, ExperimentConfig, MethodConfig,
                                  build_prompts, drafter_for, ensure_checkpoint, questions_for,
                                  run_unit)
from eagle_jax.model.registry import DEFAULT_MODEL, enable_compilation_cache, load_model
from eagle_jax.decoding.speculative import is_chain, verify_widths
from eagle_jax.evaluation.tables import TAU, tau_of, tokens_per_s

CHAIN = ("pld", "pld-static", "eagle1", "self-draft", "draft-model")  # budget = gamma, the chain length
TREE = ("eagle2", "eagle3", "medusa")  # budget = total_tokens, the tree's node count
GAMMAS = (1, 2, 3, 4, 6, 8)
TREE_SIZES = (4, 8, 16, 32, 64)
TEMPERATURES = (0.0, 0.5, 1.0)
BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_METHODS = {"budget": ("pld", "eagle1", "eagle2", "medusa"),
                   "temperature": ("eagle2", "pld"), "batch": ("eagle2", "pld")}
ALIGNMENT = {"trained-head": "eagle2", "untrained-head": "eagle2", "layer-skip": "self-draft",
             "draft-model": "draft-model"}  # drafter label -> the drafter kind it drafts as


@dataclasses.dataclass
class Bench:
  """One sweep's target, prompts and settings; vanilla baselines and costs, each measured once."""

  lm: Any  # eagle_jax.model.registry.LoadedModel
  cfg: ExperimentConfig
  prompts: list[dict]  # build_prompts dicts: id, category, turn, tokens
  progress: bool = False
  checkpoints: dict = dataclasses.field(default_factory=dict)
  _vanilla: dict = dataclasses.field(default_factory=dict)
  verify_ms: dict = dataclasses.field(default_factory=dict)  # n -> c(n), ms
  draft_ms: dict = dataclasses.field(default_factory=dict)  # "method@nodes" -> ms

  @classmethod
  def open(cls, cfg: ExperimentConfig, kinds, min_prompts: int = 1, progress: bool = False):
    """Finds the trained drafters ``kinds`` need (raising before any work), loads the target and
    builds the prompts, cycling through the questions up to a multiple of ``min_prompts``."""
    checkpoints = {k: ensure_checkpoint(MethodConfig(name=k), cfg, progress)
                   for k in dict.fromkeys(kinds) if k in TRAINED}
    lm = load_model(cfg.model)
    prompts = build_prompts(lm, questions_for(cfg.eval), (1,), None)
    total = math.ceil(len(prompts) / min_prompts) * min_prompts
    return cls(lm, cfg, [prompts[i % len(prompts)] for i in range(total)], progress, checkpoints)

  def build(self, method: MethodConfig):
    """``(drafter, dparams)`` of ``method``, with the checkpoint found by :meth:`open`."""
    method.validate()
    return drafter_for(method, self.lm.model, self.cfg, self.checkpoints.get(method.kind))

  def measure(self, label: str, built, temperature: float = 0.0, batch_size: int = 1):
    """Records of ``built`` = (drafter, dparams) and of vanilla at the same temperature and batch
    size (decoded once per pair), on the same prompts: ``(records, vanilla_records)``."""
    ev = dataclasses.replace(self.cfg.eval, batch_size=batch_size)
    decode = lambda label, built: run_unit(self.lm, *built, self.prompts, label, temperature, ev,
                                           self.progress)
    if (temperature, batch_size) not in self._vanilla:
      self._vanilla[(temperature, batch_size)] = decode("vanilla", (None, None))
    vanilla = self._vanilla[(temperature, batch_size)]
    return (vanilla if built[0] is None else decode(label, built)), vanilla

  def costs(self, built, label: str) -> tuple[float, dict[int, float]]:
    """``(draft ms, verify-cost curve)`` for the drafter ``built``: the fastest ms of one draft
    step (update with a full accepted path + propose) and of one target forward over 1 and
    w + 1 tokens for each verify width w, after a 192-token cache (each size measured once per
    sweep)."""
    sizes = (1,) + tuple(w + 1 for w in verify_widths(built[0]))
    if missing := tuple(n for n in sizes if n not in self.verify_ms):
      self.verify_ms.update(verify_cost_curve(self.lm.model, sizes=missing, repeats=5))
    ms = draft_cost_ms(*built, self.lm.model, self.prompts[0]["tokens"], repeats=5)
    self.draft_ms[label] = round(ms, 3)
    return ms, {n: self.verify_ms[n] for n in sizes}


def tau_and_tps(records) -> tuple[float | None, float]:
  """tau (None for vanilla) and tokens/s of ``run_unit`` records, as the runner's tables."""
  return tau_of(records), tokens_per_s(records)


def rows_of(method, x, records, vanilla, predicted=None, per_category=False) -> list[dict]:
  """The sweep row over all prompts (category null), then one per category if asked."""
  groups = [(None, records, vanilla)]
  if per_category:
    groups += [(c, [r for r in records if r["category"] == c],
                [r for r in vanilla if r["category"] == c])
               for c in dict.fromkeys(r["category"] for r in records)]
  predicted = None if predicted is None else round(predicted, 3)
  return [{"method": method, "x": x, "tau": tau_and_tps(recs)[0],
           "tokens_per_s": round(tau_and_tps(recs)[1], 2),
           "speedup": round(tau_and_tps(recs)[1] / tau_and_tps(vrecs)[1], 3),
           "predicted_speedup": None if category else predicted, "category": category}
          for category, recs, vrecs in groups]


def sweep_budget(cfg, methods=DEFAULT_METHODS["budget"], gammas=GAMMAS, sizes=TREE_SIZES,
                 progress=False) -> dict:
  """Speedup and tau against the draft budget, greedy, batch 1.

  x = nodes drafted per step: gamma for chains (pld, eagle1 = the EAGLE-1 head drafting a
  chain, self-draft, draft-model), total_tokens for trees (eagle2/eagle3 dynamic trees with the
  checkpoint's tuned depth and top_k, top_k widened if needed so that the largest size fits the
  drafted pool top_k + (depth - 1) top_k^2, the same for every size; medusa: the best static tree
  of that size for the checkpoint's held-out rank accuracies; a checkpoint without them keeps
  Medusa's default tree, and a size met twice is measured once).
  predicted_speedup: :func:`eagle_jax.decoding.costs.predict_speedup` (chains: the i.i.d. formula at the
  measured acceptance; trees: the measured tau), as :mod:`eagle_jax.evaluation.tables` and ``bench spec``.
  """
  _check("budget sweep: unknown method(s)", methods, CHAIN + TREE)
  bench = Bench.open(cfg, methods, progress=progress)
  rows = []
  for m in methods:
    seen, shape = set(), {}
    if m in ("eagle2", "eagle3"):  # the tuned top_k and depth, top_k widened to fit max(sizes)
      d = bench.build(MethodConfig(name=m))[0]
      k = next((k for k in range(d.top_k, max(sizes) + 1) if k + (d.depth - 1) * k * k >= max(sizes)),
               d.top_k)  # the tuned top_k when it already holds the largest size
      shape = dict(top_k=k, depth=d.depth)
    for x in gammas if m in CHAIN else sizes:
      built = bench.build(MethodConfig(name=m, gamma=x) if m in CHAIN else
                          MethodConfig(name=m, total_tokens=x, **shape))
      n = built[0].num_nodes
      if n in seen:
        print(f"[budget] {m}: {x} nodes gives the {n}-node tree already measured; skipped")
        continue
      seen.add(n)
      recs, vrecs = bench.measure(m, built)
      draft_ms, curve = bench.costs(built, f"{m}@{n}")
      predicted = predict_speedup([a for r in recs for a in r["accepted"]],
                                  [d for r in recs for d in r["drafted_depth"]], curve,
                                  widths=verify_widths(built[0]), draft_ms=draft_ms,
                                  chain=is_chain(built[0]))[0]
      rows += rows_of(m, n, recs, vrecs, predicted)
  return _sweep("budget", "draft_nodes", rows, bench)


def sweep_temperature(cfg, methods=DEFAULT_METHODS["temperature"], temperatures=TEMPERATURES,
                      progress=False) -> dict:
  """tau and speedup against the sampling temperature, overall and per MT-bench category (rows
  with ``category`` set): low-entropy tasks (math, coding, extraction) against open-ended ones
  (writing, roleplay). Batch 1; vanilla decodes at the same temperature with the same seeds."""
  bench = Bench.open(cfg, methods, progress=progress)
  rows = []
  for m in methods:
    built = bench.build(MethodConfig(name=m))
    for t in temperatures:
      rows += rows_of(m, float(t), *bench.measure(m, built, float(t)), per_category=True)
  return _sweep("temperature", "temperature", rows, bench)


def sweep_batch(cfg, methods=DEFAULT_METHODS["batch"], batch_sizes=BATCH_SIZES, temperature=0.0,
                progress=False) -> dict:
  """Speedup over vanilla at the same batch size, and tokens/s, against the batch size: where
  speculation stops paying off (a batch already fills the hardware that verification would
  use). The prompts cycle through the questions up to a multiple of the largest batch, so every
  batch size decodes the same prompts; vanilla rows (speedup 1) carry the baseline throughput."""
  bench = Bench.open(cfg, methods, min_prompts=max(batch_sizes), progress=progress)
  rows = []
  for m in ("vanilla",) + tuple(methods):
    built = (None, None) if m == "vanilla" else bench.build(MethodConfig(name=m))
    for b in batch_sizes:
      rows += rows_of(m, b, *bench.measure(m, built, temperature, b))
  return _sweep("batch", "batch_size", rows, bench)


def sweep_alignment(cfg, drafters=tuple(ALIGNMENT), temperature=0.0, progress=False) -> dict:
  """How much drafter-target alignment buys, greedy, batch 1; x = the drafter label, method =
  the drafter kind it drafts as.

  - ``trained-head``: eagle2 (dynamic tree) with the trained EAGLE-1 head (its tuned budget);
  - ``untrained-head``: a freshly initialised EAGLE-1 head (``nnx.Rngs(0)``, built in memory, no
    training) drafting in the trained head's form: the same dynamic tree (top_k, depth,
    total_tokens), draft vocabulary and weight bits (without a trained head: eagle2's defaults
    8, 5, 24, the whole vocabulary, float32), so that only training differs;
  - ``layer-skip``: self-draft, the target's first third of layers under its own LM head;
  - ``draft-model``: the small draft model distilled from the target's distributions on
    ShareGPT text. It stands for "a draft trained on different data": it never sees the
    target's features, only text; no other locally available option represents that case.
  """
  _check("alignment sweep: unknown drafter(s)", drafters, tuple(ALIGNMENT))
  bench = Bench.open(cfg, [ALIGNMENT[d] for d in drafters if d != "untrained-head"],
                     progress=progress)
  trained = bench.build(MethodConfig(name="eagle2")) if "trained-head" in drafters else None
  tree = dict(top_k=8, depth=5, total_tokens=24)  # eagle2's defaults without a tuned budget
  draft_ids, bits = None, 0
  if trained:
    tree = {k: getattr(trained[0], k) for k in tree}
    draft_ids, bits = drafting_form(*trained)
  rows = []
  for label in drafters:
    if label == "untrained-head":
      head = EagleHead(EagleHeadConfig(1, bench.lm.model.config), rngs=nnx.Rngs(0))
      if bits == 8:
        quantize_linears(head)
      built = EagleDrafter.create(head, bench.lm.model, None, draft_ids=draft_ids, **tree)
    elif label == "trained-head":
      built = trained
    else:
      built = bench.build(MethodConfig(name=ALIGNMENT[label]))
    rows += rows_of(ALIGNMENT[label], label, *bench.measure(label, built, temperature))
  return _sweep("alignment", "drafter", rows, bench)


def drafting_form(drafter: EagleDrafter, dparams) -> tuple[Any, int]:
  """How a built EAGLE drafter drafts besides its weights: its draft vocabulary (target ids, or
  None for the whole vocabulary) and its weights' bits (8 when its linears read 8-bit blocks,
  else 0), so that another head can be drafted in the same form."""
  head = nnx.merge(drafter.graphdef, dparams[0])
  blocks = any(isinstance(n, Linear) and n.blocks is not None for _, n in nnx.iter_graph(head))
  return dparams[1].d2t_K, 8 if blocks else 0


def _check(what: str, given, allowed) -> None:
  if bad := [g for g in given if g not in allowed]:
    raise EagleJaxError(f"{what} {bad}; choose from {', '.join(allowed)}")


def _sweep(kind, x, rows, bench: Bench) -> dict:
  ev = bench.cfg.eval
  return {"sweep": kind, "x": x, "rows": rows, "settings": {
      "model": bench.cfg.model, "max_new_tokens": ev.max_new_tokens, "stop_at_eos": ev.stop_at_eos,
      "prompts": f"{ev.prompts} first turns: {len({p['id'] for p in bench.prompts})} questions, "
                 f"{len(bench.prompts)} prompts", "checkpoints": bench.checkpoints,
      "verify_cost_ms": {str(k): v for k, v in sorted(bench.verify_ms.items())},
      "draft_ms": bench.draft_ms, "tau": TAU,
      "speedup": "tokens/s over vanilla's at the same temperature and batch size, same prompts, "
                 "same run (compilation excluded)"}}


def format_table(sweep: dict) -> str:
  fmt = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"
  return "\n".join(
      [f"| method | {sweep['x']} | category | tau | tokens/s | speedup | predicted |",
       "|---|---|---|---|---|---|---|"] +
      [f"| {r['method']} | {r['x']} | {r['category'] or 'all'} | {fmt(r['tau'])} | "
       f"{fmt(r['tokens_per_s'], 1)} | {fmt(r['speedup'])}x | {fmt(r['predicted_speedup'])} |"
       for r in sweep["rows"]])


def plot_sweep(sweep: dict, path: str) -> None:
  """The sweep's figure (matplotlib, Agg). Budget, batch: speedup (left; predicted dashed) and
  tau or tokens/s (right) against x. Temperature: tau and speedup per method, one line per
  category (black: all prompts). Alignment: tau and speedup bars per drafter."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  num = lambda rs, key: [np.nan if r[key] is None else r[key] for r in rs]
  rows, kind = sweep["rows"], sweep["sweep"]
  methods = list(dict.fromkeys(r["method"] for r in rows))
  pick = lambda m, cat: sorted((r for r in rows if r["method"] == m and r["category"] == cat),
                               key=lambda r: r["x"])
  if kind == "temperature":
    fig, axes = plt.subplots(2, len(methods), figsize=(4.5 * len(methods), 6), squeeze=False)
    for j, m in enumerate(methods):
      for i, cat in enumerate(dict.fromkeys(r["category"] for r in rows if r["method"] == m)):
        style = dict(color=f"C{i}", label=cat) if cat else dict(color="k", lw=2, label="all")
        for ax, key in zip(axes[:, j], ("tau", "speedup")):
          ax.plot([r["x"] for r in pick(m, cat)], num(pick(m, cat), key), "o-", **style)
          ax.set(title=m, xlabel=sweep["x"], ylabel=key)
    axes[0, -1].legend(fontsize="x-small")
  elif kind == "alignment":
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    bars = [r for r in rows if r["category"] is None]
    colors, labels = zip(*((f"C{methods.index(r['method'])}", f"{r['x']}\n({r['method']})")
                           for r in bars))
    for ax, key in zip(axes, ("tau", "speedup")):
      ax.bar(range(len(bars)), num(bars, key), color=colors, tick_label=labels)
      ax.set_ylabel(key)
  else:
    second = "tau" if kind == "budget" else "tokens_per_s"
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for i, m in enumerate(methods):
      pts, xs = pick(m, None), [r["x"] for r in pick(m, None)]
      axes[0].plot(xs, num(pts, "speedup"), "o-", color=f"C{i}", label=m)
      if np.isfinite(num(pts, "predicted_speedup")).any():
        axes[0].plot(xs, num(pts, "predicted_speedup"), "--", color=f"C{i}", label=f"{m} (pred.)")
      axes[1].plot(xs, num(pts, second), "o-", color=f"C{i}", label=m)
    for ax, label in zip(axes, ("speedup", second)):
      ax.set(xlabel=sweep["x"], ylabel=label)
      ax.set_xscale("log", base=2)
      ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
    axes[0].legend(fontsize="x-small")
  for ax in fig.axes:
    ax.grid(alpha=0.3)
    if ax.get_ylabel() == "speedup":
      ax.axhline(1.0, color="gray", lw=0.8)  # vanilla
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_sweep(sweep: dict, out: str) -> str:
  """Writes ``out/sweep-<kind>/sweep.json`` and ``<kind>.png``; returns the folder."""
  folder = os.path.join(out, f"sweep-{sweep['sweep']}")
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "sweep.json"), "w") as f:
    json.dump(sweep, f, indent=1)
  plot_sweep(sweep, os.path.join(folder, f"{sweep['sweep']}.png"))
  return folder


def run_sweep(kind: str, cfg: ExperimentConfig, methods=None, values=None, progress=False) -> dict:
  """Runs sweep ``kind``; ``methods`` / ``values`` (None = the sweep's defaults) pick the
  methods (alignment: drafter labels) and the swept values (budget: gammas and tree sizes alike;
  temperature: temperatures; batch: batch sizes)."""
  if kind == "alignment":
    if values:
      raise EagleJaxError("alignment sweep: no --values (pick drafters with --methods)")
    return sweep_alignment(cfg, tuple(methods or ALIGNMENT), progress=progress)
  methods = tuple(methods or DEFAULT_METHODS[kind])
  cast = float if kind == "temperature" else int
  try:
    values = tuple(cast(v) for v in values or ())
  except ValueError:
    raise EagleJaxError(f"{kind} sweep: --values must be {cast.__name__}s, got {values}") from None
  if any(v < 0 or (v == 0 and kind != "temperature") for v in values):
    raise EagleJaxError(f"{kind} sweep: --values must be positive"
                        f"{' (temperatures >= 0)' if kind == 'temperature' else ''}, got {list(values)}")
  if kind == "budget":
    return sweep_budget(cfg, methods, values or GAMMAS, values or TREE_SIZES, progress)
  sweep, default = {"temperature": (sweep_temperature, TEMPERATURES),
                    "batch": (sweep_batch, BATCH_SIZES)}[kind]
  return sweep(cfg, methods, values or default, progress=progress)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="sweeps.py", description=__doc__.split("\n")[0])
  p.add_argument("kind", choices=(*DEFAULT_METHODS, "alignment"))
  p.add_argument("--num-questions", type=int, default=8, help="MT-bench first turns (8 categories)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--out", default="results", help="writes OUT/sweep-KIND/{sweep.json,KIND.png}")
  p.add_argument("--runs-dir", default="runs", help="where trained drafters are found")
  p.add_argument("--model", default=DEFAULT_MODEL)
  p.add_argument("--methods", nargs="+", help="methods to sweep (alignment: drafter labels)")
  p.add_argument("--values", nargs="+", help="swept values instead of the sweep's defaults")
  p.add_argument("--quiet", action="store_true", help="no progress bars")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  enable_compilation_cache()
  try:
    ev = EvalConfig(num_questions=args.num_questions, max_new_tokens=args.max_new_tokens)
    ev.validate()
    cfg = ExperimentConfig(name=f"sweep-{args.kind}", methods=(), model=args.model,
                           runs_dir=args.runs_dir, results_dir=args.out, eval=ev)
    sweep = run_sweep(args.kind, cfg, args.methods, args.values, progress=not args.quiet)
  except EagleJaxError as e:
    print(f"sweeps.py: error: {e}", file=sys.stderr)
    return 2
  print(format_table(sweep))
  print(f"wrote {write_sweep(sweep, args.out)}/")
  return 0


if __name__ == "__main__":
  sys.exit(main())
