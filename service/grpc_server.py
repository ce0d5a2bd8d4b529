"""The gRPC server (`osscar serve`): thin servicers over `service.jobs.JobService`.

- `osscar.compression.v1.Compression`: Compress, WatchCompression, UploadBlob, DownloadArtifact;
- `google.longrunning.Operations`: Get/List/Cancel/Delete/WaitOperation;
- `grpc.health.v1.Health` (SERVING while work is accepted, NOT_SERVING while draining or when the store
  is unreachable) and server reflection.

One interceptor maps the domain errors of `service.errors` to status codes with AIP-193 details; any
other exception is logged with the RPC's name and answered INTERNAL without its text. grpc.aio serves
hundreds of watch streams from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import empty_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from . import errors
from .api import compression_pb2 as pb
from .api import compression_pb2_grpc as pb_grpc
from .jobs import JobService, ServiceConfig, SubmitRequest, UploadHeader
from .wire import (
    DOMAIN,
    api_description,
    api_field,
    artifact_to_proto,
    body_digest,
    event_to_proto,
    operation_of,
    spec_from_proto,
)

log = logging.getLogger(__name__)

SERVICE_NAMES = (pb.DESCRIPTOR.services_by_name["Compression"].full_name,
                 operations_pb2.DESCRIPTOR.services_by_name["Operations"].full_name)
DOWNLOAD_CHUNK = 1 << 20
MAX_MESSAGE = 8 << 20  # upload chunks and downloads stay well below


# ---- errors ----------------------------------------------------------------------------------------


def status_of(err: errors.ServiceError) -> status_pb2.Status:
    """AIP-193: the code and details for a domain error."""
    def packed(code: int, message: str, *details) -> status_pb2.Status:
        status = status_pb2.Status(code=code, message=message)
        for detail in details:
            status.details.add().Pack(detail)
        return status

    if isinstance(err, errors.InvalidArgument):
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=api_field(v.field),
                                                        description=api_description(v.description))
            for v in err.violations])
        return packed(code_pb2.INVALID_ARGUMENT, api_description(str(err) if len(err.violations) > 1 else
                                                                 f"{api_field(err.violations[0].field)}: "
                                                                 f"{err.violations[0].description}"), bad)
    if isinstance(err, errors.NotFound):
        return packed(code_pb2.NOT_FOUND, str(err), error_details_pb2.ResourceInfo(
            resource_type=err.resource_type, resource_name=err.name, description=str(err)))
    if isinstance(err, errors.AlreadyExists):
        return packed(code_pb2.ALREADY_EXISTS, str(err), error_details_pb2.ResourceInfo(
            resource_type=err.resource_type, resource_name=err.name, description=str(err)))
    if isinstance(err, errors.FailedPrecondition):
        return packed(code_pb2.FAILED_PRECONDITION, str(err), error_details_pb2.ErrorInfo(
            reason=err.reason, domain=DOMAIN, metadata=err.metadata))
    if isinstance(err, errors.ResourceExhausted):
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromMilliseconds(int(err.retry_after_s * 1000))
        return packed(code_pb2.RESOURCE_EXHAUSTED, str(err), info)
    if isinstance(err, errors.Unavailable):
        return packed(code_pb2.UNAVAILABLE, str(err))
    raise TypeError(f"unmapped service error {type(err).__name__}")


async def _abort(context: grpc.aio.ServicerContext, method: str, err: BaseException) -> None:
    if isinstance(err, errors.ServiceError):
        await context.abort_with_status(rpc_status.to_status(status_of(err)))
    log.error("%s failed", method, exc_info=err)
    await context.abort_with_status(rpc_status.to_status(status_pb2.Status(
        code=code_pb2.INTERNAL, message="internal error (logged on the server)")))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The one place where exceptions become status codes."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._unary(handler.stream_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._streaming(handler.unary_stream, method))
        if handler.stream_stream:
            return handler._replace(stream_stream=self._streaming(handler.stream_stream, method))
        return handler

    @staticmethod
    def _unary(behaviour: Callable, method: str) -> Callable:
        @functools.wraps(behaviour)
        async def wrapped(request, context):
            try:
                return await behaviour(request, context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except BaseException as err:
                await _abort(context, method, err)

        return wrapped

    @staticmethod
    def _streaming(behaviour: Callable, method: str) -> Callable:
        @functools.wraps(behaviour)
        async def wrapped(request, context):
            try:
                async for response in behaviour(request, context):
                    yield response
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except BaseException as err:
                await _abort(context, method, err)

        return wrapped


# ---- servicers -------------------------------------------------------------------------------------


class CompressionServicer(pb_grpc.CompressionServicer):
    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs

    async def Compress(self, request: pb.CompressRequest, context) -> operations_pb2.Operation:
        budget = request.time_budget.ToTimedelta().total_seconds() if request.HasField("time_budget") else None
        record = await self.jobs.submit(SubmitRequest(
            spec=spec_from_proto(request), body=request.SerializeToString(deterministic=True),
            body_sha256=body_digest(request), labels=dict(request.labels), request_id=request.request_id,
            time_budget_s=budget))
        return operation_of(record)

    async def WatchCompression(self, request: pb.WatchCompressionRequest,
                               context) -> AsyncIterator[pb.CompressionEvent]:
        async for event, record in self.jobs.watch(request.name):
            if record is not None:
                out = event_to_proto(record.name, {"state": record.state, "time": record.create_time,
                                                   **(record.progress or {})})
                out.operation.CopyFrom(operation_of(record))
                yield out
            else:
                yield event_to_proto(request.name, event)

    async def UploadBlob(self, request_iterator, context) -> pb.Blob:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise errors.InvalidArgument([errors.FieldViolation("header", "the first message must be the header")])
        h = first.header
        header = UploadHeader(h.filename, h.archive, h.size_bytes, h.sha256)

        async def chunks() -> AsyncIterator[bytes]:
            async for message in request_iterator:
                if message.WhichOneof("part") != "chunk":
                    raise errors.InvalidArgument([errors.FieldViolation("header", "only one header, first")])
                yield message.chunk

        reference, digest, size = await self.jobs.upload(header, chunks())
        return pb.Blob(reference=reference, sha256=digest, size_bytes=size)

    async def DownloadArtifact(self, request: pb.DownloadArtifactRequest, context) -> AsyncIterator[pb.ArtifactChunk]:
        artifact, path = self.jobs.artifact(request.name, request.artifact)
        offset, first = 0, True
        with open(path, "rb") as f:
            while True:
                data = await asyncio.to_thread(f.read, DOWNLOAD_CHUNK)
                if not data and not first:
                    break
                chunk = pb.ArtifactChunk(data=data, offset=offset)
                if first:  # size and digest first, so the client can check what follows
                    chunk.artifact.CopyFrom(artifact_to_proto(artifact))
                yield chunk
                offset += len(data)
                first = False


class OperationsServicer(operations_pb2_grpc.OperationsServicer):
    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs

    async def GetOperation(self, request, context) -> operations_pb2.Operation:
        return operation_of(self.jobs.get(request.name))

    async def ListOperations(self, request, context) -> operations_pb2.ListOperationsResponse:
        if request.name not in ("", "operations"):
            raise errors.InvalidArgument([errors.FieldViolation("name", "the collection is 'operations'")])
        records, token = self.jobs.list(request.filter, request.page_size, request.page_token)
        return operations_pb2.ListOperationsResponse(operations=[operation_of(r) for r in records],
                                                     next_page_token=token)

    async def CancelOperation(self, request, context) -> empty_pb2.Empty:
        await self.jobs.cancel(request.name)
        return empty_pb2.Empty()

    async def DeleteOperation(self, request, context) -> empty_pb2.Empty:
        await self.jobs.delete(request.name)
        return empty_pb2.Empty()

    async def WaitOperation(self, request, context) -> operations_pb2.Operation:
        timeout = request.timeout.ToTimedelta().total_seconds() if request.HasField("timeout") else None
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the caller's deadline, with the latest state
            timeout = min(timeout if timeout is not None else remaining, max(0.0, remaining - 0.5))
        return operation_of(await self.jobs.wait(request.name, timeout))


# ---- the server ------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    service: ServiceConfig
    host: str = "127.0.0.1"  # loopback unless asked: no auth by default
    port: int = 50051  # 0: any free port (printed)
    grace_s: float = 30.0  # on SIGTERM/SIGINT: running jobs get this long before they are re-queued


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.jobs = JobService(config.service)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> int:
        await self.jobs.start()
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)])
        pb_grpc.add_CompressionServicer_to_server(CompressionServicer(self.jobs), self.server)
        operations_pb2_grpc.add_OperationsServicer_to_server(OperationsServicer(self.jobs), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.server)
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if not self.port:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        await self.server.start()
        await self._set_health()
        self._monitor = asyncio.create_task(self._health_monitor())
        return self.port

    async def _set_health(self) -> None:
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
        await self.jobs.drain(self.config.grace_s)
        await self.server.stop(grace=5)

    async def run_until_signalled(self, ready: Callable[[int], None] | None = None) -> None:
        port = await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._stopping.set)
        if ready:
            ready(port)
        await self._stopping.wait()
        await self.stop()


def serve(config: ServerConfig, ready: Callable[[int], None] | None = None) -> None:
    asyncio.run(Server(config).run_until_signalled(ready))
