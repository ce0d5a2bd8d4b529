"""The parity gate: errors relative to each output's scale, per precision, every mismatch in one error."""

import numpy as np
import pytest
import torch
import transformers

from exporters.onnx import (
    PARITY_TOLERANCES,
    Float16,
    ParityError,
    _NamedInputs,
    check_hf_outputs,
    check_hf_parity,
    export_hf_onnx,
    exported_in,
    in_precision,
    output_errors,
)
from exporters.runtime import run_outputs


def test_errors_are_relative_to_the_outputs_scale():
    rng = np.random.default_rng(0)
    t = rng.standard_normal((4, 1000))
    noise = 1e-6 * rng.standard_normal(t.shape)
    small, large = output_errors(t + noise, t), output_errors(1000 * (t + noise), 1000 * t)
    assert small.peak_error == pytest.approx(large.peak_error) and small.aggregate_error == pytest.approx(
        large.aggregate_error)
    assert large.max_abs_error == pytest.approx(1000 * small.max_abs_error)
    assert small.aggregate_error == pytest.approx(1e-6, rel=0.05)  # RMS(noise) / RMS(t)
    # the same relative noise: an absolute tolerance accepts the small output and refuses the large one
    assert np.allclose(t + noise, t, rtol=1e-4, atol=1e-4) and not np.allclose(1000 * (t + noise), 1000 * t,
                                                                              rtol=1e-4, atol=1e-4)


def test_a_value_is_allowed_an_error_relative_to_its_own_size_where_it_stands_out():
    t = np.full(100, 0.1)
    t[0] = 100.0  # an outlier feature, ~10x the RMS
    got = t.copy()
    got[0] += 0.05  # half-precision rounding of the outlier: 5e-4 of its value, 5e-3 of the RMS
    errors = output_errors(got, t)
    assert errors.peak_error == pytest.approx(0.05 / (np.sqrt(np.mean(t**2)) + 100.0))
    assert errors.peak_error < 5e-4 < 0.05 / np.sqrt(np.mean(t**2))


def test_non_finite_values_fail_unless_both_sides_have_them():
    t = np.array([1.0, np.inf, np.nan, 2.0])
    assert output_errors(t.copy(), t).peak_error == 0.0
    assert output_errors(np.array([1.0, np.inf, np.nan, np.nan]), t).peak_error == np.inf
    assert output_errors(np.zeros(3), np.zeros(3)).aggregate_error == 0.0
    assert output_errors(np.full(3, 1e-3), np.zeros(3)).max_abs_error == pytest.approx(1e-3)  # absolute on zeros


@pytest.fixture(scope="module")
def deep_decoder(tmp_path_factory):
    """A random-init 12-layer Llama whose logits have a scale of ~1000 (a trained LM's are ~10-30, and its
    fp32 noise is larger than a random model's): fp32 reduction-order noise is then above any absolute
    1e-4 but a tiny fraction of the logits' scale."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=12, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 512, (4, 48), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0 / model(**inputs).logits.std())
    path = export_hf_onnx(model, {k: v[:2] for k, v in inputs.items()}, tmp_path_factory.mktemp("deep") / "m.onnx",
                          output_name="logits")
    return model, inputs, path


def test_a_deep_decoder_passes_the_scaled_gate_that_an_absolute_one_refuses(deep_decoder):
    model, inputs, path = deep_decoder
    got = run_outputs(path, [[v.numpy() for v in inputs.values()]])[0][0]
    with torch.no_grad():
        expected = _NamedInputs(model, tuple(inputs), "logits")(*inputs.values()).numpy()
    assert np.sqrt(np.mean(expected**2)) > 500
    assert not np.allclose(got, expected, rtol=1e-4, atol=1e-4)  # the former fp32 rule
    parity = check_hf_parity(model, path, inputs, "logits")
    assert parity.max_abs_error > 1e-4
    assert parity.peak_error <= PARITY_TOLERANCES["fp32"].peak / 10
    assert parity.aggregate_error <= PARITY_TOLERANCES["fp32"].aggregate / 10


def test_a_wrong_export_is_refused_with_its_numbers(deep_decoder):
    model, inputs, path = deep_decoder
    weight = model.model.layers[6].mlp.down_proj.weight
    original = weight.detach().clone()
    try:
        with torch.no_grad():  # one weight matrix of 12 layers off by 2%: the export computes another model
            weight.mul_(1.02)
        with pytest.raises(ParityError) as caught:
            check_hf_parity(model, path, inputs, "logits")
    finally:
        with torch.no_grad():
            weight.copy_(original)
    (mismatch,) = caught.value.mismatches
    assert mismatch.output == "logits" and mismatch.peak_error > PARITY_TOLERANCES["fp32"].peak
    assert mismatch.aggregate_error > PARITY_TOLERANCES["fp32"].aggregate
    assert f"peak error {mismatch.peak_error:.3g} of scale (limit {PARITY_TOLERANCES['fp32'].peak:g})" in str(
        caught.value)


def test_every_mismatching_output_is_listed_in_one_error(tmp_path):
    class TwoOutputs(torch.nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = scale

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * self.scale, x.sum(-1) * self.scale

    from exporters.onnx import _export, check_parity

    x = torch.randn(3, 5)
    module = TwoOutputs(2.0)
    _export(module, (x,), tmp_path / "two.onnx", weights=module, input_names=["x"], output_names=["a", "b"],
            dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    assert check_parity(module, tmp_path / "two.onnx", x).peak_error < 1e-6
    with pytest.raises(ParityError) as caught:
        check_parity(TwoOutputs(2.1), tmp_path / "two.onnx", x)
    assert [m.output for m in caught.value.mismatches] == ["a", "b"]
    assert all(m.peak_error > 1e-2 for m in caught.value.mismatches)


def test_the_exported_module_has_the_precision_asked_for_whatever_the_models_dtype():
    fp32, bf16 = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2).to(torch.bfloat16)
    assert in_precision(fp32, "fp32") is fp32  # nothing copied when nothing changes
    upcast = in_precision(bf16, "fp32")
    assert upcast.weight.dtype == torch.float32 and bf16.weight.dtype == torch.bfloat16  # a copy
    torch.testing.assert_close(upcast.weight, bf16.weight.float(), rtol=0, atol=0)
    assert isinstance(in_precision(bf16, "fp16"), Float16)
    with pytest.raises(ValueError, match="fp32 or fp16"):
        in_precision(fp32, "bf16")


def test_a_float16_export_keeps_the_rotary_frequencies_in_float32(tmp_path):
    """`.half()` rounded a rotary embedding's inverse frequencies (0.01 -> 0.01000214: the angles at position 1,000
    0.035 off), where transformers keeps them in float32 in a half-precision model."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, rope_theta=10000.0)
    model = transformers.LlamaForCausalLM(config).eval()
    half = in_precision(model, "fp16").model
    assert half.model.embed_tokens.weight.dtype == torch.float16
    (name, frequencies), = [(n, b) for n, b in half.named_buffers() if n.endswith(".inv_freq")]
    assert frequencies.dtype == torch.float32 and torch.equal(frequencies, dict(model.named_buffers())[name])
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(in_precision(model, "fp16")(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=5e-2)


def test_an_export_leaves_a_longrope_model_as_it_was(tmp_path):
    """transformers' longrope rotary embedding (Phi-3-128k, Phi-3.5, Phi-4-mini) caches `long_inv_freq` in a plain
    attribute on its first forward: the export's tracer left its fake tensor there, so the model could not be
    copied afterwards ("Cannot access data pointer") and computed another model past the original length, which
    the parity check then compared the export against."""
    import copy

    config = transformers.Phi3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                     original_max_position_embeddings=16, pad_token_id=0,
                                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2],
                                                   "long_factor": [2.0, 3.0, 4.0], "partial_rotary_factor": 0.75},
                                     partial_rotary_factor=0.75)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    ids = torch.randint(3, 64, (2, 32))  # past the original 16 positions: the long factors apply
    with torch.no_grad():
        before = model(input_ids=ids).logits
    fresh = copy.deepcopy(model)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    export_hf_onnx(fresh, inputs, tmp_path / "m.onnx", output_name="logits")
    again = copy.deepcopy(fresh)  # raised before
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, before, rtol=0, atol=1e-5)
        torch.testing.assert_close(again(input_ids=ids).logits, before, rtol=0, atol=1e-5)
    check_hf_outputs(tmp_path / "m.onnx", inputs, [before.numpy()])


def test_a_model_the_tracer_cannot_export_raises_one_line_of_why(tmp_path):
    """Dynamic NTK rope recomputes its frequencies from the input's length in the forward (a data-dependent guard):
    torch.onnx's hundreds of lines become an ExportError naming the tracer's innermost error."""
    from exporters.onnx import ExportError

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=16,
                                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ExportError) as err:
        export_hf_onnx(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "m.onnx",
                       output_name="logits")
    assert "\n" not in str(err.value) and "data-dependent" in str(err.value), str(err.value)


def test_an_export_keeps_no_reference_to_the_module_it_exported(tmp_path):
    """onnxscript's module-level rewrite rules keep the last graph they ran on; the saved graph drops its tensors,
    so a float32 copy made for an export (4.9 GB for a 1.2 B decoder) is freed as soon as its caller drops it."""
    import gc
    import weakref

    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    copy = in_precision(transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval(), "fp32")
    alive = [weakref.ref(t) for t in [*copy.parameters(), *copy.buffers()]]
    ids = torch.randint(0, 64, (2, 8))
    export_hf_onnx(copy, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "m.onnx",
                   output_name="logits")
    del copy
    gc.collect()
    assert [r for r in alive if r() is not None] == []


def test_a_half_precision_model_exports_in_float32_without_a_copy_of_it(tmp_path):
    """`exported_in(..., "fp32")` reads a bf16 model's weights as float32 one layer at a time: the forward and the
    export are the float32 copy's (to the bit in ONNX Runtime), the graph holds float32 weights under the module's
    names and no Cast of them, and the model keeps its own bf16 parameters, tied ones still tied."""
    import onnx_ir as ir

    # weights of more than 8,192 values: the exporter's constant folding leaves their Casts to the rewrite
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=192, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    before = dict(model.named_parameters())
    ids = torch.randint(0, 256, (2, 8))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    copy = in_precision(model, "fp32")
    export_hf_onnx(copy, inputs, tmp_path / "copy.onnx", output_name="logits")
    with exported_in(model, "fp32") as view, torch.no_grad():
        torch.testing.assert_close(view(**inputs).logits, copy(**inputs).logits, rtol=0, atol=0)
        export_hf_onnx(view, inputs, tmp_path / "view.onnx", output_name="logits")
    assert dict(model.named_parameters()).keys() == before.keys()
    assert all(p is before[name] and p.dtype == torch.bfloat16 for name, p in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {b.dtype for b in model.buffers()} == {torch.bfloat16}

    graph = ir.load(str(tmp_path / "view.onnx")).graph
    floating = (ir.DataType.FLOAT, ir.DataType.BFLOAT16, ir.DataType.FLOAT16)
    assert {v.dtype for v in graph.initializers.values() if v.dtype in floating} == {ir.DataType.FLOAT}
    assert not [n for n in graph if n.op_type == "Cast" and n.inputs[0] in graph.initializers.values()]
    assert graph.initializers["model.model.layers.0.mlp.down_proj.weight.T"].shape == [192, 64]  # stored transposed
    assert not [name for name in graph.initializers if "parametrizations" in name]
    # the tied embeddings and LM head: one tensor, read by the Gather and through a Transpose, as in the copy's
    assert [list(v.shape) for v in graph.initializers.values() if 256 in v.shape] == [[256, 64]]
    assert not [key for key, text in graph.metadata_props.items() if "parametrizations" in text]
    feed = {k: v.numpy() for k, v in inputs.items()}
    [got], [expected] = (run_outputs(tmp_path / f"{name}.onnx", [feed], reduce="raw") for name in ("view", "copy"))
    np.testing.assert_array_equal(got, expected)


def test_errors_computed_in_chunks_are_those_of_the_whole_arrays(monkeypatch):
    """A large output is measured a chunk at a time (bounded memory): the same peak, aggregate and maximum as
    in one piece, non-finite values included."""
    import exporters.onnx as onnx_module

    rng = np.random.default_rng(3)
    t = rng.standard_normal((5, 7, 11)).astype(np.float32) * 10
    g = t + rng.standard_normal(t.shape).astype(np.float32) * 1e-3
    t[0, 0, 0], g[0, 0, 0] = np.inf, np.inf  # agreed on: no error
    g[4, 6, 10] = np.nan  # one side only: infinitely wrong
    whole = output_errors(g, t)
    monkeypatch.setattr(onnx_module, "ERROR_CHUNK", 13)  # 385 elements in 30 chunks, the last one partial
    chunked = output_errors(g, t)
    assert chunked.max_abs_error == whole.max_abs_error == np.inf and chunked.peak_error == whole.peak_error
    g[4, 6, 10] = g[4, 6, 9]
    whole = output_errors(g, t)
    monkeypatch.setattr(onnx_module, "ERROR_CHUNK", 1 << 22)
    assert output_errors(g, t) == whole
    monkeypatch.setattr(onnx_module, "ERROR_CHUNK", 13)
    chunked = output_errors(g, t)
    assert chunked.max_abs_error == whole.max_abs_error and chunked.peak_error == whole.peak_error
    assert chunked.aggregate_error == pytest.approx(whole.aggregate_error, rel=1e-12)


def test_an_export_carries_no_stack_traces_or_paths_of_the_host_that_made_it(tmp_path):
    """The exporter records each node's Python stack trace (absolute paths of this checkout and its packages) and FX
    name: 377 of a small graph's 456 kB, sent to every client of a server."""
    import onnx

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    path = export_hf_onnx(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "m.onnx",
                          output_name="logits")
    proto = onnx.load(str(path))
    nodes = [*proto.graph.node, *(n for f in proto.functions for n in f.node)]
    keys = {p.key for n in nodes for p in n.metadata_props}
    assert nodes and not any(k.startswith(("pkg.torch.onnx.", "namespace")) for k in keys), keys
    assert b"site-packages" not in path.read_bytes() and str(tmp_path).encode() not in path.read_bytes()


def test_an_export_error_ending_in_a_colon_keeps_the_reason_after_it():
    from exporters.onnx import _gist

    assert _gist("Found the following conflicts between ranges:\n  - dim batch is the constant 2\n  later detail") == \
        "Found the following conflicts between ranges: - dim batch is the constant 2"
    assert _gist("\n  one line\nsecond line") == "one line" and _gist("") == ""
    assert len(_gist("a:\n" + "b" * 1000)) == 400
