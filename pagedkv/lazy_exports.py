"""Package attributes imported on first use, so importing a package stays cheap.

``pagedkv``, ``pagedkv.engine`` and ``pagedkv.server`` re-export names whose modules import
torch or FastAPI; the command line imports their light modules (argument parsing, the KV
policies) without paying for either. Each package lists ``name -> module`` and sets
``__getattr__ = lazy_exports(__name__, EXPORTS)`` (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` and returns its ``name``."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
