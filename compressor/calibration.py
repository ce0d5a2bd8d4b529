"""Calibration data: images for CNNs (`load_images`), token batches for transformers (`load_text`), and
evaluation inputs held out of them (`split_images`, `split_text`): a job never scores what it was fitted to."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import CalibrationError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# a Hugging Face tokenizer, as called here: tokenizer(text, add_special_tokens=True)["input_ids"]
Tokenizer = Callable[..., Mapping[str, Any]]


AUTO_IMAGE_BYTES = 256 << 20  # samples=None: every image up to this much float32 calibration tensor...
MIN_AUTO_SAMPLES = 500  # ...but at least this many when the file has them (the earlier fixed default)


def auto_samples(images: int, image_shape: tuple[int, ...]) -> int:
    """How many of `images` a job calibrates on when the request does not say: all of them up to
    AUTO_IMAGE_BYTES (at least MIN_AUTO_SAMPLES). The reconstruction after depth removal was measured to
    want images more than steps (ResNet-56 at 2x: 72.8 % top-1 with 2,000 images, 80.6 % with 5,085, the
    same 3,000 steps, bench/RESULTS.md); the cap keeps 224 x 224 images near the earlier 500."""
    per_image = 4 * math.prod(image_shape)
    return min(images, max(MIN_AUTO_SAMPLES, AUTO_IMAGE_BYTES // max(per_image, 1)))


def load_images(
    path: str | Path,
    *,
    samples: int | None = 500,
    seed: int = 0,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> torch.Tensor:
    """Images as float32 NCHW.

    `.npz` with `x` uint8 NHWC: scaled to [0, 1], then normalised with mean/std (the models in
    ../shared/data expect ImageNet statistics). `.npy` float32 NCHW: used as-is. `samples` images are
    drawn without replacement with `seed` (all of them if there are fewer; None: `auto_samples`).
    """
    if samples is not None and samples < 1:
        raise CalibrationError(f"samples must be >= 1 (got {samples})")
    raw = _image_array(Path(path), mean, std)
    samples = auto_samples(len(raw), raw.shape[1:]) if samples is None else samples
    return _image_tensor(raw[draw(len(raw), samples, seed)], mean, std)


MIN_HELD_OUT_IMAGES = 64  # fewer held-out images than this cannot tell a broken model from a sound one
# the float32 evaluation images an --eval file gives at most (a seeded draw beyond): every round scores them all, and
# ImageNet's labelled validation set would be 30 GB of them (here 870 images of 224 x 224, all of CIFAR-10's 10,000)
EVAL_IMAGE_BYTES = 512 << 20


def load_eval_images(path: str | Path, *, labels: bool, mean: tuple[float, ...] = IMAGENET_MEAN,
                     std: tuple[float, ...] = IMAGENET_STD) -> tuple[torch.Tensor, np.ndarray | None, int]:
    """An --eval file's images as float32 NCHW, its labels `y` as stored where `labels` and it has them (an .npz),
    and how many images it holds: all of them within EVAL_IMAGE_BYTES, else a seeded draw (labels drawn alike)."""
    path = Path(path)
    raw = _image_array(path, mean, std)
    y = None
    if labels and path.suffix.lower() == ".npz":
        with readable(path), np.load(path, allow_pickle=False) as data:
            if "y" in data:
                y = np.asarray(data["y"])
        if y is not None and y.ndim == 0:
            raise CalibrationError(f"{path}: labels 'y' must be class indices, shape (N,) or (N, 1) (got a single "
                                   f"value of {y.dtype})")
        if y is not None and len(y) != len(raw):
            raise CalibrationError(f"{path}: {len(raw)} images but {len(y)} labels")
    per_image = 4 * math.prod(raw.shape[1:])
    keep = draw(len(raw), max(MIN_HELD_OUT_IMAGES, EVAL_IMAGE_BYTES // max(per_image, 1)), 0)
    return _image_tensor(raw[keep], mean, std), (y[keep] if y is not None else None), len(raw)
HELD_OUT_SHARE = 0.2  # of a file with no images to spare, the share held out for evaluation


@dataclass(frozen=True)
class HeldOut:
    """How the evaluation inputs were set apart from the calibration inputs: what a job reports, and
    the proof that it scored unseen inputs."""

    source: str  # "held out of the calibration file" | "the --eval file"
    calibration: int  # calibration inputs (images, windows)
    evaluation: int  # evaluation inputs scored
    overlap_dropped: int = 0  # evaluation inputs a calibration input repeats (`_Seen`), dropped before scoring
    taken_from_calibration: int = 0  # inputs the calibration gave up to hold them out (no spare ones)
    tokens: int | None = None  # text: the distinct tokens the evaluation windows hold

    @property
    def enough(self) -> bool:
        """Whether the evaluation is large enough to tell a broken model from a sound one."""
        return (self.evaluation >= MIN_HELD_OUT_IMAGES if self.tokens is None
                else self.evaluation > 0 and self.tokens >= MIN_HELD_OUT_TOKENS)

    def check(self, path: str | Path) -> None:
        """Refuse evaluation data too small for the accuracy check (CalibrationError: what to give instead)."""
        if self.enough:
            return
        if self.tokens is None:
            have, unit, need = self.evaluation, "images", MIN_HELD_OUT_IMAGES
        else:
            have, unit, need = self.tokens, "tokens", MIN_HELD_OUT_TOKENS
        given = "--eval" in self.source
        repeats = (f"; {self.overlap_dropped} of its inputs repeat calibration inputs (is --eval the calibration "
                   "file, or drawn from it?)" if given and self.overlap_dropped else "")
        raise CalibrationError(
            f"{path}: {have} evaluation {unit} unseen by the calibration ({self.source}); the accuracy check needs at "
            f"least {need}" + (repeats if given else f": give a calibration file of at least {2 * need} {unit} (half "
                                                     "of a small one is held out), or separate evaluation data "
                                                     "(--eval)"))


def split_images(
    path: str | Path,
    *,
    samples: int | None,
    held_out: int,
    seed: int = 0,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> tuple[torch.Tensor, torch.Tensor, HeldOut]:
    """Calibration images and up to `held_out` evaluation images of one file, never the same image twice.

    The calibration draw is `load_images`'s (`samples` with `seed`; None: `auto_samples`); the evaluation
    images are drawn (seed + 1) from the images it left. When it left fewer than MIN_HELD_OUT_IMAGES, the
    calibration gives up what the spare images lack of HELD_OUT_SHARE of the file (at least that minimum, at most
    half the file) so that the job never scores the images it was fitted to; whether what is held out is enough is
    the caller's to check (`HeldOut.check`)."""
    if (samples is not None and samples < 1) or held_out < 1:
        raise CalibrationError(f"samples and held-out images must be >= 1 (got {samples}, {held_out})")
    path = Path(path)
    raw = _image_array(path, mean, std)
    n = len(raw)
    samples = auto_samples(n, raw.shape[1:]) if samples is None else samples
    calibration = draw(n, samples, seed)
    spare = np.setdiff1d(np.arange(n), calibration)
    taken = 0
    if len(spare) < MIN_HELD_OUT_IMAGES:  # the calibration gives up images (never more than half the file)
        want = min(held_out, max(MIN_HELD_OUT_IMAGES, math.ceil(HELD_OUT_SHARE * n)), n // 2)
        given = calibration[draw(len(calibration), max(0, want - len(spare)), seed + 1)]  # the spare ones count
        spare = np.union1d(spare, given)
        calibration = np.setdiff1d(calibration, given)
        taken = len(given)
    evaluation = spare[draw(len(spare), held_out, seed + 1)]
    info = HeldOut("held out of the calibration file", len(calibration), len(evaluation),
                   taken_from_calibration=taken)
    return _image_tensor(raw[calibration], mean, std), _image_tensor(raw[evaluation], mean, std), info


def drop_seen(inputs: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Which of `inputs` (a bool mask over its first dimension) are not identical to any of `seen`."""
    known = {_digest(x) for x in seen}
    return torch.tensor([_digest(x) not in known for x in inputs], dtype=torch.bool)


def _digest(x: torch.Tensor) -> bytes:
    return hashlib.blake2b(x.contiguous().numpy().tobytes(), digest_size=16).digest()


def draw(n: int, samples: int, seed: int) -> np.ndarray:
    """Sorted indices of `samples` of n items drawn without replacement with `seed` (all when fewer)."""
    if samples >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).permutation(n)[:samples])


@contextlib.contextmanager
def readable(path: Path) -> Iterator[None]:
    """np.load inside the block: a file that is not a readable .npz / .npy (empty, cut short, text under that name)
    is the caller's error in one line, not EOFError or BadZipFile from numpy."""
    try:
        yield
    except CalibrationError:
        raise
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as err:
        raise CalibrationError(f"{path}: not a readable {path.suffix} file ({type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else 'no detail'})") from err


def _check_file(path: Path, formats: str) -> None:
    if path.is_dir():
        raise CalibrationError(f"{path} is a directory; expected a file: {formats}")
    if not path.is_file():
        raise CalibrationError(f"no such calibration file: {path}")


def _image_array(path: Path, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """The file's images as stored (checked): uint8 NHWC from `.npz`, float32 NCHW from `.npy`."""
    _check_file(path, ".npz (x: uint8 NHWC) or .npy (float32 NCHW)")
    suffix = path.suffix.lower()  # IMAGES.NPZ as images.npz
    if suffix == ".npz":
        with readable(path), np.load(path, allow_pickle=False) as data:
            if "x" not in data:
                raise CalibrationError(f"{path}: expected an array 'x' (uint8 NHWC), found {sorted(data.files)}")
            x = data["x"]
        if x.dtype != np.uint8 or x.ndim != 4:
            hint = "; grayscale images (N, H, W) need their channel axis: x[..., None]" if x.ndim == 3 else ""
            raise CalibrationError(f"{path}: 'x' must be uint8 NHWC, got {x.dtype} with shape {x.shape}{hint}")
        if len(mean) != x.shape[3] or len(std) != x.shape[3]:
            if x.shape[1] == len(mean) == len(std):
                raise CalibrationError(f"{path}: 'x' of shape {x.shape} looks channels-first (NCHW); .npz images are "
                                       "NHWC: save x.transpose(0, 2, 3, 1)")
            # the usual cause is a colour model given RGBA or grayscale images: say how to convert them first
            convert = {(4, 3): "RGBA images for an RGB model: keep x[..., :3]",
                       (1, 3): "grayscale images for an RGB model: np.repeat(x, 3, axis=-1)"}.get(
                (x.shape[3], len(mean)))
            raise CalibrationError(f"{path}: {x.shape[3]} channels but mean/std have {len(mean)}/{len(std)} values; "
                                   + (f"{convert}; or, for a model of {x.shape[3]} channel(s), " if convert else "")
                                   + f"give --mean and --std with {x.shape[3]} value(s) each (e.g. --mean "
                                   f"{','.join(['0.5'] * x.shape[3])} --std {','.join(['0.5'] * x.shape[3])})")
        if any(s <= 0 for s in std):
            raise CalibrationError(f"std must be positive (got {std})")
        return x
    if suffix == ".npy":
        with readable(path):
            x = np.load(path, allow_pickle=False)
        if x.dtype != np.float32 or x.ndim != 4:
            raise CalibrationError(f"{path}: expected float32 NCHW, got {x.dtype} with shape {x.shape}")
        if not np.isfinite(x).all():
            raise CalibrationError(f"{path}: contains NaN or Inf")
        return x
    raise CalibrationError(f"{path}: unsupported calibration format {path.suffix!r}; expected .npz (x: uint8 "
                           "NHWC) or .npy (float32 NCHW)")


def _image_tensor(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    if images.dtype != np.uint8:  # .npy: float32 NCHW, as it is
        return torch.from_numpy(np.ascontiguousarray(images))
    t = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return ((t - m) / s).contiguous()


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
    shortest = _check_windows(sequences, length, min_length)
    documents = _documents(Path(path), tokenizer)
    return _batches(_windows(documents, sequences, length, shortest, seed), batch_size, shortest < length)


MIN_HELD_OUT_TOKENS = 512  # fewer held-out tokens than this cannot tell a broken model from a sound one
HELD_OUT_TOKEN_SHARE = 0.1  # of a calibration text, the share (its end) held out for evaluation


def split_text(
    path: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    sequences: int = 128,
    length: int = 128,
    seed: int = 0,
    batch_size: int = 16,
    min_length: int | None = None,
    eval_sequences: int = 64,
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]], HeldOut]:
    """Calibration batches and evaluation batches of one text that share no token: the text's last
    HELD_OUT_TOKEN_SHARE of tokens (at least MIN_HELD_OUT_TOKENS; a document that straddles the cut is
    split there) is held out, the calibration windows are drawn from the rest and the evaluation windows
    (`eval_sequences`, drawn alike with seed + 1) from the held-out part; an evaluation window identical
    to a calibration window (a text that repeats itself) is dropped. The held-out part is at most half the
    text; whether it is enough is the caller's to check (`HeldOut.check`)."""
    shortest = _check_windows(sequences, length, min_length)
    documents = _documents(Path(path), tokenizer)
    first, second = _held_out_cut(documents)
    if not any(len(d) for d in first) or not any(len(d) for d in second):
        raise CalibrationError(f"{path}: {sum(len(d) for d in documents)} tokens are too few to draw calibration "
                               "windows from and hold an evaluation part out of; give a longer text")
    calibration = _windows(first, sequences, length, shortest, seed)
    evaluation = _windows(second, eval_sequences, length, shortest, seed + 1)
    kept, dropped = unseen_windows(evaluation, calibration, runs=False)
    info = HeldOut("held out of the calibration text (its end)", len(calibration), len(kept), overlap_dropped=dropped,
                   tokens=sum(len(d) for d in second) if kept else 0)
    return (_batches(calibration, batch_size, shortest < length), _batches(kept, batch_size, shortest < length),
            info)


def more_windows(
    path: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    sequences: int,
    length: int = 128,
    seed: int = 0,
    batch_size: int = 16,
    min_length: int | None = None,
    held_out: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """`sequences` more windows of a calibration text, drawn alike (`load_text`'s windows and batches) from the part
    the calibration draws from: without the end that `split_text` holds out when `held_out`, else the whole text.
    For a fit that steps through more text than the solves read; draw it with a seed of its own (the calibration's
    would repeat its windows)."""
    shortest = _check_windows(sequences, length, min_length)
    documents = _documents(Path(path), tokenizer)
    if held_out:
        documents = _held_out_cut(documents)[0]
    return _batches(_windows(documents, sequences, length, shortest, seed), batch_size, shortest < length)


def _held_out_cut(documents: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(calibration part, held-out end) of a text as `split_text` cuts it."""
    total = sum(len(d) for d in documents)
    held = min(max(MIN_HELD_OUT_TOKENS, math.ceil(HELD_OUT_TOKEN_SHARE * total)), total // 2)
    return _cut(documents, total - held)


def count_tokens(path: str | Path, tokenizer: Tokenizer | None = None) -> int:
    """The tokens of a text file's documents (as `load_text` reads them)."""
    return sum(len(d) for d in _documents(Path(path), tokenizer))


NGRAM = 8  # tokens in a run that `_Seen` looks for
OVERLAP = 0.5  # a window with at least this share of its NGRAM-token runs in windows already used is one of them
# odd multipliers of a run's polynomial hash (mod 2^64): runs of 8 token ids, one uint64 each
_RUN_HASH = np.random.default_rng(0x5EED).integers(0, 2**63, NGRAM, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


class _Seen:
    """Token windows already used (the calibration's): a window is one of them when it is identical to one, or (with
    `runs`) when at least OVERLAP of its NGRAM-token runs occur in them: a window drawn at another offset of the same
    text. Only identical windows counted before, so an --eval file that was the calibration file kept every window
    (0 dropped, 86 % of its tokens calibrated on) and was reported unseen. Without `runs` (`split_text`: windows of
    disjoint positions of one text, where a run in both is the text repeating itself, as the shipped fallback
    sentences do in every document) identical windows alone."""

    def __init__(self, windows: list[torch.Tensor], runs: bool = True) -> None:
        self.digests = {_digest(w) for w in windows}
        found = [_runs(w) for w in windows] if runs else []
        self.runs = np.unique(np.concatenate(found)) if found else np.empty(0, np.uint64)  # sorted

    def __contains__(self, window: torch.Tensor) -> bool:
        if _digest(window) in self.digests:
            return True
        runs = _runs(window)
        if not len(runs) or not len(self.runs):
            return False
        at = np.searchsorted(self.runs, runs).clip(max=len(self.runs) - 1)  # O(m log n): the runs stay sorted
        return float((self.runs[at] == runs).mean()) >= OVERLAP


def _runs(window: torch.Tensor) -> np.ndarray:
    """(len - NGRAM + 1,) uint64 hashes of the window's NGRAM-token runs (none when shorter)."""
    ids = window.numpy().astype(np.uint64)
    if len(ids) < NGRAM:
        return np.empty(0, np.uint64)
    return (np.lib.stride_tricks.sliding_window_view(ids, NGRAM) * _RUN_HASH).sum(1)  # wraps mod 2^64


def unseen_windows(windows: list[torch.Tensor], seen: list[torch.Tensor], runs: bool = True
                   ) -> tuple[list[torch.Tensor], int]:
    """`windows` without those `seen` holds (`_Seen`: identical, or with `runs` overlapping), and how many were
    dropped."""
    known = _Seen(seen, runs)
    kept = [w for w in windows if w not in known]
    return kept, len(windows) - len(kept)


def unseen_batches(batches: list[dict[str, torch.Tensor]], seen: list[dict[str, torch.Tensor]], *,
                   batch_size: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """`batches` (as `load_text` gives them) rebatched without the windows that `seen`'s hold (`_Seen`), and how
    many were dropped."""
    kept, dropped = unseen_windows(_windows_of(batches), _windows_of(seen))
    return _batches(kept, batch_size, by_length=False), dropped


def unseen_rows(batch: dict[str, torch.Tensor], seen: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Which windows of a token `batch` (a bool mask over its rows) `seen`'s batches do not hold (`_Seen`, padding
    aside)."""
    return _unseen_mask(batch, _Seen(_windows_of(seen)))


def without_seen(batches: list[dict[str, torch.Tensor]],
                 seen: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """`batches` without their windows that `seen`'s hold (`unseen_rows`), every input kept and nothing rebatched; a
    batch left empty is dropped."""
    if not batches:  # nothing to compare: `seen` may be other inputs than token windows (images)
        return []
    known = _Seen(_windows_of(seen))
    return [{k: v[rows] for k, v in b.items()} for b in batches for rows in [_unseen_mask(b, known)] if rows.any()]


def _unseen_mask(batch: dict[str, torch.Tensor], known: _Seen) -> torch.Tensor:
    return torch.tensor([w not in known for w in _windows_of([batch])], dtype=torch.bool)


def _windows_of(batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The token windows of `_batches`' batches (padding removed)."""
    return [ids[mask.bool()] for b in batches for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True)]


def _check_windows(sequences: int, length: int, min_length: int | None) -> int:
    if sequences < 1 or length < 2:
        raise CalibrationError(f"need sequences >= 1 and length >= 2 (got {sequences}, {length})")
    shortest = length if min_length is None else min_length
    if not 2 <= shortest <= length:
        raise CalibrationError(f"need 2 <= min_length <= length (got {min_length}, {length})")
    return shortest


def _documents(path: Path, tokenizer: Tokenizer | None) -> list[np.ndarray]:
    _check_file(path, ".txt, .jsonl, .npz (ids, offsets) or .npy (ids)")
    documents = [d for d in _token_documents(path, tokenizer) if len(d) >= 2]
    if not documents:
        raise CalibrationError(f"{path}: no document with at least 2 tokens")
    return documents


def _cut(documents: list[np.ndarray], at: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The documents before token `at` of their concatenation and those after it (the one that straddles
    it split in two); parts shorter than 2 tokens are dropped."""
    before, after, start = [], [], 0
    for doc in documents:
        end = start + len(doc)
        if end <= at:
            before.append(doc)
        elif start >= at:
            after.append(doc)
        else:
            before.append(doc[: at - start])
            after.append(doc[at - start:])
        start = end
    return [d for d in before if len(d) >= 2], [d for d in after if len(d) >= 2]


def _windows(documents: list[np.ndarray], sequences: int, length: int, shortest: int, seed: int) -> list[torch.Tensor]:
    """`sequences` windows of documents, each at a seeded random start (and length, see `load_text`)."""
    rng = np.random.default_rng(seed)
    picks = []
    for doc_index in rng.integers(0, len(documents), size=sequences):
        doc = documents[int(doc_index)]
        size = length
        if shortest < length:  # drawn only then: fixed-length draws stay what they were
            size = round(math.exp(rng.uniform(math.log(shortest), math.log(length))))
        start = int(rng.integers(0, max(1, len(doc) - size + 1)))
        picks.append(torch.as_tensor(np.asarray(doc[start:start + size], dtype=np.int64)))
    return picks


def _batches(picks: list[torch.Tensor], batch_size: int, by_length: bool) -> list[dict[str, torch.Tensor]]:
    """Padded batches (`input_ids`, `attention_mask`) of the windows; `by_length`: shortest first."""
    if by_length:
        picks = sorted(picks, key=len)  # stable: seeded order within a length
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


def check_token_ids(batches: Sequence[dict[str, torch.Tensor]], vocabulary: int, source: object) -> None:
    """Token ids the model's embeddings have rows for, or a CalibrationError naming them: an id past the table
    ended in an IndexError (or an ONNX Runtime Gather error blamed on the export), and a negative one was read from
    the table's end without a word (ONNX Runtime and numpy both wrap it)."""
    bad: set[int] = set()
    for batch in batches:
        ids = batch["input_ids"][batch["attention_mask"].bool()] if "attention_mask" in batch else batch["input_ids"]
        bad |= set(ids[(ids < 0) | (ids >= vocabulary)].unique().tolist())
    _refuse_ids(bad, vocabulary, source, "its tokenizer's or the file's")


def _refuse_ids(bad: set[int], vocabulary: int, source: object, whose: str) -> None:
    """A CalibrationError naming the ids outside the model's `vocabulary` (the first ten), if any."""
    if bad:
        shown = ", ".join(map(str, sorted(bad)[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise CalibrationError(f"{source}: token ids {shown} are outside the model's {vocabulary} embeddings ({whose} "
                               "vocabulary is not the model's)")


def check_id_file(path: str | Path, vocabulary: int) -> None:
    """Every token id of a file of ids (.npz / .npy; text files are the tokenizer's) within the model's `vocabulary`,
    or a CalibrationError naming the others: the windows drawn first may miss an id that a later draw (the decoder's
    whole-model fit) reaches, an IndexError then, after a round's work."""
    path = Path(path)
    if path.suffix.lower() not in (".npz", ".npy"):
        return
    # per document (no second copy of a large file), the documents the draws use (`_documents`: 2 tokens or more)
    found: set[int] = set()
    for ids in _token_documents(path, None):
        if len(ids) >= 2 and (int(ids.min()) < 0 or int(ids.max()) >= vocabulary):
            found |= set(np.unique(ids[(ids < 0) | (ids >= vocabulary)]).tolist())
    _refuse_ids(found, vocabulary, path, "the file's")


def _read_text(path: Path) -> str:
    """The file's text, without a UTF-8 byte order mark (a byte-level tokenizer would read it as three tokens)."""
    try:
        return path.read_text(encoding="utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        raise CalibrationError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8") from None


def _integers(array: np.ndarray, path: Path, name: str) -> np.ndarray:
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise CalibrationError(f"{path}: '{name}' must be a 1-d integer array, got {array.dtype} {array.shape}")
    return array


def _token_documents(path: Path, tokenizer: Tokenizer | None) -> list[np.ndarray]:
    suffix = path.suffix.lower()
    if suffix == ".npz":
        with readable(path), np.load(path, allow_pickle=False) as data:
            if "ids" not in data or "offsets" not in data:
                raise CalibrationError(f"{path}: expected arrays 'ids' and 'offsets', found {sorted(data.files)}")
            ids, offsets = _integers(data["ids"], path, "ids"), _integers(data["offsets"], path, "offsets")
        if offsets.dtype == np.uint64 and len(offsets) and offsets.max() > np.iinfo(np.int64).max:
            raise CalibrationError(f"{path}: 'offsets' past int64 ({offsets.max()}) cannot index {len(ids)} ids")
        offsets = offsets.astype(np.int64)  # an unsigned difference wraps: a falling offset would read as rising
        rising = len(offsets) >= 2 and not (np.diff(offsets) < 0).any()
        if not rising or offsets[0] != 0 or offsets[-1] != len(ids):
            shown = ", ".join(map(str, offsets[:6].tolist())) + (", ..." if len(offsets) > 6 else "")
            raise CalibrationError(f"{path}: 'offsets' must rise from 0 to len(ids) = {len(ids)} (got {shown}; "
                                   f"last {offsets[-1] if len(offsets) else None})")
        return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    if suffix == ".npy":
        with readable(path):
            ids = np.load(path, allow_pickle=False)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise CalibrationError(f"{path}: expected a 1-d integer array of token ids, got {ids.dtype} {ids.shape}")
        return [ids]
    if suffix not in (".txt", ".jsonl"):
        raise CalibrationError(f"{path}: unsupported text calibration format {path.suffix!r}; expected .txt, "
                               ".jsonl, .npz (ids, offsets) or .npy (ids)")
    if tokenizer is None:
        raise CalibrationError(f"{path}: text needs the model's tokenizer (this model has none: pass token ids "
                               "as .npz with ids and offsets)")
    if suffix == ".jsonl":
        texts = []
        # records end at "\n" alone (JSON Lines): a string may hold U+2028, U+2029 or NEL unescaped, where
        # str.splitlines would cut it (read_text already made "\r\n" "\n")
        for number, line in enumerate(_read_text(path).split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                found = f" (found keys {', '.join(map(repr, list(record)[:8]))})" if isinstance(err, KeyError) and \
                    isinstance(record, dict) else ""
                raise CalibrationError(f"{path}:{number}: expected a JSON object with a 'text' field{found}") from err
            if text is not None and not isinstance(text, str):
                raise CalibrationError(f"{path}:{number}: 'text' must be a string (got {type(text).__name__})")
            # an empty or null text (a third of WikiText-2's rows) is no document: tokenised, "" was a window of
            # special tokens alone and null the word "None", each drawn as often as a real document
            if text is not None and text.strip():
                texts.append(text)
    else:
        raw = _read_text(path).replace("<|endoftext|>", "\n\n")
        # a line of spaces or tabs is a blank line too (WikiText's raw files separate paragraphs with " \n")
        texts = [t.strip() for t in re.split(r"\n[ \t]*\n", raw) if t.strip()]
    return [_tokenized(tokenizer, t) for t in texts]


PIECE_CHARS = 1 << 16  # a longer document is tokenised in pieces of about this many characters, cut after a line


def _tokenized(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """A document's token ids with the tokenizer's special tokens. A long one is tokenised in pieces cut after a
    newline, with the special tokens a short text gets around it (BOS / [CLS] before, EOS / [SEP] after) added once:
    a fast tokenizer holds ~100 bytes per token of one call (offsets, word ids), 2.5 GB for a 20 MB text without a
    blank line, where the ids are 8 bytes a token. A cut can tokenise the line after it as a text's start (a
    SentencePiece "▁" prefix): about one token in 64 K characters differs from one call's."""
    def ids(part: str, special: bool) -> list[int]:
        return list(tokenizer(part, add_special_tokens=special)["input_ids"])

    if len(text) <= PIECE_CHARS:
        return np.asarray(ids(text, True), dtype=np.int64)
    sample = text[:64]
    inner, whole = ids(sample, False), ids(sample, True)
    at = next((i for i in range(len(whole) - len(inner) + 1) if whole[i:i + len(inner)] == inner), None)
    if not inner or at is None:  # specials that do not sit around the text: the document in one call
        return np.asarray(ids(text, True), dtype=np.int64)
    pieces, start = [np.asarray(whole[:at], dtype=np.int64)], 0
    while start < len(text):
        end = text.find("\n", start + PIECE_CHARS)
        end = len(text) if end < 0 else end + 1
        pieces.append(np.asarray(ids(text[start:end], False), dtype=np.int64))
        start = end
    pieces.append(np.asarray(whole[at + len(inner):], dtype=np.int64))
    return np.concatenate(pieces)
