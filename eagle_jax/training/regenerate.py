"""``eagle-jax data regenerate CONFIG``: ShareGPT conversations answered by the target itself.

EAGLE heads trained on ShareGPT's own assistant replies learn to continue text the target did
not write; at test time they draft for the target's replies. EAGLE-3 therefore regenerates the
replies with the target: each kept user turn of a training-split conversation is answered by the
target, a later user turn given the target's own earlier replies. :func:`regenerate` does that
for a :class:`RegenerateConfig` and writes a dataset folder that training reads with
``data.replies: target`` (:func:`read_regenerated`).

The folder (default ``data/<name>/``) holds ``shard_XXXXX.jsonl`` files, one per
``shard_size`` selected conversations (shard ``k`` answers selected conversations
``[k * shard_size, (k + 1) * shard_size)``), each a line per kept conversation::

  {"id": ..., "messages": [{"role": "user", ...}, {"role": "assistant", "content": <reply>}, ...],
   "new_tokens": n, "stopped": true}

(``new_tokens`` counts every reply's tokens, its stop token included; ``stopped``: every reply
ended with EOS rather than at ``max_new_tokens``), and ``manifest.json`` (the config, per-shard
and total counts, seconds and tokens/s). A shard is written to a temporary file and renamed,
then listed in the manifest; a killed run keeps the listed shards and answers only the missing
ones. Within a shard the prompts of one turn are sorted by length and decoded in batches of
``batch_size`` (:func:`batches_by_length`), so a shard's content depends only on the config and
its conversations: a resumed run writes the same bytes as an uninterrupted one. With sampling
(``temperature > 0``), ``generate`` takes one seed per batch; batch ``b`` of turn ``t`` in shard
``k`` uses the seed :func:`batch_seed` derives from (``seed``, ``k``, ``t``, ``b``), which a
resumed run derives alike.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import re
import sys
import time
from typing import Sequence

from tqdm import tqdm

from eagle_jax.configs import load_config, to_dict
from eagle_jax.decoding.generate import BUCKET, Generation, generate
from eagle_jax.decoding.sampling import SamplingParams
from eagle_jax.errors import EagleJaxError
from eagle_jax.model.registry import DEFAULT_MODEL, load_model
from eagle_jax.training.settings import DataConfig
from eagle_jax.training.sharegpt import Conversation, load_sharegpt, split_heldout

DATA_DIR = "data"
CONFIG_DIR = os.path.join("configs", "data")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# what a shard's content does not depend on (``conversations`` only decides how many shards)
_NOT_CONTENT = ("name", "out_dir", "conversations")


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
  """A regenerated dataset: which training-split conversations, answered how."""

  name: str
  model: str = DEFAULT_MODEL
  out_dir: str = ""  # "" = data/<name>
  conversations: int = 0  # the first N training-split conversations, in file order (0 = all)
  # the training split, as in the training config: its held-out conversations are never answered
  heldout_fraction: float = DataConfig.heldout_fraction
  split_seed: int = DataConfig.split_seed
  turns: int = 1  # user turns kept per conversation (each later one sees the target's replies)
  # prompt tokens: a longer first-turn prompt skips the conversation, a later one ends it there
  max_prompt_len: int = 1024
  max_new_tokens: int = 256  # per reply; EOS stops a reply earlier
  temperature: float = 0.0  # 0 = greedy
  top_p: float = 1.0  # with temperature > 0
  seed: int = 0  # sampling: per-batch seeds derive from it (batch_seed)
  batch_size: int = 16
  shard_size: int = 64  # conversations per JSONL shard

  def validate(self):
    if not _NAME.match(self.name):
      raise EagleJaxError(f"name must be a plain folder name (letters, digits, . _ -), got "
                          f"{self.name!r}")
    if not 0 < self.heldout_fraction < 1:
      raise EagleJaxError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
    for key in ("turns", "max_prompt_len", "max_new_tokens", "batch_size", "shard_size"):
      if getattr(self, key) < 1:
        raise EagleJaxError(f"{key} must be >= 1, got {getattr(self, key)}")
    if self.conversations < 0:
      raise EagleJaxError(f"conversations must be >= 0 (0 = all), got {self.conversations}")
    SamplingParams(self.temperature, self.top_p)  # temperature >= 0, top_p in (0, 1]

  @property
  def folder(self) -> str:
    return self.out_dir or os.path.join(DATA_DIR, self.name)

  def content_key(self) -> str:
    """Digest of the settings a shard's content depends on."""
    d = {k: v for k, v in to_dict(self).items() if k not in _NOT_CONTENT}
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


@dataclasses.dataclass
class Reply:
  tokens: list[int]  # new tokens, the stop token included
  stopped: bool  # ended with a stop token (else cut at max_new_tokens)


def training_conversations(count: int, heldout_fraction: float,
                           split_seed: int) -> list[Conversation]:
  """The first ``count`` training-split ShareGPT conversations in file order (0 = all).

  The split depends on each id alone (:func:`split_heldout`), so a partial read gives the same
  first conversations as the whole file; reading stops once enough are found."""
  if count == 0:
    return split_heldout(load_sharegpt().conversations, heldout_fraction, split_seed)[0]
  limit = int(count / (1 - heldout_fraction)) + 16
  while True:
    sg = load_sharegpt(limit=limit)
    train = split_heldout(sg.conversations, heldout_fraction, split_seed)[0]
    if len(train) >= count or not sg.limited:
      return train[:count]
    limit *= 2


def batches_by_length(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
  """Indices sorted by length (ties: by index), cut into batches: little padding per batch."""
  order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
  return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def batch_seed(seed: int, shard: int, turn: int, batch: int) -> int:
  """The sampling seed of one batch: a hash of (seed, shard, turn, batch index)."""
  digest = hashlib.sha256(f"{seed}\x00{shard}\x00{turn}\x00{batch}".encode()).digest()
  return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def batch_shape(rows: int, batch_size: int, longest: int) -> tuple[int, int]:
  """A batch's compiled shape: rows up to a power of two (at most ``batch_size``), prompt width
  up to a power-of-two multiple of BUCKET; a handful of shapes serves every batch."""
  width = BUCKET
  while width < longest:
    width *= 2
  return min(1 << (rows - 1).bit_length(), batch_size), width


def generate_batch(lm, prompts: Sequence[Sequence[int]], *, batch_size: int, max_new_tokens: int,
                   params: SamplingParams, seed: int) -> tuple[list[Reply], Generation]:
  """Answers up to ``batch_size`` prompts in one :func:`generate` call (stopping at EOS); the
  batch is padded with copies of its last prompt to its compiled shape (dropped after)."""
  rows, width = batch_shape(len(prompts), batch_size, max(len(p) for p in prompts))
  padded = list(prompts) + [prompts[-1]] * (rows - len(prompts))
  g = generate(lm.model, padded, max_new_tokens=max_new_tokens, params=params, seed=seed,
               prompt_width=width)
  stop = set(lm.config.eos_token_ids)
  replies = [Reply(t, bool(t) and t[-1] in stop) for t in g.tokens[:len(prompts)]]
  return replies, g


@dataclasses.dataclass
class _Chat:
  """One conversation being answered: its messages so far and the user turns still to answer."""

  id: str
  messages: list[dict[str, str]]
  users: list[str]
  new_tokens: int = 0
  stopped: bool = True
  open: bool = True

  def record(self) -> dict:
    return {"id": self.id, "messages": self.messages, "new_tokens": self.new_tokens,
            "stopped": self.stopped}


def _answer_shard(lm, cfg: RegenerateConfig, convs: Sequence[Conversation], shard: int, bar,
                  totals: dict) -> tuple[list[dict], dict]:
  """The records of one shard (conversations in order) and its counts."""
  params = SamplingParams(cfg.temperature, cfg.top_p)
  chats = [_Chat(c.id, [dict(m) for m in c.messages[:1] if m["role"] == "system"],
                 [m["content"] for m in c.messages if m["role"] == "user"][:cfg.turns])
           for c in convs]
  info = {"replies": 0, "new_tokens": 0, "stopped": 0, "generate_seconds": 0.0}
  for turn in range(cfg.turns):
    todo, prompts = [], []
    for chat in chats:
      if not chat.open or turn >= len(chat.users):
        continue
      user = {"role": "user", "content": chat.users[turn]}
      prompt = lm.tokenizer.chat_prompt(chat.messages + [user])
      if len(prompt) > cfg.max_prompt_len:
        chat.open = False  # skipped (first turn) or ended here (later turn)
        bar.update(1)
        continue
      todo.append(chat)
      prompts.append(prompt)
    for b, rows in enumerate(batches_by_length([len(p) for p in prompts], cfg.batch_size)):
      replies, g = generate_batch(lm, [prompts[r] for r in rows], batch_size=cfg.batch_size,
                                  max_new_tokens=cfg.max_new_tokens, params=params,
                                  seed=batch_seed(cfg.seed, shard, turn, b))
      finished = 0
      for r, reply in zip(rows, replies):
        chat = todo[r]
        text = lm.tokenizer.decode(reply.tokens[:-1] if reply.stopped else reply.tokens)
        chat.messages += [{"role": "user", "content": chat.users[turn]},
                          {"role": "assistant", "content": text}]
        chat.new_tokens += len(reply.tokens)
        chat.stopped &= reply.stopped
        finished += turn + 1 == len(chat.users)
        info["replies"] += 1
        info["new_tokens"] += len(reply.tokens)
        info["stopped"] += reply.stopped
      info["generate_seconds"] += g.seconds
      totals["new_tokens"] += sum(len(r.tokens) for r in replies)
      totals["seconds"] += g.seconds + g.compile_seconds
      bar.set_postfix(new_tokens=totals["new_tokens"],
                      tok_s=f"{totals['new_tokens'] / max(totals['seconds'], 1e-9):.1f}",
                      refresh=False)
      bar.update(finished)
  records = [c.record() for c in chats if any(m["role"] == "assistant" for m in c.messages)]
  info.update(records=len(records), skipped=len(chats) - len(records))
  return records, info


def _write_jsonl(path: str, records: Sequence[dict]) -> None:
  """Writes ``records`` as JSON lines atomically (temporary file, fsync, rename)."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _save_manifest(folder: str, manifest: dict) -> None:
  tmp = os.path.join(folder, f"manifest.json.tmp{os.getpid()}")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(folder, "manifest.json"))


def _read_manifest(folder: str) -> dict | None:
  path = os.path.join(folder, "manifest.json")
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise EagleJaxError(f"{path}: unreadable manifest ({e}); delete the folder to start "
                        "over") from None


def _content_sha(folder: str, names: Sequence[str]) -> str:
  h = hashlib.sha256()
  for name in names:
    with open(os.path.join(folder, name), "rb") as f:
      h.update(hashlib.sha256(f.read()).digest())
  return h.hexdigest()


def regenerate(config_path: str, overrides: Sequence[str] = (), *, lm=None,
               progress: bool = True) -> dict:
  """Writes (or resumes) the regenerated dataset a :class:`RegenerateConfig` YAML describes
  (``lm``: the loaded target, else loaded here when there is work); returns its manifest's
  totals (JSON-serialisable)."""
  cfg = load_config(RegenerateConfig, config_path, overrides)
  return regenerate_dataset(cfg, lm=lm, progress=progress)


def regenerate_dataset(cfg: RegenerateConfig, *, lm=None, progress: bool = True) -> dict:
  """:func:`regenerate` for a built config."""
  folder = cfg.folder
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time; a second one then resumes
    return _regenerate_locked(cfg, folder, lm, progress)


def _regenerate_locked(cfg: RegenerateConfig, folder: str, lm, progress: bool) -> dict:
  t_start = time.perf_counter()
  manifest = _read_manifest(folder)
  if manifest is not None and manifest.get("key") != cfg.content_key():
    before = manifest.get("config", {})
    diff = [k for k, v in to_dict(cfg).items() if k not in _NOT_CONTENT and before.get(k) != v]
    raise EagleJaxError(f"{folder}: holds a dataset regenerated with other settings "
                        f"({', '.join(diff) or 'older format'}); use another out_dir or delete it")
  if manifest is None:
    manifest = {"key": cfg.content_key(), "config": to_dict(cfg), "shards": {}}
  for stale in glob.glob(os.path.join(folder, "*.tmp*")):
    os.remove(stale)  # a killed run's unfinished temporary file
  convs = training_conversations(cfg.conversations, cfg.heldout_fraction, cfg.split_seed)
  n, size = len(convs), cfg.shard_size
  plan = [(k, f"shard_{k:05d}.jsonl", k * size, min((k + 1) * size, n))
          for k in range(-(-n // size))]
  done = {name for _, name, start, end in plan
          if (manifest["shards"].get(name) or {}).get("range") == [start, end]
          and os.path.isfile(os.path.join(folder, name))}
  manifest.update(config=to_dict(cfg), model=cfg.model, selected=n, complete=False,
                  dataset=[p[1] for p in plan])
  todo = [p for p in plan if p[1] not in done]
  print(f"regenerate {folder}: {n} training-split conversations in {len(plan)} shards, "
        f"{len(plan) - len(todo)} done, {len(todo)} to do", file=sys.stderr)
  if todo:
    lm = lm or load_model(cfg.model)
    context = lm.config.max_position_embeddings
    if cfg.max_prompt_len + cfg.max_new_tokens > context:
      raise EagleJaxError(f"max_prompt_len + max_new_tokens ({cfg.max_prompt_len} + "
                          f"{cfg.max_new_tokens}) exceed {cfg.model}'s context of {context} tokens")
    _save_manifest(folder, manifest)
  totals = {"new_tokens": 0, "seconds": 0.0}
  initial = sum(end - start for _, name, start, end in plan if name in done)
  bar = tqdm(total=n, initial=initial, unit="conv", desc="regenerate", disable=not progress,
             file=sys.stderr)
  for k, name, start, end in todo:
    t0 = time.perf_counter()
    records, info = _answer_shard(lm, cfg, convs[start:end], k, bar, totals)
    _write_jsonl(os.path.join(folder, name), records)
    manifest["shards"][name] = {"range": [start, end], **info,
                                "generate_seconds": round(info["generate_seconds"], 3),
                                "seconds": round(time.perf_counter() - t0, 3)}
    _save_manifest(folder, manifest)
  bar.close()
  shards = [manifest["shards"][p[1]] for p in plan]
  count = lambda key: sum(s[key] for s in shards)
  seconds, gen_seconds = count("seconds"), count("generate_seconds")
  manifest.update(
      complete=True, records=count("records"), skipped=count("skipped"), replies=count("replies"),
      new_tokens=count("new_tokens"), stopped_replies=count("stopped"), seconds=round(seconds, 2),
      tokens_per_s=round(count("new_tokens") / max(seconds, 1e-9), 2),
      generate_seconds=round(gen_seconds, 2),
      generate_tokens_per_s=round(count("new_tokens") / max(gen_seconds, 1e-9), 2),
      content_sha256=_content_sha(folder, manifest["dataset"]),
      last_run={"shards_written": len(todo), "shards_kept": len(plan) - len(todo),
                "seconds": round(time.perf_counter() - t_start, 2)})
  _save_manifest(folder, manifest)
  keys = ("model", "selected", "records", "skipped", "replies", "new_tokens", "stopped_replies",
          "seconds", "tokens_per_s", "generate_seconds", "generate_tokens_per_s", "last_run")
  return {"folder": folder, **{k: manifest[k] for k in keys}}


def _make_it(folder: str) -> str:
  """The command that writes ``folder``, in words."""
  config = os.path.join(CONFIG_DIR, os.path.basename(os.path.normpath(folder)) + ".yaml")
  if os.path.isfile(config):
    return f"eagle-jax data regenerate {config}"
  return f"eagle-jax data regenerate CONFIG (a configs/data/ YAML with out_dir: {folder})"


def regenerated_manifest(folder: str, model: str) -> dict:
  """The manifest of a finished regenerated dataset answered by ``model`` (one-line errors)."""
  manifest = _read_manifest(folder) if os.path.isdir(folder) else None
  if manifest is None:
    raise EagleJaxError(f"data.regenerated: {folder}: no regenerated dataset there; make it "
                        f"with: {_make_it(folder)}")
  if not manifest.get("complete"):
    raise EagleJaxError(f"data.regenerated: {folder}: regeneration did not finish; resume it "
                        f"with: {_make_it(folder)}")
  if manifest.get("model") != model:
    raise EagleJaxError(f"data.regenerated: {folder}: holds replies of {manifest.get('model')!r}, "
                        f"but the target is {model!r}; regenerate them with model: {model}")
  return manifest


def read_regenerated(folder: str, manifest: dict) -> list[Conversation]:
  """The conversations of a finished regenerated dataset, in shard order."""
  out = []
  for name in manifest["dataset"]:
    path = os.path.join(folder, name)
    try:
      with open(path, encoding="utf-8") as f:
        # Lines end at "\n" only: a reply may hold U+2028 or other characters that
        # str.splitlines() would also break at.
        lines = [l for l in f.read().split("\n") if l]
    except OSError as e:
      raise EagleJaxError(f"{path}: cannot read shard ({e.strerror or e}); regenerate it with: "
                          f"{_make_it(folder)}") from None
    for i, line in enumerate(lines, 1):
      try:
        r = json.loads(line)
        out.append(Conversation(str(r["id"]), tuple({"role": m["role"], "content": m["content"]}
                                                    for m in r["messages"])))
      except (ValueError, KeyError, TypeError) as e:
        raise EagleJaxError(f"{path}:{i}: not a regenerated conversation ({type(e).__name__}: "
                            f"{e})") from None
  return out
