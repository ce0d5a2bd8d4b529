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
from .reports import LayerReport
from .solve import solve_layer
from .transformer_surgery import prune_ffn, prune_heads

log = logging.getLogger(__name__)


def _statistics(pruned: nn.Module, dense: nn.Module, path: str, batches: Sequence[dict[str, Tensor]],
                device: torch.device, center: bool, scale: Tensor | None,
                ) -> tuple[Tensor, Tensor, Tensor, float, Tensor, Tensor]:
    """H, G, W_hat (d1 x d2, float64), 1/2 ||X_hat W_hat||^2 and the means of X and X_hat W_hat for
    the Linear at `path`; centred (least squares with an intercept) when `center`."""
    store: dict[str, Tensor] = {}

    def hook(key: str):
        def fn(_module, inputs, _output):
            store[key] = inputs[0].detach()
        return fn

    lin_p, lin_d = pruned.get_submodule(path), dense.get_submodule(path)
    W_hat = lin_d.weight.detach().T.to(device=device, dtype=torch.float64)
    if scale is not None:  # weight output column c by scale_c^2 (undone after the solve)
        W_hat = W_hat * scale.to(device=device, dtype=torch.float64)
    d1 = W_hat.shape[0]
    H = torch.zeros(d1, d1, dtype=torch.float64, device=device)
    G = torch.zeros(d1, W_hat.shape[1], dtype=torch.float64, device=device)
    energy = 0.0
    sum_x = torch.zeros(d1, dtype=torch.float64, device=device)
    sum_y = torch.zeros(W_hat.shape[1], dtype=torch.float64, device=device)
    rows = 0
    handles = [lin_p.register_forward_hook(hook("x")), lin_d.register_forward_hook(hook("x_hat"))]
    try:
        with torch.no_grad():
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                pruned(**batch)
                dense(**batch)
                mask = batch.get("attention_mask")
                keep = mask.reshape(-1).bool() if mask is not None else slice(None)
                X = store["x"].reshape(-1, store["x"].shape[-1])[keep].double()
                Y = store["x_hat"].reshape(-1, store["x_hat"].shape[-1])[keep].double() @ W_hat
                H.addmm_(X.T, X)
                G.addmm_(X.T, Y)
                energy += 0.5 * float(Y.square().sum())
                sum_x += X.sum(0)
                sum_y += Y.sum(0)
                rows += X.shape[0]
    finally:
        for h in handles:
            h.remove()
    mu, nu = sum_x / rows, sum_y / rows
    if center:  # a refit with intercept = a refit on centred data; the intercept goes into the bias
        H -= rows * torch.outer(mu, mu)
        H.diagonal().clamp_(min=0)
        G -= rows * torch.outer(mu, nu)
        energy -= 0.5 * rows * float(nu.square().sum())
    return H, G, W_hat, energy, mu, nu


def _keep_fraction(groups: int, ratio: float) -> int:
    return max(0, min(groups - 1, round(ratio * groups)))


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
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dense = copy.deepcopy(model).eval().to(device)
    pruned = copy.deepcopy(model).eval().to(device)
    adapter, d = adapter_for(pruned), dims(pruned)
    base = adapter.layers
    prefix = "" if hasattr(pruned, base.split(".")[0]) else next(
        name for name, child in pruned.named_children() if hasattr(child, base.split(".")[0])) + "."
    reports = []
    for i in range(len(layers(pruned))):
        for kind, path, norm in (("attention_heads", adapter.o, adapter.o_norm),
                                 ("ffn_neurons", adapter.down, adapter.down_norm)):
            start = time.perf_counter()
            full = f"{prefix}{base}.{i}.{path}"
            linear = pruned.get_submodule(full)
            center = bias_correction and method != "mp" and linear.bias is not None
            scale = None
            if weight_by_norm and norm is not None and method != "mp":
                scale = dense.get_submodule(f"{prefix}{base}.{i}.{norm}").weight.detach().abs()
            H, G, W_hat, energy, mu, nu = _statistics(pruned, dense, full, batches, device, center, scale)
            g = d.group * d.head_dim if kind == "attention_heads" else 1
            groups = H.shape[0] // g
            sol = solve_layer(H, G, g, _keep_fraction(groups, ratio), method, dense_weight=W_hat)
            keep = [j for j in range(groups) if j not in set(sol.pruned)]
            rows = torch.tensor([j * g + a for j in keep for a in range(g)], device=sol.weight.device)
            W = sol.weight.index_select(0, rows)  # (kept, out), in the scaled space
            shift = nu - mu @ sol.weight.to(mu.device)
            if scale is not None:
                W, shift = W / scale.to(W), shift / scale.to(shift)
            new_weight = W.T.float()  # (out, kept)
            if center:  # the intercept: the refit output's mean matches the dense one
                linear.bias.data += shift.to(linear.bias)
            if kind == "attention_heads":
                prune_heads(pruned, i, keep, new_weight)
            else:
                prune_ffn(pruned, i, keep, new_weight)
            report = LayerReport.measure(f"{base}.{i}.{path}", kind, groups, len(keep), sol.objective, energy,
                                         start)
            reports.append(report)
            if progress:
                progress(f"{report.name}: {groups} -> {len(keep)} {kind}, relative error "
                         f"{report.relative_error:.4f}")
    return pruned, reports
