"""report.json: what a job measured, as one dict (the contract `osscar compress`, the service and
report.html read)."""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from compressor.modules import count_parameters
from compressor.reports import LayerReport
from exporters.onnx import ParityError

from .kinds import ModelJob, tolerance
from .request import CompressRequest
from .targeting import Round, accuracy_rule


def version() -> str:
    """This package's installed version ("unknown" from a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("osscar-service")
    except PackageNotFoundError:
        return "unknown"


def build_report(request: CompressRequest, job: ModelJob, chosen: Round, rounds: list[Round], status: str,
                 baseline_metric: float, provider: str, artifact: str, start: float,
                 baseline_secondary: dict[str, float] | None = None) -> dict:
    lat = chosen.latency
    rule = accuracy_rule(request, job.metric)
    report = {
        "status": status,
        "target_speedup": request.target_speedup,
        "uniform_ratio": request.uniform_ratio,
        "measured_speedup": lat.speedup,
        "baseline_latency_ms": lat.baseline_ms,
        "compressed_latency_ms": lat.compressed_ms,
        "latency_p90_ms": {"baseline": lat.baseline_p90_ms, "compressed": lat.compressed_p90_ms},
        "latency_samples": {"repeats": lat.repeats, "runs_per_sample": lat.runs_per_sample},
        # on CUDA the figures above keep inputs and outputs on the device (I/O binding); these include
        # the host copies (null where the two are the same measurement: the CPU)
        "latency_io_binding": lat.io_binding,
        "host_copy_latency": None if lat.host_speedup is None else {
            "baseline_ms": lat.host_baseline_ms, "compressed_ms": lat.host_compressed_ms,
            "speedup": lat.host_speedup},
        "execution_provider": provider,
        "precision": request.precision,
        "threads": lat.threads,
        "device": lat.device,
        "deployment_target": request.deployment_target,
        "shape": job.shape,
        "metric": {"name": job.metric.name, "baseline": baseline_metric, "compressed": chosen.metric,
                   "relative_drop": job.metric.relative_drop(baseline_metric, chosen.metric),
                   "secondary": {name: {"baseline": (baseline_secondary or {}).get(name), "compressed": value}
                                 for name, value in chosen.secondary.items()}},
        "evaluation": _evaluation(job),
        "params_before": job.params_before,
        "params_after": count_parameters(chosen.module),
        "method": request.method,
        "accuracy_budget": rule.to_dict(baseline_metric) if rule else None,
        "block_reconstruction": _reconstruction(chosen.layers),
        "layers": _layers(chosen.layers),
        "rounds": _rounds(rounds),
        "model": str(request.model),
        "calibration": str(request.calibration),
        "eval": str(request.eval) if request.eval else None,
        "seed": request.seed,
        "artifacts": {"onnx": "model.onnx", "model": artifact, "parity_max_abs_error": chosen.parity.max_abs_error,
                      "parity": dataclasses.asdict(chosen.parity)},
        **job.report_fields(chosen.module),
        "versions": _versions(),
        "elapsed_s": time.perf_counter() - start,
    }
    report["message"] = status_message(report)
    return report


def _layers(layers: list[LayerReport]) -> list[dict]:
    return [{"name": r.name, "kind": r.kind, "width_before": r.width_before, "width_after": r.width_after,
             "objective": r.objective, "relative_error": r.relative_error, "seconds": r.seconds,
             "kept": list(r.kept), **({"refine": dataclasses.asdict(r.refine)} if r.refine else {})}
            for r in layers]


def _reconstruction(layers: list[LayerReport]) -> dict | None:
    """Reconstruction in sum (each block's fit, or a conv graph's one fit, is in its last layer's `refine`);
    None when none ran."""
    fits = [r.refine for r in layers if r.refine is not None]
    if not fits:
        return None
    return {"steps": max(f.steps for f in fits), "blocks": len(fits), "blocks_kept": sum(f.kept for f in fits),
            "seconds": sum(f.seconds for f in fits)}


def _evaluation(job: ModelJob) -> dict:
    """What the accuracy check scored: unseen inputs, how many, where from."""
    return {**dataclasses.asdict(job.held_out), "unit": "images" if job.held_out.tokens is None else "windows"}


def _rounds(rounds: list[Round]) -> list[dict]:
    return [{"measured_speedup": r.latency.speedup, "predicted_speedup": r.predicted_speedup, "metric": r.metric,
             "secondary": r.secondary,
             "latency_probes": [{"saving": p.saving, "measured_speedup": p.latency.speedup,
                                 "baseline_ms": p.latency.baseline_ms, "compressed_ms": p.latency.compressed_ms}
                                for p in r.probes]}
            for r in rounds]


def _versions() -> dict:
    import onnxruntime
    import transformers

    return {"osscar": version(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def status_message(report: dict) -> str:
    """One line: how the job ended, with the measured numbers (and the rule of an exceeded budget)."""
    status, metric = report["status"], report["metric"]
    mode = f"target {report['target_speedup']}x" if report["target_speedup"] is not None else \
        f"uniform ratio {report['uniform_ratio']}" if report["uniform_ratio"] is not None else "widths from a report"
    line = (f"{status}: measured speedup {report['measured_speedup']:.3f}x ({mode}), {metric['name']} "
            f"{metric['baseline']:.4f} -> {metric['compressed']:.4f}")
    budget = report.get("accuracy_budget")
    if status == "accuracy_budget_exceeded" and budget:
        line += (f", beyond the {'default ' if budget['default'] else ''}accuracy budget: {budget['rule']} "
                 f"({budget['bound']})")
    return line


STAGES = {"baseline": "the dense model's export", "round": "the export of round {round}",
          "probe": "a latency probe's export before round {round}", "decode_step": "the decode step's export"}


def parity_failed_report(request: CompressRequest, job: ModelJob, stage: str, index: int | None,
                         error: Exception, layers: list[LayerReport], rounds: list[Round],
                         baseline_metric: float | None, provider: str, start: float) -> dict:
    """report.json of a job ended by an export that does not match PyTorch (ParityError) or does not run
    in ONNX Runtime (RuntimeFailure): where it failed, the numbers, the rounds measured before; no
    artifact but the report."""
    where = STAGES[stage].format(round=index)
    detail = " ".join(str(error).split())[:600]  # one line: ONNX Runtime's messages span several
    how = "does not run in ONNX Runtime" if not isinstance(error, ParityError) else "fails the parity check"
    mismatches = [dataclasses.asdict(m) for m in error.mismatches] if isinstance(error, ParityError) else []
    return {
        "status": "parity_failed",
        "message": f"parity_failed: {where} ({request.precision}) {how}: {detail}",
        "parity": {"stage": stage, "round": index, "precision": request.precision,
                   "tolerance": dataclasses.asdict(tolerance(request)), "error": type(error).__name__,
                   "detail": detail, "mismatches": mismatches},
        **_failed_fields(request, job, layers, rounds, baseline_metric, provider, start),
    }


def evaluation_failed_report(request: CompressRequest, job: ModelJob, stage: str, index: int | None, detail: str,
                             layers: list[LayerReport], rounds: list[Round], baseline_metric: float | None,
                             provider: str, start: float) -> dict:
    """report.json of a job whose accuracy check could not be trusted (too few unseen inputs, dense outputs
    that are not finite, a pruned model scored identical to the dense one, a returned file other than the
    scored one): what went wrong and the rounds measured before; no artifact but the report."""
    return {
        "status": "evaluation_failed",
        "message": f"evaluation_failed: the accuracy check cannot vouch for the result: {detail}",
        "evaluation_failure": {"stage": stage, "round": index, "detail": detail},
        "evaluation": _evaluation(job),
        **_failed_fields(request, job, layers, rounds, baseline_metric, provider, start),
    }


def _failed_fields(request: CompressRequest, job: ModelJob, layers: list[LayerReport], rounds: list[Round],
                   baseline_metric: float | None, provider: str, start: float) -> dict:
    """What every report of a job that returns no model carries."""
    return {
        "target_speedup": request.target_speedup,
        "uniform_ratio": request.uniform_ratio,
        "execution_provider": provider,
        "precision": request.precision,
        "metric": {"name": job.metric.name, "baseline": baseline_metric},
        "params_before": job.params_before,
        "method": request.method,
        "layers": _layers(layers),
        "rounds": _rounds(rounds),
        "model": str(request.model),
        "calibration": str(request.calibration),
        "seed": request.seed,
        "artifacts": {},
        "versions": _versions(),
        "elapsed_s": time.perf_counter() - start,
    }
