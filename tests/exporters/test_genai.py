"""ONNX Runtime GenAI generates with our decode step and the configuration we write."""

import json

import numpy as np
import pytest
import torch

from compressor.transformer.sublayers import ATTENTION, remove_sublayer
from compressor.transformer.surgery import prune_query_heads
from exporters.fusion import fuse_checked
from exporters.genai import CONFIG, genai_config, write_genai_config
from exporters.onnx import check_decode_parity, export_decode_step
from tests.compressor.transformer.transformer_models import MODELS

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is a dev dependency")


def generate(directory, prompt: list[int], length: int) -> list[int]:
    """GenAI's greedy tokens: the prompt prefilled at once, then one token at a time."""
    model = og.Model(str(directory))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=length)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)]


def torch_greedy(model, prompt: list[int], length: int) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_length=length, do_sample=False, eos_token_id=None,
                              pad_token_id=0).tolist()[0]


@pytest.mark.parametrize("name,fused", [("llama", False), ("qwen2", False), ("qwen3", False), ("phi3", False),
                                        ("llama", True), ("phi3", True)])
def test_genai_generates_the_greedy_tokens_of_a_pruned_model(name, fused, tmp_path):
    """Query heads pruned unevenly (layers with different KV head counts) and layer 1's attention removed (one
    cache fewer): GenAI, from a 5-token prompt, generates exactly PyTorch's greedy tokens; also from the graph
    with ONNX Runtime's fused kernels, as a job ships decode.onnx."""
    model = MODELS[name]()
    model.config.eos_token_id = None  # a random model would stop anywhere
    prune_query_heads(model, 0, [0, 1, 3])
    remove_sublayer(model, 1, ATTENTION)
    ids = torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    export_decode_step(model, ids, tmp_path / "decode.onnx")
    if fused:
        _, fusion = fuse_checked(tmp_path / "decode.onnx", lambda graph: check_decode_parity(model, graph, ids))
        assert fusion.fused and "rotary_embedding" in fusion.counts
    write_genai_config(model, tmp_path)
    config = json.loads((tmp_path / CONFIG).read_text())["model"]["decoder"]
    assert config["num_hidden_layers"] == 1 and config["filename"] == "decode.onnx"
    prompt = [5, 7, 9, 11, 13]
    assert generate(tmp_path, prompt, 24) == torch_greedy(model, prompt, 24)


def test_the_decode_step_prefills_from_an_empty_cache_and_steps_several_tokens(tmp_path):
    model = MODELS["llama"]()
    ids = torch.randint(3, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    export_decode_step(model, ids, tmp_path / "decode.onnx")
    for new in (1, 3, 10):  # a step, a few tokens after a cache, a whole prompt from nothing
        assert check_decode_parity(model, tmp_path / "decode.onnx", ids, new=new).max_abs_error < 1e-4


def test_families_genai_was_not_tested_with_are_refused():
    with pytest.raises(ValueError, match="not supported for 'gpt2'"):
        genai_config(MODELS["gpt2"]())


def test_a_list_of_end_tokens_without_a_pad_token_lends_genai_one_pad_id():
    """Llama 3 Instruct's config: three end tokens, no pad token. GenAI refuses a list as its pad id."""
    model = MODELS["llama"]()
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = [48, 49], None
    tokens = genai_config(model)["model"]
    assert tokens["eos_token_id"] == [48, 49] and tokens["pad_token_id"] == 48


def test_genai_stops_at_the_generation_configs_end_tokens_too(tmp_path):
    """An instruct model's end of turn is often in generation_config.json alone (config.json: one eos id): GenAI
    stopped at config.json's only, where transformers' generate() stops at both; its pad id comes from there too.
    A pruned model reloaded with `load_pruned` generates with that file, not one rebuilt from config.json."""
    from compressor.transformer.surgery import load_pruned, save_pruned

    model = MODELS["llama"]()
    model.config.eos_token_id, model.config.pad_token_id = 2, None
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = [2, 5], 0
    model.generation_config.max_new_tokens = 7
    tokens = genai_config(model)["model"]
    assert tokens["eos_token_id"] == [2, 5] and tokens["pad_token_id"] == 0
    save_pruned(model, tmp_path / "m")
    reloaded = load_pruned(tmp_path / "m").generation_config
    assert (reloaded.eos_token_id, reloaded.pad_token_id, reloaded.max_new_tokens) == ([2, 5], 0, 7)


def test_the_configs_head_counts_are_the_pruned_models():
    """num_attention_heads was the dense model's (8 where the pruned layers keep 6) beside the pruned KV-head count."""
    from compressor.transformer.surgery import prune_query_heads

    model = MODELS["llama"]()  # 8 query heads over 2 KV heads
    for i in range(model.config.num_hidden_layers):
        prune_query_heads(model, i, [0, 1, 2, 4, 5, 6])
    decoder = genai_config(model)["model"]["decoder"]
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"]) == (6, 2)
