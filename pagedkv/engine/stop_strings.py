"""Stop strings found in streamed text at a cost per character that does not grow with them.

The text of a sequence grows a few characters per step, and generation must end before the
earliest stop string in it. Searching the whole text for every stop string at every step costs
(text length x number of strings) per token. Here one Aho-Corasick automaton per request holds
all of its stop strings, and each sequence keeps its place in it (:class:`StopScan`): a step
feeds only the characters it added, at amortised O(1) per character whatever the number and
length of the strings. Building the automaton is linear in their total length, once per request.

What a scan finds is exactly what a full search of the text would: the stop string that starts
earliest, and among those starting at the same place the shortest (the only ones that can share
a start are prefixes of one another, so this is also the smallest string). That holds because
the caller scans after every append and stops at the first match: no match lies wholly in text
already scanned, so every match ends in the new characters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple


class StopMatch(NamedTuple):
    """Where the earliest stop string starts in the text, and which one it is."""

    start: int
    stop: str


class StopStringMatcher:
    """The Aho-Corasick automaton of a list of non-empty stop strings; node 0 is the root.

    Invariants: ``_goto[node]`` maps a character to the child that extends the node's path by
    it; ``_fail[node]`` is the node of the longest proper suffix of the path that is also a
    path; ``_longest[node]`` is the longest stop string that is a suffix of the path (None if
    none is). Duplicates in the list are harmless.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._longest: list[str | None] = [None]
        for stop in stops:
            if not stop:
                raise ValueError("a stop string must not be empty")
            self._insert(stop)
        self._fail = [0] * len(self._goto)
        self._link_suffixes()

    def _insert(self, stop: str) -> None:
        node = 0
        for char in stop:
            child = self._goto[node].get(char)
            if child is None:
                child = len(self._goto)
                self._goto.append({})
                self._longest.append(None)
                self._goto[node][char] = child
            node = child
        self._longest[node] = stop

    def _link_suffixes(self) -> None:
        """Breadth first, so a node's suffix (a shorter path) is complete before the node."""
        queue = deque(self._goto[0].values())  # the root's children fail to the root
        while queue:
            node = queue.popleft()
            for char, child in self._goto[node].items():
                suffix = self.advance(self._fail[node], char) if node else 0
                self._fail[child] = suffix
                if self._longest[child] is None:
                    self._longest[child] = self._longest[suffix]
                queue.append(child)

    def advance(self, node: int, char: str) -> int:
        """The node after reading ``char`` at ``node``: the longest path that is a suffix of
        the text read so far."""
        while True:
            child = self._goto[node].get(char)
            if child is not None:
                return child
            if node == 0:
                return 0
            node = self._fail[node]

    def feed(self, node: int, text: str, begin: int) -> tuple[int, StopMatch | None]:
        """Read ``text[begin:]`` from ``node``: the node reached, and the earliest stop string
        that ends in what was read (its start may lie before ``begin``)."""
        goto, fail, longest = self._goto, self._fail, self._longest  # locals: the hot loop
        best = None
        for end in range(begin, len(text)):
            char = text[end]
            while (child := goto[node].get(char)) is None and node:
                node = fail[node]
            node = child or 0  # children are never the root: None means "back at the root"
            stop = longest[node]
            if stop is not None:
                start = end + 1 - len(stop)
                if best is None or start < best.start:  # on a tie the earlier end: the shorter
                    best = StopMatch(start, stop)
        return node, best

    @property
    def num_nodes(self) -> int:
        return len(self._goto)


class StopScan:
    """One sequence's place in its request's automaton: the characters of its text read so far
    (``scanned``) and the node they led to."""

    def __init__(self, matcher: StopStringMatcher) -> None:
        self.matcher = matcher
        self.scanned = 0
        self._node = 0

    def find(self, text: str) -> StopMatch | None:
        """The earliest stop string in ``text``, which extends the text of the previous call and
        whose first ``scanned`` characters held none (so call it after every append, and stop at
        the first match). Reads only ``text[scanned:]``."""
        self._node, match = self.matcher.feed(self._node, text, self.scanned)
        self.scanned = len(text)
        return match
