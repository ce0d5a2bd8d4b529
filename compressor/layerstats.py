"""What every pruning pipeline does around `solve_layer`: accumulate a layer's statistics, then turn
the solution into kept groups, a weight and an intercept.

Life cycle (as sparsegpt's): `LayerStatistics(W_hat)` -> `add(X, X_hat)` per calibration batch ->
`finish(center)` -> `prune_layer` (observe -> solve -> keep -> the pipeline's surgery -> report).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InputError
from .progress import SOLVE, Progress, ProgressFn, emit, warning
from .reports import LayerReport
from .solver import LayerSolution, solve_layer
from .solver.problem import group_rows

log = logging.getLogger(__name__)


HALF_DTYPES = (torch.float16, torch.bfloat16)
COMPUTE_DTYPE = torch.float32  # what a half-precision checkpoint's weights compute in (solves and fits)


def compute_device(device: str | torch.device | None) -> torch.device:
    """The requested device, else CUDA when available, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def num_to_prune(groups: int, ratio: float) -> int:
    """round(ratio * groups), keeping at least one group."""
    return max(0, min(groups - 1, round(ratio * groups)))


Widths = float | Mapping[str, int]  # a uniform ratio, or the kept width (groups) of every layer by name


def planned_prune(name: str, groups: int, plan: Widths) -> int:
    """Groups to prune in layer `name` under a uniform ratio or a per-layer width plan."""
    if isinstance(plan, Mapping):
        if name not in plan:
            raise InputError(f"the width plan has no entry for layer {name!r}")
        kept = int(plan[name])
        if not 1 <= kept <= groups:
            raise InputError(f"layer {name!r}: planned width {kept} is outside [1, {groups}]")
        return groups - kept
    return num_to_prune(groups, plan)


def check_plan(plan: Widths) -> None:
    if not isinstance(plan, Mapping) and not 0 <= plan < 1:
        raise InputError(f"uniform ratio must be in [0, 1) (got {plan})")


@dataclass(frozen=True)
class LayerObservation:
    """What a pipeline saw of one layer before solving it (for loss-versus-width curves)."""

    name: str
    kind: str
    H: Tensor  # d1 x d1 (centred when the layer has an intercept), float64
    G: Tensor  # d1 x d2
    group_size: int
    energy: float  # 1/2 ||X_hat W_hat||^2 (centred likewise): the loss normaliser
    cost: float  # FLOPs one group costs per sample at the pipeline's shape (latency model)
    # 1/2 ||residual stream||^2 where the layer's output joins it (None: no residual), the scale its
    # error is felt at
    stream_energy: float | None = None
    # the width plan's entry this layer's width comes from, where layers share one (the experts of a MoE layer:
    # their losses and costs add up to the unit's curve); None: `name`
    unit: str | None = None
    # the widths the layer keeps, other than its full width, are multiples of this (a MoE layer's experts:
    # experts.ALIGN)
    multiple: int = 1


def floored_scale(scale: Tensor) -> Tensor:
    """Output-column weights (a norm's gamma after the layer) kept away from 0: a column weighted by exactly 0 has a
    zero G and refit column, and unscaling it is 0 / 0. Floored at 1e-6 of the largest weight, the column still weighs
    nothing in the choice of support (1e-12 of the error), and its refit weights unscale to the column's own."""
    magnitude = scale.abs()
    floor = 1e-6 * float(magnitude.max()) if magnitude.numel() and float(magnitude.max()) > 0 else 1.0
    return torch.where(magnitude < floor, torch.full_like(scale, floor), scale)


def token_weights(rows: Tensor, cap: float) -> Tensor:
    """(n,) weights of rows (n x d) in a robust least squares: 1 up to `cap` x the median row's squared norm,
    then cap x median / ||row||^2, so that no row weighs more than `cap` median rows. A language model carries
    a few tokens of massive activation (SmolLM2: one token ~31,000x the median's squared norm from layer 12 on);
    unweighted, they decide a refit weight and a mean, and the other tokens pay for it. Stays on the device."""
    return energy_weights(rows.square().sum(1), cap)


def energy_weights(energy: Tensor, cap: float, counted: Tensor | None = None) -> Tensor:
    """`token_weights` from the tokens' squared norms (any shape): min(1, cap x median / energy), the median over
    the tokens where the bool `counted` (same shape) is set, or over all."""
    chosen = energy if counted is None else energy[counted]
    if chosen.numel() == 0:  # nothing counted: nothing to weigh
        return torch.ones_like(energy)
    reference = chosen.median()
    reference = torch.where(reference > 0, reference, energy.mean())  # mostly zero rows: their mean
    return (cap * reference / energy.clamp_min(torch.finfo(energy.dtype).tiny)).clamp(max=1.0)


class LayerStatistics:
    """H = X^T X and G = X^T X_hat W_hat over the calibration rows, with the sums the intercept needs.

    X are the pruned model's input rows to the layer, X_hat the dense model's, W_hat (d1 x d2) the
    dense weight (columns possibly scaled by the caller), all float64 on the compute device. With
    `token_cap`, each row pair is weighted by `token_weights(X_hat row, token_cap)` (a weighted least squares,
    its intercept the weighted means).
    """

    def __init__(self, W_hat: Tensor, token_cap: float | None = None) -> None:
        d1, d2 = W_hat.shape
        self.W_hat = W_hat
        self.token_cap = token_cap
        self.weight = torch.zeros((), dtype=W_hat.dtype, device=W_hat.device)  # the rows' summed weights
        self.H = torch.zeros(d1, d1, dtype=W_hat.dtype, device=W_hat.device)
        self.G = torch.zeros(d1, d2, dtype=W_hat.dtype, device=W_hat.device)
        self.sum_x = torch.zeros(d1, dtype=W_hat.dtype, device=W_hat.device)
        self.sum_y = torch.zeros(d2, dtype=W_hat.dtype, device=W_hat.device)
        # 1/2 ||X_hat W_hat||^2, kept on the device: reading it per batch would make the host wait for every batch
        self.energy = torch.zeros((), dtype=W_hat.dtype, device=W_hat.device)
        self.rows = 0

    def add(self, X: Tensor, X_hat: Tensor) -> None:
        """One batch of matching rows (n x d1 each)."""
        root = token_weights(X_hat, self.token_cap).sqrt() if self.token_cap else None  # (n,)
        if root is not None:  # sqrt(w) on both sides: H, G and the energy are weighted by w
            X, X_hat = X * root[:, None], X_hat * root[:, None]
        Y = X_hat @ self.W_hat  # the dense layer's pre-bias output
        self.H.addmm_(X.T, X)
        self.G.addmm_(X.T, Y)
        self.energy += 0.5 * Y.square().sum()
        if root is None:
            self.sum_x += X.sum(0)
            self.sum_y += Y.sum(0)
            self.weight += X.shape[0]
        else:  # w-weighted sums of the unweighted rows: sqrt(w) once more
            self.sum_x += root @ X
            self.sum_y += root @ Y
            self.weight += root.square().sum()
        self.rows += X.shape[0]

    def add_ridge(self, weight: float) -> None:
        """`weight` x the identity rows (x = x_hat = sqrt(weight) e_i, unweighted by `token_cap`): a ridge pulling the
        refit toward W_hat, which also weighs a pruned input by its weight row's norm. Not for centred problems."""
        self.H.diagonal().add_(weight)
        self.G.add_(self.W_hat, alpha=weight)
        self.energy += 0.5 * weight * self.W_hat.square().sum()
        self.rows += self.H.shape[0]

    def finish(self, center: bool) -> FinishedStatistics:
        """The layer problem's inputs; with `center`, those of the centred rows: least squares with an
        intercept = least squares on centred data, for every support. Centring works in place on H and
        G (no second d1 x d1 matrix), so `finish` is called once."""
        total = self.weight.clamp_min(torch.finfo(self.weight.dtype).tiny)  # = rows without weights
        mu, nu = self.sum_x / total, self.sum_y / total
        H, G, energy = self.H, self.G, self.energy
        if center:
            # rank-1 updates in place: `total * outer(mu, mu)` would be two d1 x d1 temporaries
            H.addr_(-total * mu, mu)
            H.diagonal().clamp_(min=0)  # constant features: zero variance, not -1e-12 from rounding
            G.addr_(-total * mu, nu)
            energy = energy - 0.5 * total * nu.square().sum()
        rank = max(self.rows - 1, 0) if center else self.rows  # centring removes one direction
        return FinishedStatistics(H, G, float(energy), mu, nu, rank)  # the layer's one host synchronisation


@dataclass(frozen=True)
class FinishedStatistics:
    """What `LayerStatistics.finish` returns: the solver's H and G, and what the intercept needs."""

    H: Tensor  # d1 x d1 = X^T X (centred with `center`)
    G: Tensor  # d1 x d2 = X^T X_hat W_hat (centred likewise)
    energy: float  # 1/2 ||X_hat W_hat||^2 (centred likewise): the loss normaliser
    mean_x: Tensor  # mu (d1): mean input row of the pruned model
    mean_y: Tensor  # nu (d2): mean row of the dense layer's pre-bias output X_hat W_hat
    rank: int | None = None  # an upper bound on rank(H): the rows behind it (one fewer once centred)


@dataclass(frozen=True)
class KeptSolution:
    keep: list[int]  # kept groups, sorted
    weight: Tensor  # (kept groups x group_size) x d2, in the caller's (unscaled) column space
    shift: Tensor  # d2: the intercept nu - mu W, unscaled


def kept_solution(sol: LayerSolution, group_size: int, scale: Tensor | None,
                  stats: FinishedStatistics) -> KeptSolution:
    """The kept groups' rows of the solved weight and the intercept nu - mu W, with column scaling
    undone (`stats`: what the problem was solved from)."""
    pruned = set(sol.pruned)
    groups = sol.weight.shape[0] // group_size
    return kept_rows(sol.weight, [j for j in range(groups) if j not in pruned], group_size, scale, stats)


def kept_rows(weight: Tensor, keep: list[int], group_size: int, scale: Tensor | None,
              stats: FinishedStatistics) -> KeptSolution:
    """Groups `keep` (sorted) of a d1 x d2 `weight` in the solver's column space (a solve's, or the dense W_hat:
    its other rows are ignored) and their intercept nu - mu_kept W_kept, with column scaling undone."""
    rows = group_rows(torch.tensor(keep, dtype=torch.long, device=weight.device), group_size)
    W = weight.index_select(0, rows)  # kept x d2
    shift = stats.mean_y - stats.mean_x.index_select(0, rows.to(stats.mean_x.device)) @ W.to(stats.mean_x)
    if scale is not None:
        W, shift = W / scale.to(W), shift / scale.to(shift)
    return KeptSolution(keep, W, shift)


def prune_layer(name: str, kind: str, stats: FinishedStatistics, group_size: int, num_prune: int, method: str, *,
                dense_weight: Tensor, scale: Tensor | None, apply: Callable[[KeptSolution], None],
                position: tuple[int, int], start: float, observe: Callable[[LayerObservation], None] | None,
                costs: Callable[[], tuple[float, float | None]], progress: ProgressFn | None,
                rank: int | None = None, numbers: Mapping[str, float] | None = None,
                unit: str | None = None, multiple: int = 1) -> LayerReport:
    """One layer's step, the same in every pipeline: `observe` its statistics (with `costs()`: one group's
    FLOPs and the residual stream's energy, computed only when observed), solve, keep, `apply` the kept
    solution (the pipeline's surgery), then report it (a SOLVE record at `position`: (index from 1, total)).
    `unit`, `multiple`: the width plan's entry the observation is planned under and the multiple its widths keep
    (`LayerObservation`)."""
    groups = stats.H.shape[0] // group_size
    if observe is not None:
        cost, stream_energy = costs()
        observe(LayerObservation(name, kind, stats.H, stats.G, group_size, stats.energy, cost, stream_energy, unit,
                                 multiple))
    sol = solve_layer(stats.H, stats.G, group_size, num_prune, method, dense_weight=dense_weight, rank=rank,
                      magnitude_scale=scale)
    if sol.stats.get("fallback"):
        emit(progress, warning(f"{name}: the search fell back to {sol.stats['fallback']}"), log)
    kept = kept_solution(sol, group_size, scale, stats)
    apply(kept)
    report = LayerReport.measure(name, kind, groups, len(kept.keep), sol.objective, stats.energy, start, kept=kept.keep)
    emit(progress, Progress(SOLVE, name, *position, kind=kind, numbers={
        "width_before": groups, "width_after": len(kept.keep), "relative_error": report.relative_error,
        "seconds": time.perf_counter() - start, **(numbers or {})}), log)
    return report
