"""``eagle-jax train CONFIG``: data -> feature cache -> trainer -> exported drafter.

A training config (:class:`TrainConfig`, YAML validated by :mod:`eagle_jax.configs`) names the
target, the drafter (eagle1, eagle3, medusa or draft-model), the data budget, the optimizer
and the loop. The feature cache lives in ``<runs_dir>/features/<model>-sharegpt-<key>.../``
and is shared by every drafter trained on the same target and data settings (its key does not
depend on the drafter); with ``data.replies: target`` the train rows come from a regenerated
dataset (:mod:`eagle_jax.training.regenerate`) and live in ``<model>-target<digest>-<key>.../``;
the run lives in ``<runs_dir>/<name>/`` (``checkpoints/``,
``metrics.jsonl``, ``config.yaml``, ``summary.json``) and its exported drafter in
``<runs_dir>/<name>/final/`` (:mod:`eagle_jax.drafters.storage`), which ``--drafter-ckpt`` accepts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Literal

import jax

from eagle_jax import parallel
from eagle_jax.configs import dump_config, from_dict, load_config, read_yaml, to_dict
from eagle_jax.decoding.speculative import speculative_generate
from eagle_jax.drafters import registry
from eagle_jax.drafters.eagle.head import default_fuse_layers
from eagle_jax.drafters.eagle.train import reply_token_counts
from eagle_jax.drafters.storage import final_folder, read_meta
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.registry import DEFAULT_MODEL, load_model
from eagle_jax.training.features import FeatureShards, FeatureSpec, extract_features
from eagle_jax.training.regenerate import read_regenerated, regenerated_manifest
from eagle_jax.training.settings import (
  DataConfig,
  DecodeEvalConfig,
  FeatureConfig,
  TuneConfig,
  heldout_prompts,
)
from eagle_jax.training.sharegpt import encode_conversation, load_sharegpt, split_heldout
from eagle_jax.training.trainer import LoopConfig, OptimConfig, train
from eagle_jax.model.transformer import shard
from eagle_jax.parallel import MeshSpec, make_mesh, use_mesh

DEFAULT_RUNS_DIR = "runs"
# each trainable kind's config section, in registry order (kinds may share one)
SECTIONS = {}
for _kind in registry.TRAINABLE:
  _t = registry.get(_kind).trainable
  SECTIONS.setdefault(_t.section, _t.config)


def _validate(cfg) -> None:
  check = registry.get(cfg.drafter).trainable.validate
  if check is not None:
    check(cfg)


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig",
    [("name", str), ("drafter", Literal[registry.TRAINABLE]), ("model", str, DEFAULT_MODEL),
     ("runs_dir", str, DEFAULT_RUNS_DIR), ("data", DataConfig, DataConfig()),
     ("features", FeatureConfig, FeatureConfig())]
    + [(name, config, config()) for name, config in SECTIONS.items()]
    + [("optim", OptimConfig, OptimConfig()), ("loop", LoopConfig, LoopConfig()),
       ("tune", TuneConfig, TuneConfig()), ("decode_eval", DecodeEvalConfig, DecodeEvalConfig()),
       # devices for feature extraction and training (eagle_jax.parallel); all ones: one device
       ("mesh", MeshSpec, MeshSpec()),
       # the target's parameters and activations for feature extraction ("": the checkpoint's)
       ("dtype", Literal["", "float32", "bfloat16", "float16"], "")],
    frozen=True, namespace={"validate": _validate, "__module__": __name__,
                            "__doc__": "A training config: the run, its target, the drafter kind, "
                                       "the shared sections and one section per trainable kind."})


class _Encoded:
  """Conversations encoded with the chat template on first access."""

  def __init__(self, tokenizer, conversations, max_len):
    self.tok, self.convs, self.max_len, self._memo = tokenizer, conversations, max_len, {}

  def __len__(self):
    return len(self.convs)

  def __getitem__(self, i):
    if i not in self._memo:
      self._memo = {i: encode_conversation(self.tok, self.convs[i].messages, self.max_len)}
    return self._memo[i]


def feature_caches(cfg: TrainConfig, lm, *, progress=True):
  """Extracts (or reuses) the train and held-out feature caches; returns their folders.

  With ``data.replies: target`` the train rows come from the regenerated conversations in
  ``data.regenerated``, cached under a name holding that dataset's content digest (a ShareGPT
  cache is never reused for it, nor one of another regenerated dataset); the held-out rows are
  the ShareGPT held-out ones, the very cache ``replies: sharegpt`` uses."""
  layers = cfg.features.layers or default_fuse_layers(lm.config.num_layers)
  if max(layers) > lm.config.num_layers:
    raise EagleJaxError(f"features.layers {list(layers)}: {cfg.model} has hidden_states 0..."
                        f"{lm.config.num_layers} ({lm.config.num_layers} layers)")
  spec = FeatureSpec(model=cfg.model, row_len=cfg.data.row_len, max_len=cfg.data.max_len,
                     layers=tuple(layers), rows_per_shard=cfg.features.rows_per_shard,
                     batch_rows=cfg.features.batch_rows, dtype=cfg.dtype)
  stem = os.path.basename(cfg.model.rstrip("/"))
  rest = f"{spec.key()}-split{cfg.data.split_seed}-held{cfg.data.heldout_fraction}"
  root = os.path.join(cfg.runs_dir, "features", f"{stem}-sharegpt-{rest}")
  dirs = {"train": os.path.join(root, "train"), "heldout": os.path.join(root, "heldout")}
  regenerated = None
  if cfg.data.replies == "target":
    regenerated = regenerated_manifest(cfg.data.regenerated, cfg.model)
    digest = regenerated["content_sha256"][:12]
    dirs["train"] = os.path.join(cfg.runs_dir, "features", f"{stem}-target{digest}-{rest}",
                                 "train")
  budget = {"train": cfg.data.train_rows or None, "heldout": cfg.data.heldout_rows}
  todo = [s for s in dirs if not _has_rows(dirs[s], budget[s])]
  if todo:
    convs = {}
    if regenerated is None or "heldout" in todo:
      sg = load_sharegpt()
      print(sg.summary())
      convs["train"], convs["heldout"] = split_heldout(sg.conversations, cfg.data.heldout_fraction,
                                                       cfg.data.split_seed)
    if regenerated is not None and "train" in todo:
      convs["train"] = _regenerated_training(cfg, regenerated)
    for split in todo:
      m = extract_features(lm.model, _Encoded(lm.tokenizer, convs[split], cfg.data.max_len),
                           dirs[split], spec, max_rows=budget[split], progress=progress)
      if m.get("last_run"):
        print(f"features[{split}]: {json.dumps(m['last_run'])}")
  return dirs


def _regenerated_training(cfg: TrainConfig, manifest: dict):
  """The regenerated conversations, refused if any lies in this config's held-out split."""
  folder = cfg.data.regenerated
  convs = read_regenerated(folder, manifest)
  held = split_heldout(convs, cfg.data.heldout_fraction, cfg.data.split_seed)[1]
  if held:
    made = manifest.get("config", {})
    raise EagleJaxError(
        f"data.regenerated: {folder}: {len(held)} of its conversations are held out under "
        f"data.heldout_fraction={cfg.data.heldout_fraction}, data.split_seed={cfg.data.split_seed} "
        f"(it was made with heldout_fraction={made.get('heldout_fraction')}, split_seed="
        f"{made.get('split_seed')}); regenerate it with this split")
  print(f"regenerated replies: {len(convs)} conversations from {folder}")
  return convs


def _has_rows(path, rows):
  """Whether the cache at ``path`` is finished and holds ``rows`` rows (or all the data)."""
  try:
    with open(os.path.join(path, "manifest.json")) as f:
      m = json.load(f)
  except (OSError, ValueError):
    return False
  have = sum(s["rows"] for s in m["shards"])
  return bool(m.get("complete")) and (m.get("exhausted") or (rows is not None and have >= rows))


def check_same_run(cfg: TrainConfig, run_dir: str) -> None:
  """Refuses a run folder whose saved config would train different weights than ``cfg``."""
  saved = os.path.join(run_dir, "config.yaml")
  if not os.path.isfile(saved):
    return
  before = read_yaml(saved)  # compare what decides the trained weights, as plain data
  try:  # a key added to the config since that run was saved takes its default there
    before = to_dict(from_dict(TrainConfig, before, where=saved))
  except EagleJaxError:
    pass
  section = registry.get(cfg.drafter).trainable.section
  same = lambda d: ({k: d.get(k) for k in ("drafter", "model", "dtype", "data", "features", "optim",
                                           section)},
                    {k: d.get("loop", {}).get(k) for k in ("seed", "batch_rows", "epochs")})
  if same(before) != same(to_dict(cfg)):
    raise EagleJaxError(f"{run_dir}: holds a run with a different config ({saved}); "
                        "pick another name= or delete the folder")


def run_finished(cfg: TrainConfig) -> bool:
  """Whether the run ``cfg`` names has exported its drafter and, if its config tunes one, the
  budget too (a run killed while tuning is not finished); a changed config is an error."""
  run_dir = os.path.join(cfg.runs_dir, cfg.name)
  check_same_run(cfg, run_dir)
  final = os.path.join(run_dir, "final")
  if not os.path.isfile(os.path.join(final, "drafter.json")):
    return False
  tuned = cfg.tune.enabled and registry.get(cfg.drafter).trainable.tune is not None
  return not tuned or "budget" in read_meta(final)


def run_training(config_path: str, overrides=(), *, progress=True) -> dict:
  cfg = load_config(TrainConfig, config_path, overrides)
  mesh = make_mesh(cfg.mesh)  # a mesh that does not fit the devices fails before any work
  trainable = registry.get(cfg.drafter).trainable
  run_dir = os.path.join(cfg.runs_dir, cfg.name)
  os.makedirs(run_dir, exist_ok=True)
  check_same_run(cfg, run_dir)
  if parallel.is_writer():
    dump_config(cfg, os.path.join(run_dir, "config.yaml"))
  lm = load_model(cfg.model, cfg.dtype or None)
  shard(lm.model, mesh)  # extraction, training, held-out decoding and tuning on the mesh
  with use_mesh(mesh):  # several processes: process 0 shows the progress
    return _run_training(cfg, trainable, run_dir, lm, mesh, progress and parallel.is_writer())


def _run_training(cfg, trainable, run_dir: str, lm, mesh, progress: bool) -> dict:
  t0 = time.perf_counter()
  dirs = feature_caches(cfg, lm, progress=progress)
  feat_s = time.perf_counter() - t0
  data = FeatureShards(dirs["train"], max_rows=cfg.data.train_rows or None)
  held = FeatureShards(dirs["heldout"], max_rows=cfg.data.heldout_rows)
  # exported with the weights: draft vocabularies are cut from them
  counts = reply_token_counts(data, lm.config.vocab_size) if trainable.token_counts else None
  task = trainable.task(cfg, lm, data, counts)
  result = train(task, data, held, run_dir, cfg.loop, cfg.optim, progress=progress,
                 eval_hook=decode_eval_hook(cfg, lm), mesh=mesh)
  final = os.path.join(run_dir, "final")
  module = parallel.gather(result.module)  # every process takes part; process 0 writes
  if not parallel.is_writer():
    return {"run_dir": run_dir, "final": final, "steps": result.steps, "process": jax.process_index()}
  registry.export_drafter(cfg.drafter, module, final, {
      "model": cfg.model,
      "split": {"heldout_fraction": cfg.data.heldout_fraction, "split_seed": cfg.data.split_seed},
      **({"replies": {"kind": "target", "regenerated": cfg.data.regenerated}}
         if cfg.data.replies == "target" else {}),
      "steps": result.steps, "train_tokens": result.tokens,
      "train_seconds": round(result.seconds, 1),
      "heldout": {k: round(v, 4) for k, v in result.last_eval.items() if "rank" not in k}},
      lm, token_counts=counts)
  tuned = {}
  if cfg.tune.enabled and trainable.tune is not None:
    if jax.process_count() > 1:
      print(f"[train] budget tuning skipped across {jax.process_count()} processes: it times one "
            f"host's passes; run `eagle-jax tune {final}` on one host", file=sys.stderr)
    else:
      tuned = trainable.tune(final, lm, cfg.tune,
                             heldout_prompts(lm.tokenizer, cfg.tune.prompts, cfg.data), result.last_eval)
  summary = {"run_dir": run_dir, "final": final, "steps": result.steps,
             "train_tokens": result.tokens, "resumed_from": result.resumed_from,
             "feature_rows": data.num_rows, "feature_tokens": data.num_tokens,
             "features_seconds": round(feat_s, 1), "train_seconds": round(result.seconds, 1),
             **{k: round(v, 4) for k, v in result.last_eval.items() if "rank" not in k},
             "budget": {k: v for k, v in tuned.items()
                        if k not in ("by_setting", "verify_cost_ms", "rows", "tree")}}
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary


def decode_eval_hook(cfg, lm):
  """``module -> {"heldout_tau": ...}``: greedy speculative decoding of held-out prompts with
  the drafter the kind measures itself with."""
  d = cfg.decode_eval
  if not d.prompts:
    return None
  prompts = heldout_prompts(lm.tokenizer, d.prompts, cfg.data)
  eval_drafter = registry.get(cfg.drafter).trainable.eval_drafter

  def hook(module):
    drafter, dparams = eval_drafter(module, lm.model, d)
    gen = speculative_generate(lm.model, drafter, dparams, prompts,
                               max_new_tokens=d.max_new_tokens, stop_ids=())
    alphas = gen.n_alpha(3)
    return {"heldout_tau": gen.tau, **{f"heldout_alpha_{i + 1}": a for i, a in enumerate(alphas)}}
  return hook


def tune_checkpoint(checkpoint: str, tune: TuneConfig = TuneConfig(), model: str | None = None) -> dict:
  """Re-tunes the budget of an exported drafter for this machine (``eagle-jax tune``), on
  prompts from its own run's held-out split (never trained on)."""
  meta = read_meta(checkpoint)
  kind = meta.get("drafter")
  trainable = registry.get(kind).trainable if kind in registry.TRAINABLE else None
  if trainable is None or trainable.tune is None:
    tunable = [n for n in registry.TRAINABLE if registry.get(n).trainable.tune is not None]
    raise EagleJaxError(f"{final_folder(checkpoint)}: holds a {meta.get('drafter')!r} drafter; "
                        f"tuning applies to: {', '.join(tunable)}")
  lm = load_model(model or meta.get("model", DEFAULT_MODEL))
  prompts = heldout_prompts(lm.tokenizer, tune.prompts, DataConfig(**meta.get("split", {})))
  return trainable.tune(checkpoint, lm, tune, prompts, None)
