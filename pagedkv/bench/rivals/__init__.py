"""Worker scripts that run a rival engine for ``pagedkv bench throughput`` in its own Python.

vLLM and llama.cpp pin their own packages, so each runs from its own virtual environment, started
by the driver as ``PYTHON <worker>.py``. A worker imports only the standard library, its engine's
packages and :mod:`worker_io` beside it (stdlib only), never pagedkv: nothing of pagedkv has to
be installed there. The protocol is in :mod:`pagedkv.bench.rivals.worker_io`.
"""
