"""One HTTP request's generation: its engine requests and the text deltas they produce.

A completions request may carry a batch of prompts, each with ``n`` samples; every prompt is
its own engine request, all sharing one output stream, admitted together and withdrawn together.
The engine reports the full text of a sample so far; :class:`Generation` turns that into deltas
per choice (``index = prompt * n + sample``), which both the streaming (SSE) and the plain JSON
responses are built from. Every choice ends with a ``finish_reason``, also when the server aborts
the request (``"abort"``) or the engine fails it (``"error"``): the last deltas say so, then the
error is raised for the response to report.

Stop strings: the engine cuts a sample's text where a stop string completes, which may be in
text an earlier step already showed. So while a sample with stop strings runs, its last
``len(longest stop) - 1`` characters are held back (as vLLM does); the held text can never be
cut, since a stop string that ends after it must start inside it. Under
``include_stop_str_in_output`` nothing is held: the text is cut after the stop string, which ends
in what the step added.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import Receive

from pagedkv.engine import CompletionOutput, LoRARequest, RequestOutput, SamplingParams
from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.server.async_engine import AsyncEngine, Stream
from pagedkv.server.errors import ClientGoneError, EngineRequestError
from pagedkv.server.responses import Usage

if TYPE_CHECKING:
    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar


@dataclass
class ChoiceDelta:
    """What one choice gained since the last delta; ``finish_reason`` is set on its last one."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    #: With a ``stop`` finish: the stop string or stop token id that ended it (None for EOS).
    stop_reason: int | str | None = None


class _ChoiceState:
    """How much of a sample's text and tokens has been handed out."""

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False

    def end(self, index: int, reason: str, with_logprobs: bool) -> ChoiceDelta | None:
        """The closing delta of a choice the engine will not finish: it ends with ``reason``."""
        if self.done:
            return None
        self.done = True
        return ChoiceDelta(index, "", [], [] if with_logprobs else None, reason)

    def advance(self, index: int, output: CompletionOutput) -> ChoiceDelta | None:
        if self.done:
            return None
        finished = output.finish_reason is not None
        end = len(output.text) if finished else len(output.text) - self.holdback
        end = max(end, self.sent_chars)
        text = output.text[self.sent_chars : end]
        token_ids = output.token_ids[self.sent_tokens :]
        logprobs = output.logprobs[self.sent_tokens :] if output.logprobs is not None else None
        self.sent_chars, self.sent_tokens, self.done = end, len(output.token_ids), finished
        if not (text or token_ids or finished):
            return None
        return ChoiceDelta(index, text, token_ids, logprobs, output.finish_reason, output.stop_reason)


class Generation:
    """Submit with :meth:`start`, read with :meth:`deltas`, and always :meth:`close` at the end."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int = 0,
        grammar: CompiledGrammar | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.engine = engine
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.grammar = grammar
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.usage = Usage()
        #: Each prompt's prompt logprobs (by prompt index), once its first output brought them.
        self.prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}
        self._engine_ids = [self._engine_id(i) for i in range(len(prompts))]
        self._unfinished: set[int] = set()
        self._stream: Stream | None = None
        # Text kept up to the end of a stop string is never cut where an earlier step showed it.
        holdback = 0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
        self._choices = [_ChoiceState(holdback) for _ in range(len(prompts) * params.n)]

    def _engine_id(self, prompt_index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt_index}"

    async def start(self) -> None:
        """Queue every prompt as one unit, one client request for fair admission; a refusal (of
        any prompt) is raised, nothing stays queued."""
        self._stream = Stream()
        self._unfinished = set(range(len(self.prompts)))
        try:
            await self.engine.add(
                self._engine_ids,
                self.prompts,
                self.params,
                self._stream,
                self.priority,
                self.request_id,
                self.grammar,
                self.cache_salt,
                self.lora_request,
            )
        except BaseException:
            self.close()  # cancelled while waiting: withdraw whatever the worker admits
            raise
        self.usage.prompt_tokens = sum(len(p) for p in self.prompts)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas in the order the engine produced them, until every choice has finished.

        Raises :class:`~pagedkv.server.async_engine.Aborted` if the server aborted the request and
        :class:`~pagedkv.server.errors.EngineRequestError` if the engine failed one of its prompts,
        after closing deltas that end every open choice with ``"abort"`` / ``"error"``.
        """
        assert self._stream is not None, "start() first"
        while self._unfinished:
            prompt_index, item = await self._stream.get()
            if isinstance(item, BaseException):
                for delta in self._end_open_choices("abort"):
                    yield delta
                raise item
            if item.prompt_logprobs is not None:
                self.prompt_logprobs.setdefault(prompt_index, item.prompt_logprobs)
            for delta in self._advance(prompt_index, item):
                self.usage.completion_tokens += len(delta.token_ids)
                yield delta
            if item.finished:
                self._unfinished.discard(prompt_index)
            if item.error is not None:
                for delta in self._end_open_choices("error"):
                    yield delta
                raise EngineRequestError(item.request_id)
        self.usage.total_tokens = self.usage.prompt_tokens + self.usage.completion_tokens

    def _end_open_choices(self, reason: str) -> list[ChoiceDelta]:
        with_logprobs = self.params.logprobs is not None
        deltas = (state.end(index, reason, with_logprobs) for index, state in enumerate(self._choices))
        return [delta for delta in deltas if delta is not None]

    def _advance(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        deltas = []
        for sample in output.outputs:
            index = prompt_index * self.params.n + sample.index
            delta = self._choices[index].advance(index, sample)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def usage_so_far(self) -> Usage:
        """The usage up to the last delta handed out (vLLM's ``continuous_usage_stats``)."""
        prompt, completion = self.usage.prompt_tokens, self.usage.completion_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    @property
    def num_choices(self) -> int:
        return len(self._choices)

    def close(self) -> None:
        """Abort whatever has not finished, queued prompts included: the client left, or a
        response failed midway. One command for all of them."""
        if self._unfinished:
            self.engine.abort([self._engine_ids[i] for i in sorted(self._unfinished)])
        self._unfinished.clear()


async def collect(generation: Generation) -> list[list[ChoiceDelta]]:
    """Every delta of every choice (for non-streaming responses), indexed by choice."""
    per_choice: list[list[ChoiceDelta]] = [[] for _ in range(generation.num_choices)]
    async for delta in generation.deltas():
        per_choice[delta.index].append(delta)
    return per_choice


async def until_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client went away."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect_unless_disconnected(generation: Generation, receive: Receive) -> list[list[ChoiceDelta]]:
    """:func:`collect`, or :class:`ClientGoneError` as soon as the client disconnects."""
    collecting = asyncio.ensure_future(collect(generation))
    watching = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        collecting.cancel()
        watching.cancel()
    if collecting.done() and not collecting.cancelled():
        return collecting.result()
    raise ClientGoneError(generation.request_id)
