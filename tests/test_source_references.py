"""The package's docstrings and comments name only files and modules that exist.

Modules move and tools are retired; a docstring that still cites the old place sends a reader
to nothing. Every file path with an extension that a source file under ``pagedkv/`` mentions
(``docs/kv-cache.md``, ``tools/x.py``, ``engine/core/kv_tier.py`` relative to the package) must
exist, and every Sphinx cross-reference to ``pagedkv.…`` must name a module that exists and,
past the module, a name its source defines or imports.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pagedkv"
SOURCES = sorted(PACKAGE.rglob("*.py"))
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
EXTENSIONS = "py|c|h|md|sh|js|css|html|json|toml"
FILE_REF = re.compile(
    rf"(?<![\w/.])((?:pagedkv|docs|tests|tools|benchmarks|{'|'.join(SUBPACKAGES)})/[\w/.-]*\.(?:{EXTENSIONS}))\b"
)
XREF = re.compile(r":(?:mod|func|class|meth|attr|data|exc):`~?(pagedkv(?:\.\w+)+)`")


def missing_file(source: Path, ref: str) -> bool:
    return not any(base.joinpath(ref).exists() for base in (ROOT, PACKAGE, source.parent))


def missing_target(dotted: str) -> bool:
    """Whether ``dotted`` names no module, or a name its longest module prefix does not mention."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:end])
        module = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if module.is_file():
            break
    else:
        return True
    return end < len(parts) and not re.search(rf"\b{re.escape(parts[end])}\b", module.read_text())


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_references_resolve(source: Path) -> None:
    text = source.read_text()
    broken = [ref for ref in FILE_REF.findall(text) if missing_file(source, ref)]
    broken += [ref for ref in XREF.findall(text) if missing_target(ref)]
    assert not broken, f"{source.relative_to(ROOT)} cites what does not exist: {broken}"


def test_a_stale_reference_is_found(tmp_path: Path) -> None:
    assert missing_file(tmp_path / "x.py", "tools/no_such_tool.py")
    assert missing_target("pagedkv.engine.no_such_module")
    assert missing_target("pagedkv.engine.core.scheduler.NoSuchClass")
    assert not missing_target("pagedkv.engine.core.scheduler.Scheduler")
    assert not missing_file(PACKAGE / "engine" / "engine.py", "engine/core/scheduler.py")
