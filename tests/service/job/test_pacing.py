import pytest

from service.job import pacing
from service.job.pacing import FIT_SHARE, USABLE, Pace, StageClock
from service.job.report import StageTime


def test_without_a_budget_nothing_is_paced():
    pace = Pace(None)
    assert pace.left() is None and pace.fit_seconds(0) is None and pace.to_dict({}) is None


def test_each_round_may_fit_for_a_share_of_the_time_left(monkeypatch):
    clock = iter([110.0, 150.0, 500.0])  # each round's question, the job having started at 100
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: next(clock))
    pace = Pace(200.0, start=100.0)
    assert pace.fit_seconds(0) == pytest.approx(FIT_SHARE * (USABLE * 200 - 10))
    assert pace.fit_seconds(1) == pytest.approx(FIT_SHARE * (USABLE * 200 - 50))
    assert pace.fit_seconds(2) == 0.0  # past the budget: no fit at all
    report = pace.to_dict({0: {"fit_steps": 100, "fit_s": 40.0}})
    assert report["time_budget_s"] == 200.0 and "25%" in report["rule"]
    assert [r["round"] for r in report["rounds"]] == [0, 1, 2]
    assert report["rounds"][0]["fit_steps"] == 100 and report["rounds"][0]["left_s"] == 170.0
    assert report["rounds"][2]["fit_allowance_s"] == 0.0 and report["rounds"][2]["left_s"] < 0


def test_each_stage_lasts_until_the_next_begins_and_is_forwarded(monkeypatch):
    clock = iter([0.0, 2.0, 12.0, 40.0, 41.5, 50.0, 53.0])
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: next(clock))
    entered = []
    stages = StageClock(lambda name, index: entered.append((name, index)))
    assert stages.times() == []  # nothing entered yet: no clock read
    for name, index in [("loading", 0), ("baseline", 0), ("prune", 0), ("measure", 0)]:
        stages(name, index)
    assert entered == [("loading", 0), ("baseline", 0), ("prune", 0), ("measure", 0)]
    # the running stage counts up to the question, and keeps running after it
    assert stages.times() == [StageTime("loading", 0, 2.0), StageTime("baseline", 0, 10.0),
                              StageTime("prune", 0, 28.0), StageTime("measure", 0, 1.5)]
    stages("prune", 1)
    assert stages.times()[-2:] == [StageTime("measure", 0, 10.0), StageTime("prune", 1, 3.0)]
    assert StageClock().times() == []  # without a hook to forward to, it only times


def test_a_stage_entered_again_runs_on_as_one(monkeypatch):
    clock = iter([0.0, 5.0, 9.0, 20.0, 26.0])  # each probe re-enters `allocate`; the clock is read on a change only
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: next(clock))
    entered = []
    stages = StageClock(lambda name, index: entered.append((name, index)))
    for name, index in [("statistics", 0), ("allocate", 0), ("allocate", 0), ("allocate", 0), ("prune", 0),
                        ("allocate", 1)]:
        stages(name, index)
    assert entered[1:4] == [("allocate", 0)] * 3  # every entry still reaches the hook
    assert stages.times() == [StageTime("statistics", 0, 5.0), StageTime("allocate", 0, 4.0),
                              StageTime("prune", 0, 11.0), StageTime("allocate", 1, 6.0)]
