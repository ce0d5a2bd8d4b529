import copy

import pytest
import torch

from compressor.errors import UnsupportedArchitecture
from compressor.modules import count_parameters
from compressor.transformer.adapters import adapter_for, dims, layers
from compressor.transformer.experts import is_experts
from compressor.transformer.models import save_standard
from compressor.transformer.sublayers import (
    ATTENTION,
    FFN,
    check_removable,
    is_removed,
    kv_layers,
    remove_sublayer,
    removed_sublayers,
)
from compressor.transformer.surgery import (
    MANIFEST,
    load_pruned,
    projection,
    prune_ffn,
    remove_layers,
    widths,
)

from .transformer_models import MODELS, first_output, tiny_gemma2, tiny_llama


def _constant_update(model, index, path, update):
    """The dense model whose projection at `path` of block `index` outputs `update` for every token: what a
    removed sub-layer with that update must equal (its weights zeroed and its output replaced)."""
    ref = copy.deepcopy(model)
    proj = projection(layers(ref)[index], path)
    (proj.down_proj if is_experts(proj) else proj.weight).data.zero_()  # a MoE layer: every expert's
    proj.register_forward_hook(lambda _m, _i, out: torch.zeros_like(out) + update.to(out))
    shared = getattr(layers(ref)[index].get_submodule(path.rpartition(".")[0]), "shared_expert", None)
    if shared is not None:  # Qwen2-MoE: the FFN removed is the routed experts and the shared one beside them
        shared.register_forward_hook(lambda _m, _i, out: torch.zeros_like(out))
    return ref


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_removed_sublayer_adds_its_constant_update_and_the_model_saves_and_reloads(name, tmp_path):
    """Layer 0's attention and layer 1's FFN removed, each leaving a constant update: the outputs equal the
    dense model with those projections outputting the constant, parameters go, the widths say 0, the saved
    directory keeps the manifest (no config says a missing sub-layer) and reloads to the same outputs."""
    model = MODELS[name]()
    adapter, hidden = adapter_for(model), dims(model).hidden
    gen = torch.Generator().manual_seed(1)
    c_attention, c_ffn = torch.randn(hidden, generator=gen), torch.randn(hidden, generator=gen)
    reference = _constant_update(_constant_update(model, 0, adapter.o, c_attention), 1, adapter.down, c_ffn)
    before = count_parameters(model)
    if adapter.normed_updates:  # Gemma 2 and 3 norm each sub-layer's output: neither kind is removed alone
        for index, kind in ((0, ATTENTION), (1, FFN)):
            with pytest.raises(UnsupportedArchitecture, match="norms each sub-layer's output"):
                remove_sublayer(model, index, kind, c_ffn)
        torch.testing.assert_close(first_output(model), first_output(MODELS[name]()))  # left as it was
        return
    if adapter.causal and len(set(getattr(model.config, "layer_types", None) or ())) > 1:
        with pytest.raises(UnsupportedArchitecture, match="laid out by kind"):
            remove_sublayer(model, 0, ATTENTION, c_attention)
        reference = _constant_update(model, 1, adapter.down, c_ffn)
        removed = [(1, FFN)]
    else:
        remove_sublayer(model, 0, ATTENTION, c_attention)
        removed = [(0, ATTENTION), (1, FFN)]
    remove_sublayer(model, 1, FFN, c_ffn)
    assert removed_sublayers(model) == removed
    assert count_parameters(model) < before
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)
    manifest = widths(model)
    assert manifest["ffn"][1] == 0 and (manifest["heads"][0] == 0) == ((0, ATTENTION) in removed)
    assert not save_standard(model, tmp_path / "m")  # the manifest stays: no config says a missing sub-layer
    assert (tmp_path / "m" / MANIFEST).exists()
    reloaded = load_pruned(tmp_path / "m")
    assert removed_sublayers(reloaded) == removed
    torch.testing.assert_close(first_output(reloaded), first_output(model))


def test_removed_attentions_keep_no_kv_cache_and_the_rest_are_renumbered():
    """A KV cache is indexed by layer_idx: the attentions left are numbered 0, 1, ...; a layer removed whole
    afterwards keeps the numbering dense, and the model's own cache has one entry per attention left."""
    config = tiny_llama().config
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    model = type(tiny_llama())(config).eval()
    remove_sublayer(model, 1, ATTENTION)
    assert kv_layers(model) == 3
    assert [layers(model)[i].self_attn.layer_idx for i in (0, 2, 3)] == [0, 1, 2]
    remove_layers(model, [2])
    assert kv_layers(model) == 2 and [layers(model)[i].self_attn.layer_idx for i in (0, 2)] == [0, 1]
    ids = torch.randint(3, 50, (2, 6))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        full = model(input_ids=ids).logits
        # generation through the cache: the next token's logits equal a pass over the whole sequence
        step = model(input_ids=ids[:, -1:],  # the name transformers 5.x takes throughout (5.2x also `cache`)
                         past_key_values=model(input_ids=ids[:, :-1], use_cache=True).past_key_values).logits
    assert [layer.keys is not None for layer in cache.layers[:2]] == [True, True]
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


def test_bad_sublayer_removals_are_refused():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"out of range \[0, 2\)"):
        remove_sublayer(model, 2, FFN)
    with pytest.raises(ValueError, match="sub-layer kind"):
        remove_sublayer(model, 0, "heads")
    with pytest.raises(ValueError, match=r"expected \(32,\)"):
        remove_sublayer(model, 0, FFN, torch.zeros(31))
    remove_sublayer(model, 0, FFN)
    with pytest.raises(ValueError, match="already removed"):
        check_removable(model, 0, FFN)
    with pytest.raises(ValueError, match="no neurons to keep"):
        prune_ffn(model, 0, [0])
    assert is_removed(model, 0, FFN) and not is_removed(model, 1, FFN)
    gemma = tiny_gemma2()  # its sub-layers' outputs are normed (and its cache laid out by kind)
    with pytest.raises(UnsupportedArchitecture, match="norms each sub-layer's output"):
        remove_sublayer(gemma, 0, ATTENTION)
    mixed = tiny_llama()  # a causal LM of sliding-window and global layers (Qwen2 with max_window_layers)
    mixed.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(UnsupportedArchitecture, match="laid out by kind"):
        check_removable(mixed, 0, ATTENTION)
    check_removable(mixed, 0, FFN)  # its FFNs are removed alone


def test_a_decoders_last_attention_stays():
    """Without any attention a decoder reads no context, and its empty KV cache gives every decoded token position
    0 (GPT-2, OPT: their positions are embedded outside attention); an encoder may lose them all."""
    from .transformer_models import tiny_bert, tiny_gpt2

    model = tiny_gpt2()
    remove_sublayer(model, 0, ATTENTION)
    with pytest.raises(UnsupportedArchitecture, match="last one left"):
        remove_sublayer(model, 1, ATTENTION)
    assert kv_layers(model) == 1
    encoder = tiny_bert()
    for i in range(len(layers(encoder))):
        remove_sublayer(encoder, i, ATTENTION)
    assert kv_layers(encoder) == 0
