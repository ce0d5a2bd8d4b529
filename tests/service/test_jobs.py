"""The service core without a transport: validation, retention, filters and recovery after a restart."""

import asyncio
import time

import pytest

from service.errors import FailedPrecondition, InvalidArgument, NotFound
from service.jobs import JobService, ServiceConfig, SubmitRequest, _parse_filter
from service.store import FAILED, QUEUED, RUNNING, SUCCEEDED, ArtifactRecord, JobRecord, JobStore


def service(tmp_path, **config) -> JobService:
    jobs = JobService(ServiceConfig(home=tmp_path / "home", devices=("cpu",), **config))
    jobs.store = JobStore(jobs.home / "jobs.sqlite")
    return jobs


def submit(jobs: JobService, **spec) -> None:
    request = SubmitRequest(spec={"uniform_ratio": 0.5, **spec}, body=b"", body_sha256="x")
    asyncio.run(jobs.submit(request))


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
    jobs = service(tmp_path, max_attempts=2)
    for name, attempt in (("operations/a", 1), ("operations/b", 2)):
        jobs.store.insert(JobRecord(name=name, body_sha256="x", request=b"", spec={}, state=RUNNING, attempt=attempt))
    jobs._recover()
    again, exhausted = jobs.store.get("operations/a"), jobs.store.get("operations/b")
    assert again.state == QUEUED and "re-queued" in again.progress["message"] and list(jobs.queue) == [again.name]
    assert exhausted.state == FAILED and exhausted.error["reason"] == "INTERRUPTED"


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
    assert refused.value.reason == "UNSUPPORTED_ARCHITECTURE"
    assert (jobs.home / "embedded" / "calibration.txt").read_text().count("\n\n") >= 90  # built once, on demand


@pytest.mark.parametrize("text, sql", [
    ("", []),
    ('state = running AND labels.team = "ml"', ["state = ?", "json_extract(labels, '$.\"team\"') = ?"]),
    ("done = true", ["(state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')) = ?"]),
])
def test_filters_become_parameterised_conditions(text, sql):
    assert [condition for condition, _ in _parse_filter(text)] == sql


@pytest.mark.parametrize("text", ["state = SLEEPING", "done = maybe", "labels.Bad = x", "x = 1 OR y = 2",
                                  "model ~ x", "labels.a = \"x\" AND"])
def test_bad_filters_are_invalid_arguments(text):
    with pytest.raises(InvalidArgument):
        _parse_filter(text)
