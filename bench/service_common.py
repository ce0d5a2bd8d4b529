"""What the service benchmarks share: the repository on sys.path, a real ResNet-20 job, leaked-process
detection and the commit a result belongs to. Run the benchmarks from the repository root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from service.api import compression_pb2 as pb  # noqa: E402
from service.files import file_sha256  # noqa: E402, F401 - re-exported for the benchmarks

DATA = ROOT.parent / "shared" / "data"
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)


def resnet_request(data: Path, samples: int, repeats: int, bench: str) -> pb.CompressRequest:
    """ResNet-20 (CIFAR-10) at uniform ratio 0.5: a real job; `repeats` latency runs set how long it takes."""
    request = pb.CompressRequest(model=str(data / "resnet-cifar10" / "resnet20.pt2"),
                                 calibration=str(data / "cifar10" / "train_prefix_5085.npz"), uniform_ratio=0.5,
                                 request_id=str(uuid.uuid4()), labels={"bench": bench})
    request.options.samples = samples
    request.options.repeats = repeats
    # the benches measure the service, not accuracy: a uniform 0.5 keeps cosine 0.86, below the default budget
    request.no_accuracy_budget = True
    request.options.mean.extend(CIFAR_MEAN)
    request.options.std.extend(CIFAR_STD)
    return request


def leftover_processes(home: Path, wait_s: float = 5.0, server: int | None = None) -> list[str]:
    """Processes alive with OSSCAR_HOME=`home` other than `server` and its descendants (e.g. an ONNX Runtime
    subprocess orphaned by a killed worker), once they had `wait_s` to exit: each is a leak. Returned as
    "pid command" and killed."""
    needle = f"OSSCAR_HOME={home}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                alive = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                if alive and needle in (proc / "environ").read_bytes().split(b"\0") and not (
                        server is not None and _descends_from(int(proc.name), server)):
                    found.append(int(proc.name))
            except (OSError, IndexError):
                continue
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out = []
    for pid in found:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        out.append(f"{pid} {command.strip()[:160]}")
    return out



def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False



def git_state() -> dict[str, object]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "--",
                                                                              "service", "compressor", "exporters"))}


def record(result: dict, out: Path) -> None:
    """Append `result` as one JSON line to `out` and print it."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result, indent=2))
