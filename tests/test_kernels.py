"""The CPU kernels (eagle_jax.kernels) as the CPU implementations of the model's operations
(eagle_jax.model.ops): small products against XLA's einsum, attention against its reference."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import kernels
from eagle_jax.model import ops
from eagle_jax.model.blocks import BLOCK, Blocks


def _einsum(x, w):
  return jnp.einsum("...i,oi->...o", x, w)


def _operands(lead, din, dout, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal(lead + (din,)), jnp.float32),
          jnp.asarray(rng.standard_normal((dout, din)), jnp.float32))


@pytest.mark.parametrize("lead", [(1,), (2,), (1, 3), (4,), (2, 3), (1, 7), (16,), (17,)])
@pytest.mark.parametrize("din,dout", [(8, 3), (13, 301), (576, 1030)])
def test_linear_equals_einsum(lead, din, dout):
  x, w = _operands(lead, din, dout)
  got = jax.jit(ops.linear)(x, w)
  want = _einsum(x, w)
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.sqrt(din))


def test_kernel_taken_for_2_to_16_rows_only():
  assert kernels.available(), "the kernel should build on this machine (g++ and jaxlib's FFI headers)"
  for rows, taken in [(1, False), (2, True), (16, True), (17, False)]:
    x, w = _operands((rows,), 64, 96)
    hlo = jax.jit(ops.linear).lower(x, w).as_text()
    assert ("custom_call" in hlo) == taken, rows
  x, w = _operands((4,), 64, 96)
  hlo = jax.jit(ops.linear).lower(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).as_text()
  assert "custom_call" not in hlo  # float32 only


def test_gradients_and_vmap_match_einsum():
  x, w = _operands((2, 3), 40, 50, seed=1)
  loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
  got = jax.grad(loss(ops.linear), argnums=(0, 1))(x, w)
  want = jax.grad(loss(_einsum), argnums=(0, 1))(x, w)
  for g, e in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
  xb = jnp.stack([x, 2 * x, -x])  # vmap over x (w shared)
  got = jax.jit(jax.vmap(lambda x: ops.linear(x, w)))(xb)
  np.testing.assert_allclose(np.asarray(got), np.asarray(_einsum(xb, w)), rtol=1e-5, atol=1e-4)


def test_switched_off_or_unbuildable_falls_back_to_einsum(monkeypatch, tmp_path, capsys):
  x, w = _operands((4,), 32, 48)
  try:
    kernels.available.cache_clear()
    monkeypatch.setenv("EAGLE_JAX_CPU_KERNELS", "0")
    assert not kernels.available()
    assert "custom_call" not in jax.jit(ops.linear).lower(x, w).as_text()
    kernels.available.cache_clear()
    monkeypatch.setenv("EAGLE_JAX_CPU_KERNELS", "1")
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    assert not kernels.available()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "small-matmul CPU kernel unavailable" in err[0] and "false" in err[0], err
    np.testing.assert_allclose(np.asarray(ops.linear(x, w)), np.asarray(_einsum(x, w)), rtol=1e-6)
  finally:
    monkeypatch.undo()
    kernels.available.cache_clear()
  assert kernels.available()


def _blocks(dout, din, bits, seed=0):
  rng = np.random.default_rng(seed)
  q = (rng.integers(-128, 128, (dout, din)).astype(np.int8) if bits == 8
       else rng.integers(0, 256, (dout, din // 2)).astype(np.uint8))
  nb = din // BLOCK
  return Blocks(jnp.asarray(q), jnp.asarray(rng.random((dout, nb), np.float32) / 64),
                        jnp.asarray(rng.standard_normal((dout, nb)).astype(np.float32) / 8))


def test_blocks_expand_in_gguf_order():
  b = Blocks(jnp.asarray(np.arange(16, dtype=np.uint8)[None] * 17),  # byte j = (j, j)
                     jnp.full((1, 1), 0.5, jnp.float32), jnp.full((1, 1), -1.0, jnp.float32))
  want = np.concatenate([np.arange(16), np.arange(16)]) * 0.5 - 1.0
  np.testing.assert_array_equal(b.dequantize(), want[None].astype(np.float32))
  b8 = Blocks(jnp.asarray(np.arange(-16, 16, dtype=np.int8)[None]),
                      jnp.full((1, 1), 0.25, jnp.float32), jnp.zeros((1, 1), jnp.float32))
  np.testing.assert_array_equal(b8.dequantize(), (np.arange(-16, 16) * 0.25)[None].astype(np.float32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("din,dout", [(32, 5), (576, 1030)])
def test_block_kernel_equals_float32_product_and_each_row_alone(bits, din, dout):
  b = _blocks(dout, din, bits)
  w = jnp.asarray(b.dequantize())
  f = jax.jit(ops.linear)
  for lead in [(1,), (2,), (1, 3), (5,), (7,), (9,), (16,), (17,), (2, 13), (33,)]:
    x = jnp.asarray(np.random.default_rng(1).standard_normal(lead + (din,)), jnp.float32)
    got = f(x, w, b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_einsum(x, w)), rtol=1e-5,
                               atol=1e-5 * np.sqrt(din))
    if math.prod(lead) <= kernels.BLOCK_MAX_ROWS:  # each row's bits do not depend on the others
      flat = x.reshape(-1, din)
      alone = np.stack([np.asarray(f(flat[i:i + 1], w, b))[0] for i in range(flat.shape[0])])
      np.testing.assert_array_equal(np.asarray(got).reshape(alone.shape), alone)


def test_block_kernel_taken_for_1_to_32_rows_with_matching_blocks():
  b = _blocks(96, 64, 4)
  w = jnp.asarray(b.dequantize())
  for rows, taken in [(1, True), (2, True), (16, True), (17, True), (32, True), (33, False)]:
    x = jnp.ones((rows, 64), jnp.float32)
    hlo = jax.jit(ops.linear).lower(x, w, b).as_text()
    assert ("eagle_jax_block_matmul" in hlo) == taken, rows
  x = jnp.ones((1, 64), jnp.float32)
  other = jnp.ones((96, 32), jnp.float32)  # blocks of another shape are never used for it
  assert "custom_call" not in jax.jit(ops.linear).lower(jnp.ones((1, 32)), other, b).as_text()


def test_block_kernel_gradients_and_vmap():
  b = _blocks(50, 64, 8, seed=2)
  w = jnp.asarray(b.dequantize())
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 64)), jnp.float32)
  loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
  got = jax.grad(loss(lambda x, w: ops.linear(x, w, b)), argnums=(0, 1))(x, w)
  want = jax.grad(loss(_einsum), argnums=(0, 1))(x, w)
  for g, e in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-4)
  xb = jnp.stack([x, 2 * x])
  got = jax.jit(jax.vmap(lambda x: ops.linear(x, w, b)))(xb)
  np.testing.assert_allclose(np.asarray(got), np.asarray(_einsum(xb, w)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_block_kernel_applies_the_input_norm(bits):
  """linear(Normed(x, nw, eps), w, blocks) = rms_norm(x) @ w^T, the norm computed in the
  kernel: each row's bits do not depend on the other rows; gradients (x, w, the norm weight)
  and vmap (over x, and over the weights and norm) match plain JAX; without blocks the norm is
  JAX's own, then the float32 kernel's product."""
  din, dout, eps = 576, 100, 1e-5
  b = _blocks(dout, din, bits, seed=4)
  w = jnp.asarray(b.dequantize())
  rng = np.random.default_rng(5)
  nw = jnp.asarray(1 + rng.standard_normal(din).astype(np.float32) / 4)
  ref = lambda x, w, nw: _einsum(ops.rms_norm(x, nw, eps), w)
  f = jax.jit(lambda x, w, nw: ops.linear(ops.Normed(x, nw, eps), w, b))
  for lead in [(1,), (3,), (2, 5), (32,), (40,)]:
    x = jnp.asarray(3 * rng.standard_normal(lead + (din,)), jnp.float32)
    got = f(x, w, nw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref(x, w, nw)), rtol=1e-5,
                               atol=1e-5 * np.sqrt(din))
    if math.prod(lead) <= kernels.BLOCK_MAX_ROWS:
      flat = x.reshape(-1, din)
      alone = np.stack([np.asarray(f(flat[i:i + 1], w, nw))[0] for i in range(flat.shape[0])])
      np.testing.assert_array_equal(np.asarray(got).reshape(alone.shape), alone)
  assert "eagle_jax_block_matmul" in f.lower(x[:1], w, nw).as_text()
  x = jnp.asarray(rng.standard_normal((2, 3, din)), jnp.float32)
  loss = lambda g: (lambda x, w, nw: jnp.sum(jnp.sin(g(x, w, nw))))
  got = jax.grad(loss(f), argnums=(0, 1, 2))(x, w, nw)
  want = jax.grad(loss(ref), argnums=(0, 1, 2))(x, w, nw)
  for g, e in zip(got, want):  # sums of hundreds of terms of up to ~20: float32 rounding
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5 * np.abs(e).max())
  xb = jnp.stack([x, 2 * x])
  np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(lambda x: f(x, w, nw)))(xb)),
                             np.asarray(ref(xb, w, nw)), rtol=1e-5, atol=1e-4)
  nwb = jnp.stack([nw, 2 * nw])  # the norm weights batched: plain JAX per weight
  np.testing.assert_allclose(np.asarray(jax.vmap(lambda n: f(x, w, n))(nwb)),
                             np.asarray(jax.vmap(lambda n: ref(x, w, n))(nwb)), rtol=1e-5, atol=1e-4)
  no_blocks = jax.jit(lambda x: ops.linear(ops.Normed(x, nw, eps), w))
  np.testing.assert_allclose(np.asarray(no_blocks(x)), np.asarray(ref(x, w, nw)), rtol=1e-5, atol=1e-4)
  hlo = no_blocks.lower(x).as_text()
  assert "eagle_jax_small_matmul" in hlo and "eagle_jax_block_matmul" not in hlo


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("axes", [(None, 0), (0, 0), (1, 0)])
def test_vmap_over_weights_matches_einsum(blocked, axes):
  """vmap over several weights (e.g. heads' parameters stacked), with x shared or batched:
  the kernels multiply by one matrix, so such a batch takes the einsum per weight; a batch of
  x alone still reaches the kernel, also nested under a second vmap."""
  rng = np.random.default_rng(4)
  blocks = [_blocks(50, 64, 8, seed=s) for s in range(3)]
  w3 = jnp.stack([jnp.asarray(b.dequantize()) for b in blocks]) if blocked else \
      jnp.asarray(rng.standard_normal((3, 50, 64)), jnp.float32)
  b3 = jax.tree.map(lambda *a: jnp.stack([jnp.asarray(t) for t in a]), *blocks) if blocked else None
  x = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
  xa, wa = axes
  xin = x if xa != 1 else jnp.moveaxis(x, 0, 1)
  f = (lambda x, w, b: ops.linear(x, w, b)) if blocked else (lambda x, w, b: ops.linear(x, w))
  xs = x[0] if xa is None else xin
  got = jax.jit(jax.vmap(f, in_axes=(xa, wa, wa)))(xs, w3, b3)
  want = jnp.einsum("bti,boi->bto", jnp.broadcast_to(x[0], x.shape) if xa is None else x, w3)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  # x batched twice, weight shared: still one kernel call
  w, b = w3[0], (jax.tree.map(lambda a: a[0], b3) if blocked else None)
  inner = jax.vmap(jax.vmap(lambda x: f(x, w, b)))
  x2 = jnp.stack([x, -x])
  hlo = jax.jit(inner).lower(x2).as_text()
  assert "custom_call" in hlo or not kernels.available()
  np.testing.assert_allclose(np.asarray(jax.jit(inner)(x2)), np.asarray(_einsum(x2, w)),
                             rtol=1e-5, atol=1e-4)


def _attention_operands(b, kh, g, t, s, d, tc, hidden_frac, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  hide = jnp.finfo(jnp.float32).min
  bias_c = jnp.where(jnp.asarray(rng.random((b, tc, s)) < hidden_frac), hide, 0.0).astype(jnp.float32)
  causal = jnp.tril(jnp.ones((t, t), bool))
  bias_n = jnp.broadcast_to(jnp.where(causal, 0.0, hide), (b, t, t)).astype(jnp.float32)
  return f(b, kh, g * t, d), [(f(b, kh, s, d), f(b, kh, s, d), bias_c), (f(b, kh, t, d), f(b, kh, t, d), bias_n)]


@pytest.mark.parametrize("b,kh,g,t,s,d,tc,hidden", [
    (1, 3, 3, 1, 256, 64, 1, 0.3),   # a decode step of the default model
    (2, 3, 3, 9, 100, 64, 9, 0.5),   # a verify pass over 9 nodes, a bias per new token
    (1, 2, 4, 16, 33, 48, 1, 1.0),   # every cached slot hidden
    (3, 1, 1, 2, 7, 128, 2, 0.0),
])
def test_attention_kernel_equals_reference(b, kh, g, t, s, d, tc, hidden):
  q, parts = _attention_operands(b, kh, g, t, s, d, tc, hidden)
  hlo = jax.jit(ops.attend).lower(q, parts).as_text()
  assert "eagle_jax_attend" in hlo
  got = jax.jit(ops.attend)(q, parts)
  want = jax.jit(ops.attend_reference)(q, parts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-5)


def test_attention_kernel_all_hidden_row_and_fallbacks():
  q, parts = _attention_operands(1, 2, 2, 3, 10, 32, 3, 0.0, seed=4)
  hide = jnp.finfo(jnp.float32).min
  (kc, vc, bc), (kn, vn, _) = parts
  everything_hidden = [(kc, vc, jnp.full_like(bc, hide)), (kn, vn, jnp.full((1, 3, 3), hide))]
  got = jax.jit(ops.attend)(q, everything_hidden)  # no visible slot: weights as the biases give
  want = ops.attend_reference(q, everything_hidden)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-5)
  for q2, parts2 in [(q[..., :24], [(kc[..., :24], vc[..., :24], bc), (kn[..., :24], vn[..., :24], parts[1][2])]),
                     (q.astype(jnp.bfloat16), parts), (q, parts[1:])]:
    assert "eagle_jax_attend" not in jax.jit(ops.attend).lower(q2, parts2).as_text()
  q17, parts17 = _attention_operands(1, 1, 1, 17, 4, 16, 1, 0.0)
  assert "eagle_jax_attend" not in jax.jit(ops.attend).lower(q17, parts17).as_text()


def test_attention_kernel_gradients_and_vmap():
  q, parts = _attention_operands(1, 2, 2, 3, 12, 32, 1, 0.2, seed=5)
  loss = lambda f: (lambda q, parts: jnp.sum(jnp.sin(f(q, parts))))
  got = jax.grad(loss(ops.attend), argnums=(0, 1))(q, parts)
  want = jax.grad(loss(ops.attend_reference), argnums=(0, 1))(q, parts)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)
  qb = jnp.stack([q, -q])
  got = jax.jit(jax.vmap(lambda q: ops.attend(q, parts)))(qb)
  want = jax.vmap(lambda q: ops.attend_reference(q, parts))(qb)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("parts_kind", ["new only", "cache per token", "cache shared"])
@pytest.mark.parametrize("t,block", [(300, 128), (64, 16), (40, 16)])
def test_causal_blocks_equal_reference(parts_kind, t, block):
  """Blocked causal attention (queries a block at a time, the hidden upper triangle skipped)
  gives the full computation's result, with packed segments and padding in the mask, a cache
  part before the new tokens, and a last block shorter than the others; gradients too."""
  b, kh, g, s, d = 2, 2, 3, 5, 16
  tc = {"cache per token": t, "cache shared": 1}.get(parts_kind, 1)
  q, parts = _attention_operands(b, kh, g, t, s, d, tc, 0.4, seed=7)
  seg = np.ones((b, t), np.int32)
  seg[0, t // 3:] = 2  # a second conversation packed into row 0
  seg[1, -5:] = 0  # padding at the end of row 1
  from eagle_jax.training.features import segment_mask
  from eagle_jax.model.transformer import bias_from_mask
  (kc, vc, bc), (kn, vn, _) = parts
  new = (kn, vn, bias_from_mask(segment_mask(jnp.asarray(seg))))
  parts = [new] if parts_kind == "new only" else [(kc, vc, bc), new]
  want = jax.jit(ops.attend_reference)(q, parts)
  got = jax.jit(lambda q, p: ops.attend_causal_blocks(q, p, block))(q, parts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
  loss = lambda f: (lambda q, p: jnp.sum(jnp.sin(f(q, p))))
  g_want = jax.grad(loss(ops.attend_reference))(q, parts)
  g_got = jax.grad(loss(lambda q, p: ops.attend_causal_blocks(q, p, block)))(q, parts)
  np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), rtol=1e-4, atol=1e-5)
  if parts_kind == "new only" and t > ops.CAUSAL_BLOCK:  # attend takes the blocks when told
    hlo = lambda causal: jax.jit(lambda q, p: ops.attend(q, p, causal=causal)).lower(q, parts).as_text()
    assert hlo(True).count("exponential") > hlo(False).count("exponential")


def test_quantize8_rounds_each_block_to_its_own_scale():
  rng = np.random.default_rng(5)
  w = rng.standard_normal((6, 96)).astype(np.float32) * rng.uniform(0.01, 3, (6, 1)).astype(np.float32)
  w[2, 32:64] = 0.0  # an all-zero block stays zero
  b = Blocks.quantize8(w)
  assert b.bits == 8 and b.shape == (6, 96) and not np.asarray(b.offset_OxN).any()
  q, scale = np.asarray(b.q_OxQ).reshape(6, 3, 32), np.asarray(b.scale_OxN)
  assert np.abs(q).max() <= 127 and scale[2, 1] == 0 and not q[2, 1].any()
  nonzero = scale > 0
  assert (np.abs(q).max(-1)[nonzero] == 127).all()  # each block's largest weight is +-127 steps
  err = np.abs(b.dequantize() - w).reshape(6, 3, 32).max(-1)
  assert (err <= scale / 2 * (1 + 1e-5) + 1e-12).all()
  with pytest.raises(ValueError, match="multiple of 32"):
    Blocks.quantize8(np.ones((4, 40), np.float32))


_THREADS_SCRIPT = """
import os, jax, jax.numpy as jnp, numpy as np
from eagle_jax.model import ops
x, w = jnp.ones((4, 64), jnp.float32), jnp.ones((4096, 64), jnp.float32)
before = len(os.listdir("/proc/self/task"))
y = jax.jit(ops.linear)(x, w).block_until_ready()
assert np.array_equal(np.asarray(y), np.full((4, 4096), 64.0, np.float32))
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not kernels.available() or not os.path.isdir("/proc/self/task"),
                    reason="needs the CPU kernel and Linux /proc")
def test_kernel_threads_follow_the_setting():
  """EAGLE_JAX_KERNEL_THREADS=N starts N - 1 workers beside the caller (default: the process's
  CPU affinity); the product is the same either way."""
  import subprocess
  import sys

  def started(n):
    env = dict(os.environ, EAGLE_JAX_KERNEL_THREADS=str(n))
    out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True,
                         text=True, check=True)
    return int(out.stdout.split()[-1])

  assert started(4) - started(1) == 3


@pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernel")
def test_time_inside_counts_each_kernels_calls_and_time():
  """Two readings of kernels.time_inside around a computation give each kernel's calls in it
  and time spent inside them (what `bench decode` splits a step with)."""
  x, w = _operands((4,), 64, 512)
  blocks = jax.tree.map(jnp.asarray, Blocks.quantize8(np.asarray(w)))
  q, parts = _attention_operands(1, 3, 3, 1, 256, 64, 1, 0.3)
  step = jax.jit(lambda x, q: (ops.linear(x, w), ops.linear(x[:1], w, blocks),
                               ops.attend(q, parts)))
  jax.block_until_ready(step(x, q))  # compiled: no kernel runs while compiling
  before = kernels.time_inside()
  for _ in range(3):
    jax.block_until_ready(step(x, q))
  after = kernels.time_inside()
  assert set(after) == set(kernels.KERNELS)
  for name in kernels.KERNELS:
    assert after[name][0] - before[name][0] == 3  # one call of each kernel per step
    assert after[name][1] > before[name][1]
