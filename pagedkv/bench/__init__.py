"""Every benchmark of pagedkv (``pagedkv bench ...``), each against its baseline in one run.

A figure is only meaningful next to the thing it is compared with, so each benchmark measures
its baseline and pagedkv in the same process, on the same model and inputs, and prints the
ratio. ``driver`` holds what the live-engine benchmarks share (engine options, an engine on its
own clock, the run's thread settings); ``capacity_*`` and ``sharing_*`` are the KV benchmarks
(config, run, prediction, report, plots, command line); ``serve*`` the online one against an
OpenAI-compatible server; ``throughput_*`` runs pagedkv, transformers and -- from their own
venvs, through the workers in ``rivals/`` -- vLLM's CPU build and llama.cpp on the same token ids
(``machine_load`` says how busy the machine was meanwhile); ``attention`` and ``allocator``
compare with contiguous SDPA and a bare list. Plots share :mod:`pagedkv.plotting`, command lines
:mod:`pagedkv.cli_args`.
"""
