"""Quality benchmarks (paper protocol) -> bench/RESULTS.md and bench/quality.png.

    python bench/quality.py                      # ResNet-20 and ResNet-56, ratios 0.3 / 0.5 / 0.7
    python bench/quality.py --models resnet20 --ratios 0.5
    python bench/quality.py --transformers       # stories260K and all-MiniLM-L6-v2, ratios 0.25 / 0.5

CNNs: prune the inner channels of every block (input channels of each block's second conv) with a
uniform ratio, sequentially, calibrating on 500 images of `train_prefix_5085.npz`; export to ONNX;
report the top-1 of the exported model in ONNX Runtime on `test_first1017.npz`, and the prune time.

Transformers (`bench/quality_transformers.py`): heads and FFN neurons at uniform ratios, sequential,
each run in its own process so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compressor.calibration import load_images
from compressor.cnn.pipeline import prune_conv_graph
from compressor.modules import count_parameters
from exporters.onnx import export_onnx

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
METHODS = ("mp", "mp+", "thinet", "osscar")
log = logging.getLogger("bench.quality")


def onnx_top1(path: Path, images: torch.Tensor, labels: np.ndarray) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    logits = np.concatenate([session.run(None, {name: b.numpy()})[0] for b in images.split(256)])
    return float((logits.argmax(1) == labels).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet20,resnet56")
    parser.add_argument("--ratios", default="0.3,0.5,0.7")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("quality_results.json"))
    parser.add_argument("--plot", type=Path, default=Path(__file__).with_name("quality.png"))
    parser.add_argument("--transformers", action="store_true", help="run bench/quality_transformers.py instead")
    args, rest = parser.parse_known_args()
    if args.transformers:
        from quality_transformers import main as transformers_main

        transformers_main(rest)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    calibration = load_images(DATA / "cifar10" / "train_prefix_5085.npz", samples=args.samples, seed=0)
    test_images = load_images(DATA / "cifar10" / "test_first1017.npz", samples=10**9)
    labels = np.load(DATA / "cifar10" / "test_first1017.npz")["y"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models.split(","):
            gm = torch.export.load(str(DATA / "resnet-cifar10" / f"{model_name}.pt2")).module()
            export_onnx(gm, calibration[:2].clone(), Path(tmp) / "dense.onnx")
            dense = onnx_top1(Path(tmp) / "dense.onnx", test_images, labels)
            rows.append({"model": model_name, "method": "dense", "ratio": 0.0, "top1": dense,
                         "params": count_parameters(gm), "prune_s": 0.0})
            log.info("%s dense top-1 %.4f", model_name, dense)
            for ratio in map(float, args.ratios.split(",")):
                for method in args.methods.split(","):
                    start = time.perf_counter()
                    pruned, _ = prune_conv_graph(gm, calibration, ratio, method=method)
                    seconds = time.perf_counter() - start
                    path = Path(tmp) / f"{model_name}-{method}-{ratio}.onnx"
                    export_onnx(pruned, calibration[:2].clone(), path)
                    top1 = onnx_top1(path, test_images, labels)
                    rows.append({"model": model_name, "method": method, "ratio": ratio, "top1": top1,
                                 "params": count_parameters(pruned), "prune_s": seconds})
                    log.info("%s %s %.1f: top-1 %.4f, prune %.1fs", model_name, method, ratio, top1, seconds)
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    plot(rows, args.plot)
    for row in rows:
        print(f"| {row['model']} | {row['method']} | {row['ratio']} | {100 * row['top1']:.1f} | "
              f"{row['params']} | {row['prune_s']:.1f} |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        dense = next(r["top1"] for r in rows if r["model"] == model and r["method"] == "dense")
        ax.axhline(100 * dense, color="gray", linestyle="--", label=f"dense {100 * dense:.1f}")
        for method in METHODS:
            pts = sorted((r["ratio"], r["top1"]) for r in rows if r["model"] == model and r["method"] == method)
            if pts:
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=method)
        ax.set_title(f"{model}, CIFAR-10 (first 1,017 test images, ONNX Runtime)")
        ax.set_xlabel("fraction of inner channels pruned")
        ax.set_ylabel("top-1 %")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
