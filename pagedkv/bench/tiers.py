"""``pagedkv bench tiers``: multi-turn chat with a pool that holds a quarter of the conversations.

A seeded workload of ``conversations`` chats of ``turns`` turns each: every prompt is a shared
system prompt, the whole history so far (each earlier turn's user message and the engine's own
greedy reply) and a new user message. Requests go out turn by turn, chat after chat, with
``concurrency`` of them in flight (a chat's next turn waits for its reply): between two turns of
a chat every other chat has a turn, and with a pool of ``pool_share`` of the working set (the
chats' final histories) the pool's LRU has let a chat's blocks go by the time it comes back --
without a second tier most prompt tokens are recomputed, turn after turn. Few requests in
flight keep a request's time to first token its own prefill's, not a queue's. The same workload
runs under each of ``modes``, each on a fresh engine with the same model, pool and scheduler:

* ``off`` -- no second tier: what leaves the pool is recomputed;
* ``host`` -- a host-RAM tier that holds the whole working set: evicted blocks spill to it and a
  returning conversation loads its history instead of recomputing it;
* ``disk`` -- the same on disk (files in ``<out>/kv-tier``);
* ``restart`` -- a disk tier whose engine runs every turn but the last, stops, and a new engine
  on the same folder runs the last turn: its hit rate (prompt tokens served by the pool or the
  tier, over prompt tokens) against the disk run's on that turn.

The modes' engines are stepped in turn, one step each per round, so that a burst of background
load on a shared machine hits them all alike. Figures per mode, on each engine's own clock (the
sum of its step times): prompt tokens
computed, of which recomputed (tokens an earlier turn had already computed, or the shared
system prompt once computed), loaded from the tier and served by the pool; TTFT percentiles;
output tokens per second; bytes moved each way; preemptions by swap and by recompute. In
float32 greedy replies must be identical in every mode; in bfloat16 a prefix recomputed in a
larger prefill rounds differently from the steps that first wrote it, so a near-tie may flip and
identical replies are reported, not required. Tables: :mod:`pagedkv.bench.tiers_report`.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedkv.bench.driver import FIRST_TOKEN_ID, EngineOptions, MeasuredEngine, progress, run_settings
from pagedkv.bench.options import check_options, option
from pagedkv.cli_report import DEFAULT_OUT
from pagedkv.engine import EngineConfig, SamplingParams
from pagedkv.memory import blocks_for

MODES = ("off", "host", "disk", "restart")
MODELS = ("builtin", "bench")
#: The targets: of the host tier against none, and of a restarted disk tier against a warm one.
RECOMPUTE_CUT, TTFT_SPEEDUP, RESTART_HIT_SHARE = 0.70, 2.0, 0.90


@dataclass(frozen=True)
class TiersConfig:
    """The workload and the modes (see the module doc); lengths in tokens."""

    conversations: int = option(32, "chats, each sent turn by turn", positive=True)
    turns: int = option(6, "turns per chat", positive=True)
    system_len: int = option(64, "shared system prompt", positive=True)
    user_len: int = option(96, "new user tokens per turn", positive=True)
    reply_len: int = option(16, "greedy reply tokens per turn", positive=True)
    pool_share: float = option(0.25, "KV pool as a share of the working set (the final histories)")
    concurrency: int = option(
        4, "requests in flight at once (a chat's next turn waits for its reply)", positive=True
    )
    modes: tuple[str, ...] = option(MODES, "what to run", choices=MODES)
    model: str = option(
        "builtin", "builtin, bench (the throughput bench's hidden-512 Llama: costlier prefill) or a folder"
    )
    seed: int = option(0, "random seed")
    engine: EngineOptions = field(default_factory=EngineOptions)
    #: where the disk tiers and the bench model live
    out: Path = Path(DEFAULT_OUT)

    def __post_init__(self) -> None:
        check_options(self)
        if not 0 < self.pool_share <= 1:
            raise ValueError(f"pool_share must be in (0, 1], got {self.pool_share}")
        if "restart" in self.modes and self.turns < 2:
            raise ValueError("the restart mode needs at least 2 turns (a restart before the last)")

    @property
    def max_prompt_len(self) -> int:
        return self.system_len + self.turns * self.user_len + (self.turns - 1) * self.reply_len

    @property
    def working_set_blocks(self) -> int:
        history = self.max_prompt_len + self.reply_len
        return self.conversations * blocks_for(history, self.engine.run_block_size)

    @property
    def pool_blocks(self) -> int:
        """``pool_share`` of the working set, and at least two of the longest requests."""
        longest = blocks_for(self.max_prompt_len + self.reply_len, self.engine.run_block_size)
        return max(2 * longest, int(self.pool_share * self.working_set_blocks))

    def model_path(self) -> str | None:
        if self.model == "builtin":
            return None
        if self.model == "bench":
            from pagedkv.bench.bench_model import bench_model_path

            return str(bench_model_path(self.out / "models"))
        return self.model

    def engine_config(self, mode: str, kv_dir: Path, model: str | None, block_bytes: int) -> EngineConfig:
        """One mode's engine: the same pool for all; a tier that holds the whole working set."""
        base = self.engine.engine_config(self.pool_blocks, self.max_prompt_len + self.reply_len)
        base = dataclasses.replace(base, model=model, max_num_seqs=self.conversations)
        if mode == "off":
            return base
        tier = {"kv_offload": "host", "kv_offload_memory": 2 * self.working_set_blocks * block_bytes}
        if mode != "host":
            tier |= {"kv_offload": "disk", "kv_offload_dir": str(kv_dir)}
        return dataclasses.replace(base, **tier)


class Chats:
    """The conversations' token ids: user messages drawn once; replies appended as they come."""

    def __init__(self, config: TiersConfig, vocab_size: int) -> None:
        rng = np.random.default_rng(config.seed)
        self.system = rng.integers(FIRST_TOKEN_ID, vocab_size, config.system_len).tolist()
        shape = (config.conversations, config.turns, config.user_len)
        self.users = rng.integers(FIRST_TOKEN_ID, vocab_size, shape).tolist()
        self.replies: list[list[list[int]]] = [[] for _ in range(config.conversations)]

    def prompt(self, chat: int, turn: int) -> list[int]:
        history = [t for k in range(turn) for t in self.users[chat][k] + self.replies[chat][k]]
        return self.system + history + self.users[chat][turn]

    def new_tokens(self, chat: int, turn: int) -> int:
        """Prompt tokens no earlier turn computed: the new message and the last reply's last
        token (sampled, never fed back); the system prompt counts once, for the first chat."""
        if turn == 0:
            return len(self.users[chat][0]) + (len(self.system) if chat == 0 else 0)
        return len(self.users[chat][turn]) + 1


@dataclass
class ModeRun:
    """One mode's figures (see the module doc); ``last_turn_*``: the last turn's requests only."""

    mode: str
    #: the model's dtype as the engine runs it ("float32", "bfloat16", ...)
    dtype: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    computed_tokens: int = 0
    tier_hit_tokens: int = 0
    pool_hit_tokens: int = 0
    queries: int = 0
    last_turn_queries: int = 0
    last_turn_hits: int = 0
    ttft: list[float] = field(default_factory=list)
    engine_seconds: float = 0.0
    output_tokens: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    preemptions: int = 0
    swapped_preemptions: int = 0
    replies: list[list[list[int]]] = field(default_factory=list)

    @property
    def recomputed_tokens(self) -> int:
        return self.computed_tokens - self.new_tokens

    @property
    def hit_rate(self) -> float:
        return (self.tier_hit_tokens + self.pool_hit_tokens) / self.queries if self.queries else 0.0

    @property
    def last_turn_hit_rate(self) -> float:
        return self.last_turn_hits / self.last_turn_queries if self.last_turn_queries else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.ttft, q)) if self.ttft else float("nan")

    def to_json(self) -> dict:
        skipped = ("ttft", "replies", "dtype")
        figures = {k: v for k, v in dataclasses.asdict(self).items() if k not in skipped}
        return figures | {
            "recomputed_tokens": self.recomputed_tokens,
            "hit_rate": self.hit_rate,
            "last_turn_hit_rate": self.last_turn_hit_rate,
            "ttft_p50_s": self.percentile(50),
            "ttft_p99_s": self.percentile(99),
            "output_tokens_per_s": self.output_tokens / self.engine_seconds if self.engine_seconds else 0.0,
        }


@dataclass
class TiersResult:
    config: TiersConfig
    model: str
    block_size: int
    runs: dict[str, ModeRun]

    def run(self, mode: str) -> ModeRun | None:
        return self.runs.get(mode)

    @property
    def dtype(self) -> str:
        return next(iter(self.runs.values())).dtype if self.runs else ""

    @property
    def exact(self) -> bool:
        """Whether identical replies are a target: float32 only (see the module doc)."""
        return self.dtype == "float32"

    @property
    def same_replies(self) -> bool:
        replies = [run.replies for run in self.runs.values() if run.mode != "restart"]
        return all(r == replies[0] for r in replies)

    def checks(self) -> list[tuple[str, bool]]:
        """The issue's targets, where the modes they compare ran."""
        off, host, disk, restart = (self.runs.get(m) for m in MODES)
        checks = [("greedy replies identical in every mode", self.same_replies)] if self.exact else []
        if off and host:
            cut = 1 - host.recomputed_tokens / off.recomputed_tokens if off.recomputed_tokens else 0.0
            checks.append((f"host tier: recomputed prompt tokens -{cut:.0%} (>= 70%)", cut >= RECOMPUTE_CUT))
            speedup = off.percentile(50) / host.percentile(50)
            checks.append((f"host tier: TTFT p50 {speedup:.1f}x lower (>= 2x)", speedup >= TTFT_SPEEDUP))
        if disk and restart:
            share = restart.last_turn_hit_rate / disk.last_turn_hit_rate if disk.last_turn_hit_rate else 0.0
            label = f"restarted disk tier: last turn's hit rate {share:.0%} of the warm one's (>= 90%)"
            checks.append((label, share >= RESTART_HIT_SHARE))
        return checks

    @property
    def ok(self) -> bool:
        return all(met for _, met in self.checks())

    def to_json(self) -> dict:
        config = dataclasses.asdict(self.config) | {"out": str(self.config.out)}
        return {
            "config": config,
            "model": self.model,
            "dtype": self.dtype,
            "same_replies": self.same_replies,
            "block_size": self.block_size,
            "pool_blocks": self.config.pool_blocks,
            "working_set_blocks": self.config.working_set_blocks,
            "runs": {mode: run.to_json() for mode, run in self.runs.items()},
            "checks": [{"check": label, "met": met} for label, met in self.checks()],
        }


def run_tiers(config: TiersConfig) -> TiersResult:
    """Every mode of ``config``, each on a fresh engine, stepped in turn (see the module doc)."""
    from pagedkv.models import ModelConfig, builtin_model_path

    model = config.model_path()
    model_config = ModelConfig.from_pretrained(model or builtin_model_path())
    # float32 elements, the largest the engine stores: the tier holds the working set whatever the dtype
    block_bytes = model_config.kv_spec("float32").bytes_per_block(config.engine.run_block_size)
    runs = {mode: ModeRun(mode) for mode in config.modes}
    progress(f"tiers: {', '.join(config.modes)} ({config.conversations} chats x {config.turns} turns)")
    with run_settings(config.engine.threads):
        active = []
        for mode, run in runs.items():
            kv_dir = config.out / ("kv-tier" if mode == "disk" else "kv-tier-restart")
            shutil.rmtree(kv_dir, ignore_errors=True)
            engine = config.engine_config(mode, kv_dir, model, block_bytes)
            active.append(_mode_steps(config, run, engine, model_config.vocab_size))
        # One step of each mode per round: a burst of background load hits them all alike.
        while active:
            active = [steps for steps in active if next(steps, StopIteration) is not StopIteration]
    name = "built-in model" if model is None else Path(model).name
    return TiersResult(config, name, config.engine.run_block_size, runs)


def _mode_steps(config: TiersConfig, run: ModeRun, engine: EngineConfig, vocab_size: int) -> Iterator[None]:
    """Run the workload under ``run.mode``, yielding after every engine step: turn by turn,
    chat after chat, ``concurrency`` requests in flight (a chat's next turn waits for its
    reply); the restart mode stops its engine once every turn but the last is done."""
    chats = Chats(config, vocab_size)
    measured = MeasuredEngine.start(engine)
    run.dtype = measured.engine.executor.runtime["dtype"]
    last = config.turns - 1
    phases = [range(last), range(last, config.turns)] if run.mode == "restart" else [range(config.turns)]
    for turns in phases:
        if turns.start == last and run.mode == "restart":
            _account(run, measured)
            measured.engine.shutdown()  # the disk tier writes the pool's prefixes out
            measured = MeasuredEngine.start(engine, prime=False)
            measured.prime(keep_cache=True)  # a reset would clear the tier it found
        yield from _run_turns(config, run, chats, measured, turns)
    _account(run, measured)
    measured.engine.shutdown()
    run.replies = chats.replies


def _run_turns(
    config: TiersConfig, run: ModeRun, chats: Chats, measured: MeasuredEngine, turns: range
) -> Iterator[None]:
    params = SamplingParams(max_tokens=config.reply_len, temperature=0.0, ignore_eos=True)
    pending = deque((turn, chat) for turn in turns for chat in range(config.conversations))
    in_flight: dict[str, tuple[int, int]] = {}
    while pending or in_flight:
        # the head's previous turn is done or in flight, so with nothing in flight it is ready
        while (
            pending
            and len(in_flight) < config.concurrency
            and len(chats.replies[pending[0][1]]) == pending[0][0]
        ):
            turn, chat = pending.popleft()
            request_id, prompt = f"{turn}-{chat}", chats.prompt(chat, turn)
            measured.submit(request_id, prompt, params)
            in_flight[request_id] = (turn, chat)
            run.prompt_tokens += len(prompt)
            run.new_tokens += chats.new_tokens(chat, turn)
        measured.step()
        yield
        for request_id in [r for r in in_flight if r in measured.outputs]:
            turn, chat = in_flight.pop(request_id)
            chats.replies[chat].append(measured.outputs[request_id][0])
            run.ttft.append(measured.first_token[request_id] - measured.arrival[request_id])
            if turn == config.turns - 1:
                run.last_turn_queries += len(chats.prompt(chat, turn))
                run.last_turn_hits += measured.cached_tokens[request_id]


def _account(run: ModeRun, measured: MeasuredEngine) -> None:
    """Add one engine's steps and counters to ``run`` (a restart adds two engines')."""
    steps, stats = measured.steps, measured.engine.kv_stats()
    run.computed_tokens += sum(s.prefill_tokens for s in steps)
    run.tier_hit_tokens += sum(s.tier_hit_tokens for s in steps)
    run.pool_hit_tokens += sum(s.prefix_cache_hits for s in steps)
    run.queries += sum(s.prefix_cache_queries for s in steps)
    run.engine_seconds += measured.clock
    run.output_tokens += sum(s.generated_tokens for s in steps)
    run.bytes_out += int(stats.get("tier_bytes_out", 0))
    run.bytes_in += int(stats.get("tier_bytes_in", 0))
    run.preemptions += int(stats["preemptions"])
    run.swapped_preemptions += int(stats["preemptions_swapped"])
