"""The supervisor's conclusions without a transport: recovery after a restart, scheduling, cancelling,
and how each job ends."""

import asyncio

import pytest
from google.rpc import code_pb2

from service.api.wire import operation_of
from service.core import JobError, JobService
from service.core.executor import Ended
from service.core.outcomes import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from service.core.store import JobRecord, JobStore
from service.job.report import MetricResult, ParityFailure
from tests.service.core.service_helpers import running_record, service
from tests.service.job.reports import measured
from tests.service.job.reports import report as sample_report

REPORT = sample_report(measured=measured(measured_speedup=1.61), metric=MetricResult("top1", 0.9, 0.88, 0.022, {}),
                       layers=[]).to_json()


def test_a_restart_requeues_running_jobs_until_their_attempts_run_out(tmp_path):
    store = JobStore(tmp_path / "home" / "jobs.sqlite")
    for name, attempt in (("operations/a", 1), ("operations/b", 2)):
        store.insert(JobRecord(name=name, body_sha256="x", request=b"", spec={}, state=RUNNING, attempt=attempt))
    store.close()
    jobs = service(tmp_path, max_attempts=2)  # opening recovers
    again, exhausted = jobs.store.get("operations/a"), jobs.store.get("operations/b")
    assert again.state == QUEUED and "re-queued" in again.progress["message"]
    assert list(jobs.supervisor.queue) == [again.name]
    assert exhausted.state == FAILED and exhausted.error == JobError.interrupted(2)
    assert exhausted.error.code == "ABORTED" and exhausted.error.reason == "INTERRUPTED"


def test_a_restart_removes_the_scratch_of_jobs_that_will_not_run_again(tmp_path):
    """A server killed during a job leaves its attempt's folder (a dense export, for an LLM the model's size): the
    job that runs again clears it at its next attempt, one out of attempts or ended meanwhile must not keep it."""
    store = JobStore(tmp_path / "home" / "jobs.sqlite")
    for name, attempt, state in (("operations/again", 1, RUNNING), ("operations/spent", 2, RUNNING),
                                 ("operations/ended", 1, SUCCEEDED), ("operations/waiting", 0, QUEUED)):
        store.insert(JobRecord(name=name, body_sha256="x", request=b"", spec={}, state=state, attempt=attempt))
        scratch = tmp_path / "home" / "work" / name.split("/")[1] / f"attempt-{attempt}" / "out"
        scratch.mkdir(parents=True)
        (scratch / "model.onnx").write_bytes(b"dense")
    store.close()
    jobs = service(tmp_path, max_attempts=2)
    assert jobs.store.get("operations/spent").state == FAILED
    assert sorted(p.name for p in (tmp_path / "home" / "work").iterdir()) == ["again", "waiting"]
    jobs.supervisor.cancel("operations/waiting")  # cancelled in the queue: its scratch goes
    assert sorted(p.name for p in (tmp_path / "home" / "work").iterdir()) == ["again"]


def test_the_scheduler_gives_each_slot_one_job(tmp_path, monkeypatch):
    """Jobs picked in one pass of the scheduler each take a slot before any of them starts."""
    store = JobStore(tmp_path / "home" / "jobs.sqlite")
    for i in range(3):
        store.insert(JobRecord(name=f"operations/{i}", body_sha256="x", request=b"", spec={}, create_time=float(i)))
    store.close()
    jobs = service(tmp_path)
    started = []

    async def fake_run(record, running):
        started.append((record.name, running.slot.name))
        await asyncio.sleep(3600)

    async def main():
        monkeypatch.setattr(jobs.supervisor, "_run", fake_run)
        scheduler = asyncio.create_task(jobs.supervisor.schedule())
        await asyncio.sleep(0.05)
        scheduler.cancel()
        for task in [scheduler, *jobs.supervisor.tasks]:
            task.cancel()
        return list(jobs.supervisor.running), list(jobs.supervisor.queue)

    running, queued = asyncio.run(main())
    assert running == ["operations/0"] and started == [("operations/0", "cpu")]
    assert queued == ["operations/1", "operations/2"]


def _artifact(jobs: JobService, content: bytes) -> dict:
    writer = jobs.blobs.writer()
    writer.write(content)
    digest, size = writer.commit()
    return {"name": "model.onnx", "sha256": digest, "size_bytes": size, "media_type": "application/onnx"}


@pytest.mark.parametrize("status, state, code, kept", [
    ("ok", SUCCEEDED, code_pb2.OK, True),
    ("target_not_met", FAILED, code_pb2.FAILED_PRECONDITION, True),
    ("accuracy_budget_exceeded", FAILED, code_pb2.FAILED_PRECONDITION, True),
    ("parity_failed", FAILED, code_pb2.FAILED_PRECONDITION, True),
    ("a_status_nobody_added", FAILED, code_pb2.INTERNAL, False),
])
def test_a_report_ends_the_job_as_its_outcome_row_says(tmp_path, status, state, code, kept):
    jobs = service(tmp_path)
    record = running_record(jobs)
    artifact = _artifact(jobs, b"onnx bytes")
    report = {**REPORT, "status": status}
    if status == "parity_failed":  # what such a report adds: where the export failed, by how much
        report = sample_report(status="parity_failed", measured=None, message="parity_failed: the dense model's "
                               "export (fp32) fails the parity check: ...",
                               parity=ParityFailure("baseline", None, "fp32", {"peak": 1e-3, "aggregate": 1e-4},
                                                    "ParityError", "...", [])).to_json()
    jobs.supervisor.conclude(record, 1, None, Ended(0), ("done", {"report": report, "artifacts": [artifact]}))
    final = jobs.get(record.name)
    op = operation_of(final)
    assert final.state == state and op.error.code == code
    assert bool(final.artifacts) == kept and jobs.blobs.exists(artifact["sha256"]) == kept
    if status == "target_not_met":
        assert final.error.reason == "TARGET_NOT_MET" and final.error.metadata["measured_speedup"] == "1.6100"
        assert final.report["status"] == status  # the best round's report stays with the operation
    if status == "parity_failed":
        assert final.error.reason == "PARITY_FAILED" and final.error.metadata["stage"] == "baseline"


def test_stops_and_crashes_end_the_job_with_their_errors(tmp_path):
    jobs = service(tmp_path)
    cases = [("cancel", -9, None, CANCELLED, "CANCELLED"),
             ("deadline", -9, None, FAILED, "TIME_BUDGET_EXCEEDED"),
             (None, -11, None, FAILED, "WORKER_CRASHED"),
             (None, 0, ("error", JobError.from_exception(MemoryError())), FAILED, "OUT_OF_MEMORY")]
    for i, (stop, exitcode, outcome, state, reason) in enumerate(cases):
        record = running_record(jobs, f"operations/{i}", time_budget_s=4.0)
        jobs.supervisor.conclude(record, 1, stop, Ended(exitcode), outcome)
        final = jobs.get(record.name)
        assert (final.state, final.error.reason) == (state, reason)
    assert jobs.get("operations/1").error.message == "the job exceeded its time budget of 4s"
    assert "signal 11" in jobs.get("operations/2").error.message


def test_a_shutdown_leaves_the_job_queued_without_counting_the_attempt_and_its_watchers_hear_it(tmp_path):
    """The stopped job's watchers get its QUEUED event (their progress line said its last stage before), then
    their streams end once the service has drained instead of being cut by the transport's grace period."""
    jobs = service(tmp_path)
    record = running_record(jobs)

    async def main():
        seen = []

        async def watcher():
            async for event, _ in jobs.watch(record.name):
                seen.append(event and event["state"])

        task = asyncio.create_task(watcher())
        await asyncio.sleep(0.01)
        jobs.supervisor.conclude(record, 1, "shutdown", Ended(-9), None)
        await jobs.drain(0.0)
        await asyncio.wait_for(task, 5)
        return seen

    seen = asyncio.run(main())
    again = jobs.get(record.name)
    assert again.state == QUEUED and again.attempt == 0 and again.error is None
    assert seen == [None, QUEUED, None]  # the record, the event, the stored record the stream ends with


def test_a_lost_node_requeues_the_job_until_its_attempts_run_out(tmp_path):
    jobs = service(tmp_path, max_attempts=2)
    record = running_record(jobs)
    jobs.supervisor.conclude(record, 1, None, Ended(None, node_lost=True, detail="node 3b5c left"), None)
    again = jobs.get(record.name)
    assert again.state == QUEUED and again.attempt == 1 and again.error is None
    assert "left the cluster during attempt 1" in again.progress["message"]
    assert list(jobs.supervisor.queue) == [record.name]
    jobs.store.update(record.name, state=RUNNING, attempt=2)
    jobs.supervisor.conclude(jobs.get(record.name), 2, None, Ended(None, node_lost=True, detail="node 9f1a left"),
                             None)
    final = jobs.get(record.name)
    assert final.state == FAILED and (final.error.code, final.error.reason) == ("ABORTED", "NODE_LOST")
    assert "each of 2 attempts" in final.error.message and final.error.metadata["detail"] == "node 9f1a left"
    # a cancel while the node went away is still a cancel; a crash on a live node is a crash
    for i, (stop, ended, reason) in enumerate((("cancel", Ended(None, node_lost=True), "CANCELLED"),
                                               (None, Ended(None, detail="the actor died"), "WORKER_CRASHED"))):
        record = running_record(jobs, f"operations/{i}")
        jobs.supervisor.conclude(record, 1, stop, ended, None)
        assert jobs.get(record.name).error.reason == reason
    assert "the actor died" in jobs.get("operations/1").error.message


def test_a_shrunk_executor_starts_no_job_beyond_its_slots(tmp_path, monkeypatch):
    """A cluster that lost a node lists fewer slots than there are running jobs: nothing more starts."""
    from service.core.executor import Slot
    from service.core.supervisor import _Running

    store = JobStore(tmp_path / "home" / "jobs.sqlite")
    store.insert(JobRecord(name="operations/q", body_sha256="x", request=b"", spec={}))
    store.close()
    jobs = service(tmp_path)
    monkeypatch.setattr(jobs.executor, "slots", lambda: [Slot("ray-0", "auto")])
    jobs.supervisor.running["operations/r"] = _Running(Slot("ray-1", "auto"))  # started when there were two
    started = []

    async def fake_run(record, running):
        started.append(record.name)

    async def main():
        monkeypatch.setattr(jobs.supervisor, "_run", fake_run)
        scheduler = asyncio.create_task(jobs.supervisor.schedule())
        await asyncio.sleep(0.05)
        scheduler.cancel()
        return list(jobs.supervisor.queue)

    assert asyncio.run(main()) == ["operations/q"] and started == []


def test_a_cancel_after_the_result_arrived_leaves_the_job_its_result(tmp_path):
    from service.core.executor import Slot
    from service.core.supervisor import _Running

    jobs = service(tmp_path)
    stopped = []

    class Run:
        def stop(self):
            stopped.append(True)

    running = jobs.supervisor.running["operations/r"] = _Running(Slot("cpu", "cpu"), attempt=Run())
    running.outcome = ("done", {"report": REPORT, "artifacts": []})
    jobs.supervisor.cancel("operations/r")
    assert running.stop_reason is None and not stopped
    running.outcome = None
    jobs.supervisor.cancel("operations/r")
    assert running.stop_reason == "cancel" and stopped == [True]


def _queued(jobs: JobService, name: str = "operations/q", **fields) -> JobRecord:
    jobs.store.insert(JobRecord(name=name, body_sha256="x", request=b"", spec={"resolved": {}, "references": {}},
                                **fields))
    return jobs.store.get(name)


def test_a_result_whose_final_write_fails_for_a_moment_is_kept(tmp_path, monkeypatch):
    """The store refuses the write of a finished job once (a disk I/O error): the end is recorded again and the job
    SUCCEEDS with its artifact, instead of ending FAILED INTERNAL and losing the result its worker delivered. A store
    that keeps refusing still ends in `_unstick` after the tries."""
    import sqlite3

    from service.core import supervisor as sup
    from service.core.executor import Slot
    from service.core.supervisor import _Running

    jobs = service(tmp_path)
    artifact = _artifact(jobs, b"a model")

    class Attempt:
        where = "here"

        async def start(self):
            pass

        async def messages(self):
            yield "done", {"report": REPORT, "artifacts": [artifact]}

        def stop(self):
            pass

        async def end(self):
            return Ended(0)

    real_update = jobs.store.update
    written = []

    def update(name, artifacts=None, **fields):
        written.append(fields.get("state"))
        if fields.get("state") in (SUCCEEDED, FAILED) and failures:
            jobs.supervisor.cancel(name)  # a cancel between the tries: the end being recorded is the job's
            raise failures.pop()
        return real_update(name, artifacts, **fields)

    monkeypatch.setattr(jobs.executor, "attempt", lambda args, slot: Attempt())
    monkeypatch.setattr(jobs.store, "update", update)
    monkeypatch.setattr(sup, "CONCLUDE_RETRY_S", (0.01, 0.01))
    for name, refusals, state in (("operations/once", 1, SUCCEEDED), ("operations/always", 3, FAILED)):
        failures = [sqlite3.OperationalError("disk I/O error")] * refusals
        record = _queued(jobs, name)
        running = jobs.supervisor.running.setdefault(name, _Running(Slot("cpu", "cpu")))
        asyncio.run(jobs.supervisor._run(record, running))
        final = jobs.get(name)
        assert final.state == state and not failures, name
        if state == SUCCEEDED:
            assert [a.sha256 for a in final.artifacts] == [artifact["sha256"]] and final.report is not None
            assert CANCELLED not in written  # never CANCELLED (published as done) and then SUCCEEDED
        else:  # three refusals: the tries are spent, `_unstick` ends it (its own write went through)
            assert final.error.code == "INTERNAL"
        assert name not in jobs.supervisor.running


def test_a_job_whose_supervision_fails_before_its_worker_ends_failed_not_stuck(tmp_path):
    """No scratch directory can be made (here: a file where the work folder goes): the job ends FAILED INTERNAL
    and its slot is free, instead of staying QUEUED off the queue until a restart."""
    from service.core.executor import Slot
    from service.core.outcomes import INTERNAL_MESSAGE
    from service.core.supervisor import _Running

    jobs = service(tmp_path)
    record = _queued(jobs)
    (tmp_path / "home" / "work").write_text("not a folder")
    running = jobs.supervisor.running[record.name] = _Running(Slot("cpu", "cpu"))
    asyncio.run(jobs.supervisor._run(record, running))
    final = jobs.get(record.name)
    assert final.state == FAILED and (final.error.code, final.error.message) == ("INTERNAL", INTERNAL_MESSAGE)
    assert record.name not in jobs.supervisor.running


def test_a_job_whose_scratch_the_disk_refuses_ends_out_of_disk(tmp_path, monkeypatch):
    """ENOSPC making its scratch (or the store's own write of the result) ended the job INTERNAL, "an internal
    error": the machine's disk, said as such."""
    import errno

    from service.core.executor import Slot
    from service.core.supervisor import _Running

    jobs = service(tmp_path)
    record = _queued(jobs)
    real = type(tmp_path).mkdir

    def full(self, *args, **kwargs):
        if "attempt-" in self.name:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "mkdir", full)
    running = jobs.supervisor.running[record.name] = _Running(Slot("cpu", "cpu"))
    asyncio.run(jobs.supervisor._run(record, running))
    final = jobs.get(record.name)
    assert final.state == FAILED and (final.error.code, final.error.reason) == ("RESOURCE_EXHAUSTED", "OUT_OF_DISK")
    assert str(tmp_path) not in final.error.message


def test_a_result_that_arrived_before_the_time_budget_ran_out_is_the_jobs(tmp_path, monkeypatch):
    """The worker sent its result, then took past the budget to exit (its clean-up): the job ends with the
    result, not TIME_BUDGET_EXCEEDED with its artifacts deleted; a worker with no result by then still times out."""
    from service.core.executor import Slot
    from service.core.supervisor import _Running

    jobs = service(tmp_path)
    artifact = _artifact(jobs, b"the compressed model")

    class SlowToExit:
        def __init__(self, result):
            self.result, self.stopped = result, False

        where = "here"

        async def start(self):
            pass

        async def messages(self):
            if self.result is not None:
                yield self.result
            await asyncio.sleep(3600)  # still exiting when the budget runs out

        def stop(self):
            self.stopped = True

        async def end(self):
            return Ended(-9 if self.stopped else 0)

    done = ("done", {"report": REPORT, "artifacts": [artifact]})
    for name, result, state in (("operations/a", done, SUCCEEDED), ("operations/b", None, FAILED)):
        monkeypatch.setattr(jobs.executor, "attempt", lambda args, slot, result=result: SlowToExit(result))
        record = _queued(jobs, name, time_budget_s=0.2)
        running = jobs.supervisor.running[name] = _Running(Slot("cpu", "cpu"))
        asyncio.run(jobs.supervisor._run(record, running))
        final = jobs.get(name)
        assert final.state == state
        if state == SUCCEEDED:
            assert [a.sha256 for a in final.artifacts] == [artifact["sha256"]] and jobs.blobs.exists(artifact["sha256"])
        else:  # where it was stopped, so a user knows what took the time
            assert final.error.reason == "TIME_BUDGET_EXCEEDED"
            assert final.error.message == "the job exceeded its time budget of 0.2s in stage starting"
            assert final.error.metadata["stage"] == "starting"


def test_a_shutdown_leaves_a_pending_cancel_a_cancel(tmp_path):
    from service.core.executor import Slot
    from service.core.supervisor import _Running

    jobs = service(tmp_path)
    running = jobs.supervisor.running["operations/c"] = _Running(Slot("cpu", "cpu"), stop_reason="cancel")
    asyncio.run(jobs.supervisor.drain(0.0))
    assert running.stop_reason == "cancel"


def test_a_result_whose_artifact_was_deleted_meanwhile_runs_again(tmp_path):
    """The worker's artifact matched a blob that an identical operation's deletion removed before the job ended:
    the job is queued again (a re-run writes the blob again) while attempts remain, never SUCCEEDED with an
    artifact that cannot be downloaded; out of attempts it fails INTERNAL."""
    jobs = service(tmp_path, max_attempts=2)
    artifact = _artifact(jobs, b"a model an identical operation also returned")
    jobs.blobs.delete(artifact["sha256"])  # that operation deleted, its blob referenced by nobody else
    done = ("done", {"report": REPORT, "artifacts": [artifact]})
    record = running_record(jobs)
    jobs.supervisor.conclude(record, 1, None, Ended(0), done)
    again = jobs.get(record.name)
    assert again.state == QUEUED and "model.onnx" in again.progress["message"] and not again.artifacts
    assert list(jobs.supervisor.queue) == [record.name]
    jobs.store.update(record.name, state=RUNNING, attempt=2)
    jobs.supervisor.conclude(jobs.get(record.name), 2, None, Ended(0), done)
    final = jobs.get(record.name)
    assert final.state == FAILED and final.error.code == "INTERNAL" and not final.artifacts


def test_a_store_error_while_picking_a_job_leaves_it_queued_and_the_scheduler_running(tmp_path, monkeypatch):
    import sqlite3

    from service.core import supervisor as sup

    store = JobStore(tmp_path / "home" / "jobs.sqlite")
    store.insert(JobRecord(name="operations/0", body_sha256="x", request=b"", spec={}, create_time=0.0))
    store.close()
    jobs = service(tmp_path)
    started, failures = [], [sqlite3.OperationalError("disk I/O error")]
    real_get = jobs.store.get

    def flaky_get(name):
        if failures:
            raise failures.pop()
        return real_get(name)

    async def fake_run(record, running):
        started.append(record.name)
        await asyncio.sleep(3600)

    async def main():
        monkeypatch.setattr(jobs.store, "get", flaky_get)
        monkeypatch.setattr(jobs.supervisor, "_run", fake_run)
        monkeypatch.setattr(sup, "RESCHEDULE_S", 0.02)
        scheduler = asyncio.create_task(jobs.supervisor.schedule())
        await asyncio.sleep(0.2)
        alive = not scheduler.done()
        for task in [scheduler, *jobs.supervisor.tasks]:
            task.cancel()
        return alive

    assert asyncio.run(main())
    assert started == ["operations/0"]  # picked at the next pass


def test_a_time_budget_spans_the_attempts_of_a_job(tmp_path, monkeypatch):
    """A job re-run after a restart (or a lost node) has what is left of its budget, not a fresh one: each progress
    event records the seconds run, the next attempt's worker is paced to the rest, and a job with nothing left ends
    TIME_BUDGET_EXCEEDED without starting a worker."""
    from service.core.executor import Slot
    from service.core.supervisor import _Running

    jobs = service(tmp_path)
    seen = {}

    class Attempt:
        where = "here"

        def __init__(self, args):
            seen["budget"] = args.spec["time_budget"]

        async def start(self):
            pass

        async def messages(self):
            yield "progress", {"stage": "statistics", "round": 0, "layer": 0, "layers": 0, "message": ""}
            await asyncio.sleep(0.3)
            yield "error", JobError.of("internal", "stopped here")

        def stop(self):
            pass

        async def end(self):
            return Ended(0)

    monkeypatch.setattr(jobs.executor, "attempt", lambda args, slot: Attempt(args))
    record = _queued(jobs, "operations/t", time_budget_s=100.0, ran_s=40.0)
    asyncio.run(jobs.supervisor._run(record, jobs.supervisor.running.setdefault(record.name,
                                                                               _Running(Slot("cpu", "cpu")))))
    assert seen["budget"] == pytest.approx(60.0)  # the worker paces itself to what is left
    assert 40.3 <= jobs.store.get(record.name).ran_s < 45  # the attempt's seconds are added to the job's

    seen.clear()
    spent = _queued(jobs, "operations/spent", time_budget_s=100.0, ran_s=100.5)
    asyncio.run(jobs.supervisor._run(spent, jobs.supervisor.running.setdefault(spent.name,
                                                                              _Running(Slot("cpu", "cpu")))))
    final = jobs.get(spent.name)
    assert not seen and final.state == FAILED and final.error.reason == "TIME_BUDGET_EXCEEDED"
    assert final.error.message == "the job exceeded its time budget of 100s"
    assert spent.name not in jobs.supervisor.running


def test_a_store_of_the_last_release_gains_the_seconds_run(tmp_path):
    """Schema 2 -> 3 adds `ran_s` (0 for jobs that were written before it) without losing a row."""
    import sqlite3

    from service.core.store import MIGRATIONS

    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    for version in range(2):
        db.executescript(f"BEGIN; {MIGRATIONS[version]} PRAGMA user_version = {version + 1}; COMMIT;")
    db.execute("INSERT INTO operations (name, body_sha256, request, spec, labels, time_budget_s, state, progress, "
               "create_time) VALUES ('operations/old', 'x', x'', '{}', '{}', 30.0, 'QUEUED', '{}', 1.0)")
    db.close()
    record = JobStore(path).get("operations/old")
    assert (record.time_budget_s, record.ran_s, record.state) == (30.0, 0.0, QUEUED)
