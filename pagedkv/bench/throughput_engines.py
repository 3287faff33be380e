"""The engines ``pagedkv bench throughput`` compares, behind one small interface.

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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

import torch

from pagedkv.bench.throughput_config import ENGINE_TITLES
from pagedkv.bench.throughput_workloads import Workload
from pagedkv.memory import blocks_for

RIVALS_DIR = Path(__file__).parent / "rivals"
WORKER_SCRIPTS = {"vllm": RIVALS_DIR / "vllm_worker.py", "llamacpp": RIVALS_DIR / "llamacpp_worker.py"}


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


class Engine(Protocol):
    info: dict

    def run(self, workload: Workload) -> tuple[float, list[list[int]]]: ...

    def close(self) -> None: ...


# -- in this process -----------------------------------------------------------------------------
class PagedkvEngine:
    """pagedkv's offline ``LLM``, prefix caching off (every repetition sends the same prompts),
    without a tokenizer (``skip_tokenizer_init``): ids in, ids out, as vLLM's worker runs."""

    def __init__(self, spec: LoadSpec, block_size: int = 16) -> None:
        from pagedkv import LLM

        blocks = blocks_for(spec.max_tokens_in_flight, block_size) + spec.max_requests + 16
        self.llm = LLM(
            str(spec.model),
            dtype=spec.dtype,
            block_size=block_size,
            num_kv_blocks=blocks,
            max_num_seqs=max(64, spec.max_requests),
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
        )
        self.info = {
            "engine": "pagedkv",
            "kv_blocks": blocks,
            "torch_threads": torch.get_num_threads(),
            "runtime": self.llm.engine.describe(),  # dtype and the linear/attention kernels
        }
        self.run(Workload("warm-up", ((5, 6, 7, 8, 9, 10, 11, 12),) * 2, (4, 4)))

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
    each row is cut to its own ``max_tokens``, which is all the work that counts."""

    def __init__(self, spec: LoadSpec) -> None:
        try:
            import transformers
        except ImportError as err:
            raise EngineUnavailable(f"transformers is not installed ({err})") from None
        dtype = getattr(torch, spec.dtype)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(spec.model), dtype=dtype)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        self.model = model.eval()
        self.info = {"engine": "transformers", "version": transformers.__version__}
        self.run(Workload("warm-up", ((5, 6, 7, 8, 9, 10, 11, 12),) * 2, (4, 4)))

    def run(self, workload: Workload) -> tuple[float, list[list[int]]]:
        width = max(len(p) for p in workload.prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in workload.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts])
        longest = max(workload.max_tokens)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=longest, do_sample=False)
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
        command = {
            "cmd": "load",
            "model": str(spec.model),
            "dtype": spec.dtype,
            "threads": spec.threads,
            "max_requests": spec.max_requests,
            "max_tokens_in_flight": spec.max_tokens_in_flight,
            "max_total_len": spec.max_total_len,
        } | extra
        try:
            reply = self._ask(command)
        except EngineUnavailable:
            self.close()
            raise
        self.info = reply["info"] | {"log": str(log)}

    def run(self, workload: Workload) -> tuple[float, list[list[int]]]:
        reply = self._ask({"cmd": "run", "workload": workload.to_json()})
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
    if name == "pagedkv":
        return PagedkvEngine(spec)
    if name == "transformers":
        return TransformersEngine(spec)
    rival = rivals.get(name) or {}
    python = rival.get("python")
    if not python:
        flag = "--vllm-python" if name == "vllm" else "--llamacpp-python"
        raise EngineUnavailable(f"no {flag} given")
    log = log_dir / f"{name}-{spec.dtype}.log"
    print(f"  starting {ENGINE_TITLES[name]} ({python}); its log: {log}", file=sys.stderr, flush=True)
    return RivalEngine(name, python, spec, log, rival.get("load", {}))
