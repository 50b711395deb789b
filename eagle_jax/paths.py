"""Where eagle_jax keeps what it builds and converts: ``$EAGLE_JAX_CACHE`` if set, else
``~/.cache/eagle_jax`` (converted models, compiled CPU kernels, XLA's compilation cache)."""

from __future__ import annotations

import os


def cache_dir() -> str:
  return os.environ.get("EAGLE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle_jax")
