"""How one request wants its tokens chosen, checked once when the request is made.

The names and meanings follow vLLM's ``SamplingParams`` (and through it the OpenAI API), so a
caller who knows either knows this one. Every field is validated in ``__post_init__``: a bad
value fails at the API boundary with a message naming the field and the value, instead of as
a NaN or an index error deep inside a batched sampling step where the request is anonymous.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Protocol

from pagedkv.engine.structured.params import StructuredOutputsParams

#: Below this temperature a request is greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by a
#: near-zero temperature would overflow, and the limit of the distribution is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5

#: The most top-logprobs a request may ask for per token (the OpenAI API's ``top_logprobs`` cap).
MAX_LOGPROBS = 20

#: The seeds ``torch.Generator.manual_seed`` accepts: a signed or unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)

#: The bound on a ``logit_bias`` value (the OpenAI API's): +-100 already makes a token certain or
#: impossible next to any logit a model gives.
LOGIT_BIAS_BOUND = 100.0

#: A surrogate code point standing alone (a valid pair is one code point in a Python str).
_SURROGATE = re.compile("[\ud800-\udfff]")


def unpaired_surrogate_at(text: str) -> int | None:
    """Index of the first unpaired UTF-16 surrogate in ``text``, or None if it is valid Unicode.

    JSON can carry ``"\\ud800"`` and a Python str can hold it, but it is not text: the tokenizer
    refuses it. Stop strings are checked here, prompts and every field of an HTTP request by
    :mod:`pagedkv.engine.validation` and the server.
    """
    match = _SURROGATE.search(text)
    return match.start() if match else None


def _fail(name: str, requirement: str, value: object) -> ValueError:
    """``name`` is the field, qualified by its class unless it already is."""
    qualified = name if "." in name else f"SamplingParams.{name}"
    return ValueError(f"{qualified} must be {requirement}, got {value!r}")


def _as_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in [low, high]; booleans are refused, they are not counts."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, "an integer", value)
    value = int(value)
    if low is not None and value < low:
        raise _fail(name, f">= {low}", value)
    if high is not None and value > high:
        raise _fail(name, f"<= {high}", value)
    return value


def _as_float(
    name: str,
    value: object,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite float within the bounds; ints are fine (``temperature=0``), bools not.

    The error quotes the value as the caller wrote it (``got -1``, not ``got -1.0``).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, "a number", value)
    number = float(value)
    if not math.isfinite(number):
        raise _fail(name, "finite", value)
    above = number > low if low_open else number >= low
    below = number < high if high_open else number <= high
    if not (above and below):
        if math.isinf(high):
            requirement = f"{'>' if low_open else '>='} {low}"
        else:
            requirement = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise _fail(name, requirement, value)
    return number


@dataclass
class SamplingParams:
    """Decoding settings of one request; see the module docstring for the conventions.

    Normalisations done at construction: ``stop`` becomes a list of strings, ``stop_token_ids``
    a list of ints (both empty when not given), ``top_k`` of 0 becomes -1 (both mean "off"),
    and numeric fields become plain ``int`` / ``float``.
    """

    #: Independent samples for the prompt; they share its KV blocks (fork, copy-on-write).
    n: int = 1
    #: Most tokens to generate per sample.
    max_tokens: int = 16
    #: Softmax temperature; 0 means greedy (argmax, the lowest id on ties).
    temperature: float = 1.0
    #: Nucleus sampling: keep the most likely tokens whose probabilities sum to ``top_p``.
    top_p: float = 1.0
    #: Keep only the ``top_k`` most likely tokens; -1 or 0 turns it off.
    top_k: int = -1
    #: Drop tokens whose probability is below ``min_p`` times the most likely token's.
    min_p: float = 0.0
    #: Per-request seed: the same seed gives the same tokens whatever else is in the batch.
    seed: int | None = None
    #: Strings that end generation when they appear in the output text (not included in it).
    stop: str | list[str] | None = None
    #: Token ids that end generation (besides EOS).
    stop_token_ids: list[int] | None = None
    #: Keep generating past EOS (benchmarks that need a fixed output length).
    ignore_eos: bool = False
    #: Top logprobs to return per generated token besides the sampled token's own; None: none.
    logprobs: int | None = None
    #: Top logprobs to return per prompt token besides the prompt token's own (vLLM's
    #: ``prompt_logprobs``); None: none. The prompt's first token has none (nothing precedes it).
    prompt_logprobs: int | None = None
    #: OpenAI presence penalty: subtracted once from every token already generated.
    presence_penalty: float = 0.0
    #: OpenAI frequency penalty: subtracted once per earlier occurrence in the output.
    frequency_penalty: float = 0.0
    #: HF/CTRL repetition penalty over prompt and output tokens (> 1 discourages repeats).
    repetition_penalty: float = 1.0
    #: EOS and stop tokens cannot be sampled before this many tokens are generated.
    min_tokens: int = 0
    #: Leave special tokens (EOS, chat-turn markers) out of the output text; their ids stay.
    skip_special_tokens: bool = True
    #: Constrain the output to a JSON schema, a regex, a choice or a grammar (vLLM's name); the
    #: engine compiles it before the request is queued (``engine/structured/``).
    structured_outputs: StructuredOutputsParams | None = None
    #: Token id -> a value in [-100, 100] added to its logit before penalties and sampling.
    logit_bias: dict[int, float] | None = None
    #: Only these token ids can be generated (every other logit becomes -inf); None: any.
    allowed_token_ids: list[int] | None = None
    #: Words that never appear in the output: each word's last token is banned wherever the
    #: output so far ends with its other tokens (as tokenized with and without a leading space).
    bad_words: list[str] | None = None
    #: Keep the matched stop string at the end of the output text (``stop_reason`` still names it).
    include_stop_str_in_output: bool = False
    #: With special tokens shown: False writes an added token that follows another one without
    #: the space a decoder may put before it (vLLM's); True: the text is the tokenizer's ``decode``.
    spaces_between_special_tokens: bool = True
    #: ``bad_words`` as token sequences, set by :meth:`update_from_tokenizer` (vLLM's name) when
    #: the engine takes the request: the sampler reads this, never the words.
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n, low=1)
        self.max_tokens = _as_int("max_tokens", self.max_tokens, low=1)
        self.temperature = _as_float("temperature", self.temperature, low=0)
        self.top_p = _as_float("top_p", self.top_p, low=0, high=1, low_open=True)
        self.top_k = _as_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            self.top_k = -1
        self.min_p = _as_float("min_p", self.min_p, low=0, high=1)
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed, low=SEED_RANGE[0], high=SEED_RANGE[1])
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise _fail("ignore_eos", "a bool", self.ignore_eos)
        if not isinstance(self.skip_special_tokens, bool):
            raise _fail("skip_special_tokens", "a bool", self.skip_special_tokens)
        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _as_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        self.presence_penalty = _as_float("presence_penalty", self.presence_penalty, low=-2, high=2)
        self.frequency_penalty = _as_float("frequency_penalty", self.frequency_penalty, low=-2, high=2)
        self.repetition_penalty = _as_float(
            "repetition_penalty", self.repetition_penalty, low=0, low_open=True
        )
        self.min_tokens = _as_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        _check_structured_outputs("SamplingParams.structured_outputs", self.structured_outputs)
        self._normalise_token_fields()

    def _normalise_token_fields(self) -> None:
        """The fields that act on token ids or text: ``logit_bias``, ``allowed_token_ids``,
        ``bad_words`` and the two text switches."""
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._normalise_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise _fail("allowed_token_ids", "a non-empty list of token ids", self.allowed_token_ids)
        self.bad_words = self._normalise_bad_words(self.bad_words)
        for name in ("include_stop_str_in_output", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "a bool", getattr(self, name))

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        """A dict of token id -> finite bias within +-``LOGIT_BIAS_BOUND``; None or empty: None.

        vLLM clamps a bias outside the bound; the OpenAI API refuses it, and so does this: a
        value the caller did not mean is worth an error."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise _fail("logit_bias", "a dict of token id -> bias", bias)
        return {
            _as_int("logit_bias", token, low=0): _as_float(
                f"SamplingParams.logit_bias[{token!r}]", value, low=-LOGIT_BIAS_BOUND, high=LOGIT_BIAS_BOUND
            )
            for token, value in bias.items()
        } or None

    @staticmethod
    def _normalise_bad_words(words: object) -> list[str] | None:
        if words is None:
            return None
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise _fail("bad_words", "a list of strings", words)
        if any(not w.strip() for w in words):
            raise _fail("bad_words", "made of words that are not blank", words)
        if any(unpaired_surrogate_at(w) is not None for w in words):
            raise _fail("bad_words", "valid Unicode text (no unpaired surrogate)", words)
        return list(words) or None

    def update_from_tokenizer(self, tokenizer: _Encoder) -> None:
        """Set :attr:`bad_words_token_ids` from ``bad_words``, as vLLM does: each word (its
        leading spaces stripped) is encoded without special tokens, then again after one space,
        and the second form is kept when it is a different word of the same length (a tokenizer
        whose words carry their leading space, so the word mid-text is other tokens)."""
        if not self.bad_words:
            self.bad_words_token_ids = None
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        self.bad_words_token_ids = [s for s in sequences if s]

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise _fail("stop", "a string or a list of strings", stop)
        if any(s == "" for s in items):
            raise _fail("stop", "made of non-empty strings", stop)
        if any(unpaired_surrogate_at(s) is not None for s in items):
            raise _fail("stop", "valid Unicode text (no unpaired surrogate)", stop)
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        return [] if ids is None else SamplingParams._normalise_ids("stop_token_ids", ids)

    @staticmethod
    def _normalise_ids(name: str, ids: object) -> list[int]:
        """A list of non-negative ints (the vocabulary is checked by the engine, which knows it)."""
        if not isinstance(ids, (list, tuple)):
            raise _fail(name, "a list of integers", ids)
        # Plain non-negative ints (what JSON gives) pass in one cheap sweep: an oversized list
        # reaches the request limits at once instead of through a Python call per id.
        if all(type(i) is int for i in ids) and min(ids, default=0) >= 0:
            return list(ids)
        return [_as_int(name, i, low=0) for i in ids]

    @property
    def constrains_tokens(self) -> bool:
        """Whether the sampler must edit this request's logits for ``logit_bias``,
        ``allowed_token_ids`` or ``bad_words`` (see :mod:`pagedkv.engine.sample.token_constraints`)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax instead of drawing (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def _check_structured_outputs(name: str, value: object) -> None:
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise _fail(name, "a StructuredOutputsParams or None", value)


@dataclass
class BeamSearchParams:
    """Settings of one beam search (vLLM's ``BeamSearchParams``); see ``engine/sample/beam_search.py``.

    ``structured_outputs`` constrains every beam (each holds its own grammar state); it excludes
    ``ignore_eos``, since a beam whose grammar is complete can only end.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.beam_width = _as_int("BeamSearchParams.beam_width", self.beam_width, low=1)
        self.max_tokens = _as_int("BeamSearchParams.max_tokens", self.max_tokens, low=1)
        self.length_penalty = _as_float("BeamSearchParams.length_penalty", self.length_penalty)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"BeamSearchParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_structured_outputs("BeamSearchParams.structured_outputs", self.structured_outputs)
        if self.ignore_eos and self.structured_outputs is not None:
            raise ValueError(
                "BeamSearchParams.ignore_eos cannot be set with structured_outputs: a beam whose "
                "grammar is complete can only end"
            )

    def sampling_params(self) -> SamplingParams:
        """What each beam's steps run with: greedy, to ``max_tokens``, under the constraint."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=0.0,
            ignore_eos=self.ignore_eos,
            structured_outputs=self.structured_outputs,
        )
