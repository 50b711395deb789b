"""The trainer every trainable drafter shares: optax + orbax, exactly resumable.

A :class:`Task` says how to build the trainable module and its loss on a batch of feature-cache
rows (:class:`~eagle_jax.training.features.FeatureShards`). :func:`train` runs AdamW with warmup and
cosine/linear decay and global-norm clipping, logs metrics to ``run_dir/metrics.jsonl`` and a
progress bar, evaluates on held-out rows, and saves parameters, optimizer state and the data
position with an orbax ``CheckpointManager`` under ``run_dir/checkpoints``.

Determinism: the batch at global step ``s`` is a pure function of ``(seed, s)`` (row order is
a per-epoch permutation seeded by ``(seed, epoch)``) and so is the step's PRNG key; a run
killed at any point and restarted resumes from its last checkpoint and ends with exactly the
parameters of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any, Callable, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from eagle_jax import parallel
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.transformer import ROW_LAYOUT, fuse_rows, fused_row_orders
from eagle_jax.training.features import FeatureShards

# Fault injection for resume tests: the process SIGKILLs itself right after this global step.
FAULT_ENV = "EAGLE_JAX_FAULT_AT_STEP"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 3e-4
  warmup_steps: int = 50
  schedule: Literal["cosine", "linear", "constant"] = "cosine"
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.0
  grad_clip: float = 0.5

  def validate(self):
    if self.lr <= 0 or self.grad_clip <= 0:
      raise EagleJaxError(f"lr and grad_clip must be positive (lr={self.lr}, grad_clip={self.grad_clip})")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  epochs: float = 1.0  # passes over the training rows (fractions allowed)
  batch_rows: int = 4
  seed: int = 0
  log_every: int = 10
  eval_every: int = 100  # 0 = only at the end
  eval_rows: int = 32  # held-out rows per evaluation, in whole batches of batch_rows (0 = none)
  ckpt_every: int = 50
  keep_checkpoints: int = 2

  def validate(self):
    if self.epochs <= 0:
      raise EagleJaxError(f"loop.epochs must be > 0, got {self.epochs}")
    for key in ("batch_rows", "log_every", "ckpt_every", "keep_checkpoints"):
      if getattr(self, key) < 1:
        raise EagleJaxError(f"loop.{key} must be >= 1, got {getattr(self, key)}")
    for key in ("eval_every", "eval_rows"):
      if getattr(self, key) < 0:
        raise EagleJaxError(f"loop.{key} must be >= 0, got {getattr(self, key)}")


class Task(Protocol):
  keys: tuple[str, ...]  # feature-cache arrays a batch needs
  frozen: Any  # pytree of arrays the loss reads but never trains (e.g. the target's LM head)

  def init_module(self, rngs: nnx.Rngs) -> nnx.Module:
    ...

  def loss(self, module, frozen, batch: dict, key: jax.Array, train: bool) -> tuple[jax.Array, dict]:
    """Scalar loss and a dict of scalar metrics (means over the batch)."""


def sample_positions(key: jax.Array, valid_BxT: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """``n`` positions per row drawn uniformly without replacement among the valid ones (all of
  them when fewer are valid): ``(idx_BxN, weight_BxN)``. A valid pick weighs its row's valid
  count over its picks (the inverse of its chance of being drawn), anything else 0.

  Losses whose cost is dominated by a vocabulary-sized output layer evaluate it only at these
  positions: ``sum(weight * loss) / sum(weight)`` estimates the mean over every valid position
  of the batch (weight 1 per pick would over-weigh rows with fewer valid positions) at a
  fraction of the cost. ``n <= 0`` or ``n >= T`` keeps every position.
  """
  b, t = valid_BxT.shape
  if n <= 0 or n >= t:
    return jnp.broadcast_to(jnp.arange(t), (b, t)), valid_BxT.astype(jnp.float32)
  valid_f = valid_BxT.astype(jnp.float32)
  _, idx_BxN = jax.lax.top_k(jax.random.uniform(key, (b, t)) + valid_f, n)
  picked_BxN = jnp.take_along_axis(valid_f, idx_BxN, 1)
  scale_Bx1 = valid_f.sum(1, keepdims=True) / jnp.maximum(picked_BxN.sum(1, keepdims=True), 1.0)
  return idx_BxN, picked_BxN * scale_Bx1


def at_positions(x_BxTx: jax.Array, idx_BxN: jax.Array) -> jax.Array:
  """``x[b, idx[b, n], ...]``: each row's values at its positions from :func:`sample_positions`."""
  return jnp.take_along_axis(x_BxTx, idx_BxN.reshape(idx_BxN.shape + (1,) * (x_BxTx.ndim - 2)), 1)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  warm = max(min(cfg.warmup_steps, total_steps - 1), 0)
  decay_steps = max(total_steps - warm, 1)
  end = cfg.lr * cfg.min_lr_ratio
  if cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
  elif cfg.schedule == "linear":
    decay = optax.linear_schedule(cfg.lr, end, decay_steps)
  else:
    decay = optax.constant_schedule(cfg.lr)
  sched = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warm), decay], [warm]) if warm else decay
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


@dataclasses.dataclass
class TrainResult:
  module: nnx.Module
  steps: int
  tokens: int
  resumed_from: int | None
  last_eval: dict
  seconds: float


def batch_rows_at(step: int, num_rows: int, batch: int, seed: int) -> np.ndarray:
  """Row indices of the batch at global ``step`` (epoch-wise permutations, remainder dropped)."""
  per_epoch = num_rows // batch
  epoch, i = divmod(step, per_epoch)
  order = np.random.default_rng([seed, epoch]).permutation(num_rows)
  return np.sort(order[i * batch:(i + 1) * batch])


def _read_batch(shards: FeatureShards, rows, keys, mesh=None) -> dict:
  """The feature-cache ``rows`` (indices) as device arrays, bfloat16 widened, their rows over the
  mesh's ``data`` axis; with several processes each reads only the rows its devices hold."""
  mine = parallel.local_rows(len(rows), mesh)
  part = shards.rows(np.asarray(rows)[mine], keys)
  return {k: parallel.shard_batch(np.asarray(v.astype(np.float32) if v.dtype.kind == "V" or
                                             v.dtype.name == "bfloat16" else v), mesh, len(rows))
          for k, v in part.items()}


def place_optimizer_state(tree, params, mesh):
  """``tree`` (an optimizer state) with each array laid out as the parameter it mirrors (the
  one whose flat name ends its own), other arrays replicated over ``mesh``; unchanged without a
  mesh."""
  if mesh is None:
    return tree
  by_name = {".".join(str(p) for p in path): v.get_value().sharding
             for path, v in nnx.to_flat_state(params)}

  def put(path, x):
    if not isinstance(x, jax.Array):
      return x
    name = parallel.flat_name(path).removesuffix(".value")
    match = next((sh for n, sh in by_name.items() if name == n or name.endswith("." + n)), None)
    if match is None or getattr(match, "mesh", None) is None:
      match = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put(x, match)

  return jax.tree_util.tree_map_with_path(put, tree)


def make_steps(task: Task, graphdef, tx: optax.GradientTransformation):
  """The jitted ``train_step(params, opt_state, rest, frozen, batch, key) -> (params, opt_state,
  metrics, tokens)`` (``tokens``: the batch's real tokens, its nonzero ``segments``, counted on
  the devices that hold them, 0 for a batch without segments) and ``eval_step(params, rest,
  frozen, batch) -> metrics`` of ``task`` (its module split as ``nnx.split(module, nnx.Param,
  ...)`` gave ``graphdef``)."""

  def loss_fn(params, rest, frozen, batch, key, train):
    return task.loss(nnx.merge(graphdef, params, rest), frozen, batch, key, train)

  @jax.jit
  def train_step(params, opt_state, rest, frozen, batch, key):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, rest, frozen, batch, key, True)
    updates, opt_state = tx.update(grads, opt_state, params)
    tokens = jnp.sum(batch["segments"] > 0) if "segments" in batch else jnp.zeros((), jnp.int32)
    return (optax.apply_updates(params, updates), opt_state,
            dict(metrics, loss=loss, grad_norm=optax.global_norm(grads)), tokens)

  @jax.jit
  def eval_step(params, rest, frozen, batch):
    loss, metrics = loss_fn(params, rest, frozen, batch, jax.random.key(0), False)
    return dict(metrics, loss=loss)

  return train_step, eval_step


def _fuse_stacked_rows(tree, orders: dict[str, np.ndarray]):
  """``tree`` (parameters, optimizer state) restored from a checkpoint that stacks q, k, v and
  gate, up by rows, in the fused row order of ``orders`` (flat parameter name -> order): each
  array whose name ends with one of those names (moments too) is permuted by rows, keeping its
  layout over the devices."""
  def fix(path, x):
    name = parallel.flat_name(path).removesuffix(".value")
    order = next((o for n, o in orders.items() if name == n or name.endswith("." + n)), None)
    if order is None or np.ndim(x) == 0 or np.shape(x)[0] != len(order):
      return x
    rows = fuse_rows(parallel.to_host(x), order)
    if not isinstance(x, jax.Array):
      return rows
    return jax.make_array_from_callback(rows.shape, x.sharding, lambda index: rows[index])
  return jax.tree_util.tree_map_with_path(fix, tree)


def train(task: Task, data: FeatureShards, heldout: FeatureShards | None, run_dir: str,
          loop: LoopConfig = LoopConfig(), optim: OptimConfig = OptimConfig(), *,
          progress: bool = True, extra_meta: dict | None = None,
          eval_hook: Callable[[nnx.Module], dict] | None = None, mesh=None) -> TrainResult:
  """Trains ``task`` on ``data``; ``eval_hook(module)`` adds metrics at each evaluation (e.g.
  acceptance measured by decoding held-out prompts).

  ``mesh`` (a :class:`jax.sharding.Mesh`, None: one device): each batch's rows are split over
  its ``data`` axis, the parameters and the optimizer state laid out by the partition rules
  (:mod:`eagle_jax.parallel`: FSDP over ``fsdp``, heads and hidden units over ``tensor``), the
  frozen target arrays likewise; checkpoints are saved sharded and restore onto whatever mesh
  the resumed run has."""
  with parallel.use_mesh(mesh):
    return _train(task, data, heldout, run_dir, loop, optim, progress, extra_meta, eval_hook, mesh)


def _train(task, data, heldout, run_dir, loop, optim, progress, extra_meta, eval_hook, mesh):
  if data.num_rows < loop.batch_rows:
    raise EagleJaxError(f"{data.root}: {data.num_rows} rows, fewer than batch_rows={loop.batch_rows}")
  if heldout is not None and 0 < min(loop.eval_rows, heldout.num_rows) < loop.batch_rows:
    raise EagleJaxError(f"held-out evaluation runs in whole batches of loop.batch_rows={loop.batch_rows}, "
                        f"but it has {min(loop.eval_rows, heldout.num_rows)} rows (loop.eval_rows="
                        f"{loop.eval_rows}, {heldout.num_rows} held-out rows); raise them or set "
                        "loop.eval_rows=0")
  per_epoch = data.num_rows // loop.batch_rows
  total = max(int(round(loop.epochs * per_epoch)), 1)
  module = task.init_module(nnx.Rngs(loop.seed))
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  tx = make_optimizer(optim, total)
  frozen = task.frozen
  if mesh is not None:
    params, rest, frozen = parallel.place(params, mesh), parallel.place(rest, mesh), parallel.place(frozen, mesh)
  opt_state = place_optimizer_state(tx.init(params), params, mesh)
  train_step, eval_step = make_steps(task, graphdef, tx)

  os.makedirs(run_dir, exist_ok=True)
  mngr = ocp.CheckpointManager(
      os.path.abspath(os.path.join(run_dir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=loop.keep_checkpoints, create=True))
  step, tokens, resumed = 0, 0, None
  if mngr.latest_step() is not None:
    resumed = mngr.latest_step()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": opt_state})
    got = mngr.restore(resumed, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    params, opt_state = got["state"]["params"], got["state"]["opt"]
    if got["meta"].get("fused_rows") != ROW_LAYOUT:  # saved with q, k, v (gate, up) stacked
      params, opt_state = _fuse_stacked_rows((params, opt_state), fused_row_orders(module))
    step, tokens = int(got["meta"]["step"]), int(got["meta"]["tokens"])
    if got["meta"]["total_steps"] != total:
      raise EagleJaxError(f"{run_dir}: checkpoint was made for {got['meta']['total_steps']} steps, "
                          f"this config gives {total}; use a new run folder")
  metrics_path = os.path.join(run_dir, "metrics.jsonl")
  writer = parallel.is_writer()  # with several processes, process 0 logs the metrics
  if writer:
    _truncate_metrics(metrics_path, step)
  fault = int(os.environ.get(FAULT_ENV, "-1"))
  base_key = jax.random.key(loop.seed)
  bar = tqdm(total=total, initial=step, unit="step", disable=not progress, desc="train")
  last_eval: dict = {}
  t_start, seconds = time.perf_counter(), 0.0

  def evaluate() -> dict:
    if heldout is None:
      return {}
    n = min(loop.eval_rows, heldout.num_rows)
    sums: dict[str, float] = {}
    batches = 0
    for i in range(0, n - loop.batch_rows + 1, loop.batch_rows):
      m = eval_step(params, rest, frozen,
                    _read_batch(heldout, range(i, i + loop.batch_rows), task.keys, mesh))
      for k, v in m.items():
        sums[k] = sums.get(k, 0.0) + float(v)
      batches += 1
    out = {f"heldout_{k}": v / max(batches, 1) for k, v in sums.items()}
    if eval_hook is not None:
      out.update(eval_hook(nnx.merge(graphdef, params, rest)))
    return out

  def checkpoint():
    meta = {"step": step, "tokens": tokens, "total_steps": total, "fused_rows": ROW_LAYOUT,
            "epoch": step // per_epoch, "batch_in_epoch": step % per_epoch, **(extra_meta or {})}
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt": opt_state}),
        meta=ocp.args.JsonSave(meta)))

  with open(metrics_path if writer else os.devnull, "a") as log:
    while step < total:
      rows = batch_rows_at(step, data.num_rows, loop.batch_rows, loop.seed)
      batch = _read_batch(data, rows, task.keys, mesh)
      t0 = time.perf_counter()
      params, opt_state, m, n = train_step(params, opt_state, rest, frozen, batch,
                                           jax.random.fold_in(base_key, step))
      m = {k: float(v) for k, v in m.items()}
      seconds += time.perf_counter() - t0
      step += 1
      tokens += int(n)  # a replicated scalar: no process gathers the batch itself
      bar.update(1)
      bar.set_postfix(loss=f"{m['loss']:.3f}", tok_per_s=f"{tokens / max(seconds, 1e-9):.0f}")
      record = None
      if step % loop.log_every == 0 or step == total:
        record = {"step": step, "tokens": tokens, **{k: round(v, 5) for k, v in m.items()}}
      if (loop.eval_every and step % loop.eval_every == 0) or step == total:
        last_eval = evaluate()
        record = {"step": step, "tokens": tokens, **(record or {}),
                  **{k: round(v, 5) for k, v in last_eval.items()}}
      if record:
        log.write(json.dumps(record) + "\n")
        log.flush()
      if step % loop.ckpt_every == 0 or step == total:
        checkpoint()
      if step == fault:
        mngr.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
  if not last_eval:  # a finished run re-run: nothing trained, report its evaluation again
    last_eval = evaluate()
  mngr.wait_until_finished()
  mngr.close()
  bar.close()
  module = nnx.merge(graphdef, params, rest)
  return TrainResult(module=module, steps=step, tokens=tokens, resumed_from=resumed,
                     last_eval=last_eval, seconds=time.perf_counter() - t_start)


def _parse(line: str):
  try:
    return json.loads(line)
  except json.JSONDecodeError:  # a line torn by a kill
    return None


def _truncate_metrics(path: str, step: int) -> None:
  """Drops records written after the checkpoint a resumed run restarts from (atomically)."""
  if not os.path.isfile(path):
    return
  with open(path) as f:
    lines = [l for l in f if (r := _parse(l)) is not None and r.get("step", 0) <= step]
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.writelines(lines)
  os.replace(tmp, path)


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [r for l in f if (r := _parse(l)) is not None]
