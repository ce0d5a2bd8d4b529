"""The gRPC server (`osscar serve`): thin servicers over `service.core.JobService`.

- `osscar.compression.v1.Compression`: Compress, WatchCompression, UploadBlob, DownloadArtifact;
- `google.longrunning.Operations`: Get/List/Cancel/Delete/WaitOperation;
- `grpc.health.v1.Health` (SERVING while work is accepted, NOT_SERVING while draining or when the store
  is unreachable) and server reflection, `grpc.reflection.v1` and `v1alpha` (`service.api.reflection_v1`).

The servicers only convert protobuf to and from the core's calls (`service.wire`); one interceptor maps
the domain errors of `service.errors` to status codes with AIP-193 details; any other exception is logged
with the RPC's name and answered INTERNAL without its text (a finished job's error is a
`service.core.JobError`, converted by `wire.status_of_error`). grpc.aio serves hundreds of watch streams
from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import empty_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from . import errors
from .api import compression_pb2 as pb
from .api import compression_pb2_grpc as pb_grpc
from .api import reflection_v1
from .core import JobService, ServiceConfig, SubmitRequest, UploadHeader
from .metrics import Metrics
from .policy import ReferencePolicy
from .settings import ServerSettings
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
MAX_VIOLATIONS = 10  # listed in one error (with the count of the rest): replies stay under the header limit


# ---- errors ----------------------------------------------------------------------------------------


def _clip(text: str, limit: int) -> str:
    """Messages echo the caller's input; a long one must not push the reply past gRPC's 16 KiB limit on
    trailing metadata (the message travels percent-encoded: up to 3 bytes per UTF-8 byte), so `limit`
    counts UTF-8 bytes."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 32].decode(errors="ignore") + f"... ({len(text)} characters)"


def status_of(err: errors.ServiceError) -> status_pb2.Status:
    """AIP-193: the code and details for a domain error (echoed input clipped)."""
    def packed(code: int, message: str, *details) -> status_pb2.Status:
        status = status_pb2.Status(code=code, message=_clip(message, 600))
        for detail in details:
            status.details.add().Pack(detail)
        return status

    if isinstance(err, errors.InvalidArgument):
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=_clip(api_field(v.field), 100),
                                                        description=_clip(api_description(v.description), 300))
            for v in err.violations[:MAX_VIOLATIONS]])
        more = len(err.violations) - MAX_VIOLATIONS
        message = _clip("; ".join(f"{api_field(v.field)}: {_clip(api_description(v.description), 120)}"
                                  for v in err.violations[:MAX_VIOLATIONS]), 500)
        message += f"; and {more} more" if more > 0 else ""
        return packed(code_pb2.INVALID_ARGUMENT, message, bad)
    if isinstance(err, errors.NotFound):
        return packed(code_pb2.NOT_FOUND, str(err), error_details_pb2.ResourceInfo(
            resource_type=err.resource_type, resource_name=_clip(err.name, 256), description=_clip(str(err), 300)))
    if isinstance(err, errors.AlreadyExists):
        return packed(code_pb2.ALREADY_EXISTS, str(err), error_details_pb2.ResourceInfo(
            resource_type=err.resource_type, resource_name=_clip(err.name, 256), description=_clip(str(err), 300)))
    if isinstance(err, errors.FailedPrecondition):
        return packed(code_pb2.FAILED_PRECONDITION, str(err), error_details_pb2.ErrorInfo(
            reason=err.reason, domain=DOMAIN, metadata={k: _clip(str(v), 256) for k, v in err.metadata.items()}))
    if isinstance(err, errors.ResourceExhausted):
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromMilliseconds(int(err.retry_after_s * 1000))
        return packed(code_pb2.RESOURCE_EXHAUSTED, str(err), info)
    if isinstance(err, errors.Unavailable):
        return packed(code_pb2.UNAVAILABLE, str(err))
    if isinstance(err, errors.PermissionDenied):
        return packed(code_pb2.PERMISSION_DENIED, str(err), error_details_pb2.ErrorInfo(reason=err.reason,
                                                                                        domain=DOMAIN))
    if isinstance(err, errors.Unauthenticated):
        return packed(code_pb2.UNAUTHENTICATED, str(err), error_details_pb2.ErrorInfo(reason=err.reason,
                                                                                      domain=DOMAIN))
    raise TypeError(f"unmapped service error {type(err).__name__}")


async def _abort(context: grpc.aio.ServicerContext, method: str, err: BaseException,
                 metrics: Metrics | None = None) -> None:
    if isinstance(err, errors.ServiceError):
        status = status_of(err)
        if metrics:
            metrics.rpc_errors.labels(method, code_pb2.Code.Name(status.code)).inc()
        await context.abort_with_status(rpc_status.to_status(status))
    if metrics:
        metrics.rpc_errors.labels(method, "INTERNAL").inc()
    log.error("%s failed", method, exc_info=err)
    await context.abort_with_status(rpc_status.to_status(status_pb2.Status(
        code=code_pb2.INTERNAL, message="internal error (logged on the server)")))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The one place where exceptions become status codes (and unary RPCs are timed)."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        # bytes that do not parse as the request type are the caller's error (INVALID_ARGUMENT), not grpc's
        # default INTERNAL: parse leniently, refuse in the handler
        handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(_checked(handler.unary_unary, False), method))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._unary(_checked(handler.stream_unary, True), method))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._streaming(_checked(handler.unary_stream, False), method))
        if handler.stream_stream:
            return handler._replace(stream_stream=self._streaming(_checked(handler.stream_stream, True), method))
        return handler

    def _unary(self, behaviour: Callable, method: str) -> Callable:
        @functools.wraps(behaviour)
        async def wrapped(request, context):
            start = time.perf_counter()
            try:
                return await behaviour(request, context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except BaseException as err:
                await _abort(context, method, err, self.metrics)
            finally:
                if self.metrics:
                    self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)

        return wrapped

    def _streaming(self, behaviour: Callable, method: str) -> Callable:
        @functools.wraps(behaviour)
        async def wrapped(request, context):
            try:
                async for response in behaviour(request, context):
                    yield response
            except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):  # GeneratorExit: the client left
                raise
            except BaseException as err:
                await _abort(context, method, err, self.metrics)

        return wrapped


class _Malformed:
    """A request message that did not parse."""


def _lenient(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception:  # DecodeError and friends: refused by _checked
            return _Malformed()

    return parse


def _refuse_malformed(message) -> None:
    if isinstance(message, _Malformed):
        raise errors.InvalidArgument([errors.FieldViolation("request", "not a valid protobuf message of this "
                                                                       "method's request type")])


def _checked(behaviour: Callable, streaming_request: bool) -> Callable:
    if not streaming_request:
        def unary(request, context):
            _refuse_malformed(request)
            return behaviour(request, context)

        return unary

    async def messages(iterator):
        async for message in iterator:
            _refuse_malformed(message)
            yield message

    def streaming(request_iterator, context):
        return behaviour(messages(request_iterator), context)

    return streaming


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer tokens in `authorization` metadata; health checks are exempt (probes carry no secrets)."""

    EXEMPT = ("/grpc.health.v1.Health/",)

    def __init__(self, tokens: frozenset[str]) -> None:
        assert tokens, "an AuthInterceptor needs at least one token"
        self.tokens = tuple(t.encode() for t in tokens)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.EXEMPT):
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            refusal = errors.Unauthenticated("TOKEN_MISSING", "this server needs `authorization: Bearer <token>`")
        elif scheme.lower() != "bearer" or not self._known(token.strip().encode()):
            refusal = errors.Unauthenticated("TOKEN_INVALID", "the bearer token is not valid here")
        else:
            return handler
        status = rpc_status.to_status(status_of(refusal))

        async def refuse(request, context):
            await context.abort_with_status(status)

        async def refuse_stream(request, context):
            await context.abort_with_status(status)
            yield  # pragma: no cover - an async generator, as streaming handlers are

        kind = "unary_unary" if handler.unary_unary else "stream_unary" if handler.stream_unary else \
            "unary_stream" if handler.unary_stream else "stream_stream"
        return handler._replace(**{kind: refuse_stream if kind.endswith("_stream") else refuse})

    def _known(self, token: bytes) -> bool:
        # compare against every token in constant time: no timing hint of a near miss
        return any([hmac.compare_digest(token, t) for t in self.tokens])


# ---- servicers -------------------------------------------------------------------------------------


def _seconds(duration) -> float:
    """A Duration in seconds, any value (ToTimedelta overflows on huge ones; range checks are the core's)."""
    return duration.seconds + duration.nanos / 1e9


class CompressionServicer(pb_grpc.CompressionServicer):
    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs

    async def Compress(self, request: pb.CompressRequest, context) -> operations_pb2.Operation:
        budget = _seconds(request.time_budget) if request.HasField("time_budget") else None
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
        timeout = _seconds(request.timeout) if request.HasField("timeout") else None
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the caller's deadline, with the latest state
            timeout = min(timeout if timeout is not None else remaining, max(0.0, remaining - 0.5))
        return operation_of(await self.jobs.wait(request.name, timeout))


# ---- the server ------------------------------------------------------------------------------------


def service_config(settings: ServerSettings) -> ServiceConfig:
    return ServiceConfig(
        home=Path(settings.home).expanduser().resolve(), max_queue=settings.max_queue,
        devices=settings.list_of("devices"), max_attempts=settings.max_attempts,
        retention_s=settings.retention_days * 86400, max_upload_bytes=settings.max_upload_mb << 20,
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
        operations_pb2_grpc.add_OperationsServicer_to_server(OperationsServicer(self.jobs), self.server)
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
