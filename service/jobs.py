"""The service core: durable compression jobs, a bounded queue, one worker process per job and device.

Transport-agnostic (the gRPC layer converts protobuf to and from these calls and maps `service.errors`
to status codes). Life of a job: `submit` validates synchronously (every field violation at once,
references resolved, the architecture checked), dedupes by request_id and persists it QUEUED; the
scheduler starts a spawned worker (`service.worker`) when a device slot is free, persisting RUNNING and
every progress event; the worker's result or error, a cancel, the job's time budget or a crashed worker
end it in SUCCEEDED / FAILED / CANCELLED. After a restart, jobs that were RUNNING run again (artifacts are
content-addressed, so a re-run is safe) until `max_attempts`, then fail with reason INTERRUPTED; nothing
is left without a final state. Watchers follow an in-memory feed of events (latest first when slow);
the store is the source of truth.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .blobs import ArchiveError, BlobStore, valid_digest, valid_filename
from .errors import (
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from .logs import operation_context
from .metrics import Metrics
from .policy import ReferencePolicy
from .references import resolve
from .store import CANCELLED, FAILED, FINISHED, QUEUED, RUNNING, SUCCEEDED, ArtifactRecord, JobRecord, JobStore
from .worker import WorkerArgs
from .worker import run as run_worker

log = logging.getLogger(__name__)

REFERENCE_FIELDS = {"model": "model", "calibration": "calibration data", "eval": "evaluation data",
                    "widths_from": "report"}
_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_FILTER_TERM = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*=\s*(?:"([^"]*)"|([^\s"]+))\s*$')
MAX_TIME_BUDGET_S = 7 * 86400


@dataclass
class ServiceConfig:
    home: Path  # $OSSCAR_HOME: jobs.sqlite, blobs/, work/, curves/
    max_queue: int = 16  # queued jobs beyond this are refused with RESOURCE_EXHAUSTED
    devices: tuple[str, ...] = ()  # one job at a time on each; empty: every CUDA device, else ("cpu",)
    max_attempts: int = 3  # runs of a job interrupted by server restarts before it fails INTERRUPTED
    retention_s: float = 30 * 86400  # finished operations and unused uploads are forgotten after this
    max_upload_bytes: int = 64 << 30
    max_wait_s: float = 600.0  # WaitOperation's timeout is capped here
    default_wait_s: float = 60.0
    retry_after_s: float = 30.0  # suggested to clients refused because the queue is full
    policy: ReferencePolicy = field(default_factory=ReferencePolicy)  # what references may name
    log_format: str = "json"  # of the workers' logs, as the server's


@dataclass
class SubmitRequest:
    """A Compress call, as the transport received it."""

    spec: dict[str, Any]  # CompressRequest fields; model/calibration/eval/widths_from are references
    body: bytes  # the request's canonical serialization (echoed back; its digest settles request_id reuse)
    body_sha256: str  # of the body without the request_id
    labels: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    time_budget_s: float | None = None


@dataclass(frozen=True)
class UploadHeader:
    filename: str
    archive: bool = False
    size_bytes: int = 0  # 0: not declared
    sha256: str = ""  # "": not declared


class _Feed:
    """Recent events of one operation and a way to wait for the next."""

    def __init__(self) -> None:
        self.events: deque[tuple[int, dict]] = deque(maxlen=512)
        self.seq = 0
        self.changed = asyncio.Event()
        self.done = asyncio.Event()

    def publish(self, event: dict, done: bool = False) -> None:
        self.seq += 1
        self.events.append((self.seq, event))
        if done:
            self.done.set()
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass
class _Running:
    process: Any
    slot: str
    stop_reason: str | None = None  # cancel | shutdown | deadline


class JobService:
    def __init__(self, config: ServiceConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.home = Path(config.home)
        self.store: JobStore | None = None
        self.blobs = BlobStore(self.home / "blobs")
        self.queue: deque[str] = deque()
        self.running: dict[str, _Running] = {}
        self.tasks: set[asyncio.Task] = set()
        self.feeds: dict[str, _Feed] = {}
        self.draining = False
        self.slots: list[str] = []
        self._wake = asyncio.Event()
        self._background: list[asyncio.Task] = []

    # ---- life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.store = JobStore(self.home / "jobs.sqlite")
        removed = self.blobs.clean_tmp()
        if removed:
            log.info("removed %d partial files left by an interrupted write", removed)
        self.slots = list(self.config.devices or _detect_devices())
        self._recover()
        self._observe()
        self._background = [asyncio.create_task(self._scheduler(), name="scheduler"),
                            asyncio.create_task(self._retention(), name="retention")]
        log.info("job service: %s, devices %s, queue limit %d", self.home, ",".join(self.slots),
                 self.config.max_queue)

    def _recover(self) -> None:
        for record in self.store.in_states([RUNNING]):
            if record.attempt >= self.config.max_attempts:
                self._finish(record.name, FAILED, error={
                    "code": "ABORTED", "reason": "INTERRUPTED",
                    "message": f"the server stopped during each of {record.attempt} attempts; not retried again"})
                continue
            self.store.update(record.name, state=QUEUED, progress={
                **record.progress, "stage": "queued",
                "message": f"re-queued: the server stopped during attempt {record.attempt}"})
            with operation_context(record.name):
                log.info("re-queued after a restart (attempt %d was interrupted)", record.attempt)
        for record in self.store.in_states([QUEUED]):
            self.queue.append(record.name)
            self.feeds.setdefault(record.name, _Feed())
        self._wake.set()

    @property
    def accepting(self) -> bool:
        return not self.draining and self.store is not None and self.store.ping()

    async def drain(self, grace_s: float) -> None:
        """Stop taking work; give running jobs `grace_s` to finish, then stop them and leave them QUEUED
        for the next start (an interruption by shutdown does not count as an attempt)."""
        self.draining = True
        pending = set(self.tasks)
        if pending:
            log.info("draining: waiting up to %.0fs for %d running job(s)", grace_s, len(pending))
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        for name, running in list(self.running.items()):
            with operation_context(name):
                log.info("stopped by shutdown; it runs again at the next start")
            running.stop_reason = "shutdown"
            _kill(running.process)
        if pending:
            await asyncio.wait(pending)
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.store.close()

    # ---- requests --------------------------------------------------------------------------------

    async def submit(self, request: SubmitRequest) -> JobRecord:
        if self.draining:
            raise Unavailable("the server is shutting down; retry against another instance or later")
        if request.request_id:
            if not _is_uuid(request.request_id):
                raise InvalidArgument([FieldViolation("request_id", "must be a UUID (AIP-155), e.g. "
                                                                    "from uuid.uuid4()")])
            earlier = self.store.by_request_id(request.request_id)
            if earlier is not None:
                if earlier.body_sha256 != request.body_sha256:
                    raise AlreadyExists("operation", earlier.name, f"request_id {request.request_id} was used for "
                                        f"a different request ({earlier.name}); use a new request_id")
                return earlier
        resolved, references = self._validate(request)
        if self.store.count(QUEUED) >= self.config.max_queue:
            raise ResourceExhausted(f"the job queue is full ({self.config.max_queue} waiting); retry later",
                                    self.config.retry_after_s)
        record = JobRecord(
            name=f"operations/{uuid.uuid4()}", body_sha256=request.body_sha256, request=request.body,
            spec={"resolved": resolved, "references": references}, labels=dict(request.labels),
            request_id=request.request_id or None, time_budget_s=request.time_budget_s,
            progress={"stage": "queued", "round": 0, "layer": 0, "layers": 0, "message": "queued"})
        self.store.insert(record)
        self.queue.append(record.name)
        self.feeds[record.name] = _Feed()
        self._wake.set()
        with operation_context(record.name):
            log.info("queued: %s", references.get("model"))
        self._observe()
        return self.store.get(record.name)

    def _validate(self, request: SubmitRequest) -> tuple[dict, dict]:
        from .compress import CompressRequest

        violations: list[FieldViolation] = []
        not_found: list[NotFound] = []
        spec = dict(request.spec)
        references = {}
        for key, resource in REFERENCE_FIELDS.items():
            reference = spec.get(key)
            if not reference:
                if key in ("model", "calibration"):
                    violations.append(FieldViolation(key, "required"))
                spec[key] = None
                continue
            references[key] = reference
            try:
                spec[key] = str(resolve(reference, key, resource, self.blobs, self.home, self.config.policy))
                if reference.startswith("blob:"):
                    digest, name = reference.split(":", 2)[2].split("/", 1)
                    self.store.touch_upload(digest, name)
            except InvalidArgument as err:
                violations += err.violations
                spec[key] = None  # refused: not looked at again
            except NotFound as err:
                not_found.append(err)
                spec[key] = None
        for key, value in request.labels.items():
            if not _LABEL_KEY.match(key) or len(value) > 63:
                violations.append(FieldViolation(f"labels[{key}]", "label keys are lowercase letters, digits, _ "
                                                 "and - (start with a letter, <= 63), values <= 63 characters"))
        if len(request.labels) > 64:
            violations.append(FieldViolation("labels", "at most 64 labels"))
        budget = request.time_budget_s
        if budget is not None and not (math.isfinite(budget) and 0 < budget <= MAX_TIME_BUDGET_S):
            violations.append(FieldViolation("time_budget", f"must be positive and at most {MAX_TIME_BUDGET_S}s "
                                                            f"(got {budget})"))
        try:
            compress_request = CompressRequest(**{k: v for k, v in spec.items()
                                                  if k not in ("no_curves_cache", "trust_remote_code")},
                                               out_dir=Path("/nonexistent"))
            found = compress_request.violations()
        except TypeError as err:  # a transport bug, not the caller's: surfaces as INTERNAL
            raise RuntimeError(f"request fields do not match CompressRequest: {err}") from err
        violations += [FieldViolation(f, m) for f, m in found if not (f == "widths_from" and "widths_from"
                                                                       in references)]
        if violations:
            raise InvalidArgument(violations)
        if not_found:
            raise not_found[0]
        self._check_model(Path(spec["model"]), references["model"])
        spec["trust_remote_code"] = self.config.policy.trusts_code(Path(spec["model"]))
        return spec, references

    @staticmethod
    def _check_model(path: Path, reference: str) -> None:
        from compressor.transformer.adapters import ADAPTERS

        if path.is_file():
            if path.suffix != ".pt2":
                raise InvalidArgument([FieldViolation("model", f"{reference}: expected a .pt2 torch.export program "
                                                               f"or a Hugging Face model directory, got a "
                                                               f"{path.suffix or 'suffix-less'} file")])
            return
        config_file = path / "config.json"
        if not config_file.is_file():
            raise InvalidArgument([FieldViolation("model", f"{reference}: a directory without config.json; expected "
                                                           "a Hugging Face model directory")])
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError):
            raise InvalidArgument([FieldViolation("model", f"{reference}: config.json is not valid JSON")]) from None
        if not isinstance(config, dict):
            raise InvalidArgument([FieldViolation("model", f"{reference}: config.json is not a JSON object")])
        model_type = config.get("model_type")
        if model_type == "opt" and config.get("do_layer_norm_before") is False:
            raise FailedPrecondition("UNSUPPORTED_ARCHITECTURE", "post-norm OPT (e.g. opt-350m) is not supported",
                                     {"model_type": "opt"})
        if model_type not in ADAPTERS and "num_channels" not in config:
            raise FailedPrecondition(
                "UNSUPPORTED_ARCHITECTURE",
                f"model_type {model_type!r} is neither a supported transformer family ({', '.join(sorted(ADAPTERS))}) "
                "nor an image model", {"model_type": str(model_type)})
        if not any(path.glob("*.safetensors")):
            raise InvalidArgument([FieldViolation("model", f"{reference}: no *.safetensors weights; only "
                                                           "safetensors are loaded (pickled pytorch_model.bin files "
                                                           "can run code)")])

    def get(self, name: str) -> JobRecord:
        record = self.store.get(name) if name.startswith("operations/") else None
        if record is None:
            if not name.startswith("operations/"):
                raise InvalidArgument([FieldViolation("name", f"expected operations/<id>, got {name!r}")])
            raise NotFound("operation", name)
        return record

    def list(self, filter_text: str, page_size: int, page_token: str) -> tuple[list[JobRecord], str]:
        if len(filter_text) > 2048 or len(page_token) > 2048:
            raise InvalidArgument([FieldViolation("filter", "filter and page_token are at most 2048 characters")])
        if page_size < 0:
            raise InvalidArgument([FieldViolation("page_size", f"must be >= 0 (got {page_size})")])
        size = min(page_size or 50, 1000)
        where = _parse_filter(filter_text)
        fingerprint = hashlib.sha256(filter_text.encode()).hexdigest()[:16]
        after = _decode_token(page_token, fingerprint) if page_token else None
        records = self.store.page(where, after, size + 1)
        token = ""
        if len(records) > size:
            records = records[:size]
            last = records[-1]
            token = base64.urlsafe_b64encode(json.dumps(
                {"t": last.create_time, "n": last.name, "f": fingerprint}).encode()).decode()
        return records, token

    async def cancel(self, name: str) -> JobRecord:
        record = self.get(name)
        if record.state == CANCELLED:
            return record
        if record.done:
            raise FailedPrecondition("OPERATION_DONE", f"{name} already ended {record.state}; nothing to cancel",
                                     {"state": record.state})
        running = self.running.get(name)
        if running is not None:
            running.stop_reason = "cancel"
            _kill(running.process)  # the device is freed when the process is gone
            await self.wait(name, 30.0)
        else:
            with contextlib.suppress(ValueError):
                self.queue.remove(name)
            self._finish(name, CANCELLED, error={"code": "CANCELLED", "message": "cancelled by the client",
                                                 "reason": "CANCELLED"})
        return self.get(name)

    async def delete(self, name: str) -> None:
        record = self.get(name)
        if not record.done:
            raise FailedPrecondition("OPERATION_NOT_DONE", f"{name} is {record.state}; cancel it before deleting "
                                     "it", {"state": record.state})
        for digest in self.store.delete(name):
            self.blobs.delete(digest)
        self.feeds.pop(name, None)
        with operation_context(name):
            log.info("deleted")
        self._observe()

    async def wait(self, name: str, timeout_s: float | None) -> JobRecord:
        if timeout_s is not None and (not math.isfinite(timeout_s) or timeout_s < 0):  # long ones are capped
            raise InvalidArgument([FieldViolation("timeout", f"must be >= 0 (got {timeout_s})")])
        record = self.get(name)
        if record.done:
            return record
        timeout = min(self.config.default_wait_s if timeout_s is None else timeout_s, self.config.max_wait_s)
        feed = self.feeds.setdefault(name, _Feed())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(feed.done.wait(), timeout)
        return self.get(name)

    async def watch(self, name: str) -> AsyncIterator[tuple[dict | None, JobRecord | None]]:
        """(None, record) first, then (event, None) as they happen, then (None, record) when done."""
        record = self.get(name)
        yield None, record
        if record.done:
            return
        feed = self.feeds.setdefault(name, _Feed())
        cursor = feed.seq
        while True:
            changed = feed.changed
            fresh = [(seq, event) for seq, event in feed.events if seq > cursor]
            if not fresh:
                if feed.done.is_set():
                    break
                await changed.wait()
                continue
            for seq, event in fresh:
                cursor = seq
                yield event, None
        final = self.store.get(name)
        if final is not None:
            yield None, final

    async def upload(self, header: UploadHeader, chunks: AsyncIterator[bytes]) -> tuple[str, str, int]:
        """Store an upload; returns (reference, sha256, size)."""
        violations = []
        if not valid_filename(header.filename):
            violations.append(FieldViolation("header.filename", f"a plain file name without separators is required "
                                                                f"(got {header.filename!r})"))
        if header.size_bytes < 0 or header.size_bytes > self.config.max_upload_bytes:
            violations.append(FieldViolation("header.size_bytes", f"must be in [0, {self.config.max_upload_bytes}] "
                                                                  f"(got {header.size_bytes})"))
        if header.sha256 and not valid_digest(header.sha256):
            violations.append(FieldViolation("header.sha256", "must be 64 lowercase hex digits"))
        if violations:
            raise InvalidArgument(violations)
        writer = self.blobs.writer()
        try:
            async for chunk in chunks:
                if writer.size + len(chunk) > self.config.max_upload_bytes:
                    raise InvalidArgument([FieldViolation("chunk", f"the upload exceeds the server's limit of "
                                                                   f"{self.config.max_upload_bytes} bytes")])
                await asyncio.to_thread(writer.write, chunk)
            if header.size_bytes and writer.size != header.size_bytes:
                raise InvalidArgument([FieldViolation("header.size_bytes", f"declared {header.size_bytes} bytes, "
                                                                           f"received {writer.size}")])
            if header.sha256 and writer.hash.hexdigest() != header.sha256:
                raise InvalidArgument([FieldViolation("header.sha256", f"declared {header.sha256}, received content "
                                                                       f"has {writer.hash.hexdigest()}")])
            digest, size = await asyncio.to_thread(writer.commit)
        except BaseException:
            writer.abort()
            raise
        try:
            await asyncio.to_thread(self.blobs.view, digest, header.filename, header.archive)
        except ArchiveError as err:
            if not self.store.referenced(digest):
                self.blobs.delete(digest)
            raise InvalidArgument([FieldViolation("header.archive", str(err))]) from None
        self.store.record_upload(digest, header.filename, header.archive, size)
        return f"blob:sha256:{digest}/{header.filename}", digest, size

    def artifact(self, name: str, artifact: str) -> tuple[ArtifactRecord, Path]:
        record = self.get(name)
        for a in record.artifacts:
            if a.name == artifact:
                path = self.blobs.path(a.sha256)
                if not path.is_file():
                    raise NotFound("artifact", f"{name}/{artifact}", f"the content of {artifact} is gone from "
                                   "the artifact store")
                return a, path
        available = ", ".join(a.name for a in record.artifacts) or "none yet"
        raise NotFound("artifact", f"{name}/{artifact}", f"{name} has no artifact {artifact!r} (available: "
                                                         f"{available})")

    # ---- running jobs ----------------------------------------------------------------------------

    async def _scheduler(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue and not self.draining:
                free = [s for s in self.slots if s not in {r.slot for r in self.running.values()}]
                if not free:
                    break
                name = self.queue.popleft()
                record = self.store.get(name)
                if record is None or record.state != QUEUED:
                    continue
                task = asyncio.create_task(self._run(record, free[0]), name=f"job {name}")
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _run(self, record: JobRecord, slot: str) -> None:
        with operation_context(record.name):  # every record logged while supervising names the job
            await self._supervise(record, slot)

    async def _supervise(self, record: JobRecord, slot: str) -> None:
        name, attempt = record.name, record.attempt + 1
        op_id = name.split("/", 1)[1]
        work = self.home / "work" / op_id
        shutil.rmtree(work, ignore_errors=True)  # an interrupted attempt's scratch
        work_dir = work / f"attempt-{attempt}"
        work_dir.mkdir(parents=True)
        progress = {"stage": "starting", "round": 0, "layer": 0, "layers": 0, "message": f"attempt {attempt} on {slot}"}
        started = time.time()
        self.store.update(name, state=RUNNING, attempt=attempt, start_time=started, progress=progress)
        self._publish(name, RUNNING, progress)
        self._observe()
        stage, stage_start = progress["stage"], started
        context = multiprocessing.get_context("spawn")
        receiver, sender = context.Pipe(duplex=False)
        args = WorkerArgs(name, record.spec["resolved"], record.spec["references"], str(self.home), str(work_dir),
                          slot, os.getpid(), self.config.log_format)
        process = context.Process(target=run_worker, args=(args, sender), name=f"osscar-worker-{op_id[:8]}")
        running = _Running(process, slot)
        self.running[name] = running
        outcome: tuple[str, dict] | None = None
        try:
            process.start()
            sender.close()
            log.info("attempt %d running on %s (worker pid %d)", attempt, slot, process.pid)
            async with asyncio.timeout(record.time_budget_s):
                while True:
                    try:
                        kind, payload = await asyncio.to_thread(receiver.recv)
                    except (EOFError, OSError):
                        break
                    if kind == "progress":
                        self.store.update(name, progress=payload)
                        self._publish(name, RUNNING, payload)
                        if payload.get("stage") != stage and self.metrics:
                            now = time.time()
                            self.metrics.stage_seconds.labels(stage).observe(now - stage_start)
                            stage, stage_start = payload.get("stage"), now
                    else:
                        outcome = (kind, payload)
        except TimeoutError:
            running.stop_reason = running.stop_reason or "deadline"
        except Exception:
            log.exception("supervising the worker failed")
        finally:
            _kill(process)
            await asyncio.to_thread(process.join)
            receiver.close()
            del self.running[name]
            shutil.rmtree(work, ignore_errors=True)
            self._wake.set()
        self._conclude(record, attempt, running, process.exitcode, outcome)

    def _conclude(self, record: JobRecord, attempt: int, running: _Running, exitcode: int | None,
                  outcome: tuple[str, dict] | None) -> None:
        name = record.name
        reason = running.stop_reason
        if reason == "shutdown" and outcome is None:
            self.store.update(name, state=QUEUED, attempt=attempt - 1, progress={
                "stage": "queued", "round": 0, "layer": 0, "layers": 0,
                "message": "interrupted by a server shutdown; runs again at the next start"})
            self._observe()
            return
        if reason == "cancel":
            self._finish(name, CANCELLED, error={"code": "CANCELLED", "message": "cancelled by the client",
                                                 "reason": "CANCELLED"})
        elif reason == "deadline":
            self._finish(name, FAILED, error={
                "code": "DEADLINE_EXCEEDED", "reason": "TIME_BUDGET_EXCEEDED",
                "message": f"the job exceeded its time budget of {record.time_budget_s:g}s",
                "metadata": {"time_budget_s": f"{record.time_budget_s:g}"}})
        elif outcome is None:
            how = f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
            log.error("the worker process ended without a result (%s)", how)
            self._finish(name, FAILED, error={"code": "INTERNAL", "reason": "WORKER_CRASHED",
                                              "message": f"the worker process ended without a result ({how})"})
        elif outcome[0] == "error":
            self._finish(name, FAILED, error=outcome[1])
        else:
            report, artifacts = outcome[1]["report"], outcome[1]["artifacts"]
            self.store.set_artifacts(name, [ArtifactRecord(**a) for a in artifacts])
            if report["status"] == "ok":
                self._finish(name, SUCCEEDED, report=report)
            else:
                metric = report["metric"]
                self._finish(name, FAILED, report=report, error={
                    "code": "FAILED_PRECONDITION", "reason": report["status"].upper(),
                    "message": f"{report['status']}: measured speedup {report['measured_speedup']:.3f}x (target "
                               f"{report['target_speedup']}), {metric['name']} {metric['baseline']:.4f} -> "
                               f"{metric['compressed']:.4f}; the best artifact can be downloaded",
                    "metadata": {"measured_speedup": f"{report['measured_speedup']:.4f}",
                                 "target_speedup": str(report["target_speedup"]),
                                 "metric": metric["name"], "metric_baseline": f"{metric['baseline']:.6g}",
                                 "metric_compressed": f"{metric['compressed']:.6g}",
                                 "relative_drop": f"{metric['relative_drop']:.6g}"}})

    def _finish(self, name: str, state: str, *, error: dict | None = None, report: dict | None = None) -> None:
        assert state in FINISHED
        record = self.store.get(name)
        progress = {**(record.progress if record else {}), "stage": "done",
                    "message": error["message"] if error else "done"}
        end = time.time()
        self.store.update(name, state=state, error=error, report=report, end_time=end, progress=progress)
        with operation_context(name):
            log.info("%s%s", state, f" ({error['code']}: {error['message']})" if error else "")
        self._publish(name, state, progress, done=True)
        self.feeds.pop(name, None)
        if self.metrics:
            self.metrics.finished.labels(state, error["code"] if error else "OK").inc()
            if record is not None and record.start_time:
                self.metrics.job_seconds.labels(state).observe(end - record.start_time)
        self._observe()

    def _observe(self) -> None:
        """Gauges from the store, the source of truth (a few ms; called on transitions only)."""
        if self.metrics is None:
            return
        counts = self.store.counts()
        for state in (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED):
            self.metrics.jobs.labels(state).set(counts.get(state, 0))
        self.metrics.queue_depth.set(len(self.queue))

    def _publish(self, name: str, state: str, progress: dict, done: bool = False) -> None:
        feed = self.feeds.setdefault(name, _Feed())
        feed.publish({"state": state, "time": time.time(), **progress}, done=done)

    async def _retention(self) -> None:
        while True:
            try:
                self.sweep()
            except Exception:
                log.exception("retention sweep failed")
            await asyncio.sleep(3600)

    def sweep(self, now: float | None = None) -> int:
        """Forget finished operations and unused uploads older than the retention period."""
        cutoff = (now or time.time()) - self.config.retention_s
        names = self.store.finished_before(cutoff)
        for name in names:
            for digest in self.store.delete(name):
                self.blobs.delete(digest)
        for digest, _ in self.store.forget_uploads_before(cutoff):
            if not self.store.referenced(digest):
                self.blobs.delete(digest)
        return len(names)


def _kill(process) -> None:
    if process.is_alive():
        process.kill()


def _detect_devices() -> list[str]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
        return True
    except ValueError:
        return False


def _parse_filter(text: str) -> list[tuple[str, Any]]:
    """The AIP-160 subset we serve: `key = value` terms joined by AND over state, done, model, method and
    labels.<key>."""
    where: list[tuple[str, Any]] = []
    if not text.strip():
        return where
    for term in re.split(r"\s+AND\s+", text.strip()):
        match = _FILTER_TERM.match(term)
        if not match:
            raise InvalidArgument([FieldViolation("filter", f"cannot parse {term!r}; expected key = value terms "
                                                            "joined by AND")])
        key, value = match.group(1), match.group(2) if match.group(2) is not None else match.group(3)
        if key == "state":
            if value.upper() not in (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED):
                raise InvalidArgument([FieldViolation("filter", f"unknown state {value!r}")])
            where.append(("state = ?", value.upper()))
        elif key == "done":
            if value not in ("true", "false"):
                raise InvalidArgument([FieldViolation("filter", "done takes true or false")])
            finished = ", ".join(f"'{s}'" for s in FINISHED)
            where.append((f"(state IN ({finished})) = ?", int(value == "true")))
        elif key in ("model", "calibration"):
            where.append((f"json_extract(spec, '$.references.{key}') = ?", value))
        elif key == "method":
            where.append(("json_extract(spec, '$.resolved.method') = ?", value))
        elif key.startswith("labels.") and _LABEL_KEY.match(key[7:]):
            where.append((f"json_extract(labels, '$.\"{key[7:]}\"') = ?", value))
        else:
            raise InvalidArgument([FieldViolation("filter", f"unknown filter field {key!r}; known: state, done, "
                                                            "model, calibration, method, labels.<key>")])
    return where


def _decode_token(token: str, fingerprint: str) -> tuple[float, str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        after = (float(data["t"]), str(data["n"]))
        same_filter = data["f"] == fingerprint
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise InvalidArgument([FieldViolation("page_token", "not a page token from this server")]) from None
    if not same_filter:
        raise InvalidArgument([FieldViolation("page_token", "the page token belongs to another filter")])
    return after
