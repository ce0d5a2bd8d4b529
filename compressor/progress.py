"""A pipeline's progress as data.

The pipelines say what they did as `Progress` records through the `progress` callback they take; the
service renders the text (`service.job.progress`) and reads a record's position for the API's `layer` /
`layers`, so rewording a line changes no caller. Without a callback, warnings go to the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# what a record says happened
SOLVE = "solve"  # a layer's groups were chosen and its weight refit (numbers: width_before, width_after,
#                  relative_error, seconds; consumers when a coupled group has several)
STATISTICS = "statistics"  # a layer's statistics were taken and nothing pruned (the dense curves' pass)
REMOVED = "removed"  # a block was removed whole
RECONSTRUCTION = "reconstruction"  # a block's (or a graph's) fit (numbers: before, after, kept, steps, seconds)
DEPTH = "depth"  # one block chosen for removal (numbers: step, steps, error)
WARNING = "warning"  # something the user should know (`message`); a job lists its warnings in the report
NOTE = "note"  # free text (`message`) from the job around the pipelines
STAGES = (SOLVE, STATISTICS, REMOVED, RECONSTRUCTION, DEPTH, WARNING, NOTE)


@dataclass(frozen=True)
class Progress:
    stage: str  # one of STAGES
    unit: str = ""  # the layer or block it is about ("" for a whole graph's or the job's)
    index: int = 0  # the pipeline's layer (block) position, from 1, among `total`; 0: not a per-layer step
    total: int = 0
    kind: str = ""  # the layer's kind for SOLVE / STATISTICS: conv_channels | attention_heads | ffn_neurons
    numbers: Mapping[str, float] = field(default_factory=dict)
    message: str = ""  # WARNING and NOTE: the text

    def __post_init__(self) -> None:
        assert self.stage in STAGES, f"unknown progress stage {self.stage!r}"
        assert 0 <= self.index <= self.total, f"position {self.index} of {self.total}"


ProgressFn = Callable[[Progress], None]


def warning(message: str) -> Progress:
    return Progress(WARNING, message=message)


def note(message: str) -> Progress:
    return Progress(NOTE, message=message)


def emit(progress: ProgressFn | None, record: Progress, logger: logging.Logger) -> None:
    """`record` to the callback; without one a warning goes to `logger` (the rest is the caller's to ask for)."""
    if progress is not None:
        progress(record)
    elif record.stage == WARNING:
        logger.warning("%s", record.message)
    else:
        logger.debug("%s", record)
