"""Progress lines on a stream: on a terminal, transient lines (per-layer progress) redraw in place; in
logs every line is kept."""

from __future__ import annotations

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
