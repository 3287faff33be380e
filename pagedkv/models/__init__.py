"""Llama-family models (Llama, Mistral, Qwen2, Qwen3) read from Hugging Face folders.

``load_model`` builds the network from config.json and *.safetensors, and
``builtin_model_path`` gives the small trained Llama shipped in the package
(:mod:`pagedkv.models.builtin`), for demos that need no download. The tokenizer of a folder is
:mod:`pagedkv.tokenizer`'s.
"""

from pagedkv.models.builtin import BUILTIN_NOTE, builtin_model_path, shipped_model_path
from pagedkv.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from pagedkv.models.dtypes import DTYPES
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.loader import load_model

__all__ = [
    "BUILTIN_NOTE",
    "DTYPES",
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeConfig",
    "builtin_model_path",
    "load_model",
    "shipped_model_path",
]
