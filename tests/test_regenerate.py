"""Target-regenerated replies (``eagle-jax data regenerate``): greedy replies equal ``generate``'s,
resume after a kill writes the same bytes, held-out conversations are never answered, and training
with ``data.replies: target`` builds its rows from them in a cache of its own."""

import dataclasses
import json
import os

import pytest

from eagle_jax.cli import main
from eagle_jax.configs import load_config
from eagle_jax.decoding.generate import generate
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation.bench_regenerate import bench_regenerate
from eagle_jax.pipeline.train import TrainConfig, feature_caches
from eagle_jax.training import regenerate as regen
from eagle_jax.training.features import FeatureShards
from eagle_jax.training.regenerate import RegenerateConfig, regenerate, regenerate_dataset
from eagle_jax.training.sharegpt import load_sharegpt, split_heldout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "data", "sharegpt-target-tiny.yaml")
# half the conversations held out: the first ones of the file alternate between the sides
SMALL = ["conversations=6", "heldout_fraction=0.5", "shard_size=2", "batch_size=2",
         "max_new_tokens=8", "max_prompt_len=100"]


def _config(out, *overrides):
  return load_config(RegenerateConfig, TINY, [f"out_dir={out}", *SMALL, *overrides])


def _records(folder):
  out = []
  for name in json.load(open(os.path.join(folder, "manifest.json")))["dataset"]:
    out += [json.loads(line) for line in open(os.path.join(folder, name), encoding="utf-8")]
  return out


def _shard_bytes(folder):
  names = json.load(open(os.path.join(folder, "manifest.json")))["dataset"]
  return {n: open(os.path.join(folder, n), "rb").read() for n in names}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, smollm):
  folder = str(tmp_path_factory.mktemp("regen") / "a")
  summary = regenerate(TINY, [f"out_dir={folder}", *SMALL], lm=smollm, progress=False)
  return folder, summary


def _greedy_reply(lm, messages, max_new_tokens):
  g = generate(lm.model, [lm.tokenizer.chat_prompt(messages)], max_new_tokens=max_new_tokens)
  tokens = g.tokens[0]
  stopped = bool(tokens) and tokens[-1] in lm.config.eos_token_ids
  return lm.tokenizer.decode(tokens[:-1] if stopped else tokens), len(tokens), stopped


def test_greedy_replies_are_the_targets_own(dataset, smollm):
  folder, summary = dataset
  records = _records(folder)
  assert summary["records"] == len(records) == 5 and summary["skipped"] == 1  # one prompt > 100
  assert summary["new_tokens"] == sum(r["new_tokens"] for r in records) > 0
  for r in records:
    roles = [m["role"] for m in r["messages"]]
    assert roles == ["user", "assistant"]
    text, n, stopped = _greedy_reply(smollm, r["messages"][:1], 8)
    assert (r["messages"][1]["content"], r["new_tokens"], r["stopped"]) == (text, n, stopped)


def test_heldout_conversations_are_never_answered(dataset):
  folder, _ = dataset
  convs = load_sharegpt(limit=40).conversations
  train, held = split_heldout(convs, 0.5, 0)
  ids = [r["id"] for r in _records(folder)]
  assert held and not set(ids) & {c.id for c in held}
  first = [c.id for c in train[:6]]
  assert ids == first[1:]  # in file order; the first one's prompt is over max_prompt_len
  by_id = {c.id: c for c in convs}
  for r in _records(folder):  # the user turn is ShareGPT's, unchanged
    assert r["messages"][0] == by_id[r["id"]].messages[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_killed_run_resumes_to_the_same_bytes(dataset, smollm, tmp_path, monkeypatch,
                                                temperature):
  if temperature == 0.0:
    straight = dataset[0]
  else:  # sampled: per-batch seeds follow the shard, turn and batch, not the run
    straight = str(tmp_path / "straight")
    regenerate_dataset(_config(straight, f"temperature={temperature}"), lm=smollm, progress=False)
  cfg = _config(tmp_path / "resumed", f"temperature={temperature}")
  write = regen._write_jsonl
  calls = []

  def dies_on_the_second_shard(path, records):
    calls.append(path)
    if len(calls) == 2:  # killed after the rename, before the manifest listed the shard
      open(path, "w").write("torn\n")
      raise KeyboardInterrupt
    write(path, records)

  monkeypatch.setattr(regen, "_write_jsonl", dies_on_the_second_shard)
  with pytest.raises(KeyboardInterrupt):
    regenerate_dataset(cfg, lm=smollm, progress=False)
  manifest = json.load(open(os.path.join(cfg.folder, "manifest.json")))
  assert not manifest["complete"] and list(manifest["shards"]) == ["shard_00000.jsonl"]
  with pytest.raises(EagleJaxError, match="did not finish; resume it with"):
    regen.regenerated_manifest(cfg.folder, "smollm2-135m-instruct")
  monkeypatch.setattr(regen, "_write_jsonl", write)
  summary = regenerate_dataset(cfg, lm=smollm, progress=False)
  assert summary["last_run"]["shards_kept"] == 1 and summary["last_run"]["shards_written"] == 2
  assert _shard_bytes(cfg.folder) == _shard_bytes(straight)
  again = regenerate_dataset(cfg, lm=None, progress=False)  # finished: nothing to do, no model
  assert again["last_run"]["shards_written"] == 0 and again["records"] == summary["records"]
  if temperature:
    assert _records(cfg.folder) != _records(dataset[0])  # sampled replies differ from greedy


def test_later_turns_answer_given_the_targets_own_replies(smollm, tmp_path):
  cfg = load_config(RegenerateConfig, TINY, [f"out_dir={tmp_path}", "conversations=1", "turns=2",
                                             "max_new_tokens=8", "max_prompt_len=1024"])
  regenerate_dataset(cfg, lm=smollm, progress=False)
  (r,) = _records(cfg.folder)
  original = load_sharegpt(limit=1).conversations[0]
  users = [m for m in original.messages if m["role"] == "user"]
  msgs = r["messages"]
  assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
  assert msgs[0] == users[0] and msgs[2] == users[1]
  assert msgs[1]["content"] == _greedy_reply(smollm, msgs[:1], 8)[0]
  assert msgs[3]["content"] == _greedy_reply(smollm, msgs[:3], 8)[0]  # given its own 1st reply


TRAIN = """
name: t
drafter: eagle3
runs_dir: {runs}
data: {{heldout_fraction: 0.5, train_rows: 2, heldout_rows: 1, row_len: 128, max_len: 128}}
features: {{rows_per_shard: 2, batch_rows: 2}}
"""


def test_training_rows_come_from_the_target_replies(dataset, smollm, tmp_path):
  folder, _ = dataset
  path = tmp_path / "train.yaml"
  path.write_text(TRAIN.format(runs=tmp_path / "runs"))
  target = load_config(TrainConfig, str(path),
                       ["data.replies=target", f"data.regenerated={folder}"])
  sharegpt = load_config(TrainConfig, str(path))
  dirs_t = feature_caches(target, smollm, progress=False)
  dirs_s = feature_caches(sharegpt, smollm, progress=False)
  assert dirs_t["train"] != dirs_s["train"] and "-target" in dirs_t["train"]
  assert dirs_t["heldout"] == dirs_s["heldout"]  # held-out rows: ShareGPT's, one cache
  replies = {r["messages"][0]["content"]: r["messages"][1]["content"] for r in _records(folder)}
  found = 0
  for dirs, own in ((dirs_t, True), (dirs_s, False)):
    rows = FeatureShards(dirs["train"]).rows(range(2), ("tokens", "segments"))
    for tok, seg in zip(rows["tokens"], rows["segments"]):
      for s in range(1, seg.max() + 1):
        text = smollm.tokenizer.decode(tok[seg == s], skip_special_tokens=False)
        for user, reply in replies.items():
          if user in text and own:
            assert reply + "<|im_end|>" in text
            found += 1
          elif user in text:
            assert reply + "<|im_end|>" not in text  # ShareGPT's reply, not the target's
  assert found >= 2
  # the held-out split of the training config must not hold any regenerated conversation
  other = load_config(TrainConfig, str(path), ["data.replies=target", f"data.regenerated={folder}",
                                               "data.split_seed=1"])
  with pytest.raises(EagleJaxError, match="held out under"):
    feature_caches(other, smollm, progress=False)


@pytest.mark.parametrize("override,match", [
    ("batch_size=0", "batch_size must be >= 1"),
    ("turns=0", "turns must be >= 1"),
    ("temperature=-1", "temperature must be >= 0"),
    ("top_p=0", "top_p must be in"),
    ("conversations=-1", "conversations must be >= 0"),
    ("heldout_fraction=1.5", "heldout_fraction must be in"),
    ("name=a/b", "plain folder name"),
    ("batchsize=2", "unknown key 'batchsize'"),
])
def test_bad_regenerate_configs_are_one_line_errors(override, match):
  with pytest.raises(EagleJaxError, match=match) as e:
    load_config(RegenerateConfig, TINY, [override])
  assert len(str(e.value).splitlines()) == 1 and "sharegpt-target-tiny.yaml" in str(e.value)


def test_bad_training_data_settings_are_one_line_errors(dataset, smollm, tmp_path):
  path = tmp_path / "train.yaml"
  path.write_text(TRAIN.format(runs=tmp_path / "runs"))
  for overrides, match in [(["data.replies=target"], "replies: target needs regenerated"),
                           (["data.regenerated=x"], "read only with replies: target"),
                           (["data.replies=mine"], "expected one of 'sharegpt', 'target'")]:
    with pytest.raises(EagleJaxError, match=match) as e:
      load_config(TrainConfig, str(path), overrides)
    assert len(str(e.value).splitlines()) == 1
  missing = load_config(TrainConfig, str(path), ["data.replies=target",
                                                 "data.regenerated=data/sharegpt-target-greedy-x"])
  with pytest.raises(EagleJaxError, match="no regenerated dataset there; make it with: eagle-jax "
                                          "data regenerate"):
    feature_caches(missing, smollm, progress=False)
  other = load_config(TrainConfig, str(path), ["data.replies=target",
                                               f"data.regenerated={dataset[0]}", "model=elsewhere"])
  with pytest.raises(EagleJaxError, match="holds replies of 'smollm2-135m-instruct'"):
    regen.regenerated_manifest(other.data.regenerated, other.model)
  # a folder holding a dataset made with other settings is refused, not mixed
  with pytest.raises(EagleJaxError, match="other settings \\(max_new_tokens\\)"):
    regenerate_dataset(dataclasses.replace(_config(dataset[0]), max_new_tokens=9), lm=smollm)


def test_missing_folder_names_the_config_that_makes_it(monkeypatch):
  monkeypatch.chdir(ROOT)
  with pytest.raises(EagleJaxError, match="make it with: eagle-jax data regenerate "
                                          "configs/data/sharegpt-target-tiny.yaml"):
    regen.regenerated_manifest("/nonexistent/sharegpt-target-tiny", "smollm2-135m-instruct")


def test_bench_regenerate_reports_every_batch_size():
  result = bench_regenerate(batch_sizes=(1, 2), num_prompts=2, max_new_tokens=4)
  json.dumps(result)
  rows = result["by_batch_size"]
  assert set(rows) == {"1", "2"} and rows["1"]["batches"] == 2 and rows["2"]["batches"] == 1
  assert all(r["new_tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows.values())
  assert rows["1"]["new_tokens"] == rows["2"]["new_tokens"]  # greedy: the same replies
  assert result["settings"]["num_prompts"] == 2 and "jax_backend" in result["settings"]


def test_cli_verbs_print_json(dataset, capsys):
  folder, summary = dataset
  assert main(["data", "regenerate", TINY, f"out_dir={folder}", *SMALL]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["records"] == summary["records"] and out["last_run"]["shards_written"] == 0
  assert main(["data", "regenerate", TINY, "batch_size=0"]) == 2
  assert "batch_size must be >= 1" in capsys.readouterr().err


def test_replies_holding_unicode_line_separators_read_back_whole(tmp_path):
  # json.dumps(ensure_ascii=False) writes U+2028 / U+2029 / U+0085 raw: they are not line ends
  reply = "one\u2028two\u2029three\x85four"
  records = [{"id": f"c{i}", "messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": reply + str(i)}]}
             for i in range(2)]
  (tmp_path / "shard_00000.jsonl").write_text(
      "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
  out = regen.read_regenerated(str(tmp_path), {"dataset": ["shard_00000.jsonl"]})
  assert [c.messages[1]["content"] for c in out] == [reply + "0", reply + "1"]
