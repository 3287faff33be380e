"""The step's one commit point: what the stages after the forward pass decided, applied in one order.

The scheduler plans a step (:meth:`~pagedkv.engine.core.scheduler.Scheduler.schedule`: admission,
growth, preemption); the stages after the forward pass -- the KV tier's settlement, sampling,
speculative verification, beam ranking, the output processor's stop checks -- only read the
sequences' progress and the queues, and record what they decided in one
:class:`StepDecisions`; :func:`update_from_output` (vLLM v1's
``Scheduler.update_from_output``, nano-vllm's ``postprocess``) then applies it. So a sequence's
computed count, its queue, its block table and the prefix cache change in two places only:
``schedule()`` before the forward pass, this module after it.

What the stages keep writing is what is theirs: a sequence's tokens, text and logprobs (the
output processor, the beam ranking), a request's roster of sequences (``Request.seqs``: the
samples and beams whose outputs it reports) and its error message.

``update_from_output`` applies, in this order (each list in the order its stage made it, which
follows the step's order, so two runs of the same requests free, fork and cache the same blocks):

1. progress: each scheduled slice's tokens (its proposed tokens excepted) are computed; a
   sequence whose tier load failed its check falls back to the tokens still valid; the prompt
   logprobs scored join their requests;
2. forks of the samples: a prompt that finished computing forks into its ``n`` samples (progress
   and blocks of the parent, shared or copied);
3. rollbacks: a speculating sequence keeps the proposals verification accepted, its table
   shrinks to them;
4. prefix-cache inserts: the full blocks computed this step, scheduled sequences in step order
   then the new samples; only tokens that were the sequence's when the step was scheduled count
   (an accepted proposal's block is offered at the next step), and before any free, so a
   sequence finishing now still leaves its blocks to the cache;
5. beam moves: dropped beams freed and chosen ones forked, in ranking order; an ended search
   frees its beams;
6. finishes: the sequences a stop condition ended (EOS, stop token or string, grammar,
   ``max_tokens``, context length), with their reasons;
7. failures: every sequence of a failed request not finished yet ends with ``"error"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.engine.core.adapter_admission import release_adapter
from pagedkv.engine.core.sequence import Request, Sequence
from pagedkv.engine.outputs import TokenLogprobs

if TYPE_CHECKING:
    from pagedkv.engine.core.scheduler import Scheduler
    from pagedkv.engine.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class Finish:
    """``seq`` ends with ``reason`` (None for a beam: its search reports the reason)."""

    seq: Sequence
    reason: str | None = None
    #: The stop token or stop string that ended it, if one did.
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Fork:
    """``child`` (a new sample or beam) continues ``parent``: its progress and its blocks."""

    parent: Sequence
    #: Made by the stage, but running and holding blocks only once committed.
    child: Sequence


@dataclass
class StepDecisions:
    """Everything the stages after one forward pass decided, for :func:`update_from_output`
    (the order it applies them in is the module docstring's)."""

    #: Computed tokens after the step of each scheduled sequence, in step order: its slice's end,
    #: proposed tokens excluded.
    computed: dict[Sequence, int]
    #: Sequences whose tier load failed its check (they left the step): the tokens still valid.
    reverted: dict[Sequence, int] = field(default_factory=dict)
    #: Prompt logprobs scored this step, each after those its request recorded before.
    prompt_logprobs: list[tuple[Request, list[TokenLogprobs]]] = field(default_factory=list)
    #: The samples forked from prompts that finished computing (sample stage).
    forks: list[Fork] = field(default_factory=list)
    #: Speculating sequences and the computed tokens they keep (verification).
    rollbacks: list[tuple[Sequence, int]] = field(default_factory=list)
    #: Beam ranking's frees and forks, in the order it made them.
    beam_moves: list[Fork | Finish] = field(default_factory=list)
    #: Sequences a stop condition ended (output processor).
    finishes: list[Finish] = field(default_factory=list)
    #: Requests whose sampling, verification or grammar failed (they end with ``"error"``).
    failed: list[Request] = field(default_factory=list)

    @classmethod
    def after(cls, scheduled: SchedulerOutput, reverted: dict[Sequence, int]) -> StepDecisions:
        """The decisions of a step whose forward pass computed ``scheduled``'s slices, but for the
        sequences in ``reverted`` (they left the step)."""
        computed = {item.seq: item.end - item.num_spec_tokens for item in scheduled.scheduled}
        return cls(computed, reverted)

    def computed_tokens(self, seq: Sequence) -> int:
        """``seq``'s computed tokens once this step is committed (before its rollback, if any)."""
        return self.computed.get(seq, self.reverted.get(seq, seq.num_computed_tokens))


def update_from_output(scheduler: Scheduler, decisions: StepDecisions) -> None:
    """Apply one step's decisions to the sequences, the queues, the block tables and the prefix
    cache, in the module docstring's order."""
    _record_progress(decisions)
    for fork in decisions.forks:
        _fork(scheduler, fork)
    for seq, kept in decisions.rollbacks:
        _roll_back(scheduler, seq, kept)
    _cache_computed_blocks(scheduler, decisions)
    for move in decisions.beam_moves:
        if isinstance(move, Fork):
            _fork(scheduler, move)
        else:
            finish(scheduler, move.seq, move.reason, move.stop_reason)
    for end in decisions.finishes:
        finish(scheduler, end.seq, end.reason, end.stop_reason)
    for request in decisions.failed:
        for seq in request.seqs:
            if not seq.is_finished:
                finish(scheduler, seq, "error")


def finish(
    scheduler: Scheduler, seq: Sequence, reason: str | None, stop_reason: int | str | None = None
) -> None:
    """End ``seq`` with ``reason``: out of its queue, its blocks back to the pool (the cached ones
    stay reusable). Also how ``LLMEngine.abort`` ends a request's sequences."""
    scheduler.remove(seq)
    scheduler.kv_manager.free(seq.seq_id)
    release_adapter(scheduler, seq)  # after the KV blocks: cached ones go before its pages
    scheduler.blocks_returned()
    seq.finish_reason, seq.stop_reason = reason, stop_reason


def _record_progress(decisions: StepDecisions) -> None:
    """The computed tokens of every sequence the step ran, and the prompt logprobs it scored."""
    for seq, computed in (decisions.reverted | decisions.computed).items():
        seq.num_computed_tokens = computed
    for request, scored in decisions.prompt_logprobs:
        request.prompt_logprobs.extend(scored)


def _roll_back(scheduler: Scheduler, seq: Sequence, kept: int) -> None:
    """``seq`` keeps ``kept`` computed tokens: its table shrinks, emptied blocks return to the pool
    (under a policy that grows on demand; a reservation keeps its blocks)."""
    seq.num_computed_tokens = kept
    scheduler.kv_manager.truncate(seq.seq_id, kept, free_blocks=scheduler.kv_policy.grows_on_demand)
    scheduler.blocks_returned()


def _fork(scheduler: Scheduler, fork: Fork) -> None:
    """The child gets the parent's progress and blocks -- shared, or copied at the next step when
    the KV policy does not share -- and runs."""
    parent, child = fork.parent, fork.child
    child.num_computed_tokens = parent.num_computed_tokens
    share = scheduler.kv_policy.shares_blocks
    scheduler.pending_copies.extend(scheduler.kv_manager.fork(parent.seq_id, child.seq_id, share=share))
    if scheduler.paged_adapters is not None:
        scheduler.paged_adapters.fork(parent, child)
    scheduler.run(child)


def _cache_computed_blocks(scheduler: Scheduler, decisions: StepDecisions) -> None:
    """Offer the full blocks computed this step to the prefix cache (only now that their keys and
    values are really in the cache); a new sample offers what its parent computed."""
    kv_manager = scheduler.kv_manager
    allocatable = kv_manager.allocatable_blocks
    offered = [
        *decisions.computed.items(),
        *((f.child, decisions.computed[f.parent]) for f in decisions.forks),
    ]
    for seq, computed in offered:
        kv_manager.cache_computed_blocks(seq.seq_id, seq.token_ids, computed)
    if kv_manager.allocatable_blocks > allocatable:
        scheduler.blocks_returned()  # a sequence gave its copy of a block up for one cached first
