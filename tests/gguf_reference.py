"""The transformers reference for the default GGUF model, and the golden-logit file.

``python tests/gguf_reference.py`` rewrites ``tests/assets/smollm2_golden.npz`` from
transformers' PyTorch model loaded straight from the GGUF file (needs torch).
"""

import os

import numpy as np

GOLDEN = os.path.join(os.path.dirname(__file__), "assets", "smollm2_golden.npz")
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain, step by step, how to compute 17 * 23.",
]
NUM_VOCAB_COLUMNS = 256


def load_hf_gguf():
  import torch
  from transformers import AutoModelForCausalLM

  from eagle_jax.registry import REGISTRY

  path = REGISTRY["smollm2-135m-instruct"].locate()
  return AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def golden_columns(vocab_size: int) -> np.ndarray:
  return np.sort(np.random.default_rng(0).choice(vocab_size, NUM_VOCAB_COLUMNS, replace=False))


def write_golden():
  import torch

  from eagle_jax.registry import load_model

  tok = load_model("smollm2-135m-instruct").tokenizer
  hf = load_hf_gguf()
  ids, logits, argmax = [], [], []
  cols = golden_columns(hf.config.vocab_size)
  for text in PROMPTS:
    p = tok.chat_prompt(text)
    with torch.no_grad():
      out = hf(torch.tensor([p])).logits[0].numpy()
    ids.append(np.array(p, np.int32))
    logits.append(out[:, cols].astype(np.float32))
    argmax.append(out.argmax(-1).astype(np.int32))
  np.savez_compressed(
      GOLDEN, columns=cols, **{f"ids_{i}": x for i, x in enumerate(ids)},
      **{f"logits_{i}": x for i, x in enumerate(logits)},
      **{f"argmax_{i}": x for i, x in enumerate(argmax)})
  print(f"wrote {GOLDEN} ({os.path.getsize(GOLDEN)} bytes)")


if __name__ == "__main__":
  write_golden()
