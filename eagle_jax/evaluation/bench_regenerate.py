"""``eagle-jax bench regenerate``: batched generation throughput, as ``data regenerate`` runs it.

The same ShareGPT training-split first turns (the first ``num_prompts`` whose chat prompt fits
``max_prompt_len``) are answered at each batch size exactly as :mod:`eagle_jax.training.regenerate`
answers them: sorted by prompt length, batched, padded to the compiled shapes, stopped at EOS.
Throughput is the new tokens of all real rows over the compiled runs' time (prefill + decode;
compilation excluded, as :func:`~eagle_jax.decoding.generate.generate` times it), after one
untimed warm-up batch per batch size. A batch runs until its longest reply stops, so the waiting
of rows that stopped early counts against the figure, as it does in a regeneration.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Sequence

import jax

from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation.bench_decode import weights_read
from eagle_jax.model.registry import DEFAULT_MODEL, load_model
from eagle_jax.training.regenerate import (
  batch_seed,
  batch_shape,
  batches_by_length,
  generate_batch,
  training_conversations,
)
from eagle_jax.training.settings import DataConfig


def first_turn_prompts(lm, count: int, max_prompt_len: int, data: DataConfig = DataConfig()):
  """Chat prompts of the first user turns of the first training-split conversations that fit."""
  n = 4 * count
  while True:
    convs = training_conversations(n, data.heldout_fraction, data.split_seed)
    prompts = []
    for c in convs:
      p = lm.tokenizer.chat_prompt([m for m in c.messages if m["role"] == "user"][:1])
      if len(p) <= max_prompt_len:
        prompts.append(p)
      if len(prompts) == count:
        return prompts
    if len(convs) < n:
      return prompts  # ShareGPT has no more
    n *= 2


def bench_regenerate(model: str = DEFAULT_MODEL, batch_sizes: Sequence[int] = (1, 8, 32),
                     num_prompts: int = 16, max_new_tokens: int = 64, temperature: float = 0.0,
                     top_p: float = 1.0, max_prompt_len: int = 512, seed: int = 0) -> dict:
  """New tokens/s of batched generation at each batch size on the same prompts."""
  if not batch_sizes or min(batch_sizes) < 1 or num_prompts < 1 or max_new_tokens < 1:
    raise EagleJaxError(f"bench regenerate needs batch sizes >= 1, num_prompts >= 1 and "
                        f"max_new_tokens >= 1; got {list(batch_sizes)}, {num_prompts}, "
                        f"{max_new_tokens}")
  params = SamplingParams(temperature, top_p)
  lm = load_model(model)
  prompts = first_turn_prompts(lm, num_prompts, max_prompt_len)
  lengths = [len(p) for p in prompts]
  rows = {}
  for bs in batch_sizes:
    batches = batches_by_length(lengths, bs)
    run = lambda b, rows_: generate_batch(lm, [prompts[i] for i in rows_], batch_size=bs,
                                          max_new_tokens=max_new_tokens, params=params,
                                          seed=batch_seed(seed, 0, 0, b))
    t0 = time.perf_counter()
    run(0, batches[0])  # warm-up (and compilation) of the first shape
    warm_s = time.perf_counter() - t0
    new, secs, compile_s, padded, stopped, t1 = 0, 0.0, 0.0, 0, 0, time.perf_counter()
    for b, batch in enumerate(batches):
      replies, g = run(b, batch)
      new += sum(len(r.tokens) for r in replies)
      stopped += sum(r.stopped for r in replies)
      secs += g.seconds
      compile_s += g.compile_seconds
      padded += batch_shape(len(batch), bs, 1)[0] - len(batch)
    rows[str(bs)] = {
        "batch_size": bs, "batches": len(batches), "padding_rows": padded,
        "new_tokens": new, "stopped_rows": stopped, "seconds": round(secs, 3),
        "tokens_per_s": round(new / max(secs, 1e-9), 2),
        "wall_seconds": round(time.perf_counter() - t1, 3),
        "warmup_seconds": round(warm_s, 3), "compile_seconds_in_timed_runs": round(compile_s, 3)}
  base = rows.get("1", {}).get("tokens_per_s")
  if base:
    for r in rows.values():
      r["speedup_vs_batch_1"] = round(r["tokens_per_s"] / base, 2)
  device = jax.devices()[0]
  return {
      "by_batch_size": rows,
      "settings": {
          "model": model, "num_prompts": len(prompts), "prompt_tokens": lengths,
          "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
          "dtype": str(lm.model.embed.dtype), "weights_read": weights_read(lm.model),
          "prompts": "first user turns of the first ShareGPT training-split conversations "
                     f"whose chat prompt is <= {max_prompt_len} tokens",
          "decoding": "stop at EOS; a batch runs until its last row stops; rows sorted by "
                      "prompt length, padded to power-of-two rows and widths",
          "tokens_per_s_method": "new tokens of the real rows over the compiled runs' seconds "
                                 "(prefill + decode, compilation excluded), after an untimed "
                                 "warm-up batch",
          "jax_version": jax.__version__, "jax_backend": jax.default_backend(),
          "device_kind": device.device_kind, "machine": platform.machine(),
          "cpu_count": os.cpu_count()}}
