"""What a drafter kind declares, in one place: :class:`DrafterKind`.

A kind has names (``eagle2``), an options dataclass (defaults and validation in
``__post_init__``), a ``build`` function that makes ``(drafter, dparams)`` for a target, and, if
it drafts with trained weights, the kind of those weights (``eagle2`` drafts with an EAGLE-1
head). A kind that owns trained weights also declares a :class:`Trainable`: its training-config
section, its training task, the drafter a training run measures itself with, its tuner, and
how its weights are written and read. :mod:`eagle_jax.drafters.registry` lists the kinds; the
CLI flags, the experiment config's method schema, the training pipeline and the runner are
derived from it.

Option fields are declared with :func:`option`: the help text and, where it differs from
``--field-name``, the command-line flag. The same field name in two kinds is the same flag.

Two budgets (:data:`BUDGETS`): ``tuned``, the options' own defaults (the budget tuned for this
machine where a kind has a tuner), and ``paper``, the published setting a kind declares in
``paper`` (options set explicitly win over it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from eagle_jax.errors import EagleJaxError


BUDGETS = ("tuned", "paper")
# the options that give a draft's shape (a paper setting's are dropped together)
_SHAPED = ("gamma", "tree", "top_k", "depth", "total_tokens", "pld_widths")


def option(default, help: str, flag: str | None = None, choices: tuple | None = None):
  """A drafter option: a dataclass field with its command-line help (and flag, and choices)."""
  return dataclasses.field(default=default, metadata={"help": help, "flag": flag,
                                                      "choices": choices})


def flag_of(field: dataclasses.Field) -> str:
  return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Context:
  """Where a drafter's weights come from: ``checkpoint`` (a trained run folder, its ``final/``,
  or for a draft model any model name, folder or ``.gguf``) or, when it is None, the trained
  run in ``runs_dir`` with the most training tokens for ``model`` (the target's name), else the
  drafter shipped for ``model`` (:mod:`eagle_jax.drafters.shipped`)."""

  model: str | None = None
  checkpoint: str | None = None
  runs_dir: str = "runs"


@dataclasses.dataclass(frozen=True)
class Trainable:
  """How a kind's weights are trained, tuned, written and read.

  - ``section``/``config``: the training config's section for this kind and its dataclass;
  - ``task(cfg, lm, train_shards, token_counts)``: the trainer's task (``token_counts``: reply
    token counts of the training rows when ``token_counts`` is True, else None);
  - ``eval_drafter(module, target, decode_eval)``: the drafter a run measures held-out
    acceptance with;
  - ``tune(final, lm, tune, split, heldout_metrics)``: picks a budget for this machine and
    records it in the export (None: nothing to tune);
  - ``save(module, folder, lm)`` / ``load(folder, meta)``: the exported weights;
  - ``validate(cfg)``: checks of the training config that involve this kind;
  - ``published``/``write_published(module, folder, meta)``: the published checkpoint format
    of these weights (:mod:`eagle_jax.drafters.interop`) and its writer (the kind's ``build``
    reads such folders too).
  """

  section: str
  config: type
  task: Callable[..., Any]
  eval_drafter: Callable[..., tuple]
  save: Callable[..., dict]
  load: Callable[..., Any]
  tune: Callable[..., dict] | None = None
  token_counts: bool = False
  validate: Callable[[Any], None] | None = None
  published: str | None = None
  write_published: Callable[..., str] | None = None


@dataclasses.dataclass(frozen=True)
class DrafterKind:
  name: str
  summary: str  # one line, for --help
  options: type  # a frozen dataclass of option() fields
  build: Callable[[Any, Any, Context], tuple]  # (target, options, context) -> (drafter, dparams)
  weights: str | None = None  # the trained kind whose weights it drafts with
  trainable: Trainable | None = None
  # (checkpoint, target ModelConfig, options) -> a one-line description, checking the
  # checkpoint against the target from config files only (no weights read); None: the
  # checkpoint folder is only required to exist
  check: Callable[[str, Any, Any], str] | None = None
  # ``--budget paper``: the option values of the method's published setting and where they are
  # given (docs/methods.md lists them); a kind without one runs the same under both budgets
  paper: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  paper_source: str = ""
  # options that, set explicitly, replace the paper's whole draft shape (a chain length, a
  # static tree)
  shape: tuple[str, ...] = ("gamma", "tree")

  def make_options(self, values: dict, budget: str = "tuned") -> Any:
    """This kind's options from ``{field: value}`` under ``budget`` (:data:`BUDGETS`); a field
    it does not read is an error."""
    fields = {f.name: f for f in dataclasses.fields(self.options)}
    if unused := [k for k in values if k not in fields]:
      reads = ", ".join(flag_of(f) for f in fields.values()) or "no options"
      raise EagleJaxError(f"{', '.join(flag_for(k) for k in unused)}: not used by --drafter "
                          f"{self.name} (it reads: {reads})")
    return self.options(**self.budget_values(values, budget))

  def budget_values(self, values: dict, budget: str) -> dict:
    """``values`` completed by the ``budget``'s settings: explicit values win, and an explicit
    shape (``shape``) replaces the paper's whole shape."""
    if budget not in BUDGETS:
      raise EagleJaxError(f"--budget: expected one of {', '.join(BUDGETS)}, got {budget!r}")
    if budget == "tuned":
      return dict(values)
    own_shape = any(k in self.shape for k in values)
    return {**{k: v for k, v in self.paper.items() if not (own_shape and k in _SHAPED)},
            **values}


_FLAGS: dict[str, str] = {}  # field name -> flag, filled by the registry


def flag_for(name: str) -> str:
  return _FLAGS.get(name, "--" + name.replace("_", "-"))


def register_flags(kinds) -> None:
  for kind in kinds:
    for f in dataclasses.fields(kind.options):
      _FLAGS[f.name] = flag_of(f)


def check_nonnegative(options, *names: str) -> None:
  for name in names:
    if getattr(options, name) < 0:
      raise EagleJaxError(f"{flag_for(name)} must be >= 0, got {getattr(options, name)}")


def check_tuned_or_nonnegative(options, *names: str) -> None:
  """Options where -1 means the checkpoint's tuned value."""
  for name in names:
    if getattr(options, name) < -1:
      raise EagleJaxError(f"{flag_for(name)} must be >= 0 (or -1: the checkpoint's tuned value), "
                          f"got {getattr(options, name)}")


def head_bits(requested: int, tuned: dict) -> int:
  """The bits a trained drafter's weights are drafted with: ``requested`` if set (>= 0), else
  the value its tuning recorded (``budget.head_bits``), else 0 (float32, as trained)."""
  bits = requested if requested >= 0 else tuned.get("head_bits", 0)
  if bits not in (0, 8):
    raise EagleJaxError(f"head_bits must be 0 (float32, as trained) or 8; got {bits}")
  return bits


HEAD_BITS_HELP = ("the drafter's weights as 8-bit blocks (8) or float32 as trained (0); "
                  "default (-1): the checkpoint's tuned value, else 0")
