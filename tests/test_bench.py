"""``eagle-jax bench decode``: its JSON holds what the foundation issue asks for, consistently."""

import json

import jax
import pytest

from eagle_jax import kernels
from eagle_jax.evaluation.bench_decode import _peak
from eagle_jax.cli import main


def test_peak_takes_each_keys_highest_reading():
  a = {"numpy_matvec_gbs": 20.0, "jax_matvec_gbs": 31.0, "bandwidth_gbs": 31.0}
  b = {"numpy_matvec_gbs": 25.0, "jax_matvec_gbs": 12.0, "bandwidth_gbs": 25.0}
  assert _peak([a, b]) == {"numpy_matvec_gbs": 25.0, "jax_matvec_gbs": 31.0, "bandwidth_gbs": 31.0}


def test_bench_decode_json_floor_and_transformers_agree(smollm, capsys):
  pytest.importorskip("torch")
  assert main(["bench", "decode", "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "1",
               "--json"]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  for key in ("eagle_jax_tok_s", "hf_tok_s", "ms_per_token", "floor_ms_per_token", "settings"):
    assert key in out
  assert out["greedy_tokens_match_hf"] == [True]  # same 8 greedy tokens as transformers
  assert out["bandwidth_gbs"] == max(out["numpy_matvec_gbs"], out["jax_matvec_gbs"]) > 0
  floor = 1000 * out["weight_bytes_per_step"] / (out["bandwidth_gbs"] * 1e9)
  assert out["floor_ms_per_token"] == pytest.approx(floor, abs=0.01)
  assert out["ratio_to_floor"] == pytest.approx(out["ms_per_token"] / floor, rel=0.01, abs=0.01)
  # where the CPU kernel is built, a step reads the GGUF's 4/8-bit blocks (115 MB), not the
  # 538 MB of float32 weights
  blocks = kernels.available() and jax.default_backend() == "cpu"
  assert (100e6 < out["weight_bytes_per_step"] < 130e6) if blocks else out["weight_bytes_per_step"] > 500e6
  assert out["settings"]["max_new_tokens"] == 8 and out["settings"]["repeats"] == 1
  # one reading beside the prompt's runs and one after them; the floor takes the highest
  assert len(out["bandwidth_readings_gbs"]) == 2
  assert max(out["bandwidth_readings_gbs"]) == out["bandwidth_gbs"]
  if blocks:  # the step split by the time inside the CPU kernels
    inside = out["kernel_ms_per_token"]
    assert set(inside) == set(kernels.KERNELS) and inside["block_products"] > 0
    assert out["outside_kernels_ms_per_token"] == pytest.approx(
        out["ms_per_token"] - sum(inside.values()), abs=0.01)
    products = inside["float_products"] + inside["block_products"]
    assert out["products_ratio_to_floor"] == pytest.approx(products / floor, rel=0.01, abs=0.01)
    # nearly every byte a step reads is a block (the rest: norm weights)
    assert out["block_products_gbs"] == pytest.approx(
        out["weight_bytes_per_step"] / (inside["block_products"] * 1e6), rel=0.01)
