"""A real `osscar serve` in a subprocess on a free localhost port, and helpers around it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api import compression_pb2 as pb
from service.api import compression_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    def __init__(self, home: Path, *extra: str, env: dict[str, str] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.home, self.extra, self.env, self.credentials = Path(home), extra, env or {}, credentials
        self.log = self.home.parent / f"{self.home.name}-server.log"
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.channel: grpc.Channel | None = None

    def start(self, timeout: float = 90.0) -> ServerProcess:
        env = {**os.environ, "OSSCAR_HOME": str(self.home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               **self.env}
        with open(self.log, "a") as log:  # the child keeps its own copy of the descriptor
            mark = self.log.stat().st_size
            self.process = subprocess.Popen([sys.executable, "-m", "service.client.cli", "serve", "--port", "0",
                                             *self.extra], cwd=ROOT, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text()[mark:]
            match = re.search(r"serving on 127\.0\.0\.1:(\d+)", text)
            if match:
                self.port = int(match.group(1))
                break
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{text[-3000:]}")
            time.sleep(0.2)
        else:
            raise TimeoutError(f"the server did not come up:\n{self.log.read_text()[-3000:]}")
        self.channel = grpc.secure_channel(self.address, self.credentials) if self.credentials else \
            grpc.insecure_channel(self.address)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def compression(self) -> pb_grpc.CompressionStub:
        return pb_grpc.CompressionStub(self.channel)

    @property
    def operations(self) -> operations_pb2_grpc.OperationsStub:
        return operations_pb2_grpc.OperationsStub(self.channel)

    def health(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    def workers(self) -> list[int]:
        """Pids of this server's worker processes (spawned children running a job)."""
        pids = []
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for pid in children:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if "multiprocessing" in cmdline and "resource_tracker" not in cmdline:
                    pids.append(int(pid))
        return pids

    def descendants(self) -> list[int]:
        """Every job process below the server: workers and their ONNX Runtime children (not the server's
        own multiprocessing resource tracker, which lives as long as the server)."""
        found, frontier = [], [self.process.pid]
        while frontier:
            pid = frontier.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                with contextlib.suppress(OSError):
                    children = [int(c) for c in (task / "children").read_text().split()]
                    frontier += children
                    found += [c for c in children if not (pid == self.process.pid and _is_tracker(c))]
        return found

    def get(self, name: str) -> operations_pb2.Operation:
        return self.operations.GetOperation(operations_pb2.GetOperationRequest(name=name), timeout=10)

    def wait_done(self, name: str, timeout: float = 300.0) -> operations_pb2.Operation:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            request = operations_pb2.WaitOperationRequest(name=name)
            request.timeout.FromSeconds(10)
            op = self.operations.WaitOperation(request, timeout=20)
            if op.done:
                return op
        raise TimeoutError(f"{name} not done after {timeout}s")

    def wait_for_stage(self, name: str, stages: tuple[str, ...], timeout: float = 120.0) -> pb.CompressionEvent:
        for event in self.compression.WatchCompression(pb.WatchCompressionRequest(name=name), timeout=timeout):
            if event.stage in stages:
                return event
            if event.HasField("operation") and event.operation.done:
                raise AssertionError(f"{name} ended before reaching {stages}")
        raise AssertionError(f"the watch of {name} ended before {stages}")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        self.channel.close()

    def stop(self) -> int:
        if self.channel is not None:
            self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        return self.process.returncode


def _is_tracker(pid: int) -> bool:
    try:
        return "resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
