"""``make demo``: chat answers from the default model to a few MT-bench questions."""

from __future__ import annotations

import textwrap

from eagle_jax.decoding.generate import generate
from eagle_jax.evaluation.prompts import load_mtbench
from eagle_jax.model.registry import load_model


def run_demo(model: str, num_questions: int = 3, max_new_tokens: int = 200) -> None:
  lm = load_model(model)
  questions = load_mtbench()
  # one question from each of the first categories, for variety
  picked, seen = [], set()
  for q in questions:
    if q.category not in seen:
      picked.append(q)
      seen.add(q.category)
  for q in picked[:num_questions]:
    prompt = lm.tokenizer.chat_prompt(q.turns[0])
    gen = generate(lm.model, [prompt], max_new_tokens=max_new_tokens)
    print(f"\n### [{q.category}] {q.turns[0]}\n")
    print(textwrap.fill(lm.tokenizer.decode(gen.tokens[0]), 100, replace_whitespace=False))
    print(f"\n({gen.num_new[0]} tokens in {gen.seconds:.2f} s = {gen.tokens_per_s:.1f} tokens/s; "
          f"compile {gen.compile_seconds:.1f} s)")
