"""ONNX export of pruned HF transformers: input names, dynamic batch and sequence, parity."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from compressor.transformer_surgery import prune_ffn, prune_heads
from exporters.onnx import export_text_onnx
from tests.compressor.test_transformer_surgery import tiny_bert, tiny_llama


@pytest.mark.parametrize("make,output", [(tiny_bert, "last_hidden_state"), (tiny_llama, "logits")],
                         ids=["bert", "llama"])
def test_pruned_transformer_exports_with_dynamic_shapes_and_matches(make, output, tmp_path):
    model = make()
    prune_heads(model, 0, [1])  # layers of different widths
    prune_ffn(model, 1, [0, 3, 4, 9])
    ids = torch.randint(0, 50, (2, 10))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if output == "last_hidden_state":
        example["token_type_ids"] = torch.zeros_like(ids)
    path = export_text_onnx(model, example, tmp_path / "m.onnx", output_name=output, max_length=32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(example)
    assert session.get_outputs()[0].name == output
    for batch, length in ((1, 5), (3, 17)):
        ids = torch.randint(0, 50, (batch, length))
        feed = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        feed["attention_mask"][0, length // 2:] = 0
        if "token_type_ids" in example:
            feed["token_type_ids"] = torch.zeros_like(ids)
        got = session.run(None, {k: v.numpy() for k, v in feed.items()})[0]
        with torch.no_grad():
            expected = getattr(model(**feed), output).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
