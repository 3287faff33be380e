"""The benchmarks a user runs: one :class:`~pagedkv.bench.driver.Bench` each, in the order
``pagedkv bench --help`` lists them.

Each is its configuration, its run and its report, from its own modules; the driver makes it a
command. Nothing imported here loads torch or matplotlib before a command runs.
"""

from __future__ import annotations

from pagedkv.bench.capacity import CAPACITY_MAX_NUM_SEQS, CapacityConfig, run_capacity
from pagedkv.bench.capacity_report import print_capacity, write_capacity_plots
from pagedkv.bench.driver import Bench
from pagedkv.bench.hybrid_capacity import HybridCapacityConfig, print_hybrid_capacity, run_hybrid_capacity
from pagedkv.bench.lora import LoraBenchConfig, print_lora_bench, run_lora_bench
from pagedkv.bench.parallel import ParallelConfig, print_parallel, run_parallel
from pagedkv.bench.quality import QualityConfig, print_quality, run_quality
from pagedkv.bench.router import REPLICA_ENGINE, RouterConfig, bench_router, print_router
from pagedkv.bench.serve import ServeConfig, print_report
from pagedkv.bench.serve_servers import run_serve
from pagedkv.bench.sharing import SharingConfig, run_sharing
from pagedkv.bench.sharing_report import print_sharing, write_sharing_plots
from pagedkv.bench.spec import SpecConfig, run_spec
from pagedkv.bench.spec_report import print_spec
from pagedkv.bench.structured import StructuredConfig, print_structured, run_structured
from pagedkv.bench.throughput import ThroughputConfig
from pagedkv.bench.throughput_engines import run_throughput
from pagedkv.bench.throughput_report import print_result
from pagedkv.bench.tiers import TiersConfig, run_tiers
from pagedkv.bench.tiers_report import print_tiers

#: The engine options most benchmarks let users change (the pool and the limits are their own).
MODEL_FIELDS = ("model", "dtype", "block_size", "max_num_batched_tokens", "attention_backend")

CAPACITY = Bench(
    name="capacity",
    doc="""paged vs contiguous KV reservation in the live engine: concurrency, utilization, throughput

    Run one seeded workload, all requests at once, under the paged, contiguous (max_model_len
    reserved per request) and contiguous-oracle (prompt + max_tokens) KV policies on the same model
    and KV budget, interleaved step by step; print the counted and the timed figures next to the
    simulator's prediction, check the counted ones (the same on every host) and write plots.
    """,
    config=CapacityConfig,
    run=run_capacity,
    report=print_capacity,
    plots=write_capacity_plots,
    engine_fields=(*MODEL_FIELDS, "max_num_seqs", "decode_headroom", "kv_cache_dtype", "scale", "threads"),
    engine_defaults={"max_num_seqs": CAPACITY_MAX_NUM_SEQS},
)


CAPACITY_HYBRID = Bench(
    name="capacity-hybrid",
    doc="""sequences one KV budget holds with hybrid paging on and off (capacity --hybrid)

    For a Gemma-2-shaped model (half the layers windowed at 4,096 tokens) and a Gemma-3-shaped one
    (five in six at 1,024), or --model's layer kinds and window, at 32k-token contexts (divided by
    --scale), submit every request at once to two engines with the same KV budget in bytes, one
    paging by KV group and one keeping every block (--disable-hybrid-kv-cache-manager); report the
    most sequences each held at once. Tiny models with random weights: admission depends on the
    layer kinds and lengths only. `pagedkv bench capacity --hybrid` runs it on its defaults.
    """,
    config=HybridCapacityConfig,
    run=run_hybrid_capacity,
    report=print_hybrid_capacity,
)


SHARING = Bench(
    name="sharing",
    doc="""KV memory saved by block sharing in the live engine: shared prefixes, samples, beams

    Measure, in the live engine, the KV blocks that sharing saves: N requests with a common system
    prompt with prefix caching on vs off (blocks held, prefill tokens computed and skipped, time to
    first token, identical greedy outputs), and parallel sampling and beam search (blocks held with
    copy-on-write sharing vs each sample or beam a private copy), next to the PagedAttention
    paper's figures; write plots.
    """,
    config=SharingConfig,
    run=run_sharing,
    report=print_sharing,
    plots=write_sharing_plots,
    engine_fields=(*MODEL_FIELDS, "scale", "threads"),
)


SERVE = Bench(
    name="serve",
    doc="""serving benchmark: a seeded workload at a Poisson rate against an OpenAI server

    Send --num-prompts streaming completions, arriving at --request-rate per second (Poisson; inf =
    all at once), to --base-url, or to a server started in this process when no URL is given.
    Reports request and token throughput, TTFT and inter-token latency percentiles, and the
    server's peak KV-cache usage.
    """,
    config=ServeConfig,
    run=run_serve,
    report=print_report,
    engine_fields=None,
)


ROUTER = Bench(
    name="router",
    doc="""replicas behind vllm-router: prefix-cache hit rate and TTFT per routing policy

    Start one replica with 2 x --num-kv-blocks, then two replicas with --num-kv-blocks each behind
    vllm-router (round_robin, cache_aware, kv_aware), and send each the same shared-prefix
    workload (--num-systems system prompts x --users-per-system users, shuffled, --concurrency
    clients). Prints each setup's prefix-cache hit rate (from the replicas' /metrics), its share of
    the single replica's, client-side TTFT and how the requests split between the replicas.
    """,
    config=RouterConfig,
    run=bench_router,
    report=print_router,
    engine_fields=None,
    engine_defaults=REPLICA_ENGINE,
)


THROUGHPUT = Bench(
    name="throughput",
    doc="""offline tokens/s: pagedkv vs transformers, vLLM and llama.cpp; the roofline or bandwidth floor

    Run the same seeded token-id workloads (mixed lengths, uniform, one request) through pagedkv,
    transformers' static batching and, when their Pythons are given, vLLM and llama.cpp, each
    greedy with EOS ignored, in float32 and bfloat16; print generated tokens/s, pagedkv's ratio
    to each, single-stream latency, whether the engines' tokens agree and, on the CPU, the
    measured GEMM rate at the model's shapes and the throughput roofline it implies. With
    --device cuda (or --decode-batches), time the decode step at each batch size against the
    bandwidth floor, (weights + KV read) / the measured copy rate, with and without CUDA graphs;
    --model-shape runs a real model's shape (Llama-3.2-1B, Llama-3.1-8B) with seeded random
    weights drawn on the device.
    """,
    config=ThroughputConfig,
    run=run_throughput,
    report=print_result,
)


PARALLEL = Bench(
    name="parallel",
    doc="""tensor parallelism: N ranks x T threads vs 1 rank x T threads, and the all-reduces' cost

    Run a prefill-heavy workload (long prompts, one new token) and a decode workload (short
    prompts, many new tokens) on one rank and on --tensor-parallel-size ranks, stepped in turn,
    greedy; print tokens/s of each, the speed-up, rank 0's collective calls and milliseconds per
    step, and whether the tokens agree. Default model: the throughput benchmark's Llama (hidden
    512, 6 layers, 8/4 heads, 32k vocabulary).
    """,
    config=ParallelConfig,
    run=run_parallel,
    report=print_parallel,
    engine_fields=MODEL_FIELDS,
)


QUALITY = Bench(
    name="quality",
    doc="""KV cache dtype vs quality: held-out perplexity, greedy agreement and logits error against auto

    On the built-in model (trained on the Python standard library) and the stdlib files it never
    trained on, run one engine per KV cache dtype and compare each with auto: perplexity through
    the engine's prompt logprobs, the logits' max and mean absolute error on the same rows, and
    greedy continuations token by token.
    """,
    config=QualityConfig,
    run=run_quality,
    report=print_quality,
    engine_fields=(*MODEL_FIELDS, "quantized_activations", "threads"),
)


TIERS = Bench(
    name="tiers",
    doc="""a second KV tier on multi-turn chat: recomputed prompts and TTFT with no tier, host, disk, restart

    Run a seeded multi-turn chat workload -- conversations sent turn by turn, a few requests in
    flight, a KV pool that holds a quarter of their histories -- with no second tier, a host-RAM
    tier, a disk tier, and a disk tier whose engine restarts before the last turn; print prompt
    tokens computed, recomputed, loaded from the tier and served by the pool, TTFT p50/p99,
    output tokens/s and bytes moved, and whether the targets are met (exit status 1 if not).
    """,
    config=TiersConfig,
    run=run_tiers,
    report=print_tiers,
    # its own --model: builtin, bench or a folder
    engine_fields=(*MODEL_FIELDS[1:], "kv_cache_dtype", "threads"),
)


SPEC = Bench(
    name="spec",
    doc="""speculative decoding: tokens/s with n-gram and draft-model speculation against none and llama.cpp

    The built-in model (or --model) writes --max-tokens greedy tokens after the first --prompt-len
    tokens of texts it never trained on -- held-out standard-library Python files, and the language
    reference's prose -- single stream and in batches, through pagedkv without speculation, with
    n-gram speculation and with the shipped draft model, and through llama.cpp on the same weights
    with and without its prompt lookup decoding (given --llamacpp-python). Engines take turns
    workload by workload; prints tokens/s, the ratios, acceptance and whether greedy ids agree.
    """,
    config=SpecConfig,
    run=run_spec,
    report=print_spec,
)


STRUCTURED = Bench(
    name="structured",
    doc="""structured output: tokens/s of batches with none, half or all rows constrained by a JSON schema

    On one engine, run a batch of chat requests with a share of its rows constrained to a small JSON
    schema, then the same prompts unconstrained with each row's length as it came out, interleaved
    over rounds; print tokens/s of both and the share kept, how many constrained outputs are valid,
    and the grammar's compile time (first build, a new schema, a cached one).
    """,
    config=StructuredConfig,
    run=run_structured,
    report=print_structured,
    engine_fields=(*MODEL_FIELDS, "threads"),
)


LORA = Bench(
    name="lora",
    doc="""LoRA adapters: unified paging vs fixed slots at one budget, and throughput over adapters

    At one memory budget (max_loras fixed slots plus --kv-blocks KV blocks, or one pool holding
    both), count in the live engine the requests held when few adapters are active with long
    contexts, and the adapters kept resident (and read again) when many run short requests; then
    time a batch spread over adapters against the same batch on the base model, and the first
    step of a new adapter. The built-in model unless --model.
    """,
    config=LoraBenchConfig,
    run=run_lora_bench,
    report=print_lora_bench,
    engine_fields=("model", "dtype", "block_size", "attention_backend", "threads"),
)


BENCHES = (
    CAPACITY,
    CAPACITY_HYBRID,
    SHARING,
    SERVE,
    ROUTER,
    THROUGHPUT,
    PARALLEL,
    QUALITY,
    TIERS,
    SPEC,
    STRUCTURED,
    LORA,
)
