"""Linear attention (Qwen3.5's Gated DeltaNet, Mamba2's selective scan) in a graph that runs any sequence length.

transformers computes the gated delta rule chunk by chunk, its recurrent state carried from one chunk of 64 tokens to
the next in a Python loop over `sequence_length // 64`: torch.export unrolls that loop for the traced length, so an
exported graph would run that length only. During an export `scanned_delta_rule` puts in its place the same
computation with the loop over chunks as a `torch.ops.higher_order.scan` (ONNX's Scan), and the triangular solve
inside a chunk, which ONNX has no operator for, by recursive blocks (`unit_lower_inverse`).

Mamba2's scan (state space duality) has no loop, but transformers adds its skip term to the padded sequence before
cutting the padding off, an equality of the padded length with the chunks' that the tracer can only keep by tying the
traced length to its remainder modulo the chunk: `ssd_chunk_scan` computes the same with the padding cut first.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# the chunk length transformers' rule runs at: an export traces more than one chunk, so none is specialised to one
CHUNK = 64
# the chunk length the exported graph computes with (`traced_chunk`)
_chunk: ContextVar[int] = ContextVar("chunk", default=CHUNK)
# the chunk length an exported decode step's Mamba2 scan computes with (`stepped_scan`): a one-token step is a padded
# chunk, whose within-chunk products cost the chunk's length (any length gives the same outputs)
SSD_STEP_CHUNK = 8
_ssd_chunk: ContextVar[int | None] = ContextVar("ssd_chunk", default=None)
# the module-level function a Gated DeltaNet layer calls for a prompt (and, from a cache, for several new tokens),
# looked up in its modeling module at call time
CHUNK_RULE = "torch_chunk_gated_delta_rule"
# the mask builder a hybrid model calls for its linear-attention layers, looked up in its modeling module
MASK = "create_recurrent_attention_mask"
# transformers' Gated DeltaNet classes that `_gated_delta_net_forward` computes (Qwen3.5's and Qwen3.5-MoE's: one
# forward; Qwen3-Next's: its projections fused, `_projections`)
DELTA_NETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
# the module-level function a Mamba2 mixer's scan calls for a prompt (and, from a cache, for several new tokens), looked
# up in its modeling module at call time (Granite 4.0-H's, Bamba's, NemotronH's)
SSD_SCAN = "mamba2_chunk_scan"


def unit_lower_inverse(a: Tensor) -> Tensor:
    """(I + A)^-1 for A strictly lower triangular, (..., n, n) with n a power of two, by recursive blocks:
    [[P, 0], [C, Q]]^-1 = [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]], from the 1 x 1 diagonal blocks up, log2(n) levels of
    batched products with no loop over the rows. Stable as substitution is (a Neumann series' product form is not:
    a chunk of near-identical keys makes its partial sums grow like binomials before they cancel, in float32 to
    garbage)."""
    n = a.shape[-1]
    assert n & (n - 1) == 0, f"the chunk size {n} is not a power of two"
    lead = a.shape[:-2]
    a = a.reshape(-1, n, n)  # one batch axis: the tracer reasons about one symbolic size, not every leading one
    inverse = torch.ones(a.shape[0], n, 1, 1, dtype=a.dtype, device=a.device)  # the 1 x 1 diagonal blocks' inverses
    size = 1
    while size < n:
        pairs = n // (2 * size)
        # the lower-left size x size block of each 2 size x 2 size diagonal block of A: (batch, pairs, size, size)
        lower_left = torch.diagonal(a.reshape(-1, pairs, 2 * size, pairs, 2 * size), dim1=1, dim2=3)[
            :, size:, :size].permute(0, 3, 1, 2)
        halves = inverse.reshape(-1, pairs, 2, size, size)
        first, second = halves[:, :, 0], halves[:, :, 1]
        lower = -(second @ lower_left @ first)
        inverse = torch.cat([torch.cat([first, torch.zeros_like(first)], -1), torch.cat([lower, second], -1)], -2)
        size *= 2
    return inverse.reshape(*lead, n, n)


def chunk_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, **_: Any) -> tuple[Tensor, Tensor | None]:
    """transformers' `torch_chunk_gated_delta_rule` (same arguments and results) with its loop over chunks as a scan.

    query, key: (batch, length, key heads, key size); value: (batch, length, value heads, value size); g (the decay's
    log) and beta: (batch, length, value heads); initial_state: (batch, value heads, key size, value size)."""
    dtype = query.dtype
    batch, length, key_heads, key_size = key.shape
    value_heads, value_size = value.shape[-2:]
    if key_heads != value_heads:  # each query / key head serves value_heads // key_heads consecutive value heads
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    # (batch, heads, length, ...) in float32
    query, key, value, beta, decay = (x.transpose(1, 2).to(torch.float32).contiguous()
                                      for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt(query.square().sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt(key.square().sum(-1, keepdim=True) + 1e-6)
    query = query * key_size ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    # (batch, heads, chunks, chunk_size, ...)
    query, key, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta))
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size).cumsum(-1)  # the decay's log since the
    # chunk began; pairwise[i, j]: the decay from position j to position i of a chunk (none above the diagonal)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    # the UT transform: the chunk's delta-rule updates condensed into (I + A)^-1 applied to its values and keys
    transform = unit_lower_inverse(((k_beta @ key.transpose(-1, -2)) * pairwise).tril(-1))
    new_values = transform @ v_beta
    k_cumdecay = transform @ (k_beta * decay.exp().unsqueeze(-1))
    intra = (query @ key.transpose(-1, -2)) * pairwise  # attention within the chunk
    query = query * decay.exp().unsqueeze(-1)
    key = key * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]  # (batch, heads, chunks, 1, 1)
    state = (torch.zeros(batch, value_heads, key_size, value_size, dtype=torch.float32, device=query.device)
             if initial_state is None else initial_state.to(torch.float32))

    def step(state: Tensor, chunk: list[Tensor]) -> tuple[Tensor, Tensor]:
        values, k_decayed, q, attention, kept, k = chunk
        corrected = values - k_decayed @ state  # what the state does not predict already: the delta rule
        out = q @ state + attention @ corrected
        return state * kept + k.transpose(-1, -2) @ corrected, out

    from torch._higher_order_ops.scan import scan

    chunks = [x.movedim(2, 0) for x in (new_values, k_cumdecay, query, intra, chunk_decay, key)]  # chunks first
    state, out = scan(step, state, chunks)
    out = out.movedim(0, 2).flatten(2, 3).narrow(2, 0, length)  # (batch, heads, length, value size)
    return out.transpose(1, 2).to(dtype).contiguous(), state if output_final_state else None


def _segment_sum(x: Tensor) -> Tensor:
    """(..., n) -> (..., n, n): entry [i, j] the sum of x over positions j+1 .. i (0 on the diagonal), -inf above it
    (so that its exp is the decay from position j to i, 0 where j is later), by a cumulative sum of masked copies."""
    n = x.shape[-1]
    below = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
    sums = x[..., None].expand(*x.shape, n).masked_fill(~below, 0).cumsum(-2)
    return sums.masked_fill(~below.logical_or(torch.eye(n, dtype=torch.bool, device=x.device)), float("-inf"))


def ssd_chunk_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                   D: Tensor | None = None, dt_bias: Tensor | None = None, initial_states: Tensor | None = None,
                   dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                   return_final_states: bool = False, **_: Any) -> Tensor | tuple[Tensor, Tensor]:
    """transformers' `mamba2_chunk_scan` (same arguments and results; its chunk length `_chunk`'s, `traced_chunk`),
    the skip term added after the padding is cut (`D x`, on the unpadded input).

    hidden_states: (batch, length, heads, head size); dt: (batch, length, heads); A: (heads,); B, C: (batch, length,
    groups, state size), each group read by heads / groups consecutive heads; initial_states: (batch, heads, head size,
    state size). Returns (batch, length, heads, head size) in float32, and the final state where asked."""
    chunk = _ssd_chunk.get() or _chunk.get()
    batch, length, heads, _ = hidden_states.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    B, C = (t.float().repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))  # (batch, length, heads, state)
    pad = (chunk - length % chunk) % chunk

    def chunked(t: Tensor) -> Tensor:  # (batch, length, ...) -> (batch, chunks, chunk, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])

    decay = chunked(A.float() * dt).permute(0, 3, 1, 2)  # (batch, heads, chunks, chunk): log-decay a position
    xs, Bs, Cs = chunked(x * dt[..., None]), chunked(B), chunked(C)  # (batch, chunks, chunk, heads, ...)
    cumulative = decay.cumsum(-1)
    # within a chunk: an attention-like product of C and B weighted by the decay between the two positions
    within = torch.einsum("bclhn,bcshn->bhcls", Cs, Bs) * _segment_sum(decay).exp()
    y_diag = torch.einsum("bhcls,bcshp->bclhp", within, xs)
    # each chunk's contribution to the state at its end, then the states at the chunks' starts
    to_end = (cumulative[..., -1:] - cumulative).exp()  # (batch, heads, chunks, chunk)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bs, to_end, xs)
    first = (initial_states[:, None].float() if initial_states is not None
             else states.new_zeros(states.shape[0], 1, *states.shape[2:]))
    states = torch.cat([first, states], dim=1)  # (batch, chunks + 1, heads, head size, state size)
    across = _segment_sum(F.pad(cumulative[..., -1], (1, 0))).exp()  # (batch, heads, chunks + 1, chunks + 1)
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)
    starts, final = states[:, :-1], states[:, -1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cs, starts, cumulative.exp())
    out = (y_diag + y_off).reshape(batch, -1, heads, x.shape[-1]).narrow(1, 0, length)
    if D is not None:
        out = out + D.float()[:, None] * x
    return (out, final) if return_final_states else out


def _recurrent_mask(config: Any, inputs_embeds: Tensor, attention_mask: Tensor | None, cache: Any = None,
                    **_: Any) -> Tensor | None:
    """transformers' `create_recurrent_attention_mask` without its shortcuts on the traced length (a one-token step
    and an all-ones mask return None there, which a graph would keep as an assertion that the step is longer than one
    token): the 2-D mask's columns of the new tokens, whatever their number."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    length = inputs_embeds.shape[1]  # narrowed, not sliced from the end: exactly `length` columns to the tracer
    return attention_mask.narrow(1, attention_mask.shape[1] - length, length)


def _gated_delta_net_forward(self: torch.nn.Module, hidden_states: Tensor, cache: Any = None,
                             attention_mask: Tensor | None = None, **_: Any) -> Tensor:
    """Qwen3.5's `Qwen3_5GatedDeltaNet.forward` (and its kin's, `DELTA_NETS`) as one path for any number of new
    tokens after any cache: transformers branches on a one-token step (its recurrent kernel and in-place conv
    update), which a traced graph would keep as an assertion on the step's length; the chunked rule
    (`chunk_gated_delta_rule`) computes the same for one token. The conv reads the cached last `kernel` inputs before
    the new ones (zeros before a prompt, as the causal conv pads), and the layer's states are replaced by the new
    ones."""
    from transformers.activations import ACT2FN

    if attention_mask is not None:  # padding tokens write nothing into the states
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, length, _ = hidden_states.shape
    layer = cache.layers[self.layer_idx] if cache is not None else None
    cached = layer is not None and layer.is_conv_states_initialized[0]
    mixed, z, b, a = _projections(self, hidden_states)
    mixed = mixed.transpose(1, 2)  # (batch, conv channels, length)
    z = z.reshape(batch, length, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    kernel = self.conv1d.kernel_size[0]
    weight = self.conv1d.weight  # (channels, 1, kernel): depthwise
    history = layer.conv_states[0][..., -kernel:].to(mixed.dtype) if cached else \
        mixed.new_zeros(batch, mixed.shape[1], kernel)  # (a cache recording its past keeps more than `kernel`)
    inputs = torch.cat([history, mixed], dim=-1)  # (batch, channels, kernel + length)
    # a valid conv over kernel + length inputs: length + 1 outputs, the first of them the history's own
    conv = F.conv1d(inputs.to(weight.dtype), weight, self.conv1d.bias, groups=mixed.shape[1])[..., 1:]
    mixed = ACT2FN[self.activation](conv).to(hidden_states.dtype).transpose(1, 2).contiguous()  # (batch, length, ch.)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, self.head_k_dim)
    key = key.reshape(batch, length, -1, self.head_k_dim)
    value = value.reshape(batch, length, -1, self.head_v_dim)
    state = layer.recurrent_states[0] if cached else None
    # a one-token step too is a (padded) chunk: a branch for it (torch.cond) does not export (its branch is taken
    # for aliasing its inputs), so generation pays a chunk's products a token
    out, state = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, chunk_size=_chunk.get(), initial_state=state,
                                        output_final_state=layer is not None, use_qk_l2norm_in_kernel=True)
    if layer is not None:
        if not cached:  # a prompt into an empty cache: the layer's slots as transformers would lay them out
            layer.lazy_initialization(conv_states=inputs[..., -kernel:], recurrent_states=state,
                                      conv_kernel_size=kernel)
        layer.has_previous_state[0] = True  # the next forward continues these tokens
        layer.conv_states[0], layer.recurrent_states[0] = inputs[..., -kernel:], state.to(layer.recurrent_states[0])
        layer.cumulative_length_linear = layer.cumulative_length_linear + length  # the tokens it has seen
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, length, -1))


def _projections(self: torch.nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A Gated DeltaNet's input projections: the conv's channels [q | k | v] (batch, length, 2 key dims + value dim),
    the output gate z, beta's and the decay's logits b and a. Qwen3.5 projects each apart; Qwen3-Next fuses q, k, v, z
    in `in_proj_qkvz` and b, a in `in_proj_ba`, grouped by key head, which its own method orders."""
    if not hasattr(self, "in_proj_qkvz"):
        return (self.in_proj_qkv(hidden_states), self.in_proj_z(hidden_states), self.in_proj_b(hidden_states),
                self.in_proj_a(hidden_states))
    query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                   self.in_proj_ba(hidden_states))
    mixed = torch.cat([t.flatten(2) for t in (query, key, value)], dim=-1)  # (batch, length, conv channels)
    return mixed, z, b, a


def chunk_for(length: int) -> int:
    """The chunk length an export traced on `length` new tokens computes with: `CHUNK` where that length spans more
    than one chunk, else the largest power of two below it (a model whose positions end within one chunk), so that
    the tracer sees several chunks and specialises nothing to one."""
    return min(CHUNK, 1 << max(length - 1, 1).bit_length() - 1)  # the largest power of two below `length`


@contextlib.contextmanager
def stepped_scan() -> Iterator[None]:
    """Within the block, exported Mamba2 scans compute with chunks of `SSD_STEP_CHUNK` tokens (a decode step's)."""
    token = _ssd_chunk.set(SSD_STEP_CHUNK)
    try:
        yield
    finally:
        _ssd_chunk.reset(token)


@contextlib.contextmanager
def traced_chunk(chunk: int) -> Iterator[None]:
    """Within the block, exported Gated DeltaNet layers compute with chunks of `chunk` tokens (`chunk_for`)."""
    token = _chunk.set(chunk)
    try:
        yield
    finally:
        _chunk.reset(token)


def _class_of(module: torch.nn.Module) -> type:
    """The module's transformers class: a half-precision model read in float32 (`precision.float32_view`) has
    parametrized subclasses of it, which torch's parametrize module defines."""
    from torch.nn.utils.parametrize import type_before_parametrizations

    return type_before_parametrizations(module)


def _delta_nets(model: torch.nn.Module) -> list[type]:
    """The classes of the model's Gated DeltaNet layers (Qwen3.5's) that `_gated_delta_net_forward` computes."""
    return sorted({_class_of(m) for m in model.modules() if _class_of(m).__name__ in DELTA_NETS},
                  key=lambda c: c.__module__)


def _ssd_modules(model: torch.nn.Module) -> list[Any]:
    """The modeling modules of the model's Mamba2 mixers (a state size, and a module-level `SSD_SCAN` they call)."""
    found = {sys.modules[_class_of(m).__module__] for m in model.modules() if hasattr(m, "ssm_state_size")}
    return sorted((m for m in found if hasattr(m, SSD_SCAN)), key=lambda m: m.__name__)


def has_chunked_scans(model: torch.nn.Module) -> bool:
    """Whether the model (or a wrapper of it) has linear-attention layers that compute by chunks (Gated DeltaNet's,
    Mamba2's), which an export traces over several chunks."""
    return bool(_delta_nets(model) or _ssd_modules(model))


def spanning_chunks(example: dict[str, Tensor], limit: int | None) -> tuple[dict[str, Tensor], int]:
    """`example`'s token inputs (integer, (batch, length)) repeated along their length to more than one `CHUNK`, as far
    as `limit` (the longest sequence the export takes) allows, and the chunk an export traced on them computes with
    (`chunk_for`): a prompt of one chunk would be traced as one, the graph's length fixed to it."""
    tokens = [name for name, t in example.items() if not t.is_floating_point()]
    length = max((example[name].shape[1] for name in tokens), default=0)
    want = min(CHUNK + 2, limit) if limit else CHUNK + 2
    if tokens and length < want:
        example = {name: tiled(t, want) if name in tokens else t for name, t in example.items()}
        length = want
    return example, chunk_for(length)


def tiled(tokens: Tensor, length: int) -> Tensor:
    """(batch, n) token inputs repeated along their length and cut to (batch, `length`)."""
    return tokens.repeat(1, -(-length // tokens.shape[1]))[:, :length]


@contextlib.contextmanager
def scanned_linear_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block, the model's Gated DeltaNet layers run `_gated_delta_net_forward` (one path for any number of
    tokens, the chunks as a Scan), its Mamba2 mixers' scans `ssd_chunk_scan`, and their masks `_recurrent_mask`: an
    export that runs any length, from any cache; yields whether the model has such layers."""
    classes, ssd = _delta_nets(model), _ssd_modules(model)
    modules = [sys.modules[c.__module__] for c in classes]
    saved = [(c, "forward", c.forward) for c in classes]
    saved += [(m, name, getattr(m, name)) for m in modules for name in (CHUNK_RULE, MASK) if hasattr(m, name)]
    saved += [(m, name, getattr(m, name)) for m in ssd for name in (SSD_SCAN, MASK) if hasattr(m, name)]
    replacements = {"forward": _gated_delta_net_forward, CHUNK_RULE: chunk_gated_delta_rule, MASK: _recurrent_mask,
                    SSD_SCAN: ssd_chunk_scan}
    for owner, name, _ in saved:
        setattr(owner, name, replacements[name])
    try:
        yield bool(classes or ssd)
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
