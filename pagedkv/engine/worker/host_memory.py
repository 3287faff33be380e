"""How the CPU process hands out memory for a step's activations.

glibc's ``malloc`` serves large requests (above a threshold that adapts between 128 KiB and
32 MiB) with a fresh ``mmap`` and gives the memory back with ``munmap`` when freed, and it
trims the top of its heap once enough is free there. A prefill step of 2048 tokens allocates
buffers of tens of MiB per layer (a 2048 x 2752 float32 gate/up output is 22 MiB), so every
step maps them anew and faults every page in again, a large share of a prefill's time. Keeping
freed memory in the heap and reusing it, as vLLM's CPU build gets by preloading tcmalloc,
removes those faults (``minflt`` near 0 after the first step).

The cost is that the process keeps the peak of its step buffers mapped after they are freed,
which an engine that runs the same step sizes over and over reuses anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

#: ``mallopt`` parameters (glibc ``malloc.h``)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: requests above this are still mapped on their own: the KV cache pool of a large budget, a
#: checkpoint's biggest tensor; step buffers stay below it
MMAP_THRESHOLD = 1 << 30
#: free memory kept at the top of the heap before it is returned to the system (mallopt takes
#: an int: the largest value it can hold)
TRIM_THRESHOLD = (1 << 31) - 1


@functools.cache
def reuse_freed_memory() -> bool:
    """Make glibc keep freed step buffers for reuse (once per process); False where the C
    library is not glibc or refuses, which changes nothing but speed."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or not glibc's
        logger.debug("mallopt unavailable (C library %s): step buffers are mapped per step", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    logger.debug("glibc malloc keeps freed step buffers: %s", done)
    return done
