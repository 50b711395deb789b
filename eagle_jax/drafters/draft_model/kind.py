"""The ``self-draft`` and ``draft-model`` kinds: options, building, training and storage."""

from __future__ import annotations

import dataclasses
import os

from eagle_jax.drafters.draft_model.drafter import DraftModelDrafter, self_draft_model
from eagle_jax.drafters.draft_model.train import DistillTask, DraftModelConfig
from eagle_jax.drafters.kinds import (
  HEAD_BITS_HELP,
  DrafterKind,
  Trainable,
  check_nonnegative,
  check_tuned_or_nonnegative,
  head_bits,
  option,
)
from eagle_jax.drafters.shipped import find_checkpoint
from eagle_jax.model.checkpoints import save_hf_folder
from eagle_jax.model.registry import load_model
from eagle_jax.model.transformer import quantize_linears


@dataclasses.dataclass(frozen=True)
class SelfDraftOptions:
  gamma: int = option(3, "draft length (chain)")
  self_draft_layers: int = option(0, "target layers used as the draft (0 = a third)")

  def __post_init__(self):
    check_nonnegative(self, "gamma", "self_draft_layers")


@dataclasses.dataclass(frozen=True)
class DraftModelOptions:
  gamma: int = option(4, "draft length (chain)")
  head_bits: int = option(-1, "draft model: every float32 matrix and its tied embedding; "
                          + HEAD_BITS_HELP)

  def __post_init__(self):
    check_nonnegative(self, "gamma")
    check_tuned_or_nonnegative(self, "head_bits")


def build_self_draft(target, options: SelfDraftOptions, context=None) -> tuple:
  layers = options.self_draft_layers or max(1, target.config.num_layers // 3)
  return DraftModelDrafter.create(self_draft_model(target, layers), gamma=options.gamma or 3)


def build_draft_model(target, options: DraftModelOptions, context) -> tuple:
  path = context.checkpoint or find_checkpoint("draft-model", context.runs_dir, context.model)
  if os.path.isfile(os.path.join(path, "final", "drafter.json")):  # a training run's folder
    path = os.path.join(path, "final")
  draft = load_model(path, target.embed.value.dtype).model  # in the target's dtype
  if head_bits(options.head_bits, {}) == 8:  # its float32 weights (a GGUF's integer blocks stay)
    quantize_linears(draft)
  return DraftModelDrafter.create(draft, gamma=options.gamma or 4,
                                  target_vocab=target.config.vocab_size)


def _task(cfg, lm, train_shards, token_counts=None):
  return DistillTask.of(lm.model, cfg.draft_model)


def _eval_drafter(module, target, decode_eval):
  return DraftModelDrafter.create(module, gamma=decode_eval.gamma,
                                  target_vocab=target.config.vocab_size)


def _save(module, folder: str, lm) -> dict:
  save_hf_folder(module, folder, lm.folder)  # a complete Hugging Face folder
  return {}


def _load(folder: str, meta: dict):
  return load_model(folder).model


SELF_DRAFT = DrafterKind("self-draft", "the target's first layers as a draft model (no training)",
                         SelfDraftOptions, build_self_draft)
DRAFT_MODEL = DrafterKind(
    "draft-model", "a small Llama distilled from the target (or any model sharing its tokenizer)",
    DraftModelOptions, build_draft_model, weights="draft-model",
    trainable=Trainable(section="draft_model", config=DraftModelConfig, task=_task,
                        eval_drafter=_eval_drafter, save=_save, load=_load),
    paper={"gamma": 4, "head_bits": 0},
    paper_source="speculative sampling (Chen et al., arXiv 2302.01318): K = 4 drafted tokens")
