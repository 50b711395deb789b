"""``eagle-jax run CONFIG``: train what is missing, evaluate every method on the same prompts.

An :class:`ExperimentConfig` names the target, the methods (each a drafter with its options and,
for trainable drafters, a checkpoint or a training config to run when its checkpoint is
missing) and the evaluation (MT-bench or a JSONL prompt file, turns, temperatures, batch size).
The run writes ``<results_dir>/<name>/``:

- ``config.yaml``: the resolved config;
- ``records/<method>-T<temperature>.jsonl``: one record per prompt (ids, category, turn,
  generated token ids, seconds, per-step accepted counts and drafted depths), with a
  ``.key.json`` beside it naming what produced it: a unit whose key still matches is reused,
  so re-running a finished experiment only re-renders and an interrupted one resumes;
- ``baselines/<vanilla>-T<temperature>-<session>.jsonl``: vanilla's records of an earlier
  process, kept when a later one times vanilla again (a resumed run, a method added or changed)
  so that the methods the earlier process timed keep their own vanilla;
- ``first-answers.jsonl``: vanilla's greedy first answers, when second turns are evaluated;
- ``costs.json``: the verify-cost curve and each method's timed draft step (predicted speedup);
- ``summary.json`` and ``table.md`` (:mod:`eagle_jax.evaluation.tables`).

Conventions: tau = tokens per target forward (verify) pass, the bonus token included, the
prefill excluded; n-alpha = acceptance rate at draft depth n given the path reached depth n-1;
speedup = the method's tokens/s over vanilla's on the same prompts at the same temperature,
both timed by the same process (records carry its ``session``; compilation excluded). Second turns are built on the target's own greedy
first answer (vanilla, T=0), so every method sees the same second-turn prompts. At T=0 the
runner checks that every method's tokens equal vanilla's and counts mismatches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import uuid
from typing import Literal

import jax
from tqdm import tqdm

from eagle_jax.configs import dump_config, load_config, to_dict
from eagle_jax.decoding.costs import curve_from_json, sizes_up_to, verify_cost_curve
from eagle_jax.decoding.generate import generate
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.speculative import is_chain, speculative_generate, verify_widths
from eagle_jax.drafters.eagle.tune import draft_cost_ms
from eagle_jax.drafters.factory import DRAFTERS, DrafterOptions, find_checkpoint, make_drafter
from eagle_jax.drafters.storage import read_meta
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation.prompts import load_jsonl_prompts, load_mtbench, pick_questions
from eagle_jax.evaluation.tables import render_markdown, summarize
from eagle_jax.model.registry import DEFAULT_MODEL, load_model, model_slug
from eagle_jax.pipeline.train import TrainConfig, run_finished, run_training

TRAINED = ("draft-model", "medusa", "eagle1", "eagle2", "eagle3")


@dataclasses.dataclass(frozen=True)
class MethodConfig:
  name: str  # row label, unique in the experiment
  drafter: str = ""  # one of DRAFTERS; defaults to ``name``
  checkpoint: str = ""  # trained drafter (run folder or final/) or draft model name/folder
  train: str = ""  # training config run when ``checkpoint`` is empty and its run is unfinished
  train_overrides: tuple[str, ...] = ()
  gamma: int = 0
  top_k: int = 0
  depth: int = 0
  total_tokens: int = 0
  tree: Literal["", "default"] = ""
  draft_vocab: int = -1  # eagle1/eagle2 (see DrafterOptions.draft_vocab)
  head_bits: int = -1  # eagle1/2/3, medusa (see DrafterOptions.head_bits)
  self_draft_layers: int = 0
  pld_min_ngram: int = 2
  pld_max_ngram: int = 3
  pld_widths: tuple[int, ...] = ()

  @property
  def kind(self) -> str:
    return self.drafter or self.name

  def validate(self):
    if not re.fullmatch(r"[A-Za-z0-9_.+=:-]+", self.name):  # it names the method's record files
      raise EagleJaxError(f"method name {self.name!r}: use letters, digits and _.+=:- only")
    if self.kind not in DRAFTERS:
      raise EagleJaxError(f"method {self.name!r}: unknown drafter {self.kind!r}; choose from: "
                          f"{', '.join(DRAFTERS)}")
    if self.train and self.kind not in TRAINED:
      raise EagleJaxError(f"method {self.name!r}: {self.kind} is not trainable (train: is for "
                          f"{', '.join(TRAINED)})")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  prompts: str = "mtbench"  # "mtbench" or a JSONL file ({"turns": [...]} or {"prompt": ...})
  num_questions: int = 0  # spread evenly over categories; 0 = all
  categories: tuple[str, ...] = ()
  turns: tuple[int, ...] = (1,)  # 1 and/or 2
  temperatures: tuple[float, ...] = (0.0, 1.0)
  batch_size: int = 1
  max_new_tokens: int = 128
  stop_at_eos: bool = True
  seed: int = 0

  def validate(self):
    if not self.turns or set(self.turns) - {1, 2}:
      raise EagleJaxError(f"turns must be a non-empty list of 1 and/or 2, got {list(self.turns)}")
    if not self.temperatures or min(self.temperatures) < 0:
      raise EagleJaxError(f"temperatures must be a non-empty list of values >= 0")
    if self.batch_size < 1 or self.max_new_tokens < 1 or self.num_questions < 0:
      raise EagleJaxError("batch_size and max_new_tokens must be >= 1, num_questions >= 0")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  name: str
  methods: tuple[MethodConfig, ...]
  model: str = DEFAULT_MODEL
  runs_dir: str = "runs"
  results_dir: str = "results"
  eval: EvalConfig = EvalConfig()

  def validate(self):
    names = [m.name for m in self.methods]
    if len(set(names)) != len(names):
      raise EagleJaxError(f"method names must be unique, got {names}")
    if "vanilla" not in [m.kind for m in self.methods]:
      raise EagleJaxError("methods must include vanilla (the speedup and greedy-match baseline)")

  @property
  def vanilla(self) -> MethodConfig:
    return next(m for m in self.methods if m.kind == "vanilla")


def load_experiment(path: str, overrides=()) -> ExperimentConfig:
  return load_config(ExperimentConfig, path, overrides)


# -- preparation -------------------------------------------------------------------------------

def ensure_checkpoint(method: MethodConfig, cfg: ExperimentConfig, progress: bool = True) -> str:
  """The checkpoint a trained method uses, training it first if its run is unfinished."""
  if method.checkpoint:
    return method.checkpoint
  if not method.train:
    return find_checkpoint(method.kind, cfg.runs_dir, cfg.model)
  overrides = (f"runs_dir={cfg.runs_dir}",) + tuple(method.train_overrides)
  own = load_config(TrainConfig, method.train, overrides)
  if own.model != cfg.model and not any(o.startswith("name=") for o in method.train_overrides):
    # the training config's run folder holds its own model's drafter: another target's goes
    # beside it, named after that target
    overrides += (f"name={own.name}-{model_slug(cfg.model)}",)
  overrides += (f"model={cfg.model}",)
  tcfg = load_config(TrainConfig, method.train, overrides)
  final = os.path.join(tcfg.runs_dir, tcfg.name, "final")
  if not run_finished(tcfg):  # resumes an interrupted run (its training or its tuning)
    print(f"[run] training {method.name}: {method.train} -> {final}", flush=True)
    run_training(method.train, overrides, progress=progress)
  return final


def drafter_for(method: MethodConfig, target, cfg: ExperimentConfig, checkpoint: str | None):
  opts = DrafterOptions(gamma=method.gamma, pld_min_ngram=method.pld_min_ngram,
                        pld_max_ngram=method.pld_max_ngram, pld_widths=method.pld_widths, draft_model=checkpoint or None,
                        self_draft_layers=method.self_draft_layers, top_k=method.top_k,
                        depth=method.depth, total_tokens=method.total_tokens, tree=method.tree,
                        draft_vocab=method.draft_vocab, head_bits=method.head_bits,
                        runs_dir=cfg.runs_dir)
  return make_drafter(method.kind, target, opts, cfg.model)


def questions_for(ev: EvalConfig):
  qs = load_mtbench() if ev.prompts == "mtbench" else load_jsonl_prompts(ev.prompts)
  picked = pick_questions(qs, ev.num_questions, ev.categories)
  pool = sum(not ev.categories or q.category in ev.categories for q in qs)
  if len(picked) < pool:
    print(f"[eval] {len(picked)} of the {pool} prompts in {ev.prompts} "
          f"(eval.num_questions={ev.num_questions}; 0 = all)", flush=True)
  return picked


# -- evaluation --------------------------------------------------------------------------------

def run_unit(lm, drafter, dparams, prompts: list[dict], method: str, temperature: float,
             ev: EvalConfig, progress: bool = True) -> list[dict]:
  """Decodes ``prompts`` (dicts with id, category, turn, tokens) in batches; one record each."""
  params = SamplingParams(temperature=temperature)
  stop = None if ev.stop_at_eos else ()
  records = []
  width = max(len(p["tokens"]) for p in prompts)  # one padded shape: one compilation per unit
  bar = tqdm(total=len(prompts), desc=f"{method} T={temperature}", unit="prompt", disable=not progress)
  for i in range(0, len(prompts), ev.batch_size):
    batch = prompts[i:i + ev.batch_size]
    toks = [p["tokens"] for p in batch]
    seed = ev.seed + i
    if drafter is None:
      g = generate(lm.model, toks, max_new_tokens=ev.max_new_tokens, params=params, seed=seed,
                   stop_ids=stop, prompt_width=width)
      accepted = drafted = [[] for _ in batch]
    else:
      g = speculative_generate(lm.model, drafter, dparams, toks, max_new_tokens=ev.max_new_tokens,
                               params=params, seed=seed, stop_ids=stop, prompt_width=width)
      accepted, drafted = g.accepted, g.drafted_depth
    for j, p in enumerate(batch):
      records.append({"id": p["id"], "category": p["category"], "turn": p["turn"], "method": method,
                      "temperature": temperature, "prompt_tokens": len(p["tokens"]),
                      "token_ids": list(g.tokens[j]), "new_tokens": int(g.num_new[j]),
                      "seconds": g.seconds / len(batch), "accepted": list(accepted[j]),
                      "drafted_depth": list(drafted[j])})
    bar.update(len(batch))
  bar.close()
  return records


def _read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _write_atomic(path, text):
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _machine() -> dict:
  """Where timings were taken: records timed elsewhere are not mixed into one speedup."""
  return {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
          "cpus": os.cpu_count()}


def _checkpoint_key(checkpoint: str | None) -> dict | None:
  """A trained checkpoint as a cache key: its folder and its ``drafter.json`` (steps, tuned
  budget), so that retraining or ``eagle-jax tune`` invalidates the records made with it."""
  return None if checkpoint is None else {"path": checkpoint, "meta": read_meta(checkpoint)}


def _prompts_key(questions) -> dict:
  """The questions' ids and a digest of their text and categories."""
  text = json.dumps([[q.question_id, q.category, list(q.turns)] for q in questions])
  return {"ids": [q.question_id for q in questions], "sha1": hashlib.sha1(text.encode()).hexdigest()}


def _unit(out, cfg, method: MethodConfig, temperature, checkpoint, prompts_key, stem=None):
  """``(records path, key)`` of one (method, temperature) evaluation. The key holds the
  evaluation settings but not the list of temperatures: adding one keeps the others' units."""
  ev = {k: v for k, v in to_dict(cfg.eval).items() if k != "temperatures"}
  key = {"model": cfg.model, "method": to_dict(method), "checkpoint": _checkpoint_key(checkpoint),
         "temperature": temperature, "eval": ev, "prompts": prompts_key,
         "machine": _machine()}
  if stem:  # not a method's records (notebooks read records/<method>-T<temperature>.jsonl)
    return os.path.join(out, f"{stem}.jsonl"), key
  return os.path.join(out, "records", f"{method.name}-T{temperature}.jsonl"), key


def _cached(path, key):
  try:
    with open(path[:-len(".jsonl")] + ".key.json") as f:
      return _read_jsonl(path) if json.load(f) == json.loads(json.dumps(key)) else None
  except (OSError, ValueError):
    return None


def _store(path, key, records):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  _write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
  _write_atomic(path[:-len(".jsonl")] + ".key.json", json.dumps(key))


def build_prompts(lm, questions, turns, first_answers: dict | None) -> list[dict]:
  """Turn-1 prompts, and turn-2 prompts on the target's greedy first answers."""
  out = []
  for q in questions:
    user1 = {"role": "user", "content": q.turns[0]}
    if 1 in turns:
      out.append({"id": q.question_id, "category": q.category, "turn": 1,
                  "tokens": lm.tokenizer.chat_prompt([user1])})
    if 2 in turns and len(q.turns) > 1:
      answer = lm.tokenizer.decode(first_answers[q.question_id])
      msgs = [user1, {"role": "assistant", "content": answer}, {"role": "user", "content": q.turns[1]}]
      out.append({"id": q.question_id, "category": q.category, "turn": 2,
                  "tokens": lm.tokenizer.chat_prompt(msgs)})
  return out


def run_experiment(path: str, overrides=(), *, progress: bool = True) -> dict:
  cfg = load_experiment(path, overrides)
  out = os.path.join(cfg.results_dir, cfg.name)
  os.makedirs(out, exist_ok=True)
  dump_config(cfg, os.path.join(out, "config.yaml"))
  questions = questions_for(cfg.eval)  # a bad prompt file or category fails before any training
  lm = load_model(cfg.model)
  checkpoints = {m.name: ensure_checkpoint(m, cfg, progress) if m.kind in TRAINED else None
                 for m in cfg.methods}
  qkey = _prompts_key(questions)
  first_answers = None
  if 2 in cfg.eval.turns:  # the target's own greedy first answers
    ev1 = dataclasses.replace(cfg.eval, turns=(1,))
    apath, akey = _unit(out, dataclasses.replace(cfg, eval=ev1), cfg.vanilla, 0.0, None, qkey,
                        stem="first-answers")
    answers = _cached(apath, akey)
    if answers is None:
      answers = run_unit(lm, None, None, build_prompts(lm, questions, (1,), None), cfg.vanilla.name,
                         0.0, ev1, progress)
      _store(apath, akey, answers)
    first_answers = {r["id"]: r["token_ids"] for r in answers}
  prompts = build_prompts(lm, questions, cfg.eval.turns, first_answers)
  if not prompts:
    raise EagleJaxError(f"{path}: no prompts to evaluate: none of the {len(questions)} questions "
                        f"has the turns {list(cfg.eval.turns)}")
  units, drafters, baselines = {}, {}, {}
  costs_path = os.path.join(out, "costs.json")
  costs = _load_costs(costs_path, cfg.model)
  session = uuid.uuid4().hex[:12]  # records timed by this process (speedups pair within one)
  for temperature in cfg.eval.temperatures:
    unit = {m.name: _unit(out, cfg, m, temperature, checkpoints[m.name], qkey) for m in cfg.methods}
    cached = {name: _cached(*u) for name, u in unit.items()}
    if any(r is None for r in cached.values()):  # a method re-timed now gets a vanilla timed now
      _keep_baseline(out, unit[cfg.vanilla.name], cached[cfg.vanilla.name])
      cached[cfg.vanilla.name] = None
    for m in cfg.methods:
      records = cached[m.name]
      if records is None:
        if m.name not in drafters:
          drafters[m.name] = drafter_for(m, lm.model, cfg, checkpoints[m.name])
          _measure_costs(costs, m.name, lm.model, *drafters[m.name], prompts[0]["tokens"])
          _write_atomic(costs_path, json.dumps(costs, indent=1))
        records = run_unit(lm, *drafters[m.name], prompts, m.name, temperature, cfg.eval, progress)
        records = [dict(r, session=session) for r in records]
        _store(*unit[m.name], records)
      units[(m.name, temperature)] = records
    for m in cfg.methods:  # each method against the vanilla timed by the same process
      baselines[(m.name, temperature)] = _baseline(out, unit[cfg.vanilla.name],
                                                   units[(cfg.vanilla.name, temperature)],
                                                   units[(m.name, temperature)])
  summary = summarize(cfg, units, checkpoints, costs, baselines)
  _write_atomic(os.path.join(out, "summary.json"), json.dumps(summary, indent=1))
  table = render_markdown([summary])
  _write_atomic(os.path.join(out, "table.md"), table + "\n")
  print(table)
  return summary


def _sessions(records) -> set:
  return {r.get("session") for r in records}


def _baseline_path(out, vanilla_unit, session: str) -> str:
  stem = os.path.basename(vanilla_unit[0])[:-len(".jsonl")]
  return os.path.join(out, "baselines", f"{stem}-{session}.jsonl")


def _keep_baseline(out, vanilla_unit, records) -> None:
  """Keeps vanilla's records of one earlier process under ``baselines/`` before vanilla is
  timed again, so the methods that process timed stay paired with it."""
  if records and len(_sessions(records)) == 1 and None not in _sessions(records):
    _store(_baseline_path(out, vanilla_unit, records[0]["session"]), vanilla_unit[1], records)


def _baseline(out, vanilla_unit, vanilla_records, records):
  """Vanilla's records timed by the process that timed ``records`` (the current ones, or kept
  under ``baselines/`` with the same evaluation key); the current ones when there are none."""
  sessions = _sessions(records)
  if sessions == _sessions(vanilla_records) or len(sessions) != 1 or None in sessions:
    return vanilla_records
  kept = _cached(_baseline_path(out, vanilla_unit, next(iter(sessions))), vanilla_unit[1])
  return kept or vanilla_records


def _load_costs(path, model) -> dict:
  try:
    with open(path) as f:
      costs = json.load(f)
    if costs.get("model") == model and costs.get("machine") == _machine():
      return costs
  except (OSError, ValueError, AttributeError):
    pass
  return {"model": model, "machine": _machine(), "verify_cost_ms": {}, "draft_ms": {}, "num_nodes": {}}


def _measure_costs(costs, name, target, drafter, dparams, prompt) -> None:
  """Verify-cost curve (once) and the method's timed draft step, for predicted speedups."""
  # the curve (also from costs.json of an interrupted run) covers the largest tree so far;
  # a larger one times only the sizes it adds
  curve = curve_from_json(costs["verify_cost_ms"])
  missing = [n for n in sizes_up_to(0 if drafter is None else drafter.num_nodes) if n not in curve]
  if missing:
    curve.update(verify_cost_curve(target, sizes=missing))
  costs["verify_cost_ms"] = {str(k): curve[k] for k in sorted(curve)}
  if drafter is not None:
    costs["draft_ms"][name] = round(draft_cost_ms(drafter, dparams, target, prompt), 3)
    costs["num_nodes"][name] = drafter.num_nodes
    costs.setdefault("widths", {})[name] = list(verify_widths(drafter))
    costs.setdefault("chain", {})[name] = is_chain(drafter)
