"""The drafter registry: every drafter kind, by name.

Each kind is declared once, in its own module (:class:`eagle_jax.drafters.kinds.DrafterKind`);
this module lists them. The CLI's drafter flags, the experiment config's method schema, the
training pipeline and the runner read everything they need about a kind from here::

    kind = registry.get("eagle2")
    options = kind.make_options({"top_k": 4})
    drafter, dparams = registry.build("eagle2", target, options, Context(runs_dir="runs"))

Adding a drafter: write its module (the drafter, its options and ``build``, and if it is
trained a :class:`~eagle_jax.drafters.kinds.Trainable`) and add one line to :data:`KINDS`.
"""

from __future__ import annotations

import dataclasses
import os
import typing

from eagle_jax.drafters import interop, pld, shipped, storage
from eagle_jax.drafters.draft_model import kind as draft_model
from eagle_jax.drafters.eagle import kind as eagle
from eagle_jax.drafters.kinds import Context, DrafterKind, flag_for, flag_of, register_flags
from eagle_jax.drafters.medusa import kind as medusa
from eagle_jax.drafters.storage import final_folder, read_meta, save_token_counts, write_meta
from eagle_jax.errors import EagleJaxError


@dataclasses.dataclass(frozen=True)
class NoOptions:
  pass


VANILLA = DrafterKind("vanilla", "plain decoding, one target pass per token (the baseline)",
                      NoOptions, lambda target, options, context: (None, None))

KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    VANILLA,
    pld.PLD,
    pld.PLD_STATIC,
    draft_model.SELF_DRAFT,
    draft_model.DRAFT_MODEL,
    medusa.MEDUSA,
    eagle.KIND_1,
    eagle.KIND_2,
    eagle.KIND_3,
)}
register_flags(KINDS.values())

NAMES = tuple(KINDS)
TRAINABLE = tuple(n for n, k in KINDS.items() if k.trainable is not None)  # kinds with own weights
TRAINED = tuple(n for n, k in KINDS.items() if k.weights is not None)  # kinds drafting with them
# the context a trained kind reads, as option-like names (their flags: --drafter-ckpt, --runs-dir)
CONTEXT_FLAGS = {"checkpoint": "--drafter-ckpt", "runs_dir": "--runs-dir"}


def get(name: str) -> DrafterKind:
  if name not in KINDS:
    raise EagleJaxError(f"unknown drafter {name!r}; choose from: {', '.join(NAMES)}")
  return KINDS[name]


def option_fields() -> dict[str, dataclasses.Field]:
  """Every option of every kind by field name (one field per name: the first kind's)."""
  out = {}
  for kind in KINDS.values():
    for f in dataclasses.fields(kind.options):
      out.setdefault(f.name, f)
  return out


def option_types() -> dict[str, object]:
  """Every option's type by field name."""
  out = {}
  for kind in KINDS.values():
    for name, tp in typing.get_type_hints(kind.options).items():
      out.setdefault(name, tp)
  return out


def readers(field: str) -> list[str]:
  return [n for n, k in KINDS.items() if field in {f.name for f in dataclasses.fields(k.options)}]


def make_options(name: str, values: dict, context_set=(), budget: str = "tuned"):
  """Kind ``name``'s options from the options that were set (``values``) under ``budget``
  (``tuned`` or ``paper``: the kind's published setting, explicit values winning);
  ``context_set``: which of :data:`CONTEXT_FLAGS` were set. Anything the kind would ignore is a
  one-line error."""
  kind = get(name)
  fields = [f.name for f in dataclasses.fields(kind.options)]
  unused = [CONTEXT_FLAGS[c] for c in CONTEXT_FLAGS if c in context_set and kind.weights is None]
  unused += [flag_for(k) for k in values if k not in fields]
  if unused:
    reads = [flag_of(f) for f in dataclasses.fields(kind.options)]
    reads += list(CONTEXT_FLAGS.values()) if kind.weights else []
    raise EagleJaxError(f"{', '.join(unused)}: not used by --drafter {name} (it reads: "
                        f"{', '.join(reads) or 'no options'})")
  if {"checkpoint", "runs_dir"} <= set(context_set):
    raise EagleJaxError("--runs-dir: not used with --drafter-ckpt (the checkpoint is given)")
  return kind.options(**kind.budget_values(values, budget))


def build(name: str, target, options=None, context: Context = Context()) -> tuple:
  """``(drafter, dparams)`` of kind ``name`` for ``target``; ``(None, None)`` for vanilla."""
  kind = get(name)
  return kind.build(target, kind.options() if options is None else options, context)


def check(name: str, checkpoint: str, target_config, options=None) -> str:
  """A one-line description of the checkpoint kind ``name`` would draft with, checked against
  the target's :class:`~eagle_jax.model.config.ModelConfig` from config files only (no
  weights read); a checkpoint for another target, or of another kind, is a one-line error."""
  kind = get(name)
  if not os.path.exists(checkpoint):
    raise EagleJaxError(f"{checkpoint}: no such checkpoint folder (--drafter {name})")
  options = kind.options() if options is None else options
  return kind.check(checkpoint, target_config, options) if kind.check else checkpoint


def checkpoint_of(name: str, context: Context) -> str | None:
  """The checkpoint a trained kind drafts with (None for kinds without weights)."""
  kind = get(name)
  if kind.weights is None:
    return None
  return context.checkpoint or find_checkpoint(kind.weights, context.runs_dir, context.model)


def find_checkpoint(name: str, runs_dir: str, model: str | None = None) -> str:
  """The weights kind ``name`` drafts with: the trained run in ``runs_dir`` with the most
  training tokens (for target ``model`` if given), else the shipped drafter."""
  return shipped.find_checkpoint(get(name).weights or name, runs_dir, model)


def method_spec(spec: str) -> tuple[str, dict]:
  """``"eagle2:draft_vocab=8192:top_k=4"`` -> ``("eagle2", {"draft_vocab": 8192, "top_k": 4})``,
  so one benchmark run can compare settings of a drafter side by side (tuples:
  ``pld_widths=3/8``; ``checkpoint=PATH`` sets the checkpoint)."""
  name, _, rest = spec.partition(":")
  fields = option_fields()
  values = {}
  for item in filter(None, (x.strip() for x in rest.split(":"))):
    key, eq, value = item.partition("=")
    if not eq or (key not in fields and key != "checkpoint"):
      raise EagleJaxError(f"method {spec!r}: expected NAME:key=value:... with keys from: "
                          f"{', '.join(list(fields) + ['checkpoint'])}")
    default = None if key == "checkpoint" else fields[key].default
    try:
      values[key] = (tuple(int(v) for v in value.split("/") if v) if isinstance(default, tuple)
                     else int(value) if isinstance(default, int) else value)
    except ValueError:
      raise EagleJaxError(f"method {spec!r}: {key} takes an integer, got {value!r}") from None
  kind = get(name) if name in KINDS else None
  if kind is None:
    raise EagleJaxError(f"unknown drafter {name!r} in method {spec!r}; choose from: {', '.join(NAMES)}")
  reads = [f.name for f in dataclasses.fields(kind.options)] + (["checkpoint"] if kind.weights else [])
  if unused := [k for k in values if k not in reads]:
    raise EagleJaxError(f"method {spec!r}: {', '.join(unused)} not used by {name} (it reads: "
                        f"{', '.join(reads) or 'no options'})")
  return name, values


# -- trained weights -------------------------------------------------------------------------

def export_drafter(name: str, module, folder: str, meta: dict, lm, token_counts=None) -> None:
  """Writes the trained ``module`` of kind ``name`` to ``folder`` with ``drafter.json``."""
  os.makedirs(folder, exist_ok=True)
  extra = get(name).trainable.save(module, folder, lm)
  if token_counts is not None:
    save_token_counts(folder, token_counts)
  write_meta(folder, {**meta, "drafter": name, **extra})


def load_drafter(path: str, kinds=None):
  """``(module, meta)`` of the drafter exported at ``path``; its kind must be in ``kinds``
  (default: every trainable kind)."""
  kinds = TRAINABLE if kinds is None else tuple(kinds)
  folder = final_folder(path)
  meta = read_meta(path)
  kind = meta.get("drafter")
  if kind not in kinds:
    raise EagleJaxError(f"{folder}: holds a {kind!r} drafter; expected one of: {', '.join(kinds)}")
  return KINDS[kind].trainable.load(folder, meta), meta


def published_formats() -> dict[str, str]:
  """Published checkpoint format -> the trainable kind whose weights it holds."""
  return {k.trainable.published: n for n, k in KINDS.items()
          if k.trainable is not None and k.trainable.published}


def export_published(path: str, fmt: str, out: str) -> str:
  """Writes the trained drafter at ``path`` (a run or its ``final/``) to ``out`` in published
  format ``fmt`` (:mod:`eagle_jax.drafters.interop`); returns ``out``."""
  formats = published_formats()
  if fmt not in formats:
    raise EagleJaxError(f"--format {fmt!r}: choose from {', '.join(formats)}")
  if interop.detect(path) is not None:
    raise EagleJaxError(f"{path}: already a published {interop.detect(path)} folder")
  module, meta = load_drafter(path)
  kind = meta["drafter"]
  have = get(kind).trainable.published
  if have != fmt:
    hint = f"; export it with --format {have}" if have else " (no published format)"
    raise EagleJaxError(f"{path}: holds a {kind} drafter, not {formats[fmt]}{hint}")
  if os.path.abspath(out) == os.path.abspath(final_folder(path)):
    raise EagleJaxError(f"{out}: the export would overwrite the run's own folder; pick another")
  return get(kind).trainable.write_published(module, out, meta)
