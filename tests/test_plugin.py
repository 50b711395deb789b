"""The CPU kernels as a plug-in of the model's operations (eagle_jax.model.ops): consulted only
where they can run, never built when lowering for another platform, and no CPU-only argument
in the model's signatures."""

import ast
import inspect
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax import kernels
from eagle_jax.model import ops
from eagle_jax.model.config import tiny_config
from eagle_jax.model.transformer import (
  MLP,
  Attention,
  DecoderLayer,
  KVCache,
  Linear,
  RMSNorm,
  Transformer,
  quantize_linears,
)

_EXPORT_SCRIPT = r"""
import json, os, sys
import jax, jax.numpy as jnp
from flax import nnx
from eagle_jax.model import ops
from eagle_jax.model.config import tiny_config
from eagle_jax.model.transformer import KVCache, Transformer, quantize_linears

model = Transformer(tiny_config(), rngs=nnx.Rngs(0))
quantize_linears(model)  # integer blocks: on the CPU the block kernel (and its norm) would apply
graphdef, state = nnx.split(model)
cache = KVCache.init(model.config, 1, 32)

def forward(state, tokens, cache):
  out = nnx.merge(graphdef, state)(tokens, cache.lengths_B[:, None] + jnp.arange(tokens.shape[1]), cache)
  return out.logits_BxTxV, out.cache

found = {}
with ops.reference_only():
  for platform in ("cuda", "tpu"):
    for t in (1, 4):  # a decode step and a verify-sized pass: both in the kernels' range
      exported = jax.export.export(jax.jit(forward), platforms=[platform])(
          state, jnp.ones((1, t), jnp.int32), cache)
      found[f"{platform} {t}"] = "eagle_jax_" in exported.mlir_module()
kernels_dir = os.path.join(os.environ["EAGLE_JAX_CACHE"], "kernels")
built = sorted(os.listdir(kernels_dir)) if os.path.isdir(kernels_dir) else []
print("exports done", file=sys.stderr, flush=True)
# the same pass traced for the CPU outside reference_only consults the plug-in, which then
# tries to build (and fails: CXX is /bin/false), so the check above would have seen a build
jax.jit(forward).lower(state, jnp.ones((1, 4), jnp.int32), cache)
print(json.dumps({"found": found, "built": built}))
"""


def test_export_for_other_platforms_builds_nothing(tmp_path):
  """A tiny model's forward exported for CUDA and TPU under ops.reference_only(), with a C++
  compiler that always fails and an empty cache: it succeeds, no build is attempted (no
  notice, nothing in the cache's kernels folder) and no eagle_jax custom call is in the MLIR."""
  env = dict(os.environ, CXX="/bin/false", EAGLE_JAX_CACHE=str(tmp_path / "cache"),
             JAX_PLATFORMS="cpu", EAGLE_JAX_CPU_KERNELS="1")
  proc = subprocess.run([sys.executable, "-c", _EXPORT_SCRIPT], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["found"] == {f"{p} {t}": False for p in ("cuda", "tpu") for t in (1, 4)}
  assert out["built"] == []
  before, marker, after = proc.stderr.partition("exports done")
  assert marker and "kernel unavailable" not in before, proc.stderr
  assert after.count("kernel unavailable") == 1 and "/bin/false" in after, proc.stderr


@pytest.mark.parametrize("fn", [
    Linear.__init__, Linear.__call__, Attention.__init__, Attention.__call__, MLP.__init__,
    MLP.__call__, DecoderLayer.__init__, DecoderLayer.__call__, RMSNorm.__init__,
    RMSNorm.__call__, Transformer.__init__, Transformer.__call__, ops.linear, ops.attend,
    ops.rms_norm,
], ids=lambda f: f.__qualname__)
def test_signatures_carry_no_cpu_only_arguments(fn):
  """No norm to fuse into a product, and no integer blocks given to a constructor (the loader
  sets them as an attribute); ops.linear takes the weight's blocks as an operand."""
  names = set(inspect.signature(fn).parameters)
  assert "norm" not in names
  if fn.__name__ == "__init__":
    assert "blocks" not in names


def test_kernels_import_only_paths_and_errors():
  root = pathlib.Path(kernels.__file__).parent
  for path in root.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
      for name in names:
        if name.startswith("eagle_jax"):
          assert name in ("eagle_jax.paths", "eagle_jax.errors"), f"{path.name} imports {name}"


@pytest.fixture
def plugins():
  """The installed plug-ins, restored after the test."""
  saved = dict(ops._PLUGINS)
  yield
  ops._PLUGINS.clear()
  ops._PLUGINS.update(saved)


def test_a_plugin_is_consulted_only_where_it_can_run(plugins):
  """A plug-in's readiness is asked only once one of its implementations accepts the operands,
  while tracing for its platform outside reference_only; the implementation then runs on its
  platform and the reference elsewhere (and within reference_only, which jax.jit's cache
  respects). A Normed input its predicate refuses is normed first."""
  asked = []

  def ready():
    asked.append(jax.default_backend())
    return True

  takes_3_rows = lambda x, w, blocks, norm_weight, *, eps: x.shape[0] == 3 and norm_weight is None
  plus_one = lambda reference, *operands, **static: reference(*operands, **static) + 1
  ops.install(ops.Plugin("cpu", ready, {"linear": ops.Implementation(takes_3_rows, plus_one)}))
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
  x2, x3 = (jnp.asarray(rng.standard_normal((n, 8)), jnp.float32) for n in (2, 3))
  ref = lambda x: jnp.einsum("ti,oi->to", x, w)

  np.testing.assert_allclose(jax.jit(lambda x: ops.linear(x, w))(x2), ref(x2), rtol=1e-6)
  assert asked == []  # not accepted: not asked
  np.testing.assert_allclose(jax.jit(lambda x: ops.linear(x, w))(x3), ref(x3) + 1, rtol=1e-6)
  assert asked == ["cpu"]
  # the same trace exported for CUDA and the CPU: each platform's own branch
  exported = jax.export.export(jax.jit(lambda x: ops.linear(x, w)), platforms=["cuda", "cpu"])(x3)
  np.testing.assert_allclose(exported.call(x3), ref(x3) + 1, rtol=1e-6)
  nw = jnp.asarray(1 + rng.standard_normal(8) / 4, jnp.float32)
  normed = jax.jit(lambda x: ops.linear(ops.Normed(x, nw, 1e-5), w))(x3)
  np.testing.assert_allclose(normed, ref(ops.rms_norm(x3, nw, 1e-5)) + 1, rtol=1e-5)
  assert len(asked) == 3  # refused with the norm, accepted once it is applied
  f = jax.jit(lambda x: 1 * ops.linear(x, w))
  np.testing.assert_allclose(f(x3), ref(x3) + 1, rtol=1e-6)
  assert len(asked) == 4
  with ops.reference_only():  # part of jit's cache key: f is traced again, the plug-in not asked
    np.testing.assert_allclose(f(x3), ref(x3), rtol=1e-6)
  np.testing.assert_allclose(f(x3), ref(x3) + 1, rtol=1e-6)
  assert len(asked) == 4
  ops._PLUGINS.clear()
  ops.install(ops.Plugin("tpu", ready, {"linear": ops.Implementation(takes_3_rows, plus_one)}))
  np.testing.assert_allclose(jax.jit(lambda x: 2 * ops.linear(x, w))(x3), 2 * ref(x3), rtol=1e-6)
  assert len(asked) == 4  # a plug-in for another platform than the default backend: not asked


@pytest.mark.skipif(not kernels.available() or jax.default_backend() != "cpu",
                    reason="needs the CPU kernels")
def test_model_through_the_kernels_equals_its_reference():
  """A tiny model with integer blocks, a decode step and a 4-token pass: through the kernels
  (products with the layers' norms, attention) and under reference_only the same logits."""
  model = Transformer(tiny_config(), rngs=nnx.Rngs(1))
  quantize_linears(model)
  graphdef, state = nnx.split(model)
  cache = KVCache.init(model.config, 1, 32)
  prompt = jnp.asarray([[3, 9, 27, 81, 5, 7]], jnp.int32)
  cache = nnx.merge(graphdef, state)(prompt, jnp.arange(6)[None], cache).cache

  def forward(state, tokens, cache):
    pos = cache.lengths_B[:, None] + jnp.arange(tokens.shape[1])
    return nnx.merge(graphdef, state)(tokens, pos, cache).logits_BxTxV

  for tokens in (jnp.asarray([[11]], jnp.int32), jnp.asarray([[11, 12, 13, 14]], jnp.int32)):
    through = jax.jit(forward)
    hlo = through.lower(state, tokens, cache).as_text()
    assert "eagle_jax_block_matmul" in hlo and "eagle_jax_attend" in hlo
    with ops.reference_only():
      reference = jax.jit(lambda *a: forward(*a))
      assert "eagle_jax_" not in reference.lower(state, tokens, cache).as_text()
      want = reference(state, tokens, cache)
    np.testing.assert_allclose(np.asarray(through(state, tokens, cache)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)
