"""EAGLE heads in the published layouts (SafeAILab/EAGLE; what vLLM and SGLang load), in and out.

EAGLE-1/2 (``eagle``), no name prefix: ``fc.weight [h, 2h]`` (and ``fc.bias [h]`` unless the
config says ``"bias": false``); ``layers.0.self_attn.{q,k,v,o}_proj.weight``;
``layers.0.mlp.{gate,up,down}_proj.weight``; ``layers.0.post_attention_layernorm.weight``. No
input norm, final norm or LM head: the draft feature goes into the target's LM head.

EAGLE-3 (``eagle3``): ``fc.weight [h, 3h]``; ``midlayer.self_attn.{q,k,v}_proj.weight`` with
``2h`` inputs and ``o_proj``; ``midlayer.mlp.*``; ``midlayer.{hidden_norm, input_layernorm,
post_attention_layernorm}.weight``; ``norm.weight``; ``lm_head.weight [draft_vocab, h]``;
``d2t`` (int64 offsets: target id = draft id + ``d2t[draft id]``) and ``t2d`` (bool over the
target vocabulary). ``config.json`` adds ``draft_vocab_size``.

Our heads fuse q/k/v and gate/up into one matrix each (rows stacked in that order), so import
and export stack or split them; everything else maps one to one.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.drafters import interop
from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig, default_fuse_layers
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.config import ModelConfig
from eagle_jax.model.transformer import fuse_rows, fused_rows, unfuse_rows

# the draft layer's sizes an imported head's config.json sets (the rest is the target's)
_LAYER_FIELDS = ("intermediate_size", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "rope_scaling", "rms_norm_eps", "attention_bias")


def _prefix(version: int) -> str:
  return "layers.0." if version == 1 else "midlayer."


def _names(cfg: EagleHeadConfig) -> dict[str, tuple]:
  """Published tensor name -> shape, for a head of config ``cfg``."""
  c, p = cfg.target, _prefix(cfg.version)
  d, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  attn_in = d if cfg.version == 1 else 2 * d
  out = {"fc.weight": (d, 2 * d if cfg.version == 1 else len(cfg.fuse_layers) * d)}
  if cfg.version == 1 and cfg.bias:
    out["fc.bias"] = (d,)
  out.update({p + "self_attn.q_proj.weight": (q, attn_in), p + "self_attn.k_proj.weight": (kv, attn_in),
              p + "self_attn.v_proj.weight": (kv, attn_in), p + "self_attn.o_proj.weight": (d, q)})
  if c.attention_bias:
    out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,)})
  f = c.intermediate_size
  out.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
              p + "mlp.down_proj.weight": (d, f), p + "post_attention_layernorm.weight": (d,)})
  if cfg.version == 3:
    out.update({p + "hidden_norm.weight": (d,), p + "input_layernorm.weight": (d,),
                "norm.weight": (d,), "lm_head.weight": (cfg.vocab, d),
                "d2t": (cfg.vocab,), "t2d": (c.vocab_size,)})
  return out


def _layer_parts(head: EagleHead):
  """(attention, post-attention norm, MLP) of the head's draft layer."""
  if head.config.version == 1:
    return head.layer.attn, head.layer.post_norm, head.layer.mlp
  return head.attn, head.post_norm, head.mlp


def to_published(head: EagleHead) -> dict[str, np.ndarray]:
  """The head's tensors under the published names (float32; ``d2t`` int64, ``t2d`` bool)."""
  cfg, p = head.config, _prefix(head.config.version)
  c = cfg.target
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  arr = lambda v: np.asarray(v[...], np.float32)
  attn, post_norm, mlp = _layer_parts(head)
  out = {"fc.weight": arr(head.fc.weight)}
  if head.fc.bias is not None:
    out["fc.bias"] = arr(head.fc.bias)
  for kind, v in (("weight", attn.qkv.weight), ("bias", attn.qkv.bias)):
    if v is not None:
      for n, part in zip("qkv", np.split(unfuse_rows(arr(v), fused_rows(attn)), [q, q + kv])):
        out[p + f"self_attn.{n}_proj.{kind}"] = part
  out[p + "self_attn.o_proj.weight"] = arr(attn.o.weight)
  gate, up = np.split(unfuse_rows(arr(mlp.gate_up.weight), fused_rows(mlp)), 2)
  out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
  out[p + "mlp.down_proj.weight"] = arr(mlp.down.weight)
  out[p + "post_attention_layernorm.weight"] = arr(post_norm.weight)
  if cfg.version == 3:
    out[p + "hidden_norm.weight"] = arr(head.hidden_norm.weight)
    out[p + "input_layernorm.weight"] = arr(head.input_norm.weight)
    out["norm.weight"], out["lm_head.weight"] = arr(head.norm.weight), arr(head.lm_head.weight)
    ids = np.asarray(head.d2t[...], np.int64)
    out["d2t"] = ids - np.arange(ids.shape[0], dtype=np.int64)
    t2d = np.zeros(c.vocab_size, bool)
    t2d[ids] = True
    out["t2d"] = t2d
  return out


def published_config(head: EagleHead) -> dict:
  """``config.json`` as the official loaders read it: a one-layer Llama config of the draft
  layer's sizes (EAGLE-1: ``bias``; EAGLE-3: ``draft_vocab_size`` and, when not the reference
  code's defaults, the fused layers)."""
  cfg = head.config
  out = {**cfg.target.to_hf_dict(), "num_hidden_layers": 1, "tie_word_embeddings": False}
  if cfg.version == 1:
    return {**out, "architectures": ["LlamaForCausalLM"], "bias": cfg.bias}
  out.update({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": cfg.vocab})
  if tuple(cfg.fuse_layers) != default_fuse_layers(cfg.target.num_layers):
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.fuse_layers)}
  return out


def write_published(head: EagleHead, folder: str) -> str:
  return interop.write(folder, "model.safetensors", to_published(head), published_config(head))


def _head_config(version: int, raw: dict, target: ModelConfig, source: str, tensors) -> EagleHeadConfig:
  """The head's config: the target's, with the draft layer's sizes from ``raw`` (config.json)."""
  layer = ModelConfig.from_hf_dict({**raw, "num_hidden_layers": target.num_layers,
                                    "vocab_size": raw.get("vocab_size", target.vocab_size)}, source)
  for what in ("hidden_size", "vocab_size"):
    if getattr(layer, what) != getattr(target, what):
      raise EagleJaxError(f"{source}: {what} {getattr(layer, what)} but the target has "
                          f"{getattr(target, what)} (a head for another target)")
  merged = dataclasses.replace(target, **{k: getattr(layer, k) for k in _LAYER_FIELDS})
  if version == 1:
    return EagleHeadConfig(1, merged, bias=bool(raw.get("bias", "fc.bias" in tensors)))
  layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  layers = tuple(int(i) for i in layers) if layers else default_fuse_layers(target.num_layers)
  vocab = int(raw.get("draft_vocab_size", raw.get("vocab_size", target.vocab_size)))
  return EagleHeadConfig(3, merged, fuse_layers=layers,
                         draft_vocab=0 if vocab == target.vocab_size else vocab)


def describe_published(folder: str, target: ModelConfig) -> tuple[int, str]:
  """``(version, description)`` of the head in a published EAGLE folder, checked against
  ``target`` from its ``config.json`` (and a safetensors header's shapes) without reading any
  weights: a head for another target is a one-line error."""
  path = interop.weights_file(folder)
  shapes = interop.tensor_shapes(path)
  version = 3 if interop.format_of(folder) == interop.EAGLE3 else 1
  raw = interop.read_config(folder)
  cfg = _head_config(version, raw, target, f"{folder}/config.json", shapes)
  for name, shape in shapes.items():  # the header's shapes against the config's
    want = _names(cfg).get(name)
    if want is not None and tuple(shape) != tuple(want):
      raise EagleJaxError(f"{path}: tensor {name!r} has shape {shape}, expected {list(want)}")
  t = cfg.target
  parts = [f"EAGLE-{version} head", f"{t.num_heads}/{t.num_kv_heads} heads", f"MLP {t.intermediate_size}"]
  if version == 1:
    parts.append("fc bias as the weights have it" if not shapes and "bias" not in raw
                 else "fc with bias" if cfg.bias else "fc without bias")
  else:
    parts += [f"fused layers {list(cfg.fuse_layers)}", f"draft vocabulary {cfg.vocab}"]
  return version, ", ".join(parts)


def read_published(folder: str, target: ModelConfig) -> EagleHead:
  """The head in a published EAGLE-1/2 or EAGLE-3 folder, for a target of config ``target``."""
  fmt = interop.detect(folder)
  if fmt not in (interop.EAGLE, interop.EAGLE3):
    raise EagleJaxError(f"{folder}: not a published EAGLE folder (config.json plus "
                        f"{' or '.join(interop.EAGLE_FILES)})")
  path = interop.weights_file(folder)
  tensors = interop.read_tensors(path)
  version = 1 if fmt == interop.EAGLE else 3
  cfg = _head_config(version, interop.read_config(folder), target, f"{folder}/config.json", tensors)
  t = interop.take(tensors, _names(cfg), path, optional=("t2d",))
  ids = None
  if version == 3:
    ids = np.arange(cfg.vocab, dtype=np.int64) + t["d2t"].astype(np.int64)
    if ids.min() < 0 or ids.max() >= target.vocab_size or np.unique(ids).size != ids.size:
      raise EagleJaxError(f"{path}: d2t does not map the draft ids to distinct target ids in "
                          f"[0, {target.vocab_size})")
    if "t2d" in t and not np.array_equal(np.nonzero(t["t2d"])[0], np.sort(ids)):
      raise EagleJaxError(f"{path}: t2d marks other target ids than d2t maps to")
  head = nnx.eval_shape(lambda: EagleHead(cfg, rngs=nnx.Rngs(0)))
  _fill(head, t, ids)
  return head


def _fill(head: EagleHead, t: dict, ids) -> None:
  p = _prefix(head.config.version)
  put = lambda var, value: var.set_value(jnp.asarray(value, jnp.float32))
  attn, post_norm, mlp = _layer_parts(head)
  put(head.fc.weight, t["fc.weight"])
  if head.fc.bias is not None:
    put(head.fc.bias, t["fc.bias"])
  fused = lambda names, module: fuse_rows(np.concatenate([t[p + n] for n in names]), fused_rows(module))
  put(attn.qkv.weight, fused([f"self_attn.{n}_proj.weight" for n in "qkv"], attn))
  if attn.qkv.bias is not None:
    put(attn.qkv.bias, fused([f"self_attn.{n}_proj.bias" for n in "qkv"], attn))
  put(attn.o.weight, t[p + "self_attn.o_proj.weight"])
  put(mlp.gate_up.weight, fused(["mlp.gate_proj.weight", "mlp.up_proj.weight"], mlp))
  put(mlp.down.weight, t[p + "mlp.down_proj.weight"])
  put(post_norm.weight, t[p + "post_attention_layernorm.weight"])
  if head.config.version == 3:
    put(head.hidden_norm.weight, t[p + "hidden_norm.weight"])
    put(head.input_norm.weight, t[p + "input_layernorm.weight"])
    put(head.norm.weight, t["norm.weight"])
    put(head.lm_head.weight, t["lm_head.weight"])
    head.d2t.set_value(jnp.asarray(ids, jnp.int32))
