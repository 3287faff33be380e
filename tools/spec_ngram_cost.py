"""What prompt lookup costs per sequence and step, by context length: the scan against an index.

    .venv/bin/python tools/spec_ngram_cost.py [--contexts 1024 8192] [--steps 200]
        [--min-n 2] [--max-n 5] [-k 4]

The token streams are held-out standard-library files run together (real text: repeats occur,
as in code). For each context length a sequence starts at that length and grows one token a
step for ``--steps`` steps, proposing ``k`` tokens at every step, as decoding would. Printed, in
microseconds per step: :class:`~pagedkv.engine.spec.NgramProposer` (a vectorised scan of the
whole sequence, its array grown by one token); the alternative it was chosen over, a dict of
every n-gram to its latest start updated as tokens arrive (constant time per step), with the
cost of its first call (indexing the whole prompt, once per sequence) and its memory; and how
often a proposal was made. Both are checked to propose the same tokens at every step.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

from pagedkv.engine.spec import NgramProposer
from pagedkv.models.builtin import builtin_model_path
from pagedkv.models.builtin.train import stdlib_text
from pagedkv.tokenizer import load_tokenizer


class DictIndex:
    """The latest start of every n-gram (min_n <= n <= max_n) of a token list but those ending
    at its last token, updated as the list grows."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[tuple[int, ...], int] = {}
        self.end = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for end in range(self.end, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.latest[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        self.end = max(self.end, len(tokens) - 1)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.latest.get(tuple(tokens[length - n :]))
            if start is not None:
                out: list[int] = []
                for position in range(start + n, start + n + k):
                    out.append(tokens[position] if position < length else out[position - length])
                return out
        return []


def stream(length: int) -> list[int]:
    tokenizer = load_tokenizer(builtin_model_path())
    _, heldout = stdlib_text.split_files()
    ids: list[int] = []
    for text in stdlib_text.read_sources(heldout):
        ids += tokenizer.encode(text)
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"the held-out files hold fewer than {length} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=5)
    parser.add_argument("-k", type=int, default=4)
    args = parser.parse_args()
    tokens = stream(max(args.contexts) + args.steps)
    print(f"prompt_lookup_min {args.min_n}, prompt_lookup_max {args.max_n}, k {args.k}; microseconds")
    print("context  scan/step  dict/step  dict first call  dict MiB  proposals per step")
    for context in args.contexts:
        grown = tokens[:context]
        index = DictIndex(args.min_n, args.max_n)
        start = time.perf_counter()
        index.propose(grown, args.k)
        first = time.perf_counter() - start
        tracemalloc.start()
        measured = DictIndex(args.min_n, args.max_n)
        measured.propose(grown, args.k)
        memory = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        del measured
        proposer = NgramProposer(args.min_n, args.max_n)
        proposer.propose([0], [grown], [args.k])
        scan_times, dict_times, proposed = [], [], 0
        for end in range(context + 1, context + args.steps + 1):
            grown.append(tokens[end - 1])  # the sequence grows in place, as a decoding one does
            start = time.perf_counter()
            (ours,) = proposer.propose([0], [grown], [args.k])
            scan_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs = index.propose(grown, args.k)
            dict_times.append(time.perf_counter() - start)
            if ours != theirs:
                raise AssertionError(f"at {end} tokens the scan proposes {ours}, the dict {theirs}")
            proposed += bool(ours)
        scan, by_dict = statistics.median(scan_times) * 1e6, statistics.median(dict_times) * 1e6
        print(
            f"{context:7d}  {scan:9.1f}  {by_dict:9.1f}  {first * 1e6:15.0f}  {memory:8.2f}  "
            f"{proposed / args.steps:18.2f}"
        )


if __name__ == "__main__":
    main()
