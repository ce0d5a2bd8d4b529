"""Protobuf <-> domain conversions of the gRPC API, shared by the server and the client."""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.longrunning import operations_pb2
from google.protobuf import struct_pb2
from google.protobuf.json_format import ParseDict
from google.rpc import code_pb2, error_details_pb2, status_pb2

from . import compression_pb2 as pb

if TYPE_CHECKING:  # annotations only: clients import this module without the service core
    from ..core.outcomes import JobError
    from ..core.store import JobRecord
    from ..job.report import Report

DOMAIN = "osscar.compression.v1"
# CompressRequest fields that belong to the submission, not to the job's options
SUBMISSION_FIELDS = ("time_budget", "labels", "request_id", "options")
STATE_NAMES = {pb.QUEUED: "QUEUED", pb.RUNNING: "RUNNING", pb.SUCCEEDED: "SUCCEEDED", pb.FAILED: "FAILED",
               pb.CANCELLED: "CANCELLED"}
STATES = {v: k for k, v in STATE_NAMES.items()}
_UNSET = object()


def _job_fields(message: Any) -> list:
    """(message, field descriptor) of every job option: the request's own fields, then its options'."""
    top = [(message, fd) for fd in message.DESCRIPTOR.fields if fd.name not in SUBMISSION_FIELDS]
    return top + [(message.options, fd) for fd in message.options.DESCRIPTOR.fields]


def wire_option_names() -> tuple[set[str], set[str]]:
    """(request-level names, names under `options`) of the job options the API carries."""
    top = {fd.name for fd in pb.CompressRequest.DESCRIPTOR.fields if fd.name not in SUBMISSION_FIELDS}
    return top, {fd.name for fd in pb.CompressOptions.DESCRIPTOR.fields}


def _read(message: Any, fd: Any) -> Any:
    """A field's value, or _UNSET where the caller left it out (so the request's default applies)."""
    if fd.is_repeated:
        return list(getattr(message, fd.name)) or _UNSET
    if fd.message_type is not None:  # Shape: the dimensions that were given (0 = the model kind's default)
        value = getattr(message, fd.name)
        return {f.name: getattr(value, f.name) for f in fd.message_type.fields if getattr(value, f.name)}
    if fd.has_presence:  # proto3 optional and oneof members
        return getattr(message, fd.name) if message.HasField(fd.name) else _UNSET
    value = getattr(message, fd.name)
    return value if value or fd.type == fd.TYPE_BOOL else _UNSET  # "" means "the default"


def spec_from_proto(request: pb.CompressRequest) -> dict[str, Any]:
    """CompressRequest fields (service.job.request) from the wire: what the caller set, by iterating the
    message's fields; references stay unresolved strings."""
    spec = {}
    for message, fd in _job_fields(request):
        value = _read(message, fd)
        if value is not _UNSET:
            spec[fd.name] = value
    return spec


def spec_to_proto(spec: dict[str, Any], request: pb.CompressRequest | None = None) -> pb.CompressRequest:
    """The inverse: job options (CompressRequest field names, None = not given) into a request message."""
    request = request if request is not None else pb.CompressRequest()
    top, options = wire_option_names()
    for name, value in spec.items():
        if value is None:
            continue
        if name not in top | options:
            raise ValueError(f"{name!r} does not travel on the wire")
        message = request if name in top else request.options
        try:
            if isinstance(value, dict):
                for key, item in value.items():
                    setattr(getattr(message, name), key, item)
            elif isinstance(value, list | tuple):
                getattr(message, name).extend(value)
            else:
                setattr(message, name, str(value) if isinstance(value, Path) else value)
        except (ValueError, TypeError) as err:  # e.g. an int32 field given 3,000,000,000
            raise ValueError(f"--{name.replace('_', '-')} {value!r} does not fit the request's {api_field(name)} "
                             f"field: {err}") from None
    return request


def body_digest(request: pb.CompressRequest) -> str:
    """Digest of the request without its request_id: what makes two submissions the same request."""
    copy = pb.CompressRequest()
    copy.CopyFrom(request)
    copy.request_id = ""
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


def api_field(name: str) -> str:
    """A domain field name as the API spells it (options live under `options.`)."""
    return f"options.{name}" if name in wire_option_names()[1] else name


def api_description(text: str) -> str:
    """CLI flags in a domain message (`--uniform-ratio`) as the API's field paths (`uniform_ratio`)."""
    return re.sub(r"--([a-z][a-z0-9-]*)", lambda m: api_field(m.group(1).replace("-", "_")), text)


def _code(name: str) -> int:
    return getattr(code_pb2, name, code_pb2.UNKNOWN)


def status_of_error(error: JobError) -> status_pb2.Status:
    """A finished operation's error as google.rpc.Status with an ErrorInfo."""
    status = status_pb2.Status(code=_code(error.code), message=error.message)
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=dict(error.metadata))
    status.details.add().Pack(info)
    return status


def report_to_proto(report: Report) -> pb.CompressReport:
    """The gRPC report of a finished job (its status a success or a report's failure with a returned model);
    `full` carries report.json whole."""
    metric, measured = report.metric, report.measured
    assert measured is not None, "only a job that returned a model has a CompressReport"
    out = pb.CompressReport(
        status=report.status, measured_speedup=measured.measured_speedup,
        baseline_latency_ms=measured.baseline_latency_ms, compressed_latency_ms=measured.compressed_latency_ms,
        execution_provider=report.execution_provider, device=measured.device,
        metric=pb.Metric(name=metric.name, baseline=metric.baseline or 0.0, compressed=metric.compressed or 0.0,
                         relative_drop=metric.relative_drop or 0.0),
        params_before=report.params_before, params_after=measured.params_after, method=report.method,
        elapsed_s=report.elapsed_s,
        layers=[pb.LayerResult(name=layer.name, kind=layer.kind, width_before=layer.width_before,
                               width_after=layer.width_after, objective=layer.objective,
                               relative_error=layer.relative_error) for layer in report.layers])
    if report.target_speedup is not None:
        out.target_speedup = report.target_speedup
    if report.uniform_ratio is not None:
        out.uniform_ratio = report.uniform_ratio
    full = struct_pb2.Struct()
    ParseDict(_json_safe(report.to_json()), full)
    out.full.CopyFrom(full)
    return out


def _json_safe(value: Any) -> Any:
    """Struct holds JSON: non-finite floats become strings, tuples lists."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def artifact_to_proto(a) -> pb.Artifact:
    return pb.Artifact(name=a.name, sha256=a.sha256, size_bytes=a.size_bytes, media_type=a.media_type)


def metadata_of(record: JobRecord) -> pb.CompressMetadata:
    progress = record.progress or {}
    meta = pb.CompressMetadata(
        state=STATES[record.state], stage=progress.get("stage", ""), round=int(progress.get("round", 0)),
        layer=int(progress.get("layer", 0)), layers=int(progress.get("layers", 0)),
        message=str(progress.get("message", ""))[:2000], attempt=record.attempt, labels=record.labels,
        artifacts=[artifact_to_proto(a) for a in record.artifacts])
    meta.create_time.FromNanoseconds(int(record.create_time * 1e9))
    if record.start_time:
        meta.start_time.FromNanoseconds(int(record.start_time * 1e9))
    if record.end_time:
        meta.end_time.FromNanoseconds(int(record.end_time * 1e9))
    meta.request.ParseFromString(record.request)
    return meta


def operation_of(record: JobRecord) -> operations_pb2.Operation:
    op = operations_pb2.Operation(name=record.name, done=record.done)
    meta = metadata_of(record)
    if record.error and record.report is not None:  # a failure's report: no response carries it
        ParseDict(_json_safe(record.report), meta.report)
    op.metadata.Pack(meta)
    if record.error:
        op.error.CopyFrom(status_of_error(record.error))
    elif record.done and record.report is not None:
        from ..job.report import Report  # the server's side: the job package (torch) stays out of clients

        op.response.Pack(pb.CompressResponse(report=report_to_proto(Report.from_json(record.report)),
                                             artifacts=[artifact_to_proto(a) for a in record.artifacts]))
    return op


def event_to_proto(name: str, event: dict) -> pb.CompressionEvent:
    out = pb.CompressionEvent(name=name, state=STATES.get(event.get("state", ""), pb.STATE_UNSPECIFIED),
                              stage=event.get("stage", ""), round=int(event.get("round", 0)),
                              layer=int(event.get("layer", 0)), layers=int(event.get("layers", 0)),
                              message=str(event.get("message", ""))[:2000])
    out.time.FromNanoseconds(int(event.get("time", 0) * 1e9))
    return out


def unpack_metadata(op: operations_pb2.Operation) -> pb.CompressMetadata:
    meta = pb.CompressMetadata()
    op.metadata.Unpack(meta)
    return meta


def unpack_response(op: operations_pb2.Operation) -> pb.CompressResponse:
    response = pb.CompressResponse()
    op.response.Unpack(response)
    return response


def error_details(error: grpc.RpcError) -> dict[str, Any]:
    """Client side: the AIP-193 details of a failed call (field violations, reason, metadata)."""
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)
    out: dict[str, Any] = {}
    if status is None:
        return out
    for detail in status.details:
        for cls, key in ((error_details_pb2.BadRequest, "bad_request"), (error_details_pb2.ErrorInfo, "error_info"),
                         (error_details_pb2.ResourceInfo, "resource_info"), (error_details_pb2.RetryInfo, "retry")):
            if detail.Is(cls.DESCRIPTOR):
                message = cls()
                detail.Unpack(message)
                out[key] = message
    return out
