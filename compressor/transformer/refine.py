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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..refine import Reconstruction, RefineConfig
from ..reports import RefineReport
from .surgery import is_projection

log = logging.getLogger(__name__)

# a job's default fit: each block's as long as its own solves took (`RefineConfig.per_solve`), at least
# DEFAULT_STEPS and at most MAX_STEPS. SmolLM2-135M at 0.25 goes from perplexity 834 to 85 with 50 steps (dense
# 35.8), about what its two solves cost on the CPU; all-MiniLM-L6-v2's solves, on 1,024 short windows, pay for
# ~250, and 500 steps there gained +0.011 embedding cosine over 50 at 1.5x (bench/RESULTS.md)
DEFAULT_STEPS = 50
MAX_STEPS = 500
PER_SOLVE = 1.0


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
    """Adam on one block's linear weights (and biases; norms with `config.norms`), in place
    (`compressor.refine.Reconstruction` on a block fed the pruned stream)."""

    def __init__(self, block: nn.Module, config: RefineConfig) -> None:
        self.block, self.config = block, config
        linear = [m for m in block.modules() if is_projection(m)]  # GPT-2's Conv1D too
        norms = [m for m in block.modules() if "norm" in type(m).__name__.lower()] if config.norms else []
        self.parameters = [p for m in linear + norms for p in m.parameters(recurse=False)]
        assert self.parameters, f"{type(block).__name__}: no linear layers to fit"
        self.reconstruction = Reconstruction(block, self.parameters, config)

    def error(self, batches: Sequence[Sequences], run: Run) -> float:
        return self.reconstruction.error(batches, _loss(run))

    def fit(self, train: Sequence[Sequences], held_out: Sequence[Sequences], run: Run) -> RefineReport:
        """Fit in place on steps of `config.sequences` sequences; the block ends with the weights of the
        lowest held-out error seen, or its own weights when no fit beat them."""
        k = self.config.sequences
        steps = [b.select(slice(i, i + k)) for b in train for i in range(0, b.x.shape[0], k)]
        return self.reconstruction.fit(steps, held_out, _loss(run))


def _loss(run: Run) -> Callable[[nn.Module, Sequences], tuple[Tensor, Tensor]]:
    return lambda block, batch: _squared_error(run(block, batch), batch)
