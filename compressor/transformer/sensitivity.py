"""How much the model's output moves per unit of error written into its residual stream, layer by layer.

The width curves and the removal losses measure an error where it is made: in a projection's output,
relative to the residual stream it joins. That currency weighs an error in layer 3 like the same relative
error in layer 25, although what follows a layer may amplify it or wash it out, and a few tokens of massive
activation (SmolLM2's, from its 12th layer on) inflate the stream a relative error is measured against,
so the layers after them look cheap to cut (bench/RESULTS.md, issue 33).

Here the error is priced by its effect on the output, to second order: an error e_t in token t's update
changes the output by about 1/2 e_t^T F_t e_t, F_t the Fisher information of the output distribution with
respect to that update (Gauss-Newton for a deterministic output). With the error's direction taken as
isotropic, that is 1/2 ||e_t||^2 tr(F_t) / d, and tr(F_t) = E ||g_t||^2, g_t the gradient of the output's
log-likelihood at the update when labels are drawn from the model itself (language-model and classifier
logits), or of <v, y> for a random Gaussian v on a deterministic output y (Hutchinson's estimator: an
encoder's hidden states). One backward pass per calibration batch on the dense model gives every layer's
sensitivity: the mean over counted tokens of ||g_t||^2 / d, at each attention's and FFN's output (what they
add to the stream) and at each layer's output (what removing the whole layer changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..layerstats import compute_device
from .adapters import adapter_for, layers
from .sublayers import ATTENTION, FFN
from .surgery import projection


@dataclass(frozen=True)
class Sensitivity:
    """Per layer, the mean over counted calibration tokens of ||g_t||^2 / d at each place an error joins the
    stream, and the mean stream energy ||h_t||^2 there (what a relative error was measured against)."""

    attention: list[float]  # at the attention's output (its output projection)
    ffn: list[float]  # at the FFN's output (its down projection)
    layer: list[float]  # at the layer's output (after its residual adds)
    stream_in: list[float]  # mean ||h_t||^2 of the layer's input stream
    stream_out: list[float]  # mean ||h_t||^2 of the layer's output stream
    tokens: int  # counted tokens at the first layer's input (each layer's means are over its own)

    def of(self, index: int, kind: str | None) -> float:
        """The sensitivity where an error of a sub-layer `kind` (None: the whole layer) of layer `index` lands."""
        return {ATTENTION: self.attention, FFN: self.ffn, None: self.layer}[kind][index]

    def relative_to_output(self, index: int, kind: str | None, relative: float, against: str) -> float:
        """A loss relative to a stream (error energy over that stream's energy: the layer's `against` "input", as
        the width curves and the removal losses measure it, or its "output") as the predicted
        output change per token of an error where `kind` of layer `index` (None: the whole layer) writes."""
        stream = {"input": self.stream_in, "output": self.stream_out}[against][index]
        return relative * stream * self.of(index, kind)


def _draw_target(out: object, generator: torch.Generator, mask: Tensor | None = None) -> Tensor:
    """The scalar whose gradient is one sample of g: log-likelihood of labels drawn from the model's own
    logits, or <v, y> for Gaussian v on its first output, over the tokens `mask` counts (a (batch, seq)
    attention mask; all tokens without one). A padding position still attends to the real tokens before it,
    so its term would send gradient into their streams."""
    logits = getattr(out, "logits", None)
    if logits is not None:
        log_p = torch.log_softmax(logits.float(), dim=-1)
        # inverse-CDF sampling with uniforms from the CPU generator: the same labels on any device, and no
        # generator of the logits' device needed (`multinomial` takes only one of the probabilities' device)
        cdf = log_p.detach().exp().reshape(-1, log_p.shape[-1]).cumsum(-1)  # (tokens, vocab)
        u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype).to(cdf.device) * cdf[:, -1:]
        labels = torch.searchsorted(cdf, u).clamp_(max=cdf.shape[1] - 1)  # (tokens, 1)
        ll = log_p.reshape(-1, log_p.shape[-1]).gather(1, labels)  # (tokens, 1)
        if mask is not None and mask.shape == logits.shape[:-1]:
            ll = ll * mask.reshape(-1, 1).to(ll)
        return ll.sum()
    y = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0] if isinstance(out, tuple) else out
    v = torch.randn(y.shape, generator=generator, dtype=torch.float32).to(y.device)
    if mask is not None and mask.shape == y.shape[:-1]:
        v = v * mask[..., None].to(v)
    return (y.float() * v).sum()


def output_sensitivity(model: nn.Module, batches: Sequence[dict[str, Tensor]], device: str | torch.device | None = None,
                       seed: int = 0) -> Sensitivity:
    """Every layer's `Sensitivity` on the dense `model` over `batches` (one forward and backward each; the
    model's weights get no gradient and are left as they were)."""
    if not batches:
        raise ValueError("no calibration batches")
    device = compute_device(device)
    adapter, blocks = adapter_for(model), layers(model)
    n = len(blocks)
    sums = {key: [0.0] * n for key in ("attention", "ffn", "layer", "stream_in", "stream_out")}
    generator = torch.Generator().manual_seed(seed)
    tokens = [0] * n  # counted tokens at each layer's input (Swin's patch merging leaves later stages fewer)
    mask: Tensor | None = None  # the batch part's attention mask, when it has one
    hooks = []

    def add(key: str, i: int, per_token: Tensor) -> None:
        """Sum a (batch, seq) quantity over the counted tokens (all of them without a matching mask)."""
        counted = mask is not None and mask.shape == per_token.shape
        sums[key][i] += float((per_token * mask.to(per_token)).sum() if counted else per_token.sum())

    def energy(key: str, i: int, x: Tensor) -> None:
        add(key, i, x.detach().float().square().sum(-1))

    def gradient_of(key: str, i: int, x: Tensor) -> None:
        if x.requires_grad:
            d = x.shape[-1]
            x.register_hook(lambda g: add(key, i, g.detach().float().square().sum(-1) / d))

    def count(i: int, x: Tensor) -> None:
        counted = mask is not None and mask.shape == x.shape[:-1]
        tokens[i] += int(mask.sum()) if counted else x[..., 0].numel()

    for i, block in enumerate(blocks):
        def before_block(_m, args, kwargs, i=i):
            h = args[0] if args else kwargs["hidden_states"]
            count(i, h)
            energy("stream_in", i, h)

        def after_block(_m, _args, out, i=i):
            h = out[0] if isinstance(out, tuple | list) else out
            energy("stream_out", i, h)
            gradient_of("layer", i, h)

        hooks.append(block.register_forward_pre_hook(before_block, with_kwargs=True))
        hooks.append(block.register_forward_hook(after_block))
        here = adapter.at(block)  # a dense FFN's or a linear-attention mixer's paths where the block has them
        for key, path in (("attention", here.o), ("ffn", here.down)):
            hooks.append(projection(block, path).register_forward_hook(
                lambda _m, _args, out, key=key, i=i: gradient_of(key, i, out)))
    # the stream needs a gradient although no weight does: the embeddings' output is made to want one
    hooks.append(model.get_input_embeddings().register_forward_hook(_wants_grad))
    width = _output_width(model)
    was_training = model.training
    stored = {p: p.requires_grad for p in model.parameters()}
    original_device = next(model.parameters()).device
    try:
        model.eval().to(device)
        for p in model.parameters():
            p.requires_grad_(False)
        for batch in batches:
            for part in _parts(batch, width):
                part = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in part.items()}
                mask = part.get("attention_mask")
                _draw_target(model(**part), generator, mask).backward()
    finally:
        for h in hooks:
            h.remove()
        for p, flag in stored.items():
            p.requires_grad_(flag)
        model.train(was_training).to(original_device)
    mean = {key: [v / max(t, 1) for v, t in zip(values, tokens, strict=True)] for key, values in sums.items()}
    return Sensitivity(mean["attention"], mean["ffn"], mean["layer"], mean["stream_in"], mean["stream_out"], tokens[0])


LOGIT_ELEMENTS = 1 << 25  # a forward's logits at most (float32: 128 MiB, its log-softmax and gradient as much again)


def _output_width(model: nn.Module) -> int:
    """The width of a token's output scores (a language model's vocabulary), 1 without an output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(head.weight.shape[0]) if head is not None else 1


def _parts(batch: dict[str, Tensor], width: int) -> list[dict[str, Tensor]]:
    """The batch in parts of whole sequences whose logits stay under LOGIT_ELEMENTS (a 128k vocabulary's)."""
    first = next(iter(batch.values()))
    rows, per_row = first.shape[0], max(1, first[0].numel()) * width
    step = max(1, LOGIT_ELEMENTS // per_row)
    if step >= rows:
        return [batch]
    return [{k: v[i:i + step] if isinstance(v, Tensor) and v.shape[:1] == (rows,) else v for k, v in batch.items()}
            for i in range(0, rows, step)]


def _wants_grad(_module: nn.Module, _args: object, out: object) -> None:
    """The embeddings' output (Swin's: its first element, beside the grid's size) made to want a gradient."""
    first = out[0] if isinstance(out, tuple | list) else out
    first.requires_grad_(True)

