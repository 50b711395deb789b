import os

import jax
import pytest
from flax import nnx

from eagle_jax.model.config import tiny_config
from eagle_jax.model.transformer import Transformer
from eagle_jax.model.registry import enable_compilation_cache

jax.config.update("jax_default_matmul_precision", "highest")
# compiled programs go to $EAGLE_JAX_CACHE/xla, as the CLI's do: a program another test module or
# the other worker compiled already (same model, shapes and options) is loaded, not recompiled
enable_compilation_cache()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Each test module compiles many real-size programs; drop them afterwards (memory)."""
  yield
  import eagle_jax

  eagle_jax.clear_caches()


@pytest.fixture(scope="session")
def smollm():
  """The real default model (converted once into the eagle_jax cache)."""
  from eagle_jax.model.registry import load_model

  return load_model("smollm2-135m-instruct")


@pytest.fixture
def tiny():
  def make(seed=0, **overrides):
    return Transformer(tiny_config(**overrides), rngs=nnx.Rngs(seed))
  return make


@pytest.fixture(scope="session")
def mtbench_prompts(smollm):
  from eagle_jax.evaluation.prompts import load_mtbench

  return [smollm.tokenizer.chat_prompt(q.turns[0]) for q in load_mtbench()]


@pytest.fixture(scope="session")
def vanilla20(smollm, mtbench_prompts):
  """20 MT-bench prompts, their padded width and vanilla's greedy output (tests/lossless.py)."""
  from lossless import vanilla_greedy_20

  return vanilla_greedy_20(smollm.model, mtbench_prompts)


# The suite runs on two xdist workers, one test module per worker at a time (--dist loadscope,
# which hands each worker its first two modules in collection order). Compiling real-size
# programs is single-threaded, so a second worker keeps the second core busy; the longest modules
# go first and alternate between the workers so that no worker finishes with a long tail.
LONGEST_FIRST = ["test_train_cli.py", "test_speculative.py", "test_shipped_lossless.py",
                 "test_experiment.py", "test_eagle.py"]


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: others keep order


def pytest_report_header(config):
  return f"jax {jax.__version__} backend={jax.default_backend()} EAGLE_JAX_CACHE={os.environ.get('EAGLE_JAX_CACHE', '~/.cache/eagle_jax')}"
