import math

import pytest
import torch

from compressor.transformer import sensitivity as sens
from compressor.transformer.adapters import adapter_for, layers
from compressor.transformer.sensitivity import output_sensitivity
from compressor.transformer.sublayers import ATTENTION, FFN
from compressor.transformer.surgery import projection

from .transformer_models import MODELS, example_inputs, tiny_bert, tiny_llama


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_family_gets_a_sensitivity_at_every_layer_and_keeps_its_weights(name):
    model = MODELS[name]().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = example_inputs(model)
    s = output_sensitivity(model, [inputs, example_inputs(model, seed=1)])
    n = len(layers(model))
    for values in (s.attention, s.ffn, s.layer, s.stream_in, s.stream_out):
        assert len(values) == n
        assert all(math.isfinite(v) and v > 0 for v in values), values
    if "attention_mask" in inputs:  # padding is not counted
        assert s.tokens == 2 * int(inputs["attention_mask"].sum())
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # as they were: no gradient kept
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training


def test_a_layer_output_is_as_sensitive_as_its_ffn_output_in_a_pre_norm_decoder():
    """The FFN's output is added last: the gradient there is the layer output's."""
    model = tiny_llama().eval()
    s = output_sensitivity(model, [example_inputs(model)])
    assert s.layer == pytest.approx(s.ffn, rel=1e-5)
    assert s.of(1, FFN) == s.ffn[1] and s.of(0, ATTENTION) == s.attention[0] and s.of(1, None) == s.layer[1]
    # a relative loss priced by the stream it was measured against: the layer's input (a width curve's and a removal
    # loss's) or its output
    assert s.relative_to_output(1, ATTENTION, 0.5, "input") == pytest.approx(0.5 * s.stream_in[1] * s.attention[1])
    assert s.relative_to_output(1, None, 0.5, "output") == pytest.approx(0.5 * s.stream_out[1] * s.layer[1])
    assert s.relative_to_output(0, FFN, 0.5, "output") == pytest.approx(0.5 * s.stream_out[0] * s.ffn[0])


def _noise_at(module, sigma, generator):
    def hook(_m, _args, out):
        return out + sigma * torch.randn(out.shape, generator=generator, dtype=out.dtype)
    return module.register_forward_hook(hook)


def _batches(model, count):
    return [example_inputs(model, batch=4, length=12, seed=seed) for seed in range(count)]


def _counted(batch):
    return batch["attention_mask"].bool()


@pytest.mark.parametrize("kind", ["o", "down"])
def test_the_sensitivity_predicts_a_decoders_kl_for_small_noise_in_a_sublayers_output(kind):
    """Isotropic noise of variance sigma^2 per coordinate in a sub-layer's output changes the next-token
    distributions by KL ~ 1/2 sigma^2 d s per token (second order, the Fisher's trace d s)."""
    model = tiny_llama().double().eval()
    batches = _batches(model, 16)
    s = output_sensitivity(model, batches)
    index, sigma = 1, 1e-3
    module = projection(layers(model)[index], getattr(adapter_for(model), kind))
    d = module.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    kl, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            p = torch.log_softmax(model(**batch).logits, -1)
            for _ in range(4):
                hook = _noise_at(module, sigma, generator)
                q = torch.log_softmax(model(**batch).logits, -1)
                hook.remove()
                per_token = (p.exp() * (p - q)).sum(-1)
                kl += float(per_token[_counted(batch)].sum()) / 4
            tokens += int(_counted(batch).sum())
    measured = kl / tokens
    predicted = 0.5 * sigma**2 * d * (s.attention if kind == "o" else s.ffn)[index]
    assert measured == pytest.approx(predicted, rel=0.3)


def test_the_sensitivity_predicts_an_encoders_output_change_for_small_noise():
    """Hutchinson's estimate on a deterministic output: sigma^2 d s per token of squared output change."""
    model = tiny_bert().double().eval()
    batches = _batches(model, 16)
    s = output_sensitivity(model, batches)
    module = projection(layers(model)[0], adapter_for(model).down)
    d, sigma = module.weight.shape[0], 1e-4
    generator = torch.Generator().manual_seed(0)
    change, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            y = model(**batch).last_hidden_state
            hook = _noise_at(module, sigma, generator)
            moved = model(**batch).last_hidden_state
            hook.remove()
            change += float((moved - y)[_counted(batch)].square().sum())
            tokens += int(_counted(batch).sum())
    assert change / tokens == pytest.approx(sigma**2 * d * s.ffn[0], rel=0.3)


def test_long_vocabularies_run_in_parts_of_whole_sequences(monkeypatch):
    batch = {"input_ids": torch.arange(40).reshape(5, 8), "attention_mask": torch.ones(5, 8, dtype=torch.long)}
    monkeypatch.setattr(sens, "LOGIT_ELEMENTS", 2 * 8 * 100)  # two sequences' logits of a 100-word vocabulary
    parts = sens._parts(batch, 100)
    assert [len(p["input_ids"]) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert sens._parts(batch, 1) == [batch]


def test_no_batches_is_refused():
    with pytest.raises(ValueError, match="no calibration batches"):
        output_sensitivity(tiny_llama(), [])


def test_the_drawn_labels_follow_the_models_own_distribution_and_the_seed():
    """A decoder's target is the log-likelihood of labels drawn from its own next-token distribution, with the
    CPU generator whatever the logits' device (a GPU's `multinomial` refuses a CPU generator): 3 in 4 labels
    of a 1:3 distribution, the same draw for the same seed."""
    from types import SimpleNamespace

    tokens = 4000
    logits = torch.log(torch.tensor([0.25, 0.75])).expand(1, tokens, 2).clone().requires_grad_()
    total = sens._draw_target(SimpleNamespace(logits=logits), torch.Generator().manual_seed(0))
    likely = (float(total) - tokens * math.log(0.25)) / (math.log(0.75) - math.log(0.25))  # labels of class 1
    assert abs(likely / tokens - 0.75) < 0.03, likely
    again = sens._draw_target(SimpleNamespace(logits=logits), torch.Generator().manual_seed(0))
    assert float(again) == float(total)
    total.backward()  # the gradient of the drawn labels' log-likelihood reaches the logits
    assert logits.grad is not None and bool(logits.grad.abs().sum() > 0)


@pytest.mark.parametrize("build", [tiny_llama, tiny_bert])
def test_padding_moves_no_sensitivity(build):
    """A padded position attends to the real tokens (before it, or all of them): its drawn target must not send
    gradient into their streams. A sequence padded after 4 tokens gets the sensitivities of those 4 tokens
    alone (the same draws: labels and Gaussians for the first positions come first from the generator)."""
    model = build().eval()
    ids = example_inputs(model, batch=1, length=9, seed=3)["input_ids"]
    padded = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 4 + [0] * 5])}
    alone = {"input_ids": ids[:, :4], "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    a, b = output_sensitivity(model, [padded], seed=5), output_sensitivity(model, [alone], seed=5)
    assert a.tokens == b.tokens == 4
    for key in ("attention", "ffn", "layer", "stream_in", "stream_out"):
        assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-4), key


def test_each_layer_is_averaged_over_its_own_tokens():
    """Swin's patch merging leaves a later stage a quarter of the tokens: its means are over those."""
    from .transformer_models import tiny_swin

    model = tiny_swin().eval()
    batch = example_inputs(model, batch=2)
    s = output_sensitivity(model, [batch])
    seen = []
    hooks = [b.register_forward_pre_hook(lambda _m, a, k: seen.append((a[0] if a else k["hidden_states"]).detach()),
                                         with_kwargs=True) for b in layers(model)]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    assert len({h.shape[1] for h in seen}) > 1  # the stages differ in tokens
    for i, h in enumerate(seen):
        assert s.stream_in[i] == pytest.approx(float(h.float().square().sum(-1).mean()), rel=1e-4), i
