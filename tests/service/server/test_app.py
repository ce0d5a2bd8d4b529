"""The gRPC service end to end: a real `osscar serve` subprocess on a free port, the real client."""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import signal
import tarfile
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from google.longrunning import operations_pb2
from google.rpc import code_pb2, error_details_pb2
from grpc_health.v1 import health_pb2

from service.api import compression_pb2 as pb
from service.api.wire import error_details, unpack_metadata, unpack_response
from service.client import cli
from service.client.transport import RemoteCompressor
from tests.compressor.cnn.conv_models import write_conv_job
from tests.service.server_process import ServerProcess, wait_gone

SERVING = health_pb2.HealthCheckResponse.SERVING
CIFAR = {"mean": [0.4914, 0.4822, 0.4465], "std": [0.247, 0.243, 0.261]}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpc-data")
    write_conv_job(root, size=32)
    (root / "weights.pth").write_bytes(b"not a model")
    (root / "no-config").mkdir()
    (root / "qwen2_moe").mkdir()
    (root / "qwen2_moe" / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "num_experts": 0}))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("grpc") / "home", "--max-queue", "2").start()
    yield process
    assert process.stop() == 0  # SIGTERM: drains and exits cleanly


def tiny_request(data: Path, **fields) -> pb.CompressRequest:
    request = pb.CompressRequest(model=str(data / "model.pt2"), calibration=str(data / "cal.npz"),
                                 uniform_ratio=0.5, request_id=str(uuid.uuid4()), labels={"suite": "grpc"})
    request.options.samples = 16
    request.options.repeats = 15  # a 1-2 ms model: fewer samples can measure it slower than dense
    request.options.refine_steps = 0  # about the service, not the graph's fit
    for key, value in fields.items():
        setattr(request, key, value) if not isinstance(value, dict) else getattr(request, key).update(value)
    return request


def long_request(shared: Path, repeats: int) -> pb.CompressRequest:
    """ResNet-20 with many latency repeats: a job that runs for a while in its measure stage."""
    request = pb.CompressRequest(model=str(shared / "resnet-cifar10/resnet20.pt2"),
                                 calibration=str(shared / "cifar10/train_prefix_5085.npz"), uniform_ratio=0.5,
                                 request_id=str(uuid.uuid4()))
    request.options.samples = 32
    request.options.repeats = repeats
    request.options.refine_steps = 0  # the graph's fit is not what these tests are about (10 s a run)
    # about scheduling and restarts: ResNet-20 at a uniform 0.5 is below the default cosine floor (0.86)
    request.no_accuracy_budget = True
    request.options.mean.extend(CIFAR["mean"])
    request.options.std.extend(CIFAR["std"])
    return request


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- compress end to end -----------------------------------------------------------------------------


def test_compress_a_real_model_end_to_end_through_the_cli_client(server, shared_data, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["compress", str(shared_data / "resnet-cifar10/resnet20.pt2"), "--uniform-ratio", "0.5",
                     "--calibration", str(shared_data / "cifar10/train_prefix_5085.npz"), "--samples", "64",
                     "--repeats", "3", "--mean", "0.4914,0.4822,0.4465", "--std", "0.247,0.243,0.261",
                     "--accuracy-budget", "none",  # a uniform 0.5 keeps cosine 0.86: below the default budget
                     "--server", server.address, "--label", "suite=e2e", "--time-budget", "900", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "12/12" in captured.err and "prune" in captured.err  # the progress bar from the watch stream
    assert "measured speedup" in captured.out and "status             ok" in captured.out  # the printed report
    assert {p.name for p in out.iterdir()} == {"model.onnx", "model.pt2", "report.json", "report.html",
                                               "manifest.json"}
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["params_after"] < report["params_before"]
    assert report["accuracy_budget"] is None  # `none` travelled to the server
    # so did the time budget, to the job, which paced its reconstruction by it
    pacing = report["pacing"]
    assert pacing["time_budget_s"] == 900 and [r["round"] for r in pacing["rounds"]] == [0]
    assert 0 < pacing["rounds"][0]["fit_allowance_s"] < 0.25 * 900 and pacing["rounds"][0]["fit_steps"] == 300
    session = ort.InferenceSession(str(out / "model.onnx"))
    assert session.run(None, {session.get_inputs()[0].name: np.zeros((2, 3, 32, 32), np.float32)})[0].shape == (2, 10)
    # provenance: what went in, what was kept, what came out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"]["model"]["sha256"] == sha256(shared_data / "resnet-cifar10/resnet20.pt2")
    assert [len(layer["kept"]) for layer in manifest["layers"]] == [layer["width_after"] for layer in report["layers"]]
    assert manifest["artifacts"]["model.onnx"] == sha256(out / "model.onnx")
    listed = server.operations.ListOperations(operations_pb2.ListOperationsRequest(filter='labels.suite = "e2e"'),
                                              timeout=10)
    assert len(listed.operations) == 1 and listed.operations[0].done
    response = unpack_response(listed.operations[0])
    assert response.report.status == "ok" and len(response.report.layers) == 12  # 9 in-block groups, 3 residual streams
    assert response.report.full["params_after"] == report["params_after"]


def test_watch_streams_stages_and_layer_progress_as_they_happen(server, data):
    op = server.compression.Compress(tiny_request(data), timeout=30)
    assert not op.done and unpack_metadata(op).state in (pb.QUEUED, pb.RUNNING)
    events = list(server.compression.WatchCompression(pb.WatchCompressionRequest(name=op.name), timeout=300))
    assert events[0].HasField("operation") and events[-1].operation.done
    stages = [e.stage for e in events]
    for earlier, later in (("loading", "baseline"), ("baseline", "prune"), ("prune", "measure"), ("measure", "save")):
        assert stages.index(earlier) < stages.index(later)
    layers = [(e.layer, e.layers) for e in events if e.layers]
    assert layers == [(i, 5) for i in range(1, 6)]  # 4 in-block groups and the residual stream
    times = [e.time.ToNanoseconds() for e in events[1:-1]]
    assert times == sorted(times)
    final = events[-1].operation
    assert not final.HasField("error") and unpack_response(final).report.status == "ok", final.error.message
    # watching a finished operation: its final state, then the end of the stream
    again = list(server.compression.WatchCompression(pb.WatchCompressionRequest(name=op.name), timeout=30))
    assert len(again) == 1 and again[0].operation.done


def test_same_request_id_is_the_same_job_and_another_body_is_refused(server, data):
    request = tiny_request(data)
    first = server.compression.Compress(request, timeout=30)
    retry = server.compression.Compress(request, timeout=30)
    assert retry.name == first.name
    other = tiny_request(data, request_id=request.request_id)
    other.uniform_ratio = 0.25
    with pytest.raises(grpc.RpcError) as err:
        server.compression.Compress(other, timeout=30)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and first.name in err.value.details()
    done = server.wait_done(first.name)
    assert server.compression.Compress(request, timeout=30).name == first.name  # also once it has finished
    assert done.done and not done.HasField("error")


def test_delete_forgets_the_operation_and_its_artifacts(server, data):
    op = server.wait_done(server.compression.Compress(tiny_request(data), timeout=30).name)
    report = next(a for a in unpack_metadata(op).artifacts if a.name == "report.json")
    blob = server.home / "blobs" / "sha256" / report.sha256[:2] / report.sha256
    assert blob.is_file()
    with pytest.raises(grpc.RpcError) as err:  # cancel of a finished job
        server.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=op.name), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    server.operations.DeleteOperation(operations_pb2.DeleteOperationRequest(name=op.name), timeout=10)
    for call in (lambda: server.get(op.name),
                 lambda: list(server.compression.DownloadArtifact(
                     pb.DownloadArtifactRequest(name=op.name, artifact="report.json"), timeout=10))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert not blob.exists()


def test_upload_and_download_with_digest_check(server, data, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["compress", str(data / "model.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(data / "cal.npz"), "--samples", "16", "--repeats", "15", "--upload", "--server",
                     server.address, "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["references"]["model"] == f"blob:sha256:{sha256(data / 'model.pt2')}/model.pt2"
    assert manifest["inputs"]["calibration"]["sha256"] == sha256(data / "cal.npz")
    for name, digest in manifest["artifacts"].items():
        assert sha256(out / name) == digest
    # a directory goes up as a tar and is seen by jobs as that directory
    folder = tmp_path / "hf-model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "weights.bin").write_bytes(b"\x00" * 3000)
    client = RemoteCompressor(server.address)
    reference = client.upload(folder)
    digest = reference.split(":")[2].split("/")[0]
    view = server.home / "blobs" / "files" / digest / "hf-model"
    assert reference.endswith("/hf-model") and (view / "sub" / "weights.bin").read_bytes() == b"\x00" * 3000
    assert client.upload(folder) == reference  # same content, same reference
    # a stream cut before the server stored it (a restart mid-upload) is sent again, not a refusal
    real, streams = client.stub.UploadBlob, []

    def cut_once(messages, **kwargs):
        first = next(messages)
        streams.append(first.header.filename)
        if len(streams) == 1:
            raise _Cut()
        return real(itertools.chain([first], messages), **kwargs)

    client.stub.UploadBlob = cut_once
    assert client.upload(data / "cal.npz") == f"blob:sha256:{sha256(data / 'cal.npz')}/cal.npz"
    assert streams == ["cal.npz", "cal.npz"] and "upload of" in capsys.readouterr().err
    client.close()


def test_a_corrupted_download_is_refused_and_leaves_no_file(server, data, tmp_path):
    op = server.wait_done(server.compression.Compress(tiny_request(data), timeout=30).name)
    artifact = next(a for a in unpack_metadata(op).artifacts if a.name == "model.onnx")
    client = RemoteCompressor(server.address)
    wrong = pb.Artifact(name=artifact.name, sha256="0" * 64, size_bytes=artifact.size_bytes)
    with pytest.raises(Exception, match="sha256"):
        client.download(op.name, wrong, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert sha256(client.download(op.name, artifact, tmp_path)) == artifact.sha256
    client.close()


class _Cut(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset"


class _StoppedServer(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "CANCELLED"


def _cut_once(real, offsets: list[int], error: grpc.RpcError):
    """A DownloadArtifact stub whose first stream drops with `error` after half of its first chunk (each call's
    offset recorded in `offsets`; a call with one recorded before runs whole)."""

    def stub(request, **kwargs):
        offsets.append(request.offset)
        stream = real(request, **kwargs)
        if len(offsets) > 1:
            yield from stream
            return
        chunk = next(stream)
        chunk.data = chunk.data[:len(chunk.data) // 2]
        yield chunk
        stream.cancel()
        raise error

    return stub


def test_a_download_cut_by_a_stopping_server_resumes(server, data, tmp_path, capsys):
    """A server stopping with a download in flight (a restart's grace running out) ends its stream CANCELLED: the
    client gave up with "downloading its artifacts failed (CANCELLED)" and exit 2 although the job had succeeded."""
    op = server.wait_done(server.compression.Compress(tiny_request(data), timeout=30).name)
    artifact = next(a for a in unpack_metadata(op).artifacts if a.name == "model.onnx")
    client = RemoteCompressor(server.address)
    real, offsets = client.stub.DownloadArtifact, []

    client.stub.DownloadArtifact = _cut_once(real, offsets, _StoppedServer())
    assert sha256(client.download(op.name, artifact, tmp_path)) == artifact.sha256
    assert offsets[0] == 0 and 0 < offsets[1] < artifact.size_bytes
    assert "download interrupted at" in capsys.readouterr().err
    client.close()


def test_an_interrupted_download_resumes_where_it_stopped(server, data, tmp_path, capsys):
    op = server.wait_done(server.compression.Compress(tiny_request(data), timeout=30).name)
    artifact = next(a for a in unpack_metadata(op).artifacts if a.name == "model.onnx")
    client = RemoteCompressor(server.address)
    real, offsets = client.stub.DownloadArtifact, []

    cut_once = _cut_once(real, offsets, _Cut())
    client.stub.DownloadArtifact = cut_once
    assert sha256(client.download(op.name, artifact, tmp_path)) == artifact.sha256
    assert offsets[0] == 0 and 0 < offsets[1] < artifact.size_bytes  # resumed, not fetched again
    assert "download interrupted" in capsys.readouterr().err and [p.name for p in tmp_path.iterdir()] == ["model.onnx"]

    def ignores_offset(request, **kwargs):  # a server of an older release sends everything again
        offsets.append(request.offset)
        return real(pb.DownloadArtifactRequest(name=request.name, artifact=request.artifact), **kwargs)

    offsets.clear()
    client.stub.DownloadArtifact = lambda request, **kwargs: (
        cut_once(request, **kwargs) if not offsets else ignores_offset(request, **kwargs))
    again = tmp_path / "again"
    again.mkdir()
    assert sha256(client.download(op.name, artifact, again)) == artifact.sha256 and offsets[1] > 0
    # a client that died mid-stream (Ctrl-C, killed): the next one resumes from the partial file it left
    later = tmp_path / "later"
    later.mkdir()
    offsets.clear()

    def interrupted(request, **kwargs):
        offsets.append(request.offset)
        stream = real(request, **kwargs)
        chunk = next(stream)
        chunk.data = chunk.data[:len(chunk.data) // 2]
        yield chunk
        stream.cancel()
        raise KeyboardInterrupt

    client.stub.DownloadArtifact = interrupted
    with pytest.raises(KeyboardInterrupt):
        client.download(op.name, artifact, later)
    (partial,) = later.iterdir()
    held = partial.stat().st_size
    assert partial.name.startswith(".model.onnx.") and 0 < held < artifact.size_bytes

    def counted(request, **kwargs):
        offsets.append(request.offset)
        return real(request, **kwargs)

    client.stub.DownloadArtifact = counted
    assert sha256(client.download(op.name, artifact, later)) == artifact.sha256
    assert offsets == [0, held]  # where the dead client stopped, not its first byte
    assert [p.name for p in later.iterdir()] == ["model.onnx"]
    with pytest.raises(grpc.RpcError) as err:  # an offset past the end is the caller's error
        list(real(pb.DownloadArtifactRequest(name=op.name, artifact="model.onnx", offset=artifact.size_bytes + 1),
                  timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(err.value)["bad_request"].field_violations[0].field == "offset"
    client.close()


# ---- cancel, crash, queue ----------------------------------------------------------------------------


def test_a_ctrl_c_or_sigterm_reaching_a_worker_does_not_fail_its_job(server, shared_data):
    """A terminal's Ctrl-C and systemd's SIGTERM reach the server's whole process group, workers included: a worker
    ended its job FAILED (INTERNAL, or a crash) before the drain could re-queue it. Workers ignore both; the server
    stops them itself."""
    long = server.compression.Compress(long_request(shared_data, repeats=400), timeout=30)
    server.wait_for_stage(long.name, ("prune", "measure"))
    (worker,) = server.workers()
    os.kill(worker, signal.SIGINT)
    os.kill(worker, signal.SIGTERM)
    time.sleep(2)
    assert not server.get(long.name).done and server.workers() == [worker]
    server.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=long.name), timeout=40)
    assert server.wait_done(long.name).error.code == code_pb2.CANCELLED


def test_cancel_frees_the_device_and_a_full_queue_is_resource_exhausted(server, data, shared_data):
    long = server.compression.Compress(long_request(shared_data, repeats=400), timeout=30)
    server.wait_for_stage(long.name, ("prune", "measure"))
    with pytest.raises(grpc.RpcError) as err:  # running: delete refuses, cancel first
        server.operations.DeleteOperation(operations_pb2.DeleteOperationRequest(name=long.name), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    queued = [server.compression.Compress(tiny_request(data), timeout=30) for _ in range(2)]  # --max-queue 2
    with pytest.raises(grpc.RpcError) as err:
        server.compression.Compress(tiny_request(data), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_details(err.value)["retry"].retry_delay.seconds > 0
    assert server.health() == SERVING  # a full queue is not unhealthy
    workers = server.workers()
    assert len(workers) == 1
    below = server.descendants()
    server.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=queued[0].name), timeout=10)
    server.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=long.name), timeout=40)
    for name in (long.name, queued[0].name):
        op = server.wait_done(name, timeout=60)
        assert op.error.code == code_pb2.CANCELLED and unpack_metadata(op).state == pb.CANCELLED
    assert unpack_metadata(server.get(queued[0].name)).attempt == 0  # cancelled before it ever ran
    assert wait_gone(below)  # the worker and its children: the device is free, the next job runs
    done = server.wait_done(queued[1].name)
    assert not done.HasField("error") and unpack_metadata(done).state == pb.SUCCEEDED


def test_a_crashing_worker_fails_its_job_alone(server, shared_data, data):
    op = server.compression.Compress(long_request(shared_data, repeats=400), timeout=30)
    server.wait_for_stage(op.name, ("prune", "measure"))
    (worker,) = server.workers()
    below = server.descendants()
    os.kill(worker, signal.SIGSEGV)
    final = server.wait_done(op.name, timeout=60)
    assert final.error.code == code_pb2.INTERNAL and "signal" in final.error.message
    assert wait_gone(below)  # its ONNX Runtime child too
    assert server.health() == SERVING
    assert server.wait_done(server.compression.Compress(tiny_request(data), timeout=30).name).error.code == 0


def test_a_job_over_its_time_budget_ends_deadline_exceeded(server, shared_data):
    request = long_request(shared_data, repeats=400)
    request.time_budget.FromSeconds(4)
    final = server.wait_done(server.compression.Compress(request, timeout=30).name, timeout=120)
    assert final.error.code == code_pb2.DEADLINE_EXCEEDED and "time budget of 4s" in final.error.message
    assert wait_gone(server.workers())


def test_a_missed_target_fails_with_the_numbers_and_the_best_artifact(server, data, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["compress", str(data / "model.pt2"), "--target-speedup", "19", "--max-rounds", "1",
                     "--calibration", str(data / "cal.npz"), "--samples", "16", "--repeats", "3",
                     "--refine-steps", "20", "--server", server.address, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "FAILED_PRECONDITION" in err and "target_not_met" in err
    report = json.loads((out / "report.json").read_text())  # the best round is still delivered
    assert report["status"] == "target_not_met" and (out / "model.onnx").is_file()
    failed = server.operations.ListOperations(operations_pb2.ListOperationsRequest(filter="state = FAILED"),
                                              timeout=10).operations
    reasons = {}
    for op in failed:
        for detail in op.error.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reasons[info.reason] = info.metadata
    assert float(reasons["TARGET_NOT_MET"]["measured_speedup"]) == pytest.approx(report["measured_speedup"],
                                                                                  abs=1e-3)


def test_list_operations_pages_and_filters(server):
    seen, token = [], ""
    while True:
        page = server.operations.ListOperations(operations_pb2.ListOperationsRequest(
            filter='labels.suite = "grpc"', page_size=2, page_token=token), timeout=10)
        assert len(page.operations) <= 2
        seen += [op.name for op in page.operations]
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == len(set(seen)) >= 4
    cancelled = server.operations.ListOperations(operations_pb2.ListOperationsRequest(
        filter='state = CANCELLED AND done = true'), timeout=10)
    assert len(cancelled.operations) >= 1
    assert all(unpack_metadata(op).state == pb.CANCELLED for op in cancelled.operations)


# ---- a server killed mid-job -------------------------------------------------------------------------


def test_server_killed_mid_job_restarts_and_reruns_it_without_partial_artifacts(tmp_path, shared_data):
    home = tmp_path / "home"
    first = ServerProcess(home).start()
    try:
        op = first.compression.Compress(long_request(shared_data, repeats=40), timeout=30)
        first.wait_for_stage(op.name, ("measure",))
        workers = first.workers()
        deadline = time.monotonic() + 60
        while len(below := first.descendants()) <= len(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers and len(below) > len(workers)  # the measure stage runs ONNX Runtime in a worker's child
    finally:
        first.kill()
    assert wait_gone(below), "a worker or its ONNX Runtime child outlived the server"
    for blob in (home / "blobs" / "sha256").rglob("*"):  # only complete, content-addressed files are visible
        assert blob.is_dir() or sha256(blob) == blob.name
    second = ServerProcess(home).start()
    try:
        assert second.health() == SERVING
        final = second.wait_done(op.name, timeout=300)
        meta = unpack_metadata(final)
        assert not final.HasField("error") and meta.state == pb.SUCCEEDED and meta.attempt == 2
        assert list((home / "blobs" / "tmp").iterdir()) == []
        for artifact in meta.artifacts:
            assert sha256(home / "blobs" / "sha256" / artifact.sha256[:2] / artifact.sha256) == artifact.sha256
    finally:
        assert second.stop() == 0


def test_shutdown_drains_then_requeues_the_running_job_without_counting_an_attempt(tmp_path, shared_data):
    home = tmp_path / "home"
    first = ServerProcess(home, "--grace", "6").start()
    try:
        op = first.compression.Compress(long_request(shared_data, repeats=400), timeout=30)
        first.wait_for_stage(op.name, ("prune", "measure"))
        first.process.send_signal(signal.SIGTERM)
        draining = False
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not draining:
            with contextlib.suppress(grpc.RpcError):
                draining = first.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert draining  # NOT_SERVING while the running job gets its grace period
    finally:
        assert first.stop() == 0
    second = ServerProcess(home).start()
    try:
        meta = unpack_metadata(second.get(op.name))
        assert meta.attempt in (0, 1) and meta.state in (pb.QUEUED, pb.RUNNING)  # queued again, attempt not spent
        second.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=op.name), timeout=40)
        assert second.wait_done(op.name, timeout=60).error.code == code_pb2.CANCELLED
    finally:
        assert second.stop() == 0


# ---- bad requests ------------------------------------------------------------------------------------


def _compress(**fields):
    def call(server, data):
        request = tiny_request(data)
        for key, value in fields.items():
            if key.startswith("options."):
                setattr(request.options, key[8:], value)
            elif key == "clear":
                request.ClearField(value)
            elif key == "time_budget":
                request.time_budget.FromMilliseconds(value)
            elif key == "time_budget_seconds":
                request.time_budget.seconds = value
            elif key == "widths_from":
                request.widths_from = value
            elif key == "labels":
                request.labels.update(value)
            elif key == "shape":
                request.shape.batch = value
            else:
                setattr(request, key, value(data) if callable(value) else value)
        return server.compression.Compress(request, timeout=30)
    return call


def _reused_request_id(server, data):
    request = tiny_request(data)
    request.uniform_ratio = 0.75
    request.options.samples = 8
    server.compression.Compress(request, timeout=30)
    request.options.samples = 9
    return server.compression.Compress(request, timeout=30)


def _upload(*messages):
    def call(server, data):
        return server.compression.UploadBlob(iter(messages), timeout=30)
    return call


def _tar_with(*names: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    return buffer.getvalue()


def _operations(method: str, **fields):
    def call(server, data):
        given = dict(fields)
        timeout = given.pop("timeout_seconds", None)
        request = getattr(operations_pb2, f"{method}Request")(**given)
        if timeout is not None:
            request.timeout.seconds = timeout
        return getattr(server.operations, method)(request, timeout=10)
    return call


def _stream(method: str, request):
    def call(server, data):
        return list(getattr(server.compression, method)(request, timeout=10))
    return call


def _unimplemented(server, data):
    return server.channel.unary_unary("/osscar.compression.v1.Compression/Nope")(b"", timeout=10)


UNKNOWN = "operations/00000000-0000-0000-0000-000000000000"
BAD_REQUESTS = [
    ("model missing", _compress(model=""), "INVALID_ARGUMENT", "model"),
    ("calibration missing", _compress(calibration=""), "INVALID_ARGUMENT", "calibration"),
    ("no mode", _compress(clear="mode"), "INVALID_ARGUMENT", "target_speedup"),
    ("ratio above 1", _compress(uniform_ratio=1.5), "INVALID_ARGUMENT", "uniform_ratio"),
    ("ratio 0", _compress(uniform_ratio=0.0), "INVALID_ARGUMENT", "uniform_ratio"),
    ("speedup below 1", _compress(target_speedup=0.9), "INVALID_ARGUMENT", "target_speedup"),
    ("speedup nan", _compress(target_speedup=float("nan")), "INVALID_ARGUMENT", "target_speedup"),
    ("speedup 50", _compress(target_speedup=50.0), "INVALID_ARGUMENT", "target_speedup"),
    ("unknown method", _compress(method="magic"), "INVALID_ARGUMENT", "method"),
    ("relative path", _compress(model="model.pt2"), "INVALID_ARGUMENT", "model"),
    ("unknown scheme", _compress(model="s3://bucket/model.pt2"), "INVALID_ARGUMENT", "model"),
    ("malformed blob", _compress(calibration="blob:sha256:xyz/cal.npz"), "INVALID_ARGUMENT", "calibration"),
    ("pickle model", _compress(model=lambda d: str(d / "weights.pth")), "INVALID_ARGUMENT", "model"),
    ("directory without config", _compress(model=lambda d: str(d / "no-config")), "INVALID_ARGUMENT", "model"),
    ("request_id not a uuid", _compress(request_id="abc"), "INVALID_ARGUMENT", "request_id"),
    ("samples 0", _compress(**{"options.samples": 0}), "INVALID_ARGUMENT", "options.samples"),
    ("opset 9", _compress(**{"options.opset": 9}), "INVALID_ARGUMENT", "options.opset"),
    ("repeats 1", _compress(**{"options.repeats": 1}), "INVALID_ARGUMENT", "options.repeats"),
    ("min width 2", _compress(**{"options.min_width": 2.0}), "INVALID_ARGUMENT", "options.min_width"),
    ("precision int4", _compress(**{"options.precision": "int4"}), "INVALID_ARGUMENT", "options.precision"),
    ("activation dtype", _compress(**{"options.activation_dtype": "int8"}), "INVALID_ARGUMENT",
     "options.activation_dtype"),
    ("provider tpu", _compress(execution_provider="tpu"), "INVALID_ARGUMENT", "execution_provider"),
    ("negative budget", _compress(accuracy_budget=-0.5), "INVALID_ARGUMENT", "accuracy_budget"),
    ("back off without a budget", _compress(back_off=True, no_accuracy_budget=True), "INVALID_ARGUMENT", "back_off"),
    ("budget and none", _compress(accuracy_budget=0.1, no_accuracy_budget=True), "INVALID_ARGUMENT",
     "accuracy_budget"),
    ("negative time budget", _compress(time_budget=-5000), "INVALID_ARGUMENT", "time_budget"),
    ("bad label key", _compress(labels={"Bad Key": "x"}), "INVALID_ARGUMENT", "labels[Bad Key]"),
    ("label key ending in a newline", _compress(labels={"env\n": "x"}), "INVALID_ARGUMENT", "labels[env\n]"),
    ("label value with terminal escapes", _compress(labels={"env": "\x1b]0;pwned\x07\x1b[2J"}), "INVALID_ARGUMENT",
     "labels[env]"),
    ("negative batch", _compress(shape=-1), "INVALID_ARGUMENT", "shape"),
    ("model not found", _compress(model="/nonexistent/model.pt2"), "NOT_FOUND", None),
    ("calibration not found", _compress(calibration="/nonexistent/cal.npz"), "NOT_FOUND", None),
    ("unknown blob", _compress(calibration=f"blob:sha256:{'a' * 64}/cal.npz"), "NOT_FOUND", None),
    ("unknown embedded", _compress(model="embedded:gpt-5"), "NOT_FOUND", None),
    ("unsupported architecture", _compress(model=lambda d: str(d / "qwen2_moe")), "FAILED_PRECONDITION", None),
    ("request_id reused", _reused_request_id, "ALREADY_EXISTS", None),
    ("get unknown", _operations("GetOperation", name=UNKNOWN), "NOT_FOUND", None),
    ("get malformed name", _operations("GetOperation", name="jobs/1"), "INVALID_ARGUMENT", "name"),
    ("cancel unknown", _operations("CancelOperation", name=UNKNOWN), "NOT_FOUND", None),
    ("delete unknown", _operations("DeleteOperation", name=UNKNOWN), "NOT_FOUND", None),
    ("wait negative timeout", _operations("WaitOperation", name=UNKNOWN, timeout_seconds=-1), "INVALID_ARGUMENT",
     "timeout"),
    ("wait timeout beyond timedelta (capped)", _operations("WaitOperation", name=UNKNOWN, timeout_seconds=2**62),
     "NOT_FOUND", None),
    ("time budget beyond timedelta", _compress(time_budget_seconds=2**62), "INVALID_ARGUMENT", "time_budget"),
    ("long relative widths_from", _compress(widths_from="x" * 300), "INVALID_ARGUMENT", "widths_from"),
    ("get a huge name", _operations("GetOperation", name="operations/" + "x" * 6000), "NOT_FOUND", None),
    ("long 4-byte unicode reference", _compress(eval="𝔘" * 4000), "INVALID_ARGUMENT", "eval"),
    ("list bad filter", _operations("ListOperations", filter="state ~ RUNNING"), "INVALID_ARGUMENT", "filter"),
    ("list unknown field", _operations("ListOperations", filter="owner = me"), "INVALID_ARGUMENT", "filter"),
    ("list bad token", _operations("ListOperations", page_token="garbage"), "INVALID_ARGUMENT", "page_token"),
    ("list negative size", _operations("ListOperations", page_size=-1), "INVALID_ARGUMENT", "page_size"),
    ("watch unknown", _stream("WatchCompression", pb.WatchCompressionRequest(name=UNKNOWN)), "NOT_FOUND", None),
    ("download unknown", _stream("DownloadArtifact", pb.DownloadArtifactRequest(name=UNKNOWN, artifact="model.onnx")),
     "NOT_FOUND", None),
    ("upload without header", _upload(pb.UploadBlobRequest(chunk=b"x")), "INVALID_ARGUMENT", "header"),
    ("upload path name", _upload(pb.UploadBlobRequest(header=pb.BlobHeader(filename="../x"))), "INVALID_ARGUMENT",
     "header.filename"),
    ("upload wrong digest", _upload(pb.UploadBlobRequest(header=pb.BlobHeader(filename="a.npz", sha256="0" * 64)),
                                    pb.UploadBlobRequest(chunk=b"abc")), "INVALID_ARGUMENT", "header.sha256"),
    ("upload wrong size", _upload(pb.UploadBlobRequest(header=pb.BlobHeader(filename="a.npz", size_bytes=10)),
                                  pb.UploadBlobRequest(chunk=b"abc")), "INVALID_ARGUMENT", "header.size_bytes"),
    ("upload conflicting tar", _upload(pb.UploadBlobRequest(header=pb.BlobHeader(filename="m2", archive=True)),
                                       pb.UploadBlobRequest(chunk=_tar_with("a", "a/b"))), "INVALID_ARGUMENT",
     "header.archive"),
    ("upload escaping tar", _upload(pb.UploadBlobRequest(header=pb.BlobHeader(filename="m", archive=True)),
                                    pb.UploadBlobRequest(chunk=_tar_with("../evil"))), "INVALID_ARGUMENT",
     "header.archive"),
    ("unknown method", _unimplemented, "UNIMPLEMENTED", None),
]


@pytest.mark.parametrize("call, code, field", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_the_right_status_and_details(server, data, call, code, field):
    with pytest.raises(grpc.RpcError) as err:
        call(server, data)
    assert err.value.code() == getattr(grpc.StatusCode, code), err.value.details()
    assert err.value.details() and "Traceback" not in err.value.details()
    details = error_details(err.value)
    if field is not None:
        assert field in [v.field for v in details["bad_request"].field_violations], details
    if code == "NOT_FOUND" and call is not _unimplemented:
        assert details["resource_info"].resource_name
    if code == "FAILED_PRECONDITION":
        assert details["error_info"].reason == "UNSUPPORTED_ARCHITECTURE"


def test_every_violation_is_listed_at_once_and_the_server_stays_up(server, data):
    assert len(BAD_REQUESTS) >= 30
    request = tiny_request(data, method="magic")
    request.uniform_ratio = 2.0
    request.options.samples = 0
    with pytest.raises(grpc.RpcError) as err:
        server.compression.Compress(request, timeout=30)
    fields = {v.field for v in error_details(err.value)["bad_request"].field_violations}
    assert {"method", "uniform_ratio", "options.samples"} <= fields
    assert "--" not in err.value.details()  # API field names, not CLI flags
    assert server.process.poll() is None and server.health() == SERVING
    assert server.health("osscar.compression.v1.Compression") == SERVING


def test_the_client_exits_nonzero_with_the_status_when_refused(server, data, tmp_path, capsys):
    code = cli.main(["compress", str(data / "model.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(data / "missing.npz"), "--server", server.address, "--out", str(tmp_path / "o")])
    assert code == 2
    assert "NOT_FOUND" in capsys.readouterr().err


def test_the_client_says_when_no_server_answers(tmp_path, data, capsys):
    code = cli.main(["compress", str(data / "model.pt2"), "--uniform-ratio", "0.5", "--calibration",
                     str(data / "cal.npz"), "--server", "127.0.0.1:9", "--connect-timeout", "1", "--out",
                     str(tmp_path / "o")])
    assert code == 2 and "cannot reach an osscar server" in capsys.readouterr().err


def test_started_jobs_have_timestamps_in_order(server):
    ops = server.operations.ListOperations(operations_pb2.ListOperationsRequest(filter="state = SUCCEEDED"),
                                           timeout=10).operations
    assert ops
    for op in ops:
        meta = unpack_metadata(op)
        assert meta.create_time.ToNanoseconds() <= meta.start_time.ToNanoseconds() <= meta.end_time.ToNanoseconds()
        assert meta.end_time.ToNanoseconds() <= time.time_ns()


def test_health_watch_streams_the_status_on_the_main_port(server):
    """gRPC client-side health checking (gRFC A17) watches; the error interceptor wraps Watch too, which sends
    with context.write instead of yielding."""
    from grpc_health.v1 import health_pb2_grpc

    watch = health_pb2_grpc.HealthStub(server.channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert next(watch).status == SERVING
    watch.cancel()
