"""The default GGUF model: Q/K un-permutation, golden logits, live parity with transformers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import cli
from eagle_jax.gguf_convert import unpermute_qk

import gguf_reference as ref

pytestmark = pytest.mark.slow


def _llamacpp_permute(w, n_head):
  """llama.cpp's conversion (convert_hf_to_gguf.py) permutation, written independently."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llamacpp_permutation(heads):
  w = np.random.default_rng(0).standard_normal((heads * 64, 16)).astype(np.float32)
  np.testing.assert_array_equal(unpermute_qk(_llamacpp_permute(w, heads), heads), w)


def _our_logits(smollm, ids):
  ids = jnp.asarray([ids])
  return np.asarray(smollm.model(ids, jnp.arange(ids.shape[1])[None]).logits_BxTxV[0])


def test_golden_logits(smollm):
  """Checked against logits saved from transformers (no torch needed)."""
  golden = np.load(ref.GOLDEN)
  cols = golden["columns"]
  worst = 0.0
  for i in range(len(ref.PROMPTS)):
    ids = golden[f"ids_{i}"].tolist()
    assert ids == smollm.tokenizer.chat_prompt(ref.PROMPTS[i]), "tokenizer/chat template drifted"
    ours = _our_logits(smollm, ids)
    worst = max(worst, float(np.abs(ours[:, cols] - golden[f"logits_{i}"]).max()))
    assert (ours.argmax(-1) == golden[f"argmax_{i}"]).all()
  print(f"\nmax |logit diff| vs golden: {worst:.2e}")
  assert worst <= 1e-3


@pytest.fixture(scope="module")
def hf_gguf():
  pytest.importorskip("torch")
  return ref.load_hf_gguf()


def test_live_logits_match_transformers(smollm, hf_gguf):
  import torch

  worst = 0.0
  for text in ref.PROMPTS + ["Tell me a joke about programmers."]:
    ids = smollm.tokenizer.chat_prompt(text)
    with torch.no_grad():
      theirs = hf_gguf(torch.tensor([ids])).logits[0].numpy()
    ours = _our_logits(smollm, ids)
    worst = max(worst, float(np.abs(ours - theirs).max()))
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
  print(f"\nmax |logit diff| vs transformers (all positions, full vocab): {worst:.2e}")
  assert worst <= 1e-3


def test_cli_greedy_64_tokens_match_transformers(smollm, hf_gguf, capsys):
  import torch

  for text in ref.PROMPTS:
    assert cli.main(["generate", "--max-new-tokens", "64", "--json", text]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = smollm.tokenizer.chat_prompt(text)
    with torch.no_grad():
      out = hf_gguf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=64, do_sample=False, eos_token_id=list(smollm.tokenizer.eos_token_ids))
    assert got["token_ids"] == out[0, len(ids):].tolist()
    assert got["new_tokens"] == len(got["token_ids"]) and got["tokens_per_s"] > 0
    assert got["text"] == smollm.tokenizer.decode(got["token_ids"])
