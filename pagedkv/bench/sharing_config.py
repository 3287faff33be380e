"""The sharing benchmark's experiments: a shared system prompt, and parallel samples and beams."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.bench.driver import FIRST_TOKEN_ID
from pagedkv.sim.workloads import Workload

#: Length mixes of the samples-and-beams experiment.
MIXES = ("alpaca", "sharegpt")
FORK_KINDS = ("parallel", "beam")
#: Means of the PagedAttention paper's Alpaca trace (Fig. 11: ShareGPT has 8.4x longer prompts
#: and 5.8x longer outputs, 161 and 338 tokens on average). Log-normal spreads are our choice.
ALPACA_PROMPT_MEAN, ALPACA_OUTPUT_MEAN, ALPACA_SIGMA = 19.3, 58.5, 0.5
#: Memory saved by sharing in the paper (Fig. 15 and Sec. 6.3), OPT-13B, widths 2, 4 and 6.
PAPER_SAVING = {
    "alpaca": {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)},
    "sharegpt": {"parallel": (0.162, 0.305), "beam": (0.443, 0.663)},
}


def _positive_ints(name: str, values: tuple[int, ...]) -> None:
    if not values or any(not isinstance(v, int) or v <= 0 for v in values):
        raise ValueError(f"{name} must be a non-empty list of positive integers, got {values!r}")


@dataclass(frozen=True)
class PrefixConfig:
    """Shared system prompt: for each prefix length ``S`` and request count ``N``, ``N`` requests
    of ``S`` common + ``user_len`` unique prompt tokens, ``output_len`` greedy tokens each.
    Lengths are divided by the engine options' ``scale``."""

    prefix_lens: tuple[int, ...] = (256, 1024)
    num_requests: tuple[int, ...] = (1, 4, 16, 64)
    user_len: int = 32
    output_len: int = 16
    warm: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_ints("prefix_lens", self.prefix_lens)
        _positive_ints("num_requests", self.num_requests)
        for name in ("user_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def lengths(self, prefix_len: int, scale: int) -> tuple[int, int, int]:
        """(prefix, user part, output) lengths of a run at ``scale``."""
        if prefix_len % scale:
            raise ValueError(f"scale {scale} must divide every prefix length, got {prefix_len}")
        return prefix_len // scale, max(1, self.user_len // scale), max(1, self.output_len // scale)

    def prompts(self, prefix_len: int, user_len: int, count: int, vocab_size: int) -> list[list[int]]:
        """``count`` prompts: one common prefix, then unique user parts (seeded per prefix length)."""
        rng = np.random.default_rng([self.seed, prefix_len])
        prefix = rng.integers(FIRST_TOKEN_ID, vocab_size, prefix_len).tolist()
        users = rng.integers(FIRST_TOKEN_ID, vocab_size, (count, user_len)).tolist()
        return [prefix + user for user in users]


@dataclass(frozen=True)
class ForkConfig:
    """Parallel sampling and beam search: ``num_prompts`` prompts from the ``mix``, each decoded
    with every width in ``widths`` as ``n`` samples and as that many beams."""

    mix: str = "alpaca"
    num_prompts: int = 16
    widths: tuple[int, ...] = (2, 4, 6)
    max_model_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mix not in MIXES:
            raise ValueError(f"mix must be one of {MIXES}, got {self.mix!r}")
        _positive_ints("widths", self.widths)
        if not isinstance(self.num_prompts, int) or self.num_prompts <= 0:
            raise ValueError(f"num_prompts must be a positive integer, got {self.num_prompts!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 4:
            raise ValueError(f"max_model_len must be an integer >= 4, got {self.max_model_len!r}")

    def lengths(self, scale: int = 1) -> list[tuple[int, int]]:
        """(prompt, output) length per prompt, divided by ``scale``.

        ``alpaca``: log-normal prompts and outputs with the paper's Alpaca means (19.3 and 58.5
        tokens); ``sharegpt``: the simulator's ShareGPT mix (means ~160 and ~340).
        """
        rng = np.random.default_rng([self.seed, 7])
        if self.mix == "alpaca":
            prompt = _lognormal(rng, ALPACA_PROMPT_MEAN, ALPACA_SIGMA, self.num_prompts)
            output = _lognormal(rng, ALPACA_OUTPUT_MEAN, ALPACA_SIGMA, self.num_prompts)
            pairs = list(zip(np.rint(prompt).astype(int), np.rint(output).astype(int), strict=True))
        else:
            sampled = Workload("sharegpt", self.max_model_len).sample(rng, self.num_prompts)
            pairs = [(r.prompt_len, r.output_len) for r in sampled]
        limit = self.max_model_len // scale
        lengths = []
        for p, o in pairs:
            p = min(max(1, int(p) // scale), limit - 1)
            lengths.append((p, min(max(1, int(o) // scale), limit - p)))
        return lengths

    def requests(self, vocab_size: int, scale: int = 1) -> list[tuple[list[int], int]]:
        """(prompt token ids, output length) per prompt; token ids seeded apart from lengths."""
        rng = np.random.default_rng([self.seed, 8])
        return [(rng.integers(FIRST_TOKEN_ID, vocab_size, p).tolist(), o) for p, o in self.lengths(scale)]


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """Log-normal samples with the given mean (not median)."""
    return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
