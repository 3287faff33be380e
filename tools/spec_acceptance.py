"""How many proposed tokens the built-in model would accept, by proposer, before any engine work.

    .venv/bin/python tools/spec_acceptance.py [--prompts 8] [--prompt-tokens 128]
        [--max-tokens 256] [-k 4] [--draft DIR (default: the shipped stdlib-llama-draft)]

The target (the built-in model, float32) writes ``--max-tokens`` greedy tokens after the first
``--prompt-tokens`` tokens of held-out standard-library files (Python it never trained on).
Greedy speculation keeps exactly the proposed tokens that match what the target wrote, so each
proposer is replayed over those outputs as the engine would run it: at position ``t`` it proposes
``k`` tokens from the first ``t``, the matching prefix is accepted, and ``t`` moves past the
accepted tokens and the one the target adds. Printed per proposer: drafts, acceptance rate,
acceptance per position, mean acceptance length (tokens per verification step; 1 without
speculation), and for the draft model its greedy agreement with the target at every position.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pagedkv import LLM, SamplingParams
from pagedkv.engine.spec import NgramProposer, SpecDecodingStats
from pagedkv.models import shipped_model_path
from pagedkv.models.builtin.train import stdlib_text

Proposer = Callable[[list[list[int]], int], list[list[int]]]


def held_out_prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first ``count`` held-out files that are that long."""
    _, held_out = stdlib_text.split_files()
    prompts = []
    for text in stdlib_text.read_sources(held_out):
        ids = llm.tokenizer.encode(text)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def replay(
    texts: list[list[int]], starts: list[int], propose: Proposer, k: int
) -> tuple[SpecDecodingStats, float]:
    """Greedy speculation over fixed target outputs, every text advancing in lockstep: the
    drafts' statistics, and the tokens each verification step yields (steps without a
    proposal, a plain decode, included)."""
    stats = SpecDecodingStats()
    positions = list(starts)
    steps = 0
    while True:
        live = [i for i, t in enumerate(positions) if t < len(texts[i])]
        if not live:
            generated = sum(len(text) - start for text, start in zip(texts, starts, strict=True))
            return stats, generated / steps
        proposals = propose([texts[i][: positions[i]] for i in live], k)
        for i, proposal in zip(live, proposals, strict=True):
            truth = texts[i][positions[i] : positions[i] + len(proposal)]
            proposal = proposal[: len(truth)]
            accepted = next(
                (j for j, (a, b) in enumerate(zip(proposal, truth, strict=True)) if a != b), len(truth)
            )
            stats.observe_draft(len(truth), accepted)
            positions[i] += accepted + 1
            steps += 1


def ngram_proposer(min_n: int, max_n: int) -> Proposer:
    def propose(contexts: list[list[int]], k: int) -> list[list[int]]:
        proposer = NgramProposer(min_n, max_n)
        return proposer.propose(range(len(contexts)), contexts, [k] * len(contexts))

    return propose


def draft_proposer(draft: LLM) -> Proposer:
    def propose(contexts: list[list[int]], k: int) -> list[list[int]]:
        outputs = draft.generate(contexts, greedy(k), use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    return propose


def describe(name: str, result: tuple[SpecDecodingStats, float]) -> str:
    stats, tokens_per_step = result
    per_pos = ", ".join(f"{rate:.2f}" for rate in stats.acceptance_rate_per_pos())
    return (
        f"{name:<22} drafts {stats.num_drafts:5d}  acceptance {stats.draft_acceptance_rate or 0:.3f}  "
        f"per position [{per_pos}]  mean acceptance length {stats.mean_acceptance_length or 1:.2f}  "
        f"tokens per step {tokens_per_step:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft", default=str(shipped_model_path("stdlib-llama-draft")))
    args = parser.parse_args()

    target = LLM(dtype="float32", enable_prefix_caching=True)
    prompts = held_out_prompts(target, args.prompts, args.prompt_tokens)
    outputs = target.generate(prompts, greedy(args.max_tokens), use_tqdm=False)
    texts = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    starts = [len(p) for p in prompts]
    print(f"{len(texts)} held-out prompts of {args.prompt_tokens} tokens, {args.max_tokens} greedy tokens")

    for low, high in ((1, 3), (2, 5), (5, 5)):
        stats = replay(texts, starts, ngram_proposer(low, high), args.k)
        print(describe(f"ngram {low}..{high}, k={args.k}", stats))

    draft = LLM(model=args.draft, dtype="float32", enable_prefix_caching=True)
    print(describe(f"draft model, k={args.k}", replay(texts, starts, draft_proposer(draft), args.k)))
    contexts = [text[:t] for text, start in zip(texts, starts, strict=True) for t in range(start, len(text))]
    truth = [text[t] for text, start in zip(texts, starts, strict=True) for t in range(start, len(text))]
    guesses = draft.generate(contexts, greedy(1), use_tqdm=False)
    agree = sum(g.outputs[0].token_ids[0] == t for g, t in zip(guesses, truth, strict=True))
    print(f"draft model greedy agreement with the target: {agree / len(truth):.3f} ({len(truth)} positions)")


if __name__ == "__main__":
    main()
