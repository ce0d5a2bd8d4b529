"""Family records: a family whose blocks are another's modules under that family's paths is one line of `ADAPTERS`
and this end-to-end test on a tiny random-init model of it (the families of `transformer_models.MODELS` each run the
whole family-parametrised suite instead)."""

import contextlib
import copy
import json

import onnxruntime as ort
import pytest
import torch
import transformers

from compressor.errors import ModelReferenceError, UnsupportedArchitecture
from compressor.precision import float32_view
from compressor.progress import WARNING
from compressor.transformer import surgery
from compressor.transformer.adapters import (
    ADAPTERS,
    VARIANTS,
    adapter_at,
    adapter_for,
    check_config,
    family_record,
    layers,
)
from compressor.transformer.flap import flap_structure
from compressor.transformer.models import save_standard
from compressor.transformer.pipeline import (
    _run,
    attention_fixed_cost,
    capture_block_inputs,
    group_cost,
    prune_transformer,
    resize_transformer,
)
from compressor.transformer.sublayers import ATTENTION, FFN, remove_sublayer
from compressor.transformer.surgery import (
    apply_widths,
    ffn_width,
    load_pruned,
    mixer_unit_width,
    mixer_units,
    prune_ffn,
    prune_heads,
    prune_mixer_units,
    prune_query_heads,
    query_heads,
    remove_layers,
    save_pruned,
    widths,
)
from exporters.onnx import (
    CONV,
    KEY_VALUE,
    _past_of,
    check_decode_parity,
    check_hf_outputs,
    check_hf_parity,
    decode_step_names,
    export_decode_step,
    export_hf_onnx,
    hf_reference,
    layer_states,
)
from exporters.recurrent import has_chunked_scans

from .transformer_models import (
    ENCODER_SHAPED,
    HEADS_FIXED,
    LLAMA_SHAPED,
    MODELS,
    MOE_EXTRA,
    MOE_MIXED,
    example_inputs,
    first_output,
    tiny_falcon_h1,
    tiny_gemma4,
    tiny_granite_hybrid,
    tiny_lfm2,
    tiny_qwen3_5,
)


def _exports_and_decodes(pruned, tmp_path) -> None:
    """model.onnx and decode.onnx of a pruned causal LM, each within 1e-4 of PyTorch."""
    example = example_inputs(pruned, batch=2, length=10)
    path = export_hf_onnx(pruned, example, tmp_path / "model.onnx", output_name="logits", max_length=32)
    assert check_hf_parity(pruned, path, example, "logits").max_abs_error < 1e-4
    decode = export_decode_step(pruned, example["input_ids"], tmp_path / "decode.onnx", max_length=32)
    ids = torch.randint(3, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    assert check_decode_parity(pruned, decode, ids).max_abs_error < 1e-4
    assert ort.InferenceSession(str(decode), providers=["CPUExecutionProvider"]).get_outputs()[0].name == "logits"


def test_every_family_with_a_record_has_a_tiny_model_under_test():
    """A record without a model under test is a family nobody has run; a variant of a family's layout too."""
    named = {*ENCODER_SHAPED, *LLAMA_SHAPED, *MOE_EXTRA}
    assert {VARIANTS[name.split(":")[0]][1] for name in named if ":" in name} == \
        {record for _, record in VARIANTS.values()}
    tested = set(MODELS) | set(LLAMA_SHAPED) | set(ENCODER_SHAPED) | set(HEADS_FIXED) | set(MOE_EXTRA) | set(MOE_MIXED)
    assert set(ADAPTERS) - tested <= {"roberta", "xlm-roberta", "gemma", "mistral"}


@pytest.mark.parametrize("name", sorted(LLAMA_SHAPED))
def test_a_llama_shaped_family_is_pruned_exported_decoded_and_reloaded(name, tmp_path):
    model = LLAMA_SHAPED[name]()
    name = name.split(":")[0]  # a variant of the family's layout: "gpt_bigcode:mha"
    assert type(model).__name__.endswith("ForCausalLM") and model.config.model_type == name
    assert adapter_for(model) is family_record(name, vars(model.config))
    # a norm of a sub-layer's update (Gemma 2's post_feedforward_layernorm, HyperCLOVA X's post_norm1 / post_norm2;
    # Llama's post_attention_layernorm is the FFN's input norm) makes a removed sub-layer's stand-in a normed vector
    post = [n for n, _ in layers(model)[0].named_children()
            if n.startswith("post_") and n != "post_attention_layernorm"]
    assert adapter_for(model).normed_updates == bool(post), post
    check_config({**model.config.to_dict(), "model_type": name}, name)  # the CLI's and the server's check passes
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)]

    _replays_its_blocks(model, data)

    # both units pruned by the pipeline (single query heads: a layer may keep 3 of 4), then a layer removed
    pruned, reports = prune_transformer(model, data, 0.3, gqa="query-heads")
    assert {r.kind for r in reports} >= {"ffn_neurons"} and any(r.width_after < r.width_before for r in reports)
    attentions = [i for i in range(2) if not adapter_at(model, i).recurrent]  # a linear-attention mixer has no heads
    assert sum(query_heads(pruned, i) for i in attentions) < 4 * len(attentions)
    assert torch.isfinite(first_output(pruned)).all()
    remove_layers(pruned, [0])
    if not adapter_for(pruned).normed_updates:  # its FFN alone too (Falcon adds into the FFN's output in place)
        remove_sublayer(pruned, 0, FFN, torch.randn(32, generator=torch.Generator().manual_seed(0)))
    _exports_and_decodes(pruned, tmp_path)

    save_pruned(pruned, tmp_path / "saved")
    reloaded = load_pruned(tmp_path / "saved")
    assert type(reloaded) is type(pruned) and reloaded.config.model_type == name
    torch.testing.assert_close(first_output(reloaded), first_output(pruned))


# the decode step's states of `_exports_a_hybrid`'s layers: a linear-attention mixer's, then an attention's
HYBRID_STATES = ("past_conv.0", "past_recurrent.0", "past_key_values.1.key", "past_key_values.1.value")


def _exports_a_hybrid(pruned, tmp_path, lengths, max_length=None, states=HYBRID_STATES) -> dict:
    """model.onnx of a pruned hybrid decoder (layer 0 a linear-attention mixer, layer 1 an attention), exported on 10
    tokens, at prompts of `lengths`; decode.onnx within 32 positions (traced on them, its chunks shrunk to span more
    than one), its states named per layer (`states`), one token and 20 after a cache and a prompt into an empty one:
    each within 1e-4 of PyTorch. Returns the example the prefill graph was exported on."""
    example = example_inputs(pruned, batch=2, length=10)
    path = export_hf_onnx(pruned, example, tmp_path / "model.onnx", output_name="logits", max_length=max_length)
    for length in lengths:
        assert check_hf_parity(pruned, path, example_inputs(pruned, batch=2, length=length, seed=length),
                               "logits").max_abs_error < 1e-4, length
    decode = export_decode_step(pruned, example["input_ids"], tmp_path / "decode.onnx", max_length=32)
    session = ort.InferenceSession(str(decode), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()][2:] == list(states)
    ids = torch.randint(3, 50, (3, 30), generator=torch.Generator().manual_seed(1))
    for rows, new in ((3, 1), (3, 20), (1, 30)):  # after 29 and 10 tokens, and a prompt into an empty cache
        assert check_decode_parity(pruned, decode, ids[:rows], new=new).max_abs_error < 1e-4, (rows, new)
    return example


def _standard_config(model, directory) -> dict:
    """config.json of `model` saved with its widths stated there (no manifest), which AutoModelForCausalLM builds alone
    with the model's outputs."""
    assert save_standard(model, directory) and not (directory / "osscar_widths.json").exists()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    torch.testing.assert_close(first_output(reloaded), first_output(model))
    return json.loads((directory / "config.json").read_text())


def _replays_its_blocks(model, data) -> None:
    """Each block replayed on its captured inputs gives what it gives inside the model (the family's own forward:
    multipliers, clipping, norms, layer scales, rotary tables)."""
    stream = capture_block_inputs(model, data[:1], torch.device("cpu"), torch.float32)[0]
    with torch.no_grad():
        expected = model(**data[0], output_hidden_states=True).hidden_states
        hidden = stream.hidden
        for i, block in enumerate(layers(model)):
            stream.layer = i
            hidden = _run(block, hidden, stream, torch.device("cpu"))
            if i + 1 < len(layers(model)):
                torch.testing.assert_close(hidden, expected[i + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ENCODER_SHAPED))
def test_an_encoder_shaped_family_is_pruned_exported_and_reloaded(name, tmp_path):
    """Text encoders and vision transformers on BERT's, ViT's or T5's modules: heads and neurons pruned by the pipeline,
    a layer and then the other layer's FFN removed (its update a constant vector), exported within 1e-4 and reloaded."""
    model = ENCODER_SHAPED[name]()
    name = name.split(":")[0]  # a variant of the family's layout: "dinov2:swiglu"
    assert model.config.model_type == name and not adapter_for(model).causal
    assert adapter_for(model) is family_record(name, vars(model.config))
    # the CLI's and the server's check passes on the config.json it saves (which names its class: T5's encoder alone)
    check_config({**model.config.to_dict(), "model_type": name, "architectures": [type(model).__name__]}, name)
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)]
    _replays_its_blocks(model, data)
    pruned, reports = prune_transformer(model, data, 0.3)
    assert {r.kind for r in reports} == {"attention_heads", "ffn_neurons"}
    assert all(r.width_after < r.width_before for r in reports)
    remove_layers(pruned, [1 if adapter_for(pruned).first_layer_fixed else 0])  # T5's first layer holds its bias
    remove_sublayer(pruned, 0, FFN, torch.randn(pruned.config.hidden_size, generator=torch.Generator().manual_seed(0)))
    example = example_inputs(pruned, batch=2, length=10, seed=5)
    path = export_hf_onnx(pruned, example, tmp_path / "model.onnx", output_name="last_hidden_state")
    assert check_hf_parity(pruned, path, example, "last_hidden_state").max_abs_error < 1e-4
    save_pruned(pruned, tmp_path / "saved")
    reloaded = load_pruned(tmp_path / "saved")
    assert type(reloaded) is type(pruned) and reloaded.config.num_hidden_layers == 1
    torch.testing.assert_close(first_output(reloaded, example), first_output(pruned, example))


def test_qwen3_5s_delta_nets_lose_whole_key_groups_and_export_at_any_length(tmp_path):
    """A Qwen3.5 Gated DeltaNet's unit is a key head with the value heads reading it: removing one equals zeroing its
    value heads' output columns (every other head's output is unchanged), and the pipeline solves the output
    projection over such groups beside the gated-query attention's heads and the FFNs; a mixer removed alone is
    refused, a DeltaNet layer removed whole restates layer_types. The graphs, exported on 10 tokens, run prompts of 1
    to 130 tokens (several chunks of the delta rule's scan) and decode after any cache, one token or a prompt of two
    chunks, within 1e-4 of PyTorch (whose one-token step runs transformers' own recurrent kernel); reloaded as
    pruned."""
    model = tiny_qwen3_5(("linear_attention", "full_attention", "linear_attention"))
    cut, reference = copy.deepcopy(model), copy.deepcopy(model)
    prune_mixer_units(cut, 0, [1])  # key head 1 and its value heads 2 and 3
    with torch.no_grad():
        reference.model.layers[0].linear_attn.out_proj.weight[:, :16] = 0  # value heads 0 and 1's 8 columns each
    mixer = cut.model.layers[0].linear_attn
    assert (mixer.num_k_heads, mixer.num_v_heads, mixer.conv1d.weight.shape[0], mixer.A_log.shape[0]) == (1, 2, 32, 2)
    torch.testing.assert_close(first_output(cut), first_output(reference), rtol=1e-6, atol=1e-6)
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)]
    with pytest.raises(UnsupportedArchitecture, match="layer 0 of qwen3_5_text mixes tokens by linear attention"):
        remove_sublayer(copy.deepcopy(model), 0, ATTENTION)
    pruned, reports = prune_transformer(model, data, 0.5, gqa="query-heads")
    assert {r.name: r.width_after for r in reports if r.kind == "attention_heads"} == {
        "model.layers.0.linear_attn.out_proj": 1, "model.layers.1.self_attn.o_proj": 2,
        "model.layers.2.linear_attn.out_proj": 1}
    assert widths(pruned)["mixer_units"] == [1, 0, 1] and all(ffn_width(pruned, i) == 10 for i in range(3))
    # a plan of an earlier release names no DeltaNet: they stay whole, as then, said once
    earlier = {"model.layers.1.self_attn.o_proj": 2, **{f"model.layers.{i}.mlp.down_proj": 10 for i in range(3)}}
    seen = []
    kept, _ = prune_transformer(model, data, earlier, progress=seen.append)
    assert [mixer_units(kept, i) for i in (0, 2)] == [2, 2]
    assert len([p for p in seen if p.stage == WARNING and "kept whole, as then" in p.message]) == 1
    assert mixer_units(resize_transformer(model, earlier), 2) == 2
    remove_layers(pruned, [2])
    assert pruned.config.layer_types == ["linear_attention", "full_attention"]

    _exports_a_hybrid(pruned, tmp_path, (1, 130))

    save_pruned(pruned, tmp_path / "saved")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "saved")), first_output(pruned))


def test_lfm2s_short_convolutions_lose_channels_carry_their_conv_state_and_uniform_widths_load_alone(tmp_path):
    """An LFM2 short convolution's unit is a channel (its B, C and x rows, its filter, its output column): removing
    some equals zeroing their output columns, and the decode step carries each such layer's conv state alone, as wide
    as its channels. Removing a layer restates layer_types and full_attn_idxs. Uniform FFN and head widths are stated
    in config.json with block_auto_adjust_ff_dim off (else the class would build 2/3 of the width stated), so
    AutoModelForCausalLM builds the pruned model with no code of ours; pruned channels, which no config key states
    apart from hidden_size, keep the manifest and the remote code that resizes them."""
    model = tiny_lfm2(("conv", "full_attention", "conv"))
    assert ffn_width(model, 0) == 20  # 2/3 of intermediate_size 30
    cut, reference = copy.deepcopy(model), copy.deepcopy(model)
    gone = [3, 7, 8, 20]
    prune_mixer_units(cut, 0, [c for c in range(32) if c not in gone])
    with torch.no_grad():
        reference.model.layers[0].conv.out_proj.weight[:, gone] = 0
    assert cut.model.layers[0].conv.in_proj.out_features == 3 * 28 and mixer_units(cut, 0) == 28
    torch.testing.assert_close(first_output(cut), first_output(reference), rtol=1e-6, atol=1e-6)
    states = layer_states(cut)
    assert states == [CONV, KEY_VALUE, CONV]
    assert decode_step_names(3, states)[0][2:] == ["past_conv.0", "past_key_values.1.key", "past_key_values.1.value",
                                                   "past_conv.2"]
    ids = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    assert [tuple(t.shape) for t in _past_of(cut, ids)] == [(2, 28, 3), (2, 2, 5, 8), (2, 2, 5, 8), (2, 32, 3)]
    manifest = widths(cut)
    assert (manifest["heads"], manifest["mixer_units"]) == ([28, 4, 32], [28, 0, 32])  # a mixer's heads: its units
    with pytest.raises(ModelReferenceError, match=r"32, 0, 32\] at most"):
        apply_widths(tiny_lfm2(("conv", "full_attention", "conv")),
                     {**manifest, "mixer_units": [40, 0, 32], "heads": [40, 4, 32]})
    llama = MODELS["llama"]()
    with pytest.raises(ModelReferenceError, match="llama, which has no linear-attention layers"):
        apply_widths(llama, {**widths(llama), "mixer_units": [0] * len(layers(llama))})
    # an earlier release's manifest: no mixer_units, a whole mixer's out_proj width in attention heads (32 / 8)
    earlier = tiny_lfm2(("conv", "full_attention", "conv"))
    apply_widths(earlier, {"heads": [4, 4, 4], "ffn": [20, 12, 20]})
    assert [mixer_units(earlier, i) for i in (0, 2)] == [32, 32] and ffn_width(earlier, 1) == 12
    assert not save_standard(cut, tmp_path / "channels")
    remote = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "channels", trust_remote_code=True)
    for reloaded in (remote, load_pruned(tmp_path / "channels")):
        torch.testing.assert_close(first_output(reloaded), first_output(cut))

    for i in range(3):
        prune_ffn(model, i, range(12))
    prune_heads(model, 1, [1])  # the second KV group and its 2 query heads
    remove_layers(model, [0])
    assert model.config.layer_types == ["full_attention", "conv"] and model.config.full_attn_idxs == [0]
    assert save_standard(model, tmp_path / "s") and not (tmp_path / "s" / "osscar_widths.json").exists()
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"],
            config["block_auto_adjust_ff_dim"]) == (2, 1, 12, False)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    torch.testing.assert_close(first_output(reloaded), first_output(model))


def test_granite_4_h_prunes_its_mamba2_heads_carries_their_states_and_uniform_widths_load_alone(tmp_path):
    """Granite 4.0-H: its Mamba2 mixers lose heads (`test_a_mamba2_mixer_loses_whole_groups_or_heads_of_its_one_group`),
    their layers removable whole (layer_types restated); the attention's heads and every layer's fused SwiGLU neurons
    are pruned. The graphs, exported on 10 tokens, run prompts of 1 to 30 tokens (several of the scan's chunks of 8) and
    decode after any cache, one token (PyTorch's recurrent kernel) or a prompt, the decode step carrying each mixer's
    conv state and scan state (batch, heads, head size, state size) within 1e-4; uniform widths of the attentions and
    FFNs are stated in config.json, which AutoModelForCausalLM builds alone (a mixer's heads are no config's)."""
    model = tiny_granite_hybrid(("linear_attention", "full_attention", "linear_attention"))
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)]
    with pytest.raises(UnsupportedArchitecture, match="layer 0 of granitemoehybrid mixes tokens by linear attention"):
        remove_sublayer(copy.deepcopy(model), 0, ATTENTION)
    pruned, reports = prune_transformer(model, data, 0.5, gqa="query-heads")
    heads = {r.name: r.width_after for r in reports if r.kind == "attention_heads"}
    assert heads == {"model.layers.1.self_attn.o_proj": 2, "model.layers.0.mamba.out_proj": 2,
                     "model.layers.2.mamba.out_proj": 2}
    assert all(ffn_width(pruned, i) == 10 for i in range(3))
    for i in (0, 2):  # 2 heads of 16: z, x (32 rows each), B, C (8 each), dt (2); conv over x, B, C
        mixer = layers(pruned)[i].mamba
        assert (mixer.out_proj.in_features, mixer.in_proj.out_features, mixer.conv1d.in_channels) == (32, 82, 48)
    remove_layers(pruned, [2])
    assert pruned.config.layer_types == ["linear_attention", "full_attention"]

    example = _exports_a_hybrid(pruned, tmp_path, (1, 30), max_length=32)
    ids = torch.randint(3, 50, (3, 5), generator=torch.Generator().manual_seed(1))
    conv, scan, key, _ = (tuple(t.shape) for t in _past_of(pruned, ids))
    assert (conv, scan, key[2:]) == ((3, 48, 4), (3, 2, 16, 8), (5, 8))  # x, B and C's channels; heads x 16 x 8

    # a mixer's heads are no config's: the manifest (`load_pruned`)
    assert not save_standard(pruned, tmp_path / "saved")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "saved")), first_output(pruned))
    # a bf16 checkpoint is exported through a float32 view of it, whose mixers are parametrized subclasses: found too
    with float32_view(copy.deepcopy(pruned).to(torch.bfloat16)) as view:
        assert has_chunked_scans(view)
        half = export_hf_onnx(view, example, tmp_path / "half.onnx", output_name="logits", max_length=32)
        for length in (1, 30):
            feed = example_inputs(view, batch=2, length=length, seed=length)
            assert check_hf_outputs(half, feed, hf_reference(view, feed, "logits")).max_abs_error < 1e-4, length

    for i in range(3):
        prune_ffn(model, i, range(12))
    prune_heads(model, 1, [1])  # the second KV group and its 2 query heads
    remove_layers(model, [0])
    assert save_standard(model, tmp_path / "s") and not (tmp_path / "s" / "osscar_widths.json").exists()
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["shared_intermediate_size"],
            config["layer_types"]) == (2, 1, 12, ["full_attention", "linear_attention"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    torch.testing.assert_close(first_output(reloaded), first_output(model))


@pytest.mark.parametrize("groups", [2, 1])
def test_a_mamba2_mixer_loses_whole_groups_or_heads_of_its_one_group(groups, tmp_path):
    """A Mamba2 mixer's unit is a group of heads with its B and C rows where it has several groups: removing one equals
    zeroing its heads' output projection columns, every other output unchanged. With one group (Granite 4.0-H's,
    Bamba's) a unit is a head and the gated norm, over the group, normalises the kept heads over themselves; given the
    output projection inputs' energies, the kept norm weights take the mean of what that changes (here, with heads
    of unequal energies on inputs whose norm is not its epsilon's: a quarter of the error left or less). A mixer of
    two groups pruned to one keeps a group as its unit, and reloads as pruned."""
    model = tiny_granite_hybrid(("linear_attention", "full_attention"), mamba_n_groups=groups)
    mixer = layers(model)[0].mamba
    assert (mixer_units(model, 0), mixer_unit_width(model, 0)) == ((2, 32) if groups == 2 else (4, 16))
    # a unit's z, x and time-step rows of 32 inputs, output columns, 4 conv taps a channel, 16 x 8 state entries read
    # and written a head; a group's B and C (8 rows each) its own with two groups, every head's with one
    per_head = 32 * (3 * 16 + 1) + 4 * 16 + 4 * 16 * 8
    cost = 2 * per_head + (32 + 4) * 16 if groups == 2 else per_head
    assert group_cost(model, "attention_heads", 10, index=0) == cost
    assert attention_fixed_cost(model, 0) == (0 if groups == 2 else (32 + 4) * 16)
    with torch.no_grad():  # heads 0 and 3 of small x: unequal energies
        mixer.in_proj.weight[64:80] *= 0.2
        mixer.in_proj.weight[112:128] *= 0.3
    hidden = 30 * torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(0))
    inputs = {}
    hook = mixer.out_proj.register_forward_hook(lambda module, args, out: inputs.update(x=args[0]))
    with torch.no_grad():
        full = mixer(hidden)
    hook.remove()
    energy = inputs["x"].reshape(-1, 64).double().square().sum(0)
    zeroed = copy.deepcopy(mixer)
    width, drop = mixer_unit_width(model, 0), [1] if groups == 2 else [0, 3]
    with torch.no_grad():
        for unit in drop:
            zeroed.out_proj.weight[:, unit * width:(unit + 1) * width] = 0
        expected = zeroed(hidden)
    assert (expected - full).norm() > 0.05 * full.norm()  # the removed units did contribute
    errors = []
    for given in (None, energy):
        pruned = copy.deepcopy(model)
        prune_mixer_units(pruned, 0, [u for u in range(mixer_units(model, 0)) if u not in drop], energy=given)
        kept = layers(pruned)[0].mamba
        # 2 heads of 16 left: group 0 of two, or heads 1 and 2 of one group; the norm over them
        assert (kept.num_heads, kept.n_groups, kept.norm.weight.numel(), kept.norm.group_size) == (2, 1, 32, 32)
        with torch.no_grad():
            errors.append(float((kept(hidden) - expected).norm() / expected.norm()))
    if groups == 2:
        assert max(errors) < 1e-6  # every kept output computed as it was (the energies change nothing)
        assert (mixer_units(pruned, 0), mixer_unit_width(pruned, 0)) == (1, 32)  # one group of 2 heads left
        save_pruned(pruned, tmp_path / "saved")
        torch.testing.assert_close(first_output(load_pruned(tmp_path / "saved")), first_output(pruned))
    else:
        assert errors[0] > 0.1 and errors[1] < errors[0] / 4, errors


def test_falcon_h1_keeps_its_parallel_mamba2_mixers_whole_and_its_decode_step_carries_both_states(tmp_path):
    """Falcon-H1: in every layer a Mamba2 mixer beside the attention, kept whole; the heads and the SwiGLU neurons are
    pruned around it, an attention alone is refused (the layer's cache holds both's states), whole layers go (the
    config computes layer_types from the depth). The graphs, exported on 10 tokens, run prompts of 1 to 30 tokens
    (several of the scan's chunks) and decode after any cache, the step carrying each layer's keys and values, then
    its conv and scan states; uniform widths are stated in config.json, which AutoModelForCausalLM builds alone."""
    model = tiny_falcon_h1(num_hidden_layers=3)
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)]
    with pytest.raises(UnsupportedArchitecture, match="layer 1 of falcon_h1 runs a recurrent mixer beside"):
        remove_sublayer(copy.deepcopy(model), 1, ATTENTION)
    pruned, reports = prune_transformer(model, data, 0.5, gqa="query-heads")
    assert {r.kind for r in reports} == {"attention_heads", "ffn_neurons"}
    assert all(query_heads(pruned, i) == 2 and ffn_width(pruned, i) == 10 for i in range(3))
    assert all(block.mamba.out_proj.in_features == 64 for block in layers(pruned))
    remove_layers(pruned, [2])
    assert pruned.config.layer_types == ["hybrid", "hybrid"]
    states = ("past_key_values.0.key", "past_key_values.0.value", "past_conv.0", "past_recurrent.0",
              "past_key_values.1.key", "past_key_values.1.value", "past_conv.1", "past_recurrent.1")
    _exports_a_hybrid(pruned, tmp_path, (1, 30), max_length=32, states=states)
    ids = torch.randint(3, 50, (3, 5), generator=torch.Generator().manual_seed(1))
    key, _, conv, scan = (tuple(t.shape) for t in _past_of(pruned, ids)[:4])
    assert (key[2:], conv, scan) == ((5, 8), (3, 80, 4), (3, 4, 16, 8))  # x, B and C's channels; heads x 16 x 8
    save_pruned(pruned, tmp_path / "saved")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "saved")), first_output(pruned))

    for i in range(3):
        prune_ffn(model, i, range(12))
        prune_heads(model, i, [1])  # the second KV group and its 2 query heads
    remove_layers(model, [0])
    config = _standard_config(model, tmp_path / "s")
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["head_dim"]) == (2, 2, 1, 12, 8)


def test_bamba_restates_the_attention_indices_its_layer_kinds_are_computed_from(tmp_path, monkeypatch):
    """Bamba's config computes layer_types from attn_layer_indices (no setter): removing a layer restates the indices,
    and config.json, which then holds no layer_types, still states uniform widths (the layer kinds read from them). A
    config computing its layer kinds from keys not known to the surgery is refused before anything changes."""
    model = LLAMA_SHAPED["bamba"]()
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    with monkeypatch.context() as patched:
        patched.delitem(surgery.LEGACY_LAYER_INDICES, "attn_layer_indices")
        with pytest.raises(UnsupportedArchitecture, match="computes layer_types from keys of its own"):
            remove_layers(model, [0])
    assert len(layers(model)) == model.config.num_hidden_layers == 2
    for i in range(2):
        prune_ffn(model, i, range(12))
    prune_heads(model, 1, [1])
    remove_layers(model, [0])
    assert (model.config.attn_layer_indices, model.config.layer_types) == ([0], ["full_attention"])
    assert save_standard(model, tmp_path / "s")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert "layer_types" not in config and (config["attn_layer_indices"], config["intermediate_size"]) == ([0], 12)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    torch.testing.assert_close(first_output(reloaded), first_output(model))


def test_gemma4_prunes_heads_of_each_layers_size_and_removes_layers_with_their_embeddings_and_scalars(tmp_path):
    """Gemma 4: each layer's heads are its own size (the global layer's 16, stated in per_layer_config, over one KV head
    whose values are its keys), pruned as such; a removed layer takes its block of the per-layer input embeddings
    and their projection, is renumbered out of per_layer_config, and leaves its output scalar to the next kept layer,
    so the shallower model is the one whose removed layer scaled the stream and did nothing else; uniform widths
    load in transformers alone; KV-sharing and MoE layouts are refused (exports, decode step and reload: the
    Llama-shaped families' test)."""
    model = tiny_gemma4(layers=4)
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)]
    pruned, _ = prune_transformer(model, data, 0.3, gqa="query-heads")
    assert [query_heads(pruned, i) for i in range(4)] == [3] * 4
    assert layers(pruned)[3].self_attn.q_proj.weight.shape == (3 * 16, 32)  # the global layer's heads of 16

    reference = copy.deepcopy(pruned)
    scaled = layers(reference)[1]
    scaled.forward = lambda hidden_states, *_, **__: hidden_states * scaled.layer_scalar  # layer 1, scalar only
    example = example_inputs(pruned, batch=2, length=10)
    remove_layers(pruned, [1])
    torch.testing.assert_close(first_output(pruned, example), first_output(reference, example))
    assert pruned.model.embed_tokens_per_layer.weight.shape[1] == 3 * 8
    assert pruned.config.to_dict()["per_layer_config"] == {"2": {"head_dim": 16, "num_key_value_heads": 1}}

    uniform = tiny_gemma4()
    for i in range(3):
        prune_ffn(uniform, i, range(12))
        prune_query_heads(uniform, i, [0, 1])  # the sliding layers' first KV group, the global layer's one KV head
    remove_layers(uniform, [0])
    assert save_standard(uniform, tmp_path / "standard")
    torch.testing.assert_close(first_output(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "standard")),
                               first_output(uniform))
    for fields in ({"num_kv_shared_layers": 1}, {"enable_moe_block": True}):
        with pytest.raises(UnsupportedArchitecture, match="reuse earlier layers' keys and values"):
            check_config({**model.config.to_dict(), **fields}, "m")


def test_gemma4s_last_layer_stays_global_its_removal_losses_count_the_scalar_and_flap_is_refused(tmp_path):
    """Gemma 4's config rebuilds its last layer as a global one: a removal leaving a sliding-window layer last is
    refused. A block whose updates are nothing leaves its stream times its scalar, which is what its removal leaves
    too: its removal loss is nothing (the identity's would be (1 - scalar)^2); a block's loss is relative to that
    stream, the same whatever its scalar. An FFN-only pruning (no query-head
    map in the manifest) reloads each layer's head groups by its own group size; FLAP, one head size, is refused."""
    from compressor.transformer.pipeline import removal_losses
    from compressor.transformer.surgery import check_removable_layers

    model = tiny_gemma4(layers=4)
    data = [example_inputs(model, batch=2, length=8, seed=i) for i in range(2)]
    scaled = []  # a block's removal loss, relative to the stream it leaves, whatever its scalar
    for scalar in (0.5, 2.0):
        layers(model)[1].layer_scalar.fill_(scalar)
        scaled.append(removal_losses(model, data, sublayers=False)[1].layer)
    assert scaled[0] == pytest.approx(scaled[1], rel=1e-4) and scaled[0] > 1e-3
    with pytest.raises(UnsupportedArchitecture, match=r"leaves layer 2 \(sliding_attention\) last"):
        check_removable_layers(model, [3])
    check_removable_layers(model, [1, 2])
    with torch.no_grad():
        layers(model)[1].post_attention_layernorm.weight.zero_()
        layers(model)[1].post_feedforward_layernorm.weight.zero_()
        layers(model)[1].post_per_layer_input_norm.weight.zero_()
    losses = [r.layer for r in removal_losses(model, data, sublayers=False)]
    assert losses[1] < 1e-10 < losses[2]
    with pytest.raises(UnsupportedArchitecture, match="heads of their own sizes"):
        flap_structure(model, data, 0.9)
    prune_ffn(model, 0, range(12))
    save_pruned(model, tmp_path / "saved")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "saved")), first_output(model))


def test_a_uniformly_pruned_qwen3_5_loads_in_transformers_alone(tmp_path):
    """Its attention layers' kept heads, its DeltaNets' kept key groups and every layer's FFN width, each equal across
    the layers that have it, are stated in config.json: AutoModelForCausalLM builds the pruned model with no code of
    ours. DeltaNets keeping unequal key groups keep the manifest and the remote code that resizes them."""
    model = tiny_qwen3_5(("linear_attention", "full_attention", "linear_attention"))
    for i in range(3):
        prune_ffn(model, i, range(12))
    prune_heads(model, 1, [1])  # the second KV group and its 2 query heads
    unequal = copy.deepcopy(model)
    prune_mixer_units(unequal, 0, [1])
    assert not save_standard(unequal, tmp_path / "u")  # with the file that builds them: plain transformers loads it
    remote = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "u", trust_remote_code=True)
    for reloaded in (remote, load_pruned(tmp_path / "u")):
        torch.testing.assert_close(first_output(reloaded), first_output(unequal))
    prune_mixer_units(model, 0, [1])
    prune_mixer_units(model, 2, [0])
    config = _standard_config(model, tmp_path / "s")
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"],
            config["linear_num_key_heads"], config["linear_num_value_heads"]) == (2, 1, 12, 1, 2)


def test_a_backbone_config_names_the_stages_of_the_blocks_kept(caplog):
    """DINOv2's config lists a stage per block and the stages its backbone outputs: removing blocks restates both
    (a config naming a removed block's stage is refused as it loads); a removed block's stage is its last kept
    predecessor's, and two outputs that land on one stage are output once."""
    model = transformers.Dinov2Model(transformers.Dinov2Config(
        hidden_size=16, num_hidden_layers=4, num_attention_heads=2, image_size=8, patch_size=4,
        out_indices=[1, 2, 4])).eval()
    with caplog.at_level("WARNING"):
        remove_layers(model, [1, 2])
    assert model.config.stage_names == ["stem", "stage1", "stage2"]
    assert model.config.out_indices == [1, 2] and model.config.out_features == ["stage1", "stage2"]
    assert "land on 2 stage(s)" in caplog.text  # three outputs, two of them now one stage
    transformers.Dinov2Config.from_dict(model.config.to_dict())  # what a reload builds: valid
    remove_layers(model, [0])  # the first block's output is now the embeddings' (the stem's)
    assert model.config.stage_names == ["stem", "stage1"] and model.config.out_features == ["stem", "stage1"]


@pytest.mark.parametrize("name", ["t5", "umt5"])
def test_t5s_position_bias_follows_each_layers_kept_heads(name, tmp_path):
    """T5's first layer computes a position bias of a row per head and hands it on through every later layer, UMT5's
    layers each their own: heads kept unevenly (layer 0: 1 and 3, layer 1: 0, 2 and 3) read their own rows, so the
    pruned encoder is the dense one with the removed heads' outputs zeroed; exported and reloaded alike."""
    import copy

    from .transformer_models import _encoder

    model = _encoder("T5EncoderModel" if name == "t5" else "UMT5EncoderModel", "T5Config" if name == "t5" else
                     "UMT5Config", vocab_size=50, d_model=32, num_layers=3, num_heads=4, d_kv=8, d_ff=24,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16)()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for i, gone in ((0, (0, 2)), (1, (1,))):
            o = layers(reference)[i].layer[0].SelfAttention.o.weight
            for head in gone:
                o[:, head * 8:(head + 1) * 8] = 0
    prune_heads(model, 0, [1, 3])
    prune_heads(model, 1, [0, 2, 3])
    example = example_inputs(model, batch=2, length=10, seed=3)
    torch.testing.assert_close(first_output(model, example), first_output(reference, example), rtol=1e-5, atol=1e-5)
    path = export_hf_onnx(model, example, tmp_path / "model.onnx", output_name="last_hidden_state")
    assert check_hf_parity(model, path, example, "last_hidden_state").max_abs_error < 1e-5
    save_pruned(model, tmp_path / "saved")
    torch.testing.assert_close(first_output(load_pruned(tmp_path / "saved"), example), first_output(model, example))
    with pytest.raises(UnsupportedArchitecture, match=r"an attention alone is not removed") if name == "t5" \
            else contextlib.nullcontext():
        remove_sublayer(model, 1, ATTENTION)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_t5_encoder_prunes_and_keeps_its_float32_ffn_output(dtype, tmp_path):
    """A half-precision T5 (SD3 ships its encoder in fp16) is pruned with its relayed position bias in float32, as its
    blocks compute; transformers keeps the FFN's output projection in float32 against fp16 overflow
    (`_keep_in_fp32_modules`), which the pipeline's round trip through the checkpoint's dtype kept too. And a T5 encoder
    loaded from a whole T5's checkpoint (its config names T5ForConditionalGeneration) is the encoder it is."""
    torch.manual_seed(0)
    whole = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=32, num_layers=2, num_heads=4, d_kv=8, d_ff=24, relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu"))
    whole.save_pretrained(tmp_path / "whole")
    model = transformers.T5EncoderModel.from_pretrained(tmp_path / "whole", dtype=dtype).eval()
    assert model.config.architectures == ["T5ForConditionalGeneration"] and adapter_for(model).bias_relay
    wo = layers(model)[0].layer[1].DenseReluDense.wo
    assert wo.weight.dtype == (torch.float32 if dtype == torch.float16 else dtype)
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)]
    pruned, _ = prune_transformer(model, data, 0.3)
    for block in layers(pruned):
        ffn = block.layer[1].DenseReluDense
        assert ffn.wi_0.weight.dtype == dtype and ffn.wo.weight.dtype == wo.weight.dtype
    assert query_heads(pruned, 0) == 3 and torch.isfinite(first_output(pruned).float()).all()


def test_a_uniformly_pruned_umt5_encoder_loads_in_transformers_alone(tmp_path):
    """UMT5's config names its widths its own way (num_heads, d_kv, d_ff: attribute_map): a pruning that keeps equal
    widths in every layer is written as a config transformers builds the pruned encoder from."""
    model = ENCODER_SHAPED["umt5"]()
    for i in range(2):
        prune_heads(model, i, [0, 2, 3])
        prune_ffn(model, i, range(16))
    assert save_standard(model, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (config["num_heads"], config["d_kv"], config["d_ff"]) == (3, 8, 16) and "num_attention_heads" not in config
    reloaded = transformers.UMT5EncoderModel.from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(first_output(reloaded), first_output(model))


def test_esms_contact_head_keeps_the_columns_of_the_layers_kept(tmp_path):
    """ESM's contact head reads every layer's heads' attention maps (layers x heads inputs, layer after layer): a
    removed layer takes its columns with it, so the model reloads (its config builds the head from the layers left)
    and predicts contacts from the kept layers' maps with their own weights."""
    model = ENCODER_SHAPED["esm"]()
    weight = model.contact_head.regression.weight.detach().clone()  # (1, 2 layers x 4 heads)
    remove_layers(model, [0])
    assert model.contact_head.in_features == 4
    torch.testing.assert_close(model.contact_head.regression.weight, weight[:, 4:])
    save_pruned(model, tmp_path / "saved")
    reloaded = load_pruned(tmp_path / "saved")
    tokens = torch.randint(4, 30, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    for each in (model, reloaded):
        each.set_attn_implementation("eager")  # attention maps are returned by the eager attention only
    with torch.no_grad():
        contacts = model.predict_contacts(tokens, mask)
        torch.testing.assert_close(reloaded.predict_contacts(tokens, mask), contacts)
    assert contacts.shape == (2, 7, 7)


@pytest.mark.parametrize("name, norms", [("cohere", ("q_norm.weight", "k_norm.weight")),
                                         ("stablelm", ("q_layernorm.norms", "k_layernorm.norms"))])
def test_per_head_query_and_key_norms_are_kept_with_their_heads(name, norms):
    """Command R+'s q/k norms hold a row per head, StableLM 2's a LayerNorm module per head: keeping query heads 2
    and 3 (KV head 1, the second group) keeps their norms, so the pruned model is the dense one with heads 0 and 1's
    outputs zeroed. The norms are drawn at random: at their initial ones any slice of them would pass."""
    import copy

    from compressor.modules import get_attr

    def values(entry) -> torch.Tensor:  # a norm module's parameters, or a parameter's row, as one flat copy
        parts = list(entry.parameters()) if isinstance(entry, torch.nn.Module) else [entry]
        return torch.cat([t.detach().flatten() for t in parts]).clone()

    model = LLAMA_SHAPED[name]()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.uniform_(0.5, 1.5, generator=gen)
    attention = layers(model)[1].self_attn
    q_norm, k_norm = (get_attr(attention, path) for path in norms)
    dense = [values(q_norm[2]), values(q_norm[3]), values(k_norm[1])]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.model.layers[1].self_attn.o_proj.weight[:, :16] = 0  # heads 0 and 1's outputs
    prune_query_heads(model, 1, [2, 3])
    q_norm, k_norm = (get_attr(attention, path) for path in norms)
    assert len(q_norm) == 2 and len(k_norm) == 1 and query_heads(model, 1) == 2
    for kept, before in zip([q_norm[0], q_norm[1], k_norm[0]], dense, strict=True):
        torch.testing.assert_close(values(kept), before)
    torch.testing.assert_close(first_output(model), first_output(reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(HEADS_FIXED))
def test_a_family_whose_heads_are_not_a_unit_keeps_its_attention_and_prunes_the_rest(name, tmp_path):
    """OLMo 2 and 3 normalise all heads' queries (keys) together: removing a head would renormalise the kept ones, so
    heads are refused by the surgery, never solved nor resized; the FFN neurons and whole layers go."""
    model = HEADS_FIXED[name]()
    assert not adapter_for(model).heads_prunable
    check_config({**model.config.to_dict(), "model_type": name}, name)
    with pytest.raises(UnsupportedArchitecture, match="heads are not a prunable unit"):
        prune_heads(model, 0, [0])
    with pytest.raises(UnsupportedArchitecture, match="heads are not a prunable unit"):
        prune_query_heads(model, 0, [0, 1, 2])
    data = [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)]
    seen = []
    pruned, reports = prune_transformer(model, data, 0.5, progress=seen.append)
    assert {r.kind for r in reports} == {"ffn_neurons"}
    assert [p.message for p in seen if p.stage == WARNING and "its attentions stay whole" in p.message]
    assert [query_heads(pruned, i) for i in range(2)] == [4, 4] and [ffn_width(pruned, i) for i in range(2)] == [10, 10]
    resized = resize_transformer(model, 0.5)
    assert [query_heads(resized, i) for i in range(2)] == [4, 4] and ffn_width(resized, 0) == 10
    # a plan that narrows an attention (--widths-from, FLAP's structure) is refused, not silently kept whole
    plan = {"model.layers.0.self_attn.o_proj": 2, "model.layers.1.self_attn.o_proj": 4,
            "model.layers.0.mlp.down_proj": 10, "model.layers.1.mlp.down_proj": 10}
    for narrowing in (lambda: prune_transformer(model, data, plan), lambda: resize_transformer(model, plan)):
        with pytest.raises(UnsupportedArchitecture, match=r"but the plan narrows model\.layers\.0\.self_attn\.o_proj$"):
            narrowing()
    assert len(resize_transformer(model, {**plan, "model.layers.0.self_attn.o_proj": 4}).model.layers) == 2
    with pytest.raises(UnsupportedArchitecture, match="heads are not a prunable unit"):
        flap_structure(model, data, 0.5)
    remove_layers(pruned, [0])
    _exports_and_decodes(pruned, tmp_path)
    # uniform FFN widths and whole attentions: the config says the pruned model, which transformers loads alone
    assert save_standard(pruned, tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert type(reloaded) is type(pruned) and reloaded.config.intermediate_size == 10
    torch.testing.assert_close(first_output(reloaded), first_output(pruned))


def test_a_config_that_would_build_other_shapes_than_the_saved_ones_keeps_the_manifest(tmp_path, monkeypatch):
    """Helium builds its o_proj hidden x hidden whatever its heads: a config stating pruned heads (its record once
    said it could) loads in neither transformers nor `load_pruned`. Its record says so now, and a standard config is
    only written where the family's class built from it has the saved tensors' shapes."""
    from dataclasses import replace

    from compressor.transformer.surgery import MANIFEST

    for record in (ADAPTERS["helium"], replace(ADAPTERS["helium"], config_head_dim=True)):
        monkeypatch.setitem(ADAPTERS, "helium", record)
        model = LLAMA_SHAPED["helium"]()
        for i in range(2):
            prune_heads(model, i, [1])  # one KV group of two in every layer: widths a config could state
        directory = tmp_path / str(record.config_head_dim)
        assert not save_standard(model, directory) and (directory / MANIFEST).is_file()
        torch.testing.assert_close(first_output(load_pruned(directory)), first_output(model))
