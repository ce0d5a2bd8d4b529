"""The model kinds: progress (the dense statistics pass says it takes statistics, a pruning pass is passed
through as the pipeline says it) and what each kind refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressor.errors import InputError
from compressor.layerstats import LayerObservation
from service.job.kinds import TextJob, _statistics_pass
from service.job.request import CompressRequest


def _observation(name: str, kind: str, rows: int, group: int) -> LayerObservation:
    return LayerObservation(name, kind, torch.eye(rows), torch.zeros(rows, 2), group, 1.0, 1.0)


def test_the_statistics_pass_turns_solve_lines_into_statistics_lines():
    said, observed = [], []
    progress, observe = _statistics_pass(0.0, observed.append, said.append)
    for obs, line in ((_observation("model.layers.0.self_attn.o_proj", "attention_heads", 32, 4),
                       "[1/2] model.layers.0.self_attn.o_proj: 8 -> 8 attention_heads, relative error 0.0000"),
                      (_observation("model.layers.0.mlp.down_proj", "ffn_neurons", 20, 1),
                       "[1/2] model.layers.0.mlp.down_proj: 20 -> 20 ffn_neurons, relative error 0.0000"),
                      (_observation("layer1.0.conv2", "conv", 16 * 9, 9),
                       "[2/2] layer1.0.conv2: 16 -> 16 channels, relative error 0.0000 (0.1s)")):
        observe(obs)
        progress(line)
    progress("a stage line")
    assert said == ["[1/2] model.layers.0.self_attn.o_proj: statistics of 8 heads",
                    "[1/2] model.layers.0.mlp.down_proj: statistics of 20 FFN neurons",
                    "[2/2] layer1.0.conv2: statistics of 16 channels", "a stage line"]
    assert [o.name for o in observed] == ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj",
                                          "layer1.0.conv2"]  # the caller's observer sees every layer


def test_a_pruning_pass_reports_as_the_pipeline_says():
    said = []
    for plan, observer in ((0.5, None), ({"a": 4}, None), (0.5, lambda obs: None), (0.0, None)):
        progress, observe = _statistics_pass(plan, observer, said.append)
        assert progress == said.append and observe is observer


def test_removing_blocks_is_refused_for_a_transformer_before_it_is_loaded(tmp_path):
    request = CompressRequest(model=str(tmp_path / "not-loaded"), uniform_ratio=0.5,
                              calibration=tmp_path / "cal.txt", remove_blocks=2)
    with pytest.raises(InputError, match="--remove-blocks is for conv graphs"):
        TextJob(request, print)


def test_agreement_with_a_dense_model_that_predicts_one_class_is_flagged():
    """Top-1 agreement says little when the dense model predicts one class for nearly every held-out image
    (any model predicting that class agrees): the job warns; spread predictions raise nothing."""
    from types import SimpleNamespace

    from service.job.kinds import ConvJob, Metric, agreement

    job = SimpleNamespace(metric=Metric("agreement", True))
    one_class = np.tile([0.1, 3.0, 0.2], (100, 1))
    one_class[:5, 0] = 5.0
    (warning,) = ConvJob.baseline_warnings(job, one_class)
    assert "predicts class 1 for 95% of the 100 held-out images" in warning
    spread = np.eye(3)[np.arange(99) % 3]
    assert ConvJob.baseline_warnings(job, spread) == []
    assert agreement(spread[::-1], spread) == pytest.approx(33 / 99)
    assert ConvJob.baseline_warnings(SimpleNamespace(metric=Metric("cosine", True)), one_class) == []
