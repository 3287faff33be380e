"""Decode CPU time per token of one stream on a GGUF file, one thread, in pagedkv or llama.cpp.

A 128-token prompt, then 128 greedy tokens (EOS ignored); the figure is the process's CPU time of
the 128-token run less that of a 1-token run, per token (median of 3; the minimum beside it).
CPU time, not wall time: on a machine other work shares it is what the step itself cost, though
shared caches and a busy sibling hyperthread still slow it. Run each engine with its own Python:

  OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/gguf_decode_cpu_time.py FILE pagedkv q8
  $RIVALS/llamacpp/bin/python benchmarks/gguf_decode_cpu_time.py FILE llamacpp

``pagedkv MODE``: the engine's ``quantized_activations`` (float, q8, q8-all).
"""

from __future__ import annotations

import statistics
import sys
import time

PROMPT = [(i * 37) % 40000 + 100 for i in range(128)]


def pagedkv_runner(path: str, mode: str):
    import torch

    from pagedkv import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(
        path,
        dtype="float32",
        quantized_activations=mode,
        max_model_len=512,
        kv_cache_memory="256MiB",
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
    )

    def run(tokens: int) -> None:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)

    return run


def llamacpp_runner(path: str):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)

    def run(tokens: int) -> None:
        llm.reset()
        llm.eval(PROMPT)
        for _ in range(tokens - 1):
            llm.eval([llm.sample(temp=0.0)])

    return run


def cpu_seconds(run, tokens: int) -> float:
    start = time.process_time()
    run(tokens)
    return time.process_time() - start


def main() -> None:
    path, engine = sys.argv[1], sys.argv[2]
    run = pagedkv_runner(path, sys.argv[3]) if engine == "pagedkv" else llamacpp_runner(path)
    run(8)  # warm up
    per_token = [(cpu_seconds(run, 129) - cpu_seconds(run, 1)) / 128 * 1e3 for _ in range(3)]
    label = engine if engine != "pagedkv" else f"pagedkv {sys.argv[3]}"
    print(f"{label}: decode {statistics.median(per_token):.2f} ms/token CPU (min {min(per_token):.2f})")


if __name__ == "__main__":
    main()
