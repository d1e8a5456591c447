"""The slow start of ``kvfence serve`` (model load, engine warm-up) on a thread a signal can leave.

Loading and warming up take seconds to minutes and run in native code that cannot be
interrupted. ``until_stopped`` runs that work on a daemon thread and returns as soon as either
the work finishes or ``stop`` is set, so Ctrl-C or SIGTERM during start-up ends the process at
once: nothing is serving yet, and the abandoned thread dies with the process.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StartupInterrupted(Exception):
    """A signal arrived before the server was serving; ``exit_code`` is what to exit with."""

    def __init__(self, exit_code: int) -> None:
        super().__init__("interrupted during start-up")
        self.exit_code = exit_code


async def until_stopped(work: Callable[[], T], stop: asyncio.Event) -> T | None:
    """``work()``'s result, or None if ``stop`` was set first (the work is then abandoned)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = work()
        except BaseException as error:  # re-raised in the awaiting task
            loop.call_soon_threadsafe(settle, None, error)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="kvfence-startup", daemon=True).start()
    stopped: asyncio.Future[object] = asyncio.ensure_future(stop.wait())
    waiting: set[asyncio.Future[object]] = {done, stopped}  # type: ignore[arg-type]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if done.done():
        stopped.cancel()
        return done.result()
    return None
