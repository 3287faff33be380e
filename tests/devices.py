"""Where the end-to-end tests run the model: the CPU, or the device ``PAGEDKV_TEST_DEVICE`` names
(``benchmarks/gpu_check.sh`` sets ``cuda``, so the same tests check the engine on a GPU)."""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")
