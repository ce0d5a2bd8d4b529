"""Calibration data: images for CNNs (text arrives with the transformer adapters)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class CalibrationError(ValueError):
    """Calibration data that cannot be used (says what was expected)."""


def load_images(
    path: str | Path,
    *,
    samples: int = 500,
    seed: int = 0,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> torch.Tensor:
    """Images as float32 NCHW.

    `.npz` with `x` uint8 NHWC: scaled to [0, 1], then normalised with mean/std (the models in
    ../shared/data expect ImageNet statistics). `.npy` float32 NCHW: used as-is. `samples` images are
    drawn without replacement with `seed` (all of them if there are fewer).
    """
    path = Path(path)
    if samples < 1:
        raise CalibrationError(f"samples must be >= 1 (got {samples})")
    if not path.is_file():
        raise CalibrationError(f"no such calibration file: {path}")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            if "x" not in data:
                raise CalibrationError(f"{path}: expected an array 'x' (uint8 NHWC), found {sorted(data.files)}")
            x = data["x"]
        if x.dtype != np.uint8 or x.ndim != 4:
            raise CalibrationError(f"{path}: 'x' must be uint8 NHWC, got {x.dtype} with shape {x.shape}")
        if len(mean) != x.shape[3] or len(std) != x.shape[3]:
            raise CalibrationError(f"{path}: {x.shape[3]} channels but mean/std have {len(mean)}/{len(std)} values")
        if any(s <= 0 for s in std):
            raise CalibrationError(f"std must be positive (got {std})")
        images = _subset(x, samples, seed)
        t = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
        m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        return ((t - m) / s).contiguous()
    if path.suffix == ".npy":
        x = np.load(path, allow_pickle=False)
        if x.dtype != np.float32 or x.ndim != 4:
            raise CalibrationError(f"{path}: expected float32 NCHW, got {x.dtype} with shape {x.shape}")
        if not np.isfinite(x).all():
            raise CalibrationError(f"{path}: contains NaN or Inf")
        return torch.from_numpy(np.ascontiguousarray(_subset(x, samples, seed)))
    raise CalibrationError(f"{path}: unsupported calibration format {path.suffix!r}; expected .npz (x: uint8 "
                           "NHWC) or .npy (float32 NCHW)")


def _subset(x: np.ndarray, samples: int, seed: int) -> np.ndarray:
    if samples >= len(x):
        return x
    order = np.random.default_rng(seed).permutation(len(x))[:samples]
    return x[np.sort(order)]
