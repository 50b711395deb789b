import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.errors import EagleJaxError
from eagle_jax.decoding.tree import EAGLE_DEFAULT_CHOICES, MEDUSA_DEFAULT_CHOICES, TreeSpec, tree_structure


def test_eagle_default_tree_buffers():
  tree = TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES)
  assert tree.num_nodes == 25 and tree.max_depth == 5
  parents, depths = tree.parents, tree.depths
  assert parents[0] == -1 and all(parents[i] < i for i in range(1, 26))
  assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, 26))
  # each slot's path spells its choice: ranks along the path
  for slot, choice in enumerate(tree.choices, start=1):
    path = [s for s in tree.paths[slot] if s >= 0]
    assert tuple(tree.ranks[path]) == choice and path[-1] == slot
  mask = tree.ancestor_mask
  assert mask.sum(1).tolist() == (depths + 1).tolist()


def test_dynamic_structure_matches_static():
  tree = TreeSpec.from_choices(EAGLE_DEFAULT_CHOICES)
  mask, depth = tree_structure(jnp.asarray(tree.parents)[None], jnp.ones((1, 26), bool))
  np.testing.assert_array_equal(mask[0], tree.ancestor_mask)
  np.testing.assert_array_equal(depth[0], tree.depths)


def test_invalid_slots_are_isolated():
  parents = jnp.array([[-1, 0, 1, 0, 3]])
  valid = jnp.array([[True, True, False, True, True]])
  mask, depth = tree_structure(parents, valid)
  # the whole structure, pinned: the invalid slot 2 (a child of 1) sees only the root and
  # itself, at depth 1; no other slot sees it; the valid slots see exactly their ancestors
  T, F = True, False
  assert mask[0].tolist() == [[T, F, F, F, F],
                              [T, T, F, F, F],
                              [T, F, T, F, F],
                              [T, F, F, T, F],
                              [T, F, F, T, T]]
  assert depth[0].tolist() == [0, 1, 1, 1, 2]
  # a batch: each row follows its own validity (slot 2 valid in the second row: depth 2 under 1)
  mask2, depth2 = tree_structure(jnp.concatenate([parents, parents]),
                                 jnp.concatenate([valid, jnp.ones_like(valid)]))
  np.testing.assert_array_equal(mask2[0], mask[0])
  assert mask2[1, 2].tolist() == [T, T, T, F, F] and depth2[1].tolist() == [0, 1, 2, 1, 2]


def test_chain():
  chain = TreeSpec.chain(4)
  assert chain.parents.tolist() == [-1, 0, 1, 2, 3] and chain.max_depth == 4


@pytest.mark.parametrize("choices", [[(0, 0)], [(0,), (0,)], [(-1,)]])
def test_bad_choices(choices):
  with pytest.raises(EagleJaxError):
    TreeSpec(tuple(choices))


def test_medusa_default_tree():
  tree = TreeSpec.from_choices(MEDUSA_DEFAULT_CHOICES)
  assert tree.num_nodes == 63 and tree.max_depth == 4
  assert tree.ancestor_mask.sum() == (tree.depths + 1).sum()
