"""Shipped drafters: the package's manifest and files, `eagle-jax ship`, and where a trained kind
looks for its weights (checkpoint, then runs, then shipped)."""

import hashlib
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml
from flax import nnx

from eagle_jax.cli import main
from eagle_jax.drafters import shipped
from eagle_jax.drafters.shipped import find_checkpoint
from eagle_jax.drafters.storage import load_params, save_params, write_meta
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.checkpoints import read_safetensors

MODEL = "smollm2-135m-instruct"
PACKAGE = shipped._PACKAGE_FOLDER


def _fake_run(runs, name, tau, kind="eagle1", model=MODEL, tokens=1000):
  """A run folder as training leaves it: config.yaml, final/ with drafter.json and weights."""
  final = runs / name / "final"
  final.mkdir(parents=True)
  module = nnx.Linear(3, 2, rngs=nnx.Rngs(tokens))
  save_params(module, str(final))
  (final / "token_counts.npy").write_bytes(b"counts")
  heldout = {} if tau is None else {"heldout_tau": tau, "heldout_alpha_3": float("nan")}
  write_meta(str(final), {"drafter": kind, "model": model, "steps": 3, "train_tokens": tokens,
                          "heldout": heldout})
  (runs / name / "config.yaml").write_text(yaml.safe_dump(
      {"name": name, "drafter": kind, "data": {"train_rows": 8, "replies": "target",
                                               "max_len": 64}}))
  return runs / name, module


def test_package_manifest_matches_the_shipped_files():
  """Every shipped drafter is listed with its files' sizes and SHA-256, says how it was made (a
  config in configs/train, the command, tokens, held-out tau), and all of them together stay
  under 100 MB."""
  entries = shipped.manifest()
  assert {"smollm2-135m-instruct/eagle1", "smollm2-135m-instruct/eagle3"} <= set(entries)
  total = 0
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for key, entry in entries.items():
    folder = os.path.join(PACKAGE, key)
    assert sorted(os.listdir(folder)) == sorted(entry["files"]), key
    for name, f in entry["files"].items():
      data = open(os.path.join(folder, name), "rb").read()
      assert len(data) == f["bytes"] and hashlib.sha256(data).hexdigest() == f["sha256"], name
      total += len(data)
    assert os.path.isfile(os.path.join(repo, entry["config"])), entry["config"]
    assert entry["command"] == f"eagle-jax train {entry['config']}"
    assert entry["train_tokens"] > 0 and entry["heldout"]["heldout_tau"] > 1.0
    meta = json.load(open(os.path.join(folder, "drafter.json")))
    assert f"{meta['model']}/{meta['drafter']}" == key and meta["stored_dtype"] == "bfloat16"
    weights = [n for n in entry["files"] if n.endswith(".safetensors")]
    assert weights and all(str(t.dtype) == "bfloat16" for n in weights for t in
                           read_safetensors(folder, [os.path.join(folder, n)]).values()
                           if t.dtype.kind == "f" or t.dtype == ml_dtypes.bfloat16)
  assert total < 100e6, total


def test_ship_converts_and_replaces_only_with_a_better_drafter(tmp_path, capsys):
  runs, into = tmp_path / "runs", tmp_path / "pretrained"
  run, module = _fake_run(runs, "a", 1.5)
  entry = shipped.ship(str(run), folder=str(into))
  dst = into / MODEL / "eagle1"
  tensors = read_safetensors(str(dst), [str(dst / "params.safetensors")])
  assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
  assert sorted(os.listdir(dst)) == ["drafter.json", "params.safetensors", "token_counts.npy",
                                     "train_config.yaml"]
  assert entry["config"] == "configs/train/a.yaml" and entry["data"] == {"train_rows": 8,
                                                                          "replies": "target"}
  assert entry["heldout"] == {"heldout_tau": 1.5, "heldout_alpha_3": None}  # strict JSON
  text = (into / "manifest.json").read_text()
  assert "NaN" not in text and json.loads(text)[f"{MODEL}/eagle1"] == entry
  # bfloat16 weights load into the float32 parameters, rounded to bfloat16
  loaded = load_params(nnx.eval_shape(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0))), str(dst))
  assert loaded.kernel.value.dtype == jnp.float32
  want = np.asarray(module.kernel.value).astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(loaded.kernel.value), want)

  worse, _ = _fake_run(runs, "b", 1.4)
  with pytest.raises(EagleJaxError, match="--dtype 'int8': choose from bfloat16, float32"):
    shipped.ship(str(worse), folder=str(into), dtype="int8")
  with pytest.raises(EagleJaxError, match="not above the shipped"):
    shipped.ship(str(worse), folder=str(into))
  assert json.loads((into / "manifest.json").read_text())[f"{MODEL}/eagle1"]["config"].endswith("a.yaml")
  shipped.ship(str(worse), folder=str(into), force=True, dtype="float32")
  tensors = read_safetensors(str(dst), [str(dst / "params.safetensors")])
  assert {str(t.dtype) for t in tensors.values()} == {"float32"}
  better, _ = _fake_run(runs, "c", 1.7)
  shipped.ship(str(better / "final"), folder=str(into))  # a run's final/ is accepted too
  assert json.loads((into / "manifest.json").read_text())[f"{MODEL}/eagle1"]["heldout"]["heldout_tau"] == 1.7
  assert not [n for n in os.listdir(into / MODEL) if ".tmp" in n]


def test_ship_errors_are_one_line(tmp_path, capsys, monkeypatch):
  runs = tmp_path / "runs"
  monkeypatch.setenv("EAGLE_JAX_PRETRAINED", str(tmp_path / "pretrained"))
  for name, kw in [("notau", {"tau": None}), ("other", {"tau": 1.5, "model": "/some/folder"})]:
    _fake_run(runs, name, **kw)
  cases = [(["ship", str(runs / "notau")], "no held-out heldout_tau"),
           (["ship", str(runs / "other")], "not a registered model name"),
           (["ship", str(runs / "missing")], "no trained drafter here")]
  for argv, message in cases:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
  monkeypatch.setenv("EAGLE_JAX_PRETRAINED", "")
  _fake_run(runs, "good", 1.5)
  assert main(["ship", str(runs / "good")]) == 2
  assert "EAGLE_JAX_PRETRAINED is empty" in capsys.readouterr().err
  monkeypatch.setenv("EAGLE_JAX_PRETRAINED", str(tmp_path / "pretrained"))
  assert main(["ship", str(runs / "good")]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["key"] == f"{MODEL}/eagle1" and out["stored_dtype"] == "bfloat16"


def test_lookup_order_checkpoint_then_runs_then_shipped(tmp_path, monkeypatch):
  runs, into = tmp_path / "runs", tmp_path / "pretrained"
  run, _ = _fake_run(tmp_path / "made", "s", 1.5)
  shipped.ship(str(run), folder=str(into))
  monkeypatch.setenv("EAGLE_JAX_PRETRAINED", str(into))
  assert find_checkpoint("eagle1", str(runs), MODEL) == str(into / MODEL / "eagle1")  # no runs/
  with pytest.raises(EagleJaxError, match="no trained eagle3 drafter .* none shipped"):
    find_checkpoint("eagle3", str(runs), MODEL)
  with pytest.raises(EagleJaxError, match="none shipped"):
    find_checkpoint("eagle1", str(runs), "another-model")
  _fake_run(runs, "local", 1.2, tokens=10)  # a local run wins over the shipped drafter
  assert find_checkpoint("eagle1", str(runs), MODEL) == str(runs / "local" / "final")
  monkeypatch.setenv("EAGLE_JAX_PRETRAINED", "")  # no shipped fallback at all
  with pytest.raises(EagleJaxError, match="none shipped"):
    find_checkpoint("eagle1", str(tmp_path / "empty"), MODEL)
  monkeypatch.delenv("EAGLE_JAX_PRETRAINED")
  assert shipped.find("eagle1", MODEL) == os.path.join(PACKAGE, MODEL, "eagle1")
  assert shipped.find("medusa", MODEL) is None and shipped.find("eagle1", None) is None
