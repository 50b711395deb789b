"""``eagle-jax`` command line. Each verb parses its flags and calls one library function."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from flax import nnx

from eagle_jax.decoding.generate import generate
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.decoding.speculative import speculative_generate
from eagle_jax.drafters import interop, registry, shipped
from eagle_jax.drafters.draft_model.train import (
  DraftModelConfig,
  predicted_speedup,
  time_draft_sizes,
)
from eagle_jax.drafters.kinds import BUDGETS, Context, flag_of
from eagle_jax import parallel
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation.bench_decode import bench_decode
from eagle_jax.evaluation.bench_regenerate import bench_regenerate
from eagle_jax.evaluation.bench_spec import bench_spec
from eagle_jax.evaluation.demo import run_demo
from eagle_jax.evaluation.dryrun import dry_run, render_plan
from eagle_jax.evaluation.lower import lower_programs
from eagle_jax.evaluation.runner import run_experiment
from eagle_jax.evaluation.tables import render
from eagle_jax.model.registry import DEFAULT_MODEL, enable_compilation_cache, load_model
from eagle_jax.model.transformer import shard
from eagle_jax.pipeline.train import run_training, tune_checkpoint
from eagle_jax.training.regenerate import regenerate
from eagle_jax.training.settings import TuneConfig


def _int_list(text: str) -> tuple[int, ...]:
  """argparse type: comma-separated integers ('' = none)."""
  try:
    return tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _draft_shapes(text: str) -> dict[str, tuple[int, int]]:
  """argparse type: comma-separated ``L<layers>-d<width>`` shapes."""
  shapes = {}
  for spec in text.split(","):
    try:
      layers, width = (int(x) for x in spec.strip().lower().lstrip("l").split("-d"))
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected L<layers>-d<width> (e.g. L4-d256), got {spec!r}") from None
    if layers < 1 or width < 64:
      raise argparse.ArgumentTypeError(f"{spec!r}: need at least 1 layer and width >= 64")
    shapes[f"L{layers}-d{width}"] = (layers, width)
  return shapes


def _cmd_generate(args) -> None:
  params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
  if not args.message.strip():
    raise EagleJaxError("empty prompt: give a non-empty user message")
  # before loading anything
  options = registry.make_options(args.drafter, _set_options(args), _context_set(args),
                                  args.budget)
  mesh = parallel.make_mesh(args.mesh)
  lm = load_model(args.model, args.dtype)
  prompt = lm.tokenizer.chat_prompt(args.message)
  shard(lm.model, mesh)
  drafter, dparams = registry.build(args.drafter, lm.model, options, _context(args, args.model))
  dparams = shard(dparams, mesh)
  common = dict(max_new_tokens=args.max_new_tokens, params=params, seed=args.seed,
                max_cache_len=args.max_cache_len)
  with parallel.use_mesh(mesh):
    if drafter is None:
      gen = generate(lm.model, [prompt], **common)
    else:
      gen = speculative_generate(lm.model, drafter, dparams, [prompt], **common)
  text = lm.tokenizer.decode(gen.tokens[0])
  stats = {}
  if drafter is not None:
    stats = {"tau": round(gen.tau, 4), "n_alpha": [None if a != a else round(a, 4) for a in gen.n_alpha()],
             "target_passes": len(gen.accepted[0]),
             "tau_counts": "tokens per target verify pass, bonus token included, prefill excluded"}
  if args.json:
    sizes = parallel.param_bytes((nnx.state(lm.model, nnx.Param), dparams))
    print(json.dumps({"model": args.model, "drafter": args.drafter,
                      "dtype": str(lm.model.embed.dtype), "mesh": parallel.describe(mesh),
                      "param_bytes_total": sizes["total"],
                      "param_bytes_per_device": sizes["per_device"], "prompt_tokens": len(prompt),
                      "token_ids": gen.tokens[0], "text": text, "new_tokens": gen.num_new[0],
                      "tokens_per_s": round(gen.tokens_per_s, 3), "seconds": round(gen.seconds, 4),
                      "compile_seconds": round(gen.compile_seconds, 3), **stats,
                      "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                      "seed": args.seed}))
  else:
    print(text)
    extra = f", tau {stats['tau']:.2f}" if stats else ""
    print(f"[{gen.num_new[0]} tokens, {gen.tokens_per_s:.1f} tokens/s{extra}, "
          f"compile {gen.compile_seconds:.1f} s]", file=sys.stderr)


def _cmd_bench_decode(args) -> None:
  result = bench_decode(model=args.model, num_prompts=args.num_prompts,
                        max_new_tokens=args.max_new_tokens, with_hf=not args.no_hf,
                        repeats=args.repeats, mesh=args.mesh, dtype=args.dtype)
  print(json.dumps(result, indent=None if args.json else 2))


def _cmd_bench_spec(args) -> None:
  methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
  result = bench_spec(model=args.model, methods=methods, num_prompts=args.num_prompts,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      options=_set_options(args), checkpoint=args.drafter_ckpt,
                      runs_dir=args.runs_dir or "runs", with_hf=not args.no_hf,
                      repeats=args.repeats, budget=args.budget, mesh=args.mesh,
                      dtype=args.dtype)
  print(json.dumps(result, indent=None if args.json else 2))


def _cmd_bench_regenerate(args) -> None:
  result = bench_regenerate(model=args.model, batch_sizes=args.batch_sizes,
                            num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, seed=args.seed)
  print(json.dumps(result, indent=None if args.json else 2))


def _cmd_data_regenerate(args) -> None:
  print(json.dumps(regenerate(args.config, args.overrides)))


def _cmd_bench_draft_sizes(args) -> None:
  shapes = {}
  for name, (layers, width) in args.shapes.items():
    heads = max(width // 64, 1)
    shapes[name] = DraftModelConfig(
        num_layers=layers, hidden_size=width, intermediate_size=width * 3, num_heads=heads,
        num_kv_heads=heads // 2 if heads % 2 == 0 else heads, head_dim=64)
  result = time_draft_sizes(load_model(args.model).model, shapes, gamma=args.gamma)
  for name in shapes:
    c = result[name]["ratio_c"]
    result[name]["predicted_speedup"] = {f"alpha={a}": round(predicted_speedup(a, args.gamma, c), 3)
                                         for a in (0.3, 0.5, 0.7)}
  print(json.dumps(result, indent=None if args.json else 1))


def _mesh_overrides(args) -> tuple[str, ...]:
  """``--mesh`` as config overrides (``mesh.data=D`` ...), after the command line's own."""
  spec = parallel.parse_mesh(args.mesh)
  extra = () if args.dtype is None else (f"dtype={args.dtype}",)
  return tuple(args.overrides) + extra + (() if spec is None else
                                          tuple(f"mesh.{k}={v}" for k, v in spec.as_dict().items()))


def _cmd_train(args) -> None:
  print(json.dumps(run_training(args.config, _mesh_overrides(args))))


def _cmd_run(args) -> None:
  overrides = _mesh_overrides(args)
  if args.dry_run:
    plan = dry_run(args.config, overrides)
    print(json.dumps(plan, indent=1) if args.json else render_plan(plan))
    return
  run_experiment(args.config, overrides)


def _cmd_lower(args) -> None:
  platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
  result = lower_programs(model=args.model, platforms=platforms, drafter=args.drafter,
                          mesh=args.mesh, dtype=args.dtype, budget=args.budget,
                          batch=args.batch, runs_dir=args.runs_dir or "runs")
  print(json.dumps(result, indent=None if args.json else 1))
  if not result["ok"]:
    sys.exit(1)


def _cmd_table(args) -> None:
  print(render(args.results, args.format, args.per_category, args.acceptance))


def _cmd_tune(args) -> None:
  # on the run's own target and held-out split, so the prompts tuned on were never trained on
  tune = TuneConfig(prompts=args.prompts, top_ks=args.top_ks, depths=args.depths,
                    max_nodes=args.max_nodes, max_new_tokens=args.max_new_tokens,
                    draft_vocabs=args.draft_vocabs, head_bits=args.head_bits)
  result = tune_checkpoint(args.checkpoint, tune, args.model)
  print(json.dumps({k: v for k, v in result.items() if k not in ("by_setting", "rows", "tree")}))


def _cmd_export(args) -> None:
  out = registry.export_published(args.run, args.format, args.out)
  print(json.dumps({"exported": out, "format": args.format,
                    "files": sorted(os.listdir(out))}))


def _cmd_ship(args) -> None:
  entry = shipped.ship(args.run, dtype=args.dtype, force=args.force)
  print(json.dumps({"key": f"{entry['model']}/{entry['drafter']}", **entry}))


def _cmd_convert(args) -> None:
  print(json.dumps({"converted": interop.convert(args.folder)}))


def _cmd_demo(args) -> None:
  run_demo(model=args.model, num_questions=args.num_questions, max_new_tokens=args.max_new_tokens)


DTYPES = ("float32", "bfloat16", "float16")


def _add_mesh_arg(p: argparse.ArgumentParser, dtype: bool = True) -> None:
  """``--mesh`` and (``dtype``) ``--dtype``, the target's layout and precision."""
  p.add_argument("--mesh", default=None,
                 help="device mesh data=D,fsdp=F,tensor=T (axes of size 1 may be left out; the "
                 "product must equal the device count; default: one device, no mesh)")
  if dtype:
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="the target's parameters and activations (default: the checkpoint's own; "
                   "GGUF conversions are float32); logits, sampling and verify stay float32")


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
  """One flag per option of the drafter registry (unset = the drafter's default)."""
  for name, f in registry.option_fields().items():
    kind = registry.option_types()[name]
    parse = _int_list if kind == tuple[int, ...] else int if kind is int else str
    p.add_argument(flag_of(f), dest=f"opt_{name}", type=parse, default=None,
                   choices=f.metadata.get("choices"),
                   help=f"{', '.join(registry.readers(name))}: {f.metadata['help']}")
  p.add_argument("--drafter-ckpt", default=None,
                 help="trained drafters: a trained run folder or its final/, or a published EAGLE, "
                 "EAGLE-3 or Medusa folder (its kind is detected); draft-model also a "
                 "registered name, HF folder or .gguf sharing the tokenizer (default: the trained "
                 "run with most tokens in --runs-dir)")
  p.add_argument("--runs-dir", default=None, help="where trained drafters are found (default: runs)")
  p.add_argument("--budget", choices=BUDGETS, default="tuned",
                 help="tuned: the options' defaults (the budget tuned for this machine); paper: "
                 "each method's published setting (docs/methods.md), options given still win")


def _set_options(args) -> dict:
  return {name: getattr(args, f"opt_{name}") for name in registry.option_fields()
          if getattr(args, f"opt_{name}") is not None}


def _context(args, model: str) -> Context:
  return Context(model=model, checkpoint=args.drafter_ckpt, runs_dir=args.runs_dir or "runs")


def _context_set(args) -> tuple[str, ...]:
  return tuple(c for c, v in (("checkpoint", args.drafter_ckpt), ("runs_dir", args.runs_dir))
               if v is not None)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="eagle-jax", description="Speculative decoding in JAX/Flax.")
  p.add_argument("--distributed", action="store_true",
                 help="start JAX's multi-process runtime (jax.distributed) on a cluster JAX "
                 "detects; it also starts when JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
                 "JAX_PROCESS_ID are set")
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
  g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                 help="the target's parameters (default: a Hugging Face folder's own dtype; "
                 "GGUF conversions are float32)")
  g.add_argument("--json", action="store_true", help="print one JSON object as the last line")
  _add_mesh_arg(g, dtype=False)
  g.add_argument("--drafter", default="vanilla", choices=registry.NAMES,
                 help="speculative drafter (vanilla = plain decoding)")
  _add_drafter_args(g)
  g.set_defaults(func=_cmd_generate)

  b = sub.add_parser("bench", help="benchmarks (JSON output)")
  bsub = b.add_subparsers(dest="bench", required=True)
  bd = bsub.add_parser("decode", help="greedy decode speed vs transformers and the memory floor")
  bd.add_argument("--model", default=DEFAULT_MODEL)
  bd.add_argument("--num-prompts", type=int, default=3)
  bd.add_argument("--max-new-tokens", type=int, default=128)
  bd.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
  bd.add_argument("--repeats", type=int, default=3,
                  help="interleaved timed runs per prompt (medians are reported)")
  bd.add_argument("--json", action="store_true", help="compact single-line JSON")
  _add_mesh_arg(bd)
  bd.set_defaults(func=_cmd_bench_decode)

  bs = bsub.add_parser("spec", help="drafters vs vanilla: tau, n-alpha, speedup, verify cost")
  bs.add_argument("--model", default=DEFAULT_MODEL)
  bs.add_argument("--methods", default="vanilla,pld,pld-static,self-draft",
                  help=f"comma-separated, vanilla first; from: {', '.join(registry.NAMES)}; a method "
                  "may set drafter options for its row: eagle2:draft_vocab=8192:top_k=4")
  bs.add_argument("--num-prompts", type=int, default=16)
  bs.add_argument("--max-new-tokens", type=int, default=128)
  bs.add_argument("--temperature", type=float, default=0.0)
  bs.add_argument("--repeats", type=int, default=2, help="timed runs per prompt and method (fastest kept)")
  _add_drafter_args(bs)
  bs.add_argument("--no-hf", action="store_true", help="skip transformers' greedy / prompt lookup")
  bs.add_argument("--json", action="store_true", help="compact single-line JSON")
  _add_mesh_arg(bs)
  bs.set_defaults(func=_cmd_bench_spec)

  bg = bsub.add_parser("regenerate", help="batched generation throughput, as data regenerate "
                       "answers ShareGPT prompts")
  bg.add_argument("--model", default=DEFAULT_MODEL)
  bg.add_argument("--batch-sizes", type=_int_list, default="1,8,32", help="comma-separated")
  bg.add_argument("--num-prompts", type=int, default=32, help="ShareGPT training-split first turns")
  bg.add_argument("--max-new-tokens", type=int, default=64)
  bg.add_argument("--temperature", type=float, default=0.0)
  bg.add_argument("--seed", type=int, default=0)
  bg.add_argument("--json", action="store_true", help="compact single-line JSON")
  bg.set_defaults(func=_cmd_bench_regenerate)

  bz = bsub.add_parser("draft-sizes", help="draft-model decode cost vs the target's, per shape")
  bz.add_argument("--model", default=DEFAULT_MODEL)
  bz.add_argument("--shapes", type=_draft_shapes, default="L2-d256,L4-d256,L8-d256,L4-d384,L4-d576",
                  help="comma-separated L<layers>-d<width> (64-dim heads, FFN 3x width)")
  bz.add_argument("--gamma", type=int, default=4)
  bz.add_argument("--json", action="store_true", help="compact single-line JSON")
  bz.set_defaults(func=_cmd_bench_draft_sizes)

  t = sub.add_parser("train", help="extract target features and train a drafter (resumable)")
  t.add_argument("config", help="training config YAML, e.g. configs/train/eagle1-quick.yaml")
  t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=1e-4")
  _add_mesh_arg(t)
  t.set_defaults(func=_cmd_train)

  da = sub.add_parser("data", help="datasets for training")
  dsub = da.add_subparsers(dest="data", required=True)
  dr = dsub.add_parser("regenerate", help="answer ShareGPT training prompts with the target itself "
                       "(resumable)")
  dr.add_argument("config", help="regeneration config YAML, e.g. "
                  "configs/data/sharegpt-target-greedy.yaml")
  dr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. batch_size=32")
  dr.set_defaults(func=_cmd_data_regenerate)

  lo = sub.add_parser("lower", help="lower prefill, decode, speculative loop and a training step "
                      "for GPUs/TPUs without them (JSON: ok or the error per program and platform)")
  lo.add_argument("--platforms", default="cuda,rocm,tpu", help="comma-separated: cuda, rocm, tpu")
  lo.add_argument("--model", default=DEFAULT_MODEL)
  lo.add_argument("--drafter", default="eagle2", choices=registry.NAMES)
  lo.add_argument("--budget", choices=BUDGETS, default="tuned")
  lo.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                  help="the target's parameters (default: the checkpoint's)")
  lo.add_argument("--batch", type=int, default=1, help="decoding rows")
  lo.add_argument("--runs-dir", default=None, help="where trained drafters are found (default: runs)")
  lo.add_argument("--json", action="store_true", help="compact single-line JSON")
  _add_mesh_arg(lo, dtype=False)
  lo.set_defaults(func=_cmd_lower)

  r = sub.add_parser("run", help="run an experiment: train missing drafters, evaluate, tabulate")
  r.add_argument("config", help="experiment config YAML, e.g. configs/quickstart.yaml")
  r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.num_questions=8")
  r.add_argument("--dry-run", action="store_true", help="check the config, the target's and the "
                 "checkpoints' config.json files against each other and print the plan; loads "
                 "no weights")
  r.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
  _add_mesh_arg(r)
  r.set_defaults(func=_cmd_run)

  tb = sub.add_parser("table", help="paper-style table from experiment results folders")
  tb.add_argument("results", nargs="+", help="results/<name> folders")
  tb.add_argument("--format", default="markdown", choices=("markdown", "latex"))
  tb.add_argument("--per-category", action="store_true", help="add per-category tables")
  tb.add_argument("--acceptance", action="store_true",
                  help="add per-temperature tables of each method's budget, tau and n-alpha (n=1..6)")
  tb.set_defaults(func=_cmd_table)

  tu = sub.add_parser("tune", help="pick an EAGLE-2 or Medusa tree budget for this machine")
  tu.add_argument("checkpoint", help="trained run folder or its final/")
  tu.add_argument("--model", default=None, help="the target (default: the one the run trained on)")
  tu.add_argument("--prompts", type=int, default=4, help="held-out ShareGPT prompts decoded "
                  "(from the run's own held-out split)")
  tu.add_argument("--top-ks", type=_int_list, default="4,8", help="comma-separated top_k values to try")
  tu.add_argument("--depths", type=_int_list, default="4,6", help="comma-separated depths to try")
  tu.add_argument("--max-nodes", type=int, default=64, help="largest total_tokens considered "
                  "(the only setting Medusa's tree search uses)")
  tu.add_argument("--draft-vocabs", type=_int_list, default="8192", help="EAGLE-1/2: comma-separated reduced "
                  "draft vocabulary sizes to try besides the whole vocabulary ('' = none)")
  tu.add_argument("--max-new-tokens", type=int, default=48)
  tu.add_argument("--head-bits", type=int, default=8, choices=(0, 8),
                  help="EAGLE, Medusa: tune (and then draft) with the head's weights as 8-bit "
                  "blocks (8) or float32 as trained (0)")
  tu.set_defaults(func=_cmd_tune)

  ex = sub.add_parser("export", help="write a trained drafter as a published EAGLE, EAGLE-3 or "
                      "Medusa checkpoint (what the official code, vLLM and SGLang load)")
  ex.add_argument("run", help="trained run folder or its final/")
  ex.add_argument("out", help="output folder")
  ex.add_argument("--format", required=True, choices=interop.FORMATS)
  ex.set_defaults(func=_cmd_export)

  sh = sub.add_parser("ship", help="add a trained drafter to the package's shipped drafters "
                      "(its tensors in bfloat16), replacing one only by a better held-out tau")
  sh.add_argument("run", help="trained run folder or its final/")
  sh.add_argument("--dtype", default="bfloat16", choices=tuple(shipped.DTYPES))
  sh.add_argument("--force", action="store_true",
                  help="replace the shipped drafter even if this one's held-out tau is not higher")
  sh.set_defaults(func=_cmd_ship)

  cv = sub.add_parser("convert", help="rewrite a published folder's pickled PyTorch weights as "
                      "safetensors (read once with PyTorch's weights-only loader)")
  cv.add_argument("folder", help="published EAGLE or Medusa folder")
  cv.set_defaults(func=_cmd_convert)

  d = sub.add_parser("demo", help="chat answers to a few MT-bench questions")
  d.add_argument("--model", default=DEFAULT_MODEL)
  d.add_argument("--num-questions", type=int, default=3)
  d.add_argument("--max-new-tokens", type=int, default=200)
  d.set_defaults(func=_cmd_demo)
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    # several processes (one per host): JAX's runtime first, before anything touches a device
    parallel.initialize_distributed(force=args.distributed)
    enable_compilation_cache()
    with open(os.devnull, "w") as quiet, \
        contextlib.redirect_stdout(sys.stdout if parallel.is_writer() else quiet):
      args.func(args)  # several processes: process 0 prints the results
  except EagleJaxError as e:
    print(f"eagle-jax: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
