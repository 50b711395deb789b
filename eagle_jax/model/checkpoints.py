"""Load Hugging Face style checkpoint folders (config.json + safetensors) into the model.

Supports Llama, Mistral and Qwen2 configs, single-file or sharded
(``model.safetensors.index.json``) weights in float32, bfloat16 or float16. Never unpickles and
never runs remote code. Tensors are read one at a time with plain file reads (no memory map, no
dependence on which dtypes the installed ``safetensors`` converts) and converted to the
parameter dtype as they are placed, so loading holds the model in its own dtype plus about one
layer, never a second copy of the checkpoint. :func:`save_hf_folder` writes the inverse (e.g. a
trained draft model).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from eagle_jax.errors import EagleJaxError
from eagle_jax.model.blocks import Blocks
from eagle_jax.model.config import ModelConfig
from eagle_jax.model.transformer import Transformer, WeightBlocks, fuse_rows, fused_rows, unfuse_rows

BLOCKS_FILE = "gguf_blocks.safetensors"  # integer blocks of quantized weights (gguf_convert)

# safetensors dtype names -> numpy dtypes (bfloat16 and the 8-bit floats from ml_dtypes)
_ST_DTYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, t in {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}.items()}
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}
# the dtypes parameters load in (``param_dtype``)
PARAM_DTYPES = tuple(np.dtype(t) for t in (np.float32, ml_dtypes.bfloat16, np.float16))


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


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  """Where one tensor of a safetensors file lies (read it with :func:`read_tensor`)."""

  path: str
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int  # of its first byte in the file


def read_header(path: str) -> dict[str, TensorEntry]:
  """The tensors of safetensors file ``path`` by name, from its header alone (no data read)."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      length = int.from_bytes(f.read(8), "little")
      if not 2 <= length <= min(size - 8, 100_000_000):  # safetensors' own header limit
        raise ValueError(f"header length {length} does not fit a {size}-byte file")
      header = json.loads(f.read(length))
    if not isinstance(header, dict):
      raise ValueError("the header is not a JSON object")
    entries = {}
    for name, info in header.items():
      if name == "__metadata__":
        continue
      if info["dtype"] not in _ST_DTYPES:
        raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']!r}")
      dtype, shape = _ST_DTYPES[info["dtype"]], tuple(info["shape"])
      start, end = info["data_offsets"]
      if not all(isinstance(d, int) and d >= 0 for d in shape + (start, end)):
        raise ValueError(f"tensor {name!r} has a malformed shape or data offsets")
      if end - start != math.prod(shape) * dtype.itemsize or end > size - 8 - length:
        raise ValueError(f"tensor {name!r}: data offsets {[start, end]} do not fit its "
                         f"shape {list(shape)} or the file")
      entries[name] = TensorEntry(path, name, dtype, shape, 8 + length + start)
  except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
    raise EagleJaxError(f"{path}: corrupt safetensors file ({type(e).__name__}: {e})") from None
  return entries


def read_tensor(entry: TensorEntry) -> np.ndarray:
  """One tensor, read from its file into a fresh array of the stored dtype (little-endian)."""
  out = np.empty(entry.shape, entry.dtype)
  try:
    with open(entry.path, "rb") as f:
      f.seek(entry.offset)
      got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
  except OSError as e:
    raise EagleJaxError(f"{entry.path}: cannot read tensor {entry.name!r} ({e})") from None
  if got != out.nbytes:
    raise EagleJaxError(
        f"{entry.path}: corrupt safetensors file (tensor {entry.name!r} is cut off)")
  return out


def tensor_index(folder: str, paths: list[str] | None = None) -> dict[str, TensorEntry]:
  """Every tensor of the folder's weight files (or of ``paths``) by name, headers only."""
  index = {}
  for path in _weight_files(folder) if paths is None else paths:
    index.update(read_header(path))
  return index


def read_safetensors(folder: str, paths: list[str] | None = None) -> dict[str, np.ndarray]:
  """All tensors of the folder's weight files (or of ``paths``) at once, in their stored dtypes:
  for small files; :func:`load_hf_folder` reads a checkpoint one tensor at a time instead."""
  return {name: read_tensor(entry) for name, entry in tensor_index(folder, paths).items()}


def read_metadata(path: str) -> dict[str, str]:
  """The ``__metadata__`` strings of safetensors file ``path`` (``{}`` without any)."""
  read_header(path)  # a malformed file is a one-line error
  with open(path, "rb") as f:
    length = int.from_bytes(f.read(8), "little")
    meta = json.loads(f.read(length)).get("__metadata__") or {}
  return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def write_safetensors(tensors: dict[str, np.ndarray], path: str,
                      metadata: dict[str, str] | None = None) -> None:
  """Writes ``tensors`` as one safetensors file, in their dtypes (bfloat16 included, whichever
  dtypes the installed ``safetensors`` package converts), with ``metadata`` strings in its
  header."""
  arrays = {name: np.asarray(a, order="C") for name, a in tensors.items()}
  header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
  for name, a in arrays.items():
    if a.dtype not in _ST_NAMES:
      raise EagleJaxError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
    header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for a in arrays.values():
      f.write(a.reshape(-1).view(np.uint8).data)


def checkpoint_dtype(index: dict[str, TensorEntry]) -> np.dtype:
  """The dtype a checkpoint loads in when none is asked for: that of its floating-point tensors
  (of ``model.embed_tokens.weight`` where they differ); float32 for one the model does not
  compute in (float64, 8-bit floats)."""
  floats = {e.dtype for e in index.values() if jnp.issubdtype(e.dtype, jnp.floating)}
  if len(floats) > 1 and "model.embed_tokens.weight" in index:
    floats = {index["model.embed_tokens.weight"].dtype}
  dtype = floats.pop() if len(floats) == 1 else np.dtype(np.float32)
  return dtype if dtype in PARAM_DTYPES else np.dtype(np.float32)


def param_dtype_of(dtype) -> np.dtype:
  """``dtype`` (``jnp.bfloat16``, ``"float16"``, ...) as a numpy dtype, if parameters load in it."""
  try:
    out = np.dtype(dtype)
  except TypeError:
    out = None
  if out not in PARAM_DTYPES:
    raise EagleJaxError(f"parameter dtype {dtype!r} is not supported: use "
                        f"{', '.join(d.name for d in PARAM_DTYPES)} (or None: the checkpoint's)")
  return out


def _assign(param: nnx.Variable, value: np.ndarray, name: str, dtype) -> None:
  """Places ``value`` (any dtype) in ``param``, converted to ``dtype`` on the host."""
  if tuple(param.shape) != tuple(value.shape):
    raise EagleJaxError(
        f"weight {name} has shape {tuple(value.shape)}, expected {tuple(param.shape)} from config.json")
  param.value = jnp.asarray(np.asarray(value).astype(dtype, copy=False))


def _stacked_blocks(blocks: dict[str, Blocks], names: list[str], shape,
                    order: np.ndarray | None = None) -> WeightBlocks | None:
  """The integer blocks of weights ``names`` stacked by rows (then in the fused row ``order``,
  :func:`~eagle_jax.model.transformer.fused_rows`, if given), if each has them in one format."""
  parts = [blocks.get(n) for n in names]
  if any(p is None for p in parts) or len({p.q_OxQ.dtype for p in parts}) != 1:
    return None
  stacked = Blocks.concat(parts)
  if tuple(stacked.shape) != tuple(shape):
    return None
  if order is not None:
    stacked = stacked.take(order)
  return WeightBlocks(jax.tree.map(jnp.asarray, stacked))


def _stacked(get: Callable[[str], np.ndarray], names: list[str], rows: list[int],
             cols: tuple[int, ...], dtype) -> np.ndarray:
  """Tensors ``names`` (``rows[i]`` rows each) stacked by rows into one ``dtype`` array, each
  read, shape-checked, converted into place and dropped before the next is read."""
  out = np.empty((sum(rows),) + cols, dtype)
  start = 0
  for name, n in zip(names, rows):
    part = get(name)
    if tuple(part.shape) != (n,) + cols:
      raise EagleJaxError(
          f"weight {name} has shape {tuple(part.shape)}, expected {(n,) + cols} from config.json")
    out[start:start + n] = part
    start += n
    del part
  return out


def _load_linear(lin, get, names: list[str], dtype, blocks: dict[str, Blocks],
                 rows: list[int] | None = None, order: np.ndarray | None = None) -> None:
  """Loads one or more Hugging Face linears stacked by rows (fused q/k/v, gate/up: ``rows``
  each, then put in the fused row ``order``), in ``dtype``."""
  kinds = ["weight"] + (["bias"] if lin.bias is not None else [])
  for kind in kinds:
    param = getattr(lin, kind)
    keys = [f"{n}.{kind}" for n in names]
    if len(names) == 1:
      _assign(param, get(keys[0]), keys[0], dtype)
    else:
      value = fuse_rows(_stacked(get, keys, rows, tuple(param.shape[1:]), dtype), order)
      _assign(param, value, "+".join(keys), dtype)
  lin.blocks = _stacked_blocks(blocks, [n + ".weight" for n in names], lin.weight.shape,
                               order if len(names) > 1 else None)


def load_weights(model: Transformer, get: Callable[[str], np.ndarray], dtype,
                 blocks: dict[str, Blocks] | None = None) -> None:
  """Copies Hugging Face-named tensors (``get(name)``: an array of any float dtype) into
  ``model`` (same ``[out, in]`` layout), each converted to ``dtype`` as it is placed; ``blocks``:
  integer blocks of some of them (float32 models only), set beside their float32 weights."""
  dtype = np.dtype(dtype)
  blocks = blocks if blocks and dtype == np.float32 else {}
  c = model.config
  q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  _assign(model.embed, get("model.embed_tokens.weight"), "model.embed_tokens.weight", dtype)
  model.embed_blocks = _stacked_blocks(blocks, ["model.embed_tokens.weight"], model.embed.shape)
  for i, layer in enumerate(model.layers):
    prefix = f"model.layers.{i}."
    _assign(layer.input_norm.weight, get(prefix + "input_layernorm.weight"),
            prefix + "input_layernorm.weight", dtype)
    _assign(layer.post_norm.weight, get(prefix + "post_attention_layernorm.weight"),
            prefix + "post_attention_layernorm.weight", dtype)
    _load_linear(layer.attn.qkv, get, [prefix + f"self_attn.{n}_proj" for n in "qkv"], dtype,
                 blocks, [q_rows, kv_rows, kv_rows], fused_rows(layer.attn))
    _load_linear(layer.attn.o, get, [prefix + "self_attn.o_proj"], dtype, blocks)
    _load_linear(layer.mlp.gate_up, get, [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"], dtype,
                 blocks, [c.intermediate_size] * 2, fused_rows(layer.mlp))
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


def load_hf_folder(folder: str, param_dtype=None) -> tuple[ModelConfig, Transformer]:
  """Builds the model from a Hugging Face checkpoint folder. ``param_dtype``: the parameters'
  dtype (float32, bfloat16 or float16; each tensor is converted as it is read), or None for the
  checkpoint's own (:func:`checkpoint_dtype`: a float32 checkpoint loads as float32, a bfloat16
  one as bfloat16). Tensors are read one at a time, so the host never holds more than the model
  and about one layer's tensors."""
  if not os.path.isdir(folder):
    raise EagleJaxError(f"checkpoint folder not found: {folder}")
  config = read_config(folder)
  tensors = tensor_index(folder)
  param_dtype = checkpoint_dtype(tensors) if param_dtype is None else param_dtype_of(param_dtype)
  used = set()

  def get(name: str) -> np.ndarray:
    if name not in tensors:
      raise EagleJaxError(f"{folder}: weight {name!r} missing from the safetensors files")
    used.add(name)
    return read_tensor(tensors[name])

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
    qkv_order = fused_rows(layer.attn)
    parts = {"weight": np.asarray(layer.attn.qkv.weight[...])}
    if layer.attn.qkv.bias is not None:
      parts["bias"] = np.asarray(layer.attn.qkv.bias[...])
    for kind, w in parts.items():
      for n, piece in zip("qkv", np.split(unfuse_rows(w, qkv_order), [q, q + kv])):
        out[prefix + f"self_attn.{n}_proj.{kind}"] = piece
    out[prefix + "self_attn.o_proj.weight"] = np.asarray(layer.attn.o.weight[...])
    gate, up = np.split(unfuse_rows(np.asarray(layer.mlp.gate_up.weight[...]), fused_rows(layer.mlp)), 2)
    out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
    out[prefix + "mlp.down_proj.weight"] = np.asarray(layer.mlp.down.weight[...])
  if model.lm_head is not None:
    out["lm_head.weight"] = np.asarray(model.lm_head.weight[...])
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_hf_folder(model: Transformer, folder: str, tokenizer_folder: str | None = None) -> str:
  """Writes ``folder`` (atomically: a temporary folder renamed into place) as a Hugging Face
  checkpoint :func:`load_hf_folder` reads back: ``config.json``, ``model.safetensors`` and the
  tokenizer files found in ``tokenizer_folder``; the weights in the model's dtype (float32,
  bfloat16 or float16). Returns ``folder``."""
  if tokenizer_folder is not None and not os.path.isdir(tokenizer_folder):
    raise EagleJaxError(f"tokenizer folder not found: {tokenizer_folder}")
  parent = os.path.dirname(os.path.abspath(folder))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".save-", dir=parent)
  os.chmod(tmp, 0o755)  # mkdtemp makes it private
  try:
    write_safetensors(_hf_tensors(model), os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump({**model.config.to_hf_dict(), "torch_dtype": model.embed.dtype.name}, f, indent=2)
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
