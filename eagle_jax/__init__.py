"""eagle_jax: speculative decoding (EAGLE and friends) in JAX/Flax."""

from eagle_jax.config import ModelConfig, RopeScaling, tiny_config
from eagle_jax.errors import EagleJaxError
from eagle_jax.model import KVCache, Output, Transformer
from eagle_jax.registry import DEFAULT_MODEL, LoadedModel, load_model
from eagle_jax.sampling import SamplingParams
from eagle_jax.generate import Generation, generate
from eagle_jax.speculative import SpecGeneration, speculative_generate
from eagle_jax.eagle_head import EagleHead, EagleHeadConfig
from eagle_jax.exported import load_drafter, load_head
from eagle_jax.pipeline import TrainConfig, run_training



def clear_caches() -> None:
  """Drops compiled executables (ours and JAX's), e.g. between long runs of many shapes."""
  import gc
  import sys

  import jax

  sys.modules["eagle_jax.generate"]._COMPILED.clear()  # the module, not the function re-exported
  jax.clear_caches()
  gc.collect()


__all__ = [
    "DEFAULT_MODEL", "EagleHead", "EagleHeadConfig", "EagleJaxError", "clear_caches", "Generation",
    "KVCache", "LoadedModel", "ModelConfig", "Output", "RopeScaling", "SamplingParams",
    "SpecGeneration", "TrainConfig", "Transformer", "generate", "load_drafter", "load_head",
    "load_model",
    "run_training", "speculative_generate", "tiny_config",
]
