"""Training settings shared by every drafter kind: the data budget and held-out split, the
feature cache, budget tuning after training, and the held-out decoding a run measures itself
with. A training config (:class:`eagle_jax.pipeline.train.TrainConfig`) holds these sections
beside the sections of the kinds it can train."""

from __future__ import annotations

import dataclasses
from typing import Literal

from eagle_jax.errors import EagleJaxError
from eagle_jax.training.sharegpt import load_sharegpt, split_heldout


@dataclasses.dataclass(frozen=True)
class DataConfig:
  heldout_fraction: float = 0.02
  max_len: int = 512  # tokens per conversation (longer ones are truncated)
  row_len: int = 512  # packed row length
  train_rows: int = 256  # feature-cache budget (0 = every training conversation)
  heldout_rows: int = 16
  split_seed: int = 0
  # the assistant replies trained on: ShareGPT's own, or the target's (a folder that
  # eagle-jax data regenerate wrote from this split's training conversations, in ``regenerated``);
  # the held-out rows are ShareGPT's held-out conversations either way
  replies: Literal["sharegpt", "target"] = "sharegpt"
  regenerated: str = ""

  def validate(self):
    if not 0 < self.heldout_fraction < 1:
      raise EagleJaxError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
    if self.replies == "target" and not self.regenerated:
      raise EagleJaxError("replies: target needs regenerated: the folder of a regenerated dataset "
                          "(eagle-jax data regenerate CONFIG writes one)")
    if self.replies == "sharegpt" and self.regenerated:
      raise EagleJaxError(f"regenerated: {self.regenerated!r} is read only with replies: target "
                          "(replies is sharegpt)")
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
class TuneConfig:
  """Budget tuning after training (a kind's :attr:`~eagle_jax.drafters.kinds.Trainable.tune`):
  EAGLE-2 trees (:mod:`eagle_jax.drafters.eagle.tune`), Medusa trees
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
  # to 8-bit blocks (EAGLE: every linear of the head; Medusa: each head's output layer), 0 =
  # float32 as trained
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


def heldout_prompts(tokenizer, count: int, data: DataConfig = DataConfig()) -> list[list[int]]:
  """First user turns of held-out ShareGPT conversations (``data``'s split), as chat prompts."""
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
