"""Running jobs: the queue, one slot per job on an executor (`service.core.executor`), and how each job ends.

The scheduler starts the next queued job when a slot is free, persisting RUNNING and every progress event;
the worker's result or error, a cancel, the job's time budget, a crashed worker or a lost node end it
(`conclude`, with the `JobError` of its row of `service.core.outcomes.OUTCOMES`). After a restart, jobs that
were RUNNING are queued again (artifacts are content-addressed, so a re-run is safe) until `max_attempts`,
then fail INTERRUPTED; a job whose node left the cluster is queued again the same way (then NODE_LOST), and so is
one whose artifacts were deleted before it ended (an identical operation's blobs; then INTERNAL); a shutdown stops
running jobs and leaves them QUEUED without counting an attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sqlite3
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..job.report import Report
from ..logs import operation_context
from .blobs import BlobStore
from .config import ServiceConfig
from .executor import Attempt, Ended, Executor, Slot
from .feeds import Feeds
from .metrics import Metrics
from .outcomes import FINISHED, INTERNAL_MESSAGE, QUEUED, RUNNING, STATES, SUCCEEDED, JobError, out_of_disk
from .store import ArtifactRecord, JobRecord, JobStore
from .worker import WorkerArgs

log = logging.getLogger(__name__)

RESCHEDULE_S = 5.0  # the scheduler looks at the queue and the executor's slots at least this often
# seconds between the tries of recording a job's end when the store refuses the write (a disk I/O error, a full disk
# freed meanwhile): the worker's result is lost once the job is given up to `_unstick`, so it is tried again first
CONCLUDE_RETRY_S = (1.0, 4.0, 16.0)


@dataclass
class _Running:
    slot: Slot  # held from the moment the scheduler picks the job
    attempt: Attempt | None = None  # the run, once the executor made it
    stop_reason: str | None = None  # cancel | shutdown | deadline
    outcome: tuple[str, Any] | None = None  # what the worker sent last: its result or error

    def stop(self, reason: str) -> None:
        self.stop_reason = reason
        if self.attempt is not None:
            self.attempt.stop()


class Supervisor:
    def __init__(self, config: ServiceConfig, store: JobStore, blobs: BlobStore, feeds: Feeds,
                 metrics: Metrics | None, executor: Executor) -> None:
        self.config, self.store, self.blobs, self.feeds, self.metrics = config, store, blobs, feeds, metrics
        self.home = Path(config.home)
        self.executor = executor
        self.queue: deque[str] = deque()
        self.running: dict[str, _Running] = {}
        self.concluding: set[str] = set()  # jobs whose end `_conclude` is recording (their worker gone)
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self._wake = asyncio.Event()

    def recover(self) -> None:
        """After a (re)start: RUNNING jobs were interrupted; run them again or, out of attempts, fail them.
        Queue every QUEUED job in creation order."""
        for record in self.store.in_states([RUNNING]):
            if record.attempt >= self.config.max_attempts:
                self.finish(record.name, JobError.interrupted(record.attempt))
                continue
            self.store.update(record.name, state=QUEUED, progress={
                **record.progress, "stage": "queued",
                "message": f"re-queued: the server stopped during attempt {record.attempt}"})
            with operation_context(record.name):
                log.info("re-queued after a restart (attempt %d was interrupted)", record.attempt)
        for record in self.store.in_states([QUEUED]):
            self.enqueue(record.name)
        # scratch of jobs that ended while this server was down or before this release removed it at the end
        unfinished = {self.work_dir(r.name).name for r in self.store.in_states([QUEUED, RUNNING])}
        for folder in (self.home / "work").glob("*"):
            if folder.name not in unfinished:
                shutil.rmtree(folder, ignore_errors=True)

    def work_dir(self, name: str) -> Path:
        """The job's scratch on this server (its attempts' folders)."""
        return self.home / "work" / name.split("/", 1)[1]

    def enqueue(self, name: str) -> None:
        self.queue.append(name)
        self.feeds.of(name)
        self._wake.set()

    def cancel(self, name: str) -> None:
        """Cancel an unfinished job: a running one's worker is killed (the device is freed when the process is
        gone; the job ends CANCELLED when its supervision notices), a queued one ends at once."""
        running = self.running.get(name)
        if running is not None:
            if running.outcome is None:  # once its result is in, the job ends with it
                running.stop("cancel")
            return
        if name in self.concluding:  # its end is being recorded (the store refused a try): it ends with that
            return
        with contextlib.suppress(ValueError):
            self.queue.remove(name)
        self.finish(name, JobError.cancelled())

    async def drain(self, grace_s: float) -> None:
        """Start no more jobs; give running ones `grace_s` to finish, then stop them (they stay QUEUED)."""
        self.stopping = True
        pending = set(self.tasks)
        if pending:
            log.info("draining: waiting up to %.0fs for %d running job(s)", grace_s, len(pending))
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        for name, running in list(self.running.items()):
            if running.stop_reason is not None:  # a cancel or a deadline already on its way stays what it is
                continue
            with operation_context(name):
                log.info("stopped by shutdown; it runs again at the next start")
            running.stop("shutdown")
        if pending:
            await asyncio.wait(pending)

    async def schedule(self) -> None:
        """Forever: start queued jobs on free device slots."""
        while True:
            with contextlib.suppress(TimeoutError):  # also look again now and then: a cluster may have grown
                async with asyncio.timeout(RESCHEDULE_S):
                    await self._wake.wait()
            self._wake.clear()
            while self.queue and not self.stopping:
                try:
                    slots = self.executor.slots()
                except Exception:  # the executor cannot say now: look again at the next pass
                    log.exception("the executor could not list its slots")
                    break
                taken = {r.slot.name for r in self.running.values()}
                # a shrunk cluster may have fewer slots than running jobs: never more jobs than slots
                free = [s for s in slots if s.name not in taken][:max(0, len(slots) - len(self.running))]
                if not free:
                    break
                name = self.queue.popleft()
                try:
                    record = self.store.get(name)
                except Exception:  # the store cannot answer now (a full disk, a lock): the job waits its turn again
                    log.exception("the job store could not read %s; trying again at the next pass", name)
                    self.queue.appendleft(name)
                    break
                if record is None or record.state != QUEUED:
                    continue
                running = self.running[name] = _Running(free[0])  # the slot is taken before the task runs
                task = asyncio.create_task(self._run(record, running), name=f"job {name}")
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _run(self, record: JobRecord, running: _Running) -> None:
        with operation_context(record.name):  # every record logged while supervising names the job
            try:
                await self._supervise(record, running)
            except Exception as err:  # e.g. no space for the scratch directory, an executor that could not make the run
                log.exception("supervising the job failed")
                self._unstick(record.name, err)
            finally:
                if self.running.get(record.name) is running:  # the slot is free again, whatever happened
                    del self.running[record.name]
                self._wake.set()

    def _unstick(self, name: str, err: BaseException | None = None) -> None:
        """A job whose supervision failed outside its worker ends FAILED (internal, or out of disk where the disk
        refused a write: the scratch's, the store's own) rather than staying QUEUED or RUNNING in the store with
        nothing running it: off the queue, it would wait for a restart and count against `max_queue` until then,
        and its waiters would never hear of it."""
        try:
            record = self.store.get(name)
            if record is not None and record.state not in FINISHED:
                error = JobError.from_exception(err) if err is not None and out_of_disk(err) else None
                self.finish(name, error or JobError.of("internal", INTERNAL_MESSAGE))
        except Exception:  # the store itself failed: a restart's recovery is what is left
            log.exception("the job could not be ended either; it is recovered at the next start")

    async def _supervise(self, record: JobRecord, running: _Running) -> None:
        name, attempt, slot = record.name, record.attempt + 1, running.slot
        if running.stop_reason is not None:  # cancelled or shut down between the scheduler's pick and now
            del self.running[name]
            self.conclude(record, attempt, running.stop_reason, Ended(), None)
            return
        # the budget is the job's, not an attempt's: a re-run after a restart or a lost node has what is left of it
        budget = None if record.time_budget_s is None else record.time_budget_s - record.ran_s
        if budget is not None and budget <= 0:
            del self.running[name]
            self.conclude(record, attempt, "deadline", Ended(), None)
            return
        work = self.work_dir(name)
        shutil.rmtree(work, ignore_errors=True)  # an interrupted attempt's scratch
        work_dir = work / f"attempt-{attempt}"
        work_dir.mkdir(parents=True)
        progress = {"stage": "starting", "round": 0, "layer": 0, "layers": 0,
                    "message": f"attempt {attempt} on {slot.name}"}
        started = time.time()
        self.store.update(name, state=RUNNING, attempt=attempt, start_time=started, progress=progress)
        self.feeds.publish(name, RUNNING, progress)
        self.observe()
        stage, stage_start = progress["stage"], started
        # the job paces itself to its budget (`service.job.pacing`) as the supervisor enforces it
        spec = {**record.spec["resolved"], "time_budget": budget}
        args = WorkerArgs(name, spec, record.spec["references"], str(self.home), str(work_dir),
                          slot.device, os.getpid(), self.config.log_format)
        run = running.attempt = self.executor.attempt(args, slot)
        outcome: tuple[str, Any] | None = None
        ended = Ended()
        try:
            async with asyncio.timeout(budget):
                await run.start()
                log.info("attempt %d running on %s (%s)", attempt, slot.name, run.where)
                progress = {**progress, "message": f"attempt {attempt} on {slot.name}: {run.where}"}
                self.store.update(name, progress=progress)
                self.feeds.publish(name, RUNNING, progress)
                if running.stop_reason is not None:  # stopped while it started
                    run.stop()
                async for kind, payload in run.messages():
                    if kind == "progress":
                        self.store.update(name, progress=payload, ran_s=record.ran_s + time.time() - started)
                        self.feeds.publish(name, RUNNING, payload)
                        if payload.get("stage") != stage and self.metrics:
                            now = time.time()
                            self.metrics.stage_seconds.labels(stage).observe(now - stage_start)
                            stage, stage_start = payload.get("stage"), now
                    else:
                        outcome = running.outcome = (kind, payload)
                        if self.metrics:  # the last stage ends with the result (no next stage to time it)
                            self.metrics.stage_seconds.labels(stage).observe(time.time() - stage_start)
        except TimeoutError:
            if running.outcome is None:  # a result already in is the job's, however long its worker takes to exit
                running.stop(running.stop_reason or "deadline")
        except Exception:
            log.exception("supervising the worker failed")
        finally:
            try:
                ended = await run.end()  # the worker is gone (killed if it was not) once this returns
            except Exception as err:  # the job still ends: as a crash, with what went wrong
                log.exception("ending the attempt failed")
                ended = Ended(None, detail=f"the executor failed to end it: {type(err).__name__}")
            finally:
                del self.running[name]
                shutil.rmtree(work, ignore_errors=True)
                with contextlib.suppress(Exception):  # what a re-run's budget starts from (the store may be down)
                    self.store.update(name, ran_s=record.ran_s + time.time() - started)
                self._wake.set()
        await self._conclude(record, attempt, running.stop_reason, ended, outcome)

    async def _conclude(self, record: JobRecord, attempt: int, stop_reason: str | None, ended: Ended,
                        outcome: tuple[str, Any] | None) -> None:
        """`conclude`, tried again after each of CONCLUDE_RETRY_S when the store refuses its write: an attempt
        whose result is in must not end FAILED INTERNAL (`_unstick`, the last try's error) because the store
        failed for a moment. `conclude` writes before it publishes, so a try that failed changed nothing."""
        self.concluding.add(record.name)  # a cancel between the tries would be overwritten by the next one
        try:
            for delay in (*CONCLUDE_RETRY_S, None):
                try:
                    self.conclude(record, attempt, stop_reason, ended, outcome)
                    return
                except sqlite3.OperationalError as err:
                    if delay is None:
                        raise
                    log.warning("recording the end of attempt %d failed (%s); trying again in %gs", attempt, err,
                                delay)
                    await asyncio.sleep(delay)
        finally:
            self.concluding.discard(record.name)

    def conclude(self, record: JobRecord, attempt: int, stop_reason: str | None, ended: Ended,
                 outcome: tuple[str, Any] | None) -> None:
        """End a job whose worker is gone, from why it was stopped, how the worker ended and what it sent
        last: ("done", {"report", "artifacts"}) or ("error", JobError)."""
        name = record.name
        if stop_reason == "shutdown" and outcome is None:
            progress = {"stage": "queued", "round": 0, "layer": 0, "layers": 0,
                        "message": "interrupted by a server shutdown; runs again at the next start"}
            self.store.update(name, state=QUEUED, attempt=attempt - 1, progress=progress)
            self.feeds.publish(name, QUEUED, progress)  # its watchers hear why it stopped
            self.observe()
            return
        if ended.node_lost and outcome is None and stop_reason is None:
            if attempt < self.config.max_attempts:  # as after a server restart: the job runs again
                self._requeue(name, f"re-queued: its node left the cluster during attempt {attempt}")
                log.warning("re-queued: the node of attempt %d left the cluster (%s)", attempt, ended.detail)
                return
            self.finish(name, JobError.node_lost(attempt, ended.detail))
            return
        report, artifacts = None, []
        if outcome is not None and outcome[0] == "done":
            report, artifacts = outcome[1]["report"], [ArtifactRecord(**a) for a in outcome[1]["artifacts"]]
        if stop_reason == "cancel":
            error = JobError.cancelled()
        elif stop_reason == "deadline":
            try:  # the stage it was in (its last progress event), before `finish` records the end
                progress = (self.store.get(name) or record).progress
            except Exception:  # the store cannot say: the budget alone
                progress = {}
            stage = progress.get("stage")  # "queued": a re-run that had nothing left of the budget to start with
            error = JobError.time_budget_exceeded(record.time_budget_s, stage if stage != "queued" else None,
                                                  progress.get("round", 0))
        elif outcome is None:
            error = JobError.worker_crashed(ended.exitcode, ended.detail)
            log.error("%s", error.message)
        elif outcome[0] == "error":
            error = outcome[1]
        else:
            try:
                error = JobError.from_report(Report.from_json(report))
            except ValueError:  # a worker of another release, or a bug: the job cannot vouch for its result
                log.exception("the job's report does not read as a report")
                error = JobError.of("internal", INTERNAL_MESSAGE)
        kept = error.outcome.artifacts if error else True
        gone = [a.name for a in artifacts if kept and not self.blobs.exists(a.sha256)]
        if gone:  # an identical artifact's operation was deleted while this job ran, and its blob with it
            if attempt < self.config.max_attempts:  # content-addressed: a re-run writes it again
                self._requeue(name, f"re-queued: its artifacts ({', '.join(gone)}) were deleted before attempt "
                              f"{attempt} ended (an identical operation's, deleted meanwhile)")
                log.warning("re-queued: artifacts %s of attempt %d were deleted before it ended", gone, attempt)
                return
            error, kept = JobError.of("internal", INTERNAL_MESSAGE), False
        if not (kept and artifacts):  # published by the worker, then not wanted: nothing may keep them
            for artifact in artifacts:
                if not self.store.referenced(artifact.sha256):
                    self.blobs.delete(artifact.sha256)
        self.finish(name, error, report=report if kept else None, artifacts=artifacts if kept and artifacts else None)

    def _requeue(self, name: str, message: str) -> None:
        """Back in the queue for another attempt (the attempt just ended counts), saying why."""
        progress = {"stage": "queued", "round": 0, "layer": 0, "layers": 0, "message": message}
        self.store.update(name, state=QUEUED, progress=progress)
        self.feeds.publish(name, QUEUED, progress)
        self.enqueue(name)
        self.observe()

    def finish(self, name: str, error: JobError | None, report: dict | None = None,
               artifacts: Sequence[ArtifactRecord] | None = None) -> None:
        """The final state: SUCCEEDED without an error, else its outcome's state (FAILED or CANCELLED), and
        the artifacts it keeps, recorded in one transaction."""
        state = error.state if error else SUCCEEDED
        assert state in FINISHED
        record = self.store.get(name)
        progress = {**(record.progress if record else {}), "stage": "done",
                    "message": error.message if error else "done"}
        end = time.time()
        self.store.update(name, artifacts=artifacts, state=state, error=error, report=report, end_time=end,
                          progress=progress)
        # its scratch, whichever way it ended (an attempt's own end removes it too; a job failed at recovery, out of
        # attempts, or cancelled in the queue after a restart would keep its interrupted attempt's: a dense export)
        shutil.rmtree(self.work_dir(name), ignore_errors=True)
        with operation_context(name):
            log.info("%s%s", state, f" ({error.code}: {error.message})" if error else "")
        self.feeds.publish(name, state, progress, done=True)
        if self.metrics:
            self.metrics.finished.labels(state, error.code if error else "OK").inc()
            if record is not None and record.start_time:
                self.metrics.job_seconds.labels(state).observe(end - record.start_time)
        self.observe()

    def observe(self) -> None:
        """Gauges from the store, the source of truth (a few ms; called on transitions only)."""
        if self.metrics is None:
            return
        try:
            counts = self.store.counts()
        except sqlite3.Error:  # a gauge is not worth a transition: the next transition's reading corrects it
            log.warning("the job store did not answer the gauges' count", exc_info=True)
            return
        for state in STATES:
            self.metrics.jobs.labels(state).set(counts.get(state, 0))
        self.metrics.queue_depth.set(len(self.queue))


def detect_devices() -> list[str]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]

