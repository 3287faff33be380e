"""The speculative decoding an engine runs, built from its ``speculative_config``."""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.config.speculative import NGRAM
from pagedkv.engine.config import EngineSettings
from pagedkv.engine.spec.ngram import NgramProposer
from pagedkv.engine.spec.speculator import Proposer, Speculator
from pagedkv.engine.spec.verify import Verifier


def make_verifier(
    config: EngineSettings, max_model_len: int, vocab_size: int, eos_token_ids: Iterable[int], num_blocks: int
) -> Verifier | None:
    """The engine's proposer, policy and verifier; None when ``config`` does not speculate. A
    draft model is loaded here, with a KV pool of as many blocks as the target's (``num_blocks``):
    a name that is neither a folder nor a shipped model, or a model of another vocabulary, is
    refused with a ValueError naming ``speculative_config.model``."""
    spec = config.speculative
    if spec is None:
        return None
    proposer: Proposer
    if spec.method == NGRAM:
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from pagedkv.engine.spec.draft import DraftModelProposer  # loads a model: only when asked

        proposer = DraftModelProposer.load(spec, config, vocab_size, num_blocks)
    speculator = Speculator(spec, proposer, config.scheduler.max_num_batched_tokens, max_model_len)
    return Verifier(speculator, eos_token_ids)
