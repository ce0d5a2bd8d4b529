"""Calibration data: images for CNNs (`load_images`), token batches for transformers (`load_text`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import CalibrationError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# a Hugging Face tokenizer, as called here: tokenizer(text, add_special_tokens=True)["input_ids"]
Tokenizer = Callable[..., Mapping[str, Any]]


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


def load_text(
    path: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    sequences: int = 128,
    length: int = 128,
    seed: int = 0,
    batch_size: int = 16,
    min_length: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Token batches for a text model: `sequences` windows of at most `length` tokens, seeded.

    With `min_length` < `length`, each window's length is drawn log-uniformly between the two (as many
    short windows as long ones per octave) and the windows are batched shortest first, so a batch pads
    little: an encoder's window is one context of its bidirectional attention, so it wants many windows
    (why, measured: `service.job.request.ENCODER_SEQUENCES`).

    `.txt` (documents separated by blank lines or `<|endoftext|>`) and `.jsonl` (`{"text": ...}` per
    line) go through `tokenizer` (the model's); `.npz` with `ids` and `offsets` (document i is
    `ids[offsets[i]:offsets[i+1]]`, as stories260K's tokens) or `.npy` with one id array are used
    as-is. Each sequence is a window of one document, starting at a seeded random position; batches
    carry `input_ids` and `attention_mask` (padding masked out).
    """
    path = Path(path)
    if sequences < 1 or length < 2:
        raise CalibrationError(f"need sequences >= 1 and length >= 2 (got {sequences}, {length})")
    shortest = length if min_length is None else min_length
    if not 2 <= shortest <= length:
        raise CalibrationError(f"need 2 <= min_length <= length (got {min_length}, {length})")
    if not path.is_file():
        raise CalibrationError(f"no such calibration file: {path}")
    documents = _token_documents(path, tokenizer)
    documents = [d for d in documents if len(d) >= 2]
    if not documents:
        raise CalibrationError(f"{path}: no document with at least 2 tokens")
    rng = np.random.default_rng(seed)
    picks = []
    for doc_index in rng.integers(0, len(documents), size=sequences):
        doc = documents[int(doc_index)]
        size = length
        if shortest < length:  # drawn only then: fixed-length draws stay what they were
            size = round(math.exp(rng.uniform(math.log(shortest), math.log(length))))
        start = int(rng.integers(0, max(1, len(doc) - size + 1)))
        picks.append(torch.as_tensor(np.asarray(doc[start:start + size], dtype=np.int64)))
    if shortest < length:
        picks.sort(key=len)  # stable: seeded order within a length
    batches = []
    for b in range(0, len(picks), batch_size):
        chunk = picks[b:b + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, seq in enumerate(chunk):
            ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def _token_documents(path: Path, tokenizer: Tokenizer | None) -> list[np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            if "ids" not in data or "offsets" not in data:
                raise CalibrationError(f"{path}: expected arrays 'ids' and 'offsets', found {sorted(data.files)}")
            ids, offsets = data["ids"], data["offsets"]
        rising = offsets.ndim == 1 and len(offsets) >= 2 and not (np.diff(offsets) < 0).any()
        if not rising or offsets[0] != 0 or offsets[-1] != len(ids):
            raise CalibrationError(f"{path}: 'offsets' must rise from 0 to len(ids)")
        return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    if path.suffix == ".npy":
        ids = np.load(path, allow_pickle=False)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise CalibrationError(f"{path}: expected a 1-d integer array of token ids, got {ids.dtype} {ids.shape}")
        return [ids]
    if path.suffix not in (".txt", ".jsonl"):
        raise CalibrationError(f"{path}: unsupported text calibration format {path.suffix!r}; expected .txt, "
                               ".jsonl, .npz (ids, offsets) or .npy (ids)")
    if tokenizer is None:
        raise CalibrationError(f"{path}: text needs the model's tokenizer (this model has none: pass token ids "
                               "as .npz with ids and offsets)")
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(str(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CalibrationError(f"{path}:{number}: expected a JSON object with a 'text' field") from err
    else:
        raw = path.read_text(encoding="utf-8").replace("<|endoftext|>", "\n\n")
        texts = [t.strip() for t in raw.split("\n\n") if t.strip()]
    return [np.asarray(tokenizer(t, add_special_tokens=True)["input_ids"], dtype=np.int64) for t in texts]
