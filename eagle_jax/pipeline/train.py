"""``eagle-jax train CONFIG``: data -> feature cache -> trainer -> exported drafter.

A training config (:class:`TrainConfig`, YAML validated by :mod:`eagle_jax.configs`) names the
target, the drafter (eagle1, eagle3, medusa or draft-model), the data budget, the optimizer
and the loop. The feature cache lives in ``<runs_dir>/features/<model>-sharegpt-<key>.../``
and is shared by every drafter trained on the same target and data settings (its key does not
depend on the drafter); the run lives in ``<runs_dir>/<name>/`` (``checkpoints/``,
``metrics.jsonl``, ``config.yaml``, ``summary.json``) and its exported drafter in
``<runs_dir>/<name>/final/`` (:mod:`eagle_jax.drafters.storage`), which ``--drafter-ckpt`` accepts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Literal

import numpy as np

from eagle_jax.configs import dump_config, from_dict, load_config, read_yaml, to_dict
from eagle_jax.decoding.costs import verify_cost_up_to
from eagle_jax.decoding.speculative import speculative_generate
from eagle_jax.decoding.tree import MEDUSA_DEFAULT_CHOICES, TreeSpec
from eagle_jax.drafters.draft_model.drafter import DraftModelDrafter
from eagle_jax.drafters.draft_model.train import DistillTask, DraftModelConfig
from eagle_jax.drafters.eagle.drafter import EagleDrafter
from eagle_jax.drafters.eagle.head import EagleHeadConfig, Frozen, default_fuse_layers
from eagle_jax.drafters.eagle.train import EagleTask, reply_token_counts, top_tokens
from eagle_jax.drafters.eagle.tune import draft_cost_ms, tune_budget
from eagle_jax.drafters.factory import draft_vocab_ids
from eagle_jax.drafters.medusa.drafter import MedusaDrafter
from eagle_jax.drafters.medusa.heads import MedusaConfig, MedusaTask, rank_accuracies, tune_tree
from eagle_jax.drafters.storage import (
  export_drafter,
  final_folder,
  load_drafter,
  load_head,
  read_meta,
  save_token_counts,
  write_meta,
)
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.registry import load_model
from eagle_jax.model.transformer import quantize_linears
from eagle_jax.training.features import FeatureShards, FeatureSpec, extract_features
from eagle_jax.training.sharegpt import encode_conversation, load_sharegpt, split_heldout
from eagle_jax.training.trainer import LoopConfig, OptimConfig, train

DEFAULT_RUNS_DIR = "runs"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  heldout_fraction: float = 0.02
  max_len: int = 512  # tokens per conversation (longer ones are truncated)
  row_len: int = 512  # packed row length
  train_rows: int = 256  # feature-cache budget (0 = every training conversation)
  heldout_rows: int = 16
  split_seed: int = 0

  def validate(self):
    if not 0 < self.heldout_fraction < 1:
      raise EagleJaxError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
    if self.max_len > self.row_len:
      raise EagleJaxError(f"max_len ({self.max_len}) must not exceed row_len ({self.row_len})")
    if self.max_len < 2 or self.train_rows < 0 or self.heldout_rows < 0:
      raise EagleJaxError(f"data.max_len must be >= 2 and data.train_rows, data.heldout_rows >= 0; got "
                          f"{self.max_len}, {self.train_rows}, {self.heldout_rows}")


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
  batch_rows: int = 8
  rows_per_shard: int = 64
  layers: tuple[int, ...] = ()  # () = EAGLE-3's default low/mid/high layers of the target

  def validate(self):
    if self.batch_rows < 1 or self.rows_per_shard < 1:
      raise EagleJaxError(f"features.batch_rows and features.rows_per_shard must be >= 1, got "
                          f"{self.batch_rows} and {self.rows_per_shard}")
    if any(i < 0 for i in self.layers):
      raise EagleJaxError(f"features.layers are Hugging Face hidden_states indices (>= 0), got "
                          f"{list(self.layers)}")


@dataclasses.dataclass(frozen=True)
class EagleConfig:
  ttt_steps: int = 1  # training-time-test unroll (EAGLE-3)
  eval_steps: int = 4  # chain length of the held-out tau proxy
  draft_vocab: int = 0  # EAGLE-3 reduced vocabulary (0 = full)
  ce_weight: float = 0.1
  reg_weight: float = 1.0
  step_decay: float = 0.8
  feature_noise: float = 0.2
  # training: positions per row where the cross entropy (the vocabulary-sized products) is
  # evaluated, drawn among the valid ones; 0 = every position. The feature regression and the
  # head's layer always cover every position.
  positions_per_row: int = 0

  def validate(self):
    if self.positions_per_row < 0:
      raise EagleJaxError(f"eagle.positions_per_row must be >= 0 (0 = every position), got "
                          f"{self.positions_per_row}")
    if self.ttt_steps < 1 or self.eval_steps < 1:
      raise EagleJaxError(f"eagle.ttt_steps and eagle.eval_steps must be >= 1, got "
                          f"{self.ttt_steps} and {self.eval_steps}")
    if self.draft_vocab < 0:
      raise EagleJaxError(f"eagle.draft_vocab must be >= 0 (0 = the full vocabulary), got {self.draft_vocab}")


@dataclasses.dataclass(frozen=True)
class MedusaTrainConfig:
  num_heads: int = 4
  num_layers: int = 1  # residual blocks per head
  positions_per_row: int = 128  # loss positions sampled per row (0 = all)
  decay: float = 0.8  # loss weight of head k: decay**k


@dataclasses.dataclass(frozen=True)
class TuneConfig:
  """Budget tuning after training: EAGLE-2 (:mod:`eagle_jax.drafters.eagle.tune`), Medusa trees
  (:func:`eagle_jax.drafters.medusa.heads.tune_tree`)."""

  enabled: bool = True
  prompts: int = 4  # held-out ShareGPT first turns
  max_new_tokens: int = 48
  top_ks: tuple[int, ...] = (4, 8)
  depths: tuple[int, ...] = (4, 6)
  max_nodes: int = 64
  # EAGLE-1/2 draft vocabularies tried besides the whole one (most frequent reply tokens)
  draft_vocabs: tuple[int, ...] = (8192,)
  # the drafter's weights while tuning and then drafting (recorded in the budget): 8 = rounded
  # to 8-bit blocks (EAGLE: eagle_jax.model.transformer.quantize_linears, about half the draft step on a
  # 2-core CPU, the same acceptance in the measurements so far; Medusa: each head's output
  # layer, MedusaHeads.quantize8), 0 = float32 as trained
  head_bits: int = 8

  def __post_init__(self):
    for key in ("top_ks", "depths"):
      values = getattr(self, key)
      if not values or min(values) < 1:
        raise EagleJaxError(f"tune.{key} needs at least one value, each >= 1; got {list(values)}")
    if self.head_bits not in (0, 8):
      raise EagleJaxError(f"tune.head_bits must be 0 (float32) or 8; got {self.head_bits}")


@dataclasses.dataclass(frozen=True)
class DecodeEvalConfig:
  """Real acceptance during training: decode held-out ShareGPT prompts with the head."""

  prompts: int = 4  # 0 = off (only the teacher-forced tau proxy)
  max_new_tokens: int = 48
  top_k: int = 8  # EAGLE-2 dynamic tree used for the measurement
  depth: int = 5
  total_tokens: int = 24
  gamma: int = 4  # draft-model chain; Medusa uses its 63-node default tree


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  name: str
  drafter: Literal["eagle1", "eagle3", "medusa", "draft-model"]
  model: str = "smollm2-135m-instruct"
  runs_dir: str = DEFAULT_RUNS_DIR
  data: DataConfig = DataConfig()
  features: FeatureConfig = FeatureConfig()
  eagle: EagleConfig = EagleConfig()
  medusa: MedusaTrainConfig = MedusaTrainConfig()
  draft_model: DraftModelConfig = DraftModelConfig()
  optim: OptimConfig = OptimConfig()
  loop: LoopConfig = LoopConfig()
  tune: TuneConfig = TuneConfig()
  decode_eval: DecodeEvalConfig = DecodeEvalConfig()

  def validate(self):
    if self.drafter == "eagle1" and (self.eagle.draft_vocab or self.eagle.ttt_steps != 1):
      raise EagleJaxError("eagle1 trains with ttt_steps=1 and the full vocabulary "
                          "(eagle.draft_vocab and eagle.ttt_steps are EAGLE-3 settings)")
    if (self.drafter == "medusa" and self.tune.enabled
        and min(self.data.heldout_rows, self.loop.eval_rows) < self.loop.batch_rows):
      raise EagleJaxError("medusa's tree tuning reads held-out rank accuracies: data.heldout_rows and "
                          f"loop.eval_rows must be >= loop.batch_rows={self.loop.batch_rows} "
                          "(or set tune.enabled=false)")


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
  """Extracts (or reuses) the train and held-out feature caches; returns their folders."""
  layers = cfg.features.layers or default_fuse_layers(lm.config.num_layers)
  if max(layers) > lm.config.num_layers:
    raise EagleJaxError(f"features.layers {list(layers)}: {cfg.model} has hidden_states 0..."
                        f"{lm.config.num_layers} ({lm.config.num_layers} layers)")
  spec = FeatureSpec(model=cfg.model, row_len=cfg.data.row_len, max_len=cfg.data.max_len,
                     layers=tuple(layers), rows_per_shard=cfg.features.rows_per_shard,
                     batch_rows=cfg.features.batch_rows)
  tag = (f"{os.path.basename(cfg.model.rstrip('/'))}-sharegpt-{spec.key()}-split"
         f"{cfg.data.split_seed}-held{cfg.data.heldout_fraction}")
  root = os.path.join(cfg.runs_dir, "features", tag)
  dirs = {"train": os.path.join(root, "train"), "heldout": os.path.join(root, "heldout")}
  budget = {"train": cfg.data.train_rows or None, "heldout": cfg.data.heldout_rows}
  todo = [s for s in dirs if not _has_rows(dirs[s], budget[s])]
  if todo:
    sg = load_sharegpt()
    print(sg.summary())
    train, held = split_heldout(sg.conversations, cfg.data.heldout_fraction, cfg.data.split_seed)
    convs = {"train": train, "heldout": held}
    for split in todo:
      m = extract_features(lm.model, _Encoded(lm.tokenizer, convs[split], cfg.data.max_len),
                           dirs[split], spec, max_rows=budget[split], progress=progress)
      if m.get("last_run"):
        print(f"features[{split}]: {json.dumps(m['last_run'])}")
  return dirs


def _has_rows(path, rows):
  """Whether the cache at ``path`` is finished and holds ``rows`` rows (or all the data)."""
  try:
    with open(os.path.join(path, "manifest.json")) as f:
      m = json.load(f)
  except (OSError, ValueError):
    return False
  have = sum(s["rows"] for s in m["shards"])
  return bool(m.get("complete")) and (m.get("exhausted") or (rows is not None and have >= rows))


def build_task(cfg: TrainConfig, lm, train_shards, token_counts=None):
  """The trainer's task; ``token_counts`` (reply-token counts of ``train_shards``) cut EAGLE-3's
  draft vocabulary."""
  if cfg.drafter == "medusa":
    m = cfg.medusa
    heads = MedusaConfig(num_heads=m.num_heads, num_layers=m.num_layers,
                         hidden_size=lm.config.hidden_size, vocab_size=lm.config.vocab_size)
    lm_head = lm.model.embed if lm.model.lm_head is None else lm.model.lm_head.weight
    return MedusaTask(config=heads, lm_head_VxD=np.asarray(lm_head[...]),
                      positions_per_row=m.positions_per_row, decay=m.decay)
  if cfg.drafter == "draft-model":
    return DistillTask.of(lm.model, cfg.draft_model)
  v3 = cfg.drafter == "eagle3"
  layers = tuple(train_shards.spec["layers"]) if v3 else ()
  e = cfg.eagle
  head_cfg = EagleHeadConfig(version=3 if v3 else 1, target=lm.config, fuse_layers=layers,
                             draft_vocab=e.draft_vocab if v3 else 0)
  d2t = None
  if v3 and e.draft_vocab:
    if token_counts is None:
      token_counts = reply_token_counts(train_shards, lm.config.vocab_size)
    d2t = top_tokens(token_counts, e.draft_vocab, always=lm.tokenizer.eos_token_ids)
  return EagleTask(config=head_cfg, frozen=Frozen.of(lm.model), ttt_steps=e.ttt_steps,
                   eval_steps=e.eval_steps, ce_weight=e.ce_weight, reg_weight=e.reg_weight,
                   step_decay=e.step_decay, feature_noise=e.feature_noise,
                   positions_per_row=e.positions_per_row, d2t=d2t)


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
  same = lambda d: ({k: d.get(k) for k in ("drafter", "model", "data", "features", "optim",
                                           {"eagle1": "eagle", "eagle3": "eagle"}.get(
                                               cfg.drafter, cfg.drafter.replace("-", "_")))},
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
  tuned = cfg.tune.enabled and cfg.drafter in ("eagle1", "eagle3", "medusa")
  return not tuned or "budget" in read_meta(final)


def run_training(config_path: str, overrides=(), *, progress=True) -> dict:
  cfg = load_config(TrainConfig, config_path, overrides)
  run_dir = os.path.join(cfg.runs_dir, cfg.name)
  os.makedirs(run_dir, exist_ok=True)
  check_same_run(cfg, run_dir)
  dump_config(cfg, os.path.join(run_dir, "config.yaml"))
  lm = load_model(cfg.model)
  t0 = time.perf_counter()
  dirs = feature_caches(cfg, lm, progress=progress)
  feat_s = time.perf_counter() - t0
  data = FeatureShards(dirs["train"], max_rows=cfg.data.train_rows or None)
  held = FeatureShards(dirs["heldout"], max_rows=cfg.data.heldout_rows)
  counts = None
  if cfg.drafter in ("eagle1", "eagle3"):  # exported with the head: draft vocabularies are cut from it
    counts = reply_token_counts(data, lm.config.vocab_size)
  task = build_task(cfg, lm, data, counts)
  result = train(task, data, held, run_dir, cfg.loop, cfg.optim, progress=progress,
                 eval_hook=decode_eval_hook(cfg, lm))
  final = os.path.join(run_dir, "final")
  export_drafter(result.module, final, {"drafter": cfg.drafter, "model": cfg.model,
                                        "split": {"heldout_fraction": cfg.data.heldout_fraction,
                                                  "split_seed": cfg.data.split_seed},
                                        "steps": result.steps, "train_tokens": result.tokens,
                                        "train_seconds": round(result.seconds, 1),
                                        "heldout": {k: round(v, 4) for k, v in result.last_eval.items()
                                                    if "rank" not in k}},
                 tokenizer_folder=lm.folder)
  if counts is not None:
    save_token_counts(final, counts)
  tuned = {}
  if cfg.tune.enabled and cfg.drafter in ("eagle1", "eagle3"):
    tuned = tune_run(final, lm, cfg)
  elif cfg.tune.enabled and cfg.drafter == "medusa":
    tuned = tune_medusa(final, lm, cfg, result.last_eval)
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


def decode_eval_hook(cfg: TrainConfig, lm):
  """``module -> {"heldout_tau": ...}``: greedy speculative decoding of held-out prompts."""
  d = cfg.decode_eval
  if not d.prompts:
    return None
  prompts = heldout_prompts(lm.tokenizer, d.prompts, cfg)

  def hook(module):
    drafter, dparams = eval_drafter(cfg.drafter, module, lm.model, d)
    gen = speculative_generate(lm.model, drafter, dparams, prompts,
                               max_new_tokens=d.max_new_tokens, stop_ids=())
    alphas = gen.n_alpha(3)
    return {"heldout_tau": gen.tau, **{f"heldout_alpha_{i + 1}": a for i, a in enumerate(alphas)}}
  return hook


def eval_drafter(kind: str, module, target, d: DecodeEvalConfig = DecodeEvalConfig()):
  """The drafter a training run measures its held-out acceptance with."""
  if kind == "medusa":
    depth = module.config.num_heads
    tree = TreeSpec.from_choices([c for c in MEDUSA_DEFAULT_CHOICES if len(c) <= depth])
    return MedusaDrafter.create(module, tree, target)
  if kind == "draft-model":
    return DraftModelDrafter.create(module, gamma=d.gamma, target_vocab=target.config.vocab_size)
  return EagleDrafter.create(module, target, None, top_k=d.top_k, depth=d.depth,
                             total_tokens=d.total_tokens)


def heldout_prompts(tokenizer, count: int, cfg: TrainConfig | None = None) -> list[list[int]]:
  """First user turns of held-out ShareGPT conversations, as chat prompts."""
  data = cfg.data if cfg else DataConfig()
  convs = load_sharegpt().conversations
  held = split_heldout(convs, data.heldout_fraction, data.split_seed)[1]
  out = []
  for c in held:
    first = [m for m in c.messages if m["role"] == "user"][:1]
    if first and 16 <= len(first[0]["content"]) <= 1500:
      out.append(tokenizer.chat_prompt(first))
    if len(out) == count:
      break
  return out


def tune_run(final: str, lm, cfg: TrainConfig | None = None) -> dict:
  """Tunes the EAGLE-2 budget of the head in ``final`` and records it in ``drafter.json``."""
  t = cfg.tune if cfg else TuneConfig()
  final = final_folder(final)
  head, meta = load_head(final)
  if t.head_bits == 8:
    quantize_linears(head)
  prompts = heldout_prompts(lm.tokenizer, t.prompts, cfg)
  vocabs = {}
  if head.config.version == 1:
    vocabs = {n: draft_vocab_ids(final, lm.model, n) for n in t.draft_vocabs
              if 0 < n < lm.config.vocab_size}
  result = tune_budget(head, lm.model, prompts, curve=verify_cost_up_to(lm.model, t.max_nodes),
                       top_ks=t.top_ks, depths=t.depths, max_nodes=t.max_nodes,
                       max_new_tokens=t.max_new_tokens, draft_vocabs=vocabs)
  with open(os.path.join(final, "budget.json"), "w") as f:
    json.dump(result, f, indent=1)
  meta["budget"] = {k: result[k] for k in ("top_k", "depth", "total_tokens", "draft_vocab",
                                           "predicted_tau", "predicted_speedup")}
  meta["budget"]["head_bits"] = t.head_bits
  write_meta(final, meta)
  print(f"budget: {json.dumps(meta['budget'])}")
  return result


def tune_medusa(final: str, lm, cfg: TrainConfig | None, heldout_metrics: dict | None = None) -> dict:
  """Picks the Medusa tree budget (:func:`eagle_jax.drafters.medusa.heads.tune_tree`); records it and the
  held-out rank accuracies it came from in ``drafter.json`` (re-tuning reuses those)."""
  t = cfg.tune if cfg else TuneConfig()
  final = final_folder(final)
  heads, meta = load_drafter(final, ("medusa",))
  if heldout_metrics is None and "rank_acc" not in meta:
    raise EagleJaxError(f"{final}: no held-out rank accuracies recorded; re-run its training")
  acc = meta["rank_acc"] if heldout_metrics is None else rank_accuracies(
      heldout_metrics, heads.config.num_heads)
  if t.head_bits == 8:
    heads.quantize8()
  prompt = heldout_prompts(lm.tokenizer, 1, cfg)[0]
  costs = {}  # a draft step runs only the heads the tree reaches: its cost by depth
  for depth in range(1, heads.config.num_heads + 1):
    drafter, dparams = MedusaDrafter.create(heads, TreeSpec.chain(depth))
    costs[depth] = draft_cost_ms(drafter, dparams, lm.model, prompt)
  result = tune_tree(costs, acc, verify_cost_up_to(lm.model, t.max_nodes), max_nodes=t.max_nodes)
  with open(os.path.join(final, "budget.json"), "w") as f:
    json.dump(result, f, indent=1)
  meta["rank_acc"] = [[round(a, 5) for a in row] for row in acc]
  meta["budget"] = {k: result[k] for k in ("total_tokens", "tree", "predicted_tau", "predicted_speedup",
                                           "default63_predicted_tau")}
  meta["budget"]["head_bits"] = t.head_bits
  write_meta(final, meta)
  print(f"budget: {json.dumps({k: v for k, v in meta['budget'].items() if k != 'tree'})}")
  return result
