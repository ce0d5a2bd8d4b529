"""The gRPC server (`osscar serve`): thin servicers over `service.core.JobService`.

- `osscar.compression.v1.Compression`: Compress, WatchCompression, UploadBlob, DownloadArtifact;
- `google.longrunning.Operations`: Get/List/Cancel/Delete/WaitOperation;
- `grpc.health.v1.Health` (SERVING while work is accepted, NOT_SERVING while draining or when the store
  is unreachable) and server reflection, `grpc.reflection.v1` and `v1alpha` (`service.api.reflection_v1`).

The servicers only convert protobuf to and from the core's calls (`service.api.wire`); one interceptor maps
the domain errors of `service.errors` to status codes with AIP-193 details; any other exception is logged
with the RPC's name and answered INTERNAL without its text (a finished job's error is a
`service.core.JobError`, converted by `wire.status_of_error`). grpc.aio serves hundreds of watch streams
from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..api import compression_pb2 as pb
from ..api import compression_pb2_grpc as pb_grpc
from ..api import reflection_v1
from ..core import JobService, ServiceConfig
from ..core.metrics import Metrics
from ..core.policy import ReferencePolicy
from .interceptors import AuthInterceptor, ErrorInterceptor
from .servicers import CompressionServicer, OperationsServicer
from .settings import ServerSettings

log = logging.getLogger(__name__)


SERVICE_NAMES = (pb.DESCRIPTOR.services_by_name["Compression"].full_name,
                 operations_pb2.DESCRIPTOR.services_by_name["Operations"].full_name)


def service_config(settings: ServerSettings) -> ServiceConfig:
    return ServiceConfig(
        home=Path(settings.home).expanduser().resolve(), max_queue=settings.max_queue,
        devices=settings.list_of("devices"), max_attempts=settings.max_attempts,
        retention_s=settings.retention_days * 86400, max_upload_bytes=settings.max_upload_mb << 20,
        upload_idle_s=settings.upload_idle_s,
        policy=ReferencePolicy.of(settings.list_of("allowed_roots"), settings.list_of("allowed_schemes"),
                                  settings.list_of("trust_remote_code")),
        log_format=settings.log_format, executor=settings.executor, ray_address=settings.ray_address,
        shared_roots=tuple(str(Path(r).expanduser().resolve()) for r in settings.list_of("shared_roots")),
        ray_cpus_per_job=settings.ray_cpus_per_job, ray_scratch=settings.ray_scratch)


class Server:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.jobs = JobService(service_config(settings), self.metrics)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self.health_server: grpc.aio.Server | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> int:
        settings = self.settings
        await self.jobs.start()
        interceptors = [ErrorInterceptor(self.metrics)]
        tokens = settings.bearer_tokens()
        if tokens:  # outermost: nothing runs for a caller without a valid token
            interceptors.insert(0, AuthInterceptor(tokens))
        size = settings.max_message_mb << 20
        self.server = grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
                                      options=[("grpc.max_receive_message_length", size),
                                               ("grpc.max_send_message_length", size)])
        pb_grpc.add_CompressionServicer_to_server(CompressionServicer(self.jobs), self.server)
        operations_pb2_grpc.add_OperationsServicer_to_server(OperationsServicer(self.jobs, size), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection_v1.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME), self.server)
        address = f"{settings.host}:{settings.port}"
        if settings.tls:
            client_ca = Path(settings.tls_client_ca).read_bytes() if settings.tls_client_ca else None
            credentials = grpc.ssl_server_credentials(
                [(Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())],
                root_certificates=client_ca, require_client_auth=client_ca is not None)
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot bind {address}")
        await self.server.start()
        if settings.metrics_port is not None:
            self.metrics_port = self.metrics.serve(settings.host, settings.metrics_port)
        if settings.health_port is not None:  # loopback only: it answers health and nothing else
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"127.0.0.1:{settings.health_port}")
            await self.health_server.start()
        await self._set_health()
        self._monitor = asyncio.create_task(self._health_monitor())
        return self.port

    async def _set_health(self) -> None:
        await asyncio.to_thread(self.jobs.probe_home)  # file I/O: a hung home must not stall the event loop
        status = health_pb2.HealthCheckResponse.SERVING if self.jobs.accepting else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def _health_monitor(self) -> None:
        while True:
            await asyncio.sleep(5)
            await self._set_health()

    async def stop(self) -> None:
        log.info("shutting down: NOT_SERVING, draining")
        self._monitor.cancel()
        await self.health.enter_graceful_shutdown()
        await self.jobs.drain(self.settings.grace_s)
        await self.server.stop(grace=5)
        if self.health_server is not None:
            await self.health_server.stop(grace=1)
        self.jobs.close()  # after the calls in flight: a wait that ends during the stop still reads the store

    async def run_until_signalled(self, ready: Callable[[Server], None] | None = None) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._stopping.set)
        if ready:
            ready(self)
        await self._stopping.wait()
        await self.stop()


def serve(settings: ServerSettings, ready: Callable[[Server], None] | None = None) -> None:
    asyncio.run(Server(settings).run_until_signalled(ready))


