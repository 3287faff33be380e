"""What ``pagedkv bench quality`` measures, and on which text.

Torch-free: the command line builds its parser from this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.memory.spec import KV_CACHE_DTYPE_NAMES

#: The reference every other KV cache dtype is compared with: the model's own dtype.
REFERENCE = "auto"


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class QualityConfig:
    """The quality of each KV cache dtype against ``auto``, on held-out text of the built-in model.

    - perplexity of the held-out stdlib files (at most ``max_heldout_chars`` characters; None:
      all of them) in windows of ``window`` tokens every ``stride`` (None: ``window``, the
      training script's held-out figure), through prompt logprobs;
    - the logits' error: the first ``logits_rows`` rows of those windows' logits, each dtype's
      against ``auto``'s (max and mean absolute difference);
    - greedy agreement: ``num_prompts`` prompts of ``prompt_len`` held-out tokens, each continued
      by ``gen_tokens`` greedy tokens (EOS ignored), compared position by position with ``auto``.

    ``goal_pct``: the most a dtype's perplexity may rise over ``auto``'s, in percent (the issue's
    goal is 1 %); the command exits with status 1 when one rises more.
    """

    kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPE_NAMES
    max_heldout_chars: int | None = None
    window: int = 256
    stride: int | None = None
    logits_rows: int = 8192
    num_prompts: int = 8
    prompt_len: int = 128
    gen_tokens: int = 256
    goal_pct: float = 1.0
    #: KV blocks of every engine: the same pool for every dtype, so each is scheduled alike and
    #: the logits rows line up (a quantized cache would otherwise hold more blocks).
    num_kv_blocks: int = 2048

    def __post_init__(self) -> None:
        unknown = [d for d in self.kv_cache_dtypes if d not in KV_CACHE_DTYPE_NAMES]
        if unknown or not self.kv_cache_dtypes:
            raise ValueError(
                f"kv_cache_dtypes must be among {KV_CACHE_DTYPE_NAMES}, got {self.kv_cache_dtypes!r}"
            )
        if self.max_heldout_chars is not None:
            _positive("max_heldout_chars", self.max_heldout_chars)
        for name in ("window", "logits_rows", "num_prompts", "prompt_len", "gen_tokens", "num_kv_blocks"):
            _positive(name, getattr(self, name))
        if self.window < 2:
            raise ValueError(f"window must hold at least 2 tokens, got {self.window}")
        if self.stride is not None and not 1 <= self.stride <= self.window:
            raise ValueError(f"stride must be in [1, window = {self.window}], got {self.stride!r}")
        if not self.goal_pct >= 0:
            raise ValueError(f"goal_pct must be >= 0, got {self.goal_pct!r}")

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes to run, ``auto`` first (the others are compared with it)."""
        return (REFERENCE, *(d for d in dict.fromkeys(self.kv_cache_dtypes) if d != REFERENCE))

    @property
    def max_model_len(self) -> int:
        """Context of every engine: a window plus its one generated token, a prompt plus its output."""
        return max(self.window + 1, self.prompt_len + self.gen_tokens)
