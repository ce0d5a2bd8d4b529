"""`solve_layer`: the public entry point, and the registry of pruning methods behind it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .baselines import exact_support, flap_support, magnitude_support, thinet_support, wanda_sp_support
from .osscar import OsscarConfig, OsscarSolver
from .problem import IllConditioned, LayerProblem, LayerSolution, group_rows
from .sweep import PivotError, SwapState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MethodResult:
    """What a registered method returns; `solve_layer` sorts, casts and evaluates it."""

    pruned: Tensor  # pruned group indices, any order
    weight: Tensor  # d1 x d2 float64 for the support (pruned rows are zeroed by solve_layer)
    stats: dict[str, Any] = field(default_factory=dict)
    # f of `weight` on the caller's H when the method tracked it exactly (saves an evaluation)
    objective: float | None = None


# fn(problem, options) -> MethodResult; the registry METHODS follows the methods
Method = Callable[[LayerProblem, dict[str, Any]], MethodResult]


def _no_options(method: str, options: dict[str, Any]) -> None:
    if options:
        raise ValueError(f"method {method!r} takes no options (got {sorted(options)})")


def _kept_as_is(name: str, support: Callable[[LayerProblem], Tensor]) -> Method:
    """A method that picks a support and keeps the dense weight's other rows unchanged (no refit)."""

    def method(pb: LayerProblem, options: dict[str, Any]) -> MethodResult:
        _no_options(name, options)
        pruned = support(pb)
        W = pb.dense_weight.clone()
        W[group_rows(pruned, pb.group_size)] = 0
        return MethodResult(pruned, W)

    return method


def _refit_method(name: str, support: Callable[[LayerProblem], Tensor]) -> Method:
    """A method that picks a support and returns the least-squares refit on it."""

    def method(pb: LayerProblem, options: dict[str, Any]) -> MethodResult:
        _no_options(name, options)
        pruned = support(pb)
        return MethodResult(pruned, pb.refit(pruned))

    return method


# Tracked values that drifted from the caller's f by more than this fraction of |f| are not trusted: the
# guard compares refits and the weight is refit, as after a float32 search. |f| is about the energy of the
# layer's output; reconstruction errors that matter are 1e-3 of it and more.
MAX_DRIFT = 1e-5


def _osscar(pb: LayerProblem, options: dict[str, Any]) -> MethodResult:
    known = {f.name for f in dataclasses.fields(OsscarConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown osscar options {unknown}; valid: {sorted(known)}")
    config = OsscarConfig(**options)
    solver = OsscarSolver(pb, config)
    try:
        state = solver.search()
    except PivotError as err:  # lost again right after refactorising: the fallbacks decide this layer
        raise IllConditioned(f"the search lost a pivot after refactorising ({err})") from err
    stats: dict[str, Any] = {"source": "osscar"}
    # A singular H searched as H + delta I: the tracked f drifts from the caller's (~1e-6 relative on an
    # FFN projection calibrated on fewer tokens than it has features), so the weight's objective is
    # evaluated on H, and MP+ must beat the search by more than that drift to be improved.
    searched, damping = state, solver.damping
    tracked, drift, evaluated = solver.tracked, 0.0, None  # evaluated: f of the searched state on H
    if tracked and solver.delta:
        evaluated = pb.objective(state.weight())
        drift = abs(solver.caller_objective(state) - evaluated)
        tracked = drift <= MAX_DRIFT * abs(evaluated)
    if config.guard_mp and pb.dense_weight is not None and pb.num_prune > 0:
        start = time.perf_counter()
        try:
            state = _guard_mp(pb, solver, state, stats, drift if tracked else None)
        except PivotError as err:  # the searched state may be released by now: the fallbacks decide
            raise IllConditioned(f"improving MP+'s support lost a pivot ({err})") from err
        stats["guard_s"] = time.perf_counter() - start
        # improving MP+'s support may have refactorised one damping rung up: its state is then another problem's
        tracked = tracked and solver.damping == damping
    stats.update(solver.stats, drift=drift, damping=solver.damping)
    pruned = torch.sort(state.pruned()).values
    if not tracked:
        # the search's H^-1, A0 and factors go before the refit factorises H on the kept rows
        state.release()
        solver.release()
        return MethodResult(pruned, pb.refit(pruned), stats)
    # The tracked W is the optimum of the search's problem (the caller's H, or H + delta I) and needs no
    # refit; without damping f(S) was tracked with it, and casting W to a lower precision changes f only
    # at second order (the gradient vanishes on the support). With damping, f is evaluated on H (here,
    # or by solve_layer for the weight it returns).
    weight = state.weight()
    if not solver.delta:
        return MethodResult(pruned, weight, stats, objective=state.f)
    return MethodResult(pruned, weight, stats, objective=evaluated if state is searched else None)


def _guard_mp(pb: LayerProblem, solver: OsscarSolver, state: SwapState,
              stats: dict[str, Any], drift: float | None) -> SwapState:
    """Never worse than MP+ (beyond rounding, or the tracked values' drift): when the magnitude support is
    not clearly worse than the search's, improve it with swap rounds (which only lower f) and keep the
    better state.

    `drift`: how far the tracked values are from the caller's f (None: not trusted, compare refits;
    0.0: exact). With a drift, MP+ is improved only when it is better by more than the drift, and the
    improved support replaces the search's only when it is better by more than the drift: within it, the
    tracked values cannot tell two supports apart."""
    mp = torch.sort(magnitude_support(pb)).values
    if torch.equal(mp, torch.sort(state.pruned()).values):
        return state
    if drift is not None:  # compare the tracked values of the search's problem directly
        f_search = state.f
        bar = f_search - drift if drift else f_search + 1e-9 * abs(f_search)  # keep the search above it
        f_mp = solver.dense_objective(mp)  # from H^-1[P, P]: a factorisation of the pruned rows only
    else:  # float32 search, damped beyond TRACKED_DAMPING or drifted: compare refit objectives on H
        f_search = pb.objective(pb.refit(state.pruned()))
        f_mp, bar = pb.objective(pb.refit(mp)), f_search
    if f_mp > bar:
        return state
    log.info("osscar: the MP+ support is as good as the search's (%.6g vs %.6g); improving it",
             f_mp, f_search)
    state.release()  # only compared and returned from here: its A0 would double the search's memory
    improved = solver.improve(mp)
    f_improved = improved.f if drift is not None else pb.objective(pb.refit(improved.pruned()))
    if f_improved < f_search - (drift or 0.0):
        stats["source"] = "mp+ improved" if f_improved < f_mp else "mp+"
        return improved
    return state


def _osscar_support(pb: LayerProblem, options: dict[str, Any]) -> MethodResult:
    """osscar's search (and its MP+ guard) chooses the support; the dense weight's kept rows stay as they are, as
    the retraining-free baselines keep them: what the least-squares refit adds, measured apart from the support
    (bench/RESULTS.md, session 34: on SmolLM2-135M the refit on 128 C4 windows costs more than it gains).
    `solve_layer` has checked that a dense weight was given (DENSE_WEIGHT_METHODS)."""
    searched = _osscar(pb, options)
    W = pb.dense_weight.clone()
    W[group_rows(searched.pruned, pb.group_size)] = 0
    return MethodResult(searched.pruned, W, {**searched.stats, "weight": "dense rows"})


# what a layer falls back to when its method cannot factorise H even at the largest damping (an H whose scales
# span more than float64 resolves, or statistics at rounding level): MP+'s support and refit, which the search
# would have had to beat; then the magnitude support with the dense weights as they are, which needs no H
FALLBACKS = {"osscar": ("mp+", "mp"), "mp+": ("mp",), "thinet": ("mp",), "osscar-support": ("mp",)}


def _fall_back(pb: LayerProblem, method: str, err: IllConditioned) -> MethodResult:
    """The first method of FALLBACKS[method] that solves `pb`, its stats saying why; re-raises `err` when
    there is none (no dense weight: nothing to keep)."""
    if pb.dense_weight is None or method not in FALLBACKS:
        raise err
    for fallback in FALLBACKS[method]:
        try:
            result = METHODS[fallback](pb, {})
        except IllConditioned as again:
            err = again
            continue
        log.warning("%s: %s; this layer falls back to %s", method, err, fallback)
        result.stats["fallback"] = f"{fallback} ({err})"
        return result
    raise err


METHODS: dict[str, Method] = {
    "mp": _kept_as_is("mp", magnitude_support),
    "mp+": _refit_method("mp+", magnitude_support),
    # retraining-free LLM baselines (benchmarks compare against them): scores, no refit
    "wanda-sp": _kept_as_is("wanda-sp", wanda_sp_support),
    "flap": _kept_as_is("flap", flap_support),
    "thinet": _refit_method("thinet", thinet_support),
    "exact": _refit_method("exact", exact_support),
    "osscar": _osscar,
    # a benchmark ablation, not a user-facing method: osscar's support with the dense rows (no refit)
    "osscar-support": _osscar_support,
}


DENSE_WEIGHT_METHODS = ("mp", "mp+", "wanda-sp", "flap", "osscar-support")  # they score or keep the dense weight
# methods that keep the dense weight's rows as they are: no calibration-fitted weights, so no reconstruction
NO_REFIT_METHODS = ("mp", "wanda-sp", "flap")
# every method whose weight is the dense weight's kept rows (osscar-support's search sees the norm-scaled weight
# that osscar's does, so it is not among the scores on raw weights above)
DENSE_ROWS_METHODS = (*NO_REFIT_METHODS, "osscar-support")


def solve_layer(
    H: Tensor,
    G: Tensor,
    group_size: int,
    num_prune: int,
    method: str = "osscar",
    *,
    dense_weight: Tensor | None = None,
    rank: int | None = None,
    magnitude_scale: Tensor | None = None,
    **options: Any,
) -> LayerSolution:
    """Choose `num_prune` groups of rows to remove and the optimal remaining weight.

    Args:
        H: d1 x d1 symmetric PSD, X^T X of the (pruned model's) layer input.
        G: d1 x d2, X^T X_hat W_hat.
        group_size: rows per group (1: neurons, kH*kW: conv channels, head_dim: heads).
        num_prune: how many groups to remove, 0 <= num_prune <= d1 / group_size.
        method: one of "osscar", "mp", "mp+", "thinet", "exact", "wanda-sp", "flap", "osscar-support".
        dense_weight: W_hat (d1 x d2); required by the methods of DENSE_WEIGHT_METHODS (mp, mp+, wanda-sp,
            flap, osscar-support).
        rank: an upper bound on rank(H), e.g. the calibration rows behind it (one fewer once centred);
            factorisations of more rows than that skip the undamped attempt (see `problem.factorize`).
        magnitude_scale: the column scale (d2,) that dense_weight carries (a norm's gamma weighting the error), which
            MP's order (mp, mp+ and osscar's MP+ guard) takes off: they rank the weight as the model holds it.
        **options: method options (see `OsscarConfig` for "osscar").

    Results are on H's device; `weight` has G's dtype.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {sorted(METHODS)}")
    pb = LayerProblem.validate(H, G, group_size, num_prune, dense_weight, rank)
    if magnitude_scale is not None:
        assert magnitude_scale.shape == (pb.G.shape[1],), (tuple(magnitude_scale.shape), tuple(pb.G.shape))
        pb = dataclasses.replace(pb, magnitude_scale=magnitude_scale.to(pb.G))
    if method in DENSE_WEIGHT_METHODS and pb.dense_weight is None:
        raise ValueError(f"method {method!r} needs dense_weight (the layer's dense weight W_hat)")
    start = time.perf_counter()
    try:
        result = METHODS[method](pb, dict(options))
    except IllConditioned as err:
        result = _fall_back(pb, method, err)
    pruned = torch.sort(result.pruned).values
    weight = result.weight.to(pb.out_dtype)
    weight[group_rows(pruned, pb.group_size)] = 0
    if pb.num_prune == pb.num_groups:
        objective = 0.0  # nothing left: W = 0 exactly
    elif result.objective is not None:
        objective = float(result.objective)
    else:
        objective = pb.objective(weight)
    stats = {**result.stats, "elapsed_s": time.perf_counter() - start}
    assert pruned.numel() == pb.num_prune, (pruned.numel(), pb.num_prune)
    return LayerSolution(
        pruned=[int(j) for j in pruned.tolist()],
        weight=weight,
        objective=objective,
        method=method,
        stats=stats,
    )
