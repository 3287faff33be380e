"""The engines ``pagedkv bench throughput`` compares, behind one small interface, and the run.

Each engine is loaded once per dtype, warmed up, then asked to ``run`` workloads: every prompt
generated greedily to its own ``max_tokens`` with EOS ignored. ``run`` returns the wall time from
submission to the last token and the generated ids. pagedkv and transformers run in this
process; vLLM and llama.cpp in their own venv's Python through a worker script
(:mod:`pagedkv.bench.rivals`), kept running between workloads so engines can take turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Protocol

from pagedkv.bench.bench_model import bench_model_path, shape_model_path
from pagedkv.bench.driver import progress, run_settings
from pagedkv.bench.host import host_state
from pagedkv.bench.throughput import ENGINE_TITLES, ThroughputConfig, Workload, build_workloads
from pagedkv.bench.throughput_floor import measure_copy_rate
from pagedkv.bench.throughput_gemm import measure_gemm, roofline_seconds
from pagedkv.bench.throughput_report import EngineStatus, ThroughputResult
from pagedkv.memory import blocks_for
from pagedkv.tokenizer.gguf_file import open_gguf

RIVALS_DIR = Path(__file__).parent / "rivals"
WORKER_SCRIPTS = {"vllm": RIVALS_DIR / "vllm_worker.py", "llamacpp": RIVALS_DIR / "llamacpp_worker.py"}
#: What every engine in this process runs once before it is timed.
WARM_UP = Workload("warm-up", ((5, 6, 7, 8, 9, 10, 11, 12),) * 2, (4, 4))


class EngineUnavailable(RuntimeError):
    """The engine cannot run here; the message is the reason shown in its column."""


@dataclass(frozen=True)
class LoadSpec:
    """What every engine is loaded with: the model, dtype, threads and the largest batch."""

    model: Path
    dtype: str
    threads: int
    max_requests: int
    #: prompt + output tokens of the largest workload: what its KV cache must hold at once.
    max_tokens_in_flight: int
    max_total_len: int
    device: str = "cpu"
    #: "auto", or "dummy": seeded random weights drawn on the device (a ``--model-shape``)
    load_format: str = "auto"
    #: pagedkv's arithmetic on GGUF-block weights (``EngineConfig.quantized_activations``)
    quantized_activations: str = "float"


class Engine(Protocol):
    info: dict

    def run(self, workload: Workload) -> tuple[float, list[list[int]]]: ...

    def close(self) -> None: ...


# -- in this process -----------------------------------------------------------------------------
class PagedkvEngine:
    """pagedkv's offline ``LLM``, prefix caching off (every repetition sends the same prompts),
    without a tokenizer (``skip_tokenizer_init``): ids in, ids out, as vLLM's worker runs. Its
    context length is the longest workload's (on CUDA it sizes the graphs' block tables, which
    every decode step copies); ``enforce_eager``: no CUDA graphs."""

    def __init__(self, spec: LoadSpec, block_size: int = 16, enforce_eager: bool = False) -> None:
        import torch

        from pagedkv import LLM

        blocks = blocks_for(spec.max_tokens_in_flight, block_size) + spec.max_requests + 16
        self.llm = LLM(
            str(spec.model),
            dtype=spec.dtype,
            device=spec.device,
            load_format=spec.load_format,
            block_size=block_size,
            num_kv_blocks=blocks,
            max_num_seqs=max(64, spec.max_requests),
            max_model_len=max(spec.max_total_len, WARM_UP.max_total_len),
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
            enforce_eager=enforce_eager,
            quantized_activations=spec.quantized_activations,
        )
        self.info = {
            "engine": "pagedkv-eager" if enforce_eager else "pagedkv",
            "kv_blocks": blocks,
            "torch_threads": torch.get_num_threads(),
            "runtime": self.llm.engine.describe(),  # dtype and the linear/attention kernels
        }
        self.run(WARM_UP)

    def run(self, workload: Workload) -> tuple[float, list[list[int]]]:
        from pagedkv import SamplingParams

        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens]
        start = time.perf_counter()
        outputs = self.llm.generate([list(p) for p in workload.prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, [list(o.outputs[0].token_ids) for o in outputs]

    def close(self) -> None:
        del self.llm


class TransformersEngine:
    """transformers' ``generate`` on one left-padded static batch, decoded to the longest output;
    each row is cut to its own ``max_tokens``, which is all the work that counts. A dummy model
    is built on the device from its config and filled with pagedkv's dummy weights, name by
    name: the same network pagedkv runs."""

    def __init__(self, spec: LoadSpec) -> None:
        import torch

        try:
            import transformers
        except ImportError as err:
            raise EngineUnavailable(f"transformers is not installed ({err})") from None
        dtype = getattr(torch, spec.dtype)
        if spec.load_format == "dummy":
            from pagedkv.models.dummy_weights import fill_dummy_weights

            config = transformers.AutoConfig.from_pretrained(str(spec.model))
            with torch.device(spec.device):
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
            fill_dummy_weights(dict(model.named_parameters()))
        elif spec.model.suffix == ".gguf":  # dequantized by transformers (with the gguf package)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(spec.model.parent), gguf_file=spec.model.name, dtype=dtype
            )
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(spec.model), dtype=dtype)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        self.model = model.to(spec.device).eval()
        self.device = spec.device
        self.info = {"engine": "transformers", "version": transformers.__version__}
        self.run(WARM_UP)

    def run(self, workload: Workload) -> tuple[float, list[list[int]]]:
        import torch

        width = max(len(p) for p in workload.prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in workload.prompts], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts], device=self.device
        )
        longest = max(workload.max_tokens)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=longest, do_sample=False)
            if self.device != "cpu":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
        rows = out[:, width:].tolist()
        return elapsed, [row[:m] for row, m in zip(rows, workload.max_tokens, strict=True)]

    def close(self) -> None:
        del self.model


# -- in a rival's own Python ---------------------------------------------------------------------
class RivalEngine:
    """A worker script under another venv's Python, spoken to over its stdin and stdout; its
    stderr (the engine's logs) goes to ``log``."""

    def __init__(self, name: str, python: str, spec: LoadSpec, log: Path, extra: dict) -> None:
        if not Path(python).is_file() or not os.access(python, os.X_OK):
            raise EngineUnavailable(f"{python}: no such Python executable")
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        self._log: IO[str] = open(log, "w", encoding="utf-8")  # noqa: SIM115 -- closed in close()
        env = os.environ | {"OMP_NUM_THREADS": str(spec.threads), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [python, str(WORKER_SCRIPTS[name])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        try:
            reply = self._ask({"cmd": "load"} | asdict(spec) | {"model": str(spec.model)} | extra)
        except EngineUnavailable:
            self.close()
            raise
        self.info = reply["info"] | {"log": str(log)}

    def run(self, workload: Workload) -> tuple[float, list[list[int]]]:
        reply = self._ask({"cmd": "run", "workload": workload.to_json()})
        #: what the worker counted of this run beyond its tokens (e.g. drafts), or {}
        self.last_stats = reply.get("stats", {})
        return reply["elapsed_s"], reply["token_ids"]

    def _ask(self, command: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            status = self.proc.wait()
            raise EngineUnavailable(f"worker exited with status {status}; {self._log_tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise EngineUnavailable(reply["error"])
        return reply

    def _log_tail(self, lines: int = 3) -> str:
        self._log.flush()
        tail = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-lines:]
        return f"log {self.log_path}: " + " | ".join(tail)

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._log.close()


def start_engine(name: str, spec: LoadSpec, rivals: dict[str, dict], log_dir: Path) -> Engine:
    """Load one engine; :class:`EngineUnavailable` says why it cannot run."""
    if name in ("pagedkv", "pagedkv-eager"):
        return PagedkvEngine(spec, enforce_eager=name == "pagedkv-eager")
    if name == "transformers":
        return TransformersEngine(spec)
    rival = rivals.get(name) or {}
    python = rival.get("python")
    if not python:
        flag = "--vllm-python" if name == "vllm" else "--llamacpp-python"
        raise EngineUnavailable(f"no {flag} given")
    log = log_dir / f"{name}-{spec.dtype}.log"
    progress(f"  starting {ENGINE_TITLES[name]} ({python}); its log: {log}")
    return RivalEngine(name, python, spec, log, rival.get("load", {}))


# -- the run -------------------------------------------------------------------------------------
def run_throughput(config: ThroughputConfig) -> ThroughputResult:
    """Run everything the config asks for, on ``config.threads`` torch threads."""
    import torch

    from pagedkv.models.gguf_config import gguf_config  # the models package imports torch

    weight_types: dict[str, int] = {}
    if config.llamacpp_gguf is not None:
        model_path = Path(config.llamacpp_gguf)
        model_config, weight_types = gguf_config([model_path]), gguf_weight_types(model_path)
    else:
        if config.model_shape is not None:
            model_path = shape_model_path(config.out / "models", config.model_shape)
        else:
            model_path = Path(config.model) if config.model else bench_model_path(config.out / "models")
        model_config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    vocab = model_config["vocab_size"]  # a GGUF's: its embedding's rows, llama.cpp's n_vocab too
    workloads = build_workloads(config.workloads, config.shape, vocab, config.decode_batches)
    result = ThroughputResult(config, model_path, model_config, workloads, weight_types=weight_types)
    with run_settings(config.threads):
        result.host = host_state("start") | {"torch": torch.__version__}
        if config.decode_batches:
            progress(f"measuring the {config.device} copy rate (the bandwidth floor's)")
            result.copy_rate_gbs = measure_copy_rate(config.device)
        for dtype in config.dtypes:
            _run_dtype(result, dtype)
            if config.gemm and config.device == "cpu":  # the CPU kernels' roofline
                progress(f"[{dtype}] timing GEMMs at the model's shapes")
                rates = measure_gemm(model_config, getattr(torch, dtype), workloads, config.prefill_chunk)
                result.gemm[dtype] = rates.timings
                for w in workloads:
                    result.roofline_s[(dtype, w.name)] = roofline_seconds(
                        model_config, w, rates, config.prefill_chunk
                    )
        result.host |= host_state("end")
    failed = [s for by in result.status.values() for s in by.values() if s.state == "failed"]
    if failed:
        progress(f"{len(failed)} engine run(s) failed; see above")
    return result


def _run_dtype(result, dtype: str) -> None:
    """Load every engine in ``dtype``, then let them take turns on every workload, repeat by repeat."""
    config, workloads = result.config, result.workloads
    spec = LoadSpec(
        model=result.model_path,
        dtype=dtype,
        threads=config.threads,
        max_requests=max(w.num_requests for w in workloads),
        max_tokens_in_flight=max(w.prompt_tokens + w.generated_tokens for w in workloads),
        max_total_len=max(w.max_total_len for w in workloads),
        device=config.device,
        load_format=config.load_format,
        quantized_activations=config.quantized_activations,
    )
    status, engines = result.status.setdefault(dtype, {}), {}
    for name in config.engines:
        progress(f"[{dtype}] loading {ENGINE_TITLES[name]}")
        try:
            engines[name] = start_engine(
                name, spec, _rival_options(config, result.model_path, dtype), config.out / "logs"
            )
            status[name] = EngineStatus("ok", info=engines[name].info)
        except EngineUnavailable as err:
            status[name] = EngineStatus("not run", str(err))
            progress(f"[{dtype}] {ENGINE_TITLES[name]}: not run: {err}")
    try:
        for rep in range(config.repeats):
            for workload in workloads:
                for name, engine in list(engines.items()):
                    try:
                        elapsed, token_ids = engine.run(workload)
                    except EngineUnavailable as err:
                        status[name] = EngineStatus("failed", f"{workload.name}: {err}", engine.info)
                        progress(f"[{dtype}] {ENGINE_TITLES[name]} failed on {workload.name}: {err}")
                        engines.pop(name).close()
                        continue
                    result.record(name, dtype, workload, elapsed, token_ids)
                    rate = workload.generated_tokens / elapsed
                    progress(
                        f"[{dtype}] {rep + 1}/{config.repeats} {workload.name:>14s} "
                        f"{ENGINE_TITLES[name]:>28s}: {rate:9,.1f} generated tok/s ({elapsed:.2f} s)"
                    )
    finally:
        for engine in engines.values():
            engine.close()


def gguf_weight_types(file: Path) -> dict[str, int]:
    """How many of the GGUF file's tensors are of each ggml type (``{"Q4_1": 210, "F32": 61}``)."""
    from pagedkv.models.gguf_weights import type_name  # the models package imports torch

    return dict(Counter(type_name(t.tensor_type) for t in open_gguf(file).tensors).most_common())


def _rival_options(config: ThroughputConfig, model_path: Path, dtype: str) -> dict[str, dict]:
    """What the rivals' workers load: llama.cpp the ``--llamacpp-gguf`` file as it is, or else a
    GGUF of the checkpoint in ``dtype``, converted on first use."""
    suffix = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    gguf = (config.out / "models" / "gguf" / f"{model_path.name}-{suffix}.gguf").resolve()
    if config.llamacpp_gguf is not None:
        gguf = Path(config.llamacpp_gguf).resolve()
    load = {"gguf": str(gguf), "convert_script": config.llamacpp_convert, "kv_type": config.llamacpp_kv}
    return {
        "vllm": {"python": config.vllm_python},
        "llamacpp": {"python": config.llamacpp_python, "load": load},
    }
