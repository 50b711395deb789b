"""``eagle-jax lower``: the programs eagle_jax runs, lowered for GPUs and TPUs on a machine that has
neither.

For each platform (``cuda``, ``rocm``, ``tpu``) it exports, with :func:`jax.export.export`, the
target's prompt pass (``prefill``), the plain decode loop (``decode``), the speculative loop with
the chosen drafter (``speculative``) and one training step of that drafter's weights
(``train_step``; kinds without trained weights have none), with the operations' pure-JAX
references (:func:`eagle_jax.model.ops.reference_only`: the CPU kernels are host custom calls no
other platform has). Each program is ``ok`` or gives the error; ``eagle_jax_custom_calls``
counts calls to the CPU kernels in the exported module (0 is required).

Under a mesh (``--mesh``) the exported modules carry the arrays' shardings; the collectives are
inserted later by each platform's SPMD partitioner, so ``collectives`` counts them in the same
program partitioned and compiled for the host's devices (forced CPU devices: set
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before starting).

The target's weights are loaded (the drafters are built from them), the prompt pass runs once
on the host to give the loops their inputs, and a training step's inputs are a zero batch of
the feature cache's shapes.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import export

from eagle_jax import parallel
from eagle_jax.configs import from_dict
from eagle_jax.decoding import generate as gen
from eagle_jax.decoding import speculative as spec
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.drafters import registry
from eagle_jax.drafters.eagle.head import default_fuse_layers
from eagle_jax.drafters.kinds import Context
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.ops import reference_only
from eagle_jax.model.registry import DEFAULT_MODEL, load_model
from eagle_jax.model.transformer import shard
from eagle_jax.pipeline.train import TrainConfig
from eagle_jax.training.features import batch_arrays
from eagle_jax.training.trainer import make_optimizer, make_steps, place_optimizer_state

PLATFORMS = ("cuda", "rocm", "tpu")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COLLECTIVE_RE = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def _collectives(hlo_text: str) -> dict[str, int]:
  found = {}
  for name in _COLLECTIVE_RE.findall(hlo_text):
    found[name] = found.get(name, 0) + 1
  return found


class _Shards:
  """What a training task reads of its feature cache to be built: the stored layers."""

  def __init__(self, layers):
    self.spec = {"layers": list(layers)}


def _train_program(weights: str, lm, model: str, mesh, batch_rows: int, row_len: int):
  """(jitted train step, its arguments) for the kind ``weights``, at its default config."""
  trainable = registry.get(weights).trainable
  cfg = from_dict(TrainConfig, {"name": "lower", "drafter": weights, "model": model})
  layers = cfg.features.layers or default_fuse_layers(lm.config.num_layers)
  counts = np.ones(lm.config.vocab_size, np.int64)  # every id seen: a full draft vocabulary cut
  task = trainable.task(cfg, lm, _Shards(layers), counts)
  graphdef, params, rest = nnx.split(task.init_module(nnx.Rngs(0)), nnx.Param, ...)
  tx = make_optimizer(cfg.optim, 100)
  frozen = task.frozen
  if mesh is not None:
    params, rest, frozen = (parallel.place(x, mesh) for x in (params, rest, frozen))
  opt_state = place_optimizer_state(tx.init(params), params, mesh)
  rows = batch_arrays(task.keys, batch_rows, row_len, lm.config.hidden_size, len(layers))
  batch = {k: parallel.shard_batch(jnp.asarray(v), mesh) for k, v in rows.items()}
  train_step, _ = make_steps(task, graphdef, tx)
  return train_step, (params, opt_state, rest, frozen, batch, jax.random.key(0)), {}


def lower_programs(model: str = DEFAULT_MODEL, platforms=("cuda", "tpu"), drafter: str = "eagle2",
                   mesh=None, dtype: str | None = None, budget: str = "tuned", batch: int = 1,
                   prompt_len: int = 64, max_new_tokens: int = 32, runs_dir: str = "runs",
                   train_rows: int = 4, row_len: int = 512) -> dict:
  """Lowers the prefill, decode loop, speculative loop and a training step for each of
  ``platforms`` (module docstring); returns the report ``eagle-jax lower --json`` prints."""
  bad = [p for p in platforms if p not in PLATFORMS]
  if bad or not platforms:
    raise EagleJaxError(f"--platforms {','.join(platforms)}: choose from {', '.join(PLATFORMS)}")
  if drafter not in registry.NAMES:
    raise EagleJaxError(f"--drafter {drafter!r} unknown: one of {', '.join(registry.NAMES)}")
  options = registry.make_options(drafter, {}, (), budget)
  mesh = parallel.make_mesh(mesh)
  lm = load_model(model, dtype)
  shard(lm.model, mesh)
  d, dparams = registry.build(drafter, lm.model, options, Context(model=model, runs_dir=runs_dir))
  dparams = shard(dparams, mesh)
  prompts = [[1 + (i * 7 + j) % 100 for j in range(prompt_len - i % 3)] for i in range(batch)]
  params = SamplingParams()
  programs = {}
  with parallel.use_mesh(mesh), reference_only():
    graphdef, state = nnx.split(lm.model)
    nodes = d.num_nodes if d is not None else 0
    tokens, lengths, cache_len, stop = gen.prepare_prompts(lm.model, prompts, max_new_tokens, None,
                                                          None, 0, draft_nodes=nodes)
    tokens, lengths = parallel.shard_batch(tokens), parallel.shard_batch(lengths)
    layers = tuple(d.feature_layers) if d is not None else ()
    programs["prefill"] = (gen._prefill_jit, (state, tokens, lengths),
                           dict(graphdef=graphdef, cache_len=cache_len, layers=layers))
    (cache, feats, logits), _, _ = gen.run_prefill(graphdef, state, tokens, lengths, cache_len, layers)
    key, stop = jax.random.key(0), jnp.asarray(stop)
    programs["decode"] = (gen._generate_jit, (state, cache, logits, key, stop),
                          dict(graphdef=graphdef, max_new_tokens=max_new_tokens, params=params, pad_id=0))
    if d is not None:
      programs["speculative"] = (spec._spec_jit,
                                 (state, dparams, tokens, lengths, cache, feats, logits, key, stop),
                                 dict(graphdef=graphdef, drafter=d, max_new_tokens=max_new_tokens,
                                      cache_len=cache_len, params=params, pad_id=0))
    weights = registry.get(drafter).weights
    report: dict = {"model": model, "drafter": drafter, "budget": budget,
                    "dtype": str(lm.model.embed.dtype),
                    "mesh": parallel.describe(mesh),
                    "shapes": {"batch": batch, "prompt_width": int(tokens.shape[1]),
                               "cache_len": cache_len, "max_new_tokens": max_new_tokens,
                               "train_rows": train_rows, "row_len": row_len},
                    "programs": {}}
    if weights is not None and registry.get(weights).trainable is not None:
      try:
        programs["train_step"] = _train_program(weights, lm, model, mesh, train_rows, row_len)
      except EagleJaxError as e:
        report["programs"]["train_step"] = {"error": str(e)}
    for name, (fn, args, statics) in programs.items():
      entry = {"platforms": {}}
      for platform in platforms:
        t0 = time.perf_counter()
        try:
          exported = export.export(fn, platforms=[platform])(*args, **statics)
          text = exported.mlir_module()
          entry["platforms"][platform] = {
              "ok": True, "seconds": round(time.perf_counter() - t0, 2),
              "eagle_jax_custom_calls": text.count('"eagle_jax_'),
              "module_bytes": len(text), "devices": exported.nr_devices}
        except Exception as e:  # reported per program and platform, the run goes on
          entry["platforms"][platform] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
      if mesh is not None:
        try:
          entry["collectives"] = _collectives(fn.lower(*args, **statics).compile().as_text())
        except Exception as e:
          entry["collectives"] = {"error": f"{type(e).__name__}: {e}"[:500]}
      else:
        entry["collectives"] = {}
      report["programs"][name] = entry
  report["ok"] = all(p.get("ok") for e in report["programs"].values()
                     for p in e.get("platforms", {"-": {"ok": False}}).values())
  report["collectives_source"] = ("each program partitioned and compiled for the host's devices "
                                  "with the same mesh" if mesh is not None else "one device: none")
  return report
