"""Fuzzing of the gRPC service's requests with hypothesis: every call must get a deliberate status.

    .venv/bin/python bench/fuzz.py                   # 500 fuzzed calls (about 15 s)
    .venv/bin/python bench/fuzz.py --quick           # 50 (a few seconds)
    .venv/bin/python bench/fuzz.py --examples 5000 --seed 3

Starts a real `osscar serve --port 0` (tests.service.server_process.ServerProcess, its own OSSCAR_HOME in
a temporary directory), uploads a small data file and a directory (so that valid `blob:` references
exist) and, unless --no-blocker, starts one long real job that holds the server's only device slot: jobs
that the fuzzer gets accepted then wait QUEUED and are cancelled at once (CancelOperation) without
spawning a worker each. Then hypothesis (a @given test run once, seeded by --seed, no example database,
generation only) draws --examples calls, each sent with a deadline (--rpc-timeout):

- Compress: every CompressRequest field, either from scratch or as a mutation of a valid request: model /
  calibration / eval / widths_from references (real files and directories, uploaded blobs, embedded
  resources, random and unicode text, traversal, `blob:sha256:` and `embedded:` forms, very long strings,
  NUL bytes, other schemes), floats with nan/inf/negative/huge values, int32 fields at and beyond their
  limits, the shape, method, execution provider, accuracy budget, time budget (any int64 seconds), labels,
  request_id (UUIDs, reused UUIDs, text) and every option, mean/std lists included;
- the Operations service: Get/Cancel/Delete/WaitOperation names (operations the fuzzer created, random
  UUIDs, text, injection-like strings; WaitOperation timeouts of any int64 seconds) and ListOperations
  name, filter (AIP-160-like terms and text), page_size and page_token (real, forged and random);
- WatchCompression and DownloadArtifact names (and artifact names);
- UploadBlob: header fields (file name, archive flag, size and sha256 right, wrong or absurd), message
  orders (no header, two headers, header last, empty messages) and content (random bytes, or tar archives
  built from random members: regular files, directories, links, fifos, devices, `..` and absolute names).

Accepted Compress calls are cancelled at once; RESOURCE_EXHAUSTED (a full queue) is an expected answer.
Targets: 0 INTERNAL or UNKNOWN statuses, 0 server crashes (the process exits), the server alive and
SERVING at the end (and exiting 0 on SIGTERM, with `PRAGMA integrity_check` of its store "ok", and no
process of its home left behind: leftovers are reported and killed).
Also reported: counts per method and status code, DEADLINE_EXCEEDED/UNAVAILABLE (hangs), INVALID_ARGUMENT
answers without a BadRequest field violation, status messages showing a traceback, and for every INTERNAL
or UNKNOWN the request (protobuf text format) and the end of the server's log. The result is printed as one
JSON object and appended as a line to --out (bench/service_results.jsonl).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import math
import os
import shutil
import sqlite3
import tarfile
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.longrunning import operations_pb2
from google.protobuf import duration_pb2, text_format
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from service_common import (
    CIFAR_MEAN,
    CIFAR_STD,
    DATA,
    ROOT,
    git_state,
    leftover_processes,
    record,
)

from service.api import compression_pb2 as pb
from service.api.wire import STATE_NAMES, unpack_metadata
from tests.service.server_process import ServerProcess

BAD_CODES = ("INTERNAL", "UNKNOWN")  # the targets: never
HANG_CODES = ("DEADLINE_EXCEEDED", "UNAVAILABLE")  # reported: a hang, or a server gone
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
FIXED_IDS = [str(uuid.UUID(int=i + 1)) for i in range(3)]  # request_ids drawn again and again: reuse paths
OPTION_INTS = ("samples", "seed", "batch_size", "sequences", "sequence_length", "threads", "round_to", "max_rounds",
               "repeats", "opset")
OPTION_BOOLS = ("stream", "decode_step", "no_curves_cache")
OPTION_WORDS = ("activation_dtype", "deployment_target", "precision")
COMPRESS_FIELDS = ("model", "calibration", "eval", "mode", "shape.batch", "shape.sequence", "execution_provider",
                   "method", "accuracy_budget", "back_off", "time_budget", "labels", "request_id",
                   *(f"options.{name}" for name in (*OPTION_INTS, "min_width", "mean", "std", *OPTION_BOOLS,
                                                    *OPTION_WORDS)))


# ---- the calls ---------------------------------------------------------------------------------------


@dataclass
class Call:
    method: str  # Compress | GetOperation | ... | UploadBlob
    request: Any  # a message, or for UploadBlob the list of messages streamed
    timeout: float | None = None  # the deadline, when other than --rpc-timeout

    def describe(self, limit: int = 4000) -> str:
        if isinstance(self.request, list):
            parts = []
            for message in self.request:
                if message.WhichOneof("part") == "chunk":
                    parts.append(f"chunk {len(message.chunk)} bytes sha256 {hashlib.sha256(message.chunk).hexdigest()}"
                                 f" head {message.chunk[:64]!r}")
                else:
                    parts.append(text_format.MessageToString(message, as_one_line=True, as_utf8=True))
            text = " | ".join(parts) or "(no messages)"
        else:
            text = text_format.MessageToString(self.request, as_one_line=True, as_utf8=True)
        text = f"{self.method}: {text}"
        return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


@dataclass
class Pools:
    """What the fuzzer learns as it goes: names to aim the Operations calls at, real page tokens."""

    operations: list[str] = field(default_factory=list)
    page_tokens: list[str] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)  # valid blob references (uploaded before the run)


def ints(low: int, high: int, *edges: int) -> st.SearchStrategy[int]:
    special = sorted({v for v in (0, 1, -1, 2, 3, *edges, low, high, low + 1, high - 1) if low <= v <= high})
    return st.one_of(st.sampled_from(special), st.integers(low, high))


INT32S = ints(*INT32, 7, 8, 13, 14, 18, 23, 24, 100, 1000, 1024, 1025, 65536, 65537)
INT64S = ints(*INT64, 86400, 7 * 86400, 7 * 86400 + 1, 315_576_000_000, 315_576_000_001, 10**12, 2**31, 2**32)
FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 0.5, 0.999999, 1.0, 1.0000001, 1.5, 2.0, 19.99, 20.0, 20.000001, 50.0,
                                    -1.0, 1e-300, 5e-324, 1e308, math.nan, math.inf, -math.inf]), st.floats())
TEXT = st.text(max_size=40)
LONG = st.builds(lambda unit, n: unit * n, st.sampled_from(["a", "/", "/a", "é", "../", "\x00", "𝔘", " "]),
                 st.integers(100, 6000))
HEX64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)


def reference_strategy(home: Path, data: Path, pools: Pools) -> st.SearchStrategy[str]:
    real = [data / "resnet-cifar10" / "resnet20.pt2", data / "resnet-cifar10" / "resnet56.pt2",
            data / "resnet-cifar10" / "resnet20.th", data / "cifar10" / "train_prefix_5085.npz",
            data / "cifar10" / "test_first1017.npz", data / "stories260K", data / "stories260K" / "config.json",
            data / "stories260K" / "tinystories-valid-tokens.npz", data / "text" / "tinystories-sample5.txt",
            data / "text" / "c4-validation-2000.jsonl", data, data / "README.md", home, home / "jobs.sqlite",
            home / "blobs", ROOT / "README.md", Path("/"), Path("/tmp"), Path("/etc/passwd"), Path("/dev/zero"),
            Path("/dev/null"), Path("/proc/self/environ"), Path("/proc/self/fd/0"), Path("/nonexistent/model.pt2")]
    odd = ["", " ", "model.pt2", "./model.pt2", "~/model.pt2", "../../etc/passwd", "/etc/../etc/passwd",
           f"{data}/../../../etc/passwd", f"{data}/cifar10/../cifar10/train_prefix_5085.npz", "file:///etc/passwd",
           "s3://bucket/model.pt2", "http://127.0.0.1/x", "C:\\model.pt2", "\\\\host\\share\\m.pt2",
           " /etc/passwd", "/etc/passwd\n", "/tmp/\x00x", f"{data}/resnet-cifar10/resnet20.pt2\x00.npz", "blob:",
           "blob:sha256:", "blob:sha256:/", "blob:md5:abc/x", "embedded:", "embedded:all-MiniLM-L6-v2/../x",
           "embedded:calibration.txt ", "EMBEDDED:calibration.txt", "embedded:gpt-5", "//etc/passwd",
           "/" + "a" * 255, "/" + "a" * 256, "/" + "a/" * 2100]
    digests = st.one_of(HEX64, HEX64.map(str.upper), st.sampled_from([b.split(":")[2].split("/")[0]
                                                                       for b in pools.blobs] or ["0" * 64]),
                        st.text(alphabet="0123456789abcdef", max_size=70), TEXT)
    blob_names = st.one_of(st.sampled_from(["cal.npz", "model.pt2", "hf-model", "x", "..", ".", "a/b", "", "-"]),
                           TEXT)
    return st.one_of(
        st.sampled_from([str(p) for p in real]),
        st.sampled_from(pools.blobs or ["blob:sha256:" + "0" * 64 + "/x"]),
        st.sampled_from(["embedded:all-MiniLM-L6-v2", "embedded:calibration.txt"]),
        st.sampled_from(odd),
        TEXT,
        LONG,
        st.builds(lambda d, n: f"blob:sha256:{d}/{n}", digests, blob_names),
        st.builds(lambda t: f"embedded:{t}", TEXT),
        st.builds(lambda base, tail: str(base) + tail, st.sampled_from([str(p) for p in real[:11]]), TEXT),
    )


def compress_strategy(home: Path, data: Path, pools: Pools) -> st.SearchStrategy[Call]:
    references = reference_strategy(home, data, pools)
    words = st.one_of(TEXT, st.sampled_from(["", "cpu", "cuda", "CPU", "tpu", "cuda:0", "osscar", "mp", "mp+",
                                             "thinet", "OSSCAR", "magic", "fp32", "fp16", "int4", "float32",
                                             "float16", "int8"]))
    label_keys = st.one_of(st.from_regex(r"\A[a-z][a-z0-9_-]{0,62}\Z"), TEXT,
                           st.sampled_from(["", "Bad Key", "a" * 64]))
    request_ids = st.one_of(st.just(""), st.sampled_from(FIXED_IDS), st.uuids().map(str),
                            st.uuids().map(lambda u: str(u).upper()), st.uuids().map(lambda u: f"{{{u}}}"),
                            st.uuids().map(lambda u: f"urn:uuid:{u}"), st.uuids().map(lambda u: u.hex), TEXT)

    @st.composite
    def build(draw: Callable) -> Call:
        request = pb.CompressRequest()
        if draw(st.booleans()):  # a valid request with a few fields fuzzed (none at times): the deeper checks
            request.model = str(data / "resnet-cifar10" / "resnet20.pt2")
            request.calibration = str(data / "cifar10" / "train_prefix_5085.npz")
            request.uniform_ratio = 0.5
            request.request_id = str(uuid.uuid4())
            request.options.samples, request.options.repeats = 16, 3
            request.options.mean.extend(CIFAR_MEAN)
            request.options.std.extend(CIFAR_STD)
            chosen = set(draw(st.lists(st.sampled_from(COMPRESS_FIELDS), unique=True,
                                       max_size=draw(st.sampled_from([1, 2, 4])))))
        else:  # from scratch: any subset of the fields
            chosen = {name for name in COMPRESS_FIELDS if draw(st.booleans())}
        for name in ("model", "calibration", "eval"):
            if name in chosen:
                setattr(request, name, draw(references))
        if "mode" in chosen:
            mode = draw(st.sampled_from(["none", "target_speedup", "uniform_ratio", "widths_from"]))
            if mode == "none":
                request.ClearField("mode")
            elif mode == "widths_from":
                request.widths_from = draw(references)
            else:
                setattr(request, mode, draw(FLOATS))
        for name in ("batch", "sequence"):
            if f"shape.{name}" in chosen:
                setattr(request.shape, name, draw(INT32S))
        for name in ("execution_provider", "method"):
            if name in chosen:
                setattr(request, name, draw(words))
        if "accuracy_budget" in chosen:
            request.accuracy_budget = draw(FLOATS)
        if "back_off" in chosen:
            request.back_off = draw(st.booleans())
        if "time_budget" in chosen:
            request.time_budget.CopyFrom(duration_pb2.Duration(seconds=draw(INT64S), nanos=draw(INT32S)))
        if "labels" in chosen:
            request.labels.update(draw(st.dictionaries(label_keys, st.one_of(TEXT, LONG.map(lambda s: s[:200])),
                                                       max_size=draw(st.sampled_from([3, 70])))))
        if "request_id" in chosen:
            request.request_id = draw(request_ids)
        options = request.options
        for name in OPTION_INTS:
            if f"options.{name}" in chosen:
                setattr(options, name, draw(INT32S))
        if "options.min_width" in chosen:
            options.min_width = draw(FLOATS)
        for name in ("mean", "std"):
            if f"options.{name}" in chosen:
                options.ClearField(name)
                getattr(options, name).extend(draw(st.lists(FLOATS, max_size=draw(st.sampled_from([4, 300])))))
        for name in OPTION_BOOLS:
            if f"options.{name}" in chosen:
                setattr(options, name, draw(st.booleans()))
        for name in OPTION_WORDS:
            if f"options.{name}" in chosen:
                setattr(options, name, draw(words))
        return Call("Compress", request)

    return build()


def operation_names(pools: Pools) -> st.SearchStrategy[str]:
    odd = ["", "operations", "operations/", "operations/..", "operations/../jobs.sqlite", "operations/%",
           "operations/*", "operations/' OR '1'='1", "operations/\x00", "jobs/1", "OPERATIONS/x",
           "operations/" + "0" * 5000]

    @st.composite
    def build(draw: Callable) -> str:
        # the same draws whatever the pool holds (hypothesis requires generation independent of outside state)
        known, index = draw(st.booleans()), draw(st.integers(0, 1 << 16))
        other = draw(st.one_of(st.uuids().map(lambda u: f"operations/{u}"), st.sampled_from(odd),
                               TEXT.map(lambda t: f"operations/{t}"), TEXT, LONG))
        return pools.operations[index % len(pools.operations)] if known and pools.operations else other

    return build()


def filters() -> st.SearchStrategy[str]:
    keys = st.one_of(st.sampled_from(["state", "done", "model", "calibration", "method", "labels.team",
                                      "labels.bench", "labels.Bad", "labels.", "labels.a-b", "labels.a.b", "owner",
                                      "name", "create_time", "STATE"]), TEXT)
    ops = st.sampled_from(["=", "==", "!=", ":", "~", ">", "", " = "])
    values = st.one_of(st.sampled_from(["RUNNING", "running", "QUEUED", "SUCCEEDED", "FAILED", "CANCELLED", "true",
                                        "false", "1", '"x"', '"osscar"', '""', "*", '"', "'x'", '"a" OR 1=1']),
                       TEXT, TEXT.map(lambda t: '"' + t.replace('"', "") + '"'))
    terms = st.builds(lambda k, o, v: f"{k} {o} {v}", keys, ops, values)
    return st.one_of(st.just(""), terms, st.lists(terms, min_size=1, max_size=4).map(" AND ".join),
                     st.lists(terms, min_size=1, max_size=3).map(" OR ".join),
                     st.builds(lambda ts, sep: sep.join(ts), st.lists(terms, min_size=1, max_size=3),
                               st.sampled_from(["AND", " and ", "  AND  ", "\tAND\n", " AND AND "])), TEXT, LONG)


def page_tokens(pools: Pools) -> st.SearchStrategy[str]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), TEXT)
    forged = st.fixed_dictionaries({}, optional={"t": scalars, "n": scalars, "f": scalars}).map(
        lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).decode())

    @st.composite
    def build(draw: Callable) -> str:
        known, index, cut = draw(st.booleans()), draw(st.integers(0, 1 << 16)), draw(st.integers(0, 100))
        other = draw(st.one_of(st.just(""), forged, st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
                               st.just(base64.urlsafe_b64encode(b"[1, 2]").decode()), TEXT, LONG))
        if not (known and pools.page_tokens):
            return other
        token = pools.page_tokens[index % len(pools.page_tokens)]
        return token if cut == 100 else token[: len(token) * cut // 100]  # whole, or cut short

    return build()


def operations_strategy(pools: Pools) -> st.SearchStrategy[Call]:
    names = operation_names(pools)

    @st.composite
    def build(draw: Callable) -> Call:
        method = draw(st.sampled_from(["GetOperation", "CancelOperation", "DeleteOperation", "WaitOperation",
                                       "ListOperations", "ListOperations", "WatchCompression", "DownloadArtifact"]))
        if method == "ListOperations":
            request = operations_pb2.ListOperationsRequest(
                name=draw(st.one_of(st.sampled_from(["", "operations"]), TEXT)), filter=draw(filters()),
                page_size=draw(INT32S), page_token=draw(page_tokens(pools)))
            return Call(method, request)
        if method == "WaitOperation":
            request = operations_pb2.WaitOperationRequest(name=draw(names))
            if draw(st.booleans()):
                request.timeout.CopyFrom(duration_pb2.Duration(seconds=draw(st.one_of(st.integers(-2, 2), INT64S)),
                                                               nanos=draw(INT32S)))
            return Call(method, request, timeout=4.0)  # the server answers before the deadline: keep it short
        if method == "WatchCompression":
            return Call(method, pb.WatchCompressionRequest(name=draw(names)), timeout=4.0)
        if method == "DownloadArtifact":
            artifact = draw(st.one_of(st.sampled_from(["model.onnx", "report.json", "manifest.json", "model.pt2", "",
                                                       "../jobs.sqlite", "/etc/passwd"]), TEXT))
            return Call(method, pb.DownloadArtifactRequest(name=draw(names), artifact=artifact))
        return Call(method, getattr(operations_pb2, f"{method}Request")(name=draw(names)))

    return build()


def tar_archive(draw: Callable) -> bytes:
    """An uncompressed tar built from random members: plain ones and hostile ones."""
    names = st.one_of(st.sampled_from(["a", "b", "a/b", "a/b/c", "dir", "dir/f", "config.json", ".", "./a", "a/",
                                       "../x", "a/../../x", "/abs", "/etc/passwd", "a//b", "é", "a" * 120,
                                       "d/" * 60 + "f"]), TEXT.filter(bool))
    kinds = st.sampled_from([tarfile.REGTYPE, tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                             tarfile.FIFOTYPE, tarfile.CHRTYPE])
    members = draw(st.lists(st.tuples(names, kinds, names, st.binary(max_size=64)), max_size=6))
    form = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=form) as tar:
        for name, kind, link, content in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = link if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            info.size = len(content) if kind == tarfile.REGTYPE else 0
            try:
                tar.addfile(info, io.BytesIO(content) if kind == tarfile.REGTYPE else None)
            except ValueError:  # a name this format cannot hold
                continue
    return buffer.getvalue()


def upload_strategy() -> st.SearchStrategy[Call]:
    filenames = st.one_of(st.sampled_from(["a.npz", "model.pt2", "cal.npz", "x", "..", ".", "...", "../x", "a/b",
                                           "", " ", "-", "a" * 255, "a" * 256, "é.npz", ".hidden", "a\x00b", "a\\b",
                                           "hf-model", "con"]), TEXT)

    @st.composite
    def build(draw: Callable) -> Call:
        archive = draw(st.booleans())
        content = tar_archive(draw) if draw(st.booleans()) else draw(st.binary(max_size=4096))
        if content and draw(st.integers(0, 9)) == 0:  # damage it
            cut = draw(st.integers(0, len(content) - 1))
            content = content[:cut] if draw(st.booleans()) else content[:cut] + bytes([content[cut] ^ 0xFF]) + \
                content[cut + 1:]
        digest = hashlib.sha256(content).hexdigest()
        header = pb.BlobHeader(
            filename=draw(filenames), archive=archive,
            size_bytes=draw(st.one_of(st.just(0), st.just(len(content)), INT64S)),
            sha256=draw(st.one_of(st.just(""), st.just(digest), st.just(digest.upper()), HEX64, TEXT)))
        cuts = sorted(draw(st.lists(st.integers(0, len(content)), max_size=3)))
        chunks = [content[a:b] for a, b in zip([0, *cuts], [*cuts, len(content)], strict=True)]
        messages = [pb.UploadBlobRequest(chunk=c) for c in chunks]
        order = draw(st.sampled_from(["normal", "normal", "normal", "no-header", "header-twice", "header-last",
                                      "empty-message", "nothing"]))
        first = pb.UploadBlobRequest(header=header)
        if order == "normal":
            messages = [first, *messages]
        elif order == "header-twice":
            messages = [first, *messages[:1], first, *messages[1:]]
        elif order == "header-last":
            messages = [*messages, first]
        elif order == "empty-message":
            messages = [first, pb.UploadBlobRequest(), *messages]
        elif order == "nothing":
            messages = []
        return Call("UploadBlob", messages, timeout=30.0)

    return build()


# ---- sending and counting ----------------------------------------------------------------------------


class Fuzzer:
    def __init__(self, server: ServerProcess, args: argparse.Namespace, pools: Pools) -> None:
        self.server, self.args, self.pools = server, args, pools
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.examples = 0
        self.accepted = 0
        self.crashes: list[dict] = []
        self.bad: list[dict] = []  # INTERNAL / UNKNOWN
        self.hangs: list[dict] = []
        self.no_field_violation: list[str] = []
        self.traceback_in_details: list[str] = []
        self.client_errors: list[str] = []
        self.cleanup: Counter = Counter()
        self.oversized_errors: list[str] = []  # status messages + details over the client's metadata limit
        self.first: dict[str, dict] = {}  # "method CODE" -> its first call and status message

    def send(self, call: Call) -> None:
        self.examples += 1
        mark = self.server.log.stat().st_size
        timeout = call.timeout or self.args.rpc_timeout
        code, details, error = "OK", "", None
        try:
            result = self._invoke(call, timeout)
            if call.method == "Compress":
                self._accepted(result)
        except grpc.RpcError as err:
            error, code, details = err, err.code().name, err.details() or ""
        except Exception as err:  # the client could not even send it: not the server's fault, but shown
            self.client_errors.append(f"{type(err).__name__}: {str(err)[:200]} for {call.describe(300)}")
            code = "CLIENT_ERROR"
        self.counts[call.method][code] += 1
        self.first.setdefault(f"{call.method} {code}", {"details": details[:300], "request": call.describe(600)})
        if code == "RESOURCE_EXHAUSTED" and "metadata size exceeds" in details:  # the error, too big to arrive
            self.oversized_errors.append(f"{details[:200]} for {call.describe(300)}")
        if code in BAD_CODES or code in HANG_CODES:
            entry = {"method": call.method, "code": code, "details": details[:500], "request": call.describe(),
                     "server_log": self._log_since(mark)}
            (self.bad if code in BAD_CODES else self.hangs).append(entry)
        if "Traceback (most recent call last)" in details:
            self.traceback_in_details.append(f"{code}: {details[:300]} for {call.describe(300)}")
        if code == "INVALID_ARGUMENT" and not self._field_violations(error):
            self.no_field_violation.append(f"{details[:300]} for {call.describe(300)}")
        if self.server.process.poll() is not None:
            self.crashes.append({"exit_code": self.server.process.returncode, "after": call.describe(),
                                 "server_log": self._log_since(mark)})
            self.server = ServerProcess(self.server.home, *self.server.extra).start()

    def _invoke(self, call: Call, timeout: float) -> Any:
        if call.method in ("GetOperation", "CancelOperation", "DeleteOperation", "WaitOperation", "ListOperations"):
            result = getattr(self.server.operations, call.method)(call.request, timeout=timeout)
            if call.method == "ListOperations" and result.next_page_token:
                self.pools.page_tokens.append(result.next_page_token)
            return result
        if call.method == "Compress":
            return self.server.compression.Compress(call.request, timeout=timeout)
        if call.method == "UploadBlob":
            return self.server.compression.UploadBlob(iter(call.request), timeout=timeout)
        stream = getattr(self.server.compression, call.method)(call.request, timeout=timeout)
        try:  # a few messages are enough; the stream of a running job would go on
            for count, _ in enumerate(stream):
                if count >= 3:
                    break
        finally:
            stream.cancel()
        return None

    def _accepted(self, op: operations_pb2.Operation) -> None:
        self.accepted += 1
        if op.name not in self.pools.operations:
            self.pools.operations.append(op.name)
        if op.done:
            return
        try:
            self.server.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=op.name), timeout=60)
            self.cleanup["cancelled"] += 1
        except grpc.RpcError as err:  # e.g. the fuzzer's own calls already ended it
            self.cleanup[f"cancel {err.code().name}"] += 1

    @staticmethod
    def _field_violations(error: grpc.RpcError | None) -> int:
        status = rpc_status.from_call(error) if error is not None else None
        count = 0
        for detail in status.details if status is not None else []:
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad):
                count += len(bad.field_violations)
        return count

    def _log_since(self, mark: int, limit: int = 3000) -> str:
        try:
            with open(self.server.log, "rb") as f:
                f.seek(mark)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return text[-limit:]


# ---- set-up and the run ------------------------------------------------------------------------------


def prepare_blobs(server: ServerProcess, work: Path) -> list[str]:
    """Valid blob references: a small .npz of images and a directory uploaded as a tar."""
    rng = np.random.default_rng(0)
    np.savez(work / "cal.npz", x=rng.integers(0, 256, size=(8, 32, 32, 3), dtype=np.uint8))
    folder = work / "hf-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(folder / "config.json", arcname="config.json")
    references = []
    for name, content, archive in (("cal.npz", (work / "cal.npz").read_bytes(), False),
                                   ("hf-model", buffer.getvalue(), True)):
        header = pb.BlobHeader(filename=name, archive=archive, size_bytes=len(content),
                               sha256=hashlib.sha256(content).hexdigest())
        blob = server.compression.UploadBlob(iter([pb.UploadBlobRequest(header=header),
                                                   pb.UploadBlobRequest(chunk=content)]), timeout=30)
        references.append(blob.reference)
    return references


def start_blocker(server: ServerProcess, data: Path) -> str:
    """A long real job on the only device slot: accepted fuzz jobs then wait QUEUED until cancelled."""
    request = pb.CompressRequest(model=str(data / "resnet-cifar10" / "resnet20.pt2"),
                                 calibration=str(data / "cifar10" / "train_prefix_5085.npz"), uniform_ratio=0.5,
                                 request_id=str(uuid.uuid4()), labels={"bench": "fuzz-blocker"})
    request.options.samples, request.options.repeats = 16, 10_000  # the most allowed: ~30 min on 2 cores
    request.options.mean.extend(CIFAR_MEAN)
    request.options.std.extend(CIFAR_STD)
    op = server.compression.Compress(request, timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not server.workers():
        time.sleep(0.1)
    return op.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=500, help="fuzzed calls (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 50 calls")
    parser.add_argument("--rpc-timeout", type=float, default=15.0, help="deadline of each call in seconds (default 15)")
    parser.add_argument("--max-queue", type=int, default=16, help="the server's --max-queue (default 16)")
    parser.add_argument("--no-blocker", action="store_true",
                        help="no long job holding the device: accepted jobs start (a worker each) before the cancel")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared data directory")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("service_results.jsonl"),
                        help="JSON lines file the result is appended to")
    parser.add_argument("--keep", action="store_true", help="keep the server's home and log (path printed)")
    args = parser.parse_args()
    if args.quick:
        args.examples = 50
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="osscar-fuzz-"))
    server = ServerProcess(work / "home", "--max-queue", str(args.max_queue))
    fuzzer = Fuzzer(server, args, Pools())
    try:
        server.start()
        pools = fuzzer.pools
        pools.blobs = prepare_blobs(server, work)
        blocker = None if args.no_blocker else start_blocker(server, args.data)
        call = st.one_of(compress_strategy(server.home, args.data, pools),
                         compress_strategy(server.home, args.data, pools), operations_strategy(pools),
                         upload_strategy())

        @seed(args.seed)
        @settings(max_examples=args.examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(call)
        def fuzz(c: Call) -> None:
            fuzzer.send(c)

        fuzz()
        server = fuzzer.server
        alive = server.process.poll() is None
        serving = alive and server.health() == health_pb2.HealthCheckResponse.SERVING
        blocker_state = None
        if blocker is not None:
            blocker_state = STATE_NAMES.get(unpack_metadata(server.get(blocker)).state)
            server.operations.CancelOperation(operations_pb2.CancelOperationRequest(name=blocker), timeout=60)
    finally:
        exit_code = fuzzer.server.stop() if fuzzer.server.process is not None else None
        leftovers = leftover_processes(server.home)
    db = sqlite3.connect(f"file:{server.home / 'jobs.sqlite'}?mode=ro", uri=True)
    try:
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
        left = db.execute("SELECT COUNT(*) FROM operations WHERE state IN ('QUEUED', 'RUNNING')").fetchone()[0]
    finally:
        db.close()
    log_text = server.log.read_text(errors="replace")
    counts = {method: dict(c) for method, c in sorted(fuzzer.counts.items())}
    totals: Counter = Counter()
    for c in fuzzer.counts.values():
        totals.update(c)
    signatures = Counter(f"{b['method']} {b['code']}: {_exception_line(b['server_log'])}" for b in fuzzer.bad)
    result = {
        "bench": "fuzz", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), **git_state(), "seed": args.seed,
        "examples": fuzzer.examples, "blocker": not args.no_blocker, "codes": dict(totals.most_common()),
        "codes_by_method": counts, "accepted_compress": fuzzer.accepted, "cleanup": dict(fuzzer.cleanup),
        "first_example_by_code": fuzzer.first,
        "internal_or_unknown": len(fuzzer.bad), "internal_signatures": dict(signatures.most_common()),
        "internal_examples": _distinct(fuzzer.bad, 10),
        "error_metadata_too_large": len(fuzzer.oversized_errors),
        "error_metadata_too_large_examples": fuzzer.oversized_errors[:5],
        "hangs": len(fuzzer.hangs), "hang_examples": fuzzer.hangs[:5], "crashes": len(fuzzer.crashes),
        "crash_examples": fuzzer.crashes[:5], "invalid_argument_without_field_violation":
            len(fuzzer.no_field_violation), "invalid_argument_without_field_violation_examples":
            fuzzer.no_field_violation[:5], "traceback_in_status_message": fuzzer.traceback_in_details[:5],
        "client_errors": fuzzer.client_errors[:10], "server_alive_at_end": alive, "server_serving_at_end": serving,
        "blocker_state_at_end": blocker_state, "server_exit_code": exit_code, "store_integrity": integrity,
        "operations_left_unfinished": left, "leftover_processes": leftovers,
        "server_log_errors": sum('"level": "error"' in line or " ERROR " in line for line in log_text.splitlines()),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    result["targets"] = {"internal_or_unknown": 0, "crashes": 0, "server_serving_at_end": True}
    result["pass"] = (not fuzzer.bad and not fuzzer.crashes and alive and serving and exit_code == 0
                      and integrity == "ok")
    if args.keep or fuzzer.bad or fuzzer.crashes:
        result["kept"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    record(result, args.out)


def _exception_line(log: str) -> str:
    """The last `SomeError: message` line of a traceback in a log excerpt (plain or JSON lines)."""
    lines = log.replace("\\n", "\n").splitlines()
    for line in reversed(lines):
        text = line.strip().strip('",}')
        head = text.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Overflow")) and " " not in head:
            return text[:200]
    return "(no exception in the log)"


def _distinct(bad: list[dict], limit: int) -> list[dict]:
    """Up to `limit` INTERNAL examples, one per method and exception first."""
    seen, out = set(), []
    for b in bad:
        key = (b["method"], _exception_line(b["server_log"]))
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out[:limit]


if __name__ == "__main__":
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "osscar-fuzz-hypothesis"))
    main()
