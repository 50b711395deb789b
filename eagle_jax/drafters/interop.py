"""Published drafter checkpoints on disk: the folders the official EAGLE and Medusa code (and
vLLM and SGLang after them) read and write, as opposed to our own ``final/`` folders
(:mod:`eagle_jax.drafters.storage`).

A published folder holds ``config.json`` and one weights file:

- ``eagle`` (EAGLE-1, also EAGLE-2's weights): ``pytorch_model.bin`` or ``model.safetensors``;
- ``eagle3``: ``model.safetensors`` (or ``pytorch_model.bin``) holding ``d2t``/``t2d`` and
  ``midlayer.*`` tensors;
- ``medusa``: ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``.

This module finds which format a folder holds (:func:`detect`), reads its tensors (safetensors,
or a pickled PyTorch file through PyTorch's weights-only loader only, so no code in the file
runs), matches them leniently against the tensors a head needs (:func:`take`: extra tensors are
listed once and ignored, a missing or mis-shaped one is a one-line error), and writes folders
(:func:`write`). Each drafter kind maps its own tensors to and from these names.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from eagle_jax.errors import EagleJaxError

EAGLE, EAGLE3, MEDUSA = "eagle", "eagle3", "medusa"
FORMATS = (EAGLE, EAGLE3, MEDUSA)
# weight files of each format, in the order the official loaders try them
EAGLE_FILES = ("pytorch_model.bin", "model.safetensors")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
PICKLES = (".bin", ".pt", ".pth")


def weights_file(folder: str) -> str | None:
  """The weights file a published folder holds (safetensors preferred), or None."""
  for names in (MEDUSA_FILES, EAGLE_FILES):
    found = [n for n in names if os.path.isfile(os.path.join(folder, n))]
    if found:
      found.sort(key=lambda n: not n.endswith(".safetensors"))
      return os.path.join(folder, found[0])
  return None


def detect(folder: str) -> str | None:
  """The published format ``folder`` holds (``eagle``, ``eagle3`` or ``medusa``), or None when
  it is not a published folder (e.g. our own run or ``final/`` folder)."""
  if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, "drafter.json")):
    return None
  if not os.path.isfile(os.path.join(folder, "config.json")):
    return None
  path = weights_file(folder)
  if path is None:
    return None
  if os.path.basename(path).startswith("medusa_lm_head"):
    return MEDUSA
  names = tensor_names(path)
  if {"d2t", "t2d"} & names or any(n.startswith("midlayer.") for n in names):
    return EAGLE3
  return EAGLE


def format_of(folder: str) -> str | None:
  """:func:`detect`, or, in a folder whose weights file is not there yet, the format its
  ``config.json`` names (Medusa's ``medusa_num_heads``; EAGLE-3's ``draft_vocab_size`` or an
  ``Eagle3`` architecture; else EAGLE-1/2). For checking a folder without its weights."""
  fmt = detect(folder)
  if (fmt is not None or weights_file(folder) is not None or not os.path.isdir(folder)
      or os.path.isfile(os.path.join(folder, "drafter.json"))
      or not os.path.isfile(os.path.join(folder, "config.json"))):
    return fmt
  raw = read_config(folder)
  if "medusa_num_heads" in raw:
    return MEDUSA
  if "draft_vocab_size" in raw or any("eagle3" in str(a).lower() for a in raw.get("architectures") or ()):
    return EAGLE3
  return EAGLE


def tensor_shapes(path: str | None) -> dict[str, list[int]]:
  """Names and shapes of a safetensors file's tensors from its header (no tensor is read);
  empty for a pickled file or no file."""
  if path is None or path.endswith(PICKLES):
    return {}
  try:
    with safe_open(path, framework="numpy") as f:
      return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
  except Exception as e:
    raise EagleJaxError(f"{path}: corrupt safetensors file ({type(e).__name__}: {e})") from None


def read_config(folder: str) -> dict:
  path = os.path.join(folder, "config.json")
  try:
    with open(path) as f:
      cfg = json.load(f)
  except FileNotFoundError:
    raise EagleJaxError(f"{folder}: no config.json (not a published drafter folder)") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise EagleJaxError(f"{path}: invalid JSON ({e})") from None
  if not isinstance(cfg, dict):
    raise EagleJaxError(f"{path}: expected a JSON object")
  return cfg


def _torch():
  try:
    import torch  # import time: 2.5 s (python -X importtime); only pickled files need it
  except ImportError:
    return None
  return torch


def _read_pickle(path: str) -> dict[str, np.ndarray]:
  torch = _torch()
  if torch is None:
    raise EagleJaxError(f"{path}: a pickled PyTorch file, read only through PyTorch's weights-only "
                        "loader, and PyTorch is not installed; install it, or run eagle-jax "
                        "convert FOLDER where it is (writes safetensors once)")
  try:
    state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:
    raise EagleJaxError(f"{path}: refused by PyTorch's weights-only loader "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        "convert it with eagle-jax convert FOLDER, or use a safetensors file") from None
  if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
    state = state["state_dict"]
  if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
    raise EagleJaxError(f"{path}: expected a dict of tensors (a state dict)")
  out = {}
  for k, v in state.items():
    v = v.detach().cpu()
    out[k] = (v.float() if v.is_floating_point() and v.dtype != torch.float32 else v).numpy()
  return out


def tensor_names(path: str) -> set[str]:
  if path.endswith(PICKLES):
    return set(_read_pickle(path))
  try:
    with safe_open(path, framework="numpy") as f:
      return set(f.keys())
  except Exception as e:
    raise EagleJaxError(f"{path}: corrupt safetensors file ({type(e).__name__}: {e})") from None


def read_tensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a weights file, as numpy (floating point as float32)."""
  if path.endswith(PICKLES):
    return _read_pickle(path)
  try:
    with safe_open(path, framework="numpy") as f:  # bfloat16 arrives as ml_dtypes' bfloat16
      return {k: _float32(f.get_tensor(k)) for k in f.keys()}
  except Exception as e:
    raise EagleJaxError(f"{path}: corrupt safetensors file ({type(e).__name__}: {e})") from None


def _float32(x: np.ndarray) -> np.ndarray:
  return x if x.dtype.kind in "iub" or x.dtype == np.float32 else x.astype(np.float32)


def take(tensors: dict[str, np.ndarray], expected: dict[str, tuple], source: str,
         optional=()) -> dict[str, np.ndarray]:
  """The ``expected`` tensors (name -> shape) of a published file. A missing one (unless in
  ``optional``) or one of another shape is a one-line error naming it and both shapes; tensors
  the head has no use for (a copied ``embed_tokens``, a rotary ``inv_freq``) are listed once on
  stderr and ignored, as the official loaders do."""
  out = {}
  for name, shape in expected.items():
    if name not in tensors:
      if name in optional:
        continue
      raise EagleJaxError(f"{source}: tensor {name!r} missing (expected shape {list(shape)})")
    got = tuple(tensors[name].shape)
    if got != tuple(shape):
      raise EagleJaxError(f"{source}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
    out[name] = tensors[name]
  extra = sorted(set(tensors) - set(expected))
  if extra:
    print(f"[import] {source}: ignoring {len(extra)} tensor(s) the head does not use: "
          f"{', '.join(extra)}", file=sys.stderr)
  return out


def write(folder: str, weights_name: str, tensors: dict[str, np.ndarray], config: dict) -> str:
  """Writes a published folder: ``config.json`` and ``weights_name`` (safetensors)."""
  os.makedirs(folder, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(folder, weights_name), metadata={"format": "pt"})
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return folder


def convert(folder: str) -> str:
  """Rewrites a published folder's pickled PyTorch weights as safetensors beside them (read
  once through PyTorch's weights-only loader); returns the new file's path."""
  path = weights_file(folder)
  if path is None or detect(folder) is None:
    raise EagleJaxError(f"{folder}: not a published EAGLE or Medusa folder (config.json plus "
                        f"{', '.join(EAGLE_FILES + MEDUSA_FILES)})")
  if not path.endswith(PICKLES):
    return path
  name = "medusa_lm_head.safetensors" if detect(folder) == MEDUSA else "model.safetensors"
  out = os.path.join(folder, name)
  save_file({k: np.ascontiguousarray(v) for k, v in _read_pickle(path).items()}, out,
            metadata={"format": "pt"})
  return out
