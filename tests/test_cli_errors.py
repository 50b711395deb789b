"""User errors: one line on stderr naming the problem, exit code 2, no traceback."""

import json
import os

import numpy as np
import pytest

from eagle_jax import cli
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.registry import REGISTRY


def _run_error(capsys, argv):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith("eagle-jax: error: "), err
  assert "Traceback" not in err
  return err


def test_unknown_model_name(capsys):
  err = _run_error(capsys, ["generate", "--model", "no-such-model", "hi"])
  assert "unknown model 'no-such-model'" in err and "smollm2-135m-instruct" in err


def test_missing_gguf_file(capsys, tmp_path):
  err = _run_error(capsys, ["generate", "--model", str(tmp_path / "nope.gguf"), "hi"])
  assert "GGUF file not found" in err


def test_folder_without_config(capsys, tmp_path):
  err = _run_error(capsys, ["generate", "--model", str(tmp_path), "hi"])
  assert "no config.json" in err


def _hf_folder(tmp_path, **cfg):
  folder = tmp_path / "ckpt"
  folder.mkdir()
  base = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=2)
  (folder / "config.json").write_text(json.dumps({**base, **cfg}))
  return folder


def test_unsupported_architecture_in_config(capsys, tmp_path):
  folder = _hf_folder(tmp_path, model_type="gpt2")
  err = _run_error(capsys, ["generate", "--model", str(folder), "hi"])
  assert "unsupported model_type 'gpt2'" in err


def test_missing_config_key(capsys, tmp_path):
  folder = _hf_folder(tmp_path)
  cfg = json.loads((folder / "config.json").read_text())
  del cfg["hidden_size"]
  (folder / "config.json").write_text(json.dumps(cfg))
  assert "missing required key 'hidden_size'" in _run_error(capsys, ["generate", "--model", str(folder), "hi"])


def test_corrupt_safetensors(capsys, tmp_path):
  folder = _hf_folder(tmp_path)
  (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
  err = _run_error(capsys, ["generate", "--model", str(folder), "hi"])
  assert "corrupt safetensors file" in err and "model.safetensors" in err


def test_pickle_weights_are_refused(capsys, tmp_path):
  folder = _hf_folder(tmp_path)
  (folder / "pytorch_model.bin").write_bytes(b"pickle")
  assert "pickle .bin weights are not loaded" in _run_error(capsys, ["generate", "--model", str(folder), "hi"])


def test_missing_weight(capsys, tmp_path):
  from safetensors.numpy import save_file

  folder = _hf_folder(tmp_path)
  save_file({"model.embed_tokens.weight": np.zeros((32, 16), np.float32)}, str(folder / "model.safetensors"))
  err = _run_error(capsys, ["generate", "--model", str(folder), "hi"])
  assert "weight 'model.layers.0.input_layernorm.weight' missing" in err


def test_truncated_gguf(capsys, tmp_path):
  src = REGISTRY["smollm2-135m-instruct"].locate()
  bad = tmp_path / "truncated.gguf"
  with open(src, "rb") as f:
    bad.write_bytes(f.read(2_000_000))
  err = _run_error(capsys, ["generate", "--model", str(bad), "hi"])
  assert "truncated.gguf" in err and "not a readable GGUF file" in err


def test_unsupported_gguf_architecture(capsys, tmp_path):
  import gguf

  path = tmp_path / "other.gguf"
  w = gguf.GGUFWriter(str(path), "gpt2")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  assert "unsupported GGUF architecture 'gpt2'" in _run_error(capsys, ["generate", "--model", str(path), "hi"])


@pytest.mark.parametrize("argv, expected", [
    (["--drafter", "pld", "--self-draft-layers", "3"], "--self-draft-layers: not used by --drafter pld"),
    (["--gamma", "3"], "--gamma: not used by --drafter vanilla"),
    (["--drafter", "self-draft", "--drafter-ckpt", "/x", "--head-bits", "8"],
     "--drafter-ckpt, --head-bits: not used by --drafter self-draft"),
    (["--drafter", "eagle1", "--total-tokens", "9"], "--total-tokens: not used by --drafter eagle1"),
    (["--drafter", "eagle3", "--draft-vocab", "4096"], "--draft-vocab: not used by --drafter eagle3"),
    (["--drafter", "eagle2", "--gamma", "3"], "--gamma: --drafter eagle2 drafts a dynamic tree"),
    (["--drafter", "eagle2", "--tree", "default", "--total-tokens", "5", "--depth", "3"],
     "--total-tokens, --depth: not used with --tree default"),
    (["--drafter", "medusa", "--gamma", "2", "--total-tokens", "5"], "--total-tokens: not used with --gamma"),
    (["--drafter", "medusa", "--gamma", "-1"], "--gamma must be >= 0, got -1"),
    (["--drafter", "eagle2", "--total-tokens", "-2"], "--total-tokens must be >= 0, got -2"),
    (["--drafter", "eagle2", "--draft-vocab", "-7"], "--draft-vocab must be >= 0 (or -1"),
    (["--drafter", "eagle1", "--gamma", "3", "--tree", "default"], "--tree default: not used with --gamma"),
    (["--drafter", "medusa", "--gamma", "2", "--tree", "default"], "--tree default: not used with --gamma"),
    (["--drafter", "eagle1", "--drafter-ckpt", "/x", "--runs-dir", "r"],
     "--runs-dir: not used with --drafter-ckpt"),
])
def test_drafter_options_the_drafter_would_ignore_are_refused(capsys, argv, expected):
  assert expected in _run_error(capsys, ["generate", *argv, "hi"])


def test_drafter_options_refuse_negative_bits_from_python():
  from eagle_jax.drafters.registry import KINDS

  for kind in ("eagle1", "eagle2", "eagle3", "medusa", "draft-model"):
    with pytest.raises(EagleJaxError, match="--head-bits must be >= 0 \\(or -1"):
      KINDS[kind].options(head_bits=-3)


def test_draft_size_timing_needs_a_positive_gamma(tiny):
  from eagle_jax.drafters.draft_model.train import time_draft_sizes

  with pytest.raises(EagleJaxError, match="--gamma must be >= 1"):
    time_draft_sizes(tiny(), {}, gamma=0)


@pytest.mark.slow
def test_empty_prompt(capsys):
  assert "empty prompt" in _run_error(capsys, ["generate", "   "])


@pytest.mark.slow
def test_prompt_longer_than_cache(capsys):
  err = _run_error(capsys, ["generate", "--max-cache-len", "64", "--max-new-tokens", "32",
                            "Tell me about the history of the Roman Empire in detail."])
  assert "cache length 64" in err


@pytest.mark.parametrize("cfg, expected", [
    (dict(hidden_size=None), "invalid value"),
    (dict(hidden_size="wide"), "invalid value"),
    (dict(num_attention_heads=0), "num_attention_heads must be a positive integer"),
    (dict(rope_scaling="linear"), "rope_scaling must be an object"),
])
def test_bad_config_values(capsys, tmp_path, cfg, expected):
  folder = _hf_folder(tmp_path, **cfg)
  assert expected in _run_error(capsys, ["generate", "--model", str(folder), "hi"])


def test_config_json_not_an_object(capsys, tmp_path):
  folder = _hf_folder(tmp_path)
  (folder / "config.json").write_text("[1, 2]")
  assert "expected a JSON object" in _run_error(capsys, ["generate", "--model", str(folder), "hi"])


@pytest.mark.parametrize("override, expected", [
    ("loop.log_every=0", "loop.log_every must be >= 1"),
    ("loop.eval_rows=-1", "loop.eval_rows must be >= 0"),
    ("features.batch_rows=0", "features.batch_rows and features.rows_per_shard must be >= 1"),
    ("features.rows_per_shard=0", "features.batch_rows and features.rows_per_shard must be >= 1"),
    ("features.layers=[-1]", "features.layers are Hugging Face hidden_states indices"),
    ("eagle.ttt_steps=0", "eagle.ttt_steps and eagle.eval_steps must be >= 1"),
    ("data.train_rows=-5", "data.train_rows, data.heldout_rows >= 0"),
])
def test_train_config_values_fail_before_any_work(capsys, tmp_path, override, expected):
  config = tmp_path / "c.yaml"
  config.write_text(f"name: x\ndrafter: eagle3\nruns_dir: {tmp_path / 'runs'}\n")
  err = _run_error(capsys, ["train", str(config), override])
  assert expected in err and str(config) in err
  assert not (tmp_path / "runs").exists()  # nothing started


def test_medusa_tuning_needs_heldout_batches(capsys, tmp_path):
  config = tmp_path / "m.yaml"
  config.write_text(f"name: m\ndrafter: medusa\nruns_dir: {tmp_path}\ndata: {{heldout_rows: 2}}\n")
  assert "held-out rank accuracies" in _run_error(capsys, ["train", str(config)])


@pytest.mark.parametrize("argv, expected", [
    (["tune", "x", "--top-ks", "4,a"], "argument --top-ks: expected comma-separated integers"),
    (["bench", "draft-sizes", "--shapes", "L4"], "argument --shapes: expected L<layers>-d<width>"),
])
def test_list_arguments_are_parsed_by_argparse(capsys, argv, expected):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2 and expected in capsys.readouterr().err


def test_converted_gguf_is_redone_when_the_file_changes(tmp_path, monkeypatch):
  import os

  from eagle_jax.model import registry
  from eagle_jax.model.gguf import source_marker

  monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "cache"))
  gguf_file = tmp_path / "m.gguf"
  gguf_file.write_bytes(b"x" * 64)
  calls = []

  def fake_convert(path, out):
    calls.append(path)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "source.json"), "w") as f:
      json.dump(source_marker(path), f)
    return out

  monkeypatch.setattr(registry, "convert_gguf", fake_convert)
  out = registry._converted_folder(str(gguf_file), "m")
  assert registry._converted_folder(str(gguf_file), "m") == out and len(calls) == 1  # reused
  gguf_file.write_bytes(b"y" * 64)  # replaced by a file of the same size
  os.utime(gguf_file, ns=(1, 1))
  registry._converted_folder(str(gguf_file), "m")
  assert len(calls) == 2
  with open(os.path.join(out, "source.json"), "w") as f:
    f.write("{torn")
  registry._converted_folder(str(gguf_file), "m")  # an unreadable marker: converted again
  assert len(calls) == 3


def _tiny_llama_folder(tmp_path, extra_tensors=(), **config):
  from flax import nnx

  from eagle_jax.model.checkpoints import save_hf_folder
  from eagle_jax.model.config import tiny_config
  from eagle_jax.model.transformer import Transformer

  folder = str(tmp_path / "tiny")
  save_hf_folder(Transformer(tiny_config(**config), rngs=nnx.Rngs(0)), folder)
  if extra_tensors:
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors.update({n: np.zeros(4, np.float32) for n in extra_tensors})
    save_file(tensors, path)
  return folder


def test_checkpoint_tensors_without_a_place_are_refused(tmp_path):
  from eagle_jax.model.checkpoints import load_hf_folder
  from eagle_jax.errors import EagleJaxError

  load_hf_folder(_tiny_llama_folder(tmp_path))  # every tensor used
  folder = _tiny_llama_folder(tmp_path / "b", ["model.layers.0.self_attn.o_proj.bias"])
  with pytest.raises(EagleJaxError, match="1 checkpoint tensor.*'model.layers.0.self_attn.o_proj.bias'"):
    load_hf_folder(folder)
  ok = _tiny_llama_folder(tmp_path / "c", ["model.layers.0.self_attn.rotary_emb.inv_freq"])
  load_hf_folder(ok)  # a RoPE buffer some checkpoints carry is not a weight


def test_generation_config_eos_ids_stop_generation_too(tmp_path):
  from eagle_jax.model.checkpoints import read_config

  folder = _tiny_llama_folder(tmp_path)
  (tmp_path / "tiny" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9]}))
  assert set(read_config(folder).eos_token_ids) == {1, 9}


@pytest.mark.parametrize("model_type, extra, expected", [
    ("mistral", dict(sliding_window=64), 64),
    ("mistral", dict(sliding_window=None), 512),
    ("qwen2", dict(sliding_window=64, use_sliding_window=False), 512),
    ("qwen2", dict(sliding_window=64, use_sliding_window=True), 64),
])
def test_sliding_window_caps_the_cache(model_type, extra, expected):
  from eagle_jax.model.config import ModelConfig

  base = dict(model_type=model_type, vocab_size=32, hidden_size=16, intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=512)
  assert ModelConfig.from_hf_dict({**base, **extra}).max_position_embeddings == expected


def test_gguf_rope_scaling_metadata(tmp_path):
  import gguf

  from eagle_jax.errors import EagleJaxError
  from eagle_jax.model.gguf import _config_from_gguf

  def config_of(scaling, factor=4.0):
    path = str(tmp_path / f"{scaling}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_string("llama.rope.scaling.type", scaling)
    w.add_float32("llama.rope.scaling.factor", factor)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _config_from_gguf(gguf.GGUFReader(path), path)

  rope = config_of("linear").rope_scaling
  assert (rope.rope_type, rope.factor) == ("linear", 4.0)
  assert config_of("none").rope_scaling.rope_type == "default"
  with pytest.raises(EagleJaxError, match="unsupported GGUF rope scaling 'yarn'"):
    config_of("yarn")


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--mesh", "fsdp=2,tensor=4", "hi"], "spans 8 devices, but JAX sees 1"),
    (["generate", "--mesh", "pipeline=2", "hi"], "mesh axis 'pipeline' unknown"),
    (["train", "configs/train/eagle3-demo.yaml", "mesh.data=0"], "mesh axis data=0"),
    (["run", "configs/quickstart.yaml", "--mesh", "data=2"], "spans 2 devices"),
    (["lower", "--platforms", "cuda,metal"], "--platforms cuda,metal"),
])
def test_bad_meshes_and_platforms(capsys, argv, expected):
  assert expected in _run_error(capsys, argv)
