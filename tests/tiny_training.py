"""A tiny, fully deterministic EAGLE training setup (a module, not a test file).

Used in-process by tests and as ``python tests/tiny_training.py FEATURES RUN_DIR [MESH]`` by the
resume tests, which kill that process with SIGKILL and restart it.
"""

import sys

import numpy as np
from flax import nnx

from eagle_jax.model.config import tiny_config
from eagle_jax.drafters.eagle.head import EagleHeadConfig, Frozen
from eagle_jax.drafters.eagle.train import EagleTask
from eagle_jax.training.features import FeatureShards, FeatureSpec, extract_features
from eagle_jax.model.transformer import Transformer
from eagle_jax.training.trainer import LoopConfig, OptimConfig, train

SPEC = FeatureSpec(model="tiny", row_len=32, max_len=24, layers=(0, 1, 2), rows_per_shard=4,
                   batch_rows=2)
LOOP = LoopConfig(epochs=3, batch_rows=2, seed=3, log_every=1, eval_every=4, eval_rows=4,
                  ckpt_every=3)


def target():
  return Transformer(tiny_config(), rngs=nnx.Rngs(0))


def encoded(n=24, seed=0):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(n):
    length = int(rng.randint(5, 30))
    tokens = rng.randint(2, 128, size=length).astype(np.int32)
    mask = np.arange(length) >= length // 3
    out.append((tokens, mask))
  return out


def make_features(root, max_rows=None, n=24):
  return extract_features(target(), encoded(n), root, SPEC, max_rows=max_rows, progress=False)


def task(version=1):
  t = target()
  cfg = EagleHeadConfig(1, t.config) if version == 1 else EagleHeadConfig(
      3, t.config, fuse_layers=(0, 1, 2))
  return EagleTask(config=cfg, frozen=Frozen.of(t), ttt_steps=1 if version == 1 else 2)


def run(features, run_dir, version=1, mesh=None):
  data = FeatureShards(features)
  return train(task(version), data, data, run_dir, LOOP, OptimConfig(lr=1e-2, warmup_steps=2),
               progress=False, mesh=mesh)


if __name__ == "__main__":
  # FEATURES RUN_DIR: EAGLE-1 on one device, exported; FEATURES RUN_DIR MESH: EAGLE-3 over MESH
  if len(sys.argv) > 3:
    from eagle_jax.parallel import make_mesh

    run(sys.argv[1], sys.argv[2], 3, make_mesh(sys.argv[3]))
  else:
    from eagle_jax.drafters.registry import export_drafter

    result = run(sys.argv[1], sys.argv[2])
    export_drafter("eagle1", result.module, sys.argv[2] + "/final", {"steps": result.steps}, lm=None)
