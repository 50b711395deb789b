"""Tokenizer and chat template, loaded from a checkpoint folder (never from a hub)."""

from __future__ import annotations

import os
from typing import Sequence

from eagle_jax.errors import EagleJaxError

Messages = Sequence[dict[str, str]]

# Conversation formats of targets whose tokenizer carries no chat template, by name (Jinja, as
# Hugging Face chat templates are written). ``vicuna``: FastChat's ``vicuna_v1.1`` format, which
# the EAGLE, Medusa and Spec-Bench evaluations use for Vicuna v1.3: the system sentence, then
# "USER: ... ASSISTANT: ...</s>" turns, a generation prompt ending in "ASSISTANT:".
CHAT_TEMPLATES = {
    "vicuna": (
        "{{ bos_token }}A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions."
        "{% for m in messages %}{% if m['role'] == 'user' %}{% if loop.first %} {% endif %}"
        "USER: {{ m['content'] }} {% else %}ASSISTANT: {{ m['content'] }}</s>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"),
}


def chat_template_text(spec: str) -> str:
  """The Jinja text of a chat template named in :data:`CHAT_TEMPLATES` or stored in a file."""
  if spec in CHAT_TEMPLATES:
    return CHAT_TEMPLATES[spec]
  if not os.path.isfile(spec):
    raise EagleJaxError(f"chat template {spec!r}: not a built-in one ({', '.join(CHAT_TEMPLATES)}) "
                        "nor a Jinja file")
  with open(spec, encoding="utf-8") as f:
    return f.read()


class Tokenizer:
  """Thin wrapper over a Hugging Face fast tokenizer that applies the chat template."""

  def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int] = ()):
    self.hf = hf_tokenizer
    ids = set(int(i) for i in eos_token_ids)
    if hf_tokenizer.eos_token_id is not None:
      ids.add(int(hf_tokenizer.eos_token_id))
    self.eos_token_ids = tuple(sorted(ids))

  @classmethod
  def from_folder(cls, path: str, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
    if not (os.path.exists(os.path.join(path, "tokenizer.json"))
            or os.path.exists(os.path.join(path, "tokenizer.model"))):
      raise EagleJaxError(f"{path}: no tokenizer.json (or tokenizer.model) in the checkpoint folder")
    from transformers import AutoTokenizer  # import time: about 1.4 s
    try:
      hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # corrupt tokenizer files
      raise EagleJaxError(f"{path}: cannot load tokenizer ({type(e).__name__}: {e})") from None
    return cls(hf, eos_token_ids)

  def use_chat_template(self, spec: str) -> None:
    """Formats chats with ``spec`` (a name in :data:`CHAT_TEMPLATES` or a Jinja file) instead
    of the checkpoint's own template."""
    self.hf.chat_template = chat_template_text(spec)

  @property
  def vocab_size(self) -> int:
    return len(self.hf)

  def encode(self, text: str) -> list[int]:
    return list(self.hf(text, add_special_tokens=False)["input_ids"])

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def chat_prompt(self, messages: str | Messages) -> list[int]:
    """Token ids of a chat ending with the assistant's turn opener.

    ``messages`` is a user message or a list of ``{"role", "content"}`` dicts.
    """
    if isinstance(messages, str):
      messages = [{"role": "user", "content": messages}]
    if not messages or not any(m.get("content", "").strip() for m in messages):
      raise EagleJaxError("empty prompt: give a non-empty user message")
    if self.hf.chat_template is None:
      raise EagleJaxError("the checkpoint's tokenizer has no chat template")
    text = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return self.encode(text)
