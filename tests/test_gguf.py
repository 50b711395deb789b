"""The default GGUF model: Q/K un-permutation, golden logits, live parity with transformers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax import cli, kernels
from eagle_jax.model.blocks import Blocks
from eagle_jax.model.gguf import _blocks_of, unpermute_qk
from eagle_jax.model.transformer import KVCache, blocks_of

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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_integer_blocks_expand_to_gguf_dequantization(kind):
  import gguf

  x = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32) * 3 + 0.5
  t = gguf.GGMLQuantizationType[kind]
  raw = gguf.quants.quantize(x, t)
  q, scale, offset = _blocks_of(raw, kind)
  assert q.dtype == (np.int8 if kind == "Q8_0" else np.uint8)
  np.testing.assert_array_equal(Blocks(q, scale, offset).dequantize(),
                                gguf.quants.dequantize(raw, t).reshape(x.shape))
  assert _blocks_of(raw, "Q6_K") is None


def test_default_model_keeps_exact_integer_blocks(smollm):
  """Every matrix of the Q4_1 / Q8_0 file keeps its blocks, and they expand to exactly the
  float32 weights (after the Q/K un-permutation)."""
  m = smollm.model
  pairs = [(m.embed[...], blocks_of(m.embed_blocks))]
  for layer in m.layers:
    for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down):
      pairs.append((lin.weight[...], blocks_of(lin.blocks)))
  assert all(b is not None for _, b in pairs)
  assert blocks_of(m.embed_blocks).bits == 8 and blocks_of(m.layers[0].mlp.down.blocks).bits == 4
  for w, b in pairs:
    np.testing.assert_array_equal(b.dequantize(), np.asarray(w))


def test_default_model_decode_step_reads_every_matrix_as_blocks(smollm):
  """One decode step's program calls the block kernel once per matrix (4 per layer and the tied
  head) and reads no float32 weight matrix."""
  cache = KVCache.init(smollm.config, 1, 64)
  step = nnx.jit(lambda m, tok, cache: m(tok, cache.lengths_B[:, None], cache).logits_BxTxV)
  hlo = step.lower(smollm.model, jnp.ones((1, 1), jnp.int32), cache).as_text()
  assert hlo.count("eagle_jax_block_matmul") == 4 * smollm.config.num_layers + 1
  matrices = {f"tensor<{o}x{i}xf32>" for o, i in [(960, 576), (576, 576), (3072, 576), (576, 1536),
                                                  (49152, 576)]}
  products = [l for l in hlo.splitlines() if "dot_general" in l]
  assert not [l for l in products if any(m in l for m in matrices)], products


def test_golden_logits_through_the_block_kernel(smollm):
  """Prompts fed 16 tokens at a time through the cache: every product reads the integer blocks
  (CPU kernel, 1-16 rows), and logits still match transformers' stored ones."""
  assert kernels.available()
  golden = np.load(ref.GOLDEN)
  cols = golden["columns"]

  @nnx.jit
  def chunk(model, ids, pos, cache):
    out = model(ids, pos, cache)
    return out.logits_BxTxV[0], out.cache

  worst = 0.0
  for i in range(len(ref.PROMPTS)):
    ids = golden[f"ids_{i}"]
    cache = KVCache.init(smollm.config, 1, 16 * (len(ids) // 16 + 1))
    logits = []
    for s in range(0, len(ids) - len(ids) % 16, 16):
      lg, cache = chunk(smollm.model, jnp.asarray(ids[None, s:s + 16]), jnp.arange(s, s + 16)[None], cache)
      logits.append(np.asarray(lg))
    ours = np.concatenate(logits)
    n = len(ours)
    worst = max(worst, float(np.abs(ours[:, cols] - golden[f"logits_{i}"][:n]).max()))
    assert (ours.argmax(-1) == golden[f"argmax_{i}"][:n]).all()
  print(f"\nmax |logit diff| vs golden, through the block kernel: {worst:.2e}")
  assert worst <= 1e-3


LIVE_PROMPTS = ref.PROMPTS + ["Tell me a joke about programmers."]


@pytest.fixture(scope="module")
def hf_reference(smollm, tmp_path_factory):
  """Transformers' logits and 64-token greedy continuations for LIVE_PROMPTS, computed in a fresh
  process (``gguf_reference.py --run``), not in this test worker."""
  pytest.importorskip("torch")
  prompts = [smollm.tokenizer.chat_prompt(t) for t in LIVE_PROMPTS]
  request = {"prompts": prompts, "num_greedy": len(ref.PROMPTS), "max_new_tokens": 64,
             "eos_token_ids": list(smollm.tokenizer.eos_token_ids)}
  return prompts, ref.reference_in_subprocess(request, str(tmp_path_factory.mktemp("hf_reference")))


def test_live_logits_match_transformers(smollm, hf_reference):
  prompts, theirs = hf_reference
  golden = np.load(ref.GOLDEN)
  cols = golden["columns"]
  jitted = nnx.jit(lambda model, ids: model(ids, jnp.arange(ids.shape[1])[None]).logits_BxTxV[0])
  report, worst = [], 0.0
  for i, ids in enumerate(prompts):
    ours, hf = _our_logits(smollm, ids), theirs[f"logits_{i}"]
    diff = np.abs(ours - hf)
    pos, col = np.unravel_index(diff.argmax(), diff.shape)
    line = f"prompt {i}: max diff {diff.max():.2e} at position {pos}/{len(ids)}, token {col}"
    if i < len(ref.PROMPTS):  # which side moved: both against the stored transformers logits
      line += (f"; vs golden: ours {np.abs(ours[:, cols] - golden[f'logits_{i}']).max():.2e},"
               f" transformers {np.abs(hf[:, cols] - golden[f'logits_{i}']).max():.2e}")
    line += f"; ours eager vs jit {np.abs(ours - np.asarray(jitted(smollm.model, jnp.asarray([ids])))).max():.2e}"
    report.append(line)
    worst = max(worst, float(diff.max()))
    assert (ours.argmax(-1) == hf.argmax(-1)).all(), line
  print(f"\nmax |logit diff| vs transformers (all positions, full vocab): {worst:.2e}")
  print("\n".join(report))
  assert worst <= 1e-3, "\n".join(report)


def test_cli_greedy_64_tokens_match_transformers(smollm, hf_reference, capsys):
  prompts, theirs = hf_reference
  for i, text in enumerate(ref.PROMPTS):
    assert cli.main(["generate", "--max-new-tokens", "64", "--json", text]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert smollm.tokenizer.chat_prompt(text) == prompts[i]
    assert got["token_ids"] == theirs[f"greedy_{i}"].tolist()
    assert got["new_tokens"] == len(got["token_ids"]) and got["tokens_per_s"] > 0
    assert got["text"] == smollm.tokenizer.decode(got["token_ids"])
