"""Published EAGLE-1/2, EAGLE-3 and Medusa-1 checkpoints: our heads against an independent
PyTorch implementation of each published head, written here from the published architecture
(not from our code), on random weights in the official layout; import rules; export round trips.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from eagle_jax.drafters import interop  # noqa: E402
from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig, Frozen  # noqa: E402
from eagle_jax.drafters.eagle.official import read_published, write_published  # noqa: E402
from eagle_jax.drafters.medusa import official as medusa_official  # noqa: E402
from eagle_jax.drafters.medusa.heads import MedusaConfig, MedusaHeads  # noqa: E402
from eagle_jax.errors import EagleJaxError  # noqa: E402
from eagle_jax.model.config import tiny_config  # noqa: E402
from flax import nnx  # noqa: E402

# the target: 8 layers, so EAGLE-3's reference layers (2, L//2, L-3) are (2, 4, 5)
TARGET = tiny_config(num_layers=8, vocab_size=128)
H, HEADS, KV, DH, FFN = 64, 4, 2, 16, 96  # the heads' own FFN width differs from the target's 128
EPS, THETA = 1e-5, 10000.0
B, T = 2, 12


# -- the published heads, in PyTorch ---------------------------------------------------------

def rms(x, w):
  return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x, pos):  # x [B, N, T, Dh], rotate-half convention
  inv = 1.0 / THETA ** (torch.arange(0, DH, 2, dtype=torch.float32) / DH)
  f = pos[:, None, :, None].float() * inv
  emb = torch.cat([f, f], -1)
  x1, x2 = x[..., :DH // 2], x[..., DH // 2:]
  return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def attention(w, p, x, pos):
  b, t, _ = x.shape
  q = (x @ w[p + "q_proj.weight"].T).view(b, t, HEADS, DH).transpose(1, 2)
  k = (x @ w[p + "k_proj.weight"].T).view(b, t, KV, DH).transpose(1, 2)
  v = (x @ w[p + "v_proj.weight"].T).view(b, t, KV, DH).transpose(1, 2)
  q, k = rope(q, pos), rope(k, pos)
  k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
  s = q @ k.transpose(-1, -2) / DH ** 0.5
  s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
  o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, HEADS * DH)
  return o @ w[p + "o_proj.weight"].T


def mlp(w, p, x):
  gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
  return (torch.nn.functional.silu(gate) * up) @ w[p + "down_proj.weight"].T


def eagle1_reference(w, embed, lm_head, tokens, feature, pos):
  """EAGLE-1: fc([embed | feature]) -> a decoder layer without its input norm -> target head."""
  x = torch.cat([embed[tokens], feature], -1) @ w["fc.weight"].T
  if "fc.bias" in w:
    x = x + w["fc.bias"]
  h = x + attention(w, "layers.0.self_attn.", x, pos)
  h = h + mlp(w, "layers.0.mlp.", rms(h, w["layers.0.post_attention_layernorm.weight"]))
  return h, h @ lm_head.T


def eagle3_reference(w, embed, tokens, g, pos):
  """EAGLE-3 midlayer: [input_layernorm(embed) | hidden_norm(g)] into q/k/v, g the residual;
  logits lm_head(norm(h)) over the draft vocabulary."""
  p = "midlayer."
  x = torch.cat([rms(embed[tokens], w[p + "input_layernorm.weight"]),
                 rms(g, w[p + "hidden_norm.weight"])], -1)
  h = g + attention(w, p + "self_attn.", x, pos)
  h = h + mlp(w, p + "mlp.", rms(h, w[p + "post_attention_layernorm.weight"]))
  return h, rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


def medusa_reference(w, hidden, heads, layers):
  out = []
  for i in range(heads):
    x = hidden
    for j in range(layers):
      x = x + torch.nn.functional.silu(x @ w[f"{i}.{j}.linear.weight"].T + w[f"{i}.{j}.linear.bias"])
    out.append(x @ w[f"{i}.{layers}.weight"].T)
  return torch.stack(out, -2)


# -- random published checkpoints ----------------------------------------------------------

def _rand(g, *shape, scale=0.1):
  return torch.randn(*shape, generator=g) * scale


def _layer(g, p, attn_in):
  w = {p + "self_attn.q_proj.weight": _rand(g, HEADS * DH, attn_in),
       p + "self_attn.k_proj.weight": _rand(g, KV * DH, attn_in),
       p + "self_attn.v_proj.weight": _rand(g, KV * DH, attn_in),
       p + "self_attn.o_proj.weight": _rand(g, H, HEADS * DH),
       p + "mlp.gate_proj.weight": _rand(g, FFN, H), p + "mlp.up_proj.weight": _rand(g, FFN, H),
       p + "mlp.down_proj.weight": _rand(g, H, FFN),
       p + "post_attention_layernorm.weight": 1 + _rand(g, H)}
  return w


def _config(**extra):
  return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H,
          "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV,
          "num_hidden_layers": 1, "vocab_size": TARGET.vocab_size, "rms_norm_eps": EPS,
          "rope_theta": THETA, "max_position_embeddings": 512, **extra}


def eagle1_folder(path, bias=True, pickle=False, extra=()):
  g = torch.Generator().manual_seed(1)
  w = {"fc.weight": _rand(g, H, 2 * H), **_layer(g, "layers.0.", H)}
  if bias:
    w["fc.bias"] = _rand(g, H)
  stored = {**w, **{k: _rand(g, 3) for k in extra}}
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(_config(**({} if bias else {"bias": False}))))
  if pickle:
    torch.save(stored, path / "pytorch_model.bin")
  else:
    save_file(stored, str(path / "model.safetensors"))
  return w


def eagle3_folder(path, draft_vocab=48, pickle=False, extra=()):
  g = torch.Generator().manual_seed(2)
  ids = torch.sort(torch.randperm(TARGET.vocab_size, generator=g)[:draft_vocab]).values
  t2d = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
  t2d[ids] = True
  p = "midlayer."
  w = {"fc.weight": _rand(g, H, 3 * H), **_layer(g, p, 2 * H),
       p + "hidden_norm.weight": 1 + _rand(g, H), p + "input_layernorm.weight": 1 + _rand(g, H),
       "norm.weight": 1 + _rand(g, H), "lm_head.weight": _rand(g, draft_vocab, H),
       "d2t": ids - torch.arange(draft_vocab), "t2d": t2d}
  stored = {**w, **{k: _rand(g, 3) for k in extra}}
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(_config(
      architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)))
  if pickle:
    torch.save(stored, path / "pytorch_model.bin")
  else:
    save_file(stored, str(path / "model.safetensors"))
  return w


def medusa_folder(path, heads=3, layers=1, pickle=False):
  g = torch.Generator().manual_seed(3)
  w = {}
  for i in range(heads):
    for j in range(layers):
      w[f"{i}.{j}.linear.weight"], w[f"{i}.{j}.linear.bias"] = _rand(g, H, H), _rand(g, H)
    w[f"{i}.{layers}.weight"] = _rand(g, TARGET.vocab_size, H)
  path.mkdir(parents=True, exist_ok=True)
  # released configs under-state the head count: the weights decide
  (path / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": layers,
                                                "base_model_name_or_path": "tiny"}))
  if pickle:
    torch.save(w, path / "medusa_lm_head.pt")
  else:
    save_file(w, str(path / "medusa_lm_head.safetensors"))
  return w


def _frozen():
  g = torch.Generator().manual_seed(4)
  embed, lm_head = _rand(g, TARGET.vocab_size, H, scale=1.0), _rand(g, TARGET.vocab_size, H)
  return embed, lm_head, Frozen(embed_VxD=jnp.asarray(embed.numpy()),
                                lm_head_VxD=jnp.asarray(lm_head.numpy()))


def _inputs(width):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, TARGET.vocab_size, (B, T))
  feature = rng.normal(0, 3.0, (B, T, width)).astype(np.float32)
  pos = np.broadcast_to(np.arange(3, 3 + T), (B, T)).copy()
  return tokens, feature, pos


def _ours(head, frozen, tokens, feature, pos):
  """The head over T causal inputs into a fresh cache: (output, draft logits)."""
  vis = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  slots = jnp.broadcast_to(jnp.arange(T), (B, T))
  out, _ = head(jnp.asarray(tokens), jnp.asarray(feature), jnp.asarray(pos), vis, frozen,
                head.init_kv(B, T), slots, fresh_cache=True)
  return out, head.logits(out, frozen)


def _close(ours, ref):
  np.testing.assert_allclose(np.asarray(ours), ref.detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _exact_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


@pytest.mark.parametrize("bias", [True, False])
def test_eagle1_head_matches_the_published_definition(tmp_path, bias):
  w = eagle1_folder(tmp_path / "e1", bias=bias)
  assert interop.detect(str(tmp_path / "e1")) == interop.EAGLE
  head = read_published(str(tmp_path / "e1"), TARGET)
  assert head.config.version == 1 and head.config.bias == bias
  assert head.config.target.intermediate_size == FFN  # the head's own size, not the target's
  embed, lm_head, frozen = _frozen()
  tokens, feature, pos = _inputs(H)
  out, logits = _ours(head, frozen, tokens, feature, pos)
  ref_h, ref_logits = eagle1_reference(w, embed, lm_head, torch.tensor(tokens),
                                       torch.tensor(feature), torch.tensor(pos))
  _close(out, ref_h)
  _close(logits, ref_logits)


def test_eagle3_head_matches_the_published_definition_and_feeds_back_h(tmp_path):
  w = eagle3_folder(tmp_path / "e3")
  assert interop.detect(str(tmp_path / "e3")) == interop.EAGLE3
  head = read_published(str(tmp_path / "e3"), TARGET)
  assert head.config.fuse_layers == (2, 4, 5) and head.config.vocab == 48
  embed, _, frozen = _frozen()
  tokens, fused, pos = _inputs(3 * H)  # [low | mid | high], raw
  g = head.fuse_features(jnp.asarray(fused))
  ref_g = torch.tensor(fused) @ w["fc.weight"].T  # fc, no bias
  _close(g, ref_g)
  out, logits = _ours(head, frozen, tokens, g, pos)
  ref_h, ref_logits = eagle3_reference(w, embed, torch.tensor(tokens), ref_g, torch.tensor(pos))
  _close(out, ref_h)
  _close(logits, ref_logits)
  # draft ids -> target ids through d2t offsets
  best = ref_logits.argmax(-1)
  np.testing.assert_array_equal(np.asarray(head.to_target(jnp.argmax(logits, -1), frozen)),
                                (best + w["d2t"][best]).numpy())
  # the next depth (training-time test) reads the un-normed h in place of g
  out2, logits2 = _ours(head, frozen, tokens[:, ::-1].copy(), out, pos + 1)
  ref_h2, ref_logits2 = eagle3_reference(w, embed, torch.tensor(tokens[:, ::-1].copy()), ref_h,
                                         torch.tensor(pos + 1))
  _close(out2, ref_h2)
  _close(logits2, ref_logits2)


@pytest.mark.parametrize("layers", [1, 2])
def test_medusa_heads_match_the_published_definition(tmp_path, layers):
  w = medusa_folder(tmp_path / "m", heads=3, layers=layers)
  assert interop.detect(str(tmp_path / "m")) == interop.MEDUSA
  heads = medusa_official.read_published(str(tmp_path / "m"))
  assert (heads.config.num_heads, heads.config.num_layers) == (3, layers)  # from the weights
  hidden = np.random.default_rng(1).normal(0, 1, (B, T, H)).astype(np.float32)
  _close(heads(jnp.asarray(hidden)), medusa_reference(w, torch.tensor(hidden), 3, layers))


def test_a_pickled_folder_with_extra_tensors_loads_the_same(tmp_path, capsys):
  eagle3_folder(tmp_path / "st")
  eagle3_folder(tmp_path / "bin", pickle=True, extra=("embed_tokens.weight",
                                                     "midlayer.self_attn.rotary_emb.inv_freq"))
  a, b = read_published(str(tmp_path / "st"), TARGET), read_published(str(tmp_path / "bin"), TARGET)
  err = capsys.readouterr().err
  assert err.count("ignoring 2 tensor(s)") == 1 and "embed_tokens.weight" in err
  for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
    np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))
  # convert writes safetensors once; the folder then reads without PyTorch's loader
  out = interop.convert(str(tmp_path / "bin"))
  assert out.endswith("model.safetensors") and interop.weights_file(str(tmp_path / "bin")) == out
  c = read_published(str(tmp_path / "bin"), TARGET)
  np.testing.assert_array_equal(np.asarray(c.fc.weight[...]), np.asarray(a.fc.weight[...]))


class _Payload:
  def __reduce__(self):
    return (print, ("code ran",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path, capsys):
  eagle1_folder(tmp_path / "e1")
  (tmp_path / "e1" / "model.safetensors").unlink()
  torch.save({"fc.weight": torch.zeros(H, 2 * H), "x": _Payload()}, tmp_path / "e1" / "pytorch_model.bin")
  with pytest.raises(EagleJaxError, match="weights-only loader.*eagle-jax convert") as e:
    read_published(str(tmp_path / "e1"), TARGET)
  assert "\n" not in str(e.value) and "code ran" not in capsys.readouterr().out


def test_missing_and_misshaped_tensors_are_one_line_errors(tmp_path):
  w = eagle3_folder(tmp_path / "e3")
  del w["norm.weight"]
  save_file(w, str(tmp_path / "e3" / "model.safetensors"))
  with pytest.raises(EagleJaxError, match=r"tensor 'norm.weight' missing \(expected shape \[64\]\)"):
    read_published(str(tmp_path / "e3"), TARGET)
  w["norm.weight"] = torch.ones(H + 1)
  save_file(w, str(tmp_path / "e3" / "model.safetensors"))
  with pytest.raises(EagleJaxError, match=r"'norm.weight' has shape \[65\], expected \[64\]"):
    read_published(str(tmp_path / "e3"), TARGET)
  other = tiny_config(num_layers=8, vocab_size=128, hidden_size=32, num_heads=2, num_kv_heads=1)
  with pytest.raises(EagleJaxError, match="hidden_size 64 but the target has 32"):
    read_published(str(tmp_path / "e3"), other)


def test_export_writes_exactly_the_published_tensors_and_reads_back(tmp_path):
  cfg = EagleHeadConfig(3, TARGET, fuse_layers=(2, 4, 5), draft_vocab=40)
  ids = np.sort(np.random.default_rng(2).choice(TARGET.vocab_size, 40, replace=False))
  head = EagleHead(cfg, rngs=nnx.Rngs(5), d2t=ids)
  write_published(head, str(tmp_path / "out"))
  t = load_file(str(tmp_path / "out" / "model.safetensors"))
  p = "midlayer."
  expected = {"fc.weight": [H, 3 * H], "norm.weight": [H], "lm_head.weight": [40, H],
              "d2t": [40], "t2d": [TARGET.vocab_size],
              p + "self_attn.q_proj.weight": [HEADS * DH, 2 * H],
              p + "self_attn.k_proj.weight": [KV * DH, 2 * H],
              p + "self_attn.v_proj.weight": [KV * DH, 2 * H], p + "self_attn.o_proj.weight": [H, HEADS * DH],
              p + "mlp.gate_proj.weight": [TARGET.intermediate_size, H],
              p + "mlp.up_proj.weight": [TARGET.intermediate_size, H],
              p + "mlp.down_proj.weight": [H, TARGET.intermediate_size],
              p + "hidden_norm.weight": [H], p + "input_layernorm.weight": [H],
              p + "post_attention_layernorm.weight": [H]}
  assert {k: list(v.shape) for k, v in t.items()} == expected
  assert t["d2t"].dtype == np.int64 and t["t2d"].dtype == bool and t["t2d"].sum() == 40
  np.testing.assert_array_equal(np.arange(40) + t["d2t"], ids)
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["draft_vocab_size"] == 40 and config["num_hidden_layers"] == 1
  back = read_published(str(tmp_path / "out"), TARGET)
  for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(head)), nnx.to_flat_state(nnx.state(back))):
    np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


def test_medusa_export_round_trip(tmp_path):
  heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=2, hidden_size=H, vocab_size=128),
                      rngs=nnx.Rngs(0))
  heads.res_w_KxLxDxD.value = jax.random.normal(jax.random.key(1), heads.res_w_KxLxDxD.shape)
  medusa_official.write_published(heads, str(tmp_path / "m"), "tiny")
  config = json.loads((tmp_path / "m" / "config.json").read_text())
  assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)
  back = medusa_official.read_published(str(tmp_path / "m"))
  for name in ("res_w_KxLxDxD", "res_b_KxLxD", "out_KxVxD"):
    np.testing.assert_array_equal(np.asarray(getattr(back, name)[...]),
                                  np.asarray(getattr(heads, name)[...]))
