"""Convert a GGUF checkpoint (llama architecture) into a Hugging Face style folder.

The folder (``config.json``, ``model.safetensors`` in fp32, tokenizer files with the chat
template) is then loaded by :mod:`eagle_jax.model.checkpoints` like any other Hugging Face
checkpoint, so GGUF models take one code path after conversion. llama.cpp stores the Q and
K projections with rows permuted for its interleaved RoPE; :func:`unpermute_qk` undoes it.

Weights stored in GGUF's 32-weight block formats Q4_0, Q4_1 and Q8_0 are also kept as integer
blocks (``gguf_blocks.safetensors``, :data:`eagle_jax.model.checkpoints.BLOCKS_FILE`,
:mod:`eagle_jax.model.blocks`): the CPU kernels read those instead of the float32 weights for
passes over 1-32 tokens (a quarter to a sixth of the bytes; :mod:`eagle_jax.kernels`). A
tensor's blocks are kept only if they expand to exactly its float32 weights (checked at
conversion).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from safetensors.numpy import save_file

from eagle_jax.errors import EagleJaxError
from eagle_jax.model.blocks import Blocks
from eagle_jax.model.checkpoints import BLOCKS_FILE
from eagle_jax.model.config import ModelConfig, RopeScaling

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
FORMAT = 2  # of a converted folder; 2 added the integer blocks. Older conversions are redone.
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def unpermute_qk(w_OxI: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's row permutation of a Q or K projection (rows = heads x Dh)."""
  out_dim = w_OxI.shape[0]
  half = out_dim // num_heads // 2
  w = w_OxI.reshape(num_heads, half, 2, *w_OxI.shape[1:])
  return w.swapaxes(1, 2).reshape(w_OxI.shape)


def source_marker(path: str) -> dict:
  """What a conversion records of its GGUF file (``source.json``); a file whose marker differs
  (moved, replaced even by one of the same size, or an older converter) is converted again."""
  stat = os.stat(path)
  return {"converted_from": os.path.abspath(path), "size": stat.st_size,
          "mtime_ns": stat.st_mtime_ns, "format": FORMAT}


def _field(reader, key, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  return field.contents()


def _config_from_gguf(reader, path: str) -> ModelConfig:
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise EagleJaxError(f"{path}: unsupported GGUF architecture {arch!r}; supported: 'llama'")
  get = lambda k, d=None: _field(reader, f"llama.{k}", d)
  required = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count"]
  for k in required:
    if get(k) is None:
      raise EagleJaxError(f"{path}: GGUF metadata lacks 'llama.{k}'")
  num_heads = int(get("attention.head_count"))
  hidden = int(get("embedding_length"))
  names = {t.name for t in reader.tensors}
  vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
  eos = _field(reader, "tokenizer.ggml.eos_token_id")
  scaling = str(get("rope.scaling.type", "none"))
  if scaling not in ("none", "linear"):
    raise EagleJaxError(f"{path}: unsupported GGUF rope scaling {scaling!r}; supported: none, linear")
  rope = (RopeScaling(rope_type="linear", factor=float(get("rope.scaling.factor", 1.0)))
          if scaling == "linear" else RopeScaling())
  return ModelConfig(
      vocab_size=int(vocab), hidden_size=hidden,
      intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
      num_heads=num_heads, num_kv_heads=int(get("attention.head_count_kv", num_heads)),
      head_dim=int(get("rope.dimension_count", hidden // num_heads)),
      rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=rope,
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_word_embeddings="output.weight" not in names,
      max_position_embeddings=int(get("context_length", 4096)), architecture="llama",
      bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_ids=() if eos is None else (int(eos),))


def _hf_name(gguf_name: str) -> str:
  parts = gguf_name.split(".")
  if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
  if parts[0] in _TOP_NAMES:
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
  raise EagleJaxError(f"unexpected GGUF tensor {gguf_name!r}")


def _blocks_of(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """``(q, scale, offset)`` of a GGUF tensor's raw rows ``[rows, bytes]`` in a 32-weight block
  format (see :class:`eagle_jax.model.blocks.Blocks`), or None for other formats."""
  layout = {"Q4_0": (18, False), "Q4_1": (20, True), "Q8_0": (34, False)}.get(kind)
  if layout is None or data.ndim != 2:
    return None
  size, has_min = layout
  rows = data.shape[0]
  blocks = data.reshape(rows, -1, size)
  f16 = lambda a: np.ascontiguousarray(a).view(np.float16)[..., 0].astype(np.float32)
  scale = f16(blocks[..., 0:2])
  start = 4 if has_min else 2
  if kind == "Q8_0":
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    offset = np.zeros_like(scale)
  else:  # 4-bit values 0..15; Q4_0's are centred: d * (q - 8) = d * q + (-8 d), both exact
    q = np.ascontiguousarray(blocks[..., start:]).reshape(rows, -1)
    offset = f16(blocks[..., 2:4]) if has_min else -8 * scale
  return q, scale, offset


def read_gguf(path: str, with_blocks: bool = False):
  """Dequantized fp32 weights under Hugging Face names, Q/K rows un-permuted: ``(config,
  tensors)``, and with ``with_blocks`` also ``{name: (q, scale, offset)}`` for the tensors
  whose integer blocks expand exactly to their fp32 weights."""
  import gguf  # import time: 0.3 s, for GGUF conversion only

  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:
    raise EagleJaxError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
  config = _config_from_gguf(reader, path)
  tensors, blocks = {}, {}
  for t in reader.tensors:
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
      raise EagleJaxError(f"{path}: cannot dequantize tensor {t.name} ({e})") from None
    w = np.asarray(w, np.float32).reshape([int(d) for d in reversed(t.shape)])
    name = _hf_name(t.name)
    parts = _blocks_of(np.asarray(t.data), t.tensor_type.name) if with_blocks else None
    heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}
    for suffix, n in heads.items():
      if name.endswith(suffix):
        w = unpermute_qk(w, n)
        parts = parts and tuple(unpermute_qk(a, n) for a in parts)
    tensors[name] = np.ascontiguousarray(w)
    if parts is not None and np.array_equal(Blocks(*parts).dequantize(), tensors[name]):
      blocks[name] = tuple(np.ascontiguousarray(a) for a in parts)
  return (config, tensors, blocks) if with_blocks else (config, tensors)


def convert_gguf(path: str, out_dir: str) -> str:
  """Writes ``out_dir`` (atomically) as a Hugging Face folder; returns it."""
  from transformers import AutoTokenizer  # import time: transformers takes about 1.4 s to import

  if not os.path.isfile(path):
    raise EagleJaxError(f"GGUF file not found: {path}")
  config, tensors, blocks = read_gguf(path, with_blocks=True)
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
  try:
    try:
      tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                          gguf_file=os.path.basename(path))
    except Exception as e:  # no or unreadable tokenizer.ggml.* metadata
      raise EagleJaxError(f"{path}: cannot build the tokenizer from its GGUF metadata "
                          f"({type(e).__name__}: {e})") from None
    tok.save_pretrained(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"))
    if blocks:
      save_file({f"{name}.{part}": a for name, parts in blocks.items()
                 for part, a in zip(("q", "scale", "offset"), parts)}, os.path.join(tmp, BLOCKS_FILE))
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config.to_hf_dict(), f, indent=2)
    with open(os.path.join(tmp, "source.json"), "w") as f:
      json.dump(source_marker(path), f)
    if os.path.exists(out_dir):
      shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir
