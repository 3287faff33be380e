"""The package's shape, read from its source: imports point one way, layers stay apart.

Every ``import`` counts -- module level, under ``TYPE_CHECKING`` and deferred inside functions --
and ``from pkg import name`` counts as importing the module ``pkg.name`` when there is one.
Importing ``a.b.c`` also runs the packages ``a.b`` and ``a`` (their ``__init__``) first, unless
they are the importer's own: a cycle through a package's re-exports shows too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pagedkv"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                for a in node.names
            )
    parents = {
        ".".join(m.split(".")[:i]) for m in found for i in range(2, m.count(".") + 1)
    }  # the packages each import runs first
    found |= {p for p in parents if not name.startswith(p + ".")}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


# The second KV tier is one folder, memory/tier/, whose modules sit on the planes they serve: its
# bookkeeping is memory's (pure Python); the modules that move its bytes read the KV cache's
# tensors, and sit on the tensor side with attention/.
TIER_PLANES = {
    "pagedkv.memory.tier.host": "pagedkv.attention",
    "pagedkv.memory.tier.disk": "pagedkv.attention",
    "pagedkv.memory.tier.movers": "pagedkv.attention",
    "pagedkv.memory.tier.limits": "pagedkv.attention",
}


def _layer(module: str) -> str:
    return TIER_PLANES.get(module, ".".join(module.split(".")[:2]))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_the_graph_is_read_and_a_cycle_would_show():
    assert "pagedkv.engine.core.plan" in GRAPH["pagedkv.engine.worker.model_runner"]
    assert "pagedkv.engine.worker.executor" in GRAPH["pagedkv.engine.engine"]  # the package runs first
    assert len(MODULES) > 80
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    assert _cycles(GRAPH) == []


def test_no_two_layers_import_each_other():
    layers: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        layers.setdefault(_layer(module), set()).update(
            _layer(t) for t in targets if _layer(t) != _layer(module)
        )
    assert _cycles(layers) == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        # config/ holds the engine's typed settings: below everything that reads them, it knows
        # only the plain-Python memory model and the kernels' names
        (
            "pagedkv.config",
            {
                "pagedkv.attention",
                "pagedkv.models",
                "pagedkv.engine",
                "pagedkv.distributed",
                "pagedkv.tokenizer",
                "pagedkv.server",
                "pagedkv.bench",
                "pagedkv.sim",
            },
        ),
        # memory/ is pure Python: no tensors, no requests
        (
            "pagedkv.memory",
            {"pagedkv.attention", "pagedkv.config", "pagedkv.engine", "pagedkv.models", "pagedkv.server"},
        ),
        # kernels/ is the bottom of the tensor side: attention/ and models/ call it, never the reverse
        (
            "pagedkv.kernels",
            {"pagedkv.attention", "pagedkv.models", "pagedkv.engine", "pagedkv.server", "pagedkv.bench"},
        ),
        # attention/ knows nothing of requests
        ("pagedkv.attention", {"pagedkv.engine", "pagedkv.models", "pagedkv.server", "pagedkv.bench"}),
        ("pagedkv.models", {"pagedkv.engine", "pagedkv.server", "pagedkv.bench"}),
        # tokenizer/ turns text into ids and back: no models, tensors or requests
        (
            "pagedkv.tokenizer",
            {"pagedkv.models", "pagedkv.attention", "pagedkv.engine", "pagedkv.server", "pagedkv.bench"},
        ),
        (
            "pagedkv.engine",
            {"pagedkv.server", "pagedkv.bench", "pagedkv.cli", "pagedkv.cli_args", "pagedkv.cli_parsing"},
        ),
    ],
)
def test_lower_layers_never_import_upper_ones(layer, forbidden):
    imported = {_layer(t) for m, targets in GRAPH.items() if _layer(m) == layer for t in targets}
    assert not imported & forbidden


def test_the_kernels_import_only_their_builder():
    """The kernels package reaches nothing of pagedkv but the C builder, and its package module
    imports nothing at all, so the command line can read its names without torch."""
    outside = {t for m, targets in GRAPH.items() if m.startswith("pagedkv.kernels") for t in targets}
    assert {t for t in outside if not t.startswith("pagedkv.kernels")} == {"pagedkv.cbuild"}
    assert GRAPH["pagedkv.kernels"] == set()


def test_only_the_workers_reach_the_model():
    """Of the engine, only engine/worker/ (the executors with a rank's second tier, the model
    runner and its CUDA graphs) imports the model and the KV tensor code, the tier's bytes
    included: the control plane and the sampling side never do."""
    tensor_side = ("pagedkv.attention", "pagedkv.models.loader")
    touching = {
        m
        for m, targets in GRAPH.items()
        if m.startswith("pagedkv.engine")
        and any(t.startswith(tensor_side) or _layer(t) == "pagedkv.attention" for t in targets)
    }
    assert "pagedkv.engine.worker.model_runner" in touching  # the rule reads the graph
    assert {m for m in touching if not m.startswith("pagedkv.engine.worker.")} == set()


def test_the_tokenizer_stands_alone():
    """tokenizer/ reaches nothing of pagedkv outside itself, and imports without torch: text
    handling in the server and the engine's output path never loads the model side for it."""
    reached = {t for m, targets in GRAPH.items() if m.startswith("pagedkv.tokenizer") for t in targets}
    assert "pagedkv.tokenizer.detokenizer" in reached  # the graph of the package was read
    assert {t for t in reached if not t.startswith("pagedkv.tokenizer")} == set()
    probe = "import sys, pagedkv.tokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT.parent).returncode == 0


CONTROL_PLANE = sorted(
    m for m in MODULES if m.startswith("pagedkv.engine.core") or _layer(m) == "pagedkv.memory"
)


@pytest.mark.parametrize("module", ["pagedkv.engine", "pagedkv.sim", *CONTROL_PLANE])
def test_the_control_plane_imports_without_torch(module):
    """The control plane (engine/core/), the block bookkeeping with the second tier's, and the
    simulator are plain Python, module by module: they run (and are tested) without the model
    side, and the command line reads the engine's options without loading torch."""
    probe = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT.parent).returncode == 0
