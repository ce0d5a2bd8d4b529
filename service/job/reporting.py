"""The `Report` of a finished job (`service.job.report`), built from its request, model kind and rounds."""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from compressor.modules import count_parameters
from compressor.reports import LayerReport
from exporters.onnx import ExportError, ParityError

from .budgets import accuracy_rule
from .kinds import ModelJob, tolerance
from .report import (
    Artifacts,
    BudgetResult,
    EvaluationFailure,
    LayerResult,
    Measured,
    MetricResult,
    ParityFailure,
    ProbeResult,
    Report,
    RoundResult,
    status_message,
)
from .request import CompressRequest
from .targeting import Round


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
                 baseline_secondary: dict[str, float] | None = None) -> Report:
    lat = chosen.latency
    rule = accuracy_rule(request, job.metric)
    measured = Measured(
        measured_speedup=lat.speedup, baseline_latency_ms=lat.baseline_ms, compressed_latency_ms=lat.compressed_ms,
        latency_p90_ms={"baseline": lat.baseline_p90_ms, "compressed": lat.compressed_p90_ms},
        latency_samples={"repeats": lat.repeats, "runs_per_sample": lat.runs_per_sample,
                         "sessions_at_once": 1 if lat.in_turn else 2, "pieces": lat.pieces},
        latency_io_binding=lat.io_binding,
        host_copy_latency=None if lat.host_speedup is None else {
            "baseline_ms": lat.host_baseline_ms, "compressed_ms": lat.host_compressed_ms, "speedup": lat.host_speedup},
        threads=lat.threads, device=lat.device, deployment_target=request.deployment_target, shape=dict(job.shape),
        params_after=count_parameters(chosen.module),
        accuracy_budget=BudgetResult(**rule.to_dict(baseline_metric)) if rule else None,
        block_reconstruction=_reconstruction(chosen.layers), eval=str(request.eval) if request.eval else None)
    metric = MetricResult(job.metric.name, baseline_metric, chosen.metric,
                          job.metric.relative_drop(baseline_metric, chosen.metric),
                          {name: {"baseline": (baseline_secondary or {}).get(name), "compressed": value}
                           for name, value in chosen.secondary.items()})
    report = Report(
        status=status, message="", target_speedup=request.target_speedup, uniform_ratio=request.uniform_ratio,
        execution_provider=provider, precision=request.precision, metric=metric, params_before=job.params_before,
        method=request.method, layers=layer_results(chosen.layers), rounds=_rounds(rounds), model=str(request.model),
        calibration=str(request.calibration), seed=request.seed,
        artifacts=Artifacts(onnx="model.onnx", model=artifact, parity_max_abs_error=chosen.parity.max_abs_error,
                            parity=dataclasses.asdict(chosen.parity)),
        versions=_versions(), elapsed_s=time.perf_counter() - start, evaluation=_evaluation(job), measured=measured,
        kind=dataclasses.replace(job.report_fields(chosen.module), preprocessing=job.preprocessing()))
    report.message = status_message(report)
    return report


def layer_results(layers: list[LayerReport]) -> list[LayerResult]:
    return [LayerResult(r.name, r.kind, r.width_before, r.width_after, r.objective, r.relative_error, r.seconds,
                        list(r.kept), dataclasses.asdict(r.refine) if r.refine else None, r.rows,
                        [list(k) for k in r.experts_kept] if r.experts_kept is not None else None) for r in layers]


def _reconstruction(layers: list[LayerReport]) -> dict | None:
    """Reconstruction in sum (each block's fit, or a conv graph's one fit, is in its last layer's `refine`);
    None when none ran."""
    fits = [r.refine for r in layers if r.refine is not None]
    if not fits:
        return None
    return {"steps": max(f.steps for f in fits), "steps_min": min(f.steps for f in fits), "blocks": len(fits),
            "blocks_kept": sum(f.kept for f in fits), "seconds": sum(f.seconds for f in fits)}


def _evaluation(job: ModelJob) -> dict:
    """What the accuracy check scored: unseen inputs, how many, where from."""
    return {**dataclasses.asdict(job.held_out), "unit": "images" if job.held_out.tokens is None else "windows"}


def _rounds(rounds: list[Round]) -> list[RoundResult]:
    return [RoundResult(r.latency.speedup, r.predicted_speedup, r.metric, r.secondary,
                        [ProbeResult(p.saving, p.latency.speedup, p.latency.baseline_ms, p.latency.compressed_ms)
                         for p in r.probes], r.timings or None)
            for r in rounds]


def _versions() -> dict:
    import onnxruntime
    import transformers

    return {"osscar": version(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


STAGES = {"baseline": "the dense model's export", "round": "the export of round {round}",
          "probe": "a latency probe's export before round {round}", "trial": "a depth trial's export before round "
          "{round}", "decode_step": "the decode step's export"}


def parity_failed_report(request: CompressRequest, job: ModelJob, stage: str, index: int | None,
                         error: Exception, layers: list[LayerReport], rounds: list[Round],
                         baseline_metric: float | None, provider: str, start: float) -> Report:
    """report.json of a job ended by an export that torch.onnx cannot make (ExportError), that does not match
    PyTorch (ParityError) or does not run in ONNX Runtime (RuntimeFailure): where it failed, the numbers, the
    rounds measured before; no artifact but the report."""
    where = STAGES[stage].format(round=index)
    detail = " ".join(str(error).split())[:600]  # one line: ONNX Runtime's messages span several
    how = "fails the parity check" if isinstance(error, ParityError) else \
        "fails in torch.onnx.export" if isinstance(error, ExportError) else "does not run in ONNX Runtime"
    mismatches = [dataclasses.asdict(m) for m in error.mismatches] if isinstance(error, ParityError) else []
    report = _failed(request, job, layers, rounds, baseline_metric, provider, start, "parity_failed",
                     f"parity_failed: {where} ({request.precision}) {how}: {detail}")
    report.parity = ParityFailure(stage, index, request.precision, dataclasses.asdict(tolerance(request)),
                                  type(error).__name__, detail, mismatches)
    return report


def evaluation_failed_report(request: CompressRequest, job: ModelJob, stage: str, index: int | None, detail: str,
                             layers: list[LayerReport], rounds: list[Round], baseline_metric: float | None,
                             provider: str, start: float) -> Report:
    """report.json of a job whose accuracy check could not be trusted (too few unseen inputs, dense outputs
    that are not finite, a pruned model scored identical to the dense one, a returned file other than the
    scored one): what went wrong and the rounds measured before; no artifact but the report."""
    report = _failed(request, job, layers, rounds, baseline_metric, provider, start, "evaluation_failed",
                     f"evaluation_failed: the accuracy check cannot vouch for the result: {detail}")
    report.evaluation_failure = EvaluationFailure(stage, index, detail)
    report.evaluation = _evaluation(job)
    return report


def _failed(request: CompressRequest, job: ModelJob, layers: list[LayerReport], rounds: list[Round],
            baseline_metric: float | None, provider: str, start: float, status: str, message: str) -> Report:
    """What every report of a job that returns no model carries."""
    return Report(status=status, message=message, target_speedup=request.target_speedup,
                  uniform_ratio=request.uniform_ratio, execution_provider=provider, precision=request.precision,
                  metric=MetricResult(job.metric.name, baseline_metric), params_before=job.params_before,
                  method=request.method, layers=layer_results(layers), rounds=_rounds(rounds),
                  model=str(request.model), calibration=str(request.calibration), seed=request.seed,
                  artifacts=Artifacts(), versions=_versions(), elapsed_s=time.perf_counter() - start)
