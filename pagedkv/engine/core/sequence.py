"""The state of one generated sequence and of the request that owns it.

A request with ``n > 1`` starts as one sequence; when its prompt is computed it forks into ``n``
sequences that share the prompt's KV blocks (copy-on-write). Each sequence is scheduled on its
own from then on. A beam search request keeps its search state (:class:`BeamState`) here too;
the search itself is in :mod:`pagedkv.engine.sample.beam_search`.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.engine.lora_request import LoRARequest
from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.engine.stop_strings import StopScan, StopStringMatcher
from pagedkv.engine.structured.matcher import GrammarMatcher
from pagedkv.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # the scheduler reads sequences without torch; only the sampler's fields hold tensors
    import torch

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens, progress and KV bookkeeping of one sequence.

    ``num_computed_tokens`` counts tokens whose keys/values are in the cache; the tokens from
    there to ``num_tokens`` are what the next steps compute. A decoding sequence has exactly
    one: the token it sampled last. Two places write it: the scheduler when it admits or
    preempts the sequence, and the step's commit point (:mod:`pagedkv.engine.core.commit`) after the
    forward pass.
    """

    request: Request
    index: int
    token_ids: list[int]
    generator: torch.Generator | None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    #: How often this sequence lost its KV blocks and had to recompute them.
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: Streams the text of the generated tokens; None for beams, decoded once the search ends.
    detokenizer: IncrementalDetokenizer | None = None
    #: Beam search: this step's next-token log-probabilities, kept until every beam has its own.
    pending_logprobs: torch.Tensor | None = None
    #: Where ``text`` stands among the request's stop strings (None when it has none).
    stop_scan: StopScan | None = field(default=None, init=False)
    #: Structured output: where this sequence's generated tokens stand in its request's grammar
    #: (None when unconstrained). Every sequence holds its own, forked like its block table;
    #: it has accepted exactly the output tokens, so a preempted sequence that recomputes its
    #: tokens keeps it as it is.
    grammar: GrammarMatcher | None = field(default=None, init=False)
    #: Tokens proposed to follow ``token_ids`` this step (vLLM's name), verified by the target
    #: model in the step's forward pass. Never part of ``token_ids``: only what verification
    #: accepts is appended, so nothing built on ``token_ids`` (the prefix cache, stop strings,
    #: the detokenizer) ever sees an unverified token.
    spec_token_ids: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.request.stop_matcher is not None:
            self.stop_scan = StopScan(self.request.stop_matcher)

    def fork(self, index: int, generator: torch.Generator | None) -> Sequence:
        """A new sequence of the same request with this one's tokens and a copy of its grammar
        state; the commit point gives it this one's progress and KV blocks
        (:class:`~pagedkv.engine.core.commit.Fork`)."""
        child = Sequence(self.request, index, list(self.token_ids), generator)
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """Its slices must return the logits of every row, not only the last: its request asked
        for prompt logprobs and they are not all computed yet. Such a sequence also skips the
        prefix cache at admission (vLLM's rule): a cached token's logits do not exist."""
        recorded = self.request.prompt_logprobs
        return recorded is not None and len(recorded) < self.prompt_len

    @property
    def num_copies(self) -> int:
        """Sequences this one becomes: itself plus the samples or beams still to fork from it
        (they fork when its prompt is computed)."""
        request = self.request
        if request.beam is not None:
            return request.beam.params.beam_width if self.num_output_tokens == 0 else 1
        return request.params.n - len(request.seqs) + 1

    @property
    def in_prefill(self) -> bool:
        """More than one token still to compute (a prompt, or a recomputation after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1


@dataclass
class Hypothesis:
    """A finished or surviving beam: its generated tokens and their summed log-probability."""

    token_ids: list[int]
    cumulative_logprob: float
    ended_with_eos: bool = False

    def score(self, length_penalty: float) -> float:
        length = len(self.token_ids) - int(self.ended_with_eos)
        return self.cumulative_logprob / max(length, 1) ** length_penalty


@dataclass
class BeamState:
    """Per-request beam search bookkeeping; the live beams are the request's sequences."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    finished: list[Hypothesis] = field(default_factory=list)
    #: The best ``beam_width`` hypotheses, set when the search ends.
    results: list[Hypothesis] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One call of ``add_request``: a prompt, its sampling parameters and its sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    #: Set for beam search requests; their live beams are ``seqs``.
    beam: BeamState | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    #: Why the request failed inside the engine, if it did (see ``fault_isolation``).
    error: str | None = None
    #: The prompt logprobs computed so far (position ``i`` scores prompt token ``i``; the first
    #: is None), when the request asked for them; see :mod:`pagedkv.engine.sample.prompt_logprobs`.
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None, init=False)
    #: ``params.stop_token_ids`` as a set: a membership test per token that does not grow with it.
    stop_token_ids: frozenset[int] = field(default=frozenset(), init=False)
    #: The automaton of ``params.stop``, built once and shared by the request's sequences.
    stop_matcher: StopStringMatcher | None = field(default=None, init=False)
    #: Scheduling priority under the ``priority`` policy: lower runs first (vLLM's).
    priority: int = 0
    #: The client request this one is part of, e.g. the HTTP request whose prompts it is one of;
    #: None: itself. Fair admission (:mod:`pagedkv.engine.core.fairness`) shares the engine out per
    #: client request.
    client_request_id: str | None = None
    #: vLLM's ``cache_salt``: the request shares cached KV blocks only with requests of the same
    #: salt (None: with unsalted ones); see :mod:`pagedkv.memory.block_hash`.
    cache_salt: str | None = None
    #: The LoRA adapter the request runs with; None: the base model.
    lora_request: LoRARequest | None = None
    #: What speculative decoding drafted and accepted for this request's sequences (None: the
    #: engine does not speculate).
    spec_decoding: SpecDecodingStats | None = field(default=None, init=False)
    #: Why this request does not speculate although the engine does (e.g. beam search).
    spec_disabled_reason: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.stop_token_ids = frozenset(self.params.stop_token_ids)
        if self.params.stop:
            self.stop_matcher = StopStringMatcher(self.params.stop)

    @property
    def client(self) -> str:
        """The id fair admission counts this request's sequences under."""
        return self.request_id if self.client_request_id is None else self.client_request_id

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def lora_int_id(self) -> int | None:
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def prefix_salt(self) -> str | None:
        """What the prefix cache salts this request's blocks with: its ``cache_salt``, and with
        an adapter the adapter too -- the same tokens make other keys and values under another
        adapter, so blocks are shared only between requests of one adapter. (A user's salt is
        text; a NUL never appears in one, so no salt names an adapter's.)"""
        lora = self.lora_request
        if lora is None:
            return self.cache_salt
        adapter = f"{lora.lora_int_id}\x00{lora.lora_name}\x00{lora.lora_path}"
        return f"\x00lora\x00{adapter}\x00{self.cache_salt or ''}"

    @property
    def needs_fork(self) -> bool:
        """True until the ``n`` samples exist (they fork when the prompt is computed)."""
        return len(self.seqs) < self.params.n
