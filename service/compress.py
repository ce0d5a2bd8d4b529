"""The compression job: resolve -> calibrate -> prune layer by layer -> save -> export -> check.

`compress()` is what `osscar compress` runs, importable for pipelines that script it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from compressor.calibration import IMAGENET_MEAN, IMAGENET_STD, CalibrationError, load_images, load_text
from compressor.cnn import prune_conv_graph
from compressor.graph import analyse
from compressor.models import is_transformer_reference, load_model, load_transformer, save_program
from compressor.offload import StreamedCheckpoint
from compressor.solve import METHODS
from compressor.surgery import count_parameters
from compressor.transformer_pipeline import prune_blocks, prune_transformer
from compressor.transformer_surgery import load_pruned, save_pruned, widths
from exporters.onnx import check_hf_parity, check_parity, export_hf_onnx, export_onnx

log = logging.getLogger(__name__)

PRUNING_METHODS = ("osscar", "mp", "mp+", "thinet")  # "exact" only solves single small layers


@dataclass(frozen=True)
class CompressRequest:
    model: str  # .pt2 file, HF model directory / cached hub id, or torchvision:<name>
    uniform_ratio: float  # fraction of each prunable layer's groups removed (>= 1 group kept)
    calibration: Path  # .npz (x: uint8 NHWC) or .npy (float32 NCHW)
    out_dir: Path
    method: str = "osscar"
    samples: int = 500  # calibration images drawn (seeded)
    seed: int = 0
    mean: tuple[float, ...] = IMAGENET_MEAN  # applied to .npz images after scaling to [0, 1]
    std: tuple[float, ...] = IMAGENET_STD
    device: str | None = None  # default: cuda when available, else cpu
    batch_size: int = 100
    sequences: int = 128  # text calibration: windows drawn (seeded)
    sequence_length: int = 128  # text calibration: tokens per window
    stream: bool = False  # transformers: read blocks one at a time from the safetensors shards (bounded memory)
    activation_dtype: str = "float32"  # transformers: dtype of the calibration activations kept on the CPU

    def validate(self) -> None:
        errors = []
        if self.method not in PRUNING_METHODS:
            errors.append(f"method must be one of {', '.join(PRUNING_METHODS)} (got {self.method!r})")
        assert set(PRUNING_METHODS) <= set(METHODS)
        if not 0 < self.uniform_ratio < 1:
            errors.append(f"--uniform-ratio must be in (0, 1) (got {self.uniform_ratio})")
        if self.samples < 1:
            errors.append(f"--samples must be >= 1 (got {self.samples})")
        if self.batch_size < 1:
            errors.append(f"--batch-size must be >= 1 (got {self.batch_size})")
        if self.sequences < 1 or self.sequence_length < 2:
            errors.append(f"--sequences must be >= 1 and --sequence-length >= 2 (got {self.sequences}, "
                          f"{self.sequence_length})")
        if self.activation_dtype not in ("float32", "float16"):
            errors.append(f"--activation-dtype must be float32 or float16 (got {self.activation_dtype!r})")
        if errors:
            raise ValueError("; ".join(errors))


def _write_json_atomically(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def compress(request: CompressRequest, progress: Callable[[str], None] | None = None) -> dict:
    """Run the job; writes model.onnx, model.pt2 and report.json into request.out_dir."""
    request.validate()
    say = progress or (lambda message: log.info("%s", message))
    if is_transformer_reference(request.model):
        return _compress_transformer(request, say)
    start = time.perf_counter()
    loaded = load_model(request.model)
    images = load_images(request.calibration, samples=request.samples, seed=request.seed,
                         mean=request.mean, std=request.std)
    if tuple(images.shape[1:]) != loaded.input_shape:
        raise CalibrationError(f"calibration images have shape {tuple(images.shape[1:])}, the model expects "
                               f"{loaded.input_shape}")
    analysis = analyse(loaded.module)
    say(f"{request.model}: {len(analysis.units)} prunable conv layers, {len(images)} calibration images, "
        f"method {request.method}, ratio {request.uniform_ratio}")
    pruned, layers = prune_conv_graph(loaded.module, images, request.uniform_ratio, method=request.method,
                                      device=request.device, batch_size=request.batch_size, progress=say)
    out = Path(request.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    example = images[:2].clone()  # a view would save the whole calibration tensor
    say("saving model.pt2 and exporting model.onnx")
    save_program(pruned, out / "model.pt2", example)
    export_onnx(pruned, example, out / "model.onnx", input_name=loaded.input_name)
    parity = check_parity(pruned, out / "model.onnx", images[: min(16, len(images))])
    return _write_report(request, out, start, loaded.module, pruned, layers, say, artifacts="model.pt2", extra={
        "samples": len(images),
        "not_pruned": analysis.refused,
        "onnx": {"path": "model.onnx", "input": loaded.input_name, "output": "logits",
                 "parity_max_abs_error": parity},
    })


def _compress_transformer(request: CompressRequest, say: Callable[[str], None]) -> dict:
    """Heads and FFN neurons of a HF transformer: pruned HF directory (+ width manifest) and ONNX."""
    start = time.perf_counter()
    loaded = load_transformer(request.model, weights=not request.stream)
    batches = load_text(request.calibration, tokenizer=loaded.tokenizer, sequences=request.sequences,
                        length=request.sequence_length, seed=request.seed, batch_size=16)
    if "token_type_ids" in loaded.input_names:
        batches = [{**b, "token_type_ids": torch.zeros_like(b["input_ids"])} for b in batches]
    say(f"{request.model}: {type(loaded.model).__name__}, {request.sequences} calibration sequences of <= "
        f"{request.sequence_length} tokens, method {request.method}, ratio {request.uniform_ratio}")
    options = {"method": request.method, "device": request.device, "progress": say,
               "activation_dtype": getattr(torch, request.activation_dtype)}
    out = Path(request.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if request.stream:  # blocks from the shards, written back pruned into model/
        checkpoint = StreamedCheckpoint(request.model, out / "model")
        layers = prune_blocks(checkpoint, batches, request.uniform_ratio, **options)
        checkpoint.finish()
        pruned = load_pruned(out / "model")
        say("exporting model.onnx")
    else:
        pruned, layers = prune_transformer(loaded.model, batches, request.uniform_ratio, **options)
        pruned = pruned.cpu().eval()
        say("saving the pruned model (model/) and exporting model.onnx")
        save_pruned(pruned, out / "model")
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(out / "model")
    example = {name: batches[0][name][:2].clone() for name in loaded.input_names}
    export_hf_onnx(pruned, example, out / "model.onnx", output_name=loaded.output_name)
    parity = check_hf_parity(pruned, out / "model.onnx", {k: batches[0][k] for k in loaded.input_names},
                               loaded.output_name)
    return _write_report(request, out, start, loaded.model, pruned, layers, say, artifacts="model/", extra={
        "sequences": request.sequences,
        "sequence_length": request.sequence_length,
        "widths": widths(pruned),
        "onnx": {"path": "model.onnx", "inputs": list(loaded.input_names), "output": loaded.output_name,
                 "parity_max_abs_error": parity},
    })


def _write_report(request: CompressRequest, out: Path, start: float, dense: torch.nn.Module,
                  pruned: torch.nn.Module, layers: list, say: Callable[[str], None], *, artifacts: str,
                  extra: dict) -> dict:
    """report.json: the fields every job reports, then the model kind's own (`extra`)."""
    report = {
        "model": request.model,
        "method": request.method,
        "uniform_ratio": request.uniform_ratio,
        "calibration": str(request.calibration),
        "seed": request.seed,
        "params_before": count_parameters(dense),
        "params_after": count_parameters(pruned),
        "layers": [asdict(layer) for layer in layers],
        **extra,
        "elapsed_s": time.perf_counter() - start,
    }
    _write_json_atomically(out / "report.json", report)
    say(f"params {report['params_before']} -> {report['params_after']}; wrote {out}/model.onnx, {artifacts}, "
        f"report.json in {report['elapsed_s']:.1f}s")
    return report
