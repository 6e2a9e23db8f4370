"""mesh.aio.wait_set: woken, timed out, and never losing a cancel that arrives as it is woken."""

from __future__ import annotations

import asyncio

import pytest

from mesh.aio import cancel_and_wait, wait_set


async def test_set_and_timed_out() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    event.set()
    assert await wait_set(event, 10.0) is True


async def test_a_cancel_in_the_iteration_that_sets_the_event_still_cancels() -> None:
    event = asyncio.Event()
    ended = asyncio.Event()

    async def loop() -> None:  # the services' "sleep until woken" loop
        try:
            while True:
                await wait_set(event, 10.0)
                event.clear()
        finally:
            ended.set()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # the loop now waits on the event
    event.set()  # wakes it ...
    task.cancel()  # ... and the owner stops it before it runs again
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5.0)
    assert ended.is_set()


async def test_cancel_and_wait_ends_a_task_that_lost_a_cancel() -> None:
    lost = 0

    async def stubborn() -> None:  # as a task whose inner wait_for swallowed the first cancel
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(10.0)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost += 1

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, every_s=0.01), 5.0)
    assert task.cancelled() and lost == 1


async def test_cancel_and_wait_raises_what_the_task_failed_with() -> None:
    async def broken() -> None:
        try:
            await asyncio.sleep(10.0)
        finally:
            raise RuntimeError("while stopping")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="while stopping"):
        await cancel_and_wait(task)
