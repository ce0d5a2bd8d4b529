"""The outcome table (code and README agree) and the typed error of a finished job."""

from pathlib import Path

import pytest
from google.rpc import code_pb2, error_details_pb2

from compressor.errors import CalibrationError, InputError, ModelReferenceError, SurgeryError, UnsupportedArchitecture
from service.core.outcomes import COLUMNS, INTERNAL_MESSAGE, OUTCOMES, JobError, outcome
from service.wire import DOMAIN, status_of_error

ROOT = Path(__file__).resolve().parents[2]


def readme_table() -> list[tuple[str, ...]]:
    """The rows of the table in README.md's "## Job outcomes" section, header first."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Job outcomes\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    rows = [tuple(cell.strip() for cell in line.strip().strip("|").split("|")) for line in lines]
    assert set(rows[1]) == {"---"}, "a header, then the separator"
    return [rows[0], *rows[2:]]


def test_the_readme_table_is_the_code_table():
    header, *rows = readme_table()
    assert header == COLUMNS
    assert len(rows) == len(OUTCOMES)
    for row, expected in zip(rows, OUTCOMES, strict=True):
        assert row == expected.cells()


def test_every_failure_has_a_code_and_a_reason_and_exits_2():
    for row in OUTCOMES:
        assert row.source in ("report", "worker", "server")
        assert row.code == "OK" or hasattr(code_pb2, row.code), row
        assert (row.code == "OK") == (row.reason == "") == (row.exit_code == 0) == (row.state == "SUCCEEDED")
        if row.code != "OK":
            assert JobError.of(row.name, "m").outcome == row


@pytest.mark.parametrize("err, name, message", [
    (CalibrationError("cal.npz has no images\nmore"), "invalid_input", "cal.npz has no images"),
    (ModelReferenceError("m: nothing there"), "invalid_input", "m: nothing there"),
    (SurgeryError("bad indices"), "invalid_input", "bad indices"),
    (InputError("input"), "invalid_input", "input"),
    (UnsupportedArchitecture("m: gpt_neox"), "unsupported_architecture", "m: gpt_neox"),
    (FileNotFoundError("cal.npz"), "input_not_found", "cal.npz"),
    (MemoryError(), "out_of_memory", "the job ran out of memory"),
    (ValueError("secret /srv/customer"), "internal", INTERNAL_MESSAGE),
    (RuntimeError("secret /srv/customer"), "internal", INTERNAL_MESSAGE),
    (KeyboardInterrupt(), "internal", INTERNAL_MESSAGE),
])
def test_only_input_errors_are_the_callers(err, name, message):
    error = JobError.from_exception(err)
    row = outcome(name)
    assert (error.code, error.reason, error.message) == (row.code, row.reason, message)
    assert error.outcome == row and error.state == "FAILED"


def test_a_plain_value_error_is_internal_and_an_input_error_invalid_argument_on_the_wire():
    internal = status_of_error(JobError.from_exception(ValueError("x")))
    invalid = status_of_error(JobError.from_exception(CalibrationError("no images")))
    assert internal.code == code_pb2.INTERNAL and internal.message == INTERNAL_MESSAGE
    assert invalid.code == code_pb2.INVALID_ARGUMENT and invalid.message == "no images"
    info = error_details_pb2.ErrorInfo()
    assert invalid.details[0].Unpack(info) and (info.reason, info.domain) == ("INVALID_INPUT", DOMAIN)


def test_report_statuses_look_up_their_rows():
    report = {"status": "ok", "measured_speedup": 1.5, "target_speedup": 1.5,
              "metric": {"name": "top1", "baseline": 0.9, "compressed": 0.85, "relative_drop": 0.0556}}
    assert JobError.from_report(report) is None
    missed = JobError.from_report({**report, "status": "accuracy_budget_exceeded"})
    assert (missed.code, missed.reason) == ("FAILED_PRECONDITION", "ACCURACY_BUDGET_EXCEEDED")
    assert missed.message.startswith("accuracy_budget_exceeded: measured speedup 1.500x (target 1.5), top1 0.9000")
    assert missed.metadata == {"measured_speedup": "1.5000", "target_speedup": "1.5", "metric": "top1",
                               "metric_baseline": "0.9", "metric_compressed": "0.85", "relative_drop": "0.0556"}
    assert JobError.from_report({**report, "status": "invalid_input"}).reason == "INTERNAL"  # not a report status


def test_errors_round_trip_through_their_stored_form():
    for error in (JobError.cancelled(), JobError.interrupted(3), JobError.time_budget_exceeded(4.5),
                  JobError.worker_crashed(-9), JobError.worker_crashed(1)):
        assert JobError.from_dict(error.to_dict()) == error
    assert JobError.cancelled().to_dict() == {"code": "CANCELLED", "reason": "CANCELLED",
                                              "message": "cancelled by the client"}
    assert JobError.worker_crashed(-9).message == "the worker process ended without a result (signal 9)"
    assert JobError.worker_crashed(1).message == "the worker process ended without a result (exit code 1)"
    status = status_of_error(JobError.time_budget_exceeded(4.5))
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    assert status.code == code_pb2.DEADLINE_EXCEEDED and dict(info.metadata) == {"time_budget_s": "4.5"}
