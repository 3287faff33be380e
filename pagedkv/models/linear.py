"""Linear layers and the GEMM kernel they run on.

Nearly all of a decoder step's time is its matrix multiplies, and which library runs them
matters more than anything else in the step: on AMD CPUs, ``F.linear`` in float32 goes to MKL's
sgemm, which skips its fast paths there, while oneDNN -- shipped inside the same torch wheel --
runs this model family's shapes several times faster once the weight is reordered into its
blocked layout ("packed"), as vLLM's CPU build runs it. pagedkv's own tiled kernel
(:mod:`pagedkv.kernels.tiled_gemm`) goes further on decode steps, which stream every weight from
DRAM for a few rows, and keeps up at prefill sizes. So on the CPU every :class:`Linear` weight
is packed once, after loading (:func:`pack_linears`): tiled in float32 and bfloat16 (where the
CPU has AVX512-BF16, or AVX2 with FMA; on AMX tiles where it has those, which oneDNN's bfloat16
runs on too), else oneDNN's layout. ``F.linear`` stays on CUDA
(cuBLAS) and wherever neither can run the dtype; ``linear_kernel`` forces one of the three.

The packed tensor *replaces* the parameter (an opaque ``torch._mkldnn`` tensor, or a flat tiled
one): the weight is never held twice. :func:`linear` dispatches on the weight it is given, so a
subclass (tensor parallel shards) that keeps or restores a plain weight still works.
A weight tied to the embedding (``tie_word_embeddings``) is tiled too, and the embedding reads
its rows out of the tiles; under oneDNN it stays plain, since the embedding lookup cannot read
oneDNN's opaque layout and a packed copy beside it would hold the matrix twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.kernels import LINEAR_KERNELS, tiled_gemm
from pagedkv.kernels.tiled_gemm import (
    from_paired_tiles,
    from_tiles,
    tiled_gate_up,
    tiled_linear,
    to_paired_tiles,
    to_tiles,
)
from pagedkv.models.layer_ops import TorchOps

logger = logging.getLogger(__name__)
TILED = "pagedkv tiled"
ONEDNN = "oneDNN packed"
TORCH = "F.linear"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` on the weight's kernel: tiled for a flat (1-D) weight, oneDNN for
    a packed one, else ``F.linear``."""
    if weight.dim() == 1:
        return tiled_linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


#: Rows up to which a step-program projection writes into the output buffer it kept from its
#: last call (decode batches); a larger batch (prefill) gets a new tensor, so no buffer holds
#: megabytes. The decode stack's working buffers hold as many rows.
BUFFER_ROWS = 64


class OutputBuffer:
    """A step-program projection's output, kept from call to call for batches of at most
    :data:`BUFFER_ROWS` rows: one ``[BUFFER_ROWS, width]`` tensor per width and dtype asked for.

    A new output every call is a tensor allocation whose lines the kernel then writes cold; a
    kept one is warm and costs nothing to make (the LM head keeps none: logits leave the step).
    Safe because in the step program a projection's output is dead before the same projection
    runs again (the next step): the layer consumes it, and the program hands back a copy of the
    only one it returns (:meth:`pagedkv.models.step_program.StepProgram.run`).

    Buffers that :meth:`share` hold one set of tensors: the same op of every layer (and every
    expert of a mixture) writes into one output, dead by the time the next layer's op runs
    (:meth:`~pagedkv.models.ops.DecoderOps.share_outputs`), so a model keeps one layer's outputs,
    not one per layer, and the next layer finds them warm."""

    def __init__(self) -> None:
        #: (rows, width, dtype) -> the first ``rows`` rows of the width's tensor
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        #: every buffer holding these tensors (this one included)
        self._sharing: list[OutputBuffer] = [self]

    def share(self, other: OutputBuffer) -> None:
        """Hold ``other``'s tensors from now on, with every buffer that shared this one's
        (whose own tensors are dropped)."""
        if other._views is self._views:
            return
        joining = self._sharing
        for buffer in joining:
            buffer._views, buffer._sharing = other._views, other._sharing
        other._sharing.extend(joining)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors kept (one per width and dtype asked for so far)."""
        return [view for (rows, _, _), view in self._views.items() if rows == BUFFER_ROWS]

    def get(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The kept ``[rows, width]`` output, or None for a larger batch (the kernel then makes
        one). ``width`` is the projection's own; ``dtype`` changes only if the model is cast."""
        if rows > BUFFER_ROWS:
            return None
        view = self._views.get((rows, width, dtype))
        if view is None:
            whole = (BUFFER_ROWS, width, dtype)
            if whole not in self._views:
                self._views[whole] = torch.empty((BUFFER_ROWS, width), dtype=dtype)
            view = self._views[(rows, width, dtype)] = self._views[whole][:rows]
        return view


class Linear(nn.Linear):
    """``nn.Linear`` without random init (the loader overwrites every weight, and initialising a
    billion parameters only to discard them costs seconds) whose weight may be packed for oneDNN.
    """

    #: on-the-fly quantization leaves the layer in the checkpoint's precision (an MoE router,
    #: whose few logits pick the experts: llama.cpp keeps its ``ffn_gate_inp`` unquantized too)
    keeps_precision = False

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def as_function(self, output: OutputBuffer | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """This layer's forward as a plain function of ``x``, without the module call: what
        a :class:`~pagedkv.models.ops.Project` op runs, writing small batches into ``output``
        (None: a buffer of its own). It reads the weight from the module's parameter
        table at each call, so it stays right after :meth:`pack` replaces the weight."""
        params, width = self._parameters, self.out_features
        buffer = OutputBuffer() if output is None else output

        def project(x: torch.Tensor) -> torch.Tensor:
            weight = params["weight"]
            if weight.dim() == 1 and x.dim() == 2:  # tiled: into the kept buffer (OutputBuffer)
                return tiled_linear(x, weight, params["bias"], buffer.get(x.shape[0], width, weight.dtype))
            return linear(x, weight, params["bias"])

        return project

    def holding_blocks(self, layer: nn.Module) -> nn.Module:
        """The module that takes this layer's place when its weight is kept in GGUF blocks:
        ``layer``, a :class:`~pagedkv.models.quantized.QuantizedLinear` of the same rows,
        columns and bias. A tensor-parallel shard that communicates wraps it in its own kind."""
        return layer

    @property
    def is_packed(self) -> bool:
        return self.weight.is_mkldnn or self.weight.dim() == 1

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain ``[out, in]`` matrix, packed or not (a copy when packed)."""
        if self.weight.dim() == 1:
            return from_tiles(self.weight, self.in_features)
        return self.weight.to_dense() if self.weight.is_mkldnn else self.weight

    def pack(self, kernel: str, batch_hint: int = 0) -> None:
        """Replace the plain weight by ``kernel``'s layout: TILED's column tiles, or ONEDNN's
        blocked layout for about ``batch_hint`` input rows."""
        if self.is_packed:
            return
        weight = self.weight.detach()
        if kernel == TILED:
            packed = to_tiles(weight)
        elif kernel == ONEDNN:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        else:
            raise ValueError(f"{kernel!r} has no packed layout")
        self.weight = nn.Parameter(packed, requires_grad=False)


class PackedLinear(Linear):
    """Several projections of the same input as one GEMM, their output rows concatenated in
    ``shards`` order (vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``).

    A layer makes five matrix multiplies instead of seven: two dispatches and two fork/joins of
    the BLAS threads fewer per layer and step. ``shards`` maps each checkpoint projection name
    (``q_proj``...) to its row count; the loader fills those row slices. The packed product
    equals the separate ones bit for bit on the built-in and test shapes; for some shapes the
    BLAS picks another kernel for the wider matrix and the last bits differ (~1e-6 relative,
    seen at hidden 896).
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self) -> dict[str, tuple[int, int]]:
        """``name -> (first row, row count)`` of each shard inside the packed weight."""
        rows, start = {}, 0
        for name, size in self.shards.items():
            rows[name] = (start, size)
            start += size
        return rows


class GateUpLinear(PackedLinear):
    """The MLP's gate and up projections as one GEMM whose product ``silu(gate) * up`` can be made
    in one pass: tiled (without a bias), the weight takes the paired layout of
    :func:`~pagedkv.kernels.tiled_gemm.to_paired_tiles`, and :meth:`act_function` applies the
    activation to each block of columns while it is in cache, through the same C function as
    the separate op (bit for bit its result). Every other kernel keeps the two passes.
    ``names``: the checkpoint's names of the gate and the up projection (Mixtral's experts:
    ``w1``, ``w3``)."""

    def __init__(
        self,
        in_features: int,
        intermediate_size: int,
        bias: bool,
        names: tuple[str, str] = ("gate_proj", "up_proj"),
    ) -> None:
        super().__init__(in_features, dict.fromkeys(names, intermediate_size), bias)
        self.paired = False

    def _product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return tiled_gate_up(x, weight, False) if self.paired else linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.weight, self.bias)

    def as_function(self, output: OutputBuffer | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The packed product (a new tensor each call: only the fused activation keeps its output)."""
        params = self._parameters
        return lambda x: self._product(x, params["weight"], params["bias"])

    def act_function(
        self, output: OutputBuffer | None = None
    ) -> Callable[[torch.Tensor, TorchOps], torch.Tensor]:
        """``silu(gate) * up`` of ``x`` as a plain function of ``(x, ops)``: fused where the
        weight is paired and of ``x``'s dtype (small batches written into ``output``, None: a
        buffer of its own), else the product followed by ``ops.silu_and_mul``.
        Reads the weight at each call, like :meth:`as_function`."""
        params, width = self._parameters, self.out_features // 2
        buffer = OutputBuffer() if output is None else output

        def act(x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
            weight = params["weight"]
            if self.paired and x.dtype == weight.dtype:
                out = buffer.get(x.shape[0], width, x.dtype) if x.dim() == 2 else None
                return tiled_gate_up(x, weight, True, out)
            return ops.silu_and_mul(self._product(x, weight, params["bias"]))

        return act

    def dense_weight(self) -> torch.Tensor:
        if self.paired:
            return from_paired_tiles(self.weight, self.in_features)
        return super().dense_weight()

    def pack(self, kernel: str, batch_hint: int = 0) -> None:
        if self.is_packed or kernel != TILED or self.bias is not None:
            super().pack(kernel, batch_hint)
            return
        self.weight = nn.Parameter(to_paired_tiles(self.weight.detach()), requires_grad=False)
        self.paired = True


@dataclass(frozen=True)
class LinearKernel:
    """The kernel the linear layers run on, and why it was chosen (shown by the CLI)."""

    name: str  # TILED, ONEDNN or TORCH
    reason: str
    #: oneDNN's layout is chosen for this many input rows (see :func:`pack_linears`)
    batch_hint: int = 0
    #: layers left on F.linear although the kernel packs (tied weights), with why
    kept_plain: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        text = f"{self.name} ({self.reason})"
        if self.kept_plain:
            text += f"; F.linear for {', '.join(self.kept_plain)}"
        return text


def choose_linear_kernel(requested: str, device: torch.device, dtype: torch.dtype) -> LinearKernel:
    """On the CPU the tiled kernel where it runs the dtype, else oneDNN packed where that runs it
    natively, else ``F.linear``; ``requested`` "tiled", "onednn" or "torch" forces one (an error if it
    cannot run here)."""
    if requested not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernel {requested!r}; choose one of {list(LINEAR_KERNELS)}")
    if requested == "torch":
        return LinearKernel(TORCH, "asked for")
    if requested in ("auto", "tiled"):
        no_tiles = _tiled_unavailable(device, dtype)
        if no_tiles is None:
            on = " on AMX tiles" if dtype == torch.bfloat16 and tiled_gemm.amx_rows() else ""
            return LinearKernel(TILED, "asked for" if requested == "tiled" else f"CPU, {_name(dtype)}{on}")
        if requested == "tiled":
            raise ValueError(f"linear kernel 'tiled' cannot run here: {no_tiles}")
    unavailable = _onednn_unavailable(device, dtype)
    if unavailable is None:
        return LinearKernel(ONEDNN, "asked for" if requested == "onednn" else f"CPU, {_name(dtype)}")
    if requested == "onednn":
        raise ValueError(f"linear kernel 'onednn' cannot run here: {unavailable}")
    return LinearKernel(TORCH, unavailable)


def _tiled_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the tiled kernel cannot run this model's linears, or None when it can."""
    if device.type != "cpu":
        return f"{device.type}: the vendor BLAS"
    return tiled_gemm.why_unavailable(dtype)


def _onednn_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot run this model's linears, or None when it can."""
    if device.type != "cpu":
        return f"{device.type}: the vendor BLAS"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    native = {
        torch.float32: lambda: True,
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
    }.get(dtype)
    if native is None or not native():
        return f"oneDNN has no native {_name(dtype)} on this CPU"
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_linears(model: nn.Module, kernel: LinearKernel, batch_hint: int) -> LinearKernel:
    """Pack every :class:`Linear` of ``model`` for ``kernel`` (a no-op for ``F.linear``); returns
    the kernel with the layers left plain because their weight is shared with another module.
    A LM head tied to the embedding is tiled too, and the embedding then reads its rows from the
    tiles (nothing held twice); oneDNN's opaque layout cannot be read that way, so there it stays
    plain.

    The layout hint (oneDNN only): oneDNN picks one blocked layout per hint, and a call whose
    row count the layout does not suit is slower. A layout packed for one row is several times
    slower on a batch, while hints from a few dozen rows up suit decode batches and prefill
    alike, so the engine passes its ``max_num_batched_tokens``.
    """
    if kernel.name == TORCH:
        return kernel
    holders: dict[int, list[nn.Module]] = {}  # parameter -> the modules holding it as `weight`
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    kept: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.is_packed:
            continue
        sharers = [m for m in holders.get(id(module.weight), []) if m is not module]
        readable = all(getattr(m, "reads_tiled_weight", False) for m in sharers)
        if sharers and not (kernel.name == TILED and readable):
            kept.append(f"{name} (tied to the embedding)")
            continue
        module.pack(kernel.name, batch_hint)
        for sharer in sharers:  # the embedding reads its rows out of the same tiles
            sharer.weight = module.weight
    hint = batch_hint if kernel.name == ONEDNN else 0
    chosen = LinearKernel(kernel.name, kernel.reason, hint, tuple(kept))
    logger.info("linear layers: %s", chosen.describe())
    return chosen
