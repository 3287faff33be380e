"""What every figure of the package shares: a display-free figure, saving, a folder of plots.

Figures are built on :class:`matplotlib.figure.Figure` with the Agg canvas rather than through
pyplot, so nothing touches pyplot's global state or needs a display. matplotlib is imported
only by the modules that plot, and they are imported only when a command writes plots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path, dpi: int = 120) -> Path:
    fig.savefig(path, dpi=dpi)
    return path


Result = TypeVar("Result")


def write_figures(
    result: Result, out_dir: str | Path, figures: Mapping[str, Callable[[Result, Path], Path]]
) -> list[Path]:
    """Call each ``plot(result, out_dir / file_name)`` of ``figures`` (the folder is created if
    needed); return the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot(result, out / name) for name, plot in figures.items()]
