"""A node that leaves a real local Ray cluster mid-job (`ray.cluster_utils.Cluster`: worker nodes are
separate raylets on this machine; removing one is a node leaving). Its own module: its cluster must not
share the machine with the other Ray tests' cluster and server (module fixtures end at the module's end)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.rpc import code_pb2

from service.api import compression_pb2 as pb
from service.api.wire import unpack_metadata
from tests.compressor.cnn.conv_models import write_conv_job
from tests.service.core.ray_helpers import (
    add_node,
    one_cluster_at_a_time,
    paths,
    start_cluster,
    start_server,
    succeeded,
    wait_until,
)

pytest.importorskip("ray", reason="ray is not installed (pip install '.[ray]')")


@pytest.fixture(scope="module", autouse=True)
def _one_cluster_at_a_time():
    with one_cluster_at_a_time():
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_conv_job(tmp_path_factory.mktemp("ray-loss-data"), size=32)


def test_a_lost_node_requeues_the_job_then_fails_it_node_lost(tmp_path, data):
    """The head has no CPUs, so jobs land on the worker nodes; removing a node is a node leaving the cluster."""
    cluster = start_cluster(head_cpus=0)
    server = None

    def state(name: str) -> pb.CompressMetadata:
        return unpack_metadata(server.get(name))

    def lose(node, name: str) -> None:
        server.wait_for_stage(name, ("baseline", "prune", "measure"))
        cluster.remove_node(node)

    try:
        node = add_node(cluster, num_cpus=1)
        server = start_server(tmp_path / "home", cluster, data, "--max-attempts", "2")
        # a lost node re-queues the job (no slot is left, so it waits QUEUED); on a new node it runs to the end
        first = server.compression.Compress(paths(data, repeats=100), timeout=30).name
        lose(node, first)
        wait_until(lambda: state(first).state == pb.QUEUED, 60, "the re-queue")
        assert state(first).attempt == 1 and "left the cluster during attempt 1" in state(first).message
        node = add_node(cluster, num_cpus=1)
        done = server.wait_done(first, timeout=180)
        assert succeeded(done) and unpack_metadata(done).attempt == 2
        names = [a.name for a in unpack_metadata(done).artifacts]  # one set: nothing of attempt 1 was recorded
        assert sorted(names) == ["manifest.json", "model.onnx", "model.pt2", "report.html", "report.json"]
        # lost in each of its --max-attempts runs: NODE_LOST
        second = server.compression.Compress(paths(data, repeats=300), timeout=30).name
        lose(node, second)
        wait_until(lambda: state(second).state == pb.QUEUED, 60, "the re-queue")
        node = add_node(cluster, num_cpus=1)
        wait_until(lambda: state(second).attempt == 2, 60, "the second attempt")
        lose(node, second)
        final = server.wait_done(second, timeout=60)
        assert final.error.code == code_pb2.ABORTED and "each of 2 attempts" in final.error.message
        assert unpack_metadata(final).state == pb.FAILED and not unpack_metadata(final).artifacts
    finally:
        if server is not None:
            server.stop()
        cluster.shutdown()
