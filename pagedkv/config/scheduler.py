"""The scheduler's part of the engine's settings: how many sequences and tokens a step takes,
how admission keeps room for growth, and the order requests are served in (vLLM's
``SchedulerConfig``). Prefill is always chunked: a prompt longer than the step's token budget
runs over several steps."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.config.checks import one_of, positive_int, unit_fraction

#: vLLM's ``--scheduling-policy`` values (see ``engine/core/fairness.py``).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching's limits and policies, checked when made."""

    max_num_seqs: int
    #: Tokens one step computes, prompt chunks and decodes together.
    max_num_batched_tokens: int
    #: Share of each running request's remaining ``max_tokens`` that paged admission keeps room
    #: for (see ``engine/core/headroom.py``): 1.0 never over-commits; 0 admits on the prompt alone.
    decode_headroom: float
    #: "fcfs" or "priority": with "priority", a request's ``priority`` (lower first) orders
    #: admission and preemption (see ``engine/core/fairness.py``).
    scheduling_policy: str
    #: The ``priority`` values a request may carry under the "priority" policy; 0 (the
    #: default priority) is always inside.
    min_priority: int
    max_priority: int
    #: Most of the running slots and KV blocks one client request may hold while others wait;
    #: 1.0: no limit.
    max_running_share: float

    def __post_init__(self) -> None:
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        unit_fraction("decode_headroom", self.decode_headroom)
        one_of("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if not self.min_priority <= 0 <= self.max_priority:
            raise ValueError(
                f"min_priority <= 0 <= max_priority must hold (0 is the default priority), "
                f"got min_priority={self.min_priority}, max_priority={self.max_priority}"
            )
        if not 0.0 < self.max_running_share <= 1.0:
            raise ValueError(f"max_running_share must be in (0, 1], got {self.max_running_share}")

    @property
    def priority_range(self) -> tuple[int, int]:
        """(min_priority, max_priority): the values a request's ``priority`` may take."""
        return self.min_priority, self.max_priority
