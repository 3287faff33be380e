"""CUDA graphs for decode steps: captured per batch size at start-up, replayed with padded inputs.

A decode step on a GPU is hundreds of small kernel launches -- per layer the norms, the four
projections, rotary, the KV write, attention and its merge -- each of which costs the host
more than the GPU spends on it at small batches. A CUDA graph records a whole forward pass once
and replays it with one launch. vLLM's scheme, here:

- at start-up a graph is captured for each batch size of
  :func:`~pagedkv.engine.worker.step_inputs.capture_sizes` (1, 2, 4, ... up to ``max_num_seqs``),
  largest first, all in one memory pool; each reads its inputs from fixed views of one
  :class:`~pagedkv.engine.worker.step_buffers.StepBuffers` buffer;
- a decode step pads its batch to the next captured size
  (:func:`~pagedkv.engine.worker.step_inputs.pad_decode`: padding rows write and read only the
  cache's last block, which the pool never hands out), copies its inputs into that buffer with
  one copy and replays; the real rows' hidden states are the first rows of the graph's output,
  and the LM head runs on those alone, eagerly;
- prefill and mixed steps, and decode steps a graph cannot hold, run eagerly
  (:func:`~pagedkv.engine.worker.step_inputs.graph_size`).

Nothing a graph captured depends on the step: every shape comes from the batch size and the
graphs' bound on contexts (``max_model_len``), never from a device value, so the split-KV
attention divides each context in the kernel. Block tables are inputs, so preemption, forks,
beams and copy-on-write (the block copies run before the forward pass, outside any graph) need
nothing of the graphs. The rotary tables are grown to the bound before capture and only grow,
so the graphs never read a freed table.

``capture=False`` runs the very same padded steps eagerly: how the CPU test suite checks
everything here but the recording itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.attention import KVCache
from pagedkv.engine.worker.step_buffers import StepBuffers, StepLayout
from pagedkv.engine.worker.step_inputs import StepArrays, capture_sizes, empty_decode, graph_size, pad_decode


def eager_reason(device: str, enforce_eager: bool, tensor_parallel_size: int) -> str | None:
    """Why decode steps run without graphs (shown by ``describe()``), or None when they are captured."""
    if enforce_eager:
        return "off (enforce_eager)"
    if torch.device(device).type != "cuda":
        return f"off ({torch.device(device).type} device: graphs are a CUDA feature)"
    if tensor_parallel_size > 1:
        return "off (tensor parallel: eager)"
    return None


@dataclass(frozen=True)
class DecodeGraphSpec:
    """What the decode graphs are captured for."""

    #: the batch sizes (increasing); decode batches up to the last replay a graph
    sizes: tuple[int, ...]
    #: the longest context a step may have (``max_model_len``): sizes the block tables and the
    #: attention's splits, and the rotary tables are grown to it before capture
    max_seq_len: int
    #: record graphs (CUDA); False runs the same padded steps eagerly
    capture: bool = True

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_model_len: int, device: str) -> DecodeGraphSpec:
        return cls(capture_sizes(max_num_seqs), max_model_len, torch.device(device).type == "cuda")

    def describe(self) -> str:
        return f"decode at batch sizes {', '.join(map(str, self.sizes))}"


@dataclass
class _SizedStep:
    """One batch size's forward pass over fixed input views, and its graph once captured."""

    layout: StepLayout
    forward: Callable[[], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """The decode graphs of one model and KV cache; the cache's last block is the padding rows'
    scratch block (the executor allocates it beside the pool)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, spec: DecodeGraphSpec) -> None:
        self.spec = spec
        self.block_size = kv_cache.block_size
        self.scratch_block = kv_cache.num_blocks - 1
        self.table_width = -(-spec.max_seq_len // kv_cache.block_size)
        largest = self._pad(empty_decode(), spec.sizes[-1])
        self.buffers = StepBuffers(kv_cache.device, StepLayout.of(largest).words, growable=False)
        self.pool = torch.cuda.graph_pool_handle() if spec.capture else None
        self.steps: dict[int, _SizedStep] = {}
        with torch.inference_mode():
            for size in sorted(spec.sizes, reverse=True):  # the largest first: the smaller reuse its pool
                self.steps[size] = self._prepare(model, kv_cache, size)

    def _pad(self, arrays: StepArrays, size: int) -> StepArrays:
        return pad_decode(arrays, size, self.scratch_block, self.block_size, self.table_width)

    def _prepare(self, model: torch.nn.Module, kv_cache: KVCache, size: int) -> _SizedStep:
        """Views of the buffer for ``size`` rows, filled with padding rows, and the forward pass
        over them; captured (after two warm-up passes on a side stream, which also compile the
        Triton kernels for these shapes and grow the rotary tables) when the spec says so."""
        layout = self.buffers.write(self._pad(empty_decode(), size))

        def forward() -> torch.Tensor:
            # new inputs per pass, over the same views: the metadata holds what a backend derives
            # from the views' values (the CPU's kernel rows), which change from step to step
            inputs = self.buffers.inputs(layout, 1, self.spec.max_seq_len)
            return model(inputs.input_ids, inputs.positions, kv_cache, inputs.metadata)

        step = _SizedStep(layout, forward)
        if self.spec.capture:
            side = torch.cuda.Stream(device=kv_cache.device)
            side.wait_stream(torch.cuda.current_stream(kv_cache.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream(kv_cache.device).wait_stream(side)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=self.pool):
                step.output = forward()
        return step

    def run(self, arrays: StepArrays) -> torch.Tensor | None:
        """The final hidden states of this step's rows, from a graph; None when the step runs
        eagerly instead (see :func:`~pagedkv.engine.worker.step_inputs.graph_size`)."""
        size = graph_size(arrays, self.spec.sizes, self.block_size, self.table_width)
        if size is None:
            return None
        step = self.steps[size]
        layout = self.buffers.write(self._pad(arrays, size))
        if layout != step.layout:  # pad_decode makes every step of a size alike
            raise AssertionError(
                f"a padded decode step of {size} rows has layout {layout}, not {step.layout}"
            )
        return step.run()[: arrays.num_seqs]
