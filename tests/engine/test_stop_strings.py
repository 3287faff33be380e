"""The stop-string automaton finds what a search of the whole text for every stop string finds.

``naive_find`` is the definition (and what the output processor did before the automaton):
after each append, find every stop string anywhere in the text and take the earliest, the
smallest string on a tie. A scan is fed the same text in chunks, as tokens arrive.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import LLM, SamplingParams
from pagedkv.engine.stop_strings import StopMatch, StopScan, StopStringMatcher


def naive_find(text: str, stops: list[str]) -> StopMatch | None:
    hits = [(text.find(stop), stop) for stop in stops]
    hits = [(at, stop) for at, stop in hits if at >= 0]
    return StopMatch(*min(hits)) if hits else None


def scan_chunks(stops: list[str], chunks: list[str]) -> tuple[StopMatch | None, int]:
    """Feed ``chunks`` one at a time until a stop string is found: the match and the chunks read."""
    scan = StopScan(StopStringMatcher(stops))
    text = ""
    for count, chunk in enumerate(chunks, start=1):
        text += chunk
        match = scan.find(text)
        if match is not None:
            return match, count
    return None, len(chunks)


def naive_chunks(stops: list[str], chunks: list[str]) -> tuple[StopMatch | None, int]:
    text = ""
    for count, chunk in enumerate(chunks, start=1):
        text += chunk
        match = naive_find(text, stops)
        if match is not None:
            return match, count
    return None, len(chunks)


def test_the_earliest_stop_string_wins_not_the_first_listed():
    assert scan_chunks(["world", "lo w"], ["hello world"]) == (StopMatch(3, "lo w"), 1)


def test_overlapping_strings_the_one_starting_first_wins_even_if_it_ends_later():
    # "bcd" ends first but "abcde" starts first; both complete in the same chunk.
    assert scan_chunks(["bcd", "abcde"], ["xabcdef"]) == (StopMatch(1, "abcde"), 1)
    # Fed a character at a time, "bcd" completes first and ends the text there.
    assert scan_chunks(["bcd", "abcde"], list("xabcdef")) == (StopMatch(2, "bcd"), 5)


def test_strings_with_a_common_start_the_shorter_wins():
    assert scan_chunks(["abc", "ab", "abcd"], ["zzabcd"]) == (StopMatch(2, "ab"), 1)


def test_a_stop_string_found_through_a_suffix_link():
    """ "ab" is not a prefix of the path "xab", only a suffix: the failure links must find it."""
    assert scan_chunks(["xay", "ab"], ["xab"]) == (StopMatch(1, "ab"), 1)
    assert scan_chunks(["aab", "ab"], list("aaab")) == (StopMatch(1, "aab"), 4)


def test_a_stop_string_spanning_several_chunks():
    chunks = ["The end", " is n", "e", "ar, say", "s the text"]
    assert scan_chunks(["is near", "says"], chunks) == (StopMatch(8, "is near"), 4)


def test_multibyte_characters_match_as_characters():
    stops = ["\u00e9t\u00e9", "\U0001f600!", "\u732b"]
    assert scan_chunks(stops, ["summer: \u00e9", "t\u00e9 or"]) == (StopMatch(8, "\u00e9t\u00e9"), 2)
    assert scan_chunks(stops, ["hi \U0001f600", "!"]) == (StopMatch(3, "\U0001f600!"), 2)
    assert scan_chunks(stops, ["\u72ac", "\u732b\u72ac"]) == (StopMatch(1, "\u732b"), 2)
    assert scan_chunks(["\U0001f600!"], ["\U0001f601!"]) == (None, 1)


def test_a_scan_reads_only_new_text():
    """Text already scanned is not read again: a stop string planted in it is not seen."""
    scan = StopScan(StopStringMatcher(["stop"]))
    assert scan.find("abc") is None and scan.scanned == 3
    assert scan.find("sto" + "d") is None  # the first three characters count as "abc"
    assert scan.find("abcdstop") == StopMatch(4, "stop")


def test_a_request_matcher_refuses_an_empty_stop_string():
    with pytest.raises(ValueError, match="must not be empty"):
        StopStringMatcher(["ok", ""])


def test_the_automaton_grows_with_the_total_length_not_the_count():
    stops = [f"{i:04d}" for i in range(1000)]
    # Shared prefixes share nodes: far fewer than 4,000 characters' worth.
    assert StopStringMatcher(stops).num_nodes == 1 + 1 + 10 + 100 + 1000


_ALPHABET = "ab\u00e9\U0001f600"  # few letters, so stop strings do occur; two multi-byte ones


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=5), min_size=1, max_size=12),
    chunks=st.lists(st.text(_ALPHABET, max_size=6), max_size=20),
)
def test_a_scan_finds_what_a_search_of_the_whole_text_finds(stops, chunks):
    assert scan_chunks(stops, chunks) == naive_chunks(stops, chunks)


# -- in the engine: parallel samples share their request's automaton, each scans its own text
@pytest.fixture(scope="module")
def llm() -> LLM:
    """The built-in model: it writes Python, so its samples are real text to stop in."""
    return LLM(num_kv_blocks=128, block_size=16, max_model_len=256)


def _expected_stop(llm: LLM, prompt: list[int], tokens: list[int], stops: list[str]):
    """Stream ``tokens`` through a detokenizer and search the whole text after each one: the
    tokens and text a request with these stop strings must end with."""
    detokenizer = llm.tokenizer.detokenizer(prompt)
    text = ""
    for count, token in enumerate(tokens, start=1):
        text += detokenizer.push(token)
        match = naive_find(text, stops)
        if match is not None:
            return tokens[:count], text[: match.start], match.stop
    return tokens, text + detokenizer.flush(), None


def test_samples_stop_at_the_earliest_string_even_one_spanning_tokens(llm):
    prompt = llm.tokenizer.encode("def parse_header(line):\n")
    free = dict(max_tokens=24, temperature=0.8, ignore_eos=True)
    lone = llm.generate([prompt] * 3, [SamplingParams(seed=7 + i, **free) for i in range(3)], use_tqdm=False)
    tokens = [out.outputs[0].token_ids for out in lone]
    # A string from the end of sample 0's 4th token's text to the start of its 7th: it spans tokens.
    pieces = [llm.tokenizer.decode(tokens[0][:k]) for k in range(len(tokens[0]) + 1)]
    spanning = pieces[7][len(pieces[4]) - 1 : len(pieces[6]) + 1]
    assert len(spanning) >= 3 and spanning.strip()
    decoys = [f"\u2603{i}\u2603" for i in range(100)]  # never generated
    stops = [*decoys, spanning, pieces[-1][-2:]]

    forked = llm.generate([prompt], SamplingParams(n=3, seed=7, stop=stops, **free), use_tqdm=False)[0]
    for sample, out in zip(tokens, forked.outputs, strict=True):
        want_tokens, want_text, want_stop = _expected_stop(llm, prompt, sample, stops)
        assert (out.token_ids, out.text, out.stop_reason) == (want_tokens, want_text, want_stop)
        assert out.finish_reason == ("stop" if want_stop is not None else "length")
    assert forked.outputs[0].stop_reason is not None  # at the latest, the spanning string
    assert llm.kv_stats()["blocks_used"] == 0


def test_include_stop_str_in_output_keeps_the_string_and_cuts_after_it(llm):
    prompt = llm.tokenizer.encode("def parse_header(line):\n")
    free = dict(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = llm.generate([prompt], SamplingParams(**free), use_tqdm=False)[0].outputs[0].token_ids
    text = llm.tokenizer.decode(tokens)
    stop = text[len(text) // 3 : len(text) // 3 + 3]  # mid-text: tokens and text follow it
    assert len(stop) == 3 and stop.strip()
    cut = llm.generate([prompt], SamplingParams(stop=stop, **free), use_tqdm=False)[0].outputs[0]
    kept = llm.generate(
        [prompt], SamplingParams(stop=stop, include_stop_str_in_output=True, **free), use_tqdm=False
    )[0].outputs[0]
    start = text.index(stop)
    assert cut.text == text[:start] and kept.text == text[: start + len(stop)]
    assert kept.token_ids == cut.token_ids and len(kept.token_ids) < len(tokens)
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)
