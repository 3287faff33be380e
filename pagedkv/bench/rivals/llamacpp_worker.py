"""llama.cpp (llama-cpp-python) as a ``pagedkv bench throughput`` rival: ``PYTHON llamacpp_worker.py``.

Imports only the standard library, llama-cpp-python (and numpy, its dependency) and
:mod:`worker_io` (see it for the protocol); converting the checkpoint also needs sentencepiece,
gguf, torch and transformers in the same venv (llama.cpp's converter imports them).

The GGUF: a file that exists is loaded as it is (``--llamacpp-gguf``: the one pagedkv runs too).
Otherwise llama.cpp reads its own format, made by ``convert_hf_to_gguf.py`` from the
llama-cpp-python sdist (``vendor/llama.cpp/``), whose path the driver passes. For a Llama that
converter wants a SentencePiece ``tokenizer.model`` with the model's vocabulary size; the bench
model has none (prompts are token ids), so one is trained here on seeded made-up words with
exactly that size, in a folder of links to the checkpoint. Its pieces never matter: no text is
ever encoded or decoded.

Generation goes through llama.cpp's C API (``llama_decode`` on a ``llama_batch``), the way its
``llama-batched-bench`` drives it: every request a sequence of one unified KV cache, all prompts
first in batches of ``n_batch`` tokens, then one decode batch per step holding the next token of
every unfinished request; greedy is an argmax over the step's logits rows. The KV cache is f16,
llama.cpp's default and its fastest KV type on the CPU (docs/performance.md, the rivals'
environments), so llama.cpp runs at its best; ``"kv_type": "model"`` keeps it in the model's dtype, as the
other engines do.

With ``"lookup": {"max_ngram_size": N, "num_pred_tokens": K}`` (``pagedkv bench spec``) it runs
llama.cpp's prompt lookup decoding: each step every sequence's last token goes into the batch
followed by the tokens llama-cpp-python's ``LlamaPromptLookupDecoding`` proposes from the
sequence so far, every row's logits come back, the proposals are kept while they equal the
argmax, and the rejected positions leave the KV cache (``llama_memory_seq_rm``), as llama.cpp's
``lookup`` example does. A build without that class cannot load this mode.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from worker_io import not_importable, serve

#: ggml's type ids (ggml.h) of the KV cache, and the converter's --outtype, per model dtype.
GGML_TYPES = {"float32": 0, "bfloat16": 30}
GGML_F16 = 1
OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}
N_BATCH, N_UBATCH = 2048, 512  # llama-batched-bench's defaults
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
)


def load(command: dict):
    try:
        import llama_cpp
        import numpy
    except ImportError as err:
        sys.exit(not_importable("llama_cpp", err))
    gguf = Path(command["gguf"])
    if not gguf.is_file():
        convert_to_gguf(Path(command["model"]), gguf, command["dtype"], command.get("convert_script"))
    if command.get("lookup"):
        try:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as err:
            raise RuntimeError(f"this llama-cpp-python has no prompt lookup decoding ({err})") from None
        return LookupEngine(llama_cpp, numpy, gguf, command, LlamaPromptLookupDecoding(**command["lookup"]))
    return LlamaCppEngine(llama_cpp, numpy, gguf, command)


# -- the GGUF ------------------------------------------------------------------------------------
def convert_to_gguf(model: Path, gguf: Path, dtype: str, script: str | None) -> None:
    if not script:
        raise RuntimeError(
            f"no GGUF at {gguf} yet: pass --llamacpp-convert PATH/convert_hf_to_gguf.py "
            "(vendor/llama.cpp/ in the llama-cpp-python sdist) to make it"
        )
    if not Path(script).is_file():
        raise RuntimeError(f"--llamacpp-convert {script}: no such file")
    staging = gguf.parent / f"{model.name}-sentencepiece"  # links to the checkpoint + tokenizer.model
    staging.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        link = staging / name
        if (model / name).is_file() and not link.exists():
            link.symlink_to((model / name).resolve())
    if not (staging / "tokenizer.model").is_file():
        import json

        vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
        train_sentencepiece(staging, vocab_size)
    partial = gguf.with_suffix(".partial")
    command = [sys.executable, script, str(staging), "--outtype", OUTTYPES[dtype], "--outfile", str(partial)]
    print("converting:", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=sys.stderr)
    os.replace(partial, gguf)


def train_sentencepiece(folder: Path, vocab_size: int, seed: int = 0) -> None:
    """``folder/tokenizer.model``: a BPE SentencePiece model of exactly ``vocab_size`` pieces
    (<unk>, <s>, </s> at 0, 1, 2, as in Llama's), trained on seeded made-up words -- more
    distinct words than pieces, each seen several times, so training can always reach the size."""
    import sentencepiece

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(vocab_size * 2)]
    lines = [" ".join(rng.choices(words, k=24)) for _ in range(vocab_size // 2)]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(folder / "tokenizer"),
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=2,
        minloglevel=2,
    )


# -- the engine ----------------------------------------------------------------------------------
class LlamaCppEngine:
    def __init__(self, lib, np, gguf: Path, command: dict) -> None:
        self.lib, self.np = lib, np
        threads, dtype = int(command["threads"]), command["dtype"]
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lib.llama_context_default_params()
        params.n_ctx = -(-int(command["max_tokens_in_flight"]) // 256) * 256
        params.n_batch, params.n_ubatch = N_BATCH, N_UBATCH
        params.n_seq_max = max(int(command["max_requests"]), 1)
        params.n_threads = params.n_threads_batch = threads
        kv_in_model_dtype = command.get("kv_type", "f16") == "model"
        params.type_k = params.type_v = GGML_TYPES[dtype] if kv_in_model_dtype else GGML_F16
        params.kv_unified = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {params.n_ctx} tokens")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self.info = {
            "engine": "llama.cpp",
            "version": f"llama-cpp-python {lib.__version__}" if hasattr(lib, "__version__") else "",
            "gguf": str(gguf),
            "n_ctx": params.n_ctx,
            "kv_type": OUTTYPES[dtype] if kv_in_model_dtype else "f16",
            "system": lib.llama_print_system_info().decode(errors="replace").strip(),
        }
        warm = min(2, params.n_seq_max)  # sequence ids past n_seq_max fail (one-request runs)
        self.generate([[5, 6, 7, 8, 9, 10, 11, 12]] * warm, [4] * warm)  # warm-up

    def _prefill(self, prompts: list[list[int]]) -> list[list[int]]:
        """Clear the KV cache and decode every prompt, N_BATCH tokens a call: each sequence's
        first generated token."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        outputs: list[list[int]] = [[] for _ in prompts]
        pending = [(s, pos, t, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        for start in range(0, len(pending), N_BATCH):
            chunk = pending[start : start + N_BATCH]
            last = [s for s, _, _, wants in chunk if wants]
            for s, token in zip(last, self._decode(chunk), strict=True):
                outputs[s].append(token)
        return outputs

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        outputs = self._prefill(prompts)
        while True:
            active = [s for s, out in enumerate(outputs) if len(out) < max_tokens[s]]
            if not active:
                return outputs
            chunk = [(s, len(prompts[s]) + len(outputs[s]) - 1, outputs[s][-1], True) for s in active]
            for s, token in zip(active, self._decode(chunk), strict=True):
                outputs[s].append(token)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run one batch of (sequence, position, token, wants logits); the argmax of each
        wanted row, in batch order."""
        batch = self.batch
        for i, (seq, pos, token, wants) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants
        batch.n_tokens = len(items)
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} (1: no KV slot for the batch)")
        rows = sum(wants for *_, wants in items)
        if not rows:
            return []
        logits = self.np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()


class LookupEngine(LlamaCppEngine):
    """llama.cpp with prompt lookup decoding (see the module docstring); ``run_stats`` counts the
    proposed and the accepted tokens of the latest run."""

    def __init__(self, lib, np, gguf: Path, command: dict, proposer) -> None:
        self.proposer = proposer
        self.run_stats = {"draft_tokens": 0, "accepted_tokens": 0, "drafts": 0}
        super().__init__(lib, np, gguf, command)
        self.info["lookup"] = {
            "max_ngram_size": proposer.max_ngram_size,
            "num_pred_tokens": proposer.num_pred_tokens,
        }

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        self.run_stats = {"draft_tokens": 0, "accepted_tokens": 0, "drafts": 0}
        memory = self.lib.llama_get_memory(self.ctx)
        outputs = self._prefill(prompts)
        while active := [s for s, out in enumerate(outputs) if len(out) < max_tokens[s]]:
            items, drafts = [], []
            for s in active:
                text = self.np.array(prompts[s] + outputs[s], dtype=self.np.intc)
                room = max_tokens[s] - len(outputs[s]) - 1
                draft = [int(t) for t in self.proposer(text)[:room]] if room > 0 else []
                pos = len(prompts[s]) + len(outputs[s]) - 1
                items += [(s, pos + i, t, True) for i, t in enumerate([outputs[s][-1], *draft])]
                drafts.append(draft)
            rows = self._decode(items)
            for s, draft in zip(active, drafts, strict=True):
                targets, rows = rows[: len(draft) + 1], rows[len(draft) + 1 :]
                accepted = 0
                while accepted < len(draft) and draft[accepted] == targets[accepted]:
                    accepted += 1
                outputs[s] += [*draft[:accepted], targets[accepted]]
                self.run_stats["drafts"] += bool(draft)
                self.run_stats["draft_tokens"] += len(draft)
                self.run_stats["accepted_tokens"] += accepted
                kept = len(prompts[s]) + len(outputs[s]) - 1  # positions below it hold kept tokens
                self.lib.llama_memory_seq_rm(memory, s, kept, -1)
        return outputs


if __name__ == "__main__":
    sys.exit(serve(load))
