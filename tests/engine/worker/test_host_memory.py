"""Step-sized buffers are reused, not mapped and faulted in again every step."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from pagedkv.engine.worker.host_memory import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a prefill step's buffers, several alive at once: 2048-token gate/up outputs of 43 MiB
    buffers = [torch.ones(2048, 5504) for _ in range(3)]
    return sum(float(b[0, 0]) for b in buffers)
for _ in range(3):  # the first buffers fault their pages in, either way
    step()
before = faults()
for _ in range(5):
    step()
print(faults() - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc: Linux only")
def test_freed_step_buffers_are_reused_without_page_faults():
    pages = 2048 * 5504 * 4 // 4096  # one buffer's pages
    # glibc maps every request above 32 MiB (its adaptive threshold's ceiling) anew; below that,
    # whether freed buffers are handed back depends on the heap's layout
    assert _faults("default") > 2 * pages
    assert _faults("reuse") < pages // 4
