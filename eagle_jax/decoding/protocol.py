"""The drafter protocol: pure functions over pytrees, so the speculative loop jits whole.

A drafter object holds only static, hashable settings (it is a jit static argument); its
weights travel separately as ``dparams`` and its per-sequence state as a pytree.

Each step: ``propose`` returns a :class:`Draft` (N nodes below the root), the target verifies
it, and ``update`` receives what was emitted (:class:`Accepted`).
"""

from __future__ import annotations

from typing import Any, Protocol

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Draft:
  """N drafted nodes (tree slots 1..N; slot 0 is the root)."""

  tokens_BxN: jax.Array
  parents_BxN: jax.Array  # parent slot (0 = root), smaller than the node's own slot
  valid_BxN: jax.Array  # bool; invalid nodes are padding and never accepted
  q_BxNxV: jax.Array | None  # distribution each node was drawn from; None = deterministic draft


@flax.struct.dataclass
class Accepted:
  """What one verify step emitted for each row.

  ``tokens_BxK[:, :count]`` are the accepted draft tokens followed by the target's bonus
  token (the next root). ``features_BxKxD[:, i]`` is the target's feature (see
  ``Drafter.feature_layers``) at the position just before ``tokens_BxK[:, i]`` (root, then
  each accepted node). ``count_B`` is
  0 for rows that have finished.
  """

  tokens_BxK: jax.Array
  count_B: jax.Array
  features_BxKxD: jax.Array


class ChainDrafter:
  """Mixin for drafters that propose a chain of ``gamma`` nodes (node i's parent is slot i)."""

  gamma: int
  feature_layers = ()  # the top hidden state

  @property
  def num_nodes(self) -> int:
    return self.gamma

  @property
  def max_depth(self) -> int:
    return self.gamma

  def chain_parents(self, batch: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(self.gamma, dtype=jnp.int32), (batch, self.gamma))


def is_width_ladder(widths: tuple[int, ...], top: int) -> bool:
  """Whether ``widths`` is a valid verify-width ladder: strictly ascending from >= 1 to ``top``."""
  return (bool(widths) and list(widths) == sorted(set(widths)) and widths[0] >= 1
          and widths[-1] == top)


class Drafter(Protocol):
  num_nodes: int  # N, the static node budget per step
  max_depth: int  # deepest node, bounds the accepted path
  # Which target features the drafter receives (``features_BxKxF``): () = the top hidden state
  # (as fed to the LM head); otherwise Hugging Face ``hidden_states`` indices, concatenated.
  feature_layers: tuple[int, ...]
  # Optional: verify widths the loop may use (ascending, ending at num_nodes; default
  # (num_nodes,)). Each step verifies the smallest width holding every active row's valid
  # nodes, or takes a plain decode step when there are none (eagle_jax.decoding.speculative).
  widths: tuple[int, ...]
  # Optional, default False: every step proposes at least one valid node in every row, so the
  # loop compiles no plain one-token decode step for this drafter (it would never run).
  always_drafts: bool

  def init(self, dparams: Any, prompt_BxP: jax.Array, lengths_B: jax.Array,
           features_BxPxD: jax.Array, first_B: jax.Array, cache_len: int) -> Any:
    """State after the target's prefill; ``first_B`` is the first emitted token (the root)."""

  def propose(self, dparams: Any, state: Any, root_B: jax.Array, key: jax.Array,
              params) -> tuple[Draft, Any]:
    ...

  def update(self, dparams: Any, state: Any, accepted: Accepted) -> Any:
    ...
