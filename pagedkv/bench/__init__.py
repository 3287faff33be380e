"""The benchmarks a user runs (``pagedkv bench ...``), each against its baseline in one run.

A figure is only meaningful next to the thing it is compared with, so each benchmark measures
its baseline and pagedkv in the same process (or sitting), on the same model and inputs, and
prints the ratio. Every benchmark is one :class:`~pagedkv.bench.driver.Bench` -- its
configuration, its run, its tables -- run by :mod:`pagedkv.bench.driver`: ``throughput``
(pagedkv, transformers, and vLLM and llama.cpp through the workers in ``rivals/``), ``serve``
(an OpenAI-compatible server), ``capacity`` and ``sharing`` (the KV cache in the live engine),
``quality`` (KV cache dtypes), ``router`` (replicas behind vllm-router) and ``parallel``
(tensor parallelism).
"""
