"""Pretrained drafters shipped with the package, for registered targets.

``eagle_jax/pretrained/<model>/<kind>/`` holds one exported drafter per target and weights kind
(the ``final/`` folder of a training run, :mod:`eagle_jax.drafters.storage`), its floating-point
tensors stored in bfloat16 (or float32) and cast back to the drafter's parameter dtype as they
load. ``eagle_jax/pretrained/manifest.json`` says how each was made: the training config and
command, the data, the tokens seen, the held-out figures, the stored dtype, the files and their
SHA-256; each folder keeps the run's resolved training config (``train_config.yaml``).

:func:`find` is the last place a trained kind looks for its weights: ``--drafter-ckpt`` first,
then the run in ``--runs-dir`` with the most training tokens, then the shipped drafter.
``$EAGLE_JAX_PRETRAINED`` names another folder of the same layout (an empty one turns the
fallback off). :func:`ship` adds a trained run (``eagle-jax ship RUN``), replacing a shipped
drafter only with one whose held-out decoded tau is higher.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
import subprocess

import ml_dtypes
import numpy as np
import yaml

from eagle_jax.drafters.storage import final_folder, find_trained, read_meta, write_meta
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.checkpoints import read_metadata, read_safetensors, write_safetensors
from eagle_jax.model.registry import REGISTRY

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
SCORE = "heldout_tau"  # what a replacement must beat: held-out decoded tau of the run's evaluation
_PACKAGE_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "pretrained")


def root() -> str:
  """The folder of shipped drafters (``$EAGLE_JAX_PRETRAINED`` if set)."""
  env = os.environ.get("EAGLE_JAX_PRETRAINED")
  return _PACKAGE_FOLDER if env is None else env


def find(kind: str, model: str | None) -> str | None:
  """The shipped drafter folder of weights kind ``kind`` for target ``model``, or None."""
  if not model or not root():
    return None
  folder = os.path.join(root(), model, kind)
  return folder if os.path.isfile(os.path.join(folder, "drafter.json")) else None


def find_checkpoint(kind: str, runs_dir: str, model: str | None = None) -> str:
  """Where a ``kind`` drafter's weights are looked up when no checkpoint is given: the trained
  run in ``runs_dir`` with the most training tokens (for target ``model`` if given), else the
  drafter shipped for ``model``."""
  found = find_trained(kind, runs_dir, model) or find(kind, model)
  if found is None:
    raise EagleJaxError(f"no trained {kind} drafter{'' if not model else ' for ' + model} in "
                        f"{runs_dir}/ (train one with: eagle-jax train configs/train/{kind}-quick.yaml"
                        f"{'' if not model else ' model=' + model}), none shipped and no "
                        "checkpoint given")
  return found


def manifest(folder: str | None = None) -> dict:
  path = os.path.join(folder or root(), "manifest.json")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _score(meta: dict) -> float | None:
  return (meta.get("heldout") or {}).get(SCORE)


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _commit() -> str | None:
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                         text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


def _convert(src: str, dst: str, dtype: np.dtype) -> None:
  """Copies the export ``src`` to ``dst``, its float tensors (and a Hugging Face config's
  ``torch_dtype``) in ``dtype``."""
  os.makedirs(dst)
  for name in sorted(os.listdir(src)):
    path, out = os.path.join(src, name), os.path.join(dst, name)
    if os.path.isdir(path):
      continue
    if name.endswith(".safetensors"):
      tensors = read_safetensors(src, [path])
      write_safetensors({k: v.astype(dtype) if np.issubdtype(v.dtype, np.floating) or
                         v.dtype == DTYPES["bfloat16"] else v for k, v in tensors.items()}, out,
                        read_metadata(path))
    elif name == "config.json":
      with open(path) as f:
        config = json.load(f)
      config["torch_dtype"] = str(dtype)
      with open(out, "w") as f:
        json.dump(config, f, indent=1)
    elif name != "drafter.json":
      shutil.copyfile(path, out)


def _run_config(run: str) -> str:
  """The resolved training config a run wrote (its ``config.yaml``, overrides applied)."""
  return os.path.join(os.path.dirname(final_folder(run).rstrip("/")), "config.yaml")


def _made_by(run: str) -> dict:
  """The training config and data of ``run`` (its ``config.yaml``), as the manifest states them."""
  path = _run_config(run)
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    cfg = yaml.safe_load(f) or {}
  name = cfg.get("name", "")
  config = f"configs/train/{name}.yaml"
  return {"config": config, "command": f"eagle-jax train {config}",
          "data": {k: v for k, v in (cfg.get("data") or {}).items()
                   if k in ("dataset", "replies", "train_rows", "heldout_rows", "row_len")}}


def ship(run: str, dtype: str = "bfloat16", force: bool = False, folder: str | None = None) -> dict:
  """Adds the trained drafter at ``run`` (a run folder or its ``final/``) to the shipped
  drafters (``folder``, default :func:`root`) with its tensors in ``dtype``; returns its manifest
  entry. A drafter already shipped for the same target and kind is replaced only by one with a
  higher held-out decoded tau (``force``: regardless)."""
  if dtype not in DTYPES:
    raise EagleJaxError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
  folder = folder or root()
  if not folder:
    raise EagleJaxError("EAGLE_JAX_PRETRAINED is empty: no folder to ship drafters to")
  src = final_folder(run)
  meta = read_meta(run)
  kind, model = meta.get("drafter"), meta.get("model")
  if model not in REGISTRY:
    raise EagleJaxError(f"{run}: its target {model!r} is not a registered model name; only "
                        "drafters of registered targets are shipped")
  new = _score(meta)
  if new is None:
    raise EagleJaxError(f"{run}: no held-out {SCORE} in its drafter.json (train with "
                        "decode_eval.prompts > 0), so it cannot be compared with a shipped one")
  key = f"{model}/{kind}"
  dst = os.path.join(folder, model, kind)
  if os.path.isfile(os.path.join(dst, "drafter.json")) and not force:
    old = _score(read_meta(dst))
    if old is not None and new <= old:
      raise EagleJaxError(f"{run}: held-out decoded tau {new} is not above the shipped {key}'s "
                          f"{old}; a shipped drafter is replaced only by a better one (--force)")
  tmp = f"{dst}.tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  _convert(src, tmp, DTYPES[dtype])
  write_meta(tmp, {**meta, "stored_dtype": dtype})
  if os.path.isfile(_run_config(run)):  # the resolved config: what reproduces it, overrides included
    shutil.copyfile(_run_config(run), os.path.join(tmp, "train_config.yaml"))
  files = {n: {"bytes": os.path.getsize(os.path.join(tmp, n)), "sha256": _sha256(os.path.join(tmp, n))}
           for n in sorted(os.listdir(tmp))}
  entry = {**_made_by(run), "drafter": kind, "model": model, "stored_dtype": dtype,
           "steps": meta.get("steps"), "train_tokens": meta.get("train_tokens"),
           "heldout": {k: None if isinstance(v, float) and math.isnan(v) else v
                       for k, v in (meta.get("heldout") or {}).items()}, "tuned_budget": meta.get("budget"),
           "shipped": datetime.date.today().isoformat(), "shipped_commit": _commit(), "files": files}
  entry = {k: v for k, v in entry.items() if v is not None}
  if os.path.isdir(dst):
    shutil.rmtree(dst)
  os.replace(tmp, dst)
  entries = manifest(folder)
  entries[key] = entry
  path = os.path.join(folder, "manifest.json")
  with open(f"{path}.tmp", "w") as f:
    json.dump(dict(sorted(entries.items())), f, indent=1, allow_nan=False)
    f.write("\n")
  os.replace(f"{path}.tmp", path)
  return entry
