"""The client's connection to an osscar server: TLS and bearer tokens, unary calls retried on
UNAVAILABLE, chunked uploads, a watch stream resumed across server restarts, sha256-checked downloads."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc

from ..api import compression_pb2 as pb
from ..api import compression_pb2_grpc as pb_grpc
from ..api.wire import (
    error_details,
    unpack_metadata,
)
from ..files import (
    JOB_EXPORTS,
    JOB_OUTPUTS,
    ArchiveError,
    earlier_job_files,
    extract_tar,
    file_sha256,
    follow_umask,
    foreign_model,
    hold_folder,
    touches,
    valid_filename,
    write_tar,
)

UPLOAD_CHUNK = 1 << 20
DEFAULT_TIMEOUT_S = 60.0  # each call's deadline when --timeout is not given
RECONNECT_S = 600.0  # how long a watch waits for a server that went away to answer again


RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# a stream the server ends as it stops (a restart's grace runs out: CANCELLED) resumes as a dropped one does
RESUMABLE = (*RETRYABLE, grpc.StatusCode.CANCELLED)
# the largest message a server may be set to send (its max_message_mb, at most 64): a page of operations fills what
# its server allows, which a smaller limit here would refuse (RESOURCE_EXHAUSTED) on every try
MAX_RECEIVE_BYTES = 64 << 20


class ClientError(Exception):
    """What the command prints before exiting 2."""


def open_channel(target: str, tls_ca: Path | None = None, tls_cert: Path | None = None, tls_key: Path | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to `target`: TLS with `tls_ca` (the server's CA) or a client certificate (`tls_cert` and `tls_key`,
    for a server that asks for one), else plain text. Raises ClientError for a key without its certificate (or the
    reverse), OSError for a file that does not read."""
    if (tls_cert is None) != (tls_key is None):  # a key alone would otherwise connect in plain text
        raise ClientError("--tls-cert and --tls-key go together")
    if tls_ca is None and tls_cert is None:
        return grpc.insecure_channel(target, options=list(options))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)
    return grpc.secure_channel(target, credentials, options=list(options))


class RemoteCompressor:
    def __init__(self, target: str, timeout_s: float = 60.0, *, tls_ca: Path | None = None,
                 tls_cert: Path | None = None, tls_key: Path | None = None, token: str | None = None) -> None:
        self.channel = open_channel(target, tls_ca, tls_cert, tls_key,
                                    [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)])
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
                              "(start one with `osscar serve --port P`; or the server and this command differ on TLS: "
                              "--tls-ca for a server that serves TLS, none for one that does not)") from None

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

    def upload(self, path: Path, attempts: int = 5) -> str:
        """A file, or a directory as a tar; returns the blob reference. A stream cut by UNAVAILABLE or a deadline
        is sent again (up to `attempts` streams)."""
        path = Path(path)
        with tempfile.TemporaryDirectory() as tmp:
            source, archive = path, False
            if path.is_dir():
                source, archive = Path(tmp) / "upload.tar", True
                try:
                    write_tar(path, source, follow_symlinks=True)  # a Hugging Face snapshot's files are links
                except ArchiveError as err:
                    raise ClientError(f"--upload {path}: {err}") from None
            # the name as given (a link's target, a Hugging Face blob, has no extension to tell its format by);
            # `.` or `dir/..` name no file: the folder's own name does
            header = pb.BlobHeader(filename=Path(os.path.abspath(path)).name, archive=archive,
                                   size_bytes=source.stat().st_size,
                                   sha256=file_sha256(source))

            def messages():
                yield pb.UploadBlobRequest(header=header)
                with open(source, "rb") as f:
                    for chunk in iter(lambda: f.read(UPLOAD_CHUNK), b""):
                        yield pb.UploadBlobRequest(chunk=chunk)

            for attempt in range(attempts):  # a server restarted mid-upload: the upload is sent again
                try:
                    blob = self.stub.UploadBlob(messages(), timeout=max(self.timeout, 3600), wait_for_ready=True,
                                                metadata=self.metadata)
                    break
                except grpc.RpcError as err:
                    if err.code() not in RETRYABLE or attempt == attempts - 1:
                        raise
                    print(f"osscar: upload of {path} interrupted ({err.code().name}); sending it again",
                          file=sys.stderr)
                    time.sleep(min(2.0 ** attempt, 10.0))
        if blob.sha256 != header.sha256:
            raise ClientError(f"upload of {path}: the server stored sha256 {blob.sha256}, expected {header.sha256}")
        return blob.reference

    def submit(self, request: pb.CompressRequest) -> operations_pb2.Operation:
        return self._call(self.stub.Compress, request)

    def follow(self, name: str, show, reconnect_s: float = RECONNECT_S) -> operations_pb2.Operation:
        """Watch until done; a dropped stream (server restart) is resumed, said once, for up to `reconnect_s` of the
        server staying away: then a ClientError (the job may still run there), where the watch waited in silence
        for as long as the server was gone."""
        delay, lost = 1.0, None  # lost: when the stream last dropped without an event since
        while True:
            try:
                for event in self.stub.WatchCompression(pb.WatchCompressionRequest(name=name), wait_for_ready=True,
                                                        metadata=self.metadata):
                    if lost is not None:
                        print(f"osscar: reconnected; following {name}", file=sys.stderr)
                    delay, lost = 1.0, None
                    if (event.message or event.layers) and event.stage != "done":
                        show(event)
                    if event.HasField("operation") and event.operation.done:
                        return event.operation
            except grpc.RpcError as err:
                if err.code() not in RESUMABLE:
                    raise
            # the stream ended without the final event: the server went away; resume once it answers again
            if lost is None:
                lost = time.monotonic()
                print(f"osscar: lost the connection to {self.target} while following {name}; reconnecting (for up "
                      f"to {reconnect_s:.0f}s)", file=sys.stderr)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
            try:  # the next stream's wait_for_ready would wait without a bound
                self.wait_ready(max(0.0, reconnect_s - (time.monotonic() - lost)))
            except ClientError:
                raise ClientError(f"{name}: the server at {self.target} stayed unreachable for {reconnect_s:.0f}s; "
                                  "the job may still be running there: follow it again once the server is back "
                                  f"(`osscar operations watch {name}`, or this command run again)") from None

    def download(self, name: str, artifact: pb.Artifact, out: Path, attempts: int = 5) -> Path:
        """One artifact into `out`, written under a partial name and renamed once its sha256 matches. A stream
        cut by UNAVAILABLE, a deadline or a stopping server (CANCELLED) resumes from the bytes already received (up
        to `attempts` streams), and so does a later call after this process died or was interrupted (the partial
        name is the artifact's and its digest's, and stays): a multi-GB model is not fetched again from its first
        byte. A file already in place with the artifact's digest is kept as it is."""
        target = out / artifact.name
        if target.is_file() and target.stat().st_size == artifact.size_bytes and \
                file_sha256(target) == artifact.sha256:
            return target
        part = out / f".{artifact.name}.{artifact.sha256[:16]}.part"
        digest, size, expected = hashlib.sha256(), 0, None
        if part.is_file() and part.stat().st_size <= artifact.size_bytes:
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(UPLOAD_CHUNK), b""):
                    digest.update(block)
                    size += len(block)
        try:
            with open(part, "r+b" if size else "wb") as f:
                f.seek(size)
                f.truncate()
                for attempt in range(attempts):
                    try:
                        first = True
                        for chunk in self.stub.DownloadArtifact(
                                pb.DownloadArtifactRequest(name=name, artifact=artifact.name, offset=size),
                                timeout=max(self.timeout, 3600), wait_for_ready=True, metadata=self.metadata):
                            if first and size and chunk.offset == 0:  # a server that cannot resume: start over
                                f.seek(0)
                                f.truncate()
                                digest, size = hashlib.sha256(), 0
                            first = False
                            if chunk.HasField("artifact"):
                                if expected is not None and chunk.artifact != expected:
                                    raise ClientError(f"{artifact.name} changed on the server while downloading")
                                expected = chunk.artifact
                            if chunk.offset != size:
                                raise ClientError(f"{artifact.name}: chunk at offset {chunk.offset}, expected {size}")
                            f.write(chunk.data)
                            digest.update(chunk.data)
                            size += len(chunk.data)
                        break
                    except grpc.RpcError as err:
                        if err.code() not in RESUMABLE or attempt == attempts - 1:
                            raise
                        print(f"osscar: {artifact.name}: download interrupted at {size} bytes "
                              f"({err.code().name}); resuming", file=sys.stderr)
                        time.sleep(min(2.0 ** attempt, 10.0))
            # a resumed stream announces nothing: the bytes' digest is the check
            if (expected is not None and expected.sha256 != artifact.sha256) or \
                    digest.hexdigest() != artifact.sha256 or size != artifact.size_bytes:
                raise ClientError(f"{artifact.name}: downloaded {size} bytes with sha256 {digest.hexdigest()}, the "
                                  f"server announced {artifact.size_bytes} bytes with {artifact.sha256}")
        except ClientError:
            part.unlink(missing_ok=True)  # wrong bytes: none of them is worth resuming from
            raise
        follow_umask(part)
        os.replace(part, target)
        return target


def describe_error(err: grpc.RpcError) -> str:
    lines = [f"{err.code().name}: {err.details()}"]
    details = error_details(err)
    if "bad_request" in details:
        violations = [f"{v.field}: {v.description}" for v in details["bad_request"].field_violations]
        if violations and "; ".join(violations) == err.details():  # the message is the list: one line each, once
            lines = [f"{err.code().name}: the request is invalid"]
        lines += [f"  {v}" for v in violations]
    if "error_info" in details:
        info = details["error_info"]
        lines.append(f"  reason {info.reason}" + "".join(f", {k}={v}" for k, v in sorted(info.metadata.items())))
    if "retry" in details:
        lines.append(f"  retry after {details['retry'].retry_delay.ToTimedelta().total_seconds():.0f}s")
    return "\n".join(lines)


def connect(args: argparse.Namespace) -> RemoteCompressor:
    """A client for the connection flags (`--server`, TLS, token, `--timeout`), once the server answers."""
    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("OSSCAR_TOKEN")
    timeout = getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S
    connect_timeout = getattr(args, "connect_timeout", None) or getattr(args, "default_connect_timeout", 60.0)
    client = RemoteCompressor(args.server, timeout_s=timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                              tls_key=args.tls_key, token=token or None)
    try:
        client.wait_ready(connect_timeout)
    except BaseException:
        client.close()
        raise
    return client


def check_out(out: Path, inputs: Sequence[object] = ()) -> None:
    """An --out a job's artifacts can be written into: a folder, new or existing and writable, without a model/
    folder of the user's (`files.foreign_model`: refused as a local job refuses it, not replaced by the download)."""
    if out.exists() and not out.is_dir():
        raise ClientError(f"--out {out} is a file; give a folder (new or one of an earlier job's)")
    parent = next((p for p in (out, *out.parents) if p.exists()), None)
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise ClientError(f"--out {out}: {parent} is not writable")
    if why := foreign_model(out, inputs):
        raise ClientError(why)


class JobFailed(ClientError):
    """The operation ended with an error (its artifacts, if any, were delivered)."""


STAGING_PREFIX = ".osscar-download-"


def deliver(client: RemoteCompressor, final: operations_pb2.Operation, out: Path,
            inputs: Sequence[object] = ()) -> Path:
    """A finished operation's artifacts into `out` (a pruned model directory unpacked to `model/`); raises
    JobFailed when the job failed (after writing what it left, e.g. the best artifact of a missed target).
    `inputs`: the job's local model, calibration and evaluation paths, which no earlier job's files listed in
    `out` are removed from.

    Every artifact is downloaded and checked in a hidden folder of `out` named after the operation before any
    file of `out` changes, then moved into place: a download cut short (Ctrl-C, a killed client) leaves the
    earlier job's files as they were, never a mix of two jobs, and delivering the same operation again resumes
    from what that folder holds."""
    meta = unpack_metadata(final)
    # names the server chose become paths here: a plain file name each, or a server could write anywhere
    unsafe = [a.name for a in meta.artifacts if not valid_filename(a.name) or a.name.startswith(".")]
    if unsafe:
        raise ClientError(f"{final.name}: the server named artifacts that are not plain file names "
                          f"({', '.join(repr(n) for n in unsafe)}); nothing was downloaded")
    if meta.artifacts:
        out.mkdir(parents=True, exist_ok=True)
        with _writing(out):
            _deliver(client, final, meta, out, inputs)
    if final.HasField("error"):
        code = grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == final.error.code))
        raise JobFailed(f"{final.name} failed: {code.name}: {final.error.message}")
    return out


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """This process alone writes into `out` until the block ends: two clients delivering into one folder (the
    same command run twice at once, or two jobs given one --out) would resume each other's partial files and
    remove each other's staging. The second waits for the first (an advisory lock on the folder, released by
    the kernel if the holder dies)."""
    fd = hold_folder(out, wait=False)
    if fd is None:
        print(f"osscar: another osscar command is writing into {out}; waiting for it to finish", file=sys.stderr)
        fd = hold_folder(out, wait=True)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def _deliver(client: RemoteCompressor, final: operations_pb2.Operation, meta: pb.CompressMetadata, out: Path,
             inputs: Sequence[object]) -> None:
    """`deliver`'s download, check and move, with `out` held."""
    staging = out / (STAGING_PREFIX + final.name.rsplit("/", 1)[-1])
    for other in out.glob(STAGING_PREFIX + "*"):  # another operation's, cut short: not this one's to resume
        if other != staging:
            shutil.rmtree(other, ignore_errors=True)
    staging.mkdir(exist_ok=True)
    staged = [client.download(final.name, artifact, staging) for artifact in meta.artifacts]
    for i, path in enumerate(staged):
        if path.suffix == ".tar":  # a pruned model directory
            unpacked = staging / ".unpacked" / path.stem
            shutil.rmtree(unpacked, ignore_errors=True)
            extract_tar(path, unpacked)
            follow_umask(unpacked)
            staged[i] = unpacked
    delivered = {path.name for path in staged}
    if "model" in delivered and (why := foreign_model(out, inputs)):  # made while the job ran
        raise ClientError(f"{why}; the downloaded artifacts wait in {staging}: once it is moved, the same command "
                          "resumes")
    # an earlier job's in a reused --out would seem to be this one's
    earlier = {name for name in earlier_job_files(out) if not touches(out / name, inputs)}
    for name in (set(JOB_EXPORTS) | earlier) - delivered:
        (out / name).unlink(missing_ok=True)
    # an earlier job's pruned model that this one does not replace: the other kind's (model.pt2 beside a new model/),
    # or any when this job returns none (parity failed); as a local job clears them, never the job's own input
    for name in sorted(set(JOB_OUTPUTS) - set(JOB_EXPORTS) - delivered):
        stale = out / name
        if not stale.exists() or touches(stale, inputs) or (stale.is_dir() and foreign_model(out, inputs)):
            continue
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    for path in staged:
        if path.is_dir():
            shutil.rmtree(out / path.name, ignore_errors=True)
        os.replace(path, out / path.name)
    shutil.rmtree(staging, ignore_errors=True)
    print(f"downloaded {len(meta.artifacts)} artifacts (sha256 verified) into {out}", file=sys.stderr)


def server_flags(args: argparse.Namespace) -> str:
    """The connection flags of this command, to repeat in the commands it suggests."""
    flags = [f"--server {shlex.quote(str(args.server))}"]
    for name in ("tls_ca", "tls_cert", "tls_key", "token_file"):
        if getattr(args, name, None) is not None:  # quoted: a path with a space is copied and pasted whole
            flags.append(f"--{name.replace('_', '-')} {shlex.quote(str(getattr(args, name)))}")
    return " ".join(flags)


def failed(err: ClientError | grpc.RpcError) -> int:
    """One line on stderr for a refused or failed call; exit code 2."""
    print(f"osscar: error: {describe_error(err) if isinstance(err, grpc.RpcError) else err}", file=sys.stderr)
    return 2


