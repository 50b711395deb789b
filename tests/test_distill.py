"""Draft-model distillation: config errors, learning, HF round trip, lossless drafting, sizing."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

import tiny_training
from eagle_jax.model.checkpoints import load_hf_folder, save_hf_folder
from eagle_jax.model.config import tiny_config
from eagle_jax.drafters.draft_model.train import (DistillTask, DraftModelConfig, predicted_speedup,
                               time_draft_sizes)
from eagle_jax.drafters import DraftModelDrafter
from eagle_jax.errors import EagleJaxError
from eagle_jax.training.features import FeatureShards, extract_features
from eagle_jax.decoding.generate import generate
from eagle_jax.model.transformer import Transformer
from eagle_jax.decoding.speculative import speculative_generate
from eagle_jax.training.trainer import LoopConfig, OptimConfig, train

DRAFT = DraftModelConfig(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                         num_kv_heads=1, head_dim=16, embed_init="random", positions_per_row=16,
                         eval_steps=3)
LOOP = LoopConfig(epochs=4, batch_rows=2, seed=0, log_every=5, eval_every=0, eval_rows=4,
                  ckpt_every=1000)


def _target(tied=False, scale=25.0):
  """The tiny random model with a larger LM head: sharper next-token distributions. Untied, its
  argmax is a random function of the context (a tied draft starts by copying its input)."""
  t = Transformer(tiny_config(tie_word_embeddings=tied), rngs=nnx.Rngs(0))
  w = t.embed if tied else t.lm_head.weight
  w[...] = scale * w[...]
  return t


def _heldout_eval(task, module, held):
  """Held-out metrics as train() computes them (mean over batches of ``LOOP.batch_rows``)."""
  sums = {}
  for i in range(0, LOOP.eval_rows, LOOP.batch_rows):
    rows = held.rows(range(i, i + LOOP.batch_rows), task.keys)
    rows["hidden"] = rows["hidden"].astype(np.float32)
    _, m = task.loss(module, task.frozen, rows, jax.random.key(0), False)
    for k, v in m.items():
      sums[k] = sums.get(k, 0.0) + float(v) * LOOP.batch_rows / LOOP.eval_rows
  return sums


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("distill")
  target = _target()
  for name, n, seed in (("train", 64, 0), ("heldout", 8, 1)):
    extract_features(target, tiny_training.encoded(n, seed), str(root / name), tiny_training.SPEC,
                     progress=False)
  data, held = FeatureShards(str(root / "train")), FeatureShards(str(root / "heldout"))
  task = DistillTask.of(target, DRAFT)
  before = _heldout_eval(task, task.init_module(nnx.Rngs(LOOP.seed)), held)
  result = train(task, data, held, str(root / "run"), LOOP, OptimConfig(lr=1e-2, warmup_steps=2),
                 progress=False)
  return dict(root=root, target=target, task=task, held=held, before=before, result=result)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("num_kv_heads", 3), ("head_dim", 15),
                                         ("embed_init", "svd"), ("positions_per_row", -1)])
def test_config_errors_are_one_line(field, value):
  with pytest.raises(EagleJaxError) as e:
    dataclasses.replace(DraftModelConfig(), **{field: value}).validate()
  assert "\n" not in str(e.value) and field in str(e.value)


def test_pca_too_wide_and_model_config():
  target = tiny_config()
  with pytest.raises(EagleJaxError, match="pca"):
    DraftModelConfig(hidden_size=128, head_dim=32).model_config(target)
  c = DRAFT.model_config(target)
  assert c.tie_word_embeddings and c.vocab_size == 128 and c.eos_token_ids == (1,)
  assert (c.rope_theta, c.max_position_embeddings) == (target.rope_theta, 512)


def test_training_improves_heldout(trained):
  before, after = trained["before"], trained["result"].last_eval
  assert after["heldout_ce_0"] < before["ce_0"] - 0.3
  assert after["heldout_acc_0"] > before["acc_0"] + 0.1
  assert after["heldout_tau_proxy"] > before["tau_proxy"] >= 1.0
  assert trained["result"].steps >= 30


def test_pca_init_starts_closer_than_random(tmp_path):
  """Tied target: the PCA embedding is a rank-32 copy of its LM head's token geometry."""
  target = _target(tied=True, scale=8.0)
  extract_features(target, tiny_training.encoded(8, 1), str(tmp_path), tiny_training.SPEC,
                   progress=False)
  ce = {}
  for init in ("pca", "random"):
    task = DistillTask.of(target, dataclasses.replace(DRAFT, embed_init=init))
    ce[init] = _heldout_eval(task, task.init_module(nnx.Rngs(0)), FeatureShards(str(tmp_path)))["ce_0"]
  assert ce["pca"] < ce["random"] - 0.1


def test_hf_round_trip_and_lossless_drafting(trained):
  draft, root, target = trained["result"].module, trained["root"], trained["target"]
  tok = root / "tok"
  tok.mkdir()
  (tok / "tokenizer.json").write_text("{}")
  (tok / "tokenizer_config.json").write_text("{}")
  folder = str(root / "draft_hf")
  save_hf_folder(Transformer(draft.config, rngs=nnx.Rngs(5)), folder)  # replaced below
  assert save_hf_folder(draft, folder, str(tok)) == folder
  assert (root / "draft_hf" / "tokenizer.json").exists()
  assert json.loads((root / "draft_hf" / "config.json").read_text())["tie_word_embeddings"]
  config, loaded = load_hf_folder(folder)
  assert config == draft.config
  tokens = np.arange(2, 22, dtype=np.int32)[None]
  pos = np.arange(20, dtype=np.int32)[None]
  np.testing.assert_array_equal(np.asarray(loaded(tokens, pos).logits_BxTxV),
                                np.asarray(draft(tokens, pos).logits_BxTxV))

  rng = np.random.RandomState(0)
  prompts = [rng.randint(2, 128, size=n).tolist() for n in (5, 9, 3)]
  drafter, dparams = DraftModelDrafter.create(loaded, gamma=3, target_vocab=128)
  ref = generate(target, prompts, max_new_tokens=20, stop_ids=())
  spec = speculative_generate(target, drafter, dparams, prompts, max_new_tokens=20, stop_ids=())
  assert spec.tokens == ref.tokens
  assert spec.tau > 1.0

  # head_bits=8 (DrafterOptions): every float32 matrix and the tied embedding in 8-bit blocks
  from eagle_jax.model.transformer import Linear, quantize_linears
  linears = [l for _, l in nnx.iter_graph(loaded) if isinstance(l, Linear)]
  assert quantize_linears(loaded) == len(linears) + 1 and loaded.embed_blocks is not None
  np.testing.assert_array_equal(np.asarray(loaded.embed[...]), loaded.embed_blocks.get_value().dequantize())
  assert quantize_linears(loaded) == 0
  drafter, dparams = DraftModelDrafter.create(loaded, gamma=3, target_vocab=128)
  spec8 = speculative_generate(target, drafter, dparams, prompts, max_new_tokens=20, stop_ids=())
  assert spec8.tokens == ref.tokens and spec8.tau > 1.0


def test_predicted_speedup_and_timing():
  assert predicted_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
  assert predicted_speedup(1.0, 4, 0.0) == 5.0
  assert predicted_speedup(0.5, 1, 0.0) == 1.5
  assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.2)
  assert predicted_speedup(1 - 1e-9, 3, 0.1) == pytest.approx(4 / 1.3)
  assert predicted_speedup(0.8, 4, 0.1) > predicted_speedup(0.6, 4, 0.1)
  with pytest.raises(EagleJaxError):
    predicted_speedup(1.5, 4, 0.1)
  sizes = time_draft_sizes(Transformer(tiny_config(), rngs=nnx.Rngs(0)), {"s": DRAFT}, gamma=2,
                           repeats=1, context=16)
  assert sizes["target_ms"] > 0 and sizes["s"]["draft_ms"] > 0
  assert sizes["s"]["params"] == DRAFT.model_config(tiny_config()).num_params
  assert math.isclose(sizes["s"]["ratio_c"], sizes["s"]["draft_ms"] / sizes["target_ms"])


def test_hf_round_trip_untied_with_qkv_bias(tmp_path):
  model = Transformer(tiny_config(attention_bias=True, architecture="qwen2"), rngs=nnx.Rngs(2))
  model.layers[0].attn.qkv.bias[...] = 0.1 + model.layers[0].attn.qkv.bias[...]
  config, loaded = load_hf_folder(save_hf_folder(model, str(tmp_path / "m")))
  assert config == model.config and loaded.lm_head is not None
  tokens, pos = np.arange(2, 12, dtype=np.int32)[None], np.arange(10, dtype=np.int32)[None]
  np.testing.assert_array_equal(np.asarray(loaded(tokens, pos).logits_BxTxV),
                                np.asarray(model(tokens, pos).logits_BxTxV))
