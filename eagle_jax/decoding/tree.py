"""Token trees for speculative decoding.

A draft tree has M = 1 + N slots: slot 0 is the root (the last token the target emitted,
not yet in its cache) and slots 1..N are drafted nodes in topological order (a node's parent
has a smaller index, so a parent always precedes its children, and siblings are tried in
index order). ``parents[0] = -1``. Static trees (EAGLE's 25-node default, Medusa's 63-node
default, chains) are built once from choice lists; dynamic trees (EAGLE-2) are computed per
step and per row with the same shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import EagleJaxError

# Each entry is a path of top-k ranks from the root (EAGLE-1 default: 25 nodes, depth 5).
EAGLE_DEFAULT_CHOICES = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1))

# Medusa-1's published default tree for Vicuna-7B heads (63 nodes, depth 4; "mc_sim_7b_63"),
# listed here by depth, then rank.
MEDUSA_DEFAULT_CHOICES = (
    (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,), (8,), (9,), (0, 0), (0, 1), (0, 2), (0, 3),
    (0, 4), (0, 5), (0, 6), (0, 7), (0, 8), (0, 9), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4),
    (1, 5), (1, 6), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0),
    (8, 0), (9, 0), (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5), (0, 0, 6),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 2, 0), (0, 2, 1),
    (0, 3, 0), (0, 4, 0), (0, 5, 0), (0, 6, 0), (0, 7, 0), (1, 0, 0), (1, 0, 1), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1))


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """A static tree: numpy buffers computed once (hashable, usable as a jit static)."""

  choices: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    seen = set()
    for c in self.choices:
      if not c or any(r < 0 for r in c):
        raise EagleJaxError(f"tree choice {c!r}: paths must be non-empty lists of ranks >= 0")
      if len(c) > 1 and tuple(c[:-1]) not in seen:
        raise EagleJaxError(f"tree choice {c!r} appears before its parent {c[:-1]!r}")
      seen.add(tuple(c))
    if len(seen) != len(self.choices):
      raise EagleJaxError("tree choices contain duplicates")

  @classmethod
  def from_choices(cls, choices) -> "TreeSpec":
    ordered = sorted((tuple(int(r) for r in c) for c in choices), key=lambda c: (len(c), c))
    return cls(tuple(ordered))

  @classmethod
  def chain(cls, gamma: int) -> "TreeSpec":
    return cls(tuple((0,) * d for d in range(1, gamma + 1)))

  @property
  def num_nodes(self) -> int:
    return len(self.choices)

  @property
  def parents(self) -> np.ndarray:
    """``[M]`` parent slot of each slot (root first)."""
    index = {c: i + 1 for i, c in enumerate(self.choices)}
    return np.array([-1] + [index.get(c[:-1], 0) for c in self.choices], np.int32)

  @property
  def ranks(self) -> np.ndarray:
    """``[M]`` top-k rank of each node among its parent's candidates (root: 0)."""
    return np.array([0] + [c[-1] for c in self.choices], np.int32)

  @property
  def depths(self) -> np.ndarray:
    return np.array([0] + [len(c) for c in self.choices], np.int32)

  @property
  def ancestor_mask(self) -> np.ndarray:
    """``[M, M]`` bool: slot i sees slot j (j is i, the root or an ancestor of i)."""
    parents, m = self.parents, self.num_nodes + 1
    mask = np.eye(m, dtype=bool)
    for i in range(1, m):
      mask[i] |= mask[parents[i]]
    return mask

  @property
  def paths(self) -> np.ndarray:
    """``[M, max_depth]`` slots on the path root -> slot (excluding the root), -1 padded."""
    out = np.full((self.num_nodes + 1, max(self.max_depth, 1)), -1, np.int32)
    parents = self.parents
    for i in range(1, self.num_nodes + 1):
      chain, j = [], i
      while j > 0:
        chain.append(j)
        j = parents[j]
      out[i, :len(chain)] = chain[::-1]
    return out

  @property
  def max_depth(self) -> int:
    return max((len(c) for c in self.choices), default=0)


def tree_structure(parents_BxM: jax.Array, valid_BxM: jax.Array):
  """Ancestor mask ``[B, M, M]`` (self included) and depth ``[B, M]`` from parent slots.

  Invalid (padding) slots see only themselves and the root and have depth 1; no valid
  slot sees them.
  """
  b, m = parents_BxM.shape
  eye = jnp.eye(m, dtype=bool)

  def body(j, mask):
    parent_row = mask[jnp.arange(b), jnp.maximum(parents_BxM[:, j], 0)]  # [B, M]
    own = jnp.where(valid_BxM[:, j, None], parent_row, eye[0][None]) | eye[j][None]
    return mask.at[:, j].set(own)

  mask = jax.lax.fori_loop(1, m, body, jnp.broadcast_to(eye, (b, m, m)))
  return mask, mask.sum(-1).astype(jnp.int32) - 1
