"""Loading HF directories: which class a config builds (causal LMs with their head, encoders bare)."""

import json

import pytest
import torch

from compressor.transformer.adapters import layers
from compressor.transformer.models import hf_model_class, load_transformer
from compressor.transformer.offload import StreamedCheckpoint
from compressor.transformer.pipeline import prune_blocks

from .transformer_models import MODELS, example_inputs, tiny_bert, tiny_llama


def _without_architectures(model, directory):
    """`model` saved the way converted checkpoints often are: config.json naming no class."""
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("architectures", None)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "opt"])
def test_a_decoder_without_architectures_loads_as_a_causal_lm(name, tmp_path):
    model = MODELS[name]()
    loaded = load_transformer(str(_without_architectures(model, tmp_path / name)))
    assert type(loaded.model) is type(model) and loaded.output_name == "logits"
    inputs = example_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(**inputs).logits, model(**inputs).logits)


def test_an_encoder_without_architectures_stays_the_base_model(tmp_path):
    loaded = load_transformer(str(_without_architectures(tiny_bert(), tmp_path / "bert")))
    assert type(loaded.model).__name__ == "BertModel" and loaded.output_name == "last_hidden_state"
    cls, causal = hf_model_class(loaded.model.config)
    assert cls.__name__ == "AutoModel" and not causal


def test_a_streamed_llama_without_architectures_prunes_with_its_head(tmp_path):
    model = tiny_llama()
    checkpoint = StreamedCheckpoint(_without_architectures(model, tmp_path / "src"), tmp_path / "out")
    assert type(checkpoint.model).__name__ == "LlamaForCausalLM"
    reports = prune_blocks(checkpoint, [example_inputs(model, batch=3, length=12, seed=i) for i in range(2)], 0.5)
    out = checkpoint.finish()
    assert len(reports) == 2 * len(layers(model))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
