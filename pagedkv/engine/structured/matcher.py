"""One sequence's place in its grammar: which tokens may come next, advanced token by token.

A :class:`GrammarMatcher` is per sequence, like a block table: the ``n`` samples of a request
and the beams of a search each hold their own, copied at the fork (:meth:`GrammarMatcher.fork`),
so one sample's tokens never move another's state. Its invariant: the library's state is the
grammar's start advanced by :attr:`GrammarMatcher.accepted_tokens`, in order -- a refused token
changes nothing, and :meth:`GrammarMatcher.rollback` undoes the latest tokens exactly (for
speculative decoding's rejected drafts). With a :class:`Utf8Guard` it never accepts, nor
allows, a token that would make the text invalid UTF-8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from pagedkv.engine.structured.utf8_guard import Utf8Guard


class LibraryMatcher(Protocol):
    """The methods of xgrammar's ``GrammarMatcher`` this wrapper relies on."""

    def accept_token(self, token_id: int) -> bool: ...
    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any: ...
    def is_terminated(self) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...
    def fork(self) -> LibraryMatcher: ...


class GrammarMatcher:
    """The grammar state of one sequence; see the module docstring."""

    def __init__(
        self,
        matcher: LibraryMatcher,
        accepted_tokens: list[int] | None = None,
        guard: Utf8Guard | None = None,
    ) -> None:
        self._matcher = matcher
        self._accepted: list[int] = accepted_tokens if accepted_tokens is not None else []
        self._guard = guard

    def _last_token(self) -> int | None:
        return self._accepted[-1] if self._accepted else None

    @property
    def accepted_tokens(self) -> tuple[int, ...]:
        """Every token accepted since the start (a stop token included), in order."""
        return tuple(self._accepted)

    @property
    def num_accepted_tokens(self) -> int:
        return len(self._accepted)

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id`` if the grammar allows it here; False (state unchanged) if
        not, or if the matcher has already terminated."""
        if self._guard is not None and not self._guard.allows(self._last_token(), int(token_id)):
            return False
        if not self._matcher.accept_token(int(token_id)):
            return False
        self._accepted.append(int(token_id))
        return True

    @property
    def library_matcher(self) -> LibraryMatcher:
        """The library's matcher, for a caller that fills many rows in one library call; its
        rows still need :meth:`utf8_mask` ANDed in."""
        return self._matcher

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: no token may follow."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: Any, row: int, restrict: bool = True) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 words, bit ``t % 32`` of
        word ``t // 32`` set for an allowed token ``t``). A stop token is allowed exactly when
        the grammar is complete. ``restrict=False`` leaves out the guard's :meth:`utf8_mask`, for
        a caller that ANDs it into many rows at once."""
        if self.is_terminated():
            raise ValueError("a terminated grammar matcher allows no next token: its sequence is over")
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if restrict and self._guard is not None:
            words = bitmask[row].numpy()  # a CPU tensor's row: shares its memory
            words &= self._guard.mask_after(self._last_token())

    def utf8_mask(self) -> np.ndarray | None:
        """The bitmask row :meth:`fill_bitmask` ANDs into the grammar's (see :class:`Utf8Guard`);
        None without a guard."""
        return None if self._guard is None else self._guard.mask_after(self._last_token())

    def fork(self) -> GrammarMatcher:
        """An independent copy of this state (for a new sample or beam that shares the tokens so far)."""
        return GrammarMatcher(self._matcher.fork(), list(self._accepted), self._guard)

    def rollback(self, num_tokens: int) -> None:
        """Undo the latest ``num_tokens`` accepted tokens: the state is then as if they had never
        been accepted (a terminated matcher that gives back its stop token runs again)."""
        if not 0 <= num_tokens <= len(self._accepted):
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: the matcher has accepted {len(self._accepted)}"
            )
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._accepted[-num_tokens:]
