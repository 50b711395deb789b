"""``eagle-jax train`` end to end on the real default model (tiny budget), then decoding with it."""

import json
import types

import pytest

from eagle_jax.cli import main

CONFIG = """
name: {name}
drafter: {drafter}
runs_dir: {runs}
data: {{train_rows: 8, heldout_rows: 4, row_len: 128, max_len: 128}}
features: {{rows_per_shard: 4, batch_rows: 4}}
loop: {{epochs: 1, batch_rows: 2, log_every: 1, eval_every: 0, eval_rows: 4, ckpt_every: 2}}
tune: {{enabled: {tune}, prompts: 1, max_new_tokens: 8, top_ks: [2], depths: [2], max_nodes: 7,
       draft_vocabs: [4096]}}
eagle: {{ttt_steps: {ttt}, draft_vocab: {vocab}}}
decode_eval: {{prompts: 1, max_new_tokens: 8, top_k: 3, depth: 2, total_tokens: 4}}
# no warmup: the 4 steps move the heads far enough that their drafts are accepted at times
optim: {{lr: 1.0e-3, warmup_steps: 0}}
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  runs = tmp_path_factory.mktemp("runs")
  out = {}
  for drafter, tune, ttt, vocab in [("eagle1", "true", 1, 0), ("eagle3", "false", 2, 4096),
                                    ("medusa", "true", 1, 0), ("draft-model", "false", 1, 0)]:
    path = runs / f"{drafter}.yaml"
    path.write_text(CONFIG.format(name=f"tiny-{drafter}", drafter=drafter, runs=runs, tune=tune,
                                  ttt=ttt, vocab=vocab))
    assert main(["train", str(path)]) == 0
    out[drafter] = path
  return runs, out


def _generate(capsys, *flags):
  capsys.readouterr()
  assert main(["generate", "--json", "--max-new-tokens", "24", *flags,
               "Name three colors and one fruit."]) == 0
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_train_then_generate_with_every_eagle_drafter(trained, capsys):
  runs, configs = trained
  summary = json.loads((runs / "tiny-eagle1" / "summary.json").read_text())
  assert summary["steps"] == 4 and summary["feature_rows"] == 8
  # a head that drafts nothing the target takes (untrained, or not drafting) gives exactly 1
  # and top-1 0; after its 4 steps the head's drafts are accepted, decoding held-out prompts
  # and on the held-out rows
  assert summary["heldout_tau"] > 1.0 and summary["heldout_tau_proxy"] > 1.0, summary
  assert summary["heldout_acc_0"] > 0.0, summary
  assert summary["budget"]["depth"] == 2 and 1 <= summary["budget"]["total_tokens"] <= 7
  drafter = json.loads((runs / "tiny-eagle1" / "final" / "drafter.json").read_text())
  assert drafter["budget"]["total_tokens"] == summary["budget"]["total_tokens"]
  assert drafter["budget"]["draft_vocab"] in (0, 4096)  # the tuner tried both vocabularies
  budget = json.loads((runs / "tiny-eagle1" / "final" / "budget.json").read_text())
  assert "top_k=2,depth=2,draft_vocab=4096" in budget["by_setting"]
  for run in ("tiny-eagle1", "tiny-eagle3"):
    assert (runs / run / "final" / "token_counts.npy").is_file()
  vanilla = _generate(capsys)
  for name in ("eagle1", "eagle2", "eagle3"):
    got = _generate(capsys, "--drafter", name, "--runs-dir", str(runs))
    assert got["token_ids"] == vanilla["token_ids"], name
    _assert_tau_counts_passes(got)
    assert got["tau"] > 1.0, (name, got["tau"])  # the trained heads' drafts are accepted
  # explicit checkpoint, tree and draft vocabulary; then the whole vocabulary over the tuned run
  explicit = _generate(capsys, "--drafter", "eagle2", "--drafter-ckpt", str(runs / "tiny-eagle1"),
                       "--total-tokens", "5", "--depth", "2", "--top-k-tree", "3", "--draft-vocab", "4096")
  assert explicit["token_ids"] == vanilla["token_ids"] and explicit["tau"] > 1.0, explicit["tau"]
  whole = _generate(capsys, "--drafter", "eagle2", "--draft-vocab", "0", "--runs-dir", str(runs))
  assert whole["token_ids"] == vanilla["token_ids"] and whole["tau"] > 1.0, whole["tau"]


def _assert_tau_counts_passes(got):
  """tau is the tokens after the first (from the prompt pass) per target verify pass."""
  assert got["tau"] == round((got["new_tokens"] - 1) / got["target_passes"], 4), got


def test_train_then_generate_with_medusa_and_draft_model(trained, capsys):
  runs, _ = trained
  medusa = json.loads((runs / "tiny-medusa" / "final" / "drafter.json").read_text())
  assert len(medusa["rank_acc"]) == 4 and len(medusa["rank_acc"][0]) == 10
  assert 1 <= medusa["budget"]["total_tokens"] == len(medusa["budget"]["tree"]) <= 7
  assert (runs / "tiny-draft-model" / "final" / "config.json").is_file()  # a Hugging Face folder
  vanilla = _generate(capsys)
  for flags in (["--drafter", "medusa"], ["--drafter", "medusa", "--tree", "default"],
                ["--drafter", "medusa", "--total-tokens", "5"], ["--drafter", "draft-model"],
                ["--drafter", "draft-model", "--drafter-ckpt", str(runs / "tiny-draft-model")],  # a run folder
                ["--drafter", "draft-model", "--gamma", "2", "--drafter-ckpt",
                 str(runs / "tiny-draft-model" / "final")]):
    where = [] if "--drafter-ckpt" in flags else ["--runs-dir", str(runs)]
    got = _generate(capsys, *flags, *where)
    assert got["token_ids"] == vanilla["token_ids"], flags
    _assert_tau_counts_passes(got)
    if flags[1] == "medusa":  # some of the heads' drafts are accepted
      assert got["tau"] > 1.0, (flags, got["tau"])
    else:  # 4 steps leave the draft model's drafts unaccepted here, but it does draft
      assert got["n_alpha"] and got["n_alpha"][0] is not None, (flags, got["n_alpha"])


def test_tune_command_rewrites_the_budget_of_a_run(trained, capsys):
  runs, _ = trained
  capsys.readouterr()
  assert main(["tune", str(runs / "tiny-eagle3"), "--prompts", "1", "--top-ks", "2",
               "--depths", "2", "--max-nodes", "5", "--max-new-tokens", "8"]) == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert (result["top_k"], result["depth"]) == (2, 2) and 1 <= result["total_tokens"] <= 5
  meta = json.loads((runs / "tiny-eagle3" / "final" / "drafter.json").read_text())
  assert meta["budget"]["total_tokens"] == result["total_tokens"]
  assert (runs / "tiny-eagle3" / "final" / "budget.json").is_file()
  assert not (runs / "tiny-eagle3" / "drafter.json").exists()


def test_tune_command_retunes_a_medusa_tree(trained, capsys):
  runs, _ = trained
  capsys.readouterr()
  assert main(["tune", str(runs / "tiny-medusa"), "--max-nodes", "3"]) == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  meta = json.loads((runs / "tiny-medusa" / "final" / "drafter.json").read_text())
  assert 1 <= result["total_tokens"] == meta["budget"]["total_tokens"] == len(meta["budget"]["tree"]) <= 3


def test_rerun_reuses_finished_run_and_features(trained, capsys):
  runs, configs = trained
  capsys.readouterr()
  assert main(["train", str(configs["eagle3"])]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["resumed_from"] == 4 and summary["features_seconds"] < 5
  assert "heldout_loss" in summary  # a finished run re-run still reports its evaluation


def test_train_errors_are_one_line(trained, tmp_path, capsys, monkeypatch):
  runs, configs = trained
  bad = tmp_path / "bad.yaml"
  bad.write_text("name: x\ndrafter: eagle1\noptim: {lrr: 1}\n")
  capsys.readouterr()
  assert main(["train", str(bad)]) == 2
  err = capsys.readouterr().err.strip()
  assert "unknown key 'optim.lrr'" in err and len(err.splitlines()) == 1
  assert main(["train", str(tmp_path / "missing.yaml")]) == 2
  assert "missing.yaml" in capsys.readouterr().err
  assert main(["train", str(configs["eagle1"]), "data.max_len=256"]) == 2  # > row_len
  assert "max_len" in capsys.readouterr().err
  assert main(["generate", "--drafter", "eagle3", "--drafter-ckpt", str(runs / "tiny-eagle1"), "hi"]) == 2
  assert "EAGLE-1 head" in capsys.readouterr().err
  monkeypatch.setenv("EAGLE_JAX_PRETRAINED", "")  # no shipped drafter to fall back on
  assert main(["generate", "--drafter", "eagle1", "--runs-dir", str(tmp_path), "hi"]) == 2
  assert "no trained eagle1 drafter" in capsys.readouterr().err
  monkeypatch.delenv("EAGLE_JAX_PRETRAINED")
  assert main(["generate", "--drafter", "medusa", "--drafter-ckpt", str(runs / "tiny-eagle1"), "hi"]) == 2
  assert "holds a 'eagle1' drafter" in capsys.readouterr().err
  assert main(["generate", "--drafter", "eagle3", "--draft-vocab", "4096", "--runs-dir", str(runs), "hi"]) == 2
  assert "--draft-vocab: not used by --drafter eagle3" in capsys.readouterr().err


def _published_shapes(folder, name):
  from safetensors.numpy import load_file

  return {k: list(v.shape) for k, v in load_file(str(folder / name)).items()}


def test_published_exports_decode_as_the_native_heads(trained, tmp_path, capsys):
  """export -> a published folder -> --drafter-ckpt gives the native head's greedy tokens and
  tau (same budget flags on both sides: a published folder carries no tuned budget)."""
  torch = pytest.importorskip("torch")
  from safetensors.torch import load_file

  runs, _ = trained
  h, q, kv, f, v = 576, 9 * 64, 3 * 64, 1536, 49152  # the default target's sizes
  cases = {"eagle1": ("eagle", ["--drafter", "eagle2", "--total-tokens", "5", "--depth", "2",
                                "--top-k-tree", "3", "--draft-vocab", "0", "--head-bits", "0"]),
           "eagle3": ("eagle3", ["--drafter", "eagle3", "--total-tokens", "5", "--depth", "2",
                                 "--top-k-tree", "3", "--head-bits", "0"]),
           "medusa": ("medusa", ["--drafter", "medusa", "--tree", "default", "--head-bits", "0"])}
  for kind, (fmt, flags) in cases.items():
    out = tmp_path / fmt
    capsys.readouterr()
    assert main(["export", str(runs / f"tiny-{kind}"), str(out), "--format", fmt]) == 0
    native = _generate(capsys, *flags, "--drafter-ckpt", str(runs / f"tiny-{kind}"))
    published = _generate(capsys, *flags, "--drafter-ckpt", str(out))
    assert published["token_ids"] == native["token_ids"], kind
    assert published["tau"] == native["tau"] and native["tau"] > 1.0, (kind, native["tau"])
  p = "midlayer."
  assert _published_shapes(tmp_path / "eagle3", "model.safetensors") == {
      "fc.weight": [h, 3 * h], **{p + f"self_attn.{n}_proj.weight": [w, 2 * h]
                                  for n, w in (("q", q), ("k", kv), ("v", kv))},
      p + "self_attn.o_proj.weight": [h, q], p + "mlp.gate_proj.weight": [f, h],
      p + "mlp.up_proj.weight": [f, h], p + "mlp.down_proj.weight": [h, f],
      **{p + f"{n}.weight": [h] for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")},
      "norm.weight": [h], "lm_head.weight": [4096, h], "d2t": [4096], "t2d": [v]}
  p = "layers.0."
  assert _published_shapes(tmp_path / "eagle", "model.safetensors") == {
      "fc.weight": [h, 2 * h], "fc.bias": [h],
      **{p + f"self_attn.{n}_proj.weight": [w, h] for n, w in (("q", q), ("k", kv), ("v", kv))},
      p + "self_attn.o_proj.weight": [h, q], p + "mlp.gate_proj.weight": [f, h],
      p + "mlp.up_proj.weight": [f, h], p + "mlp.down_proj.weight": [h, f],
      p + "post_attention_layernorm.weight": [h]}
  assert _published_shapes(tmp_path / "medusa", "medusa_lm_head.safetensors") == {
      **{f"{i}.0.linear.weight": [h, h] for i in range(4)}, **{f"{i}.0.linear.bias": [h] for i in range(4)},
      **{f"{i}.1.weight": [v, h] for i in range(4)}}
  # the same EAGLE-3 folder as a pickled PyTorch file with a copied embedding beside the head
  pickled = tmp_path / "eagle3-bin"
  pickled.mkdir()
  (pickled / "config.json").write_text((tmp_path / "eagle3" / "config.json").read_text())
  state = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
  state["embed_tokens.weight"] = torch.zeros(v, h)
  torch.save(state, pickled / "pytorch_model.bin")
  flags = cases["eagle3"][1]
  assert (_generate(capsys, *flags, "--drafter-ckpt", str(pickled))["token_ids"]
          == _generate(capsys, *flags, "--drafter-ckpt", str(tmp_path / "eagle3"))["token_ids"])
  assert main(["export", str(runs / "tiny-eagle1"), str(tmp_path / "x"), "--format", "eagle3"]) == 2
  assert "holds a eagle1 drafter" in capsys.readouterr().err


def test_bench_spec_rows_name_their_checkpoints(trained):
  from eagle_jax.evaluation.bench_spec import bench_spec

  runs, _ = trained
  out = bench_spec("smollm2-135m-instruct", methods=("vanilla", "pld", "medusa", "draft-model"),
                   num_prompts=2, max_new_tokens=8, runs_dir=str(runs),
                   with_hf=False, repeats=1)
  rows = out["methods"]
  assert rows["pld"]["tree"] == "chain of 3, 8 (cost-aware)"
  assert set(rows["pld"]["steps_by_width"]) == {"0", "3", "8"} and set(rows["pld"]["width_costs"]) == {"3", "8"}
  assert rows["medusa"]["checkpoint"].endswith("tiny-medusa/final")
  assert rows["draft-model"]["checkpoint"].endswith("tiny-draft-model/final")
  assert rows["draft-model"]["tree"] == "chain of 4" and rows["medusa"]["tree"].startswith("static")
  for name in ("pld", "medusa", "draft-model"):
    # tau: the 2 x 7 tokens after each prompt's first over the verify passes, every step
    # counted once under some width (on these two prompts and 8 tokens no drafter's draft is
    # accepted: prompt lookup's acceptance is checked by the runner in test_experiment.py)
    passes = sum(rows[name]["steps_by_width"].values())
    assert rows[name]["greedy_matches_vanilla"] == 2
    assert rows[name]["tau"] == round(2 * 7 / passes, 3), (name, rows[name])
    assert rows[name]["speedup"] > 0 and len(rows[name]["n_alpha"]) >= 1
    assert rows[name]["predicted_speedup"] > 0 and rows[name]["draft_ms"] >= 0
    # drafting for free can only help, and no drafter passes what a perfect free one would reach
    assert rows[name]["predicted_speedup"] <= rows[name]["predicted_speedup_free_draft"]
    assert rows[name]["predicted_speedup_free_draft"] <= out["speedup_ceiling"]["speedup"] + 1e-3
  assert out["speedup_ceiling"]["tokens_per_pass"] in out["verify_cost_ms"]


def test_tune_uses_the_runs_own_target_and_heldout_split(tmp_path, monkeypatch, capsys):
  """Budget tuning decodes held-out prompts: those of the run's split, never its training data."""
  import dataclasses

  import eagle_jax.pipeline.train
  from eagle_jax.drafters import registry

  final = tmp_path / "run" / "final"
  final.mkdir(parents=True)
  (final / "drafter.json").write_text(json.dumps({
      "drafter": "eagle3", "model": "/some/target", "split": {"heldout_fraction": 0.05, "split_seed": 7}}))
  seen = {}
  monkeypatch.setattr(eagle_jax.pipeline.train, "load_model",
                      lambda name: seen.setdefault("model", name) and types.SimpleNamespace(tokenizer=None))
  monkeypatch.setattr(eagle_jax.pipeline.train, "heldout_prompts",
                      lambda tok, count, data: seen.setdefault("data", data) and [[1, 2]])
  kind = registry.KINDS["eagle3"]
  fake = lambda path, lm, tune, prompts, metrics: seen.update(tune=tune, prompts=prompts) or {"top_k": 2}
  monkeypatch.setitem(registry.KINDS, "eagle3", dataclasses.replace(
      kind, trainable=dataclasses.replace(kind.trainable, tune=fake)))
  assert main(["tune", str(tmp_path / "run"), "--top-ks", "2,3"]) == 0
  assert seen["model"] == "/some/target" and seen["prompts"] == [[1, 2]]
  assert (seen["data"].heldout_fraction, seen["data"].split_seed) == (0.05, 7)
  assert seen["tune"].top_ks == (2, 3)
