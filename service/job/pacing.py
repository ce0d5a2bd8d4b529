"""A job's time budget (the request's `time_budget`: the server's, or the CLI's --time-budget): what each
round's reconstruction may spend of the time left.

The server kills a job past its budget and keeps nothing of it, so a job that knows its budget must pace
itself. Of the stages, the reconstruction is the one whose length is a choice (its steps: Adam steps per
block or for the whole graph); the statistics pass, the depth plan, the solves, the exports and the
evaluation take what they take. So each round's fit gets an allowance (`RefineConfig.seconds`), which it
stops at with the best weights seen, and report.json's `pacing` says what each round was allowed, what
it left, and the steps its fits ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .report import StageTime

# of the budget, what the job plans to use: saving the artifacts, report.html and the worker's start come after
USABLE = 0.9
# of the time left when a round starts, what its fit may spend: the round's solves, export, measurement and
# evaluation need about as much again, and a next round (the target missed, or a re-plan) half of what is left
# then; a round that spends half of the time left leaves the next one the same share
FIT_SHARE = 0.25


@dataclass
class Pace:
    """The clock of one job against its budget (None: no budget, nothing is paced)."""

    budget: float | None  # seconds
    start: float = field(default_factory=time.perf_counter)
    rounds: list[dict[str, Any]] = field(default_factory=list)  # what each round was allowed (report.json)

    def __post_init__(self) -> None:
        assert self.budget is None or self.budget > 0, self.budget

    def left(self) -> float | None:
        """Seconds of the usable budget left (negative once past it); None without a budget."""
        if self.budget is None:
            return None
        return USABLE * self.budget - (time.perf_counter() - self.start)

    def end(self) -> float | None:
        """When the usable budget ends (a `time.perf_counter()`): no fit runs past it (`RefineConfig.deadline`);
        None without a budget."""
        return None if self.budget is None else self.start + USABLE * self.budget

    def fit_seconds(self, index: int) -> float | None:
        """Round `index`'s reconstruction allowance (recorded for the report): FIT_SHARE of the time left, 0
        once none is; None without a budget."""
        left = self.left()
        if left is None:
            return None
        allowance = max(0.0, FIT_SHARE * left)
        self.rounds.append({"round": index, "left_s": round(left, 1), "fit_allowance_s": round(allowance, 1)})
        return allowance

    def to_dict(self, fits: dict[int, dict[str, float]]) -> dict[str, Any] | None:
        """report.json `pacing`: the budget, and per round its allowance and what its fits did (`fits`: round ->
        {"fit_steps": steps run in all, "fit_s": seconds the fits took}: `compress._fits`)."""
        if self.budget is None:
            return None
        rule = (f"each round's reconstruction may spend {FIT_SHARE:.0%} of the time left of {USABLE:.0%} of the "
                "budget when the round starts, shared among its blocks; it stops at the first step past that, "
                "keeping the best weights seen")
        return {"time_budget_s": self.budget, "rule": rule,
                "rounds": [{**r, **fits.get(r["round"], {})} for r in self.rounds]}


class StageClock:
    """Each stage's wall time, timed where the job announces it (`compress`'s `stage(name, round)` hook, which
    it forwards): a stage ends where the next begins, so the times add up to the job's up to the report.
    What a user asks of a slow job first is where its time went; report.json's `stages` says."""

    def __init__(self, forward: Callable[[str, int], None] | None = None) -> None:
        self._forward = forward
        self._done: list[StageTime] = []
        self._running: tuple[str, int, float] | None = None

    def __call__(self, stage: str, index: int) -> None:
        # a stage entered again (target mode enters `allocate` at each latency probe) runs on as one
        if self._running is None or self._running[:2] != (stage, index):
            now = time.perf_counter()
            if self._running is not None:
                name, at, since = self._running
                self._done.append(StageTime(name, at, now - since))
            self._running = (stage, index, now)
        if self._forward is not None:
            self._forward(stage, index)

    def times(self) -> list[StageTime]:
        """The stages so far, the running one up to now (it keeps running)."""
        if self._running is None:
            return list(self._done)
        name, at, since = self._running
        return [*self._done, StageTime(name, at, time.perf_counter() - since)]
