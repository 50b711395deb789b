"""Statistical tests of the lossless verify step (eagle_jax.decoding.verify.verify).

A tiny synthetic target over V tokens: an order-2 table, the target's logits after context
(..., a, b) are ``table[a, b]``. Per sample, each round drafts a tree rooted at the last
emitted token (stochastic: every node drawn from the draft q of its parent's context;
deterministic: siblings are q's top-k or drawn from q without replacement), scores it with
the table, runs verify and appends tokens[path] + bonus. After K rounds at least K tokens are
emitted, and their joint law must be the target's, p(x1) p(x2 | x1) p(x3 | x1, x2): a
chi-square test checks it on >= 100k samples. Deliberately wrong verifiers (written here)
must fail the same test, so the test has power. Greedy verification is checked exactly
against a brute-force reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decoding.sampling import SamplingParams, probabilities
from eagle_jax.decoding.tree import TreeSpec
from eagle_jax.decoding.verify import Verdict, verify

V = 8
N = 100_000
ROOT_PREV, ROOT = 1, 2  # the context the continuation starts from
ALPHA = 1e-4  # p-value a correct verifier must exceed (fixed seeds: deterministic)

# ---------------------------------------------------------------- trees


def _spec_tree(spec):
  """(parents, ranks, valid) numpy arrays of a TreeSpec, all slots valid."""
  return spec.parents, spec.ranks, np.ones(spec.num_nodes + 1, bool)


CHAIN = _spec_tree(TreeSpec.chain(3))
WIDE = _spec_tree(TreeSpec.from_choices([(0,), (1,), (2,), (3,), (1, 0), (1, 1), (1, 2)]))
DEEP = _spec_tree(TreeSpec.from_choices([
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)]))
# Padding slots (valid False) interleaved with real nodes; they hang off real nodes and carry
# adversarial tokens (the target's argmax), so a verifier that looked at them would be biased.
PADDED = (np.array([-1, 0, 0, 1, 0, 3, 1, 2, 0], np.int32),
          np.array([0, 0, 1, 0, 2, 0, 1, 0, 3], np.int32),
          np.array([1, 1, 0, 1, 1, 1, 0, 1, 0], bool))
TREES = dict(chain=CHAIN, wide=WIDE, deep=DEEP, padded=PADDED)


def _depths(parents_M):
  d = np.zeros(len(parents_M), np.int32)
  for j in range(1, len(parents_M)):
    d[j] = d[parents_M[j]] + 1
  return d


# ---------------------------------------------------------------- target and drafts


def _target_table():
  """``[V, V, V]`` logits of the next token after context (a, b)."""
  return 1.5 * np.random.default_rng(0).standard_normal((V, V, V)).astype(np.float32)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _draft_table(kind, table_VxVxV):
  """``[V, V, V]`` draft probabilities q(. | a, b); kind "close", "far", "peaked" or "uniform"."""
  rng = np.random.default_rng(1)
  noise = rng.standard_normal(table_VxVxV.shape).astype(np.float32)
  if kind == "close":
    return _softmax(table_VxVxV + 0.5 * noise)
  if kind == "far":
    return _softmax(2.0 * noise)
  if kind == "peaked":
    return _softmax(4.0 * noise)
  assert kind == "uniform", kind
  return np.full(table_VxVxV.shape, 1.0 / V, np.float32)


def _draft_tree(key, prev, last, tree, table_VxVxV, q_VxVxV, det):
  """One sample's tree rooted at ``last``: tokens [M], target logits [M, V], q [M, V] or None.

  ``det`` "": every node drawn from q of its parent's context (siblings i.i.d.); "topk":
  children are q's top-k (a deterministic draft); "swor": children drawn from q without
  replacement (Gumbel top-k), also passed as a deterministic draft (distinct siblings).
  """
  parents_M, ranks_M, valid_M = tree
  m = len(parents_M)
  keys = jax.random.split(key, m)
  tok, ctx = [last], [prev]  # token of each slot and the token before it
  q_rows = [jnp.full((V,), 1.0 / V)]  # slot 0's row is unused
  for j in range(1, m):
    pa = int(parents_M[j])
    q_row = q_VxVxV[ctx[pa], tok[pa]]
    if not valid_M[j]:
      x = jnp.argmax(table_VxVxV[ctx[pa], tok[pa]])
    elif det:
      gumbel = jax.random.gumbel(keys[pa], (V,)) if det == "swor" else 0.0
      x = jnp.argsort(-(jnp.log(q_row) + gumbel))[ranks_M[j]]  # same order for all siblings
    else:
      x = jax.random.categorical(keys[j], jnp.log(q_row))
    tok.append(x.astype(jnp.int32))
    ctx.append(tok[pa])
    q_rows.append(q_row)
  tokens_M, ctx_M = jnp.stack(tok), jnp.stack(ctx)
  q_MxV = None if det else jnp.stack(q_rows)
  return tokens_M, table_VxVxV[ctx_M, tokens_M], q_MxV


# ---------------------------------------------------------------- simulation


def _emit(verdict, tokens_BxM):
  """``[B, D + 1]`` emitted tokens (tokens[path] then the bonus; -1 after)."""
  path_BxD, n_B = verdict.path_BxD, verdict.num_accepted_B
  d = path_BxD.shape[1]
  drafted_BxD = jnp.take_along_axis(tokens_BxM, path_BxD, axis=1)
  i_D = jnp.arange(d + 1)[None, :]
  padded_BxE = jnp.concatenate([drafted_BxD, jnp.zeros_like(drafted_BxD[:, :1])], 1)
  out = jnp.where(i_D < n_B[:, None], padded_BxE, -1)
  return jnp.where(i_D == n_B[:, None], verdict.bonus_B[:, None], out)


def _path_ok(verdict, parents_M, valid_M):
  """``[B]``: path[:n] is a chain of valid slots starting at a child of the root."""
  path_BxD, n_B = verdict.path_BxD, verdict.num_accepted_B
  d = path_BxD.shape[1]
  prev_BxD = jnp.concatenate([jnp.zeros_like(path_BxD[:, :1]), path_BxD[:, :-1]], 1)
  link = (jnp.asarray(parents_M)[path_BxD] == prev_BxD) & jnp.asarray(valid_M)[path_BxD]
  used = jnp.arange(d)[None, :] < n_B[:, None]
  return jnp.all(link | ~used, -1) & (n_B <= d)


def _simulate(verify_fn, tree, params, q_kind, rounds, seed=0, n=N):
  """``[n, rounds]`` first emitted tokens and ``[n]`` path sanity flags (jit once)."""
  table = _target_table()
  q_name, _, det = q_kind.partition("-")
  q_table = _draft_table(q_name, table)
  parents_M, _, valid_M = tree
  m = len(parents_M)
  max_depth = int(_depths(np.where(valid_M, parents_M, 0)).max())

  @jax.jit
  def run(key):
    prev_B = jnp.full((n,), ROOT_PREV, jnp.int32)
    last_B = jnp.full((n,), ROOT, jnp.int32)
    out_BxK = jnp.full((n, rounds), -1, jnp.int32)
    count_B = jnp.zeros((n,), jnp.int32)
    ok_B = jnp.ones((n,), bool)
    for _ in range(rounds):
      key, k_draft, k_verify = jax.random.split(key, 3)
      draft = functools.partial(_draft_tree, tree=tree, table_VxVxV=jnp.asarray(table),
                                q_VxVxV=jnp.asarray(q_table), det=det)
      tokens, logits, q = jax.vmap(draft)(jax.random.split(k_draft, n), prev_B, last_B)
      parents_BxM = jnp.broadcast_to(jnp.asarray(parents_M), (n, m))
      valid_BxM = jnp.broadcast_to(jnp.asarray(valid_M), (n, m))
      verdict = verify_fn(logits, tokens, parents_BxM, valid_BxM, q, k_verify, params, max_depth)
      ok_B &= _path_ok(verdict, parents_M, valid_M)
      emitted_BxE = _emit(verdict, tokens)
      idx_BxK = jnp.arange(rounds)[None, :] - count_B[:, None]
      take = (idx_BxK >= 0) & (idx_BxK <= verdict.num_accepted_B[:, None])
      vals = jnp.take_along_axis(emitted_BxE, jnp.clip(idx_BxK, 0, max_depth), axis=1)
      out_BxK = jnp.where(take, vals, out_BxK)
      n_B = verdict.num_accepted_B
      before_bonus = jnp.take_along_axis(emitted_BxE, jnp.maximum(n_B - 1, 0)[:, None], 1)[:, 0]
      prev_B = jnp.where(n_B > 0, before_bonus, last_B)
      last_B = verdict.bonus_B
      count_B = count_B + n_B + 1
    return out_BxK, ok_B

  out, ok = run(jax.random.key(seed))
  return np.asarray(out), np.asarray(ok)


# ---------------------------------------------------------------- exact law and chi-square


def _exact_joint(params, k):
  """``[V ** k]`` exact probability of the first k emitted tokens (target sampled directly)."""
  table = _target_table()
  p_VxVxV = np.asarray(probabilities(jnp.asarray(table.reshape(-1, V)), params)).reshape(V, V, V)
  p_VxVxV = p_VxVxV.astype(np.float64)
  flat = {(): 1.0}  # probability of each emitted prefix
  for _ in range(k):
    new_flat = {}
    for seq, pr in flat.items():
      a, b = ((ROOT_PREV, ROOT) + seq)[-2:]
      for x in range(V):
        new_flat[seq + (x,)] = pr * p_VxVxV[a, b, x]
    flat = new_flat
  return np.array([flat[s] for s in sorted(flat)])


def _chi_square(samples_NxK, probs):
  """(statistic, dof, p-value); cells with expected < 5 pooled; asserts p = 0 cells are empty."""
  n, k = samples_NxK.shape
  assert samples_NxK.min() >= 0
  idx = (samples_NxK * (V ** np.arange(k - 1, -1, -1))[None, :]).sum(-1)
  counts = np.bincount(idx, minlength=V ** k).astype(np.float64)
  zero = probs == 0
  assert counts[zero].sum() == 0, "tokens the target can never emit were emitted"
  expected = n * probs
  big, small = expected >= 5, (expected < 5) & ~zero
  obs = np.append(counts[big], counts[small].sum())
  exp = np.append(expected[big], expected[small].sum())
  obs, exp = obs[exp > 0], exp[exp > 0]
  stat = float(((obs - exp) ** 2 / exp).sum())
  dof = len(obs) - 1
  pvalue = float(jax.scipy.special.gammaincc(dof / 2.0, stat / 2.0))
  return stat, dof, pvalue


def _check(out_NxK, ok_N, params):
  """Chi-square of the first 1..K emitted tokens; returns [(k, stat, dof, p-value)]."""
  assert ok_N.all(), "verify returned a path that is not a chain of valid tree nodes"
  results = []
  for k in range(1, out_NxK.shape[1] + 1):
    results.append((k,) + _chi_square(out_NxK[:, :k], _exact_joint(params, k)))
  return results


# ---------------------------------------------------------------- deliberately wrong verifiers


def _reference_row(logits_MxV, tokens_M, parents_M, valid_M, q_MxV, key, params, max_depth,
                   mode):
  """Recursive rejection sampling, written independently; ``mode`` injects a bug.

  correct: residual p <- norm(max(p - q, 0)) after each rejected sibling, bonus from it.
  bonus_from_p: residuals updated, but the bonus is drawn from the unmodified p.
  stale_residual: every sibling tested against the unmodified p; bonus from the last residual.
  parent_p: after an accept, the children are tested against the parent's p (not the node's).
  """
  m, v = logits_MxV.shape
  probs_MxV = probabilities(logits_MxV, params)
  k_u, k_bonus = jax.random.split(key)
  u_M = jax.random.uniform(k_u, (m,))

  def step(carry, j):
    cur, p_node, p_res, path_D, n = carry
    x = tokens_M[j]
    q_V = jax.nn.one_hot(x, v) if q_MxV is None else q_MxV[j]
    cand = valid_M[j] & (parents_M[j] == cur)
    p_test = p_node if mode == "stale_residual" else p_res
    accept = cand & (u_M[j] * q_V[x] < p_test[x])
    resid = jnp.maximum(p_test - q_V, 0.0)
    resid = jnp.where(resid.sum() > 0, resid / jnp.maximum(resid.sum(), 1e-30), p_test)
    p_next = p_node if mode == "parent_p" else probs_MxV[j]
    p_node = jnp.where(accept, p_next, p_node)
    p_res = jnp.where(accept, p_next, jnp.where(cand, resid, p_res))
    path_D = jnp.where(accept, path_D.at[jnp.minimum(n, max_depth - 1)].set(j), path_D)
    return (jnp.where(accept, j, cur), p_node, p_res, path_D, n + accept), None

  init = (jnp.int32(0), probs_MxV[0], probs_MxV[0], jnp.zeros((max_depth,), jnp.int32),
          jnp.int32(0))
  (_, p_node, p_res, path_D, n), _ = jax.lax.scan(step, init, jnp.arange(1, m))
  p_bonus = p_node if mode == "bonus_from_p" else p_res
  bonus = jax.random.categorical(k_bonus, jnp.log(p_bonus)).astype(jnp.int32)
  return path_D, n, bonus


def _reference_verify(mode):
  """A verifier with ``verify``'s signature built on :func:`_reference_row`."""
  def fn(logits_BxMxV, tokens_BxM, parents_BxM, valid_BxM, q_BxMxV, key, params, max_depth):
    keys = jax.random.split(key, tokens_BxM.shape[0])
    row = functools.partial(_reference_row, params=params, max_depth=max_depth, mode=mode)
    q_axis = None if q_BxMxV is None else 0
    path, n, bonus = jax.vmap(row, in_axes=(0, 0, 0, 0, q_axis, 0))(
        logits_BxMxV, tokens_BxM, parents_BxM, valid_BxM, q_BxMxV, keys)
    return Verdict(path_BxD=path, num_accepted_B=n, bonus_B=bonus)
  return fn


# ---------------------------------------------------------------- sampling tests

CASES = [  # (tree, draft kind, params, rounds = emitted tokens checked)
    ("chain", "close", SamplingParams(temperature=1.0), 2),
    ("wide", "far", SamplingParams(temperature=0.7, top_k=5), 2),
    ("wide", "peaked", SamplingParams(temperature=1.0), 2),
    ("deep", "uniform", SamplingParams(temperature=1.0, top_p=0.8), 3),
    ("deep", "close", SamplingParams(temperature=1.3, top_p=0.9, top_k=6), 3),
    ("chain", "close-topk", SamplingParams(temperature=1.0), 2),
    ("wide", "far-swor", SamplingParams(temperature=0.7, top_k=5), 2),
    ("deep", "close-topk", SamplingParams(temperature=1.0, top_p=0.8), 3),
    ("padded", "far", SamplingParams(temperature=1.0), 2),
    ("padded", "far-swor", SamplingParams(temperature=1.0), 2),
]


@pytest.mark.parametrize("tree,q_kind,params,rounds", CASES,
                         ids=[f"{t}-{q}-{i}" for i, (t, q, _, _) in enumerate(CASES)])
def test_verify_is_lossless(tree, q_kind, params, rounds):
  """The first 1..3 emitted tokens follow the target's exact law (chi-square, 100k samples)."""
  out, ok = _simulate(verify, TREES[tree], params, q_kind, rounds)
  for k, stat, dof, pvalue in _check(out, ok, params):
    print(f"{tree}/{q_kind} k={k}: chi2={stat:.1f} dof={dof} p={pvalue:.3g}")
    assert pvalue > ALPHA, (k, stat, dof, pvalue)


@pytest.mark.parametrize("q_kind", ["far", "far-topk"])
def test_reference_verifier_passes(q_kind):
  """The test's own correct reference verifier passes: the harness has no false alarm."""
  out, ok = _simulate(_reference_verify("correct"), WIDE, SamplingParams(1.0), q_kind, 1)
  (_, stat, dof, pvalue), = _check(out, ok, SamplingParams(1.0))
  print(f"reference/{q_kind}: chi2={stat:.1f} dof={dof} p={pvalue:.3g}")
  assert pvalue > ALPHA, (stat, dof, pvalue)


@pytest.mark.parametrize("mode", ["bonus_from_p", "stale_residual"])
@pytest.mark.parametrize("q_kind", ["far", "far-topk"])
def test_broken_verifier_is_rejected(mode, q_kind):
  """A wrong residual rule is caught by the same chi-square test (the test has power)."""
  out, ok = _simulate(_reference_verify(mode), WIDE, SamplingParams(1.0), q_kind, 1)
  (_, stat, dof, pvalue), = _check(out, ok, SamplingParams(1.0))
  print(f"{mode}/{q_kind}: chi2={stat:.1f} dof={dof} p={pvalue:.3g}")
  assert pvalue < 1e-8, (stat, dof, pvalue)


def test_broken_deeper_level_is_rejected():
  """A bug that leaves the first token exact (wrong p below the root) fails the 2-token test."""
  params = SamplingParams(1.0)
  out, ok = _simulate(_reference_verify("parent_p"), CHAIN, params, "close", 2)
  (_, s1, d1, p1), (_, s2, d2, p2) = _check(out, ok, params)
  print(f"parent_p: k=1 chi2={s1:.1f} dof={d1} p={p1:.3g}; k=2 chi2={s2:.1f} dof={d2} p={p2:.3g}")
  assert p2 < 1e-8, (s2, d2, p2)


# ---------------------------------------------------------------- greedy


def _random_greedy_tree(rng, m, v):
  """Random tree with distinct valid siblings; padding slots carry the matching token."""
  logits_MxV = rng.standard_normal((m, v)).astype(np.float32)
  parents_M, tokens_M = np.full(m, -1, np.int32), np.zeros(m, np.int32)
  valid_M = np.ones(m, bool)
  used = {0: set()}
  for j in range(1, m):
    pa = int(rng.choice(np.flatnonzero(valid_M[:j])))
    parents_M[j], used[j] = pa, set()
    best = int(np.argmax(logits_MxV[pa]))
    free = [t for t in range(v) if t not in used[pa]]
    if rng.random() < 0.15 or not free:
      valid_M[j], tokens_M[j] = False, best
      continue
    tokens_M[j] = best if best in free and rng.random() < 0.6 else rng.choice(free)
    used[pa].add(int(tokens_M[j]))
  return logits_MxV, tokens_M, parents_M, valid_M


def _greedy_reference(logits_MxV, tokens_M, parents_M, valid_M):
  """Longest root path whose every token is its parent's argmax; bonus = argmax at its end."""
  target_M = logits_MxV.argmax(-1)
  best = []
  for j in range(1, len(tokens_M)):
    chain, node = [], j
    while node > 0:
      chain.append(node)
      node = parents_M[node]
    chain = chain[::-1]
    good = all(valid_M[s] and tokens_M[s] == target_M[parents_M[s]] for s in chain)
    if good and len(chain) > len(best):
      best = chain
  return best, int(target_M[best[-1] if best else 0])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_k=2, top_p=0.5)])
def test_greedy_matches_reference(params):
  """T = 0: path = longest argmax-consistent root path, bonus = argmax at its end."""
  rng = np.random.default_rng(3)
  m, v, b = 12, 4, 400
  rows = [_random_greedy_tree(rng, m, v) for _ in range(b)]
  logits, tokens, parents, valid = (jnp.asarray(np.stack(x)) for x in zip(*rows))
  verdict = verify(logits, tokens, parents, valid, None, jax.random.key(0), params, m - 1)
  path, n, bonus = (np.asarray(x) for x in (verdict.path_BxD, verdict.num_accepted_B,
                                            verdict.bonus_B))
  depths = []
  for i, row in enumerate(rows):
    want_path, want_bonus = _greedy_reference(*row)
    assert n[i] == len(want_path), (i, n[i], want_path)
    assert path[i, :n[i]].tolist() == want_path, (i, path[i], want_path)
    assert bonus[i] == want_bonus, (i, bonus[i], want_bonus)
    depths.append(len(want_path))
  assert max(depths) >= 3 and min(depths) == 0  # the cases cover long and empty paths
