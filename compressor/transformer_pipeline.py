"""Sequential head and FFN pruning of a HF transformer (first version).

Per block, in order: the attention output projection (groups = KV groups of heads, head_dim x group
rows each), then the FFN output projection (groups = neurons). H comes from the *pruned* model's
inputs to the projection and G from the *dense* model's, over non-padding tokens only; the solver
picks the groups, surgery removes them and installs the refit projection.

Not yet done here (issue 4): block-by-block activation offload (this version runs both models on
the whole calibration set for every projection), memory-mapped weights, ONNX export of pruned
transformers.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .adapters import adapter_for, dims, layers
from .layerstats import LayerStatistics, compute_device, kept_solution, num_to_prune
from .reports import LayerReport
from .solve import solve_layer
from .transformer_surgery import prune_ffn, prune_heads

log = logging.getLogger(__name__)


def _statistics(pruned: nn.Module, dense: nn.Module, lin_p: nn.Linear, lin_d: nn.Linear,
                batches: Sequence[dict[str, Tensor]], device: torch.device,
                scale: Tensor | None) -> tuple[LayerStatistics, Tensor]:
    """Statistics of one Linear from the inputs the pruned and dense models give it (padding tokens
    excluded), and W_hat (d1 x d2, float64) with columns scaled by `scale`."""
    store: dict[str, Tensor] = {}

    def hook(key: str):
        def fn(_module, inputs, _output):
            store[key] = inputs[0].detach()
        return fn

    W_hat = lin_d.weight.detach().T.to(device=device, dtype=torch.float64)
    if scale is not None:  # weight output column c by scale_c^2 (undone after the solve)
        W_hat = W_hat * scale.to(device=device, dtype=torch.float64)
    stats = LayerStatistics(W_hat)
    handles = [lin_p.register_forward_hook(hook("x")), lin_d.register_forward_hook(hook("x_hat"))]
    try:
        with torch.no_grad():
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                pruned(**batch)
                dense(**batch)
                mask = batch.get("attention_mask")
                keep = mask.reshape(-1).bool() if mask is not None else slice(None)
                stats.add(*(store[k].reshape(-1, store[k].shape[-1])[keep].double() for k in ("x", "x_hat")))
    finally:
        for h in handles:
            h.remove()
    return stats, W_hat


def prune_transformer(
    model: nn.Module,
    batches: Sequence[dict[str, Tensor]],
    ratio: float,
    *,
    method: str = "osscar",
    device: str | torch.device | None = None,
    bias_correction: bool = True,
    weight_by_norm: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[nn.Module, list[LayerReport]]:
    """Prune `ratio` of the head groups and FFN neurons of every block; returns (copy, reports)."""
    if not 0 <= ratio < 1:
        raise ValueError(f"uniform ratio must be in [0, 1) (got {ratio})")
    device = compute_device(device)
    dense = copy.deepcopy(model).eval().to(device)
    pruned = copy.deepcopy(model).eval().to(device)
    adapter, d = adapter_for(pruned), dims(pruned)
    reports = []
    for i, (layer_p, layer_d) in enumerate(zip(layers(pruned), layers(dense), strict=True)):
        for kind, path, norm in (("attention_heads", adapter.o, adapter.o_norm),
                                 ("ffn_neurons", adapter.down, adapter.down_norm)):
            start = time.perf_counter()
            linear = layer_p.get_submodule(path)
            center = bias_correction and method != "mp" and linear.bias is not None
            scale = None
            if weight_by_norm and norm is not None and method != "mp":
                scale = layer_d.get_submodule(norm).weight.detach().abs()
            stats, W_hat = _statistics(pruned, dense, linear, layer_d.get_submodule(path), batches, device, scale)
            H, G, energy, mu, nu = stats.finish(center)
            g = d.group * d.head_dim if kind == "attention_heads" else 1
            groups = H.shape[0] // g
            sol = solve_layer(H, G, g, num_to_prune(groups, ratio), method, dense_weight=W_hat)
            kept = kept_solution(sol, g, scale, mu, nu)
            new_weight = kept.weight.T.float()  # (out, kept)
            if center:  # the intercept: the refit output's mean matches the dense one
                linear.bias.data += kept.shift.to(linear.bias)
            if kind == "attention_heads":
                prune_heads(pruned, i, kept.keep, new_weight)
            else:
                prune_ffn(pruned, i, kept.keep, new_weight)
            report = LayerReport.measure(f"{adapter.layers}.{i}.{path}", kind, groups, len(kept.keep),
                                         sol.objective, energy, start)
            reports.append(report)
            if progress:
                progress(f"{report.name}: {groups} -> {len(kept.keep)} {kind}, relative error "
                         f"{report.relative_error:.4f}")
    return pruned, reports
