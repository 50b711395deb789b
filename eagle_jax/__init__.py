"""eagle_jax: speculative decoding (EAGLE and friends) in JAX/Flax."""

import gc
import sys

import jax

from eagle_jax.decoding.generate import Generation, generate
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.speculative import SpecGeneration, speculative_generate
from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig
from eagle_jax.drafters.eagle.kind import load_head
from eagle_jax.drafters.registry import load_drafter
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.config import ModelConfig, RopeScaling, tiny_config
from eagle_jax.model.registry import DEFAULT_MODEL, LoadedModel, load_model
from eagle_jax.model.transformer import KVCache, Output, Transformer
from eagle_jax.pipeline.train import TrainConfig, run_training


def clear_caches() -> None:
  """Drops compiled executables (ours and JAX's), e.g. between long runs of many shapes."""
  sys.modules["eagle_jax.decoding.generate"]._COMPILED.clear()  # the module, not the function re-exported
  jax.clear_caches()
  gc.collect()


__all__ = [
    "DEFAULT_MODEL", "EagleHead", "EagleHeadConfig", "EagleJaxError", "clear_caches", "Generation",
    "KVCache", "LoadedModel", "ModelConfig", "Output", "RopeScaling", "SamplingParams",
    "SpecGeneration", "TrainConfig", "Transformer", "generate", "load_drafter", "load_head",
    "load_model",
    "run_training", "speculative_generate", "tiny_config",
]
