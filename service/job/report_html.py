"""report.html: the report.json of a job for people — summary, per-layer widths and losses, latency
and quality — as one self-contained file (inline SVG, no scripts, no network)."""

from __future__ import annotations

import html
from pathlib import Path

from ..files import write_text_atomically


def _bars(rows: list[tuple[str, float, float]], width: int = 640, height: int = 14) -> str:
    """Horizontal bars: kept fraction of each layer (label, kept, before)."""
    out = [f'<svg width="{width}" height="{(height + 4) * len(rows) + 4}" xmlns="http://www.w3.org/2000/svg">']
    for i, (label, kept, before) in enumerate(rows):
        y = 4 + i * (height + 4)
        frac = kept / before if before else 0
        out.append(f'<rect x="260" y="{y}" width="{(width - 300) * frac:.1f}" height="{height}" fill="#4878a8"/>')
        out.append(f'<rect x="260" y="{y}" width="{width - 300}" height="{height}" fill="none" stroke="#999"/>')
        out.append(f'<text x="255" y="{y + height - 3}" font-size="11" text-anchor="end">{html.escape(label)}</text>')
        out.append(f'<text x="{width - 35}" y="{y + height - 3}" font-size="11">{int(kept)}/{int(before)}</text>')
    out.append("</svg>")
    return "".join(out)


def _budget(budget: dict | None) -> str:
    if budget is None:
        return "none"
    return f"{budget['rule']} ({budget['bound']}){', the default' if budget['default'] else ''}"


def render(report: dict) -> str:
    metric = report["metric"]
    summary = [
        ("status", report["status"]),
        ("target speedup", report["target_speedup"]),
        ("uniform ratio", report["uniform_ratio"]),
        ("measured speedup", f"{report['measured_speedup']:.3f}x"),
        ("latency (median)", f"{report['baseline_latency_ms']:.2f} ms -> {report['compressed_latency_ms']:.2f} ms"),
        ("execution provider / device", f"{report['execution_provider']} / {report['device']}"),
        ("shape", report["shape"]),
        (metric["name"], f"{metric['baseline']:.4f} -> {metric['compressed']:.4f} "
                         f"(relative drop {metric['relative_drop']:.2%})"),
        ("parameters", f"{report['params_before']:,} -> {report['params_after']:,}"),
        ("method", report["method"]),
        ("accuracy budget", _budget(report.get("accuracy_budget"))),
        ("elapsed", f"{report['elapsed_s']:.1f} s"),
    ]
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary)
    layers = "".join(
        f"<tr><td>{html.escape(r['name'])}</td><td>{r['kind']}</td><td>{r['width_before']}</td>"
        f"<td>{r['width_after']}</td><td>{r['relative_error']:.4g}</td><td>{r['objective']:.6g}</td></tr>"
        for r in report["layers"])
    def modelled(r: dict) -> str:
        return "" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.3f}x"

    rounds = "".join(
        f"<tr><td>{i}</td><td>{r['measured_speedup']:.3f}x</td><td>{modelled(r)}</td><td>{r['metric']:.4f}</td></tr>"
        for i, r in enumerate(report.get("rounds", [])))
    bars = _bars([(r["name"], r["width_after"], r["width_before"]) for r in report["layers"]])
    warn = ""
    if report["status"] != "ok" or metric["relative_drop"] > 0.05:
        warn = (f'<p style="color:#b00;font-weight:bold">{html.escape(report["status"])}: {metric["name"]} '
                f'drops {metric["relative_drop"]:.1%} against the dense model</p>')
        if report.get("message"):
            warn += f'<p>{html.escape(report["message"])}</p>'

    return f"""<!doctype html><html><head><meta charset="utf-8"><title>osscar report</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 8px;text-align:left}}
table{{border-collapse:collapse}}tr:nth-child(even){{background:#f4f4f4}}</style></head><body>
<h1>Compression report: {html.escape(str(report['model']))}</h1>{warn}
<table>{rows}</table>
<h2>Rounds (prune, export, measure)</h2>
<table><tr><th>round</th><th>measured</th><th>modelled</th><th>{metric['name']}</th></tr>{rounds}</table>
<h2>Kept width per layer</h2>{bars}
<h2>Layers</h2>
<table><tr><th>layer</th><th>kind</th><th>before</th><th>after</th><th>relative error</th><th>objective</th></tr>
{layers}</table></body></html>
"""


def write_html(report: dict, path: Path) -> None:
    write_text_atomically(path, render(report))
