"""What each pruned layer reports (report.json's `layers`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RefineReport:
    """A block's reconstruction (compressor.transformer.refine), on the held-out calibration sequences."""

    before: float  # relative error ||block(x) - target||^2 / ||target||^2 before the fit
    after: float  # and after it
    kept: bool  # the fit is kept only when it lowered the held-out error
    steps: int
    seconds: float
    windows: int | None = None  # the calibration windows a whole-model fit stepped through (None: not counted)


def fit_numbers(fit: RefineReport) -> dict[str, float]:
    """A reconstruction's figures as a RECONSTRUCTION progress record carries them."""
    return {"before": fit.before, "after": fit.after, "kept": float(fit.kept), "steps": fit.steps,
            "seconds": fit.seconds}


@dataclass(frozen=True)
class LayerReport:
    name: str  # the pruned layer (conv consumer, o_proj, down_proj, ...)
    kind: str  # "conv_channels" | "attention_heads" | "ffn_neurons"
    width_before: int  # groups: channels, KV head groups or neurons
    width_after: int
    objective: float  # f(S) of the layer problem (solve_layer's objective)
    relative_error: float  # ||X W - X_hat W_hat||^2 / ||X_hat W_hat||^2 on the calibration data
    seconds: float
    kept: tuple[int, ...] = ()  # indices of the kept groups, in the layer's original numbering (provenance)
    refine: RefineReport | None = None  # on a block's last layer: the block's reconstruction, when it ran
    rows: str | None = None  # with `choose_rows`: the rows kept, "refit" (the solve's) or "dense" (the dense weight's)
    # a Mixture-of-Experts layer's experts (`kept` empty): each expert's kept neurons, in its original numbering
    experts_kept: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def measure(cls, name: str, kind: str, before: int, after: int, objective: float, energy: float,
                start: float, kept: Sequence[int] = ()) -> LayerReport:
        """From the layer objective and the dense energy 1/2 ||X_hat W_hat||^2 (f + energy >= 0)."""
        relative = max(0.0, objective + energy) / energy if energy > 0 else 0.0
        assert not kept or len(kept) == after, f"{name}: {len(kept)} kept indices for width {after}"
        return cls(name, kind, before, after, objective, relative, time.perf_counter() - start,
                   tuple(int(k) for k in kept))
