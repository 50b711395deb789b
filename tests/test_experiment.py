"""Experiment configs, the runner (``eagle-jax run``) and tables (``eagle-jax table``)."""

import glob
import json
import os

import pytest

from eagle_jax.decoding import costs
from eagle_jax.drafters import registry, shipped
from eagle_jax.evaluation import runner as experiment
from eagle_jax.cli import main
from eagle_jax.configs import load_config
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation.runner import ExperimentConfig, load_experiment
from eagle_jax.pipeline.train import TrainConfig
from eagle_jax.training.regenerate import RegenerateConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.relpath(p, ROOT) for p in CONFIGS])
def test_every_config_loads_and_says_how_to_run_it(path):
  with open(path) as f:
    header = [l for l in f.read().splitlines() if l.startswith("#")]
  assert any("Run" in l for l in header), f"{path}: header must give the command that runs it"
  if f"{os.sep}train{os.sep}" in path:
    load_config(TrainConfig, path)
    return
  if f"{os.sep}data{os.sep}" in path:  # a dataset config says where its dataset goes
    assert any("Writes" in l for l in header), f"{path}: header must say what it writes"
    load_config(RegenerateConfig, path)
    return
  assert any("Reaches" in l for l in header), f"{path}: header must say what it should reach"
  cfg = load_experiment(path)
  for m in cfg.methods:
    if m.train:
      load_config(TrainConfig, os.path.join(ROOT, m.train))


def test_one_config_per_method_and_the_quickstart():
  names = {os.path.basename(p)[:-5] for p in CONFIGS if os.path.dirname(p).endswith("configs")}
  assert {"vanilla", "pld", "self-draft", "draft-model", "medusa", "eagle1", "eagle2", "eagle3",
          "quickstart"} <= names
  quick = load_experiment(os.path.join(ROOT, "configs", "quickstart.yaml"))
  assert {m.kind for m in quick.methods} == {"vanilla", "pld", "self-draft", "draft-model", "medusa",
                                              "eagle1", "eagle2", "eagle3"}
  assert quick.eval.num_questions == 8
  # the demo decodes with the shipped drafters: only Medusa (too large to ship) trains
  assert [m.kind for m in quick.methods if m.train] == ["medusa"]
  assert {m.name for m in quick.methods if m.budget == "paper"} == {
      "pld", "self-draft", "draft-model", "medusa", "eagle1", "eagle2", "eagle3"}
  retrain = load_experiment(os.path.join(ROOT, "configs", "quickstart-train.yaml"))
  assert [m.name for m in retrain.methods] == [m.name for m in quick.methods]
  assert retrain.eval == quick.eval
  shipped_configs = {k.split("/")[1]: v["config"] for k, v in shipped.manifest().items()}
  for m in retrain.methods:
    weights = registry.get(m.kind).weights
    assert bool(m.train) == (weights is not None), m.name
    if weights in shipped_configs:  # retrained by the recipe that made the shipped drafter
      assert m.train == shipped_configs[weights], m.name


@pytest.mark.parametrize("text,match", [
    ("name: x\nmethods: [{name: vanilla, gama: 3}]\n", "unknown key 'methods\\[0\\].gama'"),
    ("name: x\nmethods: [{name: vanilla}, {name: eagle9}]\n", "unknown drafter 'eagle9'"),
    ("name: x\nmethods: [{name: pld}]\n", "must include vanilla"),
    ("name: x\nmethods: [{name: vanilla}]\neval: {turns: [3]}\n", "turns"),
    ("name: x\nmethods: [{name: vanilla}, {name: pld, train: a.yaml}]\n", "not trainable"),
])
def test_malformed_configs_fail_in_one_line(tmp_path, capsys, text, match):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  with pytest.raises(EagleJaxError, match=match):
    load_experiment(str(path))
  assert main(["run", str(path)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "bad.yaml" in err


CONFIG = """
name: tiny
results_dir: {results}
runs_dir: {runs}
methods:
  - {{name: vanilla}}
  - {{name: pld, drafter: pld-static}}
  - {{name: skip2, drafter: self-draft, self_draft_layers: 2, gamma: 2}}
eval: {{prompts: {prompts}, num_questions: 2, turns: [1, 2], temperatures: [0.0, 1.0],
        max_new_tokens: 8}}
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("exp")
  path = tmp / "exp.yaml"
  path.write_text(CONFIG.format(results=tmp / "results", runs=tmp / "runs", prompts="mtbench"))
  assert main(["run", str(path)]) == 0
  return path, tmp / "results" / "tiny"


def test_runner_writes_records_summary_and_table(finished):
  _, out = finished
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["methods"]) == {"vanilla", "pld", "skip2"}
  for name in ("pld", "skip2"):
    t0, t1 = summary["methods"][name]["T0.0"], summary["methods"][name]["T1.0"]
    assert t0["greedy_mismatches"] == 0 and t1["greedy_mismatches"] is None
    # tau is the records' tokens per verify pass, and drafts were accepted (a drafter whose
    # drafts the target never takes gives exactly 1; here, greedy, one accepted token in the
    # reply to question 91's second turn: test_jsonl_prompts has replies that copy the prompt)
    steps = [a for l in (out / "records" / f"{name}-T0.0.jsonl").read_text().splitlines()
             for a in json.loads(l)["accepted"]]
    assert t0["tau"] == round(1 + sum(steps) / len(steps), 3) and t0["tau"] > 1.0, (name, t0["tau"])
    assert t0["speedup"] > 0 and t0["predicted_speedup"] > 0
    assert t0["predicted_speedup"] <= t0["predicted_speedup_free_draft"]
    assert t0["predicted_speedup_free_draft"] <= summary["settings"]["speedup_ceiling"]["speedup"] + 1e-3
    assert len(t0["n_alpha"]) >= 1 and set(t0["per_category"]) == {"writing", "roleplay"}
  assert summary["methods"]["vanilla"]["T0.0"]["tau"] is None
  records = [json.loads(l) for l in (out / "records" / "skip2-T0.0.jsonl").read_text().splitlines()]
  assert [(r["id"], r["turn"]) for r in records] == [("81", 1), ("81", 2), ("91", 1), ("91", 2)]
  assert all(len(r["accepted"]) == len(r["drafted_depth"]) >= 1 for r in records)
  assert all(r["new_tokens"] == len(r["token_ids"]) for r in records)
  table = (out / "table.md").read_text()
  assert "| skip2 |" in table and "Speedup (T=0.0)" in table
  assert (out / "config.yaml").is_file()
  costs = json.loads((out / "costs.json").read_text())
  sizes, biggest = sorted(map(int, costs["verify_cost_ms"])), max(costs["num_nodes"].values()) + 1
  assert sizes[0] == 1 and sizes[-2] <= biggest <= sizes[-1]  # the sizes the trees need, no more


def test_rerun_only_rerenders(finished, monkeypatch, capsys):
  path, out = finished
  before = (out / "records" / "pld-T1.0.jsonl").read_text()

  def boom(*a, **k):
    raise AssertionError("a finished unit was evaluated again")

  monkeypatch.setattr(experiment, "run_unit", boom)
  capsys.readouterr()
  assert main(["run", str(path)]) == 0
  assert "| pld |" in capsys.readouterr().out
  assert (out / "records" / "pld-T1.0.jsonl").read_text() == before
  # a changed method re-evaluates that method only
  calls, timed = [], []
  monkeypatch.setattr(experiment, "run_unit", lambda *a, **k: calls.append(a[4]) or boom())
  monkeypatch.setattr(costs, "verify_cost_curve", lambda *a, **k: timed.append(k) or {})
  with pytest.raises(AssertionError):
    main(["run", str(path), "eval.max_new_tokens=9"])
  assert calls == ["vanilla"]
  assert timed == []  # the stored costs.json covers vanilla's sizes: nothing is timed again


class Killed(BaseException):
  """Stands for a kill: raised right after a batch's records were synced to disk."""


def test_an_interrupted_unit_resumes_after_its_last_finished_batch(finished, tmp_path, monkeypatch):
  _, first = finished
  config = tmp_path / "exp.yaml"
  config.write_text(CONFIG.format(results=tmp_path / "results", runs=tmp_path / "runs", prompts="mtbench"))
  out = tmp_path / "results" / "tiny"
  append, batches = experiment.store.append, []

  def killed_after_two_skip2_batches(path, records):
    append(path, records)
    batches.append(os.path.basename(path))
    if batches.count("skip2-T0.0.jsonl") == 2:
      raise Killed

  monkeypatch.setattr(experiment.store, "append", killed_after_two_skip2_batches)
  with pytest.raises(Killed):
    experiment.run_experiment(str(config), progress=False)
  monkeypatch.setattr(experiment.store, "append", append)
  assert (out / "records" / "pld-T0.0.jsonl").is_file()  # finished before the kill: stored
  assert not (out / "records" / "skip2-T0.0.jsonl").exists()
  partial = out / "records" / "skip2-T0.0.partial.jsonl"
  assert len(partial.read_text().splitlines()) == 2
  with open(partial, "a") as f:
    f.write('{"id": "8')  # a line the kill cut short
  starts, decode = [], experiment.decode_batches

  def counted(lm, drafter, dparams, prompts, method, temperature, ev, start=0):
    starts.append((method, temperature, start))
    return decode(lm, drafter, dparams, prompts, method, temperature, ev, start)

  monkeypatch.setattr(experiment, "decode_batches", counted)
  summary = experiment.run_experiment(str(config), progress=False)
  # skip2 goes on after its two finished batches, pld is not decoded again, and vanilla is
  # timed again (every prompt) beside skip2; the other temperature runs whole
  assert [s for s in starts if s[1] == 0.0] == [("vanilla", 0.0, 0), ("skip2", 0.0, 2)]
  assert [s for s in starts if s[1] == 1.0] == [(m, 1.0, 0) for m in ("vanilla", "pld", "skip2")]
  assert not partial.exists()
  for name in ("vanilla", "pld", "skip2"):
    for t in ("T0.0", "T1.0"):  # the same tokens as the uninterrupted run (sampling included)
      got = experiment.store.read_jsonl(str(out / "records" / f"{name}-{t}.jsonl"))
      want = experiment.store.read_jsonl(str(first / "records" / f"{name}-{t}.jsonl"))
      assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want], (name, t)
  skip2 = experiment.store.read_jsonl(str(out / "records" / "skip2-T0.0.jsonl"))
  pld = experiment.store.read_jsonl(str(out / "records" / "pld-T0.0.jsonl"))
  before, now = skip2[0]["session"], skip2[-1]["session"]
  assert [r["session"] for r in skip2] == [before, before, now, now] and before != now
  assert {r["session"] for r in pld} == {before}
  # the first process's vanilla is kept, and each record is compared with its own process's
  kept = experiment.store.read_jsonl(str(out / "baselines" / f"vanilla-T0.0-{before}.jsonl"))
  assert len(kept) == 4 and {r["session"] for r in kept} == {before}
  assert summary["methods"]["skip2"]["T0.0"]["same_run"] and summary["methods"]["pld"]["T0.0"]["same_run"]
  assert summary["methods"]["skip2"]["T0.0"]["greedy_mismatches"] == 0


def test_a_method_timed_again_is_paired_with_a_vanilla_timed_again(finished, tmp_path, monkeypatch, capsys):
  import shutil

  path, out = finished
  results = tmp_path / "results"
  shutil.copytree(out, results / "tiny")
  config = tmp_path / "exp.yaml"
  config.write_text(CONFIG.format(results=results, runs=tmp_path / "runs", prompts="mtbench")
                    .replace("gamma: 2}", "gamma: 3}"))
  calls = []

  def stored(lm, drafter, dparams, prompts, method, temperature, *rest, session=None, **k):
    calls.append((method, temperature))  # decoded again: the records carry this run's session
    old = experiment.store.read_jsonl(str(results / "tiny" / "records" / f"{method}-T{temperature}.jsonl"))
    return [dict(r, session=session) for r in old]

  monkeypatch.setattr(experiment, "run_unit", stored)
  monkeypatch.setattr(experiment.store, "measure_costs", lambda *a, **k: None)
  summary = experiment.run_experiment(str(config), progress=False)
  # only skip2 changed, and vanilla is timed again beside it at each temperature
  assert calls == [("vanilla", 0.0), ("skip2", 0.0), ("vanilla", 1.0), ("skip2", 1.0)]
  assert summary["methods"]["skip2"]["T0.0"]["same_run"] is True
  # pld was timed by the first run: it keeps that run's vanilla, kept under baselines/
  kept = list((results / "tiny" / "baselines").glob("vanilla-T0.0-*.jsonl"))
  assert len(kept) == 1
  first = {r["session"] for r in experiment.store.read_jsonl(str(out / "records" / "pld-T0.0.jsonl"))}
  assert kept[0].name == f"vanilla-T0.0-{first.pop()}.jsonl"
  for t in ("T0.0", "T1.0"):
    pld, first_run = summary["methods"]["pld"][t], json.loads((out / "summary.json").read_text())
    assert pld["same_run"] is True
    assert pld["speedup"] == first_run["methods"]["pld"][t]["speedup"]
  assert "vanilla timed in another run" not in (results / "tiny" / "table.md").read_text()
  # a third run that times skip2 again keeps the second run's vanilla as well
  config.write_text(config.read_text().replace("gamma: 3}", "gamma: 2}"))
  summary = experiment.run_experiment(str(config), progress=False)
  assert len(list((results / "tiny" / "baselines").glob("vanilla-T0.0-*.jsonl"))) == 2
  assert all(summary["methods"][m][t]["same_run"] for m in summary["methods"] for t in ("T0.0", "T1.0"))
  # pair_timings false (an acceptance table): skip2 alone is decoded again, vanilla is kept,
  # and the speedup of the method timed by this process is marked as against another's vanilla
  calls.clear()
  config.write_text(config.read_text().replace("gamma: 2}", "gamma: 3}"))
  summary = experiment.run_experiment(str(config), ["eval.pair_timings=false"], progress=False)
  assert calls == [("skip2", 0.0), ("skip2", 1.0)]
  assert summary["methods"]["skip2"]["T0.0"]["same_run"] is False
  assert summary["methods"]["skip2"]["T0.0"]["tau"] is not None
  assert "vanilla timed in another run" in (results / "tiny" / "table.md").read_text()
  (results / "tiny" / "summary.json").write_text("{not json")
  assert main(["table", str(results / "tiny")]) == 2
  assert "unreadable summary" in capsys.readouterr().err
  (results / "tiny" / "summary.json").write_text('{"rows": []}')
  assert main(["table", str(results / "tiny")]) == 2
  assert "not an eagle-jax run summary" in capsys.readouterr().err
  for bad in ('{"name": "x", "methods": {}, "settings": {}}',
              '{"name": "x", "methods": [1], "settings": {"temperatures": [0.0]}}'):
    (results / "tiny" / "summary.json").write_text(bad)
    assert main(["table", str(results / "tiny")]) == 2
    err = capsys.readouterr().err
    assert "malformed run summary" in err and len(err.strip().splitlines()) == 1


def test_table_command_markdown_and_latex(finished, capsys):
  _, out = finished
  capsys.readouterr()
  assert main(["table", str(out), str(out), "--per-category"]) == 0
  md = capsys.readouterr().out
  assert "| tiny/pld |" in md and "Per category, T=0.0" in md
  assert main(["table", str(out), "--format", "latex"]) == 0
  tex = capsys.readouterr().out
  assert r"\begin{tabular}" in tex and "skip2 &" in tex
  # acceptance tables: each drafting method's budget, tau and n-alpha as the summary holds them
  summary = json.loads((out / "summary.json").read_text())
  assert main(["table", str(out), "--acceptance"]) == 0
  md = capsys.readouterr().out
  for t in ("T0.0", "T1.0"):
    section = md.split(f"Acceptance, {t.replace('T', 'T=')}")[1].split("Acceptance, ")[0]
    rows = [l.split(" | ") for l in section.splitlines() if l.startswith("| pld |") or l.startswith("| skip2 |")]
    assert len(rows) == 2 and "| vanilla |" not in section
    for r in rows:
      cell = summary["methods"][r[0][2:]][t]
      assert r[1] == "tuned" and float(r[2]) == round(cell["tau"], 2)
      assert float(r[3]) == round(cell["n_alpha"][0], 2) and len(r) == 3 + 6
  assert main(["table", str(out), "--acceptance", "--format", "latex"]) == 0
  assert "$6$-$\\alpha$" in capsys.readouterr().out
  assert main(["table", str(out / "nope")]) == 2


def test_jsonl_prompts(tmp_path):
  prompts = tmp_path / "mine.jsonl"
  # a reply that copies the prompt: prompt lookup's drafts are accepted
  prompts.write_text('{"prompt": "Repeat exactly: The quick brown fox jumps over the lazy dog.", '
                     '"category": "copy"}\n'
                     '{"turns": ["Count to three.", "Now backwards."], "category": "count"}\n')
  path = tmp_path / "exp.yaml"
  path.write_text(CONFIG.format(results=tmp_path / "r", runs=tmp_path / "runs", prompts=prompts)
                  .replace("temperatures: [0.0, 1.0]", "temperatures: [0.0]")
                  .replace("  - {name: skip2, drafter: self-draft, self_draft_layers: 2, gamma: 2}\n", ""))
  summary = experiment.run_experiment(str(path), progress=False)
  pld = summary["methods"]["pld"]["T0.0"]
  assert set(pld["per_category"]) == {"copy", "count"}
  assert pld["greedy_mismatches"] == 0 and pld["per_category"]["copy"]["tau"] > 1.0, pld
  records = (tmp_path / "r" / "tiny" / "records" / "pld-T0.0.jsonl").read_text().splitlines()
  assert len(records) == 3  # two first turns and one second turn


def test_a_prompt_file_is_used_whole_unless_cut_and_a_cut_is_announced(tmp_path, capsys):
  from eagle_jax.evaluation.runner import EvalConfig, questions_for

  prompts = tmp_path / "mine.jsonl"
  prompts.write_text("".join(f'{{"prompt": "Say {i}.", "category": "c{i % 3}"}}\n' for i in range(120)))
  assert len(questions_for(EvalConfig(prompts=str(prompts)))) == 120  # default: all
  assert "[eval]" not in capsys.readouterr().err
  assert len(questions_for(EvalConfig(prompts=str(prompts), num_questions=80))) == 80
  cut = capsys.readouterr()  # on stderr: stdout of bench spec --json stays one JSON line
  assert "[eval] 80 of the 120 prompts in" in cut.err and not cut.out
  assert len(questions_for(EvalConfig(prompts=str(prompts), categories=("c1",)))) == 40
  assert "[eval]" not in capsys.readouterr().err


def test_cache_keys_follow_the_checkpoint_and_the_prompt_text(tmp_path, monkeypatch):
  from eagle_jax.evaluation.prompts import Question

  final = tmp_path / "final"
  final.mkdir()
  (final / "drafter.json").write_text(json.dumps({"drafter": "eagle1", "steps": 4}))
  before = experiment.store.checkpoint_key(str(final))
  (final / "drafter.json").write_text(json.dumps({"drafter": "eagle1", "steps": 4, "budget": {"top_k": 4}}))
  assert experiment.store.checkpoint_key(str(final)) != before  # re-tuned: its records are stale
  tuned = experiment.store.checkpoint_key(str(final))
  (final / "drafter.json").write_text(json.dumps({"drafter": "eagle1", "steps": 4, "budget": {"top_k": 4},
                                                  "train_seconds": 81.5}))
  assert experiment.store.checkpoint_key(str(final)) == tuned  # the same training, timed again
  (final / "drafter.json").write_text(json.dumps({"drafter": "eagle1", "steps": 5, "budget": {"top_k": 4},
                                                  "train_seconds": 81.5}))
  assert experiment.store.checkpoint_key(str(final)) != tuned  # trained further
  # a shipped drafter is keyed by its place among the shipped ones, not by where the clone is
  keys = []
  for clone in ("a", "b"):
    folder = tmp_path / clone / "pretrained" / "tiny" / "eagle1"
    folder.mkdir(parents=True)
    (folder / "drafter.json").write_text(json.dumps({"drafter": "eagle1", "steps": 4}))
    monkeypatch.setenv("EAGLE_JAX_PRETRAINED", str(tmp_path / clone / "pretrained"))
    keys.append(experiment.store.checkpoint_key(str(folder)))
  assert keys[0] == keys[1] and keys[0]["path"] == "shipped:tiny/eagle1"
  assert experiment.store.checkpoint_key(str(final))["path"] == str(final)  # not a shipped one
  a = experiment.store.prompts_key([Question("1", "c", ("Say hi.",))])
  assert experiment.store.prompts_key([Question("1", "c", ("Say bye.",))]) != a  # same id, new text
  assert experiment.store.prompts_key([Question("1", "c", ("Say hi.",))]) == a


def test_a_run_killed_while_tuning_is_not_finished(tmp_path):
  from eagle_jax.pipeline.train import TrainConfig, run_finished

  cfg = TrainConfig(name="r", drafter="eagle1", runs_dir=str(tmp_path))
  final = tmp_path / "r" / "final"
  assert not run_finished(cfg)
  final.mkdir(parents=True)
  (final / "drafter.json").write_text(json.dumps({"drafter": "eagle1"}))
  assert not run_finished(cfg)  # exported, not tuned yet
  (final / "drafter.json").write_text(json.dumps({"drafter": "eagle1", "budget": {"top_k": 4}}))
  assert run_finished(cfg)
  import dataclasses

  assert run_finished(dataclasses.replace(cfg, tune=dataclasses.replace(cfg.tune, enabled=False)))
  from eagle_jax.configs import dump_config

  dump_config(cfg, str(tmp_path / "r" / "config.yaml"))
  changed = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1.0))
  with pytest.raises(EagleJaxError, match="different config"):
    run_finished(changed)
  # a run saved before a config key existed: the key counts as its default there
  import yaml

  saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
  del saved["eagle"]["positions_per_row"]
  (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump(saved))
  assert run_finished(cfg)
  sampled = dataclasses.replace(cfg, eagle=dataclasses.replace(cfg.eagle, positions_per_row=128))
  with pytest.raises(EagleJaxError, match="different config"):
    run_finished(sampled)


def test_no_prompt_with_the_asked_turns_is_a_one_line_error(tmp_path, capsys):
  prompts = tmp_path / "one-turn.jsonl"
  prompts.write_text('{"prompt": "Say hi."}\n')
  path = tmp_path / "exp.yaml"
  path.write_text(CONFIG.format(results=tmp_path / "r", runs=tmp_path / "runs", prompts=prompts)
                  .replace("turns: [1, 2]", "turns: [2]"))
  assert main(["run", str(path)]) == 2
  assert "no prompts to evaluate" in capsys.readouterr().err


def test_table_prediction_reads_the_runs_costs():
  from eagle_jax.evaluation.tables import _predicted

  costs = {"verify_cost_ms": {"1": 10.0, "2": 12.0, "4": 16.0, "8": 24.0}, "draft_ms": {"pld": 0.5},
           "num_nodes": {"pld": 7}, "widths": {"pld": [3, 7]}, "chain": {"pld": False}}
  # drafted 7 (verify width 7) accepting 3, drafted 2 (width 3) accepting 0, then two steps
  # that drafted nothing (plain decode steps); every step pays the draft
  recs = [{"accepted": [3, 0, 0, 0], "drafted_depth": [7, 2, 0, 0]}]
  assert _predicted(recs, costs, "pld") == round((4 + 1 + 1 + 1) * 10.0 / (24 + 16 + 10 + 10 + 4 * 0.5), 3)
  # costs.json written before widths and chain were recorded: the whole node budget, a tree
  old = {k: v for k, v in costs.items() if k not in ("widths", "chain")}
  assert _predicted(recs, old, "pld") == round(7 * 10.0 / (24 + 24 + 10 + 10 + 4 * 0.5), 3)
  assert _predicted([{"accepted": [], "drafted_depth": []}], costs, "pld") is None
  assert _predicted(recs, costs, "vanilla") is None
  # the same steps with drafting free, and the curve's ceiling above both
  free = _predicted(recs, costs, "pld", free_draft=True)
  assert free == round((4 + 1 + 1 + 1) * 10.0 / (24 + 16 + 10 + 10), 3) > _predicted(recs, costs, "pld")
  from eagle_jax.evaluation.tables import _ceiling
  assert _ceiling(costs) == {"speedup": 3.333, "tokens_per_pass": 8} and free <= 3.333
  assert _ceiling({}) is None


def test_a_drafter_for_another_target_trains_in_its_own_run_folder(tmp_path, monkeypatch):
  """A training config names its run after itself; trained for another target (``model=``),
  the run goes to a folder named after that target, so neither run blocks the other."""
  from eagle_jax.pipeline import train as pipeline
  from eagle_jax.evaluation.runner import MethodConfig, ensure_checkpoint

  trained = []
  monkeypatch.setattr(pipeline, "run_finished", lambda tcfg: False)
  monkeypatch.setattr(pipeline, "run_training", lambda path, overrides, progress: trained.append(overrides))
  train = os.path.join(ROOT, "configs", "train", "eagle1-demo.yaml")
  method = MethodConfig(name="eagle1", train=train)
  base = dict(name="x", methods=(MethodConfig(name="vanilla"), method), runs_dir=str(tmp_path))
  own = ensure_checkpoint(method, ExperimentConfig(**base), progress=False)
  assert own == os.path.join(str(tmp_path), "eagle1-demo", "final")
  folder = tmp_path / "my-llama"
  other = ensure_checkpoint(method, ExperimentConfig(**base, model=str(folder)), progress=False)
  assert os.path.basename(os.path.dirname(other)).startswith("eagle1-demo-my-llama-")
  assert f"model={folder}" in trained[1] and f"name={os.path.basename(os.path.dirname(other))}" in trained[1]
  named = MethodConfig(name="eagle1", train=train, train_overrides=("name=mine",))
  assert ensure_checkpoint(named, ExperimentConfig(**dict(base, methods=(base["methods"][0], named)),
                                                   model=str(folder)), progress=False).endswith("mine/final")
