"""Quiet, truthful logs: a small job prints no warning caused by our own calls, third-party noise is dropped
only where it is logged (by logger and message), and the dense statistics pass says it takes statistics."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from service.logs import drop_irrelevant
from tests.compressor.cnn.conv_models import write_conv_job

from .server_process import ROOT


def test_only_the_irrelevant_torchvision_record_is_dropped(caplog):
    drop_irrelevant()
    drop_irrelevant()  # idempotent: one filter
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    assert len(registration.filters) == 1
    with caplog.at_level(logging.WARNING):
        registration.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
        registration.warning("something else about %s", "torchvision::nms")
        logging.getLogger("service.test").warning("torchvision is not installed. (ours: kept)")
    assert [r.getMessage() for r in caplog.records] == ["something else about torchvision::nms",
                                                        "torchvision is not installed. (ours: kept)"]


def test_the_axis_name_warning_is_dropped_only_when_both_names_are_the_same():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drop_irrelevant()
        for other in ("batch", "sequence"):
            warnings.warn(f"# The axis name: batch will not be used, since it shares the same shape constraints "
                          f"with another axis: {other}.", UserWarning, stacklevel=1)
    assert [str(w.message).rsplit(" ", 1)[-1] for w in caught] == ["sequence."]


@pytest.fixture(scope="module")
def job_stderr(tmp_path_factory) -> str:
    """stderr of a whole small job (statistics pass, one round, export, save) in a subprocess, as a user
    sees it (no warning filters of the test runner)."""
    root = write_conv_job(tmp_path_factory.mktemp("quiet"), size=32)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    result = subprocess.run([sys.executable, "-m", "service.client.cli", "compress", str(root / "model.pt2"),
                             "--target-speedup", "1.2", "--max-rounds", "1", "--calibration", str(root / "cal.npz"),
                             "--samples", "16", "--repeats", "15", "--accuracy-budget", "none",
                             "--refine-steps", "20",  # the fit's lines with a short fit (the default: 3,000 steps)
                             "--out", str(root / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode in (0, 2), result.stderr  # met or not: the logs are what this is about
    assert (Path(root / "out") / "report.json").is_file()
    return result.stderr


def test_a_job_prints_no_warning_of_our_own_calls(job_stderr):
    for noise in ("in training mode", "torchvision is not installed", "LeafSpec", "will not be used, since it "
                  "shares the same shape constraints", "Traceback"):
        assert noise not in job_stderr


def test_the_statistics_pass_reports_statistics_not_a_prune(job_stderr):
    lines = job_stderr.splitlines()
    start = lines.index("dense statistics pass: loss-versus-width curve of every layer")
    stats = [line for line in lines[start + 1:] if line.startswith("[")][:5]
    assert [re.sub(r"\[\d/5\] \S+: ", "", line) for line in stats] == [
        "statistics of 16 channels", "statistics of 12 channels", "statistics of 12 channels",
        "statistics of 8 channels", "statistics of 8 channels"]
    assert [line.split("]")[0] + "]" for line in stats] == [f"[{i}/5]" for i in range(1, 6)]
    unchanged = re.compile(r": (\d+) -> \1 channels, relative error 0\.0000")
    end = next((k for k in range(start + 1, len(lines)) if not lines[k].startswith("[")), len(lines))
    # the statistics pass "prunes" no layer to its own width at no error (a round may keep a layer whole: its line)
    assert not any(unchanged.search(line) for line in lines[start + 1:end])
