"""Starting a machine's worker ranks and watching them start: fork where it is safe, else spawn.

``fork`` copies this process: a rank starts in a moment and a script without an
``if __name__ == "__main__":`` guard just works. ``spawn`` starts a fresh interpreter, which
imports the main module again: the only safe choice once CUDA is initialised (or on a CUDA
engine, or off Linux), and the one that needs the guard. As vLLM does
(``VLLM_WORKER_MULTIPROC_METHOD``), :data:`START_METHOD_ENV` picks one by hand; unset or
``auto``, fork is used where :func:`fork_is_safe` says so.

What a fork copies is made safe in the child (:func:`run_forked_rank`): the rank runs on a
fresh thread, because GNU OpenMP (torch's, and the C kernels') keeps a worker pool per thread
and the forked copy of a thread that already ran a parallel region owns a pool whose threads
did not survive the fork (its next parallel region would wait for them forever); and the
sockets this process had open (a server's listening socket, its clients' connections) are
let go, so they close when this process closes them, not when the rank exits.

A spawned rank that finds itself re-running a script's top-level engine (the missing guard)
exits at once with :data:`NO_MAIN_GUARD_EXIT`, and :func:`exit_cause` turns that status into
the sentence the user needs.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch

from pagedkv.engine.worker.executor.rank import RankSpec, ignore_ctrl_c, run_rank, serve_rank

#: "fork", "spawn" or "auto" (the default): how worker ranks start.
START_METHOD_ENV = "PAGEDKV_WORKER_MULTIPROC_METHOD"
#: The exit status of a spawned rank that was about to start another engine while its
#: interpreter imported the main module (a script without a main guard).
NO_MAIN_GUARD_EXIT = 78
#: How often the start-up watch asks whether the ranks are there while none exits.
POLL_SECONDS = 0.05

T = TypeVar("T")


def fork_is_safe(device: str) -> bool:
    """Linux (a fork on macOS may crash in system libraries), a CPU engine, and CUDA not
    initialised in this process (a forked copy of a CUDA context cannot be used)."""
    return sys.platform == "linux" and not device.startswith("cuda") and not torch.cuda.is_initialized()


def start_method(device: str) -> str:
    """The start method of this machine's ranks: :data:`START_METHOD_ENV`, else fork where
    :func:`fork_is_safe`, else spawn."""
    asked = os.environ.get(START_METHOD_ENV, "").strip().lower() or "auto"
    if asked not in ("auto", "fork", "spawn"):
        raise ValueError(f"{START_METHOD_ENV} must be fork, spawn or auto, got {asked!r}")
    if asked == "fork" and "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError(f"{START_METHOD_ENV}=fork: this platform cannot fork")
    if asked != "auto":
        return asked
    return "fork" if fork_is_safe(device) else "spawn"


def refuse_to_start_while_bootstrapping() -> None:
    """In a spawned rank that is importing the main module, a script that builds a
    tensor-parallel engine at its top level would start ranks of its own: exit at once with
    :data:`NO_MAIN_GUARD_EXIT` instead (the rank's parent reports it). ``_inheriting`` is what
    multiprocessing itself checks before it raises its generic bootstrapping error."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(NO_MAIN_GUARD_EXIT)


def start_ranks(spec: RankSpec, method: str) -> dict[int, BaseProcess]:
    """Start this machine's worker ranks as daemon processes, by ``method`` (fork or spawn)."""
    context = multiprocessing.get_context(method)
    target = run_forked_rank if method == "fork" else run_rank
    workers = {}
    for rank in spec.rendezvous.spawn_ranks:
        process = context.Process(
            target=target, args=(spec, rank, os.getpid()), name=f"pagedkv-tp-rank{rank}", daemon=True
        )
        process.start()
        workers[rank] = process
    return workers


def first_exit(
    workers: dict[int, BaseProcess], done: Callable[[], bool], timeout: float | None
) -> int | None:
    """Watch ``workers`` until ``done()``: the rank of the first one that exits before, else
    None. TimeoutError after ``timeout`` seconds (None: no limit)."""
    by_sentinel = {process.sentinel: rank for rank, process in workers.items()}
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done():
        exited = multiprocessing.connection.wait(list(by_sentinel), POLL_SECONDS)
        if exited:
            rank = by_sentinel[exited[0]]
            workers[rank].join()
            return rank
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the tensor-parallel ranks did not all start within {timeout:.0f} s")
    return None


def in_background(call: Callable[[], T]) -> Future[T]:
    """Run ``call`` on a daemon thread (a join that waits for a rank that died is left to fail
    on its own, after the store's timeout, without keeping the process from exiting)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as err:
            future.set_exception(err)

    threading.Thread(target=run, name="pagedkv-tp-join", daemon=True).start()
    return future


def stop(workers: dict[int, BaseProcess], grace: float) -> None:
    """Wait ``grace`` seconds for the workers to exit, then kill them."""
    for process in workers.values():
        process.join(grace)
    for process in workers.values():
        if process.is_alive():
            process.kill()  # SIGKILL: also ends a stopped (SIGSTOP) process
            process.join(5)


def exit_cause(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == NO_MAIN_GUARD_EXIT:
        return (
            f"exited with code {code} before it started: it was spawned, its new interpreter "
            "imported the main script, and the script started another engine. Put the script's "
            'code under `if __name__ == "__main__":` (or start the ranks with '
            f"{START_METHOD_ENV}=fork where fork is safe)"
        )
    return f"exited with code {code}"


# -- in a forked rank ----------------------------------------------------------------------------
def run_forked_rank(spec: RankSpec, rank: int, parent_pid: int) -> None:
    """The target of a forked rank: let go of what the fork copied, then run the rank on a new
    thread (see the module's docstring); exits with the rank's status."""
    _release_sockets()
    _restore_signals()
    finished = threading.Event()

    def rank_thread() -> None:
        serve_rank(spec, rank, parent_pid)  # raises SystemExit(1) on failure: not finished
        finished.set()

    thread = threading.Thread(target=rank_thread, name=f"pagedkv-tp-rank{rank}")
    thread.start()
    thread.join()
    raise SystemExit(0 if finished.is_set() else 1)


def _restore_signals() -> None:
    """The parent's handlers (a server's SIGTERM, an event loop's wakeup fd) are not the rank's."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ignore_ctrl_c()


def _release_sockets() -> None:
    """Point every inherited socket's descriptor at /dev/null: the rank drops its share of the
    connection, and the descriptor number stays taken, so a copied socket object that is
    collected later closes /dev/null, never a socket the rank opened since."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc (fork forced off Linux): the sockets stay shared
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in names:
            fd = int(name)
            try:
                if fd != null and stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
            except OSError:  # the listing's own descriptor, already closed
                continue
    finally:
        os.close(null)
