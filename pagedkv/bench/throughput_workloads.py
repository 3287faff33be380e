"""The offline workloads of ``pagedkv bench throughput``: seeded token-id prompts and output lengths.

Every engine -- pagedkv, transformers, vLLM, llama.cpp -- receives exactly these ids, built once
by the driver and sent to rival workers as JSON, so a difference in tokens/s is a difference in
engines, never in inputs. Pure Python (no torch): rival workers never import it, but its JSON
form (:meth:`Workload.to_json`) is what they read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: Workload names in table order. ``single`` is one request; its ``-prefill`` twin (the same
#: prompt, one new token) lets every engine's decode latency be measured the same way.
WORKLOAD_NAMES = ("mixed", "uniform", "single")
#: Ids below this are kept out of prompts: they are special tokens (unk, bos, eos) in the
#: SentencePiece vocabulary llama.cpp sees.
FIRST_PROMPT_ID = 4


@dataclass(frozen=True)
class WorkloadShape:
    """How big a run is. The issue's shape is the default: 32 requests of 128 + 128 tokens."""

    num_requests: int = 32
    prompt_len: int = 128
    max_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_len", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """One batch of requests, all submitted at once, greedy, ``ignore_eos``."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def generated_tokens(self) -> int:
        """The tokens every engine must produce: each request's own ``max_tokens``."""
        return sum(self.max_tokens)

    @property
    def max_total_len(self) -> int:
        return max(len(p) + m for p, m in zip(self.prompts, self.max_tokens, strict=True))

    def decode_batch_sizes(self) -> list[int]:
        """Running requests at each decode step when all start together: step t (t >= 1, the
        first token comes from the prompt's pass) runs the requests that want more than t tokens."""
        longest = max(self.max_tokens)
        return [sum(m > t for m in self.max_tokens) for t in range(1, longest)]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "prompts": [list(p) for p in self.prompts],
            "max_tokens": list(self.max_tokens),
        }

    def with_max_tokens(self, name: str, max_tokens: int) -> Workload:
        """The same prompts, each asking for ``max_tokens`` new tokens."""
        return Workload(name, self.prompts, (max_tokens,) * self.num_requests)


def build_workload(name: str, shape: WorkloadShape, vocab_size: int) -> Workload:
    """The named workload of ``shape``; same name, shape and vocabulary, same ids.

    ``uniform``: ``num_requests`` x (``prompt_len`` prompt + ``max_tokens`` new).
    ``mixed``: ``num_requests`` requests whose prompt and output lengths are drawn uniformly from
    [L/8, 2L] for L = ``prompt_len`` and ``max_tokens`` -- for 128 that is [16, 256], the mix of
    the former ``benchmarks/throughput.py --mixed`` (same seed, same lengths and ids).
    ``single``: one request of ``prompt_len`` + ``max_tokens`` (the first ``uniform`` prompt).
    """
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOAD_NAMES}")
    if vocab_size <= FIRST_PROMPT_ID:
        raise ValueError(f"a vocabulary of {vocab_size} tokens leaves no ids for prompts")
    rng = random.Random(shape.seed)  # as the former benchmarks/throughput.py drew it
    if name == "mixed":
        lengths = [
            (
                rng.randint(max(1, shape.prompt_len // 8), 2 * shape.prompt_len),
                rng.randint(max(1, shape.max_tokens // 8), 2 * shape.max_tokens),
            )
            for _ in range(shape.num_requests)
        ]
    elif name == "uniform":
        lengths = [(shape.prompt_len, shape.max_tokens)] * shape.num_requests
    else:
        lengths = [(shape.prompt_len, shape.max_tokens)]
    prompts = tuple(tuple(rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(p)) for p, _ in lengths)
    return Workload(name, prompts, tuple(o for _, o in lengths))


def build_workloads(names: tuple[str, ...], shape: WorkloadShape, vocab_size: int) -> list[Workload]:
    """The workloads to run, in table order, and for ``single`` its one-token twin
    ``single-prefill`` (time to first token), from which decode ms/token follows."""
    workloads = []
    for name in WORKLOAD_NAMES:
        if name in names:
            workload = build_workload(name, shape, vocab_size)
            workloads.append(workload)
            if name == "single":
                workloads.append(workload.with_max_tokens("single-prefill", 1))
    return workloads
