"""Paged batches for model tests: contiguous block assignment, built by hand.

The engine's model runner builds the real thing from block tables the KV cache manager hands
out; these tests only need *some* valid layout, so each sequence gets its own run of blocks.
Sequences are deliberately not block-aligned and blocks are small, so every test crosses block
boundaries.
"""

from __future__ import annotations

import torch

from pagedkv.attention import AttentionMetadata, KVCache
from pagedkv.memory.kv_groups import KVGroups
from pagedkv.models import LlamaForCausalLM
from pagedkv.models.ops import LoRARows

BLOCK_SIZE = 4


class PagedBatch:
    """Sequences that live in one KV cache; ``prefill`` then ``decode`` steps, packed."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_len: int,
        num_seqs: int,
        block_size: int = BLOCK_SIZE,
        groups: KVGroups | None = None,
    ) -> None:
        """``groups``: page the cache by these KV groups (hybrid paging), each group's tables on
        blocks of its own (group ``g``'s after group ``g - 1``'s)."""
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_seqs * self.blocks_per_seq
        num_groups = 1 if groups is None else groups.num_groups
        self.device = model.model.norm.weight.device  # the model's
        self.kv_cache = KVCache(
            model.config.kv_spec(), num_blocks * num_groups, block_size, device=self.device, groups=groups
        )
        blocks = torch.arange(num_blocks * num_groups, dtype=torch.int32)
        #: [groups, num_seqs, blocks_per_seq]
        self.group_tables = blocks.reshape(num_groups, num_seqs, self.blocks_per_seq)
        self.lens = [0] * num_seqs

    def _slot(self, seq: int, pos: int, group: int = 0) -> int:
        block = int(self.group_tables[group, seq, pos // self.block_size])
        return block * self.block_size + pos % self.block_size

    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Run one packed forward over each sequence's ``new_tokens``; return each sequence's
        float32 logits ``[len(new), vocab]``."""
        hidden, cu = self.forward(new_tokens)
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden)
        return [logits[cu[i] : cu[i + 1]] for i in range(len(new_tokens))]

    def forward(
        self,
        new_tokens: list[list[int]],
        output_rows: list[int] | None = None,
        prompt_lens: list[int] | None = None,
        lora: LoRARows | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """The model's packed hidden states for each sequence's ``new_tokens`` (only the packed
        rows ``output_rows``, when given), and where each sequence's rows start (its last entry:
        the row count). ``prompt_lens``: each sequence's prompt length, as the engine passes it
        (positions from there on are generated tokens). ``lora``: the rows' LoRA adapters."""
        ids, positions, cu = [], [], [0]
        for seq, tokens in enumerate(new_tokens):
            start = self.lens[seq]
            ids += tokens
            positions += range(start, start + len(tokens))
            self.lens[seq] += len(tokens)
            cu.append(cu[-1] + len(tokens))

        def metadata_of(group: int) -> AttentionMetadata:
            seqs = [seq for seq, tokens in enumerate(new_tokens) for _ in tokens]
            slots = [self._slot(seq, pos, group) for seq, pos in zip(seqs, positions, strict=True)]
            return AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
                block_tables=self.group_tables[group].to(self.device),
                context_lens=torch.tensor(self.lens, dtype=torch.int32, device=self.device),
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
                max_query_len=max(len(t) for t in new_tokens),
                prompt_lens=None
                if prompt_lens is None
                else torch.tensor(prompt_lens, dtype=torch.int32, device=self.device),
            )

        metadata = metadata_of(0)
        if self.group_tables.shape[0] > 1:
            metadata.groups = tuple([metadata, *map(metadata_of, range(1, self.group_tables.shape[0]))])
        with torch.inference_mode():
            rows = None if output_rows is None else torch.tensor(output_rows, device=self.device)
            ids_t, positions_t = (
                torch.tensor(ids, device=self.device),
                torch.tensor(positions, device=self.device),
            )
            hidden = self.model(ids_t, positions_t, self.kv_cache, metadata, rows, lora)
        return hidden, cu
