"""`osscar compress --server HOST:PORT`: the same job through the gRPC service.

Builds the request from the command's flags (relative paths made absolute, or uploaded with --upload),
submits it with a request_id (so a retry after a lost connection is the same job), follows the watch
stream with a progress bar (reconnecting across server restarts), then downloads every artifact, checks
its sha256 and writes the same outputs as the local command. Refusals and failed jobs exit 2 with the
status code and message; Ctrl-C exits 130 saying how to follow, download or cancel the job it leaves
running (or, with --cancel-on-interrupt, cancels it).

`osscar operations list|get|watch|cancel|download` are the same client over one operation at a time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TextIO

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc

from .api import compression_pb2 as pb
from .api import compression_pb2_grpc as pb_grpc
from .blobs import extract_tar, write_tar
from .files import file_sha256
from .references import is_remote_reference
from .terminal import ProgressLines, ignoring_interrupts
from .wire import STATE_NAMES, error_details, spec_to_proto, unpack_metadata, unpack_response

UPLOAD_CHUNK = 1 << 20
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ClientError(Exception):
    """What the command prints before exiting 2."""


class ProgressBar:
    """Watch events as stage lines, per-layer events as a bar (redrawn in place on a terminal)."""

    def __init__(self, stream: TextIO) -> None:
        self.lines = ProgressLines(stream)
        self.last = ""

    def __call__(self, event: pb.CompressionEvent) -> None:
        if event.layers:
            done = int(24 * event.layer / event.layers)
            line = (f"{event.stage:<9} [{'#' * done}{'.' * (24 - done)}] {event.layer}/{event.layers} "
                    f"{event.message.split('] ', 1)[-1]}")
        else:
            line = f"{event.stage:<9} {event.message}" if event.message else f"{event.stage}"
        if line != self.last:
            self.last = line
            self.lines(line, transient=bool(event.layers))


class RemoteCompressor:
    def __init__(self, target: str, timeout_s: float = 60.0, *, tls_ca: Path | None = None,
                 tls_cert: Path | None = None, tls_key: Path | None = None, token: str | None = None) -> None:
        options = [("grpc.max_receive_message_length", 8 << 20)]
        if tls_ca is not None or tls_cert is not None:
            if (tls_cert is None) != (tls_key is None):
                raise ClientError("--tls-cert and --tls-key go together")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
                private_key=Path(tls_key).read_bytes() if tls_key else None,
                certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)
            self.channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.target = target
        self.timeout = timeout_s
        self.stub = pb_grpc.CompressionStub(self.channel)
        self.operations = operations_pb2_grpc.OperationsStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ClientError(f"cannot reach an osscar server at {self.target} within {timeout_s:.0f}s "
                              "(start one with `osscar serve --port P`)") from None

    def _call(self, method, request, attempts: int = 5):
        """Unary call with a deadline, retried on UNAVAILABLE (requests carry a request_id, so a retried
        Compress is the same job)."""
        for attempt in range(attempts):
            try:
                return method(request, timeout=self.timeout, wait_for_ready=True, metadata=self.metadata)
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE or attempt == attempts - 1:
                    raise
                time.sleep(min(2.0 ** attempt, 10.0))
        raise AssertionError("unreachable")

    def upload(self, path: Path) -> str:
        """A file, or a directory as a tar; returns the blob reference."""
        path = Path(path)
        with tempfile.TemporaryDirectory() as tmp:
            source, archive = path, False
            if path.is_dir():
                source, archive = Path(tmp) / "upload.tar", True
                write_tar(path, source)
            header = pb.BlobHeader(filename=path.name, archive=archive, size_bytes=source.stat().st_size,
                                   sha256=file_sha256(source))

            def messages():
                yield pb.UploadBlobRequest(header=header)
                with open(source, "rb") as f:
                    for chunk in iter(lambda: f.read(UPLOAD_CHUNK), b""):
                        yield pb.UploadBlobRequest(chunk=chunk)

            blob = self.stub.UploadBlob(messages(), timeout=max(self.timeout, 3600), wait_for_ready=True,
                                        metadata=self.metadata)
        if blob.sha256 != header.sha256:
            raise ClientError(f"upload of {path}: the server stored sha256 {blob.sha256}, expected {header.sha256}")
        return blob.reference

    def submit(self, request: pb.CompressRequest) -> operations_pb2.Operation:
        return self._call(self.stub.Compress, request)

    def follow(self, name: str, show) -> operations_pb2.Operation:
        """Watch until done; a dropped stream (server restart) is resumed."""
        delay = 1.0
        while True:
            try:
                for event in self.stub.WatchCompression(pb.WatchCompressionRequest(name=name), wait_for_ready=True,
                                                        metadata=self.metadata):
                    delay = 1.0
                    if (event.message or event.layers) and event.stage != "done":
                        show(event)
                    if event.HasField("operation") and event.operation.done:
                        return event.operation
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE and err.code() != grpc.StatusCode.CANCELLED:
                    raise
            # the stream ended without the final event: the server went away; resume
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def download(self, name: str, artifact: pb.Artifact, out: Path) -> Path:
        """One artifact into `out`, written under a temporary name and renamed once its sha256 matches."""
        target = out / artifact.name
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{artifact.name}.")
        digest, size, expected = hashlib.sha256(), 0, None
        try:
            with os.fdopen(fd, "wb") as f:
                stream = self.stub.DownloadArtifact(pb.DownloadArtifactRequest(name=name, artifact=artifact.name),
                                                    timeout=max(self.timeout, 3600), wait_for_ready=True,
                                                    metadata=self.metadata)
                for chunk in stream:
                    if chunk.HasField("artifact"):
                        expected = chunk.artifact
                    if chunk.offset != size:
                        raise ClientError(f"{artifact.name}: chunk at offset {chunk.offset}, expected {size}")
                    f.write(chunk.data)
                    digest.update(chunk.data)
                    size += len(chunk.data)
            if expected is None or digest.hexdigest() != expected.sha256 or size != expected.size_bytes or \
                    expected.sha256 != artifact.sha256:
                raise ClientError(f"{artifact.name}: downloaded {size} bytes with sha256 {digest.hexdigest()}, the "
                                  f"server announced {artifact.size_bytes} bytes with {artifact.sha256}")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target


def build_request(args: argparse.Namespace, client: RemoteCompressor) -> pb.CompressRequest:
    """The Compress request of the command's flags: the options it set (the server applies the same
    defaults to the rest), references made absolute or uploaded."""
    from .cli import compress_options
    from .job.request import LOCAL_ONLY, REFERENCES, SHAPE_KEYS

    def reference(value) -> str:
        text = str(value)
        if is_remote_reference(text):
            return text
        path = Path(text).expanduser()
        if args.upload:
            if not path.exists():
                raise ClientError(f"--upload: no such file or directory: {path}")
            print(f"uploading {path}", file=sys.stderr)
            return client.upload(path)
        return str(path.resolve())

    options = {k: v for k, v in compress_options(args).items() if k not in LOCAL_ONLY}
    for name in REFERENCES:
        if name in options:
            options[name] = reference(options[name])
    bad = sorted(set(options.get("shape", {})) - set(SHAPE_KEYS))
    if bad:
        raise ClientError(f"--shape takes batch=N and sequence=N (got {', '.join(bad)})")
    request = spec_to_proto(options, pb.CompressRequest(request_id=args.request_id or str(uuid.uuid4()),
                                                        labels=dict(args.label or [])))
    if args.time_budget is not None:
        request.time_budget.FromMilliseconds(int(args.time_budget * 1000))
    return request


def describe_error(err: grpc.RpcError) -> str:
    lines = [f"{err.code().name}: {err.details()}"]
    details = error_details(err)
    if "bad_request" in details:
        lines += [f"  {v.field}: {v.description}" for v in details["bad_request"].field_violations]
    if "error_info" in details:
        info = details["error_info"]
        lines.append(f"  reason {info.reason}" + "".join(f", {k}={v}" for k, v in sorted(info.metadata.items())))
    if "retry" in details:
        lines.append(f"  retry after {details['retry'].retry_delay.ToTimedelta().total_seconds():.0f}s")
    return "\n".join(lines)


def format_report(report: pb.CompressReport, out: Path) -> str:
    m = report.metric
    target = f"{report.target_speedup:g}x" if report.HasField("target_speedup") else \
        f"uniform ratio {report.uniform_ratio:g}" if report.HasField("uniform_ratio") else "widths from a report"
    rows = [("status", report.status), ("target", target),
            ("measured speedup", f"{report.measured_speedup:.3f}x ({report.execution_provider}, {report.device})"),
            ("latency", f"{report.baseline_latency_ms:.2f} -> {report.compressed_latency_ms:.2f} ms"),
            (f"metric ({m.name})", f"{m.baseline:.4f} -> {m.compressed:.4f} (relative drop {m.relative_drop:.2%})"),
            ("parameters", f"{report.params_before:,} -> {report.params_after:,}"),
            ("method", report.method), ("layers", ", ".join(f"{layer.width_after}/{layer.width_before}"
                                                            for layer in report.layers)),
            ("elapsed", f"{report.elapsed_s:.1f}s"), ("artifacts", str(out))]
    return "\n".join(f"{k:<18} {v}" for k, v in rows)


def connect(args: argparse.Namespace) -> RemoteCompressor:
    """A client for the connection flags (`--server`, TLS, token, `--timeout`), once the server answers."""
    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("OSSCAR_TOKEN")
    client = RemoteCompressor(args.server, timeout_s=args.timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                              tls_key=args.tls_key, token=token or None)
    try:
        client.wait_ready(args.connect_timeout)
    except BaseException:
        client.close()
        raise
    return client


def deliver(client: RemoteCompressor, final: operations_pb2.Operation, out: Path) -> Path:
    """A finished operation's artifacts into `out` (a pruned model directory unpacked to `model/`); raises
    ClientError when the job failed (after writing what it left, e.g. the best artifact of a missed
    target)."""
    meta = unpack_metadata(final)
    out.mkdir(parents=True, exist_ok=True)
    for artifact in meta.artifacts:
        path = client.download(final.name, artifact, out)
        if path.suffix == ".tar":  # a pruned model directory
            staging = Path(tempfile.mkdtemp(dir=out, prefix=".extract-"))
            try:
                extract_tar(path, staging / path.stem)
                shutil.rmtree(out / path.stem, ignore_errors=True)
                os.replace(staging / path.stem, out / path.stem)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            path.unlink()
    if meta.artifacts:
        print(f"downloaded {len(meta.artifacts)} artifacts (sha256 verified) into {out}", file=sys.stderr)
    if final.HasField("error"):
        code = grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == final.error.code))
        raise ClientError(f"{final.name} failed: {code.name}: {final.error.message}")
    return out


def server_flags(args: argparse.Namespace) -> str:
    """The connection flags of this command, to repeat in the commands it suggests."""
    flags = [f"--server {args.server}"]
    for name in ("tls_ca", "tls_cert", "tls_key", "token_file"):
        if getattr(args, name, None) is not None:
            flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    return " ".join(flags)


def follow_up(name: str, args: argparse.Namespace) -> str:
    """What to run to follow, fetch or cancel an operation this command left running."""
    flags = server_flags(args)
    return "\n".join([f"  follow it:   osscar operations watch {name} {flags}",
                      f"  download:    osscar operations download {name} {flags} --out {args.out_dir}",
                      f"  cancel it:   osscar operations cancel {name} {flags}"])


def remote_compress(args: argparse.Namespace) -> int:
    try:
        if args.device is not None:
            raise ClientError("--device is chosen by the server (one job per device); drop it with --server")
        client = connect(args)
    except ClientError as err:
        print(f"osscar: error: {err}", file=sys.stderr)
        return 2
    args.request_id = args.request_id or str(uuid.uuid4())  # known before submitting: said if interrupted
    name = None
    try:
        try:
            request = build_request(args, client)
            op = client.submit(request)
        except grpc.RpcError as err:
            raise ClientError(f"the server refused the request: {describe_error(err)}") from None
        name = op.name
        print(f"{op.name}: {STATE_NAMES.get(unpack_metadata(op).state, '?').lower()} on {args.server}",
              file=sys.stderr)
        bar = ProgressBar(sys.stderr)
        try:
            final = client.follow(op.name, bar) if not op.done else op
        finally:
            bar.lines.end()
        if not final.done:
            final = client._call(client.operations.GetOperation, operations_pb2.GetOperationRequest(name=op.name))
        out = deliver(client, final, Path(args.out_dir))
        print(format_report(unpack_response(final).report, out))
        return 0
    except KeyboardInterrupt:
        return interrupted(client, name, args)
    except (ClientError, grpc.RpcError) as err:
        return failed(err)
    finally:
        client.close()


def failed(err: ClientError | grpc.RpcError) -> int:
    """One line on stderr for a refused or failed call; exit code 2."""
    print(f"osscar: error: {describe_error(err) if isinstance(err, grpc.RpcError) else err}", file=sys.stderr)
    return 2


def interrupted(client: RemoteCompressor, name: str | None, args: argparse.Namespace) -> int:
    """Ctrl-C on `osscar compress --server`: the job goes on on the server (the commands to follow, fetch
    or cancel it are printed), or with --cancel-on-interrupt it is cancelled. Exit 130."""
    with ignoring_interrupts():  # a second Ctrl-C must not cut the cancel or the message short
        if name is None:
            print(f"osscar: interrupted before the server named the job; submitting again with --request-id "
                  f"{args.request_id} returns the same job if it was created (`osscar operations list "
                  f"{server_flags(args)}` lists the jobs)", file=sys.stderr)
        elif args.cancel_on_interrupt:
            try:
                client.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=name),
                                                  timeout=client.timeout, metadata=client.metadata)
                print(f"osscar: interrupted; cancelled {name}", file=sys.stderr)
            except grpc.RpcError as err:
                print(f"osscar: interrupted; cancelling {name} failed ({describe_error(err)})\n"
                      f"{follow_up(name, args)}", file=sys.stderr)
        else:
            print(f"osscar: interrupted; {name} keeps running on {args.server}\n{follow_up(name, args)}",
                  file=sys.stderr)
    return 130


# ---- osscar operations list|get|watch|cancel|download ----------------------------------------------


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
    final = _follow(client, args.name)
    out = deliver(client, final, Path(args.out_dir))
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
        return OPERATION_ACTIONS[args.action](client, args)
    except KeyboardInterrupt:
        name = getattr(args, "name", None)
        if args.action in ("watch", "download") and name:
            print(f"osscar: interrupted; {name} keeps running on {args.server}", file=sys.stderr)
        else:
            print("osscar: interrupted", file=sys.stderr)
        return 130
    except (ClientError, grpc.RpcError) as err:
        return failed(err)
    finally:
        client.close()
