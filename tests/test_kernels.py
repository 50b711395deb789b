"""The CPU small-matmul kernel (eagle_jax.kernels) against XLA's einsum."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import kernels


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
  got = jax.jit(kernels.linear)(x, w)
  want = _einsum(x, w)
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.sqrt(din))


def test_kernel_taken_for_2_to_16_rows_only():
  assert kernels.available(), "the kernel should build on this machine (g++ and jaxlib's FFI headers)"
  for rows, taken in [(1, False), (2, True), (16, True), (17, False)]:
    x, w = _operands((rows,), 64, 96)
    hlo = jax.jit(kernels.linear).lower(x, w).as_text()
    assert ("custom_call" in hlo) == taken, rows
  x, w = _operands((4,), 64, 96)
  hlo = jax.jit(kernels.linear).lower(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).as_text()
  assert "custom_call" not in hlo  # float32 only


def test_gradients_and_vmap_match_einsum():
  x, w = _operands((2, 3), 40, 50, seed=1)
  loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
  got = jax.grad(loss(kernels.linear), argnums=(0, 1))(x, w)
  want = jax.grad(loss(_einsum), argnums=(0, 1))(x, w)
  for g, e in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
  xb = jnp.stack([x, 2 * x, -x])  # vmap over x (w shared)
  got = jax.jit(jax.vmap(lambda x: kernels.linear(x, w)))(xb)
  np.testing.assert_allclose(np.asarray(got), np.asarray(_einsum(xb, w)), rtol=1e-5, atol=1e-4)


def test_switched_off_or_unbuildable_falls_back_to_einsum(monkeypatch, tmp_path, capsys):
  x, w = _operands((4,), 32, 48)
  try:
    kernels.available.cache_clear()
    monkeypatch.setenv("EAGLE_JAX_CPU_KERNELS", "0")
    assert not kernels.available()
    assert "custom_call" not in jax.jit(kernels.linear).lower(x, w).as_text()
    kernels.available.cache_clear()
    monkeypatch.setenv("EAGLE_JAX_CPU_KERNELS", "1")
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    assert not kernels.available()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "small-matmul CPU kernel unavailable" in err[0] and "false" in err[0], err
    np.testing.assert_allclose(np.asarray(kernels.linear(x, w)), np.asarray(_einsum(x, w)), rtol=1e-6)
  finally:
    monkeypatch.undo()
    kernels.available.cache_clear()
  assert kernels.available()


def _blocks(dout, din, bits, seed=0):
  rng = np.random.default_rng(seed)
  q = (rng.integers(-128, 128, (dout, din)).astype(np.int8) if bits == 8
       else rng.integers(0, 256, (dout, din // 2)).astype(np.uint8))
  nb = din // kernels.BLOCK
  return kernels.Blocks(jnp.asarray(q), jnp.asarray(rng.random((dout, nb), np.float32) / 64),
                        jnp.asarray(rng.standard_normal((dout, nb)).astype(np.float32) / 8))


def test_blocks_expand_in_gguf_order():
  b = kernels.Blocks(jnp.asarray(np.arange(16, dtype=np.uint8)[None] * 17),  # byte j = (j, j)
                     jnp.full((1, 1), 0.5, jnp.float32), jnp.full((1, 1), -1.0, jnp.float32))
  want = np.concatenate([np.arange(16), np.arange(16)]) * 0.5 - 1.0
  np.testing.assert_array_equal(b.dequantize(), want[None].astype(np.float32))
  b8 = kernels.Blocks(jnp.asarray(np.arange(-16, 16, dtype=np.int8)[None]),
                      jnp.full((1, 1), 0.25, jnp.float32), jnp.zeros((1, 1), jnp.float32))
  np.testing.assert_array_equal(b8.dequantize(), (np.arange(-16, 16) * 0.25)[None].astype(np.float32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("din,dout", [(32, 5), (576, 1030)])
def test_block_kernel_equals_float32_product_and_each_row_alone(bits, din, dout):
  b = _blocks(dout, din, bits)
  w = jnp.asarray(b.dequantize())
  f = jax.jit(kernels.linear)
  for lead in [(1,), (2,), (1, 3), (7,), (16,), (17,)]:
    x = jnp.asarray(np.random.default_rng(1).standard_normal(lead + (din,)), jnp.float32)
    got = f(x, w, b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_einsum(x, w)), rtol=1e-5,
                               atol=1e-5 * np.sqrt(din))
    if math.prod(lead) <= kernels.MAX_ROWS:  # each row's bits do not depend on the others
      flat = x.reshape(-1, din)
      alone = np.stack([np.asarray(f(flat[i:i + 1], w, b))[0] for i in range(flat.shape[0])])
      np.testing.assert_array_equal(np.asarray(got).reshape(alone.shape), alone)


def test_block_kernel_taken_for_1_to_16_rows_with_matching_blocks():
  b = _blocks(96, 64, 4)
  w = jnp.asarray(b.dequantize())
  for rows, taken in [(1, True), (2, True), (16, True), (17, False)]:
    x = jnp.ones((rows, 64), jnp.float32)
    hlo = jax.jit(kernels.linear).lower(x, w, b).as_text()
    assert ("eagle_jax_block_matmul" in hlo) == taken, rows
  x = jnp.ones((1, 64), jnp.float32)
  other = jnp.ones((96, 32), jnp.float32)  # blocks of another shape are never used for it
  assert "custom_call" not in jax.jit(kernels.linear).lower(jnp.ones((1, 32)), other, b).as_text()


def test_block_kernel_gradients_and_vmap():
  b = _blocks(50, 64, 8, seed=2)
  w = jnp.asarray(b.dequantize())
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 64)), jnp.float32)
  loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
  got = jax.grad(loss(lambda x, w: kernels.linear(x, w, b)), argnums=(0, 1))(x, w)
  want = jax.grad(loss(_einsum), argnums=(0, 1))(x, w)
  for g, e in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-4)
  xb = jnp.stack([x, 2 * x])
  got = jax.jit(jax.vmap(lambda x: kernels.linear(x, w, b)))(xb)
  np.testing.assert_allclose(np.asarray(got), np.asarray(_einsum(xb, w)), rtol=1e-5, atol=1e-4)
