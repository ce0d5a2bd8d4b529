"""The in-memory event feeds behind WatchCompression and WaitOperation.

Each unfinished operation has a feed: its recent events (a bounded deque: a slow watcher skips to the
latest) and a way to wait for the next one or for the end. Feeds are a fan-out of what the store already
holds (the store is the source of truth): after a restart, watchers start again from the stored state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator


class Feed:
    """Recent events of one operation and a way to wait for the next."""

    def __init__(self) -> None:
        self.events: deque[tuple[int, dict]] = deque(maxlen=512)
        self.seq = 0
        self.changed = asyncio.Event()
        self.done = asyncio.Event()  # no more events come: the operation ended, or the server is stopping

    def publish(self, event: dict, done: bool = False) -> None:
        self.seq += 1
        self.events.append((self.seq, event))
        if done:
            self.done.set()
        self.changed.set()
        self.changed = asyncio.Event()

    def end(self) -> None:
        """No more events through this feed (the server stops): its followers and waiters return."""
        self.done.set()
        self.changed.set()

    async def follow(self, after: int) -> AsyncIterator[dict]:
        """The events after sequence number `after` as they come, until the operation is done."""
        cursor = after
        while True:
            changed = self.changed
            fresh = [(seq, event) for seq, event in self.events if seq > cursor]
            if not fresh:
                if self.done.is_set():
                    return
                await changed.wait()
                continue
            for seq, event in fresh:
                cursor = seq
                yield event


class Feeds:
    """The feeds of the operations that have not ended, by name."""

    def __init__(self) -> None:
        self._feeds: dict[str, Feed] = {}
        self.ended = False

    def of(self, name: str) -> Feed:
        """The operation's feed (opened on first use: call it only for an operation that has not ended, and
        with no await between reading that and this call); once the server stops, an ended one."""
        feed = self._feeds.setdefault(name, Feed())
        if self.ended:
            feed.end()
        return feed

    def end_all(self) -> None:
        """The server stops: every watch stream and wait ends now with the stored state (a client resumes it
        after the restart), rather than being cut by the transport's grace period as an error."""
        self.ended = True
        for feed in self._feeds.values():
            feed.end()

    def publish(self, name: str, state: str, progress: dict, done: bool = False) -> None:
        self.of(name).publish({"state": state, "time": time.time(), **progress}, done=done)
        if done:
            self.close(name)

    def close(self, name: str) -> None:
        self._feeds.pop(name, None)

    async def wait_done(self, name: str, timeout_s: float) -> None:
        """Until the operation ends or `timeout_s` passes."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.of(name).done.wait(), timeout_s)
