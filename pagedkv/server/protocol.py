"""The OpenAI request shapes the server takes (pydantic models): what completions and chat
completions share, and the completion request; the chat request is in
:mod:`pagedkv.server.chat_protocol`, responses in :mod:`pagedkv.server.responses`.

Request models accept what the official clients send -- unknown fields are accepted, as vLLM
accepts them, and named in a warning and a response header (:mod:`pagedkv.server.ignored_fields`)
-- and map onto :class:`~pagedkv.engine.SamplingParams`, whose own validation then names
any bad value. vLLM's extra fields mean what they mean in vLLM (``top_k``, ``min_p``,
``ignore_eos``, ``skip_special_tokens``, ``truncate_prompt_tokens``, ``echo``,
``add_generation_prompt``, ``continue_final_message``, ``structured_outputs`` and the older
``guided_*``, ``allowed_token_ids``, ``bad_words``, ``include_stop_str_in_output``,
``spaces_between_special_tokens``, ...); OpenAI's ``logit_bias`` maps token-id strings to
biases. What constrains the output (``response_format``, ``structured_outputs``, ``guided_*``)
is read by :mod:`pagedkv.server.structured`, ``tools`` and ``tool_choice`` by
:mod:`pagedkv.server.tools`. Fields that would change the meaning of a request but are not
implemented (``suffix``, beam search, the deprecated ``functions``, ...) are
refused with a 400 naming the field rather than dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, Strict

from pagedkv.engine import SamplingParams
from pagedkv.engine.sampling_params import unpaired_surrogate_at
from pagedkv.server.errors import APIError
from pagedkv.server.structured import (
    GUIDED_FIELDS,
    Constraint,
    ResponseFormat,
    StructuredOutputsRequest,
    request_constraint,
)

# Strict scalars: JSON ``true`` is not the number 1, ``"0.5"`` is not a float, ``2.0`` is not a count.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


def _invalid_text_at(value: object, path: str) -> str | None:
    """The dotted path of the first string (or key) in ``value`` holding an unpaired surrogate."""
    if isinstance(value, str):
        return path if unpaired_surrogate_at(value) is not None else None
    if isinstance(value, BaseModel):
        items = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and not (value and isinstance(value[0], int)):  # typed: all ints
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and unpaired_surrogate_at(key) is not None:
            return where
        found = _invalid_text_at(item, where)
        if found is not None:
            return found
    return None


def refuse_invalid_text(value: object) -> None:
    """A 400 naming the first string (or key) in ``value`` holding an unpaired surrogate: JSON can
    carry ``"\\ud800"``, Python holds it, but it is not Unicode text, and the tokenizer would fail
    on it mid-request."""
    path = _invalid_text_at(value, "")
    if path is not None:
        raise APIError.bad_request(
            f"{path} holds an unpaired UTF-16 surrogate (U+D800..U+DFFF): it is not valid Unicode text",
            param=path,
        )


class StreamOptions(BaseModel):
    include_usage: Bool = False
    #: vLLM's: with ``include_usage``, every chunk carries the usage so far.
    continuous_usage_stats: Bool = False


def _asks_for_something(value: object) -> bool:
    """Whether a field not implemented here was set to ask for something: absent, null, false,
    empty and ``"none"`` ask for nothing."""
    return bool(value) and value != "none"


class SamplingRequest(BaseModel):
    """The fields completions and chat share."""

    model: str | None = None
    n: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    user: str | None = None
    best_of: Int | None = None
    # vLLM's extra sampling parameters.
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int | None = 0
    ignore_eos: Bool | None = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: Bool | None = True
    #: Keep only the prompt's last this many tokens; -1: as many as fit beside ``max_tokens``.
    truncate_prompt_tokens: Int | None = None
    #: OpenAI's: token id (a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: dict[str, Float] | None = None
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: Bool | None = False
    spaces_between_special_tokens: Bool | None = True
    # What constrains the output (pagedkv.server.structured): one of them at most.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: vLLM's: a regex the whitespace between JSON tokens matches (with a JSON constraint).
    guided_whitespace_pattern: str | None = None
    # llama.cpp's and SGLang's names for the same constraints (pagedkv.server.structured).
    json_schema: dict[str, Any] | str | None = None
    grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    # Undeclared fields are kept (in ``model_extra``) so that vLLM's fields that are not
    # implemented here can be refused by name: those named in ``_refused`` (declared or not).
    model_config = ConfigDict(extra="allow")
    _refused: ClassVar[tuple[str, ...]] = (
        "use_beam_search",
    )  # fmt: skip
    #: vLLM's: lower runs first under --scheduling-policy priority (anything but 0 is refused
    #: otherwise).
    priority: Int = 0
    #: vLLM's: logprob tokens read ``"token_id:N"`` instead of their text.
    return_tokens_as_token_ids: Bool | None = None
    #: vLLM's: a non-empty string; the request reuses cached KV blocks only of requests with the
    #: same salt (one tenant cannot time another's prompts through the prefix cache).
    cache_salt: Annotated[str, Field(min_length=1)] | None = None

    def check_text(self) -> None:
        """Refuse any string holding an unpaired surrogate (:func:`refuse_invalid_text`)."""
        refuse_invalid_text(self)

    def _refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in self._refused:
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if _asks_for_something(value):
                raise APIError.bad_request(f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:  # vLLM's rule: it would do nothing
            raise APIError.bad_request("stream_options needs stream to be true", param="stream_options")
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of != n:
            raise APIError.bad_request(
                f"best_of ({self.best_of}) different from n ({n}) is not supported", param="best_of"
            )

    def constraint(self, tools: Constraint | None = None) -> Constraint | None:
        """What the request constrains its output to (``tools``: what its tool choice forces)."""
        guided = {name: getattr(self, name) for name in GUIDED_FIELDS}
        return request_constraint(
            self.structured_outputs, self.response_format, guided, tools, self.guided_whitespace_pattern
        )

    def _sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        constraint: Constraint | None = None,
        defaults: Mapping[str, Any] = {},
    ) -> SamplingParams:
        """The engine's parameters; a bad value becomes a 400 naming the field. ``defaults``: the
        model's (``LLMEngine.default_sampling_params``), for the fields the request leaves unset."""
        options: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": self._logit_bias(),
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "structured_outputs": constraint.params if constraint is not None else None,
        }
        # None (absent or JSON null) means "the default": the model's, else SamplingParams' own,
        # except for the fields where None itself is the value (no logprobs, no seed, no stops).
        options |= {k: v for k, v in defaults.items() if k in options and options[k] is None}
        keep_none = {"logprobs", "prompt_logprobs", "seed", "stop", "stop_token_ids", "structured_outputs"}
        keep_none |= {"logit_bias", "allowed_token_ids", "bad_words"}
        options = {k: v for k, v in options.items() if v is not None or k in keep_none}
        try:
            return SamplingParams(**options)
        except ValueError as err:
            raise APIError.from_value_error(err) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids; a key that is not an integer is a 400 (the
        vocabulary and the bounds are checked by the engine, naming ``logit_bias`` too)."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError.bad_request(
                    f"logit_bias keys must be token ids (integers), got {key!r}", param="logit_bias"
                ) from None
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk: ``continuous_usage_stats`` with ``include_usage``."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt or a batch (text or token ids).

    ``echo`` prepends each prompt (as sent; token ids decoded) to its choices' text, and with
    ``logprobs`` the prompt tokens' logprobs to theirs (the first is null); with ``max_tokens``
    0 the choices are the prompt alone (one token is generated and not shown, as in vLLM).
    """

    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    #: vLLM's extra parameter: the logprob of every prompt token and its top ``prompt_logprobs``.
    prompt_logprobs: Int | None = None
    echo: Bool | None = False
    #: Add the tokenizer's special tokens (BOS) to text prompts.
    add_special_tokens: Bool | None = True
    suffix: str | None = None

    _refused = (*SamplingRequest._refused, "suffix", "prompt_embeds")

    def prompts(self) -> list[str | list[int]]:
        """The batch as a list: a string or a list of ints is one prompt."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise APIError.bad_request("prompt must not be empty", param="prompt")
        return list(prompt)

    @property
    def echo_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0

    def sampling_params(
        self, constraint: Constraint | None = None, defaults: Mapping[str, Any] = {}
    ) -> SamplingParams:
        """``defaults``: the model's sampling defaults; its ``max_tokens`` replaces a null one."""
        self._refuse_unsupported()
        max_tokens = defaults.get("max_tokens", 16) if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and prompt_logprobs is None:
            prompt_logprobs = self.logprobs  # echo's logprobs start with the prompt's (vLLM)
        max_tokens = 1 if self.echo_only else max_tokens
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, constraint, defaults)
