"""Per-layer widths for a latency budget: loss-versus-width curves and their allocation.

Curves come from the dense model's layer statistics (one calibration pass): the nested greedy path
of OSSCAR (prune the groups with the smallest impact B_j, a few at a time) gives f for every width
along one path from one factorisation. Each layer's loss is normalised by its dense output energy
(a relative error), so layers of different scales compare. `allocate` then narrows layers one
allowed width at a time, always the step that adds the least loss per unit of saved cost, until the
predicted saving is reached or every layer is at its narrowest allowed width.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .solver.osscar import OsscarConfig, OsscarSolver
from .solver.problem import LayerProblem


def allowed_widths(groups: int, multiple: int, minimum: int) -> list[int]:
    """Kept widths a layer may take, descending: its full width, then the multiples of `multiple`
    (hardware-friendly sizes) down to `minimum` (at least one group, or one multiple)."""
    if groups < 1 or multiple < 1:
        raise ValueError(f"need groups >= 1 and multiple >= 1 (got {groups}, {multiple})")
    floor = max(1, minimum)
    widths = [groups] + [w for w in range(groups - groups % multiple, 0, -multiple) if w != groups and w >= floor]
    if groups < multiple and groups > floor:  # a layer narrower than the multiple: allow its floor
        widths.append(floor)
    return widths


def loss_path(H: Tensor, G: Tensor, group_size: int, widths: Sequence[int]) -> list[float]:
    """f(S_w) - f(dense) for each kept width in `widths` (descending), along the nested greedy path."""
    groups = H.shape[0] // group_size
    if list(widths) != sorted(widths, reverse=True) or widths[0] > groups or widths[-1] < 1:
        raise ValueError(f"widths must descend within [1, {groups}] (got {list(widths)})")
    problem = LayerProblem.validate(H, G, group_size, groups - widths[-1])
    state = OsscarSolver(problem, OsscarConfig()).start()
    out = []
    for width in widths:
        remove = groups - width - int((~state.kept).sum())
        # Steps of a fifth of the groups this width prunes in all (at least one), capped at what is
        # left to reach it; not the search's ceil(0.2 * still-to-prune): far from dense a width is then
        # reached in one step instead of a run of ever smaller ones, which keeps the path cheap when a
        # layer has many allowed widths.
        while remove > 0:
            t = max(1, min(remove, (groups - width) // 5 or 1))
            state.prune(torch.topk(state.scores(), t, largest=False).indices)
            remove -= t
        out.append(state.f - state.f0)
    return out


@dataclass
class LayerCurve:
    name: str
    kind: str  # conv_channels | attention_heads | ffn_neurons
    widths: list[int]  # allowed kept widths (groups), descending, widths[0] = dense
    loss: list[float]  # normalised loss at each width (0 at the dense width)
    cost: float  # latency-model cost of one group (FLOPs at the declared shape)

    @property
    def groups(self) -> int:
        return self.widths[0]


def allocate(curves: Sequence[LayerCurve], saving: float, *, fill: bool = False) -> dict[str, int]:
    """Kept width per layer saving at least `saving` cost units, by a greedy on the marginal loss per
    saved cost.

    Each step moves one layer to its next allowed width: the layer whose step has the smallest loss
    increase per unit of cost saved. Steps stop once the cost saved reaches `saving` (the last step
    may overshoot it) or every layer is at its narrowest allowed width (then the saving falls short).
    When every curve is convex in saved cost, this is a greedy on the Lagrangian: each allocation it
    passes through has the least total loss for the cost it saves. Otherwise it is a heuristic.

    `fill`: a step that would carry the saving past `saving` is skipped (its layer stays where it is) while
    smaller steps of other layers can still reach it; when none can, the smallest skipped step is taken.
    The saving then lands closer to the asked one where a layer's coarse step (a residual stream of 16
    channels at a multiple of 8 halves at once) makes the plain greedy jump past it: slightly more loss for
    the saving, a saving between the greedy path's points. When the filled widths save more than the
    greedy's (the coarse step was needed after all), the greedy's are returned.
    """
    position = {c.name: 0 for c in curves}
    order = {c.name: i for i, c in enumerate(curves)}
    heap: list[tuple[float, int, str]] = []

    def push(curve: LayerCurve) -> None:
        k = position[curve.name]
        if k + 1 < len(curve.widths):
            saved = curve.cost * (curve.widths[k] - curve.widths[k + 1])
            dloss = max(0.0, curve.loss[k + 1] - curve.loss[k])  # f is monotone along a nested path: < 0 is rounding
            # a step that saves nothing goes last (unless it loses nothing either: it then costs nothing to take);
            # equal ratios (common: many steps lose nothing) go in layer order, so the same curves give the same
            # widths
            ratio = dloss / saved if saved > 0 else (math.inf if dloss > 0 else 0.0)
            heapq.heappush(heap, (ratio, order[curve.name], curve.name))

    by_name = {c.name: c for c in curves}
    for curve in curves:
        push(curve)

    def step(name: str) -> float:
        curve, k = by_name[name], position[name]
        return curve.cost * (curve.widths[k] - curve.widths[k + 1])

    done = 0.0
    skipped: list[str] = []
    while done < saving and heap:
        _, _, name = heapq.heappop(heap)
        if fill and done + step(name) > saving:
            skipped.append(name)
            continue
        done += step(name)
        position[name] += 1
        push(by_name[name])
    if done < saving and skipped:  # fill: every step left overshoots; the smallest overshoots least
        position[min(skipped, key=step)] += 1
    widths = {c.name: c.widths[position[c.name]] for c in curves}
    if fill:  # small steps spent before a coarse one became unavoidable: the greedy's widths save less
        greedy = allocate(curves, saving)
        return greedy if total_cost(curves, greedy) > total_cost(curves, widths) else widths
    return widths


def total_cost(curves: Sequence[LayerCurve], widths: dict[str, int] | None = None) -> float:
    """The prunable cost of the layers at `widths` (dense widths when None)."""
    return sum(c.cost * (widths[c.name] if widths else c.groups) for c in curves)


def max_saving(curves: Sequence[LayerCurve]) -> float:
    """The fraction of the prunable cost removed with every layer at its minimum width (0 without cost)."""
    full = total_cost(curves)
    return 1 - total_cost(curves, {c.name: c.widths[-1] for c in curves}) / full if full > 0 else 0.0


def curve_loss(curves: Sequence[LayerCurve], widths: dict[str, int]) -> float:
    """The summed normalised loss of the layers at `widths` (a layer not named stays dense)."""
    return sum(c.loss[c.widths.index(widths[c.name])] for c in curves if c.name in widths)


@dataclass(frozen=True)
class DepthOption:
    """One mix of depth and width for a speedup: some whole blocks removed (measured, or modelled from what they
    cost), the rest from widths (modelled), with the loss of each part in the curves' currency (errors relative to
    the residual stream)."""

    blocks: tuple[str, ...]  # the residual blocks removed
    depth_loss: float  # their summed removal losses
    depth_speedup: float  # the dense graph without them, against the dense graph
    width_saving: float  # fraction of the remaining prunable cost the widths must still remove
    width_loss: float  # the allocation's loss for that saving (inf: the minimum widths cannot reach it)
    measured: bool = True  # depth_speedup measured by a latency probe (False: modelled from the blocks' cost)

    @property
    def loss(self) -> float:
        return self.depth_loss + self.width_loss


def depth_option(blocks: Sequence[str], depth_loss: float, depth_speedup: float, curves: Sequence[LayerCurve],
                 target: float, share: float, measured: bool = True) -> DepthOption:
    """What reaching `target` costs with `blocks` removed (at `depth_speedup`, `measured` or modelled) and the
    layers left (`curves`, the removed blocks' layers already left out) narrowed by `allocate` for the rest.

    The rest: the speedup still missing, target / depth_speedup, as a fraction of the remaining latency,
    over `share` (the latency model's fraction of latency per fraction of prunable cost removed)."""
    if depth_speedup <= 0 or share <= 0:
        raise ValueError(f"need a positive depth speedup and share (got {depth_speedup}, {share})")
    rest = target / depth_speedup
    if rest <= 1:
        return DepthOption(tuple(blocks), depth_loss, depth_speedup, 0.0, 0.0, measured)
    saving = (1 - 1 / rest) / share
    if saving > max_saving(curves):
        return DepthOption(tuple(blocks), depth_loss, depth_speedup, saving, math.inf, measured)
    widths = allocate(curves, saving * total_cost(curves))
    return DepthOption(tuple(blocks), depth_loss, depth_speedup, saving, curve_loss(curves, widths), measured)
