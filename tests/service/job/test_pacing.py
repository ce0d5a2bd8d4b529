import pytest

from service.job import pacing
from service.job.pacing import FIT_SHARE, USABLE, Pace


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
