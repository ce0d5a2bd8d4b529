"""The Ray executor's cost: the same small jobs through the service on the local executor with 2 slots and on
a 2-slot local Ray cluster.

    .venv/bin/python bench/executors.py                  # 8 jobs on each executor (a few minutes on 2 cores)
    .venv/bin/python bench/executors.py --jobs 4 --quick

For each executor a real `osscar serve --port 0` starts (tests.service.server_process.ServerProcess, its own
OSSCAR_HOME): local with `--devices cpu,cpu`; Ray against a local cluster started here
(`ray.cluster_utils.Cluster`, a head with 2 CPUs) with `--ray-cpus-per-job 1`, so each executor runs two
jobs at a time. --jobs jobs are submitted at once: ResNet-20 (shared data) at uniform ratio 0.5 with
--samples calibration images and --repeats latency runs, by path (under --shared-roots for Ray) or, with
--upload, uploaded first (so on Ray they travel through the object store).

Measured per executor: the total time from the first submission to the last job's end, each job's run time
(its operation's start to end time, as the server recorded them) and queue wait, the median of each, and
the Ray overhead per job: the median run time on Ray minus the median run time locally (what placing an
actor, shipping inputs, polling progress and pulling artifacts back adds to a job) and the ratio of the
totals. The result is printed as one JSON object and appended to --out (bench/service_results.jsonl).
Ray pins each job to the core it claims; the local executor does not pin (both take turns at timing).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from service_common import DATA, git_state, leftover_processes, record, resnet_request

from service.api.wire import STATE_NAMES, unpack_metadata
from service.client.transport import RemoteCompressor
from tests.service.server_process import ServerProcess


def run_jobs(server: ServerProcess, requests: list) -> dict:
    start = time.time()
    names = [server.compression.Compress(r, timeout=60).name for r in requests]
    finals = [server.wait_done(name, timeout=3600) for name in names]
    end = time.time()
    metas = [unpack_metadata(op) for op in finals]
    runs = [m.end_time.ToNanoseconds() / 1e9 - m.start_time.ToNanoseconds() / 1e9 for m in metas]
    waits = [m.start_time.ToNanoseconds() / 1e9 - m.create_time.ToNanoseconds() / 1e9 for m in metas]
    return {"total_s": round(end - start, 2), "run_s": [round(r, 2) for r in runs],
            "median_run_s": round(statistics.median(runs), 2), "wait_s": [round(w, 2) for w in waits],
            "states": sorted({STATE_NAMES.get(m.state, str(m.state)) for m in metas}),
            "errors": sorted({op.error.message for op in finals if op.HasField("error")})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--upload", action="store_true", help="upload the inputs (Ray: they travel to the worker)")
    parser.add_argument("--quick", action="store_true", help="--samples 16 --repeats 3")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("service_results.jsonl"))
    args = parser.parse_args()
    if args.quick:
        args.samples, args.repeats = 16, 3
    from ray.cluster_utils import Cluster

    result: dict = {"bench": "executors", "jobs": args.jobs, "samples": args.samples, "repeats": args.repeats,
                    "upload": args.upload, "date": time.strftime("%Y-%m-%d %H:%M"), **git_state()}
    root = Path(tempfile.mkdtemp(prefix="osscar-bench-executors-"))
    try:
        for executor in ("local", "ray"):
            cluster = None
            if executor == "ray":
                cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
                extra = ("--executor", "ray", "--ray-address", cluster.address, "--ray-cpus-per-job", "1",
                         "--shared-roots", str(DATA), "--ray-scratch", str(root / "ray-scratch"))
            else:
                extra = ("--devices", "cpu,cpu")
            home = root / executor / "home"
            home.parent.mkdir(parents=True)
            server = ServerProcess(home, "--max-queue", str(args.jobs), "--log-format", "text", *extra)
            try:
                started = time.monotonic()
                server.start()
                result[f"{executor}_server_start_s"] = round(time.monotonic() - started, 2)
                requests = [resnet_request(DATA, args.samples, args.repeats, "executors") for _ in range(args.jobs)]
                if args.upload:
                    client = RemoteCompressor(server.address)
                    model, calibration = client.upload(Path(requests[0].model)), client.upload(
                        Path(requests[0].calibration))
                    client.close()
                    for request in requests:
                        request.model, request.calibration = model, calibration
                result[executor] = run_jobs(server, requests)
            finally:
                server.stop()
                if cluster is not None:
                    cluster.shutdown()
            result[f"{executor}_leftovers"] = leftover_processes(home)
        local, ray = result["local"], result["ray"]
        result["ray_overhead_per_job_s"] = round(ray["median_run_s"] - local["median_run_s"], 2)
        result["ray_total_ratio"] = round(ray["total_s"] / local["total_s"], 3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record(result, args.out)


if __name__ == "__main__":
    main()
