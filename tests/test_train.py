"""Feature cache and trainer: packing, resumable extraction, exact resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import tiny_training
from eagle_jax.training.features import FeatureShards, pack_shard, segment_mask
from eagle_jax.training.trainer import FAULT_ENV, batch_rows_at, read_metrics

HERE = os.path.dirname(__file__)


def _examples(lengths):
  return [(np.arange(n, dtype=np.int32) + 10 * i, np.ones(n, bool)) for i, n in enumerate(lengths)]


def test_pack_shard_first_fit_and_segment_mask():
  ex = _examples([3, 4, 6, 3])
  rows, nxt = pack_shard(ex, 0, 8, max_rows=2)  # example 3 fits in neither row: the shard closes
  assert nxt == 3 and len(rows) == 2
  r0 = rows[0]
  assert list(r0["segments"]) == [1, 1, 1, 2, 2, 2, 2, 0]
  assert list(r0["positions"][:7]) == [0, 1, 2, 0, 1, 2, 3]
  assert list(r0["tokens"][3:7]) == [10, 11, 12, 13]
  rest, nxt = pack_shard(ex, 3, 8, max_rows=2)
  assert nxt is None and len(rest) == 1 and list(rest[0]["tokens"][:3]) == [30, 31, 32]
  m = np.asarray(segment_mask(r0["segments"][None]))[0]
  assert m[4, 3] and not m[3, 4] and not m[3, 2] and m[2, 0] and m[7, 7] and not m[7, 0]
  # first fit: later short examples fill earlier rows' gaps (greedy closing would need 3 rows)
  rows, nxt = pack_shard(_examples([5, 6, 3, 2, 9]), 0, 8, max_rows=2)
  assert nxt == 4 and len(rows) == 2
  assert list(rows[0]["segments"]) == [1] * 5 + [2] * 3 and list(rows[0]["tokens"][5:]) == [20, 21, 22]
  assert list(rows[1]["segments"]) == [1] * 6 + [2] * 2 and list(rows[1]["tokens"][6:]) == [30, 31]
  # an example longer than a row is truncated to it and takes a row of its own
  rows, nxt = pack_shard(_examples([5, 6, 3, 2, 9]), 4, 8, max_rows=2)
  assert nxt is None and list(rows[0]["tokens"]) == list(range(40, 48))


def _conversations(rows):
  """Every packed conversation's tokens, sorted: what a cache holds, whatever its layout."""
  out = []
  for tok, seg in zip(rows["tokens"], rows["segments"]):
    out += [tuple(tok[seg == s]) for s in range(1, seg.max() + 1)]
  return sorted(out)


def test_extraction_resumes_and_extends(tmp_path):
  full = tiny_training.make_features(str(tmp_path / "a"))
  per_shard = tiny_training.SPEC.rows_per_shard
  tiny_training.make_features(str(tmp_path / "b"), max_rows=per_shard)  # stops after a budget ...
  part = json.load(open(tmp_path / "b" / "manifest.json"))
  assert sum(s["rows"] for s in part["shards"]) == per_shard and not part["exhausted"]
  tiny_training.make_features(str(tmp_path / "b"))  # ... and a later run extends it
  a, b = FeatureShards(str(tmp_path / "a")), FeatureShards(str(tmp_path / "b"))
  assert a.num_rows == b.num_rows > per_shard
  ra, rb = a.rows(range(a.num_rows)), b.rows(range(b.num_rows))
  for k in ra:
    np.testing.assert_array_equal(ra[k], rb[k])
  # a budget inside a shard packs its last shard into fewer rows: extended, the cache holds
  # every conversation exactly once, in another layout
  tiny_training.make_features(str(tmp_path / "c"), max_rows=per_shard + 1)
  assert FeatureShards(str(tmp_path / "c")).num_rows == per_shard + 1
  tiny_training.make_features(str(tmp_path / "c"))
  c = FeatureShards(str(tmp_path / "c"))
  assert _conversations(c.rows(range(c.num_rows))) == _conversations(ra)
  assert len(_conversations(ra)) == len(tiny_training.encoded())
  run = full["last_run"]
  assert run["mfu"] > 0 and run["tokens_per_s"] > 0
  low, high = run["matmul_flops_per_s_range"]
  assert low <= run["matmul_flops_per_s"] <= high
  # both rates are printed rounded to 0.01 GFLOP/s and the MFU to 0.001: compare within that
  m, p = run["model_flops_per_s"], run["matmul_flops_per_s"]
  assert abs(run["mfu"] - m / p) <= 0.0005 + 0.005 / p + 0.005 * m / p**2 + 1e-9
  limited = FeatureShards(str(tmp_path / "a"), max_rows=3)
  assert limited.num_rows == 3 and limited.num_tokens == int((ra["segments"][:3] > 0).sum())
  assert ra["hidden"].dtype.name == "bfloat16" and ra["layers"].shape[2] == 3


def test_cache_killed_before_marked_complete_recovers(tmp_path):
  root = tmp_path / "a"
  tiny_training.make_features(str(root), max_rows=5)
  m = json.loads((root / "manifest.json").read_text())
  m["complete"] = False  # as if killed between the last shard and the final manifest write
  (root / "manifest.json").write_text(json.dumps(m))
  tiny_training.make_features(str(root), max_rows=5)
  assert json.loads((root / "manifest.json").read_text())["complete"]
  assert FeatureShards(str(root)).num_rows == 5


def test_batches_are_a_function_of_step():
  a = [tuple(batch_rows_at(s, 10, 3, seed=1)) for s in range(9)]
  assert a == [tuple(batch_rows_at(s, 10, 3, seed=1)) for s in range(9)]
  assert len(set(sum(a[:3], ()))) == 9  # one epoch: distinct rows


def _params(run_dir):
  return load_file(os.path.join(run_dir, "final", "params.safetensors"))


def test_sigkill_mid_epoch_then_resume_gives_identical_parameters(tmp_path):
  feats = str(tmp_path / "features")
  tiny_training.make_features(feats)
  script = os.path.join(HERE, "tiny_training.py")
  env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
  straight = str(tmp_path / "straight")
  subprocess.run([sys.executable, script, feats, straight], env=env, check=True)
  resumed = str(tmp_path / "resumed")
  killed = subprocess.run([sys.executable, script, feats, resumed], env={**env, FAULT_ENV: "5"})
  assert killed.returncode == -signal.SIGKILL
  assert not os.path.exists(os.path.join(resumed, "final"))
  per_epoch = FeatureShards(feats).num_rows // tiny_training.LOOP.batch_rows
  assert per_epoch > 5  # the kill lands mid-epoch, after the checkpoint of step 3
  assert max(r["step"] for r in read_metrics(resumed)) == 5
  subprocess.run([sys.executable, script, feats, resumed], env=env, check=True)
  a, b = _params(straight), _params(resumed)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  steps = [r["step"] for r in read_metrics(resumed)]
  assert steps == [r["step"] for r in read_metrics(straight)]  # no duplicated or lost records


def test_a_checkpoint_with_stacked_rows_resumes_in_the_fused_row_order(tmp_path):
  """A training checkpoint whose metadata does not name the fused row layout holds q, k, v (and
  gate, up) stacked by rows, as checkpoints made before the rows were grouped do: it resumes
  with its weights and Adam moments put in the fused order, ending where an uninterrupted run
  ends. Control: the same stacked checkpoint labelled with the fused layout ends elsewhere."""
  import shutil

  import orbax.checkpoint as ocp
  from flax import nnx

  from eagle_jax.model.transformer import ROW_LAYOUT, fused_row_orders, unfuse_rows
  from eagle_jax.parallel import flat_name

  feats = str(tmp_path / "features")
  tiny_training.make_features(feats)
  whole = tiny_training.run(feats, str(tmp_path / "whole"))
  # the tokens trained on: the nonzero segments of every batch the loop drew
  data, loop = FeatureShards(feats), tiny_training.LOOP
  segments = data.rows(range(data.num_rows), ("segments",))["segments"]
  assert whole.tokens == sum(int((segments[batch_rows_at(s, data.num_rows, loop.batch_rows, loop.seed)]
                                  > 0).sum()) for s in range(whole.steps)) > 0
  orders = fused_row_orders(whole.module)
  assert any(n.endswith("qkv.weight") for n in orders) and any(n.endswith("gate_up.weight") for n in orders)

  def stacked(path, x):
    name = flat_name(path).removesuffix(".value")
    order = next((o for n, o in orders.items() if name.endswith("." + n) or name == n), None)
    return x if order is None or np.ndim(x) == 0 else unfuse_rows(np.asarray(x), order)

  def resume_from_stacked(name, label):
    run = tmp_path / name
    shutil.copytree(tmp_path / "whole", run)
    ckpts = run / "checkpoints"
    steps = sorted(int(s) for s in os.listdir(ckpts) if s.isdigit())
    for s in steps[1:]:
      shutil.rmtree(ckpts / str(s))
    mngr = ocp.CheckpointManager(str(ckpts))
    got = mngr.restore(steps[0], args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                         meta=ocp.args.JsonRestore()))
    meta = {k: v for k, v in got["meta"].items() if k != "fused_rows"} | label
    assert got["meta"]["fused_rows"] == ROW_LAYOUT  # what checkpoints record now
    state = jax.tree_util.tree_map_with_path(stacked, got["state"])
    shutil.rmtree(ckpts / str(steps[0]))
    mngr = ocp.CheckpointManager(str(ckpts))
    mngr.save(steps[0], args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                meta=ocp.args.JsonSave(meta)))
    mngr.wait_until_finished()
    result = tiny_training.run(feats, str(run))
    assert result.resumed_from == steps[0]
    return weights(result.module)

  weights = lambda module: {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(module))}
  want = weights(whole.module)
  converted = resume_from_stacked("old", {})
  for k in want:
    np.testing.assert_array_equal(converted[k], want[k], err_msg=str(k))
  mislabelled = resume_from_stacked("mislabelled", {"fused_rows": ROW_LAYOUT})
  assert any(not np.array_equal(mislabelled[k], want[k]) for k in want)


def _heldout_metrics(task, module, feats):
  """The trainer's held-out evaluation of ``module`` (rows and batches of tiny_training.LOOP)."""
  from eagle_jax.training.trainer import _read_batch

  loop, data = tiny_training.LOOP, FeatureShards(feats)
  starts = range(0, min(loop.eval_rows, data.num_rows) - loop.batch_rows + 1, loop.batch_rows)
  sums = {}
  for i in starts:
    batch = _read_batch(data, range(i, i + loop.batch_rows), task.keys)
    _, m = task.loss(module, task.frozen, batch, jax.random.key(0), False)
    for k, v in m.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  return {k: v / len(starts) for k, v in sums.items()}


@pytest.mark.parametrize("version", [1, 3])
def test_training_reduces_loss(tmp_path, version):
  from flax import nnx

  feats = str(tmp_path / "features")
  tiny_training.make_features(feats)
  result = tiny_training.run(feats, str(tmp_path / "run"), version)
  log = read_metrics(str(tmp_path / "run"))
  assert log[-1]["loss"] < log[0]["loss"]
  assert result.steps == log[-1]["step"] and result.resumed_from is None
  # on the rows the trainer evaluates (tiny_training holds none out), the trained head drafts
  # the target's tokens where the head it started from (same seed) does not: top-1 and the
  # greedy-chain proxy of tau rise
  # (an untrained head here accepts nothing: tau proxy exactly 1, top-1 0), cross entropy falls
  task = tiny_training.task(version)
  init = _heldout_metrics(task, task.init_module(nnx.Rngs(tiny_training.LOOP.seed)), feats)
  final = log[-1]
  assert final["heldout_tau_proxy"] > init["tau_proxy"], (final, init)
  # top-1 over the ~86 evaluated positions: at least one more right (EAGLE-3 here: 1 -> 2)
  assert final["heldout_acc_0"] > init["acc_0"], (final, init)
  assert final["heldout_ce_0"] < init["ce_0"], (final, init)


def test_sample_positions_weights_estimate_the_mean_over_every_valid_position():
  from eagle_jax.training.trainer import sample_positions

  valid = jnp.array([[1] * 30 + [0] * 2, [1] * 4 + [0] * 28, [0] * 32], bool)
  value = jnp.arange(3 * 32, dtype=jnp.float32).reshape(3, 32)  # differs by row and position
  truth = float((value * valid).sum() / valid.sum())
  idx, w = sample_positions(jax.random.key(0), valid, 8)
  assert idx.shape == (3, 8)
  assert jnp.all(jnp.where(w > 0, jnp.take_along_axis(valid, idx, 1), True))  # only valid picks weigh
  np.testing.assert_allclose(w.sum(1), valid.sum(1))  # each row weighs its valid count
  ests = []
  for i in range(400):
    idx, w = sample_positions(jax.random.key(i), valid, 8)
    ests.append(float((jnp.take_along_axis(value, idx, 1) * w).sum() / w.sum()))
  assert abs(np.mean(ests) - truth) < 0.5  # weight 1 per pick: about 20.8 against 16.7
  idx, w = sample_positions(jax.random.key(0), valid, 32)  # n >= T: every position, weight 1
  assert idx.shape == (3, 32) and jnp.array_equal(w, valid.astype(jnp.float32))


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_loss_on_sampled_positions_estimates_the_loss_on_every_position(tmp_path, version):
  import dataclasses

  from flax import nnx

  from eagle_jax.drafters.eagle.train import eagle_loss

  feats = str(tmp_path / "features")
  tiny_training.make_features(feats)
  full = dataclasses.replace(tiny_training.task(version), feature_noise=0.0)
  sampled = dataclasses.replace(full, positions_per_row=6)
  head = full.init_module(nnx.Rngs(0))
  rows = FeatureShards(feats).rows(range(4), full.keys)
  batch = {k: jnp.asarray(v) for k, v in rows.items()}
  valid = (batch["segments"] > 0) & batch["loss_mask"]
  assert int(valid.sum(1).min()) > 6  # every row has more valid positions than are drawn
  loss = lambda task, key: eagle_loss(head, full.frozen, batch, key, steps=full.ttt_steps,
                                      train=True, task=task)
  total_all, m_all = loss(full, jax.random.key(0))
  ests = [loss(sampled, jax.random.key(i)) for i in range(120)]
  for j in range(full.ttt_steps):
    ce = [float(m[f"ce_{j}"]) for _, m in ests]
    assert np.std(ce) > 0  # the draws differ
    assert abs(np.mean(ce) - float(m_all[f"ce_{j}"])) < 0.02 * float(m_all[f"ce_{j}"]), j
  if version == 1:  # the feature regression covers every position whatever is drawn
    for _, m in ests[:5]:
      assert float(m["reg_0"]) == pytest.approx(float(m_all["reg_0"]), rel=1e-6)
  assert abs(np.mean([float(t) for t, _ in ests]) - float(total_all)) < 0.02 * float(total_all)


def test_heldout_smaller_than_one_batch_is_refused_before_training(tmp_path):
  import dataclasses

  from eagle_jax.errors import EagleJaxError
  from eagle_jax.training.trainer import OptimConfig, train

  feats = str(tmp_path / "features")
  tiny_training.make_features(feats)
  data = FeatureShards(feats)
  loop = dataclasses.replace(tiny_training.LOOP, eval_rows=1)  # batch_rows=2: no whole batch
  with pytest.raises(EagleJaxError, match="whole batches of loop.batch_rows=2"):
    train(tiny_training.task(), data, data, str(tmp_path / "run"), loop, OptimConfig())
  assert not (tmp_path / "run").exists()
