"""Thin servicers: protobuf to and from `service.core.JobService` calls (`service.api.wire`), nothing
else: `osscar.compression.v1.Compression` and `google.longrunning.Operations`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import empty_pb2

from .. import errors
from ..api import compression_pb2 as pb
from ..api import compression_pb2_grpc as pb_grpc
from ..api.wire import (
    artifact_to_proto,
    body_digest,
    event_to_proto,
    operation_of,
    spec_from_proto,
)
from ..core import JobService, SubmitRequest, UploadHeader

DOWNLOAD_CHUNK = 1 << 20


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
        if not 0 <= request.offset <= artifact.size_bytes:
            raise errors.InvalidArgument([errors.FieldViolation(
                "offset", f"{request.offset} is outside {artifact.name}'s {artifact.size_bytes} bytes")])
        offset, first = request.offset, True
        with open(path, "rb") as f:
            f.seek(offset)
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


# what a page's operations may take of the largest message, the rest for the response's framing and page token
PAGE_SHARE = 0.9


class OperationsServicer(operations_pb2_grpc.OperationsServicer):
    def __init__(self, jobs: JobService, max_message_bytes: int = 8 << 20) -> None:
        self.jobs = jobs
        self.max_message_bytes = max_message_bytes  # the server's grpc.max_send_message_length

    async def GetOperation(self, request, context) -> operations_pb2.Operation:
        return operation_of(self.jobs.get(request.name))

    async def ListOperations(self, request, context) -> operations_pb2.ListOperationsResponse:
        if request.name not in ("", "operations"):
            raise errors.InvalidArgument([errors.FieldViolation("name", "the collection is 'operations'")])
        # a page of full reports (100 kB each for a 6-layer encoder) could pass the message cap, which would fail the
        # call (RESOURCE_EXHAUSTED) on every retry: the page ends before it does, and its token goes on from there
        converted: dict[str, operations_pb2.Operation] = {}

        def weigh(record) -> int:
            converted[record.name] = operation_of(record)
            return converted[record.name].ByteSize() + 16  # the repeated field's tag and length

        records, token = self.jobs.list(request.filter, request.page_size, request.page_token, weigh,
                                        int(self.max_message_bytes * PAGE_SHARE))
        return operations_pb2.ListOperationsResponse(operations=[converted[r.name] for r in records],
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


