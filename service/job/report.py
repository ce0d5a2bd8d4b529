"""report.json as one typed record: what a job measured, the contract `osscar compress`, the service,
the gRPC `CompressReport` (`service.api.wire`) and report.html read.

Schema (`SCHEMA_VERSION`, written as `schema_version`): `Report`'s fields, in JSON as named here. Nested
records are JSON objects; a field marked `optional` is left out of the JSON when it is None (a failed
job's report has no measurements, a model kind adds only its own fields); a `flatten` field's record
writes its fields at the top level (report.json has always been flat). A new field is one field here: the
JSON, its reading back (`Report.from_json`) and every reader follow from it.

It imports nothing heavy itself: the server reads reports out of its store with it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1  # bump when a field changes meaning or goes; adding an optional field does not


OPTIONAL = types.MappingProxyType({"optional": True})  # a field left out of the JSON when it is None


def _flat(present: str | None = None) -> Mapping[str, Any]:
    """A nested record whose fields are written at the top level; `present`: the key whose presence in the
    JSON says the record is there (else it always is)."""
    return types.MappingProxyType({"flatten": True, "present": present})


@dataclass
class MetricResult:
    name: str  # top1 | agreement | cosine | perplexity (`service.job.budgets.METRICS`)
    baseline: float | None  # the dense model's (None when the job failed before measuring it)
    compressed: float | None = field(default=None, metadata=OPTIONAL)  # the returned model's
    # (baseline - compressed) / |baseline|, signed so that > 0 is worse
    relative_drop: float | None = field(default=None, metadata=OPTIONAL)
    # other metrics reported beside it, never budgeted: name -> {"baseline", "compressed"}
    secondary: dict[str, dict[str, float | None]] | None = field(default=None, metadata=OPTIONAL)


@dataclass
class BudgetResult:
    """The accuracy rule in force (`budgets.AccuracyRule.to_dict`)."""

    rule: str  # in words: "perplexity at most 2x dense"
    kind: str  # relative | times | at_least | points
    limit: float
    default: bool  # the metric's default rule, not the request's
    worst_allowed: float
    bound: str  # "perplexity <= 103.3600"


@dataclass
class LayerResult:
    name: str
    kind: str  # conv_channels | attention_heads | ffn_neurons
    width_before: int  # groups: channels, heads (or KV groups) or neurons
    width_after: int
    objective: float
    relative_error: float
    seconds: float
    kept: list[int]  # the kept groups, in the dense numbering
    # on a block's last layer: its reconstruction (RefineReport)
    refine: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    # a transformer's output projection: the rows it kept, "refit" (the solve's) or "dense" (the dense weight's)
    rows: str | None = field(default=None, metadata=OPTIONAL)
    # a Mixture-of-Experts layer's experts (`kept` empty: each keeps its own): each expert's kept neurons
    experts_kept: list[list[int]] | None = field(default=None, metadata=OPTIONAL)


@dataclass
class ProbeResult:
    saving: float  # the share of the prunable cost the probe's widths remove
    measured_speedup: float
    baseline_ms: float
    compressed_ms: float


@dataclass
class RoundResult:
    measured_speedup: float
    predicted_speedup: float | None  # the latency model's (None: not target mode)
    metric: float
    secondary: dict[str, float]
    latency_probes: list[ProbeResult]
    # every speedup measured of the round's widths (its probe's, its own, a second look's) when they disagreed on
    # the window; measured_speedup is then their median
    timings: list[float] | None = field(default=None, metadata=OPTIONAL)


@dataclass
class Artifacts:
    onnx: str | None = field(default=None, metadata=OPTIONAL)  # model.onnx
    model: str | None = field(default=None, metadata=OPTIONAL)  # the pruned model: model.pt2 or model/
    parity_max_abs_error: float | None = field(default=None, metadata=OPTIONAL)
    # exporters.onnx.Parity of model.onnx against PyTorch
    parity: dict[str, float] | None = field(default=None, metadata=OPTIONAL)
    decode_step: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # decode.onnx and its parity
    # what serving stacks read beside model.onnx (an encoder's model/onnx/model.onnx, sentence-transformers'
    # modules, remote code for unequal widths): kinds.ModelJob.serving_files
    serving: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)


@dataclass
class Measured:
    """What the returned model measured: in every report but a failed job's."""

    measured_speedup: float  # median of paired dense/compressed latency ratios
    baseline_latency_ms: float
    compressed_latency_ms: float
    latency_p90_ms: dict[str, float]  # baseline, compressed
    # repeats, runs_per_sample, sessions_at_once (2: paired in one process; 1: in turns, the pair did not fit),
    # pieces (0: each model whole; n: the most pieces a model ran in, one session each, as its whole did not fit)
    latency_samples: dict[str, int]
    # on CUDA the figures above keep inputs and outputs on the device (I/O binding); host_copy_latency
    # includes the host copies (None where the two are the same measurement: the CPU)
    latency_io_binding: bool
    host_copy_latency: dict[str, float] | None
    threads: int
    device: str
    deployment_target: str | None
    shape: dict[str, int]  # the measured input shape
    params_after: int
    accuracy_budget: BudgetResult | None  # None: --accuracy-budget none
    # the fits in sum (steps: the most a block ran, steps_min the fewest, blocks, blocks_kept, seconds)
    block_reconstruction: dict[str, Any] | None
    eval: str | None  # the --eval reference as the job saw it
    warnings: list[str] = field(default_factory=list)
    # the ONNX graphs timed (transformers): each graph's ONNX Runtime fusions (exporters.fusion.Fusion.to_json:
    # "dense" and "compressed"), and "as_exported": the same two graphs timed as the exporter wrote them
    # (baseline_ms, compressed_ms, speedup). The speedup above is the fused graphs'.
    onnx_graph: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)


@dataclass
class KindFields:
    """What a model kind adds (`ModelJob.report_fields`); each left out when None."""

    samples: int | None = field(default=None, metadata=OPTIONAL)  # calibration images
    not_pruned: dict[str, str] | None = field(default=None, metadata=OPTIONAL)  # conv layers left dense, and why
    # residual blocks the returned graph lacks
    removed_blocks: list[str] | None = field(default=None, metadata=OPTIONAL)
    refine_steps: int | None = field(default=None, metadata=OPTIONAL)  # a conv graph's reconstruction steps
    # target mode's depth plan (targeting.DepthPlan.to_dict)
    depth: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    widths: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # a transformer's kept widths
    # a grouped-query transformer's head unit, what its attention layers' widths count: query-heads or kv-groups
    gqa: str | None = field(default=None, metadata=OPTIONAL)
    onnx_inputs: list[str] | None = field(default=None, metadata=OPTIONAL)
    onnx_output: str | None = field(default=None, metadata=OPTIONAL)
    # transformer layers removed whole ("model.layers.7"), and attentions / FFNs removed alone, named by their output
    # projection ("model.layers.7.self_attn.o_proj")
    removed_layers: list[str] | None = field(default=None, metadata=OPTIONAL)
    # a transformer's whole-model fit after its block fits (compressor.reports.RefineReport: before, after, kept,
    # steps, seconds), when it ran
    model_reconstruction: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    sequences: int | None = field(default=None, metadata=OPTIONAL)  # text calibration windows
    sequence_length: int | None = field(default=None, metadata=OPTIONAL)
    min_sequence_length: int | None = field(default=None, metadata=OPTIONAL)
    # what a server of model.onnx does to its inputs (also model.onnx's metadata `osscar.preprocessing`): an image
    # model's layout, scaling and normalisation (`normalisation_from`: the request's, the model directory's
    # preprocessor_config.json, or ImageNet's), a text model's input names and tokenizer
    preprocessing: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)


@dataclass
class ParityFailure:
    stage: str  # baseline | round | probe | trial | decode_step
    round: int | None
    precision: str
    tolerance: dict[str, float]
    error: str  # ParityError | RuntimeFailure
    detail: str
    mismatches: list[dict[str, Any]]


@dataclass
class EvaluationFailure:
    stage: str
    round: int | None
    detail: str


@dataclass
class StageTime:
    stage: str  # a stage as `compress` enters it: loading | baseline | statistics | allocate | prune | measure | save
    round: int  # the prune-measure round it belongs to (0 before the first)
    seconds: float  # from its start to the next stage's (the last one's: to the report)


@dataclass
class Report:
    status: str  # a row of service.core.outcomes.OUTCOMES from the report
    message: str  # the outcome in one line, with the numbers
    target_speedup: float | None
    uniform_ratio: float | None
    execution_provider: str
    precision: str
    metric: MetricResult
    params_before: int
    method: str
    layers: list[LayerResult]  # the returned (or last) round's
    rounds: list[RoundResult]
    model: str  # the references as the job saw them (resolved paths)
    calibration: str
    seed: int
    artifacts: Artifacts
    versions: dict[str, str]
    elapsed_s: float
    # calibration.HeldOut and its unit: what the check scored
    evaluation: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    measured: Measured | None = field(default=None, metadata=_flat("measured_speedup"))
    kind: KindFields = field(default_factory=KindFields, metadata=_flat())
    parity: ParityFailure | None = field(default=None, metadata=OPTIONAL)  # status parity_failed
    evaluation_failure: EvaluationFailure | None = field(default=None, metadata=OPTIONAL)  # status evaluation_failed
    references: dict[str, str] | None = field(default=None, metadata=OPTIONAL)  # the references as the user gave them
    pacing: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # the time budget's pacing (`pacing.Pace`)
    # where the job's time went, stage by stage in the order they ran (reports of earlier releases: None)
    stages: list[StageTime] | None = field(default=None, metadata=OPTIONAL)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return _dump(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Report:
        """A report read back (keys it does not know are ignored: a newer release's additions)."""
        try:
            return _load(cls, data)
        except (TypeError, KeyError, AttributeError) as err:
            raise ValueError(f"not a report.json of schema {SCHEMA_VERSION}: {err}") from err

    def chosen_round(self) -> int | None:
        """The round the job returned: the one whose measurements are the report's."""
        if self.measured is None:
            return None
        for i, r in enumerate(self.rounds):
            if r.measured_speedup == self.measured.measured_speedup and r.metric == self.metric.compressed:
                return i
        return None


def status_message(report: Report) -> str:
    """One line: how the job ended, with the measured numbers (and the rule of an exceeded budget)."""
    assert report.measured is not None, "a failed job's message is its failure's"
    metric, measured = report.metric, report.measured
    mode = f"target {report.target_speedup}x" if report.target_speedup is not None else \
        f"uniform ratio {report.uniform_ratio}" if report.uniform_ratio is not None else "widths from a report"
    line = (f"{report.status}: measured speedup {measured.measured_speedup:.3f}x ({mode}), {metric.name} "
            f"{metric.baseline:.4f} -> {metric.compressed:.4f}")
    budget = measured.accuracy_budget
    if report.status == "accuracy_budget_exceeded" and budget:
        line += f", beyond the {'default ' if budget.default else ''}accuracy budget: {budget.rule} ({budget.bound})"
    return line


def _dump(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.metadata.get("flatten"):
                if item is not None:
                    out.update(_dump(item))
            elif item is not None or not f.metadata.get("optional"):
                out[f.name] = _dump(item)
        return out
    if isinstance(value, list | tuple):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


def _load(cls: type, data: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):
            present = f.metadata.get("present")
            if present is None or present in data:
                values[f.name] = _load(_record(hints[f.name]), data)
        elif f.name in data:
            values[f.name] = _value(hints[f.name], data[f.name])
    return cls(**values)


def _record(hint: Any) -> type:
    """The record type in `X` or `X | None`."""
    return next(a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a))


def _value(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value) if len(inner) == 1 else value
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return [_load(args[0], v) for v in value]
    if dataclasses.is_dataclass(hint):
        return _load(hint, value)
    return value
