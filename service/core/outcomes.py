"""The states of a job and every way a job ends, as one table; the typed error of a failed job.

`OUTCOMES` has one row per outcome: a status of the job's report (`report`), an exception the worker
caught (`worker`) or an end the server imposed (`server`), with the operation's final state, its
google.rpc code and ErrorInfo reason, the exit code of `osscar compress` and whether the artifacts are
kept (downloadable). `JobError`'s constructors look their row up, so a new status is one new row here
(README.md's "Job outcomes" shows the same table; a test keeps the two equal).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..files import out_of_disk
from ..job.budgets import default_budgets_text
from ..job.report import Report

log = logging.getLogger(__name__)

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
FINISHED = (SUCCEEDED, FAILED, CANCELLED)

INTERNAL_MESSAGE = "the job failed with an internal error (logged on the server)"


@dataclass(frozen=True)
class Outcome:
    name: str  # the report's status, or how the job ended
    source: str  # report | worker | server
    state: str  # the operation's final state
    code: str  # google.rpc.Code name ("OK": no error)
    reason: str  # ErrorInfo reason ("": no error)
    exit_code: int  # of `osscar compress`
    artifacts: bool  # the artifacts are kept and can be downloaded
    when: str

    def cells(self) -> tuple[str, ...]:
        """The row as README.md's table writes it."""
        return (f"`{self.name}`", self.source, self.state, self.code, f"`{self.reason}`" if self.reason else "-",
                str(self.exit_code), "yes" if self.artifacts else "no", self.when)


COLUMNS = ("outcome", "from", "state", "code", "reason", "exit", "artifacts", "when")
OUTCOMES: tuple[Outcome, ...] = (
    Outcome("ok", "report", SUCCEEDED, "OK", "", 0, True, "the job met its target (or ran its uniform ratio / "
            "widths) within the accuracy budget"),
    Outcome("target_not_met", "report", FAILED, "FAILED_PRECONDITION", "TARGET_NOT_MET", 2, True,
            "no round within the accuracy budget (the sanity floor of the returned artifact) reached the target "
            "speedup; the fastest such round is delivered, never one below the floor, the numbers in the metadata"),
    Outcome("accuracy_budget_exceeded", "report", FAILED, "FAILED_PRECONDITION", "ACCURACY_BUDGET_EXCEEDED", 2, True,
            "no round kept the metric within the accuracy budget: `accuracy_budget` (max relative drop) or, unset, "
            f"the default rule ({default_budgets_text()}; `DEFAULT_BUDGETS` in `service/job/budgets.py`); the best "
            "round is delivered, the numbers and the rule in the message"),
    Outcome("slower_than_dense", "report", FAILED, "FAILED_PRECONDITION", "SLOWER_THAN_DENSE", 2, True,
            "the returned model measured below 0.98x the dense model's speed (e.g. a uniform ratio with unrounded "
            "widths: `--round-to 8` rounds them); the artifact is delivered, the numbers in the metadata"),
    Outcome("parity_failed", "report", FAILED, "FAILED_PRECONDITION", "PARITY_FAILED", 2, True,
            "an export (the dense baseline, a round, the decode step) cannot be made, does not match PyTorch "
            "within the parity tolerance or does not run in ONNX Runtime; only report.json is kept (no model.onnx), "
            "where and by how much in the message"),
    Outcome("evaluation_failed", "report", FAILED, "FAILED_PRECONDITION", "EVALUATION_FAILED", 2, True,
            "the accuracy check cannot vouch for the result (fewer unseen inputs than it needs, dense outputs that "
            "are not finite, a pruned model scored identical to the dense one, or a returned file other than the "
            "one scored); only report.json is kept (no model.onnx), why in the message"),
    Outcome("invalid_input", "worker", FAILED, "INVALID_ARGUMENT", "INVALID_INPUT", 2, False,
            "`compressor.errors.InputError`: calibration data, a model reference or surgery indices that cannot "
            "be used"),
    Outcome("input_not_found", "worker", FAILED, "NOT_FOUND", "INPUT_NOT_FOUND", 2, False,
            "`FileNotFoundError`: an input went missing while the job ran"),
    Outcome("unsupported_architecture", "worker", FAILED, "FAILED_PRECONDITION", "UNSUPPORTED_ARCHITECTURE", 2, False,
            "`compressor.errors.UnsupportedArchitecture`: the model loads but no pipeline prunes it"),
    Outcome("out_of_memory", "worker", FAILED, "RESOURCE_EXHAUSTED", "OUT_OF_MEMORY", 2, False,
            "`MemoryError`, CUDA out of memory (PyTorch's, or ONNX Runtime's allocator): the stage and the "
            "size it tried in the message and metadata; the worker process ends, so the device is free for "
            "the next job"),
    Outcome("out_of_disk", "worker", FAILED, "RESOURCE_EXHAUSTED", "OUT_OF_DISK", 2, False,
            "an `OSError` of a full disk or quota (ENOSPC, EDQUOT) or a file-size limit (EFBIG) while the job wrote "
            "its files: the stage in the message and metadata, no server path"),
    Outcome("internal", "worker", FAILED, "INTERNAL", "INTERNAL", 2, False,
            "any other exception (a plain `ValueError` too): a generic message, the traceback in the server's log"),
    Outcome("time_budget_exceeded", "server", FAILED, "DEADLINE_EXCEEDED", "TIME_BUDGET_EXCEEDED", 2, False,
            "the job ran past its `time_budget`; its worker is killed"),
    Outcome("cancelled", "server", CANCELLED, "CANCELLED", "CANCELLED", 2, False,
            "`CancelOperation`; a running worker is killed"),
    Outcome("interrupted", "server", FAILED, "ABORTED", "INTERRUPTED", 2, False,
            "the server stopped during each of `--max-attempts` runs"),
    Outcome("worker_crashed", "server", FAILED, "INTERNAL", "WORKER_CRASHED", 2, False,
            "the worker process ended without a result (a signal, an exit; on Ray: its actor's process died)"),
    Outcome("node_lost", "server", FAILED, "ABORTED", "NODE_LOST", 2, False,
            "Ray executor: the job's node left the cluster during each of `--max-attempts` runs (a lost node "
            "re-queues the job, as a server restart does)"),
)
_BY_NAME = {o.name: o for o in OUTCOMES}
_BY_REASON = {o.reason: o for o in OUTCOMES if o.reason}
assert len(_BY_NAME) == len(_BY_REASON) + 1 == len(OUTCOMES), "outcomes and reasons are unique"


def outcome(name: str) -> Outcome:
    return _BY_NAME[name]


@dataclass(frozen=True)
class JobError:
    """Why a job did not succeed: a google.rpc code name, an ErrorInfo reason, a short message for the caller
    and string metadata. Stored as JSON ({"code", "reason", "message"[, "metadata"]})."""

    code: str
    reason: str
    message: str
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def outcome(self) -> Outcome:
        """Its row of OUTCOMES (an unknown reason, from some other release's store, reads as internal)."""
        return _BY_REASON.get(self.reason, _BY_NAME["internal"])

    @property
    def state(self) -> str:
        return self.outcome.state

    # ---- how jobs end ------------------------------------------------------------------------------

    @classmethod
    def of(cls, name: str, message: str, metadata: Mapping[str, Any] | None = None) -> JobError:
        """The error of outcome `name`, its code and reason from the table."""
        row = _BY_NAME[name]
        assert row.code != "OK", f"{name} is not an error"
        return cls(row.code, row.reason, message, {k: str(v) for k, v in (metadata or {}).items()})

    @classmethod
    def cancelled(cls) -> JobError:
        return cls.of("cancelled", "cancelled by the client")

    @classmethod
    def interrupted(cls, attempts: int) -> JobError:
        return cls.of("interrupted", f"the server stopped during each of {attempts} attempts; not retried again")

    @classmethod
    def time_budget_exceeded(cls, seconds: float, stage: str | None = None, index: int = 0) -> JobError:
        """`stage`, `index`: where the job was when it was stopped (what to speed up, or how much more to ask)."""
        where = f" in stage {stage}{f' (round {index})' if index else ''}" if stage else ""
        return cls.of("time_budget_exceeded", f"the job exceeded its time budget of {seconds:g}s{where}",
                      {"time_budget_s": f"{seconds:g}", **({"stage": stage, "round": index} if stage else {})})

    @classmethod
    def worker_crashed(cls, exitcode: int | None, how: str = "") -> JobError:
        """`how`: what the executor knows when there is no exit code (a Ray actor's death cause)."""
        if exitcode is not None:
            how = f"signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
        return cls.of("worker_crashed", f"the worker process ended without a result ({how or 'no exit code'})")

    @classmethod
    def node_lost(cls, attempts: int, detail: str = "") -> JobError:
        return cls.of("node_lost", f"the job's node left the cluster during each of {attempts} attempts; not "
                                   "retried again", {"detail": detail[:200]} if detail else {})

    @classmethod
    def from_report(cls, report: Report) -> JobError | None:
        """None when the report's status is a success, else its row's error with the measured numbers."""
        status = report.status
        row = _BY_NAME.get(status)
        if row is None or row.source != "report":
            log.error("the job reported status %r, which is not in the outcome table", status)
            return cls.of("internal", INTERNAL_MESSAGE)
        if row.code == "OK":
            return None
        if status == "parity_failed":
            return cls._parity_failed(report)
        if status == "evaluation_failed":
            failure = report.evaluation_failure
            assert failure is not None, "an evaluation_failed report says where"
            metadata = {"stage": failure.stage, **({"round": failure.round} if failure.round is not None else {})}
            return cls.of(status, f"{report.message}; no model.onnx is kept", metadata)
        metric, measured = report.metric, report.measured
        assert measured is not None, f"a {status} report returns a measured model"
        metadata = {"measured_speedup": f"{measured.measured_speedup:.4f}",
                    "target_speedup": str(report.target_speedup), "metric": metric.name,
                    "metric_baseline": f"{metric.baseline:.6g}", "metric_compressed": f"{metric.compressed:.6g}",
                    "relative_drop": f"{metric.relative_drop:.6g}"}
        budget = measured.accuracy_budget
        if budget:
            metadata.update(accuracy_rule=budget.rule, accuracy_bound=budget.bound,
                            default_budget=str(budget.default).lower())
        return cls.of(status, f"{report.message}; the best artifact can be downloaded", metadata)

    @classmethod
    def _parity_failed(cls, report: Report) -> JobError:
        parity = report.parity
        assert parity is not None, "a parity_failed report says where"
        metadata = {"stage": parity.stage, "precision": parity.precision, "error": parity.error}
        if parity.round is not None:
            metadata["round"] = parity.round
        worst = max(parity.mismatches or [{}], key=lambda m: m.get("peak_error") or 0.0)
        for key in ("output", "peak_error", "aggregate_error", "max_abs_error"):
            if worst.get(key) is not None:
                metadata[key] = worst[key] if isinstance(worst[key], str) else f"{worst[key]:.4g}"
        for key, value in parity.tolerance.items():
            metadata[f"tolerance_{key}"] = f"{value:g}"
        return cls.of("parity_failed", f"{report.message}; no model.onnx is kept", metadata)

    @classmethod
    def from_exception(cls, err: BaseException, stage: str | None = None) -> JobError:
        """An exception the job raised (in `stage`, when known). Only the compressor's input errors (and
        missing files) are the caller's, and memory running out is the machine's; anything else is a bug:
        INTERNAL with a generic message (the caller logs the traceback)."""
        from compressor.errors import InputError, UnsupportedArchitecture

        oom = out_of_memory(err)
        if oom is not None:
            device, requested = oom
            where = f" in stage {stage}" if stage else ""
            tried = f" (it tried to allocate {requested})" if requested else ""
            metadata = {"device": device, **({"stage": stage} if stage else {}),
                        **({"requested": requested} if requested else {})}
            return cls.of("out_of_memory", f"the job ran out of {device} memory{where}{tried}", metadata)

        full = out_of_disk(err)
        if full is not None:
            where = f" in stage {stage}" if stage else ""
            return cls.of("out_of_disk", f"the job ran out of disk space{where} ({full})",
                          {"reason": full, **({"stage": stage} if stage else {})})
        if isinstance(err, UnsupportedArchitecture):  # an InputError too, but no retry with other input helps
            return cls.of("unsupported_architecture", _first_line(err))
        if isinstance(err, InputError):
            return cls.of("invalid_input", _first_line(err))
        if isinstance(err, FileNotFoundError):
            return cls.of("input_not_found", _first_line(err))
        return cls.of("internal", INTERNAL_MESSAGE)

    # ---- storage -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "reason": self.reason, "message": self.message}
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobError:
        return cls(str(data["code"]), str(data.get("reason") or data["code"]), str(data["message"]),
                   {str(k): str(v) for k, v in (data.get("metadata") or {}).items()})


_TORCH_REQUEST = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
_ORT_REQUEST = re.compile(r"(?:requested buffer of size|Failed to allocate memory.*?size) (\d+)")
_ORT_OOM = ("out of memory", "failed to allocate memory", "cudaerrormemoryallocation", "cuda_error_out_of_memory")


def out_of_memory(err: BaseException) -> tuple[str, str | None] | None:
    """("CUDA" or "host", the size it tried to allocate if the message says) when `err` is memory
    running out: MemoryError, torch.cuda.OutOfMemoryError (by name: the server never imports torch),
    ONNX Runtime's CUDA allocator failing in its subprocess (exporters.runtime.RuntimeFailure), or that
    subprocess killed by the host's out-of-memory killer (exporters.runtime.RuntimeKilled)."""
    names = {c.__name__ for c in type(err).__mro__}
    text = str(err)
    if "OutOfMemoryError" in names:
        match = _TORCH_REQUEST.search(text)
        return "CUDA", match.group(1) if match else None
    if "RuntimeKilled" in names:  # ONNX Runtime's subprocess killed (SIGKILL), even when run again in pieces
        return "host", None
    if "RuntimeFailure" in names and any(key in text.lower() for key in _ORT_OOM):
        match = _ORT_REQUEST.search(text)
        device = "CUDA" if "cuda" in text.lower() else "host"
        return device, (f"{int(match.group(1)) / 2**20:.1f} MiB" if match else None)
    if isinstance(err, MemoryError):
        return "host", None
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:500]
