"""`osscar operations list|get|watch|cancel|download`: the client over one operation at a time."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from google.longrunning import operations_pb2

from ..api import compression_pb2 as pb
from ..api.wire import (
    STATE_NAMES,
    unpack_metadata,
    unpack_response,
)
from .terminal import ProgressBar, format_report
from .transport import ClientError, RemoteCompressor, check_out, connect, deliver, failed, server_flags


def _state(op: operations_pb2.Operation) -> str:
    return STATE_NAMES.get(unpack_metadata(op).state, "?")


def _when(stamp) -> str:
    return stamp.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if stamp.ToNanoseconds() else "-"


def _progress(meta: pb.CompressMetadata) -> str:
    text = meta.stage or "-"
    if meta.round:
        text += f" round {meta.round}"
    if meta.layers:
        text += f" {meta.layer}/{meta.layers}"
    return text


def _failure(op: operations_pb2.Operation) -> str:
    code = next((c.name for c in grpc.StatusCode if c.value[0] == op.error.code), str(op.error.code))
    return f"{code}: {op.error.message}"


def list_operations(client: RemoteCompressor, args: argparse.Namespace) -> int:
    rows, token = [], ""
    while True:
        page = client._call(client.operations.ListOperations, operations_pb2.ListOperationsRequest(
            name="operations", filter=args.filter or "", page_size=100, page_token=token))
        for op in page.operations:
            meta = unpack_metadata(op)
            rows.append((op.name, _state(op), _progress(meta), _when(meta.create_time), meta.request.model))
        token = page.next_page_token
        if not token:
            break
    if not rows:
        print("no operations" + (f" match {args.filter!r}" if args.filter else ""), file=sys.stderr)
        return 0
    table = [("NAME", "STATE", "PROGRESS", "CREATED", "MODEL"), *rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row[:4], widths, strict=True)) + "  " + row[4])
    return 0


def describe_operation(op: operations_pb2.Operation) -> str:
    """An operation in plain lines: state, progress, times, labels, artifacts, and its error or report."""
    meta = unpack_metadata(op)
    rows = [("name", op.name), ("state", _state(op)), ("model", meta.request.model),
            ("progress", _progress(meta) + (f": {meta.message}" if meta.message else "")),
            ("attempt", str(meta.attempt)), ("created", _when(meta.create_time)),
            ("started", _when(meta.start_time)), ("ended", _when(meta.end_time))]
    if meta.labels:
        rows.append(("labels", ", ".join(f"{k}={v}" for k, v in sorted(meta.labels.items()))))
    if meta.artifacts:
        rows.append(("artifacts", ", ".join(f"{a.name} ({a.size_bytes:,} bytes)" for a in meta.artifacts)))
    if op.HasField("error"):
        rows.append(("error", _failure(op)))
    text = "\n".join(f"{k:<18} {v}" for k, v in rows)
    if op.HasField("response"):
        report = format_report(unpack_response(op).report, Path("(not downloaded)"))
        text += "\n" + "\n".join(line for line in report.splitlines() if not line.startswith(("status", "artifacts")))
    return text


def get_operation(client: RemoteCompressor, args: argparse.Namespace) -> int:
    op = client._call(client.operations.GetOperation, operations_pb2.GetOperationRequest(name=args.name))
    if args.json:
        from google.protobuf import json_format

        print(json_format.MessageToJson(op))
    else:
        print(describe_operation(op))
    return 0


def _follow(client: RemoteCompressor, name: str) -> operations_pb2.Operation:
    op = client._call(client.operations.GetOperation, operations_pb2.GetOperationRequest(name=name))
    if op.done:
        return op
    bar = ProgressBar(sys.stderr)
    try:
        final = client.follow(name, bar)
    finally:
        bar.lines.end()
    return final if final.done else \
        client._call(client.operations.GetOperation, operations_pb2.GetOperationRequest(name=name))


def watch_operation(client: RemoteCompressor, args: argparse.Namespace) -> int:
    final = _follow(client, args.name)
    print(describe_operation(final))
    if final.HasField("error"):
        return 2
    print(f"download it with: osscar operations download {final.name} {server_flags(args)} --out DIR",
          file=sys.stderr)
    return 0


def cancel_operation(client: RemoteCompressor, args: argparse.Namespace) -> int:
    client._call(client.operations.CancelOperation, operations_pb2.CancelOperationRequest(name=args.name))
    print(f"cancelled {args.name}", file=sys.stderr)
    return 0


def download_operation(client: RemoteCompressor, args: argparse.Namespace) -> int:
    """The artifacts of an operation into --out (a running one is followed until it ends)."""
    check_out(Path(args.out_dir))
    final = _follow(client, args.name)
    try:
        out = deliver(client, final, Path(args.out_dir))
    except KeyboardInterrupt:  # the job has ended: only this copy was cut short, and the same command resumes it
        print(f"osscar: interrupted during the download; {final.name} has ended; this command run again resumes "
              "the download", file=sys.stderr)
        return 130
    print(format_report(unpack_response(final).report, out))
    return 0


OPERATION_ACTIONS = {"list": list_operations, "get": get_operation, "watch": watch_operation,
                     "cancel": cancel_operation, "download": download_operation}


def operations_command(args: argparse.Namespace) -> int:
    """`osscar operations ACTION [NAME]`: 0 when done as asked, 2 on an error or a failed job, 130 on Ctrl-C."""
    try:
        client = connect(args)
    except ClientError as err:
        print(f"osscar: error: {err}", file=sys.stderr)
        return 2
    try:
        code = OPERATION_ACTIONS[args.action](client, args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except KeyboardInterrupt:
        name = getattr(args, "name", None)
        if args.action in ("watch", "download") and name:
            print(f"osscar: interrupted; {name} keeps running on {args.server}", file=sys.stderr)
        else:
            print("osscar: interrupted", file=sys.stderr)
        return 130
    except (ClientError, grpc.RpcError) as err:
        return failed(err)
    except BrokenPipeError:  # `osscar operations list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more for Python to flush at exit
        return 0
    finally:
        client.close()


