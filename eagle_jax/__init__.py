"""eagle_jax: speculative decoding (EAGLE and friends) in JAX/Flax."""

from eagle_jax.config import ModelConfig, RopeScaling, tiny_config
from eagle_jax.errors import EagleJaxError
from eagle_jax.model import KVCache, Output, Transformer
from eagle_jax.registry import DEFAULT_MODEL, LoadedModel, load_model
from eagle_jax.sampling import SamplingParams
from eagle_jax.generate import Generation, generate

__all__ = [
    "DEFAULT_MODEL", "EagleJaxError", "Generation", "KVCache", "LoadedModel", "ModelConfig",
    "Output", "RopeScaling", "SamplingParams", "Transformer", "generate", "load_model",
    "tiny_config",
]
