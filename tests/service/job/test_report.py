"""report.json's typed record: the JSON it writes (flat, optional fields left out), and reading it back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from service.job.report import SCHEMA_VERSION, KindFields, Report, RoundResult, StageTime

from .reports import measured, report


def test_a_report_writes_flat_json_and_reads_back_equal():
    original = report(kind=KindFields(widths={"model.layers.0.mlp.down_proj": 32}, removed_layers=["model.layers.3"],
                                      depth={"rule": "r", "options": []}),
                      stages=[StageTime("loading", 0, 0.5), StageTime("prune", 1, 20.0)])
    data = json.loads(json.dumps(original.to_json()))
    # the returned model's measurements and the kind's fields at the top level, as report.json always had them
    assert data["measured_speedup"] == 1.5 and data["params_after"] == 600
    assert data["removed_layers"] == ["model.layers.3"]
    assert data["accuracy_budget"]["bound"] == "cosine >= 0.9000" and data["layers"][1]["kept"] == list(range(32))
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["stages"][1] == {"stage": "prune", "round": 1, "seconds": 20.0}
    # optional fields that are None are left out; required ones that are None are written as null
    assert "parity" not in data and "onnx_output" not in data and "refine" not in data["layers"][0]
    assert data["uniform_ratio"] is None and data["eval"] is None
    assert Report.from_json(data) == original


def test_a_rounds_timings_are_written_only_when_it_was_timed_again():
    retimed = RoundResult(2.1, 2.06, 0.86, {}, [], timings=[2.1, 2.45, 2.08])
    original = report(rounds=[RoundResult(1.5, 1.45, 0.95, {}, []), retimed])
    data = json.loads(json.dumps(original.to_json()))
    assert "timings" not in data["rounds"][0] and data["rounds"][1]["timings"] == [2.1, 2.45, 2.08]
    assert Report.from_json(data) == original


def test_a_failed_jobs_report_has_no_measurements():
    failed = report(status="evaluation_failed", measured=None, kind=KindFields())
    data = failed.to_json()
    assert not {"measured_speedup", "params_after", "warnings", "samples"} & set(data)
    back = Report.from_json(data)
    assert back.measured is None and back == failed


def test_every_field_of_the_record_is_in_its_json():
    """A new field is one field: declared, it is written (and read back) with nothing else to change."""
    full = report(kind=KindFields(**{f.name: 1 for f in dataclasses.fields(KindFields)}),
                  references={"model": "embedded:m"}, pacing={"time_budget_s": 60.0, "rounds": []},
                  stages=[StageTime("baseline", 0, 1.5)],
                  measured=measured(onnx_graph={"dense": {"fusions": {}, "fallback": None}}))
    data = full.to_json()
    for record in (Report, KindFields, type(full.measured)):
        names = {f.name for f in dataclasses.fields(record)} - {"measured", "kind", "parity", "evaluation_failure"}
        assert names <= set(data), names - set(data)


def test_unknown_keys_are_ignored_and_a_missing_one_is_a_clear_error():
    data = {**report().to_json(), "a_field_of_a_newer_release": 1}
    assert Report.from_json(data) == report()
    del data["metric"]
    with pytest.raises(ValueError, match=r"not a report\.json of schema 1: .*metric"):
        Report.from_json(data)


def test_the_returned_round_is_the_one_whose_numbers_the_report_has():
    assert report().chosen_round() == 0
    assert report(measured=None).chosen_round() is None
