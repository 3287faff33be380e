"""Decode headroom: admit a request only if the running ones can still grow to their end.

Why: paged admission used to look at the prompt alone. An offline batch then filled the pool
with prompts, every sequence grew a block at a time, the pool ran dry and the scheduler threw
computed tokens away (preemption by recompute) -- a third of all the work in the capacity
benchmark. Reserving each request's whole ``prompt + max_tokens`` up front avoids that but is
the contiguous oracle again: the capacity paging exists to win is gone.

The middle way, used here, is a *projection*: every running sequence gains one token per step
(the scheduler runs every decode each step), and one that has appended its remaining tokens
finishes and returns its private blocks. So the blocks the running set will still take at a
future step ``k`` is the growth of the sequences still alive at ``k`` minus what the finished
ones gave back; its maximum over ``k`` -- reached just before some sequence finishes -- is the
pool the running set still needs. A request is admitted only if its prompt blocks plus that
peak, computed with it included, fit in the free blocks (less the watermark). Requests finish
at different times, so the peak is far below the sum of their final sizes: paged still runs
many more requests at once than a contiguous reservation, without over-committing.

The projection is exact when every running sequence really gains one token per step: the step
budget covers every decode plus a prompt, so an admitted prompt is computed by the next step
(what the property test checks: no preemption at all). Otherwise it is an estimate -- a prompt
split into chunks is assumed to get the whole budget each step, a beam search's forks are
bounded by its width -- and the watermark absorbs the slack; a preemption is then still
possible, and still safe.

``ratio`` scales the tokens each request is assumed to still generate: 1.0 takes
``max_tokens`` at its word (exact for ``ignore_eos``; an upper bound otherwise), smaller values
bet that outputs stop early (SGLang's ``new_token_ratio``), trading preemptions for concurrency.
The arithmetic (:class:`Growth`, :func:`peak_new_blocks`) is pure; :class:`Headroom` reads the
scheduler's sequences and the KV manager to build it. A refusal is kept while it provably
stands (:class:`Refusal`), so the steps between two finishes do not project the running set
again only to refuse the same request.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from pagedkv.engine.core.sequence import Sequence
from pagedkv.memory import KVCacheManager, blocks_for


@dataclass(frozen=True, slots=True)
class Growth:
    """What one sequence (or a request not yet forked into its samples) will still take."""

    #: Token slots its block table holds now.
    slots: int
    #: Tokens it may still append before it finishes.
    remaining: int
    #: Steps before its first append (prompt chunks still to compute).
    delay: int = 0
    #: Blocks it holds now that go back to the pool when it finishes (its private ones).
    held: int = 0
    #: Sequences it becomes: ``n`` samples or beams fork from it once the prompt is computed,
    #: each growing on its own.
    copies: int = 1
    #: Blocks copied at its first append (a shared, partly filled last block: copy-on-write).
    copy_on_write: int = 0

    @property
    def finish_step(self) -> int:
        """The step (0 = the current one) after which it is done and its blocks are back."""
        return self.delay + self.remaining

    def new_blocks(self, step: int, block_size: int) -> int:
        """Blocks it has taken beyond what it holds now, once ``step`` steps have run."""
        appended = min(max(step - self.delay, 0), self.remaining)
        if appended == 0:
            return 0
        grown = blocks_for(self.slots + appended, block_size) - blocks_for(self.slots, block_size)
        return self.copies * grown + self.copy_on_write


def peak_new_blocks(growths: Iterable[Growth], block_size: int) -> int:
    """The most blocks, beyond those in use now, that these sequences hold at any future step.

    At step ``k`` the sequences with ``finish_step >= k`` hold ``new_blocks(k)`` more than now;
    those done earlier hold nothing: their growth is gone and their ``held`` blocks are back.
    Between two finishes the total only grows, so the maximum is at one of the ``finish_step``
    values; never below 0 (step 0: nothing has grown yet).

    In NumPy, one row per candidate step (every sequence's ``finish_step``; a repeated or zero
    one changes no maximum) and one column per sequence: a few whole-array operations whatever
    the number of sequences, where a Python loop over the n x n pairs would cost admission more
    than the step it admits into.
    """
    rows = [(g.slots, g.remaining, g.delay, g.held, g.copies, g.copy_on_write) for g in growths]
    if not rows:
        return 0
    slots, remaining, delay, held, copies, copy_on_write = np.array(rows, dtype=np.int64).T
    finish = delay + remaining
    steps = finish[:, None]
    appended = np.clip(steps - delay, 0, remaining)
    round_up = block_size - 1
    grown = (slots + appended + round_up) // block_size - (slots + round_up) // block_size
    alive = finish >= steps
    demand = np.where(alive, copies * grown + copy_on_write * (appended > 0), -held).sum(axis=1)
    return max(0, int(demand.max()))


class Headroom:
    """Builds each sequence's :class:`Growth` from the scheduler's state and answers whether
    a request can be admitted without over-committing the pool (module docstring)."""

    def __init__(
        self, kv_manager: KVCacheManager, ratio: float, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"decode headroom ratio must be in (0, 1], got {ratio}")
        self.kv_manager = kv_manager
        self.ratio = ratio
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len

    def _remaining(self, seq: Sequence, slots: int) -> int:
        """Tokens ``seq`` may still append, scaled by the ratio: up to ``prompt + max_tokens``
        (one slot more than it ever holds: its last token is sampled, never fed back)."""
        final = min(seq.prompt_len + seq.request.params.max_tokens, self.max_model_len)
        return math.ceil(self.ratio * max(final - slots, 0))

    def _delay(self, tokens_left: int) -> int:
        """Steps of prompt chunks still to compute after this one (a full budget each)."""
        return -(-max(tokens_left, 0) // self.max_num_batched_tokens)

    def running_growth(
        self, seq: Sequence, scheduled_tokens: int, shared_soon: Collection[int] = ()
    ) -> Growth:
        """A running sequence, ``scheduled_tokens`` of which this step computes; the blocks in
        ``shared_soon`` will not come back when it finishes (a new request shares them)."""
        table = self.kv_manager.table(seq.seq_id)
        slots = table.num_tokens
        natural = blocks_for(slots + 1, table.block_size) - table.capacity // table.block_size
        copies = seq.num_copies
        # Prompt tokens that hold slots but are not computed yet (between steps, a decoding
        # sequence's sampled token has no slot yet: that is its next append, not a delay).
        left = table.num_tokens - seq.num_computed_tokens - scheduled_tokens
        return Growth(
            slots=slots,
            remaining=self._remaining(seq, slots),
            delay=self._delay(left),
            held=self.kv_manager.private_blocks(seq.seq_id, shared_soon),
            copies=copies,
            copy_on_write=max(table.blocks_needed(1) - max(natural, 0), 0)
            + _cow(slots, table.block_size, copies),
        )

    def waiting_growth(self, seq: Sequence, new_blocks: int, budget: int) -> Growth:
        """A waiting sequence about to take ``new_blocks`` blocks and ``budget`` tokens of the
        step (its prompt, or everything it had computed before a preemption)."""
        slots = seq.num_tokens
        copies = seq.num_copies
        return Growth(
            slots=slots,
            remaining=self._remaining(seq, slots),
            delay=self._delay(slots - budget),
            held=new_blocks,
            copies=copies,
            copy_on_write=_cow(slots, self.kv_manager.block_size, copies),
        )

    def projection(self, running: Iterable[Sequence], scheduled: Mapping[int, int]) -> Projection:
        """The running set's growth now; ``scheduled`` maps a sequence id to the tokens this step
        computes for it."""
        return Projection(self, list(running), dict(scheduled))


@dataclass(slots=True)
class Refusal:
    """The waiting head that admission turned away, kept so the next steps need not project
    the running set again (a :class:`Growth` per running sequence, every step) while the
    verdict provably stands.

    Why it stands: while no block comes back (no sequence finishes or is preempted -- the
    scheduler drops the refusal then), every running sequence either gains its one token as
    projected -- its growth and the free pool shrink by the same blocks -- or falls behind,
    which only moves its growth and its finish later. Neither lowers the peak left over the
    free blocks. What can lower it is the head's own growth starting a step closer to the
    running set's peak: at most ``2 * copies`` blocks a step (one new block per sequence it
    becomes, plus a copy-on-write copy at its first append). So with the same step budget
    (which sets the head's prompt delay) and the same blocks to allocate (a prefix-cache hit
    can change those), a shortfall of ``s`` blocks stands for ``s / (2 * copies)`` steps.
    """

    seq: Sequence
    budget: int
    new_blocks: int
    shortfall: int
    #: Most blocks the shortfall can shrink by per step (0 without headroom: only the prompt
    #: counts, and the free pool only shrinks until a block comes back).
    max_drop: int
    steps: int = 0

    @classmethod
    def of(cls, seq: Sequence, budget: int, new_blocks: int, shortfall: int, headroom: bool) -> Refusal:
        return cls(seq, budget, new_blocks, shortfall, 2 * seq.num_copies if headroom else 0)

    def stands(self, seq: Sequence, budget: int, new_blocks: int) -> bool:
        """Admission would still refuse ``seq`` now, ``steps`` steps later."""
        return (
            seq is self.seq
            and budget == self.budget
            and new_blocks == self.new_blocks
            and self.steps * self.max_drop < self.shortfall
        )


class Projection:
    """The running set's growth at one moment, built once and tested against each waiting
    request in turn (one step admits many: rebuilding it per request would cost O(running^2))."""

    def __init__(self, headroom: Headroom, running: list[Sequence], scheduled: dict[int, int]) -> None:
        self.headroom = headroom
        self.running = running
        self.scheduled = scheduled
        self.growths = [headroom.running_growth(s, scheduled.get(s.seq_id, 0)) for s in running]

    def shortfall(
        self, candidate: Sequence, new_blocks: int, budget: int, unprotected: Collection[str] = ()
    ) -> int:
        """Blocks missing for ``candidate``'s ``new_blocks`` plus the peak growth of the running
        set with it to fit in the free blocks less the watermark (<= 0: it is admitted). The
        growth of the client requests in ``unprotected`` is left out: they are over their fair
        share (:mod:`pagedkv.engine.core.fairness`) and are preempted first if the pool runs dry."""
        headroom, manager = self.headroom, self.headroom.kv_manager
        growths = self.growths
        use_cache = not candidate.needs_prompt_logits
        hits = manager.cached_prefix_blocks(candidate.token_ids, use_cache, candidate.request.prefix_salt)
        in_use = [b for b in hits if manager.is_in_use(b)]
        if in_use:  # it will share blocks the running hold: those stay when their holders finish
            shared = frozenset(in_use)
            growths = [
                headroom.running_growth(s, self.scheduled.get(s.seq_id, 0), shared) for s in self.running
            ]
        if unprotected:
            running = zip(self.running, growths, strict=True)
            growths = [g for s, g in running if s.request.client not in unprotected]
        growths = [*growths, headroom.waiting_growth(candidate, new_blocks, budget)]
        peak = peak_new_blocks(growths, manager.block_size)
        return new_blocks + peak - manager.allocatable_blocks

    def add(self, seq: Sequence, scheduled_tokens: int) -> None:
        """``seq`` was admitted and computes ``scheduled_tokens`` this step: it runs now."""
        self.running.append(seq)
        self.scheduled[seq.seq_id] = scheduled_tokens
        manager = self.headroom.kv_manager
        if manager.private_blocks(seq.seq_id) < manager.held_blocks(seq.seq_id):
            # It shares blocks a running sequence held alone: those no longer come back when that
            # one finishes, so every ``held`` is read again.
            self.growths = [
                self.headroom.running_growth(s, self.scheduled.get(s.seq_id, 0)) for s in self.running
            ]
        else:
            self.growths.append(self.headroom.running_growth(seq, scheduled_tokens))


def _cow(slots: int, block_size: int, copies: int) -> int:
    """Copy-on-write copies when ``copies`` sequences first append to one shared, partly
    filled last block: all but the last writer copy it."""
    return copies - 1 if slots % block_size else 0
