"""A generic gRPC client that knows the API by server reflection alone (grpc_requests: no generated code of
ours): it lists the services, describes Compress, submits a job and polls its long-running operation, and
decodes a failed operation's google.rpc.ErrorInfo and the report in its metadata."""

from __future__ import annotations

import time
import uuid

import grpc_requests
import pytest
from google.protobuf import descriptor_pool, symbol_database

from tests.compressor.cnn.conv_models import write_conv_job

from ..server_process import ServerProcess

SERVICE = "osscar.compression.v1.Compression"
OPERATIONS = "google.longrunning.Operations"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("reflection-client") / "home").start()
    yield process
    assert process.stop() == 0


def _client(server: ServerProcess):
    """A fresh descriptor pool: nothing of this process's generated modules can fill in for reflection."""
    return grpc_requests.Client.get_by_endpoint(server.address, descriptor_pool=descriptor_pool.DescriptorPool(),
                                                symbol_db=symbol_database.SymbolDatabase())


def test_a_reflection_client_lists_and_describes_the_api(server):
    client = _client(server)
    assert {SERVICE, OPERATIONS} <= set(client.service_names)
    method = client.get_method_descriptor(SERVICE, "Compress")
    assert {"model", "target_speedup", "calibration", "options"} <= set(method.input_type.fields_by_name)
    assert method.output_type.full_name == "google.longrunning.Operation"
    assert "target_speedup" in client.describe_request(SERVICE, "Compress")  # the text a user reads
    # a failed operation's error details: loaded with the service's file, never by its own name
    assert client._desc_pool.FindMessageTypeByName("google.rpc.ErrorInfo").fields_by_name["reason"]


def test_a_reflection_client_submits_polls_and_reads_a_failure_with_its_report(server, tmp_path):
    data = write_conv_job(tmp_path, size=16)
    client = _client(server)
    # a speedup the toy cannot reach in one round: FAILED (target_not_met) with a report
    op = client.request(SERVICE, "Compress", {
        "model": str(data / "model.pt2"), "calibration": str(data / "cal.npz"), "target_speedup": 19.0,
        "request_id": str(uuid.uuid4()), "no_accuracy_budget": True,
        "options": {"samples": 16, "repeats": 3, "max_rounds": 1}})
    name = op["name"]
    deadline = time.monotonic() + 240
    while not op.get("done") and time.monotonic() < deadline:
        time.sleep(1)
        op = client.request(OPERATIONS, "GetOperation", {"name": name})
    assert op.get("done"), op
    meta = op["metadata"]
    assert meta["@type"].endswith("osscar.compression.v1.CompressMetadata") and meta["state"] == "FAILED"
    assert meta["report"]["status"] == "target_not_met" and meta["report"]["target_speedup"] == 19.0
    (info,) = op["error"]["details"]
    assert info["@type"].endswith("google.rpc.ErrorInfo") and info["reason"] == "TARGET_NOT_MET"
