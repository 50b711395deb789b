"""bfloat16 / float16 Hugging Face checkpoints: loaded in their own dtype (or the one asked for),
tensor by tensor, without a float32 copy of the model in host memory."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from eagle_jax import cli
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.checkpoints import (load_hf_folder, read_safetensors, save_hf_folder,
                                         write_safetensors)
from eagle_jax.model.config import tiny_config
from eagle_jax.model.transformer import Transformer

LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
# bfloat16 keeps 8 significand bits: one rounding step is 2**-8 (0.4%) of a value. Our model and
# transformers' both compute in bfloat16 but round activations at different points (op order,
# fused vs separate matmuls, accumulation), so their logits differ by a few steps of the
# logits' own size (~1 here: measured 0.004). 0.02 absolute + 2% relative is ~5 steps.
BF16_ATOL = BF16_RTOL = 0.02


def _dtypes(model: Transformer) -> set[str]:
  return {str(p.dtype) for p in jax.tree.leaves(nnx.state(model, nnx.Param))}


def _logits(model: Transformer, ids: np.ndarray) -> np.ndarray:
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return np.asarray(model(jnp.asarray(ids), pos).logits_BxTxV, np.float32)


def test_bf16_checkpoint_loads_in_bf16_or_float32_and_matches_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
  with torch.no_grad():  # non-trivial norms, so loading mistakes show
    for name, p in hf.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  hf = hf.to(torch.bfloat16)
  folder = str(tmp_path / "bf16")
  hf.save_pretrained(folder, max_shard_size="300KB")  # sharded: the index is followed too
  assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))

  _, ours16 = load_hf_folder(folder)  # the checkpoint's own dtype
  _, ours32 = load_hf_folder(folder, param_dtype=jnp.float32)
  assert _dtypes(ours16) == {"bfloat16"} and _dtypes(ours32) == {"float32"}

  ids = np.random.default_rng(0).integers(3, LLAMA["vocab_size"], (2, 40))
  with torch.no_grad():
    ref16 = hf(torch.tensor(ids)).logits.float().numpy()
    ref32 = hf.float()(torch.tensor(ids)).logits.numpy()  # the same bf16-rounded weights
  np.testing.assert_allclose(_logits(ours32, ids), ref32, atol=1e-4, rtol=1e-4)
  out16 = _logits(ours16, ids)
  np.testing.assert_allclose(out16, ref16, atol=BF16_ATOL, rtol=BF16_RTOL)
  # greedy picks agree but for near-ties: where they differ, our pick is within the tolerance
  # of transformers' best logit (random weights give logits close together)
  mine, theirs = out16.argmax(-1), ref16.argmax(-1)
  assert (mine == theirs).mean() >= 0.9
  gap = ref16.max(-1) - np.take_along_axis(ref16, mine[..., None], -1)[..., 0]
  assert (gap <= BF16_ATOL + BF16_RTOL * np.abs(ref16).max(-1)).all()


def test_bf16_and_f16_round_trip_and_dtype_choice(tmp_path):
  model = Transformer(tiny_config(), rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
  folder = save_hf_folder(model, str(tmp_path / "bf16"))
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f:
    assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"  # standard safetensors
  _, loaded = load_hf_folder(folder)
  assert _dtypes(loaded) == {"bfloat16"}
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(loaded, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, as16 = load_hf_folder(folder, param_dtype=jnp.float16)  # converted as read
  assert _dtypes(as16) == {"float16"}
  np.testing.assert_array_equal(np.asarray(as16.layers[0].attn.qkv.weight[...]),
                                np.asarray(model.layers[0].attn.qkv.weight[...]).astype(np.float16))

  # mixed dtypes (a float32 RoPE buffer beside float16 weights): the embedding's dtype
  path = os.path.join(folder, "model.safetensors")
  tensors = {k: v.astype(np.float16) for k, v in read_safetensors(folder).items()}
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  write_safetensors(tensors, path)
  assert _dtypes(load_hf_folder(folder)[1]) == {"float16"}
  # a float32 checkpoint still loads as float32 (and in bfloat16 when asked)
  f32 = save_hf_folder(Transformer(tiny_config(), rngs=nnx.Rngs(1)), str(tmp_path / "f32"))
  assert _dtypes(load_hf_folder(f32)[1]) == {"float32"}
  assert _dtypes(load_hf_folder(f32, jnp.bfloat16)[1]) == {"bfloat16"}
  with pytest.raises(EagleJaxError, match="parameter dtype .* not supported"):
    load_hf_folder(f32, jnp.int8)


def test_bad_bf16_tensors_are_one_line_errors(tmp_path):
  folder = save_hf_folder(Transformer(tiny_config(), rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16),
                          str(tmp_path / "m"))
  path = os.path.join(folder, "model.safetensors")
  good = read_safetensors(folder)
  key = "model.layers.1.self_attn.k_proj.weight"  # one part of the fused q/k/v weight
  write_safetensors({**good, key: np.zeros((24, 64), ml_dtypes.bfloat16)}, path)
  with pytest.raises(EagleJaxError) as e:
    load_hf_folder(folder)
  assert str(e.value) == f"weight {key} has shape (24, 64), expected (32, 64) from config.json"

  write_safetensors({k: v for k, v in good.items() if k != key}, path)
  with pytest.raises(EagleJaxError, match=f"weight '{key}' missing") as e:
    load_hf_folder(folder)
  assert "\n" not in str(e.value)

  extra = "model.layers.0.mlp.down_proj.bias"
  write_safetensors({**good, extra: np.zeros(64, ml_dtypes.bfloat16)}, path)
  with pytest.raises(EagleJaxError, match=f"1 checkpoint tensor.*'{extra}'"):
    load_hf_folder(folder)

  write_safetensors(good, path)
  with open(path, "r+b") as f:  # cut off inside the last tensor's data
    f.truncate(os.path.getsize(path) - 10)
  with pytest.raises(EagleJaxError, match="corrupt safetensors file") as e:
    load_hf_folder(folder)
  assert "\n" not in str(e.value)


_MEASURE = textwrap.dedent("""
    import json, resource, sys
    import jax.numpy as jnp
    jnp.ones(4).block_until_ready()  # the baseline includes jax and its CPU client
    from eagle_jax.model.checkpoints import load_hf_folder
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config, model = load_hf_folder(sys.argv[1])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"increase": (after - before) * 1024, "dtype": str(model.embed.dtype)}))
""")


def test_bf16_load_peak_host_memory(tmp_path):
  """A ~100 MB bfloat16 checkpoint raises a fresh process's peak RSS by well under 1.5x its
  size: the model itself (1x) plus one tensor being read. A float32 copy of the weights would
  alone be 2x, and the old loader (every tensor read first, then converted) peaked at ~3.5x."""
  h, layers, vocab, inter, heads, kv_heads = 1024, 6, 16000, 1024, 16, 4
  hd = h // heads
  config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab,
                hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=True, torch_dtype="bfloat16")
  rng = np.random.default_rng(0)
  w = lambda *shape: (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
  tensors = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": w(h)}
  for i in range(layers):
    p = f"model.layers.{i}."
    tensors.update({
        p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h),
        p + "self_attn.q_proj.weight": w(heads * hd, h),
        p + "self_attn.k_proj.weight": w(kv_heads * hd, h),
        p + "self_attn.v_proj.weight": w(kv_heads * hd, h),
        p + "self_attn.o_proj.weight": w(h, heads * hd),
        p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
        p + "mlp.down_proj.weight": w(h, inter)})
  folder = tmp_path / "big"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(config))
  write_safetensors(tensors, str(folder / "model.safetensors"))
  del tensors
  size = os.path.getsize(folder / "model.safetensors")
  assert 60e6 < size < 120e6

  run = subprocess.run([sys.executable, "-c", _MEASURE, str(folder)], capture_output=True,
                       text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  assert result["dtype"] == "bfloat16"
  assert result["increase"] < 1.5 * size, f"peak RSS rose {result['increase'] / size:.2f}x the file"


def test_cli_generate_in_bfloat16_is_lossless_against_bfloat16_vanilla(capsys):
  runs = {}
  for drafter in ("vanilla", "pld"):
    assert cli.main(["generate", "--dtype", "bfloat16", "--drafter", drafter, "--max-new-tokens",
                     "32", "--json", "List three uses of a paperclip, then repeat the list."]) == 0
    runs[drafter] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert {r["dtype"] for r in runs.values()} == {"bfloat16"}
  assert runs["pld"]["token_ids"] == runs["vanilla"]["token_ids"]
  assert len(runs["vanilla"]["token_ids"]) > 0
