"""Writes the small results fixtures the notebook tests read (run once; the output is committed).

    .venv/bin/python tests/assets/results/make_fixtures.py

The layout copies what ``eagle-jax run CONFIG`` and the sweep scripts in ``experiments/``
write: ``quickstart/`` (config.yaml, records/<method>-T<temperature>.jsonl, summary.json,
table.md) and ``sweep-{budget,batch,temperature,alignment}/sweep.json``. As in the runner's
summary, each method has its "drafter" and "checkpoint" next to its "T<temperature>" entries.
Numbers are synthetic but consistent: every summary entry backed by a records file
(vanilla-T0.0, eagle2-T0.0, eagle2-T1.0) is computed from it with the runner's conventions
(tau = mean accepted + 1 per verify step; n-alpha as ``eagle_jax.decoding.speculative.acceptance_rates``).
"""

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
MAX_NEW = 48
QUESTIONS = [(81, "writing"), (82, "writing"), (111, "math"), (112, "math"), (121, "coding"), (122, "coding")]
DEPTH = 5  # eagle2 tree depth in the fixture
CHECKPOINT = {m: f"runs/smollm2-135m-instruct/{m}/step-2000" for m in ("eagle2", "eagle3")}
VANILLA_TPS = {"T0.0": 180.0, "T1.0": 176.0}  # vanilla tokens/s
# synthetic entries (no records file): tau, n-alpha, speedup, predicted speedup, per-category tau
SYNTHETIC = {
    ("pld", "T0.0"): (1.62, [0.41, 0.33, 0.28], 1.31, 1.36, {"writing": 1.35, "math": 1.71, "coding": 1.80}),
    ("pld", "T1.0"): (1.38, [0.27, 0.2, 0.15], 1.12, 1.15, {"writing": 1.22, "math": 1.44, "coding": 1.48}),
    ("eagle3", "T0.0"): (4.21, [0.8, 0.76, 0.74, 0.71, 0.69, 0.66, 0.63], 2.48, 2.61,
                         {"writing": 3.82, "math": 4.55, "coding": 4.26}),
    ("eagle3", "T1.0"): (3.54, [0.71, 0.66, 0.63, 0.6, 0.55, 0.52, None], 2.07, 2.2,
                         {"writing": 3.21, "math": 3.8, "coding": 3.61}),
}


def _n_alpha(accepted, drafted, max_n):
  acc, dep = np.array(accepted, np.int64), np.array(drafted, np.int64)
  out = []
  for n in range(1, max_n + 1):
    tried = ((acc >= n - 1) & (dep >= n)).sum()
    out.append(round(float(((acc >= n) & (dep >= n)).sum() / tried), 3) if tried else None)
  return out


def _records(method, temperature, rng):
  """One record per question; eagle2 accepts fewer tokens at T=1 and on writing prompts."""
  out = []
  for qid, category in QUESTIONS:
    p = 0.78 - (0.12 if category == "writing" else 0.0) - 0.1 * temperature  # per-depth acceptance
    accepted, drafted, n = [], [], 1  # the prefill emits the first token
    while method != "vanilla" and n < MAX_NEW:
      a = 0
      while a < DEPTH and rng.random() < p:
        a += 1
      accepted.append(a)
      drafted.append(DEPTH)
      n += a + 1
    n = min(n, MAX_NEW) if method != "vanilla" else MAX_NEW
    steps = len(accepted) if accepted else MAX_NEW - 1
    seconds = round(0.004 + steps * (0.0062 if method == "vanilla" else 0.0075) * (1 + 0.05 * rng.random()), 4)
    out.append({"id": qid, "category": category, "turn": 1, "method": method, "temperature": temperature,
                "prompt_tokens": int(rng.integers(40, 120)), "token_ids": rng.integers(0, 49152, n).tolist(),
                "new_tokens": n, "seconds": seconds, "accepted": accepted, "drafted_depth": drafted})
  return out


def _stats(recs):
  acc = [a for r in recs for a in r["accepted"]]
  tokens, seconds = sum(r["new_tokens"] for r in recs), sum(r["seconds"] for r in recs)
  tau = round(float(np.mean(acc)) + 1, 3) if acc else None
  return tau, tokens, seconds


def _quickstart(rng):
  folder = HERE / "quickstart"
  (folder / "records").mkdir(parents=True, exist_ok=True)
  methods = {}
  for method, temp in [("vanilla", 0.0), ("eagle2", 0.0), ("vanilla", 1.0), ("eagle2", 1.0)]:
    recs, t = _records(method, temp, rng), f"T{temp}"
    if (method, t) != ("vanilla", "T1.0"):  # vanilla-T1.0 is summarized but not shipped: 3 files
      (folder / "records" / f"{method}-{t}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    tau, tokens, seconds = _stats(recs)
    tps = tokens / seconds
    vanilla_tps = methods["vanilla"][t]["tokens_per_s"] if method != "vanilla" else tps
    per_category = {}
    for _, cat in QUESTIONS:
      ctau, ctok, csec = _stats([r for r in recs if r["category"] == cat])
      per_category[cat] = {"tau": ctau, "tokens_per_s": round(ctok / csec, 2), "speedup": None}
    entry = {"tau": tau, "n_alpha": _n_alpha([a for r in recs for a in r["accepted"]],
                                             [d for r in recs for d in r["drafted_depth"]], DEPTH) if tau else [],
             "tokens_per_s": round(tps, 2), "speedup": round(tps / vanilla_tps, 3), "seconds": round(seconds, 3),
             "new_tokens": tokens, "greedy_mismatches": 0 if temp == 0.0 and method != "vanilla" else None,
             "predicted_speedup": round(1.08 * tps / vanilla_tps, 3) if tau else None,
             "num_nodes": 60 if tau else None, "per_category": per_category}
    methods.setdefault(method, {})[t] = entry
  for t in ("T0.0", "T1.0"):  # per-category speedup against vanilla's per-category tokens/s
    for method in ("vanilla", "eagle2"):
      for cat, c in methods[method][t]["per_category"].items():
        c["speedup"] = round(c["tokens_per_s"] / methods["vanilla"][t]["per_category"][cat]["tokens_per_s"], 3)
  for (method, t), (tau, n_alpha, speedup, predicted, cats) in SYNTHETIC.items():
    tps = VANILLA_TPS[t] * speedup
    tokens = len(QUESTIONS) * MAX_NEW
    methods.setdefault(method, {})[t] = {
        "tau": tau, "n_alpha": n_alpha, "tokens_per_s": round(tps, 2), "speedup": speedup,
        "seconds": round(tokens / tps, 3), "new_tokens": tokens, "greedy_mismatches": 0 if t == "T0.0" else None,
        "predicted_speedup": predicted, "num_nodes": 10 if method == "pld" else 60,
        "per_category": {c: {"tau": ct, "tokens_per_s": round(tps * ct / tau, 2), "speedup": round(speedup * ct / tau, 3)}
                         for c, ct in cats.items()}}
  order = ["vanilla", "pld", "eagle2", "eagle3"]
  summary = {"name": "quickstart", "model": "smollm2-135m-instruct",
             "settings": {"temperatures": [0.0, 1.0], "batch_size": 1, "max_new_tokens": MAX_NEW,
                          "prompts": "mtbench[81,82,111,112,121,122] turn 1",
                          "tau": "tokens per target forward (verify) pass, bonus token included, prefill excluded",
                          "speedup": "tokens/s over vanilla's, same prompts, same run"},
             "methods": {m: {"drafter": m, "checkpoint": CHECKPOINT.get(m), **methods[m]} for m in order}}
  (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
  lines = ["| method | T0.0 speedup | T0.0 tau | T1.0 speedup | T1.0 tau |", "|---|---|---|---|---|"]
  for m in order:
    cells = [f"{methods[m][t]['speedup']:.2f}x | {methods[m][t]['tau'] or '-'}" for t in ("T0.0", "T1.0")]
    lines.append(f"| {m} | " + " | ".join(cells) + " |")
  (folder / "table.md").write_text("\n".join(lines) + "\n")
  (folder / "config.yaml").write_text(
      "# eagle-jax run tests/assets/results/quickstart/config.yaml (fixture; numbers are synthetic)\n"
      "name: quickstart\nmodel: smollm2-135m-instruct\nprompts: mtbench\nlimit: 6\nturns: [1]\n"
      f"max_new_tokens: {MAX_NEW}\nbatch_size: 1\ntemperatures: [0.0, 1.0]\n"
      "methods: [vanilla, pld, eagle2, eagle3]\nseed: 0\n")


def _sweep(kind, x, rows):
  folder = HERE / f"sweep-{kind}"
  folder.mkdir(exist_ok=True)
  (folder / "sweep.json").write_text(json.dumps({"sweep": kind, "x": x, "rows": rows}, indent=1) + "\n")


def _row(method, x, tau, tps, speedup, predicted=None, category=None):
  return {"method": method, "x": x, "tau": tau, "tokens_per_s": tps, "speedup": speedup,
          "predicted_speedup": predicted, "category": category}


def _sweeps():
  rows = []
  for method, scale in [("eagle2", 1.0), ("eagle3", 1.15)]:
    for n in (8, 16, 32, 60, 96):
      tau = round(1 + scale * 2.6 * (1 - np.exp(-n / 24)), 3)
      speedup = round(tau / (1 + n / 160), 3)
      rows.append(_row(method, n, tau, round(180 * speedup, 2), speedup, round(1.05 * speedup, 3)))
  _sweep("budget", "total_tokens", rows)
  rows = []
  for method, tau in [("vanilla", None), ("eagle2", 3.4), ("eagle3", 4.0)]:
    for b in (1, 2, 4, 8):
      speedup = 1.0 if tau is None else round(tau / (1.6 + 0.25 * b), 3)
      rows.append(_row(method, b, tau, round(180 * b ** 0.8 * speedup, 2), speedup))
  _sweep("batch", "batch_size", rows)
  rows = []
  for method, base in [("eagle2", 3.5), ("eagle3", 4.2)]:
    for t in (0.0, 0.5, 1.0):
      for cat, shift in [(None, 0.0), ("writing", -0.4), ("math", 0.35), ("coding", 0.2)]:
        tau = round(base + shift - 0.8 * t, 3)
        rows.append(_row(method, t, tau, round(180 * tau / 1.6, 2), round(tau / 1.6, 3), category=cat))
  _sweep("temperature", "temperature", rows)
  rows = []
  for method, base in [("eagle1", 2.9), ("eagle2", 3.5), ("draft-model", 2.4)]:
    for drafter, gain in [("sharegpt", 0.0), ("self-distilled", 0.45)]:
      tau = round(base + gain, 3)
      rows.append(_row(method, drafter, tau, round(180 * tau / 1.7, 2), round(tau / 1.7, 3)))
  _sweep("alignment", "drafter", rows)


if __name__ == "__main__":
  rng = np.random.default_rng(0)
  _quickstart(rng)
  _sweeps()
