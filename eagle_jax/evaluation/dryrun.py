"""``eagle-jax run CONFIG --dry-run``: checks an experiment before anything is loaded.

Reads the config, the prompts, and the ``config.json`` (and safetensors headers) of the target
and of each method's checkpoint, never their weights, and reports what the run would do: the
target's shape and parameter memory, each method's checkpoint and drafting settings, the
published figures its table would show. A missing folder, a head for another target or of
another kind, a generation longer than the target's context or a chat-less tokenizer is a
one-line error, so a GPU job fails in seconds rather than after minutes of loading.
"""

from __future__ import annotations

import glob
import json
import os

from eagle_jax.drafters import registry
from eagle_jax.errors import EagleJaxError
from eagle_jax.evaluation.runner import ExperimentConfig, load_experiment, questions_for
from eagle_jax.model.checkpoints import read_config
from eagle_jax.model.registry import resolve
from eagle_jax.model.tokenizer import chat_template_text

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _target(cfg: ExperimentConfig) -> tuple[object, dict]:
  """The target's ModelConfig and its report line's facts."""
  where = f" (checkpoints_dir: {cfg.checkpoints_dir})" if cfg.checkpoints_dir else ""
  if not os.path.exists(cfg.model) and os.sep in cfg.model:
    raise EagleJaxError(f"model {cfg.model}: no such folder{where}")
  folder = resolve(cfg.model)
  config = read_config(folder)
  with open(os.path.join(folder, "config.json")) as f:
    raw = json.load(f)
  dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
  weights = sorted(glob.glob(os.path.join(folder, "*.safetensors")) + glob.glob(os.path.join(folder, "*.bin")))
  return config, {
      "folder": folder, "architecture": config.architecture, "layers": config.num_layers,
      "hidden_size": config.hidden_size, "heads": f"{config.num_heads}/{config.num_kv_heads}",
      "vocab_size": config.vocab_size, "max_positions": config.max_position_embeddings,
      "parameters": config.num_params, "dtype": dtype,
      "parameter_gib": round(config.num_params * _BYTES.get(dtype, 4) / 2**30, 2),
      "weights": "present" if weights else "absent"}


def _chat_template(cfg: ExperimentConfig, folder: str) -> str:
  if cfg.chat_template:
    chat_template_text(cfg.chat_template)  # a bad name or a missing file fails here
    return cfg.chat_template
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    return "the tokenizer's own (tokenizer files not checked: absent)"
  with open(path) as f:
    own = json.load(f).get("chat_template")
  if not own and not os.path.isfile(os.path.join(folder, "chat_template.jinja")):
    raise EagleJaxError(f"{folder}: its tokenizer has no chat template; set chat_template: "
                        "(vicuna, or a Jinja file)")
  return "the tokenizer's own"


def dry_run(path: str, overrides=()) -> dict:
  """The plan of the experiment ``path`` names, checked from config files only."""
  cfg = load_experiment(path, overrides)
  questions = questions_for(cfg.eval, announce=False)  # the plan gives the count
  target, facts = _target(cfg)
  ev = cfg.eval
  if ev.max_new_tokens >= target.max_position_embeddings:
    raise EagleJaxError(f"eval.max_new_tokens={ev.max_new_tokens} leaves no room for a prompt in "
                        f"the target's {target.max_position_embeddings} positions")
  facts["chat_template"] = _chat_template(cfg, facts["folder"])
  methods = {}
  for m in cfg.methods:
    entry = {"drafter": m.kind, "budget": m.budget,
             "options": registry.get(m.kind).budget_values(m.option_values(), m.budget)}
    if m.kind in registry.TRAINED:
      if m.checkpoint:
        try:
          entry["checkpoint"] = m.checkpoint
          entry["head"] = registry.check(m.kind, m.checkpoint, target, m.options())
        except EagleJaxError as e:
          raise EagleJaxError(f"method {m.name!r}: {e}") from None
      elif m.train:
        entry["checkpoint"] = f"trained first by {m.train} (if its run is unfinished)"
      else:
        entry["checkpoint"] = registry.find_checkpoint(m.kind, cfg.runs_dir, cfg.model)
    if m.published:
      entry["published"] = m.published_figures()
    methods[m.name] = entry
  return {"config": path, "target": facts, "methods": methods,
          "prompts": {"source": ev.prompts, "questions": len(questions), "turns": list(ev.turns),
                      "temperatures": list(ev.temperatures), "max_new_tokens": ev.max_new_tokens,
                      "batch_size": ev.batch_size},
          "results": os.path.join(cfg.results_dir, cfg.name)}


def render_plan(plan: dict) -> str:
  t, p = plan["target"], plan["prompts"]
  lines = [f"{plan['config']}: ok (nothing loaded; results would go to {plan['results']})",
           f"target   {t['folder']}: {t['architecture']}, {t['layers']} layers, hidden "
           f"{t['hidden_size']}, heads {t['heads']}, vocab {t['vocab_size']}, "
           f"{t['max_positions']} positions; {t['parameters'] / 1e9:.2f}B parameters = "
           f"{t['parameter_gib']} GiB in {t['dtype']}; weights {t['weights']}; chat template: "
           f"{t['chat_template']}",
           f"prompts  {p['source']}: {p['questions']} questions, turns {p['turns']}, T "
           f"{p['temperatures']}, {p['max_new_tokens']} new tokens, batch {p['batch_size']}"]
  for name, m in plan["methods"].items():
    opts = ", ".join(f"{k}={v}" for k, v in m["options"].items())
    line = f"method   {name}: {m['drafter']}, {m['budget']} budget" + (f" ({opts})" if opts else "")
    if "checkpoint" in m:
      line += f"; {m['checkpoint']}" + (f": {m['head']}" if "head" in m else "")
    for temp, fig in m.get("published", {}).items():
      shown = " / ".join(x for x in (fig["speedup"] and f"{fig['speedup']:.2f}x",
                                     fig["tau"] and f"tau {fig['tau']:.2f}") if x)
      line += f"; paper {temp}: {shown} ({fig['source']})"
    lines.append(line)
  return "\n".join(lines)
