"""The model's part of the engine's settings: which checkpoint, how it is loaded and on what it
runs (vLLM's ``ModelConfig`` and ``DeviceConfig``). Not to be confused with
:class:`pagedkv.models.ModelConfig`, the checkpoint's own architecture read from config.json:
these are the user's choices about it. No torch here: a dtype is checked by name, and what
only the device can tell (the attention backend a device defaults to, whether it reads the KV
dtype) is checked by the executor that owns the device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedkv.config.checks import optional_positive_int
from pagedkv.kernels import LINEAR_KERNELS, QUANTIZED_ACTIVATIONS

if TYPE_CHECKING:
    import torch

#: The model dtypes an engine runs: "auto" picks one for the device (``pagedkv.models.config``).
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
#: vLLM's ``load_format`` values pagedkv reads: the checkpoint's safetensors, or seeded random weights.
LOAD_FORMATS = ("auto", "dummy")
#: On-the-fly quantization of a 16/32-bit checkpoint, by llama.cpp's type names
#: (``pagedkv.models.quantization.on_the_fly``).
QUANTIZATION_NAMES = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k")


@dataclass(frozen=True)
class ModelOptions:
    """The checkpoint and how it runs, checked when made."""

    #: A folder or a Hub id; None: the built-in trained tiny Llama.
    model: str | Path | None
    #: The Hub revision of a ``model`` given as a Hub id; None: "main".
    revision: str | None
    #: huggingface_hub's cache; None: HF_HUB_CACHE.
    download_dir: str | Path | None
    #: "auto" (the checkpoint's safetensors) or "dummy" (seeded random weights of its shape).
    load_format: str
    #: The model's sampling defaults: "auto", "vllm" (none) or a folder.
    generation_config: str
    #: Token-id prompts only, outputs without text.
    skip_tokenizer_init: bool
    #: The tokenizer's folder, GGUF file or Hub id when not the model's own; None: the model's.
    tokenizer: str | Path | None
    #: A name of :data:`DTYPE_NAMES` or a torch dtype; None: the checkpoint's.
    dtype: str | torch.dtype | None
    #: Context length; None: the model's.
    max_model_len: int | None
    device: str
    #: "torch", "cpu" or "triton"; None: triton on CUDA, else cpu.
    attention_backend: str | None
    #: A name of ``pagedkv.kernels.LINEAR_KERNELS``.
    linear_kernel: str
    #: No CUDA graphs: every decode step runs eagerly.
    enforce_eager: bool
    #: A name of :data:`QUANTIZATION_NAMES`: the decoder's projections quantized when loaded;
    #: None: the checkpoint's own weights (quantized ones included).
    quantization: str | None
    #: A name of ``pagedkv.kernels.QUANTIZED_ACTIVATIONS``: how a decode step multiplies
    #: activations by GGUF-block weights ("float" exact, "q8" llama.cpp's 8-bit arithmetic).
    quantized_activations: str

    def __post_init__(self) -> None:
        if self.dtype is not None and str(self.dtype).removeprefix("torch.") not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {list(DTYPE_NAMES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose one of {list(LOAD_FORMATS)}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_NAMES:
            raise ValueError(
                f"unknown quantization {self.quantization!r}; choose one of {list(QUANTIZATION_NAMES)}"
            )
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(
                f"unknown linear kernel {self.linear_kernel!r}; choose one of {list(LINEAR_KERNELS)}"
            )
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(
                f"unknown quantized_activations {self.quantized_activations!r}; "
                f"choose one of {list(QUANTIZED_ACTIVATIONS)}"
            )
        optional_positive_int("max_model_len", self.max_model_len)

    @property
    def loads_weights(self) -> bool:
        """The checkpoint's weights are read (not drawn at random: ``load_format="dummy"``)."""
        return self.load_format != "dummy"
