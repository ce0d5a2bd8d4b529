"""ONNX Runtime's fused kernels on our exports: fused where the fused graph matches PyTorch, else the plain one."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compressor.transformer.adapters import dims
from compressor.transformer.surgery import prune_ffn, prune_heads
from exporters import fusion as fusion_module
from exporters.fusion import FUSIONS_KEY, fuse_checked, fusion_of, unfused_path
from exporters.onnx import ParityError, ParityMismatch, check_hf_parity, export_hf_onnx
from tests.compressor.transformer.transformer_models import MODELS, example_inputs, first_output, output_name

CONTRIB = "com.microsoft"


def _contrib_ops(path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.domain == CONTRIB]


def _pruned(family: str):
    """Layer 0 keeps one KV group (its query heads), layer 1 four FFN neurons: per-layer widths differ."""
    model = MODELS[family]()
    prune_heads(model, 0, [dims(model).kv_heads - 1])
    prune_ffn(model, 1, [0, 3, 4, 9])
    return model


def _export(model, directory):
    example = example_inputs(model, batch=2, length=10)
    return export_hf_onnx(model, example, directory / "model.onnx", output_name=output_name(model), max_length=32)


def _padded(model):
    inputs = example_inputs(model, batch=3, length=17, seed=3)
    inputs["attention_mask"][1, 11:] = 0  # one padded row: the fused attention must mask it as the plain one does
    return inputs


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_each_layer_attention_fuses_with_its_own_head_count_and_matches_pytorch(family, tmp_path):
    model = _pruned(family)
    path = _export(model, tmp_path)
    inputs = _padded(model)
    parity, fusion = fuse_checked(path, lambda graph: check_hf_parity(model, graph, inputs, output_name(model)))
    assert fusion.fused and fusion.fallback is None and parity.peak_error < 1e-4
    heads = sorted(a.i for n in _contrib_ops(path) if n.op_type in ("Attention", "MultiHeadAttention")
                   for a in n.attribute if a.name == "num_heads")
    assert heads == [dims(model).heads // dims(model).kv_heads, dims(model).heads]
    assert fusion_of(path) == fusion
    # the plain graph is kept beside, unfused, for the job's figures as exported
    assert unfused_path(path).is_file() and not _contrib_ops(unfused_path(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {k: v.numpy() for k, v in inputs.items()})[0]
    real = inputs["attention_mask"].bool().numpy()
    np.testing.assert_allclose(got[real], first_output(model, inputs).numpy()[real], rtol=1e-4, atol=1e-4)


def test_an_epsilon_of_1e_8_stays_in_the_exported_and_the_fused_graph(tmp_path):
    """onnxscript's optimizer took `variance + 1e-8` for `variance + 0` (its no-op rules match constants within
    1e-8): Helium's RMSNorms lost their epsilon, a padding token's zero embedding normalised to NaN and attention
    spread it over its whole row, so the dense export of a job failed parity (inf) wherever a window held the padding
    token."""
    from tests.compressor.transformer.transformer_models import LLAMA_SHAPED

    model = LLAMA_SHAPED["helium"]()
    assert model.config.rms_norm_eps == 1e-8 and model.model.embed_tokens.padding_idx == 0
    path = _export(model, tmp_path)
    inputs = _padded(model)
    inputs["input_ids"][:, 4] = 0  # the padding token inside every row (zero embeddings)
    assert check_hf_parity(model, path, inputs, "logits").peak_error < 1e-4
    parity, fusion = fuse_checked(path, lambda graph: check_hf_parity(model, graph, inputs, "logits"))
    assert fusion.fused and fusion.fallback is None and parity.peak_error < 1e-4
    norms = [n for n in onnx.load(str(path), load_external_data=False).graph.node if "LayerNormalization" in n.op_type]
    assert norms and all(np.isclose(a.f, 1e-8) for n in norms for a in n.attribute if a.name == "epsilon")


def test_gpt2s_gemms_become_matmuls_so_its_attention_fuses_and_matches_pytorch(tmp_path):
    """GPT-2's Conv1D exports as Reshape -> Gemm -> Reshape; onnxscript's optimizer removed the reshapes and left a
    Gemm on a 3-D input, which ONNX Runtime refuses: every GPT-2 graph shipped unfused, with two warnings per export."""
    model = MODELS["gpt2"]().eval()
    path = _export(model, tmp_path)
    inputs = _padded(model)
    parity, fusion = fuse_checked(path, lambda graph: check_hf_parity(model, graph, inputs, output_name(model)))
    assert fusion.fused and parity.peak_error < 1e-4, fusion
    assert fusion.counts[fusion_module.GEMM_AS_MATMUL] > 0 and fusion.counts.get("sdpa", 0) > 0
    assert not [n for n in onnx.load(str(path)).graph.node if n.op_type == "Gemm"]
    # no stale 2-D shapes of values the rewrites made 3-D (ONNX Runtime warned of them at every load)
    graph = onnx.load(str(path)).graph
    weights = {i.name for i in graph.initializer}
    assert not [v.name for v in graph.value_info if v.name not in weights and v.type.tensor_type.HasField("shape")]


def test_a_half_precision_gemma2_fuses_its_skip_norms_with_their_weights_cast(tmp_path):
    """Gemma's RMSNorm scales by 1 + weight in float32: the fused fp16 skip-norm got a float32 gamma, which ONNX
    Runtime refused to load, and Gemma 2's fp16 graphs shipped unfused."""
    from exporters.onnx import PARITY_TOLERANCES, in_precision

    model = MODELS["gemma2"]().eval()
    half = in_precision(model, "fp16")
    example = example_inputs(model, batch=2, length=10)
    path = export_hf_onnx(half, example, tmp_path / "model.onnx", output_name=output_name(model), max_length=32)
    inputs = _padded(model)
    parity, fusion = fuse_checked(path, lambda graph: check_hf_parity(half, graph, inputs, output_name(model),
                                                                      tolerance=PARITY_TOLERANCES["fp16"]))
    assert fusion.fused and parity.peak_error <= PARITY_TOLERANCES["fp16"].peak, fusion
    assert fusion.counts["skip_rms_normalization"] > 0 and fusion.counts[fusion_module.NORM_WEIGHTS_CAST] > 0


def _session_ops(path, tmp_path) -> set[str]:
    """The operators of the graph ONNX Runtime runs after its own session-level fusions."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "as_run.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}


def test_a_cpu_graph_keeps_the_residual_sum_apart_from_its_norm_and_onnx_runtime_leaves_it_so(tmp_path):
    """ONNX Runtime's CPU SkipLayerNormalization is slower than Sum + LayerNormalization; CUDA's is not."""
    model = _pruned("bert")
    inputs = _padded(model)
    graphs = {}
    for provider in ("cpu", "cuda"):
        (tmp_path / provider).mkdir()
        path = _export(model, tmp_path / provider)
        _, graphs[provider] = fuse_checked(path, lambda graph: check_hf_parity(model, graph, inputs,
                                                                                output_name(model)), provider)
        ops = {n.op_type for n in _contrib_ops(path)}
        assert ("SkipLayerNormalization" in ops) == (provider == "cuda") and "Attention" in ops
    layers = len(model.encoder.layer)
    assert graphs["cpu"].counts[fusion_module.SKIP_AS_SUM] == 2 * layers and fusion_module.SKIP_AS_SUM not in \
        graphs["cuda"].counts
    as_run = _session_ops(tmp_path / "cpu" / "model.onnx", tmp_path)
    assert "SkipLayerNormalization" not in as_run and {"Sum", "LayerNormalization", "Attention"} <= as_run


def _rejects_fused(graph):
    if _contrib_ops(graph):
        raise ParityError([ParityMismatch("logits", "peak error 0.5 of scale")])
    return fusion_module.Parity(0.0, 0.0, 0.0)


def test_a_fused_graph_that_fails_its_check_ships_as_exported(tmp_path):
    model = _pruned("llama")
    path = _export(model, tmp_path)
    plain_nodes = len(onnx.load(str(path)).graph.node)
    _, fusion = fuse_checked(path, _rejects_fused)
    assert not _contrib_ops(path) and len(onnx.load(str(path)).graph.node) == plain_nodes
    assert fusion.fallback.startswith("the fused graph failed its check") and "peak error 0.5" in fusion.fallback
    assert fusion_of(path).fallback == fusion.fallback and not fusion.fused


def test_a_fusion_that_raises_ships_the_plain_graph_and_a_plain_graph_failing_raises(tmp_path, monkeypatch):
    import onnxscript.rewriter.ort_fusions as ort_fusions

    def broken(model):
        raise RuntimeError("a rewrite rule's bug")

    model = _pruned("bert")
    path = _export(model, tmp_path)
    monkeypatch.setattr(ort_fusions, "optimize_for_ort", broken)
    _, fusion = fuse_checked(path, _rejects_fused)
    assert fusion.fallback == "the fusion failed: RuntimeError" and not _contrib_ops(path)

    def always_fails(graph):
        raise ParityError([ParityMismatch("last_hidden_state", "shape (1,) != (2,)")])

    with pytest.raises(ParityError, match="shape"):  # the plain graph is what failed: the job's parity_failed
        (tmp_path / "again").mkdir()
        fuse_checked(_export(model, tmp_path / "again"), always_fails)


@pytest.mark.parametrize("fused_limit", [0, 2 * 1024**3])
def test_weights_in_external_data_stay_beside_the_fused_graph(tmp_path, monkeypatch, fused_limit):
    """Over 2 GB both graphs keep their weights beside them; a graph of 1.5-2 GB too (torch's exporter writes
    external data from 1.5 GB on: its fused graph, saved as it was read, pointed at the plain graph's data file,
    moved away with it, and never loaded)."""
    from exporters import onnx as onnx_exporter

    monkeypatch.setattr(onnx_exporter, "EXTERNAL_DATA_BYTES", 0)  # as a model over 1.5 GB is saved
    monkeypatch.setattr(fusion_module, "EXTERNAL_DATA_BYTES", fused_limit)
    model = _pruned("llama")
    (tmp_path / "x").mkdir()
    path = _export(model, tmp_path / "x")
    inputs = _padded(model)
    _, fusion = fuse_checked(path, lambda graph: check_hf_parity(model, graph, inputs, output_name(model)))
    assert fusion.fused and (tmp_path / "x" / "model.onnx.data").is_file()
    assert (unfused_path(path).parent / "model.onnx.data").is_file()
    stamped = onnx.load(str(path), load_external_data=False).metadata_props
    assert [p.key for p in stamped if p.key == FUSIONS_KEY] == [FUSIONS_KEY]
