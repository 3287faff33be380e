"""A normalised view of a Hugging Face ``config.json`` for the Llama family.

Checkpoints in the wild were written by two generations of ``transformers``: 4.x spells RoPE as
``rope_theta`` + ``rope_scaling`` and the dtype as ``torch_dtype``; 5.x writes one
``rope_parameters`` dict and ``dtype``. Every other part of pagedkv reads this dataclass only, so
that difference (and each architecture's defaults) is settled here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.memory.kv_bytes import KVSpec
from pagedkv.models.dtypes import dtype_name, resolve_dtype
from pagedkv.models.gguf_config import gguf_config
from pagedkv.models.moe_config import MOE_ARCHITECTURES, MoeConfig, moe_config
from pagedkv.tokenizer.gguf_file import GGUFError, gguf_parts

#: The architectures (``config.json`` ``architectures[0]``) this package can run.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    *MOE_ARCHITECTURES,
)

#: RoPE scalings implemented in :mod:`pagedkv.models.rope`; "freq_factors" is llama.cpp's form of
#: Llama 3.1's scaling in a GGUF file (one divisor per frequency, ``params["factors"]``).
SUPPORTED_ROPE_TYPES: tuple[str, ...] = (
    "default",
    "linear",
    "llama3",
    "freq_factors",
    "yarn",
    "dynamic",
    "longrope",
)


#: What transformers' Gemma 2 and Gemma 3 configs default alike (their lengths and soft-caps differ).
_GEMMA_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
}

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    # The values transformers' own config classes default to when config.json omits a key.
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 128},
    "Gemma2ForCausalLM": {
        **_GEMMA_DEFAULTS,
        "max_position_embeddings": 8192,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "Gemma3ForCausalLM": {**_GEMMA_DEFAULTS, "max_position_embeddings": 131072},
    "Phi3ForCausalLM": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "MixtralForCausalLM": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "Qwen2MoeForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
}

#: Scalings whose parameters name the context length the model was pretrained with.
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def unsupported_architecture(arch: str) -> ValueError:
    return ValueError(f"unsupported architecture {arch!r}; pagedkv supports {list(SUPPORTED_ARCHITECTURES)}")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE: base ``theta``, scaling ``type`` and that scaling's parameters (``factor``, ...)."""

    theta: float = 10000.0
    type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model, the KV cache and the engine need to know about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    #: the sliding layers' own RoPE (Gemma 3's ``rope_local_base_freq``); None: ``rope``.
    local_rope: RopeConfig | None = None
    tie_word_embeddings: bool = False
    #: bias on q/k/v projections (Qwen2, or Llama's ``attention_bias``).
    attention_bias: bool = False
    #: bias on o_proj (Llama/Qwen3 ``attention_bias`` covers it; Qwen2 never has one).
    o_proj_bias: bool = False
    mlp_bias: bool = False
    #: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    qk_norm: bool = False
    #: how many of a head's dimensions rotate (``partial_rotary_factor`` of it: Phi-4-mini's
    #: 0.75); None: all of them. See :func:`pagedkv.models.rope.rotary_row_order`.
    rotary_dim: int | None = None
    #: sliding-window size for the layers marked sliding in ``layer_types``; None: full attention.
    sliding_window: int | None = None
    #: per layer, "full_attention" or "sliding_attention".
    layer_types: tuple[str, ...] = ()
    #: attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma); None: ``head_dim``.
    query_pre_attn_scalar: float | None = None
    #: attention scores pass through ``cap * tanh(score / cap)`` (Gemma 2); None: uncapped.
    attn_logit_softcapping: float | None = None
    #: the logits pass through ``cap * tanh(logit / cap)`` (Gemma 2); None: uncapped.
    final_logit_softcapping: float | None = None
    #: the mixture of experts of a MoE family (:mod:`pagedkv.models.moe`); None: a dense MLP.
    moe: MoeConfig | None = None
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise unsupported_architecture(self.architecture)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"partial_rotary_factor gives {self.rotary_dim} rotary dimensions of {self.head_dim}; "
                "pagedkv needs an even number below head_dim"
            )
        if self.rope.type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE scaling {self.rope.type!r}; pagedkv supports {list(SUPPORTED_ROPE_TYPES)}"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(
                f"unsupported layer_types {unknown}; expected full_attention or sliding_attention"
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                f"sliding_window must be a positive integer or null, got {self.sliding_window!r}"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """config.json's eos_token_id as a tuple (it may be an int, a list or absent)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def attention_scale(self) -> float:
        """The factor attention scores are scaled by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends over, None for full causal attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def kv_spec(self, dtype: torch.dtype | str | None = None) -> KVSpec:
        """The KV cache shape of this model; the cache dtype defaults to the model's dtype."""
        kv_dtype = resolve_dtype(dtype, default=self.dtype)
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, dtype_name(kv_dtype))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json`` (a folder or the file itself), or a GGUF model's metadata
        (a .gguf file, or a folder holding one and no config.json: :mod:`pagedkv.models.gguf_config`)."""
        parts = gguf_parts(path)
        if parts is not None:
            try:
                return cls.from_dict(gguf_config(parts))
            except GGUFError:
                raise
            except ValueError as err:
                raise GGUFError(f"{parts[0]}: {err}") from None
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face model folder")
        with open(file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Normalise a config.json dict written by transformers 4.x or 5.x."""
        architectures = raw.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture, got {architectures!r}; "
                f"pagedkv supports {list(SUPPORTED_ARCHITECTURES)}"
            )
        arch = architectures[0]
        if arch not in _ARCH_DEFAULTS:
            raise unsupported_architecture(arch)
        defaults = _ARCH_DEFAULTS[arch]
        # the MLP activation the family's modules implement (Gemma names it hidden_activation)
        expected = defaults.get("hidden_activation", "silu")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or expected
        if act != expected:
            raise ValueError(f"unsupported hidden_act {act!r}; {arch} uses {expected!r}")

        num_layers = _required(raw, "num_hidden_layers")
        num_heads = _required(raw, "num_attention_heads")
        hidden = _required(raw, "hidden_size")
        head_dim = raw.get("head_dim") or defaults.get("head_dim") or hidden // num_heads
        bias = bool(raw.get("attention_bias", False))
        # Qwen2 always has q/k/v biases, Qwen2-MoE by its qkv_bias; neither has an o_proj bias
        qkv_bias = {"Qwen2ForCausalLM": True, "Qwen2MoeForCausalLM": raw.get("qkv_bias", True)}
        qkv_bias = qkv_bias.get(arch, bias)
        max_pos = raw.get("max_position_embeddings", defaults["max_position_embeddings"])
        if arch == "Gemma3ForCausalLM":
            rope, local_rope = _gemma3_ropes(raw, arch, max_pos)
        else:
            rope, local_rope = _rope(raw, arch, max_pos), None
        if rope.type == "dynamic":  # the context NTK scaling stretches to (vLLM's max_model_len)
            max_pos = int(max_pos * rope.params["factor"])
        sliding_window, layer_types = _sliding(raw, arch, num_layers)
        rope_dict = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        partial = rope_dict.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        return cls(
            architecture=arch,
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", defaults["rms_norm_eps"])),
            rope=rope,
            max_position_embeddings=max_pos,
            local_rope=local_rope,
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))
            ),
            attention_bias=bool(qkv_bias),
            o_proj_bias=bias and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),
            sliding_window=sliding_window,
            layer_types=layer_types,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar", defaults.get("query_pre_attn_scalar")),
            attn_logit_softcapping=raw.get("attn_logit_softcapping", defaults.get("attn_logit_softcapping")),
            final_logit_softcapping=raw.get(
                "final_logit_softcapping", defaults.get("final_logit_softcapping")
            ),
            moe=moe_config(raw, arch, num_layers),
            dtype=resolve_dtype(raw.get("dtype") or raw.get("torch_dtype")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
        )


def _required(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ValueError(f"config.json lacks the required key {key!r}")
    return raw[key]


def _rope(raw: dict[str, Any], arch: str, max_position_embeddings: int) -> RopeConfig:
    """RoPE from 5.x ``rope_parameters`` or from 4.x ``rope_theta`` + ``rope_scaling``, with the
    parameters transformers fills in settled here: the pretraining length of llama3/yarn/longrope
    (Phi-3's top-level ``original_max_position_embeddings`` wins, as in transformers), longrope's
    ``factor`` (context over pretraining length) and dynamic NTK's pretraining length (the
    config's ``max_position_embeddings``, which :meth:`ModelConfig.from_dict` then stretches by
    ``factor``: the frequencies are computed once for that length, as vLLM does)."""
    params = dict(raw.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {sorted(params)}")
    if not params:
        params = dict(raw.get("rope_scaling") or {})
    default_theta = _ARCH_DEFAULTS[arch].get("rope_theta", 10000.0)
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or default_theta
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # ModelConfig.rotary_dim
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's own older names for it
    if rope_type in _ORIGINAL_LENGTH_TYPES:
        original = raw.get("original_max_position_embeddings", 4096 if arch == "Phi3ForCausalLM" else None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]
    if rope_type == "dynamic":
        if not params.get("factor"):
            raise ValueError(f"dynamic RoPE scaling needs a 'factor', got {params}")
        params["original_max_position_embeddings"] = max_position_embeddings
    return RopeConfig(theta=float(theta), type=rope_type, params=params)


def _gemma3_ropes(
    raw: dict[str, Any], arch: str, max_position_embeddings: int
) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's RoPE of its full and of its sliding layers: 5.x writes ``rope_parameters`` per
    layer type; 4.x ``rope_theta`` (+ ``rope_scaling``) and ``rope_local_base_freq``."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = ({"rope_parameters": params[kind]} for kind in ("full_attention", "sliding_attention"))
    else:
        full = {**raw, "rope_theta": raw.get("rope_theta", 1e6)}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    local_rope = _rope(local, arch, max_position_embeddings)
    if local_rope.type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling {local_rope.type!r} of the sliding layers")
    return _rope(full, arch, max_position_embeddings), local_rope


def _sliding(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and which layers use it, as transformers decides per architecture.

    Mistral, Mixtral and Phi-3 slide every layer when ``sliding_window`` is set. Qwen2/Qwen3 slide
    only with ``use_sliding_window`` and only layers from ``max_window_layers`` on (5.x also writes
    the resulting ``layer_types``); Qwen3-MoE slides every layer with ``use_sliding_window``,
    Qwen2-MoE its ``layer_types`` (which 4.x did not write: refused without them). Gemma 2 slides
    the even layers (0, 2, ...), Gemma 3 all but every ``sliding_window_pattern``-th (6th).
    Llama never slides.
    """
    window = raw.get("sliding_window", _ARCH_DEFAULTS[arch].get("sliding_window"))
    if arch == "LlamaForCausalLM":
        window = None
    elif arch.startswith(("Qwen2", "Qwen3")) and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return None, ("full_attention",) * num_layers
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM"):
        return window, ("sliding_attention",) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None and arch == "Qwen2MoeForCausalLM":
        raise ValueError("a Qwen2MoeForCausalLM config with use_sliding_window needs its layer_types")
    if layer_types is None and arch == "Gemma2ForCausalLM":
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if layer_types is None and arch == "Gemma3ForCausalLM":
        pattern = raw.get("sliding_window_pattern", 6)
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ]
    if layer_types is None:
        first = raw.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return window, tuple(layer_types)
