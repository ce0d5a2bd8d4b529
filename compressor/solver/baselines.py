"""Baseline supports: magnitude (MP / MP+), ThiNet's greedy output-error removal, exact enumeration, and
the retraining-free structured scores of the LLM pruning literature (Wanda-sp, FLAP's fluctuation, and
FLAP's allocation of widths across layers)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .problem import LayerProblem, damp, factorize, group_rows

# Enumeration refuses problems beyond this many groups (C(20, 10) = 184,756 supports).
EXACT_MAX_GROUPS = 20


def magnitude_support(problem: LayerProblem) -> Tensor:
    """MP: the num_prune groups of W_hat with the smallest Frobenius norm."""
    return problem.magnitude_order()[: problem.num_prune]


def _by_score(problem: LayerProblem, per_row: Tensor) -> Tensor:
    """The num_prune groups with the smallest summed row scores."""
    scores = per_row.view(problem.num_groups, problem.group_size).sum(1)
    return torch.argsort(scores, stable=True)[: problem.num_prune]


def wanda_sp_support(problem: LayerProblem) -> Tensor:
    """Wanda-sp (the structured Wanda of An et al. 2024, "Fluctuation-based adaptive structured pruning",
    sec. 5): input row j scores ||X_j|| * sum_i |W_ji| (H = X^T X: ||X_j|| = sqrt(H_jj)); a group, the sum
    of its rows'. Retraining-free: the kept weights stay as they are."""
    if problem.dense_weight is None:
        raise ValueError("wanda-sp needs dense_weight (the layer's dense weight W_hat)")
    norms = problem.H.diagonal().clamp_min(0).sqrt()
    return _by_score(problem, norms * problem.dense_weight.abs().sum(1))


def flap_support(problem: LayerProblem) -> Tensor:
    """FLAP's fluctuation metric (An et al. 2024, eq. 5): input row j scores the sample variance of X_j
    times ||W_j||^2, the output change its removal leaves once its mean is compensated in the bias. H's
    diagonal is N Var(X_j) when the statistics are centred (layers with a bias, where the pipeline also
    folds the removed rows' mean into it: FLAP's bias compensation), else the second moment. A group of rows (a
    head) scores the sum of their scores squared, as FLAP's code ranks heads (`flap_allocation`: squared,
    standardized, averaged; within a layer the same order); one row's order is its score's."""
    if problem.dense_weight is None:
        raise ValueError("flap needs dense_weight (the layer's dense weight W_hat)")
    return _by_score(problem, (problem.H.diagonal().clamp_min(0) * problem.dense_weight.square().sum(1)).square())


def thinet_support(problem: LayerProblem) -> Tensor:
    """ThiNet (Luo et al. 2017): greedily zero the group whose removal raises the error least.

    The error is the layer objective of the *un-refit* weight (W_hat with the chosen rows zeroed;
    W* = H^-1 G when no dense weight is given), updated in O(d1 g d2) per step through the residual
    R = H W - G; the refit happens afterwards, as in ThiNet's second stage.
    """
    pb, g = problem, problem.group_size
    if pb.dense_weight is not None:
        W = pb.dense_weight.clone()
    else:
        W = pb.refit(torch.empty(0, dtype=torch.long, device=pb.device))
    p = pb.num_groups
    R = pb.H @ W - pb.G  # gradient of the objective at W
    Hb = pb.H.view(p, g, p, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (p, g, g) H_jj
    alive = torch.ones(p, dtype=torch.bool, device=pb.device)
    order = []
    for _ in range(pb.num_prune):
        Wg, Rg = W.view(p, g, -1), R.view(p, g, -1)
        # f(W - E_j) - f(W) = 1/2 Tr(W_j^T H_jj W_j) - Tr(W_j^T R_j)
        quad = 0.5 * (Wg * (Hb @ Wg)).sum((1, 2))
        delta = torch.where(alive, quad - (Wg * Rg).sum((1, 2)), torch.inf)
        j = int(torch.argmin(delta))
        rows = slice(j * g, (j + 1) * g)
        R -= pb.H[:, rows] @ W[rows]
        W[rows] = 0
        alive[j] = False
        order.append(j)
    return torch.tensor(order, dtype=torch.long, device=pb.device)


def exact_support(problem: LayerProblem, chunk: int = 4096) -> Tensor:
    """The optimal support by enumerating all C(p, num_prune) of them (batched small solves)."""
    pb, g, p = problem, problem.group_size, problem.num_groups
    if p > EXACT_MAX_GROUPS:
        raise ValueError(f"method 'exact' enumerates supports and refuses more than "
                         f"{EXACT_MAX_GROUPS} groups (got {p})")
    n_keep = p - pb.num_prune
    if n_keep == 0 or pb.num_prune == 0:
        return torch.arange(pb.num_prune, device=pb.device)
    # f(S) = -1/2 Tr(G_K^T H_KK^-1 G_K); damp once so every principal block factorises alike.
    _, lam = factorize(pb.H, pb.mean_diag, singular=pb.singular(pb.d1))
    H = damp(pb.H, lam, pb.mean_diag)
    best_f, best = math.inf, None
    combos = itertools.combinations(range(p), n_keep)
    while batch := list(itertools.islice(combos, chunk)):
        kept = torch.tensor(batch, device=pb.device)  # (b, n_keep)
        rows = group_rows(kept, g).view(len(batch), -1)  # (b, m)
        H_KK = H[rows.unsqueeze(2), rows.unsqueeze(1)]  # (b, m, m)
        G_K = pb.G[rows]  # (b, m, d2)
        chol, info = torch.linalg.cholesky_ex(H_KK)
        y = torch.linalg.solve_triangular(chol, G_K, upper=False)
        f = -0.5 * y.square().sum((1, 2))
        f = torch.where(info == 0, f, torch.inf)
        k = int(torch.argmin(f))
        if float(f[k]) < best_f:
            best_f, best = float(f[k]), kept[k]
    pruned = torch.ones(p, dtype=torch.bool, device=pb.device)
    pruned[best] = False
    return torch.nonzero(pruned).squeeze(1)


def flap_allocation(attention: Sequence[Tensor], ffn: Sequence[Tensor], head_dim: int, head_weight: float,
                    keep: float) -> tuple[list[int], list[int]]:
    """FLAP's adaptive structure search across layers and modules (An et al. 2024, sec. 4.2, "AL-AM"): the
    kept heads and FFN neurons of every layer, by one global threshold on standardized fluctuation scores.

    `attention[l]`: layer l's attention output projection inputs scored (heads x head_dim, FLAP's WIFV: the
    input's variance x its weight column's squared norm); `ffn[l]`: its FFN neurons scored likewise. As FLAP
    does, the attention scores are squared, each layer's scores of a module are standardized (mean 0, std 1
    over that layer's channels), a head scores its channels' mean, and the units are kept best first until
    their weight (a head weighs `head_weight` neurons: its parameters over a neuron's) reaches `keep` of the
    total. A layer may keep no head (its attention goes) or no neuron."""
    assert len(attention) == len(ffn) and attention, (len(attention), len(ffn))
    assert 0 < keep <= 1 and head_weight > 0, (keep, head_weight)

    def standardized(x: Tensor) -> Tensor:
        x = x.double()
        return (x - x.mean()) / x.std().clamp_min(1e-30)

    heads = [standardized(a.square()).view(-1, head_dim).mean(1) for a in attention]  # (heads,) per layer
    neurons = [standardized(f) for f in ffn]
    scores = torch.cat([*heads, *neurons])
    weights = torch.cat([torch.full((sum(h.numel() for h in heads),), float(head_weight), dtype=torch.float64),
                         torch.ones(sum(n.numel() for n in neurons), dtype=torch.float64)])
    order = torch.argsort(scores, descending=True, stable=True)
    kept_weight = torch.cumsum(weights[order], 0)
    # FLAP's threshold: the score where the kept weight comes closest to `keep` of the total
    last = int(torch.argmin((kept_weight - keep * float(weights.sum())).abs()))
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen[order[: last + 1]] = True
    counts, start = [], 0
    for unit in (*heads, *neurons):
        counts.append(int(chosen[start:start + unit.numel()].sum()))
        start += unit.numel()
    return counts[:len(heads)], counts[len(heads):]
