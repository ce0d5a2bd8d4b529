"""Mixture-of-Experts FFNs: every expert's neurons pruned, one width for all the experts of a layer.

transformers 5.x keeps a layer's experts as two 3-D parameters (Mixtral, Qwen3-MoE):
`gate_up_proj` (experts, 2 x width, hidden), each expert's rows laid out [gate | up], and `down_proj`
(experts, hidden, width); gpt-oss stores them transposed, gate and up columns interleaved, with biases and a clamped
SwiGLU (`INTERLEAVED_EXPERTS`). Its router (`mlp.gate`; Phi-3.5-MoE's and gpt-oss's `mlp.router`) gives each token its
top-k experts and their weights (Phi-3.5-MoE's: two, by the sparse mixer, `sparse_mixer`; GLM-4.5's and DeepSeek-V3's:
by sigmoid scores within the best groups of experts, DeepSeek-V2's by softmax scores within them, `routes_itself`).
Expert e adds w_e(t) * down_e(act(gate_e x_t) * up_e x_t) to the stream of the tokens t routed to it, so
its down projection's reconstruction problem reads the routing-weighted activations w_e(t) * a_e(t)
(`expert_inputs`). Each expert keeps neurons of its own, the same number in every expert of a layer: the
3-D layout and ONNX Runtime's MoE operator (one node per layer: `moe_op`, `experts_as_operator`) take one width.
Qwen2-MoE's shared expert (every token, scaled by its own sigmoid gate; GLM-4.5's `shared_experts`, ungated) is a dense
FFN beside them, whose neurons the pipeline prunes as a unit of their own (`FamilyAdapter.shared_down`). Where a
router's k-th and (k+1)-th experts are a near tie, rounding may route a token otherwise in ONNX Runtime than in
PyTorch: the parity check knows those tokens (`routing_settled`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..modules import check_keep

# kept expert widths are multiples of this many neurons: transformers' default experts kernel (grouped_mm) wants
# 16-byte strides, 8 half-precision values, and refuses a model loaded from a pruned checkpoint otherwise
ALIGN = 8

# the MoE operator's name in the torch.library namespace of this package (what the ONNX export translates)
OP_NAMESPACE, OP_NAME = "osscar", "moe_experts"


def is_experts(module: nn.Module) -> bool:
    """A layer's experts as transformers 5.x stores them: 3-D `gate_up_proj` and `down_proj` parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.dim() == 3 and down.dim() == 3


# experts stored transposed with interleaved gate / up columns, by class name (along the MRO: `float32_view`
# parametrizes them into a subclass): gpt-oss's `gate_up_proj` (experts, hidden, 2 x width) as [g0, u0, g1, u1, ...]
# with a bias of each, `down_proj` (experts, width, hidden) with a bias, and a clamped SwiGLU (gate * sigmoid(alpha
# gate) * (up + 1), the gate at most `limit`, up within +-limit)
INTERLEAVED_EXPERTS = ("GptOssExperts",)


def interleaved(experts: nn.Module) -> bool:
    """Whether `experts` are laid out as gpt-oss's (`INTERLEAVED_EXPERTS`)."""
    return any(cls.__name__ in INTERLEAVED_EXPERTS for cls in type(experts).__mro__)


def expert_width(experts: nn.Module) -> int:
    """Neurons of each expert (the layer's one width)."""
    return int(experts.down_proj.shape[1 if interleaved(experts) else -1])


def expert_hidden(experts: nn.Module) -> int:
    """The stream's width, which each expert reads and writes."""
    return int(experts.down_proj.shape[-1 if interleaved(experts) else 1])


def down_weight(experts: nn.Module, e: int) -> Tensor:
    """Expert e's down projection as the solver's W_hat: (width, hidden), in x out."""
    return experts.down_proj[e] if interleaved(experts) else experts.down_proj[e].T


def swiglu(experts: nn.Module) -> tuple[float, float, float]:
    """(alpha, beta, limit) of the experts' SwiGLU gate * sigmoid(alpha gate) * (up + beta), the gate at most `limit`
    and up within +-limit when limit > 0: SiLU-gated experts are (1, 0, 0)."""
    if interleaved(experts):
        return float(experts.alpha), 1.0, float(experts.limit)
    return 1.0, 0.0, 0.0


def _activation(gate: Tensor, up: Tensor, alpha: float, beta: float, limit: float) -> Tensor:
    """The SwiGLU (`swiglu`) of gate and up pre-activations (n, width) each: (n, width)."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def aligned_width(width: int, kept: int) -> int:
    """A planned expert width `kept` rounded up to a multiple of ALIGN, at most the dense `width`."""
    if not 1 <= kept <= width:
        raise ValueError(f"an expert width of {kept} is outside [1, {width}]")
    return min(width, -(-kept // ALIGN) * ALIGN)


def expert_inputs(experts: nn.Module, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                  rows: Tensor | None = None, chosen: Sequence[int] | None = None) -> list[Tensor]:
    """What each expert's down projection reads, weighted by the routing: w_e(t) * act(gate_e x_t) * up_e x_t,
    (tokens routed to e, width) per expert (of `chosen`, or all), over the tokens `rows` of x (tokens, hidden) when
    given. The weight multiplies the row because the expert's output is scaled by it: the least squares on these
    rows is the error the expert adds to the stream."""
    width = expert_width(experts)
    if rows is not None:  # the uncounted tokens routed nowhere, once for every expert
        top_k_index = top_k_index.masked_fill(~torch.isin(torch.arange(x.shape[0], device=x.device), rows)[:, None], -1)
    out, stored_transposed, act = [], interleaved(experts), swiglu(experts)
    for e in range(experts.gate_up_proj.shape[0]) if chosen is None else chosen:
        tokens, slots = torch.where(top_k_index == e)  # (token, top-k slot) pairs
        if stored_transposed:  # (n, 2 x width) as [g0, u0, g1, u1, ...]: the weights as stored, no copy of them
            h = x[tokens] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
            a = _activation(h[:, ::2], h[:, 1::2], *act)
        else:  # [gate | up] rows, the module's own activation (SiLU)
            h = x[tokens] @ experts.gate_up_proj[e].T  # (n, 2 x width)
            a = experts.act_fn(h[:, :width]) * h[:, width:]  # (n, width)
        out.append(a * top_k_weights[tokens, slots, None].to(a.dtype))
    return out


def keep_expert_neurons(experts: nn.Module, keeps: Sequence[Sequence[int] | Tensor],
                        down_weights: Sequence[Tensor | None] | None = None) -> None:
    """Keep neurons `keeps[e]` of each expert e, as many in each (down_weights[e]: its refit down projection,
    hidden x kept, or None for the kept columns as they are)."""
    count, width = experts.gate_up_proj.shape[0], expert_width(experts)
    if len(keeps) != count:
        raise ValueError(f"{len(keeps)} expert supports for {count} experts")
    keeps = [check_keep(k, width, f"expert {e}'s neurons") for e, k in enumerate(keeps)]
    sizes = sorted({k.numel() for k in keeps})
    if len(sizes) != 1:
        raise ValueError(f"the experts of a layer keep one width; got widths {sizes}")
    if sizes[0] != width and sizes[0] % ALIGN:
        raise ValueError(f"experts keep a multiple of {ALIGN} neurons (transformers' grouped_mm kernel wants 16-byte "
                         f"strides); got {sizes[0]} of {width}")
    down_weights = down_weights or [None] * count
    if interleaved(experts):
        _keep_interleaved(experts, keeps, down_weights, sizes[0])
        return
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    new_gate_up, new_down = [], []
    for e, keep in enumerate(keeps):
        keep = keep.to(gate_up.device)
        new_gate_up.append(gate_up[e].index_select(0, torch.cat([keep, width + keep])))  # [gate | up] rows
        new_down.append(_kept_down(down[e], keep, down_weights[e], e, transposed=False))
    experts.gate_up_proj = nn.Parameter(torch.stack(new_gate_up).contiguous(), requires_grad=False)
    experts.down_proj = nn.Parameter(torch.stack(new_down).contiguous(), requires_grad=False)
    if hasattr(experts, "intermediate_dim"):  # what the module says of itself, kept true (its forward reads shapes)
        experts.intermediate_dim = sizes[0]


# routers' module names beside the experts: `gate` (Mixtral, Qwen2/3-MoE), `router` (Phi-3.5-MoE)
ROUTER_NAMES = ("gate", "router")


def router_of(block: nn.Module) -> nn.Module | None:
    """A sparse MoE block's router (a module with top_k beside its experts), or None."""
    return next((r for name in ROUTER_NAMES if hasattr(r := getattr(block, name, None), "top_k")), None)


def is_router(module: nn.Module) -> bool:
    """A MoE router: its weight gives each token's experts (what block fits leave alone)."""
    return hasattr(module, "top_k") and isinstance(getattr(module, "weight", None), Tensor)


def _kept_down(down: Tensor, keep: Tensor, weight: Tensor | None, e: int, transposed: bool) -> Tensor:
    """Expert e's down projection on its kept neurons, as stored (hidden x width; `transposed`: width x hidden):
    its kept columns (rows), or `weight`, the refit one, hidden x kept whatever the storage."""
    if weight is None:
        return down.index_select(0 if transposed else 1, keep)
    expected = (down.shape[1 if transposed else 0], keep.numel())
    if tuple(weight.shape) != expected:
        raise ValueError(f"expert {e}'s new down weight has shape {tuple(weight.shape)}, expected {expected}")
    return (weight.T if transposed else weight).to(down)


def _keep_interleaved(experts: nn.Module, keeps: Sequence[Tensor], down_weights: Sequence[Tensor | None],
                      kept: int) -> None:
    """`keep_expert_neurons` of gpt-oss's layout (`INTERLEAVED_EXPERTS`): neuron n is columns 2n and 2n + 1 of the
    input projection and its bias, row n of the down projection (down_weights[e]: hidden x kept, as for the others)."""
    gate_up, bias, down = experts.gate_up_proj.data, experts.gate_up_proj_bias.data, experts.down_proj.data
    new_gate_up, new_bias, new_down = [], [], []
    for e, keep in enumerate(keeps):
        keep = keep.to(gate_up.device)
        columns = torch.stack([2 * keep, 2 * keep + 1], -1).reshape(-1)  # [g, u] of each kept neuron, in turn
        new_gate_up.append(gate_up[e].index_select(1, columns))
        new_bias.append(bias[e].index_select(0, columns))
        new_down.append(_kept_down(down[e], keep, down_weights[e], e, transposed=True))
    experts.gate_up_proj = nn.Parameter(torch.stack(new_gate_up).contiguous(), requires_grad=False)
    experts.gate_up_proj_bias = nn.Parameter(torch.stack(new_bias).contiguous(), requires_grad=False)
    experts.down_proj = nn.Parameter(torch.stack(new_down).contiguous(), requires_grad=False)
    if hasattr(experts, "intermediate_size"):  # what the module says of itself, kept true
        experts.intermediate_size = kept


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of a model: modules holding a router (`router_of`) beside `experts`."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)
            and is_experts(m.experts) and router_of(m) is not None]


def _normalised(router: nn.Module) -> bool:
    """Whether the router rescales its top-k weights to sum to one (Mixtral always; Qwen3-MoE by its config)."""
    return bool(getattr(router, "norm_topk_prob", True))


# routers that pick their experts by the sparse mixer (`sparse_mixer`), by class name; a half-precision model read
# in float32 (`precision.float32_view`) has a parametrized subclass of them, so the whole MRO is read
SPARSE_MIXER_ROUTERS = ("PhimoeTopKRouter",)
# ... by sigmoid scores plus the bias their MoE block holds (`expert_bias`, passed to their forward), their weights
# renormalised and scaled (LFM2-MoE's)
BLOCK_BIASED_ROUTERS = ("Lfm2MoeTopKRouter",)
# routers by softmax scores within the groups whose best two sum highest, in the model's dtype (their model keeps
# nothing in float32): Mistral 4's
SOFTMAX_GROUPED_ROUTERS = ("Mistral4TopkRouter",)


def _block_biased(router: nn.Module) -> bool:
    """Whether `router` is one of `BLOCK_BIASED_ROUTERS` (along the MRO, as `SPARSE_MIXER_ROUTERS`)."""
    return any(cls.__name__ in BLOCK_BIASED_ROUTERS for cls in type(router).__mro__)


def kept_in_float32(router: nn.Module) -> bool:
    """Whether transformers keeps `router` in float32 in a half-precision model (`_keep_in_fp32_modules_strict`): the
    routers that route themselves (`routes_itself`) but LFM2-MoE's and Mistral 4's, which run in the model's dtype."""
    return routes_itself(router) and not _block_biased(router) and not _softmax_grouped(router)


def _softmax_grouped(router: nn.Module) -> bool:
    """Whether `router` is one of `SOFTMAX_GROUPED_ROUTERS` (along the MRO, as `SPARSE_MIXER_ROUTERS`)."""
    return any(cls.__name__ in SOFTMAX_GROUPED_ROUTERS for cls in type(router).__mro__)


def _route(block: nn.Module, router: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A router that routes itself (`routes_itself`) on x (tokens, hidden): (logits, weights, index), as its forward
    gives them, with its block's expert bias where it reads one (`BLOCK_BIASED_ROUTERS`)."""
    if _block_biased(router):
        return router(x, getattr(block, "expert_bias", None))
    return router(x)


def _mixer_eps(router: nn.Module) -> float | None:
    """The jitter epsilon of a router that routes by the sparse mixer (Phi-3.5-MoE's `router_jitter_noise`), or None
    for softmax routing."""
    mixer = any(cls.__name__ in SPARSE_MIXER_ROUTERS for cls in type(router).__mro__)
    return float(router.router_jitter_noise) if mixer else None


def routes_itself(router: nn.Module) -> bool:
    """Whether the router picks its experts otherwise than by the softmax and top-k of its logits, which the MoE node
    computes: by sigmoid scores plus a correction bias, within the best groups of experts, its weights rescaled
    (GLM-4.5's, DeepSeek-V3's); by softmax scores within the groups of the best single experts, or greedily, its
    weights scaled and not renormalised (DeepSeek-V2's `topk_method`); by softmax scores plus a correction bias, the
    scores renormalised as weights (ERNIE 4.5's `moe_statics`); by sigmoid scores plus its block's bias, renormalised
    and scaled (LFM2-MoE's, `BLOCK_BIASED_ROUTERS`); by softmax scores within the groups whose top two sum highest
    (Mistral 4's, `SOFTMAX_GROUPED_ROUTERS`). Such a router's own forward gives the export
    its picks and weights (`_as_operator`)."""
    if hasattr(router, "moe_statics"):  # ERNIE 4.5: softmax scores plus its correction bias pick, the scores weigh
        return True
    if _block_biased(router):  # LFM2-MoE: sigmoid scores (plus its block's bias) pick and weigh
        return True
    # grouped: GLM-4.5's, DeepSeek-V3's (a correction bias), DeepSeek-V2's (topk_method), Mistral 4's
    return hasattr(router, "topk_group") and (hasattr(router, "e_score_correction_bias")
                                              or getattr(router, "topk_method", None) is not None
                                              or _softmax_grouped(router))


def router_logits(router: nn.Module, x: Tensor) -> Tensor:
    """The router's logits of x (..., hidden) in x's dtype, (..., experts)."""
    bias = getattr(router, "bias", None)
    return nn.functional.linear(x, router.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def sparse_mixer(logits: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Phi-3.5-MoE's routing at inference (transformers' `sparsemixer` outside training): two experts, each the
    largest score left, its weight the softmax at it over the scores within 2 eps (relative) of it; (weights,
    index), each (tokens, 2)."""
    scores = logits.float()
    masked, weights, picked = scores, [], []
    for _ in range(2):
        top, index = masked.max(-1, keepdim=True)  # (tokens, 1)
        far = (top - scores) / scores.abs().clamp(min=top) > 2 * eps
        weights.append(masked.masked_fill(far, float("-inf")).softmax(-1).gather(-1, index))
        picked.append(index)
        masked = masked.scatter(-1, index, float("-inf"))
    return torch.cat(weights, -1), torch.cat(picked, -1)


@functools.cache
def moe_op() -> Any:
    """torch.ops.osscar.moe_experts, registered on first use: a layer's routing and experts as one operator, the
    shape of ONNX Runtime's com.microsoft.MoE (router logits in: softmax, top-k, optional renormalisation, SwiGLU
    experts). The ONNX export translates it into that node (`exporters.experts`)."""

    @torch.library.custom_op(f"{OP_NAMESPACE}::{OP_NAME}", mutates_args=())
    def moe_experts(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, fc1_bias: Tensor | None,
                    fc2_bias: Tensor | None, k: int, normalize: bool, mixer: bool, eps: float, alpha: float,
                    beta: float, limit: float) -> Tensor:
        if mixer:  # Phi-3.5-MoE: two experts by the sparse mixer
            weights, index = sparse_mixer(logits, eps)
        else:
            weights, index = logits.float().softmax(-1).topk(k, -1)  # (tokens, k)
            if normalize:
                weights = weights / weights.sum(-1, keepdim=True)
        width = down.shape[-1]
        out = torch.zeros_like(x)
        for e in range(gate_up.shape[0]):
            tokens, slots = torch.where(index == e)
            if tokens.numel():
                h = x[tokens] @ gate_up[e].T  # (n, 2 x width)
                if fc1_bias is not None:
                    h = h + fc1_bias[e]
                y = _activation(h[:, :width], h[:, width:], alpha, beta, limit) @ down[e].T  # (n, hidden)
                if fc2_bias is not None:
                    y = y + fc2_bias[e]
                out.index_add_(0, tokens, y * weights[tokens, slots, None].to(x.dtype))
        return out

    @moe_experts.register_fake
    def _(x, logits, gate_up, down, fc1_bias, fc2_bias, k, normalize, mixer, eps, alpha, beta, limit):
        return torch.empty_like(x)

    return getattr(getattr(torch.ops, OP_NAMESPACE), OP_NAME)


def _shared_of(block: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """A sparse MoE block's shared expert and its sigmoid gate: Qwen2-MoE's `shared_expert` and
    `shared_expert_gate`, GLM-4.5's ungated `shared_experts`; (None, None) without."""
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        return shared, getattr(block, "shared_expert_gate", None)
    return getattr(block, "shared_experts", None), None


def _as_operator(block: nn.Module, hidden_states: Tensor, pair: bool = False) -> Tensor | tuple[Tensor, None]:
    """A sparse MoE block's forward through `moe_op` (eval mode: no router jitter); `pair`: returned as (output, None),
    where the block returns its router's scores beside its output (gpt-oss: `FamilyAdapter.ffn_pair`)."""
    batch, length, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    router = router_of(block)
    scale = None
    if routes_itself(router):  # its picks and weights as logits the node's softmax and top-k give back, renormalised
        _, weights, index = _route(block, router, x)  # (tokens, k) each
        weights = weights.float()
        # (tokens, 1): the weights' sum, by which the output is scaled back (floored as the router floors its own)
        scale = weights.sum(-1, keepdim=True).clamp_min(1e-20)
        # the other experts at the dtype's lowest finite value (no infinity in the graph, none where it is float16)
        low = torch.finfo(x.dtype).min
        picked = torch.full((x.shape[0], router.weight.shape[0]), low, dtype=torch.float32, device=x.device)
        logits = picked.scatter(-1, index, torch.log(weights / scale)).to(x.dtype)  # (tokens, experts)
    else:
        logits = router_logits(router, x)  # (tokens, experts)
    eps = _mixer_eps(router)
    experts = block.experts
    gate_up, down, fc1_bias, fc2_bias = experts.gate_up_proj, experts.down_proj, None, None
    if interleaved(experts):  # as the others': (experts, 2 x width, hidden) rows [gate | up], (experts, hidden, width)
        count, width = gate_up.shape[0], expert_width(experts)
        gate_up = gate_up.transpose(1, 2).reshape(count, width, 2, -1).transpose(1, 2).reshape(count, 2 * width, -1)
        fc1_bias = experts.gate_up_proj_bias.reshape(count, width, 2).transpose(1, 2).reshape(count, 2 * width)
        down, fc2_bias = down.transpose(1, 2), experts.down_proj_bias
    y = moe_op()(x, logits, gate_up, down, fc1_bias, fc2_bias, int(router.top_k),
                 _normalised(router) or scale is not None, eps is not None, eps or 0.0, *swiglu(experts))
    if scale is not None:
        y = y * scale.to(y.dtype)
    shared, gate = _shared_of(block)
    if shared is not None:  # a dense FFN every token visits beside the experts (Qwen2-MoE's scaled by its own gate)
        y = y + (shared(x) if gate is None else torch.sigmoid(gate(x)) * shared(x))
    y = y.reshape(batch, length, hidden)
    return (y, None) if pair else y


# a token's experts are ambiguous where its k-th and (k+1)-th router logits lie within this share of the k-th's
# magnitude (of 1 at least): the float rounding by which ONNX Runtime's pass differs from PyTorch's (~1e-6 relative,
# more through many layers) can swap the two, and the token's output with them; the tokens after it in its row read it
ROUTING_MARGIN = 1e-4


@contextmanager
def routing_settled(model: nn.Module) -> Iterator[list[Tensor]]:
    """Within it, every call of a sparse MoE block of `model` appends a (batch, length) bool tensor: whether each
    token's top-k experts won by more than `ROUTING_MARGIN` (four roundings of a half-precision pass at least)."""
    found: list[Tensor] = []

    def hook(block: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]  # (batch, length, hidden)
        router = router_of(block)
        # in the pass's own precision: a half-precision router's logits tie at its rounding
        logits = router_logits(router, hidden)  # (batch, length, experts)
        margin = max(ROUTING_MARGIN, 4 * torch.finfo(logits.dtype).eps)
        eps = _mixer_eps(router)
        if eps is not None:
            found.append(_mixer_clear(logits, eps, margin))
            return
        if routes_itself(router):
            found.append(_groups_clear(router, logits, margin, getattr(block, "expert_bias", None)))
            return
        k = int(router.top_k)
        top = logits.topk(min(k + 1, logits.shape[-1]), -1).values.float()
        if top.shape[-1] <= k:  # every expert chosen: nothing to swap
            found.append(torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device))
            return
        gap = top[..., k - 1] - top[..., k]
        found.append(gap > margin * top[..., k - 1].abs().clamp(min=1.0))

    hooks = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in moe_blocks(model)]
    try:
        yield found
    finally:
        for handle in hooks:
            handle.remove()


def _mixer_clear(logits: Tensor, eps: float, margin: float) -> Tensor:
    """Whether the sparse mixer's choices at each token (`sparse_mixer`) are clear of rounding: each pick's best score
    ahead of the runner-up, and every score away from the 2 eps band's edge (which decides the scores its weight's
    softmax spans), by `margin` of the pick's magnitude (of 1 at least) in logit units; (...,) bool."""
    scores = logits.float()
    masked = scores
    clear = torch.ones(scores.shape[:-1], dtype=torch.bool, device=scores.device)
    for _ in range(2):
        best = masked.topk(min(2, masked.shape[-1]), -1).values  # (..., 2): the pick and its runner-up
        top = best[..., :1]
        if best.shape[-1] > 1:
            clear &= (top[..., 0] - best[..., 1]) > margin * top[..., 0].abs().clamp(min=1.0)
        # in logit units, as the gap: a relative distance of small logits moves far with a rounding of them
        factor = scores.abs().clamp(min=top)
        edge = ((top - scores) - 2 * eps * factor).abs() > margin * top.abs().clamp(min=1.0)
        clear &= (edge | (top - scores <= 0)).all(-1)  # the pick itself (distance 0): the gap above
        masked = masked.scatter(-1, masked.argmax(-1, keepdim=True), float("-inf"))
    return clear


def _groups_clear(router: nn.Module, logits: Tensor, margin: float, block_bias: Tensor | None = None) -> Tensor:
    """Whether the choices of a router that routes itself (`routes_itself`: GLM-4.5's, DeepSeek-V2's, ERNIE 4.5's,
    Mistral 4's, LFM2-MoE's, whose bias its block holds: `block_bias`) are clear of rounding at each token: its
    topk_group-th group ahead of the next by `margin`, and its k-th expert within the chosen groups ahead of the next;
    (...,) bool."""
    method = getattr(router, "topk_method", None)
    # two scores are apart by more than `margin` times a size clamped to (low, high): sigmoid scores (about 0.5) by
    # `margin` itself, logits as a plain router's (by the first's magnitude); ERNIE's by a share of the two experts'
    # own softmax scores, which rounding moves, not the bias
    low, high, unbiased = 1.0, 1.0, None
    if _block_biased(router):  # LFM2-MoE: sigmoid scores plus its block's bias (where it has one), one group
        scores = logits.float().sigmoid()
        if block_bias is not None and router.use_expert_bias:
            scores = scores + block_bias.float()
        groups, chosen = 1, 1
        by_group = scores.unflatten(-1, (1, -1))
        group_scores = by_group.max(-1).values
    elif hasattr(router, "moe_statics"):  # ERNIE 4.5: softmax scores plus a correction bias, one group
        unbiased = logits.float().softmax(-1)
        scores = unbiased + router.moe_statics.e_score_correction_bias.float().squeeze(0)
        groups, chosen, low, high = 1, 1, 0.0, None
        by_group = scores.unflatten(-1, (1, -1))
        group_scores = by_group.max(-1).values
    elif method is not None:  # DeepSeek-V2: softmax scores, a group scored by its best expert; greedy: one group
        # its logits, which order the experts and the groups as their softmax does
        scores, high = logits.float(), None  # (..., experts)
        groups = int(router.num_group) if method == "group_limited_greedy" else 1
        by_group = scores.unflatten(-1, (groups, -1))  # (..., groups, experts per group)
        group_scores = by_group.max(-1).values  # (..., groups)
        chosen = int(router.topk_group) if groups > 1 else 1
    elif _softmax_grouped(router):  # Mistral 4: softmax scores (apart by a share of the first), a group by its best two
        scores, low, high = logits.float().softmax(-1), 0.0, None  # (..., experts)
        groups = int(router.num_group)
        by_group = scores.unflatten(-1, (groups, -1))  # (..., groups, experts per group)
        group_scores = by_group.topk(min(2, by_group.shape[-1]), -1).values.sum(-1)  # (..., groups)
        chosen = int(router.topk_group)
    else:  # sigmoid scores plus the correction bias, a group scored by its best two
        scores = logits.float().sigmoid() + router.e_score_correction_bias.float()  # (..., experts)
        groups = int(router.num_group)
        by_group = scores.unflatten(-1, (groups, -1))  # (..., groups, experts per group)
        group_scores = by_group.topk(min(2, by_group.shape[-1]), -1).values.sum(-1)  # (..., groups)
        chosen = int(router.topk_group)
    clear = torch.ones(scores.shape[:-1], dtype=torch.bool, device=scores.device)

    def apart(first: Tensor, second: Tensor, size: Tensor) -> Tensor:
        return first - second > margin * size.abs().clamp(min=low, max=high)

    if chosen < groups:
        top = group_scores.topk(chosen + 1, -1).values
        clear &= apart(top[..., chosen - 1], top[..., chosen], top[..., chosen - 1])
    best = group_scores.topk(chosen, -1).indices  # (..., chosen)
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, best, True)
    within = scores.masked_fill(~mask.repeat_interleave(by_group.shape[-1], -1), float("-inf"))
    k = int(router.top_k)
    if k < chosen * by_group.shape[-1]:  # else every expert of the chosen groups is picked
        top = within.topk(k + 1, -1)
        first, second = top.values[..., k - 1], top.values[..., k]
        size = first if unbiased is None else unbiased.gather(-1, top.indices[..., k - 1:k + 1]).amax(-1)
        clear &= apart(first, second, size)
    return clear


def check_exportable(block: nn.Module) -> None:
    """Refuse, in one line, experts the ONNX operator does not compute (another activation than SiLU) and a shared
    expert combined otherwise than Qwen2-MoE's (`shared_expert` scaled by its sigmoid `shared_expert_gate`) or
    GLM-4.5's (`shared_experts`, added as it is)."""
    if hasattr(block, "shared_expert") and not hasattr(block, "shared_expert_gate"):
        raise ValueError("a shared expert without its sigmoid gate (shared_expert_gate) is not exported: Qwen2-MoE's "
                         "gated shared expert is")
    if hasattr(block, "shared_experts") and any(hasattr(block, f"shared_experts{s}") for s in ("_gate", "_gating")):
        raise ValueError("gated shared_experts are not exported: GLM-4.5's ungated shared_experts and Qwen2-MoE's "
                         "gated shared_expert are")
    act = getattr(block.experts, "act_fn", None)
    if interleaved(block.experts):  # gpt-oss's clamped SwiGLU: the node's swiglu with its alpha, beta and limit
        return
    # torch's module, transformers' ACT2FN["silu"], or the function itself (LFM2-MoE's experts)
    if type(act).__name__ not in ("SiLU", "SiLUActivation") and act is not nn.functional.silu:
        raise ValueError(f"experts with activation {type(act).__name__} are not exported: ONNX Runtime's MoE "
                         "operator computes SwiGLU (SiLU-gated) experts")


@contextmanager
def experts_as_operator(model: nn.Module) -> Iterator[bool]:
    """Within it, every sparse MoE block of `model` runs as one `moe_op` call (what the ONNX export traces);
    yields whether the model has any."""
    from .adapters import ADAPTERS

    blocks = moe_blocks(model)
    # the family of the model, or of the one inside a wrapper (the export's named-inputs or decode-step module)
    types = (getattr(getattr(m, "config", None), "model_type", None) for m in model.modules())
    adapter = ADAPTERS.get(next((t for t in types if t is not None), None))
    pair = adapter is not None and adapter.ffn_pair
    for block in blocks:
        check_exportable(block)
    try:
        for block in blocks:
            block.forward = functools.partial(_as_operator, block, pair=pair)
        yield bool(blocks)
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)  # the class's forward again
