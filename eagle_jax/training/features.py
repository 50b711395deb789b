"""Target feature cache: run the target once over the training data, store what drafters learn from.

Conversations are encoded with the target's chat template (loss mask on assistant tokens),
packed into fixed rows of ``row_len`` tokens (several conversations per row, first fit within a
shard, see :func:`pack_shard`; each attends only to itself: block-diagonal causal mask,
positions restart per conversation),
and run through the target in batches of rows by one jit-compiled forward. Each shard
(``shard_XXXXX/``, ``rows_per_shard`` rows) holds:

- ``tokens``, ``positions``, ``segments`` (0 = padding), ``loss_mask``: ``[R, T]``
- ``target_argmax`` ``[R, T]``: the target's greedy next token at each position
- ``hidden`` ``[R, T, D]``: the top hidden state (as fed to the LM head), bfloat16
- ``layers`` ``[R, T, L, D]``: Hugging Face ``hidden_states`` at ``layers`` (EAGLE-3), bfloat16

bfloat16 arrays are stored as ``uint16`` bit patterns (``.npy``). ``manifest.json`` lists
finished shards with the conversation range each consumed; a killed extraction resumes after
the last finished shard (a shard is written to a temporary folder and renamed when complete).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from eagle_jax import parallel
from eagle_jax.errors import EagleJaxError

ARRAYS = ("tokens", "positions", "segments", "loss_mask", "target_argmax", "hidden", "layers")
_BF16 = ("hidden", "layers")


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  model: str
  row_len: int = 512
  max_len: int = 512  # tokens per conversation (truncated)
  layers: tuple[int, ...] = ()
  rows_per_shard: int = 64
  batch_rows: int = 8
  dtype: str = ""  # the target's, if not its checkpoint's own

  def key(self) -> str:
    fields = dataclasses.asdict(self)
    if not fields["dtype"]:  # caches made before the field existed keep their key
      del fields["dtype"]
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def pack_shard(encoded: Sequence[tuple[np.ndarray, np.ndarray]], start: int, row_len: int,
               max_rows: int) -> tuple[list[dict], int | None]:
  """First-fit packing of the examples ``encoded[start:]`` (each truncated to ``row_len``) into
  at most ``max_rows`` rows: each example goes into the first row with room for it, a new row
  opens while fewer than ``max_rows`` are open, and the shard closes at the first example that
  fits nowhere. Returns ``(row arrays dicts, index of that example)``, or ``None`` as the index
  when the examples ran out. A shard thus holds a contiguous range of examples, so a resumed
  extraction starts at the index its last finished shard recorded.

  Why first fit: most ShareGPT conversations fill a 512-token row on their own; closing a row
  at the first example that does not fit left 5.5% of the default `full` cache's positions as
  padding, and letting later short examples fill earlier rows' gaps roughly halves that (a
  simulation over the conversation lengths of that cache's 2,048 rows: 94.5% -> 97.3% filled)."""
  rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
  free: list[int] = []
  i = start
  while i < len(encoded):
    tok, mask = encoded[i]
    tok, mask = tok[:row_len], mask[:row_len]
    j = next((r for r, f in enumerate(free) if f >= len(tok)), None)
    if j is None:
      if len(rows) >= max_rows:
        return [_row(parts, row_len) for parts in rows], i
      rows.append([])
      free.append(row_len)
      j = len(rows) - 1
    rows[j].append((tok, mask))
    free[j] -= len(tok)
    i += 1
  return [_row(parts, row_len) for parts in rows], None


def batch_arrays(keys, rows: int, row_len: int, hidden_size: int, num_layers: int) -> dict:
  """A zero batch of ``rows`` feature-cache rows with the arrays ``keys`` names, in the shapes
  and dtypes the trainer hands a task (bfloat16 features widened to float32): for lowering a
  training step without a cache."""
  shapes = {"tokens": ((), np.int32), "positions": ((), np.int32), "segments": ((), np.int32),
            "loss_mask": ((), bool), "target_argmax": ((), np.int32),
            "hidden": ((hidden_size,), np.float32),
            "layers": ((num_layers, hidden_size), np.float32)}
  unknown = [k for k in keys if k not in shapes]
  if unknown:
    raise EagleJaxError(f"no feature-cache array named {unknown[0]!r}")
  return {k: np.zeros((rows, row_len) + shapes[k][0], shapes[k][1]) for k in keys}


def _row(parts, row_len):
  tokens = np.zeros(row_len, np.int32)
  positions = np.zeros(row_len, np.int32)
  segments = np.zeros(row_len, np.int32)
  loss = np.zeros(row_len, bool)
  o = 0
  for s, (tok, mask) in enumerate(parts, 1):
    n = len(tok)
    tokens[o:o + n], positions[o:o + n], segments[o:o + n], loss[o:o + n] = tok, np.arange(n), s, mask
    o += n
  return dict(tokens=tokens, positions=positions, segments=segments, loss_mask=loss)


def segment_mask(segments_BxT: jax.Array) -> jax.Array:
  """Block-diagonal causal visibility ``[B, T, T]`` of packed rows (padding sees itself)."""
  t = segments_BxT.shape[1]
  same = (segments_BxT[:, :, None] == segments_BxT[:, None, :]) & (segments_BxT[:, :, None] > 0)
  return (same & jnp.tril(jnp.ones((t, t), bool))[None]) | jnp.eye(t, dtype=bool)[None]


def _forward_fn(graphdef, layers):
  @jax.jit
  def fwd(state, tokens, positions, segments):
    model = nnx.merge(graphdef, state)
    out = model(tokens, positions, None, mask_BxTxT=segment_mask(segments), return_layers=layers,
                with_logits=False, causal=True)
    stack = jnp.stack(out.layer_hiddens, 2) if layers else jnp.zeros(tokens.shape + (0, 1))
    return (model.greedy_tokens(out.hidden_BxTxD),
            out.hidden_BxTxD.astype(jnp.bfloat16), stack.astype(jnp.bfloat16))
  return fwd


def _write_shard(root: str, index: int, arrays: dict) -> str:
  name = f"shard_{index:05d}"
  if not parallel.is_writer():  # several processes: process 0 writes
    return name
  tmp = os.path.join(root, f"{name}.tmp{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  for k, v in arrays.items():
    if k in _BF16:
      v = v.view(np.uint16)
    with open(os.path.join(tmp, k + ".npy"), "wb") as f:
      np.save(f, v)
      f.flush()
      os.fsync(f.fileno())  # on disk before the rename and the manifest make the shard visible
  final = os.path.join(root, name)
  shutil.rmtree(final, ignore_errors=True)
  os.rename(tmp, final)
  return name


def read_manifest(root: str) -> dict:
  path = os.path.join(root, "manifest.json")
  if not os.path.isfile(path):
    raise EagleJaxError(f"{root}: no feature cache here (manifest.json missing); run feature "
                        "extraction first (eagle-jax train CONFIG does it)")
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise EagleJaxError(f"{path}: corrupt manifest ({e.msg})") from None


def _save_manifest(root: str, manifest: dict) -> None:
  if not parallel.is_writer():
    return
  tmp = os.path.join(root, f"manifest.json.tmp{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(root, "manifest.json"))


_matmul = jax.jit(lambda a, b: a @ b)


def matmul_flops_per_s(m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 5) -> float:
  """Dense fp32 matmul FLOP/s this machine reaches under jit (the MFU denominator)."""
  a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
  _matmul(a, b).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(repeats):
    _matmul(a, b).block_until_ready()
  return 2 * m * k * n * repeats / (time.perf_counter() - t0)


def model_flops_per_token(config, context: float) -> float:
  """Forward FLOPs per token: 2 x matmul parameters (LM head included) + attention."""
  c = config
  d, f, h, kv, dh = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
  per_layer = d * (h + 2 * kv) * dh + h * dh * d + 3 * d * f
  return 2 * (c.num_layers * per_layer + d * c.vocab_size) + 4 * c.num_layers * h * dh * context


def extract_features(model, encoded: Sequence[tuple[np.ndarray, np.ndarray]], root: str,
                     spec: FeatureSpec, *, max_rows: int | None = None, progress: bool = True) -> dict:
  """Extracts (or resumes extracting) features of ``encoded`` examples into ``root``.

  ``encoded``: ``(tokens, loss_mask)`` per conversation, in a fixed order. Returns the manifest,
  with throughput and model-FLOP utilisation of the run (``last_run``). One writer at a time:
  a second process waits on ``root/.lock`` and then sees the first one's shards.

  ``max_rows`` stops after that many rows (a later call with a larger budget extends the cache).
  Extended at a multiple of ``rows_per_shard``, the cache equals one extracted in one go; cut
  inside a shard, its last shard packs the same conversations into fewer rows, so the extended
  cache holds the same conversations in another layout.
  """
  os.makedirs(root, exist_ok=True)
  if jax.process_count() > 1:
    # the processes of one run extract together (each pass spans all their devices), process 0
    # writes; the others wait for its files before they read them
    manifest = _extract_locked(model, encoded, root, spec, max_rows, progress and parallel.is_writer())
    multihost_utils.sync_global_devices(f"features {root}")
    return manifest
  with open(os.path.join(root, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return _extract_locked(model, encoded, root, spec, max_rows, progress)


def _extract_locked(model, encoded, root, spec, max_rows, progress) -> dict:
  mpath = os.path.join(root, "manifest.json")
  manifest = read_manifest(root) if os.path.isfile(mpath) else None
  if manifest is not None and manifest["spec_key"] != spec.key():
    raise EagleJaxError(f"{root}: holds features for a different setting ({manifest['spec']}); "
                        "use another folder or delete it")
  if manifest is None:
    manifest = {"spec": dataclasses.asdict(spec), "spec_key": spec.key(), "shards": [],
                "complete": False, "exhausted": False}
  total_rows = sum(s["rows"] for s in manifest["shards"])
  if manifest.get("exhausted") or (max_rows is not None and total_rows >= max_rows):
    if not manifest["complete"]:  # killed after the last shard, before it was marked
      manifest["complete"] = True
      _save_manifest(root, manifest)
    return manifest
  start = manifest["shards"][-1]["next_example"] if manifest["shards"] else 0
  budget = None if max_rows is None else max_rows - total_rows
  graphdef, state = nnx.split(model)
  # rows over the current mesh's data axis, if any (eagle_jax.parallel)
  rows_shape = (spec.batch_rows, spec.row_len)
  shape = jax.ShapeDtypeStruct(rows_shape, jnp.int32, sharding=parallel.batch_sharding(rows_shape))
  fwd = _forward_fn(graphdef, spec.layers).lower(state, shape, shape, shape).compile()  # not timed
  bar = tqdm(total=max_rows, initial=total_rows, unit="row", disable=not progress,
             desc="features")
  rate = _RateLog(matmul_flops_per_s())
  tokens_done = 0
  while start is not None and (budget is None or budget > 0):
    shard_rows = spec.rows_per_shard if budget is None else min(spec.rows_per_shard, budget)
    rows, next_example = pack_shard(encoded, start, spec.row_len, shard_rows)
    if not rows:
      break
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    outs = {"target_argmax": [], "hidden": [], "layers": []}
    for i in range(0, len(rows), spec.batch_rows):
      sl = {k: v[i:i + spec.batch_rows] for k, v in batch.items()}
      n = len(sl["tokens"])
      pad = spec.batch_rows - n  # keep one compiled shape
      args = [parallel.shard_batch(np.pad(sl[k], ((0, pad), (0, 0))))
              for k in ("tokens", "positions", "segments")]
      t0 = time.perf_counter()
      am, hid, lay = jax.block_until_ready(fwd(state, *args))
      rate.add(time.perf_counter() - t0, matmul_flops_per_s())
      tokens_done += int((sl["segments"] > 0).sum())
      outs["target_argmax"].append(parallel.to_host(am)[:n])
      outs["hidden"].append(parallel.to_host(hid)[:n])
      outs["layers"].append(parallel.to_host(lay)[:n])
      bar.update(n)
      bar.set_postfix(tok_per_s=f"{tokens_done / max(rate.seconds, 1e-9):.0f}")
    batch.update({k: np.concatenate(v) for k, v in outs.items()})
    name = _write_shard(root, len(manifest["shards"]), batch)
    manifest["shards"].append({"name": name, "rows": len(rows),
                               "next_example": len(encoded) if next_example is None else next_example,
                               "tokens": int((batch["segments"] > 0).sum())})
    manifest["exhausted"] = next_example is None
    manifest["complete"] = False  # until the budget is reached (a reader must not use it yet)
    _save_manifest(root, manifest)
    start = next_example
    if budget is not None:
      budget -= len(rows)
  if start is None or start >= len(encoded):
    manifest["exhausted"] = True
  bar.close()
  manifest["complete"] = True
  _save_manifest(root, manifest)
  context, seconds = spec.max_len / 2, rate.seconds
  flops = model_flops_per_token(model.config, context) * tokens_done
  manifest["last_run"] = {
      "tokens": tokens_done, "seconds": round(seconds, 2),
      "tokens_per_s": round(tokens_done / max(seconds, 1e-9), 1),
      "model_flops_per_s": round(flops / max(seconds, 1e-9) / 1e9, 2),
      **rate.summary(),
      "mfu": round(flops / max(rate.achievable_flops, 1e-9), 3),
      "mfu_note": "forward FLOPs (2 x matmul params incl. LM head + attention at mean context "
                  "max_len/2) over what the jitted fp32 2048x576x1536 matmul reaches in the same "
                  "time: its rate measured before and after every batch, the larger of the two "
                  "per batch, weighted by the batch's time; GFLOP/s"}
  _save_manifest(root, manifest)
  return manifest


class _RateLog:
  """The MFU denominator of an extraction: the matmul rate measured between batches.

  Why per batch: on a shared machine the rate this measures moved between 92 and 164 GFLOP/s
  within one minute (and 145-420 between sessions), so one measurement before and after a
  37-minute extraction did not describe the time in between. Each batch's time is credited
  with the larger of the rates measured just before and just after it (the conservative
  choice: a larger denominator), and the run's achievable FLOPs are their time-weighted sum.
  A measurement takes about 0.1 s against several seconds per batch."""

  def __init__(self, first: float):
    self.last, self.rates = first, [first]
    self.achievable_flops, self.seconds = 0.0, 0.0

  def add(self, seconds: float, rate_after: float) -> None:
    self.achievable_flops += seconds * max(self.last, rate_after)
    self.seconds += seconds
    self.last = rate_after
    self.rates.append(rate_after)

  def summary(self) -> dict:
    mean = self.achievable_flops / self.seconds if self.seconds else self.last
    return {"matmul_flops_per_s": round(mean / 1e9, 2),
            "matmul_flops_per_s_range": [round(min(self.rates) / 1e9, 2),
                                         round(max(self.rates) / 1e9, 2)]}


class FeatureShards:
  """Read access to a finished feature cache: ``rows(idx)`` gathers rows across shards.

  ``max_rows`` limits it to the first rows (a smaller budget reusing a larger cache).
  """

  def __init__(self, root: str, max_rows: int | None = None):
    self.root = root
    self.manifest = read_manifest(root)
    if not self.manifest.get("complete"):
      raise EagleJaxError(f"{root}: feature extraction did not finish; re-run it to resume")
    self.spec = self.manifest["spec"]
    offsets = np.cumsum([0] + [s["rows"] for s in self.manifest["shards"]])
    if max_rows is not None and max_rows < offsets[-1]:
      keep = int(np.searchsorted(offsets, max_rows, side="left"))
      self.manifest = dict(self.manifest, shards=self.manifest["shards"][:keep])
      offsets = np.minimum(offsets[:keep + 1], max_rows)
    self._offsets = offsets
    self._cache: dict[str, dict[str, np.ndarray]] = {}

  @property
  def num_rows(self) -> int:
    return int(self._offsets[-1])

  @property
  def num_tokens(self) -> int:
    full = self._offsets[1:] - self._offsets[:-1] == [s["rows"] for s in self.manifest["shards"]]
    n = sum(s["tokens"] for s, f in zip(self.manifest["shards"], full) if f)
    if not full.all():  # the last shard is used in part
      rows = range(int(self._offsets[-2]), int(self._offsets[-1]))
      n += int((self.rows(rows, ("segments",))["segments"] > 0).sum())
    return n

  def _shard(self, i: int) -> dict[str, np.ndarray]:
    name = self.manifest["shards"][i]["name"]
    if name not in self._cache:
      arrays = {}
      for k in ARRAYS:
        path = os.path.join(self.root, name, k + ".npy")
        try:
          a = np.load(path, mmap_mode="r")
        except (OSError, ValueError, EOFError) as e:  # EOFError: a zero-byte file
          raise EagleJaxError(f"{path}: unreadable feature shard ({e})") from None
        arrays[k] = a.view(ml_dtypes.bfloat16) if k in _BF16 else a
      self._cache[name] = arrays
    return self._cache[name]

  def rows(self, idx: Sequence[int], keys: Sequence[str] = ARRAYS) -> dict[str, np.ndarray]:
    idx = np.asarray(idx)
    shard = np.searchsorted(self._offsets, idx, side="right") - 1
    out = {k: [] for k in keys}
    for i, s in zip(idx, shard):
      arrays = self._shard(int(s))
      for k in keys:
        out[k].append(np.asarray(arrays[k][i - self._offsets[s]]))
    return {k: np.stack(v) for k, v in out.items()}
