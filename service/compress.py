"""The compression job: resolve -> calibrate -> (curves -> allocate) -> prune -> export -> measure ->
adjust, and the report.

`compress()` is what `osscar compress` runs, importable for pipelines that script it. Two modes:
`uniform_ratio` (the paper's protocol: that fraction of every layer, one round) and `target_speedup`
(widths per layer from the dense model's loss-versus-width curves and a latency model, then a closed
loop: prune, export, measure the speedup in ONNX Runtime, correct the latency model, retry).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compressor.allocation import LayerCurve, allocate, allowed_widths, loss_path, total_cost
from compressor.calibration import IMAGENET_MEAN, IMAGENET_STD, load_images, load_text
from compressor.cnn.graph import analyse
from compressor.cnn.models import load_model, save_program
from compressor.cnn.pipeline import prune_conv_graph
from compressor.errors import CalibrationError
from compressor.layerstats import LayerObservation
from compressor.modules import count_parameters
from compressor.solver.solve import METHODS
from compressor.transformer.models import is_transformer_reference, load_transformer
from compressor.transformer.offload import StreamedCheckpoint
from compressor.transformer.pipeline import prune_blocks, prune_transformer
from compressor.transformer.surgery import load_pruned, save_pruned, widths
from exporters.onnx import (
    Float16,
    check_decode_parity,
    check_hf_parity,
    check_parity,
    export_decode_step,
    export_hf_onnx,
    export_onnx,
    stamp_metadata,
)
from exporters.runtime import PROVIDERS, Latency, default_provider, device_name, measure_latency, run_outputs

from .files import file_sha256, write_text_atomically
from .report_html import write_html

log = logging.getLogger(__name__)

PRUNING_METHODS = ("osscar", "mp", "mp+", "thinet")  # "exact" only solves single small layers
MET = 0.98  # a measured speedup >= 0.98 x target counts as met (measurement noise)
AIM = 1.10  # and the loop aims at <= 1.10 x target
MAX_MEASURED_ELEMENTS = 1 << 22  # batch x sequence of the measured shape (4M tokens)


@dataclass(frozen=True)
class CompressRequest:
    model: str  # .pt2 file, HF model directory / cached hub id, or torchvision:<name>
    calibration: Path  # images: .npz (x uint8 NHWC) / .npy (NCHW); text: .txt/.jsonl/.npz/.npy
    out_dir: Path
    uniform_ratio: float | None = None  # fraction of each prunable layer's groups removed
    target_speedup: float | None = None  # measured speedup to reach instead
    widths_from: Path | None = None  # or the per-layer widths of an earlier report.json (e.g. another method's)
    eval: Path | None = None  # evaluation data (images .npz with labels y -> top-1; token ids -> perplexity)
    method: str = "osscar"
    samples: int = 500  # calibration images drawn (seeded)
    seed: int = 0
    mean: tuple[float, ...] = IMAGENET_MEAN  # applied to .npz images after scaling to [0, 1]
    std: tuple[float, ...] = IMAGENET_STD
    device: str | None = None  # pruning device; default: cuda when available, else cpu
    batch_size: int = 100
    sequences: int = 128  # text calibration: windows drawn (seeded)
    sequence_length: int = 128  # text calibration: tokens per window
    stream: bool = False  # transformers: blocks read one at a time from the safetensors shards
    activation_dtype: str = "float32"  # transformers: calibration activations kept on the CPU
    shape: dict[str, int] = field(default_factory=dict)  # measured shape: batch (+ sequence for text)
    execution_provider: str | None = None  # cpu | cuda; default: cuda when ONNX Runtime has it
    threads: int | None = None  # ONNX Runtime intra-op threads (default: the cores available)
    deployment_target: str | None = None  # the provider it will be served on; warns when it differs
    round_to: int = 8  # target mode: kept widths are multiples of this (or the full width)
    min_width: float = 0.1  # target mode: no layer keeps less than this fraction of its groups
    max_rounds: int = 4  # target mode: prune -> measure rounds at most
    accuracy_budget: float | None = None  # max relative drop of the metric
    back_off: bool = False  # on a blown budget, return the largest measured speedup that meets it
    repeats: int = 20  # latency runs per model
    opset: int = 18  # ONNX opset of the exports
    precision: str = "fp32"  # exports (dense baseline and compressed alike) compute in fp32 or fp16
    decode_step: bool = False  # causal LMs: also export decode.onnx (one token with past key/values)
    normalise: str = "stream"  # target mode: layer losses relative to the residual stream, or the layer's output
    trust_remote_code: bool = False  # run a HF model's own code (the server grants it per model directory)
    # target mode: where dense loss curves are cached (None: not cached)
    curves_cache: Path | None = field(default_factory=lambda: default_home() / "curves")

    def violations(self) -> list[tuple[str, str]]:
        """Every problem with the request as (field, message); the messages name the CLI flags."""
        errors: list[tuple[str, str]] = []

        def check(ok: bool, field: str, message: str) -> None:
            if not ok:
                errors.append((field, message))

        assert set(PRUNING_METHODS) <= set(METHODS)
        check(self.method in PRUNING_METHODS, "method",
              f"method must be one of {', '.join(PRUNING_METHODS)} (got {self.method!r})")
        check(sum(x is not None for x in (self.uniform_ratio, self.target_speedup, self.widths_from)) == 1,
              "target_speedup", "give exactly one of --target-speedup, --uniform-ratio and --widths-from")
        check(self.widths_from is None or _is_file(self.widths_from), "widths_from",
              f"--widths-from: no such report: {self.widths_from}")
        check(self.uniform_ratio is None or 0 < self.uniform_ratio < 1, "uniform_ratio",
              f"--uniform-ratio must be in (0, 1) (got {self.uniform_ratio})")
        check(self.target_speedup is None or (math.isfinite(self.target_speedup) and 1 < self.target_speedup <= 20),
              "target_speedup", f"--target-speedup must be in (1, 20] (got {self.target_speedup})")
        check(1 <= self.samples <= 1_000_000, "samples", f"--samples must be in [1, 1000000] (got {self.samples})")
        check(1 <= self.batch_size <= 100_000, "batch_size", f"--batch-size must be in [1, 100000] (got "
              f"{self.batch_size})")
        check(1 <= self.sequences <= 1_000_000, "sequences", f"--sequences must be in [1, 1000000] (got "
              f"{self.sequences})")
        check(2 <= self.sequence_length <= 65536, "sequence_length", f"--sequence-length must be in [2, 65536] "
              f"(got {self.sequence_length})")
        check(-2**63 <= self.seed < 2**63, "seed", f"--seed must fit in 64 bits (got {self.seed})")
        check(self.activation_dtype in ("float32", "float16"), "activation_dtype",
              f"--activation-dtype must be float32 or float16 (got {self.activation_dtype!r})")
        bad = {k: v for k, v in self.shape.items() if k not in ("batch", "sequence") or not 1 <= v <= 65536}
        check(not bad, "shape", f"--shape takes batch=N and sequence=N with 1 <= N <= 65536 (got {bad})")
        tokens = self.shape.get("batch", 1) * self.shape.get("sequence", 1)
        check(bool(bad) or tokens <= MAX_MEASURED_ELEMENTS, "shape", f"--shape batch x sequence must be at most "
              f"{MAX_MEASURED_ELEMENTS} (got {tokens})")
        for field_name, value in (("execution_provider", self.execution_provider),
                                  ("deployment_target", self.deployment_target)):
            check(value is None or value in PROVIDERS, field_name,
                  f"--{field_name.replace('_', '-')} must be one of {', '.join(PROVIDERS)} (got {value!r})")
        check(self.threads is None or 1 <= self.threads <= 1024, "threads",
              f"--threads must be in [1, 1024] (got {self.threads})")
        check(1 <= self.round_to <= 4096, "round_to", f"--round-to must be in [1, 4096] (got {self.round_to})")
        check(0 < self.min_width <= 1, "min_width", f"--min-width must be in (0, 1] (got {self.min_width})")
        check(1 <= self.max_rounds <= 20, "max_rounds", f"--max-rounds must be in [1, 20] (got {self.max_rounds})")
        check(self.accuracy_budget is None or 0 < self.accuracy_budget < 1, "accuracy_budget",
              f"--accuracy-budget must be in (0, 1) (got {self.accuracy_budget})")
        check(not self.back_off or self.accuracy_budget is not None, "back_off", "--back-off needs --accuracy-budget")
        check(14 <= self.opset <= 23, "opset", f"--opset must be in [14, 23] (got {self.opset})")
        check(self.precision in ("fp32", "fp16"), "precision",
              f"--precision must be fp32 or fp16 (got {self.precision!r})")
        check(not (self.decode_step and self.precision != "fp32"), "decode_step",
              "--decode-step is exported in fp32 only")
        check(self.normalise in ("stream", "layer"), "normalise",
              f"normalise must be 'stream' or 'layer' (got {self.normalise!r})")
        check(3 <= self.repeats <= 10_000, "repeats", f"--repeats must be in [3, 10000] (got {self.repeats})")
        finite = all(math.isfinite(v) for v in (*self.mean, *self.std))
        check(len(self.mean) <= 16 and len(self.mean) == len(self.std) and finite and all(v > 0 for v in self.std),
              "std",
              "--mean and --std need the same number (at most 16) of finite values, std > 0")
        return errors

    def validate(self) -> None:
        errors = self.violations()
        if errors:
            raise ValueError("; ".join(message for _, message in errors))


def _is_file(path: str | Path) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte
        return False


def default_home() -> Path:
    """$OSSCAR_HOME, else ~/.osscar: caches and (later) the service's data."""
    return Path(os.environ.get("OSSCAR_HOME") or Path.home() / ".osscar")


def _write_json_atomically(path: Path, data: dict | list) -> None:
    write_text_atomically(path, json.dumps(data, indent=2))


# ---- what differs between conv graphs and transformers ---------------------------------------------


@dataclass
class Metric:
    name: str  # top1 | perplexity | cosine
    higher_is_better: bool


class _ConvJob:
    kind = "conv"

    def __init__(self, request: CompressRequest, say: Callable[[str], None]) -> None:
        self.request, self.say = request, say
        self.loaded = load_model(request.model, trust_remote_code=request.trust_remote_code)
        self.images = load_images(request.calibration, samples=request.samples, seed=request.seed,
                                  mean=request.mean, std=request.std)
        if tuple(self.images.shape[1:]) != self.loaded.input_shape:
            raise CalibrationError(f"calibration images have shape {tuple(self.images.shape[1:])}, the model "
                                   f"expects {self.loaded.input_shape}")
        self.analysis = analyse(self.loaded.module)
        self.dense = self.loaded.module
        self.params_before = count_parameters(self.dense)
        self.shape = {"batch": request.shape.get("batch", 64)}
        if request.eval is not None:
            self.eval_x = load_images(request.eval, samples=10**9, mean=request.mean, std=request.std)
            with np.load(request.eval, allow_pickle=False) as data:
                if "y" not in data:
                    raise CalibrationError(f"{request.eval}: evaluation images need labels 'y' for top-1")
                self.eval_y = data["y"]
            self.metric = Metric("top1", True)
        else:  # no labels: agreement with the dense model on held-out calibration-like images
            self.eval_x = load_images(request.calibration, samples=256, seed=request.seed + 1,
                                      mean=request.mean, std=request.std)
            self.eval_y = None
            self.metric = Metric("cosine", True)
        self.say(f"{request.model}: {len(self.analysis.units)} prunable conv layers, {len(self.images)} "
                 f"calibration images, method {request.method}")

    def prune(self, plan, observe=None):
        return prune_conv_graph(self.dense, self.images, plan, method=self.request.method, device=self.request.device,
                                batch_size=self.request.batch_size, progress=self.say, observe=observe)

    def export_decode_step(self, module, path: Path) -> float:
        raise ValueError("--decode-step is for causal language models")

    def export(self, module, path: Path) -> float:
        example = self.images[:2].clone()  # a view would save the whole calibration tensor
        module = Float16(module) if self.request.precision == "fp16" else module
        export_onnx(module, example, path, input_name=self.loaded.input_name, opset=self.request.opset)
        return check_parity(module, path, self.images[: min(16, len(self.images))], **_tolerance(self.request))

    def latency_feed(self) -> dict[str, np.ndarray]:
        x = self.images[: self.shape["batch"]]
        reps = math.ceil(self.shape["batch"] / len(x))
        return {self.loaded.input_name: x.repeat(reps, 1, 1, 1)[: self.shape["batch"]].numpy()}

    def outputs(self, path: Path) -> np.ndarray:
        batches = [[b.numpy()] for b in self.eval_x.split(256)]
        return np.concatenate(run_outputs(path, batches, reduce="raw"))

    def save(self, module, out: Path) -> str:
        save_program(module, out / "model.pt2", self.images[:2].clone())
        return "model.pt2"

    def extra(self) -> dict:
        return {"samples": len(self.images), "not_pruned": self.analysis.refused}

    def preprocessing(self) -> dict:
        return {"input": self.loaded.input_name, "layout": "NCHW float32", "shape": list(self.loaded.input_shape),
                "npz_images": "uint8 NHWC / 255, then (x - mean) / std", "mean": list(self.request.mean),
                "std": list(self.request.std)}


class _TextJob:
    kind = "transformer"

    def __init__(self, request: CompressRequest, say: Callable[[str], None]) -> None:
        self.request, self.say = request, say
        self.loaded = load_transformer(request.model, trust_remote_code=request.trust_remote_code)
        self.dense = self.loaded.model
        self.params_before = count_parameters(self.dense)
        self.causal = self.loaded.output_name == "logits"
        text = {"tokenizer": self.loaded.tokenizer, "length": request.sequence_length, "batch_size": 16}
        self.batches = self._typed(load_text(request.calibration, sequences=request.sequences, seed=request.seed,
                                             **text))
        if request.eval is not None:
            self.eval_batches = self._typed(load_text(request.eval, sequences=64, seed=request.seed, **text))
        else:  # held-out windows of the calibration data (another seed)
            self.eval_batches = self._typed(load_text(request.calibration, sequences=64, seed=request.seed + 1,
                                                      **text))
        self.metric = Metric("perplexity", False) if self.causal else Metric("cosine", True)
        default = {"batch": 1, "sequence": 512} if self.causal else {"batch": 8, "sequence": 128}
        limit = int(getattr(self.dense.config, "max_position_embeddings", 0) or 0)
        if limit:
            default["sequence"] = min(default["sequence"], limit)
            if request.shape.get("sequence", 0) > limit:
                raise ValueError(f"--shape sequence={request.shape['sequence']} exceeds the model's "
                                 f"max_position_embeddings ({limit})")
        self.shape = {**default, **request.shape}
        self.say(f"{request.model}: {type(self.dense).__name__}, {request.sequences} calibration sequences of <= "
                 f"{request.sequence_length} tokens, method {request.method}")

    def _typed(self, batches: list[dict]) -> list[dict]:
        if "token_type_ids" in self.loaded.input_names:
            batches = [{**b, "token_type_ids": torch.zeros_like(b["input_ids"])} for b in batches]
        return batches

    def prune(self, plan, observe=None):
        request = self.request
        options = {"method": request.method, "device": request.device, "progress": self.say, "observe": observe,
                   "activation_dtype": getattr(torch, request.activation_dtype),
                   "cost_sequence_length": self.shape["sequence"]}
        if request.stream:
            work = Path(tempfile.mkdtemp(prefix="osscar-stream-"))
            checkpoint = StreamedCheckpoint(request.model, work / "model")
            layers = prune_blocks(checkpoint, self.batches, plan, **options)
            checkpoint.finish()
            pruned = load_pruned(work / "model")
            shutil.rmtree(work, ignore_errors=True)
            return pruned, layers
        pruned, layers = prune_transformer(self.dense, self.batches, plan, **options)
        return pruned.cpu().eval(), layers

    def export(self, module, path: Path) -> float:
        names = self.loaded.input_names
        example = {name: self.batches[0][name][:2].clone() for name in names}
        module = Float16(module) if self.request.precision == "fp16" else module
        export_hf_onnx(module, example, path, output_name=self.loaded.output_name, opset=self.request.opset)
        return check_hf_parity(module, path, {k: self.batches[0][k] for k in names}, self.loaded.output_name,
                               **_tolerance(self.request))

    def export_decode_step(self, module, path: Path) -> float:
        ids = self.batches[0]["input_ids"][:2, :8].clone()
        export_decode_step(module, ids, path, opset=self.request.opset)
        return check_decode_parity(module, path, ids)

    def latency_feed(self) -> dict[str, np.ndarray]:
        batch, seq = self.shape["batch"], self.shape["sequence"]
        vocab = int(getattr(self.dense.config, "vocab_size", 100))
        ids = np.random.default_rng(0).integers(3, vocab, size=(batch, seq), dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if "token_type_ids" in self.loaded.input_names:
            feed["token_type_ids"] = np.zeros_like(ids)
        return feed

    def outputs(self, path: Path):
        batches = [{k: v.numpy() for k, v in b.items() if k in self.loaded.input_names} for b in self.eval_batches]
        return run_outputs(path, batches, reduce="nll" if self.causal else "mean_pool")

    def save(self, module, out: Path) -> str:
        save_pruned(module, out / "model")
        if self.loaded.tokenizer is not None:
            self.loaded.tokenizer.save_pretrained(out / "model")
        return "model/"

    def preprocessing(self) -> dict:
        return {"inputs": list(self.loaded.input_names), "tokenizer": "the model's (saved in model/)"
                if self.loaded.tokenizer is not None else None}

    def extra(self) -> dict:
        return {"sequences": self.request.sequences, "sequence_length": self.request.sequence_length,
                "onnx_inputs": list(self.loaded.input_names), "onnx_output": self.loaded.output_name}


def _tolerance(request: CompressRequest) -> dict[str, float]:
    """Parity tolerance of an export against the PyTorch module it came from (half precision rounds
    differently in ONNX Runtime's kernels)."""
    return {"rtol": 2e-2, "atol": 2e-2} if request.precision == "fp16" else {"rtol": 1e-4, "atol": 1e-4}


def _score(job, outputs, reference) -> float:
    """The metric of one model's evaluation outputs (`reference`: the dense model's, for cosine)."""
    name = job.metric.name
    if name == "top1":
        return float((outputs.argmax(1) == job.eval_y).mean())
    if name == "perplexity":
        nll, count = sum(o[0] for o in outputs), sum(o[1] for o in outputs)
        return float(math.exp(nll / max(count, 1)))
    a = np.concatenate([np.asarray(o).reshape(len(o), -1) for o in outputs]) if isinstance(outputs, list) \
        else outputs.reshape(len(outputs), -1)
    b = np.concatenate([np.asarray(o).reshape(len(o), -1) for o in reference]) if isinstance(reference, list) \
        else reference.reshape(len(reference), -1)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return float(cos.mean())


def _drop(metric: Metric, baseline: float, value: float) -> float:
    """Relative degradation (>= 0 is worse)."""
    if baseline == 0:
        return 0.0
    return (baseline - value) / abs(baseline) if metric.higher_is_better else (value - baseline) / abs(baseline)


# ---- the job ------------------------------------------------------------------------------------------


@dataclass
class _Round:
    plan: Any  # ratio or {layer: kept width}
    module: Any
    layers: list
    onnx: Path
    parity: float
    latency: Latency
    metric: float
    predicted_saving: float | None = None


def compress(request: CompressRequest, progress: Callable[[str], None] | None = None,
             stage: Callable[[str, int], None] | None = None) -> dict:
    """Run the job; writes model.onnx, the pruned model, report.json and report.html into request.out_dir.
    Returns the report; its `status` says whether the target and the accuracy budget were met.

    `progress` receives every progress line; `stage(name, round)` each stage as it begins: loading,
    baseline, statistics, allocate, prune, measure, save (round: the prune-measure round, else 0)."""
    request.validate()
    say = progress or (lambda message: log.info("%s", message))
    enter = stage or (lambda name, index: None)
    start = time.perf_counter()
    enter("loading", 0)
    job = _TextJob(request, say) if is_transformer_reference(request.model) else _ConvJob(request, say)
    if request.decode_step and not getattr(job, "causal", False):
        raise ValueError("--decode-step is for causal language models")
    provider = request.execution_provider or default_provider()
    if request.deployment_target and request.deployment_target != provider:
        say(f"WARNING: measuring on {provider}, but the declared deployment target is {request.deployment_target}; "
            "the speedup may not transfer")
    out = Path(request.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".osscar-work-", dir=out))
    try:
        enter("baseline", 0)
        say("exporting the dense model for the baseline")
        dense_onnx = work / "dense.onnx"
        job.export(job.dense, dense_onnx)
        reference = job.outputs(dense_onnx)
        baseline_metric = _score(job, reference, reference)
        feed = job.latency_feed()

        def run_round(plan, index: int, predicted: float | None = None) -> _Round:
            enter("prune", index)
            module, layers = job.prune(plan)
            enter("measure", index)
            # one folder per round: the file keeps its final name, so the external data it references over
            # 2 GB (model.onnx.data) stays valid when moved
            path = work / f"round{index}" / "model.onnx"
            path.parent.mkdir()
            say(f"round {index}: exporting and measuring in ONNX Runtime ({provider})")
            parity = job.export(module, path)
            latency = measure_latency(dense_onnx, path, feed, provider=provider, threads=request.threads,
                                      repeats=request.repeats)
            value = _score(job, job.outputs(path), reference)
            say(f"round {index}: measured speedup {latency.speedup:.3f}x ({latency.baseline_ms:.1f} -> "
                f"{latency.compressed_ms:.1f} ms), {job.metric.name} {baseline_metric:.4f} -> {value:.4f}")
            return _Round(plan, module, layers, path, parity, latency, value, predicted)

        rounds: list[_Round] = []
        if request.uniform_ratio is not None:
            rounds.append(run_round(request.uniform_ratio, 0))
        elif request.widths_from is not None:
            rounds.append(run_round(_widths_of(request.widths_from), 0))
        else:
            enter("statistics", 0)
            curves = _curves(job, request, say)
            rounds += _target_loop(request, curves, run_round, job, baseline_metric, say, enter)
        chosen, status = _choose(request, rounds, job.metric, baseline_metric)
        enter("save", len(rounds) - 1)
        say("saving the pruned model and model.onnx")
        artifact = job.save(chosen.module, out)
        os.replace(chosen.onnx, out / "model.onnx")
        for data in chosen.onnx.parent.glob("*.data"):  # external weights of a model over 2 GB
            os.replace(data, out / data.name)
        stamp_metadata(out / "model.onnx", {
            "osscar.source_model": str(request.model), "osscar.method": request.method,
            "osscar.calibration": str(request.calibration),
            "osscar.calibration_sha256": file_sha256(request.calibration),
            "osscar.seed": request.seed, "osscar.version": _version(), "osscar.preprocessing": job.preprocessing(),
            "osscar.widths": {r.name: r.width_after for r in chosen.layers}})
        decode = None
        if request.decode_step:
            say("exporting the decode step (decode.onnx)")
            decode = job.export_decode_step(chosen.module, out / "decode.onnx")
        report = _report(request, job, chosen, rounds, status, baseline_metric, provider, artifact, start)
        if decode is not None:
            report["artifacts"]["decode_step"] = {"path": "decode.onnx", "parity_max_abs_error": decode}
        _write_json_atomically(out / "report.json", report)
        write_html(report, out / "report.html")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"{status}: measured speedup {report['measured_speedup']:.3f}x, {job.metric.name} "
        f"{report['metric']['baseline']:.4f} -> {report['metric']['compressed']:.4f}, params "
        f"{report['params_before']} -> {report['params_after']}; wrote {out} in {report['elapsed_s']:.1f}s")
    return report


def _fingerprint(path: str | Path) -> list:
    """What identifies a model or data reference without reading gigabytes: each file's name, size and
    modification time (a content digest for files under 64 MB)."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    out: list = [str(path.resolve()) if path.exists() else str(path)]
    for f in files:
        stat = f.stat()
        out.append([f.name, stat.st_size, file_sha256(f) if stat.st_size < 64 << 20 else stat.st_mtime_ns])
    return out


def curves_cache_key(job, request: CompressRequest) -> str:
    import hashlib

    parts = {"model": _fingerprint(request.model), "calibration": _fingerprint(request.calibration),
             "seed": request.seed, "samples": request.samples, "sequences": request.sequences,
             "sequence_length": request.sequence_length, "mean": request.mean, "std": request.std,
             "round_to": request.round_to, "min_width": request.min_width, "shape": job.shape,
             "normalise": request.normalise,
             "version": _version()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _curves(job, request: CompressRequest, say: Callable[[str], None]) -> list[LayerCurve]:
    """Loss-versus-width curves of every layer from the dense model's statistics (one pass), cached by
    model, calibration and settings, so a sweep of targets costs one calibration pass."""
    cache = Path(request.curves_cache) / f"{curves_cache_key(job, request)}.json" if request.curves_cache else None
    if cache is not None and cache.is_file():
        say(f"dense statistics: cached curves {cache}")
        return [LayerCurve(**c) for c in json.loads(cache.read_text())]
    say("dense statistics pass: loss-versus-width curve of every layer")
    curves: list[LayerCurve] = []
    kv_multiple = 1

    def observe(obs: LayerObservation) -> None:
        groups = obs.H.shape[0] // obs.group_size
        # heads are already hardware-sized (head_dim rows): the multiple applies to channels and neurons
        multiple = kv_multiple if obs.kind == "attention_heads" else request.round_to
        minimum = max(1, math.ceil(request.min_width * groups))
        allowed = allowed_widths(groups, multiple, minimum)
        losses = loss_path(obs.H, obs.G, obs.group_size, allowed)
        # a layer's loss counts relative to what its error adds to: the residual stream when there is one
        norm = obs.stream_energy if request.normalise == "stream" and obs.stream_energy else obs.energy
        norm = norm if norm > 0 else 1.0
        curves.append(LayerCurve(obs.name, obs.kind, allowed, [v / norm for v in losses], obs.cost))

    job.prune(0.0, observe=observe)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _write_json_atomically(cache, [asdict(c) for c in curves])
    return curves


def _target_loop(request: CompressRequest, curves: list[LayerCurve], run_round, job, baseline_metric: float,
                 say: Callable[[str], None], enter: Callable[[str, int], None] | None = None) -> list[_Round]:
    """Allocate -> prune -> measure; correct the latency model's prunable share and retry."""
    full = total_cost(curves)
    share = 0.85  # fraction of the latency in the prunable layers: corrected after each measurement
    target = request.target_speedup
    rounds: list[_Round] = []
    for index in range(request.max_rounds):
        wanted = (1 - 1 / target) / share  # fraction of the prunable cost to remove
        plan = allocate(curves, wanted * full)
        saved = 1 - total_cost(curves, plan) / full
        if enter:
            enter("allocate", index)
        say(f"round {index}: removing {saved:.1%} of the prunable cost (modelled prunable share {share:.2f})")
        result = run_round(plan, index, predicted=1 / (1 - share * saved))
        rounds.append(result)
        speedup = result.latency.speedup
        blown = request.accuracy_budget is not None and \
            _drop(job.metric, baseline_metric, result.metric) > request.accuracy_budget
        if blown and request.back_off:
            target = max(1.0 + 1e-3, 1 + (min(speedup, target) - 1) * 0.7)  # ask for less
            say(f"round {index}: accuracy budget exceeded; backing off to {target:.3f}x")
        elif MET * request.target_speedup <= speedup <= AIM * request.target_speedup:
            break
        if saved > 0 and speedup > 0:  # observed share of the latency that the removed cost accounted for
            share = min(1.5, max(0.05, (1 - 1 / speedup) / saved))
        if saved >= 1 - 1e-9 or (speedup < MET * target and saved >= _max_saving(curves) - 1e-9):
            say("the minimum widths allow no more pruning")
            break
    return rounds


def _widths_of(path: Path) -> dict[str, int]:
    """{layer: kept width} from a report.json's layers."""
    try:
        layers = json.loads(Path(path).read_text())["layers"]
        return {layer["name"]: int(layer["width_after"]) for layer in layers}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--widths-from {path}: expected a report.json with layers[].name and width_after") from err


def _max_saving(curves: list[LayerCurve]) -> float:
    full = total_cost(curves)
    return 1 - sum(c.cost * c.widths[-1] for c in curves) / full


def _choose(request: CompressRequest, rounds: list[_Round], metric: Metric, baseline: float) -> tuple[_Round, str]:
    def within_budget(r: _Round) -> bool:
        return request.accuracy_budget is None or _drop(metric, baseline, r.metric) <= request.accuracy_budget

    def quality(r: _Round) -> float:
        return r.metric if metric.higher_is_better else -r.metric

    if request.target_speedup is None:
        chosen = rounds[0]
        return chosen, "ok" if within_budget(chosen) else "accuracy_budget_exceeded"
    target = request.target_speedup
    met = [r for r in rounds if r.latency.speedup >= MET * target]
    if request.back_off:
        fine = [r for r in rounds if within_budget(r)]
        if fine:
            best = max(fine, key=lambda r: r.latency.speedup)
            return best, "ok" if best.latency.speedup >= MET * target else "target_not_met"
        return max(rounds, key=quality), "accuracy_budget_exceeded"
    if met:
        best = max(met, key=quality)
        return best, "ok" if within_budget(best) else "accuracy_budget_exceeded"
    return max(rounds, key=lambda r: r.latency.speedup), "target_not_met"


def _report(request: CompressRequest, job, chosen: _Round, rounds: list[_Round], status: str, baseline_metric: float,
            provider: str, artifact: str, start: float) -> dict:
    import onnxruntime
    import transformers

    lat = chosen.latency
    return {
        "status": status,
        "target_speedup": request.target_speedup,
        "uniform_ratio": request.uniform_ratio,
        "measured_speedup": lat.speedup,
        "baseline_latency_ms": lat.baseline_ms,
        "compressed_latency_ms": lat.compressed_ms,
        "latency_p90_ms": {"baseline": lat.baseline_p90_ms, "compressed": lat.compressed_p90_ms},
        "execution_provider": provider,
        "precision": request.precision,
        "threads": lat.threads,
        "device": device_name(provider),
        "deployment_target": request.deployment_target,
        "shape": job.shape,
        "metric": {"name": job.metric.name, "baseline": baseline_metric, "compressed": chosen.metric,
                   "relative_drop": _drop(job.metric, baseline_metric, chosen.metric)},
        "params_before": job.params_before,
        "params_after": count_parameters(chosen.module),
        "method": request.method,
        "layers": [{"name": r.name, "kind": r.kind, "width_before": r.width_before, "width_after": r.width_after,
                    "objective": r.objective, "relative_error": r.relative_error, "seconds": r.seconds,
                    "kept": list(r.kept)} for r in chosen.layers],
        "rounds": [{"measured_speedup": r.latency.speedup, "predicted_speedup": r.predicted_saving,
                    "metric": r.metric} for r in rounds],
        "model": str(request.model),
        "calibration": str(request.calibration),
        "eval": str(request.eval) if request.eval else None,
        "seed": request.seed,
        "artifacts": {"onnx": "model.onnx", "model": artifact, "parity_max_abs_error": chosen.parity},
        **({"widths": widths(chosen.module)} if job.kind == "transformer" else {}),
        **job.extra(),
        "versions": {"osscar": _version(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                     "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "elapsed_s": time.perf_counter() - start,
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("osscar-service")
    except PackageNotFoundError:
        return "unknown"
