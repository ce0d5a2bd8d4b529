"""The server's interceptors: bearer-token authentication, and the one place that maps domain errors
(`service.errors`) to gRPC status codes with AIP-193 details (anything else: INTERNAL, logged, its text
kept from the caller); malformed messages are refused as INVALID_ARGUMENT before a servicer runs."""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import logging
import time
from collections.abc import Callable

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from .. import errors
from ..api.wire import (
    DOMAIN,
    api_description,
    api_field,
)
from ..core.metrics import Metrics

log = logging.getLogger(__name__)


MAX_VIOLATIONS = 10  # listed in one error (with the count of the rest): replies stay under the header limit


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
        status = status_pb2.Status(code=code, message=_clip(message, 1100))
        for detail in details:
            status.details.add().Pack(detail)
        return status

    if isinstance(err, errors.InvalidArgument):
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=_clip(api_field(v.field), 100),
                                                        description=_clip(api_description(v.description), 300))
            for v in err.violations[:MAX_VIOLATIONS]])
        more = len(err.violations) - MAX_VIOLATIONS
        # each violation whole as its detail keeps it (a client that reads only the message, such as one built
        # by reflection, gets the line a user can act on), the list clipped
        message = _clip("; ".join(f"{api_field(v.field)}: {_clip(api_description(v.description), 300)}"
                                  for v in err.violations[:MAX_VIOLATIONS]), 1000)
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

    def _unary(self, behaviour: Callable, method: str, timed: bool = True) -> Callable:
        """A handler awaited to its end (`timed`: its seconds go to the RPC metric; not a stream's)."""
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
                if self.metrics and timed:
                    self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)

        return wrapped

    def _streaming(self, behaviour: Callable, method: str) -> Callable:
        # a coroutine that sends with context.write (Health.Watch), not an async generator: awaited to its end
        if not inspect.isasyncgenfunction(inspect.unwrap(behaviour)):
            return self._unary(behaviour, method, timed=False)

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
        @functools.wraps(behaviour)  # __wrapped__: whether the servicer's method yields or writes stays visible
        def unary(request, context):
            _refuse_malformed(request)
            return behaviour(request, context)

        return unary

    async def messages(iterator):
        async for message in iterator:
            _refuse_malformed(message)
            yield message

    @functools.wraps(behaviour)
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


