"""What differs between model kinds, behind one declared protocol (`ModelJob`).

* `ConvJob`: conv graphs (`.pt2`, HF image CNNs, torchvision): image calibration, top-1 or cosine.
* `TextJob`: HF text transformers (encoders, causal LMs): text calibration, cosine or perplexity.
* `ImageTransformerJob`: HF vision transformers (ViT, DeiT, Swin): image calibration through the transformer
  pipeline, `pixel_values` in, cosine of the pooled `last_hidden_state`.

`open_job` is the one place that decides which kind a reference is; the compressor's CNN and
transformer parts never meet anywhere else.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import fx, nn

from compressor.calibration import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    HeldOut,
    check_id_file,
    check_token_ids,
    count_tokens,
    draw,
    drop_seen,
    load_eval_images,
    load_images,
    load_text,
    more_windows,
    split_images,
    split_text,
    unseen_batches,
    without_seen,
)
from compressor.cnn.depth import choose_blocks, greedy_blocks, remove_blocks, residual_blocks
from compressor.cnn.depth import removal_losses as block_removal_losses
from compressor.cnn.graph import analyse
from compressor.cnn.models import load_model, save_program
from compressor.cnn.pipeline import channel_cost, fit_conv_graph, prune_conv_graph, resize_conv_graph
from compressor.cnn.refine import DEFAULT_STEPS as GRAPH_STEPS
from compressor.cnn.refine import graph_config
from compressor.errors import CalibrationError, InputError, ModelReferenceError, UnsupportedArchitecture
from compressor.layerstats import LayerObservation, Widths, compute_device
from compressor.modules import count_parameters
from compressor.progress import RECONSTRUCTION, SOLVE, STATISTICS, Progress, warning
from compressor.refine import RefineConfig
from compressor.reports import LayerReport, RefineReport, fit_numbers
from compressor.transformer.adapters import (
    ADAPTERS,
    adapter_for,
    block_path,
    check_config,
    dims,
    layers,
    max_sequence,
)
from compressor.transformer.models import load_transformer, save_standard, transformer_config
from compressor.transformer.offload import STREAM_SHARE, TOKENIZER_FILES, StreamedCheckpoint, needs_streaming
from compressor.transformer.pipeline import (
    ADDS_BIAS,
    UNCOMPENSATED,
    attention_fixed_cost,
    group_cost,
    parallel_mixer_cost,
    prune_blocks,
    prune_transformer,
    removal_losses,
    resize_transformer,
)
from compressor.transformer.refine import DEFAULT_STEPS as BLOCK_STEPS
from compressor.transformer.refine import default_config as block_refine
from compressor.transformer.refine import model_config, reconstruct_model
from compressor.transformer.remote import MODULE as REMOTE_MODULE
from compressor.transformer.sensitivity import Sensitivity, output_sensitivity
from compressor.transformer.sublayers import ATTENTION, FFN, check_removable, remove_sublayer, softmax_attentions
from compressor.transformer.surgery import (
    check_removable_layers,
    in_features,
    load_pruned,
    mixer_units,
    projection,
    query_heads,
    remove_layers,
    widths,
)
from exporters.fusion import fuse_checked, unfused_path
from exporters.genai import GENAI_TYPES, genai_type, write_genai_config
from exporters.onnx import (
    PARITY_TOLERANCES,
    Parity,
    ParityTolerance,
    check_decode_parity,
    check_hf_outputs,
    check_parity,
    export_decode_step,
    export_hf_onnx,
    export_onnx,
    exported_in,
    hf_reference,
    in_precision,
)
from exporters.runtime import default_provider, run_outputs
from exporters.serving import (
    ONNX_DIR,
    LayoutError,
    copy_image_classifier_files,
    copy_sentence_files,
    link_onnx,
    sentence_pooling,
)

from .budgets import AGREEMENT, COSINE, PERPLEXITY, TOP1, Metric
from .report import KindFields
from .request import IMAGES, NPZ_IMAGES, TEXT, TRANSFORMER, CompressRequest

Say = Callable[[str | Progress], None]  # a line of text, or a pipeline's record
Observe = Callable[[LayerObservation], None]
Solved = tuple[nn.Module, list[LayerReport]]  # a prune without the fit: the solved model and its layers' reports
DEPTH_IMAGES = 256  # calibration images that judge which residual blocks to remove (a forward pass per candidate)
# reconstruction steps of a conv graph without some of its blocks, fitted to the dense graph: ResNet-56 at 2x
# with 6 blocks removed measured 73.6 % top-1 fitted for 300 steps to its own outputs, 82.0 % for 3,000 to the
# dense ones (bench/RESULTS.md, 2026-11-25)
DEPTH_STEPS = 3000
# calibration images behind the layer statistics (the curves' pass and every round's solves; a random prefix of
# the draw), while the graph reconstruction fits on all of them: on 2 CPU cores ResNet-56's curves pass took ~8
# minutes and a round's solves ~10 on all 5,085 images, each image a 32 x 32 map of rows in H
STATISTICS_IMAGES = 1024
# the text windows the planning passes (the dense curves and the removal losses) read at most: every k-th batch of
# the draw, so they span its lengths; the round's solves and fits read them all
PLANNING_SEQUENCES = 1024
# the most output values of a transformer that one check or one evaluation call holds: a 1B decoder's logits of a
# batch of 16 windows x 128 tokens x 128,256 words are 1 GB in float32, held by the job (PyTorch's and ONNX Runtime's
# in a check) and by ONNX Runtime's arena (an evaluation: its subprocess grew to 9.7 GB on a 4.9 GB export). An
# export is checked on the first calibration batch cut to this (hundreds of tokens still), an evaluation runs its
# batches in slices within it (a perplexity sums them)
OUTPUT_VALUES = 64 << 20
# the windows a decoder's whole-model fit of its next-token distributions steps through (the calibration's and more
# of the same text): on the calibration's 128 alone SmolLM2-135M's fit saturates (session 29: a returned model fitted
# on for 30 steps of fresh windows went 80.64 -> 74.79, then no further on those), while a step costs the same
# whatever the pool; 1,024 cover the ~60-250 steps of 4 windows that a job's allowance runs to without a repeat. A
# SmolLM2-135M 1.25x job with them: WikiText-2 78.8 at 1.32x, 84.5 on the same structure without (RESULTS, session 30)
FIT_SEQUENCES = 1024


def _statistics_pass(plan: Widths, observe: Observe | None) -> bool:
    """Whether a pipeline run is the dense statistics pass: ratio 0 with an observer prunes nothing."""
    return observe is not None and isinstance(plan, (int, float)) and plan == 0


def _relay(statistics: bool, say: Say) -> Say:
    """The pipeline's progress for the job: in the statistics pass each layer's SOLVE record (a "solve"
    that keeps every group) says what the pass did, taking the layer's statistics."""
    if not statistics:
        return say

    def progress(record: str | Progress) -> None:
        say(dataclasses.replace(record, stage=STATISTICS) if isinstance(record, Progress) and record.stage == SOLVE
            else record)

    return progress


class ModelJob(Protocol):
    """One model kind, as the compression job drives it."""

    causal: bool  # a causal LM (decode-step export, perplexity)
    traits: frozenset[str]  # what the job is, as the request's options need it (request.IMAGES, TEXT, TRANSFORMER)
    dense: nn.Module  # the model as loaded, eval mode
    metric: Metric
    shape: dict[str, int]  # the measured input shape
    params_before: int
    held_out: HeldOut  # how the evaluation inputs were set apart from the calibration inputs

    def prune(self, plan: Widths, observe: Observe | None = None, fit_seconds: float | None = None,
              fit: bool = True, solved: Solved | None = None, fit_deadline: float | None = None
              ) -> tuple[nn.Module, list[LayerReport]]:
        """Prune a copy of the dense model (`plan`: a ratio or {layer: kept width}); `observe` sees every
        layer's statistics before its solve (the dense curves pass prunes nothing); `fit_seconds`: what the
        reconstruction may spend in all (a time budget's pacing; None: its steps alone bound it), and
        `fit_deadline` when it must end whatever that left (the budget's end, `RefineConfig.deadline`); `fit`: False
        solves the layers without any reconstruction after them (a depth trial's); `solved`: such a prune of
        the same plan, whose solves are kept and fitted (kinds with `refits_solved` only)."""
        ...

    def resize(self, plan: Widths) -> nn.Module:
        """A copy of the dense model at the plan's widths, weights sliced and not solved: what a latency
        probe exports and measures (the latency depends on the widths alone)."""
        ...

    def export(self, module: nn.Module, path: Path) -> Parity:
        """Export to ONNX, check parity against `module` (ParityError beyond tolerance); returns the errors."""
        ...

    def export_decode_step(self, module: nn.Module, path: Path) -> Parity: ...

    def latency_feed(self) -> dict[str, np.ndarray]:
        """ONNX Runtime inputs of the measured shape."""
        ...

    def outputs(self, path: Path) -> Any:
        """The evaluation outputs of one ONNX model, as `score` takes them."""
        ...

    def score(self, outputs: Any, reference: Any) -> float:
        """The metric of one model's evaluation outputs (`reference`: the dense model's)."""
        ...

    def secondary(self, outputs: Any, reference: Any) -> dict[str, float]:
        """Other metrics reported beside the job's metric (never budgeted), by name."""
        ...

    def baseline_warnings(self, reference: Any) -> list[str]:
        """What makes the metric weak on these evaluation inputs, judged from the dense model's outputs."""
        ...

    def save(self, module: nn.Module, out: Path) -> str:
        """Save the pruned model into `out`; returns its artifact name."""
        ...

    def serving_files(self, out: Path) -> dict[str, Any] | None:
        """Files the stacks that serve the model read beside the returned `out`/model.onnx (written after it),
        for report.json's artifacts; None when the kind writes none."""
        ...

    def preprocessing(self) -> dict:
        """What a server of the ONNX file must do to inputs (stamped into its metadata)."""
        ...

    def report_fields(self, module: nn.Module) -> KindFields:
        """Kind-specific entries of report.json."""
        ...

    def currency(self) -> Callable[..., float] | None:
        """How a layer's loss relative to the residual stream becomes the currency target mode allocates in:
        convert(unit name, loss, against) with `against` the stream it is relative to, the layer's "input" (a width
        curve's and a removal loss's) or "output"; None: the stream's own (the request's `normalise`, where the kind
        has another)."""
        ...


def open_job(request: CompressRequest, say: Say) -> ModelJob:
    """The job for the request's model kind (see the module docstring). A Hugging Face directory of an
    architecture nothing here prunes is refused before anything loads, with its reason
    (`check_config`, the rule the server's submission applies too)."""
    directory = Path(str(request.model)).expanduser()
    if (directory / "config.json").is_file():
        try:
            config_json = json.loads((directory / "config.json").read_text())
        except ValueError as err:
            raise InputError(f"{request.model}: config.json is not valid JSON") from err
        if isinstance(config_json, dict):
            check_config(config_json, str(request.model))
    config = transformer_config(request.model)
    if config is not None:
        if "num_channels" in config:
            return ImageTransformerJob(request, say)
        return TextJob(request, say)
    return ConvJob(request, say)


def tolerance(request: CompressRequest) -> ParityTolerance:
    """Parity tolerance of an export against the PyTorch module it came from, relative to each output's
    scale (half precision rounds differently in ONNX Runtime's kernels)."""
    return PARITY_TOLERANCES[request.precision]


MIN_COSINE_VALUES = 8  # fewer output values a sample: `cosine` compares each output over the samples


def cosine(outputs: Sequence[np.ndarray] | np.ndarray, reference: Sequence[np.ndarray] | np.ndarray) -> float:
    """Mean cosine similarity of matching rows (each sample's output flattened). An output of fewer than
    MIN_COSINE_VALUES values a sample (a regression head's score) is compared column by column over the samples
    instead, both centred on the dense column's mean: the cosine of one number is the agreement of two signs, and
    scored a pruned model's random positive scores 1.0 against a dense model's positive ones."""
    def rows(x) -> np.ndarray:
        parts = x if isinstance(x, list) else [x]
        return np.concatenate([np.asarray(p).reshape(len(p), -1) for p in parts])

    a, b = rows(outputs), rows(reference)
    if a.shape[1] < MIN_COSINE_VALUES and len(a) > 1:
        centre = b.mean(0, keepdims=True)  # (1, values)
        a, b = (a - centre).T, (b - centre).T  # (values, samples)
    norm_a, norm_b = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    cos = (a * b).sum(1) / np.maximum(norm_a * norm_b, 1e-30)
    return float(np.where((norm_a == 0) & (norm_b == 0), 1.0, cos).mean())  # both exactly zero: identical


def agreement(outputs: np.ndarray, reference: np.ndarray) -> float:
    """Top-1 agreement: the share of samples whose highest output is the dense model's."""
    return float((np.asarray(outputs).argmax(1) == np.asarray(reference).argmax(1)).mean())


def _no_secondary(outputs: Any, reference: Any) -> dict[str, float]:
    return {}


def _no_warnings(reference: Any) -> list[str]:
    return []


ONE_CLASS_SHARE = 0.9  # a dense model predicting one class this often makes top-1 agreement say little


def _one_class_warnings(logits: np.ndarray, samples: str, advice: str) -> list[str]:
    """A warning when the dense model's `logits` (samples, classes) pick one class for most samples."""
    counts = np.bincount(logits.argmax(1))
    share = counts.max() / counts.sum()
    if share < ONE_CLASS_SHARE:
        return []
    return [f"the dense model predicts class {counts.argmax()} for {share:.0%} of the {counts.sum()} held-out "
            f"{samples}: top-1 agreement with it says little about them (any model predicting that class agrees); "
            f"{advice}"]


def _chance_warnings(logits: np.ndarray, labels: np.ndarray) -> list[str]:
    """A warning when the dense model's top-1 on the labelled images is no better than always answering their most
    common label: a budget relative to it then passes any model."""
    top1 = float((logits.argmax(1) == labels).mean())
    chance = float(np.bincount(labels).max() / len(labels))
    if top1 > chance:
        return []
    return [f"the dense model's top-1 on the {len(labels)} labelled images is {top1:.1%}, no better than always "
            f"answering their most common label ({chance:.1%}): the accuracy budget says little; check that the "
            "labels number the model's classes as it does (an ImageNet model of 1,001 outputs reads class 0 as "
            "'background') and the preprocessing (--mean, --std)"]


def _no_decode_step(module: nn.Module, path: Path) -> Parity:
    raise InputError("--decode-step is for causal language models")


def image_normalisation(request: CompressRequest) -> tuple[tuple[float, ...], tuple[float, ...], str]:
    """(mean, std, where they came from) of the .npz images: the request's, else the model directory's
    preprocessor_config.json (what serving stacks read beside the returned model: google/mobilenet_v2 and the ViTs
    normalise with 0.5 / 0.5, not ImageNet's statistics), else ImageNet's."""
    config: dict[str, Any] = {}
    path = Path(str(request.model)).expanduser() / "preprocessor_config.json"
    if (request.mean is None or request.std is None) and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise InputError(f"{path}: not readable as JSON ({err}); give --mean and --std") from None
        if config.get("do_normalize") is False:  # the processor leaves [0, 1] as it is
            config = {"image_mean": 0.0, "image_std": 1.0}

    def value(given: tuple[float, ...] | None, key: str, fallback: tuple[float, ...]) -> tuple[tuple[float, ...], str]:
        if given is not None:
            return tuple(given), "the request"
        found = config.get(key)
        if isinstance(found, int | float) and not isinstance(found, bool):
            found = [found] * len(fallback)
        if isinstance(found, list) and found and all(isinstance(v, int | float) for v in found):
            return tuple(float(v) for v in found), "preprocessor_config.json"
        return fallback, "ImageNet's"

    (mean, mean_from), (std, std_from) = value(request.mean, "image_mean", IMAGENET_MEAN), value(
        request.std, "image_std", IMAGENET_STD)
    if len(mean) != len(std) or not all(v > 0 for v in std):
        raise InputError(f"image normalisation: mean {mean} ({mean_from}) and std {std} ({std_from}) need as many "
                         "values, std > 0; give --mean and --std")
    return mean, std, mean_from if mean_from == std_from else f"mean: {mean_from}, std: {std_from}"


def npy_images(request: CompressRequest) -> bool:
    """Whether the job's images come as .npy: float32 NCHW used as given, normalised by whoever saved them."""
    return Path(request.calibration).suffix.lower() == ".npy"


def _image_traits(request: CompressRequest, *more: str) -> frozenset[str]:
    """An image job's traits: NPZ_IMAGES where a file of the job is .npz images, which --mean / --std normalise."""
    files = [p for p in (request.calibration, request.eval) if p is not None]
    npz = any(Path(p).suffix.lower() != ".npy" for p in files)
    return frozenset({IMAGES, *more, *([NPZ_IMAGES] if npz else [])})


def _image_preprocessing(request: CompressRequest, input_name: str, shape: Sequence[int]) -> dict:
    if npy_images(request):  # the job never saw the images unnormalised: what serving must do is the caller's
        return {"input": input_name, "layout": "NCHW float32", "shape": list(shape),
                "npy_images": "used as given", "normalisation_from": "the caller (.npy calibration images, "
                                                                     "normalised before the job)"}
    mean, std, source = image_normalisation(request)
    return {"input": input_name, "layout": "NCHW float32", "shape": list(shape),
            "npz_images": "uint8 NHWC / 255, then (x - mean) / std", "mean": list(mean), "std": list(std),
            "normalisation_from": source}


def _repeat_to(x: torch.Tensor, batch: int) -> np.ndarray:
    """`batch` samples from `x`, cycling through it."""
    reps = math.ceil(batch / len(x))
    return x.repeat(reps, *([1] * (x.dim() - 1)))[:batch].numpy()


def _images_and_held_out(request: CompressRequest, held_out: int, labels: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None, HeldOut]:
    """(calibration images, evaluation images, their labels or None, how they were set apart).

    Without --eval the evaluation images are held out of the calibration file (`split_images`); with it,
    they are the --eval file's (its labels `y`, where it has them and `labels`: top-1), less any image identical to
    a calibration image. Either way at least MIN_HELD_OUT_IMAGES unseen images, or the job is refused."""
    mean, std, _ = image_normalisation(request)
    norm = {"mean": mean, "std": std}
    if request.eval is None:
        images, eval_x, info = split_images(request.calibration, samples=request.samples, held_out=held_out,
                                            seed=request.seed, **norm)
        return images, eval_x, None, info
    images = load_images(request.calibration, samples=request.samples, seed=request.seed, **norm)
    # a .npy holds one array, no labels; unlabelled images are scored as the held-out ones are (agreement with the
    # dense model for a classifier, else the outputs' cosine)
    eval_x, eval_y, given = load_eval_images(request.eval, labels=labels, **norm)
    if eval_y is not None:
        eval_y = _class_indices(eval_y, request.eval)
    source = "the --eval file" + (f" (a seeded draw of {len(eval_x):,} of its {given:,} images)"
                                  if len(eval_x) < given else "")
    unseen = drop_seen(eval_x, images)
    eval_x, eval_y = eval_x[unseen], (eval_y[unseen.numpy()] if eval_y is not None else None)
    if eval_y is None and len(eval_x) > held_out:  # labels make every image count; without, a seeded draw
        eval_x = eval_x[draw(len(eval_x), held_out, request.seed + 1)]
    info = HeldOut(source, len(images), len(eval_x), overlap_dropped=int((~unseen).sum()))
    return images, eval_x, eval_y, info


def _class_indices(labels: np.ndarray, source: object) -> np.ndarray:
    """Labels as (N,) class indices: a column (N, 1) (Keras' CIFAR-10) flattened; one-hot rows and fractional
    values refused (compared with the outputs' argmax, an (N, 1) column broadcast to N x N and scored ~1 / classes
    for any model, the dense one too, so every budget passed)."""
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    integral = np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_ or (
        np.issubdtype(labels.dtype, np.floating) and bool(np.all(np.isfinite(labels) & (labels == np.round(labels)))))
    if labels.ndim != 1 or not integral:
        raise CalibrationError(f"{source}: labels 'y' must be class indices, shape (N,) or (N, 1) of integers (got "
                               f"shape {labels.shape}, {labels.dtype}); one-hot rows become indices with "
                               "y.argmax(1)")
    return labels.astype(np.int64)


def _image_value_warnings(images: torch.Tensor, request: CompressRequest) -> list[str]:
    """Calibration images whose values look mis-scaled, which nothing else would flag (the model is pruned for inputs
    it will never see): .npy images (used as given) of raw pixel values, and .npz images whose uint8 pixels are all
    0 or 1 (scaled to [0, 1] before the uint8 cast)."""
    if npy_images(request):
        reach = float(images.abs().amax())
        if reach > 20:
            return [f"{request.calibration}: .npy images are used as given (normalised), but these reach "
                    f"{reach:.0f}: raw pixel values? normalise them as the model's inputs are, "
                    "or give uint8 NHWC images as .npz"]
        return []
    mean, std, _ = image_normalisation(request)
    # each channel's largest value back in [0, 1] (std > 0 keeps the order; no copy of the images)
    top = images.amax(dim=(0, 2, 3)) * torch.tensor(std) + torch.tensor(mean)
    if float(top.amax()) <= 1.5 / 255:
        return [f"{request.calibration}: every pixel is 0 or 1 of 255: images scaled to [0, 1] before the uint8 cast? "
                "save x as uint8 values 0-255"]
    return []


def _check_image_shapes(images: torch.Tensor, eval_x: torch.Tensor, expected: tuple[int, ...],
                        request: CompressRequest) -> None:
    """Calibration and evaluation images of the model's input shape, or the job is refused before any export (an
    evaluation image of another size failed the dense model's scoring, reported as its export's failure)."""
    for what, name, x in (("calibration", request.calibration, images), ("evaluation", request.eval, eval_x)):
        if tuple(x.shape[1:]) != tuple(expected):
            raise CalibrationError(f"{what} images{f' ({name})' if name else ''} have shape {tuple(x.shape[1:])}, "
                                   f"the model expects {tuple(expected)}")


def _classes(model: nn.Module, example: torch.Tensor) -> int | None:
    """How many classes the model's (first) output scores, where it is one score per class: (batch, classes >= 2);
    else None."""
    with torch.no_grad():
        out = model(example)
    out = out[0] if isinstance(out, tuple | list) else out
    return out.shape[1] if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] >= 2 else None


def _check_labels(labels: np.ndarray, classes: int | None, source: object) -> None:
    """Labels the model's outputs can match, or the job is refused: a label outside [0, classes) is never the
    argmax, so shifted labels (1-based, or -1 for "none") scored the dense model ~0 and every budget passed."""
    if classes is None:
        raise CalibrationError(f"{source}: labels 'y' are scored as top-1 of the model's class scores, but its output "
                               "is not one score per class (batch, classes); drop 'y' to compare the outputs instead")
    bad = sorted({int(v) for v in labels if not 0 <= v < classes})
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise CalibrationError(f"{source}: labels 'y' must be class indices in [0, {classes}) of the model's "
                               f"{classes} outputs; found {shown}")


def _image_metric(labels: np.ndarray | None, classes: int | None, source: object) -> Metric:
    """An image model's metric: top-1 on labelled evaluation images, else top-1 agreement with the dense model for
    a classifier (`classes` scores an image), else the cosine of the outputs. One output (a score) has no top-1: its
    argmax is always 0, so top-1 and agreement would read 1.0 for any model; it is compared by cosine, labels or not."""
    if classes == 1:
        return COSINE
    if labels is not None:
        _check_labels(labels, classes, source)
        return TOP1
    return AGREEMENT if classes is not None else COSINE  # no labels: "accuracy kept" is agreement with dense


def _image_score(metric: Metric, outputs: np.ndarray, reference: np.ndarray, labels: np.ndarray | None) -> float:
    if metric == TOP1:
        return float((outputs.argmax(1) == labels).mean())
    if metric == AGREEMENT:
        return agreement(outputs, reference)
    return cosine(outputs, reference)


def _image_secondary(metric: Metric, outputs: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    if metric == COSINE:
        return {}
    extra = {COSINE.name: cosine(outputs, reference)}
    return {AGREEMENT.name: agreement(outputs, reference), **extra} if metric == TOP1 else extra


def _image_warnings(metric: Metric, reference: np.ndarray, labels: np.ndarray | None) -> list[str]:
    if metric == TOP1:
        return _chance_warnings(reference, labels)
    if metric != AGREEMENT:
        return []
    return _one_class_warnings(reference, "images", "calibrate on images of the model's domain, or give labelled "
                               "evaluation images (--eval)")


class ConvJob:
    causal = False
    plans_depth = True  # target mode weighs removing whole residual blocks (`targeting.plan_depth`)
    refits_solved = True  # the fit follows every solve, so a prune without it can be fitted later (`prune(solved=)`)
    EVAL_IMAGES = 256  # held-out images scored (at most)

    def __init__(self, request: CompressRequest, say: Say) -> None:
        self.request, self.say = request, say
        self.traits = _image_traits(request)
        self.loaded = load_model(request.model, trust_remote_code=request.trust_remote_code)
        self.images, self.eval_x, self.eval_y, self.held_out = _images_and_held_out(request, self.EVAL_IMAGES,
                                                                                    labels=True)
        _check_image_shapes(self.images, self.eval_x, self.loaded.input_shape, request)
        for text in _image_value_warnings(self.images, request):
            say(warning(text))
        self.held_out.check(request.eval or request.calibration)
        self.dense = self.loaded.module  # the baseline, and what the reconstruction fits to
        self.depth: dict | None = None  # target mode's depth plan (report.json `depth`), when it made one
        chosen: list[str] = []
        if request.remove_blocks:
            say(f"depth: choosing {request.remove_blocks} residual blocks to remove")
            chosen = choose_blocks(self.dense, self.images[:DEPTH_IMAGES], request.remove_blocks,
                                   device=compute_device(request.device), batch_size=request.batch_size, progress=say)
        self.remove(chosen)  # the graph the channels are pruned of: the dense one, or it without some blocks
        self.params_before = count_parameters(self.dense)
        self.shape = {"batch": request.shape.get("batch", 64)}
        self.metric = _image_metric(self.eval_y, _classes(self.dense, self.images[:2]),
                                    request.eval or request.calibration)
        say(f"{request.model}: {len(self.analysis.units)} prunable conv layers, {len(self.images)} calibration "
            f"images, method {request.method}")

    def prune(self, plan: Widths, observe: Observe | None = None, fit_seconds: float | None = None,
              fit: bool = True, solved: Solved | None = None, fit_deadline: float | None = None
              ) -> tuple[nn.Module, list[LayerReport]]:
        statistics = _statistics_pass(plan, observe)  # nothing is pruned: nothing to reconstruct either
        progress = _relay(statistics, self.say)
        steps = self.refine_steps if fit and not statistics else 0
        refine = dataclasses.replace(graph_config(steps), seconds=fit_seconds, budgeted=fit_seconds is not None,
                                     deadline=fit_deadline)
        teacher = self.dense if self.removed_blocks else None
        if solved is not None:  # a depth trial's solves of this plan: only the fit is left
            module, layers = solved
            return fit_conv_graph(module, layers, self.graph, self.images, refine, teacher=teacher,
                                  device=self.request.device, batch_size=self.request.batch_size, progress=progress,
                                  solve_images=STATISTICS_IMAGES)
        # the statistics (curves and solves) from the first STATISTICS_IMAGES of the draw, the fit from all
        return prune_conv_graph(self.graph, self.images, plan, method=self.request.method, device=self.request.device,
                                batch_size=self.request.batch_size, progress=progress, observe=observe,
                                refine=refine, teacher=teacher, solve_images=STATISTICS_IMAGES)

    @property
    def refine_steps(self) -> int:
        """The reconstruction steps in force: the request's, else more for a graph without some blocks."""
        return self._refine_steps(bool(self.removed_blocks))

    def _refine_steps(self, shallower: bool) -> int:
        return self.request.refine_steps_or(DEPTH_STEPS if shallower else GRAPH_STEPS)

    def depth_order(self) -> Iterator[tuple[str, float]]:
        """The residual blocks in the order depth removes them (`greedy_blocks`), lazily."""
        return greedy_blocks(self.dense, self.images[:DEPTH_IMAGES], device=compute_device(self.request.device),
                             batch_size=self.request.batch_size)

    def removal_losses(self) -> dict[str, float]:
        """Each removable block's loss if removed, in the width curves' currency (`removal_losses`)."""
        return block_removal_losses(self.dense, self.images[:DEPTH_IMAGES], device=compute_device(self.request.device),
                                    batch_size=self.request.batch_size)

    def currency(self) -> None:
        """Conv graphs price errors relative to the stream they join (no output sensitivity yet)."""
        return None

    def removed_cost(self, blocks: Sequence[str]) -> None:
        """None: a conv graph's blocks run at different resolutions and widths, so each depth option's speedup is
        measured (`targeting.plan_depth`), not modelled from its multiply-adds."""
        return None

    def without(self, blocks: Sequence[str]) -> fx.GraphModule:
        """The dense graph without `blocks`."""
        return remove_blocks(self.dense, list(blocks))

    def unit_costs(self, blocks: Sequence[str], graph: fx.GraphModule | None = None) -> dict[str, float]:
        """Each prunable unit's cost per channel (`channel_cost`) in the dense graph without `blocks` (`graph`, when
        the caller built it already), named as in the dense graph: a coupled group (the residual stream's channels)
        loses the producers and consumers of the removed blocks, so its dense curve's cost prices it 20-30 % high
        once a quarter of ResNet-56's blocks are gone."""
        if graph is None:
            graph = remove_blocks(self.dense, list(blocks)) if blocks else self.dense
        # by the dense graph's unit names, which the curves carry: a stream left with one producer and one
        # consumer is a plain unit named after its consumer (HF MobileNetV2 without layer.1: `coupled:...layer.0
        # .reduce_1x1...` becomes `...layer.2.expand_1x1...`), and a conv writes one group, so its first producer
        # names it
        dense = self._dense_units
        return {dense.get(unit.producers[0].name, unit.name): channel_cost(unit) for unit in analyse(graph).units}

    @functools.cached_property
    def _dense_units(self) -> dict[str, str]:
        """Each producer's unit in the dense graph (the depth plan prices every option against it)."""
        return {producer.name: unit.name for unit in analyse(self.dense).units for producer in unit.producers}

    def remove(self, blocks: Sequence[str]) -> None:
        """From now on the channels are pruned of the dense graph without `blocks`."""
        self.removed_blocks = list(blocks)
        self.graph = remove_blocks(self.dense, self.removed_blocks) if blocks else self.dense
        self.analysis = analyse(self.graph)

    def resize(self, plan: Widths) -> nn.Module:
        return resize_conv_graph(self.graph, plan)

    export_decode_step = staticmethod(_no_decode_step)

    def export(self, module: nn.Module, path: Path) -> Parity:
        example = self.images[:2].clone()  # a view would save the whole calibration tensor
        module = in_precision(module, self.request.precision)
        export_onnx(module, example, path, input_name=self.loaded.input_name, opset=self.request.opset)
        return check_parity(module, path, self.images[: min(16, len(self.images))], tolerance=tolerance(self.request))

    def latency_feed(self) -> dict[str, np.ndarray]:
        return {self.loaded.input_name: _repeat_to(self.images, self.shape["batch"])}

    def outputs(self, path: Path) -> np.ndarray:
        batches = [[b.numpy()] for b in self.eval_x.split(256)]
        return np.concatenate(run_outputs(path, batches, reduce="raw"))

    def score(self, outputs: np.ndarray, reference: np.ndarray) -> float:
        return _image_score(self.metric, outputs, reference, self.eval_y)

    def baseline_warnings(self, reference: np.ndarray) -> list[str]:
        labels = self.eval_y if self.metric == TOP1 else None  # read only where scored
        return _image_warnings(self.metric, np.asarray(reference), labels)

    def secondary(self, outputs: np.ndarray, reference: np.ndarray) -> dict[str, float]:
        return _image_secondary(self.metric, outputs, reference)

    def save(self, module: nn.Module, out: Path) -> str:
        save_program(module, out / "model.pt2", self.images[:2].clone())
        return "model.pt2"

    def serving_files(self, out: Path) -> dict[str, Any] | None:
        if self.loaded.kind != "hf":
            return None
        # a Hugging Face image classifier: the job's directory loads as Optimum's ORTModelForImageClassification
        copied = copy_image_classifier_files(Path(str(self.request.model)).expanduser(), out)
        return {"onnx": "model.onnx", "optimum": "ORTModelForImageClassification", "files": copied}

    def preprocessing(self) -> dict:
        return _image_preprocessing(self.request, self.loaded.input_name, self.loaded.input_shape)

    def report_fields(self, module: nn.Module) -> KindFields:
        # the blocks the returned graph lacks, not the job's last plan: after a re-plan they can differ
        params = set(module.state_dict())
        removed = [b.name for b in residual_blocks(self.dense) if not params.intersection(b.parameters)]
        return KindFields(samples=len(self.images), not_pruned=dict(self.analysis.refused), removed_blocks=removed,
                          refine_steps=self._refine_steps(bool(removed)), depth=self.depth)


def _removable(model: nn.Module, indices: list[int]) -> bool:
    """Whether `remove_layers` takes these layers (`check_removable_layers`)."""
    try:
        check_removable_layers(model, indices)
    except (ValueError, UnsupportedArchitecture):
        return False
    return True


def _streamed(request: CompressRequest) -> bool:
    """Whether a transformer job streams its checkpoint: asked (--stream), or on by itself where pruning it in memory
    would take more than STREAM_SHARE of the available memory (Mixture-of-Experts checkpoints too: a streamed block
    merges its experts as it is read). A bias for a MoE layer's experts is refused before anything loads."""
    family = ADAPTERS.get((transformer_config(request.model) or {}).get("model_type"))
    experts = family is not None and family.experts
    if experts and (request.method in ADDS_BIAS or request.add_bias == "yes"):
        what = f"method {request.method!r}" if request.method in ADDS_BIAS else "--add-bias yes"
        raise UnsupportedArchitecture(f"{what} gives output projections a bias, which is not built for a "
                                      "Mixture-of-Experts layer's experts")
    return request.stream or needs_streaming(request.model)


class _TransformerJob:
    """What text and vision transformers share: the block pipeline, HF exports and saving."""

    planning_samples: int | None = None  # what the planning passes read at most (None: every calibration sample)
    refits_solved = False  # each block's fit runs before the next block's solves: no prune is fitted later

    causal = False
    # after the block fits, the whole model fitted to the dense model's outputs (`reconstruct_model`): on for text
    # models (measured: all-MiniLM-L6-v2 on its last hidden states; SmolLM2-135M on its next-token distributions,
    # `target="logits"`, where the hidden states' fit gained 1.3 % perplexity: bench/RESULTS.md, sessions 17, 28
    # and 29); off for vision transformers (no real weights here to measure it on)
    model_fit = False

    def __init__(self, request: CompressRequest, say: Say) -> None:
        if request.remove_blocks:
            raise InputError("--remove-blocks is for conv graphs (residual blocks of a CNN), not transformers: their "
                             "whole layers are weighed in target mode (report.json `depth`); --remove-blocks 0 "
                             "turns that off")
        self.request, self.say = request, say
        self.stream = _streamed(request)
        if self.stream and not request.stream:
            say(warning(f"pruning streams the checkpoint block by block (--stream): pruning it in memory would take "
                        f"more than {STREAM_SHARE:.0%} of the available memory; whole layers are not weighed for "
                        "removal when streaming"))
        if self.stream and self.model_fit:  # the fit runs on the whole pruned model in memory, which streaming avoids
            say(warning("the whole-model fit after the block fits is not run when streaming (--stream): each block "
                        "is fitted on its own"))
        self.loaded = load_transformer(request.model, trust_remote_code=request.trust_remote_code)
        self.dense = self.loaded.model
        self.params_before = count_parameters(self.dense)
        self.batches: list[dict[str, torch.Tensor]] = []
        self.shape: dict[str, int] = {}
        self.tokens = 0  # tokens per sample at the measured shape (the latency model's sequence length)
        # whole layers: target mode weighs removing them (`targeting.plan_depth`), in memory only
        self.plans_depth = not self.stream
        # layers removed whole ("model.layers.7") and sub-layers removed alone (their output projection's name,
        # "model.layers.7.mlp.down_proj"), in the dense numbering
        self.removed_blocks: list[str] = []
        self.depth: dict | None = None  # target mode's depth plan (report.json `depth`)
        self._removal_losses: dict[str, float] | None = None
        self._sensitivity: Sensitivity | None = None

    def currency(self) -> Callable[..., float] | None:
        """With `normalise` "output", a unit's loss relative to the stream becomes the change of the model's output
        it predicts (`compressor.transformer.sensitivity`: the stream's energy there times the output's gradient
        energy, from one backward pass of the dense model over the planning batches, made once)."""
        if self.request.normalise != "output":
            return None
        if self._sensitivity is None:
            self.say("output sensitivity: a backward pass of the dense model over the planning batches")
            self._sensitivity = output_sensitivity(self.dense, self.planning_batches(), device=self.request.device)
        sensitivity, units = self._sensitivity, self._units()
        adapter, blocks = adapter_for(self.dense), layers(self.dense)
        # a shared expert's width curve: its error joins its FFN's update (MoE layers only: a dense FFN has none)
        units |= {f"{block_path(self.dense, i)}.{shared}": (i, FFN)
                  for i, block in enumerate(blocks) if (shared := adapter.at(block).shared_down) is not None}

        def convert(name: str, loss: float, against: str = "input") -> float:
            if name not in units:
                raise KeyError(f"{name}: not a layer or sub-layer of this model, no output sensitivity for it")
            return sensitivity.relative_to_output(*units[name], loss, against)

        return convert

    def removal_losses(self) -> dict[str, float]:
        """Each removable unit's loss if removed, in the width curves' currency (`pipeline.removal_losses`), by
        name: whole layers ("model.layers.7"; a family whose first layer is built unlike the others keeps it:
        `FamilyAdapter.first_layer_fixed`), and each layer's attention and FFN alone, named by their output
        projection ("model.layers.7.self_attn.o_proj": the width curve's unit, all of whose groups go)."""
        if self._removal_losses is None:
            losses = removal_losses(self.dense, self.planning_batches(), device=self.request.device,
                                    activation_dtype=getattr(torch, self.request.activation_dtype),
                                    compensate=self.request.method not in UNCOMPENSATED)
            units = self._units()
            adapter = adapter_for(self.dense)
            first = len(losses) if not adapter.whole_layers else 1 if adapter.first_layer_fixed else 0
            found = {(i, None): loss.layer for i, loss in enumerate(losses) if i >= first}
            found |= {(i, ATTENTION): loss.attention for i, loss in enumerate(losses) if loss.attention is not None}
            found |= {(i, FFN): loss.ffn for i, loss in enumerate(losses) if loss.ffn is not None}
            convert = self.currency()
            self._removal_losses = {  # relative to the layer's input stream (a sub-layer's too), as the widths
                name: convert(name, found[unit], "input") if convert else found[unit]
                for name, unit in units.items() if unit in found}
        return self._removal_losses

    def depth_order(self) -> Iterator[tuple[str, float]]:
        """Whole layers and sub-layers by removal loss per multiply-add saved, least first (ShortGPT's order,
        in the curves' units, weighed by what each move saves: a layer's attention and its FFN cost unequally).
        A move overlapping an earlier one (a layer after one of its sub-layers, a sub-layer after its layer) is
        left out; a layer's two sub-layers together are its removal (`_split`). A move that would leave no layer
        at all (a shallow model has its best moves in every layer), or a decoder no attention (a hybrid one no
        softmax attention beside its linear ones), is left out."""
        costs = self._unit_costs()
        units = self._units()
        n = dims(self.dense).layers
        whole, partial, deaf = set(), set(), set()  # deaf: layers without their attention (a decoder keeps one)
        attentive = set(softmax_attentions(self.dense))  # a hybrid decoder keeps one beside its linear attentions
        for name, loss in sorted(self.removal_losses().items(), key=lambda item: item[1] / costs[item[0]]):
            index, kind = units[name]
            if index in whole or (kind is None and index in partial):
                continue
            gone = kind is None or index in partial  # the layer is then removed whole
            if gone and len(whole) + 1 >= n:
                continue
            if gone and adapter_for(self.dense).whole_layers and not _removable(self.dense, sorted(whole | {index})):
                continue  # e.g. Gemma 4's last layer (a Swin block named by both sub-layers keeps its norms)
            if self.causal and kind != FFN and attentive <= deaf | {index}:
                continue
            (whole if gone else partial).add(index)
            if kind != FFN:
                deaf.add(index)
            yield name, loss

    def _units(self) -> dict[str, tuple[int, str | None]]:
        """Every depth unit's name -> (layer index, sub-layer kind, None for the whole layer)."""
        adapter = adapter_for(self.dense)
        units: dict[str, tuple[int, str | None]] = {}
        for i, block in enumerate(layers(self.dense)):
            path = block_path(self.dense, i)
            units[path] = (i, None)
            here = adapter.at(block)  # a MoE family's dense FFN, a linear-attention mixer: their own paths
            units[f"{path}.{here.o}"] = (i, ATTENTION)
            units[f"{path}.{here.down}"] = (i, FFN)
        return units

    def _unit_costs(self) -> dict[str, float]:
        """Each depth unit's multiply-adds per token at the measured sequence length (the latency model's)."""
        adapter, blocks = adapter_for(self.dense), layers(self.dense)
        costs = {}
        for name, (i, kind) in self._units().items():
            here = adapter.at(blocks[i])  # a MoE family's layer with a dense FFN, a linear-attention mixer: their own
            linear = here.recurrent and here.heads_prunable  # a linear-attention mixer: its units
            units = mixer_units(self.dense, i) if linear else query_heads(self.dense, i)
            attention = group_cost(self.dense, ATTENTION, max(self.tokens, 1), index=i) * units \
                + attention_fixed_cost(self.dense, i)  # latent attention's shared projections, a whole mixer
            ffn = group_cost(self.dense, FFN, 1, index=i) * in_features(projection(blocks[i], here.down))
            if here.shared_down is not None:  # Qwen2-MoE's shared expert goes with its FFN
                ffn += group_cost(self.dense, FFN, 1, index=i, shared=True) * in_features(
                    projection(blocks[i], here.shared_down))
            sublayer = {ATTENTION: attention, FFN: ffn}
            # a layer's mixer beside its attention (Falcon-H1's), kept whole, goes with the layer alone
            costs[name] = sublayer[kind] if kind is not None else \
                sum(sublayer.values()) + parallel_mixer_cost(self.dense, i)
        return costs

    def curve_owner(self, name: str) -> str:
        """The depth unit whose removal takes a width curve's unit with it: a MoE layer's shared expert goes with its
        FFN (named by its experts, `_units`); any other curve is its own."""
        adapter = adapter_for(self.dense)
        if adapter.shared_down is not None and name.endswith(f".{adapter.shared_down}"):
            return f"{name.removesuffix(adapter.shared_down)}{adapter.down}"
        return name

    def removed_cost(self, blocks: Sequence[str]) -> float:
        """The share of the prunable multiply-adds that removing `blocks` (depth units) saves. A transformer's layers
        all run at one sequence length and width, so a layer's or sub-layer's share of the latency is its share of
        the multiply-adds times the latency model's share (`targeting.plan_depth` models its options so)."""
        costs, units = self._unit_costs(), self._units()
        total = sum(costs[name] for name, (_, kind) in units.items() if kind is None)
        unknown = [b for b in blocks if b not in costs]
        assert not unknown, f"not depth units of this model: {unknown}"
        return sum(costs[b] for b in blocks) / total

    def _split(self, names: Sequence[str]) -> tuple[list[int], list[tuple[int, str]]]:
        """(layers removed whole, (layer, kind) of the sub-layers removed alone) of depth unit names, in the dense
        numbering; a layer named with one of its sub-layers, or by both of them, is removed whole (unless it is a
        first layer kept by `first_layer_fixed`). Names of no unit of this model are refused, all listed."""
        units = self._units()
        unknown = [name for name in names if name not in units]
        adapter = adapter_for(self.dense)
        if unknown:
            first, last = block_path(self.dense, 0), block_path(self.dense, dims(self.dense).layers - 1)
            dense = f" (LAYER.{adapter.dense_down} where its FFN is dense)" if adapter.dense_down else ""
            mixer = f" (LAYER.{adapter.linear_attention}.out_proj in its linear-attention layers)" \
                if adapter.linear_attention else ""
            raise InputError(f"no layer or sub-layer named {unknown} in this model (its layers: {first} ... {last}, "
                             f"their sub-layers LAYER.{adapter.o}{mixer} and LAYER.{adapter.down}{dense})")
        fixed = 0 if adapter.first_layer_fixed else None
        chosen = [units[name] for name in names]
        whole = {i for i, kind in chosen if kind is None}
        if adapter.whole_layers:  # else a layer named by both its sub-layers keeps its norms (Swin)
            whole |= {i for i, kind in chosen if kind == ATTENTION and (i, FFN) in chosen and i != fixed}
        subs = sorted({(i, kind) for i, kind in chosen if kind is not None and i not in whole})
        return sorted(whole), subs

    def without(self, blocks: Sequence[str]) -> nn.Module:
        """The dense model without the named layers and sub-layers (the structure: sub-layers add zeros)."""
        whole, subs = self._split(blocks)
        shallow = copy.deepcopy(self.dense).cpu().eval()
        for index, kind in subs:
            remove_sublayer(shallow, index, kind)
        remove_layers(shallow, whole)
        return shallow

    def remove(self, blocks: Sequence[str]) -> None:
        """From now on the named layers and sub-layers are removed when the model is pruned."""
        whole, subs = self._split(blocks)  # names checked now, not mid-job
        if whole and not adapter_for(self.dense).whole_layers:
            raise InputError(f"{', '.join(block_path(self.dense, i) for i in whole)}: "
                             f"{self.dense.config.model_type}'s layers are not removed whole (its blocks differ by "
                             "their place in a stage); name their attention and FFN alone")
        attentions = set(softmax_attentions(self.dense)) - set(whole) - {i for i, k in subs if k == ATTENTION}
        if self.causal and not attentions:
            raise InputError(f"{', '.join(blocks)}: every attention would be gone; a decoder without any reads no "
                             "context, a hybrid one's cache does not run in transformers (keep at least one)")
        check_removable_layers(self.dense, whole)
        for index, kind in subs:
            check_removable(self.dense, index, kind)
        self.removed_blocks = list(blocks)

    def planning_batches(self) -> list[dict[str, torch.Tensor]]:
        """The calibration batches the planning passes read: every k-th, at most `planning_samples` windows
        (a text draw is batched shortest first, so every k-th batch spans its lengths); all without a limit."""
        if self.planning_samples is None:
            return self.batches
        samples = sum(len(next(iter(b.values()))) for b in self.batches)
        return self.batches[::max(1, math.ceil(samples / self.planning_samples))]

    def prune(self, plan: Widths, observe: Observe | None = None, fit_seconds: float | None = None,
              fit: bool = True, solved: Solved | None = None, fit_deadline: float | None = None
              ) -> tuple[nn.Module, list[LayerReport]]:
        if solved is not None:
            raise ValueError("a transformer's block fits run between its solves: its solves cannot be fitted later")
        request = self.request
        statistics = _statistics_pass(plan, observe)  # nothing is pruned: no block to reconstruct either
        solve_only = statistics or not fit
        batches = self.planning_batches() if statistics else self.batches
        progress = _relay(statistics, self.say)
        options = {"method": request.method, "device": request.device, "progress": progress, "observe": observe,
                   "activation_dtype": getattr(torch, request.activation_dtype),
                   "cost_sequence_length": self.tokens, "gqa": request.gqa,
                   "refine": dataclasses.replace(self._refine(solve_only, fit_seconds), deadline=fit_deadline),
                   "add_bias": {"auto": None, "yes": True, "no": False}[request.add_bias],
                   # per projection, the refit or the dense rows, by the block's held-out error: SmolLM2-135M at 0.2
                   # with 50-step fits went 78.03 -> 66.87 WikiText-2 perplexity (bench/RESULTS.md, session 36)
                   "choose_rows": not statistics}
        if self.removed_blocks and not statistics:
            options["skip"], options["sublayers"] = self._split(self.removed_blocks)
        if self.stream:
            # in the job's folder (a server's scratch, removed with the job however its worker ends), not /tmp:
            # a killed worker would leave a partial checkpoint of the model's size there
            work = Path(tempfile.mkdtemp(prefix=".osscar-stream-", dir=request.out_dir))
            try:
                checkpoint = StreamedCheckpoint(request.model, work / "model")
                layers = prune_blocks(checkpoint, batches, plan, **options)
                checkpoint.finish()
                return load_pruned(work / "model"), layers
            finally:
                shutil.rmtree(work, ignore_errors=True)
        pruned, layers = prune_transformer(self.dense, batches, plan, **options)
        pruned.osscar_removed_layers = list(self.removed_blocks)  # what report.json says of this round's model
        fitted = sum(r.refine.seconds for r in layers if r.refine is not None)  # the block fits' seconds
        config = dataclasses.replace(
            self._model_refine(solve_only, fitted, None if fit_seconds is None else fit_seconds - fitted,
                               solves=sum(r.seconds for r in layers)), deadline=fit_deadline)
        if config.steps and (self.removed_blocks or any(r.width_after < r.width_before for r in layers)):
            model_fit = reconstruct_model(pruned, self.dense, self.batches, config, compute_device(request.device),
                                          target=self.model_target, pool=self.fit_pool())
            pruned.osscar_model_fit = model_fit  # report.json `model_reconstruction`
            progress(Progress(RECONSTRUCTION, "model", numbers=fit_numbers(model_fit)))
        return pruned.cpu().eval(), layers

    def fit_pool(self) -> list[dict[str, torch.Tensor]]:
        """More windows the whole-model fit steps through beside the calibration's (`reconstruct_model`'s `pool`):
        none here."""
        return []

    @property
    def model_target(self) -> str:
        """What the whole-model fit reproduces: a causal LM's next-token distributions, else the last hidden
        states."""
        return "logits" if self.causal else "hidden"

    def _model_refine(self, solve_only: bool, block_fits: float, budget: float | None,
                      solves: float) -> RefineConfig:
        """The whole-model fit after the block fits: off in a statistics pass or a solve without the fit, for kinds
        without it (`model_fit`) and where the request turned reconstruction off (--refine-steps 0); else
        `model_config` after solves of `solves` and block fits of `block_fits` seconds, within what the time budget
        left the round's fits (`budget`)."""
        if solve_only or not self.model_fit or not self.request.refine_steps_or(BLOCK_STEPS):
            return RefineConfig(steps=0)
        return model_config(block_fits, budget, solves=solves, target=self.model_target)

    def _refine(self, solve_only: bool, fit_seconds: float | None) -> RefineConfig:
        """Each block's fit: none in a statistics pass, a solve without the fit or for a method that keeps the dense
        weights, the steps the request gave, else as long as the block's own solves took
        (`compressor.transformer.refine`)."""
        if solve_only or not self.request.refine_steps_or(BLOCK_STEPS):
            return RefineConfig(steps=0)
        return dataclasses.replace(block_refine(self.request.refine_steps), seconds=fit_seconds)

    def resize(self, plan: Widths) -> nn.Module:
        whole, subs = self._split(self.removed_blocks)
        return resize_transformer(self.dense, plan, gqa=self.request.gqa, skip=whole, sublayers=subs)

    @property
    def provider(self) -> str:
        """The ONNX Runtime provider the job measures on, which its graphs are fused for."""
        return self.request.execution_provider or default_provider()

    def export(self, module: nn.Module, path: Path) -> Parity:
        names = self.loaded.input_names
        example = {name: self.batches[0][name][:2].clone() for name in names}
        inputs = self._parity_inputs()
        # a half-precision model is exported and its reference computed in float32 without a float32 copy of it
        # (4.9 GB at 1.2 B parameters: exporters.onnx.float32_view), and the outputs are computed before the
        # fusion and the checks load the export into ONNX Runtime
        with exported_in(module, self.request.precision) as exported:
            outputs = self.loaded.outputs if self.loaded.extra_outputs else self.loaded.output_name
            export_hf_onnx(exported, example, path, output_name=outputs, opset=self.request.opset)
            expected = hf_reference(exported, inputs, outputs)
        # ONNX Runtime's fused attention / skip-LayerNorm / GELU kernels, for the dense baseline and every
        # round alike: the speedup is measured between the fastest graphs of both (exporters.fusion)
        parity, fusion = fuse_checked(path, lambda graph: check_hf_outputs(graph, inputs, expected,
                                                                           tolerance=tolerance(self.request)),
                                      self.provider)
        if fusion.rejected:
            self.say(warning(f"{path.name} ships as exported, without ONNX Runtime's fused kernels: {fusion.fallback}"))
        return parity

    def _parity_inputs(self) -> dict[str, torch.Tensor]:
        """The first calibration batch, cut to the windows whose outputs stay within OUTPUT_VALUES."""
        batch = {k: self.batches[0][k] for k in self.loaded.input_names}
        return {k: v[:self._rows_within(batch)] for k, v in batch.items()}

    def _rows_within(self, batch: dict[str, torch.Tensor]) -> int:
        """How many windows of `batch` (token inputs) give at most OUTPUT_VALUES outputs (at least one); images'
        batches whole (a class or a patch per output row, not a vocabulary)."""
        ids = batch[self.loaded.input_names[0]]
        if ids.dim() != 2 or ids.is_floating_point():
            return len(ids)
        config = self.dense.config
        # a decoder's logits span the vocabulary; a classifier's are one row of labels a window
        width = getattr(config, "vocab_size", 0) if getattr(self, "causal", False) else 0
        width = max(width, getattr(config, "hidden_size", 0), 1)
        return max(1, min(len(ids), OUTPUT_VALUES // (ids.shape[1] * width)))

    export_decode_step = staticmethod(_no_decode_step)

    def save(self, module: nn.Module, out: Path) -> str:
        # config.json says the widths when every layer kept the same ones (transformers loads it alone);
        # otherwise osscar_widths.json beside it, for load_pruned
        # an earlier job's model/ in a reused --out: its serving files (sentence-transformers modules, its
        # tokenizer, remote code, onnx/) would describe this model as well as the files this job writes over
        if (out / "model").is_dir() and not (out / "model").is_symlink() and not self.request.reads(out / "model"):
            shutil.rmtree(out / "model")
        shutil.rmtree(out / "model" / ONNX_DIR, ignore_errors=True)
        (out / "model" / f"{REMOTE_MODULE}.py").unlink(missing_ok=True)
        save_standard(module, out / "model")
        self._write_tokenizer(out / "model")
        return "model/"

    def _write_tokenizer(self, target: Path) -> None:
        """The source's tokenizer files into `target` as they are, and what transformers writes of the tokenizer
        beside them where the source lacks it (a sentencepiece model's tokenizer.json). A tokenizer saved again alone
        dropped vocab.txt, tokenizer.model, merges.txt and special_tokens_map.json (what slow tokenizers and
        converters read) and added keys of this machine's loading (local_files_only) to tokenizer_config.json."""
        source = Path(str(self.request.model))
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and not ((target / name).exists() and (target / name).samefile(source / name)):
                shutil.copyfile(source / name, target / name)
        if self.loaded.tokenizer is None:
            return
        with tempfile.TemporaryDirectory() as saved:
            self.loaded.tokenizer.save_pretrained(saved)
            for written in Path(saved).iterdir():
                if written.is_file() and not (target / written.name).exists():
                    shutil.copyfile(written, target / written.name)

    def serving_files(self, out: Path) -> dict[str, Any] | None:
        return None

    def report_fields(self, module: nn.Module) -> KindFields:
        fit: RefineReport | None = getattr(module, "osscar_model_fit", None)
        return KindFields(widths=widths(module), gqa=self.request.gqa if dims(self.dense).group > 1 else None,
                          onnx_inputs=list(self.loaded.input_names),
                          onnx_output=self.loaded.output_name,
                          removed_layers=list(getattr(module, "osscar_removed_layers", [])), depth=self.depth,
                          model_reconstruction=None if fit is None else dataclasses.asdict(fit))


class TextJob(_TransformerJob):
    EVAL_SEQUENCES = 64  # evaluation windows (at most)
    traits = frozenset({TEXT, TRANSFORMER})
    planning_samples = PLANNING_SEQUENCES
    model_fit = True

    def __init__(self, request: CompressRequest, say: Say) -> None:
        super().__init__(request, say)
        self.causal = self.loaded.causal
        # an encoder with its sequence-classification head: scored by top-1 agreement with the dense model
        self.classifier = self.loaded.output_name == "logits" and not self.causal
        # a decoder's sequence classifier (a reranker, a reward model) scores each row at its last token whose id is
        # not config.pad_token_id (transformers' rule, which reads no attention mask): padding carries that id
        self.pad_id: int | None = None
        if self.classifier and adapter_for(self.dense).causal:
            self.pad_id = getattr(self.dense.config, "pad_token_id", None)
            if self.pad_id is None:
                raise ModelReferenceError(
                    f"{request.model}: {type(self.dense).__name__} scores each sequence at its last token that is not "
                    "the pad token, and config.json sets no pad_token_id: set it to the tokenizer's pad token id")
            vocabulary = self.dense.get_input_embeddings().num_embeddings
            if not 0 <= int(self.pad_id) < vocabulary:
                raise ModelReferenceError(f"{request.model}: config.json's pad_token_id {self.pad_id} is no token of "
                                          f"its {vocabulary}-token vocabulary: set the tokenizer's pad token id")
        self.draw = request.text_calibration(self.causal)
        limit = max_sequence(self.dense)
        if limit and self.draw.length > limit:  # a window past the position embeddings indexes out of their table
            say(warning(f"calibration windows of up to {self.draw.length} tokens exceed the {limit} positions the "
                        f"model's position embeddings take: windows are cut to {limit} tokens (--sequence-length)"))
            self.draw = dataclasses.replace(self.draw, length=limit, min_length=min(self.draw.min_length, limit))
        if limit and request.shape.get("sequence", 0) > limit:  # before the text is read
            raise InputError(f"--shape sequence={request.shape['sequence']} exceeds the {limit} positions the "
                             f"model's position embeddings take (max_position_embeddings "
                             f"{self.dense.config.max_position_embeddings})")
        text = {"tokenizer": self.loaded.tokenizer, "length": self.draw.length, "batch_size": 16}
        drawn = {**text, "min_length": self.draw.min_length}
        if request.eval is None:  # the text's end held out, unseen by the calibration (split_text)
            calibration, held, self.held_out = split_text(request.calibration, sequences=self.draw.sequences,
                                                          seed=request.seed, eval_sequences=self.EVAL_SEQUENCES,
                                                          **drawn)
        else:  # the user's texts as they are (up to the longest window), never cut shorter
            calibration = load_text(request.calibration, sequences=self.draw.sequences, seed=request.seed, **drawn)
            held, dropped = unseen_batches(load_text(request.eval, sequences=self.EVAL_SEQUENCES, seed=request.seed,
                                                     **text), calibration, batch_size=text["batch_size"])
            # the distinct tokens scored: no more than the file holds (windows are drawn with replacement), nor than
            # the windows kept hold (those dropped as seen take theirs with them)
            scored = sum(int(b["attention_mask"].sum()) for b in held)
            tokens = min(scored, count_tokens(request.eval, self.loaded.tokenizer)) if held else 0
            self.held_out = HeldOut("the --eval file", self.draw.sequences, sum(len(b["input_ids"]) for b in held),
                                    overlap_dropped=dropped, tokens=tokens)
        self.held_out.check(request.eval or request.calibration)
        vocabulary = self.dense.get_input_embeddings().num_embeddings
        for source in (request.calibration, request.eval):  # the windows drawn later too (`fit_pool`)
            if source is not None:
                check_id_file(source, vocabulary)
        check_token_ids(calibration, vocabulary, request.calibration)
        check_token_ids(held, vocabulary, request.eval or request.calibration)
        self.batches, self.eval_batches = self._typed(calibration), self._typed(held)
        self._pool: list[dict[str, torch.Tensor]] | None = None  # drawn for the first whole-model fit
        # a head of one output (a cross-encoder reranker's or a reward model's score) has no top-1 to agree on (its
        # argmax is always 0): its scores are compared over the samples, centred, by `cosine`
        scores = self.classifier and int(getattr(self.dense.config, "num_labels", 2) or 2) == 1
        self.metric = PERPLEXITY if self.causal else AGREEMENT if self.classifier and not scores else COSINE
        # an embedding model's cosine is of the embedding it serves: its sentence-transformers pooling
        self.pooling = "mean" if self.causal or self.classifier else \
            sentence_pooling(Path(str(request.model)).expanduser())
        if self.pooling != "mean":
            say(f"the cosine is of the {self.pooling} token pooling the model's sentence-transformers modules apply")
        default = {"batch": 1, "sequence": 512} if self.causal else {"batch": 8, "sequence": 128}
        if limit:
            default["sequence"] = min(default["sequence"], limit)
        self.shape = {**default, **request.shape}
        self.tokens = self.shape["sequence"]
        lengths = (f"{self.draw.min_length}-{self.draw.length}" if self.draw.min_length < self.draw.length
                   else f"<= {self.draw.length}")
        say(f"{request.model}: {type(self.dense).__name__}, {self.draw.sequences} calibration sequences of "
            f"{lengths} tokens, method {request.method}")

    def fit_pool(self) -> list[dict[str, torch.Tensor]]:
        """A decoder's fit of its next-token distributions steps through FIT_SEQUENCES windows in all: the calibration's
        and more drawn alike from the same text (a seed of their own; without any window that repeats an
        evaluation window). An encoder's fit of its hidden states keeps the calibration's (2,048 windows already,
        whose targets it holds)."""
        if self.model_target != "logits" or self.draw.sequences >= FIT_SEQUENCES:
            return []
        if self._pool is None:
            request = self.request
            drawn = more_windows(request.calibration, tokenizer=self.loaded.tokenizer,
                                 sequences=FIT_SEQUENCES - self.draw.sequences,
                                 length=self.draw.length, min_length=self.draw.min_length, seed=request.seed + 2,
                                 held_out=request.eval is None)
            self._pool = without_seen(self._typed(drawn), self.eval_batches)
        return self._pool

    def _typed(self, batches: list[dict]) -> list[dict]:
        if "token_type_ids" in self.loaded.input_names:
            batches = [{**b, "token_type_ids": torch.zeros_like(b["input_ids"])} for b in batches]
        if self.pad_id is not None:
            batches = [{**b, "input_ids": b["input_ids"].masked_fill(b["attention_mask"] == 0, self.pad_id)}
                       for b in batches]
        return batches

    def export_decode_step(self, module: nn.Module, path: Path) -> Parity:
        if not self.causal:
            return _no_decode_step(module, path)
        ids = self.batches[0]["input_ids"][:2, :8].clone()
        with exported_in(module, "fp32") as view:  # the decode step computes in float32 (a bf16 model upcast)
            export_decode_step(view, ids, path, opset=self.request.opset)

            def check(graph: Path) -> Parity:
                # a step of one token after a cache, and a prompt's prefill from an empty one: how generation runs
                step, prefill = check_decode_parity(view, graph, ids), check_decode_parity(view, graph, ids, new=8)
                return max(step, prefill, key=lambda parity: parity.max_abs_error)

            parity, fusion = fuse_checked(path, check, self.provider)
        shutil.rmtree(unfused_path(path).parent, ignore_errors=True)  # beside decode.onnx: nothing times it
        if fusion.rejected:
            self.say(warning(f"decode.onnx ships as exported, without ONNX Runtime's fused kernels: {fusion.fallback}"))
        if genai_type(module) is not None:  # ONNX Runtime GenAI generates from the job's directory as it is
            write_genai_config(module, path.parent, path.name)
            self._write_tokenizer(path.parent)
        else:
            self.say(f"decode.onnx: ONNX Runtime GenAI's configuration is written for {', '.join(sorted(GENAI_TYPES))} "
                     f"only (tested to generate PyTorch's greedy tokens), not {module.config.model_type}")
        return parity

    def latency_feed(self) -> dict[str, np.ndarray]:
        batch, seq = self.shape["batch"], self.shape["sequence"]
        vocab = int(getattr(self.dense.config, "vocab_size", 100))
        ids = np.random.default_rng(0).integers(3, vocab, size=(batch, seq), dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if "token_type_ids" in self.loaded.input_names:
            feed["token_type_ids"] = np.zeros_like(ids)
        return feed

    def outputs(self, path: Path) -> list:
        batches = [{k: v for k, v in b.items() if k in self.loaded.input_names} for b in self.eval_batches]
        reduce = "nll" if self.causal else "raw" if self.classifier else f"{self.pooling}_pool"
        if reduce == "nll":  # summed: slices of a batch score as the batch
            batches = [{k: v[i:i + rows] for k, v in b.items()} for b in batches
                       for rows in [self._rows_within(b)] for i in range(0, len(b["input_ids"]), rows)]
        return run_outputs(path, [{k: v.numpy() for k, v in b.items()} for b in batches], reduce=reduce)

    def secondary(self, outputs: list, reference: list) -> dict[str, float]:
        return {COSINE.name: cosine(outputs, reference)} if self.metric == AGREEMENT else {}

    def baseline_warnings(self, reference: list) -> list[str]:
        if self.metric != AGREEMENT:
            return []
        return _one_class_warnings(np.concatenate(reference), "windows", "calibrate on text of the model's task")

    def score(self, outputs: list, reference: list) -> float:
        if self.metric == PERPLEXITY:
            nll, count = sum(o[0] for o in outputs), sum(o[1] for o in outputs)
            return float(math.exp(min(nll / max(count, 1), 709.0)))  # a broken model's: huge, not an overflow
        if self.metric == AGREEMENT:  # logits (batch, classes) per evaluation batch
            return agreement(np.concatenate(outputs), np.concatenate(reference))
        return cosine(outputs, reference)

    def serving_files(self, out: Path) -> dict[str, Any] | None:
        if self.causal:  # generation reads decode.onnx and genai_config.json (export_decode_step)
            return None
        # an encoder as Optimum and sentence-transformers load it: model/ with the graph in model/onnx/
        model_dir = out / "model"
        onnx = link_onnx(out / "model.onnx", model_dir)
        sentence = False
        try:
            if not self.classifier:
                sentence = copy_sentence_files(Path(str(self.request.model)).expanduser(), model_dir,
                                               dims(self.dense).hidden)
        except LayoutError as err:
            self.say(warning(f"model/ is not a sentence-transformers model: {err}"))
        optimum = "ORTModelForSequenceClassification" if self.classifier else "ORTModelForFeatureExtraction"
        return {"onnx": onnx.relative_to(out).as_posix(), "optimum": optimum, "sentence_transformers": sentence,
                "trust_remote_code": (model_dir / f"{REMOTE_MODULE}.py").is_file()}

    def preprocessing(self) -> dict:
        return {"inputs": list(self.loaded.input_names), "tokenizer": "the model's (saved in model/)"
                if self.loaded.tokenizer is not None else None}

    def report_fields(self, module: nn.Module) -> KindFields:
        return dataclasses.replace(super().report_fields(module), sequences=self.draw.sequences,
                                   sequence_length=self.draw.length, min_sequence_length=self.draw.min_length)


def image_tokens(model: nn.Module, size: int | None = None) -> int:
    """Tokens a vision transformer's blocks see per image of side `size` (default: its config's): the patches and the
    tokens beside them ([CLS], DeiT's distillation token), as the position embeddings count them at the config's size
    (a parameter, or CLIP's and SigLIP's table), plus register tokens (DINOv2's and DINOv3's, outside the position
    embeddings); at another size (DINOv2 interpolates its positions) or without position embeddings (DINOv3's rotary,
    Swin's first stage) the patches and a [CLS] where there is one."""
    config = model.config
    embeddings = next((m for name, m in model.named_modules() if name.rpartition(".")[2] == "embeddings"), None)
    positions, table = getattr(embeddings, "position_embeddings", None), getattr(embeddings, "position_embedding", None)
    if size not in (None, int(config.image_size)):
        positions = table = None
    if isinstance(positions, torch.Tensor):
        tokens = int(positions.shape[1])  # (1, tokens, hidden)
    elif isinstance(table, nn.Embedding):
        tokens = table.num_embeddings
    else:
        classes = any(getattr(embeddings, name, None) is not None for name in ("cls_token", "class_embedding"))
        tokens = ((size or int(config.image_size)) // int(config.patch_size)) ** 2 + int(classes)
    return tokens + int(getattr(config, "num_register_tokens", 0) or 0)


def served_image_size(model: nn.Module, directory: Path) -> int:
    """The side of the images a vision transformer is calibrated, costed and exported at: its config's image_size,
    or for a family that takes any size (`FamilyAdapter.any_image_size`) the square its preprocessor_config.json crops
    to (DINOv2's 224, where its config says 518), where it says one."""
    size = int(model.config.image_size)
    path = Path(directory) / "preprocessor_config.json"
    if not adapter_for(model).any_image_size or not path.is_file():
        return size
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return size
    crop = config.get("crop_size") if config.get("do_center_crop", True) else None
    crop = crop if crop is not None else config.get("size")
    sides = {crop.get("height"), crop.get("width")} if isinstance(crop, dict) else {crop}
    if len(sides) != 1 or not isinstance(side := sides.pop(), int) or isinstance(side, bool) or side <= 0:
        return size  # a shortest edge without a crop, a rectangle: the config's square
    return side


class ImageTransformerJob(_TransformerJob):
    """A vision transformer (ViT, DeiT, Swin, DINOv2 / v3, CLIP's or SigLIP's vision tower): calibration images (as
    for CNNs) through the transformer pipeline. An image classifier (its head kept) is scored by top-1 on labelled
    --eval images, else by top-1 agreement with the dense model; a bare model by the cosine of the embedding it serves
    to the dense model's: its pooled output (CLIP's, SigLIP's: `FamilyAdapter.pooled_output`), else its mean-pooled
    last hidden state."""

    EVAL_SAMPLES = 64

    def __init__(self, request: CompressRequest, say: Say) -> None:
        super().__init__(request, say)
        self.traits = _image_traits(request, TRANSFORMER)
        config = self.dense.config
        size, channels = served_image_size(self.dense, Path(str(request.model)).expanduser()), int(config.num_channels)
        self.classifier = self.loaded.output_name == "logits"
        self.images, self.eval_x, self.eval_y, self.held_out = _images_and_held_out(request, self.EVAL_SAMPLES,
                                                                                    labels=self.classifier)
        side = self.images.shape[-1]
        if adapter_for(self.dense).any_image_size and self.images.shape[-2] == side and \
                side % int(config.patch_size) == 0:
            size = side  # a model that takes any size: the images' own, a square of whole patches
        if size != int(config.image_size):
            say(f"images of {size} x {size} (config.json's image_size: {config.image_size}; the model takes any "
                f"size of whole {config.patch_size}-pixel patches)")
        self.input_shape = (channels, size, size)
        _check_image_shapes(self.images, self.eval_x, self.input_shape, request)
        for text in _image_value_warnings(self.images, request):
            say(warning(text))
        self.held_out.check(request.eval or request.calibration)
        batch = min(request.batch_size, 32)  # a ViT's activations are (images x tokens x hidden) per block
        self.batches = [{"pixel_values": x} for x in self.images.split(batch)]
        self.metric = _image_metric(self.eval_y, int(config.num_labels) if self.classifier else None,
                                    request.eval or request.calibration)
        self.shape = {"batch": request.shape.get("batch", 8)}
        self.tokens = image_tokens(self.dense, size)
        say(f"{request.model}: {type(self.dense).__name__}, {len(self.images)} calibration images, method "
            f"{request.method}")

    def latency_feed(self) -> dict[str, np.ndarray]:
        return {"pixel_values": _repeat_to(self.images, self.shape["batch"])}

    def outputs(self, path: Path) -> list:
        return run_outputs(path, [{"pixel_values": b.numpy()} for b in self.eval_x.split(32)],
                           reduce="mean_pool" if self.loaded.output_name == "last_hidden_state" else "raw")

    # its outputs come a batch at a time: scored as the conv graph's, one array of them
    def score(self, outputs: list, reference: list) -> float:
        return _image_score(self.metric, np.concatenate(outputs), np.concatenate(reference), self.eval_y)

    def secondary(self, outputs: list, reference: list) -> dict[str, float]:
        return _image_secondary(self.metric, np.concatenate(outputs), np.concatenate(reference))

    def baseline_warnings(self, reference: list) -> list[str]:
        return _image_warnings(self.metric, np.concatenate(reference), self.eval_y)

    def serving_files(self, out: Path) -> dict[str, Any] | None:
        if not self.classifier:
            return None
        # an image classifier as Optimum loads it: model/ (its config's labels) with the graph in model/onnx/ and
        # the preprocessing beside it
        model_dir = out / "model"
        onnx = link_onnx(out / "model.onnx", model_dir)
        # the preprocessing; the pruned model's own config.json (its labels, and its widths) is there already
        preprocessor = Path(str(self.request.model)).expanduser() / "preprocessor_config.json"
        if preprocessor.is_file():
            shutil.copyfile(preprocessor, model_dir / preprocessor.name)
        return {"onnx": onnx.relative_to(out).as_posix(), "optimum": "ORTModelForImageClassification",
                "trust_remote_code": (model_dir / f"{REMOTE_MODULE}.py").is_file()}

    def preprocessing(self) -> dict:
        return _image_preprocessing(self.request, "pixel_values", self.input_shape)

    def report_fields(self, module: nn.Module) -> KindFields:
        return dataclasses.replace(super().report_fields(module), samples=len(self.images))
