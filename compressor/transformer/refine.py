"""Block reconstruction: after a block's projections are pruned and refit one at a time, Adam fits the
block's weights jointly, so that the pruned block fed the pruned stream reproduces the dense block's
output (the next block's dense input) on the calibration tokens.

The layer-wise solves each see only their own projection; errors they leave in the other sublayer, and
the interaction through the attention softmax and the FFN gate, are what this fit can still remove.
Life cycle per block: `split` the calibration batches into fitting and held-out sequences once,
`BlockReconstruction(block, config).fit(train, held_out, run)` -> a `RefineReport`; the fit is kept only
when the held-out error improves, so it cannot make a block worse on data it did not see.

Each block is fitted to its own dense output, fed the pruned stream: what the blocks' fits leave still adds
up through the model. `reconstruct_model` then fits every block's projections at once to the dense model's
last hidden states (an encoder job's default, `model_config`): all-MiniLM-L6-v2 at 1.54x, WikiText-2
embedding cosine 0.9177 -> 0.9252 in 1,000 steps (111 s on 2 CPU cores; bench/RESULTS.md, 2026-11-29); or to a
causal LM's next-token distributions (a decoder job's): SmolLM2-135M at 1.29x, WikiText-2 perplexity 87.5 -> 80.6
in 80 steps (386 s; session 29).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..calibration import without_seen
from ..layerstats import COMPUTE_DTYPE, HALF_DTYPES, energy_weights
from ..precision import float32_view
from ..refine import Reconstruction, RefineConfig, held_out_draw
from ..reports import RefineReport
from .adapters import layers
from .experts import is_experts, is_router
from .surgery import is_projection

log = logging.getLogger(__name__)

# a job's default fit: each block's as long as its own solves took (`RefineConfig.per_solve`), at least
# DEFAULT_STEPS and at most MAX_STEPS. SmolLM2-135M at 0.25 goes from perplexity 834 to 85 with 50 steps (dense
# 35.8), about what its two solves cost on the CPU; all-MiniLM-L6-v2's solves, on 1,024 short windows, pay for
# ~250, and 500 steps there gained +0.011 embedding cosine over 50 at 1.5x (bench/RESULTS.md)
DEFAULT_STEPS = 50
MAX_STEPS = 500
PER_SOLVE = 1.0


# the whole-model fit (`model_config`): a step size a tenth of a block fit's, since every block moves at once and
# their changes compound (all-MiniLM-L6-v2 at 1.54x: relative step 2e-4 took the WikiText-2 cosine 0.9177 ->
# 0.9252 in 1,000 steps, 2e-3 and 2e-2 lost ground on the held-out windows from the first check and never got
# back); held-out checks every 100 steps (each is a forward pass over a tenth of the calibration windows). It
# runs as long as the block fits took in all (MODEL_PER_BLOCK_FITS x their seconds), at most MODEL_STEPS: it
# scales with the model and the calibration as they do, and at most doubles the reconstruction
MODEL_STEPS = 1000
MODEL_LR = 2e-4
MODEL_CHECK_EVERY = 100
MODEL_PER_BLOCK_FITS = 1.0
# a causal LM's fit of its next-token distributions (target "logits"): a step runs the dense model beside the pruned
# one and a softmax over the vocabulary at every token (SmolLM2-135M, 4 windows of 256 tokens: ~12 s on 2 CPU
# cores, against ~5 s for the hidden states'), so the held-out checks come every LOGITS_CHECK_EVERY steps for the
# seconds to bind, and it runs LOGITS_PER_PRUNE x as long as the pruning pass (solves and block fits) took:
# SmolLM2-135M at 0.2 went 78.03 -> 71.69 in 60 steps, 1.05x its prune (bench/RESULTS.md, session 28)
LOGITS_CHECK_EVERY = 20
LOGITS_PER_PRUNE = 1.0
TARGETS = ("hidden", "logits")  # what `reconstruct_model` fits: last hidden states, or next-token distributions


def default_config(steps: int | None) -> RefineConfig:
    """A job's block reconstruction: `steps` as the user gave them (a fixed count), else the per-solve rule."""
    if steps is not None:
        return RefineConfig(steps=steps)
    return RefineConfig(steps=MAX_STEPS, min_steps=DEFAULT_STEPS, per_solve=PER_SOLVE)


@dataclass
class Sequences:
    """Calibration sequences as one block sees them."""

    x: Tensor  # (batch, seq, d) the pruned stream's input to the block (CPU)
    target: Tensor  # (batch, seq, d) the dense block's output on the dense stream (CPU)
    args: tuple[Any, ...]  # what the model passes the block besides the hidden states
    kwargs: dict[str, Any]
    mask: Tensor | None  # (batch, seq) bool: tokens that count

    def select(self, rows: Tensor | slice) -> Sequences:
        """The sequences `rows` of this batch (a slice: views, no copy); context tensors with a batch
        dimension (the batch first, the sequence after it: masks, position ids) are sliced with them, broadcast
        ones (batch dimension 1: rotary tables, ...), 1-D ones (cache positions) and ones without a sequence
        dimension (DeBERTa-v2's relative-position embeddings, buckets x hidden) are kept."""
        batch, length = self.x.shape[:2]

        def pick(obj: Any) -> Any:
            if isinstance(obj, Tensor):
                batched = obj.dim() >= 2 and obj.shape[0] == batch and batch > 1 and length in obj.shape[1:]
                return obj[rows] if batched else obj
            if isinstance(obj, tuple | list):
                return type(obj)(pick(o) for o in obj)
            if isinstance(obj, dict):
                return {k: pick(v) for k, v in obj.items()}
            return obj

        return Sequences(self.x[rows], self.target[rows], pick(self.args), pick(self.kwargs),
                         None if self.mask is None else self.mask[rows])


def split(batches: Sequence[Sequences], held_out: float, seed: int) -> tuple[list[Sequences], list[Sequences]]:
    """(fitting, held-out) sequences: a seeded `held_out` fraction of all sequences (at least one), taken
    across the batches; a batch keeps its other sequences for fitting. Empty fitting list: nothing to fit."""
    sizes = [b.x.shape[0] for b in batches]
    total = sum(sizes)
    if total < 2:
        return [], list(batches)
    chosen = torch.zeros(total, dtype=torch.bool)
    chosen[held_out_draw(total, held_out, seed)[0]] = True
    fit, judge, offset = [], [], 0
    for batch, size in zip(batches, sizes, strict=True):
        mine = chosen[offset:offset + size]
        offset += size
        if mine.all():
            judge.append(batch)
        elif not mine.any():
            fit.append(batch)
        else:
            judge.append(batch.select(mine.nonzero().squeeze(1)))
            fit.append(batch.select((~mine).nonzero().squeeze(1)))
    return fit, judge


Run = Callable[[nn.Module, Sequences], Tensor]  # block(x, *args, **kwargs) on the compute device -> output


def _squared_error(out: Tensor, batch: Sequences | Windows, token_cap: float | None = None) -> tuple[Tensor, Tensor]:
    """(sum of squared errors, sum of squared targets) over the counted tokens (a block's, or the whole model's);
    with `token_cap`, each token's terms weighted by `energy_weights` of its target over the batch's counted tokens."""
    target = batch.target.to(out.device, out.dtype)
    error = (out - target).square().sum(-1)  # (batch, seq)
    energy = target.square().sum(-1)
    weight = None if batch.mask is None else batch.mask.to(out.device, out.dtype)  # (batch, seq)
    if token_cap is not None:  # the target's weights: no gradient flows through them
        capped = energy_weights(energy.detach(), token_cap, None if weight is None else weight > 0)
        weight = capped if weight is None else weight * capped
    if weight is not None:
        error, energy = error * weight, energy * weight
    return error.sum(), energy.sum()


def _fitted(module: nn.Module) -> bool:
    """The modules whose weights the fits move: projections (GPT-2's Conv1D too) and a MoE layer's experts (their 3-D
    weights; the router keeps its choices, Phi-3.5-MoE's an nn.Linear too)."""
    return (is_projection(module) and not is_router(module)) or is_experts(module)


class BlockReconstruction:
    """Adam on one block's linear weights (and biases; norms with `config.norms`; a MoE layer's experts), in place
    (`compressor.refine.Reconstruction` on a block fed the pruned stream)."""

    def __init__(self, block: nn.Module, config: RefineConfig) -> None:
        self.block, self.config = block, config
        linear = [m for m in block.modules() if _fitted(m)]
        norms = [m for m in block.modules() if "norm" in type(m).__name__.lower()] if config.norms else []
        self.parameters = [p for m in linear + norms for p in m.parameters(recurse=False)]
        assert self.parameters, f"{type(block).__name__}: no linear layers to fit"
        self.reconstruction = Reconstruction(block, self.parameters, config)

    def error(self, batches: Sequence[Sequences], run: Run) -> float:
        return self.reconstruction.error(batches, _loss(run, self.config.token_cap))

    def fit(self, train: Sequence[Sequences], held_out: Sequence[Sequences], run: Run) -> RefineReport:
        """Fit in place on steps of `config.sequences` sequences; the block ends with the weights of the
        lowest held-out error seen, or its own weights when no fit beat them."""
        k = self.config.sequences
        steps = [b.select(slice(i, i + k)) for b in train for i in range(0, b.x.shape[0], k)]
        return self.reconstruction.fit(steps, held_out, _loss(run, self.config.token_cap))


def _loss(run: Run, token_cap: float | None = None) -> Callable[[nn.Module, Sequences], tuple[Tensor, Tensor]]:
    return lambda block, batch: _squared_error(run(block, batch), batch, token_cap)


def model_config(block_fits: float, budget: float | None = None, *, solves: float = 0.0,
                 target: str = "hidden") -> RefineConfig:
    """The whole-model fit's settings (`reconstruct_model` with `target`): MODEL_STEPS steps of 4 windows at most,
    for MODEL_PER_BLOCK_FITS x the seconds the block fits took (`block_fits`; "logits": LOGITS_PER_PRUNE x those
    and the solves' `solves` seconds), or what a time budget left (`budget`) when that is less; the fit stops at its
    first held-out check past its seconds (at once when the budget's are those: `RefineConfig.budgeted`)."""
    _check_target(target)
    if target == "logits":
        seconds, check_every = LOGITS_PER_PRUNE * (solves + block_fits), LOGITS_CHECK_EVERY
    else:
        seconds, check_every = MODEL_PER_BLOCK_FITS * block_fits, MODEL_CHECK_EVERY
    return RefineConfig(steps=MODEL_STEPS, lr=MODEL_LR, check_every=check_every,
                        seconds=max(0.0, seconds if budget is None else min(seconds, budget)),
                        budgeted=budget is not None and budget < seconds)


@dataclass
class Windows:
    """A few calibration windows and the dense model's last hidden states on them."""

    inputs: dict[str, Tensor]  # the model's inputs, (windows, seq, ...) each
    target: Tensor  # (windows, seq, hidden) float32 on the CPU
    mask: Tensor | None  # (windows, seq) bool: tokens that count (None: all)


def _last_hidden(model: nn.Module, inputs: dict[str, Tensor], device: torch.device) -> Tensor:
    """The base model's last hidden states (batch, seq, hidden): an encoder's output, a decoder's before its LM
    head (a task head is left out: it reads these)."""
    base = getattr(model, "base_model", model)
    out = base(**{k: v.to(device) for k, v in inputs.items()})
    return out[0] if isinstance(out, tuple | list) else out.last_hidden_state


def _cut(batch: dict[str, Tensor], rows: slice) -> dict[str, Tensor]:
    """`rows` of a calibration batch, its padding columns beyond the longest of them dropped (a batch is padded to
    its own longest window; a few of its windows rarely need all of it)."""
    part = {k: v[rows] for k, v in batch.items()}
    mask = part.get("attention_mask")
    if mask is None or mask.dim() != 2 or bool(mask.all()):
        return part
    length = int(mask.any(0).nonzero().max()) + 1
    return {k: v[:, :length] if v.dim() >= 2 and v.shape[1] == mask.shape[1] else v for k, v in part.items()}


def reconstruct_model(pruned: nn.Module, dense: nn.Module, batches: Sequence[dict[str, Tensor]],
                      config: RefineConfig, device: torch.device, target: str = "hidden",
                      pool: Sequence[dict[str, Tensor]] = ()) -> RefineReport:
    """Fit every block's projections (weights and biases; with `config.norms` every norm's weights too) of `pruned`,
    in place, so that its outputs reproduce `dense`'s on the calibration `batches`, `config.sequences` windows per
    step; a seeded `config.held_out` of them judge the fit, which is kept only when it lowers their error
    (`compressor.refine.Reconstruction`). `pool`: more windows to step through beside the calibration's, never
    judged (those that repeat a judged window, `calibration._Seen`, are left out), so that a fit of many steps does
    not go over the same few windows again and again.

    `target` "hidden": the last hidden states (relative squared error over the tokens that count). "logits": a
    causal LM's next-token distributions (the KL divergence from the dense model's, per token that counts; the
    dense model runs beside the fit, since distributions over a vocabulary at every calibration token would not
    fit in memory): SmolLM2-135M pruned at 0.2, WikiText-2 perplexity 78.03 -> 71.69 in 60 steps, where the
    hidden states' fit gave 76.99 (bench/RESULTS.md, session 28)."""
    _check_target(target)
    k = config.sequences
    slices = _slices(batches, k)
    assert slices, "no calibration windows to fit on"
    pruned.to(device)
    home = next(dense.parameters()).device  # the caller's dense model goes back where it was (a job keeps it)
    judge, fit = held_out_draw(len(slices), config.held_out, config.seed)
    judged = [slices[i] for i in judge.tolist()]
    extra = _slices(without_seen(list(pool), judged), k)
    slices += extra  # fitted, never judged: their indices are past the draw's
    fit = torch.cat([fit, torch.arange(len(slices) - len(extra), len(slices))])
    fitted = sum(len(next(iter(slices[i].values()))) for i in fit.tolist())  # windows stepped through
    # Adam's relative steps (2e-4) are below half precision's resolution (bf16: 2^-8): a half-precision model is
    # fitted in float32 and its fitted weights round once, at the end
    restore = _in_float32(pruned)
    try:
        parameters = [p for block in layers(pruned) for m in block.modules() if _fitted(m)
                      for p in m.parameters(recurse=False)]
        if config.norms:  # every norm the blocks' outputs pass through, the final one's too (not the embeddings')
            embeddings = {id(m) for m in pruned.get_input_embeddings().modules()}
            owner = getattr(getattr(pruned, "base_model", pruned), "embeddings", None)
            if isinstance(owner, nn.Module):  # BERT's embeddings.LayerNorm sits beside the word embeddings
                embeddings |= {id(m) for m in owner.modules()}
            parameters += [p for m in pruned.modules() if "norm" in type(m).__name__.lower()
                           and id(m) not in embeddings for p in m.parameters(recurse=False)]

        def run(items: list[Any], loss: Callable[[nn.Module, Any], tuple[Tensor, Tensor]]) -> RefineReport:
            held_out, train = [items[i] for i in judge.tolist()], [items[i] for i in fit.tolist()]
            report = Reconstruction(pruned, parameters, config).fit(train, held_out, loss)
            return replace(report, windows=fitted)

        # the target in float32 too: a half-precision forward overflowed fp16 (a NaN target, the fit thrown away
        # unsaid) and rounded every bf16 logit; read through an upcast, with no float32 copy of the dense model
        with float32_view(dense):
            dense.to(device)
            try:
                if target == "logits":
                    return run(slices, lambda model, inputs: _next_token_kl(model, dense, inputs, device))
                with torch.no_grad():
                    windows = []
                    for inputs in slices:
                        mask = inputs.get("attention_mask")
                        hidden = _last_hidden(dense, inputs, device).float().cpu()  # (windows, seq, hidden)
                        windows.append(Windows(inputs, hidden, None if mask is None else mask.bool()))
            finally:
                dense.to(home)
        return run(windows, lambda model, batch: _squared_error(_last_hidden(model, batch.inputs, device).float(),
                                                                batch))
    finally:
        restore()


def _slices(batches: Sequence[dict[str, Tensor]], k: int) -> list[dict[str, Tensor]]:
    """The batches in steps of `k` windows (`_cut`)."""
    return [_cut(b, slice(i, i + k)) for b in batches for i in range(0, len(next(iter(b.values()))), k)]


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)} (got {target!r})")


def _in_float32(model: nn.Module) -> Callable[[], None]:
    """Cast `model`'s half-precision parameters and buffers to float32, in place; the returned call casts each back
    to the dtype it had. Not the pipeline's `block.to(dtype=...)` round trip: a whole model's float32 buffers (its
    rotary frequencies) would come back rounded to the half dtype."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    half = {name: t.dtype for name, t in tensors if t.dtype in HALF_DTYPES}

    def cast(dtypes: dict[str, torch.dtype]) -> None:
        for name, t in tensors:
            if name in dtypes:
                t.data = t.data.to(dtypes[name])

    cast(dict.fromkeys(half, COMPUTE_DTYPE))
    return lambda: cast(half)


def _next_token_kl(model: nn.Module, dense: nn.Module, inputs: dict[str, Tensor],
                   device: torch.device) -> tuple[Tensor, Tensor]:
    """(sum over the counted tokens of KL(dense's next-token distribution || model's), the number of those tokens):
    a mean KL once `Reconstruction` divides them."""
    inputs = {name: value.to(device) for name, value in inputs.items()}
    with torch.no_grad():
        target = torch.log_softmax(_logits(dense, inputs).float(), -1)  # (windows, seq, vocab)
    log_p = torch.log_softmax(_logits(model, inputs).float(), -1)
    kl = torch.nn.functional.kl_div(log_p, target, reduction="none", log_target=True).sum(-1)  # (windows, seq)
    mask = inputs.get("attention_mask")
    if mask is None:
        return kl.sum(), torch.tensor(float(kl.numel()), device=kl.device)
    mask = mask.to(kl.dtype)
    return (kl * mask).sum(), mask.sum()


def _logits(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    out = model(**inputs)
    logits = getattr(out, "logits", None)
    if logits is None or logits.dim() != 3:
        raise ValueError(f"{type(model).__name__} has no next-token logits to fit: the whole-model fit of "
                         "target='logits' is for causal LMs (target='hidden' fits any model's last hidden states)")
    return logits
