"""How many tokens each sequence proposes this step: speculation where it pays, none where not.

Verification is not free: each proposed token is one more query row in the step, and a step
that verifies anything leaves the decode-only path (one query row per sequence) for the general
one. The policy weighs that against what the proposals are expected to yield.

**Cost model** (:class:`StepCostModel`, in units of an empty step): a step of ``n`` query rows
costs ``1 + n / saturation_tokens`` -- nearly flat while the weights' reads dominate, linear
once the arithmetic does -- plus ``verify_overhead`` when it verifies. Plain decoding of ``B``
sequences yields ``B`` tokens for ``cost(B)``.

**Per sequence** (:class:`AcceptanceEstimate`): ``rate`` estimates the chance that a proposed
token is accepted given the ones before it were: accepted tokens over accepted tokens plus
rejections, each count decayed by ``decay`` per draft so that it follows the text (a model
that starts repeating itself is noticed within a few drafts). Proposed token ``j`` is accepted
with chance ``rate ** j``; the row it costs is worth it while that chance beats the share of the
step a row costs per token the step yields, ``(1 / saturation_tokens) * B / cost(B)``. So ``k``
is the largest ``j <= num_speculative_tokens`` above that bar, and 0 -- *backed off* -- when even
the first token is below it.

**Per step** (:meth:`SpecPolicy.verify_lengths`, after proposing): the step verifies only if the
tokens it expects, ``B + sum(rate + ... + rate ** k_i)``, per unit of its cost beat plain
decoding's ``B / cost(B)``; otherwise it decodes plainly. It also never verifies while more than
``disable_by_batch_size`` sequences decode, and trims proposals to the step's token budget.

**Probing**: once every ``probe_interval`` steps (the same step for every sequence, so that
their probes share one verifying step), a backed-off sequence proposes one token and the step
verifies whatever was proposed. When nothing is ever accepted, speculation costs one verifying
step in ``probe_interval``; when acceptance comes back, the estimates rise and ``k`` with them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCostModel:
    """A forward pass's time in units of an empty step (see the module docstring)."""

    #: Query rows at which a step costs twice an empty one.
    saturation_tokens: float = 64.0
    #: Extra cost of a step that verifies, over one of the same rows that only decodes.
    verify_overhead: float = 1.0

    def __post_init__(self) -> None:
        if not self.saturation_tokens > 0 or not self.verify_overhead >= 0:
            raise ValueError(
                f"StepCostModel needs saturation_tokens > 0 and verify_overhead >= 0, got "
                f"{self.saturation_tokens} and {self.verify_overhead}"
            )

    def step_cost(self, rows: int, verifies: bool) -> float:
        return 1.0 + rows / self.saturation_tokens + (self.verify_overhead if verifies else 0.0)

    def row_bar(self, batch: int) -> float:
        """The acceptance chance a proposed token needs to be worth its row."""
        return (1.0 / self.saturation_tokens) * batch / self.step_cost(batch, verifies=False)


@dataclass
class AcceptanceEstimate:
    """Decayed counts of accepted tokens and of rejections of one sequence's drafts."""

    accepted: float
    rejected: float

    @property
    def rate(self) -> float:
        """Chance that a proposed token is accepted, given the ones before it were."""
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int, decay: float) -> None:
        self.accepted = decay * self.accepted + num_accepted_tokens
        self.rejected = decay * self.rejected + (num_accepted_tokens < num_draft_tokens)

    def expected_accepted(self, k: int) -> float:
        """Tokens a draft of ``k`` is expected to keep: ``rate + rate**2 + ... + rate**k``."""
        rate = self.rate
        return sum(rate**j for j in range(1, k + 1))


class SpecPolicy:
    """Chooses each decoding sequence's draft length, step by step (see the module docstring).

    A step calls :meth:`draft_lengths` (how much to propose), then, once the proposals are
    known, :meth:`verify_lengths` (how much of them to verify), then :meth:`observe` for every
    verified draft; :meth:`release` forgets a finished sequence.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        max_num_batched_tokens: int,
        disable_by_batch_size: int | None = None,
        cost: StepCostModel | None = None,
        probe_interval: int = 32,
        decay: float = 0.8,
        prior: tuple[float, float] = (3.0, 1.0),
    ) -> None:
        if num_speculative_tokens < 1 or max_num_batched_tokens < 1 or probe_interval < 1:
            raise ValueError(
                "SpecPolicy needs num_speculative_tokens, max_num_batched_tokens and probe_interval "
                f">= 1, got {num_speculative_tokens}, {max_num_batched_tokens} and {probe_interval}"
            )
        if not 0 < decay <= 1 or min(prior) <= 0:
            raise ValueError(
                f"SpecPolicy needs 0 < decay <= 1 and positive prior counts, got {decay}, {prior}"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.cost = cost or StepCostModel()
        self.probe_interval = probe_interval
        self.decay = decay
        #: Counts a new sequence starts from: an optimistic guess, soon outweighed by its drafts.
        self.prior = prior
        self._estimates: dict[Hashable, AcceptanceEstimate] = {}
        self._step = 0

    def estimate(self, seq_id: Hashable) -> AcceptanceEstimate:
        found = self._estimates.get(seq_id)
        if found is None:
            found = self._estimates[seq_id] = AcceptanceEstimate(*self.prior)
        return found

    @property
    def is_probe_step(self) -> bool:
        """Whether the step :meth:`draft_lengths` was last called for probes backed-off sequences."""
        return self._step % self.probe_interval == 0

    def draft_lengths(self, seq_ids: Sequence[Hashable], room: Sequence[int]) -> list[int]:
        """How many tokens each of this step's decoding sequences should propose (0: none),
        at most ``room[i]`` (what its ``max_tokens`` and the context length leave after the
        token the step adds anyway). All 0 when even full proposals would not pay for a
        verifying step, except on probe steps, where every sequence that would not speculate
        proposes one token."""
        self._step += 1
        batch = len(seq_ids)
        if self.disable_by_batch_size is not None and batch > self.disable_by_batch_size:
            return [0] * batch
        bar = self.cost.row_bar(batch)
        lengths = [
            max(0, min(self._worth(self.estimate(seq_id).rate, bar), limit))
            for seq_id, limit in zip(seq_ids, room, strict=True)
        ]
        pays = self._pays(seq_ids, lengths)
        if self.is_probe_step:  # one token from each sequence the step would not hear from
            probe = [max(0, min(1, limit)) for limit in room]
            return [k if pays and k else one for k, one in zip(lengths, probe, strict=True)]
        return lengths if pays else [0] * batch

    def _worth(self, rate: float, bar: float) -> int:
        """The largest ``j <= num_speculative_tokens`` with ``rate ** j > bar``."""
        k = 0
        while k < self.num_speculative_tokens and rate ** (k + 1) > bar:
            k += 1
        return k

    def verify_lengths(
        self, seq_ids: Sequence[Hashable], proposal_lengths: Sequence[int], other_tokens: int = 0
    ) -> list[int]:
        """The proposal lengths this step verifies: all 0 when the step is better off decoding
        plainly (probe steps excepted), trimmed so that the step's rows plus ``other_tokens``
        (prompt chunks in the same step) fit ``max_num_batched_tokens``."""
        batch = len(seq_ids)
        lengths = list(proposal_lengths)
        if not any(lengths):
            return lengths
        if not self.is_probe_step and not self._pays(seq_ids, lengths):
            return [0] * batch  # the proposals came out shorter than hoped
        over = batch + sum(lengths) + other_tokens - self.max_num_batched_tokens
        while over > 0 and any(lengths):
            longest = max(range(batch), key=lambda i: (lengths[i], -self.estimate(seq_ids[i]).rate))
            lengths[longest] -= 1
            over -= 1
        return lengths

    def _pays(self, seq_ids: Sequence[Hashable], lengths: list[int]) -> bool:
        """Whether verifying ``lengths`` yields more tokens per unit of cost than plain decoding."""
        batch = len(seq_ids)
        expected = batch + sum(
            self.estimate(seq_id).expected_accepted(k) for seq_id, k in zip(seq_ids, lengths, strict=True)
        )
        speculative = expected / self.cost.step_cost(batch + sum(lengths), verifies=True)
        return speculative > batch / self.cost.step_cost(batch, verifies=False)

    def observe(self, seq_id: Hashable, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record a verified draft of ``seq_id`` (nothing for an empty one)."""
        if num_draft_tokens:
            self.estimate(seq_id).observe(num_draft_tokens, num_accepted_tokens, self.decay)

    def release(self, seq_id: Hashable) -> None:
        """Forget a finished sequence (idempotent)."""
        self._estimates.pop(seq_id, None)
