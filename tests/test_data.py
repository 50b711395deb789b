"""Evaluation prompt loaders: MT-bench, user JSONL files, and the even spread over categories."""

import collections
import re

import pytest

from eagle_jax.evaluation.prompts import Question, load_jsonl_prompts, load_mtbench, pick_questions
from eagle_jax.errors import EagleJaxError


def test_pick_questions_spreads_evenly_and_fills_from_larger_categories():
  qs = load_mtbench()
  assert len(qs) == 80
  for num in (6, 12, 16, 20):
    per = collections.Counter(q.category for q in pick_questions(qs, num))
    assert sum(per.values()) == num and max(per.values()) - min(per.values(), default=0) <= 1
    assert len(per) == min(num, 8)  # every category gets a question before any gets a second
  small = [Question("a1", "a", ("x",)), Question("b1", "b", ("x",)), Question("b2", "b", ("x",)),
           Question("b3", "b", ("x",))]
  assert [q.question_id for q in pick_questions(small, 3)] == ["a1", "b1", "b2"]  # a ran out


@pytest.mark.parametrize("text, expected", [
    ('["a"]\n', "expected a JSON object, got list"),
    ('{"turns": "hello"}\n', "'turns' (a list of strings)"),
    ('{"prompt": ""}\n', "non-empty"),
    ('{"prompt": "a", "question_id": 7}\n{"prompt": "b", "question_id": "7"}\n', "question_id '7' already used on line 1"),
    ('{"prompt": "a"}\n{"prompt": "b", "question_id": 1}\n', "question_id '1' already used"),
])
def test_bad_jsonl_records_are_one_line_errors(tmp_path, text, expected):
  path = tmp_path / "p.jsonl"
  path.write_text(text)
  with pytest.raises(EagleJaxError, match=re.escape(expected)):
    load_jsonl_prompts(str(path))


def test_non_utf8_prompt_file(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_bytes(b'{"prompt": "caf\xe9"}\n')
  with pytest.raises(EagleJaxError, match="not UTF-8"):
    load_jsonl_prompts(str(path))
