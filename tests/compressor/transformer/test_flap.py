"""FLAP's structure: fluctuation scores on the dense model and the widths its global search keeps."""

import pytest
import torch
import transformers

from compressor.transformer.adapters import layers
from compressor.transformer.flap import flap_structure, fluctuation_scores
from compressor.transformer.models import save_standard
from compressor.transformer.pipeline import prune_transformer
from compressor.transformer.surgery import load_pruned
from compressor.transformer.surgery import widths as widths_of

from .transformer_models import MODELS, example_inputs, first_output


def test_fluctuation_is_each_inputs_variance_over_counted_tokens_times_its_weight_rows_energy():
    model = MODELS["llama"]().eval()
    batches = [example_inputs(model, batch=3, length=7, seed=s) for s in range(2)]
    seen = []
    o_proj = layers(model)[1].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(lambda _m, inputs: seen.append(inputs[0].detach()))
    attention, ffn = fluctuation_scores(model, batches)
    handle.remove()
    x = torch.cat([s[b["attention_mask"].bool()] for s, b in zip(seen, batches, strict=True)]).double()
    expected = x.var(0) * o_proj.weight.detach().double().square().sum(0)
    torch.testing.assert_close(attention[1], expected)
    assert len(attention) == len(ffn) == 2 and ffn[0].shape == (20,)


@pytest.mark.parametrize("keep", [0.5, 0.8])
def test_flaps_structure_prunes_through_the_pipeline_and_keeps_about_its_share(keep):
    model = MODELS["llama"]().eval()
    batches = [example_inputs(model, batch=3, length=7, seed=s) for s in range(2)]
    structure = flap_structure(model, batches, keep)
    widths = {layer["name"]: layer["width_after"] for layer in structure["layers"]}
    # 8 query heads of head_dim 4 over 2 KV heads (a head: its q and o rows and a quarter of its KV head's k and v
    # rows, (2 + 2 x 2 / 8) x 4 = 10 rows of 32), 20 neurons (3 rows of 32) per layer
    kept = sum(w * (10 / 3 if "o_proj" in n else 1) for n, w in widths.items())
    assert kept == pytest.approx(keep * 2 * (8 * 10 / 3 + 20), abs=10 / 3)
    names = {f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")}
    assert set(widths) | set(structure["removed_layers"]) == names
    assert not structure["removed_layers"]  # every layer of this model keeps some of both
    _, reports = prune_transformer(model, batches, widths, method="flap")
    assert {r.name: r.width_after for r in reports} == widths


def _o_proj_mean(model, batches) -> torch.Tensor:
    """Layer 0's attention output projection's output, averaged over the counted tokens."""
    seen = []
    handle = layers(model)[0].self_attn.o_proj.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    return torch.cat([s[b["attention_mask"].bool()] for s, b in zip(seen, batches, strict=True)]).double().mean(0)


def test_flap_gives_bias_free_output_projections_a_bias_that_keeps_their_mean(tmp_path):
    dense = MODELS["llama"]().eval()  # Llama: no projection has a bias
    batches = [example_inputs(dense, batch=3, length=7, seed=s) for s in range(2)]
    # whole KV groups (1 of 2): query heads pruned one by one read their KV heads through a map, which the
    # remote code cannot state
    widths = {f"model.layers.{i}.{p}": w for i in range(2) for p, w in (("self_attn.o_proj", 1), ("mlp.down_proj", 12))}
    model, _ = prune_transformer(dense, batches, widths, method="flap", gqa="kv-groups")
    for layer in layers(model):
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert proj.bias is not None and proj.bias.abs().max() > 0
        assert layer.self_attn.q_proj.bias is None  # only what the compensation writes into
    # layer 0's kept heads see the dense inputs: FLAP's compensation restores the removed heads' mean exactly
    torch.testing.assert_close(_o_proj_mean(model, batches), _o_proj_mean(dense, batches), rtol=1e-5, atol=1e-6)
    manifest = widths_of(model)
    assert manifest["biases"] == [f"{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")]
    # the config cannot state the biases: the width manifest and the remote code carry them, both reload exactly
    assert not save_standard(model, tmp_path)
    inputs = example_inputs(model, seed=5)
    expected = first_output(model, inputs)
    torch.testing.assert_close(first_output(load_pruned(tmp_path), inputs), expected, rtol=0, atol=0)
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, local_files_only=True)
    torch.testing.assert_close(first_output(auto.eval(), inputs), expected, rtol=0, atol=0)


@pytest.mark.parametrize(("method", "add_bias", "biased"), [("osscar", None, False), ("osscar", True, True),
                                                            ("flap", False, False), ("wanda-sp", True, False)])
def test_a_bias_is_added_by_flap_or_when_asked_and_only_by_methods_that_compensate(method, add_bias, biased):
    dense = MODELS["llama"]().eval()
    batches = [example_inputs(dense, batch=3, length=7, seed=s) for s in range(2)]
    model, _ = prune_transformer(dense, batches, 0.25, method=method, add_bias=add_bias)
    assert all((layer.mlp.down_proj.bias is not None) == biased for layer in layers(model))
    assert bool(widths_of(model).get("biases")) == biased


def test_flap_refuses_latent_attention_heads_whose_rows_it_does_not_weigh():
    """FLAP's allocation weighs a head as 4 x head_dim x hidden parameters; a latent attention head's rows come from
    latents of their own widths (MiniCPM3-4B's: 2.4x fewer), so its budget would be sized wrong: refused in one line."""
    from compressor.errors import UnsupportedArchitecture

    from .transformer_models import LLAMA_SHAPED

    model = LLAMA_SHAPED["minicpm3"]()
    with pytest.raises(UnsupportedArchitecture, match="minicpm3's multi-head latent attention heads are not"):
        flap_structure(model, [example_inputs(model)], 0.5)


def test_flap_refuses_a_recurrent_mixer_beside_the_attention():
    """Falcon-H1 runs a Mamba2 mixer beside each attention, which FLAP's budget over heads and neurons does not weigh,
    and an attention it would empty cannot go alone (the layer's cache holds both): refused in one line."""
    from compressor.errors import UnsupportedArchitecture

    from .transformer_models import LLAMA_SHAPED

    model = LLAMA_SHAPED["falcon_h1"]()
    with pytest.raises(UnsupportedArchitecture, match="falcon_h1's layers run a recurrent mixer beside the attention"):
        flap_structure(model, [example_inputs(model)], 0.5)
