"""Sequential head and FFN pruning of HF transformers (first version)."""

import pytest
import torch

from compressor.adapters import adapter_for, layers
from compressor.transformer_pipeline import prune_transformer
from compressor.transformer_surgery import head_groups

from .test_transformer_surgery import first_output, tiny_bert, tiny_llama


def batches(vocab=50, n=4, length=12):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (3, length), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, length // 2:] = 0  # padding is excluded from the statistics
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


@pytest.mark.parametrize("make", [tiny_bert, tiny_llama], ids=["bert", "llama"])
def test_every_block_is_pruned_and_runs(make):
    model = make()
    pruned, reports = prune_transformer(model, batches(), 0.5)
    adapter = adapter_for(model)
    assert [r.kind for r in reports] == ["attention_heads", "ffn_neurons"] * len(layers(model))
    for i, layer in enumerate(layers(pruned)):
        assert head_groups(pruned, i) == head_groups(model, i) // 2
        ffn = model.config.intermediate_size
        assert layer.get_submodule(adapter.down).in_features == ffn - round(0.5 * ffn)
    assert first_output(pruned).shape == first_output(model).shape
    assert all(0 <= r.relative_error <= 1.5 for r in reports)


def test_osscar_beats_mp_plus_on_stories260k(shared_data):
    import numpy as np
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(shared_data / "stories260K")).eval()
    tok = np.load(shared_data / "stories260K" / "tinystories-valid-tokens.npz")
    ids, off = tok["ids"], tok["offsets"]
    cal = [{"input_ids": torch.from_numpy(ids[off[i]:off[i] + 64].astype(np.int64)).unsqueeze(0)}
           for i in range(24)]
    held = [torch.from_numpy(ids[off[i]:off[i + 1]][:256].astype(np.int64)).unsqueeze(0) for i in range(150, 170)]

    def nll(m):
        with torch.no_grad():
            return sum(float(m(input_ids=s, labels=s).loss) for s in held) / len(held)

    results = {method: nll(prune_transformer(model, cal, 0.25, method=method)[0]) for method in ("osscar", "mp+")}
    assert results["osscar"] < results["mp+"]
    assert nll(model) < results["osscar"]
