"""FLAP's structure: fluctuation scores on the dense model and the widths its global search keeps."""

import pytest
import torch

from compressor.transformer.adapters import layers
from compressor.transformer.flap import flap_structure, fluctuation_scores
from compressor.transformer.pipeline import prune_transformer

from .transformer_models import MODELS, example_inputs


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
    # 8 query heads of head_dim 4 (a head: 2 x 4 rows of 32), 20 neurons (3 rows of 32) per layer
    kept = sum(w * (8 / 3 if "o_proj" in n else 1) for n, w in widths.items())
    assert kept == pytest.approx(keep * 2 * (8 * 8 / 3 + 20), abs=8 / 3)
    names = {f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")}
    assert set(widths) | set(structure["removed_layers"]) == names
    assert not structure["removed_layers"]  # every layer of this model keeps some of both
    _, reports = prune_transformer(model, batches, widths, method="flap")
    assert {r.name: r.width_after for r in reports} == widths
