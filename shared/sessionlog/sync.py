"""The writer for agents that are not async: `SyncSessionLog` and `SyncSessionWriter`.

The async client runs on an event loop of its own in a background thread; every call of the facade is one
coroutine submitted to that loop, and the caller waits for its result. The lease keepers run on that loop too,
so a caller that blocks its own thread (a synchronous model call, a long tool) keeps its lease: nothing it does
can stop the refreshes. What the async writer promises holds unchanged (the same objects do the work), and a
refusal arrives in the caller's thread as the same typed `SessionLogError`.

A caller interrupted while it waits (KeyboardInterrupt) cancels the call on the loop: a flush cancelled in flight
is in doubt and is settled by the next publish, as in the async writer.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

from .errors import SessionLogError
from .log import SessionLog, SessionWriter
from .record import Record
from .session import Session
from .settings import Settings

T = TypeVar("T")
P = ParamSpec("P")


class _LoopThread:
    """An event loop running forever in a daemon thread, until `stop()`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result in the calling thread."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sessionlog sync call was made from its own loop thread; use the async API there")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                future.cancel()  # an interrupt in the caller's thread cancels the call on the loop
            raise

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class SyncSessionLog:
    """A connection to the log for synchronous code: create, open and resume return `SyncSessionWriter`s."""

    def __init__(self, settings: Settings | None = None, *, provision_stores: bool = True) -> None:
        self._thread = _LoopThread("sessionlog-sync")
        try:
            self.log: SessionLog = self._thread.run(SessionLog.connect(settings, provision_stores=provision_stores))
        except BaseException:
            self._thread.stop()
            raise
        self._writers: list[SyncSessionWriter] = []

    @property
    def settings(self) -> Settings:
        return self.log.settings

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run any coroutine of the async API (`self.log`, a writer's) on the facade's loop and wait for it."""
        return self._thread.run(coro)

    def _writer(self, writer: SessionWriter) -> SyncSessionWriter:
        out = SyncSessionWriter(writer, self._thread)
        self._writers.append(out)
        return out

    def create(self, session_id: str, **options: Any) -> SyncSessionWriter:
        """A new, empty session held by the returned writer (options as `SessionLog.create`)."""
        return self._writer(self.run(self.log.create(session_id, **options)))

    def open(self, session_id: str) -> SyncSessionWriter:
        """Continue a session whose last turn is closed."""
        return self._writer(self.run(self.log.open(session_id)))

    def resume(self, session_id: str) -> SyncSessionWriter:
        """Close a turn a crash left open, mark the seed end, and continue."""
        return self._writer(self.run(self.log.resume(session_id)))

    def load(self, session_id: str, *, up_to_seq: int | None = None) -> tuple[bytes, Session, Record | None]:
        """The session header, the validated log and its last record (see `SessionLog.load`)."""
        return self.run(self.log.load(session_id, up_to_seq=up_to_seq))

    def close(self) -> None:
        """Close every writer still open (flushing it), then the connection, then the loop; raises the first
        writer's refusal, if any, once everything is closed."""
        refused: list[SessionLogError] = []
        try:
            for writer in self._writers:
                try:
                    writer.close()
                except SessionLogError as err:  # the others are still closed, and their leases released
                    refused.append(err)
        finally:
            try:
                self.run(self.log.close())
            finally:
                self._thread.stop()
        if refused:
            raise refused[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_loop(
    method: Callable[Concatenate[SessionWriter, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[SyncSessionWriter, P], T]:
    """A `SessionWriter` coroutine method as a method of the sync writer that runs it on the loop and waits."""

    @functools.wraps(method)
    def call(self: SyncSessionWriter, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._thread.run(method(self.writer, *args, **kwargs))

    return call


class SyncSessionWriter:
    """One session's writer for synchronous code; its lease is refreshed on the background loop."""

    def __init__(self, writer: SessionWriter, thread: _LoopThread) -> None:
        self.writer = writer
        self._thread = thread
        self._done = False

    @property
    def session_id(self) -> str:
        return self.writer.session_id

    @property
    def session(self) -> Session:
        """The writer's validated view (durable and queued events); read it between calls, not during one."""
        return self.writer.session

    @property
    def durable_seq(self) -> int:
        return self.writer.durable_seq

    @property
    def next_seq(self) -> int:
        return self.writer.next_seq

    @property
    def epoch(self) -> int:
        return self.writer.epoch

    # The writer's own methods, each run on the loop: one signature and one docstring, the async writer's.
    append = _on_loop(SessionWriter.append)
    emit = _on_loop(SessionWriter.emit)
    compact = _on_loop(SessionWriter.compact)
    flush = _on_loop(SessionWriter.flush)

    def close(self) -> None:
        """Flush, stop and release the lease."""
        if not self._done:
            self._done = True
            self._thread.run(self.writer.close())

    def abandon(self) -> None:
        """Stop without flushing or releasing the lease (a crash, as far as the log can tell)."""
        if not self._done:
            self._done = True
            self._thread.run(self.writer.abandon())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["SyncSessionLog", "SyncSessionWriter"]
