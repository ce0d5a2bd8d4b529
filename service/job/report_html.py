"""report.html: a job's report.json for people, as one self-contained file (inline SVG charts, no script,
nothing fetched: a content security policy forbids it).

What it says, in this order: how the job ended in one sentence; what went in (the references as the user
gave them), what came out and with which settings, in plain words; then the charts: the prune-measure
rounds (modelled against measured speedup), quality against measured speedup for every round and the
dense model, latency (median and p90, dense and compressed), kept width and relative error per layer;
then the per-layer table. Every chart is an <svg data-chart="NAME"> (CHARTS lists them).
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import write_text_atomically
from .budgets import METRIC_WORDS
from .report import Report

CHARTS = ("rounds", "quality", "latency", "widths", "errors")
BLUE, ORANGE, GREY, RED, GREEN = "#3b6ea8", "#d9822b", "#8a8a8a", "#b3261e", "#2e7d32"
FONT = 12
CHAR_W = 6.8  # average width of a character at FONT px (labels are sized by it, never cut off)
STATUS_WORDS = {"ok": "Target met", "target_not_met": "Target not met",
                "accuracy_budget_exceeded": "Accuracy budget exceeded",
                "slower_than_dense": "Slower than the dense model", "parity_failed": "Export failed the parity check",
                "evaluation_failed": "The accuracy check could not be trusted"}
UNIT_WORDS = {"attention_heads": "heads", "ffn_neurons": "neurons", "conv_channels": "channels",
              "coupled_channels": "channels (coupled: a residual stream)"}


def _e(value: Any) -> str:
    return html.escape(str(value))


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if abs(value) >= 1e4 or 0 < abs(value) < 1e-3 else \
        f"{value:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{value:.0f}"


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if raw <= m * step)
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(math.ceil((hi - first) / step) + 1)]


def _label(text: str, limit: int) -> str:
    """At most `limit` characters: the middle elided (layer names differ at both ends)."""
    return text if len(text) <= limit else text[: limit // 2 - 1] + "…" + text[-(limit - limit // 2):]


class _Plot:
    """An x/y plot area with axes, ticks and axis titles; `x(v)`, `y(v)` map data to pixels."""

    def __init__(self, name: str, title: str, x_range: tuple[float, float], y_range: tuple[float, float],
                 x_title: str, y_title: str, x_ticks: list[float] | None = None, width: int = 500,
                 height: int = 300) -> None:
        self.name, self.width, self.height = name, width, height
        self.left, self.right, self.top, self.bottom = 64, 16, 12, 46
        self.xt, self.yt = x_ticks if x_ticks is not None else _ticks(*x_range), _ticks(*y_range)
        self.x0, self.x1 = (x_range if x_ticks is not None else (self.xt[0], self.xt[-1]))
        self.y0, self.y1 = self.yt[0], self.yt[-1]
        self.parts = [f'<svg data-chart="{name}" role="img" aria-label="{_e(title)}" viewBox="0 0 {width} {height}" '
                      f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" font-size="{FONT}">',
                      f"<title>{_e(title)}</title>"]
        for t in self.yt:
            self.parts.append(f'<line x1="{self.left}" x2="{width - self.right}" y1="{self.y(t):.1f}" '
                              f'y2="{self.y(t):.1f}" stroke="#e4e4e4"/>')
            self.parts.append(f'<text x="{self.left - 6}" y="{self.y(t) + 4:.1f}" text-anchor="end">{_num(t)}</text>')
        for t in self.xt:
            self.parts.append(f'<text x="{self.x(t):.1f}" y="{height - self.bottom + 16}" '
                              f'text-anchor="middle">{_num(t)}</text>')
        self.parts.append(f'<rect x="{self.left}" y="{self.top}" width="{width - self.left - self.right}" '
                          f'height="{height - self.top - self.bottom}" fill="none" stroke="#999"/>')
        self.parts.append(f'<text x="{(self.left + width - self.right) / 2}" y="{height - 8}" '
                          f'text-anchor="middle">{_e(x_title)}</text>')
        self.parts.append(f'<text transform="translate(14 {(self.top + height - self.bottom) / 2}) rotate(-90)" '
                          f'text-anchor="middle">{_e(y_title)}</text>')

    def x(self, v: float) -> float:
        return self.left + (v - self.x0) / (self.x1 - self.x0) * (self.width - self.left - self.right)

    def y(self, v: float) -> float:
        return self.height - self.bottom - (v - self.y0) / (self.y1 - self.y0) * (self.height - self.top - self.bottom)

    def svg(self) -> str:
        return "".join(self.parts) + "</svg>"


def _legend(items: list[tuple[str, str, str]]) -> str:
    """(colour, marker: line | dashed | dot | ring | bar, text) as an HTML legend under a chart."""
    def mark(colour: str, kind: str) -> str:
        body = {"line": f'<line x1="0" x2="18" y1="6" y2="6" stroke="{colour}" stroke-width="2"/>',
                "dashed": f'<line x1="0" x2="18" y1="6" y2="6" stroke="{colour}" stroke-width="2" '
                          'stroke-dasharray="4 3"/>',
                "dot": f'<circle cx="9" cy="6" r="4" fill="{colour}"/>',
                "ring": f'<circle cx="9" cy="6" r="4" fill="white" stroke="{colour}" stroke-width="2"/>',
                "bar": f'<rect x="2" y="1" width="14" height="10" fill="{colour}"/>'}[kind]
        return f'<svg width="18" height="12" xmlns="http://www.w3.org/2000/svg">{body}</svg>'

    return '<p class="legend">' + "".join(f"<span>{mark(c, k)} {_e(t)}</span>" for c, k, t in items) + "</p>"


def _span(values: list[float], pad: float = 0.08) -> tuple[float, float]:
    values = [v for v in values if math.isfinite(v)] or [0.0, 1.0]  # an infinite perplexity has no place on an axis
    lo, hi = min(values), max(values)
    margin = (hi - lo) * pad or abs(hi) * pad or 1.0
    return lo - margin, hi + margin


def rounds_chart(report: Report) -> str:
    """Modelled and measured speedup of every prune-measure round (and the target)."""
    rounds = report.rounds
    target = report.target_speedup
    measured: list[float | None] = [r.measured_speedup for r in rounds]
    modelled = [r.predicted_speedup for r in rounds]
    # each round's latency probes (structure only, before its solve), left of the round, in order
    probes = [(i - 0.4 + 0.3 * (k + 1) / (len(r.latency_probes) + 1), p.measured_speedup)
              for i, r in enumerate(rounds) for k, p in enumerate(r.latency_probes)]
    values = [v for v in measured + modelled + [v for _, v in probes] + [target, 1.0] if v is not None]
    plot = _Plot("rounds", "Speedup per round: modelled by the latency model and measured in ONNX Runtime",
                 (-0.5, max(len(rounds) - 0.5, 0.5)), _span(values), "round", "speedup (x dense)",
                 x_ticks=list(range(len(rounds))))
    if target is not None:
        plot.parts.append(f'<line x1="{plot.left}" x2="{plot.width - plot.right}" y1="{plot.y(target):.1f}" '
                          f'y2="{plot.y(target):.1f}" stroke="{RED}" stroke-dasharray="6 4"/>')
        plot.parts.append(f'<text x="{plot.left + 4}" y="{plot.y(target) - 5:.1f}" fill="{RED}">'
                          f'target {_num(target, 3)}x</text>')
    for series, colour, dashed, hollow in ((modelled, ORANGE, True, True), (measured, BLUE, False, False)):
        points = [(i, plot.x(i), plot.y(v), v) for i, v in enumerate(series) if v is not None]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for _, x, y, _ in points)
            dash = ' stroke-dasharray="6 4"' if dashed else ""
            plot.parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for i, x, y, v in points:
            other = (measured if series is modelled else modelled)[i]
            dy = -9 if other is None or v >= other else 17  # the higher value's label above, the other below
            fill = "white" if hollow else colour
            plot.parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{fill}" stroke="{colour}" '
                              f'stroke-width="2"><title>{_num(v, 3)}x</title></circle>')
            plot.parts.append(f'<text x="{x:.1f}" y="{y + dy:.1f}" fill="{colour}" text-anchor="middle">'
                              f"{_num(v, 3)}x</text>")
    for x, v in probes:
        plot.parts.append(f'<circle cx="{plot.x(x):.1f}" cy="{plot.y(v):.1f}" r="3.5" fill="{GREY}">'
                          f"<title>latency probe: {_num(v, 3)}x</title></circle>")
    items = [(ORANGE, "ring", "modelled (latency model)"), (BLUE, "dot", "measured (ONNX Runtime)")]
    if probes:
        items.append((GREY, "dot", "latency probes (widths only, before the solve)"))
    if target is not None:
        items.append((RED, "dashed", "target"))
    return plot.svg() + _legend(items)


def quality_chart(report: Report) -> str:
    """The metric against measured speedup: the dense model at 1x and every round; the returned one
    ringed; the accuracy budget's bound when there is one."""
    metric = report.metric
    points = [(1.0, metric.baseline, "dense")] + \
        [(r.measured_speedup, r.metric, f"round {i}") for i, r in enumerate(report.rounds)]
    points = [p for p in points if p[1] is not None and math.isfinite(p[1])]
    budget = report.measured.accuracy_budget if report.measured else None
    bound = budget.worst_allowed if budget else None
    ys = [p[1] for p in points] + ([bound] if bound is not None else [])
    name = metric.name
    plot = _Plot("quality", f"{METRIC_WORDS.get(name, name)} against measured speedup",
                 _span([p[0] for p in points] or [1.0], 0.15), _span(ys or [0.0, 1.0]),
                 "measured speedup (x dense)", name)
    if bound is not None:
        plot.parts.append(f'<line x1="{plot.left}" x2="{plot.width - plot.right}" y1="{plot.y(bound):.1f}" '
                          f'y2="{plot.y(bound):.1f}" stroke="{RED}" stroke-dasharray="6 4"/>')
        plot.parts.append(f'<text x="{plot.width - plot.right - 4}" y="{plot.y(bound) - 5:.1f}" fill="{RED}" '
                          f'text-anchor="end">accuracy budget {_num(bound)}</text>')
    chosen = report.chosen_round()
    for index, (x, y, label) in enumerate(points):
        colour = GREY if label == "dense" else BLUE
        plot.parts.append(f'<circle cx="{plot.x(x):.1f}" cy="{plot.y(y):.1f}" r="5" fill="{colour}">'
                          f"<title>{_e(label)}: {_num(x, 3)}x, {name} {_num(y)}</title></circle>")
        if chosen is not None and index == chosen + 1:
            plot.parts.append(f'<circle cx="{plot.x(x):.1f}" cy="{plot.y(y):.1f}" r="9" fill="none" '
                              f'stroke="{GREEN}" stroke-width="2"/>')
        plot.parts.append(f'<text x="{plot.x(x) + 9:.1f}" y="{plot.y(y) - 7:.1f}">{_e(label)}</text>')
    items = [(GREY, "dot", "dense model"), (BLUE, "dot", "round"), (GREEN, "ring", "returned")]
    if bound is not None:
        items.append((RED, "dashed", "accuracy budget"))
    return plot.svg() + _legend(items)


def _hbars(name: str, title: str, rows: list[tuple[str, float, str]], colour: str, scale_max: float,
           axis_title: str, bar_width: int = 360) -> str:
    """Horizontal bars with their labels at full length (up to 70 characters, the middle elided beyond,
    the full name as a tooltip) and the value written after each bar."""
    limit = 70
    label_w = int(min(limit, max((len(r[0]) for r in rows), default=4)) * CHAR_W) + 12
    value_w = int(max((len(r[2]) for r in rows), default=4) * CHAR_W) + 16
    row_h, top = 18, 6
    width, height = label_w + bar_width + value_w, top + row_h * len(rows) + 36
    parts = [f'<svg data-chart="{name}" role="img" aria-label="{_e(title)}" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" font-size="{FONT}">',
             f"<title>{_e(title)}</title>"]
    scale_max = scale_max or 1.0
    for i, (label, value, text) in enumerate(rows):
        y = top + i * row_h
        length = max(0.0, min(1.0, value / scale_max)) * bar_width
        parts.append(f'<text x="{label_w - 8}" y="{y + 13}" text-anchor="end"><title>{_e(label)}</title>'
                     f"{_e(_label(label, limit))}</text>")
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{bar_width}" height="{row_h - 4}" fill="#f0f0f0"/>')
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{length:.1f}" height="{row_h - 4}" fill="{colour}">'
                     f"<title>{_e(label)}: {_e(text)}</title></rect>")
        parts.append(f'<text x="{label_w + bar_width + 6}" y="{y + 13}">{_e(text)}</text>')
    base = top + row_h * len(rows) + 4
    for t in _ticks(0, scale_max, 4):
        if t <= scale_max * 1.0001:
            x = label_w + t / scale_max * bar_width
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{base}" stroke="#ccc"/>')
            parts.append(f'<text x="{x:.1f}" y="{base + 13}" text-anchor="middle">{_num(t)}</text>')
    parts.append(f'<text x="{label_w + bar_width / 2}" y="{height - 4}" text-anchor="middle">{_e(axis_title)}</text>')
    return "".join(parts) + "</svg>"


def latency_chart(report: Report) -> str:
    m = report.measured
    rows = [] if m is None else [
        ("dense, median", m.baseline_latency_ms), ("dense, p90", m.latency_p90_ms.get("baseline")),
        ("compressed, median", m.compressed_latency_ms), ("compressed, p90", m.latency_p90_ms.get("compressed"))]
    rows = [(label, value) for label, value in rows if value is not None]
    top = max((v for _, v in rows), default=1.0)
    svg = _hbars("latency", "Latency in ONNX Runtime, median and p90 (ms)",
                 [(label, value, f"{value:.2f} ms") for label, value in rows], BLUE, top * 1.05, "milliseconds")
    return svg.replace(f'fill="{BLUE}"><title>dense', f'fill="{GREY}"><title>dense')


def width_chart(report: Report) -> str:
    rows = [(r.name, r.width_after / r.width_before if r.width_before else 0.0,
             f"{r.width_after}/{r.width_before} {UNIT_WORDS.get(r.kind, 'channels').split(' (')[0]}")
            for r in report.layers]
    return _hbars("widths", "Kept width per layer (fraction of the dense width)", rows, BLUE, 1.0,
                  "fraction kept")


def error_chart(report: Report) -> str:
    rows = [(r.name, float(r.relative_error), _num(r.relative_error)) for r in report.layers]
    top = max((v for _, v, _ in rows), default=0.0)
    return _hbars("errors", "Relative output error per layer, ||X(W_dense - W)||^2 / ||X W_dense||^2", rows, ORANGE,
                  top * 1.05 or 1.0, "relative error")


def _seen(report: Report, field: str) -> str | None:
    """A reference as the job saw it (a resolved path)."""
    return report.measured.eval if field == "eval" and report.measured else getattr(report, field, None)


def _given(report: Report, field: str) -> str | None:
    """A reference as the user gave it (report.references), else as the job saw it."""
    given = (report.references or {}).get(field)
    return given or _seen(report, field)


def _shape_words(shape: dict | None) -> str:
    if not shape:
        return "-"
    return " x ".join(f"{k} {v}" for k, v in shape.items())


def _budget_words(report: Report) -> str:
    if report.measured is None:
        return "-"
    budget = report.measured.accuracy_budget
    if budget is None:
        return "none (turned off)"
    return f"{budget.rule} ({budget.bound})" + (", the default rule" if budget.default else "")


def _mode_words(report: Report) -> str:
    if report.target_speedup is not None:
        return f"a measured speedup of {_num(report.target_speedup, 3)}x"
    if report.uniform_ratio is not None:
        return f"{report.uniform_ratio:.0%} of every layer's groups removed (uniform ratio)"
    return "the widths of an earlier report"


def summary_sentence(report: Report) -> str:
    status, metric, m = report.status, report.metric, report.measured
    name = metric.name
    # "ok" without a target (a uniform ratio, another report's widths) met no target: it ran and held its checks
    words = "Done" if status == "ok" and report.target_speedup is None else STATUS_WORDS.get(status, status)
    text = (f"<strong>{_e(words)}.</strong> {_e(_given(report, 'model'))} was pruned "
            f"with {_e(report.method)} asking for {_e(_mode_words(report))}")
    if m is not None:
        text += (f"; in ONNX Runtime it runs <strong>{m.measured_speedup:.2f}x</strong> as fast as the dense "
                 f"model ({m.baseline_latency_ms:.2f} ms → {m.compressed_latency_ms:.2f} ms, median)")
    if metric.compressed is not None:
        text += (f", and its {_e(METRIC_WORDS.get(name, name))} went from {_num(metric.baseline)} to "
                 f"{_num(metric.compressed)}")
        also = [f"{_e(METRIC_WORDS.get(other, other))} {_num(values['compressed'])}"
                for other, values in (metric.secondary or {}).items()]
        if also:
            text += f" ({', '.join(also)})"
        held = report.evaluation or {}
        if held.get("evaluation"):
            text += f" on {held['evaluation']} unseen {_e(held.get('unit', 'inputs'))}"
    return text + "."


def _table(rows: list[tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows if v not in (None, "")) + \
        "</table>"


def _inputs(report: Report) -> list[tuple[str, Any]]:
    rows = []
    kind = report.kind
    for field, words in (("model", "model"), ("calibration", "calibration data"), ("eval", "evaluation data")):
        given = _given(report, field)
        if given:
            seen = _seen(report, field)
            rows.append((words, f"<code>{_e(given)}</code>" +
                         (f" <span class=dim>(read from <code>{_e(seen)}</code>)</span>" if seen and seen != given
                          else "")))
    if kind.samples:
        rows.append(("calibration used", f"{kind.samples} images, seed {report.seed}"))
    elif kind.sequences:
        shortest, longest = kind.min_sequence_length, kind.sequence_length
        lengths = f"{shortest}-{longest}" if shortest and shortest != longest else f"up to {longest}"
        rows.append(("calibration used", f"{kind.sequences} sequences of {lengths} tokens, seed {report.seed}"))
    if kind.removed_blocks:
        names = ", ".join(f"<code>{_e(name)}</code>" for name in kind.removed_blocks)
        rows.append(("residual blocks removed", f"{len(kind.removed_blocks)}: {names}"))
    return rows


def _outputs(report: Report) -> list[tuple[str, Any]]:
    artifacts = report.artifacts
    rows = []
    if artifacts.onnx:
        rows.append(("ONNX model", f"<code>{_e(artifacts.onnx)}</code> (parity with PyTorch checked: peak error "
                                   f"{_num((artifacts.parity or {}).get('peak_error'), 2)})"))
    graph = report.measured.onnx_graph if report.measured is not None else None
    if graph:
        rows.append(("ONNX Runtime fusions", _fusion_words(graph)))
    model = artifacts.model
    serving = artifacts.serving or {}
    if model == "model/" and serving.get("trust_remote_code"):
        rows.append(("pruned model", "<code>model/</code>, a Hugging Face directory whose layers kept unequal "
                                     "widths: transformers loads it with <code>trust_remote_code=True</code> (its "
                                     "<code>modeling_osscar.py</code>), or "
                                     "<code>compressor.transformer.surgery.load_pruned</code>"))
    elif model == "model/":
        rows.append(("pruned model", "<code>model/</code>, a Hugging Face directory that transformers loads by "
                                     "itself, unless it holds <code>osscar_widths.json</code> (widths its config "
                                     "cannot say): then <code>compressor.transformer.surgery.load_pruned</code>"))
    elif model:
        rows.append(("pruned model", f"<code>{_e(model)}</code> (a torch.export program)"))
    if serving.get("onnx"):
        stacks = f"Optimum's <code>{_e(serving.get('optimum', 'ORTModel'))}</code>"
        if serving.get("sentence_transformers"):
            stacks = f"sentence-transformers (<code>backend=\"onnx\"</code>) and {stacks}"
        where = ("beside its config" if serving["onnx"] == "model.onnx"
                 else f"as <code>{_e(serving['onnx'])}</code>")
        rows.append(("for serving", f"model.onnx {where}, where {stacks} reads it"))
    if artifacts.decode_step:
        rows.append(("decode step", f"<code>{_e(artifacts.decode_step.get('path', 'decode.onnx'))}</code>"))
    rows.append(("report", "<code>report.json</code> (every number on this page) and this page"))
    if report.params_before and report.measured is not None:
        before, after = report.params_before, report.measured.params_after
        rows.append(("parameters", f"{before:,} → {after:,} ({1 - after / before:.1%} fewer)"))
    return rows


def _fusion_words(graph: dict) -> str:
    """Which fused kernels the shipped graph and the dense baseline use, and the speedup as exported."""
    def words(entry: dict) -> str:
        if entry.get("fallback"):
            return f"none ({_e(entry['fallback'])})"
        fused = entry.get("fusions") or {}
        return ", ".join(f"{_e(name)} {count}" for name, count in fused.items()) or "none"

    text = (f"model.onnx: {words(graph['compressed'])}; the dense baseline it was timed against: "
            f"{words(graph['dense'])}")
    raw = graph.get("as_exported")
    if raw:
        text += (f". Both as exported, unfused: {raw['baseline_ms']:.2f} ms → {raw['compressed_ms']:.2f} ms "
                 f"({raw['speedup']:.2f}x)")
    return text


def _settings(report: Report) -> list[tuple[str, Any]]:
    m, kind = report.measured, report.kind
    rows: list[tuple[str, Any]] = [
        ("asked for", _e(_mode_words(report))),
        ("method", _e(report.method)),
        ("accuracy budget", _e(_budget_words(report))),
        ("measured on", _e(f"ONNX Runtime {report.execution_provider} provider on "
                           f"{m.device if m else '?'}, {m.threads if m else '?'} threads, {report.precision}")),
        ("measured input", _e(_shape_words(m.shape if m else None))),
    ]
    recon = m.block_reconstruction if m else None
    if recon:
        fewest = recon.get("steps_min", recon["steps"])  # reports before per-block lengths: one count
        steps = f"{recon['steps']}" if fewest == recon["steps"] else f"{fewest}-{recon['steps']}"
        rows.append(("block reconstruction", _e(f"{steps} steps per block; kept in {recon['blocks_kept']} of "
                                                f"{recon['blocks']} blocks ({recon['seconds']:.0f} s)")))
    whole = kind.model_reconstruction
    if whole:
        outcome = "kept" if whole["kept"] else "not kept (no better on the held-out windows)"
        windows = f" through {whole['windows']} windows" if whole.get("windows") else ""
        rows.append(("whole-model fit", _e(f"{whole['steps']} steps{windows}, held-out error {whole['before']:.4f} "
                                           f"-> {whole['after']:.4f}, {outcome} ({whole['seconds']:.0f} s)")))
    if kind.samples is not None:
        steps = f", {kind.refine_steps} reconstruction steps" if kind.refine_steps is not None else ""
        rows.append(("calibration", _e(f"{kind.samples} images{steps}")))
    rows.append(("time", _e(f"{report.elapsed_s:.0f} s" + (f": {_stage_words(report)}" if report.stages else ""))))
    if report.versions:
        rows.append(("versions", _e(", ".join(f"{k} {v}" for k, v in report.versions.items()))))
    return rows


def _stage_words(report: Report) -> str:
    """Where the time went: each stage's seconds summed over its rounds, in the order the stages first ran."""
    total: dict[str, float] = {}
    rounds: dict[str, set[int]] = {}
    for t in report.stages or []:
        total[t.stage] = total.get(t.stage, 0.0) + t.seconds
        rounds.setdefault(t.stage, set()).add(t.round)
    return ", ".join(f"{name} {seconds:,.0f} s" + (f" ({len(rounds[name])} rounds)" if len(rounds[name]) > 1 else "")
                     for name, seconds in total.items())


def depth_section(report: Report) -> str:
    """Which whole blocks went and why: the options the depth plan weighed (target mode), else the blocks
    --remove-blocks named; empty when the model kind has no depth to plan."""
    kind = report.kind
    # conv graphs' blocks, transformers' layers
    removed = kind.removed_blocks if kind.removed_blocks is not None else kind.removed_layers
    depth = kind.depth
    if removed is None and depth is None:
        return ""
    if depth is None:
        why = "chosen by --remove-blocks" if removed else "none removed (--remove-blocks 0 or not target mode)"
        return f"<h2>Depth</h2><p>Blocks removed: {_e(', '.join(removed) or 'none')} ({_e(why)}).</p>"
    rows = "".join(
        f"<tr><td>{o['blocks']}</td><td>{_e(o['last'] or '')}</td>"
        f"<td>{_num(o['depth_speedup'], 3)}x{'' if o.get('measured', True) else ' (modelled)'}</td>"
        f"<td>{o['width_saving']:.1%}</td><td>{_num(o['depth_loss'])}</td>"
        f"<td>{_num(o['width_loss'])}</td><td>{_num(o['loss'])}{' <strong>(chosen)</strong>' if o['chosen'] else ''}"
        "</td></tr>"
        for o in depth["options"])
    tried = depth.get("tried") or []
    replanned = (f" The rounds tried {', then '.join(map(str, tried))} blocks removed: the rounds of a plan that all "
                 "fell below the accuracy budget made the next plan by planned loss run, and those that stayed within "
                 "it but short of the target the next that removes more." if len(tried) > 1 else "")
    trials = depth.get("trials") or []
    tie = ("" if not trials else f" Options planned within {depth['tie']:.0%} of each other were each solved without "
           "the fit and scored, the best first: " + "; ".join(
               f"{t['blocks']} blocks, {t['measured_speedup']:.3f}x, {_num(t['metric'])}"
               + (" (run first)" if t["chosen"] else "") for t in trials) + ".")
    gone = ", ".join(removed or []) or "none"
    return (f"<h2>Depth</h2><p>Blocks removed: {_e(gone)}. How: {_e(depth['rule'])}"
            f" (planned for {depth['aim']:.3f}x).{_e(tie)}{_e(replanned)}</p><div class='scroll'><table><tr>"
            "<th>blocks removed</th><th>last block</th><th>speedup without them</th>"
            "<th>widths still remove</th>"
            f"<th>depth loss</th><th>width loss</th><th>planned loss</th></tr>{rows}</table></div>")


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#222}
h1{font-size:1.5em;word-break:break-all}h2{font-size:1.15em;margin-top:1.6em}
td,th{padding:3px 10px;text-align:left;vertical-align:top}th{font-weight:600;color:#444}
table{border-collapse:collapse}tr:nth-child(even){background:#f6f6f6}code{font-size:.95em}
.dim{color:#777}.legend span{margin-right:1.4em;white-space:nowrap}.legend svg{vertical-align:middle}
.charts{display:flex;flex-wrap:wrap;gap:1.5em}.charts figure{margin:0;max-width:520px}
.legend{font-size:.9em}.layers figure{margin:0 0 1em}figcaption{font-weight:600;margin:.4em 0}
.bad{color:#b3261e}.scroll{overflow-x:auto}"""


def render(report: Report) -> str:
    status = report.status
    warnings = report.measured.warnings if report.measured else []
    notice = ""
    if status != "ok":
        notice = f'<p class="bad">{_e(report.message)}</p>'
    if warnings:
        notice += "<ul>" + "".join(f'<li class="bad">{_e(w)}</li>' for w in warnings) + "</ul>"
    layers = "".join(
        f"<tr><td>{_e(r.name)}</td><td>{_e(UNIT_WORDS.get(r.kind, r.kind))}</td>"
        f"<td>{r.width_before}</td><td>{r.width_after}</td><td>{_num(r.relative_error)}</td>"
        f"<td>{_num(r.objective, 6)}</td><td>{_e(r.rows or '')}</td></tr>" for r in report.layers)
    figure = "<figure><figcaption>{}</figcaption>{}</figure>".format
    charts = (figure("Rounds: modelled and measured speedup", rounds_chart(report)) +
              figure("Quality against measured speedup", quality_chart(report)) +
              figure("Latency (ONNX Runtime)", latency_chart(report)))
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>osscar report: {_e(_given(report, 'model'))}</title><style>{STYLE}</style></head><body>
<h1>Compression report: {_e(_given(report, 'model'))}</h1>
<p>{summary_sentence(report)}</p>{notice}
<h2>What went in</h2>{_table(_inputs(report))}
<h2>What came out</h2>{_table(_outputs(report))}
<h2>Settings</h2>{_table(_settings(report))}
{depth_section(report)}
<h2>Charts</h2><div class="charts">{charts}</div>
<h2>Per layer</h2><div class="layers">
{figure("Kept width", '<div class="scroll">' + width_chart(report) + "</div>")}
{figure("Relative error", '<div class="scroll">' + error_chart(report) + "</div>")}</div>
<h2>Layers</h2><div class="scroll">
<table><tr><th>layer</th><th>unit</th><th>before</th><th>after</th><th>relative error</th><th>objective</th>
<th>rows kept</th></tr>
{layers}</table></div></body></html>
"""


def write_html(report: Report, path: Path) -> None:
    write_text_atomically(path, render(report))


def record_references(out: Path, report: Report, references: dict[str, str],
                      redact: Callable[[Any], Any] | None = None) -> Report:
    """Add the references as the user gave them (`embedded:...`, `blob:...`, a relative path: what the job
    itself sees as resolved paths) to the report in `out`: report.json's `references` and report.html's
    title and inputs. `redact` (a server's): the report's JSON with the server's paths replaced in every string
    (its fields, warnings and messages), the inputs named as given. Returns the updated report. A no-op when the
    job wrote no report.html (parity_failed keeps only report.json, which gets them too)."""
    given = {k: str(v) for k, v in references.items() if v is not None}
    report = dataclasses.replace(report, references=given)
    if redact is not None:
        report = Report.from_json(redact(report.to_json()))
    if (out / "report.json").is_file():
        write_text_atomically(out / "report.json", json.dumps(report.to_json(), indent=2))
    if (out / "report.html").is_file():
        write_html(report, out / "report.html")
    return report
