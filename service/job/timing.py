"""A job's latency measurements of its pruned graphs against the dense one, timed again in a slow spell of the host.

Pairing the dense and the pruned samples cancels a host that is uniformly slower, not one that is busy: on the
2-core VM the same ResNet-56 pair (2.1x) measured 1.91-2.17x over 24 measurements (sigma of the log 3.3 %), the low
readings with the dense graph at 78-82 ms against its usual 74-75 ms and the pruned one 17-19 % slower where the
dense one was 8 % (bench/RESULTS.md, session 40): a busy host slows the smaller graph more in proportion. The dense
graph is timed in every measurement, so its median against its quietest one in the job says when the host is
busy: then the pair is timed again (at most len(SLOW_WAITS) times, each after a pause that lets a short spell pass)
and the quietest measurement is kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from exporters.runtime import Latency, measure_latency

from .kinds import Say

SLOW_HOST = 1.04  # the dense graph's median this much above its quietest in the job: a busy host
# the pause before each measurement more while the host is busy, in multiples of the time the measurement took (at
# most this many more): all-MiniLM-L6-v2 at 2x, 2026-12-05, had its dense graph 12-15 % slower for seven measurements
# in a row, about a minute, taken back to back, and ran a round more (~300 s); a pause of a measurement or a few lets
# such a spell pass at a measurement's scale of cost (a toy model's second, a 120 ms encoder pair's ~8 s)
SLOW_WAITS = (1.0, 3.0)


@dataclass
class QuietTimer:
    """Times pruned graphs against the job's dense export (`measure_latency`), each measured again (after pauses
    of SLOW_WAITS times the measurement's own duration) while the dense graph runs more than SLOW_HOST x its
    quietest median so far; the measurement with the quietest dense median is kept. A pair timed in turn (too
    large to hold both sessions, minutes a measurement) is timed once and is no reference for the paired ones (its
    dense session runs alone in its process); a pair timed in pieces is judged against the pairs timed in as many
    pieces (`reference`)."""

    dense: Path
    feed: dict[str, np.ndarray]
    provider: str
    threads: int | None
    repeats: int
    say: Say
    quietest_ms: float = math.inf  # the dense graph's quietest median in this job's paired timings
    retimed: int = 0  # measurements taken again for a busy host
    # the dense graph's medians by how it was timed (0: whole; n: in n pieces, each a session of its own, which
    # times another program): a reference is one of the same setup
    dense_ms: dict[int, list[float]] = field(default_factory=dict)

    def reference(self, pieces: int, now: float) -> float:
        """The dense median a measurement (`now`) is judged against: the quietest before it of its setup, or from
        three on the second quietest (one reading far below the rest, 2.0 ms where the dense graph ran 4.5 ms in
        every other, had every later measurement taken three times for a busy host); `now` itself when lower."""
        before = sorted(self.dense_ms.get(pieces, ()))
        return min(now, before[1] if len(before) >= 3 else before[0] if before else now)

    def __call__(self, compressed: Path) -> Latency:
        best: Latency | None = None
        for attempt in range(1 + len(SLOW_WAITS)):
            start = time.perf_counter()
            latency = measure_latency(self.dense, compressed, self.feed, provider=self.provider, threads=self.threads,
                                      repeats=self.repeats)
            # its own duration: not the wait for the machine's latency lock while another job timed (minutes)
            took = latency.seconds if latency.seconds is not None else time.perf_counter() - start
            if best is None or latency.baseline_ms < best.baseline_ms:
                best = latency
            if latency.in_turn:  # the dense session alone in its process: not a reference for a paired timing
                break
            self.quietest_ms = min(self.quietest_ms, latency.baseline_ms)
            reference = self.reference(latency.pieces, latency.baseline_ms)
            self.dense_ms.setdefault(latency.pieces, []).append(latency.baseline_ms)
            slower = latency.baseline_ms / reference
            if slower <= SLOW_HOST or attempt == len(SLOW_WAITS):
                break
            self.retimed += 1
            wait = SLOW_WAITS[attempt] * took
            self.say(f"the dense model ran {slower - 1:.0%} slower than its quietest timing in this job "
                     f"({latency.baseline_ms:.1f} against {reference:.1f} ms): a busy host; timing again in "
                     f"{wait:.1f} s")
            time.sleep(wait)
        assert best is not None
        return best
