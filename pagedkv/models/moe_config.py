"""The Mixture-of-Experts part of a ``config.json``: how many experts, how many a token uses, how
their weights are normalised, and which layers are sparse.

Each family spells it differently and transformers' own config classes fill different defaults;
this module settles that once, into :class:`MoeConfig`, which
:class:`~pagedkv.models.config.ModelConfig` carries and :mod:`pagedkv.models.moe` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the architectures whose MLP is a mixture of experts
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

#: transformers' config defaults of each family: (experts, experts per token, expert rows key,
#: expert rows default); Mixtral's experts are ``intermediate_size`` rows
_DEFAULTS: dict[str, tuple[int, int, str, int]] = {
    "MixtralForCausalLM": (8, 2, "intermediate_size", 14336),
    "Qwen2MoeForCausalLM": (60, 4, "moe_intermediate_size", 1408),
    "Qwen3MoeForCausalLM": (128, 8, "moe_intermediate_size", 768),
}


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts as transformers runs it: a token's router probabilities (a softmax
    over every expert, in float32) pick its ``top_k`` experts, whose outputs are summed weighted
    by those probabilities."""

    num_experts: int
    top_k: int
    #: intermediate rows of each routed expert's gated MLP
    expert_size: int
    #: the ``top_k`` probabilities are divided by their sum (Mixtral always; Qwen's ``norm_topk_prob``)
    renormalize: bool
    #: the routing weights multiply the expert outputs in float32, the product then rounded to
    #: the hidden dtype (Mixtral); else the weights are rounded to it first (Qwen)
    float32_weights: bool
    #: intermediate rows of the shared expert every token also runs, its output scaled by
    #: ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE); None: no shared expert
    shared_expert_size: int | None = None
    #: the layers whose MLP is dense (``intermediate_size`` rows), not a mixture: Qwen's
    #: ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts <= 0:
            raise ValueError(f"config num_experts must be a positive integer, got {self.num_experts!r}")
        if not isinstance(self.top_k, int) or not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"config num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                f"got {self.top_k!r}"
            )
        for name in ("expert_size", "shared_expert_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts."""
        return layer not in self.dense_layers


def moe_config(raw: dict[str, Any], arch: str, num_layers: int) -> MoeConfig | None:
    """The mixture of ``config.json`` dict ``raw`` of architecture ``arch`` (None: a dense model)."""
    if arch not in MOE_ARCHITECTURES:
        return None
    experts, top_k, size_key, size = _DEFAULTS[arch]
    if arch == "MixtralForCausalLM":
        return MoeConfig(
            num_experts=raw.get("num_local_experts", experts),
            top_k=raw.get("num_experts_per_tok", top_k),
            expert_size=raw.get(size_key, size),
            renormalize=True,
            float32_weights=True,
        )
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step <= 0:
        raise ValueError(f"config decoder_sparse_step must be a positive integer, got {step!r}")
    only = raw.get("mlp_only_layers") or []
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in only):
        raise ValueError(f"config mlp_only_layers must name layers 0..{num_layers - 1}, got {only!r}")
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    shared = None
    if arch == "Qwen2MoeForCausalLM":
        shared = raw.get("shared_expert_intermediate_size", 5632)
    return MoeConfig(
        num_experts=raw.get("num_experts", raw.get("num_local_experts", experts)),
        top_k=raw.get("num_experts_per_tok", top_k),
        expert_size=raw.get(size_key, size),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        float32_weights=False,
        shared_expert_size=shared,
        dense_layers=dense,
    )
