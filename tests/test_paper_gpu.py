"""The GPU paper configs (configs/paper/gpu/): checked by ``eagle-jax run --dry-run`` against
stand-ins of the published folders (config files only), published-figure columns in the tables,
and Vicuna's conversation format."""

import glob
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from eagle_jax.cli import main
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation.dryrun import dry_run
from eagle_jax.evaluation.runner import load_experiment
from eagle_jax.evaluation.tables import render_latex, render_markdown
from eagle_jax.model.registry import DEFAULT_MODEL, resolve
from eagle_jax.model.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "tests", "assets", "paper-gpu")
GPU = sorted(glob.glob(os.path.join(ROOT, "configs", "paper", "gpu", "*.yaml")))


def _error(capsys, argv) -> str:
  assert main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  return err


def test_the_four_published_settings_are_there():
  names = {os.path.basename(p) for p in GPU}
  assert names == {"vicuna7b-eagle.yaml", "llama31-8b-eagle3.yaml", "vicuna7b-medusa.yaml",
                   "specbench-mtbench.yaml"}


@pytest.mark.parametrize("path", GPU, ids=[os.path.basename(p) for p in GPU])
def test_every_gpu_config_dry_runs_against_the_published_folders(path, capsys):
  assert main(["run", path, f"checkpoints_dir={ASSETS}", "--dry-run", "--json"]) == 0
  plan = json.loads(capsys.readouterr().out)
  assert plan["target"]["folder"].startswith(ASSETS) and plan["target"]["weights"] == "absent"
  assert plan["prompts"]["questions"] == 80 and plan["prompts"]["turns"] == [1, 2]
  cfg = load_experiment(path, [f"checkpoints_dir={ASSETS}"])
  for m in cfg.methods:
    entry = plan["methods"][m.name]
    if m.checkpoint:  # every checkpoint is a published folder under checkpoints_dir
      assert entry["checkpoint"].startswith(ASSETS) and os.path.isdir(entry["checkpoint"])
      assert entry["head"].startswith(("EAGLE-1 head", "EAGLE-3 head", "Medusa-1"))
    if m.kind != "vanilla":  # each compared method carries the paper's figures and their source
      assert m.published and all(p.source and p.tau for p in m.published), m.name
      assert set(entry["published"]) == {f"T{p.temperature}" for p in m.published}


def test_dry_run_names_the_target_and_heads(capsys):
  plan = dry_run(os.path.join(ROOT, "configs", "paper", "gpu", "llama31-8b-eagle3.yaml"),
                 [f"checkpoints_dir={ASSETS}"])
  t = plan["target"]
  assert (t["layers"], t["hidden_size"], t["heads"], t["vocab_size"]) == (32, 4096, "32/8", 128256)
  assert t["dtype"] == "bfloat16" and 14.9 < t["parameter_gib"] < 15.0  # 8.03B parameters in 2 bytes
  head = plan["methods"]["eagle3"]["head"]
  assert "fused layers [2, 16, 29]" in head and "draft vocabulary 32000" in head
  assert plan["methods"]["eagle3"]["options"] == {"total_tokens": 60, "top_k": 10, "depth": 7}


def _copy_assets(tmp_path):
  root = tmp_path / "ckpts"
  shutil.copytree(ASSETS, root)
  return root


def _edit(path, **changes):
  cfg = json.loads(path.read_text())
  cfg.update(changes)
  path.write_text(json.dumps(cfg))


def test_dry_run_errors_are_one_line(tmp_path, capsys):
  cfg = os.path.join(ROOT, "configs", "paper", "gpu", "vicuna7b-eagle.yaml")
  err = _error(capsys, ["run", cfg, f"checkpoints_dir={tmp_path / 'none'}", "--dry-run"])
  assert "no such folder" in err and "checkpoints_dir" in err
  root = _copy_assets(tmp_path)
  _edit(root / "EAGLE-Vicuna-7B-v1.3" / "config.json", hidden_size=5120)
  err = _error(capsys, ["run", cfg, f"checkpoints_dir={root}", "--dry-run"])
  assert "method 'eagle1'" in err and "hidden_size 5120 but the target has 4096" in err
  root = _copy_assets(tmp_path / "b")
  # an EAGLE-3 head where EAGLE-1 weights are expected
  shutil.rmtree(root / "EAGLE-Vicuna-7B-v1.3")
  shutil.copytree(root / "EAGLE3-LLaMA3.1-Instruct-8B", root / "EAGLE-Vicuna-7B-v1.3")
  _edit(root / "EAGLE-Vicuna-7B-v1.3" / "config.json", intermediate_size=11008, vocab_size=32000,
        draft_vocab_size=16000, num_key_value_heads=32, rope_scaling=None, rope_theta=10000.0)
  err = _error(capsys, ["run", cfg, f"checkpoints_dir={root}", "--dry-run"])
  assert "holds an EAGLE-3 head; --drafter eagle1 needs EAGLE-1" in err
  # Vicuna's tokenizer has no chat template of its own
  err = _error(capsys, ["run", cfg, f"checkpoints_dir={ASSETS}", "chat_template=''", "--dry-run"])
  assert "has no chat template" in err and "vicuna" in err
  err = _error(capsys, ["run", cfg, f"checkpoints_dir={ASSETS}", "chat_template=nope", "--dry-run"])
  assert "chat template 'nope'" in err
  err = _error(capsys, ["run", cfg, f"checkpoints_dir={ASSETS}", "eval.max_new_tokens=4096",
                        "--dry-run"])
  assert "2048 positions" in err
  medusa = tmp_path / "medusa.yaml"
  with open(os.path.join(ROOT, "configs", "paper", "gpu", "vicuna7b-medusa.yaml")) as f:
    medusa.write_text(f.read().replace("checkpoint: medusa-vicuna-7b-v1.3",
                                       "checkpoint: EAGLE-Vicuna-7B-v1.3"))
  err = _error(capsys, ["run", str(medusa), f"checkpoints_dir={ASSETS}", "--dry-run"])
  assert "holds a published eagle checkpoint; expected Medusa heads" in err


def test_dry_run_checks_safetensors_headers_without_reading_weights(tmp_path, capsys):
  """With a weights file in place the dry run compares its header's shapes with the config's."""
  target = tmp_path / "target"
  target.mkdir()
  (target / "config.json").write_text(json.dumps(dict(
      model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)))
  head = tmp_path / "head"
  head.mkdir()
  (head / "config.json").write_text(json.dumps(dict(
      model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
      num_attention_heads=2, num_key_value_heads=1)))
  save_file({"fc.weight": np.zeros((16, 30), np.float32), "fc.bias": np.zeros(16, np.float32)},
            str(head / "model.safetensors"))
  cfg = tmp_path / "exp.yaml"
  cfg.write_text(f"# Run: eagle-jax run\nname: x\nmodel: {target}\nchat_template: vicuna\n"
                 f"methods:\n  - {{name: vanilla}}\n  - {{name: eagle1, checkpoint: {head}}}\n"
                 "eval: {num_questions: 8, max_new_tokens: 16}\n")
  err = _error(capsys, ["run", str(cfg), "--dry-run"])
  assert "tensor 'fc.weight' has shape [16, 30], expected [16, 32]" in err
  save_file({"fc.weight": np.zeros((16, 32), np.float32), "fc.bias": np.zeros(16, np.float32)},
            str(head / "model.safetensors"))
  plan = dry_run(str(cfg))
  assert plan["methods"]["eagle1"]["head"].endswith("fc with bias")


def test_published_entries_are_validated(tmp_path):
  cfg = tmp_path / "exp.yaml"
  cfg.write_text("name: x\nmethods:\n  - {name: vanilla}\n  - name: pld\n    published:\n"
                 "      - {temperature: 0.0, tau: 1.7, source: ''}\n")
  with pytest.raises(EagleJaxError, match="source must name where the figure comes from"):
    load_experiment(str(cfg))
  cfg.write_text("name: x\nmethods:\n  - {name: vanilla}\n  - name: pld\n    published:\n"
                 "      - {temperature: 0.0, tau: 1.7, source: a}\n"
                 "      - {temperature: 0.0, tau: 1.8, source: b}\n")
  with pytest.raises(EagleJaxError, match="one entry per temperature"):
    load_experiment(str(cfg))


def _summary(published: bool) -> dict:
  cell = {"speedup": 1.5, "tau": 2.0, "greedy_mismatches": 0, "same_run": True, "per_category": {}}
  eagle = {"drafter": "eagle2", "checkpoint": "x", "T0.0": cell, "T1.0": cell}
  if published:
    eagle["published"] = {"T0.0": {"speedup": 3.62, "tau": 4.98, "source": "EAGLE-2 Table 1"}}
  return {"name": "s", "methods": {"vanilla": {"drafter": "vanilla", "T0.0": {}, "T1.0": {}},
                                   "eagle2": eagle},
          "settings": {"temperatures": [0.0, 1.0], "prompts": "mtbench", "max_new_tokens": 8,
                       "batch_size": 1}}


def test_tables_show_paper_columns_only_where_figures_are_given():
  plain = render_markdown([_summary(False)])
  assert "Paper" not in plain and "Paper" not in render_latex([_summary(False)])
  table = render_markdown([_summary(True)])
  head, _, vanilla, eagle = table.splitlines()[:4]
  assert head.endswith("| Paper (T=0.0) | Notes |") and "Paper (T=1.0)" not in head
  assert "| 3.62x / 4.98 |" in eagle and vanilla.endswith("| - |  |")
  assert "from EAGLE-2 Table 1." in table
  assert r"3.62$\times$ / 4.98" in render_latex([_summary(True)])


def test_vicuna_conversation_format():
  """FastChat's vicuna_v1.1 format, as the EAGLE, Medusa and Spec-Bench evaluations build it."""
  tok = Tokenizer.from_folder(resolve(DEFAULT_MODEL))
  tok.use_chat_template("vicuna")
  system = ("A chat between a curious user and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the user's questions.")
  bos = tok.hf.bos_token or ""
  text = tok.hf.apply_chat_template(
      [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
       {"role": "user", "content": "Why?"}], add_generation_prompt=True, tokenize=False)
  assert text == f"{bos}{system} USER: Hi ASSISTANT: Hello.</s>USER: Why? ASSISTANT:"
  assert tok.chat_prompt("Hi") == tok.encode(f"{bos}{system} USER: Hi ASSISTANT:")
