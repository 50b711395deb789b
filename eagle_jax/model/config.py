"""Typed model configuration shared by every Llama-family model (Llama, Mistral, Qwen2)."""

from __future__ import annotations

import dataclasses
from typing import Any

from eagle_jax.errors import EagleJaxError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3") or linear."""

  rope_type: str = "default"  # "default" | "linear" | "llama3"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only Llama-family transformer."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # Qwen2: bias on the q, k, v projections
  max_position_embeddings: int = 8192
  architecture: str = "llama"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise EagleJaxError(
          f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if self.num_heads % self.num_kv_heads:
      raise EagleJaxError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

  @property
  def num_params(self) -> int:
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.attention_bias:
      attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else v * d
    return self.num_layers * layer + v * d + head + d

  @classmethod
  def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
    """Builds a config from a Hugging Face ``config.json`` dictionary."""
    if not isinstance(cfg, dict):
      raise EagleJaxError(f"{source}: expected a JSON object at the top level, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
      raise EagleJaxError(
          f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
      num_heads = int(cfg["num_attention_heads"])
      hidden = int(cfg["hidden_size"])
      for key in ("num_attention_heads", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "vocab_size"):
        if int(cfg[key]) < 1:
          raise EagleJaxError(f"{source}: {key} must be a positive integer, got {cfg[key]!r}")
      scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
      if not isinstance(scaling, dict):
        raise EagleJaxError(f"{source}: rope_scaling must be an object, got {scaling!r}")
      rope_type = scaling.get("rope_type", scaling.get("type", "default"))
      rope_theta = cfg.get("rope_theta", scaling.get("rope_theta", 10000.0))
      if rope_type not in ("default", "linear", "llama3"):
        raise EagleJaxError(f"{source}: unsupported rope_scaling type {rope_type!r}")
      rope = RopeScaling(
          rope_type=rope_type,
          factor=float(scaling.get("factor", 1.0)),
          low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
          high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
          original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
      )
      # sliding-window attention (Mistral; Qwen2 when use_sliding_window) equals full attention
      # while the sequence fits in the window, so the cache is capped at the window
      max_positions = int(cfg.get("max_position_embeddings", 8192))
      window = cfg.get("sliding_window") if (model_type == "mistral" or cfg.get("use_sliding_window")) else None
      if window:
        max_positions = min(max_positions, int(window))
      eos = cfg.get("eos_token_id")
      eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
      return cls(
          vocab_size=int(cfg["vocab_size"]),
          hidden_size=hidden,
          intermediate_size=int(cfg["intermediate_size"]),
          num_layers=int(cfg["num_hidden_layers"]),
          num_heads=num_heads,
          num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
          head_dim=int(cfg.get("head_dim") or hidden // num_heads),
          rope_theta=float(rope_theta),
          rope_scaling=rope,
          rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
          tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
          attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
          max_position_embeddings=max_positions,
          architecture=model_type,
          bos_token_id=cfg.get("bos_token_id"),
          eos_token_ids=eos_ids,
      )
    except KeyError as e:
      raise EagleJaxError(f"{source}: missing required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:  # e.g. "hidden_size": null or "abc"
      raise EagleJaxError(f"{source}: invalid value ({e})") from None

  def to_hf_dict(self) -> dict[str, Any]:
    """The inverse of :meth:`from_hf_dict` (used to cache converted GGUF checkpoints)."""
    out = {
        "model_type": self.architecture,
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[self.architecture]],
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "attention_bias": self.attention_bias,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_ids),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if self.rope_scaling.rope_type != "default":
      out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
    return out


def tiny_config(**overrides) -> ModelConfig:
  """A small random-weight config for fast tests and examples."""
  base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
              eos_token_ids=(1,))
  base.update(overrides)
  return ModelConfig(**base)
