"""Waiting for work on another thread without letting a cancelled caller leave early.

A request that started tokenizer or grammar work holds a stream slot. If a cancel freed the
slot while the thread ran on, a tenant capped at 4 streams could keep any number of threads
busy by cancelling (200 cancelled calls kept both cores busy for 4.5 s). ``outlive_cancel``
is how callers wait instead: the slot stays taken until the thread is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TypeVar

T = TypeVar("T")


async def outlive_cancel(work: concurrent.futures.Future[T]) -> T:
    """``work``'s result. A cancelled caller cancels work that has not started; work that
    has started is waited for before the cancellation goes on, so whatever the caller holds
    (its stream slot) stays taken while the thread still burns a core for it."""
    waiting = asyncio.wrap_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(waiting)
            break
        except asyncio.CancelledError:
            if work.cancel() or waiting.done():  # never started, or over
                raise
            cancelled = True
        except BaseException:
            if cancelled:
                raise asyncio.CancelledError() from None
            raise
    if cancelled:
        raise asyncio.CancelledError()
    return result
