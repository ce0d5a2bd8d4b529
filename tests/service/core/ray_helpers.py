"""What the Ray executor's tests share: a local Ray cluster (`ray.cluster_utils.Cluster`), an
`osscar serve --executor ray` against it, requests, and waiting."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from service.api import compression_pb2 as pb
from service.api.wire import unpack_response
from tests.service.server_process import ServerProcess

logger = logging.getLogger(__name__)


STARTUP_ATTEMPTS = 3  # Ray waits a fixed 30 s for a new raylet to register; a loaded 2-core CI box can miss it


@contextlib.contextmanager
def one_cluster_at_a_time() -> Iterator[None]:
    """Held while a module's cluster lives: local Ray clusters on one host share /tmp/ray (the address file
    that `ray.init("auto")` reads, `session_latest`), so test workers side by side (pytest-xdist) take turns."""
    with open(Path(tempfile.gettempdir()) / "osscar-tests-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def start_cluster(head_cpus: int):
    """A local Ray cluster: a head with `head_cpus` CPUs (nodes are added by the caller, with `add_node`)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=False)
    add_node(cluster, num_cpus=head_cpus, include_dashboard=False, object_store_memory=200 << 20)  # the head
    return cluster


def add_node(cluster, **node_args):
    """`cluster.add_node`, retried as the head's start is."""
    return _started(lambda: cluster.add_node(**node_args))


def _started(start):
    """Run Ray's node start `start`, retrying one that timed out registering with the GCS.

    The test is about our executor, not Ray's startup: a raylet that missed Ray's fixed 30 s window under
    load (CI, 2026-11-29: "The current node timed out during startup") is killed with everything it spawned
    and started afresh; any other error, or the last attempt's, is raised as it came."""
    for attempt in range(1, STARTUP_ATTEMPTS + 1):
        before = _children()
        try:
            return start()
        except Exception as error:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(error) or attempt == STARTUP_ATTEMPTS:
                raise
            for pid in _children() - before:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            logger.warning("Ray node start attempt %d of %d timed out; retrying", attempt, STARTUP_ATTEMPTS)
            time.sleep(2.0)
    raise AssertionError("unreachable")


def _children() -> set[int]:
    """PIDs of this process's direct children (Ray starts its GCS, raylet and helpers as such)."""
    me = os.getpid()
    # the parent is field 4 of stat, the second after the parenthesised name
    return {pid for pid, stat in _proc_files("stat") if int(stat.rsplit(b")", 1)[1].split()[1]) == me}


def _proc_files(name: str) -> Iterator[tuple[int, bytes]]:
    """(pid, /proc/<pid>/<name>) of every process still there when read."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / name).read_bytes()
            except OSError:
                continue


def start_server(home: Path, cluster, data: Path, *extra: str) -> ServerProcess:
    return ServerProcess(home, "--executor", "ray", "--ray-address", cluster.address, "--ray-cpus-per-job", "1",
                         "--shared-roots", str(data), "--ray-scratch", str(home.parent / "node-scratch"),
                         "--log-format", "text", *extra).start()


def request(model: str, calibration: str, repeats: int = 15) -> pb.CompressRequest:
    message = pb.CompressRequest(model=model, calibration=calibration, uniform_ratio=0.5,
                                 request_id=str(uuid.uuid4()))
    message.options.samples = 16
    message.options.repeats = repeats  # 15: a 1-2 ms model; 300: a job that runs for a while (~30 s)
    message.options.refine_steps = 0  # about the executor, not the graph's fit
    return message


def paths(data: Path, repeats: int = 15) -> pb.CompressRequest:
    return request(str(data / "model.pt2"), str(data / "cal.npz"), repeats)


def runner_pids() -> list[int]:
    """Processes of live job actors on this machine (Ray names them `ray::JobRunner...`)."""
    return [pid for pid, cmdline in _proc_files("cmdline") if cmdline.startswith(b"ray::JobRunner")]


def watch(server: ServerProcess, name: str, into: list) -> None:
    for event in server.compression.WatchCompression(pb.WatchCompressionRequest(name=name), timeout=300):
        into.append(event)


def wait_until(condition, timeout: float = 120.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout}s")


def succeeded(op) -> bool:
    return op.done and not op.HasField("error") and unpack_response(op).report.status == "ok"
