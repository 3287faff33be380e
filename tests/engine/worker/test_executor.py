"""The executor seam: a step's plan is plain data, and the model runner builds a step from it alone.

Tensor parallelism will send the same plan to worker processes, so it must survive pickle and
JSON unchanged and hold no sequence or tensor; a plan must compute the same logits however the
prompt is cut into steps and wherever its blocks sit in the pool.
"""

import json
import pickle

import pytest
import torch

from pagedkv.attention import set_per_call_checks
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.executor import ExecutorError
from pagedkv.engine.worker.executor.in_process import InProcessExecutor
from pagedkv.models import ModelConfig
from tests.checkpoints import make_checkpoint
from tests.engine.plans import Piece, plan_of

PROMPT = [7, 99, 31, 250, 4, 18, 77, 301, 12, 45, 9, 400, 5]  # 13 tokens


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("executor"), "llama")


def _executor(path) -> InProcessExecutor:
    settings = EngineConfig(model=str(path), num_kv_blocks=16, block_size=4).resolve()
    return InProcessExecutor(settings, path, ModelConfig.from_pretrained(path))


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (int, bool))  # None: a field not known


def test_a_plan_is_plain_data_that_survives_pickle_and_json():
    plan = plan_of(
        [Piece([5, 6, 7], 0, [3, 9], True), Piece([8], 4, [1, 2], False, prompt_len=3)],
        block_copies=[(2, 11)],
    )
    assert _plain(plan.to_dict())
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert StepPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.num_tokens == 4 and plan.num_logits == 1 and plan.slices[1].end == 5


def test_the_same_prompt_gives_the_same_logits_in_one_step_or_two_and_in_any_blocks(model_path):
    whole = _executor(model_path).execute(plan_of([Piece(PROMPT, 0, [0, 1, 2, 3], True)]))
    chunked = _executor(model_path)
    table = [11, 4, 15, 2]  # anywhere in the pool, in no order
    first = chunked.execute(plan_of([Piece(PROMPT[:6], 0, table, False)]))
    assert first.shape == (0, whole.shape[1])  # no slice needs logits: no rows
    # the second step sent as JSON, as a worker process would receive it
    second = plan_of([Piece(PROMPT[6:], 6, table, True)])
    last = chunked.execute(StepPlan.from_dict(json.loads(json.dumps(second.to_dict()))))
    assert whole.dtype == last.dtype == torch.float32
    torch.testing.assert_close(last, whole, rtol=1e-5, atol=1e-5)


def test_a_bad_plan_is_refused_once_per_step_even_with_per_call_checks_off(model_path):
    executor = _executor(model_path)
    previous = set_per_call_checks(False)
    try:
        with pytest.raises(ValueError, match="slice 0 computes positions 0..12, but its block table"):
            executor.execute(plan_of([Piece(PROMPT, 0, [0, 1, 2, 16], True)]))
        for table in ([0, 1, 2], [0, -1, 2, 3]):  # too short; a negative id
            with pytest.raises(ValueError, match="slice 1 computes positions 0..12"):
                executor.execute(plan_of([Piece([5], 3, [4], True), Piece(PROMPT, 0, table, True)]))
        with pytest.raises(ValueError, match="slice 0 computes positions 0..-1"):
            executor.execute(plan_of([Piece([], 0, [0], False)]))
    finally:
        set_per_call_checks(previous)


def test_a_shut_down_executor_reports_it(model_path):
    executor = _executor(model_path)
    executor.check_health()
    executor.shutdown()
    with pytest.raises(ExecutorError, match="shut down"):
        executor.check_health()
    with pytest.raises(ExecutorError, match="shut down"):
        executor.execute(plan_of([Piece([5], 0, [0], True)]))
    executor.shutdown()  # idempotent
