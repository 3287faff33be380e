"""The line protocol between the throughput driver and a rival worker. Standard library only.

The driver writes one JSON command per line on the worker's stdin and reads one JSON reply per
line on the worker's stdout:

- ``{"cmd": "load", "model": DIR, "dtype": "float32", "threads": 2, "max_requests": N,
  "max_tokens_in_flight": T, ...}`` -> ``{"ok": true, "info": {"engine": ..., "version": ...}}``
  (loads the model and warms it up);
- ``{"cmd": "run", "workload": {"name", "prompts", "max_tokens"}}`` -> ``{"ok": true,
  "elapsed_s": S, "token_ids": [[...], ...]}``: every prompt generated greedily to its own
  ``max_tokens`` with EOS ignored, timed from submission to the last token;
- end of stdin: the worker exits.

Any failure is ``{"ok": false, "error": MESSAGE}``. Engines print logs to stdout, so the worker
keeps the real stdout for replies and points file descriptor 1 at stderr before loading anything.
The worker stays up between commands, so the driver can interleave engines run by run and a
burst of background load on a shared machine hits each of them alike.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

#: A worker whose engine's packages do not import exits with this status after its reply.
EXIT_NOT_IMPORTABLE = 3


class WorkerEngine(Protocol):
    info: dict[str, Any]

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]: ...


_REPLIES: list = []  # the one reply stream, made on first use


def _reply_stream():
    """A private copy of the original stdout for replies, made once; fd 1 then goes to stderr,
    where engine logs belong."""
    if not _REPLIES:
        sys.stdout.flush()
        _REPLIES.append(os.fdopen(os.dup(1), "w", encoding="utf-8"))
        os.dup2(2, 1)
    return _REPLIES[0]


def _send(stream, reply: dict[str, Any]) -> None:
    stream.write(json.dumps(reply) + "\n")
    stream.flush()


def not_importable(package: str, err: BaseException) -> int:
    """Tell the driver that this Python cannot import the engine, and how to fix it."""
    _send(
        _reply_stream(),
        {
            "ok": False,
            "error": f"{package} is not importable by {sys.executable} "
            f"({type(err).__name__}: {err}); pass the python of the venv it is installed in",
        },
    )
    return EXIT_NOT_IMPORTABLE


def timed_run(engine: WorkerEngine, workload: dict[str, Any]) -> dict[str, Any]:
    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    start = time.perf_counter()
    token_ids = engine.generate(prompts, max_tokens)
    elapsed = time.perf_counter() - start
    short = [i for i, (t, m) in enumerate(zip(token_ids, max_tokens, strict=True)) if len(t) != m]
    if short:
        raise RuntimeError(f"requests {short[:5]} did not generate exactly max_tokens tokens")
    reply = {"ok": True, "elapsed_s": elapsed, "token_ids": token_ids}
    if getattr(engine, "run_stats", None):  # what an engine counts of its own run (e.g. drafts)
        reply["stats"] = dict(engine.run_stats)
    return reply


def serve(load: Callable[[dict[str, Any]], WorkerEngine]) -> int:
    """Answer commands until stdin closes. A failed load ends the worker with status 1."""
    replies = _reply_stream()
    engine: WorkerEngine | None = None
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["cmd"] == "load":
                engine = load(command)
                reply = {"ok": True, "info": engine.info}
            elif command["cmd"] == "run" and engine is not None:
                reply = timed_run(engine, command["workload"])
            else:
                reply = {
                    "ok": False,
                    "error": f"unexpected command {command['cmd']!r} (loaded: {bool(engine)})",
                }
        except Exception as err:  # reported to the driver, which shows it as the engine's reason
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        _send(replies, reply)
        if command["cmd"] == "load" and not reply["ok"]:
            return 1
    return 0
