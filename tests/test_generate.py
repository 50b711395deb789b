import sys

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.errors import EagleJaxError
from eagle_jax.decoding.generate import generate
from eagle_jax.decoding.sampling import SamplingParams


def _teacher_forced_argmax(model, prompt, new):
  seq = jnp.asarray([list(prompt) + list(new)])
  logits = model(seq, jnp.arange(seq.shape[1])[None]).logits_BxTxV[0]
  return np.asarray(jnp.argmax(logits[len(prompt) - 1:-1], -1)).tolist()


def test_greedy_equals_teacher_forced_tiny(tiny):
  model = tiny()
  prompt = [3, 17, 42, 5, 9]
  gen = generate(model, [prompt], max_new_tokens=20, stop_ids=())
  assert gen.num_new == [20]
  assert gen.tokens[0] == _teacher_forced_argmax(model, prompt, gen.tokens[0])


def test_ragged_batch_equals_alone_tiny(tiny):
  model = tiny()
  prompts = [[3, 4], [5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
  batch = generate(model, prompts, max_new_tokens=12, stop_ids=())
  for p, toks in zip(prompts, batch.tokens):
    assert generate(model, [p], max_new_tokens=12, stop_ids=()).tokens[0] == toks


def test_chunked_prefill_equals_one_pass(tiny, monkeypatch):
  """Prompts wider than the chunk run chunk by chunk (stopping after the longest row): same
  logits, cache, lengths and hidden states at every real position as one pass over all."""
  gen = sys.modules["eagle_jax.decoding.generate"]
  model = tiny()
  lengths = np.array([5, 19, 11])
  tokens = np.zeros((3, 40), np.int32)  # a width that is not a multiple of the chunk
  for i, n in enumerate(lengths):
    tokens[i, :n] = np.random.RandomState(i).randint(1, model.config.vocab_size, n)
  run = lambda: gen.prefill(model, jnp.asarray(tokens), jnp.asarray(lengths),
                            gen.KVCache.init(model.config, 3, 64), return_layers=(0, 2))
  whole, whole_logits = run()
  monkeypatch.setattr(gen, "PREFILL_CHUNK", 8)
  chunked, chunked_logits = run()
  np.testing.assert_allclose(chunked_logits, whole_logits, atol=1e-5)
  assert chunked.cache.lengths_B.tolist() == lengths.tolist() == whole.cache.lengths_B.tolist()
  assert chunked.hidden_BxTxD.shape == whole.hidden_BxTxD.shape
  for i, n in enumerate(lengths):
    for a, b in [(chunked.hidden_BxTxD, whole.hidden_BxTxD), *zip(chunked.layer_hiddens, whole.layer_hiddens)]:
      np.testing.assert_allclose(a[i, :n], b[i, :n], atol=1e-5)
    for a, b in [*zip(chunked.cache.k, whole.cache.k), *zip(chunked.cache.v, whole.cache.v)]:
      np.testing.assert_allclose(a[i, :, :n], b[i, :, :n], atol=1e-5)  # [B, K, S, Dh]


def test_stop_token_ends_row_and_is_kept(tiny):
  model = tiny()
  free = generate(model, [[3, 4, 5]], max_new_tokens=10, stop_ids=()).tokens[0]
  stop = free[3]
  first = free.index(stop)
  gen = generate(model, [[3, 4, 5], [3, 4, 5]], max_new_tokens=10, stop_ids=(stop,))
  assert gen.tokens[0] == free[:first + 1] and gen.num_new == [first + 1] * 2


def test_stop_sets_share_one_compiled_program(tiny):
  """Stop ids are a traced argument: changing them (up to four) compiles nothing new."""
  compiled = sys.modules["eagle_jax.decoding.generate"]._COMPILED  # the module, not the function
  model = tiny()
  free = generate(model, [[3, 4, 5]], max_new_tokens=10, stop_ids=())
  before = len(compiled)
  for stop in [(free.tokens[0][2],), (1, 2, 3, 4), ()]:
    gen = generate(model, [[3, 4, 5]], max_new_tokens=10, stop_ids=stop)
    hit = [i for i, t in enumerate(free.tokens[0]) if t in stop]
    assert gen.tokens[0] == free.tokens[0][:hit[0] + 1 if hit else 10]
  assert len(compiled) == before
  many = generate(model, [[3, 4, 5]], max_new_tokens=10, stop_ids=(90, 91, 92, 93, free.tokens[0][4]))
  assert many.tokens[0] == free.tokens[0][:free.tokens[0].index(free.tokens[0][4]) + 1]


def test_decode_loop_updates_cache_in_place(tiny):
  """The compiled token loop writes each step's K/V into the cache without copying a layer's
  cache inside the loop (read of the old cache ordered before the in-place write)."""
  import re

  import jax
  from flax import nnx

  gen = sys.modules["eagle_jax.decoding.generate"]
  model = tiny()
  tokens, lengths, cache_len, stop = gen.prepare_prompts(model, [[3, 4, 5], [6, 7]], 8, None, (), 0)
  graphdef, state = nnx.split(model)
  (cache, _, logits), _, _ = gen.run_prefill(graphdef, state, tokens, lengths, cache_len)
  hlo = gen._generate_jit.lower(state, cache, logits, jax.random.key(0), jnp.asarray(stop),
                                graphdef=graphdef, max_new_tokens=8, params=SamplingParams(),
                                pad_id=0).compile().as_text()
  shape = "f32[%s]" % ",".join(map(str, cache.k[0].shape))
  loop_bodies = [c for c in re.split(r"\n(?=\S)", hlo) if not c.startswith("ENTRY")]
  copies = sum(len(re.findall(re.escape(shape) + r"\{[^}]*\} copy\(", c)) for c in loop_bodies)
  assert shape in hlo and copies == 0


def test_sampling_seeded_and_top_k_one_is_greedy(tiny):
  model = tiny()
  p = [[3, 4, 5]]
  hot = SamplingParams(temperature=1.0)
  a = generate(model, p, max_new_tokens=16, params=hot, seed=1, stop_ids=()).tokens
  b = generate(model, p, max_new_tokens=16, params=hot, seed=1, stop_ids=()).tokens
  c = generate(model, p, max_new_tokens=16, params=hot, seed=2, stop_ids=()).tokens
  assert a == b and a != c
  greedy = generate(model, p, max_new_tokens=16, stop_ids=()).tokens
  top1 = generate(model, p, max_new_tokens=16, params=SamplingParams(1.0, top_k=1), seed=3, stop_ids=())
  assert top1.tokens == greedy


def test_prompt_longer_than_cache(tiny):
  with pytest.raises(EagleJaxError, match="cache length 16"):
    generate(tiny(), [list(range(10))], max_new_tokens=8, max_cache_len=16)


def test_cache_longer_than_the_models_context_is_refused(tiny):
  model = tiny(max_position_embeddings=32)  # e.g. a sliding window capped the context
  with pytest.raises(EagleJaxError, match="cache length 128 exceeds the model's context of 32"):
    generate(model, [list(range(10))], max_new_tokens=8, max_cache_len=128)
  generate(model, [list(range(10))], max_new_tokens=8, max_cache_len=32)


def test_empty_prompt(tiny):
  with pytest.raises(EagleJaxError, match="empty prompt"):
    generate(tiny(), [[]], max_new_tokens=4)


@pytest.mark.slow
def test_real_model_greedy_consistency_and_ragged(smollm, mtbench_prompts):
  """Greedy decode == argmax of a teacher-forced forward; ragged batch rows == alone."""
  prompts = [mtbench_prompts[i] for i in (0, 10, 20)]
  batch = generate(smollm.model, prompts, max_new_tokens=24, stop_ids=())
  for p, toks in zip(prompts, batch.tokens):
    assert toks == _teacher_forced_argmax(smollm.model, p, toks)
    assert generate(smollm.model, [p], max_new_tokens=24, stop_ids=()).tokens[0] == toks
