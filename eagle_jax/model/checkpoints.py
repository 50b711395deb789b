"""Load Hugging Face style checkpoint folders (config.json + safetensors) into the model.

Supports Llama, Mistral and Qwen2 configs, single-file or sharded
(``model.safetensors.index.json``) weights. Never unpickles and never runs remote code.
:func:`save_hf_folder` writes the inverse (e.g. a trained draft model).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from eagle_jax.errors import EagleJaxError
from eagle_jax.model.blocks import Blocks
from eagle_jax.model.config import ModelConfig
from eagle_jax.model.transformer import Transformer, WeightBlocks

BLOCKS_FILE = "gguf_blocks.safetensors"  # integer blocks of quantized weights (gguf_convert)


def read_config(folder: str) -> ModelConfig:
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise EagleJaxError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
  try:
    with open(path) as f:
      cfg = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise EagleJaxError(f"{path}: invalid JSON ({e})") from None
  gen_path = os.path.join(folder, "generation_config.json")
  if isinstance(cfg, dict) and os.path.isfile(gen_path):  # generation stops at its EOS ids too
    try:
      with open(gen_path) as f:
        gen_eos = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
      raise EagleJaxError(f"{gen_path}: invalid generation config ({type(e).__name__}: {e})") from None
    ids = lambda x: [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
    merged = list(dict.fromkeys(ids(cfg.get("eos_token_id")) + ids(gen_eos)))
    if merged:
      cfg = {**cfg, "eos_token_id": merged}
  return ModelConfig.from_hf_dict(cfg, source=path)


def _weight_files(folder: str) -> list[str]:
  index = os.path.join(folder, "model.safetensors.index.json")
  if os.path.isfile(index):
    try:
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
      if not all(isinstance(n, str) for n in files):
        raise TypeError("shard names must be strings")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
      raise EagleJaxError(f"{index}: invalid safetensors index ({type(e).__name__}: {e})") from None
  else:
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors") and n != BLOCKS_FILE)
    if not files:
      has_pickle = any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(folder))
      hint = " (pickle .bin weights are not loaded; convert them to safetensors)" if has_pickle else ""
      raise EagleJaxError(f"{folder}: no *.safetensors weight files{hint}")
  paths = [os.path.join(folder, n) for n in files]
  for p in paths:
    if not os.path.isfile(p):
      raise EagleJaxError(f"{p}: weight shard listed in the index is missing")
  return paths


def read_safetensors(folder: str, paths: list[str] | None = None) -> dict[str, np.ndarray]:
  tensors = {}
  for path in _weight_files(folder) if paths is None else paths:
    try:
      with safe_open(path, framework="numpy") as f:
        for name in f.keys():
          tensors[name] = f.get_tensor(name)
    except Exception as e:
      raise EagleJaxError(f"{path}: corrupt safetensors file ({type(e).__name__}: {e})") from None
  return tensors


def _assign(param: nnx.Variable, value: np.ndarray, name: str, dtype):
  if tuple(param.shape) != tuple(value.shape):
    raise EagleJaxError(
        f"weight {name} has shape {tuple(value.shape)}, expected {tuple(param.shape)} from config.json")
  param.value = jnp.asarray(value, dtype=dtype)


def _stacked_blocks(blocks: dict[str, Blocks], names: list[str], shape) -> WeightBlocks | None:
  """The integer blocks of weights ``names`` stacked by rows, if each has them in one format."""
  parts = [blocks.get(n) for n in names]
  if any(p is None for p in parts) or len({p.q_OxQ.dtype for p in parts}) != 1:
    return None
  stacked = Blocks.concat(parts)
  if tuple(stacked.shape) != tuple(shape):
    return None
  return WeightBlocks(jax.tree.map(jnp.asarray, stacked))


def _load_linear(lin, get, names: list[str], dtype, blocks: dict[str, Blocks]) -> None:
  """Loads one or more Hugging Face linears stacked by rows (fused q/k/v, gate/up)."""
  _assign(lin.weight, np.concatenate([get(n + ".weight") for n in names]), "+".join(names), dtype)
  if lin.bias is not None:
    _assign(lin.bias, np.concatenate([get(n + ".bias") for n in names]), "+".join(names) + " bias", dtype)
  lin.blocks = _stacked_blocks(blocks, [n + ".weight" for n in names], lin.weight.shape)


def load_weights(model: Transformer, get: Callable[[str], np.ndarray], dtype,
                 blocks: dict[str, Blocks] | None = None) -> None:
  """Copies Hugging Face-named tensors into ``model`` (same ``[out, in]`` layout); ``blocks``:
  integer blocks of some of them (float32 models only), set beside their float32 weights."""
  blocks = blocks if blocks and dtype == jnp.float32 else {}
  _assign(model.embed, get("model.embed_tokens.weight"), "model.embed_tokens.weight", dtype)
  model.embed_blocks = _stacked_blocks(blocks, ["model.embed_tokens.weight"], model.embed.shape)
  for i, layer in enumerate(model.layers):
    prefix = f"model.layers.{i}."
    _assign(layer.input_norm.weight, get(prefix + "input_layernorm.weight"),
            prefix + "input_layernorm.weight", dtype)
    _assign(layer.post_norm.weight, get(prefix + "post_attention_layernorm.weight"),
            prefix + "post_attention_layernorm.weight", dtype)
    _load_linear(layer.attn.qkv, get, [prefix + f"self_attn.{n}_proj" for n in "qkv"], dtype, blocks)
    _load_linear(layer.attn.o, get, [prefix + "self_attn.o_proj"], dtype, blocks)
    _load_linear(layer.mlp.gate_up, get, [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"], dtype,
                 blocks)
    _load_linear(layer.mlp.down, get, [prefix + "mlp.down_proj"], dtype, blocks)
  _assign(model.final_norm.weight, get("model.norm.weight"), "model.norm.weight", dtype)
  if model.lm_head is not None:
    _assign(model.lm_head.weight, get("lm_head.weight"), "lm_head.weight", dtype)
    model.lm_head.blocks = _stacked_blocks(blocks, ["lm_head.weight"], model.lm_head.weight.shape)


def read_blocks(folder: str) -> dict[str, Blocks]:
  """The integer blocks a GGUF conversion kept (:data:`BLOCKS_FILE`), by weight name."""
  path = os.path.join(folder, BLOCKS_FILE)
  if not os.path.isfile(path):
    return {}
  flat = read_safetensors(folder, [path])
  names = {k.rsplit(".", 1)[0] for k in flat}
  try:
    return {n: Blocks(flat[n + ".q"], flat[n + ".scale"], flat[n + ".offset"]) for n in names}
  except KeyError as e:
    raise EagleJaxError(f"{path}: incomplete integer blocks (no {e.args[0]!r})") from None


def abstract_model(config: ModelConfig, param_dtype=jnp.float32) -> Transformer:
  """The model with shape-only parameters (no memory, no init cost): fill or eval_shape it."""
  return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))


def load_hf_folder(folder: str, param_dtype=jnp.float32) -> tuple[ModelConfig, Transformer]:
  """Builds the model from a Hugging Face checkpoint folder."""
  if not os.path.isdir(folder):
    raise EagleJaxError(f"checkpoint folder not found: {folder}")
  config = read_config(folder)
  tensors = read_safetensors(folder)
  used = set()

  def get(name):
    if name not in tensors:
      raise EagleJaxError(f"{folder}: weight {name!r} missing from the safetensors files")
    used.add(name)
    return tensors[name]

  model = abstract_model(config, param_dtype)
  load_weights(model, get, param_dtype, read_blocks(folder))
  # a tensor this model has no place for (an o_proj or MLP bias, an extra layer) would be
  # silently dropped and the logits would differ from the checkpoint's own model: refuse it
  ignorable = lambda n: n.endswith("rotary_emb.inv_freq") or (n == "lm_head.weight" and config.tie_word_embeddings)
  unused = sorted(n for n in tensors if n not in used and not ignorable(n))
  if unused:
    raise EagleJaxError(f"{folder}: {len(unused)} checkpoint tensor(s) have no place in this "
                        f"{config.architecture} model, e.g. {unused[0]!r} (an unsupported variant)")
  leftover = [p for p in jax.tree.leaves(nnx.state(model)) if isinstance(p, jax.ShapeDtypeStruct)]
  assert not leftover, f"{len(leftover)} parameters were not loaded"
  return config, model


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja")


def _hf_tensors(model: Transformer) -> dict[str, np.ndarray]:
  """``model``'s weights under Hugging Face names (fused q/k/v and gate/up split back)."""
  c = model.config
  out = {"model.embed_tokens.weight": np.asarray(model.embed[...]),
         "model.norm.weight": np.asarray(model.final_norm.weight[...])}
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  for i, layer in enumerate(model.layers):
    prefix = f"model.layers.{i}."
    out[prefix + "input_layernorm.weight"] = np.asarray(layer.input_norm.weight[...])
    out[prefix + "post_attention_layernorm.weight"] = np.asarray(layer.post_norm.weight[...])
    parts = {"weight": np.asarray(layer.attn.qkv.weight[...])}
    if layer.attn.qkv.bias is not None:
      parts["bias"] = np.asarray(layer.attn.qkv.bias[...])
    for kind, w in parts.items():
      for n, piece in zip("qkv", np.split(w, [q, q + kv])):
        out[prefix + f"self_attn.{n}_proj.{kind}"] = piece
    out[prefix + "self_attn.o_proj.weight"] = np.asarray(layer.attn.o.weight[...])
    gate, up = np.split(np.asarray(layer.mlp.gate_up.weight[...]), 2)
    out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
    out[prefix + "mlp.down_proj.weight"] = np.asarray(layer.mlp.down.weight[...])
  if model.lm_head is not None:
    out["lm_head.weight"] = np.asarray(model.lm_head.weight[...])
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_hf_folder(model: Transformer, folder: str, tokenizer_folder: str | None = None) -> str:
  """Writes ``folder`` (atomically: a temporary folder renamed into place) as a Hugging Face
  checkpoint :func:`load_hf_folder` reads back: ``config.json``, ``model.safetensors`` and the
  tokenizer files found in ``tokenizer_folder``. Returns ``folder``."""
  if tokenizer_folder is not None and not os.path.isdir(tokenizer_folder):
    raise EagleJaxError(f"tokenizer folder not found: {tokenizer_folder}")
  parent = os.path.dirname(os.path.abspath(folder))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".save-", dir=parent)
  os.chmod(tmp, 0o755)  # mkdtemp makes it private
  try:
    save_file(_hf_tensors(model), os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(model.config.to_hf_dict(), f, indent=2)
    for name in _TOKENIZER_FILES if tokenizer_folder else ():
      if os.path.isfile(os.path.join(tokenizer_folder, name)):
        shutil.copyfile(os.path.join(tokenizer_folder, name), os.path.join(tmp, name))
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  old = None
  if os.path.exists(folder):  # moved aside, not deleted, until the new folder is in place
    old = tempfile.mkdtemp(prefix=".old-", dir=parent)
    os.replace(folder, os.path.join(old, "previous"))
  os.replace(tmp, folder)
  if old:
    shutil.rmtree(old, ignore_errors=True)
  return folder
