"""From a request body to what the engine runs: prompt token ids and sampling parameters.

The generation routes and the render routes (``/v1/completions/render``, ``/v1/chat/completions
/render``) share this path, so they accept and refuse exactly the same requests. The checks run
cheapest first, so that a request that will be refused costs little: on the event loop the model
name, the sampling fields and the number of prompts; then on the tokenizer thread
(:mod:`pagedkv.server.prompts`) what reads the whole body -- the text (no unpaired surrogate), the
chat template, the prompt lengths (bounded before tokenizing, each prompt checked as soon as it is
tokenized) and the engine's own checks of the ids (vocabulary, KV pool); last the output's
constraint, if any, compiled on the engine's grammar compiler while the event loop goes on
(:mod:`pagedkv.server.structured`) -- so the engine's worker never has to refuse what passed
here, nor wait for a grammar.

Chat template options are vLLM's: ``add_generation_prompt`` (default true) opens an assistant
turn after the last message; ``continue_final_message`` instead leaves the last message open for
the model to continue; the two exclude each other; which template renders the conversation, and
with which variables, is :mod:`pagedkv.server.chat_prompt`'s (shared with ``/tokenize``). The
answer's role is the assistant's, or
without a generation prompt the last message's (vLLM's ``get_chat_request_role``), and chat
``echo`` prepends the last message's content to the answer when its role is that one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.engine import InvalidRequestError, LoRARequest, RequestLimits, SamplingParams
from pagedkv.engine.validation import RequestValidator
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.chat_prompt import check_chat_options, render_conversation
from pagedkv.server.chat_protocol import ChatCompletionRequest
from pagedkv.server.errors import APIError
from pagedkv.server.lora import ServedAdapters
from pagedkv.server.prompts import PromptEncoder, PromptLimits
from pagedkv.server.protocol import CompletionRequest
from pagedkv.server.structured import Constraint, compile_constraint
from pagedkv.server.tool_parsers import ToolParser
from pagedkv.server.tools import check_read_schemas, resolve_tool_choice, tool_at_fault, tool_constraint
from pagedkv.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar


@dataclass
class ServingContext:
    """What the handlers need besides the request: shared by every request of one app."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    encoder: PromptEncoder
    model_name: str
    max_model_len: int
    #: Most tokens (prompt + output) one request can ever hold in the KV cache.
    kv_capacity_tokens: int
    #: What one request may ask for (the engine's limits, applied here to a batch as a whole).
    limits: RequestLimits
    max_prompts_per_request: int
    #: ``--tool-call-parser``'s parser: with it (and --enable-auto-tool-choice), tool_choice "auto".
    tool_parser: ToolParser | None = None
    #: ``--chat-template``: replaces the model's (None: the model's own).
    chat_template: str | None = None
    #: ``--trust-request-chat-template``: a request's ``chat_template`` is accepted.
    trust_request_chat_template: bool = False
    #: ``--reasoning-parser``: splits an answer's reasoning from its content (None: no split).
    reasoning_parser: str | None = None
    #: The LoRA adapters a request's ``model`` may name (empty without --enable-lora).
    adapters: ServedAdapters = field(default_factory=ServedAdapters)

    async def compile(self, constraint: Constraint | None) -> CompiledGrammar | None:
        """The output constraint's grammar (None without one); a 400 naming the field if refused."""
        return await compile_constraint(self.engine.engine.structured_outputs, constraint)

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's sampling defaults (its generation_config.json, per --generation-config):
        what a request's unset fields take; fixed at start, so any thread may read them."""
        return self.engine.engine.default_sampling_params

    @property
    def validator(self) -> RequestValidator:
        """The engine's checks of a request's ids; immutable, so any thread may run them."""
        return self.engine.engine.validator

    def check_priority(self, priority: int) -> None:
        """A non-zero ``priority`` needs the engine's ``priority`` scheduling policy (vLLM's rule);
        the policy never changes, so this reads nothing the engine's worker writes."""
        try:
            self.engine.engine.scheduler.check_priority(priority)
        except InvalidRequestError as err:
            raise APIError.from_value_error(err) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and self.adapters.get(name) is None:
            raise APIError.bad_request(
                f"the model {name!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.adapters.get(name)

    def check_size(self, num_prompts: int, params: SamplingParams) -> None:
        """The limits that need no tokens, checked before any prompt is tokenized."""
        if num_prompts > self.max_prompts_per_request:
            raise APIError.bad_request(
                f"the request has {num_prompts} prompts, over the limit max_prompts_per_request = "
                f"{self.max_prompts_per_request} (--max-prompts-per-request)",
                param="prompt",
            )
        try:
            self.limits.check_n(params.n)
            self.limits.check_stops(params)
        except InvalidRequestError as err:
            raise APIError.from_value_error(err) from None

    def prompt_limits(
        self, params: SamplingParams, truncate_prompt_tokens: int | None, add_special_tokens: bool
    ) -> PromptLimits:
        """The request's prompt limits; ``truncate_prompt_tokens`` checked as vLLM does: -1 keeps
        as many tokens as fit beside ``max_tokens``, else 1 up to that many."""
        room = self.max_model_len - params.max_tokens
        if truncate_prompt_tokens == -1:
            truncate_prompt_tokens = max(room, 1)  # no room: the context check says why
        elif truncate_prompt_tokens is not None and not 1 <= truncate_prompt_tokens <= max(room, 1):
            raise APIError.bad_request(
                f"truncate_prompt_tokens must be -1 or in [1, max_model_len - max_tokens = {room}], got "
                f"{truncate_prompt_tokens}",
                param="truncate_prompt_tokens",
            )
        return PromptLimits(
            max_model_len=self.max_model_len,
            max_tokens=params.max_tokens,
            n=params.n,
            max_request_tokens=self.limits.max_request_tokens,
            truncate_to=truncate_prompt_tokens,
            add_special_tokens=add_special_tokens,
        )

    def check_ids(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """The engine's own checks of each prompt's ids (vocabulary, stop ids, KV pool)."""
        for index, ids in enumerate(prompts):
            try:
                self.validator.check(ids, params, params.n)
            except InvalidRequestError as err:
                prefix = f"prompt {index}: " if len(prompts) > 1 else ""
                raise InvalidRequestError(f"{prefix}{err}", err.param) from None


# -- /v1/completions -----------------------------------------------------------------------------
@dataclass
class CompletionInputs:
    prompts: list[list[int]]
    params: SamplingParams
    #: With ``echo``: each prompt as sent, as text (token ids decoded); else None.
    echoes: list[str] | None
    #: The compiled ``params.structured_outputs`` (None without one).
    grammar: CompiledGrammar | None = None


async def preprocess_completion(ctx: ServingContext, body: CompletionRequest) -> CompletionInputs:
    """Validate a completions request and tokenize its prompts; :class:`APIError` if refused."""
    ctx.check_model(body.model)
    ctx.check_priority(body.priority)
    constraint = body.constraint()
    params = body.sampling_params(constraint, ctx.sampling_defaults)
    prompts = body.prompts()
    ctx.check_size(len(prompts), params)  # first: a 200k-prompt list is refused before it is read
    limits = ctx.prompt_limits(params, body.truncate_prompt_tokens, body.add_special_tokens is not False)
    try:
        inputs = await ctx.encoder.run(_encode_completion, ctx, body, prompts, limits, params)
    except InvalidRequestError as err:
        raise APIError.from_value_error(err) from None
    inputs.grammar = await ctx.compile(constraint)
    return inputs


def _encode_completion(
    ctx: ServingContext,
    body: CompletionRequest,
    prompts: Sequence[str | list[int]],
    limits: PromptLimits,
    params: SamplingParams,
) -> CompletionInputs:
    """The prompts' ids and echoes (on the tokenizer thread, the text scan included: it reads
    every character of a body that may be 1 MiB)."""
    body.check_text()
    encoded = ctx.encoder.encode_prompts(prompts, limits)
    ctx.check_ids(encoded, params)
    echoes = None
    if body.echo:
        echoes = [
            p if isinstance(p, str) else ctx.tokenizer.decode(p, skip_special_tokens=False) for p in prompts
        ]
    return CompletionInputs(encoded, params, echoes)


# -- /v1/chat/completions ------------------------------------------------------------------------
@dataclass
class ChatInputs:
    prompt: list[int]
    params: SamplingParams
    #: The answer's role: the assistant's, or without a generation prompt the last message's.
    role: str
    #: What ``echo`` prepends to the answer ('' when nothing).
    echo: str
    #: The compiled ``params.structured_outputs`` (None without one).
    grammar: CompiledGrammar | None = None
    #: How tools are used: "none", "auto", "required" or "named" (:mod:`pagedkv.server.tools`).
    tool_mode: str = "none"
    #: The rendered conversation (a reasoning parser reads whether it opened a thinking block).
    prompt_text: str = ""


async def preprocess_chat(ctx: ServingContext, body: ChatCompletionRequest) -> ChatInputs:
    """Validate a chat request, render and tokenize its conversation; :class:`APIError` if refused."""
    ctx.check_model(body.model)
    ctx.check_priority(body.priority)
    check_chat_options(body, ctx.trust_request_chat_template)
    tool_mode = resolve_tool_choice(body.tools, body.tool_choice, ctx.tool_parser is not None)
    forced = tool_constraint(body.tools, tool_mode, body.tool_choice, body.parallel_tool_calls)
    constraint = body.constraint(forced)
    # Without max_tokens a chat runs to the end of the context (vLLM's default), known once the
    # prompt is; until then the fields are checked with the least it can be.
    params = body.sampling_params(max(1, body.min_tokens or 0), constraint, ctx.sampling_defaults)
    ctx.check_size(1, params)
    limits = ctx.prompt_limits(params, body.truncate_prompt_tokens, bool(body.add_special_tokens))
    messages = [m.as_template_dict(f"messages.{i}") for i, m in enumerate(body.messages)]
    role = "assistant" if body.add_generation_prompt is not False else messages[-1]["role"]
    echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == role else ""
    try:
        prompt, params, text = await ctx.encoder.run(
            _encode_chat, ctx, body, messages, limits, params, constraint
        )
    except InvalidRequestError as err:
        raise APIError.from_value_error(err) from None
    if tool_mode in ("auto", "none") and body.tools:
        await check_read_schemas(ctx.engine.engine.structured_outputs, body.tools)
    try:
        grammar = await ctx.compile(constraint)
    except APIError as refused:
        if constraint is forced and tool_mode == "required":  # name the tool at fault, if one is
            refused = await tool_at_fault(ctx.engine.engine.structured_outputs, body.tools) or refused
        raise refused from None
    return ChatInputs(prompt, params, role, echo, grammar, tool_mode, text)


def _encode_chat(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    limits: PromptLimits,
    params: SamplingParams,
    constraint: Constraint | None,
) -> tuple[list[int], SamplingParams, str]:
    """The conversation rendered (:mod:`pagedkv.server.chat_prompt`) and tokenized, and the final
    sampling parameters (on the tokenizer thread: the text scan and the template read the whole
    conversation)."""
    body.check_text()
    text = render_conversation(ctx.tokenizer, ctx.chat_template, body, messages)
    (prompt,) = ctx.encoder.encode_prompts([text], limits)
    if body.max_tokens_asked is None:
        ceiling = min(ctx.max_model_len, ctx.kv_capacity_tokens, ctx.limits.max_request_tokens // params.n)
        params = body.sampling_params(max(ceiling - len(prompt), 1), constraint, ctx.sampling_defaults)
    ctx.check_ids([prompt], params)
    return prompt, params, text
