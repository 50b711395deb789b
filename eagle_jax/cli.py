"""``eagle-jax`` command line. Each verb parses its flags and calls one library function."""

from __future__ import annotations

import argparse
import json
import sys

from eagle_jax.errors import EagleJaxError


def _cmd_generate(args) -> None:
  from eagle_jax.generate import generate
  from eagle_jax.registry import load_model
  from eagle_jax.sampling import SamplingParams

  params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
  if not args.message.strip():
    raise EagleJaxError("empty prompt: give a non-empty user message")
  lm = load_model(args.model)
  prompt = lm.tokenizer.chat_prompt(args.message)
  gen = generate(lm.model, [prompt], max_new_tokens=args.max_new_tokens, params=params,
                 seed=args.seed, max_cache_len=args.max_cache_len)
  text = lm.tokenizer.decode(gen.tokens[0])
  if args.json:
    print(json.dumps({"model": args.model, "prompt_tokens": len(prompt), "token_ids": gen.tokens[0],
                      "text": text, "new_tokens": gen.num_new[0],
                      "tokens_per_s": round(gen.tokens_per_s, 3), "seconds": round(gen.seconds, 4),
                      "compile_seconds": round(gen.compile_seconds, 3),
                      "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                      "seed": args.seed}))
  else:
    print(text)
    print(f"[{gen.num_new[0]} tokens, {gen.tokens_per_s:.1f} tokens/s, "
          f"compile {gen.compile_seconds:.1f} s]", file=sys.stderr)


def _cmd_bench_decode(args) -> None:
  from eagle_jax.bench import bench_decode

  result = bench_decode(model=args.model, num_prompts=args.num_prompts,
                        max_new_tokens=args.max_new_tokens, with_hf=not args.no_hf)
  print(json.dumps(result, indent=None if args.json else 2))


def _cmd_demo(args) -> None:
  from eagle_jax.demo import run_demo

  run_demo(model=args.model, num_questions=args.num_questions, max_new_tokens=args.max_new_tokens)


def build_parser() -> argparse.ArgumentParser:
  from eagle_jax.registry import DEFAULT_MODEL

  p = argparse.ArgumentParser(prog="eagle-jax", description="Speculative decoding in JAX/Flax.")
  sub = p.add_subparsers(dest="command", required=True)

  g = sub.add_parser("generate", help="chat generation with a target model")
  g.add_argument("message", help="the user message (the chat template is applied)")
  g.add_argument("--model", default=DEFAULT_MODEL, help="registered name, HF folder or .gguf file")
  g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--top-k", type=int, default=0)
  g.add_argument("--max-new-tokens", type=int, default=256)
  g.add_argument("--max-cache-len", type=int, default=None, help="default: model context length")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--json", action="store_true", help="print one JSON object as the last line")
  g.set_defaults(func=_cmd_generate)

  b = sub.add_parser("bench", help="benchmarks (JSON output)")
  bsub = b.add_subparsers(dest="bench", required=True)
  bd = bsub.add_parser("decode", help="greedy decode speed vs transformers and the memory floor")
  bd.add_argument("--model", default=DEFAULT_MODEL)
  bd.add_argument("--num-prompts", type=int, default=3)
  bd.add_argument("--max-new-tokens", type=int, default=128)
  bd.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
  bd.add_argument("--json", action="store_true", help="compact single-line JSON")
  bd.set_defaults(func=_cmd_bench_decode)

  d = sub.add_parser("demo", help="chat answers to a few MT-bench questions")
  d.add_argument("--model", default=DEFAULT_MODEL)
  d.add_argument("--num-questions", type=int, default=3)
  d.add_argument("--max-new-tokens", type=int, default=200)
  d.set_defaults(func=_cmd_demo)
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    args.func(args)
  except EagleJaxError as e:
    print(f"eagle-jax: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
