"""What an open dashboard costs: ``pagedkv bench serve`` throughput with and without pages open.

.venv/bin/python tools/dashboard_cost.py [--rounds 3] [--pages 1] [--num-prompts 100]
    [-- SERVE OPTIONS, e.g. --num-kv-blocks 2048]

Starts one ``pagedkv serve`` process and runs the same seeded workload against it in alternating
rounds, A (no page) and B (``--pages`` readers of ``/dashboard/stream``, each its own process,
as a browser would be), A first in odd rounds and B first in even ones, so both see the same
machine load. Prints each round's output tokens/s and the medians, and the share of the B
rounds' time the engine worker spent publishing frames (the server's
``pagedkv:dashboard_publish_seconds_total``): the direct cost, which the throughput comparison
measures only as well as the machine is quiet. A warm-up run goes first (the first requests pay
one-off costs).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedkv.bench.serve import ServeConfig, run_benchmark
from pagedkv.bench.serve_servers import running_server
from pagedkv.server.replicas import free_port

#: A page, minus the drawing: reads the event stream and throws it away.
READER = (
    "import sys, httpx\n"
    "with httpx.stream('GET', sys.argv[1] + '/dashboard/stream', timeout=None) as r:\n"
    "    for _ in r.iter_raw(): pass\n"
)


def publish_seconds(base_url: str) -> float:
    """The server's ``pagedkv:dashboard_publish_seconds_total``."""
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith("pagedkv:dashboard_publish_seconds_total"):
            return float(line.split()[-1])
    raise RuntimeError("the server exposes no pagedkv:dashboard_publish_seconds_total")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    args, serve_options = parser.parse_known_args()
    serve_options = [o for o in serve_options if o != "--"]
    port = free_port()
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--log-level", "warning"]
    config = ServeConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
    results: dict[str, list[float]] = {"A": [], "B": []}
    shares: list[float] = []  # of the B rounds' wall time, the worker's time publishing frames
    log = Path(tempfile.mkdtemp()) / "server.log"
    with running_server([*command, *serve_options], {}, port, log, "pagedkv serve") as base_url:
        run_benchmark(base_url, config)  # warm-up
        for round_ in range(args.rounds):
            for label in ("A", "B") if round_ % 2 == 0 else ("B", "A"):  # no order bias
                readers = []
                if label == "B":
                    readers = [
                        subprocess.Popen([sys.executable, "-c", READER, base_url]) for _ in range(args.pages)
                    ]
                    time.sleep(1.0)  # connected and past the first (full) frame
                published = publish_seconds(base_url)
                result = run_benchmark(base_url, config)
                if label == "B":
                    shares.append((publish_seconds(base_url) - published) / result.duration_s)
                for reader in readers:
                    reader.kill()
                    reader.wait()
                if result.failed:
                    print(f"round {round_ + 1} {label}: {result.failed} failed: {result.errors}", flush=True)
                results[label].append(result.output_throughput)
                share = f" (publishing: {100 * shares[-1]:.2f} % of the time)" if label == "B" else ""
                print(f"round {round_ + 1} {label}: {result.output_throughput:.1f} tok/s{share}", flush=True)
    a, b = statistics.median(results["A"]), statistics.median(results["B"])
    print(f"median without a page: {a:.1f} tok/s; with {args.pages} page(s): {b:.1f} tok/s")
    print(f"cost of the open page(s): {100 * (a - b) / a:+.2f} % of output throughput")
    print(f"the engine worker spent {100 * statistics.median(shares):.2f} % of the time publishing (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
