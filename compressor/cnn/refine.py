"""Reconstruction of a pruned conv graph: after every channel group is solved and refit one at a time,
Adam fits the remaining conv and Linear weights (and biases; BatchNorm's affine parameters with
`config.norms`, on in long fits) of the whole pruned graph so that it reproduces the dense graph's outputs on the
calibration images (distillation on the calibration set, no labels).

The layer-wise solves each see one group's consumers; the errors they leave compound through the
residual streams, which a fit of the whole graph to the dense outputs can still remove. A tenth of the
calibration images is held out: the fit keeps the weights of its lowest held-out error and is dropped
when that is no better than the solve's (`compressor.refine.Reconstruction`).

A few hundred calibration images are soon fitted by heart: a long fit then stops improving on the
held-out ones. Fitting on flipped and shifted views of the images instead, their targets the dense graph's
outputs on the views (`Views`, drawn with those outputs before the fit, each drawn about VIEW_USES times),
gives the fit many more inputs to match the dense graph on than images; the held-out images stay as they
are, so the judge is unchanged. On for long fits only (`graph_config`, from AUGMENT_FROM steps): it pays
off once the fit has fitted the images themselves (bench/RESULTS.md: ResNet-20 +1.2 to +2.2 points of top-1
with 1,000-1,500 steps, nothing at 300; ResNet-56 without 6 blocks at 3,000 steps on 5,085 images +1.6;
channels alone, 2,000 images and 1,500 steps -1.6).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor, fx, nn

from ..refine import Reconstruction, RefineConfig, held_out_draw
from ..reports import RefineReport
from .graph import BATCH_NORM_OPS, CONV_OPS, LINEAR_OPS

log = logging.getLogger(__name__)

# the default steps of a job (ResNet-20: ~15 s on 2 CPU cores, against ~40 s for the rest of the job;
# its held-out error stops improving by ~300 steps)
DEFAULT_STEPS = 300
# fits of at least this many steps run on flipped and shifted views of the images (`draw_views`)
AUGMENT_FROM = 1000
# steps between held-out checks: each check is a forward pass over the held-out tenth of the images, which
# every 10 steps took a quarter of a ResNet-56 fit's time (3,000 steps: 711 s -> 541 s every 25, held-out
# error 0.207 -> 0.194, top-1 82.8 -> 83.0 %; bench/RESULTS.md, 2026-11-29)
CHECK_EVERY = 25
# a long fit's first step (x each weight's RMS), annealed towards 0 over the fit (`RefineConfig.anneal`): twice a
# short fit's, since the half cosine takes half of it away on average and a long fit is still improving at its end
LONG_LR = 0.01
# a long fit returns the moving average of its weights over about this many steps (`RefineConfig.average`, decay
# 1 - 1 / AVERAGE_STEPS): ResNet-56 without 6 blocks, 3,000 steps from one solve, held-out error 0.182 -> 0.139-0.141
# and top-1 84.5 -> 87.5 % averaged over 200 or 500 steps; ResNet-20, 1,500 steps, 0.138 -> 0.121-0.122 over 100 or
# 250 (bench/RESULTS.md, session 23). A short fit (300 steps, constant step size) gained nothing from it: off there
AVERAGE_STEPS = 200
# a fit on views draws its views, and the dense outputs on them, before its steps: enough views for each to be
# drawn about this many times over the fit (1: a new view at every draw). Their dense outputs then cost a pass in
# batches of `batch_size` over a 1 / VIEW_USES share of the draws, where new views at every step cost a dense
# forward pass per step (a third of a ResNet-56 step)
VIEW_USES = 4
# the most values of dense outputs a fit on views holds (float32: 256 MiB): fewer views, each drawn more often, past it
VIEW_VALUES = 64 << 20


def graph_config(steps: int) -> RefineConfig:
    """The reconstruction settings of a conv graph. A whole graph is one fit of many steps, not one short fit
    per block, so its steps are larger and gentler than a transformer block's: 32 images per step (4 is
    mostly noise), a first step of 0.005 x RMS, halved (not quartered) after a worse held-out check, and
    a check within 5 % of the best is noise, not divergence. Measured on ResNet-20 at 1.64x (2,000
    calibration images, 300 steps; bench/RESULTS.md): top-1 72.8 -> 82.6 % with these, 79.9 % with the
    transformer blocks' settings (first step 0.02, quartered at any worse check: it stalls by step 200).
    A long fit (AUGMENT_FROM steps or more) fits views of the images, with a first step of LONG_LR annealed
    towards 0 over the fit, and BatchNorm's affine parameters too. ResNet-56 without 6 blocks, 3,000 steps from
    the same solve (top-1 on 1,017 test images; bench/RESULTS.md): 83.0 % without views, 84.6 % with them
    (held-out error 0.194 -> 0.188), 85.1 % (0.182) with them and the annealed 0.01, 85.3 % (0.166) with the
    norms as well; annealed from 0.005 it fell to 82.8 % (0.209), mixed pairs of views 82.8 % (0.206). A long fit
    also returns the moving average of its weights (AVERAGE_STEPS)."""
    long = steps >= AUGMENT_FROM
    return RefineConfig(steps=steps, sequences=32, lr=LONG_LR if long else 0.005, backoff=0.5, slack=0.05,
                        check_every=CHECK_EVERY, augment=long, anneal=long, norms=long,
                        average=1 - 1 / AVERAGE_STEPS if long else None)


def fitted_parameters(gm: fx.GraphModule, norms: bool = False) -> list[nn.Parameter]:
    """The parameters a reconstruction fits: the weight and bias of every conv and Linear node, and the
    affine parameters of every BatchNorm with `norms` (running statistics are buffers: never fitted)."""
    ops = CONV_OPS + LINEAR_OPS + (BATCH_NORM_OPS if norms else ())
    parameters = dict(gm.named_parameters())
    chosen: dict[str, nn.Parameter] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ops:
            for arg in node.args[1:3]:  # (input, weight, bias, ...) for all three
                if isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target in parameters:
                    chosen.setdefault(arg.target, parameters[arg.target])
    return list(chosen.values())


def graph_output(out: object) -> Tensor:
    """The graph's output tensor (the first one of a tuple or list)."""
    while isinstance(out, tuple | list):
        out = out[0]
    assert isinstance(out, Tensor), f"a conv graph's output must be a tensor (got {type(out).__name__})"
    return out


@dataclass(frozen=True)
class Views:
    """Flipped and shifted views of images, as what makes them (each a flip or not and a crop of the image padded
    by an eighth of its size each way), so that many of them cost no memory until a batch of them is made."""

    index: Tensor  # (V,) int64: each view's image
    flip: Tensor  # (V,) bool
    dy: Tensor  # (V,) int64: the crop's corner in the padded image
    dx: Tensor

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, which: Tensor | slice) -> Views:
        return Views(self.index[which], self.flip[which], self.dy[which], self.dx[which])


def draw_views(index: Tensor, size: tuple[int, int], generator: torch.Generator) -> Views:
    """A view of each image `index` names, of images of `size` (H, W): flipped left-right with probability 1/2
    and shifted by up to an eighth of its size each way."""
    (h, w), n = size, len(index)
    pad_h, pad_w = max(1, h // 8), max(1, w // 8)
    flip = torch.rand(n, generator=generator) < 0.5
    return Views(index, flip, torch.randint(0, 2 * pad_h + 1, (n,), generator=generator),
                 torch.randint(0, 2 * pad_w + 1, (n,), generator=generator))


def view_images(images: Tensor, views: Views) -> Tensor:
    """The views' images (V, C, H, W) of `images` (N, C, H, W), zero-padded where shifted (zero: the mean of
    normalised images), on `images`' device. Distillation needs no label to survive them: the dense graph's output
    on a view is its target."""
    h, w = images.shape[-2:]
    pad_h, pad_w = max(1, h // 8), max(1, w // 8)
    x = images[views.index.to(images.device)]
    flip = views.flip.to(x.device).view(-1, 1, 1, 1)
    padded = nn.functional.pad(torch.where(flip, x.flip(-1), x), (pad_w, pad_w, pad_h, pad_h))
    return torch.stack([padded[i, :, a:a + h, b:b + w]
                        for i, (a, b) in enumerate(zip(views.dy.tolist(), views.dx.tolist(), strict=True))])


def reconstruct_graph(pruned: fx.GraphModule, dense: fx.GraphModule, images: Tensor, config: RefineConfig,
                      device: torch.device, batch_size: int = 100, channels_last: bool = True,
                      view_uses: int = VIEW_USES, solved: int = 0) -> RefineReport:
    """Fit `pruned` in place to `dense`'s outputs on `images` (N, C, H, W), `config.sequences` images per
    step (with `config.augment` and 2-D images, flipped and shifted views of them, seeded, each drawn about
    `view_uses` times), `config.held_out` of them held out as they are (seeded); returns the held-out errors before
    and after, and the seconds of the fit with its pass of dense outputs. Both graphs run channels-last during the
    fit where they take it (`_to_layout`; `channels_last=False`: standard strides, a benchmark's baseline) and
    leave in standard strides. `solved`: the leading images the solves were computed from; the judge is drawn
    after them where there are enough (`held_out_draw`)."""
    assert view_uses >= 1, f"each view is drawn at least once (got view_uses={view_uses})"
    homes = [_device_of(gm) for gm in (pruned, dense)]
    layout = _to_layout(pruned, dense, images[:2], device, channels_last)
    try:
        return _reconstruct(pruned, dense, images, config, device, batch_size, layout, view_uses, solved)
    finally:  # the graphs leave as they came in, where they came from (a GPU fit's graph is exported on the host
        # with host images) and in standard strides (later solves, exports and saves expect them)
        for gm, home in zip((pruned, dense), homes, strict=True):
            gm.to(home, memory_format=torch.contiguous_format)


def _device_of(gm: nn.Module) -> torch.device:
    return next((t.device for t in itertools.chain(gm.parameters(), gm.buffers())), torch.device("cpu"))


def _to_layout(pruned: fx.GraphModule, dense: fx.GraphModule, sample: Tensor, device: torch.device,
               channels_last: bool) -> torch.memory_format:
    """Both graphs moved to `device` in the memory format their fit runs in, returned: channels-last for 2-D images
    where both graphs take it (oneDNN's and cuDNN's convolutions run it natively: a dense ResNet-56 forward of 32
    images on 2 CPU cores 218 -> 116 ms, bench/RESULTS.md session 26), else the standard one (a graph that `view`s
    a feature map as a flat vector refuses channels-last strides; its fit runs as before)."""
    graphs = (dense, pruned)
    if channels_last and sample.dim() == 4:
        last = torch.channels_last
        try:
            with torch.no_grad():
                for gm in graphs:
                    gm.to(device, memory_format=last)(sample.to(device, memory_format=last))
            return last
        except RuntimeError as err:
            log.info("the fit runs in the standard memory format: a graph refuses channels-last (%s)", err)
    for gm in graphs:
        gm.to(device, memory_format=torch.contiguous_format)
    return torch.contiguous_format


def _batch(images: Tensor, inputs: Tensor | Views, device: torch.device, layout: torch.memory_format) -> Tensor:
    """The images `inputs` names (indices into `images`, or views of them) on `device`, in `layout`."""
    x = images[inputs] if isinstance(inputs, Tensor) else view_images(images, inputs)
    return x.to(device).contiguous(memory_format=layout)  # stacked views come out standard


def _reconstruct(pruned: fx.GraphModule, dense: fx.GraphModule, images: Tensor, config: RefineConfig,
                 device: torch.device, batch_size: int, layout: torch.memory_format, view_uses: int,
                 solved: int = 0) -> RefineReport:
    judge, fit = held_out_draw(len(images), config.held_out, config.seed, unseen_from=solved)
    k = config.sequences
    views_wanted = config.augment and images.dim() == 4  # views are of 2-D images (N, C, H, W) only

    def dense_outputs(inputs: Tensor | Views) -> Tensor:
        if not len(inputs):  # a single calibration image: none held out
            return torch.empty(0)
        with torch.no_grad():
            return torch.cat([graph_output(dense(_batch(images, inputs[i:i + batch_size], device, layout))).cpu()
                              for i in range(0, len(inputs), batch_size)])

    # the dense outputs once, in batches of `batch_size`: on the held-out images, and on the fitted images or their
    # views; a fit with an allowance of seconds (fits on views or not) has spent them on that pass too
    start = time.perf_counter()
    judge_targets = dense_outputs(judge)
    # no steps, no time, or no held-out image to judge by: nothing is fitted, so nothing to compute targets for
    late = config.deadline is not None and time.perf_counter() >= config.deadline  # the budget's end has passed
    fitted: Tensor | Views = fit if config.steps and config.seconds != 0 and len(judge) and not late else fit[:0]
    if views_wanted and len(fitted):
        # each fitting image's views, enough for `view_uses` draws of each over the fit's steps, as many as
        # VIEW_VALUES of dense outputs hold (a graph whose output is a feature map, not a row of logits), and for a
        # paced fit as many as a 1 / (1 + 3 view_uses) share of its seconds computes at the held-out pass's rate (a
        # fitting step's forward and backward cost about three dense forwards an image)
        per_image = math.ceil(config.steps * k / (len(fit) * view_uses))
        most = VIEW_VALUES // judge_targets[0].numel()  # views
        if config.seconds is not None:
            per_view = (time.perf_counter() - start) / len(judge)
            most = min(most, int(config.seconds / (1 + 3 * view_uses) / max(per_view, 1e-9)))
        per_image = max(1, min(per_image, most // len(fit)))
        size = tuple(images.shape[-2:])
        fitted = draw_views(fit.repeat(per_image), size, torch.Generator().manual_seed(config.seed + 1))
        fitted = fitted[torch.randperm(len(fitted), generator=torch.Generator().manual_seed(config.seed + 2))]
    fit_targets = dense_outputs(fitted)
    if config.seconds is not None:
        config = dataclasses.replace(config, seconds=max(0.0, config.seconds - (time.perf_counter() - start)))
    train = [(fitted[i:i + k], fit_targets[i:i + k]) for i in range(0, len(fitted), k)]
    held_out = [(judge[i:i + batch_size], judge_targets[i:i + batch_size]) for i in range(0, len(judge), batch_size)]

    def loss(module: nn.Module, batch: tuple[Tensor | Views, Tensor]) -> tuple[Tensor, Tensor]:
        inputs, target = batch
        out = graph_output(module(_batch(images, inputs, device, layout)))
        target = target.to(device)
        return (out - target).square().sum(), target.square().sum()

    dense_pass = time.perf_counter() - start
    report = Reconstruction(pruned, fitted_parameters(pruned, config.norms), config).fit(train, held_out, loss)
    return dataclasses.replace(report, seconds=report.seconds + dense_pass)  # a paced fit's time includes the pass
