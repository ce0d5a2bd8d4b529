"""report.json: what a job measured, as one dict (the contract `osscar compress`, the service and
report.html read)."""

from __future__ import annotations

import sys
import time

import torch

from compressor.modules import count_parameters

from .kinds import ModelJob
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
                 baseline_metric: float, provider: str, artifact: str, start: float) -> dict:
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
        "device": lat.device,
        "deployment_target": request.deployment_target,
        "shape": job.shape,
        "metric": {"name": job.metric.name, "baseline": baseline_metric, "compressed": chosen.metric,
                   "relative_drop": job.metric.relative_drop(baseline_metric, chosen.metric)},
        "params_before": job.params_before,
        "params_after": count_parameters(chosen.module),
        "method": request.method,
        "layers": [{"name": r.name, "kind": r.kind, "width_before": r.width_before, "width_after": r.width_after,
                    "objective": r.objective, "relative_error": r.relative_error, "seconds": r.seconds,
                    "kept": list(r.kept)} for r in chosen.layers],
        "rounds": [{"measured_speedup": r.latency.speedup, "predicted_speedup": r.predicted_speedup,
                    "metric": r.metric} for r in rounds],
        "model": str(request.model),
        "calibration": str(request.calibration),
        "eval": str(request.eval) if request.eval else None,
        "seed": request.seed,
        "artifacts": {"onnx": "model.onnx", "model": artifact, "parity_max_abs_error": chosen.parity},
        **job.report_fields(chosen.module),
        "versions": {"osscar": version(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                     "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "elapsed_s": time.perf_counter() - start,
    }
