"""``eagle-jax bench decode``: our compiled greedy decode vs transformers, and the memory floor.

Both run the same MT-bench prompts in the same process. The floor is the bytes of weights
a decode step must read divided by the best read bandwidth measured here (a large fp32
matrix-vector product in numpy and in JAX, the fastest of repeats, measured beside every
prompt's timed runs and once after them; the highest reading counts).

Where the CPU kernels run, it also splits the step by the time spent inside them
(:func:`eagle_jax.kernels.time_inside`): the weight products, the attention, and everything
else (XLA's own operations: norms, rotary embedding, cache writes, sampling, the loop).
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import kernels
from eagle_jax.decoding.costs import fastest_ms
from eagle_jax.decoding.generate import generate
from eagle_jax.evaluation.prompts import load_mtbench
from eagle_jax.model.blocks import Blocks
from eagle_jax.model.registry import load_model
from eagle_jax.model.transformer import WeightBlocks, shard
from eagle_jax.parallel import MeshSpec, is_writer, make_mesh, spec_of, use_mesh


def read_bandwidth_probe(nbytes: int = 256 * 2**20, repeats: int = 20) -> Callable[[], dict[str, float]]:
  """A function measuring the peak read bandwidth (GB/s) of an fp32 matrix-vector product far
  larger than the caches, in numpy (BLAS) and in jitted JAX: its bytes over the fastest of
  ``repeats`` calls (the floor is a lower bound, so it takes the best the machine showed, not a
  typical call). The matrix is built once, however often the probe is called."""
  cols = 1024
  mat = np.random.default_rng(0).standard_normal((nbytes // 4 // cols, cols), dtype=np.float32)
  vec = np.ones(cols, np.float32)
  jmat, jvec = jnp.asarray(mat), jnp.asarray(vec)
  matvec = jax.jit(lambda m, v: m @ v)
  gbs = lambda ms: mat.nbytes / (ms / 1000) / 1e9

  def measure() -> dict[str, float]:
    np_gbs = gbs(fastest_ms(lambda: mat @ vec, repeats=repeats, warmup=1))
    jax_gbs = gbs(fastest_ms(matvec, jmat, jvec, repeats=repeats))
    return {"numpy_matvec_gbs": round(np_gbs, 2), "jax_matvec_gbs": round(jax_gbs, 2),
            "bandwidth_gbs": round(max(np_gbs, jax_gbs), 2)}
  return measure


def _peak(readings: list[dict[str, float]]) -> dict[str, float]:
  """Per key, the highest of several bandwidth readings."""
  return {k: max(r[k] for r in readings) for k in readings[0]}


def _kernels_in_use() -> bool:
  """Whether the CPU kernels compute this process's products (the CPU is JAX's default backend
  and they are switched on and built)."""
  return jax.default_backend() == kernels.PLATFORM and kernels.available()


def _blocks_read(model) -> dict[tuple, int]:
  """Bytes of each integer-block variable a decode step reads, by its path ({} where the CPU
  kernels do not read blocks)."""
  if not _kernels_in_use():
    return {}
  blocks = nnx.to_flat_state(nnx.state(model, WeightBlocks))
  return {path: v.get_value().nbytes for path, v in blocks}


def weight_bytes_per_step(model) -> int:
  """Bytes of parameters read by one decode step (an untied embedding reads one row only).
  A weight whose integer blocks the CPU kernel reads counts by the blocks' bytes."""
  read = {}  # weight path -> bytes read
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    read[path] = v.get_value().nbytes
  for path, nbytes in _blocks_read(model).items():
    read[path[:-1] + ("weight",) if path[-1] == "blocks" else ("embed",)] = nbytes
  if model.lm_head is not None:
    read.pop(("embed",))
  return sum(read.values())


def weights_read(model) -> str:
  """Which form of the weights a decode step reads, in words."""
  n = len(jax.tree.leaves(nnx.state(model, WeightBlocks), is_leaf=lambda x: isinstance(x, Blocks)))
  if n and _kernels_in_use():
    return f"integer blocks (GGUF's own) for {n} matrices, float32 for the rest"
  return "float32"


def _generate_timed(model, prompt, max_new_tokens):
  """``generate`` with the seconds it spent inside each CPU kernel (None without kernels)."""
  before = kernels.time_inside()
  g = generate(model, [prompt], max_new_tokens=max_new_tokens, stop_ids=())
  after = kernels.time_inside()
  return g, None if before is None else {k: after[k][1] - before[k][1] for k in after}


def _hf_greedy(folder: str, prompts: list[list[int]], max_new_tokens: int):
  import torch  # import time: about 2.6 s; only the transformers reference needs it
  from transformers import AutoModelForCausalLM  # import time: about 1.4 s

  hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  hf.generation_config.eos_token_id = None  # ignore EOS, as our side does: same token counts
  outs, secs = [], []
  with torch.inference_mode():
    hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm-up
    for p in prompts:
      ids = torch.tensor([p])
      t = time.perf_counter()
      out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                        do_sample=False)
      secs.append(time.perf_counter() - t)
      outs.append(out[0, len(p):].tolist())
  return outs, secs, torch.__version__, torch.get_num_threads()


def bench_decode(model: str, num_prompts: int = 3, max_new_tokens: int = 128,
                 with_hf: bool = True, repeats: int = 3, mesh=None, dtype: str | None = None) -> dict:
  """``mesh``: the target laid out over this device mesh (:func:`eagle_jax.parallel.make_mesh`
  of it; None: one device). ``dtype``: the target's (None: the checkpoint's own)."""
  mesh = make_mesh(mesh)
  lm = load_model(model, dtype)
  shard(lm.model, mesh)
  with use_mesh(mesh):
    return _bench_decode(lm, model, num_prompts, max_new_tokens, with_hf, repeats, mesh)


def _bench_decode(lm, model, num_prompts, max_new_tokens, with_hf, repeats, mesh) -> dict:
  questions = load_mtbench()[:num_prompts]
  prompts = [lm.tokenizer.chat_prompt(q.turns[0]) for q in questions]
  ours, step_ms, tokens, readings, inside_ms = [], [], [], [], []
  measure_read_bandwidth = read_bandwidth_probe()
  for p in prompts:
    generate(lm.model, [p], max_new_tokens=max_new_tokens, stop_ids=())  # compile + warm
    generate(lm.model, [p], max_new_tokens=1, stop_ids=())
    readings.append(measure_read_bandwidth())  # beside the timed runs: the machine of the moment
    fulls, ones = [], []
    for _ in range(repeats):  # interleaved, medians: a shared machine's noise hits both alike
      fulls.append(_generate_timed(lm.model, p, max_new_tokens))
      ones.append(_generate_timed(lm.model, p, 1))  # prefill + 1st token
    per_step = lambda full, one: (1000 * (statistics.median(full) - statistics.median(one))
                                  / (max_new_tokens - 1))
    full_s = statistics.median(g.seconds for g, _ in fulls)
    ours.append(full_s)
    step_ms.append(per_step([g.seconds for g, _ in fulls], [g.seconds for g, _ in ones]))
    if fulls[0][1] is not None:  # the same difference, for the time inside each kernel
      inside_ms.append({k: per_step([t[k] for _, t in fulls], [t[k] for _, t in ones])
                        for k in kernels.KERNELS})
    tokens.append(fulls[0][0].tokens[0])
  readings.append(measure_read_bandwidth())
  bw = _peak(readings)
  wbytes = weight_bytes_per_step(lm.model)
  floor_ms = 1000 * wbytes / (bw["bandwidth_gbs"] * 1e9)
  ms_per_token = statistics.median(step_ms)
  n_total = max_new_tokens * len(prompts)
  result = {
      "eagle_jax_tok_s": round(n_total / sum(ours), 2),
      "ms_per_token": round(ms_per_token, 2),
      "ms_per_token_incl_prefill": round(1000 * sum(ours) / n_total, 2),
      "floor_ms_per_token": round(floor_ms, 2),
      "ratio_to_floor": round(ms_per_token / floor_ms, 3),
      "weight_bytes_per_step": wbytes,
      **bw,
      "bandwidth_readings_gbs": [r["bandwidth_gbs"] for r in readings],
  }
  if inside_ms:
    inside = {k: round(statistics.median(t[k] for t in inside_ms), 3) for k in kernels.KERNELS}
    products_ms = inside["float_products"] + inside["block_products"]
    result.update({
        "kernel_ms_per_token": inside,
        "outside_kernels_ms_per_token": round(ms_per_token - sum(inside.values()), 3),
        "products_ratio_to_floor": round(products_ms / floor_ms, 3),
    })
    if inside["block_products"] > 0:
      result["block_products_gbs"] = round(sum(_blocks_read(lm.model).values())
                                           / inside["block_products"] / 1e6, 2)
  if with_hf and is_writer():  # several processes: process 0 times the reference
    hf_tokens, hf_secs, torch_version, threads = _hf_greedy(lm.folder, prompts, max_new_tokens)
    result.update({
        "hf_tok_s": round(n_total / sum(hf_secs), 2),
        "speedup_vs_hf": round(sum(hf_secs) / sum(ours), 2),
        "greedy_tokens_match_hf": [a == b for a, b in zip(tokens, hf_tokens)],
        "torch_version": torch_version, "torch_threads": threads,
    })
  result["settings"] = {
      "model": model, "batch": 1, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
      "mesh": str(spec_of(mesh) or MeshSpec()),
      "prompt_tokens": [len(p) for p in prompts], "dtype": str(lm.model.embed.dtype),
      "weights_read": weights_read(lm.model),
      "decoding": "greedy, EOS ignored", "jax_version": jax.__version__,
      "jax_backend": jax.default_backend(), "machine": platform.machine(),
      "cpu_count": __import__("os").cpu_count(),
      "repeats": repeats,
      "bandwidth_method": "bytes of a 256 MB fp32 matrix-vector product over its fastest of 20 "
                          "calls, numpy and JAX, measured before each prompt's timed runs and "
                          "after all of them; the highest reading",
      "kernel_ms_method": "wall time inside each CPU kernel (kernels.time_inside) per step, "
                          "taken as ms_per_token is; outside_kernels_ms_per_token is the rest "
                          "of the step",
      "ms_per_token_method": "(median time for N tokens - median time for 1 token) / (N - 1) over "
                             "`repeats` interleaved runs, median over prompts; tokens/s from the "
                             "median N-token run",
  }
  return result
