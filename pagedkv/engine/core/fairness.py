"""Fair admission: one client request may not hold the engine while others wait.

A *client request* is what one caller asked for at once: an engine request with all its samples
(``n``) or beams, and in the server every prompt of one HTTP request (they share a
``client_request_id``). Without the rules below, one such request inside every limit -- many
samples, many prompts, long outputs -- takes every running slot and the whole KV pool, and a
two-token request sent after it waits until it is done. The rules cost nothing while nobody else
waits: a lone request may still use the whole engine (admission stays work-conserving).

1. **Order.** Waiting sequences go in by how many running slots their client request holds,
   fewest first (under the ``priority`` policy, lower ``priority`` first, then fewest); ties keep
   the queue's order (arrival, with preempted sequences in front). A request that holds nothing
   is never overtaken by one that holds something, and among those that hold nothing admission
   is first-come-first-served and waits for its head: every request starts in its turn. One
   exception goes before all: a preempted beam whose sibling beams still run (they hold their
   blocks and cannot advance until it has caught up, so it is never passed over either).
2. **Share.** While another client request waits, one may hold at most ``max_running_share`` of
   the running slots (``max_num_seqs``) and of the KV blocks; a waiting sequence that would take
   its request past that is passed over for the others, and the rest of its request's with it
   for the step -- unless its request holds nothing yet (a request may always start). KV is
   counted as *claimed*: each running sequence, and each sample or beam still to fork from it, at
   its full length (blocks of prompt + ``max_tokens``, the size the request budget counts and
   decode headroom reserves), so a request is over its share from admission on, not only once
   its sequences have grown.
3. **Reclaim.** A waiting sequence that keeps its request within its share is *protected*: the
   slots and blocks it needs are taken back from requests over their share. Their growth is not
   reserved against it (the headroom check leaves it out) and, while it still does not fit,
   their newest sequences are preempted by recompute; one admitted in the same step is spared,
   so a request that gets in always computes a step. When the pool runs dry, the sequences of
   requests over their share are the first preempted -- after the running beams of a beam
   search that already waits for a preempted beam: they are idle until it is back, and taking
   them keeps two beam searches from each holding the blocks the other's missing beam needs.

``max_running_share = 1`` turns rules 2 and 3 off (rule 1 then only reorders the sequences of
requests that already run). Under ``--scheduling-policy priority`` (vLLM's) a request's
``priority`` orders admission (lower first, ties by arrival) and, as in vLLM, the running
sequence with the highest ``priority`` value is preempted first (idle beams aside; among equal
values, one over its share, then the newest). Any client may ask for the front of the queue, so
the policy is for trusted clients; the engine bounds the values (``min_priority`` ..
``max_priority``, -100 .. 100 by default), and ``min_priority = 0`` lets a client only yield,
never go ahead of requests that do not set a priority.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable

from pagedkv.engine.core.kv_policy import KVPolicy
from pagedkv.engine.core.sequence import Sequence, SequenceStatus
from pagedkv.engine.validation import InvalidRequestError
from pagedkv.memory import blocks_for


def check_priority(policy: str, priority: object, min_priority: int = -100, max_priority: int = 100) -> None:
    """A request's ``priority`` must be an integer, 0 unless the policy is ``priority``, and in
    ``[min_priority, max_priority]``."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r:.40}", param="priority")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(
            f"priority = {_shown(priority)} needs the priority scheduling policy (--scheduling-policy "
            f"priority); this engine schedules {policy}",
            param="priority",
        )
    if not min_priority <= priority <= max_priority:
        raise InvalidRequestError(
            f"priority = {_shown(priority)} is outside the allowed range [{min_priority}, {max_priority}] "
            "(--min-priority, --max-priority)",
            param="priority",
        )


def _shown(priority: int) -> str:
    """A priority as a message shows it (a huge one in short)."""
    if abs(priority) < 10**15:
        return str(priority)
    return f"{'-' if priority < 0 else ''}2^{abs(priority).bit_length() - 1} or more"


class FairShare:
    """The share rules (module docstring) for one engine: its caps and how a sequence counts."""

    def __init__(
        self,
        max_running_share: float,
        max_num_seqs: int,
        num_blocks: int,
        block_size: int,
        kv_policy: KVPolicy,
        max_model_len: int,
    ) -> None:
        self.enabled = max_running_share < 1.0
        #: Most running slots and claimed KV blocks one client request holds while others wait.
        self.max_slots = max(1, int(max_running_share * max_num_seqs))
        self.max_blocks = max(1, int(max_running_share * num_blocks))
        self.block_size = block_size
        self.kv_policy = kv_policy
        self.max_model_len = max_model_len

    def claim(self, seq: Sequence) -> tuple[int, int]:
        """The running slots and KV blocks ``seq`` claims: itself and the samples or beams still
        to fork from it, each at its full length."""
        copies = seq.num_copies
        params = seq.request.params
        tokens = self.kv_policy.peak_tokens(seq.prompt_len, params.max_tokens, self.max_model_len)
        return copies, copies * blocks_for(tokens, self.block_size)

    def holdings(self, running: Iterable[Sequence]) -> Holdings:
        return Holdings(self, running)


class Holdings:
    """What each client request's running sequences claim at one moment; kept up to date by
    :meth:`take` and :meth:`release` while a step admits and preempts."""

    def __init__(self, share: FairShare, running: Iterable[Sequence]) -> None:
        self.share = share
        self.slots: Counter[str] = Counter()
        self.blocks: Counter[str] = Counter()
        for seq in running:
            self.take(seq)

    def take(self, seq: Sequence) -> None:
        slots, blocks = self.share.claim(seq)
        self.slots[seq.request.client] += slots
        self.blocks[seq.request.client] += blocks

    def release(self, seq: Sequence) -> None:
        slots, blocks = self.share.claim(seq)
        client = seq.request.client
        self.slots[client] -= slots
        self.blocks[client] -= blocks
        if self.slots[client] <= 0:
            del self.slots[client], self.blocks[client]

    def holds(self, client: str) -> int:
        """Running slots ``client`` holds (0: it has nothing running)."""
        return self.slots.get(client, 0)

    def over_share(self, client: str) -> bool:
        share = self.share
        return share.enabled and (
            self.slots.get(client, 0) > share.max_slots or self.blocks.get(client, 0) > share.max_blocks
        )

    def within_share(self, seq: Sequence) -> bool:
        """Admitting ``seq`` keeps its client request within its share."""
        slots, blocks = self.share.claim(seq)
        client = seq.request.client
        return (
            self.slots.get(client, 0) + slots <= self.share.max_slots
            and self.blocks.get(client, 0) + blocks <= self.share.max_blocks
        )

    def may_start(self, seq: Sequence) -> bool:
        """``seq`` may be admitted while other client requests wait (rule 2)."""
        if not self.share.enabled or self.holds(seq.request.client) == 0 or stalls_siblings(seq):
            return True
        return self.within_share(seq)

    def unprotected(self, seq: Sequence) -> frozenset[str]:
        """The other client requests over their share, from which ``seq`` may reclaim (rule 3):
        none unless ``seq`` keeps its own request within its share."""
        if not self.share.enabled or not self.within_share(seq):
            return frozenset()
        own = seq.request.client
        return frozenset(c for c in self.slots if c != own and self.over_share(c))


def stalls_siblings(seq: Sequence) -> bool:
    """``seq`` is a waiting beam whose sibling beams run: they cannot advance without it."""
    request = seq.request
    return request.beam is not None and any(s.status is SequenceStatus.RUNNING for s in request.seqs)


def admission_order(
    waiting: Iterable[Sequence], holdings: Holdings, by_priority: bool, waiting_clients: Collection[str]
) -> list[Sequence]:
    """The waiting sequences in the order admission considers them (rule 1); ``waiting_clients``:
    their client requests (the queue's order stands unless one of them holds slots)."""
    queue = list(waiting)
    if by_priority or not holdings.slots.keys().isdisjoint(waiting_clients):

        def key(seq: Sequence) -> tuple[bool, int, int]:
            priority = seq.request.priority if by_priority else 0
            return (not stalls_siblings(seq), priority, holdings.holds(seq.request.client))

        queue.sort(key=key)  # stable: ties keep the queue's order
    return queue


def choose_victim(
    running: list[Sequence],
    holdings: Holdings,
    by_priority: bool,
    among: Collection[str] | None = None,
    spare: Collection[int] = (),
) -> Sequence | None:
    """The running sequence to preempt first: a beam whose beam search waits for a preempted beam,
    then the highest ``priority`` value (under the priority policy), then one of a client request
    over its share, then the newest. ``among`` limits the choice to those client requests,
    ``spare`` excludes sequence ids; None if nothing is left."""
    best, best_key = None, None
    for index, seq in enumerate(running):
        request, client = seq.request, seq.request.client
        if (among is not None and client not in among) or seq.seq_id in spare:
            continue
        idle = request.beam is not None and any(s.status is SequenceStatus.WAITING for s in request.seqs)
        priority = request.priority if by_priority else 0
        key = (idle, priority, holdings.over_share(client), index)
        if best_key is None or key > best_key:
            best, best_key = seq, key
    return best
