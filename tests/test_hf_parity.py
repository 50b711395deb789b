"""Our model vs transformers' PyTorch implementation on random checkpoints written by the test."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from eagle_jax.model.checkpoints import load_hf_folder  # noqa: E402
from eagle_jax.decoding.generate import generate  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama_mha_tied": ("LlamaConfig", "LlamaForCausalLM",
                       dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=5e5)),
    "llama3_rope_scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=5e5, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Llama-2 / Vicuna v1.3: multi-head attention, untied head, eps 1e-6, a 2k context
    "llama2_vicuna": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0)),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=4.0))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=False)),
}


def _write_random(tmp_path, variant, shard):
  cfg_cls, model_cls, extra = VARIANTS[variant]
  torch.manual_seed(0)
  cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
  hf = getattr(transformers, model_cls)(cfg).eval()
  with torch.no_grad():  # non-trivial norms and biases, so loading mistakes show
    for name, p in hf.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  folder = tmp_path / variant
  hf.save_pretrained(folder, max_shard_size="300KB" if shard else "1GB")
  return hf, str(folder)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_greedy_match_transformers(tmp_path, variant):
  hf, folder = _write_random(tmp_path, variant, shard=variant == "llama")
  if variant == "llama":
    assert (tmp_path / variant / "model.safetensors.index.json").exists()
  config, model = load_hf_folder(folder)
  assert config.architecture == VARIANTS[variant][0].removesuffix("Config").lower()
  rng = np.random.default_rng(0)
  ids = rng.integers(3, COMMON["vocab_size"], (2, 40))
  with torch.no_grad():
    ref = hf(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(40), (2, 40))).logits_BxTxV)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
  assert (ours.argmax(-1) == ref.argmax(-1)).all()

  prompt = ids[0, :10].tolist()
  hf.generation_config.eos_token_id = None  # both sides ignore EOS: always 64 tokens
  with torch.no_grad():
    hf_out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 10, dtype=torch.long),
                         max_new_tokens=64, do_sample=False)
  gen = generate(model, [prompt], max_new_tokens=64, stop_ids=())
  assert gen.tokens[0] == hf_out[0, 10:].tolist()
