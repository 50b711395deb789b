"""Typed YAML configs: loading, overrides, one-line errors naming file and key, round-trips."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional

import pytest
import yaml

from eagle_jax.configs import dump_config, from_dict, load_config, parse_overrides, to_dict
from eagle_jax.errors import EagleJaxError


@dataclasses.dataclass(frozen=True)
class Data:
  path: str
  max_len: int = 256
  lengths: tuple[int, ...] = (1, 2)


@dataclasses.dataclass(frozen=True)
class Optim:
  lr: float = 3e-4
  warmup_steps: int = 0
  schedule: Literal["cosine", "linear"] = "cosine"
  clip: Optional[float] = None

  def validate(self) -> None:
    if self.lr <= 0:
      raise ValueError(f"lr must be positive, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class Train:
  name: str
  data: Data
  optim: Optim = dataclasses.field(default_factory=Optim)
  seed: int = 0
  bf16: bool = True
  tags: list[str] = dataclasses.field(default_factory=list)
  note: str | None = None
  extra: dict[str, int] = dataclasses.field(default_factory=dict)

  def validate(self) -> None:
    if self.seed < 0:
      raise EagleJaxError("seed must be >= 0")


GOOD = """\
name: run1
data:
  path: /data/train.jsonl
  lengths: [128, 256]
optim:
  lr: 1e-4
  schedule: linear
  clip: 1
tags: [a, b]
extra: {x: 1}
"""


def _write(tmp_path, text, name="x.yaml"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def _error(cls, path, overrides=()):
  with pytest.raises(EagleJaxError) as info:
    load_config(cls, path, overrides)
  msg = str(info.value)
  assert len(msg.splitlines()) == 1, msg
  assert msg.startswith(f"{path}: "), msg
  return msg


def test_good_yaml_loads(tmp_path):
  cfg = load_config(Train, _write(tmp_path, GOOD))
  assert cfg == Train(
      name="run1", data=Data(path="/data/train.jsonl", lengths=(128, 256)),
      optim=Optim(lr=1e-4, schedule="linear", clip=1.0), tags=["a", "b"], extra={"x": 1})
  assert isinstance(cfg.data.lengths, tuple) and isinstance(cfg.optim.clip, float)
  assert cfg.data.max_len == 256 and cfg.bf16 is True and cfg.note is None


def test_from_dict_default_where():
  cfg = from_dict(Train, {"name": "n", "data": {"path": "p"}})
  assert cfg.optim == Optim() and cfg.data.lengths == (1, 2)
  with pytest.raises(EagleJaxError, match=r"^config: data\.max_len: expected int, got 'x'$"):
    from_dict(Train, {"name": "n", "data": {"path": "p", "max_len": "x"}})


@pytest.mark.parametrize("text, expected", [
    (GOOD.replace("  lr: 1e-4", "  lrr: 1e-4"),
     "unknown key 'optim.lrr' (known: lr, warmup_steps, schedule, clip)"),
    (GOOD + "bogus: 1\n", "unknown key 'bogus' (known: name, data, optim,"),
    (GOOD.replace("  path: /data/train.jsonl\n", ""), "missing required key 'data.path'"),
    (GOOD.replace("name: run1\n", ""), "missing required key 'name'"),
    (GOOD.replace("lr: 1e-4", "lr: abc"), "optim.lr: expected float, got 'abc'"),
    (GOOD.replace("lr: 1e-4", "lr: true"), "optim.lr: expected float, got True"),
    (GOOD + "seed: 1.5\n", "seed: expected int, got 1.5"),
    (GOOD + "seed: false\n", "seed: expected int, got False"),
    (GOOD + "bf16: yes\n", "bf16: expected bool, got 'yes'"),
    (GOOD + "bf16: 1\n", "bf16: expected bool, got 1"),
    (GOOD + "note: 1\n", "note: expected str or null, got 1"),
    (GOOD.replace("schedule: linear", "schedule: step"),
     "optim.schedule: expected one of 'cosine', 'linear', got 'step'"),
    (GOOD.replace("clip: 1", "clip: [1]"), "optim.clip: expected float or null, got [1]"),
    (GOOD.replace("[128, 256]", "[128, x]"), "data.lengths[1]: expected int, got 'x'"),
    (GOOD.replace("[128, 256]", "128"), "data.lengths: expected list of int, got 128"),
    (GOOD.replace("{x: 1}", "{x: one}"), "extra.x: expected int, got 'one'"),
    ("name: a\ndata: 5\n", "data: expected mapping, got 5"),
    ("name: a\ndata: {path: p, max_len: 1, oops: 2}\n", "unknown key 'data.oops' (known: path, max_len, lengths)"),
    (GOOD + "seed: -1\n", "seed must be >= 0"),
    (GOOD.replace("lr: 1e-4", "lr: 0"), "optim: lr must be positive, got 0.0"),
    (GOOD + "seed: 1\nseed: 2\n", "invalid YAML: duplicate key 'seed' at line"),
    ("name: [unclosed\n", "invalid YAML: "),
    ("- a\n- b\n", "expected a mapping at the top level, got list"),
])
def test_errors_name_file_and_key(tmp_path, text, expected):
  path = _write(tmp_path, text)
  assert expected in _error(Train, path)


def test_missing_file(tmp_path):
  path = str(tmp_path / "nope.yaml")
  assert "No such file" in _error(Train, path)


def test_overrides_apply(tmp_path):
  path = _write(tmp_path, GOOD)
  cfg = load_config(Train, path, [
      "optim.lr=2e-5", "data.max_len=512", "name=foo", "data.lengths=[1, 2, 3]", "optim.clip=null",
      "bf16=false", "tags=[]", "note=hello world", "optim.warmup_steps=10", "seed=3", "seed=4",
      "extra.y=2"])
  assert cfg.optim == Optim(lr=2e-5, warmup_steps=10, schedule="linear", clip=None)
  assert cfg.data == Data(path="/data/train.jsonl", max_len=512, lengths=(1, 2, 3))
  assert (cfg.name, cfg.bf16, cfg.tags, cfg.note, cfg.seed) == ("foo", False, [], "hello world", 4)
  assert cfg.extra == {"x": 1, "y": 2}
  assert load_config(Train, path, ["name='123'"]).name == "123"


def test_override_errors(tmp_path):
  path = _write(tmp_path, GOOD)
  assert "override 'optim.lr'" in _error(Train, path, ["optim.lr"])
  assert "expected key=value" in _error(Train, path, ["=3"])
  assert "unknown key 'optim.lrr' (known: lr," in _error(Train, path, ["optim.lrr=1"])
  assert "unknown key 'model'" in _error(Train, path, ["model.dim=8"])
  assert "optim.lr: expected float, got 'abc'" in _error(Train, path, ["optim.lr=abc"])
  assert "override 'seed=[1'" in _error(Train, path, ["seed=[1"])
  assert "optim: lr must be positive, got -1.0" in _error(Train, path, ["optim.lr=-1"])


def test_parse_overrides():
  assert parse_overrides(["a.b=1", "a.c=1e-3", "d=[1, x]", "e=null", "f=true", "a.b=2"]) == {
      "a": {"b": 2, "c": 1e-3}, "d": [1, "x"], "e": None, "f": True}
  with pytest.raises(EagleJaxError, match="override 'oops'"):
    parse_overrides(["oops"])


def test_round_trip(tmp_path):
  cfg = load_config(Train, _write(tmp_path, GOOD), ["note='1e-4'", "tags=[yes, '2024-01-01', 'true']"])
  assert cfg.tags == ["yes", "2024-01-01", "true"]  # strings that look like floats/bools/dates
  plain = to_dict(cfg)
  assert plain["data"]["lengths"] == [128, 256] and isinstance(plain["data"], dict)
  assert yaml.safe_load(yaml.safe_dump(plain)) == plain
  out = str(tmp_path / "run" / "resolved.yaml")
  dump_config(cfg, out)
  assert os.path.exists(out)
  assert load_config(Train, out) == cfg


def test_empty_file_uses_defaults(tmp_path):
  @dataclasses.dataclass(frozen=True)
  class AllDefaults:
    seed: int = 1

  assert load_config(AllDefaults, _write(tmp_path, "")) == AllDefaults()
