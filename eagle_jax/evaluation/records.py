"""An experiment's records on disk: each (method, temperature) unit's records with the key
that produced them (a unit whose key still matches is reused), vanilla baselines kept per
timing process, and the measured costs (verify-cost curve, each method's draft step).

With several processes (:mod:`eagle_jax.parallel`), process 0 alone reads and writes these
files: what it reads is given to every process (:func:`eagle_jax.parallel.share`), so that all
of them skip the same cached units and time the same programs, whether or not they see the
same filesystem.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax

from eagle_jax.configs import to_dict
from eagle_jax.decoding.costs import curve_from_json, draft_cost_ms, sizes_up_to, verify_cost_curve
from eagle_jax.decoding.speculative import is_chain, loop_widths, verify_widths
from eagle_jax.drafters import shipped
from eagle_jax.drafters.storage import read_meta
from eagle_jax.parallel import is_writer, share


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def write_atomic(path, text):
  """Writes ``text`` to ``path`` through a temporary file (process 0 only)."""
  if not is_writer():
    return
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def machine() -> dict:
  """Where timings were taken: records timed elsewhere are not mixed into one speedup."""
  return {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
          "cpus": os.cpu_count()}


# drafter.json fields that time the training process, not properties of the drafter: a rerun
# of the same training (on a fresh machine) keeps the records made with the first
_TRAINING_TIME = ("train_seconds",)


def checkpoint_key(checkpoint: str | None) -> dict | None:
  """A trained checkpoint as a cache key: its folder and its ``drafter.json`` (steps, held-out
  figures, tuned budget; not how long it trained), so that retraining to other weights or
  ``eagle-jax tune`` invalidates the records made with it."""
  if checkpoint is None:
    return None
  meta = {k: v for k, v in read_meta(checkpoint).items() if k not in _TRAINING_TIME}
  return {"path": _portable(checkpoint), "meta": meta}


def _portable(checkpoint: str) -> str:
  """A shipped drafter's folder as ``shipped:<target>/<kind>``, wherever the package lies (so
  that records kept in the repository stay valid in another clone); other paths as given."""
  folder, path = os.path.abspath(shipped.root() or os.sep), os.path.abspath(checkpoint)
  if shipped.root() and os.path.commonpath([folder, path]) == folder:
    return "shipped:" + os.path.relpath(path, folder).replace(os.sep, "/")
  return checkpoint


def prompts_key(questions) -> dict:
  """The questions' ids and a digest of their text and categories."""
  text = json.dumps([[q.question_id, q.category, list(q.turns)] for q in questions])
  return {"ids": [q.question_id for q in questions], "sha1": hashlib.sha1(text.encode()).hexdigest()}


_TIMING = {"repeats": 1, "interleave": False}  # their defaults
# settings that do not change a unit's records: which temperatures run, whether vanilla is
# timed again beside each process's methods
_NOT_KEYED = ("temperatures", "pair_timings")
_METHOD = {"budget": "tuned"}  # method fields newer than some records, at their defaults


def unit(out, cfg, method, temperature, checkpoint, prompts_key, stem=None):
  """``(records path, key)`` of one (method, temperature) evaluation. The key holds the
  evaluation settings but not the list of temperatures (adding one keeps the others' units) nor
  ``pair_timings``."""
  # the timing settings join the key only when set (records made before they existed stay valid)
  ev = {k: v for k, v in to_dict(cfg.eval).items()
        if k not in _NOT_KEYED and not (k in _TIMING and v == _TIMING[k])}
  # the published figures do not change what is measured; newer fields join when set
  meth = {k: v for k, v in to_dict(method).items()
          if k != "published" and not (k in _METHOD and v == _METHOD[k])}
  key = {"model": cfg.model, "method": meth, "checkpoint": checkpoint_key(checkpoint),
         "temperature": temperature, "eval": ev, "prompts": prompts_key,
         "machine": machine()}
  mesh = to_dict(getattr(cfg, "mesh", None))
  if mesh and any(v != 1 for v in mesh.values()):  # one device: records made before meshes stay valid
    key["mesh"] = mesh
  if getattr(cfg, "dtype", ""):
    key["dtype"] = cfg.dtype
  if stem:  # not a method's records (notebooks read records/<method>-T<temperature>.jsonl)
    return os.path.join(out, f"{stem}.jsonl"), key
  return os.path.join(out, "records", f"{method.name}-T{temperature}.jsonl"), key


def cached(path, key):
  """The records at ``path`` if their key file holds ``key``, else None (read by process 0,
  given to all)."""
  return share(lambda: _read_cached(path, key))


def _key_path(path):
  """The key file beside the records file ``path``."""
  return path[:-len(".jsonl")] + ".key.json"


def _lines(records) -> str:
  return "".join(json.dumps(r) + "\n" for r in records)


def _read_cached(path, key):
  try:
    with open(_key_path(path)) as f:
      return read_jsonl(path) if json.load(f) == json.loads(json.dumps(key)) else None
  except (OSError, ValueError):
    return None


def store(path, key, records):
  """Writes a finished unit's records and key (process 0 only); its partial file goes."""
  if not is_writer():
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  write_atomic(path, _lines(records))
  write_atomic(_key_path(path), json.dumps(key))
  for leftover in (_partial(path), _key_path(_partial(path))):
    if os.path.exists(leftover):
      os.remove(leftover)


def _partial(path):
  return path[:-len(".jsonl")] + ".partial.jsonl"


def resume(path, key, fresh: bool = False) -> list:
  """The records an interrupted evaluation of the unit ``(path, key)`` wrote before it was
  stopped (:func:`append`), in prompt order; [] when there are none under this key (or with
  ``fresh``: the unit starts over). The partial file is left holding exactly these (a line torn
  by a kill is dropped), so that appending continues it (process 0 reads and writes; every
  process gets the records)."""
  return share(lambda: _resume(path, key, fresh))


def _resume(path, key, fresh) -> list:
  part, done = _partial(path), []
  if not fresh:
    try:
      with open(_key_path(part)) as f:
        same = json.load(f) == json.loads(json.dumps(key))
      with open(part) as f:
        for line in f if same else ():
          try:
            done.append(json.loads(line))
          except ValueError:  # the line a kill cut short, and nothing after it
            break
    except (OSError, ValueError):
      done = []
  if is_writer():
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(_key_path(part), json.dumps(key))
    write_atomic(part, _lines(done))
  return done


def append(path, records) -> None:
  """Appends one batch's records to the partial file :func:`resume` started (process 0 only),
  synced to disk, so that a killed evaluation resumes after the last batch it finished."""
  if not is_writer():
    return
  with open(_partial(path), "a") as f:
    f.write(_lines(records))
    f.flush()
    os.fsync(f.fileno())


def sessions(records) -> set:
  return {r.get("session") for r in records}


def baseline_path(out, vanilla_unit, session: str) -> str:
  stem = os.path.basename(vanilla_unit[0])[:-len(".jsonl")]
  return os.path.join(out, "baselines", f"{stem}-{session}.jsonl")


def keep_baseline(out, vanilla_unit, records) -> None:
  """Keeps vanilla's records of earlier processes under ``baselines/`` (one file per timing
  process, merged with what that file holds) before vanilla is timed again, so the records
  those processes timed stay paired with their own vanilla."""
  for session in sessions(records or []) - {None}:
    path = baseline_path(out, vanilla_unit, session)
    mine = {(r["id"], r["turn"]): r for r in cached(path, vanilla_unit[1]) or []}
    mine.update({(r["id"], r["turn"]): r for r in records if r.get("session") == session})
    store(path, vanilla_unit[1], list(mine.values()))


def baseline(out, vanilla_unit, vanilla_records, records):
  """For each of ``records``, vanilla's record of the same prompt timed by the same process (in
  the current vanilla records, or kept under ``baselines/`` with the same evaluation key); the
  current vanilla's record of that prompt where that process's is not kept."""
  current = {(r["id"], r["turn"]): r for r in vanilla_records}
  by_session = {}
  for session in sessions(records) - sessions(vanilla_records) - {None}:
    kept = cached(baseline_path(out, vanilla_unit, session), vanilla_unit[1]) or []
    by_session[session] = {(r["id"], r["turn"]): r for r in kept}
  paired = []
  for r in records:
    prompt = (r["id"], r["turn"])
    paired.append(by_session.get(r.get("session"), {}).get(prompt) or current[prompt])
  return paired


def load_costs(path, model) -> dict:
  """The costs measured for ``model`` on this machine so far (process 0's file, given to all)."""
  return share(lambda: _read_costs(path, model))


def _read_costs(path, model) -> dict:
  try:
    with open(path) as f:
      costs = json.load(f)
    if costs.get("model") == model and costs.get("machine") == machine():
      return costs
  except (OSError, ValueError, AttributeError):
    pass
  return {"model": model, "machine": machine(), "verify_cost_ms": {}, "draft_ms": {}, "num_nodes": {}}


def describe(drafter) -> str:
  """What a drafter drafts each step, in words (``chain of 8``, ``dynamic top_k=8 ...``)."""
  tree = getattr(drafter, "tree", "chain")
  widths = verify_widths(drafter)
  text = (f"chain of {drafter.num_nodes}" if tree == "chain" and len(widths) == 1 else
          f"chain of {', '.join(map(str, widths))} (cost-aware)" if tree == "chain" else
          f"static {drafter.num_nodes} nodes, depth {drafter.max_depth}" if tree is not None
          else f"dynamic top_k={drafter.top_k} depth={drafter.depth} "
               f"total_tokens={drafter.total_tokens}")
  if getattr(drafter, "draft_vocab", 0):
    text += f", {drafter.draft_vocab}-token draft vocab"
  return text


def measure_costs(costs, name, target, drafter, dparams, prompt, sizes=()) -> None:
  """Verify-cost curve (once, over the largest tree's sizes and ``sizes``) and the method's
  timed draft step, for predicted speedups; what it drafts, for the summary."""
  # the curve (also from costs.json of an interrupted run) covers the largest tree so far;
  # a larger one times only the sizes it adds
  curve = curve_from_json(costs["verify_cost_ms"])
  wanted = set(sizes_up_to(0 if drafter is None else drafter.num_nodes)) | set(sizes)
  missing = sorted(n for n in wanted if n not in curve)
  if missing:
    curve.update(verify_cost_curve(target, sizes=missing))
  costs["verify_cost_ms"] = {str(k): curve[k] for k in sorted(curve)}
  if drafter is not None:
    costs["draft_ms"][name] = round(draft_cost_ms(drafter, dparams, target, prompt), 3)
    costs["num_nodes"][name] = drafter.num_nodes
    costs.setdefault("widths", {})[name] = list(verify_widths(drafter))
    costs.setdefault("chain", {})[name] = is_chain(drafter)
    costs.setdefault("loop_widths", {})[name] = list(loop_widths(drafter))
    costs.setdefault("max_depth", {})[name] = drafter.max_depth
    costs.setdefault("tree", {})[name] = describe(drafter)
    if getattr(drafter, "costs", ()):
      costs.setdefault("width_costs", {})[name] = dict(zip(map(str, verify_widths(drafter)),
                                                           drafter.costs))
