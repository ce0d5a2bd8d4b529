"""The job service without a transport: retention and cancelling a queued job."""

import asyncio
import os
import time
from pathlib import Path

import pytest
from google.rpc import code_pb2

from service.api.wire import operation_of
from service.core import JobError
from service.core.outcomes import CANCELLED, RUNNING, SUCCEEDED
from service.core.store import ArtifactRecord, JobRecord
from tests.service.core.service_helpers import service


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


def test_a_queued_job_cancels_at_once_with_the_cancelled_error(tmp_path):
    jobs = service(tmp_path)
    jobs.store.insert(JobRecord(name="operations/q", body_sha256="x", request=b"", spec={}))
    jobs.supervisor.enqueue("operations/q")
    record = asyncio.run(jobs.cancel("operations/q"))
    assert record.state == CANCELLED and record.error == JobError.cancelled() and record.attempt == 0
    assert list(jobs.supervisor.queue) == []
    assert operation_of(record).error.code == code_pb2.CANCELLED


def test_retention_keeps_the_uploads_of_jobs_still_to_run(tmp_path, monkeypatch):
    """An upload unused for longer than the retention period is forgotten, unless a queued or running job names
    it (a job queued before a long outage would otherwise fail INPUT_NOT_FOUND when it starts)."""
    from service.core.outcomes import QUEUED

    jobs = service(tmp_path, retention_s=3600)
    digests = []
    for content in (b"the queued job's model", b"nobody's"):
        writer = jobs.blobs.writer()
        writer.write(content)
        digests.append(writer.commit()[0])
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - 7200)  # both uploads last used two hours ago
    for digest in digests:
        jobs.store.record_upload(digest, "model.pt2", False, 10)
    monkeypatch.undo()
    jobs.store.insert(JobRecord(name="operations/q", body_sha256="x", request=b"", state=QUEUED,
                                spec={"references": {"model": f"blob:sha256:{digests[0]}/model.pt2"}}))
    jobs.sweep(now)
    assert jobs.blobs.exists(digests[0]) and not jobs.blobs.exists(digests[1])
    assert jobs.store.referenced(digests[0]) and not jobs.store.referenced(digests[1])


def test_a_drained_service_still_reads_its_operations_until_closed(tmp_path):
    """Shutdown drains the jobs before the transport stops: a wait that runs out meanwhile reads its operation
    (it got INTERNAL from a closed store); the store closes only with `close`, after the transport."""
    jobs = service(tmp_path)
    jobs.store.insert(JobRecord(name="operations/q", body_sha256="x", request=b"", spec={}))
    asyncio.run(jobs.drain(0.0))
    assert not jobs.accepting and jobs.get("operations/q").name == "operations/q"
    jobs.close()
    assert not jobs.store.ping()


def test_a_home_that_takes_no_write_is_not_accepting(tmp_path, monkeypatch, caplog):
    """A home that stopped taking writes under a running server (remounted read-only, a full disk) still answers the
    store's read: the health check said SERVING and sent it work that could only fail. Now not accepting after a
    probe that fails, said once in the log, and accepting again once the home takes writes; a disk with less than
    HOME_MIN_FREE left is full for it. The probe leaves no file in the home."""
    import errno
    import logging

    from service.core import service as core

    jobs = service(tmp_path)
    before = sorted(p.name for p in jobs.home.iterdir())
    assert jobs.probe_home() and jobs.accepting
    real_open = os.open
    refusing = [True]

    def open_(path, flags, *args):
        if refusing[0] and Path(path).name.startswith(".health-probe"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(core.os, "open", open_)
    with caplog.at_level(logging.INFO, logger="service.core.service"):
        assert not jobs.probe_home() and not jobs.probe_home()
        assert not jobs.accepting and jobs.store.ping()
        refusing[0] = False
        assert jobs.probe_home() and jobs.accepting
        monkeypatch.setattr(core, "HOME_MIN_FREE", 1 << 62)  # more than any disk has free
        assert not jobs.probe_home() and not jobs.accepting
    said = [r.getMessage() for r in caplog.records]
    assert sum("cannot be written (Read-only file system)" in m for m in said) == 1
    assert sum("takes writes again" in m for m in said) == 1
    assert any("MiB free, under" in m for m in said)
    assert sorted(p.name for p in jobs.home.iterdir()) == before


def test_retention_removes_blobs_nothing_names_once_old(tmp_path):
    """A worker stopped between writing its artifact and reporting it leaves a blob that no operation or upload
    names: it goes once older than the retention period. A named old blob stays, and so does an unnamed recent
    one (a running job's, not reported yet); writing old content again makes it recent."""
    import os

    jobs = service(tmp_path, retention_s=3600)
    digests = {}
    for label in ("orphan", "artifact", "recent", "written again"):
        writer = jobs.blobs.writer()
        writer.write(label.encode())
        digests[label] = writer.commit()[0]
    now = time.time()
    for label in ("orphan", "artifact", "written again"):
        os.utime(jobs.blobs.path(digests[label]), (now - 7200, now - 7200))
    jobs.store.insert(JobRecord(name="operations/done", body_sha256="x", request=b"", spec={}, state=SUCCEEDED,
                                end_time=now - 60))
    jobs.store.set_artifacts("operations/done", [ArtifactRecord("model.onnx", digests["artifact"], 8, "x")])
    writer = jobs.blobs.writer()
    writer.write(b"written again")
    writer.commit()
    jobs.sweep(now)
    assert {label for label, digest in digests.items() if jobs.blobs.exists(digest)} == \
        {"artifact", "recent", "written again"}


async def _chunks(*parts: bytes):
    for part in parts:
        yield part


def test_an_upload_is_recorded_before_its_view_is_built(tmp_path, monkeypatch):
    """The blob's commit and view (a tar's extraction: seconds) run in a thread: a delete of an operation whose
    artifact has the same bytes, or a sweep, must meanwhile see the blob in use, not remove it under an upload about
    to answer OK."""
    from service.core import UploadHeader

    jobs = service(tmp_path)
    real_view, seen = jobs.blobs.view, []

    def view(digest, filename, archive):
        seen.append(jobs.store.referenced(digest))
        return real_view(digest, filename, archive)

    monkeypatch.setattr(jobs.blobs, "view", view)
    real_writer = jobs.blobs.writer

    def writer():  # a sweep that listed the blob old must see it in use once the upload writes it again
        made = real_writer()
        commit = made.commit
        made.commit = lambda: (seen.append(jobs.store.referenced(made.hash.hexdigest())), commit())[1]
        return made

    monkeypatch.setattr(jobs.blobs, "writer", writer)
    reference, digest, _ = asyncio.run(jobs.upload(UploadHeader("model.pt2"), _chunks(b"pt2 bytes")))
    assert seen == [True, True] and jobs.blobs.exists(digest) and reference.endswith("/model.pt2")
    # an archive that does not extract leaves no upload row and no blob
    from service.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        asyncio.run(jobs.upload(UploadHeader("m", archive=True), _chunks(b"not a tar")))
    assert jobs.store.db.execute("SELECT COUNT(*) FROM uploads").fetchone()[0] == 1


def test_an_upload_refused_for_its_archive_flag_leaves_the_earlier_upload_of_its_bytes(tmp_path):
    """The same bytes and name uploaded as a file, then as an archive: the second is refused, and the first upload
    (which queued jobs may name) keeps its row, blob and view; they were all deleted."""
    from service.core import UploadHeader
    from service.errors import InvalidArgument

    jobs = service(tmp_path)
    _, digest, _ = asyncio.run(jobs.upload(UploadHeader("m.bin"), _chunks(b"some bytes")))
    with pytest.raises(InvalidArgument, match="already here as a file"):
        asyncio.run(jobs.upload(UploadHeader("m.bin", archive=True), _chunks(b"some bytes")))
    assert jobs.store.has_upload(digest, "m.bin") and jobs.blobs.exists(digest)
    assert (jobs.blobs.files / digest / "m.bin").read_bytes() == b"some bytes"


def test_an_upload_refused_beside_a_concurrent_one_of_its_bytes_leaves_that_ones_answer_good(tmp_path, monkeypatch):
    """One content and name uploaded as a file and as an archive at once: the archive's finishes while the file's
    builds its view, so the file's is refused. It shared the archive's row and, having recorded it first, forgot it
    and deleted the blob and the archive's view under the archive's OK."""
    import io
    import tarfile

    from service.core import UploadHeader
    from service.errors import InvalidArgument

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("config.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    content = buffer.getvalue()
    jobs = service(tmp_path)
    real_view, answers = jobs.blobs.view, []

    async def main():
        loop = asyncio.get_running_loop()

        def view(digest, filename, archive):
            if not archive and not answers:  # the archive's upload runs start to end meanwhile
                answers.append(asyncio.run_coroutine_threadsafe(
                    jobs.upload(UploadHeader("m", archive=True), _chunks(content)), loop).result())
            return real_view(digest, filename, archive)

        monkeypatch.setattr(jobs.blobs, "view", view)
        with pytest.raises(InvalidArgument, match="already here as a directory"):
            await jobs.upload(UploadHeader("m"), _chunks(content))

    asyncio.run(main())
    _, digest, _ = answers[0]
    assert jobs.store.has_upload(digest, "m") and jobs.blobs.exists(digest)
    assert (jobs.blobs.files / digest / "m" / "config.json").read_text() == "{}"


def test_a_forgotten_upload_whose_content_is_an_artifact_loses_its_view(tmp_path, monkeypatch):
    """Retention forgets an old upload; an operation's artifact with the same bytes keeps the blob. Its view must
    go too: a new job naming the upload would otherwise be accepted with nothing keeping the blob for it."""
    from service.core import UploadHeader

    jobs = service(tmp_path, retention_s=3600)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - 7200)
    _, digest, size = asyncio.run(jobs.upload(UploadHeader("model.pt2"), _chunks(b"pt2 bytes")))
    monkeypatch.undo()
    jobs.store.insert(JobRecord(name="operations/a", body_sha256="x", request=b"", spec={}, state=SUCCEEDED,
                                end_time=now))
    jobs.store.set_artifacts("operations/a", [ArtifactRecord("model.pt2", digest, size, "application/zip")])
    view = jobs.blobs.files / digest / "model.pt2"
    assert view.exists()
    jobs.sweep(now)
    assert jobs.blobs.exists(digest) and not view.exists()


def test_an_upload_that_goes_silent_is_ended_and_leaves_nothing(tmp_path):
    """A client that sends a header and a chunk, then nothing, held its RPC slot and temporary file for as long as it
    kept the stream open (a few such streams filled --max-concurrent-rpcs): it is ended after `upload_idle_s`."""
    from service.core import UploadHeader
    from service.errors import InvalidArgument

    jobs = service(tmp_path, upload_idle_s=0.2)

    async def stalls():
        yield b"first bytes"
        await asyncio.sleep(3600)

    with pytest.raises(InvalidArgument, match=r"no data for 0\.2s"):
        asyncio.run(asyncio.wait_for(jobs.upload(UploadHeader("m.bin"), stalls()), 10))
    assert not any(jobs.blobs.tmp.iterdir())
    assert jobs.store.db.execute("SELECT COUNT(*) FROM uploads").fetchone()[0] == 0


def test_a_second_server_on_one_home_is_refused_while_the_first_runs(tmp_path):
    """A second `osscar serve` on the same OSSCAR_HOME took the first one's running job for an interrupted one,
    deleted its scratch under it and ran it again: refused in one line now, and the home is free once the first
    has gone."""
    import subprocess
    import sys

    from service.core.service import HomeInUse
    from tests.service.server_process import ROOT

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from service.core import JobService; "
         "from service.core.config import ServiceConfig; "
         "s = JobService(ServiceConfig(home=Path(sys.argv[1]), devices=('cpu',))); s.open(); print('open', "
         "flush=True); time.sleep(60)", str(tmp_path / "home")], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(HomeInUse, match=f"in use by another osscar server \\(pid {holder.pid}\\)"):
            service(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    jobs = service(tmp_path)  # the kernel released the dead server's lock
    jobs.close()


def test_a_home_on_a_file_system_without_record_locks_still_serves_and_says_so(tmp_path, monkeypatch, caplog):
    """ENOLCK (an NFS mount without a lock daemon) is no other server: the home opens, with a warning."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    jobs = service(tmp_path)
    assert any("cannot be locked" in r.getMessage() for r in caplog.records)
    jobs.close()


def test_a_home_that_cannot_be_used_is_refused_in_one_line(tmp_path):
    """A home the server cannot write (here its lock file a folder) or a store that is no database ended `osscar serve`
    with a PermissionError / sqlite3.DatabaseError traceback."""
    from service.core.service import HomeUnusable

    (tmp_path / "a" / "home" / "server.lock").mkdir(parents=True)  # what the server must write, not writable
    with pytest.raises(HomeUnusable, match=r"cannot be the server's home: Is a directory .*server.lock"):
        service(tmp_path / "a")
    (tmp_path / "b" / "home").mkdir(parents=True)
    (tmp_path / "b" / "home" / "jobs.sqlite").write_bytes(b"\x01" * 4096)
    with pytest.raises(HomeUnusable, match=r"jobs.sqlite cannot be read .*move it aside"):
        service(tmp_path / "b")
