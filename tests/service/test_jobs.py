"""The service core without a transport: validation, retention, recovery after a restart, scheduling and how
each job ends (the supervisor's conclusions)."""

import asyncio
import json
import os
import time

import pytest
from google.rpc import code_pb2

from service.core import JobError, JobService, ServiceConfig, SubmitRequest
from service.core.executor import Ended
from service.core.outcomes import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED
from service.core.store import ArtifactRecord, JobRecord, JobStore
from service.core.submission import check_model
from service.errors import FailedPrecondition, InvalidArgument, NotFound
from service.wire import operation_of

REPORT = {"status": "ok", "measured_speedup": 1.61, "target_speedup": 1.5, "layers": [], "method": "osscar",
          "metric": {"name": "top1", "baseline": 0.9, "compressed": 0.88, "relative_drop": 0.022},
          "baseline_latency_ms": 2.0, "compressed_latency_ms": 1.24, "execution_provider": "cpu",
          "params_before": 100, "params_after": 60, "elapsed_s": 3.0}


def service(tmp_path, **config) -> JobService:
    jobs = JobService(ServiceConfig(home=tmp_path / "home", **{"devices": ("cpu",), **config}))
    jobs.open()
    return jobs


def submit(jobs: JobService, **spec) -> None:
    request = SubmitRequest(spec={"uniform_ratio": 0.5, **spec}, body=b"", body_sha256="x")
    asyncio.run(jobs.submit(request))


def running_record(jobs: JobService, name: str = "operations/r", **fields) -> JobRecord:
    jobs.store.insert(JobRecord(name=name, body_sha256="x", request=b"", spec={}, state=RUNNING, attempt=1,
                                start_time=time.time(), **fields))
    return jobs.store.get(name)


def test_retention_forgets_old_finished_jobs_and_their_blobs(tmp_path):
    jobs = service(tmp_path, retention_s=3600)
    writer = jobs.blobs.writer()
    writer.write(b"an artifact")
    digest, size = writer.commit()
    now = time.time()
    for name, state, end in (("operations/old", SUCCEEDED, now - 7200), ("operations/new", SUCCEEDED, now - 60),
                             ("operations/running", RUNNING, None)):
        jobs.store.insert(JobRecord(name=name, body_sha256="x", request=b"", spec={}, state=state, end_time=end,
                                    create_time=now - 9000))
    jobs.store.set_artifacts("operations/old", [ArtifactRecord("model.onnx", digest, size, "application/onnx")])
    assert jobs.sweep(now) == 1
    assert jobs.store.get("operations/old") is None and not jobs.blobs.exists(digest)
    assert jobs.store.get("operations/new") and jobs.store.get("operations/running")


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


def test_submit_lists_every_violation_and_resolves_references(tmp_path):
    jobs = service(tmp_path)
    with pytest.raises(InvalidArgument) as err:
        submit(jobs, model="relative.pt2", calibration="", method="magic", samples=0)
    fields = {v.field for v in err.value.violations}
    assert {"model", "calibration", "method", "samples"} <= fields
    with pytest.raises(NotFound, match="no such model"):
        submit(jobs, model=str(tmp_path / "missing.pt2"), calibration="embedded:calibration.txt")
    folder = tmp_path / "bert-like"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "opt", "do_layer_norm_before": false}')
    with pytest.raises(FailedPrecondition) as refused:
        submit(jobs, model=str(folder), calibration="embedded:calibration.txt")
    assert refused.value.reason == "UNSUPPORTED_ARCHITECTURE" and "post-norm OPT" in str(refused.value)
    assert (jobs.home / "embedded" / "calibration.txt").read_text().count("\n\n") >= 90  # built once, on demand


@pytest.mark.parametrize("config, refusal", [
    ({"model_type": "opt", "do_layer_norm_before": False}, "UNSUPPORTED_ARCHITECTURE"),
    ({"model_type": "gpt_neox"}, "UNSUPPORTED_ARCHITECTURE"),
    ({"model_type": "opt"}, "safetensors"),  # pre-norm OPT passes the architecture check
    ({"model_type": "resnet", "num_channels": 3}, "safetensors"),  # an image model: pruned as a conv graph
    ([1, 2], "not a JSON object"),
])
def test_the_model_check_uses_the_compressors_architecture_rules(tmp_path, config, refusal):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((FailedPrecondition, InvalidArgument)) as err:
        check_model(tmp_path, "the-model")
    assert refusal in (getattr(err.value, "reason", "") + str(err.value))
    if refusal == "UNSUPPORTED_ARCHITECTURE":
        assert err.value.metadata["model_type"] == config["model_type"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    if refusal == "safetensors":
        check_model(tmp_path, "the-model")  # now acceptable


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


def test_a_queued_job_cancels_at_once_with_the_cancelled_error(tmp_path):
    jobs = service(tmp_path)
    jobs.store.insert(JobRecord(name="operations/q", body_sha256="x", request=b"", spec={}))
    jobs.supervisor.enqueue("operations/q")
    record = asyncio.run(jobs.cancel("operations/q"))
    assert record.state == CANCELLED and record.error == JobError.cancelled() and record.attempt == 0
    assert list(jobs.supervisor.queue) == []
    assert operation_of(record).error.code == code_pb2.CANCELLED


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
        report.update(message="parity_failed: the dense model's export (fp32) fails the parity check: ...",
                      parity={"stage": "baseline", "round": None, "precision": "fp32", "error": "ParityError",
                              "mismatches": [], "tolerance": {"peak": 1e-3, "aggregate": 1e-4}})
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


def test_a_shutdown_leaves_the_job_queued_without_counting_the_attempt(tmp_path):
    jobs = service(tmp_path)
    record = running_record(jobs)
    jobs.supervisor.conclude(record, 1, "shutdown", Ended(-9), None)
    again = jobs.get(record.name)
    assert again.state == QUEUED and again.attempt == 0 and again.error is None


def test_a_worker_raising_a_plain_value_error_fails_internal_and_an_input_error_invalid_argument(
        tmp_path, monkeypatch, caplog):
    """The worker's own error path, in process: only the compressor's input errors are the caller's."""
    import multiprocessing
    import os

    from compressor.errors import CalibrationError
    from service import logs
    from service.core import worker

    monkeypatch.setattr(worker, "die_with_parent", lambda pid: None)
    monkeypatch.setattr(os, "nice", lambda n: 0)
    monkeypatch.setattr(logs, "configure", lambda log_format: None)
    jobs = service(tmp_path)
    codes = {}
    for i, err in enumerate((ValueError("secret path /srv/x"), CalibrationError("cal.npz: no images"))):
        def failing(args, send, current, blobs, err=err):
            raise err

        monkeypatch.setattr(worker, "_compress", failing)
        receiver, sender = multiprocessing.Pipe(duplex=False)
        work = tmp_path / f"work-{i}"
        work.mkdir()
        worker.run(worker.WorkerArgs(f"operations/{i}", {}, {}, str(jobs.home), str(work), "cpu", 1), sender)
        kind, error = receiver.recv()
        assert kind == "error" and not work.exists()
        record = running_record(jobs, f"operations/{i}")
        jobs.supervisor.conclude(record, 1, None, Ended(0), (kind, error))
        status = operation_of(jobs.get(record.name)).error
        codes[type(err).__name__] = (status.code, status.message)
    assert codes["ValueError"] == (code_pb2.INTERNAL, "the job failed with an internal error (logged on the server)")
    assert codes["CalibrationError"] == (code_pb2.INVALID_ARGUMENT, "cal.npz: no images")
    assert any(r.exc_info and "secret path" in str(r.exc_info[1]) for r in caplog.records)  # logged, not sent


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


def test_a_device_named_twice_is_two_slots(tmp_path):
    jobs = service(tmp_path, devices=("cpu", "cpu", "cuda:1"))
    slots = jobs.executor.slots()
    assert [s.name for s in slots] == ["cpu", "cpu#2", "cuda:1"] and [s.device for s in slots] == ["cpu", "cpu",
                                                                                                    "cuda:1"]
    cores = sorted(os.sched_getaffinity(0))
    # the two CPU slots share the cores between them, none twice; the GPU slot is not pinned
    assert sorted(slots[0].cores + slots[1].cores) == cores and slots[0].cores and slots[1].cores
    assert slots[2].cores == ()
    assert service(tmp_path / "one", devices=("cpu",)).executor.slots()[0].cores == ()  # alone: every core
    with pytest.raises(ValueError, match="needs a core of its own"):
        service(tmp_path / "many", devices=("cpu",) * (len(cores) + 1))


def test_cores_are_shared_in_contiguous_near_equal_parts():
    from service.core.executor import share_cores

    assert share_cores(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert share_cores([0, 1], 2) == [[0], [1]]
    assert share_cores([0], 2) is None


def _pinned_report(core: int, out) -> None:
    import threading

    import torch

    from service.core.worker import pin

    seen = {}
    started = threading.Event()
    done = threading.Event()

    def before() -> None:  # a thread that existed before the pin
        started.set()
        done.wait(10)
        seen["thread"] = sorted(os.sched_getaffinity(0))

    thread = threading.Thread(target=before)
    thread.start()
    started.wait(10)
    pin([core])
    done.set()
    thread.join(10)
    out.send({"main": sorted(os.sched_getaffinity(0)), "thread": seen["thread"], "torch": torch.get_num_threads()})


def test_a_pinned_worker_keeps_every_thread_on_its_cores():
    import multiprocessing

    core = sorted(os.sched_getaffinity(0))[-1]
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_pinned_report, args=(core, sender))
    process.start()
    report = receiver.recv()
    process.join(30)
    assert report == {"main": [core], "thread": [core], "torch": 1}


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
