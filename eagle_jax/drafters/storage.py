"""Trained drafters on disk: the ``final/`` folder a training run exports.

Every exported drafter has ``drafter.json``: ``{"drafter": KIND, "model": TARGET, "steps",
"train_tokens", ...}`` plus what its kind writes (:class:`eagle_jax.drafters.kinds.Trainable`):

- heads (EAGLE-1, EAGLE-3, Medusa): ``"head"`` (the module's config) and ``params.safetensors``
  (flat NNX state names, :func:`save_params`); tuned budgets under ``"budget"``;
- EAGLE heads also keep ``token_counts.npy``: how often each target id occurs in the training
  replies, from which draft vocabularies are cut (``--draft-vocab``);
- a draft model: a complete Hugging Face folder (``config.json``, ``model.safetensors``,
  tokenizer files), loadable by any Llama-family loader, ours included.

``--drafter-ckpt`` accepts the ``final/`` folder or its run folder. Without it a kind drafts with
the run in ``--runs-dir`` with the most training tokens, else with the drafter shipped for the
target (:mod:`eagle_jax.drafters.shipped`: the same layout, weights stored in bfloat16).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from eagle_jax.errors import EagleJaxError
from eagle_jax.model.checkpoints import read_metadata, read_safetensors
from eagle_jax.model.transformer import ROW_LAYOUT, fuse_rows, fused_row_orders


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


# params.safetensors metadata: the fused q/k/v and gate/up weights are stored in the model's row
# order (eagle_jax.model.transformer.fused_rows); files without it stack q, k, v (gate, up)
FUSED_ROWS = {"fused_rows": ROW_LAYOUT}


def save_params(module, folder: str) -> None:
  """Writes ``module``'s state to ``folder/params.safetensors`` under its flat NNX names."""
  flat = {".".join(str(p) for p in path): np.asarray(v[...])
          for path, v in nnx.to_flat_state(nnx.state(module))}
  save_file(flat, os.path.join(folder, "params.safetensors"), metadata=FUSED_ROWS)


def _fuse_stacked(module, tensors: dict) -> None:
  """Puts the fused weights of a file that stacks q, k, v (and gate, up) by rows in the model's
  row order (:func:`~eagle_jax.model.transformer.fused_rows`), in place."""
  for key, order in fused_row_orders(module).items():
    if key in tensors:
      tensors[key] = fuse_rows(tensors[key], order)


def load_params(module, folder: str):
  """Fills ``module`` (e.g. built with ``nnx.eval_shape``) from ``folder/params.safetensors``,
  each tensor converted to its parameter's dtype (shipped heads store bfloat16)."""
  path = os.path.join(folder, "params.safetensors")
  tensors = read_safetensors(folder, [path])
  if read_metadata(path).get("fused_rows") != FUSED_ROWS["fused_rows"]:
    _fuse_stacked(module, tensors)
  state = nnx.state(module)
  for p, v in nnx.to_flat_state(state):
    key = ".".join(str(x) for x in p)
    if key not in tensors:
      raise EagleJaxError(f"{path}: missing tensor {key!r}")
    v.set_value(jax.numpy.asarray(tensors[key].astype(v.value.dtype)))
  nnx.update(module, state)
  return module


def find_trained(kind: str, runs_dir: str, model: str | None = None) -> str | None:
  """The ``final/`` folder of the trained run in ``runs_dir`` holding a ``kind`` drafter with
  the most training tokens (for the target ``model`` if given), or None."""
  best = None
  if os.path.isdir(runs_dir):
    for run in sorted(os.listdir(runs_dir)):
      meta_path = os.path.join(runs_dir, run, "final", "drafter.json")
      if not os.path.isfile(meta_path):
        continue
      meta = read_meta(os.path.dirname(meta_path))
      if meta.get("drafter") != kind or (model and meta.get("model") != model):
        continue
      key = (meta.get("train_tokens", 0), os.path.getmtime(meta_path))
      if best is None or key > best[0]:
        best = (key, os.path.join(runs_dir, run, "final"))
  return None if best is None else best[1]
