"""``--speculative-config``: how the engine proposes tokens for the target model to verify.

The shape is vLLM's ``SpeculativeConfig``, given as a JSON object on the command line or a dict
to ``LLM(speculative_config=...)``:

- ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
  "prompt_lookup_max": b}``: prompt lookup, no second model (:mod:`.ngram`). As in vLLM both
  bounds default to 5, and one given alone sets the other.
- ``{"model": DIR, "num_speculative_tokens": k}``: a smaller draft model with the target's
  tokenizer; ``"method": "draft_model"`` is implied (and accepted when written).

Every refusal is a ``ValueError`` that names the field (``speculative_config.<field>``). Methods
vLLM has but pagedkv does not (EAGLE, MTP, Medusa, ...) are refused as "not supported", any
other name as unknown; unknown fields are refused too, so a typo never silently turns a setting
off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.config.checks import json_object, positive_int

NGRAM, DRAFT_MODEL = "ngram", "draft_model"

#: vLLM's methods that need weights or kernels pagedkv does not have.
UNSUPPORTED_METHODS = frozenset(
    {"eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix", "ngram_gpu", "custom_class"}
)

#: vLLM's defaults for prompt lookup when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5

_FIELDS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
)


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _positive_int(name: str, value: object) -> int:
    return positive_int(_field(name), value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative decoding setup (build it with :meth:`from_dict` or :meth:`from_json`)."""

    #: "ngram" or "draft_model".
    method: str
    #: Tokens proposed per sequence and step, at most: the adaptive policy may propose fewer.
    num_speculative_tokens: int
    #: The draft model's folder (method "draft_model" only).
    model: str | None = None
    #: Shortest and longest n-gram prompt lookup matches (method "ngram" only).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    #: No speculation while more than this many sequences run (vLLM's name); None: no such bound.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == NGRAM:
            self._check_ngram()
        elif self.method == DRAFT_MODEL:
            self._check_draft_model()
        else:
            raise ValueError(f"{_field('method')} must be 'ngram' or 'draft_model', got {self.method!r}")

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError(f"{_field('model')} names a draft model, which method 'ngram' does not use")
        low = _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        high = _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if low > high:
            raise ValueError(
                f"{_field('prompt_lookup_min')} ({low}) must be <= {_field('prompt_lookup_max')} ({high})"
            )

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{_field('model')} must be the draft model's folder, got {self.model!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"{_field(name)} only applies to method 'ngram', not 'draft_model'")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        """Parse vLLM's ``speculative_config`` dict (see the module docstring)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"{_field(str(unknown[0]))} is not a setting pagedkv knows (it knows {', '.join(_FIELDS)})"
            )
        method = _method(data)
        fields = {name: data.get(name) for name in _FIELDS if name != "method"}
        if "num_speculative_tokens" not in data:
            raise ValueError(f"{_field('num_speculative_tokens')} is required")
        if method == NGRAM:
            fields["model"] = None if data.get("model") in ("ngram", "[ngram]") else data.get("model")
            low, high = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
            if low is None and high is None:
                low = high = DEFAULT_PROMPT_LOOKUP
            fields["prompt_lookup_min"] = high if low is None else low
            fields["prompt_lookup_max"] = low if high is None else high
        return cls(method=method, **fields)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse ``--speculative-config`` (a JSON object)."""
        return cls.from_dict(json_object("speculative_config", text))


def _method(data: Mapping[str, Any]) -> str:
    """The method the dict asks for: written, or implied by ``model`` (vLLM's rule: a model named
    "ngram" means prompt lookup, any other model a draft model)."""
    method, model = data.get("method"), data.get("model")
    if method is None:
        if model is None:
            raise ValueError(f"{_field('method')} or {_field('model')} is required")
        return NGRAM if model in ("ngram", "[ngram]") else DRAFT_MODEL
    if method in (NGRAM, "[ngram]"):
        return NGRAM
    if method == DRAFT_MODEL:
        return DRAFT_MODEL
    if isinstance(method, str) and (method in UNSUPPORTED_METHODS or method.endswith("_mtp")):
        raise ValueError(
            f"{_field('method')} {method!r} is not supported: pagedkv speculates with 'ngram' "
            "(prompt lookup) or 'draft_model'"
        )
    raise ValueError(f"{_field('method')} must be 'ngram' or 'draft_model', got {method!r}")
