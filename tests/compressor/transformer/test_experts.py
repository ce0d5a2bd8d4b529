"""Mixture-of-Experts layers: the experts' routed inputs, their surgery, their solve, their export and their config."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from compressor.progress import WARNING
from compressor.transformer.adapters import layers
from compressor.transformer.experts import (
    ALIGN,
    aligned_width,
    down_weight,
    expert_inputs,
    expert_width,
    experts_as_operator,
    interleaved,
    keep_expert_neurons,
    moe_blocks,
    router_of,
    routing_settled,
    sparse_mixer,
)
from compressor.transformer.models import save_standard
from compressor.transformer.pipeline import group_cost, prune_transformer
from compressor.transformer.surgery import prune_ffn
from exporters.onnx import HFReference, ParityError, check_hf_outputs, export_hf_onnx, hf_reference

from .transformer_models import (
    MODELS,
    MOE_EXTRA,
    example_inputs,
    first_output,
    tiny_mixtral,
    tiny_qwen3_moe,
)

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "phimoe", "gpt_oss", "olmoe", "flex_olmo", "glm4_moe")
MODELS = {**MODELS, **MOE_EXTRA}


def _routing(block, x):
    """The block's router on x (tokens, hidden): (top-k indices, their weights)."""
    _, weights, index = router_of(block)(x)
    return index, weights


@pytest.mark.parametrize("name", FAMILIES)
def test_each_experts_routed_inputs_through_its_down_projection_sum_to_the_layers_output(name):
    """The rows an expert's solve reads are its activations times the routing weight: through its down projection
    and summed over the experts they give the layer's output, so their least squares is the error added to the
    stream."""
    model = MODELS[name]()
    block = moe_blocks(model)[0]
    x = torch.randn(30, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    index, weights = _routing(block, x)
    rows = expert_inputs(block.experts, x, index, weights)
    assert sum(r.shape[0] for r in rows) == 30 * model.config.num_experts_per_tok
    summed = torch.zeros_like(x)
    for e, (tokens, slots) in enumerate(torch.where(index == e) for e in range(len(rows))):
        y = rows[e] @ down_weight(block.experts, e)
        if interleaved(block.experts):  # gpt-oss's down projection has a bias, scaled by the routing weight too
            y = y + weights[tokens, slots, None] * block.experts.down_proj_bias[e]
        summed.index_add_(0, tokens, y)
    with torch.no_grad():
        torch.testing.assert_close(summed, block.experts(x, index, weights), rtol=1e-5, atol=1e-6)


def test_each_expert_keeps_its_own_neurons_and_a_refit_down_weight():
    model = tiny_mixtral()
    experts = layers(model)[0].mlp.experts
    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    keeps = [list(range(8)), list(range(12, 20)), list(range(0, 16, 2)), list(range(1, 17, 2))]
    refit = torch.randn(down.shape[1], 8)
    keep_expert_neurons(experts, keeps, [None, refit, None, None])
    assert experts.gate_up_proj.shape == (4, 16, 32) and experts.down_proj.shape == (4, 32, 8)
    width = down.shape[-1]
    torch.testing.assert_close(experts.gate_up_proj[2], gate_up[2][keeps[2] + [width + k for k in keeps[2]]])
    torch.testing.assert_close(experts.down_proj[0], down[0][:, keeps[0]])
    torch.testing.assert_close(experts.down_proj[1], refit)


def test_expert_widths_are_refused_when_they_differ_or_break_the_kernels_alignment():
    experts = layers(tiny_mixtral())[0].mlp.experts
    with pytest.raises(ValueError, match=r"one width; got widths \[8, 16\]"):
        keep_expert_neurons(experts, [range(8), range(16), range(8), range(8)])
    with pytest.raises(ValueError, match=r"multiple of 8 neurons .* got 5 of 20"):
        keep_expert_neurons(experts, [range(5)] * 4)
    with pytest.raises(ValueError, match=r"indices out of range \[0, 20\): \[20\]"):
        keep_expert_neurons(experts, [range(13, 21)] * 4)
    with pytest.raises(ValueError, match="4 experts"):
        keep_expert_neurons(experts, [range(8)] * 3)
    assert [aligned_width(20, k) for k in (1, 8, 9, 16, 17, 20)] == [8, 8, 16, 16, 20, 20]
    assert ALIGN == 8


@pytest.mark.parametrize("name", FAMILIES)
def test_osscar_reconstructs_the_experts_better_than_magnitude(name):
    """Each expert solved on its routed tokens: the pruned model's outputs stay nearer the dense model's than
    magnitude pruning's at the same widths (a quarter of each expert's neurons and of the heads)."""
    model = MODELS[name]()
    batches = [example_inputs(model, batch=4, length=16, seed=s) for s in range(3)]
    dense = first_output(model, example_inputs(model, batch=2, length=12, seed=9))
    errors = {}
    for method in ("osscar", "mp"):
        pruned, reports = prune_transformer(model, batches, 0.25, method=method)
        experts = [r for r in reports if r.name.endswith("mlp.experts")]
        width = expert_width(layers(model)[0].mlp.experts)  # 20: 15 rounded up to a multiple of 8; gpt-oss's 32: 24
        assert [r.width_after for r in experts] == [aligned_width(width, width - round(0.25 * width))] * 2
        out = first_output(pruned, example_inputs(model, batch=2, length=12, seed=9))
        errors[method] = float((out - dense).norm() / dense.norm())
    assert errors["osscar"] < errors["mp"]


def test_an_expert_no_calibration_token_reaches_keeps_its_largest_neurons_and_is_reported():
    model = tiny_qwen3_moe()

    def never_three(_router, _args, out):  # layer 0's router never picks expert 3 (norm_topk_prob off)
        logits = out[0].clone()
        logits[:, 3] = float("-inf")
        weights, index = logits.softmax(-1).topk(2, -1)
        return logits, weights, index

    layers(model)[0].mlp.gate.register_forward_hook(never_three)
    seen = []
    batch = example_inputs(model, batch=2, length=12)
    dense_down = layers(model)[0].mlp.experts.down_proj[3].detach().clone()
    pruned, _ = prune_transformer(model, [batch], 0.5, progress=seen.append)
    warnings = [p.message for p in seen if p.stage == WARNING and "no calibration token" in p.message]
    assert len(warnings) == 1 and "experts [3]" in warnings[0]
    largest = dense_down.norm(dim=0).topk(ALIGN * 2).indices.sort().values
    # the weights kept as they were: the columns of largest norm
    torch.testing.assert_close(layers(pruned)[0].mlp.experts.down_proj[3], dense_down[:, largest])
    assert torch.isfinite(first_output(pruned)).all()


@pytest.mark.parametrize("name", FAMILIES)
def test_the_export_runs_each_moe_layer_as_one_onnx_runtime_moe_node(name, tmp_path):
    model = MODELS[name]()
    prune_ffn(model, 1, range(8))
    example = example_inputs(model, batch=2, length=10)
    path = export_hf_onnx(model, example, tmp_path / "m.onnx", output_name="logits", max_length=32)
    nodes = [n for n in onnx.load(str(path)).graph.node if n.op_type == "MoE"]
    assert len(nodes) == 2 and {n.domain for n in nodes} == {"com.microsoft"}
    # the node always renormalises (ONNX Runtime 1.31 did so whatever the attribute said); a router that does not
    # (the tiny Qwen3-MoE's norm_topk_prob is off) scales the node's output by its top-k weights' sum
    assert {a.i for n in nodes for a in n.attribute if a.name == "normalize_routing_weights"} == {1}
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    # renormalised top-k (Mixtral, gpt-oss) and the sparse mixer need none
    # GLM-4.5's router picks by its own forward (its groups' top-2, the best group, the top-k within it): three a layer
    assert ops.count("TopK") == {"mixtral": 0, "phimoe": 0, "gpt_oss": 0, "glm4_moe": 6}.get(name, 2)
    feed = example_inputs(model, batch=3, length=17, seed=3)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {k: v.numpy() for k, v in feed.items()})[0]
    np.testing.assert_allclose(got, first_output(model, feed).numpy(), rtol=1e-4, atol=1e-4)
    assert not any("forward" in vars(b) for b in moe_blocks(model))  # the blocks' own forward again


def test_the_parity_check_holds_an_export_to_the_tokens_before_a_routers_near_tie(tmp_path):
    """ONNX Runtime's rounding may pick the other expert where a router's k-th and (k+1)-th experts are a near tie, and
    the causal tokens after that one read it: the reference vouches for the tokens before the first such tie of each
    row. An export is held to every token first; one that fails there passes when it holds at those tokens and they
    are at least half of them (a difference before a tie still fails it, and so does one that leaves too few)."""
    model = tiny_qwen3_moe()
    example = example_inputs(model, batch=2, length=10)
    path = export_hf_onnx(model, example, tmp_path / "m.onnx", output_name="logits", max_length=32)
    feed = {"input_ids": example["input_ids"], "attention_mask": torch.ones_like(example["input_ids"])}
    reference = hf_reference(model, feed, "logits")
    assert reference.settled is not None and reference.settled.shape == (2, 10)
    assert not (reference.settled[:, 1:] & ~reference.settled[:, :-1]).any()  # once unsettled, the rest of the row
    assert hf_reference(MODELS["llama"](), feed, "logits").settled is None  # no router: every token vouched for
    assert check_hf_outputs(path, feed, reference).peak_error < 1e-4
    after_a_tie = [o.copy() for o in reference.outputs]
    after_a_tie[0][0, 4:] += 1.0  # what a swapped expert at token (0, 4) would give from there on
    settled = torch.ones(2, 10, dtype=torch.bool)
    settled[0, 4:] = False
    assert check_hf_outputs(path, feed, HFReference(after_a_tie, settled)).peak_error < 1e-4
    with pytest.raises(ParityError):
        check_hf_outputs(path, feed, HFReference(after_a_tie))
    before_it = [o.copy() for o in reference.outputs]
    before_it[0][0, 3] += 1.0
    with pytest.raises(ParityError):
        check_hf_outputs(path, feed, HFReference(before_it, settled))
    few = torch.zeros(2, 10, dtype=torch.bool)
    few[:, :4] = True  # 8 of 20 tokens before the ties: too few to forgive the rest
    with pytest.raises(ParityError, match="only 40% of the tokens come before every near tie"):
        check_hf_outputs(path, feed, HFReference(after_a_tie, few))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_operator_the_export_traces_equals_the_blocks_forward(name):
    """Qwen2-MoE's shared expert (its own sigmoid gate) is added beside the operator's routed experts."""
    model = MODELS[name]()
    feed = example_inputs(model, batch=2, length=9)
    expected = first_output(model, feed)
    with experts_as_operator(model) as found:
        assert found
        torch.testing.assert_close(first_output(model, feed), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["qwen3_moe", "phimoe", "glm4_moe"])
def test_a_router_near_a_tie_leaves_its_tokens_unsettled(name):
    """A zero router gives every expert the same logit at every token: which k experts a token visits is then down to
    rounding (ONNX Runtime's may differ from PyTorch's); a random one decides clearly."""
    model = MODELS[name]()
    with torch.no_grad():
        router_of(layers(model)[0].mlp).weight.zero_()
        getattr(router_of(layers(model)[0].mlp), "e_score_correction_bias", torch.empty(0)).zero_()
    feed = example_inputs(model, batch=2, length=9)
    with routing_settled(model) as found:
        first_output(model, feed)
    assert [f.shape for f in found] == [(2, 9), (2, 9)]
    assert not found[0].any() and found[1].float().mean() > 0.9


def test_a_gelu_expert_is_not_exported():
    model = tiny_mixtral()
    layers(model)[0].mlp.experts.act_fn = transformers.activations.ACT2FN["gelu"]
    with pytest.raises(ValueError, match="SwiGLU"), experts_as_operator(model):
        pass


def test_a_shared_expert_without_its_gate_is_not_exported():
    model = MODELS["qwen2_moe"]()
    del layers(model)[1].mlp.shared_expert_gate
    with pytest.raises(ValueError, match="shared expert without its sigmoid gate"), experts_as_operator(model):
        pass
    assert not any("forward" in vars(b) for b in moe_blocks(model))


@pytest.mark.parametrize("name, key", [("mixtral", "intermediate_size"), ("qwen3_moe", "moe_intermediate_size"),
                                       ("qwen2_moe", "moe_intermediate_size")])
def test_uniform_expert_widths_save_a_config_transformers_loads_alone(name, key, tmp_path):
    model = MODELS[name]()
    for i in range(2):
        prune_ffn(model, i, range(2, 10))
    assert save_standard(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())[key] == 8
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(first_output(reloaded), first_output(model))


def test_one_neuron_of_every_expert_costs_a_token_its_top_k_experts_rows():
    model = tiny_mixtral()  # hidden 32, 2 experts a token, SwiGLU: gate, up and down rows
    assert group_cost(model, "ffn_neurons", 128) == 32 * 3 * 2


@pytest.mark.parametrize("name", ["mixtral", "phimoe"])
def test_a_blocks_fit_reaches_its_experts_but_not_its_router(name):
    """Phi-3.5-MoE's router is an nn.Linear: a fit would move its choices."""
    from compressor.transformer.refine import BlockReconstruction, RefineConfig

    block = layers(MODELS[name]())[0]
    fitted = {id(p) for p in BlockReconstruction(block, RefineConfig(steps=1)).parameters}
    assert id(block.mlp.experts.gate_up_proj) in fitted and id(block.mlp.experts.down_proj) in fitted
    assert id(router_of(block.mlp).weight) not in fitted and id(block.self_attn.o_proj.weight) in fitted


def test_experts_read_in_several_passes_prune_as_in_one(monkeypatch):
    """A layer whose experts' statistics exceed EXPERT_STATISTICS_BYTES is read a share of its experts a pass: the
    same solves, the same model, and the dense stream advanced once (the next block sees the same inputs)."""
    from compressor.transformer import pipeline

    model = tiny_mixtral()
    batches = [example_inputs(model, batch=3, length=12, seed=s) for s in range(2)]
    one, one_reports = prune_transformer(model, batches, 0.5)
    monkeypatch.setattr(pipeline, "EXPERT_STATISTICS_BYTES", 8 * 20 * (20 + 32))  # one expert a pass
    passes, reports = prune_transformer(model, batches, 0.5)
    assert [r.objective for r in reports] == pytest.approx([r.objective for r in one_reports], rel=1e-6)
    torch.testing.assert_close(first_output(passes), first_output(one))


def _few_token_case():
    """A tiny Qwen3-MoE (8 experts of 96 neurons, 2 a token) calibrated on 128 tokens: 9-56 tokens an expert, each
    keeping 48 neurons; its held-out inputs."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, moe_intermediate_size=96, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256)
    model = transformers.Qwen3MoeForCausalLM(config).eval()

    def ids(batch, length, seed):
        tokens = torch.randint(3, 50, (batch, length), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}

    plan = {**{f"model.layers.{i}.self_attn.o_proj": 4 for i in range(2)},
            **{f"model.layers.{i}.mlp.experts": 48 for i in range(2)}}
    return model, [ids(4, 32, 0)], ids(8, 64, 99), plan


def test_experts_with_fewer_tokens_than_kept_neurons_lean_on_their_dense_weights(monkeypatch):
    """Least squares alone on an expert's few routed tokens shrank what they do not span toward zero: worse than
    magnitude pruning (0.115 against 0.073 relative output error); the ridge toward the dense weights
    (EXPERT_PRIOR) beats it (0.059), and the job says which experts saw too few tokens."""
    from compressor.transformer import pipeline

    model, calibration, held_out, plan = _few_token_case()
    with torch.no_grad():
        dense = model(**held_out).logits

    def error(method: str) -> float:
        pruned, _ = prune_transformer(model, calibration, plan, method=method, progress=seen.append)
        with torch.no_grad():
            return float((pruned(**held_out).logits - dense).norm() / dense.norm())

    seen = []
    magnitude, osscar = error("mp"), error("osscar")
    warnings = [p.message for p in seen if p.stage == WARNING and "fewer calibration tokens than" in p.message]
    assert osscar < 0.9 * magnitude
    assert warnings and "model.layers.0.mlp.experts: experts [" in warnings[0]
    monkeypatch.setattr(pipeline, "EXPERT_PRIOR", 0.0)  # least squares alone
    assert error("osscar") > magnitude


def test_flap_refuses_a_moe_model_in_one_line():
    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.flap import flap_structure

    model = tiny_mixtral()
    with pytest.raises(UnsupportedArchitecture, match="Mixture-of-Experts layer"):
        flap_structure(model, [example_inputs(model)], 0.5)


@pytest.mark.parametrize("act, refused", [("silu", False), ("swish", False), ("gelu", True)])
def test_swish_is_silu_for_the_experts_check(act, refused):
    from compressor.errors import UnsupportedArchitecture
    from compressor.transformer.adapters import check_config

    config = {"model_type": "mixtral", "hidden_act": act}
    if refused:
        with pytest.raises(UnsupportedArchitecture, match="SwiGLU"):
            check_config(config, "m")
    else:
        check_config(config, "m")


def test_a_moe_layers_report_gives_its_calibration_error_and_each_experts_neurons():
    """The layer's relative error is the calibration's (the ridge's rows left out: with them it read 5x higher on
    few tokens), recomputed here from the routed rows; `experts_kept` says which neurons each expert kept."""
    model, calibration, _, plan = _few_token_case()
    pruned, reports = prune_transformer(model, calibration, plan)
    layer = next(r for r in reports if r.name == "model.layers.0.mlp.experts")
    captured = {}
    hooks = [layers(m)[0].mlp.experts.register_forward_pre_hook(
        lambda _m, args, key=key: captured.setdefault(key, args)) for key, m in (("pruned", pruned), ("dense", model))]
    with torch.no_grad():
        pruned(**calibration[0])
        model(**calibration[0])
    for h in hooks:
        h.remove()
    x, index, weights = captured["pruned"]
    experts, dense = layers(pruned)[0].mlp.experts, layers(model)[0].mlp.experts
    error = energy = 0.0
    with torch.no_grad():
        rows = zip(expert_inputs(experts, x, index, weights),
                   expert_inputs(dense, captured["dense"][0], index, weights), strict=True)
        for e, (a, a_hat) in enumerate(rows):
            target = a_hat @ dense.down_proj[e].T
            error += float((a @ experts.down_proj[e].T - target).square().sum())
            energy += float(target.square().sum())
    assert layer.relative_error == pytest.approx(error / energy, rel=1e-3)
    assert layer.kept == () and len(layer.experts_kept) == 8
    width = dense.down_proj.shape[-1]
    for e, keep in enumerate(layer.experts_kept):
        assert len(keep) == 48 == layer.width_after
        rows = list(keep) + [width + k for k in keep]  # [gate | up]
        torch.testing.assert_close(experts.gate_up_proj[e], dense.gate_up_proj[e][rows])


def test_a_planned_expert_width_rounded_up_is_said_once():
    model = tiny_mixtral()  # 20 neurons an expert: a quarter pruned plans 15, the experts keep 16
    seen = []
    _, reports = prune_transformer(model, [example_inputs(model, batch=4, length=16)], 0.25, progress=seen.append)
    said = [p.message for p in seen if p.stage == WARNING and "where the plan gives" in p.message]
    assert said == ["model.layers.0.mlp.experts: its experts keep 16 of 20 neurons where the plan gives 15: an "
                    "expert's width is a multiple of 8 (transformers' grouped_mm experts kernel wants 16-byte "
                    "strides); further such layers are not reported"]
    assert [r.width_after for r in reports if r.name.endswith("experts")] == [16, 16]


def _shared_expert_rows(model, batch, index):
    """Layer `index`'s shared expert: its input x (tokens, hidden) and activations a (tokens, width) on `batch`, and
    its gate's value s(t) = sigmoid(gate x_t) (tokens, 1)."""
    mlp = layers(model)[index].mlp
    captured = {}
    hook = mlp.shared_expert.register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0]))
    with torch.no_grad():
        model(**batch)
        hook.remove()
        x = captured["x"]
        a = mlp.shared_expert.act_fn(mlp.shared_expert.gate_proj(x)) * mlp.shared_expert.up_proj(x)
        return a, torch.sigmoid(mlp.shared_expert_gate(x))


def test_a_shared_experts_neurons_are_solved_on_its_gated_rows():
    """Qwen2-MoE's shared expert is a unit of its own: a quarter of its neurons pruned beside the experts', its
    least squares on s(t) a(t) (its output is scaled by its gate): the report's error is that one, recomputed here,
    and the pruned model stays nearer the dense one than magnitude pruning's."""
    model = MODELS["qwen2_moe"]()  # shared expert: 24 neurons
    batches = [example_inputs(model, batch=4, length=16, seed=s) for s in range(3)]
    feed = example_inputs(model, batch=2, length=12, seed=9)
    dense = first_output(model, feed)
    errors = {}
    for method in ("osscar", "mp"):
        pruned, reports = prune_transformer(model, batches, 0.25, method=method)
        shared = [r for r in reports if r.name.endswith("mlp.shared_expert.down_proj")]
        assert [(r.width_before, r.width_after, r.kind) for r in shared] == [(24, 18, "ffn_neurons")] * 2
        assert layers(pruned)[1].mlp.shared_expert.gate_proj.out_features == 18
        errors[method] = float((first_output(pruned, feed) - dense).norm() / dense.norm())
    assert errors["osscar"] < 0.5 * errors["mp"]
    plan = {**{f"model.layers.{i}.self_attn.o_proj": 4 for i in (0, 1)},
            **{f"model.layers.{i}.mlp.experts": 20 for i in (0, 1)},
            **{f"model.layers.{i}.mlp.shared_expert.down_proj": 12 for i in (0, 1)}}
    pruned, reports = prune_transformer(model, batches[:1], plan)
    report = next(r for r in reports if r.name == "model.layers.0.mlp.shared_expert.down_proj")
    a, s = _shared_expert_rows(pruned, batches[0], 0)
    a_hat, s_hat = _shared_expert_rows(model, batches[0], 0)
    counted = batches[0]["attention_mask"].reshape(-1).bool()  # padding tokens are not calibration data
    with torch.no_grad():
        target = (s_hat * a_hat)[counted] @ layers(model)[0].mlp.shared_expert.down_proj.weight.T
        got = (s * a)[counted] @ layers(pruned)[0].mlp.shared_expert.down_proj.weight.T
    assert report.relative_error == pytest.approx(float((got - target).square().sum() / target.square().sum()),
                                                  rel=1e-3)


def test_shared_expert_widths_save_load_and_resize():
    """Equal shared widths go to the config (transformers loads the model alone); unequal ones to the manifest, which
    `load_pruned` applies; a manifest of an earlier release (no shared widths) keeps the shared experts whole, and
    one that removes a shared expert without its FFN is refused."""
    import tempfile
    from pathlib import Path

    from compressor.errors import ModelReferenceError
    from compressor.transformer.pipeline import resize_transformer
    from compressor.transformer.surgery import MANIFEST, apply_widths, load_pruned, prune_shared_ffn, widths

    model = MODELS["qwen2_moe"]()
    with tempfile.TemporaryDirectory() as tmp:
        equal = MODELS["qwen2_moe"]()
        for i in range(2):
            prune_shared_ffn(equal, i, range(4, 20))
        assert save_standard(equal, Path(tmp) / "equal")
        assert json.loads((Path(tmp) / "equal" / "config.json").read_text())["shared_expert_intermediate_size"] == 16
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "equal")
        torch.testing.assert_close(first_output(reloaded), first_output(equal))
        unequal = MODELS["qwen2_moe"]()
        prune_shared_ffn(unequal, 1, [0, 5, 9, 23])
        assert widths(unequal)["shared"] == [24, 4]
        assert not save_standard(unequal, Path(tmp) / "unequal")
        torch.testing.assert_close(first_output(load_pruned(Path(tmp) / "unequal")), first_output(unequal))
        manifest = json.loads((Path(tmp) / "unequal" / MANIFEST).read_text())
    earlier = MODELS["qwen2_moe"]()
    apply_widths(earlier, {"heads": [4, 4], "ffn": [20, 20]})
    assert [layers(earlier)[i].mlp.shared_expert.down_proj.in_features for i in (0, 1)] == [24, 24]
    with pytest.raises(ModelReferenceError, match="removed together"):
        apply_widths(MODELS["qwen2_moe"](), {**manifest, "shared": [0, 4]})
    plan = {**{f"model.layers.{i}.self_attn.o_proj": 4 for i in (0, 1)},
            **{f"model.layers.{i}.mlp.experts": 16 for i in (0, 1)},
            "model.layers.0.mlp.shared_expert.down_proj": 8, "model.layers.1.mlp.shared_expert.down_proj": 24}
    resized = resize_transformer(model, plan)
    assert widths(resized)["shared"] == [8, 24] and widths(resized)["ffn"] == [16, 16]


def test_a_plan_naming_no_shared_expert_width_keeps_it_whole():
    """A width plan of an earlier release (a report's widths, `--widths-from`) names no shared expert: it stays whole,
    as it was then, and the job says so once."""
    from compressor.transformer.pipeline import resize_transformer

    model = MODELS["qwen2_moe"]()
    plan = {**{f"model.layers.{i}.self_attn.o_proj": 2 for i in (0, 1)},
            **{f"model.layers.{i}.mlp.experts": 8 for i in (0, 1)}}
    seen = []
    pruned, reports = prune_transformer(model, [example_inputs(model, batch=4, length=16)], plan, progress=seen.append)
    assert [r.name.rsplit(".", 1)[-1] for r in reports] == ["o_proj", "experts"] * 2
    assert [layers(pruned)[i].mlp.shared_expert.down_proj.in_features for i in (0, 1)] == [24, 24]
    assert len([p for p in seen if p.stage == WARNING and "names no width" in p.message]) == 1
    resized = resize_transformer(model, plan)
    assert [layers(resized)[i].mlp.shared_expert.down_proj.in_features for i in (0, 1)] == [24, 24]


def test_one_shared_expert_neuron_costs_every_token_its_three_rows():
    model = MODELS["qwen2_moe"]()  # hidden 32: gate, up and down rows
    assert group_cost(model, "ffn_neurons", 128, shared=True) == 32 * 3


def test_a_removed_ffns_update_is_the_mean_of_its_experts_and_its_gated_shared_expert():
    """The stand-in of a removed Qwen2-MoE FFN adds the calibration mean of the whole MoE block's output: the routed
    experts' and the gated shared expert's (it was the experts' alone)."""
    from compressor.transformer.sublayers import FFN, RemovedSublayer

    model = MODELS["qwen2_moe"]()
    batch = example_inputs(model, batch=4, length=16)
    outputs = []
    mlp = layers(model)[1].mlp
    hooks = [mlp.register_forward_hook(lambda _m, _args, out: outputs.append(out)),
             mlp.shared_expert.register_forward_pre_hook(lambda _m, args: outputs.append(args[0]))]
    with torch.no_grad():
        model(**batch)
        for hook in hooks:
            hook.remove()
        x, out = outputs  # the shared expert's input runs first
        counted = batch["attention_mask"].reshape(-1).bool()
        shared_mean = (torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x))[counted].mean(0)
    outputs = [out]
    pruned, _ = prune_transformer(model, [batch], 0.0, sublayers=[(1, FFN)], refine=None)
    stand_in = layers(pruned)[1].mlp
    assert isinstance(stand_in, RemovedSublayer)
    expected = outputs[0].reshape(-1, 32)[counted].mean(0)
    torch.testing.assert_close(stand_in.update, expected, rtol=1e-4, atol=1e-6)
    assert (stand_in.update - expected).norm() < 0.01 * shared_mean.norm()  # the shared expert's part is no rounding


def test_the_decode_steps_parity_sets_aside_a_row_whose_new_token_is_a_routers_near_tie(tmp_path):
    """A near tie of a router's top-k experts at a new token changes its logits and, past that layer, its keys and
    values: a failing decode step is checked again on the rows without one, whole, when they are at least half."""
    from exporters.onnx import check_decode_outputs, decode_reference, export_decode_step

    model = tiny_qwen3_moe()
    ids = torch.randint(3, 50, (4, 9), generator=torch.Generator().manual_seed(1))
    path = export_decode_step(model, ids[:, :6], tmp_path / "decode.onnx", max_length=32)
    inputs, reference = decode_reference(model, ids)
    assert reference.settled is not None and reference.settled.shape == (4, 1)
    assert decode_reference(MODELS["llama"](), ids)[1].settled is None  # no router
    assert check_decode_outputs(path, inputs, reference).peak_error < 1e-4
    swapped = [o.copy() for o in reference.outputs]
    for o in swapped:  # row 0 as a swapped expert would leave it: its logits and its keys and values
        o[0] += 1.0
    settled = torch.ones(4, 1, dtype=torch.bool)
    settled[0] = False
    assert check_decode_outputs(path, inputs, HFReference(swapped, settled)).peak_error < 1e-4
    with pytest.raises(ParityError):
        check_decode_outputs(path, inputs, HFReference(swapped))
    with pytest.raises(ParityError):  # a settled row that differs still fails
        check_decode_outputs(path, inputs, HFReference(swapped, torch.ones(4, 1, dtype=torch.bool)))
    few = torch.zeros(4, 1, dtype=torch.bool)
    few[3] = True
    with pytest.raises(ParityError, match="only 25% of the rows"):
        check_decode_outputs(path, inputs, HFReference(swapped, few))


@pytest.mark.parametrize("eps", [0.01, 0.0, 0.5])
def test_the_sparse_mixer_routes_as_phi_3_5_moes_router(eps):
    """Phi-3.5-MoE's two experts and their weights (transformers' sparsemixer outside training), which the export
    computes in plain ops before the MoE node (whose CPU kernel ignores use_sparse_mixer)."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    logits = torch.randn(300, 6, generator=torch.Generator().manual_seed(0)) * 0.05
    logits[:5, 1] = logits[:5, 0]  # exact ties
    expected_weights, expected_index = sparsemixer(logits, jitter_eps=eps, training=False)
    weights, index = sparse_mixer(logits, eps)
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(weights, expected_weights)
    assert (weights > 0).all() and (weights <= 1).all()



def test_deepseek_v2_and_ernie_near_ties_are_measured_on_their_own_scale():
    """DeepSeek-V2's choices are read on its logits (which order experts and groups as their softmax does) and ERNIE
    4.5's scores apart by a share of the k-th: a half-precision pass's margin (4 roundings: 3.9e-3) on softmax
    probabilities of 160 experts (~0.006 each) would call nearly every token a near tie, and the parity check could
    never set a rounding's routing flip apart. Ties built in are still found."""
    from types import SimpleNamespace

    from compressor.transformer.experts import _groups_clear

    margin = 4 * torch.finfo(torch.float16).eps
    logits = torch.randn(400, 160, generator=torch.Generator().manual_seed(0)) * 2
    greedy = SimpleNamespace(topk_method="greedy", top_k=6, num_group=None, topk_group=None)
    grouped = SimpleNamespace(topk_method="group_limited_greedy", top_k=6, num_group=8, topk_group=3)
    ernie = SimpleNamespace(top_k=6, moe_statics=SimpleNamespace(e_score_correction_bias=torch.zeros(1, 160)))
    for router in (greedy, grouped, ernie):
        assert _groups_clear(router, logits, margin).float().mean() > 0.9
    tied = logits.clone()
    order = tied[0].argsort(descending=True)
    tied[0, order[6]] = tied[0, order[5]]  # the 6th and 7th experts of token 0 tie
    for router in (greedy, ernie):
        assert not _groups_clear(router, tied, margin)[0]
    # ERNIE: a bias that brings token 0's scores near 0 leaves its 6th and 7th experts 6e-8 apart, far within a
    # rounding of their softmax scores (6e-3 on average): a near tie, however small the biased scores are
    p = logits[0].softmax(-1)
    offsets = torch.linspace(1e-5, 0, 160)
    ernie.moe_statics.e_score_correction_bias = (offsets - p).unsqueeze(0)
    assert not _groups_clear(ernie, logits, margin)[0]
    assert _groups_clear(ernie, logits, margin)[1:].float().mean() > 0.5
