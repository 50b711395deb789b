"""Drafters by name, for the CLI and benchmarks: ``make_drafter("pld", target, gamma=8)``."""

from __future__ import annotations

import dataclasses
import os

from eagle_jax.decoding.costs import verify_cost_curve
from eagle_jax.decoding.tree import EAGLE_DEFAULT_CHOICES, MEDUSA_DEFAULT_CHOICES, TreeSpec
from eagle_jax.drafters.draft_model.drafter import DraftModelDrafter, self_draft_model
from eagle_jax.drafters.eagle.drafter import EagleDrafter
from eagle_jax.drafters.eagle.train import top_tokens
from eagle_jax.drafters.medusa.drafter import MedusaDrafter
from eagle_jax.drafters.medusa.heads import best_tree
from eagle_jax.drafters.pld import PromptLookupDrafter, check_widths
from eagle_jax.drafters.storage import load_drafter, load_head, load_token_counts, read_meta
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.registry import load_model
from eagle_jax.model.transformer import Transformer, quantize_linears

DRAFTERS = ("vanilla", "pld", "pld-static", "draft-model", "self-draft", "medusa", "eagle1", "eagle2", "eagle3")
EAGLE_VERSION = {"eagle1": 1, "eagle2": 1, "eagle3": 3}  # EAGLE-2 drafts with EAGLE-1 weights


@dataclasses.dataclass(frozen=True)
class DrafterOptions:
  gamma: int = 0  # 0 = the drafter's default; eagle1 with gamma > 0 drafts a chain
  pld_min_ngram: int = 2
  pld_max_ngram: int = 3
  pld_widths: tuple[int, ...] = ()  # pld's cost-aware widths; () = (3, gamma)
  draft_model: str | None = None  # --drafter-ckpt: draft model (name/folder/.gguf) or trained head
  self_draft_layers: int = 0  # 0 = a third of the target's layers
  top_k: int = 0  # dynamic trees (eagle2/eagle3); 0 = the checkpoint's tuned value or default
  depth: int = 0
  total_tokens: int = 0  # eagle2/eagle3 dynamic trees; medusa: a tree of this many nodes
  tree: str = ""  # "default": the paper's static tree (EAGLE-1 25 nodes, Medusa 63 nodes)
  # eagle1/eagle2: draft over the K most frequent training-reply tokens through their rows of
  # the target's LM head (FR-Spec); 0 = the whole vocabulary, -1 = the checkpoint's tuned value
  draft_vocab: int = -1
  # eagle1/2/3, medusa, draft-model: 8 = the drafter's own weights (Medusa: its output layers;
  # a draft model: every float32 matrix and its tied embedding) rounded to 8-bit blocks (a
  # quarter of the bytes per draft step through the CPU kernel; drafts may change, the output
  # cannot), 0 = as trained, -1 = the checkpoint's tuned value (eagle2, eagle3, medusa), else
  # as trained
  head_bits: int = -1
  runs_dir: str = "runs"  # where trained drafters are looked up when no checkpoint is given

  def __post_init__(self):
    for name in ("gamma", "pld_min_ngram", "pld_max_ngram", "self_draft_layers", "top_k", "depth",
                 "total_tokens"):
      if getattr(self, name) < 0:
        raise EagleJaxError(f"{FLAGS[name]} must be >= 0, got {getattr(self, name)}")
    for name in ("draft_vocab", "head_bits"):  # -1 = the checkpoint's tuned value
      if getattr(self, name) < -1:
        raise EagleJaxError(f"{FLAGS[name]} must be >= 0 (or -1: the checkpoint's tuned value), "
                            f"got {getattr(self, name)}")


# the command-line flag of each option (``eagle-jax generate``, ``bench spec``)
FLAGS = {"gamma": "--gamma", "pld_min_ngram": "--pld-min-ngram", "pld_max_ngram": "--pld-max-ngram",
         "pld_widths": "--pld-widths", "draft_model": "--drafter-ckpt", "runs_dir": "--runs-dir",
         "self_draft_layers": "--self-draft-layers", "top_k": "--top-k-tree", "depth": "--depth",
         "total_tokens": "--total-tokens", "tree": "--tree", "draft_vocab": "--draft-vocab",
         "head_bits": "--head-bits"}
_TRAINED = ("draft_model", "runs_dir", "head_bits")
_DYNAMIC = ("top_k", "depth", "total_tokens")
USES = {  # the options each drafter reads
    "vanilla": (), "pld": ("gamma", "pld_min_ngram", "pld_max_ngram", "pld_widths"),
    "pld-static": ("gamma", "pld_min_ngram", "pld_max_ngram"),
    "self-draft": ("gamma", "self_draft_layers"), "draft-model": ("gamma",) + _TRAINED,
    "medusa": ("gamma", "total_tokens", "tree") + _TRAINED,
    "eagle1": ("gamma", "tree", "draft_vocab") + _TRAINED,
    "eagle2": ("gamma", "tree", "draft_vocab") + _DYNAMIC + _TRAINED,
    "eagle3": ("gamma", "tree") + _DYNAMIC + _TRAINED,
}


def check_options(name: str, options: DrafterOptions) -> None:
  """One-line error for an option set for drafter ``name`` that it would ignore: one it never
  reads, or one overridden by another (a static tree or a chain has no dynamic budget)."""
  set_ = {f.name for f in dataclasses.fields(DrafterOptions)
          if getattr(options, f.name) != getattr(DrafterOptions(), f.name)}
  unused = sorted(set_ - set(USES[name]), key=list(FLAGS).index)
  if unused:
    raise EagleJaxError(f"{', '.join(FLAGS[u] for u in unused)}: not used by --drafter {name} "
                        f"(it reads: {', '.join(FLAGS[u] for u in USES[name]) or 'no options'})")
  if "runs_dir" in set_ and "draft_model" in set_:
    raise EagleJaxError("--runs-dir: not used with --drafter-ckpt (the checkpoint is given)")
  if name in ("eagle1", "medusa") and "gamma" in set_ and options.tree == "default":
    raise EagleJaxError(f"--tree default: not used with --gamma (--drafter {name} then drafts "
                        "a chain)")
  if name in ("eagle2", "eagle3") and "gamma" in set_ and options.tree != "default":
    raise EagleJaxError(f"--gamma: --drafter {name} drafts a dynamic tree; a chain needs "
                        "--tree default or --drafter eagle1")
  static = options.tree == "default" or ("gamma" in set_ and name != "eagle1")
  if static and (clash := [u for u in ("total_tokens",) + _DYNAMIC[:2] if u in set_ and u in USES[name]]):
    raise EagleJaxError(f"{', '.join(FLAGS[u] for u in clash)}: not used with "
                        f"{'--tree default' if options.tree == 'default' else '--gamma'} "
                        "(a static tree or chain, not a budget)")


def method_spec(spec: str, options: DrafterOptions) -> tuple[str, DrafterOptions]:
  """``"eagle2:draft_vocab=8192:top_k=4"`` -> ``("eagle2", options with those fields)``, so one
  benchmark run can compare settings of a drafter side by side (tuples: ``pld_widths=3/8``)."""
  name, _, rest = spec.partition(":")
  fields = {f.name: f for f in dataclasses.fields(DrafterOptions)}
  changes = {}
  for item in filter(None, (x.strip() for x in rest.split(":"))):
    key, eq, value = item.partition("=")
    if not eq or key not in fields:
      raise EagleJaxError(f"method {spec!r}: expected NAME:key=value:... with keys from: "
                          f"{', '.join(fields)}")
    default = getattr(DrafterOptions(), key)
    try:
      changes[key] = (tuple(int(v) for v in value.split("/") if v) if isinstance(default, tuple)
                      else int(value) if isinstance(default, int) else value)
    except ValueError:
      raise EagleJaxError(f"method {spec!r}: {key} takes an integer, got {value!r}") from None
  if name not in DRAFTERS:
    raise EagleJaxError(f"unknown drafter {name!r} in method {spec!r}; choose from: {', '.join(DRAFTERS)}")
  if unused := [k for k in changes if k not in USES[name]]:
    raise EagleJaxError(f"method {spec!r}: {', '.join(unused)} not used by {name} (it reads: "
                        f"{', '.join(USES[name]) or 'no options'})")
  return name, dataclasses.replace(options, **changes)


def make_drafter(name: str, target: Transformer, options: DrafterOptions = DrafterOptions(),
                 model: str | None = None):
  """Returns ``(drafter, dparams)``; ``(None, None)`` for plain decoding.

  ``model`` (the target's name) narrows the search for trained heads in ``options.runs_dir``.
  """
  if name == "vanilla":
    return None, None
  if name in ("pld", "pld-static"):
    return prompt_lookup(target, options, cost_aware=name == "pld"), None
  if name == "self-draft":
    layers = options.self_draft_layers or max(1, target.config.num_layers // 3)
    return DraftModelDrafter.create(self_draft_model(target, layers), gamma=options.gamma or 3)
  if name in EAGLE_VERSION:
    return make_eagle(name, target, options, model)
  if name == "medusa":
    return make_medusa(target, options, model)
  if name == "draft-model":
    path = options.draft_model or find_checkpoint(name, options.runs_dir, model)
    if os.path.isfile(os.path.join(path, "final", "drafter.json")):  # a training run's folder
      path = os.path.join(path, "final")
    draft = load_model(path).model
    if head_bits(options, {}) == 8:  # its float32 weights (a GGUF's integer blocks stay as they are)
      quantize_linears(draft)
    return DraftModelDrafter.create(draft, gamma=options.gamma or 4,
                                    target_vocab=target.config.vocab_size)
  raise EagleJaxError(f"unknown drafter {name!r}; choose from: {', '.join(DRAFTERS)}")


def prompt_lookup(target: Transformer, options: DrafterOptions,
                  cost_aware: bool = True) -> PromptLookupDrafter:
  """Prompt lookup: ``pld`` picks its draft width from verify costs measured on this machine
  and the acceptance it has seen; ``pld-static`` drafts every match at full ``gamma``."""
  gamma = options.gamma or 8
  widths = (options.pld_widths or tuple(sorted({min(3, gamma), gamma}))) if cost_aware else ()
  check_widths(widths, gamma)  # before timing verify passes for them
  PromptLookupDrafter(gamma=gamma, min_ngram=options.pld_min_ngram, max_ngram=options.pld_max_ngram)
  costs = ()
  if widths:
    curve = verify_cost_curve(target, sizes=(1,) + tuple(w + 1 for w in widths))
    costs = tuple(round(curve[w + 1] / curve[1], 3) for w in widths)
  return PromptLookupDrafter(gamma=gamma, min_ngram=options.pld_min_ngram,
                             max_ngram=options.pld_max_ngram, widths=tuple(widths),
                             costs=costs)


def find_checkpoint(name: str, runs_dir: str, model: str | None = None) -> str:
  """The trained run in ``runs_dir`` for drafter ``name`` with the most training tokens."""
  want = {"eagle2": "eagle1"}.get(name, name)
  best = None
  if os.path.isdir(runs_dir):
    for run in sorted(os.listdir(runs_dir)):
      meta_path = os.path.join(runs_dir, run, "final", "drafter.json")
      if not os.path.isfile(meta_path):
        continue
      meta = read_meta(os.path.dirname(meta_path))
      if meta.get("drafter") != want or (model and meta.get("model") != model):
        continue
      key = (meta.get("train_tokens", 0), os.path.getmtime(meta_path))
      if best is None or key > best[0]:
        best = (key, os.path.join(runs_dir, run, "final"))
  if best is None:
    raise EagleJaxError(f"no trained {want} drafter{'' if not model else ' for ' + model} in "
                        f"{runs_dir}/ (train one with: eagle-jax train configs/train/{want}-quick.yaml"
                        f"{'' if not model else ' model=' + model}) and no checkpoint given")
  return best[1]


def make_eagle(name: str, target: Transformer, options: DrafterOptions, model: str | None = None):
  path = options.draft_model or find_checkpoint(name, options.runs_dir, model)
  head, meta = load_head(path)
  if head.config.version != EAGLE_VERSION[name]:
    raise EagleJaxError(f"{path}: holds an EAGLE-{head.config.version} head; --drafter {name} "
                        f"needs EAGLE-{EAGLE_VERSION[name]}")
  tuned = meta.get("budget", {}) if name != "eagle1" else {}
  if head_bits(options, tuned) == 8:
    quantize_linears(head)
  vocab = options.draft_vocab if options.draft_vocab >= 0 else tuned.get("draft_vocab", 0)
  if vocab and name == "eagle3":
    raise EagleJaxError("--draft-vocab applies to eagle1/eagle2; eagle3 drafts over the "
                        f"{head.config.vocab}-token vocabulary it was trained with")
  ids = draft_vocab_ids(path, target, vocab) if vocab else None
  if name == "eagle1" or options.tree == "default":
    tree = TreeSpec.chain(options.gamma) if options.gamma else TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES)
    drafter, dparams = EagleDrafter.create(head, target, tree, draft_ids=ids)
  else:
    drafter, dparams = EagleDrafter.create(
        head, target, None, draft_ids=ids, top_k=options.top_k or tuned.get("top_k", 8),
        depth=options.depth or tuned.get("depth", 5),
        total_tokens=options.total_tokens or tuned.get("total_tokens", 24))
  return drafter, dparams


def head_bits(options: DrafterOptions, tuned: dict) -> int:
  """The bits a trained drafter's weights are drafted with: ``options.head_bits`` if set, else
  the value its tuning recorded (``budget.head_bits``), else 0 (float32, as trained)."""
  bits = options.head_bits if options.head_bits >= 0 else tuned.get("head_bits", 0)
  if bits not in (0, 8):
    raise EagleJaxError(f"head_bits must be 0 (float32, as trained) or 8; got {bits}")
  return bits


def draft_vocab_ids(path: str, target: Transformer, size: int):
  """The ``size`` most frequent training-reply tokens of the head at ``path`` (EOS included)."""
  counts = load_token_counts(path, target.config.vocab_size)
  return top_tokens(counts, size, always=target.config.eos_token_ids)


def make_medusa(target: Transformer, options: DrafterOptions, model: str | None = None):
  """Medusa heads with the tree budget tuned after training (``total_tokens`` nodes of the
  best tree for the held-out rank accuracies, if given), or Medusa's 63-node default tree
  (``tree="default"``, or when the checkpoint carries no tuning)."""
  path = options.draft_model or find_checkpoint("medusa", options.runs_dir, model)
  heads, meta = load_drafter(path, ("medusa",))
  if head_bits(options, meta.get("budget", {})) == 8:
    heads.quantize8()
  depth = heads.config.num_heads
  if options.total_tokens and "rank_acc" not in meta:
    raise EagleJaxError(f"{path}: --total-tokens needs the held-out rank accuracies that tuning "
                        "records (none in drafter.json); use --tree default or --gamma")
  if options.tree == "default" or "rank_acc" not in meta:
    choices = [c for c in MEDUSA_DEFAULT_CHOICES if len(c) <= depth]
  elif options.total_tokens:
    choices = best_tree(meta["rank_acc"], options.total_tokens)[0]
  else:
    choices = meta["budget"]["tree"]
  if options.gamma:
    if options.gamma > depth:
      raise EagleJaxError(f"--gamma {options.gamma}: a Medusa chain is at most {depth} deep (one "
                          "node per head)")
    choices = TreeSpec.chain(options.gamma).choices
  return MedusaDrafter.create(heads, TreeSpec.from_choices(choices), target)
