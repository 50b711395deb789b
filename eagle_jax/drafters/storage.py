"""Trained drafters on disk: the ``final/`` folder a training run exports.

Every exported drafter has ``drafter.json``: ``{"drafter": KIND, "model": TARGET, "steps",
"train_tokens", ...}`` plus what its kind needs:

- ``eagle1`` / ``eagle3`` / ``medusa``: ``"head"`` (the module's config) and
  ``params.safetensors`` (flat NNX state names); tuned budgets under ``"budget"``.
- ``eagle1`` / ``eagle3`` also keep ``token_counts.npy``: how often each target id occurs in
  the training replies, from which EAGLE-1/2 draft vocabularies are cut (``--draft-vocab``).
- ``draft-model``: a complete Hugging Face folder (``config.json``, ``model.safetensors``,
  tokenizer files), loadable by any Llama-family loader, ours included.

``--drafter-ckpt`` accepts the ``final/`` folder or its run folder.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig
from eagle_jax.drafters.medusa.heads import MedusaConfig, MedusaHeads
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.checkpoints import save_hf_folder
from eagle_jax.model.registry import load_model

HEAD_KINDS = ("eagle1", "eagle3", "medusa")
TRAINABLE = HEAD_KINDS + ("draft-model",)


def final_folder(path: str) -> str:
  """``path`` itself if it holds an exported drafter, else its ``final/`` (a run folder)."""
  return path if os.path.isfile(os.path.join(path, "drafter.json")) else os.path.join(path, "final")


def read_meta(path: str) -> dict:
  meta_path = os.path.join(final_folder(path), "drafter.json")
  if not os.path.isfile(meta_path):
    raise EagleJaxError(f"{path}: no trained drafter here (drafter.json missing; train one with "
                        "eagle-jax train CONFIG)")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise EagleJaxError(f"{meta_path}: unreadable drafter metadata ({e}); re-run the training "
                        "(it re-exports) or delete the run") from None
  if not isinstance(meta, dict):
    raise EagleJaxError(f"{meta_path}: expected a JSON object")
  return meta


def write_meta(folder: str, meta: dict) -> None:
  """Writes ``folder/drafter.json`` (``folder`` is the export folder itself), atomically: a
  reader never sees a half-written file, even if the writer is killed."""
  path = os.path.join(folder, "drafter.json")
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=1)
  os.replace(tmp, path)


def export_drafter(module, folder: str, meta: dict, tokenizer_folder: str | None = None) -> None:
  """Writes the trained ``module`` of kind ``meta["drafter"]`` to ``folder``."""
  os.makedirs(folder, exist_ok=True)
  if meta["drafter"] == "draft-model":
    save_hf_folder(module, folder, tokenizer_folder)
    write_meta(folder, meta)
    return
  flat = {".".join(str(p) for p in path): np.asarray(v[...])
          for path, v in nnx.to_flat_state(nnx.state(module))}
  save_file(flat, os.path.join(folder, "params.safetensors"))
  write_meta(folder, {**meta, "head": module.config.to_dict()})


def save_token_counts(folder: str, counts: np.ndarray) -> None:
  np.save(os.path.join(folder, "token_counts.npy"), np.asarray(counts, np.int64))


def load_token_counts(path: str, vocab: int) -> np.ndarray:
  """The training-reply token counts exported with the head at ``path`` (``[vocab]``)."""
  file = os.path.join(final_folder(path), "token_counts.npy")
  if not os.path.isfile(file):
    raise EagleJaxError(f"{file} missing: this head was exported without token counts, so no "
                        "draft vocabulary can be cut from it (re-run its training, or --draft-vocab 0)")
  counts = np.load(file)
  if counts.shape != (vocab,):
    raise EagleJaxError(f"{file}: {counts.shape[0]} counts, but the target has {vocab} tokens")
  return counts


def _head_module(kind: str, config: dict):
  if kind == "medusa":
    cfg = MedusaConfig.from_dict(config)
    return nnx.eval_shape(lambda: MedusaHeads(cfg, rngs=nnx.Rngs(0)))
  cfg = EagleHeadConfig.from_dict(config)
  return nnx.eval_shape(lambda: EagleHead(cfg, rngs=nnx.Rngs(0)))


def load_drafter(path: str, kinds=TRAINABLE):
  """``(module, meta)`` of the drafter exported at ``path``; its kind must be in ``kinds``."""
  folder = final_folder(path)
  meta = read_meta(path)
  kind = meta.get("drafter")
  if kind not in kinds:
    raise EagleJaxError(f"{folder}: holds a {kind!r} drafter; expected one of: {', '.join(kinds)}")
  if kind == "draft-model":
    return load_model(folder).model, meta
  module = _head_module(kind, meta["head"])
  tensors = load_file(os.path.join(folder, "params.safetensors"))
  state = nnx.state(module)
  for p, v in nnx.to_flat_state(state):
    key = ".".join(str(x) for x in p)
    if key not in tensors:
      raise EagleJaxError(f"{folder}/params.safetensors: missing tensor {key!r}")
    v.set_value(jax.numpy.asarray(tensors[key]))
  nnx.update(module, state)
  return module, meta


def load_head(path: str):
  """An exported EAGLE head ``(head, meta)``."""
  return load_drafter(path, kinds=("eagle1", "eagle3"))
