"""Reports for tests of what reads them: a whole, valid `Report` with the fields a test cares about set."""

from __future__ import annotations

import dataclasses
from typing import Any

from service.job.report import (
    Artifacts,
    BudgetResult,
    KindFields,
    LayerResult,
    Measured,
    MetricResult,
    ProbeResult,
    Report,
    RoundResult,
)


def measured(**changes: Any) -> Measured:
    base = Measured(measured_speedup=1.5, baseline_latency_ms=10.0, compressed_latency_ms=6.6,
                    latency_p90_ms={"baseline": 11.0, "compressed": 7.0},
                    latency_samples={"repeats": 20, "runs_per_sample": 1}, latency_io_binding=False,
                    host_copy_latency=None, threads=2, device="cpu", deployment_target=None, shape={"batch": 4},
                    params_after=600, accuracy_budget=BudgetResult("cosine at least 0.9", "at_least", 0.9, True, 0.9,
                                                                   "cosine >= 0.9000"),
                    block_reconstruction=None, eval=None)
    return dataclasses.replace(base, **changes)


def report(**changes: Any) -> Report:
    """An "ok" report of a two-layer model at 1.5x; `changes` replace its fields (`measured=None`: failed)."""
    base = Report(
        status="ok", message="ok: measured speedup 1.500x (target 1.5x), cosine 1.0000 -> 0.9500",
        target_speedup=1.5, uniform_ratio=None, execution_provider="cpu", precision="fp32",
        metric=MetricResult("cosine", 1.0, 0.95, 0.05, {}), params_before=1000, method="osscar",
        layers=[LayerResult("conv1", "conv_channels", 16, 8, -1.0, 0.01, 0.1, list(range(8))),
                LayerResult("model.layers.0.mlp.down_proj", "ffn_neurons", 64, 32, -2.0, 0.02, 0.2,
                            list(range(32)))],
        rounds=[RoundResult(1.5, 1.45, 0.95, {}, [ProbeResult(0.3, 1.4, 10.0, 7.1)])],
        model="/models/m", calibration="/data/cal.npz", seed=0,
        artifacts=Artifacts(onnx="model.onnx", model="model.pt2", parity_max_abs_error=1e-5,
                            parity={"max_abs_error": 1e-5, "peak_error": 1e-6, "aggregate_error": 1e-7}),
        versions={"osscar": "test"}, elapsed_s=12.0,
        evaluation={"source": "held out of the calibration file", "calibration": 500, "evaluation": 256,
                    "unit": "images"},
        measured=measured(), kind=KindFields(samples=500, refine_steps=300, removed_blocks=[]))
    return dataclasses.replace(base, **changes)
