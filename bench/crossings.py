"""How often a target-mode job's control crosses between the modules of `service/job` (issue 32's seam count).

Runs one small target-mode job (ResNet-20 from ../shared/data at --target-speedup 1.5, few images, no
reconstruction, one round) under `sys.setprofile` and follows the module of the innermost frame that
belongs to `service/job/*.py` (frames of the compressor, exporters and libraries are transparent: time
spent in them stays with the service module that called them). It prints, as JSON:

- `modules`: the service/job modules control passed through, in order of first entry;
- `entries`: per module, how many times control entered it from another service/job module;
- `crossings`: all such changes of module;
- `returns`: changes into a module control had already been in and left (the "back into a module it had
  already left" count).

Usage: .venv/bin/python bench/crossings.py [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "service" / "job"


def trace(run) -> dict:
    sequence: list[str] = []
    stack: list[str | None] = []

    def module_of(frame) -> str | None:
        path = Path(frame.f_code.co_filename)
        return path.stem if path.parent == JOB else None

    def current() -> str | None:
        return next((m for m in reversed(stack) if m is not None), None)

    def profile(frame, event, arg) -> None:
        if event == "call":
            stack.append(module_of(frame))
        elif event == "return" and stack:
            stack.pop()
        else:
            return
        here = current()
        if here is not None and (not sequence or sequence[-1] != here):
            sequence.append(here)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    seen: set[str] = set()
    returns = 0
    for previous, module in itertools.pairwise(sequence):
        seen.add(previous)
        returns += module in seen
    return {"modules": list(dict.fromkeys(sequence)), "entries": dict(Counter(sequence[1:])),
            "crossings": len(sequence) - 1, "returns": returns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from service.job import CompressRequest, compress

    with tempfile.TemporaryDirectory() as out:
        request = CompressRequest(model=str(args.data / "resnet-cifar10" / "resnet20.pt2"),
                                  calibration=args.data / "cifar10" / "train_prefix_5085.npz", out_dir=Path(out),
                                  target_speedup=1.5, samples=600, max_rounds=1, refine_steps=0, repeats=3,
                                  latency_probes=1, no_accuracy_budget=True, mean=(0.485, 0.456, 0.406),
                                  std=(0.229, 0.224, 0.225))
        print(json.dumps(trace(lambda: compress(request, progress=lambda record: None)), indent=2))


if __name__ == "__main__":
    main()
