"""The conv graph's long fit (`compressor.cnn.refine.reconstruct_graph`), timed in variants: a solved
ResNet-56 (a job's `model.pt2` solved without the fit, e.g. `osscar compress resnet56.pt2 --calibration
train_prefix_5085.npz --eval test_first1017.npz --target-speedup 2 --remove-blocks 6 --refine-steps 0`) fitted
to the dense graph for `--steps` steps of the job's long-fit settings (`graph_config(3000)`: 32 flipped and shifted
views a step, checks every 25), on all 5,085 calibration images, the variants alternating, each fit in a fresh
process. A variant is `last` (channels-last, the default), `std` (standard strides) or `uses=N` (channels-last,
each view drawn about N times: `view_uses`; 1 is a new view at every draw).
Prints one JSON line per fit (seconds, held-out errors, top-1 on `test_first1017`, dense 92.72 %).

    .venv/bin/python bench/conv_fit.py --solved <pruned model.pt2> [--steps 200] [--repeats 2] [--variants std,last]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def _fit(solved: Path, steps: int, variant: str) -> dict:
    import numpy as np
    import torch

    from compressor.calibration import load_images
    from compressor.cnn.models import load_model
    from compressor.cnn.refine import VIEW_USES, graph_config, reconstruct_graph

    dense = load_model(str(DATA / "resnet-cifar10" / "resnet56.pt2")).module
    pruned = load_model(str(solved)).module
    images = load_images(DATA / "cifar10" / "train_prefix_5085.npz", samples=10**9)
    test = DATA / "cifar10" / "test_first1017.npz"
    ex, labels = load_images(test, samples=10**9), np.load(test)["y"]

    def top1() -> float:
        with torch.no_grad():
            return float((torch.cat([pruned(x) for x in ex.split(200)]).argmax(1).numpy() == labels).mean())

    before = top1()
    config = dataclasses.replace(graph_config(3000), steps=steps)
    start = time.perf_counter()
    uses = int(variant.removeprefix("uses=")) if variant.startswith("uses=") else VIEW_USES
    fit = reconstruct_graph(pruned, dense, images, config, torch.device("cpu"), channels_last=variant != "std",
                            view_uses=uses)
    return {"variant": variant, "view_uses": uses, "steps": fit.steps, "fit_s": round(fit.seconds, 1),
            "call_s": round(time.perf_counter() - start, 1), "held_out_before": fit.before, "held_out_after": fit.after,
            "top1_before": before, "top1_after": top1(), "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--solved", type=Path, required=True, help="a pruned ResNet-56 program, not fitted")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default="std,last", help="comma-separated: std, last, uses=N")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one fit of one variant
    args = parser.parse_args()
    variants = args.variants.split(",")
    for variant in variants:
        if not (variant in ("std", "last") or (variant.startswith("uses=") and variant[5:].isdigit()
                                               and int(variant[5:]) >= 1)):
            parser.error(f"unknown variant {variant!r}: std, last or uses=N (N >= 1)")
    sys.path.insert(0, str(ROOT))
    if args.one:
        print(json.dumps(_fit(args.solved, args.steps, args.one)), flush=True)
        return
    for _ in range(args.repeats):
        for variant in variants:
            subprocess.run([sys.executable, __file__, "--solved", str(args.solved), "--steps", str(args.steps),
                            "--one", variant], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
