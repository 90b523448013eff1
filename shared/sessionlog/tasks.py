"""Stopping background tasks so that a stop always ends.

One `task.cancel()` is not always enough. On Python 3.11, `asyncio.wait_for` (which nats-py's `request` uses)
returns the result and swallows the cancellation when the reply and the cancel arrive in the same loop turn
(CPython gh-86296, fixed in 3.12); the task then runs on, and `await task` after a single cancel can wait forever.
`cancel_and_wait` cancels again until the task has finished; the loops it stops also check a stop flag, so a
swallowed cancel costs at most one more iteration.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

log = logging.getLogger("sessionlog.tasks")

# How long one cancel is given before the next: long enough for a task's own cleanup (a checkpoint write) to finish
# without being interrupted, short enough that a swallowed cancel is not noticed.
RECANCEL_S: Final = 0.25


async def cancel_and_wait(task: asyncio.Task[Any] | None, *, recancel_s: float = RECANCEL_S) -> None:
    """Cancel `task` and return once it has finished, whatever it raised (a failure is logged, not raised).

    If the caller itself is cancelled while waiting, that cancellation propagates as usual."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("task %s ended with %s: %s", task.get_name(), type(error).__name__, error)


def detach(coroutine: Any, name: str | None = None) -> asyncio.Task[Any]:
    """Run `coroutine` in a task of its own (the caller may be a task being cancelled); a failure is logged, never
    left unretrieved."""
    task = asyncio.get_running_loop().create_task(coroutine, name=name)

    def done(finished: asyncio.Task[Any]) -> None:
        if not finished.cancelled() and (error := finished.exception()) is not None:
            log.warning("task %s ended with %s: %s", finished.get_name(), type(error).__name__, error)

    task.add_done_callback(done)
    return task


class BackgroundWrites:
    """Writes that run in the background, each in a task of its own (the caller goes on), and that a stop settles
    within a bound: whatever is still being sent again then (the log not answering) is cancelled, not waited out."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coroutine: Any, name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settle(self, timeout_s: float | None) -> int:
        """Wait for the writes in flight, at most `timeout_s`; cancel the ones still running and return how many
        were given up."""
        tasks = list(self._tasks)
        if not tasks:
            return 0
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            await cancel_and_wait(task)
        return len(pending)
