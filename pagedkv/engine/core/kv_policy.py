"""How admission reserves KV memory: paged, or the contiguous reservations it replaced.

``paged`` (the default) takes blocks for the prompt only and one more block whenever a sequence
crosses a block boundary; sequences share blocks (forks, prefix caching). The two contiguous
policies behave like the systems PagedAttention replaced, on the same pool and kernels, so that
only the allocation policy differs when they are compared: ``contiguous`` reserves
``max_model_len`` slots per sequence at admission, ``contiguous-oracle`` exactly prompt +
``max_tokens`` (the oracle of the PagedAttention paper). A contiguous reservation is private
memory: it never shares a block, so it never reuses a cached prefix either.

Everything that depends on the policy -- the scheduler's admission, request validation, the
prefix cache switch, the benchmarks' predictions -- asks the policy object; nothing compares
its name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Reservation(enum.Enum):
    """What a sequence holds from admission on, beyond the tokens it has."""

    NOTHING = "nothing"  # blocks on demand
    MAX_MODEL_LEN = "max_model_len"
    PROMPT_AND_MAX_TOKENS = "prompt + max_tokens"


@dataclass(frozen=True)
class KVPolicy:
    """One KV allocation policy; see the module docstring."""

    name: str
    reservation: Reservation
    #: Forks share blocks copy-on-write; without sharing a fork copies its parent's blocks.
    shares_blocks: bool

    @property
    def grows_on_demand(self) -> bool:
        """Blocks come as tokens do, so admission must leave room for growth (headroom)."""
        return self.reservation is Reservation.NOTHING

    @property
    def allows_prefix_caching(self) -> bool:
        """A cached prefix is a shared block, so only a sharing policy can reuse one."""
        return self.shares_blocks

    def reserved_tokens(self, prompt_len: int, max_tokens: int, max_model_len: int) -> int:
        """Token slots held at admission (0: only what the prompt needs)."""
        if self.reservation is Reservation.MAX_MODEL_LEN:
            return max_model_len
        if self.reservation is Reservation.PROMPT_AND_MAX_TOKENS:
            return prompt_len + max_tokens
        return 0

    def peak_tokens(self, prompt_len: int, max_tokens: int, max_model_len: int) -> int:
        """The most token slots a request can ever hold under this policy."""
        return max(prompt_len + max_tokens, self.reserved_tokens(prompt_len, max_tokens, max_model_len))

    @classmethod
    def named(cls, policy: str | KVPolicy) -> KVPolicy:
        """The policy called ``policy`` (a policy passes through); a clear error if unknown."""
        if isinstance(policy, KVPolicy):
            return policy
        for known in KV_POLICIES:
            if known.name == policy:
                return known
        raise ValueError(f"kv_policy must be one of {POLICY_NAMES}, got {policy!r}")

    def __str__(self) -> str:
        return self.name


PAGED = KVPolicy("paged", Reservation.NOTHING, shares_blocks=True)
CONTIGUOUS = KVPolicy("contiguous", Reservation.MAX_MODEL_LEN, shares_blocks=False)
CONTIGUOUS_ORACLE = KVPolicy("contiguous-oracle", Reservation.PROMPT_AND_MAX_TOKENS, shares_blocks=False)
#: Every policy, in the order tables and plots show them.
KV_POLICIES = (PAGED, CONTIGUOUS, CONTIGUOUS_ORACLE)
POLICY_NAMES = tuple(policy.name for policy in KV_POLICIES)
