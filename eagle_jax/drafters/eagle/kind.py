"""The ``eagle1``, ``eagle2`` and ``eagle3`` kinds: options, building from a checkpoint,
training, budget tuning and storage.

``eagle2`` drafts with EAGLE-1 weights and a dynamic tree; ``eagle1`` with EAGLE-1's static
25-node tree (or a chain); ``eagle3`` with an EAGLE-3 head and a dynamic tree.
"""

from __future__ import annotations

import dataclasses
import json
import os

from flax import nnx

from eagle_jax.decoding.costs import verify_cost_up_to
from eagle_jax.decoding.tree import EAGLE_DEFAULT_CHOICES, TreeSpec
from eagle_jax.drafters import interop
from eagle_jax.drafters.eagle.drafter import EagleDrafter
from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig, Frozen
from eagle_jax.drafters.eagle.official import describe_published, read_published, write_published
from eagle_jax.drafters.eagle.train import EagleTask, reply_token_counts, top_tokens
from eagle_jax.drafters.eagle.tune import tune_budget
from eagle_jax.drafters.kinds import (
  HEAD_BITS_HELP,
  DrafterKind,
  Trainable,
  check_nonnegative,
  check_tuned_or_nonnegative,
  flag_for,
  head_bits,
  option,
)
from eagle_jax.drafters.shipped import find_checkpoint
from eagle_jax.drafters.storage import (
  final_folder,
  load_params,
  load_token_counts,
  read_meta,
  save_params,
  write_meta,
)
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.transformer import quantize_linears

EAGLE1, EAGLE2, EAGLE3 = "eagle1", "eagle2", "eagle3"
VERSION = {EAGLE1: 1, EAGLE2: 1, EAGLE3: 3}  # the head each drafts with
_DYNAMIC = ("total_tokens", "top_k", "depth")


@dataclasses.dataclass(frozen=True)
class EagleConfig:
  """The ``eagle`` section of a training config (EAGLE-1 and EAGLE-3)."""

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


def _gamma():
  return option(0, "draft a chain of this many nodes instead of a tree (0 = a tree)")


def _tree():
  return option("", "default = EAGLE-1's static 25-node tree instead of the tuned budget",
                choices=("", "default"))


def _draft_vocab():
  return option(-1, "draft only the K most frequent training-reply tokens, through their rows of "
                "the target's LM head (0 = whole vocabulary; -1 = the tuned value, else whole)")


def _head_bits():
  return option(-1, HEAD_BITS_HELP)


def _check(options, name: str) -> None:
  """Validation shared by the three kinds' options."""
  names = [f.name for f in dataclasses.fields(options)]
  check_nonnegative(options, *[n for n in names if n not in ("tree", "head_bits", "draft_vocab")])
  check_tuned_or_nonnegative(options, *[n for n in ("draft_vocab", "head_bits") if n in names])
  if options.tree not in ("", "default"):
    raise EagleJaxError(f"--tree: expected 'default' or nothing, got {options.tree!r}")
  dynamic = "total_tokens" in names
  if options.gamma and options.tree == "default" and not dynamic:
    raise EagleJaxError(f"--tree default: not used with --gamma (--drafter {name} then drafts "
                        "a chain)")
  if options.gamma and options.tree != "default" and dynamic:
    raise EagleJaxError(f"--gamma: --drafter {name} drafts a dynamic tree; a chain needs "
                        f"--tree default or --drafter {EAGLE1}")
  if dynamic and options.tree == "default":
    if clash := [n for n in _DYNAMIC if getattr(options, n)]:
      raise EagleJaxError(f"{', '.join(flag_for(n) for n in clash)}: not used with --tree "
                          "default (a static tree or chain, not a budget)")


@dataclasses.dataclass(frozen=True)
class Eagle1Options:
  gamma: int = _gamma()
  tree: str = _tree()
  draft_vocab: int = _draft_vocab()
  head_bits: int = _head_bits()

  def __post_init__(self):
    _check(self, EAGLE1)


@dataclasses.dataclass(frozen=True)
class Eagle3Options:
  gamma: int = _gamma()
  tree: str = _tree()
  top_k: int = option(0, "dynamic tree: nodes expanded per depth (0 = the tuned value)",
                      flag="--top-k-tree")
  depth: int = option(0, "dynamic tree depth (0 = the tuned value)")
  total_tokens: int = option(0, "dynamic tree node budget (0 = the tuned value)")
  head_bits: int = _head_bits()

  def __post_init__(self):
    _check(self, EAGLE3)


@dataclasses.dataclass(frozen=True)
class Eagle2Options(Eagle3Options):
  draft_vocab: int = _draft_vocab()

  def __post_init__(self):
    _check(self, EAGLE2)


def load_head(path: str, version: int | None = None, target=None):
  """``(head, meta)`` of the EAGLE head at ``path`` (of ``version`` if given): a trained run, its
  ``final/`` folder, or a published EAGLE-1/2 or EAGLE-3 folder (which needs ``target``, the
  target's :class:`~eagle_jax.model.config.ModelConfig`, for the draft layer's sizes)."""
  fmt = interop.detect(path)
  if fmt in (interop.EAGLE, interop.EAGLE3):
    if target is None:
      raise EagleJaxError(f"{path}: a published EAGLE folder is read for a given target model")
    head = read_published(path, target)
    meta = {"drafter": EAGLE1 if fmt == interop.EAGLE else EAGLE3, "published": fmt,
            "source": path}
  elif fmt is not None:
    raise EagleJaxError(f"{path}: holds a published {fmt} checkpoint; expected an EAGLE head")
  else:
    folder = final_folder(path)
    meta = read_meta(path)
    head = None
  if head is None:
    if meta.get("drafter") not in (EAGLE1, EAGLE3):
      raise EagleJaxError(f"{folder}: holds a {meta.get('drafter')!r} drafter; expected one of: "
                          f"{EAGLE1}, {EAGLE3}")
    head = _load(folder, meta)
  if version is not None and head.config.version != version:
    raise EagleJaxError(f"{path}: holds an EAGLE-{head.config.version} head; this drafter needs "
                        f"EAGLE-{version}")
  return head, meta


def draft_vocab_ids(path: str, target, size: int):
  """The ``size`` most frequent training-reply tokens of the head at ``path`` (EOS included)."""
  counts = load_token_counts(path, target.config.vocab_size)
  return top_tokens(counts, size, always=target.config.eos_token_ids)


_NAMES = {Eagle1Options: EAGLE1, Eagle2Options: EAGLE2, Eagle3Options: EAGLE3}


def build(target, options, context) -> tuple:
  name = _NAMES[type(options)]
  weights = EAGLE3 if name == EAGLE3 else EAGLE1
  path = context.checkpoint or find_checkpoint(weights, context.runs_dir, context.model)
  head, meta = load_head(path, target=target.config)
  if head.config.version != VERSION[name]:
    raise EagleJaxError(f"{path}: holds an EAGLE-{head.config.version} head; --drafter {name} "
                        f"needs EAGLE-{VERSION[name]}")
  tuned = meta.get("budget", {}) if name != EAGLE1 else {}
  if head_bits(options.head_bits, tuned) == 8:
    quantize_linears(head)
  requested = getattr(options, "draft_vocab", 0)
  vocab = requested if requested >= 0 else tuned.get("draft_vocab", 0)
  ids = draft_vocab_ids(path, target, vocab) if vocab else None
  if name == EAGLE1 or options.tree == "default":
    tree = TreeSpec.chain(options.gamma) if options.gamma else TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES)
    return EagleDrafter.create(head, target, tree, draft_ids=ids)
  return EagleDrafter.create(
      head, target, None, draft_ids=ids, top_k=options.top_k or tuned.get("top_k", 8),
      depth=options.depth or tuned.get("depth", 5),
      total_tokens=options.total_tokens or tuned.get("total_tokens", 24))


def check(path: str, target, options) -> str:
  """The head at ``path`` checked against the target config ``target`` without its weights."""
  name = _NAMES[type(options)]
  fmt = interop.format_of(path)
  if fmt in (interop.EAGLE, interop.EAGLE3):
    version, text = describe_published(path, target)
  elif fmt is not None:
    raise EagleJaxError(f"{path}: holds a published {fmt} checkpoint; expected an EAGLE head")
  else:
    meta = read_meta(path)
    if meta.get("drafter") not in (EAGLE1, EAGLE3):
      raise EagleJaxError(f"{path}: holds a {meta.get('drafter')!r} drafter; expected one of: "
                          f"{EAGLE1}, {EAGLE3}")
    cfg = EagleHeadConfig.from_dict(meta["head"], f"{path}/drafter.json")
    if cfg.target.hidden_size != target.hidden_size:
      raise EagleJaxError(f"{path}: a head of hidden size {cfg.target.hidden_size} but the target "
                          f"has {target.hidden_size} (a head for another target)")
    version, text = cfg.version, f"EAGLE-{cfg.version} head trained for {meta.get('model')}"
  if version != VERSION[name]:
    raise EagleJaxError(f"{path}: holds an EAGLE-{version} head; --drafter {name} needs "
                        f"EAGLE-{VERSION[name]}")
  return text


def _task(cfg, lm, train_shards, token_counts=None):
  """The trainer's task; ``token_counts`` (reply-token counts of ``train_shards``) cut EAGLE-3's
  draft vocabulary."""
  v3 = cfg.drafter == EAGLE3
  layers = tuple(train_shards.spec["layers"]) if v3 else ()
  e = cfg.eagle
  head_cfg = EagleHeadConfig(version=VERSION[cfg.drafter], target=lm.config, fuse_layers=layers,
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


def _eval_drafter(module, target, decode_eval):
  return EagleDrafter.create(module, target, None, top_k=decode_eval.top_k,
                             depth=decode_eval.depth, total_tokens=decode_eval.total_tokens)


def _save(module, folder: str, lm) -> dict:
  save_params(module, folder)
  return {"head": module.config.to_dict()}


def _load(folder: str, meta: dict):
  cfg = EagleHeadConfig.from_dict(meta["head"], f"{folder}/drafter.json")
  return load_params(nnx.eval_shape(lambda: EagleHead(cfg, rngs=nnx.Rngs(0))), folder)


def tune(final: str, lm, t, prompts, heldout_metrics: dict | None = None) -> dict:
  """Tunes the EAGLE-2 budget of the head in ``final`` (:func:`eagle_jax.drafters.eagle.tune.tune_budget`)
  and records it in ``drafter.json``. ``t``: the tuning settings; ``prompts``: held-out prompts."""
  final = final_folder(final)
  head, meta = load_head(final)
  if t.head_bits == 8:
    quantize_linears(head)
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


def _validate(cfg) -> None:
  if cfg.drafter == EAGLE1 and (cfg.eagle.draft_vocab or cfg.eagle.ttt_steps != 1):
    raise EagleJaxError(f"{EAGLE1} trains with ttt_steps=1 and the full vocabulary "
                        "(eagle.draft_vocab and eagle.ttt_steps are EAGLE-3 settings)")


def _write_published(module, folder: str, meta: dict) -> str:
  return write_published(module, folder)


def _trainable(published: str) -> Trainable:
  return Trainable(section="eagle", config=EagleConfig, task=_task, eval_drafter=_eval_drafter,
                   save=_save, load=_load, tune=tune, token_counts=True, validate=_validate,
                   published=published, write_published=_write_published)


# the published settings (--budget paper): whole vocabulary and float weights, as published
_FLOAT = {"head_bits": 0}
KIND_1 = DrafterKind(EAGLE1, "EAGLE-1 head, static 25-node tree (or a chain)", Eagle1Options,
                     build, weights=EAGLE1, trainable=_trainable(interop.EAGLE), check=check,
                     paper={"tree": "default", "draft_vocab": 0, **_FLOAT},
                     paper_source="EAGLE (arXiv 2401.15077): the 25-node static tree of its "
                     "reference code")
KIND_2 = DrafterKind(EAGLE2, "EAGLE-1 head, dynamic tree (EAGLE-2)", Eagle2Options, build,
                     weights=EAGLE1, check=check,
                     paper={"total_tokens": 60, "depth": 6, "top_k": 10, "draft_vocab": 0,
                            **_FLOAT},
                     paper_source="EAGLE-2 (arXiv 2406.16858), Section 5: 60 nodes, depth 6, "
                     "top-k 10")
KIND_3 = DrafterKind(EAGLE3, "EAGLE-3 head over fused low/mid/high features, dynamic tree",
                     Eagle3Options, build, weights=EAGLE3, trainable=_trainable(interop.EAGLE3),
                     check=check, paper={"total_tokens": 60, "depth": 7, "top_k": 10, **_FLOAT},
                     paper_source="EAGLE-3 reference code (SafeAILab/EAGLE): total_token 60, "
                     "depth 7, top_k 10")
