"""Streaming detokenization: text deltas for tokens that arrive one at a time.

Decoding token by token and joining the pieces is wrong for two reasons: byte-level BPE can
split one UTF-8 character over several tokens (each alone decodes to U+FFFD), and some decoders
(SentencePiece's leading-space rule) decode a token differently at the start of a string. So,
like vLLM, each step decodes a short window twice -- from ``prefix_offset`` up to the tokens
already emitted, and up to the newest -- and emits the difference, holding it back while it
ends in U+FFFD (an unfinished character). Cost per token is O(window), not O(sequence).

Special tokens shown (``skip_special_tokens=False``), the text is the tokenizer's ``decode``,
which for some decoders (WordPiece, or none) puts a space between two added tokens. With
``spaces_between_special_tokens=False`` an added token that follows another one is written as
its bare content instead, as vLLM's detokenizer does; the text of every other token is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

#: Prompt tokens kept as left context so the first generated token decodes as it would mid-text.
PROMPT_CONTEXT = 5

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with :meth:`push`; the joined deltas plus :meth:`flush` equal
    ``decode(generated ids)`` (for byte-level BPE; for other decoders, the generated text as it
    reads after the prompt)."""

    def __init__(
        self,
        decode: Callable[..., str],
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        added_tokens: Mapping[int, str] | None = None,
    ) -> None:
        """``added_tokens``: id -> content of the tokenizer's added tokens, given to write one
        that follows another without a space between (``spaces_between_special_tokens=False``)."""
        self._decode = decode
        self._skip = skip_special_tokens
        self._added = added_tokens if added_tokens and not skip_special_tokens else None
        self._last_added = False  # the last generated token was an added token
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    @property
    def num_held_ids(self) -> int:
        """Ids kept for the next push: bounded, since ids whose text is out are dropped."""
        return len(self._ids)

    def _text(self, ids: list[int]) -> str:
        return self._decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: int | Sequence[int]) -> str:
        """Add generated token(s); return the text they complete (possibly '')."""
        if self._added is not None:
            return "".join(
                self._push_added(t) for t in ([token_ids] if isinstance(token_ids, int) else token_ids)
            )
        return self._push(token_ids)

    def _push_added(self, token_id: int) -> str:
        """One token, an added token after an added token written as its bare content."""
        text = self._push(token_id)
        follows_added, self._last_added = self._last_added, token_id in self._added
        if follows_added and self._last_added and text:
            return self._added[token_id]
        return text

    def _push(self, token_ids: int | Sequence[int]) -> str:
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix_text = self._text(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._text(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        # Drop ids left of the new window so memory stays bounded on long generations.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back (an unfinished character ends as U+FFFD, as decode gives)."""
        prefix_text = self._text(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._text(self._ids[self._prefix_offset :])
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]
