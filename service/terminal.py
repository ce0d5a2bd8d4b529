"""Progress lines on a stream: on a terminal, transient lines (per-layer progress) redraw in place; in
logs every line is kept."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import TextIO


class ProgressLines:
    def __init__(self, stream: TextIO) -> None:
        self.stream, self.tty, self.open = stream, stream.isatty(), False

    def __call__(self, line: str, transient: bool = False) -> None:
        if self.tty and transient:
            self.stream.write("\r\033[K" + line[:150])
            self.open = True
        else:
            if self.open:
                self.stream.write("\n")
                self.open = False
            self.stream.write(line + "\n")
        self.stream.flush()

    def end(self) -> None:
        """Close a transient line still open (before a message that must start on its own line)."""
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False


@contextlib.contextmanager
def ignoring_interrupts() -> Iterator[None]:
    """SIGINT ignored inside (a second Ctrl-C must not cut a clean-up or a cancel short); in a thread
    other than the main one, where signals cannot be set, a no-op."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
