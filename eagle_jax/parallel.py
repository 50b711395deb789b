"""Device meshes and partition rules: how parameters, caches and batches are laid out over devices.

eagle_jax runs on JAX's own SPMD partitioner: arrays carry a :class:`jax.sharding.NamedSharding`
over a mesh with the axes ``data``, ``fsdp`` and ``tensor`` (:class:`MeshSpec`), and ``jax.jit``
compiles one program for all devices, inserting the collectives itself.

Two tables decide every layout:

- :data:`PARAM_RULES` gives each parameter (matched by its flat name) a *logical* axis per
  dimension: ``vocab``, ``embed``, ``heads``, ``mlp``;
- :data:`LOGICAL_AXES` maps logical axes to mesh axes: the vocabulary, the attention heads and
  the MLP's hidden units over ``tensor`` (vocab-parallel embedding and LM head, Megatron-style
  attention and MLP), the model width over ``fsdp`` (parameters fully sharded, gathered by the
  partitioner where a product needs them), and the batch (``batch``: decoding rows, training
  rows, the KV cache's rows) over ``data``; a cache's kv heads (``kv_heads``) over ``tensor``.

A dimension is sharded over a mesh axis only if the axis size divides its *units*: the dimension's
size, or for the fused q/k/v rows (and the attention output's columns) the number of kv heads,
whose groups of rows (:func:`~eagle_jax.model.transformer.qkv_rows`) must stay whole, and for
the fused gate/up rows the hidden units (gate and up rows paired). Where it does not divide (the
default target has 9 query heads and 3 kv heads: ``tensor=4`` divides neither), that dimension
is replicated over that axis and the run says so once. A parameter no rule names is replicated.

Without a mesh (the default, :func:`current` is None) nothing here applies: arrays stay on
JAX's default device and the CPU kernels run as before. Under a mesh of more than one device
the operations trace their pure-JAX reference (:mod:`eagle_jax.model.ops`): the kernels are
single-device custom calls, which the partitioner cannot split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle_jax.errors import EagleJaxError

AXES = ("data", "fsdp", "tensor")  # mesh axes, in the mesh's device order

# logical axis -> mesh axis
LOGICAL_AXES: Mapping[str, str] = {
    "batch": "data",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "embed": "fsdp",
}

# (pattern searched in a parameter's flat name, logical axis of each dimension); first match wins.
# Weights are [out, in] (eagle_jax.model.transformer.Linear).
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    # token embedding and LM heads [V, D] (the target's, a draft model's, EAGLE-3's, the target
    # arrays an EAGLE drafter holds: embed_VxD, lm_head_VxD, its draft-vocabulary rows)
    (r"(^|\.)(embed|embed_VxD|lm_head_VxD|draft_head_KxD)$", ("vocab", "embed")),
    (r"(^|\.)lm_head\.weight$", ("vocab", "embed")),
    # attention: fused q/k/v rows by kv-head group, output projection's columns likewise
    (r"(^|\.)qkv\.weight$", ("heads", "embed")),
    (r"(^|\.)qkv\.bias$", ("heads",)),
    (r"(^|\.)o\.weight$", ("embed", "heads")),
    # SwiGLU: fused gate/up rows (paired) and the down projection's columns
    (r"(^|\.)gate_up\.weight$", ("mlp", "embed")),
    (r"(^|\.)down\.weight$", ("embed", "mlp")),
    # EAGLE's fusion layer [D, k * D]
    (r"(^|\.)fc\.weight$", ("embed", None)),
    # Medusa: residual blocks [heads, layers, D, D] and vocabulary layers [heads, V, D]
    (r"(^|\.)res_w_KxLxDxD$", (None, None, "embed", None)),
    (r"(^|\.)out_KxVxD$", (None, "vocab", "embed")),
)

CACHE_AXES = ("batch", "kv_heads", None, None)  # a KV cache layer's keys or values [B, K, S, Dh]

UNITS = "shard_units"  # variable metadata: indivisible units per dimension (None = its size)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Mesh axis sizes; their product is the number of devices. All ones (the default): no mesh,
  JAX's default device. Configs hold one as ``mesh:`` (``mesh.fsdp=4`` overrides an axis)."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  def validate(self):
    for axis in AXES:
      size = getattr(self, axis)
      if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise EagleJaxError(f"mesh axis {axis}={size!r}: the size must be a positive integer")

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor

  def __str__(self) -> str:
    return ",".join(f"{a}={getattr(self, a)}" for a in AXES)

  def as_dict(self) -> dict[str, int]:
    return {a: getattr(self, a) for a in AXES}


def parse_mesh(value: str | Mapping | MeshSpec | None) -> MeshSpec | None:
  """``"data=D,fsdp=F,tensor=T"`` (axes of size 1 may be left out) or a mapping of the same;
  None or empty for no mesh. Bad input is a one-line error."""
  if value is None or isinstance(value, MeshSpec):
    return value
  if isinstance(value, str):
    if not value.strip():
      return None
    items = {}
    for part in value.split(","):
      name, eq, size = part.partition("=")
      if not eq:
        raise EagleJaxError(f"--mesh {value!r}: expected axis=size pairs such as data=2,tensor=4")
      if name.strip() in items:
        raise EagleJaxError(f"--mesh {value!r}: axis {name.strip()!r} given twice")
      items[name.strip()] = size.strip()
  elif isinstance(value, Mapping):
    if not value:
      return None
    items = dict(value)
  else:
    raise EagleJaxError(f"mesh: expected axis=size pairs or a mapping, got {value!r}")
  sizes: dict[str, int] = {}
  for name, size in items.items():
    if name not in AXES:
      raise EagleJaxError(f"mesh axis {name!r} unknown: the axes are {', '.join(AXES)}")
    try:
      sizes[name] = int(size)
    except (TypeError, ValueError):
      raise EagleJaxError(f"mesh axis {name}={size!r}: the size must be an integer") from None
    if sizes[name] < 1 or str(size).strip() != str(sizes[name]):
      raise EagleJaxError(f"mesh axis {name}={size!r}: the size must be a positive integer")
  spec = MeshSpec(**sizes)
  spec.validate()
  return spec


def make_mesh(spec: MeshSpec | str | Mapping | None, devices: Sequence | None = None) -> Mesh | None:
  """The :class:`jax.sharding.Mesh` of ``spec`` over ``devices`` (default: every device of
  every process); None without a spec or for all axes of size 1 (JAX's default device, as
  without a mesh). The axis sizes' product must equal the device count."""
  spec = parse_mesh(spec)
  if spec is None or spec.size == 1:
    return None
  devices = list(jax.devices() if devices is None else devices)
  if spec.size != len(devices):
    raise EagleJaxError(f"mesh {spec} spans {spec.size} devices, but JAX sees {len(devices)} "
                        f"({devices[0].platform}); make the sizes' product {len(devices)}")
  grid = np.asarray(devices, dtype=object).reshape(spec.data, spec.fsdp, spec.tensor)
  return Mesh(grid, AXES)


def spec_of(mesh: Mesh | None) -> MeshSpec | None:
  return None if mesh is None else MeshSpec(**{a: int(mesh.shape[a]) for a in AXES})


def describe(mesh: Mesh | None) -> dict[str, int]:
  """The mesh for JSON reports: its axis sizes and device count (one device without a mesh)."""
  return {**(spec_of(mesh) or MeshSpec()).as_dict(), "devices": 1 if mesh is None else mesh.size}


# The mesh the program being traced runs on (None: JAX's default device). Part of jax.jit's
# cache key, so a function traced under one mesh is traced again under another.
_MESH = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[Mesh | None]:
  """Within it, caches and batches are laid out over ``mesh`` (:func:`constrain`) and, if it
  spans several devices, the operations trace their pure-JAX reference."""
  with _MESH(mesh):
    yield mesh


def current() -> Mesh | None:
  return _MESH.value


def spans_devices() -> bool:
  """Whether the current mesh has more than one device (the CPU kernels then step aside)."""
  mesh = _MESH.value
  return mesh is not None and mesh.size > 1


_NOTED: set = set()


def _per_layer(name: str) -> str:
  """``name`` with its layer indices as ``*`` (``layers.*.attn.qkv.weight``): a note says once
  what holds for every layer."""
  return re.sub(r"(^|\.)\d+(?=\.)", r"\1*", name)


def _note(message: str) -> None:
  """Prints ``message`` once per process."""
  if message not in _NOTED:
    _NOTED.add(message)
    print(f"[eagle_jax] {message}", file=sys.stderr)


def partition(name: str, shape: Sequence[int], logical: Sequence[str | None], mesh: Mesh,
              units: Sequence[int | None] | None = None) -> PartitionSpec:
  """The partition spec of an array of ``shape`` whose dimensions have the ``logical`` axes,
  over ``mesh``: each mapped to its mesh axis (:data:`LOGICAL_AXES`) where the axis size divides
  the dimension's units (``units[i]``, default its size), else replicated there (noted once,
  naming ``name``). Axes of size 1 are left out."""
  if len(logical) != len(shape):
    raise ValueError(f"{name}: {len(logical)} logical axes for a {len(shape)}-d array")
  units = tuple(units or (None,) * len(shape))
  out = []
  for dim, (size, axis, unit) in enumerate(zip(shape, logical, units)):
    mesh_axis = LOGICAL_AXES.get(axis) if axis else None
    n = 1 if mesh_axis is None else int(mesh.shape[mesh_axis])
    if n == 1:
      out.append(None)
      continue
    count = size if unit is None else unit
    if count % n:
      _note(f"{_per_layer(name)}: {mesh_axis}={n} does not divide the {count} units of its {axis} axis "
            f"(dimension {dim}); replicated over {mesh_axis}")
      out.append(None)
    else:
      out.append(mesh_axis)
  return PartitionSpec(*out)


def param_axes(name: str, ndim: int) -> tuple[str | None, ...] | None:
  """The logical axes :data:`PARAM_RULES` give the parameter ``name`` (None: no rule)."""
  for pattern, axes in PARAM_RULES:
    if re.search(pattern, name) and len(axes) == ndim:
      return axes
  return None


def param_sharding(name: str, shape, mesh: Mesh, units=None) -> NamedSharding:
  axes = param_axes(name, len(shape))
  if axes is None:
    if len(shape) >= 2 and np.prod(shape) >= 1 << 16:
      _note(f"{_per_layer(name)}: no partition rule; replicated")
    return NamedSharding(mesh, PartitionSpec())
  return NamedSharding(mesh, partition(name, shape, axes, mesh, units))


def _key_name(entry) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def flat_name(path) -> str:
  """A pytree key path as a dotted name (``layers.0.attn.qkv.weight``)."""
  return ".".join(_key_name(p) for p in path)


def place(tree: Any, mesh: Mesh | None) -> Any:
  """``tree`` (an NNX module, updated in place and returned, an NNX state, updated in place, or
  any pytree holding arrays, states and modules: a drafter's parameters) with every array laid
  out over ``mesh`` by :data:`PARAM_RULES` (a variable's :data:`UNITS` metadata applied);
  unchanged without a mesh. Variables holding other pytrees (a model's integer weight blocks)
  are left as they are: :func:`eagle_jax.model.transformer.shard` drops those first."""
  if mesh is None:
    return tree
  if isinstance(tree, nnx.Module):
    nnx.update(tree, place(nnx.state(tree), mesh))
    return tree
  if isinstance(tree, nnx.State):
    for path, var in nnx.to_flat_state(tree):
      value = var.get_value()
      if isinstance(value, jax.Array | np.ndarray):
        units = var.get_metadata().get(UNITS)
        var.set_value(jax.device_put(value, param_sharding(flat_name(path), value.shape, mesh, units)))
    return tree

  def put(path, x):
    if isinstance(x, nnx.State | nnx.Module):
      return place(x, mesh)
    if isinstance(x, jax.Array | np.ndarray):
      return jax.device_put(x, param_sharding(flat_name(path), x.shape, mesh))
    return x

  return jax.tree_util.tree_map_with_path(
      put, tree, is_leaf=lambda x: isinstance(x, nnx.State | nnx.Module))


def set_units(variable: nnx.Variable, units: Sequence[int | None]) -> None:
  """Records a parameter's indivisible units per dimension (:data:`UNITS`), for
  :func:`partition`."""
  variable.set_metadata(UNITS, tuple(units))


def constrain(x: jax.Array, logical: Sequence[str | None], name: str = "activation") -> jax.Array:
  """``x`` constrained to the layout of its ``logical`` axes over the current mesh (inside a
  traced function); ``x`` itself without a mesh."""
  mesh = _MESH.value
  if mesh is None or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, partition(name, x.shape, logical, mesh)))


def batch_sharding(shape: Sequence[int], mesh: Mesh | None = None) -> NamedSharding | None:
  """The layout of a batch ``[B, ...]``: rows over ``data`` (replicated where ``data`` does not
  divide ``B``); None without a mesh (``mesh`` or the current one)."""
  mesh = mesh or _MESH.value
  if mesh is None:
    return None
  return NamedSharding(mesh, partition("batch", shape, ("batch",) + (None,) * (len(shape) - 1), mesh))


def local_rows(batch: int, mesh: Mesh | None = None) -> slice:
  """The rows of a ``[batch, ...]`` array laid out by :func:`batch_sharding` that this
  process's devices hold (every row with one process or without a mesh): what it needs to
  read."""
  sharding = batch_sharding((batch,), mesh)
  if sharding is None or jax.process_count() == 1:
    return slice(0, batch)
  spans = {idx[0].indices(batch)[:2] for idx in sharding.addressable_devices_indices_map((batch,)).values()}
  start, stop = min(a for a, _ in spans), max(b for _, b in spans)
  return slice(start, stop)


def shard_batch(x, mesh: Mesh | None = None, batch: int | None = None):
  """A batch placed by :func:`batch_sharding`; unchanged without a mesh. ``x`` holds every row
  (``batch=None``) or only this process's (:func:`local_rows` of ``batch`` rows), as each
  process of a multi-process run reads only its own
  (:func:`jax.make_array_from_process_local_data`)."""
  full = (batch if batch is not None else np.shape(x)[0],) + tuple(np.shape(x)[1:])
  sharding = batch_sharding(full, mesh)
  if sharding is None:
    return x
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  if batch is None:
    x = np.asarray(x)[local_rows(full[0], mesh)]
  return jax.make_array_from_process_local_data(sharding, np.asarray(x), full)


def to_host(x) -> np.ndarray:
  """``x`` as a numpy array on this host; an array spread over several processes' devices is
  gathered from all of them first (every process must call this together)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def gather(module: nnx.Module) -> nnx.Module:
  """``module`` with every array brought onto this host's default device (:func:`to_host`;
  every process must call it together): for writing it out. Returned, updated in place; as it
  is with one process, whose arrays are all addressable."""
  if jax.process_count() == 1:
    return module
  state = nnx.state(module)
  for _, var in nnx.to_flat_state(state):
    value = var.get_value()
    if isinstance(value, jax.Array):
      var.set_value(jax.numpy.asarray(to_host(value)))
  nnx.update(module, state)
  return module


def initialize_distributed(force: bool = False) -> bool:
  """Starts JAX's multi-process runtime (:func:`jax.distributed.initialize`) when the standard
  variables name a coordinator (``JAX_COORDINATOR_ADDRESS``, with ``JAX_NUM_PROCESSES`` and
  ``JAX_PROCESS_ID``), or when ``force`` asks for it (a cluster JAX detects itself: TPU pods,
  SLURM, Open MPI). Must run before anything touches a device; returns whether it ran."""
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not (address or force):
    return False
  kwargs = {}
  for key, env in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
    if os.environ.get(env):
      try:
        kwargs[key] = int(os.environ[env])
      except ValueError:
        raise EagleJaxError(f"{env}={os.environ[env]!r}: expected an integer") from None
  try:
    jax.distributed.initialize(coordinator_address=address, **kwargs)
  except (ValueError, RuntimeError) as e:
    raise EagleJaxError(f"multi-process start failed: {e}") from None
  return True


def is_writer() -> bool:
  """Whether this process writes results, metrics and exported files (process 0)."""
  return jax.process_index() == 0


def share(read: Callable[[], Any]) -> Any:
  """What ``read()`` returns on process 0, on every process (``read`` runs there only; its
  value must be JSON-serialisable; every process must call this together). With one process,
  ``read()``. For decisions that must agree across processes (which units are cached, what a
  resumed run has done) and for what only process 0 reads from disk."""
  if jax.process_count() == 1:
    return read()
  payload = np.frombuffer(json.dumps(read()).encode(), np.uint8) if is_writer() else None
  size = int(multihost_utils.broadcast_one_to_all(np.int64(0 if payload is None else payload.size)))
  data = multihost_utils.broadcast_one_to_all(payload if payload is not None else np.zeros(size, np.uint8))
  return json.loads(np.asarray(data, np.uint8).tobytes().decode())


def param_bytes(tree: Any) -> dict[str, int]:
  """``{"total": bytes of every array in tree, "per_device": the largest device's share}``
  (with replicas counted on each device that holds one; an array held twice counts once)."""
  total, by_device, seen = 0, {}, set()
  for x in jax.tree.leaves(tree):
    if not isinstance(x, jax.Array) or id(x) in seen:
      continue
    seen.add(id(x))
    total += x.nbytes
    for shard in x.addressable_shards:
      by_device[shard.device.id] = by_device.get(shard.device.id, 0) + shard.data.nbytes
  return {"total": total, "per_device": max(by_device.values(), default=0)}
