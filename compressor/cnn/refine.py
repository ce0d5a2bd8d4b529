"""Reconstruction of a pruned conv graph: after every channel group is solved and refit one at a time,
Adam fits the remaining conv and Linear weights (and biases; BatchNorm's affine parameters with
`config.norms`, on in long fits) of the whole pruned graph so that it reproduces the dense graph's outputs on the
calibration images (distillation on the calibration set, no labels).

The layer-wise solves each see one group's consumers; the errors they leave compound through the
residual streams, which a fit of the whole graph to the dense outputs can still remove. A tenth of the
calibration images is held out: the fit keeps the weights of its lowest held-out error and is dropped
when that is no better than the solve's (`compressor.refine.Reconstruction`).

A few hundred calibration images are soon fitted by heart: a long fit then stops improving on the
held-out ones. Fitting on flipped and shifted views of the images instead, each step's targets the
dense graph's outputs on that step's views (`flip_and_shift`), gives the fit new inputs to match the
dense graph on at every step; the held-out images stay as they are, so the judge is unchanged. On for
long fits only (`graph_config`, from AUGMENT_FROM steps): it pays off once the fit has fitted the images
themselves (bench/RESULTS.md: ResNet-20 +1.2 to +2.2 points of top-1 with 1,000-1,500 steps, nothing at
300; ResNet-56 without 6 blocks at 3,000 steps on 5,085 images +1.6; channels alone, 2,000 images and
1,500 steps -1.6).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, fx, nn

from ..refine import Reconstruction, RefineConfig, held_out_draw
from ..reports import RefineReport
from .graph import BATCH_NORM_OPS, CONV_OPS, LINEAR_OPS

log = logging.getLogger(__name__)

# the default steps of a job (ResNet-20: ~15 s on 2 CPU cores, against ~40 s for the rest of the job;
# its held-out error stops improving by ~300 steps)
DEFAULT_STEPS = 300
# fits of at least this many steps run on flipped and shifted views of the images (`flip_and_shift`)
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


def flip_and_shift(x: Tensor, generator: torch.Generator) -> Tensor:
    """Views of images (N, C, H, W): each flipped left-right with probability 1/2 and shifted by up to an
    eighth of its size each way (zero padding: the mean of normalised images). Distillation needs no
    label to survive them: the dense graph's output on the view is the target."""
    n, _, h, w = x.shape
    pad_h, pad_w = max(1, h // 8), max(1, w // 8)
    flip = (torch.rand(n, generator=generator) < 0.5).to(x.device).view(n, 1, 1, 1)
    padded = nn.functional.pad(torch.where(flip, x.flip(-1), x), (pad_w, pad_w, pad_h, pad_h))
    dy = torch.randint(0, 2 * pad_h + 1, (n,), generator=generator).tolist()
    dx = torch.randint(0, 2 * pad_w + 1, (n,), generator=generator).tolist()
    return torch.stack([padded[i, :, a:a + h, b:b + w] for i, (a, b) in enumerate(zip(dy, dx, strict=True))])


def reconstruct_graph(pruned: fx.GraphModule, dense: fx.GraphModule, images: Tensor, config: RefineConfig,
                      device: torch.device, batch_size: int = 100, channels_last: bool = True) -> RefineReport:
    """Fit `pruned` in place to `dense`'s outputs on `images` (N, C, H, W), `config.sequences` images per
    step (with `config.augment` and 2-D images, flipped and shifted views of them, seeded), `config.held_out` of them
    held out as they are (seeded); returns the held-out errors before and after. Both graphs run channels-last
    during the fit where they take it (`_to_layout`; `channels_last=False`: standard strides, a benchmark's
    baseline) and leave in standard strides."""
    layout = _to_layout(pruned, dense, images[:2], device, channels_last)
    try:
        return _reconstruct(pruned, dense, images, config, device, batch_size, layout)
    finally:  # the graphs leave as they came in: later solves, exports and saves expect standard strides
        pruned.to(memory_format=torch.contiguous_format)
        dense.to(memory_format=torch.contiguous_format)


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


def _reconstruct(pruned: fx.GraphModule, dense: fx.GraphModule, images: Tensor, config: RefineConfig,
                 device: torch.device, batch_size: int, layout: torch.memory_format) -> RefineReport:
    n = len(images)
    judge, fit = held_out_draw(n, config.held_out, config.seed)
    with torch.no_grad():
        targets = torch.cat([graph_output(dense(x.to(device, memory_format=layout))).cpu()
                             for x in images.split(batch_size)])
    k = config.sequences
    views_wanted = config.augment and images.dim() == 4  # views are of 2-D images (N, C, H, W) only
    # a fitting batch without targets: they are the dense outputs on that step's views
    train = [(images[fit[i:i + k]], None if views_wanted else targets[fit[i:i + k]]) for i in range(0, len(fit), k)]
    held_out = [(images[judge[i:i + batch_size]], targets[judge[i:i + batch_size]])
                for i in range(0, len(judge), batch_size)]
    views = torch.Generator().manual_seed(config.seed + 1)

    def loss(module: nn.Module, batch: tuple[Tensor, Tensor | None]) -> tuple[Tensor, Tensor]:
        x, target = batch
        x = x.to(device, memory_format=layout)
        if target is None:
            x = flip_and_shift(x, views).contiguous(memory_format=layout)  # stacked views come out standard
            with torch.no_grad():
                target = graph_output(dense(x))
        out = graph_output(module(x))
        target = target.to(device)
        return (out - target).square().sum(), target.square().sum()

    return Reconstruction(pruned, fitted_parameters(pruned, config.norms), config).fit(train, held_out, loss)
