"""Token logprobs in the two OpenAI shapes: legacy completions and chat.

Token strings are the single-token decodes (special tokens kept), so a byte-level BPE token
that is half of a UTF-8 character reads as U+FFFD, as with OpenAI's own API; chat's ``bytes``
field carries the UTF-8 of that string. With ``return_tokens_as_token_ids`` (vLLM's) a token
reads ``"token_id:N"`` instead -- for tokens that do not decode alone -- and chat's ``bytes`` are
those of that string; a completion's ``text_offset`` still counts the text's characters.
"""

from __future__ import annotations

from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.server.responses import CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob
from pagedkv.tokenizer import Tokenizer


class LogprobFormatter:
    """Formats the logprobs of one response; remembers each choice's text offset across deltas."""

    def __init__(self, tokenizer: Tokenizer, tokens_as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids
        self._strings: dict[int, str] = {}
        self._offsets: dict[int, int] = {}

    def text(self, token_id: int) -> str:
        """The token's text, decoded alone (special tokens kept)."""
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token(self, token_id: int) -> str:
        """How a logprob names the token: its text, or ``"token_id:N"``."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.text(token_id)

    def completion(self, choice: int, logprobs: list[TokenLogprobs]) -> CompletionLogprobs:
        """Parallel lists; ``top_logprobs`` also holds the sampled token (up to ``logprobs + 1``)."""
        out = CompletionLogprobs()
        offset = self._offsets.get(choice, 0)
        for entry in logprobs:
            token = self.token(entry.token_id)
            top = {self.token(t): lp for t, lp in entry.top}
            top.setdefault(token, entry.logprob)
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(self.text(entry.token_id))
        self._offsets[choice] = offset
        return out

    def echoed_prompt(
        self, choice: int, prompt_ids: list[int], logprobs: list[TokenLogprobs | None], top: int
    ) -> CompletionLogprobs:
        """An echoed prompt's tokens in the legacy shape, before the choice's own (vLLM's echo):
        the first token's logprob and top are null (nothing predicts it), the others keep their
        ``top`` most likely tokens besides their own."""
        out = CompletionLogprobs()
        offset = self._offsets.get(choice, 0)
        for token_id, entry in zip(prompt_ids, logprobs, strict=True):
            token = self.token(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(self.text(token_id))
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            candidates = {self.token(t): lp for t, lp in entry.top[:top]}
            candidates.setdefault(token, entry.logprob)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append(candidates)
        self._offsets[choice] = offset
        return out

    @staticmethod
    def merge(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for part in parts:
            out.tokens += part.tokens
            out.token_logprobs += part.token_logprobs
            out.top_logprobs += part.top_logprobs
            out.text_offset += part.text_offset
        return out

    def prompt(self, logprobs: list[TokenLogprobs | None]) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's ``prompt_logprobs``: per position, the prompt token and then the top tokens."""
        out: list[dict[str, PromptLogprob] | None] = []
        for entry in logprobs:
            if entry is None:
                out.append(None)
                continue
            candidates = [(entry.token_id, entry.logprob, entry.rank)]
            candidates += [(t, lp, rank) for rank, (t, lp) in enumerate(entry.top, start=1)]
            position: dict[str, PromptLogprob] = {}
            for token_id, logprob, rank in candidates:
                position.setdefault(
                    str(token_id),
                    PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.text(token_id)),
                )
            out.append(position)
        return out

    def chat(self, logprobs: list[TokenLogprobs]) -> list[TokenLogprob]:
        return [
            TokenLogprob(
                **self._top(entry.token_id, entry.logprob).model_dump(),
                top_logprobs=[self._top(t, lp) for t, lp in entry.top],
            )
            for entry in logprobs
        ]

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
