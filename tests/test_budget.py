"""``--budget paper|tuned``: each method's published setting, declared once by its drafter kind,
reaches the CLI, ``bench spec`` and experiment methods; explicit options win over it."""

import dataclasses
import os

import pytest

from eagle_jax import cli
from eagle_jax.cli import build_parser
from eagle_jax.drafters import registry
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation import records
from eagle_jax.evaluation.bench_spec import methods_for
from eagle_jax.evaluation.dryrun import dry_run
from eagle_jax.evaluation.runner import MethodConfig, load_experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "tests", "assets", "paper-gpu")

# the published settings (docs/methods.md lists them with their sources)
PAPER = {
    "eagle1": {"tree": "default", "draft_vocab": 0, "head_bits": 0},
    "eagle2": {"total_tokens": 60, "depth": 6, "top_k": 10, "draft_vocab": 0, "head_bits": 0},
    "eagle3": {"total_tokens": 60, "depth": 7, "top_k": 10, "head_bits": 0},
    "medusa": {"tree": "default", "head_bits": 0},
    "draft-model": {"gamma": 4, "head_bits": 0},
    "pld-static": {"gamma": 10, "pld_min_ngram": 1, "pld_max_ngram": 3},
    "pld": {"gamma": 10, "pld_min_ngram": 1, "pld_max_ngram": 3, "pld_widths": (10,)},
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_budget_is_the_published_setting_and_tuned_the_defaults(name):
  paper = registry.make_options(name, {}, budget="paper")
  tuned = registry.make_options(name, {})
  assert {k: getattr(paper, k) for k in PAPER[name]} == PAPER[name]
  assert tuned == registry.get(name).options()
  assert paper != tuned and registry.get(name).paper_source
  methods = open(os.path.join(ROOT, "docs", "methods.md")).read()
  assert f"`{name}`" in methods.split("## Published figures")[1]  # documented with its source


def test_kinds_without_a_published_setting_run_the_same_under_both():
  for name in ("vanilla", "self-draft"):
    assert registry.make_options(name, {}, budget="paper") == registry.make_options(name, {})


def test_explicit_options_win_and_an_explicit_shape_replaces_the_papers():
  o = registry.make_options("eagle2", {"top_k": 4}, budget="paper")
  assert (o.top_k, o.depth, o.total_tokens, o.draft_vocab) == (4, 6, 60, 0)
  o = registry.make_options("eagle2", {"tree": "default"}, budget="paper")
  assert (o.tree, o.top_k, o.depth, o.total_tokens, o.draft_vocab) == ("default", 0, 0, 0, 0)
  o = registry.make_options("eagle1", {"gamma": 4}, budget="paper")
  assert (o.gamma, o.tree, o.draft_vocab) == (4, "", 0)
  o = registry.make_options("pld", {"gamma": 5}, budget="paper")
  assert (o.gamma, o.pld_min_ngram, o.pld_widths) == (5, 1, ())


def test_a_bad_budget_is_a_one_line_error(capsys):
  with pytest.raises(EagleJaxError, match="--budget: expected one of tuned, paper, got 'papers'"):
    registry.make_options("eagle2", {}, budget="papers")
  with pytest.raises(EagleJaxError, match="method 'e': --budget: expected one of") as e:
    MethodConfig(name="e", drafter="eagle2", budget="big").validate()
  assert len(str(e.value).splitlines()) == 1
  with pytest.raises(SystemExit):
    build_parser().parse_args(["generate", "hi", "--budget", "big"])
  assert "invalid choice: 'big'" in capsys.readouterr().err


def test_cli_and_bench_spec_carry_the_budget(monkeypatch, capsys):
  seen = {}
  monkeypatch.setattr(cli, "bench_spec", lambda **kw: seen.update(kw) or {})
  assert cli.main(["bench", "spec", "--methods", "vanilla,eagle2", "--budget", "paper"]) == 0
  assert seen["budget"] == "paper" and seen["methods"] == ("vanilla", "eagle2")
  assert build_parser().parse_args(["generate", "hi"]).budget == "tuned"
  by = methods_for(["vanilla", "eagle2", "medusa:total_tokens=8"], {}, None, "paper")
  assert by["eagle2"].options().total_tokens == 60
  assert by["medusa:total_tokens=8"].options().total_tokens == 8  # the row's own setting wins


def test_experiment_methods_take_a_budget_and_the_dry_run_shows_it(tmp_path):
  path = tmp_path / "e.yaml"
  path.write_text(f"""name: e
model: vicuna-7b-v1.3
checkpoints_dir: {ASSETS}
chat_template: vicuna
methods:
  - {{name: vanilla}}
  - {{name: eagle2, checkpoint: EAGLE-Vicuna-7B-v1.3, budget: paper}}
  - {{name: eagle2-tuned, drafter: eagle2, checkpoint: EAGLE-Vicuna-7B-v1.3}}
eval: {{prompts: mtbench, num_questions: 2, max_new_tokens: 64}}
""")
  cfg = load_experiment(str(path))
  assert cfg.methods[1].options().total_tokens == 60 and cfg.methods[2].options().total_tokens == 0
  plan = dry_run(str(path))
  assert plan["methods"]["eagle2"]["budget"] == "paper"
  assert plan["methods"]["eagle2"]["options"]["total_tokens"] == 60
  assert plan["methods"]["eagle2-tuned"]["options"] == {}


def test_records_made_before_the_budget_existed_keep_their_key(tmp_path):
  cfg = load_experiment(os.path.join(ROOT, "configs", "eagle3.yaml"))
  m = cfg.methods[1]
  _, key = records.unit(str(tmp_path), cfg, m, 0.0, None, {})
  assert "budget" not in key["method"] and "published" not in key["method"]
  _, paper = records.unit(str(tmp_path), cfg, dataclasses.replace(m, budget="paper"), 0.0, None, {})
  assert paper["method"]["budget"] == "paper"
