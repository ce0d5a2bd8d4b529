"""Load on the gRPC service: many clients polling and watching while a real job runs.

    .venv/bin/python bench/load.py                   # 100 clients for 60 s (about 70 s in all)
    .venv/bin/python bench/load.py --quick           # 10 clients for 10 s (about 20 s)
    .venv/bin/python bench/load.py --clients 200 --duration 120 --poll-interval 0.05

Starts a real `osscar serve --port 0` (tests.service.server_process.ServerProcess, with its own
OSSCAR_HOME in a temporary directory) and submits a real job: ResNet-20 (shared data), uniform ratio 0.5,
--samples calibration images and --repeats latency runs (enough that it still runs when the window
closes; should it end early, the next one is submitted at once, so a job runs for the whole window).
Then --clients clients run for --duration seconds, all in one asyncio event loop (grpc.aio, one channel
each, so one thread serves them all): half poll GetOperation on the current job every --poll-interval
seconds, half hold a WatchCompression stream on it (re-opened when it ends). After the window the job is
cancelled and the server stopped with SIGTERM.

Measured: RPCs by method, errors by method and status code (target: 0), GetOperation latency p50/p90/
p99/max in ms (target: p99 < 20 ms), watch events and streams, the delay between a progress event's
server time stamp and its arrival at a watcher, whether the job made progress during the window (its
stage at the start and at the end of the window, the progress events seen, the jobs finished), the
server's CPU seconds, processes of the server's home still alive after it stopped (a leak; they are
killed), and `loop_lag_ms`: how late a 10 ms sleep of the client's event loop wakes up.
The clients share the machine's cores with the server and its worker, so their latencies include the
client's own scheduling delays: a large loop lag means the client, not the server, was the bottleneck.

The result is printed as one JSON object and appended as a line to --out (bench/service_results.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from grpc_health.v1 import health_pb2
from service_common import (
    DATA,
    git_state,
    leftover_processes,
    record,
    resnet_request,
)

from service.api import compression_pb2 as pb
from service.api import compression_pb2_grpc as pb_grpc
from service.api.wire import STATE_NAMES, unpack_metadata
from tests.service.server_process import ServerProcess

TARGET_P99_MS = 20.0


def percentiles(values: list[float], points: tuple[float, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles and the maximum, rounded to 0.01."""
    if not values:
        return {**{f"p{p:g}": None for p in points}, "max": None, "count": 0}
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for p in points:
        rank = max(1, min(len(ordered), int(-(-p * len(ordered) // 100))))
        out[f"p{p:g}"] = round(ordered[rank - 1], 2)
    out["max"] = round(ordered[-1], 2)
    out["count"] = len(ordered)
    return out


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process (Linux /proc), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Stats:
    rpcs: Counter = field(default_factory=Counter)  # method -> calls answered OK
    errors: Counter = field(default_factory=Counter)  # "method CODE" -> calls
    get_ms: list[float] = field(default_factory=list)  # GetOperation round trips, OK or not
    watch_events: int = 0
    watch_streams: int = 0
    event_lag_ms: list[float] = field(default_factory=list)  # server time stamp -> received, progress events
    loop_lag_ms: list[float] = field(default_factory=list)
    progress: set[tuple] = field(default_factory=set)  # (job, stage, round, layer) seen by the clients


@dataclass
class Shared:
    """What the clients look at: the current job; set by the job driver."""

    job: str
    end: float  # monotonic end of the window
    stopping: bool = False
    calls: set = field(default_factory=set)  # open watch calls, cancelled at the end
    jobs: list[dict] = field(default_factory=list)  # every job of the run and how it ended


async def poller(channel: grpc.aio.Channel, shared: Shared, stats: Stats, interval: float, timeout: float) -> None:
    stub = operations_pb2_grpc.OperationsStub(channel)
    await asyncio.sleep(random.uniform(0, interval))  # spread the clients over the interval
    while time.monotonic() < shared.end:
        start = time.perf_counter()
        try:
            op = await stub.GetOperation(operations_pb2.GetOperationRequest(name=shared.job), timeout=timeout)
            stats.rpcs["GetOperation"] += 1
            meta = unpack_metadata(op)
            stats.progress.add((op.name, meta.stage, meta.round, meta.layer))
        except grpc.aio.AioRpcError as err:
            stats.errors[f"GetOperation {err.code().name}"] += 1
        stats.get_ms.append((time.perf_counter() - start) * 1000)
        await asyncio.sleep(interval)


async def watcher(channel: grpc.aio.Channel, shared: Shared, stats: Stats, interval: float) -> None:
    stub = pb_grpc.CompressionStub(channel)
    await asyncio.sleep(random.uniform(0, interval))
    while time.monotonic() < shared.end and not shared.stopping:
        name = shared.job
        call = stub.WatchCompression(pb.WatchCompressionRequest(name=name))
        shared.calls.add(call)
        stats.watch_streams += 1
        try:
            async for event in call:
                stats.watch_events += 1
                if not event.HasField("operation"):  # the first and last events carry the state, not a fresh event
                    stats.event_lag_ms.append((time.time() - event.time.ToNanoseconds() / 1e9) * 1000)
                    stats.progress.add((name, event.stage, event.round, event.layer))
            stats.rpcs["WatchCompression"] += 1
        except grpc.aio.AioRpcError as err:
            if not (shared.stopping and err.code() == grpc.StatusCode.CANCELLED):  # we closed it at the end
                stats.errors[f"WatchCompression {err.code().name}"] += 1
        except asyncio.CancelledError:  # grpc.aio raises this in the reader of a call we cancelled
            if not shared.stopping:
                raise
        finally:
            shared.calls.discard(call)
        if shared.job == name and not shared.stopping:  # the job ended and no next one yet: do not spin
            await asyncio.sleep(interval)


async def ticker(shared: Shared, stats: Stats) -> None:
    """How late the client's event loop wakes from a 10 ms sleep: the client's own saturation."""
    while time.monotonic() < shared.end:
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        stats.loop_lag_ms.append((time.perf_counter() - start) * 1000 - 10)


async def describe(ops: operations_pb2_grpc.OperationsStub, name: str) -> dict:
    op = await ops.GetOperation(operations_pb2.GetOperationRequest(name=name), timeout=30)
    meta = unpack_metadata(op)
    return {"job": name, "state": STATE_NAMES.get(meta.state, str(meta.state)), "stage": meta.stage,
            "round": meta.round, "layer": meta.layer, "layers": meta.layers}


async def driver(channel: grpc.aio.Channel, shared: Shared, make_request) -> None:
    """Keeps a job running for the whole window: when one ends, the next is submitted."""
    ops = operations_pb2_grpc.OperationsStub(channel)
    compression = pb_grpc.CompressionStub(channel)
    while time.monotonic() < shared.end:
        request = operations_pb2.WaitOperationRequest(name=shared.job)
        request.timeout.FromMilliseconds(int(1000 * min(5.0, max(0.1, shared.end - time.monotonic()))))
        op = await ops.WaitOperation(request, timeout=30)
        if not op.done:
            continue
        meta = unpack_metadata(op)
        shared.jobs[-1].update(state=STATE_NAMES.get(meta.state), code=op.error.code, ended_in_window=True)
        if time.monotonic() < shared.end:
            op = await compression.Compress(make_request(), timeout=30)
            shared.jobs.append({"job": op.name})
            shared.job = op.name


async def run_clients(address: str, job: str, args: argparse.Namespace, make_request) -> dict:
    stats = Stats()
    shared = Shared(job=job, end=time.monotonic() + args.duration, jobs=[{"job": job}])
    control = grpc.aio.insecure_channel(address)
    ops = operations_pb2_grpc.OperationsStub(control)
    channels = [grpc.aio.insecure_channel(address) for _ in range(args.clients)]
    await asyncio.gather(*(c.channel_ready() for c in channels))
    at_start = await describe(ops, job)
    shared.end = time.monotonic() + args.duration
    clients = [poller(c, shared, stats, args.poll_interval, args.rpc_timeout) if i % 2 == 0
               else watcher(c, shared, stats, args.poll_interval) for i, c in enumerate(channels)]
    tasks = [asyncio.create_task(t) for t in (*clients, ticker(shared, stats), driver(control, shared, make_request))]
    await asyncio.sleep(args.duration)
    shared.stopping = True
    for call in list(shared.calls):
        call.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    crashed = [repr(r) for r in results if isinstance(r, BaseException)]
    at_end = await describe(ops, shared.job)
    for entry in shared.jobs:  # the window is over: cancel what still runs
        if "state" not in entry:
            try:
                await ops.CancelOperation(operations_pb2.CancelOperationRequest(name=entry["job"]), timeout=60)
            except grpc.aio.AioRpcError as err:
                entry["cancel_error"] = err.code().name
            final = await describe(ops, entry["job"])
            entry.update(state=final["state"], ended_in_window=False)
    for c in (*channels, control):
        await c.close()
    events_in_window = len({p for p in stats.progress if p[1] not in ("", "queued")})
    total_ok = sum(stats.rpcs.values())
    total_errors = sum(stats.errors.values())
    return {
        "rpcs": total_ok + total_errors,
        "rpcs_by_method": dict(stats.rpcs),
        "errors": total_errors,
        "errors_by_code": dict(stats.errors),
        "client_task_crashes": crashed,
        "get_operation_ms": percentiles(stats.get_ms),
        "get_operation_per_s": round(len(stats.get_ms) / args.duration, 1),
        "watch_streams": stats.watch_streams,
        "watch_events": stats.watch_events,
        "watch_event_lag_ms": percentiles(stats.event_lag_ms),
        "loop_lag_ms": percentiles(stats.loop_lag_ms),
        "job": {"at_start": at_start, "at_end": at_end, "distinct_progress_states_seen": events_in_window,
                "jobs": shared.jobs, "finished_in_window": sum(bool(j.get("ended_in_window")) for j in shared.jobs),
                "made_progress": at_start != at_end or len(shared.jobs) > 1},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100, help="concurrent clients, half polling, half watching "
                                                                   "(default 100)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--poll-interval", type=float, default=0.1,
                        help="seconds a poller sleeps between GetOperation calls (default 0.1)")
    parser.add_argument("--rpc-timeout", type=float, default=5.0, help="deadline of each GetOperation (default 5 s)")
    parser.add_argument("--samples", type=int, default=32, help="calibration images of the job (default 32)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="latency runs of the job (default 0: 8 per second of --duration, at least 40, so "
                             "that it outlasts the window)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 clients for 10 s")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared data directory (resnet-cifar10/, cifar10/)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("service_results.jsonl"),
                        help="JSON lines file the result is appended to")
    parser.add_argument("--keep", action="store_true", help="keep the server's home and log (path printed)")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.duration = 10, 10.0
    repeats = args.repeats or max(40, int(8 * args.duration))

    work = Path(tempfile.mkdtemp(prefix="osscar-load-"))
    started = time.monotonic()
    server = ServerProcess(work / "home").start()
    try:
        first = server.compression.Compress(resnet_request(args.data, args.samples, repeats, "load"), timeout=30)
        cpu_before = cpu_seconds(server.process.pid)
        result = asyncio.run(run_clients(server.address, first.name, args,
                                         lambda: resnet_request(args.data, args.samples, repeats, "load")))
        cpu_after = cpu_seconds(server.process.pid)
        serving = server.health()
        alive = server.process.poll() is None
    finally:
        exit_code = server.stop()
        leftovers = leftover_processes(server.home)
    result = {
        "bench": "load", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), **git_state(),
        "clients": args.clients, "pollers": (args.clients + 1) // 2, "watchers": args.clients // 2,
        "duration_s": args.duration, "poll_interval_s": args.poll_interval, "job_repeats": repeats,
        "cpus": os.cpu_count(), **result,
        "server_cpu_s": round(cpu_after - cpu_before, 2) if cpu_before is not None and cpu_after is not None else None,
        "server_alive": alive, "server_health_serving_at_end": serving == health_pb2.HealthCheckResponse.SERVING,
        "server_exit_code": exit_code, "leftover_processes": leftovers,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    p99 = result["get_operation_ms"]["p99"]
    result["targets"] = {"errors": 0, "get_operation_p99_ms": TARGET_P99_MS}
    result["pass"] = (result["errors"] == 0 and not result["client_task_crashes"] and p99 is not None
                      and p99 < TARGET_P99_MS and result["job"]["made_progress"] and alive)
    if args.keep:
        result["work"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    record(result, args.out)


if __name__ == "__main__":
    main()
