"""Measured-speedup targeting: dense loss-versus-width curves (cached), the closed prune -> measure loop
that corrects its latency model, the accuracy budget, and the choice of the round to return.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from torch import nn

import compressor
from compressor.allocation import (
    DepthOption,
    LayerCurve,
    allocate,
    allowed_widths,
    depth_option,
    loss_path,
    max_saving,
    total_cost,
)
from compressor.errors import InputError
from compressor.layerstats import LayerObservation, Widths
from compressor.progress import warning
from compressor.reports import LayerReport
from compressor.solver.problem import IllConditioned
from compressor.solver.sweep import PivotError
from exporters.onnx import Parity
from exporters.runtime import Latency

from ..files import file_sha256, write_text_atomically
from .budgets import Metric, accuracy_rule
from .kinds import ModelJob, Say, Solved
from .request import REFERENCES, CompressRequest, statistics_fields

MET = 0.98  # a measured speedup >= 0.98 x target counts as met (measurement noise)
AIM = 1.10  # and the loop aims at <= 1.10 x target
AIM_AT = 1.03  # each round asks for 1.03 x target: inside [MET, AIM], with room for noise on both sides
# a probe in [SURE] x target ends the search. Not [1, AIM]: a first probe at 1.085 x target (the share model's
# usual overshoot) ended it, and its round, timed again, read above AIM one time in three at 3 % timing noise
# (bench/targeting_noise.py); in [1, 1.07] the round has room for its own noise on both sides of the aim
SURE = (1.0, 1.07)
# what a cached curve file was computed with: conv graphs' coupled channel groups (residual adds) are layers
# since version 2 (3: option-A shortcuts count in their groups' losses; 4: in-block groups normalised by the
# residual stream they join; 5: calibration draws leave the accuracy check's held-out inputs out; 6: conv
# graphs' curves from the first STATISTICS_IMAGES of the draw; 7: text models' curves from at most
# PLANNING_SEQUENCES windows of the draw), so older curves describe other layers, losses or calibration data
LAYERS_VERSION = 7
INITIAL_SHARE = 0.85  # modelled fraction of the latency in the prunable layers before the first measurement
ROUND_TO = 8  # target mode's width multiple when --round-to is not given
MAX_SHARE = 3.0  # bounds of the corrected latency share (fraction of latency per fraction of removed cost)
# depth planning: at most this share of a graph's removable blocks is weighed (it bounds the search: each
# block weighed costs a forward pass per remaining block and a latency probe), and the search stops once
# this many blocks in a row did not lower the planned loss
MAX_DEPTH_SHARE = 0.5
# the prefix lengths of the depth order that are weighed (each costs an export and a latency probe): every one
# at first, then ~1.5x apart, so a transformer's 3 units a layer (90 for SmolLM2-135M, a probe ~1 minute on 2
# CPU cores) cost a dozen probes, not 45
DEPTH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEPTH_PATIENCE = 2
# a kind whose depth units' latency is their share of the multiply-adds (`removed_cost`: transformers, every layer at
# one sequence length) has its options' speedups modelled, and a probe measures the best option only once it
# removes at least DEPTH_PROBE_MIN of the modelled latency: SmolLM2-135M's options of 1-4 units (1-6 % of its
# latency) measured 1.009x, 1.039x, 1.034x, 1.066x where their multiply-adds say 1.010x, 1.020x, 1.030x, 1.059x, the
# 2-core VM's timing noise deciding between them at a minute or more a probe (bench/RESULTS.md, session 31). Each
# probe corrects the model's share; at most MAX_DEPTH_PROBES of them
DEPTH_PROBE_MIN = 0.05
MAX_DEPTH_PROBES = 3
# depth options planned within TIE of the least loss are a tie the planned losses cannot break: ResNet-56 at 2x
# planned its 3-block option at 0.740-0.759 from run to run (2.5 %), 3 and 6 blocks 0.2-2.5 % apart, and every
# 6-block round measured more top-1 than the 3-block ones (bench/RESULTS.md, sessions 24-25). The first TRIALS of
# them are each solved without the fit and scored (a trial: the composed loss of the layers' solves, measured,
# where the plan summed each layer's loss on the dense stream), and the best trial's option runs first
TIE = 0.03
TRIALS = 2


@dataclass
class Round:
    """One prune -> export -> measure round."""

    plan: Widths  # the uniform ratio, or {layer: kept width}
    module: nn.Module | None  # the pruned model
    layers: list[LayerReport]
    onnx: Path | None  # its export (in the job's scratch directory)
    parity: Parity  # errors of the export against the PyTorch model
    latency: Latency  # dense and pruned, measured together
    metric: float  # the job's metric on the evaluation data
    predicted_speedup: float | None = None  # what the latency model expected (target mode)
    probes: list[Probe] = field(default_factory=list)  # the latency probes that chose its widths
    secondary: dict[str, float] = field(default_factory=dict)  # other metrics beside `metric` (not budgeted)
    scored_sha256: str = ""  # digest of the ONNX file whose outputs `metric` scored
    # every speedup measured of its widths (its probes', its own, a second look's) when they disagreed on the window,
    # `latency` then being their median (empty: its own measurement alone)
    timings: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Probe:
    """A latency-only measurement of planned widths (weights sliced, not solved; never evaluated)."""

    saving: float  # fraction of the prunable cost the widths remove
    latency: Latency


# (widths, round, predicted speedup[, a depth trial's solved model and reports, to fit]) -> the round
RunRound = Callable[..., Round]
ProbeGraph = Callable[[nn.Module], Latency]  # a model's latency against the dense one (export, no evaluation)


class DepthJob(Protocol):
    """What depth planning needs of a model job (conv graphs: `kinds.ConvJob`). A kind whose units' costs change when
    blocks go (a conv graph's residual stream runs through them) also has `unit_costs(blocks) -> {unit: cost per
    group}` (`kept_curves`)."""

    def depth_order(self) -> Iterator[tuple[str, float]]: ...
    def removal_losses(self) -> dict[str, float]: ...
    def currency(self) -> Callable[..., float] | None: ...
    def without(self, blocks: Sequence[str]) -> nn.Module: ...
    def removed_cost(self, blocks: Sequence[str]) -> float | None: ...
ProbeWidths = Callable[[Widths, int], Latency]  # (plan, round) -> dense and resized latency
Retime = Callable[["Round", int], Latency]  # (a round, its number) -> its export timed again against the dense one


def _inside(speedup: float, target: float) -> bool:
    """Whether a measured speedup is inside the loop's window, [MET, AIM] x target."""
    return MET * target <= speedup <= AIM * target


def _from_aim(speedup: float, target: float) -> float:
    """How far a measured speedup is from what each round asks for (AIM_AT x target), in log terms."""
    return abs(math.log(speedup / (AIM_AT * target)))


DIGESTED_BYTES = 64 << 20  # files under this are fingerprinted by their content


def _fingerprint(path: str | Path) -> list:
    """What identifies a model or data reference without reading gigabytes: each file's path in it, size and a
    content digest under 64 MB, else its modification and change times and inode (a model delivered from a server
    has every mtime 0, and an extraction cannot set the change time). A hub id is its cached snapshot's files."""
    path = Path(path)
    if not path.exists():
        path = _hub_snapshot(str(path)) or path
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    out: list = [str(path.resolve()) if path.exists() else str(path)]
    for f in files:
        stat = f.stat()
        name = f.relative_to(path).as_posix() if path.is_dir() else f.name
        out.append([name, stat.st_size, file_sha256(f) if stat.st_size < DIGESTED_BYTES else
                    [stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]])
    return out


def _hub_snapshot(reference: str) -> Path | None:
    """The local snapshot a cached hub id resolves to (its revision's files), or None."""
    if reference.count("/") != 1 or reference.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(reference, local_files_only=True))
    except Exception:  # not cached, or not a hub id: the reference's words are all there is
        return None


@functools.cache
def code_digest() -> str:
    """A digest of the code that computes the curves (the compressor and the jobs): an installed version number does
    not move with an edit or a pull, so curves cached by other code would be served as this code's."""
    roots = [Path(__file__).resolve().parent, Path(compressor.__file__).resolve().parent]
    digest = hashlib.sha256()
    for source in sorted(p for root in roots for p in root.rglob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def curves_cache_key(job: ModelJob, request: CompressRequest, version: str) -> str:
    """The cache key of the dense loss curves: every request field declared to change them
    (`statistics=True` in `request.py`; references by their content's fingerprint), the values the job
    derives from them, and the code's versions."""
    parts: dict[str, object] = {}
    for name in statistics_fields():
        value = getattr(request, name)
        parts[name] = _fingerprint(value) if name in REFERENCES and value is not None else value
    parts.update(text=asdict(request.text_calibration(job.causal)), round_to=request.round_to or ROUND_TO,
                 measured_shape=job.shape, version=version, layers=LAYERS_VERSION, code=code_digest(),
                 removed_blocks=getattr(job, "removed_blocks", []))
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def dense_curves(job: ModelJob, request: CompressRequest, say: Say, version: str) -> list[LayerCurve]:
    """Loss-versus-width curves of every layer from the dense model's statistics (one pass), cached by
    model, calibration and settings, so a sweep of targets costs one calibration pass."""
    cache_dir = request.curves_cache
    cache = cache_dir / f"{curves_cache_key(job, request, version)}.json" if cache_dir else None
    if cache is not None and cache.is_file():
        try:
            cached = [LayerCurve(**c) for c in json.loads(cache.read_text())]
        except (OSError, ValueError, TypeError) as err:  # cut short by a power loss, or another release's format
            say(warning(f"the cached curves {cache} do not read ({type(err).__name__}); computing them again"))
        else:
            say(f"dense statistics: cached curves {cache}")
            return cached
    say("dense statistics pass: loss-versus-width curve of every layer")
    curves: list[LayerCurve] = []
    convert = job.currency()

    job.prune(0.0, observe=lambda obs: curves.append(layer_curve(obs, request, convert, say)))
    curves = merged_units(curves)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(cache, json.dumps([asdict(c) for c in curves], indent=2))
    return curves


def layer_curve(obs: LayerObservation, request: CompressRequest, convert: Callable[..., float] | None,
                say: Say) -> LayerCurve:
    """One layer's loss at each width it may take (`loss_path`), relative to what its error adds to. A layer whose
    statistics no damping factorises (an H at rounding level: an EfficientNet squeeze-excite conv fed ~zero inputs)
    has no curve to plan with: the allocation keeps it whole, and says so (the job used to end in a traceback)."""
    name, groups = obs.unit or obs.name, obs.H.shape[0] // obs.group_size  # the plan's entry (a MoE layer's experts)
    # heads are already hardware-sized (head_dim rows): the multiple applies to channels and neurons (and to an LFM2
    # short convolution's channels, its attention sub-layer's units of one row each)
    multiple = 1 if obs.kind == "attention_heads" and obs.group_size > 1 else request.round_to or ROUND_TO
    multiple = math.lcm(multiple, obs.multiple)  # widths the layer can take at all (a MoE layer's experts)
    minimum = max(1, math.ceil(request.min_width * groups))
    allowed = allowed_widths(groups, multiple, minimum)
    try:
        losses = loss_path(obs.H, obs.G, obs.group_size, allowed)
    except (IllConditioned, PivotError) as err:
        say(warning(f"{obs.name}: no loss curve ({err}); the allocation keeps it whole"))
        return LayerCurve(name, obs.kind, [groups], [0.0], obs.cost)
    # a layer's loss counts relative to what its error adds to: the residual stream when there is one
    norm = obs.stream_energy if request.normalise != "layer" and obs.stream_energy else obs.energy
    norm = norm if norm > 0 else 1.0
    relative = [v / norm for v in losses]
    if convert is not None and obs.stream_energy:  # priced by the output change they predict
        relative = [convert(name, v, "input") for v in relative]
    return LayerCurve(name, obs.kind, allowed, relative, obs.cost)


def merged_units(curves: Sequence[LayerCurve]) -> list[LayerCurve]:
    """One curve per plan unit: curves of the same name (a MoE layer's experts, which keep one width) become one whose
    loss and cost at each width are their sums (their errors add in the stream they share), in first-seen order."""
    units: dict[str, list[LayerCurve]] = {}
    for curve in curves:
        units.setdefault(curve.name, []).append(curve)
    out = []
    for name, parts in units.items():
        first = parts[0]
        if len(parts) == 1:
            out.append(first)
            continue
        if any(p.widths != first.widths or p.kind != first.kind for p in parts):
            # a part without a loss curve (kept whole) makes the unit whole: its experts take one width
            out.append(LayerCurve(name, first.kind, [first.groups], [0.0], sum(p.cost for p in parts)))
            continue
        loss = [sum(values) for values in zip(*(p.loss for p in parts), strict=True)]
        out.append(LayerCurve(name, first.kind, list(first.widths), loss, sum(p.cost for p in parts)))
    return out


CURRENCIES = {"stream": "relative to the residual stream they join",
              "output": "the change of the model's output they predict: the error relative to the stream times the "
                        "stream's energy and the output's gradient energy there (compressor.transformer.sensitivity)"}


@dataclass(frozen=True)
class DepthPlan:
    """How many whole blocks a target-mode job removes, and the options it weighed (report.json `depth`)."""

    chosen: DepthOption
    options: list[DepthOption]
    aim: float  # the speedup the options were planned for
    share: float  # the latency model's share that turned the missing speedup into a width saving
    losses: dict[str, float] = field(default_factory=dict)  # every removable unit's removal loss (the why)
    currency: str = "stream"  # what the losses are: "stream" (relative to it) or "output" (the change they predict)
    modelled: bool = False  # the options' depth speedups modelled from their multiply-adds (`removed_cost`)
    # the share those depth speedups were modelled with (removed latency per removed multiply-add), corrected by the
    # depth probes; None when each option's speedup was measured
    depth_share: float | None = None

    def to_dict(self, tried: Sequence[DepthOption] = (), trials: Sequence[Trial] = ()) -> dict:
        """The plan as report.json's `depth`; `tried`: the options whose rounds ran, in order (re-plans);
        `trials`: the tied options' solves without the fit that ordered them."""
        how = (f"its speedup modelled from the multiply-adds it saves (the latency model's share, corrected by "
               f"probes of the best option once it removes {DEPTH_PROBE_MIN:.0%} of the latency or more)"
               if self.modelled else "its speedup measured")
        rule = ("each prefix of the greedy block order (the block whose removal changes the outputs least, one at "
                "a time; a transformer's layers and their attentions and FFNs alone, by that change per multiply-add "
                f"saved) removed and {how}, the widths planned for the rest of the aim from the "
                "dense loss curves; the option with the least loss (removal losses plus width losses, both "
                f"{CURRENCIES[self.currency]}) is taken")
        return {"rule": rule, "aim": self.aim, "share": self.share, "depth_share": self.depth_share,
                "planned": list(self.chosen.blocks),
                "options": [{"blocks": len(o.blocks), "last": o.blocks[-1] if o.blocks else None,
                             "depth_speedup": o.depth_speedup, "measured": o.measured, "depth_loss": o.depth_loss,
                             "width_saving": o.width_saving,
                             "width_loss": o.width_loss if math.isfinite(o.width_loss) else None,
                             "loss": o.loss if math.isfinite(o.loss) else None,
                             "chosen": o is self.chosen} for o in self.options],
                "tried": [len(o.blocks) for o in tried or [self.chosen]], "tie": TIE,
                "trials": [{"blocks": len(t.option.blocks), "measured_speedup": t.round.latency.speedup,
                            "metric": t.round.metric, "chosen": bool(tried) and t.option is tried[0]} for t in trials],
                "removal_losses": dict(self.losses)}

    def ranked(self) -> list[DepthOption]:
        """The options by planned loss, the chosen one first: the order re-planning tries them in."""
        finite = [o for o in self.options if math.isfinite(o.loss)]
        return sorted(finite, key=lambda o: (o is not self.chosen, o.loss)) or [self.chosen]

    def contenders(self) -> list[DepthOption]:
        """The options planned within TIE of the least loss (the chosen one first), at most TRIALS of them."""
        return [o for o in self.ranked() if o.loss <= (1 + TIE) * self.chosen.loss][:TRIALS]


@dataclass(frozen=True)
class Trial:
    """A tied depth option's widths solved without the fit, exported, timed and scored (never returned)."""

    option: DepthOption
    curves: list[LayerCurve]  # the layers left without the option's blocks
    round: Round  # its widths (probed into the window), measured speedup and metric


def in_blocks(layer: str, blocks: Sequence[str]) -> bool:
    """Whether a layer's curve (its unit's name) belongs to one of the removed blocks (module paths), or is a
    removed sub-layer itself (named by its output projection, the curve's own name)."""
    name = layer.removeprefix("coupled:")
    return any(name == block or name.startswith(f"{block}.") for block in blocks)


def kept_curves(job: Any, blocks: Sequence[str], curves: list[LayerCurve], graph: nn.Module | None = None
                ) -> list[LayerCurve]:
    """The curves of the layers left without `blocks`, each at its cost per group in the graph without them
    (`graph`, when the caller built it) where the kind says (`unit_costs`): the dense curves' costs would price the
    widths of the residual stream for the blocks it no longer runs through."""
    owner = getattr(job, "curve_owner", None)  # a unit that goes with another's removal (a shared expert)
    kept = [c for c in curves if not in_blocks(c.name, blocks) and not (owner and in_blocks(owner(c.name), blocks))]
    unit_costs = getattr(job, "unit_costs", None)
    if not blocks or unit_costs is None:
        return kept
    costs = unit_costs(blocks, graph)
    return [replace(c, cost=costs[c.name]) if c.name in costs else c for c in kept]


def plan_depth(job: DepthJob, curves: list[LayerCurve], request: CompressRequest, probe: ProbeGraph,
               say: Say) -> DepthPlan:
    """How many residual blocks to remove before the widths: one allocation over depth and width.

    Every option is a prefix of the greedy block order (of the lengths in DEPTH_SIZES): its speedup is
    measured (the dense graph without the blocks, exported and timed), or modelled where the kind's units cost
    latency in proportion to their multiply-adds (`_modelled_options`), the widths for the speedup still
    missing are allocated on the remaining layers' dense curves with the latency model's share,
    and the option's loss is the blocks' removal
    losses plus that allocation's loss: both in the currency in which `allocate` already trades one layer's
    width against another's (`ModelJob.currency`: errors relative to the residual stream, or the output change
    they predict). The least loss wins; removing none is an option like the others."""
    assert request.target_speedup is not None
    aim = AIM_AT * request.target_speedup
    losses = job.removal_losses()
    order = itertools.islice(job.depth_order(), int(MAX_DEPTH_SHARE * len(losses)))
    currency = "stream" if job.currency() is None else "output"

    def say_none(none: DepthOption) -> None:
        say(f"depth: {len(losses)} removable residual blocks or sub-layers; none removed: widths remove "
            f"{none.width_saving:.1%} of the prunable cost, planned loss {none.loss:.4f}")

    if job.removed_cost(()) is not None:
        options, best, depth_share = _modelled_options(job, [b for b, _ in order], curves, losses, aim, probe, say)
        say_none(options[0])
        for o in options[1:]:
            say(f"depth: {len(o.blocks)} units removed (last {o.blocks[-1]}): "
                f"{'measured' if o.measured else 'modelled'} {o.depth_speedup:.3f}x; widths then remove "
                f"{o.width_saving:.1%} of the remaining prunable cost; planned loss {o.depth_loss:.4f} depth + "
                f"{o.width_loss:.4f} width = {o.loss:.4f}")
        say(f"depth: removing {len(best.blocks)} units ({', '.join(best.blocks) or 'none'}): the least planned loss")
        return DepthPlan(best, options, aim, INITIAL_SHARE, dict(losses), currency, modelled=True,
                         depth_share=depth_share)
    none = depth_option((), 0.0, 1.0, curves, aim, INITIAL_SHARE)
    say_none(none)
    options = [none]
    best, worse = none, 0
    chosen: list[str] = []
    for block, _ in order:
        chosen.append(block)
        if len(chosen) not in DEPTH_SIZES:
            continue
        shallower = job.without(chosen)
        latency = probe(shallower)
        kept = kept_curves(job, chosen, curves, shallower)
        option = depth_option(chosen, sum(losses[b] for b in chosen), latency.speedup, kept, aim, INITIAL_SHARE)
        options.append(option)
        say(f"depth: {len(chosen)} blocks removed (last {block}): measured {latency.speedup:.3f}x; widths then "
            f"remove {option.width_saving:.1%} of the remaining prunable cost; planned loss {option.depth_loss:.4f} "
            f"depth + {option.width_loss:.4f} width = {option.loss:.4f}")
        best, worse, stop = _searched(option, best, worse)
        if stop:
            break
    say(f"depth: removing {len(best.blocks)} blocks ({', '.join(best.blocks) or 'none'}): the least planned loss")
    return DepthPlan(best, options, aim, INITIAL_SHARE, dict(losses), currency)


def _searched(option: DepthOption, best: DepthOption, worse: int) -> tuple[DepthOption, int, bool]:
    """The depth search after weighing `option`: (the best option so far, how many in a row planned no better,
    whether to stop: DEPTH_PATIENCE of those, or blocks alone reaching the aim). An option whose widths cannot reach
    the aim (infinite loss) is better than another such when it leaves less for the widths to save: while widths
    alone fall short, each deeper option comes closer, and two of them must not end the search."""
    def rank(o: DepthOption) -> tuple[bool, float]:
        return (math.isinf(o.loss), o.width_saving if math.isinf(o.loss) else o.loss)

    best, worse = (option, 0) if rank(option) < rank(best) else (best, worse + 1)
    return best, worse, option.width_saving == 0 or worse >= DEPTH_PATIENCE


def _modelled_speedup(share: float, saved: float) -> float:
    """The latency model's speedup of removing `saved` of the prunable cost, `share` of the latency per unit of it
    (the latency removed capped at 95 %)."""
    return 1 / (1 - min(share * saved, 0.95))


def _modelled_options(job: DepthJob, order: list[str], curves: list[LayerCurve], losses: dict[str, float],
                      aim: float, probe: ProbeGraph, say: Say) -> tuple[list[DepthOption], DepthOption, float]:
    """(options, the least loss's, the depth share they were modelled with) of a kind whose depth units cost
    latency in proportion to their multiply-adds: prefix n's speedup is 1 / (1 - share x removed_cost(prefix)),
    with share the latency model's (INITIAL_SHARE) corrected by what probes measured (removed latency over removed
    cost, summed over the probes: the larger removals weigh more, their timing noise being the smaller part). That
    share is the depth units' alone: a whole unit also takes its fixed costs (norms, launches, a KV cache) that
    narrowing leaves, so the widths for the rest keep the latency model's own share, as where depth is measured. The
    options are weighed as the measured search weighs them (prefixes of DEPTH_SIZES until DEPTH_PATIENCE in a row
    plan no better); the best is probed when it removes DEPTH_PROBE_MIN of the latency or more and was not
    probed yet, and the options are planned again with the corrected share (at most MAX_DEPTH_PROBES probes)."""
    measured: dict[int, float] = {}  # prefix length -> measured speedup
    share = INITIAL_SHARE
    costs = {n: job.removed_cost(order[:n]) for n in DEPTH_SIZES if n <= len(order)}  # prefix length -> its cost
    assert all(c is not None and 0 < c < 1 for c in costs.values()), costs

    def weigh() -> tuple[list[DepthOption], DepthOption]:
        options = [depth_option((), 0.0, 1.0, curves, aim, INITIAL_SHARE)]
        best, worse = options[0], 0
        for n, cost in costs.items():
            blocks = order[:n]
            speedup = measured.get(n, _modelled_speedup(share, cost))
            kept = kept_curves(job, blocks, curves)
            option = depth_option(blocks, sum(losses[b] for b in blocks), speedup, kept, aim, INITIAL_SHARE,
                                  n in measured)
            options.append(option)
            best, worse, stop = _searched(option, best, worse)
            if stop:
                break
        return options, best

    options, best = weigh()
    while len(measured) < MAX_DEPTH_PROBES:
        n = len(best.blocks)
        if n == 0 or n in measured or 1 - 1 / best.depth_speedup < DEPTH_PROBE_MIN:
            break
        measured[n] = probe(job.without(order[:n])).speedup
        say(f"depth: {n} units removed measured {measured[n]:.3f}x (modelled {best.depth_speedup:.3f}x from "
            f"{costs[n]:.1%} of the prunable multiply-adds)")
        removed = sum(1 - 1 / s for s in measured.values())
        share = min(MAX_SHARE, max(0.05, removed / sum(costs[m] for m in measured)))
        options, best = weigh()
    return options, best, share


def target_loop(request: CompressRequest, curves: list[LayerCurve], run_round: RunRound, metric: Metric,
                baseline_metric: float, say: Say,
                enter: Callable[[str, int], None] | None = None, probe: ProbeWidths | None = None,
                base_speedup: float = 1.0, first_round: int = 0, first: Widths | None = None,
                known: Sequence[tuple[float, float]] = (), label: str = "round", solved: Solved | None = None,
                retime: Retime | None = None, first_latency: Latency | None = None) -> list[Round]:
    """Allocate -> (probe) -> prune -> measure -> choose the next saving, until a round is within
    [MET, AIM] x target.

    Each round aims at AIM_AT x target; its saving (fraction of the prunable cost removed) comes from
    `next_saving`: the latency model's prunable share until two points are measured, then a curve
    through the measured points (latency depends on the widths alone, so every measurement is a point
    of one monotone curve of the saving; widths measured twice, the mean of both). With `probe`, up to
    `request.latency_probes` latency-only measurements of planned widths (cheap: no solve, no evaluation)
    search that curve before each round, so the round's solve runs at widths already measured within the
    window. `base_speedup`: what the graph measured before any width was narrowed (its removed blocks); the
    latency model describes the widths' part of the speedup, the measured speedup over it. `first_round`: the
    number of the loop's first round (a job that re-plans runs the loop again after rounds of its own). `first`:
    widths already measured inside the window (a depth trial's) for the first round, which then runs without
    probes (and from `solved`, its solves, when given: only the fit is left); `known`: (saving, measured
    speedup) of widths measured before, the latency model's first points. `retime`: times a round's export again
    (`_second_look`: a round and its probe that disagree on the window).
    `label` names the rounds in the lines said ("depth trial" for a trial's)."""
    full = total_cost(curves)
    rule = accuracy_rule(request, metric)
    target = request.target_speedup
    assert target is not None
    rounds: list[Round] = []
    # measured 1 - 1/speedup of rounds and probes, by modelled saving: one widths' latency measured twice (a
    # probe, then the round at its widths) is one point, their mean. As two points at one saving, a probe's
    # 2.07x and its round's 1.90x (ResNet-20 at 2x: timing noise) bracketed the aim at zero width, so the
    # curve asked for the same widths again and the loop stopped below the target
    measured: dict[float, list[float]] = {}
    share = INITIAL_SHARE  # corrected after each measurement

    def record(saved: float, measured_speedup: float) -> None:
        nonlocal share
        speedup = measured_speedup / base_speedup  # the widths' part
        if saved > 0 and speedup > 0:
            removed = measured.setdefault(saved, [])
            removed.append(1 - 1 / speedup)
            # the observed share of the latency that the removed cost accounted for: above 1 when narrower
            # layers also run more efficiently (measured up to ~1.7 on CPU convs)
            share = min(MAX_SHARE, max(0.05, statistics.fmean(removed) / saved))

    def planned(fill: bool = False) -> tuple[Widths, float]:
        aim = 1 - base_speedup / (AIM_AT * target)  # the latency fraction the widths must remove
        if aim <= 0:  # the removed blocks alone reach the aim: no layer is narrowed
            return allocate(curves, 0.0), 0.0
        points = [(s, statistics.fmean(ys)) for s, ys in measured.items()]
        plan = allocate(curves, next_saving(points, aim, share) * full, fill=fill)
        return plan, 1 - total_cost(curves, plan) / full

    for saved, speedup in known:
        record(saved, speedup)
    for index in range(first_round, first_round + request.max_rounds):
        probes: list[tuple[Widths, Probe]] = []
        if first is not None and index == first_round:
            plan, saved = first, 1 - total_cost(curves, first) / full
        else:
            plan, saved = planned()
            if probe is not None and request.latency_probes and saved > 0:  # dense widths: measured as the base
                plan, saved, probes = _search_widths(request, plan, saved, target, index, rounds, probe, planned,
                                                     record, say, enter, label)
        if any(r.plan == plan for r in rounds):
            say(f"{label} {index}: the measurements ask for widths already measured; stopping")
            break
        if enter:
            enter("allocate", index)
        say(f"{label} {index}: removing {saved:.1%} of the prunable cost (modelled prunable share {share:.2f})")
        if at_minimum_widths(curves, plan):
            say(warning(f"{label} {index}: every layer is at its minimum width (--min-width {request.min_width:g}, "
                        f"--round-to {request.round_to or ROUND_TO}); expect a large quality loss"))
        # the latency model's speedup for these widths (the aim, AIM_AT x target, was reported in its place)
        predicted = base_speedup * _modelled_speedup(share, saved)
        if first is not None and index == first_round and solved is not None:
            result = run_round(plan, index, predicted, solved)
        else:
            result = run_round(plan, index, predicted)
        result.probes = [p for _, p in probes]
        rounds.append(result)
        record(saved, result.latency.speedup)
        if first is not None and index == first_round and first_latency is not None:
            probes = [(first, Probe(saved, first_latency))]  # the trial's timing of the same widths
        if retime is not None and probes:
            _second_look(result, probes, saved, index, retime, record, say, label, target)
        speedup = result.latency.speedup
        blown = rule is not None and not rule.allows(baseline_metric, result.metric)
        if blown and request.back_off:
            target = max(1.0 + 1e-3, 1 + (min(speedup, target) - 1) * 0.7)  # ask for less
            say(f"{label} {index}: accuracy budget exceeded; backing off to {target:.3f}x")
            if AIM_AT * target <= base_speedup:  # the removed blocks alone are past it: no widths can back off
                say(f"{label} {index}: the removed blocks alone measure {base_speedup:.3f}x: the widths cannot back "
                    "off further")
                break
        elif _inside(speedup, target) or (target < request.target_speedup and speedup >= MET * target):
            break  # met; or, backed off, within the budget at least as fast as the lowered target asks
        if saved >= 1 - 1e-9 or (speedup < MET * target and saved >= max_saving(curves) - 1e-9):
            say("the minimum widths allow no more pruning")
            break
    return rounds


def _search_widths(request: CompressRequest, plan: Widths, saved: float, target: float, index: int,
                   rounds: list[Round], probe: ProbeWidths, planned: Callable[..., tuple[Widths, float]],
                   record: Callable[[float, float], None], say: Say,
                   enter: Callable[[str, int], None] | None, label: str = "round",
                   ) -> tuple[Widths, float, list[tuple[Widths, Probe]]]:
    """Probe planned widths until one measures within [1, AIM] x target (or the probes run out, or the
    curve asks for widths already measured); returns the widths for the round, their saving and the probes.
    A probe in [MET, 1) x target does not stop the search: the round measures its widths again, and ResNet-56's
    probe at 1.981x (2x) became a round at 1.943x, not met, and a second round's solve and fit (+10 minutes).
    When the greedy allocation of the saving asked for is widths already measured (its path jumps past the
    saving in one coarse step), the filled allocation (`allocate(..., fill=True)`) is probed instead: ResNet-56
    without 6 blocks at 2x measured 1.948x and 2.223x on the two sides of one such step, and the round took
    the 2.223x (83.4 % top-1) where a saving between them was left untried.

    The round takes the probed widths closest to the aim within the window, those in [SURE] x target first, then
    those at or above the target; when none is (a model
    whose widths move in coarse steps can have no allocation inside it), the least pruning measured to
    meet the target (a solve is too dear to spend on a guess); else the curve's latest proposal."""
    probes: list[tuple[Widths, Probe]] = []
    seen = [r.plan for r in rounds]

    def sure(p: Probe) -> bool:  # in the window with room for the round's own noise
        return SURE[0] * target <= p.latency.speedup <= SURE[1] * target

    for _ in range(request.latency_probes):
        if plan in seen:
            break
        if enter:
            enter("allocate", index)
        latency = probe(plan, index)
        probes.append((plan, Probe(saved, latency)))
        seen.append(plan)
        record(saved, latency.speedup)
        say(f"{label} {index}: latency probe {len(probes)}: removing {saved:.1%} of the prunable cost measures "
            f"{latency.speedup:.3f}x ({latency.baseline_ms:.1f} -> {latency.compressed_ms:.1f} ms)")
        if sure(probes[-1][1]):
            break
        plan, saved = planned()
        if plan in seen:
            plan, saved = planned(fill=True)

    def distance(p: Probe) -> float:
        return _from_aim(p.latency.speedup, target)

    inside = [(w, p) for w, p in probes if _inside(p.latency.speedup, target)]
    met = [(w, p) for w, p in probes if p.latency.speedup >= MET * target]
    if inside:
        above = [item for item in inside if item[1].latency.speedup >= SURE[0] * target]
        plan, chosen = min([item for item in inside if sure(item[1])] or above or inside,
                           key=lambda item: distance(item[1]))
    elif met:
        plan, chosen = min(met, key=lambda item: item[1].latency.speedup)
    else:
        return plan, saved, probes
    return plan, chosen.saving, probes


def _second_look(result: Round, probes: list[tuple[Widths, Probe]], saved: float, index: int, retime: Retime,
                 record: Callable[[float, float], None], say: Say, label: str, target: float) -> None:
    """A round measured outside [MET, AIM] x target (the loop's, lowered by a back-off) at widths one of its probes
    measured inside: its export timed
    once more (a probe's cost, not a round's), and the round's latency becomes the median of the three.

    One latency measured twice that disagrees on the window is a coin toss between a round met and a round
    more (a solve and a fit: ~300 s for all-MiniLM-L6-v2 at 2x, where a timing is ~10 s); the median of three
    timings is robust to one of them taken in a slow or fast spell of the host, and two of the three time the
    round's own export, so a probe that reads its sliced graph differently does not decide alone. Every timing
    is reported."""
    own = result.latency
    agreeing = [p.latency for plan, p in probes if plan == result.plan and _inside(p.latency.speedup, target)]
    if _inside(own.speedup, target) or not agreeing:
        return
    again = retime(result, index)
    record(saved, again.speedup)
    first = min(agreeing, key=lambda latency: _from_aim(latency.speedup, target))
    median = sorted([first, own, again], key=lambda latency: latency.speedup)[1]
    result.timings = [first.speedup, own.speedup, again.speedup]
    result.latency = median
    say(f"{label} {index}: measured {own.speedup:.3f}x where its probe measured {first.speedup:.3f}x; timed again: "
        f"{again.speedup:.3f}x, the median {median.speedup:.3f}x is the round's")


def next_saving(measured: list[tuple[float, float]], aim: float, share: float) -> float:
    """The saving to ask for to remove a latency fraction `aim`, given the rounds measured so far as
    (saving, removed latency fraction) and the current share.

    One measurement or none: the share model (a line through the origin). Two or more: a power law
    y = a s^b through the two rounds that bracket the aim (closest on each side), else through the two
    closest to it. It is exact for a line and for the concave and convex curves seen on CPUs, where a
    line through the origin converges one halving at a time; a bracket whose points disagree (noise
    measured the larger saving as the smaller speedup) is split half way."""
    points = [(s, y) for s, y in measured if 0 < s <= 1 and 0 < y < 1]
    if len(points) < 2:
        return min(1.0, aim / share)
    below = [m for m in points if m[1] < aim]
    above = [m for m in points if m[1] >= aim]
    if below and above:
        first, second = max(below, key=lambda m: m[1]), min(above, key=lambda m: m[1])
    else:
        first, second = sorted(points, key=lambda m: abs(math.log(m[1] / aim)))[:2]
    (s1, y1), (s2, y2) = first, second
    slope = math.log(y2 / y1) / math.log(s2 / s1) if s1 != s2 and y1 != y2 else 0.0
    if slope <= 0:  # inconsistent points
        return (s1 + s2) / 2 if below and above else min(1.0, aim / share)
    slope = min(4.0, max(0.25, slope))
    return min(1.0, s1 * (aim / y1) ** (1 / slope))


Stage = Callable[[str, int], None]  # (stage, round) as each stage begins


@dataclass(frozen=True)
class Measure:
    """What target mode asks of the job that runs it: a round (prune, export, time, score) and latency probes
    (export and time only) of planned widths or of a whole model."""

    run_round: RunRound
    probe: ProbeWidths
    probe_model: Callable[[nn.Module, int], Latency]  # (model, round) -> its latency against the dense one
    # (widths, trial, predicted) -> a depth trial: the widths solved without the fit, exported, timed and scored,
    # never one of the job's rounds (None: ties of planned losses stay broken by the planned loss)
    trial: RunRound | None = None
    retime: Retime | None = None  # a round's export timed again (None: each round timed once)


def run_target(request: CompressRequest, job: ModelJob, measure: Measure, rounds: list[Round],
               baseline_metric: float, say: Say, enter: Stage, version: str) -> None:
    """Target mode, start to end (`rounds`, the job's list, is filled by `measure.run_round`): the dense
    curves, then depth and width planned together where the model kind removes whole blocks (and
    --remove-blocks did not choose them), else the width loop alone."""
    assert request.target_speedup is not None
    enter("statistics", 0)
    curves = dense_curves(job, request, say, version)
    if getattr(job, "plans_depth", False) and request.remove_blocks is None:
        enter("allocate", 0)
        plan = plan_depth(job, curves, request, lambda module: measure.probe_model(module, 0), say)
        depth_and_width(request, job, plan, curves, rounds, baseline_metric, say, enter, measure, version)
    else:
        target_loop(request, curves, measure.run_round, job.metric, baseline_metric, say, enter, probe=measure.probe,
                    retime=measure.retime)


# depth options a job tries after the planned one when every round misses the budget, or stays within it short of
# the target: each costs a round's solves and fit (ResNet-56 at 2x on 2 CPU cores: ~17 minutes with 3,000 steps)
MAX_REPLANS = 1


def depth_and_width(request: CompressRequest, job: Any, plan: DepthPlan, curves: list[LayerCurve],
                    rounds: list[Round], baseline_metric: float, say: Say, enter: Stage, measure: Measure,
                    version: str) -> None:
    """Target mode over depth and width (without --remove-blocks): the width loop on the model without the
    plan's blocks or layers; when every round of it lands below the accuracy budget, the next option by
    planned loss (another mix of depth and width, not only another amount; at most MAX_REPLANS of them)
    gets the rounds left, so the planned losses' ranking is corrected by a measurement before the job
    gives up; when every round stays within the budget but short of the target (the widths at their minimum), the
    next option by planned loss that removes more (a faster depth speedup). Options planned within TIE of the least
    loss are first measured by trials (`_trials`), and the best trial's option runs first, from the trial's widths.
    Rounds are numbered across the options (`rounds` is the job's list, which `run_round` fills)."""
    rule = accuracy_rule(request, job.metric)
    trials = _trials(request, job, plan, curves, baseline_metric, say, enter, measure, version)
    by_option = {id(t.option): t for t in trials}
    order = plan.ranked()
    if trials:  # the best trial's option first
        order = [trials[0].option, *(o for o in order if o is not trials[0].option)]
    tried: list[DepthOption] = []
    pending, why = list(order), ""
    while pending and len(tried) <= MAX_REPLANS:
        option = pending.pop(0)
        left = request.max_rounds - len(rounds)
        if left <= 0:
            break
        if tried:
            say(f"depth: {why}; re-planning with {len(option.blocks)} blocks removed (planned loss {option.loss:.4f})")
        tried.append(option)
        # an option is reported tried once a round of it ran (a time budget can stop the job before its first)
        job.depth = plan.to_dict(tried if len(tried) == 1 else tried[:-1], trials)
        start = len(rounds)
        trial = by_option.get(id(option))
        first: Widths | None = None
        first_latency: Latency | None = None
        solved: Solved | None = None
        base = option.depth_speedup
        if trial is None:
            kept, known = _without(job, option, curves, request, say, version), []
            if not option.measured and option.blocks and 1 - 1 / base >= DEPTH_PROBE_MIN:
                # a re-planned option was only modelled: its 1.395x measured 1.291x, and the loop took the blocks
                # for the aim, planned dense widths and stopped short with rounds left (or, taking the widths' part
                # for nothing, pruned 20x too much); the widths' rounds build on what the shallower graph measures
                enter("allocate", len(rounds))
                base = measure.probe_model(job.without(option.blocks), len(rounds)).speedup
                say(f"depth: {len(option.blocks)} units removed measured {base:.3f}x (modelled "
                    f"{option.depth_speedup:.3f}x)")
        else:  # the trial's measurements seed the loop; inside the window its widths (and solves, where the kind
            job.remove(option.blocks)  # keeps them) are the first round's, fitted
            kept, widths = trial.curves, trial.round.plan
            known = [(p.saving, p.latency.speedup) for p in trial.round.probes]
            known.append((1 - total_cost(kept, widths) / total_cost(kept), trial.round.latency.speedup))
            if _in_window(trial, request):
                first, first_latency = widths, trial.round.latency
                solved = None if trial.round.module is None else (trial.round.module, trial.round.layers)
        try:
            target_loop(replace(request, max_rounds=left), kept, measure.run_round, job.metric, baseline_metric, say,
                        enter, probe=measure.probe, base_speedup=base, first_round=len(rounds),
                        first=first, known=known, solved=solved, retime=measure.retime, first_latency=first_latency)
        finally:
            if len(rounds) > start:
                job.depth = plan.to_dict(tried, trials)
        mine = rounds[start:]
        within = [r for r in mine if rule is None or rule.allows(baseline_metric, r.metric)]
        if not mine:  # stopped before a round of it (its time budget)
            return
        if not within:  # every round below the budget: the next option by planned loss (other blocks, or fewer)
            why = f"every round with {len(option.blocks)} blocks removed was below the accuracy budget"
            continue
        # met within the budget; or the budget held the widths back (a round past it, then backing off: the depth's
        # speedup is not what fell short, so a faster mix would not help)
        if len(within) < len(mine) or any(r.latency.speedup >= MET * request.target_speedup for r in within):
            return
        # every round within the budget but short of the target where the widths stopped (their minimum, or what the
        # rounds measured): the planned losses ranked first a mix the latency cannot reach; an option removing more
        # goes next
        pending = [o for o in pending if o.depth_speedup > option.depth_speedup]
        best = max(r.latency.speedup for r in mine)
        why = (f"the rounds with {len(option.blocks)} blocks removed reached {best:.3f}x, short of the "
               f"{request.target_speedup:g}x target")
        if not pending:
            say(f"depth: {why}; no other option removes more")


def _in_window(trial: Trial, request: CompressRequest) -> bool:
    """Whether a trial's widths measured within [1, AIM] x target, where a probe ends the search (a round measures
    them again): then the round runs at them without another probe."""
    assert request.target_speedup is not None
    return 1 <= trial.round.latency.speedup / request.target_speedup <= AIM


def _trials(request: CompressRequest, job: Any, plan: DepthPlan, curves: list[LayerCurve], baseline_metric: float,
            say: Say, enter: Stage, measure: Measure, version: str) -> list[Trial]:
    """The tied options' trials (`DepthPlan.contenders`, when more than one), the best first (those that measured
    the target before those that did not): each option's widths probed into the window as a round's would be,
    solved without the fit, exported, timed and scored. The plan sums each layer's loss on the dense stream and
    prices the widths' latency with one share for all options; a trial measures the composed loss at the speedup
    itself (ResNet-56 at 2x, solved without the fit: 3 blocks 77.48 % top-1 at 2.027x, 6 blocks 79.06 % at
    2.123x; fitted, 82.20 % and 84.76-85.64 %). A trial timed outside the window at widths its probe measured inside
    gets the rounds' second look, by a probe of its widths (its export is gone once scored)."""
    contenders = plan.contenders()
    if len(contenders) < 2 or measure.trial is None:
        return []
    say(f"depth: {', '.join(str(len(o.blocks)) for o in contenders)} blocks removed are planned within "
        f"{TIE:.0%} of each other ({', '.join(f'{o.loss:.4f}' for o in contenders)}): each is solved without the "
        "fit and scored")
    trials = []
    for number, option in enumerate(contenders, 1):
        kept = _without(job, option, curves, request, say, version)
        [measured] = target_loop(replace(request, max_rounds=1, back_off=False), kept, measure.trial, job.metric,
                                 baseline_metric, say, lambda stage, index: enter("allocate", 0),
                                 probe=measure.probe, base_speedup=option.depth_speedup, first_round=number,
                                 label="depth trial", retime=lambda done, index: measure.probe(done.plan, index))
        trials.append(Trial(option, kept, measured))
        say(f"depth trial {number}: {len(option.blocks)} blocks removed, measured {measured.latency.speedup:.3f}x, "
            f"{job.metric.name} {baseline_metric:.4f} -> {measured.metric:.4f} without the fit")
    assert request.target_speedup is not None
    met = MET * request.target_speedup  # a trial short of the target is not scored at the same speedup

    def rank(t: Trial) -> tuple[bool, bool, float]:
        # a score that is not a number (outputs gone to NaN) compares equal to every other: it ranks last
        broken = not math.isfinite(t.round.metric)
        score = 0.0 if broken else -t.round.metric if job.metric.higher_is_better else t.round.metric
        return broken, t.round.latency.speedup < met, score

    trials.sort(key=rank)  # stable: equal trials keep the plan's order
    say(f"depth: removing {len(trials[0].option.blocks)} blocks first: the best trial"
        + ("" if trials[0].round.latency.speedup >= met else " (none measured the target)"))
    return trials


def _without(job: Any, option: DepthOption, curves: list[LayerCurve], request: CompressRequest, say: Say,
             version: str) -> list[LayerCurve]:
    """The job without the option's blocks; returns the curves of the layers left. The dense curves of
    those layers serve (their statistics were taken on the dense stream, which the pruned model is solved
    and fitted against) at their costs in the shallower graph (`kept_curves`), unless a conv graph's analysis
    finds a unit without one: then the statistics pass runs again on the shallower graph."""
    job.remove(option.blocks)
    kept = kept_curves(job, option.blocks, curves, getattr(job, "graph", None))
    analysis = getattr(job, "analysis", None)
    if analysis is None:
        return kept
    units = {u.name for u in analysis.units}
    if units <= {c.name for c in kept}:
        return [c for c in kept if c.name in units]
    return dense_curves(job, request, say, version)


def widths_of(path: Path) -> dict[str, int]:
    """{layer: kept width} from a report.json's layers."""
    try:
        report = json.loads(Path(path).read_text())
        widths = {layer["name"]: int(layer["width_after"]) for layer in report["layers"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"--widths-from {path}: expected a report.json with layers[].name and width_after") from err
    if not widths:  # a failed job's report (parity_failed, evaluation_failed before any round) holds none
        raise InputError(f"--widths-from {path}: the report holds no widths (status {report.get('status')!r}); give "
                         "the report of a job that returned a model")
    return widths


def check_gqa_of(path: Path, gqa: str) -> None:
    """A report whose attention widths count another head unit than the request's (`--gqa`) is refused: its widths
    would be read as the other unit's (2 of 2 KV groups as 2 of 8 query heads), another structure without a word."""
    try:
        unit = json.loads(Path(path).read_text()).get("gqa")
    except (OSError, ValueError, AttributeError) as err:
        raise InputError(f"--widths-from {path}: not a readable report.json") from err
    if unit is not None and unit != gqa:
        counted = "whole KV groups" if unit == "kv-groups" else "single query heads"
        raise InputError(f"--widths-from {path}: its attention widths count {counted} (--gqa {unit}); give --gqa "
                         f"{unit} to build its structure")


def removed_of(path: Path) -> list[str]:
    """The whole blocks (conv graphs) or layers (transformers) a report.json's model went without: the
    depth half of its structure, which --widths-from reproduces with the widths."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"--widths-from {path}: not a readable report.json") from err
    removed = report.get("removed_blocks") or report.get("removed_layers") or []
    if not isinstance(removed, list) or not all(isinstance(name, str) for name in removed):
        raise InputError(f"--widths-from {path}: removed_blocks / removed_layers must be a list of names")
    return removed


def choose(request: CompressRequest, rounds: list[Round], metric: Metric, baseline: float) -> tuple[Round, str]:
    """The round to return and the job's status (ok, target_not_met, accuracy_budget_exceeded,
    slower_than_dense).

    Target mode: the accuracy rule in force (the request's budget, else the metric's DEFAULT_BUDGETS
    rule) is also the *sanity floor* of the returned artifact: a round below it is never returned while
    another round is within it, so a missed target returns the best round within the floor
    (target_not_met), not a faster broken one. Only when every round is below it does the job end
    accuracy_budget_exceeded with the best-quality round. With `--accuracy-budget none` there is no floor.
    Any mode: a measured speedup below MET (0.98, the noise margin) is never "ok" (slower_than_dense)."""
    chosen, status = _choose(request, rounds, metric, baseline)
    if status == "ok" and chosen.latency.speedup < MET:
        status = "slower_than_dense"
    return chosen, status


def _choose(request: CompressRequest, rounds: list[Round], metric: Metric, baseline: float) -> tuple[Round, str]:
    rule = accuracy_rule(request, metric)

    def within_budget(r: Round) -> bool:
        return rule is None or rule.allows(baseline, r.metric)

    def quality(r: Round) -> float:
        return r.metric if metric.higher_is_better else -r.metric

    if request.target_speedup is None:
        chosen = rounds[0]
        return chosen, "ok" if within_budget(chosen) else "accuracy_budget_exceeded"
    target = request.target_speedup
    eligible = [r for r in rounds if within_budget(r)]  # above the sanity floor
    if not eligible:
        return max(rounds, key=quality), "accuracy_budget_exceeded"
    met = [r for r in eligible if r.latency.speedup >= MET * target]
    if met and not request.back_off:
        return max(met, key=quality), "ok"
    best = max(eligible, key=lambda r: r.latency.speedup)  # back-off, or no eligible round met the target
    return best, "ok" if best.latency.speedup >= MET * target else "target_not_met"


def at_minimum_widths(curves: list[LayerCurve], plan: Widths) -> bool:
    """Whether an allocation put every layer that can narrow at its narrowest allowed width."""
    narrowable = [c for c in curves if len(c.widths) > 1]
    return bool(narrowable) and isinstance(plan, dict) and all(plan.get(c.name) == c.widths[-1] for c in narrowable)
