"""The step's commit point applies the stages' decisions in its documented order.

These run the real scheduler over a real KV manager, without a model: a step's forward pass is
only the scheduler's slices taken as computed (``StepDecisions.after``).
"""

from __future__ import annotations

from pagedkv.engine.core.commit import Finish, Fork, StepDecisions, update_from_output
from pagedkv.engine.core.scheduler import Scheduler
from pagedkv.engine.core.sequence import Request, Sequence, SequenceStatus
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.memory import KVCacheManager

PROMPT = list(range(1, 10))  # two full blocks of 4 and one token more


def _scheduler() -> Scheduler:
    return Scheduler(KVCacheManager(16, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)


def _queue(scheduler: Scheduler, request_id: str, **params) -> Sequence:
    request = Request(request_id, None, list(PROMPT), SamplingParams(**params), arrival_time=0.0)
    seq = Sequence(request, 0, list(PROMPT), None)
    request.seqs.append(seq)
    scheduler.add(seq)
    return seq


def _prompt_step(scheduler: Scheduler) -> StepDecisions:
    """Schedule one step and take its slices as computed."""
    return StepDecisions.after(scheduler.schedule(), reverted={})


def test_a_sequence_finishing_in_the_step_that_computed_its_blocks_leaves_them_cached():
    scheduler = _scheduler()
    seq = _queue(scheduler, "a")
    decisions = _prompt_step(scheduler)
    seq.token_ids.append(42)  # what the output processor appends before the commit
    decisions.finishes.append(Finish(seq, "stop", 42))
    update_from_output(scheduler, decisions)

    assert (seq.status, seq.finish_reason, seq.stop_reason) == (SequenceStatus.FINISHED, "stop", 42)
    assert seq.num_computed_tokens == len(PROMPT)
    assert not scheduler.running and scheduler.kv_manager.usage().used_blocks == 0
    again = _queue(scheduler, "b")
    scheduler.schedule()
    assert again.num_computed_tokens == 8  # its two full blocks were cached before the free


def test_forked_samples_run_on_their_parents_progress_and_blocks():
    scheduler = _scheduler()
    parent = _queue(scheduler, "a", n=3)
    decisions = _prompt_step(scheduler)
    children = [parent.fork(index, None) for index in (1, 2)]
    parent.request.seqs.extend(children)
    decisions.forks.extend(Fork(parent, child) for child in children)
    assert all(child.num_computed_tokens == 0 for child in children)  # nothing before the commit
    update_from_output(scheduler, decisions)

    kv = scheduler.kv_manager
    for child in children:
        assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == len(PROMPT)
        assert kv.block_ids(child.seq_id) == kv.block_ids(parent.seq_id)
    assert scheduler.running == [parent, *children]


def test_a_failed_request_ends_with_an_error_all_its_sequences_that_did_not_stop():
    scheduler = _scheduler()
    parent = _queue(scheduler, "a", n=3)
    other = _queue(scheduler, "b")
    decisions = _prompt_step(scheduler)
    children = [parent.fork(index, None) for index in (1, 2)]
    parent.request.seqs.extend(children)
    decisions.forks.extend(Fork(parent, child) for child in children)
    decisions.finishes.append(Finish(children[0], "length"))
    decisions.failed.append(parent.request)
    update_from_output(scheduler, decisions)

    assert [s.finish_reason for s in parent.request.seqs] == ["error", "length", "error"]
    assert parent.request.is_finished
    assert scheduler.running == [other] and other.finish_reason is None
    assert scheduler.kv_manager.usage().used_blocks == len(scheduler.kv_manager.block_ids(other.seq_id))
