"""The accuracy check against an independent one: a MobileNetV2 as TFLite converts it (no BatchNorm, clamp
for ReLU6, 1,001 classes, 224 x 224; random weights scaled to unit variance), 500 unlabelled calibration
images (CIFAR-10 training images upsampled to 224 x 224), `osscar compress` at a uniform ratio, then the
returned model.onnx scored against the dense model on 500 other images of the same kind.

Before the held-out split the job scored images it had calibrated on: "cosine 1.0000 -> 1.0000", ok.

    .venv/bin/python bench/heldout.py [--ratio 0.3] [--width 0.5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compressor.cnn.models import export_module, save_program  # noqa: E402
from tests.compressor.cnn.conv_models import TfliteMobileNetV2, scale_to_unit_variance  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "cifar10" / "train_prefix_5085.npz"
NORM = 0.50196  # the TFLite MobileNetV2's (x / 255 - 0.502) / 0.502


def upsampled(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.repeat(7, axis=1).repeat(7, axis=2))  # 32 -> 224, nearest


def normalised(x: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255 - NORM) / NORM


def scores(dense: torch.nn.Module, onnx: Path, images: np.ndarray) -> dict[str, float]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    d, p = [], []
    for i in range(0, len(images), 50):
        x = normalised(images[i:i + 50])
        with torch.no_grad():
            d.append(dense(x).numpy())
        p.append(session.run(None, {"x": x.numpy()})[0])
    d, p = np.concatenate(d), np.concatenate(p)
    cos = (d * p).sum(1) / np.linalg.norm(d, axis=1) / np.linalg.norm(p, axis=1)
    return {"agreement": float((d.argmax(1) == p.argmax(1)).mean()), "cosine_mean": float(cos.mean()),
            "cosine_min": float(cos.min())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--width", type=float, default=0.5)
    args = parser.parse_args()
    images = np.load(DATA)["x"]
    calibration, other = upsampled(images[:500]), upsampled(images[500:1000])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        np.savez(root / "cal.npz", x=calibration)
        torch.manual_seed(0)
        model = scale_to_unit_variance(TfliteMobileNetV2(width=args.width, depth=2), normalised(calibration[:32]))
        example = normalised(calibration[:2])
        save_program(export_module(model.eval(), example), root / "model.pt2", example)
        norm = ",".join([str(NORM)] * 3)
        subprocess.run([sys.executable, "-m", "service.client.cli", "compress", str(root / "model.pt2"),
                        "--uniform-ratio", str(args.ratio), "--round-to", "8", "--calibration", str(root / "cal.npz"),
                        "--mean", norm,
                        "--std", norm, "--refine-steps", "0", "--out", str(root / "out")], cwd=ROOT, check=False)
        report = json.loads((root / "out" / "report.json").read_text())
        dense = torch.export.load(str(root / "model.pt2")).module()
        print(json.dumps({"status": report["status"], "measured_speedup": report["measured_speedup"],
                          "metric": report["metric"], "evaluation": report["evaluation"],
                          "warnings": report["warnings"],
                          "independent_500_other_images": scores(dense, root / "out" / "model.onnx", other),
                          "calibration_images": scores(dense, root / "out" / "model.onnx", calibration[:500])},
                         indent=2))


if __name__ == "__main__":
    main()
