"""Where torch's CPU work runs: the engine thread, and fresh threads for one-off work.

torch's CPU kernels parallelize through libgomp (OpenMP). Every thread that ever runs a
parallel region keeps its own pool of OpenMP workers until the thread exits, and while the
process holds more OpenMP threads than CPUs, libgomp cuts its workers' spin-wait to almost
nothing, so each of the ~600 small parallel ops of a decode step pays a futex wake-up.
NOTE: measured on 2 cores: a B=1 decode forward took 17-19 ms on the thread that had loaded
the model and 45-58 ms on the engine thread (int4 GEMV 3x, bmm 9x, softmax 10x slower);
after the loading thread exited, 21 ms. So the engine thread is meant to be the process's
only long-lived thread that runs parallel torch work: model loading and pool allocation run
on a fresh thread that exits when done (:func:`on_fresh_thread`), and the warm-up runs on the
engine thread itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def on_fresh_thread(fn: Callable[[], T], name: str = "kvfence-load") -> T:
    """``fn()`` on a new thread that exits afterwards, taking its OpenMP pool with it; its
    result or exception comes back to the caller. The thread uses the caller's torch thread
    count (OpenMP's is per thread). It is a daemon, so an interrupted caller does not keep the
    process waiting for it."""
    result: list[T] = []
    error: list[BaseException] = []
    threads = torch.get_num_threads()

    def run() -> None:
        try:
            torch.set_num_threads(threads)
            result.append(fn())
        except BaseException as err:  # re-raised on the caller's thread
            error.append(err)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
