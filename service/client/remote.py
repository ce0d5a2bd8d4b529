"""`osscar compress --server HOST:PORT`: the same job through the gRPC service.

Builds the request from the command's flags (relative paths made absolute, or uploaded with --upload),
submits it with a request_id (so a retry after a lost connection is the same job), follows the watch
stream with a progress bar (reconnecting across server restarts), then downloads every artifact, checks
its sha256 and writes the same outputs as the local command. Refusals and failed jobs exit 2 with the
status code and message; Ctrl-C exits 130 saying how to follow, download or cancel the job it leaves
running (or, with --cancel-on-interrupt, cancels it)."""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

import grpc
from google.longrunning import operations_pb2

from ..api.wire import (
    STATE_NAMES,
    unpack_metadata,
    unpack_response,
)
from .options import build_request
from .terminal import ProgressBar, format_report, ignoring_interrupts
from .transport import (
    ClientError,
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
    flags = server_flags(args)
    return "\n".join([f"  follow it:   osscar operations watch {name} {flags}",
                      f"  download:    osscar operations download {name} {flags} --out {args.out_dir}",
                      f"  cancel it:   osscar operations cancel {name} {flags}"])


def remote_compress(args: argparse.Namespace) -> int:
    try:
        if args.device is not None:
            raise ClientError("--device is chosen by the server (one job per device); drop it with --server")
        check_out(Path(args.out_dir))  # before the job runs: not found hours later when its artifacts come
        client = connect(args)
    except ClientError as err:
        print(f"osscar: error: {err}", file=sys.stderr)
        return 2
    args.request_id = args.request_id or str(uuid.uuid4())  # known before submitting: said if interrupted
    name, ended = None, False
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
        ended = final.done
        try:
            inputs = [getattr(args, name, None) for name in ("model", "calibration", "eval")]
            out = deliver(client, final, Path(args.out_dir), inputs)
        except (grpc.RpcError, OSError) as err:  # the job has ended on the server: only its copy here failed
            why = describe_error(err) if isinstance(err, grpc.RpcError) else f"{type(err).__name__}: {err}"
            print(f"osscar: error: {final.name} has ended, but downloading its artifacts failed "
                  f"({why}); {download_command(final.name, args)}", file=sys.stderr)
            return 2
        print(format_report(unpack_response(final).report, out))
        return 0
    except KeyboardInterrupt:
        if ended and name is not None:  # nothing runs on the server any more: only the download was cut short
            print(f"osscar: interrupted during the download; {name} has ended; {download_command(name, args)}",
                  file=sys.stderr)
            return 130
        return interrupted(client, name, args)
    except (ClientError, grpc.RpcError) as err:
        return failed(err)
    finally:
        client.close()


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


def download_command(name: str, args: argparse.Namespace) -> str:
    """What fetches a finished job's artifacts again, in words."""
    return f"download it with: osscar operations download {name} {server_flags(args)} --out {args.out_dir}"
