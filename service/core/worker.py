"""One compression job in its own process.

The server spawns `run` with a pipe; the worker runs `service.job.compress`, sends every stage and
progress line up the pipe, publishes the artifacts into the content-addressed store and sends the result
(or the `JobError` its exception maps to, `JobError.from_exception`) last. It lowers its own priority
(the server stays responsive) and dies with the server (PR_SET_PDEATHSIG on Linux, plus a watchdog on the
parent's pid), so a killed server never leaves an orphan holding the device.

`execute` is the job itself, whatever process runs it: the local worker above, or a Ray actor
(`service.core.ray_executor`), which sends its messages and keeps its blobs elsewhere. Jobs sharing a
machine take turns measuring latency: `execute` names a lock file (OSSCAR_LATENCY_LOCK) that
`exporters.runtime.measure_latency` holds while it times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporters.runtime import die_with_parent

from .outcomes import JobError

if TYPE_CHECKING:
    from compressor.progress import Progress

log = logging.getLogger(__name__)

MEDIA_TYPES = {".onnx": "application/onnx", ".data": "application/octet-stream", ".json": "application/json",
               ".html": "text/html", ".pt2": "application/zip", ".tar": "application/x-tar"}


@dataclass(frozen=True)
class WorkerArgs:
    operation: str  # operations/<id>
    spec: dict[str, Any]  # CompressRequest fields, references resolved to paths
    references: dict[str, str]  # field -> the reference as the client gave it (provenance)
    home: str  # $OSSCAR_HOME of the server
    work_dir: str  # scratch directory of this attempt (removed at the end)
    device: str  # the device slot this job holds: "cpu" or "cuda:N"
    parent_pid: int
    log_format: str = "json"  # the server's: json or text
    cores: tuple[int, ...] = ()  # CPU cores the job is pinned to (its slot's share); empty: not pinned


Send = Callable[[tuple[str, Any]], None]


def server_paths(args: WorkerArgs) -> dict[str, str]:
    """The server's paths a job's words may hold (its inputs as resolved, their named links, its output and
    scratch, the server's home and its caches), each with what a client is shown instead: the reference as it gave
    it, or what the path is. They mean nothing to a client and are not its business (the server's log keeps them)."""
    from .references import input_name

    work = Path(args.work_dir)
    shown = {str(work): "the job's scratch", str(work / "out"): "the job's artifacts"}
    if len(Path(args.home).parts) > 1:  # its caches (the dense curves a progress line names), not "/" itself
        shown[str(Path(args.home))] = "the server's home"
    for field, reference in args.references.items():
        if reference is not None and args.spec.get(field):
            resolved = str(args.spec[field])
            shown[resolved] = shown[str(work / "inputs" / field / input_name(reference, resolved))] = str(reference)
    return shown


def redact(value: Any, shown: dict[str, str]) -> Any:
    """`value` (a text, or JSON's lists and objects of them) with each server path in `shown` replaced in every
    string (the longest first: a path inside another is its own)."""
    if isinstance(value, str):
        for path in sorted(shown, key=len, reverse=True):
            value = value.replace(path, shown[path])
        return value
    if isinstance(value, list):
        return [redact(v, shown) for v in value]
    if isinstance(value, dict):
        return {k: redact(v, shown) for k, v in value.items()}
    return value


def latency_lock_path(home: os.PathLike | str) -> str:
    """The lock file that serialises latency measurement between the jobs sharing one machine's cores."""
    return os.path.join(home, "latency.lock")


def pin(cores: list[int]) -> None:
    """This process, every thread it has (and what they start later: torch's pool, ONNX Runtime's
    subprocess) on `cores`, and torch's intra-op pool sized to them: jobs sharing a machine each keep to
    their own cores instead of all of them oversubscribing all of them."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(int(task.name), cores)
    import torch

    torch.set_num_threads(len(cores))


def visible_device(device: str) -> str:
    """A `cuda:N` slot as this process's only GPU (CUDA_VISIBLE_DEVICES, before CUDA starts): ONNX Runtime's CUDA
    provider and its bound inputs take device 0, which would otherwise be slot 0's GPU whatever the slot. The
    slot's N counts the GPUs the server sees (its own CUDA_VISIBLE_DEVICES, when set). Returns "cuda:0" for it.
    A `cpu` slot sees no GPU: its job measures on the CPU (taking the machine's latency lock) instead of timing on
    GPU 0 beside the job of slot cuda:0."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return device
    if not device.startswith("cuda:"):
        return device
    index = int(device.split(":", 1)[1])
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    os.environ["CUDA_VISIBLE_DEVICES"] = seen[index] if index < len(seen) else str(index)
    return "cuda:0"


def run(args: WorkerArgs, conn: Connection) -> None:
    """Process entry point (spawned)."""
    from .blobs import BlobStore

    die_with_parent(args.parent_pid)
    # the server stops its workers itself (SIGKILL, after its drain re-queued the job): a Ctrl-C or SIGTERM sent to
    # the server's whole process group (a terminal, systemd's control group) must not end a job as failed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = dataclasses.replace(args, device=visible_device(args.device))
    with contextlib.suppress(OSError):
        os.nice(10)
    from ..logs import configure, operation_id

    configure(args.log_format)
    operation_id.set(args.operation)
    try:
        execute(args, conn.send, BlobStore(Path(args.home) / "blobs"))
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
        conn.close()


def execute(args: WorkerArgs, send: Send, blobs: Any) -> None:
    """Run the job: progress, then ("done", {"report", "artifacts"}) or ("error", JobError) through `send`;
    the artifacts go into `blobs` (a `service.core.blobs.BlobStore`). Exceptions are mapped, not raised (a
    BaseException such as KeyboardInterrupt is sent, then raised again)."""
    os.environ.setdefault("OSSCAR_LATENCY_LOCK", latency_lock_path(args.home))
    current = {"stage": "loading", "round": 0}  # where the job is: progress events, and an error's stage
    try:
        if args.cores:
            pin(list(args.cores))
        result = _compress(args, send, current, blobs)
        send(("done", result))
    except BaseException as err:  # mapped for the caller; the traceback stays in the server's log
        error = JobError.from_exception(err, stage=current["stage"])
        shown = server_paths(args)
        error = dataclasses.replace(error, message=redact(error.message, shown),
                                    metadata={k: redact(v, shown) for k, v in error.metadata.items()})
        if error.reason == "INTERNAL":
            log.error("job failed", exc_info=err)
        send(("error", error))
        if not isinstance(err, Exception):
            raise


def _compress(args: WorkerArgs, send: Send, current: dict[str, Any], blobs: Any) -> dict:
    from ..job import compress
    from ..job.progress import render
    from ..job.report_html import record_references
    from ..job.request import request_from_spec
    from .blobs import tree_sha256
    from .references import named_inputs

    out = Path(args.work_dir) / "out"
    spec = named_inputs(args.spec, args.references, Path(args.work_dir) / "inputs")
    request = request_from_spec(spec, out_dir=out, device=args.device, home=Path(args.home))

    def stage(name: str, index: int) -> None:
        current.update(stage=name, round=index)
        log.info("stage %s (round %d)", name, index)
        send(("progress", {"stage": name, "round": index, "layer": 0, "layers": 0, "message": ""}))

    shown = server_paths(args)

    def progress(record: Progress) -> None:
        message = render(record)
        log.info("%s", message)  # the job's own log, with its operation id; the event goes to watchers
        event = {**current, "message": redact(message, shown)}
        if record.total:  # a pipeline's per-layer step: where it is
            event.update(layer=record.index, layers=record.total)
        send(("progress", event))

    report = compress(request, progress=progress, stage=stage)
    # report.json and report.html name the inputs as the client gave them, and no server path
    report = record_references(out, report, args.references, lambda tree: redact(tree, shown))
    artifacts = []
    for path in sorted(out.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_dir():  # a pruned HF model directory: one tar artifact
            digest, size = blobs.put_tree(path)
            artifacts.append({"name": f"{path.name}.tar", "sha256": digest, "size_bytes": size,
                              "media_type": MEDIA_TYPES[".tar"]})
        else:
            digest, size = blobs.put_file(path)
            artifacts.append({"name": path.name, "sha256": digest, "size_bytes": size,
                              "media_type": MEDIA_TYPES.get(path.suffix, "application/octet-stream")})
    manifest = {
        "operation": args.operation,
        "request": redact(args.spec, shown),
        "references": args.references,
        "inputs": {field: {"reference": args.references.get(field), "sha256": tree_sha256(Path(args.spec[field]))}
                   for field in ("model", "calibration", "eval", "widths_from") if args.spec.get(field)},
        "layers": [{"name": layer.name, "kind": layer.kind, "width_before": layer.width_before,
                    "width_after": layer.width_after, "kept": layer.kept} for layer in report.layers],
        "artifacts": {a["name"]: a["sha256"] for a in artifacts},
        "versions": report.versions,
        "status": report.status,
        "created": time.time(),
    }
    path = Path(args.work_dir) / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    digest, size = blobs.put_file(path)
    artifacts.append({"name": "manifest.json", "sha256": digest, "size_bytes": size,
                      "media_type": MEDIA_TYPES[".json"]})
    return {"report": report.to_json(), "artifacts": artifacts}
