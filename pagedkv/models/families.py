"""Which model class runs an architecture: the Llama family's shared decoder unless a family
has its own module."""

from __future__ import annotations

from pagedkv.models.gemma2 import Gemma2ForCausalLM
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.moe import MoeForCausalLM
from pagedkv.models.moe_config import MOE_ARCHITECTURES

#: architectures (config.json ``architectures[0]``) with their own module; every other supported
#: one (Llama, Mistral, Qwen2, Qwen3, Phi-3) is a switch of :class:`LlamaForCausalLM`
_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma2ForCausalLM,
    **dict.fromkeys(MOE_ARCHITECTURES, MoeForCausalLM),
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class whose instances run ``architecture``."""
    return _FAMILIES.get(architecture, LlamaForCausalLM)
