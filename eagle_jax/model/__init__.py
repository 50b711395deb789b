"""The target model and its loading: config, plain ops, the Llama-family transformer with an
explicit KV cache, Hugging Face and GGUF checkpoints, the model registry and the tokenizer.

Importing this package installs the CPU kernels (:mod:`eagle_jax.kernels`) as the ``"cpu"``
plug-in of :mod:`eagle_jax.model.ops`: the implementations its operations stage out when traced
with the CPU as JAX's default backend (built on their first use there, never elsewhere).
"""

from eagle_jax import kernels
from eagle_jax.model.ops import Implementation, Plugin, install

install(Plugin(platform=kernels.PLATFORM, ready=kernels.available,
               implementations={op: Implementation(accepts, run)
                                for op, (accepts, run) in kernels.IMPLEMENTATIONS.items()}))
