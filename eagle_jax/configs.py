"""Typed configs: YAML files validated into (frozen, possibly nested) dataclasses.

Fields: int, float, str, bool, ``X | None``, ``Literal``, ``tuple``/``list``/``dict`` and nested
schema dataclasses (sections); ``key=value`` overrides take dotted keys and YAML values. User
mistakes raise a one-line :class:`EagleJaxError` naming the file and dotted key. A schema's
``validate(self)`` runs after it is built. Unlike PyYAML's defaults, ``1e-4`` is a float, only
``true``/``false`` are bools (``yes``, dates stay strings) and duplicate keys are errors.
"""

from __future__ import annotations

import dataclasses
import os
import re
import reprlib
import types
import typing
from typing import Any, Literal, Mapping, Sequence, TypeVar, Union

import yaml

from eagle_jax.errors import EagleJaxError

T = TypeVar("T")
_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
  """SafeLoader with YAML 1.2-style bools and floats, and no duplicate keys."""

  def construct_mapping(self, node, deep=False):
    keys = [k for k, _ in node.value if isinstance(k, yaml.ScalarNode) and not k.tag.endswith(":merge")]
    for i, k in enumerate(keys):
      if any((k.tag, k.value) == (j.tag, j.value) for j in keys[:i]):
        raise yaml.constructor.ConstructorError(None, None, f"duplicate key {k.value!r}", k.start_mark)
    return super().construct_mapping(node, deep=deep)


_Dumper = type("_Dumper", (yaml.SafeDumper,), {})  # also quotes strings _Loader reads as floats
_Loader.yaml_implicit_resolvers = {k: [r for r in v if not r[0].endswith((":bool", ":timestamp"))]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
for _cls in (_Loader, _Dumper):
  _cls.add_implicit_resolver(_FLOAT, _EXP_FLOAT, list("-+0123456789."))


def _yaml_error(e: yaml.YAMLError) -> str:
  mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
  at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
  return f"{getattr(e, 'problem', None) or getattr(e, 'context', None) or e}{at}"


def _name(tp: Any) -> str:
  """A type as a user reads it in an error message."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in args)
  if origin in (Union, types.UnionType):
    return " or ".join("null" if a is type(None) else _name(a) for a in args)
  if origin is list or (origin is tuple and args[-1:] == (Ellipsis,)):
    return f"list of {_name(args[0])}" if args else "list"
  if origin is tuple:
    return f"list of {len(args)} items"
  return "mapping" if origin is dict or dataclasses.is_dataclass(tp) else getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str, where: str) -> Any:
  """Checks (and converts: list -> tuple, int -> float) one value against a field type."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  bad = EagleJaxError(f"{where}: {key}: expected {_name(tp)}, got {reprlib.repr(value)}")
  if origin in (Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    rest = [a for a in args if a is not type(None)]
    for a in rest:
      try:
        return _coerce(a, value, key, where)
      except EagleJaxError as e:
        err = e
    raise bad if len(rest) > 1 or str(err).startswith(f"{where}: {key}: expected ") else err
  seq = origin in (tuple, list) or tp in (tuple, list)
  fixed = origin is tuple and bool(args) and args[-1] is not Ellipsis  # tuple[int, str]
  mapping = origin is dict or tp is dict or dataclasses.is_dataclass(tp)
  if origin is Literal:
    ok = any(value == a and type(value) is type(a) for a in args)
  elif tp in (int, float):
    ok = isinstance(value, (int, tp)) and not isinstance(value, bool)
  elif seq:
    ok = isinstance(value, (list, tuple)) and not (fixed and len(value) != len(args))
  elif mapping:
    ok = isinstance(value, Mapping)
  else:
    ok = tp is Any or not isinstance(tp, type) or isinstance(value, tp)
  if not ok:
    raise bad
  if tp is float:
    return float(value)
  if dataclasses.is_dataclass(tp):
    return _build(tp, value, where, key + ".")
  if seq:
    item_types = args if fixed else [args[0] if args else Any] * len(value)
    items = [_coerce(t, v, f"{key}[{i}]", where) for i, (t, v) in enumerate(zip(item_types, value))]
    return items if list in (origin, tp) else tuple(items)
  if mapping:
    kt, vt = args or (Any, Any)
    return {_coerce(kt, k, f"{key} key", where): _coerce(vt, v, f"{key}.{k}", where)
            for k, v in value.items()}
  return value


def _build(cls: type[T], data: Mapping, where: str, prefix: str) -> T:
  fields, hints = {f.name: f for f in dataclasses.fields(cls) if f.init}, typing.get_type_hints(cls)
  for k in data:
    if k not in fields:
      raise EagleJaxError(f"{where}: unknown key '{prefix}{k}' (known: {', '.join(fields)})")
  kwargs = {}
  for name, f in fields.items():
    if name in data:
      kwargs[name] = _coerce(hints[name], data[name], prefix + name, where)
    elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
      raise EagleJaxError(f"{where}: missing required key '{prefix}{name}'")
  try:
    cfg = cls(**kwargs)
    if callable(getattr(cfg, "validate", None)):
      cfg.validate()
  except (EagleJaxError, ValueError) as e:
    raise EagleJaxError(f"{where}: {prefix[:-1] + ': ' if prefix else ''}{e}") from e
  return cfg


def from_dict(cls: type[T], data: Mapping, *, where: str = "config") -> T:
  """Builds dataclass ``cls`` from a mapping (nested mappings for nested sections)."""
  if not isinstance(data, Mapping):
    raise EagleJaxError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
  return _build(cls, data, where, "")


def _split(item: str, where: str) -> tuple[list[str], Any]:
  key, eq, text = item.partition("=")
  parts = key.strip().split(".")
  if not eq or not all(parts):
    raise EagleJaxError(f"{where}: override {item!r}: expected key=value (e.g. optim.lr=1e-4)")
  try:
    return parts, yaml.load(text, Loader=_Loader)
  except yaml.YAMLError as e:
    raise EagleJaxError(f"{where}: override {item!r}: invalid value: {_yaml_error(e)}") from None


def _set(data: dict, parts: list[str], value: Any) -> None:
  for part in parts[:-1]:
    data[part] = data[part] if isinstance(data.get(part), dict) else {}
    data = data[part]
  data[parts[-1]] = value


def parse_overrides(items: Sequence[str], *, where: str = "overrides") -> dict:
  """Nested dict from ``key=value`` strings (later items win); values are parsed as YAML."""
  out: dict = {}
  for item in items:
    _set(out, *_split(item, where))
  return out


def read_yaml(path: str) -> dict:
  """The mapping in a YAML file, read with this module's rules (one-line errors)."""
  try:
    with open(path, encoding="utf-8") as f:
      data = yaml.load(f, Loader=_Loader)
  except OSError as e:
    raise EagleJaxError(f"{path}: cannot read config: {e.strerror or e}") from None
  except yaml.YAMLError as e:
    raise EagleJaxError(f"{path}: invalid YAML: {_yaml_error(e)}") from None
  data = {} if data is None else data  # an empty file: all defaults
  if not isinstance(data, dict):
    raise EagleJaxError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
  return data


def load_config(cls: type[T], path: str, overrides: Sequence[str] = ()) -> T:
  """Reads YAML at ``path``, applies ``key=value`` overrides, validates into ``cls``."""
  data = read_yaml(path)
  for item in overrides:
    _set(data, *_split(item, path))  # an unknown key is then reported by from_dict
  return from_dict(cls, data, where=path)


def to_dict(cfg: Any) -> Any:
  """A plain dict (tuples -> lists) of a config, for yaml/json dumps."""
  if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
    return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
  if isinstance(cfg, (list, tuple)):
    return [to_dict(v) for v in cfg]
  return {k: to_dict(v) for k, v in cfg.items()} if isinstance(cfg, Mapping) else cfg


def dump_config(cfg: Any, path: str) -> None:
  """Writes the resolved config as YAML (parent folders are created)."""
  try:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      yaml.dump(to_dict(cfg), f, Dumper=_Dumper, sort_keys=False)
  except OSError as e:
    raise EagleJaxError(f"{path}: cannot write config: {e.strerror or e}") from None
