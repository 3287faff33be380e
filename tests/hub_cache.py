"""A Hugging Face Hub cache built on disk, so that tests load ``org/name`` ids without a network.

huggingface_hub keeps a downloaded repository as ``models--org--name/`` under the cache folder:
``snapshots/<commit>/`` holds the files of each revision (links into ``blobs/`` on a real
download; plain files serve as well), and ``refs/<branch or tag>`` holds the commit a name
points at. Offline, ``snapshot_download`` resolves a revision through ``refs/`` (a 40-hex
commit directly) and returns that snapshot folder: exactly what :func:`add_snapshot` writes.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def repo_folder(cache: Path, repo_id: str) -> Path:
    """Where huggingface_hub keeps the model repository ``repo_id`` in ``cache``."""
    return Path(cache) / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(cache: Path, repo_id: str, model: Path, refs: tuple[str, ...] = ("main",)) -> Path:
    """Copy the model folder ``model`` into ``cache`` as a snapshot of ``repo_id`` that each of
    ``refs`` points at; returns the snapshot folder (its name is the commit hash)."""
    digest = hashlib.sha1()
    for file in sorted(Path(model).iterdir()):
        digest.update(file.name.encode() + file.read_bytes())
    commit = digest.hexdigest()
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
