"""Answers from the engine's worker thread to the event loop: a future resolved on its own loop,
and a function of the engine run on the worker (which alone touches the engine) whose result
resolves one, e.g. adding or removing a LoRA adapter while the server runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.engine import LLMEngine


def settle(future: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    """Resolve ``future`` (to ``result``, or ``error``) on its own loop unless its waiter already
    gave up."""

    def resolve() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
        future.get_loop().call_soon_threadsafe(resolve)


@dataclass
class EngineCall:
    """``function(engine)``, run by the worker between steps; its result or its exception
    resolves ``done``."""

    function: Callable[[LLMEngine], object]
    done: asyncio.Future

    def run(self, engine: LLMEngine) -> None:
        try:
            result = self.function(engine)
        except Exception as err:
            settle(self.done, err)
            return
        settle(self.done, None, result)
