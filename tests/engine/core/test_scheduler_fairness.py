"""Fair admission in the live engine: order, shares, reclaim, priority, and no starvation.

Every assertion is on scheduling decisions (who runs after which step), never on time.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import LLM, SamplingParams
from pagedkv.engine import EngineConfig, InvalidRequestError, RequestLimits
from pagedkv.engine.core.sequence import SequenceStatus
from tests.checkpoints import make_checkpoint
from tests.engine.core.test_scheduler_headroom import _check_blocks

#: A pool the tests below fill: 48 blocks of 4 tokens, 6 running slots.
OPTIONS = dict(num_kv_blocks=48, block_size=4, max_num_seqs=6, max_num_batched_tokens=64, watermark=0.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fairness"), "llama")


def _engine(model_path, **options):
    return LLM(str(model_path), **(OPTIONS | options)).engine


def _long(max_tokens: int = 30, n: int = 1, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=seed, ignore_eos=True)


def _running_by_client(engine) -> Counter:
    return Counter(seq.request.client for seq in engine.scheduler.running)


def _started(request) -> bool:
    return any(seq.status is not SequenceStatus.WAITING for seq in request.seqs)


def test_the_engine_derives_the_request_budget_from_its_pool(model_path):
    engine = _engine(model_path)
    pool_tokens = OPTIONS["num_kv_blocks"] * OPTIONS["block_size"]
    assert engine.validator.limits.max_request_tokens == pool_tokens
    with pytest.raises(InvalidRequestError, match=f"max_request_tokens = {pool_tokens}"):
        engine.add_request("r", [20, 21, 22], _long(30, n=7))  # 7 x 33 tokens: more than the pool
    assert not engine.requests and not engine.scheduler.waiting


# -- the share ---------------------------------------------------------------------------------
def test_two_batches_queued_together_get_half_the_slots_each(model_path):
    engine = _engine(model_path)
    for client in ("a", "b"):
        for i in range(6):
            engine.add_request(f"{client}{i}", [20 + i, 30, 40], _long(8), client_request_id=client)
    engine.step()
    assert _running_by_client(engine) == {"a": 3, "b": 3}


def test_without_a_share_the_first_batch_takes_every_slot(model_path):
    engine = _engine(model_path, max_running_share=1.0)
    for client in ("a", "b"):
        for i in range(6):
            engine.add_request(f"{client}{i}", [20 + i, 30, 40], _long(8), client_request_id=client)
    engine.step()
    assert _running_by_client(engine) == {"a": 6}


def test_alone_a_batch_may_use_every_slot(model_path):
    """Work-conserving: the share binds only while another client request waits."""
    engine = _engine(model_path)
    for i in range(8):
        engine.add_request(f"a{i}", [20 + i, 30, 40], _long(8), client_request_id="a")
    engine.step()
    assert _running_by_client(engine) == {"a": 6}


def test_one_that_holds_nothing_goes_before_one_that_holds_slots(model_path):
    """A batch's remaining prompts wait behind a request sent after them: fewest held first."""
    engine = _engine(model_path, max_num_seqs=4)
    for i in range(8):
        engine.add_request(f"a{i}", [20 + i, 30, 40], _long(8), client_request_id="a")
    engine.step()
    assert _running_by_client(engine) == {"a": 4}
    late = engine.add_request("late", [50, 51], _long(max_tokens=2))
    engine.step()
    assert late.seqs[0].status is SequenceStatus.RUNNING
    assert sum(1 for seq in engine.scheduler.waiting if seq.request.client == "a") >= 4


# -- reclaim -----------------------------------------------------------------------------------
def test_many_samples_give_slots_back_to_a_later_request(model_path):
    """n = 12 forks beyond the 6 slots; a 2-token request sent next is admitted at once,
    preempting the newest samples, and finishes long before them."""
    engine = _engine(model_path)
    big = engine.add_request("big", [20, 21, 22], _long(max_tokens=12, n=12))
    engine.step()  # the prompt is computed and forks into 12 samples
    assert len(engine.scheduler.running) == 12
    small = engine.add_request("small", [30, 31], _long(max_tokens=2))
    engine.step()
    assert small.seqs[0].status is SequenceStatus.RUNNING
    assert engine.last_step.preemptions > 0
    preempted = [seq for seq in engine.scheduler.waiting if seq.request is big]
    assert preempted and all(seq.num_preemptions == 1 for seq in preempted)
    while not small.is_finished:
        engine.step()
    assert not big.is_finished
    _run_to_end(engine)
    assert [len(seq.output_token_ids) for seq in big.seqs] == [12] * 12


def _samples_claiming_the_pool(engine):
    """Three samples of 36 tokens: 27 of the 28 blocks at their full length, within the slot
    share (3 of 6) but over the KV share (14 blocks)."""
    return engine.add_request("big", [20, 21, 22], _long(max_tokens=33, n=3))


def test_a_request_over_its_share_of_the_pool_does_not_keep_its_growth_from_others(model_path):
    """A request of 32 tokens sent after it fits beside the samples only if their growth is not
    all reserved for them: it is admitted at once, and the samples yield blocks when the pool
    runs dry."""
    engine = _engine(model_path, num_kv_blocks=28)
    big = _samples_claiming_the_pool(engine)
    engine.step()
    other = engine.add_request("other", [30, 31], _long(max_tokens=30))
    engine.step()
    assert other.seqs[0].status is SequenceStatus.RUNNING
    _run_to_end(engine)
    assert engine.stats().preemptions > 0
    assert [len(seq.output_token_ids) for seq in big.seqs] == [33] * 3
    assert len(other.seqs[0].output_token_ids) == 30


def test_without_a_share_the_same_request_waits_for_the_samples(model_path):
    engine = _engine(model_path, num_kv_blocks=28, max_running_share=1.0)
    big = _samples_claiming_the_pool(engine)
    engine.step()
    other = engine.add_request("other", [30, 31], _long(max_tokens=30))
    while not _started(other):
        engine.step()
    # Headroom alone reserves the samples' growth: the request gets in near their end.
    assert min(len(seq.output_token_ids) for seq in big.seqs) >= 30


# -- priority ----------------------------------------------------------------------------------
def test_priority_needs_the_priority_policy(model_path):
    engine = _engine(model_path)
    with pytest.raises(InvalidRequestError, match="scheduling-policy priority") as refused:
        engine.add_request("r", [20, 21], _long(), priority=1)
    assert refused.value.param == "priority"
    assert not engine.requests and not engine.scheduler.waiting


@pytest.mark.parametrize("priority", [-101, 101, 10**25, -(10**400)])
def test_a_priority_outside_the_range_is_refused_naming_it(model_path, priority):
    engine = _engine(model_path, scheduling_policy="priority")
    with pytest.raises(InvalidRequestError, match=r"outside the allowed range \[-100, 100\]") as refused:
        engine.add_request("r", [20, 21], _long(), priority=priority)
    assert refused.value.param == "priority"
    assert not engine.requests and not engine.scheduler.waiting
    for bound in (-100, 100):  # the bounds themselves are in
        engine.add_request(f"at {bound}", [20, 21], _long(max_tokens=2), priority=bound)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_deployer_sets_the_range_and_zero_must_be_in_it(model_path):
    engine = _engine(model_path, scheduling_policy="priority", min_priority=0, max_priority=3)
    with pytest.raises(InvalidRequestError, match=r"\[0, 3\]"):
        engine.add_request("jump", [20, 21], _long(), priority=-1)  # nobody goes ahead of the default
    engine.add_request("yield", [20, 21], _long(max_tokens=2), priority=3)
    while engine.has_unfinished_requests():
        engine.step()
    for low, high in ((1, 5), (-5, -1)):
        with pytest.raises(ValueError, match="min_priority <= 0 <= max_priority"):
            EngineConfig(min_priority=low, max_priority=high)


def test_lower_priority_values_are_admitted_first_ties_by_arrival(model_path):
    engine = _engine(model_path, scheduling_policy="priority", max_num_seqs=2)
    for name, priority in (("p5", 5), ("p1a", 1), ("p9", 9), ("p1b", 1), ("p0", 0)):
        engine.add_request(name, [20, 21, 22], _long(max_tokens=2), priority=priority)
    order = []
    while engine.has_unfinished_requests():
        engine.step()
        order += [s.request.request_id for s in engine.scheduler.running if s.request.request_id not in order]
    assert order == ["p0", "p1a", "p1b", "p5", "p9"]


def test_the_highest_priority_value_is_preempted_first(model_path):
    """Three requests outgrow a small pool (no headroom): the one with priority 7 loses its blocks,
    the others never do."""
    engine = _engine(
        model_path,
        scheduling_policy="priority",
        num_kv_blocks=12,
        decode_headroom=0.0,
        max_running_share=1.0,
    )
    for i, (name, priority) in enumerate((("urgent", 0), ("low", 7), ("normal", 3))):
        engine.add_request(name, [20 + i, 21, 22, 23], _long(max_tokens=20), priority=priority)
    preempted = Counter()
    while engine.has_unfinished_requests():
        engine.step()
        preempted.update(s.request.request_id for s in engine.scheduler.waiting if s.num_preemptions)
    assert preempted["low"] > 0
    assert preempted["urgent"] == preempted["normal"] == 0


def test_llm_generate_takes_a_priority_per_prompt(model_path):
    llm = LLM(str(model_path), scheduling_policy="priority", **OPTIONS)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[20, 21], [22, 23]], params, use_tqdm=False, priority=[3, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate([[20, 21]], params, use_tqdm=False, priority=[0, 1])


# -- the policy changes the order, never the tokens ---------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        dict(max_running_share=0.5),
        dict(max_running_share=0.25, scheduling_policy="priority"),
        dict(max_running_share=1.0, decode_headroom=0.0),
    ],
)
def test_greedy_tokens_do_not_depend_on_the_policy(model_path, options):
    """Prompts and samples that outgrow a 20-block pool: the scheduling differs (preemptions,
    reclaims), the greedy tokens do not."""
    prompts = [[20 + i, 30 + 2 * i, 40, 41 + i] for i in range(5)]
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, n=1 + i % 3) for i in range(5)]
    roomy = LLM(str(model_path), num_kv_blocks=512, block_size=4).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM(
        str(model_path),
        num_kv_blocks=20,
        block_size=4,
        max_num_seqs=4,
        limits=RequestLimits(max_request_tokens=4096),
        **options,
    )
    priority = [(7 * i) % 4 for i in range(5)] if options.get("scheduling_policy") == "priority" else None
    tight = tight_llm.generate(prompts, params, use_tqdm=False, priority=priority)
    assert [[c.token_ids for c in o.outputs] for o in tight] == [
        [c.token_ids for c in o.outputs] for o in roomy
    ]
    assert tight_llm.kv_stats()["blocks_used"] == 0


# -- property: nobody starves, nothing leaks ----------------------------------------------------
#: Steps a small request lives at most: its prompt, then up to 4 tokens.
SMALL_LIFETIME = 5
#: Steps of slack a small request may wait besides the small ones ahead of it: a step in which a
#: large request that was readmitted is spared, and one to reclaim from it.
SLACK = 3

big_requests = st.one_of(
    st.builds(lambda n, m: ("samples", n, m), st.integers(1, 6), st.integers(8, 30)),
    st.builds(lambda k, m: ("prompts", k, m), st.integers(2, 6), st.integers(8, 30)),
)
small_requests = st.lists(
    st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(2, 8)),  # after steps, max_tokens, prompt
    min_size=1,
    max_size=6,
)


def _add_big(engine, kind: str, count: int, max_tokens: int) -> list:
    """One client request: ``count`` samples of one prompt, or ``count`` prompts."""
    if kind == "samples":
        return [engine.add_request("big", [20, 21, 22], _long(max_tokens, n=count), client_request_id="big")]
    return [
        engine.add_request(f"big-{i}", [20 + i, 21, 22], _long(max_tokens, seed=i), client_request_id="big")
        for i in range(count)
    ]


def _run_to_end(engine, on_step=lambda step: None) -> None:
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        _check_blocks(engine)
        on_step(step)
    totals = engine.stats()
    assert totals.kv.used_blocks == 0 and totals.kv_sequences == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(big_requests, small_requests, st.sampled_from([1.0, 0.5]))
def test_a_large_request_never_starves_the_small_ones_sent_after_it(model_path, big, smalls, headroom):
    """Whatever the large client request (in the budget: up to the whole pool), each small one
    starts within the lifetimes of the small ones still ahead of it, plus a little slack; every
    request finishes with all its tokens and every block comes back."""
    engine = _engine(model_path, decode_headroom=headroom)
    kind, count, max_tokens = big
    try:
        bigs = _add_big(engine, kind, count, max_tokens)
    except InvalidRequestError:
        return  # over the budget (what the pool holds): refused, as the budget says
    arrivals = []  # (request, the step it arrived after, small requests unfinished then)
    started: dict[str, int] = {}  # the step after which each small request was running

    def record(step: int) -> None:
        for request, _, _ in arrivals:
            if request.request_id not in started and _started(request):
                started[request.request_id] = step

    step = 0
    for after, small_tokens, prompt_len in smalls:
        for _ in range(after):
            engine.step()
            step += 1
            _check_blocks(engine)
            record(step)
        ahead = sum(1 for request, _, _ in arrivals if not request.is_finished)
        prompt = [30 + (len(arrivals) + j) % 50 for j in range(prompt_len)]
        request = engine.add_request(f"small-{len(arrivals)}", prompt, _long(small_tokens))
        arrivals.append((request, step, ahead))
    _run_to_end(engine, lambda more: record(step + more))
    for request, arrived, ahead in arrivals:
        assert started[request.request_id] - arrived <= 1 + ahead * SMALL_LIFETIME + SLACK
        assert all(len(seq.output_token_ids) == request.params.max_tokens for seq in request.seqs)
    for request in bigs:
        assert [len(seq.output_token_ids) for seq in request.seqs] == [max_tokens] * len(request.seqs)
