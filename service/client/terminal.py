"""What the command line shows on a terminal: transient progress lines, the watch stream's bar, a
remote job's report, and Ctrl-C handling around clean-ups."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from compressor.progress import Progress

from ..api import compression_pb2 as pb


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


class ProgressBar:
    """Watch events as stage lines, per-layer events as a bar (redrawn in place on a terminal)."""

    def __init__(self, stream: TextIO) -> None:
        self.lines = ProgressLines(stream)
        self.last = ""

    def __call__(self, event: pb.CompressionEvent) -> None:
        if event.layers:
            done = int(24 * event.layer / event.layers)
            line = (f"{event.stage:<9} [{'#' * done}{'.' * (24 - done)}] {event.layer}/{event.layers} "
                    f"{event.message.split('] ', 1)[-1]}")
        else:
            line = f"{event.stage:<9} {event.message}" if event.message else f"{event.stage}"
        if line != self.last:
            self.last = line
            self.lines(line, transient=bool(event.layers))


def format_report(report: pb.CompressReport, out: Path) -> str:
    m = report.metric
    target = f"{report.target_speedup:g}x" if report.HasField("target_speedup") else \
        f"uniform ratio {report.uniform_ratio:g}" if report.HasField("uniform_ratio") else "widths from a report"
    rows = [("status", report.status), ("target", target),
            ("measured speedup", f"{report.measured_speedup:.3f}x ({report.execution_provider}, {report.device})"),
            ("latency", f"{report.baseline_latency_ms:.2f} -> {report.compressed_latency_ms:.2f} ms"),
            (f"metric ({m.name})", f"{m.baseline:.4f} -> {m.compressed:.4f} (relative drop {m.relative_drop:.2%})"),
            ("parameters", f"{report.params_before:,} -> {report.params_after:,}"),
            ("method", report.method), ("layers", ", ".join(f"{layer.width_after}/{layer.width_before}"
                                                            for layer in report.layers)),
            ("elapsed", f"{report.elapsed_s:.1f}s"), ("artifacts", str(out))]
    return "\n".join(f"{k:<18} {v}" for k, v in rows)


class JobProgress:
    """Stage lines as they come; per-layer lines are transient (redrawn in place on a terminal)."""

    def __init__(self, stream) -> None:
        self.lines = ProgressLines(stream)

    def __call__(self, record: Progress) -> None:
        # here, not at the top: importing service.job loads the job (torch), which the CLI's light commands skip
        from ..job.progress import TRANSIENT, render

        self.lines(render(record), transient=record.stage in TRANSIENT)


