"""Block reconstruction: after a block's projections are pruned and refit one at a time, Adam fits the
block's weights jointly, so that the pruned block fed the pruned stream reproduces the dense block's
output (the next block's dense input) on the calibration tokens.

The layer-wise solves each see only their own projection; errors they leave in the other sublayer, and
the interaction through the attention softmax and the FFN gate, are what this fit can still remove.
Life cycle per block: `split` the calibration batches into fitting and held-out sequences once,
`BlockReconstruction(block, config).fit(train, held_out, run)` -> a `RefineReport`; the fit is kept only
when the held-out error improves, so it cannot make a block worse on data it did not see.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..reports import RefineReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefineConfig:
    steps: int = 0  # Adam steps per block (0: off)
    sequences: int = 4  # calibration sequences per step (fewer, cheaper steps fit better for the same time)
    lr: float = 0.02  # Adam's first step size, relative to each tensor's RMS (Adam moves every weight by ~lr)
    check_every: int = 10  # steps between held-out checks; a check that got worse backs off
    backoff: float = 0.25  # the step size's factor after a worse check
    held_out: float = 0.1  # fraction of the calibration sequences that judge the fit (never fitted)
    norms: bool = False  # also fit the norms' weights (default: the norms stay as the dense model has them)
    seed: int = 0  # the order of the fitting batches

    def __post_init__(self) -> None:
        assert self.steps >= 0, f"refine steps must be >= 0 (got {self.steps})"
        assert 0 < self.held_out < 1, f"held-out fraction must be in (0, 1) (got {self.held_out})"
        assert self.lr > 0, f"learning rate must be > 0 (got {self.lr})"
        assert self.check_every >= 1 and 0 < self.backoff < 1, (self.check_every, self.backoff)


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
        dimension are sliced with them, broadcast ones (batch dimension 1: rotary tables, ...) and 1-D ones
        (cache positions) are kept."""
        batch = self.x.shape[0]

        def pick(obj: Any) -> Any:
            if isinstance(obj, Tensor):
                return obj[rows] if obj.dim() >= 2 and obj.shape[0] == batch and batch > 1 else obj
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
    count = min(total - 1, max(1, round(held_out * total)))
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.zeros(total, dtype=torch.bool)
    chosen[torch.randperm(total, generator=generator)[:count]] = True
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


def _squared_error(out: Tensor, batch: Sequences) -> tuple[Tensor, Tensor]:
    """(sum of squared errors, sum of squared targets) over the counted tokens."""
    target = batch.target.to(out.device, out.dtype)
    error = (out - target).square().sum(-1)  # (batch, seq)
    energy = target.square().sum(-1)
    if batch.mask is not None:
        mask = batch.mask.to(out.device, out.dtype)
        error, energy = error * mask, energy * mask
    return error.sum(), energy.sum()


class BlockReconstruction:
    """Adam on one block's linear weights (and biases; norms with `config.norms`), in place."""

    def __init__(self, block: nn.Module, config: RefineConfig) -> None:
        self.block, self.config = block, config
        linear = [m for m in block.modules() if isinstance(m, nn.Linear)]
        norms = [m for m in block.modules() if "norm" in type(m).__name__.lower()] if config.norms else []
        self.parameters = [p for m in linear + norms for p in m.parameters(recurse=False)]
        assert self.parameters, f"{type(block).__name__}: no linear layers to fit"

    def error(self, batches: Sequence[Sequences], run: Run) -> float:
        errors = energies = 0.0
        with torch.no_grad():
            for batch in batches:
                error, energy = _squared_error(run(self.block, batch), batch)
                errors, energies = errors + float(error), energies + float(energy)
        return errors / energies if energies > 0 else 0.0

    def fit(self, train: Sequence[Sequences], held_out: Sequence[Sequences], run: Run) -> RefineReport:
        """Fit in place; the block ends with the weights of the lowest held-out error seen (checked every
        `config.check_every` steps), or its own weights when no fit beat them."""
        start = time.perf_counter()
        before = self.error(held_out, run)
        if not train or self.config.steps == 0:
            return RefineReport(before, before, False, 0, time.perf_counter() - start)
        best, best_weights = before, [p.detach().clone() for p in self.parameters]
        trainable = {id(p): p.requires_grad for p in self.block.parameters()}
        for p in self.block.parameters():
            p.requires_grad_(False)
        for p in self.parameters:
            p.requires_grad_(True)
        # relative step sizes: one lr suits weights of any scale (model to model, weights against norms)
        scales = [float(p.detach().square().mean().sqrt().clamp_min(1e-3)) for p in self.parameters]
        lr = self.config.lr
        optimizer = self._adam(scales, lr)
        generator = torch.Generator().manual_seed(self.config.seed)
        k = self.config.sequences
        train = [b.select(slice(i, i + k)) for b in train for i in range(0, b.x.shape[0], k)]
        order: list[int] = []
        try:
            for step in range(1, self.config.steps + 1):
                if not order:  # a new pass over the fitting batches, in a seeded order
                    order = torch.randperm(len(train), generator=generator).tolist()
                batch = train[order.pop()]
                with torch.enable_grad():
                    error, energy = _squared_error(run(self.block, batch), batch)
                    loss = error / energy.clamp_min(1e-30)  # relative: batches weigh alike
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                optimizer.step()
                if step % self.config.check_every and step != self.config.steps:
                    continue
                # the held-out judge doubles as the step-size control: a step size that suits one model
                # diverges on another (SmolLM2's outlier features), so a check that got worse goes back
                # to the best weights and goes on with smaller steps
                current = self.error(held_out, run)
                with torch.no_grad():
                    if current < best:
                        best = current
                        for saved, p in zip(best_weights, self.parameters, strict=True):
                            saved.copy_(p)
                    else:
                        for saved, p in zip(best_weights, self.parameters, strict=True):
                            p.copy_(saved)
                        lr *= self.config.backoff
                        optimizer = self._adam(scales, lr)
        finally:
            for p in self.block.parameters():
                p.requires_grad_(trainable[id(p)])
                p.grad = None
        with torch.no_grad():
            for saved, p in zip(best_weights, self.parameters, strict=True):
                p.copy_(saved)
        return RefineReport(before, best, best < before, self.config.steps, time.perf_counter() - start)

    def _adam(self, scales: Sequence[float], lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam([{"params": [p], "lr": lr * scale} for p, scale in zip(self.parameters, scales,
                                                                                        strict=True)])
