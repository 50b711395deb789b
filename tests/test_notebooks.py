"""The analysis notebooks run headless (nbclient, kernel python3) against tests/assets/results.

The fixtures copy the layout of ``eagle-jax run`` and the sweep scripts (regenerate them with
``tests/assets/results/make_fixtures.py``). Each test launches one kernel in a temporary working
directory, points the notebook at the fixtures through its environment variable, and counts
the figures (``image/png`` outputs) it draws.
"""

import json
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "tests" / "assets" / "results"
RUNS = REPO / "tests" / "assets" / "runs"  # metrics.jsonl and config.yaml of real training runs
NOTEBOOKS = ["acceptance.ipynb", "sweeps.ipynb", "learning_curves.ipynb"]


def _execute(name, cwd, monkeypatch, env, extra_source=None):
  """Runs notebooks/<name> (plus an optional last cell); returns (png count, stdout text, notebook)."""
  monkeypatch.setenv("MPLBACKEND", "Agg")
  for key, value in env.items():
    monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
  nb = nbformat.read(REPO / "notebooks" / name, as_version=4)
  if extra_source:
    nb.cells.append(nbformat.v4.new_code_cell(extra_source))
  NotebookClient(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  pngs = sum("image/png" in o.get("data", {}) for o in outputs)
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  return pngs, text, nb


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_without_outputs_and_parametrized(name):
  nb = nbformat.read(REPO / "notebooks" / name, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not c.outputs and c.execution_count is None for c in code)
  assert "parameters" in code[0].metadata.get("tags", [])
  assert nb.metadata.kernelspec.name == "python3"


def test_acceptance(tmp_path, monkeypatch):
  pngs, text, nb = _execute("acceptance.ipynb", tmp_path, monkeypatch,
                            {"EAGLE_JAX_RESULTS": str(RESULTS / "quickstart")},
                            extra_source="import sys; print('kernel:', sys.executable)")
  assert pngs == 3  # n-alpha curves, per-category tau, predicted vs measured
  tables = [o for c in nb.cells for o in c.get("outputs", []) if "text/markdown" in o.get("data", {})]
  assert len(tables) == 1 and "| eagle2 | 2.36x | 3.00 | 1.90x | 2.44 |" in tables[0]["data"]["text/markdown"]
  assert text.count(": tau ") == 3 and "MISMATCH" not in text  # 3 records files agree with summary.json
  assert f"kernel: {sys.executable}\n" in text  # the venv's interpreter runs the notebook


def test_sweeps(tmp_path, monkeypatch):
  pngs, text, _ = _execute("sweeps.ipynb", tmp_path, monkeypatch, {"EAGLE_JAX_RESULTS_ROOT": str(RESULTS)})
  assert pngs == 4 and "skipped" not in text


def test_sweeps_skip_absent(tmp_path, monkeypatch):
  root = tmp_path / "results"
  shutil.copytree(RESULTS / "sweep-budget", root / "sweep-budget")
  pngs, text, _ = _execute("sweeps.ipynb", tmp_path, monkeypatch, {"EAGLE_JAX_RESULTS_ROOT": "results"})
  assert pngs == 1  # a relative root resolves against the working directory
  assert [line.split(":")[0] for line in text.splitlines() if "(skipped)" in line] == [
      "sweep-batch", "sweep-temperature", "sweep-alignment"]


def test_learning_curves(tmp_path, monkeypatch):
  runs = sorted(p.name for p in RUNS.iterdir() if (p / "metrics.jsonl").is_file())
  pngs, text, _ = _execute("learning_curves.ipynb", tmp_path, monkeypatch,
                           {"EAGLE_JAX_RUNS_ROOT": str(RUNS)})
  assert pngs == 2 and f"{len(runs)} runs with held-out evaluations" in text
  # the last evaluation of each run, as its metrics.jsonl holds it
  for name in runs:
    rows = [json.loads(l) for l in (RUNS / name / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "heldout_acc_0" in r][-1]
    assert f"{name} (" in text and f"top-1 by depth {last['heldout_acc_0']:.3f}" in text
    if "heldout_tau" in last:
      assert f"tau {last['heldout_tau']:.3f} after {last['tokens']:,} token steps" in text
  pngs, text, _ = _execute("learning_curves.ipynb", tmp_path, monkeypatch,
                           {"EAGLE_JAX_RUNS_ROOT": str(RUNS), "EAGLE_JAX_RUNS": runs[0]})
  assert "1 runs with held-out evaluations" in text
