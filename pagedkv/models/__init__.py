"""Llama-family models (Llama, Mistral, Qwen2, Qwen3) read from Hugging Face folders.

``load_model`` builds the network from config.json and *.safetensors, ``load_tokenizer`` the
tokenizer and chat template from tokenizer.json/tokenizer_config.json, and
``builtin_model_path`` the small trained Llama shipped in the package, for demos that need no
download.
"""

from pagedkv.models.builtin import BUILTIN_NOTE, builtin_model_path
from pagedkv.models.config import DTYPES, SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from pagedkv.models.detokenizer import IncrementalDetokenizer
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.loader import load_model
from pagedkv.models.tokenizer import (
    NoTokenizer,
    NoTokenizerError,
    Tokenizer,
    engine_tokenizer,
    load_tokenizer,
)

__all__ = [
    "BUILTIN_NOTE",
    "DTYPES",
    "SUPPORTED_ARCHITECTURES",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "NoTokenizer",
    "NoTokenizerError",
    "ModelConfig",
    "RopeConfig",
    "Tokenizer",
    "builtin_model_path",
    "engine_tokenizer",
    "load_model",
    "load_tokenizer",
]
