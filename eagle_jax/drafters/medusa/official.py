"""Medusa-1 heads in the published layout (FasterDecoding/Medusa), in and out.

``medusa_lm_head.safetensors`` (or the pickled ``medusa_lm_head.pt``) holds the head list's
state dict without a prefix: for head ``i``, residual block ``j`` is ``{i}.{j}.linear.weight``
``[h, h]`` and ``{i}.{j}.linear.bias`` ``[h]``, and the output layer after the ``L`` blocks is
``{i}.{L}.weight`` ``[V, h]``. ``config.json`` carries ``medusa_num_heads``,
``medusa_num_layers`` and ``base_model_name_or_path``; released configs under-state the head
count, so it is read from the weights.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.drafters import interop
from eagle_jax.drafters.medusa.heads import MedusaConfig, MedusaHeads
from eagle_jax.errors import EagleJaxError

WEIGHTS = "medusa_lm_head.safetensors"
_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.weight$")


def _names(cfg: MedusaConfig) -> dict[str, tuple]:
  d, v, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
  out = {}
  for i in range(cfg.num_heads):
    for j in range(layers):
      out[f"{i}.{j}.linear.weight"], out[f"{i}.{j}.linear.bias"] = (d, d), (d,)
    out[f"{i}.{layers}.weight"] = (v, d)
  return out


def to_published(heads: MedusaHeads) -> dict[str, np.ndarray]:
  cfg = heads.config
  w, b = np.asarray(heads.res_w_KxLxDxD[...]), np.asarray(heads.res_b_KxLxD[...])
  out_w = np.asarray(heads.out_KxVxD[...])
  out = {}
  for i in range(cfg.num_heads):
    for j in range(cfg.num_layers):
      out[f"{i}.{j}.linear.weight"], out[f"{i}.{j}.linear.bias"] = w[i, j], b[i, j]
    out[f"{i}.{cfg.num_layers}.weight"] = out_w[i]
  return out


def write_published(heads: MedusaHeads, folder: str, base_model: str | None = None) -> str:
  cfg = heads.config
  config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
            "base_model_name_or_path": base_model, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}
  return interop.write(folder, WEIGHTS, to_published(heads), config)


def describe_published(folder: str, target_hidden: int, target_vocab: int) -> tuple[int | None, str]:
  """``(heads, description)`` of a published Medusa folder, checked against the target's
  hidden size and vocabulary from a safetensors header (no weights read), or from
  ``config.json`` alone (its head count then only as stated: the weights decide)."""
  path = interop.weights_file(folder)
  shapes = interop.tensor_shapes(path)
  raw = interop.read_config(folder)
  if shapes:
    outs = {int(k.split(".")[0]): s for k, s in shapes.items() if re.match(r"^\d+\.\d+\.weight$", k)}
    if not outs:
      raise EagleJaxError(f"{path}: no Medusa output layers ('{{i}}.{{L}}.weight') found")
    heads, (vocab, hidden), stated = max(outs) + 1, outs[0], "from the weights"
  else:
    heads, stated = raw.get("medusa_num_heads"), "as config.json states; the weights decide"
    hidden, vocab = raw.get("hidden_size", target_hidden), raw.get("vocab_size", target_vocab)
  for what, got, want in (("hidden size", hidden, target_hidden), ("vocabulary", vocab, target_vocab)):
    if got != want:
      raise EagleJaxError(f"{path or folder}: Medusa heads of {what} {got} but the target has "
                          f"{want} (heads for another target)")
  return (heads if shapes else None), (f"Medusa-1, {heads} heads ({stated}), "
                                       f"{raw.get('medusa_num_layers', 1)} residual block(s)")


def read_published(folder: str) -> MedusaHeads:
  """The heads in a published Medusa folder; their count and depth come from the weights."""
  path = interop.weights_file(folder)
  if interop.detect(folder) != interop.MEDUSA:
    raise EagleJaxError(f"{folder}: not a published Medusa folder (config.json plus "
                        f"{' or '.join(interop.MEDUSA_FILES)})")
  tensors = interop.read_tensors(path)
  blocks = [tuple(int(x) for x in m.groups()) for m in map(_BLOCK.match, tensors) if m]
  heads = [int(k.split(".")[0]) for k in tensors if re.match(r"^\d+\.\d+\.weight$", k)]
  if not heads:
    raise EagleJaxError(f"{path}: no Medusa output layers ('{{i}}.{{L}}.weight') found")
  num_heads = max(heads) + 1
  num_layers = 1 + max((j for i, j in blocks if i == 0), default=-1)
  out = tensors.get(f"0.{num_layers}.weight")
  if out is None or out.ndim != 2:
    raise EagleJaxError(f"{path}: tensor '0.{num_layers}.weight' missing (head 0's output "
                        f"layer after its {num_layers} residual block(s))")
  cfg = MedusaConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=int(out.shape[1]),
                     vocab_size=int(out.shape[0]))
  t = interop.take(tensors, _names(cfg), path)
  module = nnx.eval_shape(lambda: MedusaHeads(cfg, rngs=nnx.Rngs(0)))
  k, l, d = num_heads, num_layers, cfg.hidden_size
  w = np.stack([np.stack([t[f"{i}.{j}.linear.weight"] for j in range(l)]) if l else
                np.zeros((0, d, d), np.float32) for i in range(k)])
  b = np.stack([np.stack([t[f"{i}.{j}.linear.bias"] for j in range(l)]) if l else
                np.zeros((0, d), np.float32) for i in range(k)])
  module.res_w_KxLxDxD.set_value(jnp.asarray(w, jnp.float32))
  module.res_b_KxLxD.set_value(jnp.asarray(b, jnp.float32))
  module.out_KxVxD.set_value(jnp.asarray(np.stack([t[f"{i}.{l}.weight"] for i in range(k)]),
                                         jnp.float32))
  return module
