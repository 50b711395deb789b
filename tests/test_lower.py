"""``eagle-jax lower``: every program exports for GPUs and TPUs from this CPU machine, without a
CPU kernel in it."""

import jax.numpy as jnp
import pytest
from flax import nnx
from jax import export

from eagle_jax.decoding import generate as gen
from eagle_jax.evaluation.lower import lower_programs
from eagle_jax.model.config import tiny_config
from eagle_jax.model.transformer import Transformer


def test_programs_lower_for_cuda_and_tpu_without_cpu_kernels():
  report = lower_programs(platforms=("cuda", "tpu"), drafter="eagle2")
  assert set(report["programs"]) == {"prefill", "decode", "speculative", "train_step"}
  for name, entry in report["programs"].items():
    for platform in ("cuda", "tpu"):
      got = entry["platforms"][platform]
      assert got["ok"], (name, platform, got)
      assert got["eagle_jax_custom_calls"] == 0, (name, platform)
  assert report["ok"]


def test_a_program_with_cpu_kernels_does_not_export():
  # the same prefill traced with the kernels (outside reference_only) holds their custom calls,
  # which jax.export refuses: lower() would report it as that program's error
  model = Transformer(tiny_config(), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens, lengths = jnp.ones((2, 64), jnp.int32), jnp.array([5, 9], jnp.int32)
  with pytest.raises(ValueError, match="eagle_jax_small_matmul"):
    export.export(gen._prefill_jit, platforms=["cpu", "cuda"])(
        state, tokens, lengths, graphdef=graphdef, cache_len=128, layers=())
