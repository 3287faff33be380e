"""Paged batches for model tests: contiguous block assignment, built by hand.

The engine's model runner builds the real thing from block tables the KV cache manager hands
out; these tests only need *some* valid layout, so each sequence gets its own run of blocks.
Sequences are deliberately not block-aligned and blocks are small, so every test crosses block
boundaries.
"""

from __future__ import annotations

import torch

from pagedkv.attention import AttentionMetadata, KVCache
from pagedkv.models import LlamaForCausalLM
from pagedkv.models.ops import LoRARows

BLOCK_SIZE = 4


class PagedBatch:
    """Sequences that live in one KV cache; ``prefill`` then ``decode`` steps, packed."""

    def __init__(
        self, model: LlamaForCausalLM, max_len: int, num_seqs: int, block_size: int = BLOCK_SIZE
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_seqs * self.blocks_per_seq
        self.device = model.model.norm.weight.device  # the model's
        self.kv_cache = KVCache(model.config.kv_spec(), num_blocks, block_size, device=self.device)
        self.tables = torch.arange(num_blocks, dtype=torch.int32).reshape(num_seqs, self.blocks_per_seq)
        self.lens = [0] * num_seqs

    def _slot(self, seq: int, pos: int) -> int:
        return int(self.tables[seq, pos // self.block_size]) * self.block_size + pos % self.block_size

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
        ids, positions, slots, cu = [], [], [], [0]
        for seq, tokens in enumerate(new_tokens):
            start = self.lens[seq]
            for offset, token in enumerate(tokens):
                ids.append(token)
                positions.append(start + offset)
                slots.append(self._slot(seq, start + offset))
            self.lens[seq] += len(tokens)
            cu.append(cu[-1] + len(tokens))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=self.tables.to(self.device),
            context_lens=torch.tensor(self.lens, dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            max_query_len=max(len(t) for t in new_tokens),
            prompt_lens=None
            if prompt_lens is None
            else torch.tensor(prompt_lens, dtype=torch.int32, device=self.device),
        )
        with torch.inference_mode():
            rows = None if output_rows is None else torch.tensor(output_rows, device=self.device)
            ids_t, positions_t = (
                torch.tensor(ids, device=self.device),
                torch.tensor(positions, device=self.device),
            )
            hidden = self.model(ids_t, positions_t, self.kv_cache, metadata, rows, lora)
        return hidden, cu
