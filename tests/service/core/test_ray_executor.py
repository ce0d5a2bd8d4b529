"""The Ray executor on a real local Ray cluster (`ray.cluster_utils.Cluster`: a head and worker nodes as
separate raylets on this machine) behind a real `osscar serve --executor ray` subprocess: jobs through
gRPC end to end, two at once on two slots, cancel, a killed actor process (a node that leaves: test_ray_node_loss)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from google.longrunning import operations_pb2
from google.rpc import code_pb2

from service.api import compression_pb2 as pb
from service.api.wire import error_details, unpack_metadata
from service.client.transport import RemoteCompressor
from tests.compressor.cnn.conv_models import write_conv_job
from tests.service.core.ray_helpers import (
    one_cluster_at_a_time,
    paths,
    request,
    runner_pids,
    start_cluster,
    start_server,
    succeeded,
    wait_until,
    watch,
)

pytest.importorskip("ray", reason="ray is not installed (pip install '.[ray]')")


@pytest.fixture(scope="module", autouse=True)
def _one_cluster_at_a_time():
    with one_cluster_at_a_time():
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_conv_job(tmp_path_factory.mktemp("ray-data"), size=32)


@pytest.fixture(scope="module")
def cluster():
    cluster = start_cluster(head_cpus=2)  # two slots of one CPU each
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, cluster, data):
    process = start_server(tmp_path_factory.mktemp("ray-server") / "home", cluster, data, "--max-queue", "4")
    yield process
    assert process.stop() == 0


def test_the_ray_settings_come_from_the_environment_and_stay_coherent(monkeypatch):
    from service.server.app import service_config
    from service.server.settings import ServerSettings

    monkeypatch.setenv("OSSCAR_EXECUTOR", "ray")
    monkeypatch.setenv("OSSCAR_RAY_ADDRESS", "head:6379")
    monkeypatch.setenv("OSSCAR_SHARED_ROOTS", "/mnt/models,/mnt/data")
    config = service_config(ServerSettings(ray_cpus_per_job=4))
    assert (config.executor, config.ray_address, config.ray_cpus_per_job) == ("ray", "head:6379", 4)
    assert config.shared_roots == ("/mnt/models", "/mnt/data")
    with pytest.raises(ValueError, match="devices are local slots"):
        ServerSettings(devices="cuda:0")
    monkeypatch.setenv("OSSCAR_EXECUTOR", "local")
    with pytest.raises(ValueError, match="settings of --executor ray"):
        ServerSettings()


def test_jobs_on_one_node_claim_distinct_cores_until_their_claims_close(tmp_path):
    from service.core.ray_executor import claim_cores

    allowed = sorted(os.sched_getaffinity(0))
    first, held = claim_cores(1, tmp_path)
    second, held_too = claim_cores(len(allowed), tmp_path)  # asks for every core: gets the others only
    assert first == allowed[:1] and second == allowed[1:]
    for handle in held:
        handle.close()  # the first job's process ended
    third, held_three = claim_cores(1, tmp_path)
    assert third == allowed[:1]
    for handle in held_too + held_three:
        handle.close()


def test_uploads_travel_to_the_actor_and_artifacts_come_back_digest_checked(server, data, tmp_path):
    client = RemoteCompressor(server.address)
    model, calibration = client.upload(data / "model.pt2"), client.upload(data / "cal.npz")
    op = server.compression.Compress(request(model, calibration), timeout=30)
    events: list = []
    watch(server, op.name, events)
    final = events[-1].operation
    assert succeeded(final), final.error.message
    messages = [e.message for e in events]
    assert any("Ray actor pid" in m and "cores [" in m for m in messages)  # where it ran, pinned
    assert [(e.layer, e.layers) for e in events if e.layers] == [(i, 5) for i in range(1, 6)]  # progress flowed
    out = tmp_path / "out"
    out.mkdir()
    for artifact in unpack_metadata(final).artifacts:  # in the server's own store, as announced
        path = client.download(op.name, artifact, out)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == artifact.sha256
    client.close()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"]["model"]["sha256"] == hashlib.sha256((data / "model.pt2").read_bytes()).hexdigest()
    session = ort.InferenceSession(str(out / "model.onnx"))
    assert session.run(None, {session.get_inputs()[0].name: np.zeros((2, 3, 32, 32), np.float32)})[0].shape == (2, 5)
    (node,) = (server.home.parent / "node-scratch").iterdir()  # one node: its own scratch, by node id
    assert (node / "cores").is_dir() and not any((node / "work").iterdir())  # the actor cleaned its work


def test_a_path_outside_the_shared_roots_is_refused(server, data, tmp_path):
    outside = tmp_path / "cal.npz"
    outside.write_bytes((data / "cal.npz").read_bytes())
    with pytest.raises(grpc.RpcError) as err:
        server.compression.Compress(request(str(data / "model.pt2"), str(outside)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (violation,) = error_details(err.value)["bad_request"].field_violations
    assert violation.field == "calibration" and "shared_roots" in violation.description


def test_two_jobs_run_at_once_on_two_slots_on_their_own_cores(server, data):
    ops = [server.compression.Compress(paths(data, repeats=60), timeout=30) for _ in range(2)]
    streams: list[list] = [[], []]
    threads = [threading.Thread(target=watch, args=(server, op.name, events))
               for op, events in zip(ops, streams, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    finals = [events[-1].operation for events in streams]
    assert all(succeeded(op) for op in finals), [op.error.message for op in finals]
    meta = [unpack_metadata(op) for op in finals]
    first, second = sorted(meta, key=lambda m: m.start_time.ToNanoseconds())
    assert second.start_time.ToNanoseconds() < first.end_time.ToNanoseconds()  # they overlapped
    cores = []
    for events in streams:
        where = next(e.message for e in events if "Ray actor pid" in e.message)
        cores.append(where.split("cores ", 1)[1].split(",")[0])
    assert len(set(cores)) == 2, cores  # each pinned to the core it claimed


def test_cancel_kills_the_actor_and_ends_cancelled(server, data):
    op = server.compression.Compress(paths(data, repeats=300), timeout=30)
    server.wait_for_stage(op.name, ("baseline", "prune", "measure"))
    assert len(runner_pids()) == 1
    server.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=op.name), timeout=40)
    final = server.wait_done(op.name, timeout=60)
    assert final.error.code == code_pb2.CANCELLED and unpack_metadata(final).state == pb.CANCELLED
    wait_until(lambda: not runner_pids(), 30, "the actor's exit")
    assert succeeded(server.wait_done(server.compression.Compress(paths(data), timeout=30).name))


def test_a_killed_ray_worker_process_fails_its_job_alone(server, data):
    op = server.compression.Compress(paths(data, repeats=300), timeout=30)
    server.wait_for_stage(op.name, ("baseline", "prune", "measure"))
    (pid,) = runner_pids()
    os.kill(pid, signal.SIGKILL)
    final = server.wait_done(op.name, timeout=60)
    assert final.error.code == code_pb2.INTERNAL and unpack_metadata(final).state == pb.FAILED
    assert "the worker process ended without a result" in final.error.message
    assert not unpack_metadata(final).artifacts
    assert succeeded(server.wait_done(server.compression.Compress(paths(data), timeout=30).name))


def test_an_artifact_that_arrives_corrupted_is_refused_and_nothing_of_the_result_is_kept(tmp_path):
    """The server-side transfer alone (no cluster): the second artifact's bytes differ from its announced digest."""
    import asyncio

    from service.core.blobs import BlobStore
    from service.core.ray_executor import RayAttempt

    blobs = BlobStore(tmp_path / "blobs")
    good, bad = b"onnx bytes" * 1000, b"report"
    announced = {hashlib.sha256(good).hexdigest(): good, hashlib.sha256(bad).hexdigest(): b"tampered"}

    class Read:
        def remote(self, digest, offset, size):
            async def piece():
                return announced[digest][offset:offset + size]
            return piece()

    class Actor:
        read = Read()

    class Executor:
        def __init__(self):
            self.blobs = blobs

        def referenced(self, digest):
            return False

    attempt = RayAttempt.__new__(RayAttempt)
    attempt.executor, attempt.actor, attempt.imported = Executor(), Actor(), []
    artifacts = [{"name": name, "sha256": hashlib.sha256(content).hexdigest(), "size_bytes": len(content),
                  "media_type": "application/octet-stream"} for name, content in (("model.onnx", good),
                                                                                  ("report.json", bad))]
    kind, error = asyncio.run(attempt._bring_back(("done", {"report": {}, "artifacts": artifacts})))
    assert kind == "error" and error.reason == "INTERNAL"
    assert not blobs.exists(artifacts[0]["sha256"]) and not blobs.exists(artifacts[1]["sha256"])
    announced[artifacts[1]["sha256"]] = bad  # intact: both arrive, digests as announced
    kind, result = asyncio.run(attempt._bring_back(("done", {"report": {}, "artifacts": artifacts})))
    assert result["artifacts"] == artifacts
    assert kind == "done" and all(blobs.exists(a["sha256"]) for a in artifacts)
    assert blobs.path(artifacts[0]["sha256"]).read_bytes() == good
