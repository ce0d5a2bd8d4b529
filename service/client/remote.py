"""`osscar compress --server HOST:PORT`: the same job through the gRPC service.

Builds the request from the command's flags (relative paths made absolute, or uploaded with --upload),
submits it with a request_id (so a retry after a lost connection is the same job), follows the watch
stream with a progress bar (reconnecting across server restarts), then downloads every artifact, checks
its sha256 and writes the same outputs as the local command. Refusals and failed jobs exit 2 with the
status code and message; Ctrl-C exits 130 saying how to follow, download or cancel the job it leaves
running (or, with --cancel-on-interrupt, cancels it)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shlex
import sys
import uuid
from pathlib import Path

import grpc
from google.longrunning import operations_pb2

from ..api import compression_pb2 as pb
from ..api.wire import (
    STATE_NAMES,
    unpack_metadata,
    unpack_response,
)
from .options import build_request
from .terminal import ProgressBar, format_report, ignoring_interrupts
from .transport import (
    RETRYABLE,
    ClientError,
    JobFailed,
    RemoteCompressor,
    check_out,
    connect,
    deliver,
    describe_error,
    failed,
    server_flags,
)


def follow_up(name: str, args: argparse.Namespace) -> str:
    """What to run to follow, fetch or cancel an operation this command left running."""
    flags, out = server_flags(args), shlex.quote(str(args.out_dir))
    return "\n".join([f"  follow it:   osscar operations watch {name} {flags} (or run this command again)",
                      f"  download:    osscar operations download {name} {flags} --out {out}",
                      f"  cancel it:   osscar operations cancel {name} {flags}"])


class RequestMark:
    """The request a run of `osscar compress --server` submitted, kept in its --out until the job has ended and
    been delivered. The same command run again after this client died (killed, its terminal closed) submits the
    same request_id, so it follows and downloads the job that is running instead of running it a second time;
    a run with other flags or another server is another job. A finished job's mark is gone: the command run
    again after it is a new job."""

    NAME = ".osscar-request.json"

    def __init__(self, out: Path, server: str, request: pb.CompressRequest, upload: bool = False) -> None:
        """`request` names the local files (absolute paths), also where --upload (`upload`) sends them."""
        body = pb.CompressRequest()
        body.CopyFrom(request)
        body.request_id = ""
        self.path = Path(out) / self.NAME
        digest = hashlib.sha256(server.encode() + b"\0" + body.SerializeToString(deterministic=True)
                                + (b"\0upload" if upload else b""))
        # a path names its file, not its bytes: a model changed in place since the earlier run is another job
        for reference in (body.model, body.calibration, body.eval, body.widths_from):
            digest.update(b"\0" + json.dumps(_stamp(reference)).encode())
        self.digest = digest.hexdigest()
        self.created_out = not Path(out).exists()

    def earlier(self) -> dict | None:
        """The mark an earlier run of this very command left, if any."""
        try:
            mark = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(mark, dict) or mark.get("request") != self.digest or \
                not isinstance(mark.get("request_id"), str):
            return None
        self.created_out = bool(mark.get("created_out"))  # the folder is the earlier run's, made for its mark
        return mark

    def write(self, request_id: str, operation: str | None = None, uploaded: dict[str, str] | None = None) -> None:
        """`uploaded`: the blob references of the files --upload sent, by local path (a run again reuses them)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"request_id": request_id, "operation": operation, "request": self.digest,
                                         "created_out": self.created_out, "uploaded": uploaded or {}}))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.created_out:  # a folder this run made for its mark alone goes with it
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


def _stamp(reference: str) -> list:
    """What changes when a local file or folder does (each file's path in it, size, modification and change time),
    without reading it; [] for a reference that is no path here (embedded:, blob:, a path of the server's)."""
    path = Path(reference) if reference else None
    if path is None or not path.exists():
        return []
    stamps = []
    for f in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        stat = f.stat()
        stamps.append([f.relative_to(path).as_posix() if path.is_dir() else f.name, stat.st_size, stat.st_mtime_ns,
                       stat.st_ctime_ns])
    return stamps


def remote_compress(args: argparse.Namespace) -> int:
    try:
        if args.device is not None:
            raise ClientError("--device is chosen by the server (one job per device); drop it with --server")
        inputs = [getattr(args, name, None) for name in ("model", "calibration", "eval")]
        check_out(Path(args.out_dir), inputs)  # before the job runs: not found hours later when its artifacts come
        client = connect(args)
    except ClientError as err:
        print(f"osscar: error: {err}", file=sys.stderr)
        return 2
    explicit = args.request_id is not None
    args.request_id = args.request_id or str(uuid.uuid4())  # known before submitting: said if interrupted
    name, ended, mark = None, False, None
    try:
        try:
            # the mark is of the local files (with --upload too): an earlier run's uploads are reused, not sent again
            request = build_request(args, client, upload=False)
            uploaded: dict[str, str] = {}
            earlier = None
            if not explicit:
                mark = RequestMark(Path(args.out_dir), args.server, request, upload=bool(args.upload))
                if (earlier := mark.earlier()) is not None:
                    args.request_id = earlier["request_id"]
                    if isinstance(earlier.get("uploaded"), dict):
                        uploaded = {str(k): str(v) for k, v in earlier["uploaded"].items()}
                    print(f"osscar: following {earlier.get('operation') or 'the job'} that an earlier run of this "
                          f"command submitted (request {args.request_id}; {mark.path} says so)", file=sys.stderr)
                mark.write(args.request_id, uploaded=uploaded)
            if args.upload:
                try:
                    request = build_request(args, client, uploaded=uploaded)
                except ClientError:  # an upload refused or failed before any submit: no job to come back to
                    if mark is not None and earlier is None:
                        mark.clear()
                    raise
                if mark is not None:
                    mark.write(args.request_id, uploaded=uploaded)
            request.request_id = args.request_id
            op = client.submit(request)
        except grpc.RpcError as err:
            if mark is not None and err.code() not in RETRYABLE:  # refused: no job to come back to
                mark.clear()
            if err.code() in RETRYABLE:  # not a refusal: the server could not be reached (or stayed away)
                if mark is not None:  # the uploads that went through are not sent again
                    mark.write(args.request_id, uploaded=uploaded)
                raise ClientError(f"lost the connection to the server: {describe_error(err)}; running this command "
                                  "again submits the same job") from None
            raise ClientError(f"the server refused the request: {describe_error(err)}") from None
        name = op.name
        if mark is not None:
            mark.write(args.request_id, name, uploaded)
        print(f"{op.name}: {STATE_NAMES.get(unpack_metadata(op).state, '?').lower()} on {args.server}",
              file=sys.stderr)
        bar = ProgressBar(sys.stderr)
        try:
            final = client.follow(op.name, bar) if not op.done else op
        finally:
            bar.lines.end()
        if not final.done:
            final = client._call(client.operations.GetOperation, operations_pb2.GetOperationRequest(name=op.name))
        ended = final.done
        try:
            try:
                out = deliver(client, final, Path(args.out_dir), inputs)
            except JobFailed:
                if mark is not None:
                    mark.clear()
                raise
        except (grpc.RpcError, OSError) as err:  # the job has ended on the server: only its copy here failed
            why = describe_error(err) if isinstance(err, grpc.RpcError) else f"{type(err).__name__}: {err}"
            print(f"osscar: error: {final.name} has ended, but downloading its artifacts failed "
                  f"({why}); {download_command(final.name, args)}", file=sys.stderr)
            return 2
        if mark is not None:
            mark.clear()
        print(format_report(unpack_response(final).report, out))
        return 0
    except KeyboardInterrupt:
        if ended and name is not None:  # nothing runs on the server any more: only the download was cut short
            print(f"osscar: interrupted during the download; {name} has ended; {download_command(name, args)}",
                  file=sys.stderr)
            return 130
        if interrupted(client, name, args) and mark is not None:  # cancelled: nothing to come back to
            mark.clear()
        return 130
    except (ClientError, grpc.RpcError) as err:
        return failed(err)
    finally:
        client.close()


def interrupted(client: RemoteCompressor, name: str | None, args: argparse.Namespace) -> bool:
    """Ctrl-C on `osscar compress --server`: the job goes on on the server (the commands to follow, fetch
    or cancel it are printed), or with --cancel-on-interrupt it is cancelled. Whether it was cancelled: a cancel
    that failed (the server away, the job done meanwhile) leaves a job that running the command again follows."""
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
                return True
            except grpc.RpcError as err:
                print(f"osscar: interrupted; cancelling {name} failed ({describe_error(err)})\n"
                      f"{follow_up(name, args)}", file=sys.stderr)
        else:
            print(f"osscar: interrupted; {name} keeps running on {args.server}\n{follow_up(name, args)}",
                  file=sys.stderr)
    return False


def download_command(name: str, args: argparse.Namespace) -> str:
    """What fetches a finished job's artifacts again, in words."""
    return (f"download it with: osscar operations download {name} {server_flags(args)} "
            f"--out {shlex.quote(str(args.out_dir))}")
