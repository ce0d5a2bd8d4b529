"""Latency measurement in ONNX Runtime: samples long enough to time a millisecond model."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from exporters.runtime import MIN_SAMPLE_MS, measure_latency


def _matmul_model(path, width: int) -> None:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [width, width], np.ones(width * width, np.float32))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "m",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, width])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_a_fast_model_is_timed_in_blocks_of_runs(tmp_path):
    _matmul_model(tmp_path / "a.onnx", 64)
    feed = {"x": np.ones((4, 64), np.float32)}
    _matmul_model(tmp_path / "c.onnx", 64)
    latency = measure_latency(tmp_path / "a.onnx", tmp_path / "c.onnx", feed, threads=1, repeats=5)
    # a 64 x 64 matmul takes microseconds: one sample is many runs, and each time is per run
    assert latency.runs_per_sample > 10
    assert latency.baseline_ms < MIN_SAMPLE_MS / 10 and latency.compressed_ms < MIN_SAMPLE_MS / 10
    assert latency.repeats == 5 and latency.speedup > 0
