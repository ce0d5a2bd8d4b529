"""Structured logs and Prometheus metrics of a real server running a real job."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid

import grpc
import pytest
from google.longrunning import operations_pb2

from service.api import compression_pb2 as pb
from tests.compressor.cnn.conv_models import write_conv_job

from .server_process import ServerProcess


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("observed")
    write_conv_job(root, size=32)
    server = ServerProcess(root / "home", "--metrics-port", "0").start()
    request = pb.CompressRequest(model=str(root / "model.pt2"), calibration=str(root / "cal.npz"), uniform_ratio=0.5,
                                 request_id=str(uuid.uuid4()))
    request.options.samples, request.options.repeats = 16, 15
    op = server.wait_done(server.compression.Compress(request, timeout=30).name)
    with pytest.raises(grpc.RpcError):
        server.get(f"operations/{uuid.uuid4()}")
    port = int(re.search(r"metrics on 127\.0\.0\.1:(\d+)", server.log.read_text()).group(1))
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    yield server, op, metrics
    server.stop()


def _value(metrics: str, name: str, **labels: str) -> float:
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # exposition sorts labels
    pattern = rf"^{re.escape(name)}{{{re.escape(selector)}}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    match = re.search(pattern, metrics, flags=re.MULTILINE)
    assert match, f"{name}{{{selector}}} not in /metrics"
    return float(match.group(1))


def test_metrics_count_jobs_stages_rpcs_and_errors(finished):
    _, op, metrics = finished
    assert not op.HasField("error")
    assert _value(metrics, "osscar_jobs", state="SUCCEEDED") == 1
    assert _value(metrics, "osscar_jobs", state="RUNNING") == 0
    assert _value(metrics, "osscar_queue_depth") == 0
    assert _value(metrics, "osscar_jobs_finished_total", state="SUCCEEDED", code="OK") == 1
    for stage in ("loading", "baseline", "prune", "measure", "save"):  # the last one too, timed by the result
        assert _value(metrics, "osscar_stage_seconds_count", stage=stage) == 1
    assert _value(metrics, "osscar_rpc_seconds_count", method="/osscar.compression.v1.Compression/Compress") == 1
    assert _value(metrics, "osscar_rpc_errors_total", method="/google.longrunning.Operations/GetOperation",
                  code="NOT_FOUND") == 1


def test_logs_are_json_lines_carrying_the_operation_id(finished):
    server, op, _ = finished
    records = []
    for line in server.log.read_text().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    mine = [r for r in records if r.get("operation") == op.name]
    assert any(r["logger"] == "service.core.supervisor" and r["message"].startswith("SUCCEEDED") for r in mine)
    workers = {r["pid"] for r in mine} - {server.process.pid}
    assert workers, "the worker's own records carry the operation id too"
    progress = [r["message"] for r in mine if r["logger"] == "service.core.worker"]
    assert any(m.startswith("[5/5]") for m in progress) and "stage measure (round 0)" in progress


def test_a_deleted_operation_leaves_the_gauges(finished):
    server, op, _ = finished
    server.operations.DeleteOperation(operations_pb2.DeleteOperationRequest(name=op.name), timeout=10)
    port = int(re.search(r"metrics on 127\.0\.0\.1:(\d+)", server.log.read_text()).group(1))
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert _value(metrics, "osscar_jobs", state="SUCCEEDED") == 0
