"""`JobService`: the service core's one entry point, transport-agnostic.

The gRPC layer converts protobuf to and from these calls and maps `service.errors` to status codes.
Life of a job: `submit` validates synchronously (`submission`: every field violation at once, references
resolved, the architecture checked), dedupes by request_id and persists it QUEUED; the `supervisor` runs
it in a worker process on a free device slot and ends it SUCCEEDED / FAILED / CANCELLED (`outcomes`);
nothing is left without a final state. Watchers follow the in-memory `feeds`; the `store` is the source of
truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from compressor.errors import InputError

from ..errors import (
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from ..fields import check_request_id
from ..files import ArchiveError
from ..job.request import REFERENCES
from ..logs import operation_context
from .blobs import BlobStore, valid_digest, valid_filename
from .config import ServiceConfig
from .executor import Executor, LocalExecutor
from .feeds import Feeds
from .metrics import Metrics
from .outcomes import CANCELLED, QUEUED, RUNNING
from .references import resolve, upload_of
from .store import ArtifactRecord, JobRecord, JobStore
from .submission import SubmitRequest, validate
from .supervisor import Supervisor, detect_devices

log = logging.getLogger(__name__)

MAX_LIST_TEXT = 2048  # filter and page_token characters
DEFAULT_PAGE, MAX_PAGE = 50, 1000
CANCEL_WAIT_S = 30.0  # CancelOperation answers once the worker is gone, or after this
HOME_MIN_FREE = 64 << 20  # bytes the home's disk keeps free while the server says SERVING


@dataclass(frozen=True)
class UploadHeader:
    filename: str
    archive: bool = False
    size_bytes: int = 0  # 0: not declared
    sha256: str = ""  # "": not declared


class HomeInUse(InputError):
    """Another server holds this OSSCAR_HOME."""


class HomeUnusable(InputError):
    """OSSCAR_HOME cannot be written, or its job store cannot be read: the operator's to fix, said in one line."""


class JobService:
    def __init__(self, config: ServiceConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.home = Path(config.home)
        self.blobs = BlobStore(self.home / "blobs")
        self.feeds = Feeds()
        self.store: JobStore | None = None  # from `open`
        self.supervisor: Supervisor | None = None
        self.executor: Executor | None = None  # from `open`
        self._home_lock: int | None = None  # from `open`: the descriptor holding the home's lock
        self.draining = False
        self._writable = True  # the home's last write probe (`probe_home`)
        self._background: list[asyncio.Task] = []
        # uploads under way by (digest, file name): a failed one forgets the upload's row only when it is the
        # only one (two of one content and name at once share that row)
        self._uploading: Counter[tuple[str, str]] = Counter()

    # ---- life cycle ------------------------------------------------------------------------------

    def open(self) -> None:
        """Open (and migrate) the store, remove what a crash left half-written, recover the jobs a stop
        interrupted and queue the queued ones; nothing runs until `start`. The home is this process's alone
        while it is open (`HomeInUse` otherwise)."""
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            self._lock_home()
            self.store = JobStore(self.home / "jobs.sqlite")
        except OSError as err:  # a read-only home, a file in its place: a traceback said less than this
            raise HomeUnusable(f"{self.home} cannot be the server's home: {err.strerror or err}"
                               f"{f' ({err.filename})' if err.filename else ''}") from None
        except sqlite3.DatabaseError as err:  # not a database, or a damaged one
            raise HomeUnusable(f"the job store {self.home / 'jobs.sqlite'} cannot be read ({err}): restore it from "
                               "a backup, or move it aside to start with an empty store (its jobs are then lost)"
                               ) from None
        removed = self.blobs.clean_tmp()
        if removed:
            log.info("removed %d partial files left by an interrupted write", removed)
        self.executor = self._executor()
        self.executor.referenced = self.store.referenced  # what a half-imported result may delete
        self.supervisor = Supervisor(self.config, self.store, self.blobs, self.feeds, self.metrics, self.executor)
        self.supervisor.recover()
        self.supervisor.observe()

    def _lock_home(self) -> None:
        """A second server on this home would take the first one's running jobs for interrupted ones, delete their
        scratch and re-run them, and empty its partial uploads: refused. A POSIX record lock: the process's own
        (a second service of one process shares it), released by the kernel when the process dies."""
        path = self.home / "server.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: another process holds it
            holder = path.read_text().strip() or "another process"
            os.close(fd)
            raise HomeInUse(f"{self.home} is in use by another osscar server (pid {holder}); give this one its own "
                            "--home") from None
        except OSError as err:  # a file system without record locks (ENOLCK): run, but say what is not guarded
            log.warning("%s cannot be locked (%s): nothing stops a second server on this home", path, err)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._home_lock = fd  # held (open) for the process's life or until `close`

    def _executor(self) -> Executor:
        if self.config.executor == "ray":
            from .ray_executor import RayExecutor  # ray is an optional extra

            return RayExecutor(self.config, self.blobs)
        assert self.config.executor == "local", f"unknown executor {self.config.executor!r}"
        return LocalExecutor(list(self.config.devices or detect_devices()), self.blobs)

    async def start(self) -> None:
        self.open()
        self._background = [asyncio.create_task(self.supervisor.schedule(), name="scheduler"),
                            asyncio.create_task(self._retention(), name="retention")]
        log.info("job service: %s, %s executor, slots %s, queue limit %d", self.home, self.executor.name,
                 ",".join(s.name for s in self.executor.slots()), self.config.max_queue)

    @property
    def accepting(self) -> bool:
        """Whether work is taken (the health check's SERVING): not draining, the home took its last write probe
        (`probe_home`), and the store answers."""
        return not self.draining and self.store is not None and self._writable and self.store.ping()

    def probe_home(self) -> bool:
        """Whether a new file can be written in the home and its disk has HOME_MIN_FREE left; kept for `accepting`
        and said in the log when it changes. A home remounted read-only, a full disk or permissions changed under a
        running server still answer the store's SELECT, then refuse every job's write: a health check that said
        SERVING kept sending it work that could only fail. Blocking (a hung network file system): the server runs it
        in a thread."""
        probe = self.home / f".health-probe.{os.getpid()}.{uuid.uuid4().hex}"
        try:
            # a new file each time: one file rewritten in place gets its own freed block back on a full disk
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"\0" * 4096)
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
            stat = os.statvfs(self.home)
            free = stat.f_bavail * stat.f_frsize
            writable, why = free >= HOME_MIN_FREE, f"{free >> 20} MiB free, under {HOME_MIN_FREE >> 20} MiB"
        except OSError as err:
            writable, why = False, err.strerror or str(err)
        if writable != self._writable:
            if writable:
                log.info("%s takes writes again: serving", self.home)
            else:
                log.error("%s cannot be written (%s): NOT_SERVING until it can", self.home, why)
            self._writable = writable
        return writable

    async def drain(self, grace_s: float) -> None:
        """Stop taking work; give running jobs `grace_s` to finish, then stop them and leave them QUEUED
        for the next start (an interruption by shutdown does not count as an attempt)."""
        self.draining = True
        await self.supervisor.drain(grace_s)
        self.feeds.end_all()  # the stopped jobs' QUEUED events are out: the watchers' streams end with them
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.executor.close()

    def close(self) -> None:
        """Close the store, once the transport answers no more calls (after `drain`): a wait that runs out while
        the server stops still reads its operation."""
        self.store.close()
        if self._home_lock is not None:
            os.close(self._home_lock)  # the home is free for the next server
            self._home_lock = None

    # ---- operations ------------------------------------------------------------------------------

    async def submit(self, request: SubmitRequest) -> JobRecord:
        if (earlier := self._earlier(request)) is not None:
            return earlier
        accepted = await asyncio.to_thread(validate, request, home=self.home, blobs=self.blobs,
                                           policy=self.config.policy)
        # from here on the event loop's alone (no await up to the insert): what the thread could not see (a drain,
        # the same request_id submitted twice at once)
        if (earlier := self._earlier(request)) is not None:
            return earlier
        for field, reference in accepted.references.items():
            if (upload := upload_of(reference)) is not None:  # a delete or sweep meanwhile may have removed it
                resolve(reference, field, REFERENCES[field], self.blobs, self.home, self.config.policy)
                self.store.touch_upload(*upload)
        refused = self.executor.refusals(accepted.resolved, accepted.references)
        if refused:
            raise InvalidArgument(refused)
        if self.store.count(QUEUED) >= self.config.max_queue:
            raise ResourceExhausted(f"the job queue is full ({self.config.max_queue} waiting); retry later",
                                    self.config.retry_after_s)
        record = JobRecord(
            name=f"operations/{uuid.uuid4()}", body_sha256=request.body_sha256, request=request.body,
            spec={"resolved": accepted.resolved, "references": accepted.references}, labels=dict(request.labels),
            request_id=request.request_id or None, time_budget_s=request.time_budget_s,
            progress={"stage": "queued", "round": 0, "layer": 0, "layers": 0, "message": "queued"})
        self.store.insert(record)
        self.supervisor.enqueue(record.name)
        with operation_context(record.name):
            log.info("queued: %s", accepted.references.get("model"))
        self.supervisor.observe()
        return self.store.get(record.name)

    def _earlier(self, request: SubmitRequest) -> JobRecord | None:
        """The operation an earlier call with this request_id made (the same body: a retry), else None; refused
        while draining, or when the request_id was used for another body."""
        if self.draining:
            raise Unavailable("the server is shutting down; retry against another instance or later")
        if not request.request_id:
            return None
        check_request_id(request.request_id)
        earlier = self.store.by_request_id(request.request_id)
        if earlier is not None and earlier.body_sha256 != request.body_sha256:
            raise AlreadyExists("operation", earlier.name, f"request_id {request.request_id} was used for a "
                                f"different request ({earlier.name}); use a new request_id")
        return earlier

    def get(self, name: str) -> JobRecord:
        record = self.store.get(name) if name.startswith("operations/") else None
        if record is None:
            if not name.startswith("operations/"):
                raise InvalidArgument([FieldViolation("name", f"expected operations/<id>, got {name!r}")])
            raise NotFound("operation", name)
        return record

    def list(self, filter_text: str, page_size: int, page_token: str,
             weigh: Callable[[JobRecord], int] | None = None, budget: int = 0) -> tuple[list[JobRecord], str]:
        """A page of operations (`store.search`; `weigh` and `budget` bound the page's size in bytes, say)."""
        if len(filter_text) > MAX_LIST_TEXT or len(page_token) > MAX_LIST_TEXT:
            raise InvalidArgument([FieldViolation("filter", f"filter and page_token are at most {MAX_LIST_TEXT} "
                                                            "characters")])
        if page_size < 0:
            raise InvalidArgument([FieldViolation("page_size", f"must be >= 0 (got {page_size})")])
        return self.store.search(filter_text, min(page_size or DEFAULT_PAGE, MAX_PAGE), page_token, weigh, budget)

    async def cancel(self, name: str) -> JobRecord:
        record = self.get(name)
        if record.state == CANCELLED:
            return record
        if record.done:
            raise FailedPrecondition("OPERATION_DONE", f"{name} already ended {record.state}; nothing to cancel",
                                     {"state": record.state})
        self.supervisor.cancel(name)
        return await self.wait(name, CANCEL_WAIT_S)

    async def delete(self, name: str) -> None:
        record = self.get(name)
        if not record.done:
            raise FailedPrecondition("OPERATION_NOT_DONE", f"{name} is {record.state}; cancel it before deleting "
                                     "it", {"state": record.state})
        for digest in self.store.delete(name):
            self.blobs.delete(digest)
        self.feeds.close(name)
        with operation_context(name):
            log.info("deleted")
        self.supervisor.observe()

    async def wait(self, name: str, timeout_s: float | None) -> JobRecord:
        if timeout_s is not None and (not math.isfinite(timeout_s) or timeout_s < 0):  # long ones are capped
            raise InvalidArgument([FieldViolation("timeout", f"must be >= 0 (got {timeout_s})")])
        record = self.get(name)
        if record.done:
            return record
        timeout = min(self.config.default_wait_s if timeout_s is None else timeout_s, self.config.max_wait_s)
        await self.feeds.wait_done(name, timeout)
        return self.get(name)

    async def watch(self, name: str) -> AsyncIterator[tuple[dict | None, JobRecord | None]]:
        """(None, record) first, then (event, None) as they happen, then (None, record) when done."""
        record = self.get(name)
        if record.done:
            yield None, record
            return
        feed = self.feeds.of(name)  # taken before the first yield: an end while the caller sends is not missed
        cursor = feed.seq
        yield None, record
        async for event in feed.follow(cursor):
            yield event, None
        final = self.store.get(name)
        if final is not None:
            yield None, final

    # ---- blobs -----------------------------------------------------------------------------------

    async def upload(self, header: UploadHeader, chunks: AsyncIterator[bytes]) -> tuple[str, str, int]:
        """Store an upload; returns (reference, sha256, size)."""
        violations = []
        if not valid_filename(header.filename):
            violations.append(FieldViolation("header.filename", "a plain file name is required: ASCII letters, "
                                                                "digits, spaces and ._+- (no separator, at most 255; "
                                                                f"got {header.filename!r})"))
        if header.size_bytes < 0 or header.size_bytes > self.config.max_upload_bytes:
            violations.append(FieldViolation("header.size_bytes", f"must be in [0, {self.config.max_upload_bytes}] "
                                                                  f"(got {header.size_bytes})"))
        if header.sha256 and not valid_digest(header.sha256):
            violations.append(FieldViolation("header.sha256", "must be 64 lowercase hex digits"))
        if violations:
            raise InvalidArgument(violations)
        writer = self.blobs.writer()
        try:
            while True:
                try:  # a stream that goes silent would hold its RPC slot (and its temporary file) for ever
                    chunk = await asyncio.wait_for(anext(chunks), self.config.upload_idle_s)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise InvalidArgument([FieldViolation("chunk", f"no data for {self.config.upload_idle_s:g}s; the "
                                                                   "upload was ended (send it again)")]) from None
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
        except BaseException:
            writer.abort()
            raise
        # recorded before the blob is committed and its view built (both in a thread): a delete or retention sweep
        # meanwhile sees the blob in use, instead of removing it (a sweep that listed it old, before this upload
        # wrote it again) under an upload about to answer OK
        digest, size = writer.hash.hexdigest(), writer.size
        key = (digest, header.filename)
        earlier = self.store.has_upload(*key)  # the same bytes and name, uploaded before
        self.store.record_upload(digest, header.filename, header.archive, size)
        self._uploading[key] += 1

        def alone() -> bool:
            """Whether the row is this upload's alone: an earlier upload of these bytes and name, or one under way
            beside it, keeps it (forgetting it deleted their blob and view under an OK)."""
            return not earlier and self._uploading[key] == 1

        try:
            try:
                await asyncio.to_thread(writer.commit)
            except BaseException:
                writer.abort()
                if alone() and not self.blobs.exists(digest):
                    self.store.forget_upload(*key)
                raise
            try:
                await asyncio.to_thread(self.blobs.view, digest, header.filename, header.archive)
            except ArchiveError as err:
                # a view of the other kind under the name (an earlier or a concurrent upload's: the row, blob and view
                # stay theirs), or an archive that does not extract (this upload's alone: nothing of it stays)
                if alone() and not (self.blobs.files / digest / header.filename).exists():
                    self.store.forget_upload(*key)
                    if not self.store.referenced(digest):
                        self.blobs.delete(digest)
                raise InvalidArgument([FieldViolation("header.archive", str(err))]) from None
        finally:
            self._uploading[key] -= 1
            if not self._uploading[key]:
                del self._uploading[key]
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

    # ---- retention -------------------------------------------------------------------------------

    async def _retention(self) -> None:
        while True:
            try:
                self.sweep()
            except Exception:
                log.exception("retention sweep failed")
            await asyncio.sleep(3600)

    def sweep(self, now: float | None = None) -> int:
        """Forget finished operations, unused uploads and blobs nothing names, older than the retention period."""
        cutoff = (now or time.time()) - self.config.retention_s
        for record in self.store.in_states([QUEUED, RUNNING]):  # a job still to run keeps its uploads, however
            for reference in record.spec.get("references", {}).values():  # long it waited (a server down a while)
                if (upload := upload_of(reference)) is not None:
                    self.store.touch_upload(*upload)
        names = self.store.finished_before(cutoff)
        for name in names:
            for digest in self.store.delete(name):
                self.blobs.delete(digest)
        for digest, filename in self.store.forget_uploads_before(cutoff):
            if not self.store.referenced(digest):
                self.blobs.delete(digest)
            else:  # the content lives on as an artifact: its upload's view goes, so no new job can name it
                self.blobs.delete_view(digest, filename)
        # blobs no operation or upload names: a worker stopped between writing its artifacts and reporting them
        # (a cancel, a deadline, a crash) leaves them; no job runs for the retention period, so none still writes them
        for digest in self.blobs.written_before(cutoff):
            if not self.store.referenced(digest):
                self.blobs.delete(digest)
        self.blobs.clean_tmp(dead_only=True)  # a killed worker's half-written blob or tar
        return len(names)
