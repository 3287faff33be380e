"""vLLM as a ``pagedkv bench throughput`` rival: ``VLLM_PYTHON vllm_worker.py``.

Imports only the standard library, vLLM and :mod:`worker_io` (see it for the protocol). Runs
vLLM the way the benchmark compares it: the engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), no tokenizer (token-id prompts,
``skip_tokenizer_init=True``), prefix caching off (every run repeats the same prompts, and
pagedkv runs without it too), the benchmark's ``load_format`` (``dummy``: vLLM's own random
weights of the config's shape).

Its CPU build runs eagerly with ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache; OpenMP threads are
bound to CPUs ``0..threads-1`` unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise: vLLM's
``auto`` binding keeps one core of a 2-core machine for its scheduler and would run its kernels
on one thread. On CUDA it runs as it is served, with its CUDA graphs, on
:data:`GPU_MEMORY_SHARE` of the GPU's memory: the benchmark's other engines hold theirs in the
driver's process meanwhile.
"""

from __future__ import annotations

import os
import sys

from worker_io import not_importable, serve


def load(command: dict):
    threads = int(command["threads"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(command.get("kv_cache_gib", 2)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # else vLLM drops torch to one thread
    try:
        import vllm
    except ImportError as err:
        sys.exit(not_importable("vllm", err))
    return VllmEngine(vllm, command)


#: the share of the GPU's memory vLLM takes on CUDA (its default, 0.9, would leave none to the others)
GPU_MEMORY_SHARE = 0.3


class VllmEngine:
    def __init__(self, vllm, command: dict) -> None:
        self.vllm = vllm
        cuda = command.get("device", "cpu") == "cuda"
        device_options = {"gpu_memory_utilization": GPU_MEMORY_SHARE} if cuda else {}
        self.llm = vllm.LLM(
            model=command["model"],
            dtype=command["dtype"],
            skip_tokenizer_init=True,
            enforce_eager=not cuda,
            enable_prefix_caching=False,
            max_num_seqs=max(int(command["max_requests"]), 1),
            max_model_len=max(int(command["max_total_len"]), 16),  # the workloads' and the warm-up's
            load_format=command.get("load_format", "auto"),
            seed=0,
            **device_options,
        )
        self.info = {
            "engine": "vLLM",
            "version": vllm.__version__,
            "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "kv_cache_gib": os.environ["VLLM_CPU_KVCACHE_SPACE"],
        }
        import torch  # vLLM's own dependency; its thread count is what the kernels run on

        self.info["torch_threads"] = torch.get_num_threads()
        self.generate([[5, 6, 7, 8, 9, 10, 11, 12]] * 2, [4, 4])  # warm-up

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [
            self.vllm.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
            for m in max_tokens
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


if __name__ == "__main__":
    sys.exit(serve(load))
