"""The model kinds: progress (the dense statistics pass says it takes statistics, a pruning pass is passed
through as the pipeline says it) and what each kind refuses."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from compressor.errors import InputError
from compressor.progress import SOLVE, STATISTICS, Progress
from service.job.kinds import ConvJob, TextJob, _relay, _statistics_pass
from service.job.progress import render
from service.job.request import CompressRequest


def test_the_statistics_pass_turns_solve_records_into_statistics_records():
    """The dense statistics pass (ratio 0 with an observer) prunes nothing: each layer's SOLVE record says
    what the pass did, and reads as such."""
    said: list = []
    assert _statistics_pass(0.0, lambda obs: None) and not _statistics_pass(0.0, None)
    assert not _statistics_pass(0.5, lambda obs: None) and not _statistics_pass({"a": 4}, lambda obs: None)
    progress = _relay(True, said.append)
    for unit, kind, groups, position in (("model.layers.0.self_attn.o_proj", "attention_heads", 8, (1, 2)),
                                         ("model.layers.0.mlp.down_proj", "ffn_neurons", 20, (1, 2)),
                                         ("layer1.0.conv2", "conv_channels", 16, (2, 2))):
        progress(Progress(SOLVE, unit, *position, kind=kind, numbers={
            "width_before": groups, "width_after": groups, "relative_error": 0.0, "seconds": 0.1}))
    progress("a stage line")
    assert [render(r) if isinstance(r, Progress) else r for r in said] == [
        "[1/2] model.layers.0.self_attn.o_proj: statistics of 8 heads",
        "[1/2] model.layers.0.mlp.down_proj: statistics of 20 FFN neurons",
        "[2/2] layer1.0.conv2: statistics of 16 channels", "a stage line"]
    assert [r.stage for r in said[:3]] == [STATISTICS] * 3


def test_a_pruning_pass_reports_as_the_pipeline_says():
    said: list = []
    assert _relay(False, said.append) == said.append


def test_removing_blocks_is_refused_for_a_transformer_before_it_is_loaded(tmp_path):
    request = CompressRequest(model=str(tmp_path / "not-loaded"), uniform_ratio=0.5,
                              calibration=tmp_path / "cal.txt", remove_blocks=2)
    with pytest.raises(InputError, match="--remove-blocks is for conv graphs"):
        TextJob(request, print)


def test_agreement_with_a_dense_model_that_predicts_one_class_is_flagged():
    """Top-1 agreement says little when the dense model predicts one class for nearly every held-out image
    (any model predicting that class agrees): the job warns; spread predictions raise nothing."""
    from types import SimpleNamespace

    from service.job.budgets import Metric
    from service.job.kinds import agreement

    job = SimpleNamespace(metric=Metric("agreement", True))
    one_class = np.tile([0.1, 3.0, 0.2], (100, 1))
    one_class[:5, 0] = 5.0
    (warning,) = ConvJob.baseline_warnings(job, one_class)
    assert "predicts class 1 for 95% of the 100 held-out images" in warning
    spread = np.eye(3)[np.arange(99) % 3]
    assert ConvJob.baseline_warnings(job, spread) == []
    assert agreement(spread[::-1], spread) == pytest.approx(33 / 99)
    assert ConvJob.baseline_warnings(SimpleNamespace(metric=Metric("cosine", True)), one_class) == []


def test_the_depth_order_never_removes_every_layer():
    """A two-layer model whose cheapest moves lie in both layers: the order takes one layer and the other's
    sub-layer alone, never both layers (a depth plan that removed them crashed the job: "leaves no model")."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    job = TextJob.__new__(TextJob)
    job.dense = transformers.LlamaForCausalLM(config).eval()
    job.tokens = 16
    job._removal_losses = {"model.layers.1": 0.1, "model.layers.0": 0.2, "model.layers.0.self_attn.o_proj": 0.3,
                           "model.layers.0.mlp.down_proj": 0.4, "model.layers.1.self_attn.o_proj": 0.5,
                           "model.layers.1.mlp.down_proj": 0.6}
    order = [name for name, _ in job.depth_order()]
    assert order[0] == "model.layers.1" and "model.layers.0" not in order
    assert len([n for n in order if n.startswith("model.layers.0.")]) == 1  # the second would empty the model
    whole, _ = job._split(order)
    assert len(whole) < 2


def test_the_depth_order_leaves_a_decoder_one_attention():
    """A decoder without any attention reads no context (and its empty cache gives decoded tokens position 0)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    job = TextJob.__new__(TextJob)
    job.dense, job.tokens, job.causal = transformers.LlamaForCausalLM(config).eval(), 16, True
    job._removal_losses = {"model.layers.0.self_attn.o_proj": 0.1, "model.layers.1.self_attn.o_proj": 0.2,
                           "model.layers.1": 0.3, "model.layers.0.mlp.down_proj": 0.4}
    order = [name for name, _ in job.depth_order()]
    assert order == ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"]
    with pytest.raises(InputError, match="every attention would be gone"):
        job.remove(["model.layers.0.self_attn.o_proj", "model.layers.1"])


def test_the_depth_order_leaves_a_hybrid_decoder_one_softmax_attention(tmp_path):
    """Qwen3.5's and Qwen3-Next's linear-attention layers read context, but transformers runs their cache only beside
    an attention layer (its masks are sized by one): the last attention layer stays, whichever way it would go."""
    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.sublayers import ATTENTION, check_removable
    from compressor.transformer.surgery import check_removable_layers

    from ...compressor.transformer.transformer_models import tiny_qwen3_5

    job = TextJob.__new__(TextJob)
    job.dense = tiny_qwen3_5(("linear_attention", "full_attention", "linear_attention"))
    job.tokens, job.causal = 16, True
    job._removal_losses = {"model.layers.1": 0.1, "model.layers.1.self_attn.o_proj": 0.1, "model.layers.0": 0.2,
                           "model.layers.2.mlp.down_proj": 0.3}
    assert [name for name, _ in job.depth_order()] == ["model.layers.0", "model.layers.2.mlp.down_proj"]
    with pytest.raises(InputError, match="a hybrid one's cache does not run in transformers"):
        job.remove(["model.layers.1"])
    with pytest.raises(UnsupportedArchitecture, match="no attention beside its linear-attention layers"):
        check_removable_layers(job.dense, [1, 2])
    with pytest.raises(UnsupportedArchitecture, match="the last one beside linear-attention layers"):
        check_removable(job.dense, 1, ATTENTION)


def test_a_transformers_depth_units_cost_their_share_of_the_multiply_adds():
    """What a depth plan models a transformer's options by (`removed_cost`): each layer its equal share, a layer's
    attention and FFN together the layer's, and the attention's share growing with the measured sequence length
    (its scores and weighted sum are per pair of tokens)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    job = TextJob.__new__(TextJob)
    job.dense = transformers.LlamaForCausalLM(config).eval()
    attention, ffn = "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"
    job.tokens = 16
    assert job.removed_cost(["model.layers.1"]) == pytest.approx(0.5)
    assert job.removed_cost([attention]) + job.removed_cost([ffn]) == pytest.approx(0.5)
    assert job.removed_cost(["model.layers.1", attention, ffn]) == pytest.approx(1.0)
    short = job.removed_cost([attention])
    job.tokens = 512
    assert job.removed_cost([attention]) > short
    assert ConvJob.removed_cost(None, ["layer1.0"]) is None  # a conv graph's blocks are measured


def test_a_moe_ffns_depth_cost_counts_its_shared_expert():
    """Removing a Qwen2-MoE FFN removes its shared expert too: 24 neurons at every token beside 2 of 4 experts of 20."""
    from tests.compressor.transformer.transformer_models import MODELS

    job = TextJob.__new__(TextJob)
    job.dense, job.tokens = MODELS["qwen2_moe"](), 16
    costs = job._unit_costs()
    assert costs["model.layers.0.mlp.experts"] == pytest.approx(32 * 3 * 2 * 20 + 32 * 3 * 24)


def test_a_removed_moe_ffn_takes_its_shared_experts_width_curve_with_it():
    """Depth options plan the widths of what they leave: not those of a removed FFN's shared expert, whose cost the
    FFN's removal already counts."""
    from compressor.allocation import LayerCurve
    from service.job.targeting import kept_curves
    from tests.compressor.transformer.transformer_models import MODELS

    job = TextJob.__new__(TextJob)
    job.dense, job.tokens = MODELS["qwen2_moe"](), 16
    names = [f"model.layers.{i}.{path}" for i in (0, 1)
             for path in ("self_attn.o_proj", "mlp.shared_expert.down_proj", "mlp.experts")]
    curves = [LayerCurve(name, "ffn_neurons", [24, 16], [0.0, 0.1], 1.0) for name in names]
    kept = [c.name for c in kept_curves(job, ["model.layers.0.mlp.experts"], curves)]
    assert kept == ["model.layers.0.self_attn.o_proj", *names[3:]]
    assert job.curve_owner("model.layers.1.self_attn.o_proj") == "model.layers.1.self_attn.o_proj"


def test_a_swin_weighs_its_attentions_and_ffns_alone_never_a_whole_block():
    """Swin's blocks shift windows by their place in a stage: its depth units are each block's attention and FFN
    (named by the block's path through the stages), a block named by both keeps its norms and stays a block, and
    the model without them runs with the stage-1 blocks' own widths (32, not 16)."""
    from types import SimpleNamespace

    import torch

    from compressor.transformer.sublayers import removed_sublayers
    from service.job.kinds import ImageTransformerJob
    from tests.compressor.transformer.transformer_models import tiny_swin

    job = ImageTransformerJob.__new__(ImageTransformerJob)
    job.dense, job.tokens, job._removal_losses, job._sensitivity = tiny_swin(), 64, None, None
    job.request = SimpleNamespace(device="cpu", activation_dtype="float32", method="osscar", normalise="output")
    job.say = lambda *_args, **_kwargs: None
    job.batches = [{"pixel_values": torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(i))}
                   for i in range(2)]
    losses = job.removal_losses()
    blocks = [f"encoder.layers.{s}.blocks.{b}" for s in (0, 1) for b in (0, 1)]
    assert sorted(losses) == sorted(f"{block}.{unit}" for block in blocks for unit in ("attention.o_proj", "mlp.fc2"))
    assert all(loss > 0 for loss in losses.values())
    order = [name for name, _ in job.depth_order()]
    assert len(order) == 7  # every unit but the one that would leave no block with a sub-layer
    both = ["encoder.layers.1.blocks.1.attention.o_proj", "encoder.layers.1.blocks.1.mlp.fc2"]
    assert job._split(both) == ([], [(3, "attention_heads"), (3, "ffn_neurons")])
    shallow = job.without(both)
    assert removed_sublayers(shallow) == [(3, "attention_heads"), (3, "ffn_neurons")]
    with pytest.raises(InputError, match=r"encoder\.layers\.0\.blocks\.1: swin's layers are not removed whole"):
        job.remove(["encoder.layers.0.blocks.1"])  # refused when named, before any work
    with torch.no_grad():
        assert shallow(**job.batches[0]).last_hidden_state.shape == (4, 16, 32)


def test_the_output_currency_prices_removal_losses_by_the_output_change_they_predict():
    """normalise "output": each unit's removal loss relative to the stream times the stream's energy and the output
    gradient's there (one backward pass, made once); "stream" keeps them as they are and has no conversion."""
    from types import SimpleNamespace

    import torch

    from tests.compressor.transformer.transformer_models import tiny_llama

    said = []
    job = TextJob.__new__(TextJob)
    job.dense, job.tokens, job._removal_losses, job._sensitivity = tiny_llama().eval(), 16, None, None
    job.request = SimpleNamespace(device="cpu", activation_dtype="float32", method="osscar", normalise="stream")
    job.say = said.append
    job.batches = [{"input_ids": torch.randint(3, 50, (4, 16), generator=torch.Generator().manual_seed(i))}
                   for i in range(2)]
    assert job.currency() is None
    stream = job.removal_losses()
    job._removal_losses, job.request.normalise = None, "output"
    output = job.removal_losses()
    s = job._sensitivity
    assert sorted(output) == sorted(stream) and len(said) == 1
    assert output["model.layers.1"] == pytest.approx(stream["model.layers.1"] * s.stream_in[1] * s.layer[1])
    attention = "model.layers.0.self_attn.o_proj"
    # a removal loss is relative to the layer's input stream (as its widths' losses are), a sub-layer's too
    assert output[attention] == pytest.approx(stream[attention] * s.stream_in[0] * s.attention[0])
    assert job.currency()(attention, 0.5, "input") == pytest.approx(0.5 * s.stream_in[0] * s.attention[0])
    convert = job.currency()
    assert job._sensitivity is s and len(said) == 1  # made once
    with pytest.raises(KeyError, match=r"model\.layers\.9: not a layer"):
        convert("model.layers.9", 1.0)


def test_the_planning_passes_read_at_most_1024_windows_spread_over_the_draw():
    """2,048 windows in 64 batches shortest first: the dense curves and the removal losses read every other batch
    (1,024 windows, from the shortest to the longest); a draw of 128 windows is read whole."""
    import torch

    from service.job.kinds import PLANNING_SEQUENCES, ImageTransformerJob

    job = TextJob.__new__(TextJob)
    job.batches = [{"input_ids": torch.zeros(32, 16 + i, dtype=torch.long)} for i in range(64)]
    planning = job.planning_batches()
    assert sum(len(b["input_ids"]) for b in planning) == PLANNING_SEQUENCES == 1024
    assert planning[0] is job.batches[0] and planning[-1] is job.batches[62]
    job.batches = job.batches[:4]
    assert job.planning_batches() == job.batches
    vit = ImageTransformerJob.__new__(ImageTransformerJob)  # a ViT plans on all its images, as measured so far
    vit.batches = [{"pixel_values": torch.zeros(32, 3, 8, 8)} for _ in range(40)]
    assert vit.planning_batches() == vit.batches


@pytest.mark.parametrize(("method", "add_bias", "biased"), [("flap", "auto", True), ("flap", "no", False),
                                                            ("osscar", "auto", False), ("osscar", "yes", True)])
def test_a_request_decides_whether_bias_free_projections_gain_a_bias(method, add_bias, biased):
    """--add-bias reaches the pipeline: auto is the method's paper (FLAP adds a bias to Llama's bias-free
    o_proj / down_proj), yes and no override it; the width manifest lists what was added."""
    from pathlib import Path

    import torch

    from compressor.transformer.surgery import widths
    from tests.compressor.transformer.transformer_models import tiny_llama

    job = TextJob.__new__(TextJob)
    job.dense, job.tokens, job.removed_blocks, job.stream = tiny_llama().eval(), 16, [], False
    job.say = lambda *_args, **_kwargs: None
    job.request = CompressRequest(model="m", calibration=Path("c"), out_dir=Path("o"), uniform_ratio=0.25,
                                  method=method, add_bias=add_bias, refine_steps=0, device="cpu")
    job.batches = [{"input_ids": torch.randint(3, 50, (4, 16), generator=torch.Generator().manual_seed(i))}
                   for i in range(2)]
    pruned, reports = job.prune(0.25)
    assert reports and bool(widths(pruned).get("biases")) == biased
    # a refitting method's rows are chosen per projection (osscar's refit or the dense rows), FLAP keeps the dense ones
    assert all(r.rows in ("refit", "dense") for r in reports) if method == "osscar" else all(r.rows is None
                                                                                             for r in reports)


def test_a_decoders_export_is_checked_on_the_windows_whose_logits_fit_without_a_float32_copy(tmp_path, monkeypatch):
    """A bf16 decoder exports as float32 without a float32 copy of it (`float32_view`): the check reads at most
    OUTPUT_VALUES logits (a 1B decoder's 16 windows of a 128,256 vocabulary were 1 GB, held twice), the model is
    back in bf16 before the fused graph is checked, and the job's own bf16 model is untouched."""
    from types import SimpleNamespace

    import torch
    import transformers

    from service.job import kinds

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    job = TextJob.__new__(TextJob)
    job.dense = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    job.loaded = SimpleNamespace(input_names=("input_ids", "attention_mask"), output_name="logits", extra_outputs=())
    ids = torch.randint(0, 64, (6, 10))
    job.batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    job.request = CompressRequest(model="m", calibration=tmp_path / "c.txt", out_dir=tmp_path, uniform_ratio=0.5,
                                  execution_provider="cpu")
    job.say = print
    job.causal = True
    before = {k: v.clone() for k, v in job.dense.state_dict().items()}
    params = dict(job.dense.named_parameters())
    monkeypatch.setattr(kinds, "OUTPUT_VALUES", 3 * 10 * 64 + 5)
    checked = []
    real_check = kinds.check_hf_outputs

    def check(graph, inputs, expected, **options):
        checked.append(len(inputs["input_ids"]))
        # the view has ended before ONNX Runtime loads the export: the model's own bf16 parameters are back
        assert all(p is params[name] for name, p in job.dense.named_parameters())
        assert {p.dtype for p in job.dense.parameters()} == {torch.bfloat16}
        return real_check(graph, inputs, expected, **options)

    def no_copy(model, precision):
        raise AssertionError("a float32 copy was made of a half-precision model")

    monkeypatch.setattr(kinds, "check_hf_outputs", check)
    monkeypatch.setattr(kinds, "in_precision", no_copy)
    parity = job.export(job.dense, tmp_path / "model.onnx")
    assert parity.peak_error < 1e-4 and checked == [3]
    job.causal = False  # a classifier's logits are a row of labels a window, not a vocabulary: every window fits
    assert len(job._parity_inputs()["input_ids"]) == 6
    # the evaluation runs a batch in slices within OUTPUT_VALUES: the same perplexity
    from service.job.budgets import PERPLEXITY

    job.causal, job.classifier, job.metric = True, False, PERPLEXITY
    held = torch.randint(0, 64, (5, 10))
    job.eval_batches = [{"input_ids": held, "attention_mask": torch.ones_like(held)}]
    sliced = job.outputs(tmp_path / "model.onnx")
    monkeypatch.setattr(kinds, "OUTPUT_VALUES", 1 << 30)
    whole = job.outputs(tmp_path / "model.onnx")
    assert len(sliced) == 2 and len(whole) == 1
    assert job.score(sliced, sliced) == pytest.approx(job.score(whole, whole), rel=1e-9)
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in job.dense.state_dict().items())


def test_a_transformer_prune_without_the_fit_solves_only_and_refuses_to_fit_solves_later():
    """A depth trial's prune (`fit=False`) runs no block fit where the default prune fits every pruned block; a
    transformer's fits run between its solves, so a solved model handed back to be fitted is refused."""
    from pathlib import Path

    import torch

    from tests.compressor.transformer.transformer_models import tiny_llama

    job = TextJob.__new__(TextJob)
    job.dense, job.tokens, job.removed_blocks, job.stream = tiny_llama().eval(), 16, [], False
    job.say = lambda *_args, **_kwargs: None
    job.request = CompressRequest(model="m", calibration=Path("c"), out_dir=Path("o"), uniform_ratio=0.25,
                                  refine_steps=5, device="cpu")
    job.batches = [{"input_ids": torch.randint(3, 50, (4, 16), generator=torch.Generator().manual_seed(i))}
                   for i in range(2)]
    _, fitted = job.prune(0.25)
    solved, bare = job.prune(0.25, fit=False)
    assert any(r.refine is not None for r in fitted) and all(r.refine is None for r in bare)
    assert [r.width_after for r in bare] == [r.width_after for r in fitted]
    with pytest.raises(ValueError, match="cannot be fitted later"):
        job.prune(0.25, solved=(solved, bare))


def test_a_first_layer_that_cannot_go_is_refused_when_the_job_is_told_to_remove_it():
    """ModernBERT's first layer is built unlike the others: a --widths-from report naming it is refused when the
    job takes the structure, not after every other block is solved."""
    from compressor.errors import UnsupportedArchitecture
    from tests.compressor.transformer.transformer_models import tiny_modernbert

    job = TextJob.__new__(TextJob)
    job.dense, job.causal = tiny_modernbert(), False
    with pytest.raises(UnsupportedArchitecture, match="first layer is built unlike the others"):
        job.remove(["layers.0"])
    job.remove(["layers.1"])
    assert job.removed_blocks == ["layers.1"]


def test_a_perplexity_of_a_broken_model_is_huge_not_an_overflow():
    from service.job.budgets import PERPLEXITY

    job = object.__new__(TextJob)
    job.metric = PERPLEXITY
    assert job.score([(800.0 * 10, 10)], []) > 1e300


def test_evaluation_images_without_labels_are_scored_as_held_out_ones_and_unreadable_labels_are_refused(tmp_path):
    """An --eval without labels (a .npy, or an .npz without y) was refused for every CNN, though the job scores
    held-out images without labels (agreement with the dense model, or the outputs' cosine), and a CNN whose output
    is not class scores could then take no --eval at all; labels saved as objects were a ValueError traceback."""
    from compressor.errors import CalibrationError
    from service.job.budgets import AGREEMENT, COSINE
    from service.job.kinds import _image_metric, _images_and_held_out

    rng = np.random.default_rng(0)
    np.save(tmp_path / "cal.npy", rng.standard_normal((200, 3, 8, 8)).astype(np.float32))
    np.save(tmp_path / "eval.npy", rng.standard_normal((100, 3, 8, 8)).astype(np.float32))
    np.savez(tmp_path / "eval.npz", x=rng.integers(0, 256, (100, 8, 8, 3), dtype=np.uint8))
    for name in ("eval.npy", "eval.npz"):
        request = CompressRequest(model="m.pt2", calibration=tmp_path / "cal.npy", eval=tmp_path / name,
                                  out_dir=tmp_path / "out", uniform_ratio=0.5)
        _, eval_x, eval_y, held = _images_and_held_out(request, 64, labels=True)
        assert eval_y is None and len(eval_x) == 64 and held.evaluation == 64
        assert _image_metric(eval_y, 10, name) == AGREEMENT and _image_metric(eval_y, None, name) == COSINE
        # one output (a score): no top-1 to agree on, labels or not (its argmax is always 0: 1.0 for any model)
        assert _image_metric(eval_y, 1, name) == COSINE == _image_metric(np.zeros(100, np.int64), 1, name)
    np.savez(tmp_path / "eval.npz", x=rng.integers(0, 256, (100, 8, 8, 3), dtype=np.uint8),
             y=np.array([[1], 2] * 50, dtype=object))
    with pytest.raises(CalibrationError, match=r"eval\.npz: not a readable \.npz file \(ValueError: Object arrays"):
        _images_and_held_out(request, 64, labels=True)


def test_evaluation_labels_are_class_indices_and_a_column_is_flattened(tmp_path):
    """Keras' CIFAR-10 labels are an (N, 1) column: compared with the outputs' argmax it broadcast to N x N, and a
    perfect model scored ~1 / classes (the dense one too, so every budget passed); one-hot rows are refused."""
    from types import SimpleNamespace

    from compressor.errors import CalibrationError
    from service.job.budgets import TOP1
    from service.job.kinds import _images_and_held_out

    rng = np.random.default_rng(0)
    np.save(tmp_path / "cal.npy", rng.standard_normal((200, 3, 8, 8)).astype(np.float32))
    x = rng.integers(0, 256, (100, 8, 8, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 100)
    request = CompressRequest(model="m.pt2", calibration=tmp_path / "cal.npy", eval=tmp_path / "eval.npz",
                              out_dir=tmp_path / "out", uniform_ratio=0.5)
    np.savez(tmp_path / "eval.npz", x=x, y=labels[:, None])
    _, eval_x, eval_y, _ = _images_and_held_out(request, 256, labels=True)
    assert len(eval_x) == 100 and eval_y.shape == (100,) and np.array_equal(eval_y, labels)
    perfect = np.eye(10)[eval_y]  # scores whose argmax is each label
    assert ConvJob.score(SimpleNamespace(metric=TOP1, eval_y=eval_y), perfect, perfect) == 1.0
    for y, words in ((np.eye(10)[labels], r"shape \(100, 10\)"), (labels + 0.5, "float64")):
        np.savez(tmp_path / "eval.npz", x=x, y=y)
        with pytest.raises(CalibrationError, match=f"labels 'y' must be class indices.*{words}"):
            _images_and_held_out(request, 256, labels=True)


def test_labels_outside_the_models_classes_are_refused_naming_them():
    """A label outside [0, classes) is never an argmax: 1-based or -1 labels scored the dense model ~0 top-1, and a
    budget relative to 0 passed every model."""
    import torch

    from compressor.errors import CalibrationError
    from service.job.kinds import _check_labels, _classes

    classifier = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
    images = torch.randn(2, 3, 2, 2)
    assert _classes(classifier, images) == 10
    assert _classes(torch.nn.Conv2d(3, 4, 1), images) is None  # a map, not class scores
    _check_labels(np.arange(10), 10, "eval.npz")
    with pytest.raises(CalibrationError, match=r"in \[0, 10\) of the model's 10 outputs; found -1, 10$"):
        _check_labels(np.array([3, 10, -1, 10]), 10, "eval.npz")
    with pytest.raises(CalibrationError, match="not one score per class"):
        _check_labels(np.arange(3), None, "eval.npz")


def test_a_dense_top1_no_better_than_the_commonest_label_is_warned_of():
    from service.job.budgets import TOP1

    labels = np.array([1, 2, 3, 1, 2, 3, 1, 1])  # 1 is half of them
    job = SimpleNamespace(metric=TOP1, eval_y=labels)
    right = np.eye(1001)[labels]
    shifted = np.eye(1001)[labels + 1]  # a background class first: every label read one class off
    assert ConvJob.baseline_warnings(job, right) == []
    (warning,) = ConvJob.baseline_warnings(job, shifted)
    assert "top-1 on the 8 labelled images is 0.0%" in warning and "(50.0%)" in warning


def test_evaluation_images_of_another_size_are_refused_before_any_export(tmp_path):
    import torch

    from compressor.errors import CalibrationError
    from service.job.kinds import _check_image_shapes

    request = CompressRequest(model="m.pt2", calibration=tmp_path / "cal.npy", eval=tmp_path / "eval.npz",
                              out_dir=tmp_path / "out", uniform_ratio=0.5)
    _check_image_shapes(torch.zeros(2, 3, 8, 8), torch.zeros(2, 3, 8, 8), (3, 8, 8), request)
    with pytest.raises(CalibrationError, match=r"evaluation images \(.*eval\.npz\) have shape \(3, 16, 16\), the "
                                               r"model expects \(3, 8, 8\)"):
        _check_image_shapes(torch.zeros(2, 3, 8, 8), torch.zeros(2, 3, 16, 16), (3, 8, 8), request)


def test_the_cosine_of_a_models_few_output_values_compares_each_over_the_samples():
    """One score a sample (a regression head): the cosine of one number is the agreement of two signs, and scored a
    pruned model's random positive scores 1.0 against the dense model's positive ones."""
    from service.job.kinds import cosine

    rng = np.random.default_rng(0)
    dense = rng.uniform(1, 5, (256, 1)).astype(np.float32)
    noise = rng.uniform(0.01, 100, (256, 1)).astype(np.float32)
    assert cosine(dense, dense) == pytest.approx(1.0)
    assert cosine(noise, dense) < 0.3
    assert cosine(dense * 1.01 + 0.01, dense) > 0.99  # close outputs stay close
    constant = np.full((8, 2), 3.0, np.float32)
    assert cosine(constant, constant) == 1.0 and cosine(constant + rng.normal(size=(8, 2)), constant) == 0.0
    wide = rng.normal(size=(16, 32)).astype(np.float32)  # enough values a sample: row by row, as before
    rows = (wide * -wide).sum(1) / (np.linalg.norm(wide, axis=1) ** 2)
    assert cosine(-wide, wide) == pytest.approx(float(rows.mean())) == pytest.approx(-1.0)


def test_images_are_normalised_as_the_models_preprocessor_says_unless_the_request_does(tmp_path):
    """google/mobilenet_v2 and the ViTs ship mean = std = 0.5: calibrating and scoring them with ImageNet's
    statistics shifted every input while the returned directory told serving to use 0.5."""
    import json

    from compressor.calibration import IMAGENET_MEAN, IMAGENET_STD
    from compressor.errors import InputError
    from service.job.kinds import image_normalisation

    def normalisation(**options):
        return image_normalisation(CompressRequest(model=str(tmp_path), calibration=tmp_path / "c.npz",
                                                   out_dir=tmp_path / "o", uniform_ratio=0.5, **options))

    assert normalisation() == (IMAGENET_MEAN, IMAGENET_STD, "ImageNet's")  # no preprocessor_config.json
    config = tmp_path / "preprocessor_config.json"
    config.write_text(json.dumps({"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    assert normalisation() == ((0.5,) * 3, (0.5,) * 3, "preprocessor_config.json")
    assert normalisation(mean=(0.1, 0.2, 0.3)) == ((0.1, 0.2, 0.3), (0.5,) * 3,
                                                   "mean: the request, std: preprocessor_config.json")
    config.write_text(json.dumps({"do_normalize": False, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    assert normalisation() == ((0.0,) * 3, (1.0,) * 3, "preprocessor_config.json")
    config.write_text(json.dumps({"image_mean": [0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    with pytest.raises(InputError, match="need as many values"):
        normalisation()
    config.write_text("{not json")
    with pytest.raises(InputError, match="not readable as JSON"):
        normalisation()
    assert normalisation(mean=(0.2,), std=(0.4,))[:2] == ((0.2,), (0.4,))  # the request's own: the file is not read


def test_a_transformer_saved_into_a_reused_out_leaves_no_earlier_model_files(tmp_path):
    """An earlier sentence-transformers job's modules.json, pooling and tokenizer stayed in out/model beside a
    decoder saved there later, and its loaders read them as the new model's. A model/ the job reads stays."""
    from tests.compressor.transformer.transformer_models import tiny_llama

    job = TextJob.__new__(TextJob)
    job.loaded = SimpleNamespace(tokenizer=None)
    out = tmp_path / "out"
    (out / "model" / "1_Pooling").mkdir(parents=True)
    (out / "model" / "modules.json").write_text("[]")
    job.request = CompressRequest(model=str(tmp_path / "src"), calibration=tmp_path / "c.txt", out_dir=out,
                                  uniform_ratio=0.25)
    assert job.save(tiny_llama(), out) == "model/"
    assert (out / "model" / "config.json").is_file()
    assert not (out / "model" / "modules.json").exists() and not (out / "model" / "1_Pooling").exists()
    (out / "model" / "notes.txt").write_text("the input's")
    job.request = CompressRequest(model=str(out / "model"), calibration=tmp_path / "c.txt", out_dir=out,
                                  uniform_ratio=0.25)
    job.save(tiny_llama(), out)
    assert (out / "model" / "notes.txt").is_file()  # `compress out/model --out out`: the input stays


def test_an_earlier_jobs_listed_files_in_the_models_own_folder_stay(tmp_path):
    """--out the model's own folder, run twice: the first report lists config.json and preprocessor_config.json
    as its serving files, which are the model's own; the second job removed them before reading them again."""
    import json

    from service.job.compress import _clear_earlier_files

    model = tmp_path / "hf_model"
    model.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (model / name).write_text("{}")
    (model / "report.json").write_text(json.dumps({"artifacts": {"serving": {"files": ["config.json",
                                                                                      "preprocessor_config.json"]}}}))
    own = CompressRequest(model=str(model), calibration=tmp_path / "c.npz", out_dir=model, uniform_ratio=0.5)
    assert own.reads(model / "config.json") and own.reads(tmp_path) and not own.reads(tmp_path / "other")
    _clear_earlier_files(model, own)
    assert (model / "config.json").is_file() and (model / "preprocessor_config.json").is_file()
    other = CompressRequest(model=str(tmp_path / "m.pt2"), calibration=tmp_path / "c.npz", out_dir=model,
                            uniform_ratio=0.5)
    _clear_earlier_files(model, other)
    assert not (model / "config.json").exists() and not (model / "preprocessor_config.json").exists()


def test_a_model_of_any_image_size_takes_its_images_size(tmp_path):
    """DINOv2 takes images of any size in whole patches: calibration images of 8 x 8 (its config says 16) make the job's
    input, export and token count that size, where a ViT's fixed positions refuse them."""
    from compressor.errors import CalibrationError
    from service.job.kinds import ImageTransformerJob
    from tests.compressor.transformer.transformer_models import ENCODER_SHAPED, MODELS

    for name, model in (("dinov2", ENCODER_SHAPED["dinov2"]()), ("vit", MODELS["vit"]())):
        model.save_pretrained(tmp_path / name)
    np.savez(tmp_path / "images.npz", x=np.random.default_rng(0).integers(0, 256, (160, 8, 8, 3), dtype=np.uint8))
    request = CompressRequest(model=str(tmp_path / "dinov2"), uniform_ratio=0.5, calibration=tmp_path / "images.npz")
    said: list = []
    job = ImageTransformerJob(request, said.append)
    assert job.input_shape == (3, 8, 8) and job.tokens == 5 and any("images of 8 x 8" in str(s) for s in said)
    with pytest.raises(CalibrationError, match=r"the model expects \(3, 16, 16\)"):
        ImageTransformerJob(dataclasses.replace(request, model=str(tmp_path / "vit")), said.append)


def test_dinov2_is_served_at_its_preprocessors_crop_not_its_configs_image_size(tmp_path):
    """DINOv2's config says image_size 518 where its processor crops 224 and the model interpolates its positions:
    the job takes the crop's size (its images, its export, the latency model's tokens); a family of fixed positions
    (ViT) keeps its config's."""
    import json

    from service.job.kinds import image_tokens, served_image_size
    from tests.compressor.transformer.transformer_models import ENCODER_SHAPED, MODELS

    dinov2, vit = ENCODER_SHAPED["dinov2"](), MODELS["vit"]()  # config image_size 16, patch 4
    assert served_image_size(dinov2, tmp_path) == 16  # no preprocessor_config.json
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_center_crop": True,
                                                                   "crop_size": {"height": 8, "width": 8}}))
    assert served_image_size(dinov2, tmp_path) == 8 and served_image_size(vit, tmp_path) == 16
    with torch.no_grad():
        seen = dinov2(pixel_values=torch.randn(1, 3, 8, 8), output_hidden_states=True).hidden_states[1].shape[1]
    assert image_tokens(dinov2, 8) == seen == 5  # 2 x 2 patches and [CLS]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_center_crop": False,
                                                                   "size": {"height": 8, "width": 12}}))
    assert served_image_size(dinov2, tmp_path) == 16  # a rectangle: the config's square


@pytest.mark.parametrize("cls, labels, metric, reduce", [
    ("Qwen3Model", None, "cosine", "lasttoken_pool"),  # Qwen3-Embedding: its last token's state, as it serves it
    ("Qwen3ForSequenceClassification", 1, "cosine", "raw"),  # a reranker's score: no top-1 to agree on
    ("Qwen3ForSequenceClassification", 3, "agreement", "raw"),
    ("BertForSequenceClassification", 1, "cosine", "raw"),  # a cross-encoder's (ms-marco-MiniLM)
])
def test_a_decoder_embedding_or_a_score_head_is_scored_on_what_it_serves(tmp_path, monkeypatch, cls, labels, metric,
                                                                          reduce):
    """A decoder family's base model (an embedding model) or sequence classifier is an encoder job: no decode step,
    its pooling read from its sentence-transformers modules (last token); a head of one output (a reranker's or a
    reward model's score), whose argmax is always 0, was scored by top-1 agreement, 1.0 for any model."""
    import json

    import transformers

    fields = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=20,
                  max_position_embeddings=64, pad_token_id=0, **({"num_labels": labels} if labels else {}),
                  **({"num_key_value_heads": 2, "head_dim": 8} if cls.startswith("Qwen3") else {}))
    config = getattr(transformers, cls.replace("ForSequenceClassification", "").replace("Model", "") + "Config")
    torch.manual_seed(0)
    getattr(transformers, cls)(config(**fields)).save_pretrained(tmp_path / "m")
    if labels is None:  # sentence-transformers' modules of a last-token-pooled decoder
        (tmp_path / "m" / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (tmp_path / "m" / "1_Pooling").mkdir()
        (tmp_path / "m" / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=4000), offsets=[0, 2000, 4000])
    job = TextJob(CompressRequest(model=str(tmp_path / "m"), uniform_ratio=0.5, calibration=tmp_path / "ids.npz",
                                  sequences=16, sequence_length=32), lambda line: None)
    assert not job.causal and job.metric.name == metric
    calls = []
    monkeypatch.setattr("service.job.kinds.run_outputs", lambda path, batches, reduce: calls.append(reduce) or [])
    job.outputs(tmp_path / "model.onnx")
    assert calls == [reduce]


def test_a_decoder_score_head_reads_its_padding_by_its_pad_token_id(tmp_path):
    """transformers scores a decoder's sequence classifier at each row's last token whose id is not pad_token_id (no
    attention mask read): the job's padded windows carry that id, so a short window is scored at its last real token,
    not at a padding column; without a pad_token_id the job is refused before it reads the text."""
    import transformers

    fields = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=20, max_position_embeddings=64, num_labels=1)
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=4000),
             offsets=[0, 5, 11, 2000, 4000])  # two short documents: padded windows
    for pad, name in ((7, "m"), (None, "nopad")):
        torch.manual_seed(0)
        transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(**fields, pad_token_id=pad)
                                                    ).save_pretrained(tmp_path / name)
    request = CompressRequest(model=str(tmp_path / "m"), uniform_ratio=0.5, calibration=tmp_path / "ids.npz",
                              sequences=16, sequence_length=32)
    job = TextJob(request, lambda line: None)
    padded = [b for b in job.batches + job.eval_batches if (b["attention_mask"] == 0).any()]
    assert padded and all(bool((b["input_ids"][b["attention_mask"] == 0] == 7).all()) for b in padded)
    batch = padded[0]
    row = int((batch["attention_mask"] == 0).any(1).nonzero()[0])
    last = int(batch["attention_mask"][row].sum()) - 1  # right padding: the last real token
    with torch.no_grad():
        states = job.dense.model(input_ids=batch["input_ids"][row:row + 1],
                                 attention_mask=batch["attention_mask"][row:row + 1]).last_hidden_state
        scored = job.dense(**{k: v[row:row + 1] for k, v in batch.items()}).logits
    torch.testing.assert_close(scored[0], job.dense.score(states[0, last]))
    with pytest.raises(InputError, match=r"config\.json sets no pad_token_id"):
        TextJob(dataclasses.replace(request, model=str(tmp_path / "nopad")), lambda line: None)
    config = json.loads((tmp_path / "nopad" / "config.json").read_text())
    (tmp_path / "nopad" / "config.json").write_text(json.dumps({**config, "pad_token_id": -1}))
    with pytest.raises(InputError, match="pad_token_id -1 is no token of its 50-token vocabulary"):
        TextJob(dataclasses.replace(request, model=str(tmp_path / "nopad")), lambda line: None)


def test_an_embedding_model_is_scored_on_the_pooling_it_serves(tmp_path, monkeypatch):
    """A CLS-pooled sentence model's cosine was of its mean-pooled states, not of the embedding it serves."""
    import json

    from service.embedded import calibration_texts
    from tests.exporters.test_serving import _sentence_model

    source = _sentence_model(tmp_path / "src")
    (source / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (tmp_path / "c.txt").write_text("\n\n".join(calibration_texts(64)))
    said: list[str] = []
    job = TextJob(CompressRequest(model=str(source), uniform_ratio=0.5, calibration=tmp_path / "c.txt",
                                  sequences=16, sequence_length=32), said.append)
    assert job.pooling == "cls" and any("cls token pooling" in str(line) for line in said)
    calls = []
    monkeypatch.setattr("service.job.kinds.run_outputs", lambda path, batches, reduce: calls.append(reduce) or [])
    job.outputs(tmp_path / "model.onnx")
    assert calls == ["cls_pool"]


def test_a_streamed_text_job_says_it_runs_no_whole_model_fit(tmp_path):
    """--stream returned the block-fitted model without the whole-model fit an in-memory job runs, and said
    nothing: its report read as the same job's."""
    from tests.compressor.transformer.transformer_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "m")
    np.savez(tmp_path / "ids.npz", ids=np.random.default_rng(0).integers(3, 50, size=4000), offsets=[0, 2000, 4000])
    said: list[str] = []
    request = dict(model=str(tmp_path / "m"), uniform_ratio=0.5, calibration=tmp_path / "ids.npz", sequences=16,
                   sequence_length=32)
    TextJob(CompressRequest(**request, stream=True), said.append)
    assert any("whole-model fit after the block fits is not run when streaming" in str(line) for line in said)
    said.clear()
    TextJob(CompressRequest(**request), said.append)
    assert not any("whole-model fit" in str(line) for line in said)


def test_mean_and_std_with_npy_images_are_named_as_ignored_and_the_record_says_the_images_were_used_as_given(
        tmp_path):
    """.npy images are used as they are; --mean / --std passed with them did nothing, yet the report's preprocessing
    recorded them as "the request"'s normalisation, which a server reading it would then apply."""
    from service.job.kinds import _image_preprocessing, _image_traits

    npy = CompressRequest(model="m.pt2", calibration=tmp_path / "cal.npy", out_dir=tmp_path / "out",
                          uniform_ratio=0.5, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    assert npy.ignored_options(_image_traits(npy)) == [
        "--mean (for .npz images; .npy images are used as given)", "--std (for .npz images; .npy images are used as "
        "given)"]
    record = _image_preprocessing(npy, "x", (3, 8, 8))
    assert record["npy_images"] == "used as given" and "mean" not in record
    # with .npz evaluation images beside them, the flags normalise those
    mixed = dataclasses.replace(npy, eval=tmp_path / "eval.npz")
    assert mixed.ignored_options(_image_traits(mixed)) == []
    npz = dataclasses.replace(npy, calibration=tmp_path / "cal.npz")
    assert npz.ignored_options(_image_traits(npz)) == []
    assert _image_preprocessing(npz, "x", (3, 8, 8))["mean"] == [0.5, 0.5, 0.5]


def test_mis_scaled_calibration_images_are_warned_of(tmp_path):
    from service.job.kinds import _image_value_warnings

    request = CompressRequest(model="m.pt2", calibration=tmp_path / "cal.npy", out_dir=tmp_path / "out",
                              uniform_ratio=0.5)
    raw = torch.rand(4, 3, 8, 8) * 255
    assert "raw pixel values?" in _image_value_warnings(raw, request)[0]
    assert _image_value_warnings((raw / 255 - 0.45) / 0.22, request) == []
    npz = dataclasses.replace(request, calibration=tmp_path / "cal.npz", mean=(0.5,) * 3, std=(0.25,) * 3)
    binary = (torch.randint(0, 2, (4, 3, 8, 8)) / 255 - 0.5) / 0.25  # uint8 pixels of 0 and 1, normalised
    assert "every pixel is 0 or 1 of 255" in _image_value_warnings(binary, npz)[0]
    assert _image_value_warnings((torch.rand(4, 3, 8, 8) - 0.5) / 0.25, npz) == []


@pytest.mark.parametrize("name", ["vit", "deit", "dinov2", "dinov2_with_registers", "dinov3_vit", "clip_vision_model",
                                  "siglip_vision_model"])
def test_a_vision_transformer_is_costed_at_the_tokens_its_blocks_see(name):
    """The latency model's sequence length: the patches, [CLS], DeiT's distillation token, register tokens (outside
    DINOv2's position embeddings; DINOv3 has none), as many as the blocks' outputs hold."""
    from service.job.kinds import image_tokens
    from tests.compressor.transformer.transformer_models import ENCODER_SHAPED, MODELS, example_inputs

    model = {**MODELS, **ENCODER_SHAPED}[name]()
    with torch.no_grad():
        seen = model(**example_inputs(model), output_hidden_states=True).hidden_states[1].shape[1]
    assert image_tokens(model) == seen
