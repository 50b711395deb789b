"""Device meshes: parsing, the partition rules' fallbacks, the fused row orders they rely on, and
decoding over 8 forced CPU devices equal to one device (in a subprocess: the device count is
fixed when JAX starts)."""

import json
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from eagle_jax import parallel
from eagle_jax.drafters.eagle.head import EagleHead, EagleHeadConfig
from eagle_jax.drafters.storage import load_params, save_params
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.checkpoints import read_safetensors, write_safetensors
from eagle_jax.model.transformer import gate_up_rows, qkv_rows, unfuse_rows


def test_mesh_specs_parse_and_bad_ones_are_one_line_errors():
  assert parallel.parse_mesh("data=2,tensor=4") == parallel.MeshSpec(data=2, tensor=4)
  assert parallel.parse_mesh({"fsdp": 8}) == parallel.MeshSpec(fsdp=8)
  assert parallel.parse_mesh(None) is None and parallel.parse_mesh("") is None
  for bad, words in [("data=0", "positive"), ("pipe=2", "unknown"), ("data=2,data=2", "twice"),
                     ("data", "axis=size"), ("tensor=x", "integer"), ("fsdp=1.5", "integer")]:
    with pytest.raises(EagleJaxError, match=words):
      parallel.parse_mesh(bad)
  with pytest.raises(EagleJaxError, match="spans 8 devices, but JAX sees 1"):
    parallel.make_mesh("fsdp=2,tensor=4")
  assert parallel.make_mesh(None) is None


def test_partition_rules_shard_whole_units_and_replicate_the_rest(capsys):
  mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 2, "tensor": 4})
  spec = lambda name, shape, units=None: parallel.partition(
      name, shape, parallel.param_axes(name, len(shape)), mesh, units)
  assert spec("embed", (49152, 576)) == P("tensor", "fsdp")
  assert spec("lm_head.weight", (49152, 576)) == P("tensor", "fsdp")
  assert spec("layers.0.mlp.gate_up.weight", (3072, 576), (1536, None)) == P("tensor", "fsdp")
  assert spec("layers.0.mlp.down.weight", (576, 1536)) == P("fsdp", "tensor")
  # 8 kv heads split over 4, 3 kv heads cannot be (the default target): replicated over tensor
  assert spec("layers.0.attn.qkv.weight", (1536, 576), (8, None)) == P("tensor", "fsdp")
  assert spec("layers.3.attn.qkv.weight", (960, 576), (3, None)) == P(None, "fsdp")
  assert spec("layers.7.attn.qkv.weight", (960, 576), (3, None)) == P(None, "fsdp")
  assert parallel.param_axes("layers.0.input_norm.weight", 1) is None
  # the batch over data where it divides
  assert parallel.partition("x", (3, 5), ("batch", None), mesh) == P(None, None)
  assert parallel.partition("x", (4, 5), ("batch", None), mesh) == P("data", None)
  notes = capsys.readouterr().err
  assert notes.count("layers.*.attn.qkv.weight: tensor=4 does not divide the 3 units") == 1


def test_fused_rows_group_heads_and_pair_gate_with_up():
  h, k, dh = 6, 2, 2
  rows = qkv_rows(h, k, dh)
  # kv head 0's group: query heads 0-2 (rows 0-5), key 0 (rows 12-13), value 0 (rows 16-17)
  assert rows[:10].tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 16, 17]
  stacked = np.arange(len(rows) * 3).reshape(len(rows), 3)
  assert (unfuse_rows(stacked[rows], rows) == stacked).all()
  assert gate_up_rows(3).tolist() == [0, 3, 1, 4, 2, 5]


def test_params_saved_with_stacked_rows_load_into_the_fused_order(tiny, tmp_path):
  head = EagleHead(EagleHeadConfig(1, tiny().config), rngs=nnx.Rngs(3))
  save_params(head, str(tmp_path))
  path = str(tmp_path / "params.safetensors")
  tensors = read_safetensors(str(tmp_path), [path])
  attn, mlp = head.layer.attn, head.layer.mlp
  tensors["layer.attn.qkv.weight"] = unfuse_rows(
      tensors["layer.attn.qkv.weight"], qkv_rows(attn.num_heads, attn.num_kv_heads, attn.head_dim))
  tensors["layer.mlp.gate_up.weight"] = unfuse_rows(
      tensors["layer.mlp.gate_up.weight"], gate_up_rows(mlp.down.weight.shape[1]))
  write_safetensors(tensors, path)  # no fused_rows metadata: q, k, v (gate, up) stacked
  loaded = load_params(nnx.eval_shape(lambda: EagleHead(head.config, rngs=nnx.Rngs(0))), str(tmp_path))
  for a, b in zip(nnx.to_flat_state(nnx.state(head)), nnx.to_flat_state(nnx.state(loaded))):
    np.testing.assert_array_equal(np.asarray(a[1][...]), np.asarray(b[1][...]), err_msg=str(a[0]))


_MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from flax import nnx
    sys.path.insert(0, "tests")
    from test_eagle import PROMPTS, TREES, make_head
    from eagle_jax import parallel
    from eagle_jax.decoding import generate as gen_module
    from eagle_jax.decoding.generate import generate
    from eagle_jax.decoding.speculative import speculative_generate
    from eagle_jax.drafters.eagle.drafter import EagleDrafter
    from eagle_jax.model.config import tiny_config
    from eagle_jax.model.transformer import Transformer, shard

    def decode(mesh):
      target = Transformer(tiny_config(), rngs=nnx.Rngs(0))
      shard(target, mesh)
      out = {}
      with parallel.use_mesh(mesh):
        out["vanilla"] = generate(target, PROMPTS, max_new_tokens=24).tokens
      for version, tree in ((1, "static25"), (3, "dynamic")):
        head = make_head(target.config, version, draft_vocab=96 if version == 3 else 0)
        drafter, dparams = EagleDrafter.create(head, target, TREES[tree][0], **TREES[tree][1])
        dparams = shard(dparams, mesh)
        with parallel.use_mesh(mesh):
          g = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=24)
        out[f"eagle{version}"] = g.tokens
      sizes = parallel.param_bytes(nnx.state(target, nnx.Param))
      return out, sizes["per_device"] / sizes["total"]

    single, _ = decode(None)
    report = {}
    for spec in ("fsdp=2,tensor=4",):  # data=2,fsdp=2,tensor=2: the two-process test
      tokens, share = decode(parallel.make_mesh(spec))
      report[spec] = {"equal": {k: tokens[k] == single[k] for k in single}, "share": share}
    texts = [c.as_text() for key, c in gen_module._COMPILED.items() if key[-1] is not None]
    report["programs"] = len(texts)
    report["custom_calls"] = sum("eagle_jax_" in t for t in texts)
    report["single_custom_calls"] = sum("eagle_jax_" in c.as_text()
                                        for key, c in gen_module._COMPILED.items() if key[-1] is None)
    print(json.dumps(report))
    """)


def test_decoding_over_a_mesh_of_8_devices_equals_one_device():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], cwd=root, env=env, capture_output=True,
                       text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert all(report["fsdp=2,tensor=4"]["equal"].values()), report
  # the tiny target's 2 kv heads stay whole over tensor=4, the rest splits 8 ways
  assert report["fsdp=2,tensor=4"]["share"] < 0.3
  # prefill and loop programs, none calling a single-device CPU kernel (the same programs on
  # one device do call them)
  assert report["programs"] >= 3 and report["custom_calls"] == 0 and report["single_custom_calls"] > 0


_TRAIN_SCRIPT = textwrap.dedent("""
    import json, os, shutil, subprocess, sys
    import numpy as np
    from flax import nnx
    sys.path.insert(0, "tests")
    import tiny_training as tt
    from eagle_jax import parallel
    from eagle_jax.training.trainer import read_metrics

    root = sys.argv[1]
    tt.make_features(os.path.join(root, "features"))
    meshes = {"1": None, "8": parallel.make_mesh("data=2,fsdp=4")}

    def run(name, mesh):
      return tt.run(os.path.join(root, "features"), os.path.join(root, name), 3, meshes[mesh])

    def params(result):
      return {".".join(map(str, p)): np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(nnx.state(result.module, nnx.Param))}

    def killed(name):
      # the same run in a process killed (SIGKILL) after step 5, past its checkpoint of step 3
      out = subprocess.run([sys.executable, "tests/tiny_training.py", os.path.join(root, "features"),
                            os.path.join(root, name), "data=2,fsdp=4"],
                           env=dict(os.environ, EAGLE_JAX_FAULT_AT_STEP="5"))
      assert out.returncode == -9, out.returncode
      ckpts = os.path.join(root, name, "checkpoints")
      return max(int(s) for s in os.listdir(ckpts) if s.isdigit())

    def cut(name):
      # the latest checkpoint gone: the next run resumes from the one before it
      ckpts = os.path.join(root, name, "checkpoints")
      steps = sorted(int(s) for s in os.listdir(ckpts) if s.isdigit())
      shutil.rmtree(os.path.join(ckpts, str(steps[-1])))
      return steps[-2]

    report = {}
    whole = {m: run("whole" + m, m) for m in meshes}
    losses = {m: [r["loss"] for r in read_metrics(os.path.join(root, "whole" + m))] for m in meshes}
    report["steps"] = len(losses["1"])
    report["loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(losses["1"], losses["8"]))
    qkv = whole["8"].module.attn.qkv.weight.get_value()
    report["sharded"] = str(qkv.sharding.spec)
    for first, then in (("8", "8"), ("8", "1"), ("1", "8")):
      name = f"resume{first}to{then}"
      if first == then:
        at = killed(name)
      else:
        shutil.copytree(os.path.join(root, "whole" + first), os.path.join(root, name))
        at = cut(name)
      resumed = run(name, then)
      diff = max(float(np.max(np.abs(a - b))) for a, b in
                 zip(params(resumed).values(), params(whole[then]).values()))
      report[name] = {"resumed_from": resumed.resumed_from, "cut_at": at, "max_abs_diff": diff}
    print(json.dumps(report))
    """)


def test_training_over_a_mesh_matches_one_device_and_resumes_across_meshes(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", _TRAIN_SCRIPT, str(tmp_path)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  # data=2 x fsdp=4: the same losses at every logged step as one device
  assert report["steps"] > 10 and report["loss_rel_diff"] < 1e-3, report
  assert "fsdp" in report["sharded"], report
  # a run killed by SIGKILL resumes bit-exact on its own mesh, and onto another mesh (8 -> 1, 1 -> 8) it
  # ends where an uninterrupted run on that mesh ends
  assert report["resume8to8"]["resumed_from"] == report["resume8to8"]["cut_at"]
  assert report["resume8to8"]["max_abs_diff"] == 0.0, report
  for name in ("resume8to1", "resume1to8"):
    assert report[name]["resumed_from"] == report[name]["cut_at"], report
    assert report[name]["max_abs_diff"] < 1e-4, report


_PROCESS_SCRIPT = textwrap.dedent("""
    import hashlib, json, os, sys
    who, root = sys.argv[1], sys.argv[2]
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count="
                               + ("8" if who == "single" else "4"))
    from eagle_jax import parallel
    assert parallel.initialize_distributed() == (who != "single")
    import jax
    import numpy as np
    from flax import nnx
    sys.path.insert(0, "tests")
    import tiny_training as tt
    from test_eagle import PROMPTS, TREES, make_head
    from eagle_jax.decoding.generate import generate
    from eagle_jax.decoding.speculative import speculative_generate
    from eagle_jax.drafters.eagle.drafter import EagleDrafter
    from eagle_jax.model.config import tiny_config
    from eagle_jax.model.transformer import Transformer, shard
    from eagle_jax.training.features import FeatureShards
    from eagle_jax.training.trainer import OptimConfig, read_metrics, train

    mesh = parallel.make_mesh("data=2,fsdp=2,tensor=2")
    target = Transformer(tiny_config(), rngs=nnx.Rngs(0))
    shard(target, mesh)
    head = make_head(target.config, 1)
    drafter, dparams = EagleDrafter.create(head, target, TREES["static25"][0])
    dparams = shard(dparams, mesh)
    with parallel.use_mesh(mesh):
      vanilla = generate(target, PROMPTS, max_new_tokens=20).tokens
      eagle = speculative_generate(target, drafter, dparams, PROMPTS, max_new_tokens=20).tokens
    features = os.path.join(root, "features")
    tt.make_features(features)
    data = FeatureShards(features)
    run_dir = os.path.join(root, "run-" + ("single" if who == "single" else "multi"))
    result = train(tt.task(3), data, data, run_dir, tt.LOOP, OptimConfig(lr=1e-2, warmup_steps=2),
                   progress=False, mesh=mesh)
    digest = hashlib.sha256()
    for path, v in sorted(nnx.to_flat_state(nnx.state(result.module, nnx.Param)), key=lambda x: str(x[0])):
      digest.update(parallel.to_host(v.get_value()).astype(np.float32).round(5).tobytes())
    # the experiment runner: batches of 2 rows over data=2 (each process decodes its row), into
    # a results folder of each process's own: process 0 alone reads and writes it
    from eagle_jax.evaluation.runner import EvalConfig, ExperimentConfig, MethodConfig, run_config
    results = os.path.join(root, "results-" + who)
    cfg = ExperimentConfig(
        name="x", model=os.path.join(root, "..", "model"), results_dir=results, mesh=parallel.spec_of(mesh),
        methods=(MethodConfig(name="vanilla"), MethodConfig(name="skip1", drafter="self-draft",
                                                            self_draft_layers=1, gamma=2)),
        eval=EvalConfig(prompts=os.path.join(root, "..", "prompts.jsonl"), temperatures=(0.0,),
                        batch_size=2, max_new_tokens=6, stop_at_eos=False))
    summary, units, _ = run_config(cfg, progress=False)
    again = run_config(cfg, progress=False)[1]  # every unit cached: process 0's records, shared
    runner = {"tokens": {m: [r["token_ids"] for r in units[(m, 0.0)]] for m in ("vanilla", "skip1")},
              "tau": summary["methods"]["skip1"]["T0.0"]["tau"],
              "mismatches": summary["methods"]["skip1"]["T0.0"]["greedy_mismatches"],
              "again": {m: [(r["token_ids"], r["seconds"], r["session"]) for r in again[(m, 0.0)]]
                        for m in ("vanilla", "skip1")},
              "wrote": sorted(os.listdir(os.path.join(results, "x"))) if os.path.isdir(results) else []}
    report = {"processes": jax.process_count(), "devices": jax.device_count(), "vanilla": vanilla,
              "eagle": eagle, "params": digest.hexdigest(), "runner": runner,
              "train_tokens": result.tokens}
    if parallel.is_writer():
      report["losses"] = [r["loss"] for r in read_metrics(run_dir)]
    print(json.dumps(report))
    """)


def test_two_processes_of_4_devices_equal_one_process_of_8(tmp_path):
  import socket

  from eagle_jax.model.checkpoints import save_hf_folder
  from eagle_jax.model.config import tiny_config
  from eagle_jax.model.registry import DEFAULT_MODEL, resolve
  from eagle_jax.model.transformer import Transformer

  # a tiny random target with the default target's tokenizer, and four prompts, for the runner
  save_hf_folder(Transformer(tiny_config(vocab_size=49152), rngs=nnx.Rngs(0)), str(tmp_path / "model"),
                 resolve(DEFAULT_MODEL))
  (tmp_path / "prompts.jsonl").write_text("".join(
      json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(
          ["Name three rivers.", "What is 12 times 9?", "Write a haiku about rain.",
           "Why is the sky blue?"])))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda args, env: subprocess.Popen([sys.executable, "-c", _PROCESS_SCRIPT, *args], cwd=root,
                                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True)
  base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = [run([str(i), str(tmp_path / "multi")],
               dict(base, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                    JAX_PROCESS_ID=str(i))) for i in range(2)]
  outs = [p.communicate(timeout=900) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  single = run(["single", str(tmp_path / "single")], base)
  out, err = single.communicate(timeout=900)
  assert single.returncode == 0, err[-3000:]
  reports = lambda text: [json.loads(l) for l in text.splitlines() if l.startswith("{")]
  (multi,), (other,), (one,) = reports(outs[0][0]), reports(outs[1][0]), reports(out)
  assert "losses" not in other  # process 0 alone writes the metrics
  assert (multi["processes"], multi["devices"], one["processes"], one["devices"]) == (2, 8, 1, 8)
  assert multi["vanilla"] == one["vanilla"] and multi["eagle"] == one["eagle"]
  assert len(multi["losses"]) == len(one["losses"]) > 10
  np.testing.assert_allclose(multi["losses"], one["losses"], rtol=1e-5)
  assert multi["params"] == one["params"]
  # every process counts the whole batch's tokens (each holds only its own rows)
  assert multi["train_tokens"] == other["train_tokens"] == one["train_tokens"] > 0
  # the runner: both processes hold every row's tokens, equal to one process's; process 0
  # wrote the results (process 1 nothing, though it sees no file of process 0's), and a
  # re-run reuses them on both
  for proc in (multi, other):
    assert proc["runner"]["tokens"] == one["runner"]["tokens"]
    assert proc["runner"]["tau"] == one["runner"]["tau"]
    assert [t for t, _, _ in proc["runner"]["again"]["skip1"]] == one["runner"]["tokens"]["skip1"]
  assert multi["runner"]["again"] == other["runner"]["again"]  # process 0's timings, on both
  assert len(one["runner"]["tokens"]["vanilla"]) == 4 and multi["runner"]["mismatches"] == 0
  assert multi["runner"]["wrote"] == one["runner"]["wrote"] and "summary.json" in one["runner"]["wrote"]
  assert other["runner"]["wrote"] == []
