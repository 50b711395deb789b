"""The transformers reference for the default GGUF model, and the golden-logit file.

``python tests/gguf_reference.py`` rewrites ``tests/assets/smollm2_golden.npz`` from
transformers' PyTorch model loaded straight from the GGUF file (needs torch).
``python tests/gguf_reference.py --run REQUEST.json OUT.npz`` computes transformers' logits and
greedy continuations for the prompts in REQUEST.json in this fresh process (what the live parity
tests compare against, so nothing that ran earlier in a test worker can touch the reference).
"""

import json
import os
import subprocess
import sys

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

  from eagle_jax.model.registry import REGISTRY

  path = REGISTRY["smollm2-135m-instruct"].locate()
  return AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def golden_columns(vocab_size: int) -> np.ndarray:
  return np.sort(np.random.default_rng(0).choice(vocab_size, NUM_VOCAB_COLUMNS, replace=False))


def write_golden():
  from eagle_jax.model.registry import load_model

  tok = load_model("smollm2-135m-instruct").tokenizer
  ids = [tok.chat_prompt(text) for text in PROMPTS]
  ref = run_reference({"prompts": ids, "num_greedy": 0})
  full = [ref[f"logits_{i}"] for i in range(len(ids))]
  cols = golden_columns(full[0].shape[-1])
  np.savez_compressed(
      GOLDEN, columns=cols, **{f"ids_{i}": np.array(x, np.int32) for i, x in enumerate(ids)},
      **{f"logits_{i}": x[:, cols].astype(np.float32) for i, x in enumerate(full)},
      **{f"argmax_{i}": x.argmax(-1).astype(np.int32) for i, x in enumerate(full)})
  print(f"wrote {GOLDEN} ({os.path.getsize(GOLDEN)} bytes)")


def run_reference(request: dict) -> dict[str, np.ndarray]:
  """Transformers' full logits (``logits_i``) for each prompt of ``request["prompts"]`` (token
  ids), and the greedy ``max_new_tokens`` continuation (``greedy_i``) of the first
  ``request["num_greedy"]``."""
  import torch

  hf = load_hf_gguf()
  out = {}
  with torch.no_grad():
    for i, ids in enumerate(request["prompts"]):
      out[f"logits_{i}"] = hf(torch.tensor([ids])).logits[0].numpy()
      if i >= request["num_greedy"]:
        continue
      gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=request["max_new_tokens"], do_sample=False,
                        eos_token_id=request["eos_token_ids"])
      out[f"greedy_{i}"] = gen[0, len(ids):].numpy()
  return out


def reference_in_subprocess(request: dict, workdir: str) -> dict[str, np.ndarray]:
  """:func:`run_reference` in a fresh Python process."""
  req, out = os.path.join(workdir, "request.json"), os.path.join(workdir, "reference.npz")
  with open(req, "w") as f:
    json.dump(request, f)
  proc = subprocess.run([sys.executable, __file__, "--run", req, out], capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"transformers reference failed:\n{proc.stderr[-3000:]}")
  with np.load(out) as data:
    return dict(data)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--run"]:
    with open(sys.argv[2]) as f:
      result = run_reference(json.load(f))
    np.savez(sys.argv[3], **result)
  else:
    write_golden()
