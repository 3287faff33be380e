"""A draft model proposes: ``k`` greedy decode steps of a small model with the target's tokenizer.

For each speculating sequence, the draft first catches up on the tokens it has not seen (the
whole prompt the first time, then the one or two tokens the last verification added) and
proposes its argmax; then it feeds each proposal back for the next, ``k`` draft steps in all,
every sequence of the batch in the same draft steps. Greedy drafting is a point-mass proposal:
the rejection sampler accepts proposal ``x`` with the target's own probability of ``x``, which
keeps the target's distribution exact (and greedy verification keeps plain greedy's tokens).

The draft's keys and values live in its own pool
(:class:`~pagedkv.engine.worker.executor.draft.DraftExecutor`) under block tables kept here by
a :class:`~pagedkv.memory.KVCacheManager` of its own. What the draft fed a sequence is
remembered; at the next proposal its cache is cut back to the longest prefix the sequence's
tokens still share with it (a rejected proposal's keys are dropped, an accepted one's are
kept), so it never computes a verified token twice. A sequence whose draft blocks do not fit
proposes nothing that step; one the engine no longer runs is released.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.engine.config import EngineSettings
from pagedkv.engine.core.plan import SeqSlice, ShippedTables
from pagedkv.memory import KVCacheManager


class DraftModelProposer:
    """Proposals from a draft model (see the module docstring). ``executor`` runs the draft's
    steps (``execute(plan)`` -> one logits row per slice)."""

    def __init__(self, executor, num_blocks: int, block_size: int) -> None:
        self.executor = executor
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, watermark=0.0)
        #: the draft runner's copies of ``kv``'s tables, as the draft's plans sent them
        self.shipped_tables = ShippedTables()
        #: per sequence: the tokens whose keys and values the draft's cache holds, in order
        self._fed: dict[Hashable, list[int]] = {}
        #: per sequence: how many of its tokens were verified when it last proposed (a prefix of
        #: ``_fed`` known to match), and the length the draft treats as its prompt
        self._verified: dict[Hashable, int] = {}
        self._prompt_len: dict[Hashable, int] = {}

    @classmethod
    def load(
        cls, spec: SpeculativeConfig, config: EngineSettings, vocab_size: int, num_blocks: int
    ) -> DraftModelProposer:
        """The draft named by ``spec.model``, with a pool of ``num_blocks`` blocks."""
        from pagedkv.engine.worker.executor.draft import DraftExecutor  # loads torch and the model

        return cls(
            DraftExecutor(spec.model, config, num_blocks, vocab_size), num_blocks, config.cache.block_size
        )

    def propose(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]], num_tokens: Sequence[int]
    ) -> list[list[int]]:
        """Up to ``num_tokens[i]`` greedy draft tokens to follow ``token_ids[i]``."""
        proposals: list[list[int]] = [[] for _ in seq_ids]
        live = [i for i, k in enumerate(num_tokens) if k > 0 and self._sync(seq_ids[i], token_ids[i], k)]
        first = True
        while live:
            slices = []
            for i in live:
                seq_id = seq_ids[i]
                fed = self._fed[seq_id]
                new = list(token_ids[i][len(fed) :]) if first else proposals[i][-1:]
                slices.append(self._slice(seq_id, new, len(fed)))
                fed.extend(new)
            drafted = self.executor.execute(self.shipped_tables.plan(slices, self.kv)).argmax(dim=-1).tolist()
            for i, token in zip(live, drafted, strict=True):
                proposals[i].append(int(token))
            live = [i for i in live if len(proposals[i]) < num_tokens[i]]
            first = False
        return proposals

    def _slice(self, seq_id: Hashable, tokens: list[int], start: int) -> SeqSlice:
        return SeqSlice(seq_id, tokens, start, True, prompt_len=self._prompt_len[seq_id])

    def _sync(self, seq_id: Hashable, tokens: Sequence[int], k: int) -> bool:
        """Cut the draft's cache of ``seq_id`` back to what ``tokens`` still share with it and
        make room for the tokens the proposal feeds (the new ones and ``k - 1`` proposals);
        False (nothing changed beyond the cut) when the draft's pool cannot hold them."""
        fed = self._fed.get(seq_id)
        if fed is None:
            self.kv.allocate(seq_id, [], use_cache=False)
            fed = self._fed[seq_id] = []
            self._verified[seq_id] = 0
            self._prompt_len[seq_id] = len(tokens) - 1
        common = self._verified[seq_id]
        limit = min(len(fed), len(tokens) - 1)  # the last token is always fed: its logits propose
        while common < limit and fed[common] == tokens[common]:
            common += 1
        del fed[common:]
        self.kv.truncate(seq_id, common)
        fits = self.kv.try_append(seq_id, len(tokens) - common + k - 1) is not None
        self._verified[seq_id] = len(tokens) if fits else common  # fed only when it fits
        return fits

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence and free its draft blocks (idempotent)."""
        if self._fed.pop(seq_id, None) is not None:
            self.kv.free(seq_id)
        self._verified.pop(seq_id, None)
        self._prompt_len.pop(seq_id, None)
