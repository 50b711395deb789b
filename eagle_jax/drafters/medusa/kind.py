"""The ``medusa`` kind: options, building from a checkpoint, training, tree tuning, storage."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from flax import nnx

from eagle_jax.decoding.costs import draft_cost_ms, verify_cost_up_to
from eagle_jax.decoding.tree import MEDUSA_DEFAULT_CHOICES, TreeSpec
from eagle_jax.drafters import interop
from eagle_jax.drafters.kinds import (
  HEAD_BITS_HELP,
  DrafterKind,
  Trainable,
  check_nonnegative,
  check_tuned_or_nonnegative,
  head_bits,
  option,
)
from eagle_jax.drafters.medusa import official
from eagle_jax.drafters.medusa.drafter import MedusaDrafter
from eagle_jax.drafters.medusa.heads import (
  MedusaConfig,
  MedusaHeads,
  MedusaTask,
  best_tree,
  rank_accuracies,
  tune_tree,
)
from eagle_jax.drafters.shipped import find_checkpoint
from eagle_jax.drafters.storage import (
  final_folder,
  load_params,
  read_meta,
  save_params,
  write_meta,
)
from eagle_jax.errors import EagleJaxError

NAME = "medusa"


@dataclasses.dataclass(frozen=True)
class MedusaTrainConfig:
  num_heads: int = 4
  num_layers: int = 1  # residual blocks per head
  positions_per_row: int = 128  # loss positions sampled per row (0 = all)
  decay: float = 0.8  # loss weight of head k: decay**k


@dataclasses.dataclass(frozen=True)
class MedusaOptions:
  gamma: int = option(0, "a chain of this many nodes, one per head (0 = a tree)")
  total_tokens: int = option(0, "nodes of the best static tree for the held-out rank "
                             "accuracies (0 = the tuned budget)")
  tree: str = option("", "default = Medusa's 63-node tree instead of the tuned budget",
                     choices=("", "default"))
  head_bits: int = option(-1, "Medusa: its output layers; " + HEAD_BITS_HELP)

  def __post_init__(self):
    check_nonnegative(self, "gamma", "total_tokens")
    check_tuned_or_nonnegative(self, "head_bits")
    if self.tree not in ("", "default"):
      raise EagleJaxError(f"--tree: expected 'default' or nothing, got {self.tree!r}")
    if self.gamma and self.tree == "default":
      raise EagleJaxError(f"--tree default: not used with --gamma (--drafter {NAME} then drafts "
                          "a chain)")
    if (self.gamma or self.tree == "default") and self.total_tokens:
      raise EagleJaxError(f"--total-tokens: not used with "
                          f"{'--tree default' if self.tree == 'default' else '--gamma'} "
                          "(a static tree or chain, not a budget)")


def _default_tree(depth: int) -> TreeSpec:
  return TreeSpec.from_choices([c for c in MEDUSA_DEFAULT_CHOICES if len(c) <= depth])


def build(target, options: MedusaOptions, context) -> tuple:
  """Medusa heads with the tree budget tuned after training (``total_tokens`` nodes of the
  best tree for the held-out rank accuracies, if given), or Medusa's 63-node default tree
  (``tree="default"``, or when the checkpoint carries no tuning)."""
  path = context.checkpoint or find_checkpoint(NAME, context.runs_dir, context.model)
  heads, meta = load_weights(path)
  if head_bits(options.head_bits, meta.get("budget", {})) == 8:
    heads.quantize8()
  depth = heads.config.num_heads
  if options.total_tokens and "rank_acc" not in meta:
    raise EagleJaxError(f"{path}: --total-tokens needs the held-out rank accuracies that tuning "
                        "records (none in drafter.json); use --tree default or --gamma")
  if options.tree == "default" or "rank_acc" not in meta:
    tree = _default_tree(depth)
  elif options.total_tokens:
    tree = TreeSpec.from_choices(best_tree(meta["rank_acc"], options.total_tokens)[0])
  else:
    tree = TreeSpec.from_choices(meta["budget"]["tree"])
  if options.gamma:
    if options.gamma > depth:
      raise EagleJaxError(f"--gamma {options.gamma}: a Medusa chain is at most {depth} deep (one "
                          "node per head)")
    tree = TreeSpec.chain(options.gamma)
  return MedusaDrafter.create(heads, tree, target)


def check(path: str, target, options: MedusaOptions) -> str:
  """The heads at ``path`` checked against the target config ``target`` without their weights."""
  fmt = interop.format_of(path)
  if fmt == interop.MEDUSA:
    heads, text = official.describe_published(path, target.hidden_size, target.vocab_size)
  elif fmt is not None:
    raise EagleJaxError(f"{path}: holds a published {fmt} checkpoint; expected Medusa heads")
  else:
    meta = read_meta(path)
    if meta.get("drafter") != NAME:
      raise EagleJaxError(f"{path}: holds a {meta.get('drafter')!r} drafter; expected one of: {NAME}")
    heads, text = None, f"Medusa-1 heads trained for {meta.get('model')}"
  if heads is not None and options.gamma > heads:
    raise EagleJaxError(f"--gamma {options.gamma}: a Medusa chain is at most {heads} deep (one "
                        "node per head)")
  return text


def load_weights(path: str):
  """``(heads, meta)`` of the Medusa heads at ``path``: a trained run, its ``final/`` folder,
  or a published Medusa-1 folder."""
  fmt = interop.detect(path)
  if fmt == interop.MEDUSA:
    return official.read_published(path), {"drafter": NAME, "published": fmt, "source": path}
  if fmt is not None:
    raise EagleJaxError(f"{path}: holds a published {fmt} checkpoint; expected Medusa heads")
  folder = final_folder(path)
  meta = read_meta(path)
  if meta.get("drafter") != NAME:
    raise EagleJaxError(f"{folder}: holds a {meta.get('drafter')!r} drafter; expected one of: {NAME}")
  return _load(folder, meta), meta


def _task(cfg, lm, train_shards, token_counts=None):
  m = cfg.medusa
  heads = MedusaConfig(num_heads=m.num_heads, num_layers=m.num_layers,
                       hidden_size=lm.config.hidden_size, vocab_size=lm.config.vocab_size)
  lm_head = lm.model.embed if lm.model.lm_head is None else lm.model.lm_head.weight
  return MedusaTask(config=heads, lm_head_VxD=np.asarray(lm_head[...]),
                    positions_per_row=m.positions_per_row, decay=m.decay)


def _eval_drafter(module, target, decode_eval):
  return MedusaDrafter.create(module, _default_tree(module.config.num_heads), target)


def _save(module, folder: str, lm) -> dict:
  save_params(module, folder)
  return {"head": module.config.to_dict()}


def _load(folder: str, meta: dict):
  cfg = MedusaConfig.from_dict(meta["head"])
  return load_params(nnx.eval_shape(lambda: MedusaHeads(cfg, rngs=nnx.Rngs(0))), folder)


def tune(final: str, lm, t, prompts, heldout_metrics: dict | None = None) -> dict:
  """Picks the Medusa tree budget (:func:`eagle_jax.drafters.medusa.heads.tune_tree`); records
  it and the held-out rank accuracies it came from in ``drafter.json`` (re-tuning reuses
  those). ``t``: the tuning settings; ``prompts``: held-out prompts (the first is timed)."""
  final = final_folder(final)
  heads, meta = load_weights(final)
  if heldout_metrics is None and "rank_acc" not in meta:
    raise EagleJaxError(f"{final}: no held-out rank accuracies recorded; re-run its training")
  acc = meta["rank_acc"] if heldout_metrics is None else rank_accuracies(
      heldout_metrics, heads.config.num_heads)
  if t.head_bits == 8:
    heads.quantize8()
  costs = {}  # a draft step runs only the heads the tree reaches: its cost by depth
  for depth in range(1, heads.config.num_heads + 1):
    drafter, dparams = MedusaDrafter.create(heads, TreeSpec.chain(depth))
    costs[depth] = draft_cost_ms(drafter, dparams, lm.model, prompts[0])
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


def _write_published(module, folder: str, meta: dict) -> str:
  return official.write_published(module, folder, meta.get("model"))


def _validate(cfg) -> None:
  if cfg.tune.enabled and min(cfg.data.heldout_rows, cfg.loop.eval_rows) < cfg.loop.batch_rows:
    raise EagleJaxError(f"{NAME}'s tree tuning reads held-out rank accuracies: data.heldout_rows and "
                        f"loop.eval_rows must be >= loop.batch_rows={cfg.loop.batch_rows} "
                        "(or set tune.enabled=false)")


MEDUSA = DrafterKind(
    NAME, "Medusa-1 heads over the target's last hidden state, a static tree", MedusaOptions,
    build, weights=NAME,
    trainable=Trainable(section="medusa", config=MedusaTrainConfig, task=_task,
                        eval_drafter=_eval_drafter, save=_save, load=_load, tune=tune,
                        validate=_validate, published=interop.MEDUSA,
                        write_published=_write_published),
    paper={"tree": "default", "head_bits": 0},
    paper_source="Medusa-1 (arXiv 2401.10774): the 63-node tree its code ships for Vicuna-7B",
    shape=("gamma", "tree", "total_tokens"),  # total_tokens: the size of a static tree
    check=check)
