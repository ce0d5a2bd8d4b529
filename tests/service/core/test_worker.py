"""The worker process: its error path and its pinning to cores."""

import os

import pytest
from google.rpc import code_pb2

from service.api.wire import operation_of
from service.core.executor import Ended
from tests.service.core.service_helpers import running_record, service


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
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what a cpu slot's worker sets: this process's, until the end
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


def test_a_gpu_slot_is_the_workers_only_visible_gpu(monkeypatch):
    """ONNX Runtime's CUDA provider and its bound inputs take device 0: a worker on slot cuda:1 timed on slot 0's
    GPU. The slot becomes the only visible GPU, counted among the server's own visible ones."""
    from service.core.worker import visible_device

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_device("cuda:1") == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_device("cuda:1") == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    # a cpu slot on a GPU node timed its ONNX Runtime sessions on GPU 0 (the default provider), beside slot cuda:0's
    # job and without the machine's latency lock: it sees no GPU now
    assert visible_device("cpu") == "cpu" and os.environ["CUDA_VISIBLE_DEVICES"] == ""


def _closes_then_exits(sender) -> None:
    import time

    sender.close()
    time.sleep(0.3)  # still exiting when the supervisor reads the end of its stream
    raise SystemExit(3)


def test_a_worker_that_closed_its_pipe_ends_with_its_own_exit_code():
    """Ending an attempt killed the worker before joining it: one still exiting read as signal 9."""
    import asyncio
    import multiprocessing

    from service.core.executor import _LocalAttempt

    attempt = _LocalAttempt.__new__(_LocalAttempt)
    context = multiprocessing.get_context("spawn")
    attempt.receiver, sender = context.Pipe(duplex=False)
    attempt.process = context.Process(target=_closes_then_exits, args=(sender,))
    attempt.process.start()
    sender.close()

    async def main():
        return [m async for m in attempt.messages()], await attempt.end()

    messages, ended = asyncio.run(main())
    assert messages == [] and ended.exitcode == 3


def test_a_job_reads_a_linked_input_by_the_name_the_client_gave_it(tmp_path, monkeypatch):
    """The spec holds the checked target (a Hugging Face cache's blob has no extension); the job's request names it
    as the reference did, so its loaders read the format."""
    from pathlib import Path

    from service import job
    from service.core import worker

    blob = tmp_path / "blobs" / "0a1b2c"
    blob.parent.mkdir()
    blob.write_bytes(b"program")
    seen = {}

    def compress(request, **_kwargs):
        seen["model"] = Path(str(request.model))
        raise RuntimeError("stop here")

    monkeypatch.setattr(job, "compress", compress)
    work = tmp_path / "work"
    spec = {"model": str(blob), "calibration": "/data/c.jsonl", "uniform_ratio": 0.5}
    args = worker.WorkerArgs("operations/n", spec, {"model": "/hub/snapshots/main/model.pt2",
                                                    "calibration": "/data/c.jsonl"}, str(tmp_path), str(work), "cpu", 1)
    with pytest.raises(RuntimeError, match="stop here"):
        worker._compress(args, lambda message: None, {"stage": "", "round": 0}, None)
    assert seen["model"].name == "model.pt2" and seen["model"].resolve() == blob
    assert seen["model"].parent.parent == work / "inputs"


def test_a_watcher_sees_the_clients_names_not_the_servers_paths(tmp_path, monkeypatch):
    """Progress lines name the job's output and inputs as the client named them: the server's scratch and blob paths
    never reach a watcher (they stay in the server's log)."""
    from compressor.progress import note
    from service import job
    from service.core import worker

    blob = tmp_path / "blobs" / "0a1b2c"
    blob.parent.mkdir()
    blob.write_bytes(b"program")
    work = tmp_path / "work"

    def compress(request, progress, **_kwargs):
        progress(note(f"read {request.model}; ok: wrote {request.out_dir} in 1.0s"))
        raise RuntimeError("stop here")

    monkeypatch.setattr(job, "compress", compress)
    sent = []
    args = worker.WorkerArgs("operations/n", {"model": str(blob)}, {"model": "blob:0a1b2c/model.pt2"}, str(tmp_path),
                             str(work), "cpu", 1)
    with pytest.raises(RuntimeError, match="stop here"):
        worker._compress(args, sent.append, {"stage": "", "round": 0}, None)
    [(kind, event)] = sent
    assert kind == "progress" and str(tmp_path) not in event["message"], event
    assert "read blob:0a1b2c/model.pt2; ok: wrote the job's artifacts in 1.0s" in event["message"]


def test_a_jobs_error_names_its_inputs_as_the_client_gave_them(tmp_path, monkeypatch):
    """An input error carries the path the job read (the server's blob store): the client is told the reference."""
    from compressor.errors import ModelReferenceError
    from service import job
    from service.core import worker

    blob = tmp_path / "home" / "blobs" / "files" / "0a1b" / "broken.pt2"

    def compress(request, **_kwargs):
        raise ModelReferenceError(f"{request.model} is not a loadable torch.export program: File is not a zip file")

    monkeypatch.setattr(job, "compress", compress)
    sent = []
    args = worker.WorkerArgs("operations/n", {"model": str(blob)}, {"model": "blob:sha256:0a1b/broken.pt2"},
                             str(tmp_path / "home"), str(tmp_path / "work"), "cpu", 1)
    worker.execute(args, sent.append, None)
    [(kind, error)] = sent
    assert kind == "error" and error.code == "INVALID_ARGUMENT"
    assert error.message == "blob:sha256:0a1b/broken.pt2 is not a loadable torch.export program: File is not a zip file"


def test_a_jobs_words_name_no_path_of_the_servers_home(tmp_path):
    """A second job of one model read "dense statistics: cached curves /srv/osscar/curves/baa4....json": the home's
    paths are the server's, as its scratch is."""
    from service.core.worker import WorkerArgs, redact, server_paths

    home = tmp_path / "home"
    args = WorkerArgs("operations/1", {"model": str(tmp_path / "m.pt2")}, {"model": "my-model.pt2"}, str(home),
                      str(home / "work" / "1" / "attempt-1"), "cpu", 1)
    shown = server_paths(args)
    said = redact(f"dense statistics: cached curves {home}/curves/baa4.json; model {tmp_path / 'm.pt2'}; "
                  f"wrote {home}/work/1/attempt-1/out/model.onnx", shown)
    assert said == ("dense statistics: cached curves the server's home/curves/baa4.json; model my-model.pt2; "
                    "wrote the job's artifacts/model.onnx")
    assert str(tmp_path) not in said
