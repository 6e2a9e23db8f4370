"""asyncio helpers the services share.

`wait_set(event, timeout_s)` is the loop's "sleep until woken or until the interval passes". It is written
with `asyncio.timeout`, not `asyncio.wait_for`: on Python 3.11, `wait_for` returns normally when the task is
cancelled in the same loop iteration as the awaited event is set (CPython gh-86296, fixed in 3.12), so a
loop like `while True: wait_for(wake.wait(), t)` can lose the cancel its owner sends on shutdown and never
end, hanging whoever awaits it. `asyncio.timeout` turns only its own expiry into TimeoutError.

`cancel_and_wait(task)` stops a background task even where a cancel is lost deeper in it.
"""

from __future__ import annotations

import asyncio
import contextlib


async def wait_set(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until `event` is set (True) or `timeout_s` seconds pass (False); a cancellation always raises."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_and_wait(task: asyncio.Task[object], every_s: float = 1.0) -> None:
    """Cancel a service's background `task` and wait for it to end, cancelling again every `every_s` seconds:
    one cancel can be lost (a `wait_for` deep in the task swallows it when its inner call completes in the
    same iteration, Python 3.11), and a stop that awaited a task still running would never return. Its
    CancelledError is absorbed; any other exception it ended with is raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every_s)
    with contextlib.suppress(asyncio.CancelledError):
        await task
