"""Seeded request-length workloads: what the naive and paged allocators are compared on.

Every experiment draws its requests from one :class:`Workload` with a numpy ``Generator``
seeded from ``--seed``, so a figure is a function of (workload, seed, options) and nothing else.

The three workloads (all lengths in tokens, every request capped at ``max_seq_len``):

* ``normal`` -- the classic tutorial setting: response lengths ~ Normal(500, 200) clipped to
  [200, max_seq_len]. A request also needs a prompt, or a snapshot taken mid-generation would
  see almost nothing stored; prompts are ~ Normal(250, 100) clipped to [16, max_seq_len // 2],
  and the response is then cut so that prompt + response <= max_seq_len.
* ``sharegpt`` -- a ShareGPT-like chat mix: log-normal prompts (mean ~160, long tail) and
  log-normal outputs (mean ~340), the shape of the conversation lengths behind the PagedAttention
  paper's ShareGPT experiments.
* ``shared-prefix`` -- every request starts with the same ``prefix_len``-token system prompt,
  followed by a unique log-normal user part (mean ~100) and a Normal(500, 200) response.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

WORKLOAD_NAMES = ("normal", "sharegpt", "shared-prefix")

# Sampling is done in chunks of this many requests; a stream is reproducible for any chunk size
# only if the size is fixed, so it is a constant, not an option.
_CHUNK = 256


@dataclass(frozen=True)
class Request:
    """One request's lengths: it is prefilled with ``prompt_len`` tokens and then generates
    ``output_len`` more, one per decode step. ``shared_prefix_len`` leading prompt tokens are the
    workload's common system prompt (0 when there is none)."""

    prompt_len: int
    output_len: int
    shared_prefix_len: int = 0

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class LiveRequest:
    """A request caught mid-life: ``tokens`` (prompt + generated so far) are stored right now."""

    request: Request
    tokens: int

    def __post_init__(self) -> None:
        if not self.request.prompt_len <= self.tokens <= self.request.final_len:
            raise ValueError(
                f"a live request stores between its prompt ({self.request.prompt_len}) and final "
                f"length ({self.request.final_len}) tokens, got {self.tokens}"
            )


@dataclass(frozen=True)
class Workload:
    """A named length distribution. ``prefix_len`` is used only by ``shared-prefix``."""

    name: str = "normal"
    max_seq_len: int = 2048
    prefix_len: int = 600

    def __post_init__(self) -> None:
        if self.name not in WORKLOAD_NAMES:
            raise ValueError(f"unknown workload {self.name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 4:
            raise ValueError(f"max_seq_len must be an integer >= 4, got {self.max_seq_len!r}")
        if self.name == "shared-prefix" and not 0 < self.prefix_len <= self.max_seq_len - 2:
            raise ValueError(
                f"prefix_len must be in [1, max_seq_len - 2] = [1, {self.max_seq_len - 2}], "
                f"got {self.prefix_len!r}"
            )

    def sample(self, rng: np.random.Generator, n: int) -> list[Request]:
        """``n`` independent requests."""
        if n < 0:
            raise ValueError(f"cannot sample a negative number of requests ({n})")
        prompt, output = _SAMPLERS[self.name](self, rng, n)
        prefix = self.prefix_len if self.name == "shared-prefix" else 0
        return [Request(int(p), int(o), prefix) for p, o in zip(prompt, output, strict=True)]

    def stream(self, rng: np.random.Generator) -> Iterator[Request]:
        """An endless stream of requests (for closed loops that need 'the next one')."""
        while True:
            yield from self.sample(rng, _CHUNK)


def _fit(workload: Workload, prompt: np.ndarray, output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round to whole tokens, keep at least one of each, cut the output to the context limit."""
    prompt = np.clip(np.rint(prompt), 1, workload.max_seq_len - 1).astype(np.int64)
    output = np.clip(np.rint(output), 1, workload.max_seq_len - prompt).astype(np.int64)
    return prompt, output


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """Log-normal samples with the given mean (not median): mu = ln(mean) - sigma^2 / 2."""
    return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)


def _normal(workload: Workload, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    prompt = np.clip(rng.normal(250, 100, n), 16, workload.max_seq_len // 2)
    output = np.clip(rng.normal(500, 200, n), 200, workload.max_seq_len)
    return _fit(workload, prompt, output)


def _sharegpt(workload: Workload, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return _fit(workload, _lognormal(rng, 160, 1.0, n), _lognormal(rng, 340, 0.9, n))


def _shared_prefix(workload: Workload, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    unique = np.minimum(_lognormal(rng, 100, 0.8, n), workload.max_seq_len)
    prompt = np.minimum(workload.prefix_len + np.maximum(np.rint(unique), 1), workload.max_seq_len - 1)
    output = np.clip(rng.normal(500, 200, n), 200, workload.max_seq_len)
    return _fit(workload, prompt, output)


_SAMPLERS = {"normal": _normal, "sharegpt": _sharegpt, "shared-prefix": _shared_prefix}


def poisson_arrivals(rng: np.random.Generator, rate: float, steps: int) -> np.ndarray:
    """Arrivals per step for a Poisson process of ``rate`` requests per step."""
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 requests per step, got {rate!r}")
    if steps <= 0:
        raise ValueError(f"a trace needs at least one step, got {steps!r}")
    return rng.poisson(rate, steps)
