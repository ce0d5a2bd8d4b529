"""ONNX export of pruned HF transformers of every family: input names, dynamic shapes, parity."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from compressor.transformer.adapters import adapter_for, dims, layers
from compressor.transformer.experts import is_experts
from compressor.transformer.surgery import projection, prune_ffn, prune_heads
from exporters.onnx import ParityError, check_hf_parity, export_hf_onnx
from tests.compressor.transformer.transformer_models import MODELS, example_inputs, ffn_keep, first_output, output_name


@pytest.fixture(scope="module", params=sorted(MODELS))
def exported(request, tmp_path_factory):
    """A pruned model with layers of different widths, exported once per family."""
    model = MODELS[request.param]()
    prune_heads(model, 0, [dims(model).kv_heads - 1])
    prune_ffn(model, 1, ffn_keep(model, [0, 3, 4, 9]))
    example = example_inputs(model, batch=2, length=10)
    path = export_hf_onnx(model, example, tmp_path_factory.mktemp(request.param) / "m.onnx",
                          output_name=output_name(model), max_length=32)
    return model, example, path


def test_names_and_dynamic_shapes_match_pytorch(exported):
    model, example, path = exported
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(example)
    assert session.get_outputs()[0].name == output_name(model)
    for batch, length in ((1, 5), (3, 17)):
        feed = example_inputs(model, batch=batch, length=length, seed=batch)
        got = session.run(None, {k: v.numpy() for k, v in feed.items()})[0]
        # the real tokens (a padding query under a sliding window sees no key: undefined, see check_hf_parity)
        real = feed["attention_mask"].bool().numpy() if "attention_mask" in feed else np.ones(got.shape[:2], bool)
        np.testing.assert_allclose(got[real], first_output(model, feed).numpy()[real], rtol=1e-4, atol=1e-4)


def test_parity_gate_passes_and_catches_a_changed_model(exported):
    model, example, path = exported
    assert check_hf_parity(model, path, example, output_name(model)).max_abs_error < 1e-4
    down = projection(layers(model)[-1], adapter_for(model).down)
    layer_weight = down.down_proj if is_experts(down) else down.weight  # a MoE layer: its experts' 3-D weight
    saved = layer_weight.data.clone()
    layer_weight.data += torch.randn(saved.shape, generator=torch.Generator().manual_seed(0))
    try:
        with pytest.raises(ParityError, match=output_name(model)):
            check_hf_parity(model, path, example, output_name(model))
    finally:
        layer_weight.data.copy_(saved)


@pytest.mark.parametrize("name,unit", [("llama", "kv-groups"), ("qwen2", "kv-groups"), ("opt", "kv-groups"),
                                       ("gpt2", "kv-groups"), ("gpt_neox", "kv-groups"), ("phi3", "kv-groups"),
                                       ("llama", "query-heads"), ("qwen2", "query-heads"), ("phi3", "query-heads"),
                                       ("gemma2", "kv-groups"), ("gemma3_text", "query-heads"),
                                       ("mixtral", "kv-groups"), ("qwen3_moe", "query-heads"),
                                       ("qwen2_moe", "query-heads"),
                                       ("smollm3", "query-heads"), ("granite", "kv-groups"), ("glm4", "query-heads"),
                                       ("exaone4", "kv-groups"), ("starcoder2", "query-heads")])
def test_decode_step_with_past_key_values_matches_the_full_forward(name, unit, tmp_path):
    """Gemma 2 and 3 have a sliding-window layer (window 4) beside a global one: past lengths of 5 to 12 tokens reach
    beyond the window, where a cache of the window alone gave the check other logits and the export was refused."""
    from compressor.transformer.surgery import prune_query_heads
    from exporters.onnx import _DecodeStep, _past_of, check_decode_parity, decode_step_names, export_decode_step

    model = MODELS[name]()
    if unit == "kv-groups":
        prune_heads(model, 0, [0])  # layers with different KV widths
    else:  # single query heads: uneven query heads per KV head, a KV head gone from layer 1
        prune_query_heads(model, 0, [0, 1, 3])
        prune_query_heads(model, 1, [1])
    ids = torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    path = export_decode_step(model, ids, tmp_path / "decode.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs, outputs = decode_step_names(model.config.num_hidden_layers)
    assert [i.name for i in session.get_inputs()] == inputs and [o.name for o in session.get_outputs()] == outputs
    for batch, length in ((2, 8), (3, 13)):  # other batch and past lengths
        ids = torch.randint(3, 50, (batch, length), generator=torch.Generator().manual_seed(length))
        assert check_decode_parity(model, path, ids).max_abs_error < 1e-4
        with torch.no_grad():
            full = model(input_ids=ids).logits[:, -1:]
        step, past = _DecodeStep(model, model.config.num_hidden_layers), _past_of(model, ids[:, :-1])
        with torch.no_grad():  # the step's semantics: one token after the cache = the full forward's last
            torch.testing.assert_close(step(ids[:, -1:], torch.ones_like(ids), *past)[0], full, rtol=1e-4, atol=1e-4)


def test_the_decode_step_passes_its_cache_by_the_installed_transformers_name():
    """transformers 5.25 renamed forward's `past_key_values` to `cache`: the old name warned at every decode-step export
    and check, and goes in 5.40."""
    import warnings

    from exporters.onnx import _DecodeStep, _past_of

    model = MODELS["llama"]()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        past = _past_of(model, ids[:, :-1])
        logits = _DecodeStep(model, model.config.num_hidden_layers)(ids[:, -1:], torch.ones_like(ids), *past)[0]
        torch.testing.assert_close(logits, model(input_ids=ids).logits[:, -1:], rtol=1e-4, atol=1e-4)


def test_a_left_padded_row_of_gpt2_is_its_unpadded_self_in_both_graphs(tmp_path):
    """GPT-2's learned positions count from 0 whatever the padding: model.onnx and decode.onnx gave a left-padded row
    other logits than the same tokens unpadded (0.44 apart), with no position_ids input to set. The exports count
    positions along the mask, as generate() does."""
    from exporters.onnx import decode_step_names, export_decode_step

    model = MODELS["gpt2"]().eval()
    tokens = torch.randint(3, 50, (1, 6), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    path = export_hf_onnx(model, example_inputs(model, batch=2, length=10), tmp_path / "m.onnx", output_name="logits",
                          max_length=32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    alone = session.run(None, {"input_ids": tokens.numpy(), "attention_mask": np.ones((1, 6), np.int64)})[0]
    left = session.run(None, {"input_ids": padded.numpy(), "attention_mask": mask.numpy()})[0]
    np.testing.assert_allclose(left[:, 3:], alone, rtol=1e-4, atol=1e-4)

    decode = export_decode_step(model, torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0)),
                                tmp_path / "decode.onnx")
    step = ort.InferenceSession(str(decode), providers=["CPUExecutionProvider"])
    names, _ = decode_step_names(model.config.num_hidden_layers)
    heads, head_dim = model.config.n_head, model.config.n_embd // model.config.n_head
    empty = {n: np.zeros((1, heads, 0, head_dim), np.float32) for n in names[2:]}  # a prompt from an empty cache
    first = step.run(None, {"input_ids": padded.numpy(), "attention_mask": mask.numpy(), **empty})[0]
    np.testing.assert_allclose(first[:, -1], alone[:, -1], rtol=1e-4, atol=1e-4)
