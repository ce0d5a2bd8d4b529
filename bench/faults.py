"""Crash faults of the gRPC service: kill -9 of the server, and of a job's worker, at random points of a job.

    .venv/bin/python bench/faults.py                  # 20 server kills + 20 worker kills (~40 job times + ~7 min)
    .venv/bin/python bench/faults.py --quick          # 2 + 2 (1.5-2.5 minutes)
    .venv/bin/python bench/faults.py --kinds server --trials 5 --kills-per-trial 3   # up to 3 attempts killed

First one uninterrupted job (the control trial, skipped with --job-seconds) measures how long a job takes
here. Then --trials trials of each kind, alternating (server, worker, server, ...), each on a fresh
OSSCAR_HOME with a real `osscar serve --port 0` (tests.service.server_process.ServerProcess) and one real
job (ResNet-20 from the shared data, uniform ratio 0.5, --samples images, --repeats latency runs). A seeded
random delay in [2 %, 98 %] of the measured job time after the submission, then:

- kind `server`: SIGKILL of the server. Its worker must die with it (pids taken before the kill, polled in
  /proc); no partial or corrupt file may be visible in the blob store; a server restarted on the same home
  must empty blobs/tmp/ and run the job again (its `attempt` goes up). With --kills-per-trial K the re-run
  is killed too, K times in all (when --max-attempts running attempts were killed, the job must end
  ABORTED INTERRUPTED; a kill after the job ended interrupts nothing).
- kind `worker`: SIGKILL of the job's worker process (the server stays up): the job must end FAILED with
  INTERNAL / WORKER_CRASHED (or SUCCEEDED when the result was already sent), the server alive and SERVING.
- both kinds: once the killed process's workers are gone (server) or the job has ended (worker), no
  process of the trial's OSSCAR_HOME may be left outside the live server's process tree: an orphan (e.g.
  the worker's ONNX Runtime subprocess) would hold the device. Orphans are reported and killed.

Invariants checked after every trial (each failure is a violation; target 0): the operation is done
within --job-timeout, either SUCCEEDED with a response or with an error that has a code, a message and
an ErrorInfo reason; nothing is left QUEUED or RUNNING; every file under blobs/sha256/ has the sha256 its
name says; every artifact of the operation exists with its digest and size, and manifest.json (downloaded
with DownloadArtifact) lists the same digests; the server exits 0 on SIGTERM; `PRAGMA integrity_check`
of jobs.sqlite (opened read-only once the server has stopped) is "ok"; a server started once more empties
blobs/tmp/ and reports the same final state (it was durable); once the last server has stopped, no
process of the trial's OSSCAR_HOME is left (an orphan would hold the device; it is killed).

Reported: trials by kind, outcomes (e.g. `SUCCEEDED attempt 2`, `FAILED INTERNAL WORKER_CRASHED`),
attempts, violations, and the median time from the kill to the job's end (`recover_s`; for the server kind
it includes the restart, `restart_s`: kill to a SERVING server, the checks above included, and the whole
re-run). Progress goes to stderr; the result is printed as one JSON object and appended as a line to --out
(bench/service_results.jsonl). Homes and server logs of trials with a violation are kept (paths in the
result). The full run takes about 40 job times plus 10 s per trial: ~15 minutes with 11 s jobs, ~25 with
26 s jobs (the control trial prints the job time first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
from google.rpc import code_pb2, error_details_pb2
from grpc_health.v1 import health_pb2
from service_common import (
    DATA,
    file_sha256,
    git_state,
    leftover_processes,
    resnet_request,
)

from service.api import compression_pb2 as pb
from service.api.wire import STATE_NAMES, unpack_metadata
from service.core.outcomes import OUTCOMES
from tests.service.server_process import ServerProcess, wait_gone

SERVING = health_pb2.HealthCheckResponse.SERVING
EXPECTED_ARTIFACTS = {"model.onnx", "report.json", "manifest.json"}


# ---- invariants --------------------------------------------------------------------------------------


def blob_violations(home: Path) -> list[str]:
    """Every visible blob is complete: its content hashes to its name, under the right prefix."""
    out = []
    root = home / "blobs" / "sha256"
    for path in sorted(root.rglob("*")) if root.is_dir() else []:
        if path.is_dir():
            continue
        if path.parent.name != path.name[:2]:
            out.append(f"blob in the wrong directory: {path.relative_to(home)}")
        elif file_sha256(path) != path.name:
            out.append(f"corrupt or partial blob visible: {path.relative_to(home)} ({path.stat().st_size} bytes)")
    return out


def tmp_entries(home: Path) -> list[str]:
    tmp = home / "blobs" / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


def database_check(home: Path) -> tuple[list[str], dict[str, int]]:
    """PRAGMA integrity_check and the operations by state, read-only, with no server running."""
    db = sqlite3.connect(f"file:{home / 'jobs.sqlite'}?mode=ro", uri=True)
    try:
        integrity = [row[0] for row in db.execute("PRAGMA integrity_check")]
        foreign = db.execute("PRAGMA foreign_key_check").fetchall()
        states = dict(db.execute("SELECT state, COUNT(*) FROM operations GROUP BY state").fetchall())
    finally:
        db.close()
    out = [] if integrity == ["ok"] else [f"integrity_check: {'; '.join(integrity)[:500]}"]
    if foreign:
        out.append(f"foreign_key_check: {foreign[:5]}")
    for state in ("QUEUED", "RUNNING"):
        if states.get(state):
            out.append(f"{states[state]} operation(s) left {state} in the store")
    return out, states


def reason_of(op) -> str:
    for detail in op.error.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def outcome_violations(op) -> list[str]:
    meta = unpack_metadata(op)
    state = STATE_NAMES.get(meta.state, str(meta.state))
    if not op.done:
        return [f"not done: {state} at stage {meta.stage!r}"]
    if op.HasField("error"):
        out = []
        if op.error.code == 0 or not op.error.message:
            out.append(f"an error without a code or message: {op.error}")
        if not reason_of(op):
            out.append(f"an error without an ErrorInfo reason (code {op.error.code})")
        if state not in ("FAILED", "CANCELLED"):
            out.append(f"an error but state {state}")
        row = (state, code_pb2.Code.Name(op.error.code), reason_of(op))
        if row not in {(o.state, o.code, o.reason) for o in OUTCOMES}:
            out.append(f"an outcome that is not in the outcome table: {' '.join(row)}")
        return out
    if state != "SUCCEEDED" or not op.HasField("response"):
        return [f"done without an error but state {state}, response set: {op.HasField('response')}"]
    return []


def artifact_violations(server: ServerProcess, op) -> list[str]:
    """The operation's artifacts are in the store, whole; manifest.json agrees with the metadata."""
    out = []
    meta = unpack_metadata(op)
    digests = {a.name: a.sha256 for a in meta.artifacts}
    for a in meta.artifacts:
        path = server.home / "blobs" / "sha256" / a.sha256[:2] / a.sha256
        if not path.is_file():
            out.append(f"artifact {a.name} missing from the store ({a.sha256[:12]})")
        elif path.stat().st_size != a.size_bytes or file_sha256(path) != a.sha256:
            out.append(f"artifact {a.name} differs from its metadata (size {path.stat().st_size} vs {a.size_bytes})")
    if STATE_NAMES.get(meta.state) == "SUCCEEDED":
        missing = EXPECTED_ARTIFACTS - set(digests)
        if missing:
            out.append(f"succeeded without {sorted(missing)}")
    if "manifest.json" in digests:
        chunks = server.compression.DownloadArtifact(pb.DownloadArtifactRequest(name=op.name,
                                                                                artifact="manifest.json"), timeout=60)
        content = b"".join(chunk.data for chunk in chunks)
        if hashlib.sha256(content).hexdigest() != digests["manifest.json"]:
            out.append("downloaded manifest.json does not match its digest")
        else:
            manifest = json.loads(content)
            listed = manifest.get("artifacts", {})
            others = {k: v for k, v in digests.items() if k != "manifest.json"}
            if listed != others:
                out.append(f"manifest.json lists {sorted(listed)} with other digests than the metadata "
                           f"{sorted(others)}")
            if manifest.get("operation") != op.name:
                out.append(f"manifest.json names operation {manifest.get('operation')!r}")
    return out


# ---- one trial ---------------------------------------------------------------------------------------


def stage_of(server: ServerProcess, name: str) -> str:
    try:
        meta = unpack_metadata(server.get(name))
    except grpc.RpcError as err:
        return f"? ({err.code().name})"
    where = f"{meta.stage} {meta.layer}/{meta.layers}" if meta.layers else meta.stage
    return f"{STATE_NAMES.get(meta.state, meta.state)} {where}".strip()


def kill_server(server: ServerProcess, trial: dict, args: argparse.Namespace) -> ServerProcess:
    """SIGKILL the server; check its worker died and nothing partial is visible; start it again."""
    workers = server.workers()
    server.kill()
    killed = time.monotonic()
    trial["kills"].append({"workers": len(workers)})
    if not wait_gone(workers, 30):
        trial["violations"].append(f"worker(s) {workers} outlived their killed server by 30 s")
    orphans = leftover_processes(server.home, wait_s=1)  # the workers are gone: what is left stays
    if orphans:  # the worker's own children (ONNX Runtime runs in a subprocess) must go with it
        trial["violations"].append(f"process(es) outlived the killed server and its worker: {orphans}")
    trial["violations"] += blob_violations(server.home)
    trial["kills"][-1]["tmp_files_left"] = len(tmp_entries(server.home))
    again = ServerProcess(server.home, *server.extra).start(timeout=120)
    trial["kills"][-1]["restart_s"] = round(time.monotonic() - killed, 2)
    left = tmp_entries(server.home)
    if left:
        trial["violations"].append(f"blobs/tmp not emptied by the restart: {left[:5]}")
    if again.health() != SERVING:
        trial["violations"].append("the restarted server is not SERVING")
    return again


def kill_worker(server: ServerProcess, name: str, trial: dict, timeout: float = 60.0) -> bool:
    """SIGKILL the job's worker (waiting for it to be spawned if need be); False when the job ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = server.workers()
        if workers:
            os.kill(workers[0], signal.SIGKILL)
            trial["kills"].append({"workers": len(workers)})
            return True
        if server.get(name).done:
            return False
        time.sleep(0.05)
    trial["violations"].append(f"no worker process for {name} after {timeout:.0f} s")
    return False


def run_trial(index: int, kind: str, delays: list[float], home: Path, args: argparse.Namespace) -> dict:
    """kind: server | worker | none (the control: no kill). delays: seconds after the submission (server:
    after each restart) to each kill."""
    trial: dict = {"trial": index, "kind": kind, "delays_s": [round(d, 2) for d in delays], "kills": [],
                   "violations": [], "home": str(home)}
    extra = ("--max-attempts", str(args.max_attempts))
    home.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(home, *extra)
    killed_at = None
    try:
        server.start(timeout=120)
        op = server.compression.Compress(resnet_request(args.data, args.samples, args.repeats, "faults"), timeout=30)
        submitted = time.monotonic()
        trial["operation"] = op.name
        if kind == "server":
            since = submitted
            for delay in delays:
                time.sleep(max(0.0, since + delay - time.monotonic()))
                stage = stage_of(server, op.name)
                kill_time = time.monotonic()
                server = kill_server(server, trial, args)
                trial["kills"][-1]["stage"] = stage
                if stage.startswith(("QUEUED", "RUNNING")):  # (a kill after the end interrupts nothing)
                    killed_at = kill_time
                since = time.monotonic()
        elif kind == "worker":
            time.sleep(max(0.0, submitted + delays[0] - time.monotonic()))
            stage = stage_of(server, op.name)
            if kill_worker(server, op.name, trial):
                killed_at = time.monotonic()
                trial["kills"][-1]["stage"] = stage
        try:
            final = server.wait_done(op.name, timeout=args.job_timeout)
        except TimeoutError:
            trial["violations"].append(f"{op.name} not done {args.job_timeout:.0f} s after the last kill: "
                                       f"{stage_of(server, op.name)}")
            final = server.get(op.name)
        end = time.monotonic()
        if kind == "worker" and trial["kills"]:
            orphans = leftover_processes(home, wait_s=5, server=server.process.pid)
            if orphans:  # the worker's own children (ONNX Runtime runs in a subprocess) must go with it
                trial["violations"].append(f"process(es) outlived the killed worker: {orphans}")
        trial["job_s"] = round(end - submitted, 2)
        if killed_at is not None:
            trial["recover_s"] = round(end - killed_at, 2)
        meta = unpack_metadata(final)
        trial.update(state=STATE_NAMES.get(meta.state, str(meta.state)), attempt=meta.attempt,
                     code=code_pb2.Code.Name(final.error.code) if final.HasField("error") else "OK",
                     reason=reason_of(final), message=final.error.message[:300])
        trial["violations"] += outcome_violations(final)
        trial["violations"] += artifact_violations(server, final)
        if kind == "worker" and trial["kills"] and trial["state"] != "SUCCEEDED" and (
                trial["code"], trial["reason"]) != ("INTERNAL", "WORKER_CRASHED"):
            trial["violations"].append(f"a killed worker ended the job {trial['code']} {trial['reason']}, "
                                       "not INTERNAL WORKER_CRASHED")
        interrupted = sum(k.get("stage", "").startswith("RUNNING") for k in trial["kills"])
        trial["interrupted"] = interrupted
        if kind == "server":  # every kill of a running attempt costs one attempt, up to --max-attempts
            if interrupted >= args.max_attempts:
                if (trial["code"], trial["reason"]) != ("ABORTED", "INTERRUPTED"):
                    trial["violations"].append(f"killed during each of {interrupted} attempts but ended "
                                               f"{trial['state']} {trial['code']} {trial['reason']}, not ABORTED "
                                               "INTERRUPTED")
            elif trial["state"] == "SUCCEEDED" and trial["attempt"] != interrupted + 1:
                trial["violations"].append(f"succeeded at attempt {trial['attempt']} after {interrupted} "
                                           "interrupted attempt(s)")
        if server.process.poll() is not None or server.health() != SERVING:
            trial["violations"].append("the server is not alive and SERVING after the trial")
        code = server.stop()
        if code != 0:
            trial["violations"].append(f"the server exited {code} on SIGTERM")
        found, states = database_check(home)
        trial["violations"] += found
        trial["store"] = states
        # once more: a start empties blobs/tmp and the final state was durable
        server = ServerProcess(home, *extra).start(timeout=120)
        left = tmp_entries(home)
        if left:
            trial["violations"].append(f"blobs/tmp not emptied at start: {left[:5]}")
        again = server.get(op.name)
        if (again.done, again.error.code, unpack_metadata(again).state, list(unpack_metadata(again).artifacts)) != (
                final.done, final.error.code, meta.state, list(meta.artifacts)):
            trial["violations"].append("the final state changed across a restart")
        trial["violations"] += blob_violations(home)
        scratch = list((home / "work").iterdir()) if (home / "work").is_dir() else []
        trial["work_dirs_left"] = len(scratch)  # scratch of a killed attempt, informational
    except Exception as err:  # a broken trial is a finding, not the end of the benchmark
        trial["violations"].append(f"trial aborted: {type(err).__name__}: {str(err)[:500]}")
    finally:
        if server.process is not None and server.process.poll() is None:
            server.stop()
    leftovers = leftover_processes(home)
    if leftovers:  # e.g. a worker's ONNX Runtime subprocess outliving the worker: it would hold the device
        trial["violations"].append(f"process(es) of the trial's home alive after its server stopped: {leftovers}")
    trial["log"] = str(server.log)
    return trial


def summary(trials: list[dict]) -> dict:
    out: dict = {"trials": {}, "outcomes": {}, "attempts": {}, "recover_s": {}, "restart_s": {}}
    for kind in sorted({t["kind"] for t in trials}):
        group = [t for t in trials if t["kind"] == kind]
        out["trials"][kind] = len(group)
        outcomes: Counter = Counter()
        for t in group:
            if t.get("state") == "SUCCEEDED":
                label = f"SUCCEEDED attempt {t['attempt']}"
            else:
                label = f"{t.get('state')} {t.get('code')} {t.get('reason')}".strip()
            if kind != "none" and not t.get("interrupted"):
                label += " (ended before the kill)"
            outcomes[label] += 1
        out["outcomes"][kind] = dict(outcomes)
        out["attempts"][kind] = dict(Counter(str(t.get("attempt")) for t in group))
        recover = [t["recover_s"] for t in group if "recover_s" in t]
        restart = [k["restart_s"] for t in group for k in t["kills"] if "restart_s" in k]
        for key, values in (("recover_s", recover), ("restart_s", restart)):
            if values:
                out[key][kind] = {"median": round(statistics.median(values), 2), "max": round(max(values), 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="trials of each kind, server and worker (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points (default 0)")
    parser.add_argument("--kinds", default="server,worker", help="which kinds to run, alternating (default both)")
    parser.add_argument("--kills-per-trial", type=int, default=1,
                        help="server kind: kills of the same job, each at a random point of its (re-)run (default 1)")
    parser.add_argument("--max-attempts", type=int, default=3, help="the server's --max-attempts (default 3)")
    parser.add_argument("--samples", type=int, default=32, help="calibration images of the job (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="latency runs of the job (default 3)")
    parser.add_argument("--job-seconds", type=float, default=0.0,
                        help="typical job time the kill points are drawn from (default 0: measured first with "
                             "an uninterrupted control job)")
    parser.add_argument("--job-timeout", type=float, default=300.0,
                        help="seconds a job may take to end after the last kill (default 300)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 trials of each kind")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared data directory (resnet-cifar10/, cifar10/)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("service_results.jsonl"),
                        help="JSON lines file the result is appended to")
    parser.add_argument("--keep", action="store_true", help="keep every trial's home and server log")
    args = parser.parse_args()
    if args.quick:
        args.trials = 2
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    assert set(kinds) <= {"server", "worker"}, f"unknown kinds {kinds}"
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="osscar-faults-"))
    started = time.monotonic()
    trials: list[dict] = []

    def report(trial: dict, total: int) -> None:
        kills = ", ".join(f"{d:.1f} s ({k.get('stage', '?')})" for d, k in zip(trial["delays_s"], trial["kills"],
                                                                                strict=False))
        print(f"[{len(trials)}/{total}] {trial['kind']:<6} kill at {kills or '-'}: {trial.get('state')} "
              f"{trial.get('code')} {trial.get('reason')} attempt {trial.get('attempt')}, recovered in "
              f"{trial.get('recover_s', '-')} s, {len(trial['violations'])} violation(s) "
              f"{trial['violations'][:3]}", file=sys.stderr, flush=True)

    total = len(kinds) * args.trials + (0 if args.job_seconds else 1)
    typical = args.job_seconds
    if not typical:
        control = run_trial(0, "none", [], work / "control" / "home", args)
        trials.append(control)
        report(control, total)
        typical = control.get("job_s") or 35.0
    plan = [(kind, i) for i in range(args.trials) for kind in kinds]
    for index, (kind, _) in enumerate(plan, start=1):
        kills = args.kills_per_trial if kind == "server" else 1
        delays = [rng.uniform(0.02, 0.98) * typical for _ in range(kills)]
        trial = run_trial(index, kind, delays, work / f"trial-{index:03d}" / "home", args)
        trials.append(trial)
        report(trial, total)
    violations = [f"trial {t['trial']} ({t['kind']}): {v}" for t in trials for v in t["violations"]]
    kept = sorted({str(Path(t["home"]).parent) for t in trials if t["violations"]})
    if args.keep:
        kept = [str(work)]
    else:
        for t in trials:
            if not t["violations"]:
                shutil.rmtree(Path(t["home"]).parent, ignore_errors=True)
        if not kept:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "bench": "faults", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), **git_state(), "seed": args.seed,
        "kills_per_trial": args.kills_per_trial, "max_attempts": args.max_attempts, "samples": args.samples,
        "repeats": args.repeats, "typical_job_s": round(typical, 2), **summary(trials),
        "violations": len(violations), "violation_list": violations[:100], "target_violations": 0,
        "pass": not violations, "kept": kept, "elapsed_s": round(time.monotonic() - started, 1),
        "per_trial": [{k: v for k, v in t.items() if k not in ("home", "log")} for t in trials],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_trial"}, indent=2))


if __name__ == "__main__":
    main()
