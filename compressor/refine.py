"""Reconstruction after pruning: Adam fits a pruned module's remaining weights so that it reproduces the
dense model's outputs on calibration data, judged on held-out calibration data (a fit is kept only when
the held-out error improves, so it cannot make the module worse on data it did not see).

What a module is depends on the model kind: one transformer block fed the pruned stream
(`compressor.transformer.refine`), or a whole pruned conv graph fed calibration images
(`compressor.cnn.refine`). Both share this loop: `Reconstruction(module, parameters, config)
.fit(train, held_out, loss)` -> a `RefineReport`, where `loss(module, batch)` returns the batch's
(sum of squared errors, sum of squared targets).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .errors import InputError
from .reports import RefineReport


@dataclass(frozen=True)
class RefineConfig:
    steps: int = 0  # Adam steps (0: off)
    sequences: int = 4  # calibration sequences (images for conv graphs) per step: fewer, cheaper steps fit
    # better in the same time
    lr: float = 0.02  # Adam's first step size, relative to each tensor's RMS (Adam moves every weight by ~lr)
    check_every: int = 10  # steps between held-out checks; a check that got worse backs off
    backoff: float = 0.25  # the step size's factor after a worse check
    slack: float = 0.0  # a check within (1 + slack) x the best error is not "worse": the step size stays
    # (minibatch noise is not divergence); the best weights are still the ones returned
    held_out: float = 0.1  # fraction of the calibration sequences that judge the fit (never fitted)
    norms: bool = False  # also fit the norms' weights (default: the norms stay as the dense model has them)
    augment: bool = False  # conv graphs: fit on flipped and shifted views of the images, their targets the
    # dense graph's outputs on those views (more inputs to match the dense model on than images drawn)
    anneal: bool = False  # the step size follows a half cosine from lr towards 0 over the fit (its `steps`, or its
    # `seconds` when those run out first; on top of any back-off): a long fit's last steps then settle into a
    # minimum instead of circling it at the first step size
    seed: int = 0  # the order of the fitting batches
    # wall-clock allowance of one fit (a job's time budget, `service/job/pacing.py`, or a default allowance): the
    # fit stops at its first held-out check past it (`budgeted`: at once), with the best weights seen; None: the
    # steps alone bound it. A pipeline fitting several blocks shares it out among them
    seconds: float | None = None
    # a transformer block's fit as long as its own solves took, times this (a job's default; None: off): the
    # pipeline turns it into `seconds` per block, so a block whose solves were costly gets a longer fit and the
    # reconstruction at most doubles a pruning pass; `steps` still caps it
    per_solve: float | None = None
    # `seconds` is a time budget's share: past it the fit stops at once, its steps since the last check judged there
    # (False: an allowance the fit may run past to its next held-out check, as the default per-solve and whole-model
    # allowances do; under a budget a decoder's interval of 20 steps of ~12 s ran minutes past a second's share)
    budgeted: bool = False
    # a time budget's end (an absolute `time.perf_counter()`, `service/job/pacing.py`): past it the fit ends at once
    # whatever `seconds` and `min_steps` say, judged there; one that starts past it does not fit (the allowance is
    # set when a round starts: solves that took the time left would otherwise still leave the fits their share)
    deadline: float | None = None
    min_steps: int = 0  # steps that run whatever `seconds` says (a floor under the per-solve allowance)
    # the weights judged and returned are an exponential moving average of the fitted ones with this decay per
    # step (None: the fitted weights themselves): the average of a noisy fit's last few hundred steps sits nearer
    # the minimum they circle than any one of them
    average: float | None = None
    # a transformer block's fit weighs each token at most this many median tokens of its target (the dense block's
    # output; `layerstats.token_weights`), None: every token alike (the default). SmolLM2 carries one token per window
    # whose residual stream is ~31,000x the median's squared norm, ~99 % of a block's loss; yet capping it at one
    # median token took SmolLM2 at 0.2 from perplexity 78.03 to 150.6 (bench/RESULTS.md, session 36): that token's
    # output is what the later layers read, and fitting it is what the block fits are for
    token_cap: float | None = None

    def __post_init__(self) -> None:
        assert self.steps >= 0, f"refine steps must be >= 0 (got {self.steps})"
        assert self.sequences >= 1, f"refine sequences per step must be >= 1 (got {self.sequences})"
        assert 0 < self.held_out < 1, f"held-out fraction must be in (0, 1) (got {self.held_out})"
        assert self.lr > 0, f"learning rate must be > 0 (got {self.lr})"
        assert self.check_every >= 1 and 0 < self.backoff < 1 and self.slack >= 0, (self.check_every, self.backoff,
                                                                                   self.slack)
        assert self.seconds is None or self.seconds >= 0, f"refine seconds must be >= 0 (got {self.seconds})"
        assert self.per_solve is None or self.per_solve > 0, f"per-solve share must be > 0 (got {self.per_solve})"
        assert 0 <= self.min_steps <= self.steps, f"min steps must be in [0, steps] (got {self.min_steps})"
        # an annealed fit's length is its steps or its seconds; a floor of steps past the seconds would run at ~0
        assert not (self.anneal and self.min_steps), "an annealed fit takes no min_steps"
        assert self.average is None or 0 < self.average < 1, f"average decay must be in (0, 1) (got {self.average})"
        assert self.token_cap is None or self.token_cap > 0, f"token cap must be > 0 (got {self.token_cap})"


def check_method(config: RefineConfig, method: str) -> None:
    """Refuse reconstruction for magnitude pruning, which uses no calibration data (InputError)."""
    if config.steps and method == "mp":
        raise InputError("reconstruction (refine steps) does not apply to method 'mp' (magnitude pruning uses no "
                         "calibration data)")


def held_out_draw(total: int, fraction: float, seed: int, unseen_from: int = 0) -> tuple[Tensor, Tensor]:
    """(held-out, fitting) indices of `total` samples: a seeded `fraction` of them (at least one, and at least
    one left to fit when there are two or more) judge a fit, the rest are fitted. `unseen_from`: the samples
    before it fed the solves a fit starts from; the judge is drawn after it when enough samples are there (its
    "before" error would otherwise be partly in-sample for the solves, biased low against the fit)."""
    count = min(total - 1, max(1, round(fraction * total)))
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    if unseen_from > 0 and total - unseen_from >= count:
        judge = order[order >= unseen_from][:count]
        fitted = torch.ones(total, dtype=torch.bool)
        fitted[judge] = False
        return judge, order[fitted[order]]
    return order[:count], order[count:]


def annealed(progress: float) -> float:
    """The step size's factor under `RefineConfig.anneal` at `progress` in [0, 1] through a fit: a half cosine
    from 1 at the start down to 0 at the end (a fit's last step, at progress (steps - 1) / steps, still moves)."""
    assert 0 <= progress <= 1, f"progress {progress} outside [0, 1]"
    return 0.5 * (1 + math.cos(math.pi * progress))


Loss = Callable[[nn.Module, Any], tuple[Tensor, Tensor]]  # (module, batch) -> (squared errors, squared targets)


class Reconstruction:
    """Adam on `parameters` of `module`, in place, with a held-out judge."""

    def __init__(self, module: nn.Module, parameters: Sequence[nn.Parameter], config: RefineConfig) -> None:
        self.module, self.config = module, config
        self.parameters = list(parameters)
        assert self.parameters, f"{type(module).__name__}: no weights to fit"

    def error(self, batches: Sequence[Any], loss: Loss) -> float:
        """Relative squared error over `batches`: sum of squared errors / sum of squared targets."""
        errors = energies = 0.0
        with torch.no_grad():
            for batch in batches:
                error, energy = loss(self.module, batch)
                errors, energies = errors + float(error), energies + float(energy)
        return errors / energies if energies > 0 else 0.0

    def fit(self, train: Sequence[Any], held_out: Sequence[Any], loss: Loss) -> RefineReport:
        """Fit in place, one `train` batch per step in a seeded order; the module ends with the weights of
        the lowest held-out error seen (checked every `config.check_every` steps; with `config.average`, the
        moving average's), or its own weights when no fit beat them."""
        start = time.perf_counter()
        before = self.error(held_out, loss)
        late = self.config.deadline is not None and time.perf_counter() >= self.config.deadline
        if not train or self.config.steps == 0 or before == 0.0 or self.config.seconds == 0 or late:  # nothing to
            # fit, nothing to fix (a block left whole on a stream still equal to the dense one), or no time to
            return RefineReport(before, before, False, 0, time.perf_counter() - start)
        best, best_weights = before, [p.detach().clone() for p in self.parameters]
        averaged = [p.detach().clone() for p in self.parameters] if self.config.average else None
        judged = averaged or self.parameters  # the weights a check judges and keeps
        trainable = {id(p): p.requires_grad for p in self.module.parameters()}
        for p in self.module.parameters():
            p.requires_grad_(False)
        for p in self.parameters:
            p.requires_grad_(True)
        # relative step sizes: one lr suits weights of any scale (model to model, weights against norms)
        scales = [float(p.detach().square().mean().sqrt().clamp_min(1e-3)) for p in self.parameters]
        lr = self.config.lr
        optimizer = self._adam(scales, lr)
        generator = torch.Generator().manual_seed(self.config.seed)
        order: list[int] = []
        step = 0
        # the seconds the fit has, which the annealed step follows: its own, or less where the budget ends first
        horizon = self.config.seconds
        if self.config.deadline is not None:
            horizon = min(horizon if horizon is not None else math.inf, max(self.config.deadline - start, 1e-9))
        try:
            for step in range(1, self.config.steps + 1):
                if not order:  # a new pass over the fitting batches, in a seeded order
                    order = torch.randperm(len(train), generator=generator).tolist()
                batch = train[order.pop()]
                if self.config.anneal:  # through the fit by steps, or by seconds when those will run out first
                    progress = (step - 1) / self.config.steps
                    if horizon:
                        progress = max(progress, min(1.0, (time.perf_counter() - start) / horizon))
                    factor = annealed(progress)
                    for group, scale in zip(optimizer.param_groups, scales, strict=True):
                        group["lr"] = lr * scale * factor
                with torch.enable_grad():
                    error, energy = loss(self.module, batch)
                    relative = error / energy.clamp_min(1e-30)  # batches weigh alike
                    optimizer.zero_grad(set_to_none=True)
                    relative.backward()
                optimizer.step()
                if averaged is not None:
                    with torch.no_grad():
                        for mean, p in zip(averaged, self.parameters, strict=True):
                            mean.lerp_(p, 1 - self.config.average)
                now = time.perf_counter()
                past_end = self.config.deadline is not None and now > self.config.deadline
                out_of_time = past_end or (self.config.seconds is not None and step >= self.config.min_steps
                                           and now - start > self.config.seconds)
                if (step % self.config.check_every and step != self.config.steps
                        and not (out_of_time and (self.config.budgeted or past_end))):
                    continue
                # the held-out judge doubles as the step-size control: a step size that suits one model
                # diverges on another (SmolLM2's outlier features), so a check that got worse goes back
                # to the best weights and goes on with smaller steps
                current = self._judge(held_out, loss, averaged)
                with torch.no_grad():
                    if current < best:
                        best = current
                        for saved, weight in zip(best_weights, judged, strict=True):
                            saved.copy_(weight)
                    elif current > best * (1 + self.config.slack):
                        for saved, p in zip(best_weights, self.parameters, strict=True):
                            p.copy_(saved)
                        if averaged is not None:  # the average restarts from the best weights too
                            for saved, mean in zip(best_weights, averaged, strict=True):
                                mean.copy_(saved)
                        lr *= self.config.backoff
                        optimizer = self._adam(scales, lr)
                if out_of_time:
                    break  # the steps run so far, judged
        finally:
            for p in self.module.parameters():
                p.requires_grad_(trainable[id(p)])
                p.grad = None
        with torch.no_grad():
            for saved, p in zip(best_weights, self.parameters, strict=True):
                p.copy_(saved)
        return RefineReport(before, best, best < before, step, time.perf_counter() - start)

    def _judge(self, held_out: Sequence[Any], loss: Loss, averaged: list[Tensor] | None) -> float:
        """The held-out error of the weights a check would keep: the fitted ones, or their average (swapped in
        for the check and out again)."""
        if averaged is None:
            return self.error(held_out, loss)

        def swap() -> None:
            for mean, p in zip(averaged, self.parameters, strict=True):
                mean.data, p.data = p.data, mean.data

        swap()
        try:
            return self.error(held_out, loss)
        finally:
            swap()

    def _adam(self, scales: Sequence[float], lr: float) -> torch.optim.Optimizer:
        return torch.optim.Adam([{"params": [p], "lr": lr * scale} for p, scale in zip(self.parameters, scales,
                                                                                        strict=True)])
