"""How a command that measures shows its figures: ``--out``, ``--no-plots`` and ``--json``, then
tables or one JSON document. Imports neither torch nor the engine (``pagedkv --help`` stays fast).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rich.console import Console

#: Where plots and reports go unless ``--out`` says otherwise (``pagedkv demo`` writes there too).
DEFAULT_OUT = "pagedkv-report"


def add_report_options(
    parser: argparse.ArgumentParser, plots: bool = True, out_help: str = "folder for the PNG plots"
) -> None:
    """``--out``, ``--no-plots`` and ``--json``: how a command that measures shows its figures
    (``plots=False``: a command that draws none has no ``--no-plots``; ``out_help`` says what
    else its ``--out`` holds)."""
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out", type=Path, default=Path(DEFAULT_OUT), help=f"{out_help} (default: %(default)s)"
    )
    if plots:
        output.add_argument("--no-plots", action="store_true", help="do not write plots")
    output.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


@dataclass(frozen=True)
class ReportOptions:
    """What ``--out``, ``--no-plots`` and ``--json`` say, for a report shown without a parser
    (the sections of ``pagedkv demo``)."""

    out: Path
    no_plots: bool = False
    json: bool = False


class Report(Protocol):
    def to_json(self) -> dict: ...


R = TypeVar("R", bound=Report)


def show_report(
    options: argparse.Namespace | ReportOptions,
    result: R,
    write_plots: Callable[[R, Path], list[Path]] | None,
    print_report: Callable[[R, Console], None],
    console: Console | None = None,
    extra_json: dict[str, Any] | None = None,
) -> list[Path]:
    """How every measuring command ends: its plots (unless ``--no-plots``, or ``write_plots``
    is None for a command that draws none), then one JSON document (``--json``, with
    ``extra_json``'s keys: other files the command wrote) or its tables and where the plots
    went. Returns the plots written."""
    if write_plots is None:
        plots, listed = [], {}
    else:
        plots = [] if options.no_plots else write_plots(result, Path(options.out))
        listed = {"plots": [str(p) for p in plots]}
    if options.json:
        print(json.dumps(result.to_json() | listed | (extra_json or {}), indent=2))
        return plots
    console = console or Console()
    print_report(result, console)
    if plots:
        # soft_wrap: a path longer than the terminal stays one string the user can copy
        console.print(f"\nPlots written to [bold]{plots[0].parent}/[/]:", soft_wrap=True)
        for path in plots:
            console.print(f"  {path}", soft_wrap=True)
    return plots
