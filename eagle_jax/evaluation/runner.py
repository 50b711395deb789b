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
import json
import os
import re
import sys
import uuid
from typing import Literal

from tqdm import tqdm

from eagle_jax.configs import dump_config, load_config
from eagle_jax.decoding.generate import generate
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.speculative import speculative_generate
from eagle_jax.drafters import registry
from eagle_jax.drafters.kinds import Context
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation import records as store
from eagle_jax.evaluation.prompts import load_jsonl_prompts, load_mtbench, pick_questions
from eagle_jax.evaluation.tables import render_markdown, summarize
from eagle_jax.model.registry import DEFAULT_MODEL, REGISTRY, load_model, model_slug
from eagle_jax.model.transformer import shard
from eagle_jax.parallel import MeshSpec, is_writer, make_mesh, share, use_mesh
from eagle_jax.pipeline import train as pipeline


class _Method:
  """Behaviour of :data:`MethodConfig` (its option fields come from the drafter registry)."""

  @property
  def kind(self) -> str:
    return self.drafter or self.name

  def published_figures(self) -> dict:
    """The published figures by temperature key (``"T0.0"``), as summaries and plans hold them."""
    return {f"T{p.temperature}": {"speedup": p.speedup, "tau": p.tau, "source": p.source}
            for p in self.published}

  def option_values(self) -> dict:
    """The drafter options this method sets (None = the kind's default)."""
    return {k: getattr(self, k) for k in registry.option_fields() if getattr(self, k) is not None}

  def options(self):
    return registry.make_options(self.kind, self.option_values(),
                                 ("checkpoint",) if self.checkpoint else (), self.budget)

  def validate(self):
    if not re.fullmatch(r"[A-Za-z0-9_.+=:-]+", self.name):  # it names the method's record files
      raise EagleJaxError(f"method name {self.name!r}: use letters, digits and _.+=:- only")
    if self.kind not in registry.NAMES:
      raise EagleJaxError(f"method {self.name!r}: unknown drafter {self.kind!r}; choose from: "
                          f"{', '.join(registry.NAMES)}")
    if self.train and self.kind not in registry.TRAINED:
      raise EagleJaxError(f"method {self.name!r}: {self.kind} is not trainable (train: is for "
                          f"{', '.join(registry.TRAINED)})")
    try:
      self.options()
    except EagleJaxError as e:
      raise EagleJaxError(f"method {self.name!r}: {e}") from None
    temps = [p.temperature for p in self.published]
    if len(set(temps)) != len(temps):
      raise EagleJaxError(f"method {self.name!r}: published: one entry per temperature, got {temps}")


@dataclasses.dataclass(frozen=True)
class Published:
  """A figure a paper reports for a method, shown beside the measured one in the tables."""
  temperature: float
  source: str  # the paper and table (or leaderboard) it comes from
  speedup: float | None = None
  tau: float | None = None

  def validate(self):
    if not self.source.strip():
      raise EagleJaxError("published: source must name where the figure comes from")
    if self.speedup is None and self.tau is None:
      raise EagleJaxError(f"published ({self.source}): give speedup and/or tau")


# One method of an experiment: a row label, its drafter kind (default: the name), where its
# weights come from (a checkpoint, or a training config run when the checkpoint is missing) and
# any option of the drafter registry (unset = the kind's default, or its published setting with
# budget: paper).
MethodConfig = dataclasses.make_dataclass(
    "MethodConfig",
    [("name", str), ("drafter", str, ""), ("checkpoint", str, ""), ("train", str, ""),
     ("train_overrides", tuple[str, ...], ()), ("published", tuple[Published, ...], ()),
     ("budget", str, "tuned")]
    + [(name, tp | None, None) for name, tp in registry.option_types().items()],
    bases=(_Method,), frozen=True, namespace={"__module__": __name__})


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
  repeats: int = 1  # timed runs per batch, the fastest kept
  interleave: bool = False  # methods run batch by batch in turn, not one after another
  # a process that decodes a method times vanilla again over every prompt, so that each speedup
  # compares timings of one process; false: vanilla is decoded once and kept (an acceptance
  # table, whose tau and n-alpha do not depend on timings; speedups across processes are marked)
  pair_timings: bool = True

  def validate(self):
    if not self.turns or set(self.turns) - {1, 2}:
      raise EagleJaxError(f"turns must be a non-empty list of 1 and/or 2, got {list(self.turns)}")
    if not self.temperatures or min(self.temperatures) < 0:
      raise EagleJaxError("temperatures must be a non-empty list of values >= 0")
    if self.batch_size < 1 or self.max_new_tokens < 1 or self.num_questions < 0:
      raise EagleJaxError("batch_size and max_new_tokens must be >= 1, num_questions >= 0")
    if self.repeats < 1:
      raise EagleJaxError(f"repeats must be >= 1, got {self.repeats}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  name: str
  methods: tuple[MethodConfig, ...]
  model: str = DEFAULT_MODEL
  runs_dir: str = "runs"
  results_dir: str = "results"
  # the folder relative ``model`` and ``checkpoint`` paths are read from ("": the working
  # directory); registered model names stay names
  checkpoints_dir: str = ""
  # "" = the target tokenizer's own; a name in eagle_jax.model.tokenizer.CHAT_TEMPLATES
  # ("vicuna") or a Jinja file, for targets whose tokenizer has none
  chat_template: str = ""
  eval: EvalConfig = EvalConfig()
  # devices the target and drafters are laid out over (eagle_jax.parallel); all ones: one device
  mesh: MeshSpec = MeshSpec()
  # the target's parameters and activations ("": the checkpoint's own dtype); logits, sampling
  # and the verify step are float32 whatever it is
  dtype: Literal["", "float32", "bfloat16", "float16"] = ""

  def validate(self):
    names = [m.name for m in self.methods]
    if len(set(names)) != len(names):
      raise EagleJaxError(f"method names must be unique, got {names}")
    if registry.VANILLA.name not in [m.kind for m in self.methods]:
      raise EagleJaxError("methods must include vanilla (the speedup and greedy-match baseline)")

  @property
  def vanilla(self) -> MethodConfig:
    return next(m for m in self.methods if m.kind == registry.VANILLA.name)


def load_experiment(path: str, overrides=()) -> ExperimentConfig:
  return under_checkpoints_dir(load_config(ExperimentConfig, path, overrides))


def under_checkpoints_dir(cfg: ExperimentConfig) -> ExperimentConfig:
  """``cfg`` with its relative model and checkpoint paths joined to ``checkpoints_dir``."""
  if not cfg.checkpoints_dir:
    return cfg
  root = os.path.expanduser(cfg.checkpoints_dir)
  join = lambda p: p if not p or os.path.isabs(p) else os.path.join(root, p)
  return dataclasses.replace(
      cfg, checkpoints_dir=root, model=cfg.model if cfg.model in REGISTRY else join(cfg.model),
      methods=tuple(dataclasses.replace(m, checkpoint=join(m.checkpoint)) for m in cfg.methods))


# -- preparation -------------------------------------------------------------------------------

def ensure_checkpoint(method: MethodConfig, cfg: ExperimentConfig, progress: bool = True) -> str:
  """The checkpoint a trained method uses, training it first if its run is unfinished."""
  if method.checkpoint:
    return method.checkpoint
  if not method.train:
    return registry.find_checkpoint(method.kind, cfg.runs_dir, cfg.model)
  overrides = (f"runs_dir={cfg.runs_dir}",) + tuple(method.train_overrides)
  own = load_config(pipeline.TrainConfig, method.train, overrides)
  if own.model != cfg.model and not any(o.startswith("name=") for o in method.train_overrides):
    # the training config's run folder holds its own model's drafter: another target's goes
    # beside it, named after that target
    overrides += (f"name={own.name}-{model_slug(cfg.model)}",)
  overrides += (f"model={cfg.model}",)
  tcfg = load_config(pipeline.TrainConfig, method.train, overrides)
  final = os.path.join(tcfg.runs_dir, tcfg.name, "final")
  if not share(lambda: pipeline.run_finished(tcfg)):  # resumes an interrupted run (its training or its tuning)
    if is_writer():
      print(f"[run] training {method.name}: {method.train} -> {final}", flush=True)
    pipeline.run_training(method.train, overrides, progress=progress)
  return final


def drafter_for(method: MethodConfig, target, cfg: ExperimentConfig, checkpoint: str | None):
  context = Context(model=cfg.model, checkpoint=checkpoint or None, runs_dir=cfg.runs_dir)
  return registry.build(method.kind, target, method.options(), context)


def questions_for(ev: EvalConfig, announce: bool = True):
  """The evaluation's questions; ``announce``: say on stderr when they are a cut of the pool."""
  qs = load_mtbench() if ev.prompts == "mtbench" else load_jsonl_prompts(ev.prompts)
  picked = pick_questions(qs, ev.num_questions, ev.categories)
  pool = sum(not ev.categories or q.category in ev.categories for q in qs)
  if announce and len(picked) < pool and is_writer():
    print(f"[eval] {len(picked)} of the {pool} prompts in {ev.prompts} "
          f"(eval.num_questions={ev.num_questions}; 0 = all)", file=sys.stderr, flush=True)
  return picked


# -- evaluation --------------------------------------------------------------------------------

def decode_batches(lm, drafter, dparams, prompts: list[dict], method: str, temperature: float,
                   ev: EvalConfig, start: int = 0):
  """Decodes ``prompts`` (dicts with id, category, turn, tokens) a batch at a time from prompt
  ``start`` (a batch boundary), yielding each batch's records (one per prompt): the fastest of
  ``ev.repeats`` runs. Batch ``i`` samples with seed ``ev.seed + i`` wherever decoding starts."""
  params = SamplingParams(temperature=temperature)
  stop = None if ev.stop_at_eos else ()
  width = max(len(p["tokens"]) for p in prompts)  # one padded shape: one compilation per unit
  for i in range(start, len(prompts), ev.batch_size):
    batch = prompts[i:i + ev.batch_size]
    toks = [p["tokens"] for p in batch]
    common = dict(max_new_tokens=ev.max_new_tokens, params=params, seed=ev.seed + i,
                  stop_ids=stop, prompt_width=width)
    g = None
    for _ in range(ev.repeats):
      run = (generate(lm.model, toks, **common) if drafter is None else
             speculative_generate(lm.model, drafter, dparams, toks, **common))
      g = run if g is None or run.seconds < g.seconds else g
    accepted, drafted = ((g.accepted, g.drafted_depth) if drafter is not None
                         else ([[] for _ in batch],) * 2)
    yield [{"id": p["id"], "category": p["category"], "turn": p["turn"], "method": method,
            "temperature": temperature, "prompt_tokens": len(p["tokens"]),
            "token_ids": list(g.tokens[j]), "new_tokens": int(g.num_new[j]),
            "seconds": g.seconds / len(batch), "accepted": list(accepted[j]),
            "drafted_depth": list(drafted[j])} for j, p in enumerate(batch)]


def run_units(lm, methods: dict, prompts: list[dict], temperature: float, ev: EvalConfig,
              progress: bool = True, *, units: dict | None = None,
              session: str | None = None) -> dict[str, list[dict]]:
  """Records of each method in ``methods`` (name -> (drafter, dparams)) on ``prompts``: one
  method after another, or with ``ev.interleave`` batch by batch across the methods, so that
  a change in the machine's speed hits every method alike. Records made now carry ``session``
  (the timing process) when given. With ``units`` (name -> records path and key), each batch's
  records go to the unit's partial file as they are made, and a unit an earlier process left
  unfinished under the same key resumes after its last finished batch."""
  done = {name: store.resume(*units[name]) if units else [] for name in methods}
  for name, recs in done.items():
    ids = [(r["id"], r["turn"]) for r in recs]
    whole = len(recs) % ev.batch_size == 0 or len(recs) == len(prompts)
    if not whole or ids != [(p["id"], p["turn"]) for p in prompts[:len(recs)]]:
      done[name] = store.resume(*units[name], fresh=True)  # not this unit's batches: start over
  runs = {name: decode_batches(lm, *dd, prompts, name, temperature, ev, start=len(done[name]))
          for name, dd in methods.items()}
  out = {name: list(done[name]) for name in runs}
  bars = {name: tqdm(total=len(prompts), initial=len(done[name]), desc=f"{name} T={temperature}",
                     unit="prompt", disable=not progress) for name in runs}
  order = [list(runs)] if ev.interleave else [[name] for name in runs]
  for group in order:
    live = list(group)
    while live:
      for name in list(live):
        batch = next(runs[name], None)
        if batch is None:
          live.remove(name)
          bars[name].close()
          continue
        if session is not None:
          batch = [dict(r, session=session) for r in batch]
        if units:
          store.append(units[name][0], batch)
        out[name] += batch
        bars[name].update(len(batch))
  return out


def run_unit(lm, drafter, dparams, prompts: list[dict], method: str, temperature: float,
             ev: EvalConfig, progress: bool = True, *, unit: tuple | None = None,
             session: str | None = None) -> list[dict]:
  """Records of one method on ``prompts`` (``unit``: its records path and key, to resume)."""
  return run_units(lm, {method: (drafter, dparams)}, prompts, temperature, ev, progress,
                   units={method: unit} if unit else None, session=session)[method]


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
  """``eagle-jax run CONFIG``: the summary of the experiment ``path`` names (its table printed)."""
  cfg = load_experiment(path, overrides)
  summary = run_config(cfg, progress=progress, where=path)[0]
  if is_writer():
    print(render_markdown([summary]))
  return summary


def run_config(cfg: ExperimentConfig, *, progress: bool = True, where: str = "",
               curve_sizes=()) -> tuple[dict, dict, dict]:
  """Runs the experiment ``cfg`` (training what is missing, reusing records whose key matches)
  and returns ``(summary, units, costs)``: ``units[(method, T)]`` are the records.
  ``curve_sizes``: verify-cost sizes to measure besides the methods' own."""
  out = os.path.join(cfg.results_dir, cfg.name)
  progress = progress and is_writer()  # several processes: process 0 shows progress and writes
  if is_writer():
    os.makedirs(out, exist_ok=True)
    dump_config(cfg, os.path.join(out, "config.yaml"))
  mesh = make_mesh(cfg.mesh)  # a mesh that does not fit the devices fails before any work
  questions = questions_for(cfg.eval)  # so does a bad prompt file or category
  lm = load_model(cfg.model, cfg.dtype or None)
  if cfg.chat_template:
    lm.tokenizer.use_chat_template(cfg.chat_template)
  checkpoints = {m.name: ensure_checkpoint(m, cfg, progress) if m.kind in registry.TRAINED else None
                 for m in cfg.methods}  # trained by their own configs (and meshes)
  shard(lm.model, mesh)
  with use_mesh(mesh):
    return _evaluate(cfg, lm, mesh, questions, checkpoints, out, progress, where, curve_sizes)


def _evaluate(cfg: ExperimentConfig, lm, mesh, questions, checkpoints: dict, out: str,
              progress: bool, where: str, curve_sizes) -> tuple[dict, dict, dict]:
  """:func:`run_config` once the target is loaded (and laid out over ``mesh``) and the
  drafters are trained."""
  qkey = store.prompts_key(questions)
  first_answers = None
  if 2 in cfg.eval.turns:  # the target's own greedy first answers
    ev1 = dataclasses.replace(cfg.eval, turns=(1,))
    apath, akey = store.unit(out, dataclasses.replace(cfg, eval=ev1), cfg.vanilla, 0.0, None, qkey,
                             stem="first-answers")
    answers = store.cached(apath, akey)
    if answers is None:
      answers = run_unit(lm, None, None, build_prompts(lm, questions, (1,), None), cfg.vanilla.name,
                         0.0, ev1, progress, unit=(apath, akey))
      store.store(apath, akey, answers)
    first_answers = {r["id"]: r["token_ids"] for r in answers}
  prompts = build_prompts(lm, questions, cfg.eval.turns, first_answers)
  if not prompts:
    raise EagleJaxError(f"{where or cfg.name}: no prompts to evaluate: none of the {len(questions)} "
                        f"questions has the turns {list(cfg.eval.turns)}")
  units, drafters, baselines = {}, {}, {}
  costs_path = os.path.join(out, "costs.json")
  costs = store.load_costs(costs_path, cfg.model)
  # records timed by this run (speedups pair within one); with several processes, process 0's
  # timings are recorded, under one session name
  session = share(lambda: uuid.uuid4().hex[:12])
  for temperature in cfg.eval.temperatures:
    unit = {m.name: store.unit(out, cfg, m, temperature, checkpoints[m.name], qkey) for m in cfg.methods}
    cached = {name: store.cached(*u) for name, u in unit.items()}
    van = cfg.vanilla.name
    if cfg.eval.pair_timings and any(r is None for name, r in cached.items() if name != van):
      # a method decoding now gets a vanilla timed now, over every prompt: vanilla's records of
      # earlier processes (finished or not) are kept for the records those processes timed
      store.keep_baseline(out, unit[van], cached[van])
      store.keep_baseline(out, unit[van], store.resume(*unit[van]))
      store.resume(*unit[van], fresh=True)
      cached[van] = None
    todo = [m for m in cfg.methods if cached[m.name] is None]
    for m in todo:
      if m.name not in drafters:
        drafter, dparams = drafter_for(m, lm.model, cfg, checkpoints[m.name])
        drafters[m.name] = (drafter, shard(dparams, mesh))
        store.measure_costs(costs, m.name, lm.model, *drafters[m.name], prompts[0]["tokens"],
                            sizes=curve_sizes)
        store.write_atomic(costs_path, json.dumps(costs, indent=1))
    # each unit is stored once finished; till then its batches are kept as they come (resumable)
    def finished(name, records):
      cached[name] = records
      store.store(*unit[name], records)

    if cfg.eval.interleave:
      for name, records in run_units(lm, {m.name: drafters[m.name] for m in todo}, prompts,
                                     temperature, cfg.eval, progress, session=session,
                                     units={m.name: unit[m.name] for m in todo}).items():
        finished(name, records)
    else:
      for m in todo:
        finished(m.name, run_unit(lm, *drafters[m.name], prompts, m.name, temperature, cfg.eval,
                                  progress, unit=unit[m.name], session=session))
    for m in cfg.methods:
      units[(m.name, temperature)] = cached[m.name]
    for m in cfg.methods:  # each method against the vanilla timed by the same process
      baselines[(m.name, temperature)] = store.baseline(out, unit[cfg.vanilla.name],
                                                        units[(cfg.vanilla.name, temperature)],
                                                        units[(m.name, temperature)])
  summary = summarize(cfg, units, checkpoints, costs, baselines)
  store.write_atomic(os.path.join(out, "summary.json"), json.dumps(summary, indent=1))
  store.write_atomic(os.path.join(out, "table.md"), render_markdown([summary]) + "\n")
  return summary, units, costs


