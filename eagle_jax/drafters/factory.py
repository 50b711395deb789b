"""Drafters by name, for the CLI and benchmarks: ``make_drafter("pld", target, gamma=8)``."""

from __future__ import annotations

import dataclasses

from eagle_jax.drafters.draft_model import DraftModelDrafter, self_draft_model
from eagle_jax.drafters.pld import PromptLookupDrafter
from eagle_jax.errors import EagleJaxError
from eagle_jax.model import Transformer

DRAFTERS = ("vanilla", "pld", "draft-model", "self-draft")


@dataclasses.dataclass(frozen=True)
class DrafterOptions:
  gamma: int = 0  # 0 = the drafter's default
  pld_min_ngram: int = 2
  pld_max_ngram: int = 3
  draft_model: str | None = None  # registered name, HF folder or .gguf (draft-model)
  self_draft_layers: int = 0  # 0 = a third of the target's layers


def make_drafter(name: str, target: Transformer, options: DrafterOptions = DrafterOptions()):
  """Returns ``(drafter, dparams)``; ``(None, None)`` for plain decoding."""
  if name == "vanilla":
    return None, None
  if name == "pld":
    return PromptLookupDrafter(gamma=options.gamma or 8, min_ngram=options.pld_min_ngram,
                               max_ngram=options.pld_max_ngram), None
  if name == "self-draft":
    layers = options.self_draft_layers or max(1, target.config.num_layers // 3)
    return DraftModelDrafter.create(self_draft_model(target, layers), gamma=options.gamma or 3)
  if name == "draft-model":
    if not options.draft_model:
      raise EagleJaxError("--drafter draft-model needs --drafter-ckpt NAME_OR_PATH (a model "
                          "sharing the target's tokenizer)")
    from eagle_jax.registry import load_model

    draft = load_model(options.draft_model).model
    return DraftModelDrafter.create(draft, gamma=options.gamma or 4,
                                    target_vocab=target.config.vocab_size)
  raise EagleJaxError(f"unknown drafter {name!r}; choose from: {', '.join(DRAFTERS)}")
