"""``pagedkv simulate --html DIR``: the replay as one self-contained HTML file.

The page (``replay_page/``: markup, style and two scripts -- ``memory.js`` draws one allocator's
memory, ``page.js`` the controls and curves -- shipped as package data) gets its data from
:func:`pagedkv.sim.replay.replay_document`, inlined with the style and the scripts, so that the
file opens from disk (``file://``) with no server, no network and nothing beside it.
"""

from __future__ import annotations

import json
from html import escape
from importlib.resources import files
from pathlib import Path

from pagedkv.sim.replay import MAX_FRAMES, replay_document
from pagedkv.sim.simulate import SimResult

REPLAY_FILENAME = "simulator_replay.html"
_PAGE = files("pagedkv.sim") / "replay_page"
_SCRIPTS = ("memory.js", "page.js")  # in this order: page.js uses memory.js's replayMaps


def _script_safe(text: str) -> str:
    """JSON that cannot end the ``<script>`` element holding it (``</`` becomes ``<\\/``)."""
    return text.replace("</", "<\\/")


def render_replay(result: SimResult, max_frames: int = MAX_FRAMES) -> str:
    """The replay page of ``result`` as one HTML string."""
    document = replay_document(result, max_frames)
    html = (_PAGE / "replay.html").read_text(encoding="utf-8")
    parts = {
        "/*@STYLE@*/": (_PAGE / "replay.css").read_text(encoding="utf-8"),
        "/*@SCRIPT@*/": "\n".join((_PAGE / name).read_text(encoding="utf-8") for name in _SCRIPTS),
        "@TITLE@": escape(document["title"]),
        "@DATA@": _script_safe(json.dumps(document, separators=(",", ":"))),
    }
    for marker, text in parts.items():
        if html.count(marker) != 1:
            raise RuntimeError(f"the replay template must hold {marker} exactly once")
        html = html.replace(marker, text)
    return html


def write_replay(result: SimResult, out_dir: str | Path, max_frames: int = MAX_FRAMES) -> Path:
    """Write the replay into ``out_dir`` (created if needed); return the file's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPLAY_FILENAME
    path.write_text(render_replay(result, max_frames), encoding="utf-8")
    return path
