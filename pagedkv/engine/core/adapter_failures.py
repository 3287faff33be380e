"""LoRA adapters a step could not load: their requests end with an error, the step goes on.

An adapter is read from its folder each time it is loaded (an evicted one again), long after it
was checked when added; the read may fail (the folder moved, the file changed since: its CRC-32
differs). Every rank then skips that adapter alike and runs the step
(:mod:`pagedkv.engine.worker.adapter_loads`), so the driver drops the adapter's sequences from
the step -- their slices and logits rows, their progress back to their slice's start, as a
failed tier load drops a sequence (:func:`~pagedkv.engine.core.kv_tier.drop_from_step`), so
nothing they computed is sampled or offered to the prefix cache -- and fails their requests,
and those of every running sequence of the adapter, with the reason (``finish_reason="error"``).
Once the commit has ended them, nothing pins the adapter: its slot placement is undone and its
pages go back, so a later request of it loads it anew (and fails the same way while its file is
wrong). The other requests of the step are served as if nothing happened. :func:`execute` runs
the executor's step and hands these failures on (a step that raises instead undoes its adapter
loads: the adapters are not resident).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.engine.core.kv_tier import drop_from_step
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.core.scheduler_output import SchedulerOutput
from pagedkv.engine.core.sequence import Request, Sequence

if TYPE_CHECKING:
    from pagedkv.engine.core.commit import StepDecisions
    from pagedkv.engine.core.scheduler import Scheduler
    from pagedkv.engine.output_processor import ProcessedStep


class AdapterFailures:
    """One step's adapters that no rank could load (``failures``: id -> why; empty: a no-op),
    applied around the step's commit point in the order the engine calls them."""

    def __init__(self, scheduler: Scheduler, failures: dict[int, str]) -> None:
        self.scheduler, self.failures = scheduler, failures
        #: The computed tokens each dropped sequence keeps (its slice's start).
        self.reverted: dict[Sequence, int] = {}
        #: The requests to fail, those of the step first (their ``error`` set by :meth:`drop`).
        self.requests: list[Request] = []

    def drop(self, scheduled: SchedulerOutput, plan: StepPlan, logits: Any) -> tuple[StepPlan, Any]:
        """The step without the failed adapters' sequences: the plan and logits left."""
        if not self.failures:
            return plan, logits
        failures = self.failures
        seqs = [item.seq for item in scheduled.scheduled] + list(self.scheduler.running)
        by_id = {id(s.request): s.request for s in seqs if s.request.lora_int_id in failures}
        self.requests = list(by_id.values())
        for request in self.requests:
            name = request.lora_request.lora_name
            request.error = f"LoRA adapter {name!r} could not be loaded: {failures[request.lora_int_id]}"
        failing = (item for item in scheduled.scheduled if item.seq.request.lora_int_id in failures)
        dropped = {item.seq.seq_id: item.start for item in failing}
        plan, logits, self.reverted = drop_from_step(scheduled, plan, logits, dropped)
        return plan, logits

    def fail(self, decisions: StepDecisions, processed: ProcessedStep) -> None:
        """The requests end with ``"error"`` at the commit, and their outputs show it."""
        decisions.failed.extend(self.requests)
        shown = {id(request) for request in processed.requests}
        processed.requests.extend(r for r in self.requests if id(r) not in shown)

    def forget(self, plan: StepPlan) -> None:
        """After the commit ended their requests (nothing pins the adapters now): their slot
        placements undone and their pages given back, so the next request of one loads it anew."""
        scheduler = self.scheduler
        if self.failures and scheduler.adapters is not None:
            scheduler.adapters.undo([load for load in plan.lora_loads if load.lora_int_id in self.failures])
        if scheduler.paged_adapters is not None:
            for lora_int_id in self.failures:
                scheduler.paged_adapters.pages.unload(lora_int_id)


def execute(executor: Any, scheduler: Scheduler, plan: StepPlan) -> tuple[Any, AdapterFailures]:
    """``executor``'s step of ``plan``: its logits and the adapters it skipped. If the step
    fails, the adapters it was to load are not resident: their slot placements are undone and
    their pages written again by the next plan."""
    try:
        logits = executor.execute(plan)
    except Exception:
        if plan.lora_loads and scheduler.adapters is not None:
            scheduler.adapters.undo(plan.lora_loads)
        if plan.lora_page_writes and scheduler.paged_adapters is not None:
            scheduler.paged_adapters.retry(plan.lora_page_writes)
        raise
    return logits, AdapterFailures(scheduler, executor.adapter_failures())
