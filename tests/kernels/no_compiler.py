"""Running code where the kernels library cannot be built: a fresh Python whose ``PATH`` holds
no C compiler (and no ``$CC``), with an empty kernel cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_without_compiler(script: str, tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script`` (from the repository root, ``tests`` importable) with no C compiler to find;
    fails the test when it exits with an error. Returns the finished process (its stderr holds
    what it logged and warned)."""
    empty_bin, cache = tmp_path / "no-compiler-bin", tmp_path / "no-compiler-cache"
    empty_bin.mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key != "CC"}
    env |= {"PATH": str(empty_bin), "PAGEDKV_KERNEL_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr
    return done
