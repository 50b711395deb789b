"""experiments/sweeps.py on the real default model with tiny settings and no trained drafter.

Two MT-bench questions (writing, roleplay; one 64-token prompt bucket), 8 new tokens, prompt
lookup only. The tests share compiled programs (same drafter, prompts and shapes), so keep the
settings aligned: pld's default gamma is 8, the budget test sweeps gamma 8.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "assets" / "results"
TINY = ["--num-questions", "2", "--max-new-tokens", "8", "--quiet"]


@pytest.fixture(scope="module")
def sweeps():
  spec = importlib.util.spec_from_file_location("sweeps", REPO / "experiments" / "sweeps.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["sweeps"] = module  # dataclasses resolve annotations through sys.modules
  spec.loader.exec_module(module)
  yield module
  del sys.modules["sweeps"]


def _run(sweeps, capsys, tmp_path, argv):
  out = tmp_path / "results"
  assert sweeps.main(argv + TINY + ["--out", str(out), "--runs-dir", str(tmp_path / "runs")]) == 0
  kind = argv[0]
  folder = out / f"sweep-{kind}"
  sweep = json.loads((folder / "sweep.json").read_text())
  assert (folder / f"{kind}.png").stat().st_size > 1000
  # the shape notebooks/sweeps.ipynb reads, as in its fixture
  fixture = json.loads((FIXTURES / f"sweep-{kind}" / "sweep.json").read_text())
  assert sweep["sweep"] == kind and set(fixture) <= set(sweep)
  assert all(set(r) == set(fixture["rows"][0]) for r in sweep["rows"])
  for r in sweep["rows"]:
    assert isinstance(r["tokens_per_s"], float) and r["tokens_per_s"] > 0
    assert isinstance(r["speedup"], float) and r["speedup"] > 0
    assert r["tau"] is None or 1.0 <= r["tau"] <= 9.0
  text = capsys.readouterr().out
  assert f"| method | {sweep['x']} |" in text and "wrote" in text
  return sweep


def test_budget_pld(sweeps, capsys, tmp_path):
  sweep = _run(sweeps, capsys, tmp_path, ["budget", "--methods", "pld", "--values", "8"])
  assert sweep["x"] == "draft_nodes"
  [row] = sweep["rows"]
  assert row["method"] == "pld" and row["x"] == 8 and row["category"] is None
  assert 0 < row["predicted_speedup"] < 9  # chain formula with measured alpha and costs
  assert {"1", "9"} <= set(sweep["settings"]["verify_cost_ms"])  # c(1) and c(gamma + 1)


def test_temperature_pld(sweeps, capsys, tmp_path):
  # T=0 only: reuses the budget test's programs (each new temperature compiles twice, ~40 s
  # on 2 shared cores); T > 0 changes nothing in the sweep's code but the number passed on
  sweep = _run(sweeps, capsys, tmp_path, ["temperature", "--methods", "pld", "--values", "0"])
  rows = sweep["rows"]
  assert sweep["x"] == "temperature" and {r["x"] for r in rows} == {0.0}
  assert [r["category"] for r in rows] == [None, "writing", "roleplay"]  # all, then each category
  assert all(r["predicted_speedup"] is None for r in rows)


def test_batch_pld(sweeps, capsys, tmp_path):
  sweep = _run(sweeps, capsys, tmp_path, ["batch", "--methods", "pld", "--values", "1", "2"])
  rows = sweep["rows"]
  assert sweep["x"] == "batch_size"
  assert [(r["method"], r["x"]) for r in rows] == [("vanilla", 1), ("vanilla", 2), ("pld", 1),
                                                   ("pld", 2)]
  assert all(r["speedup"] == 1.0 and r["tau"] is None for r in rows[:2])


def test_alignment_needs_trained_drafters(sweeps, capsys, tmp_path, monkeypatch):
  monkeypatch.setenv("EAGLE_JAX_PRETRAINED", "")  # no shipped drafter to fall back on
  (tmp_path / "runs").mkdir()
  argv = ["alignment", "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "results")]
  assert sweeps.main(argv + TINY) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1
  assert err.startswith("sweeps.py: error: no trained eagle1 drafter for smollm2-135m-instruct in")
  assert not (tmp_path / "results").exists()


def test_bad_methods_and_values(sweeps, capsys, tmp_path):
  out = ["--out", str(tmp_path / "results")]
  assert sweeps.main(["budget", "--methods", "vanilla"] + TINY + out) == 2
  assert "unknown method(s) ['vanilla']" in capsys.readouterr().err
  assert sweeps.main(["batch", "--values", "two"] + TINY + out) == 2
  assert "--values must be ints" in capsys.readouterr().err
  assert sweeps.main(["alignment", "--methods", "sharegpt"] + TINY + out) == 2
  assert "unknown drafter(s) ['sharegpt']" in capsys.readouterr().err


@pytest.mark.parametrize("bits", [0, 8])
@pytest.mark.parametrize("vocab", [None, "half"])
def test_untrained_head_takes_the_trained_heads_drafting_form(sweeps, tiny, bits, vocab):
  """The alignment sweep's untrained head drafts with the trained head's draft vocabulary and
  weight bits (read back by drafting_form), so the two rows differ by training alone."""
  import numpy as np
  from flax import nnx

  from eagle_jax.drafters.eagle.drafter import EagleDrafter
  from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig
  from eagle_jax.model.transformer import quantize_linears

  target = tiny()
  ids = None if vocab is None else np.arange(0, target.config.vocab_size, 2)
  head = EagleHead(EagleHeadConfig(1, target.config), rngs=nnx.Rngs(1))
  if bits:
    quantize_linears(head)
  built = EagleDrafter.create(head, target, None, draft_ids=ids, top_k=3, depth=2, total_tokens=4)
  got_ids, got_bits = sweeps.drafting_form(*built)
  assert got_bits == bits
  assert (got_ids is None) if ids is None else np.array_equal(np.asarray(got_ids), ids)
