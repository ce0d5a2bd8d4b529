"""The outcome table (code and README agree) and the typed error of a finished job."""

import dataclasses
import json
from pathlib import Path

import pytest
from google.rpc import code_pb2, error_details_pb2

from compressor.errors import CalibrationError, InputError, ModelReferenceError, SurgeryError, UnsupportedArchitecture
from service.api.wire import DOMAIN, status_of_error
from service.core.outcomes import COLUMNS, INTERNAL_MESSAGE, OUTCOMES, JobError, outcome
from service.job.report import Artifacts, BudgetResult, MetricResult, ParityFailure, Report, status_message
from tests.service.job.reports import measured
from tests.service.job.reports import report as sample_report

ROOT = Path(__file__).resolve().parents[3]


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
    (MemoryError(), "out_of_memory", "the job ran out of host memory"),
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
    ok = sample_report(metric=MetricResult("top1", 0.9, 0.85, 0.0556, {}), measured=measured(accuracy_budget=None))
    assert JobError.from_report(ok) is None
    missed = JobError.from_report(dataclasses.replace(
        ok, status="accuracy_budget_exceeded", message="accuracy_budget_exceeded: measured speedup 1.500x (target "
                                                       "1.5x), top1 0.9000 -> 0.8500"))
    assert (missed.code, missed.reason) == ("FAILED_PRECONDITION", "ACCURACY_BUDGET_EXCEEDED")
    assert missed.message.startswith("accuracy_budget_exceeded: measured speedup 1.500x (target 1.5x), top1 0.9000")
    assert missed.metadata == {"measured_speedup": "1.5000", "target_speedup": "1.5", "metric": "top1",
                               "metric_baseline": "0.9", "metric_compressed": "0.85", "relative_drop": "0.0556"}
    assert JobError.from_report(dataclasses.replace(ok, status="invalid_input")).reason == "INTERNAL"  # not a report's


def test_an_exceeded_budget_says_its_rule_and_numbers():
    report = sample_report(
        status="accuracy_budget_exceeded", target_speedup=None, uniform_ratio=0.5,
        message="accuracy_budget_exceeded: measured speedup 1.200x (uniform ratio 0.5), perplexity 51.6800 -> "
                "1800.3700, beyond the default accuracy budget: perplexity at most 2x dense (perplexity <= 103.3600)",
        metric=MetricResult("perplexity", 51.68, 1800.37, 33.84, {}),
        measured=measured(measured_speedup=1.2, accuracy_budget=BudgetResult(
            "perplexity at most 2x dense", "times", 2.0, True, 103.36, "perplexity <= 103.3600")))
    assert status_message(report) == report.message  # the job's own line, with the rule
    error = JobError.from_report(report)
    assert (error.code, error.reason) == ("FAILED_PRECONDITION", "ACCURACY_BUDGET_EXCEEDED")
    assert error.message == report.message + "; the best artifact can be downloaded"
    assert error.metadata["accuracy_rule"] == "perplexity at most 2x dense"
    assert error.metadata["default_budget"] == "true"
    assert error.metadata["metric_compressed"] == "1800.37"


PARITY_REPORT = sample_report(
    status="parity_failed", layers=[], rounds=[], measured=None, artifacts=Artifacts(),
    message="parity_failed: the export of round 1 (fp32) fails the parity check: ONNX export does not match "
            "PyTorch: logits: peak error 0.031 of scale (limit 0.001), aggregate 0.0042 (limit 0.0001), max abs "
            "error 0.75",
    metric=MetricResult("cosine", 1.0),
    parity=ParityFailure("round", 1, "fp32", {"peak": 1e-3, "aggregate": 1e-4}, "ParityError", "...",
                         [{"output": "logits", "problem": "...", "peak_error": 0.031, "aggregate_error": 0.0042,
                           "max_abs_error": 0.75}]))


def test_a_parity_failure_is_failed_precondition_with_its_numbers():
    stored = Report.from_json(json.loads(json.dumps(PARITY_REPORT.to_json())))  # as the server reads it back
    assert stored == PARITY_REPORT and "measured_speedup" not in PARITY_REPORT.to_json()
    error = JobError.from_report(stored)
    assert (error.code, error.reason, error.state) == ("FAILED_PRECONDITION", "PARITY_FAILED", "FAILED")
    assert error.message.startswith("parity_failed: the export of round 1 (fp32)")
    assert error.message.endswith("no model.onnx is kept")
    assert dict(error.metadata) == {"stage": "round", "round": "1", "precision": "fp32", "error": "ParityError",
                                    "output": "logits", "peak_error": "0.031", "aggregate_error": "0.0042",
                                    "max_abs_error": "0.75", "tolerance_peak": "0.001",
                                    "tolerance_aggregate": "0.0001"}
    status = status_of_error(error)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert status.code == code_pb2.FAILED_PRECONDITION and (info.reason, info.domain) == ("PARITY_FAILED", DOMAIN)
    runtime = dataclasses.replace(PARITY_REPORT, parity=dataclasses.replace(
        PARITY_REPORT.parity, stage="baseline", round=None, error="RuntimeFailure", mismatches=[]))
    assert JobError.from_report(runtime).metadata["error"] == "RuntimeFailure"


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


def test_device_memory_running_out_names_the_stage_and_the_size():
    import torch

    from exporters.runtime import RuntimeFailure

    torch_oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")
    error = JobError.from_exception(torch_oom, stage="pruning")
    assert (error.code, error.reason) == ("RESOURCE_EXHAUSTED", "OUT_OF_MEMORY")
    assert error.message == "the job ran out of CUDA memory in stage pruning (it tried to allocate 2.00 GiB)"
    assert error.metadata == {"device": "CUDA", "stage": "pruning", "requested": "2.00 GiB"}
    ort_oom = RuntimeFailure("ONNX Runtime failed: RuntimeException: [ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : "
                             "... CUDA failure 2: out of memory ... Failed to allocate memory for requested "
                             "buffer of size 1073741824")
    error = JobError.from_exception(ort_oom, stage="exporting and measuring")
    assert error.reason == "OUT_OF_MEMORY" and error.metadata["requested"] == "1024.0 MiB"
    assert "in stage exporting and measuring" in error.message
    # another ONNX Runtime failure, or an unrelated RuntimeError saying "memory", stays a bug
    assert JobError.from_exception(RuntimeFailure("ONNX Runtime failed: bad node")).reason == "INTERNAL"
    assert JobError.from_exception(RuntimeError("out of memory")).reason == "INTERNAL"


def test_a_disk_running_out_is_the_machines_and_names_no_path():
    """ENOSPC / EDQUOT / EFBIG while a job wrote its files ended INTERNAL ("an internal error, logged on the server"):
    a cause the operator can act on, said without the server's path."""
    import errno

    full = OSError(errno.ENOSPC, "No space left on device", "/srv/osscar/work/1/out/model.onnx.data")
    error = JobError.from_exception(full, stage="save")
    assert (error.code, error.reason) == ("RESOURCE_EXHAUSTED", "OUT_OF_DISK")
    assert error.message == "the job ran out of disk space in stage save (no space left on the device)"
    assert "/srv" not in str(error.to_dict())
    try:  # a library that wraps the OSError in its own error
        try:
            raise OSError(errno.EFBIG, "File too large")
        except OSError as err:
            raise RuntimeError("could not write the export") from err
    except RuntimeError as wrapped:
        assert "size limit" in JobError.from_exception(wrapped).message
    assert JobError.from_exception(OSError(errno.EDQUOT, "Disk quota exceeded")).reason == "OUT_OF_DISK"
    assert JobError.from_exception(RuntimeError("safetensors: No space left on device (os error 28)")).reason \
        == "OUT_OF_DISK"
    assert JobError.from_exception(OSError(errno.EIO, "Input/output error")).reason == "INTERNAL"
