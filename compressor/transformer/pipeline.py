"""Sequential head and FFN pruning of a HF transformer, one block at a time.

The model's embeddings run once to capture the first block's inputs (hidden states and the keyword
arguments the model passes its blocks: masks, rotary tables, ...). Then, block by block, only that
block is on the compute device: a dense copy advances the dense stream, the block itself the pruned
stream, and both streams live on the CPU between blocks (`activation_dtype`, float16 allowed).
Per block, in order: the attention output projection (groups = query heads, head_dim rows each; or,
with `gqa="kv-groups"`, whole KV groups of head_dim x group rows), then the FFN output projection
(groups = neurons). H comes from the pruned
stream's inputs to the projection and G from the dense stream's, over non-padding tokens only; the
solver picks the groups, surgery removes them and installs the refit projection.

Blocks come from a `BlockSource`: the model's own blocks (`InMemoryBlocks`), or blocks read one at a
time from safetensors shards and written back pruned
(`compressor.transformer.offload.StreamedCheckpoint`), for models larger than memory.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import gc
import inspect
import itertools
import logging
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..errors import CalibrationError, InputError, UnsupportedArchitecture
from ..layerstats import (
    COMPUTE_DTYPE,
    HALF_DTYPES,
    FinishedStatistics,
    KeptSolution,
    LayerObservation,
    LayerStatistics,
    Widths,
    check_plan,
    compute_device,
    floored_scale,
    kept_rows,
    planned_prune,
    prune_layer,
    token_weights,
)
from ..modules import owner_of
from ..progress import RECONSTRUCTION, REMOVED, Progress, ProgressFn, emit, warning
from ..refine import check_method
from ..reports import LayerReport, RefineReport, fit_numbers
from ..solver.solve import DENSE_ROWS_METHODS, NO_REFIT_METHODS
from .adapters import (
    FIXED_HEADS,
    LINEAR_MIXER,
    FamilyAdapter,
    TransformerDims,
    adapter_at,
    adapter_for,
    block_hidden,
    block_lists,
    block_path,
    dims,
    layers,
    stage_exit,
    stage_of,
    submodule,
)
from .experts import (
    ALIGN,
    aligned_width,
    down_weight,
    expert_hidden,
    expert_inputs,
    expert_width,
    is_experts,
    keep_expert_neurons,
)
from .refine import BlockReconstruction, RefineConfig, Sequences, split
from .sublayers import ATTENTION, FFN, KINDS, check_removable, remove_sublayer, replaced_path, sublayer_removed
from .surgery import (
    add_bias,
    check_removable_layers,
    dense_weight,
    head_groups,
    in_features,
    is_short_conv,
    is_ssd,
    linear_mixer,
    mixer_unit_width,
    mixer_units,
    projection,
    prune_ffn,
    prune_heads,
    prune_mixer_units,
    prune_query_heads,
    prune_shared_ffn,
    query_heads,
    remove_layers,
    set_weight,
    ssd_unit_heads,
)

log = logging.getLogger(__name__)


class BlockSource(Protocol):
    """Where blocks live between their turns on the compute device."""

    model: nn.Module  # the model whose non-block modules compute the first block's inputs

    def load(self, index: int) -> nn.Module:
        """Block `index` with its dense weights (on the CPU), installed in `model`'s layer list."""

    def store(self, index: int) -> None:
        """Block `index` is pruned: keep it (its module in `model` has its final widths)."""

    def release_rest(self) -> None:
        """The first block's inputs are captured: until the end, nothing reads the weights outside the blocks."""


class InMemoryBlocks:
    """The model's own blocks, moved back to the CPU once pruned."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def load(self, index: int) -> nn.Module:
        return layers(self.model)[index]

    def release_rest(self) -> None:
        """Nothing to release: the caller's model stays whole."""

    def store(self, index: int) -> None:
        layers(self.model)[index].to("cpu")


@dataclass
class _Stream:
    """One calibration batch as the blocks see it."""

    hidden: Tensor  # dense stream's block input, CPU, activation dtype
    pruned: Tensor  # pruned stream's block input
    # what the model passes each block besides the hidden states (CPU), per layer: layers of different kinds get
    # different masks and rotary tables (sliding-window and global layers: ModernBERT, Gemma 2); a tensor that
    # layers share is stored once
    layer_inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]
    mask: Tensor | None  # (batch, seq) bool: tokens that count (padding excluded)
    # flat indices of the counted tokens, formed once on the CPU (None: all count): a boolean mask applied
    # on the device would make the host wait for every batch of every layer's statistics
    counted: Tensor | None = None
    layer: int = 0  # the layer whose inputs `args` / `kwargs` are: set as the blocks take their turns

    @property
    def args(self) -> tuple[Any, ...]:
        return self.layer_inputs[self.layer][0]

    @property
    def kwargs(self) -> dict[str, Any]:
        return self.layer_inputs[self.layer][1]


class _Stop(Exception):
    """Raised by a hook once it has what it needs: the rest of the forward pass is not run."""


def _to(obj: Any, device: torch.device | str, dtype: torch.dtype | None = None, non_blocking: bool = False,
        memo: dict[int, Tensor] | None = None) -> Any:
    """Tensors of a nested tuple / list / dict on `device`. `non_blocking`: asynchronous where the memory allows
    it (into pinned CPU memory from a GPU; from pinned CPU memory to a GPU), so the host does not wait for the
    device: the values may be read on the host only after `_host_ready`. `memo`: a tensor met again (in this
    call or another given the same memo) is moved once and shared."""
    if isinstance(obj, Tensor):
        if memo is not None and id(obj) in memo:
            return memo[id(obj)]
        moved = obj.to(device=device, dtype=dtype if dtype is not None and obj.is_floating_point() else None,
                       non_blocking=non_blocking)
        if memo is not None:
            memo[id(obj)] = moved
        return moved
    if isinstance(obj, tuple | list):
        return type(obj)(_to(o, device, dtype, non_blocking, memo) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device, dtype, non_blocking, memo) for k, v in obj.items()}
    return obj


def _offload(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Block activations to the CPU in `dtype`. From a GPU: converted there, then one asynchronous copy into
    pinned memory (a copy to pageable memory makes the host wait for every batch of every block); uploading
    it again is ordered after it on the device, reading it on the host needs `_host_ready`."""
    if x.device.type != "cuda":
        return x.to("cpu", dtype)
    return x.to(dtype).to("cpu", non_blocking=True)


def _check_finite(name: str, stats: FinishedStatistics, activation_dtype: torch.dtype) -> None:
    """A projection's statistics are finite, or the job is refused naming it (the solve raised a ValueError with a
    traceback): in float16 activations, a stream beyond its range (65,504: a bf16 model's massive activations are
    not) became infinite when it was stored between blocks."""
    if bool(torch.isfinite(stats.H).all()) and bool(torch.isfinite(stats.G).all()):
        return
    if activation_dtype == torch.float16:
        raise CalibrationError(f"{name}: its calibration inputs overflow float16 (--activation-dtype float16 stores "
                               "the stream between blocks in it, up to 65,504); use --activation-dtype float32")
    raise CalibrationError(f"{name}: its calibration inputs are not finite (the dense model's activations on the "
                           "calibration data overflow or are NaN)")


def stored_dtype(module: nn.Module) -> torch.dtype:
    """The floating dtype a module's parameters are kept in (float32 when it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def _to_compute(block: nn.Module, device: torch.device) -> dict[str, torch.dtype]:
    """Move a block to the device for its turn; a half-precision (bf16 / fp16) block is upcast there, so the
    statistics, the solve and the reconstruction see float32 and the host keeps the checkpoint's dtype.
    Returns each floating tensor's dtype by name, which `_to_stored` gives back to it before the block is stored."""
    dtypes = {name: t.dtype for name, t in itertools.chain(block.named_parameters(), block.named_buffers())
              if t.is_floating_point()}
    dtype = stored_dtype(block)
    block.to(device=device, dtype=COMPUTE_DTYPE if dtype in HALF_DTYPES else None)
    return dtypes


def _to_stored(block: nn.Module, dtypes: dict[str, torch.dtype], device: torch.device | str | None = None) -> None:
    """Each of the block's tensors back in the dtype `_to_compute` found it in (by name: surgery replaces the
    parameters it resizes), not one dtype for all: an fp16 T5 keeps its FFN output projection in float32
    (transformers' `_keep_in_fp32_modules`, against fp16 overflow), which a round trip through fp16 would undo."""
    if device is not None:
        block.to(device)
    for name, t in itertools.chain(block.named_parameters(), block.named_buffers()):
        if name in dtypes and t.dtype != dtypes[name]:
            t.data = t.data.to(dtypes[name])


def _host_ready(device: torch.device) -> None:
    """Wait for the device's queued work (the asynchronous copies of `_offload`) before the host reads the
    streams: once per block, not per batch."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@contextmanager
def _without_blocks(model: nn.Module) -> Iterator[None]:
    """Temporarily swap the block lists out (to move the rest of the model without its blocks)."""
    swapped = []
    for path in block_lists(model):
        owner, name = owner_of(model, path)
        swapped.append((owner, name, getattr(owner, name)))
        setattr(owner, name, nn.ModuleList())
    try:
        yield
    finally:
        for owner, name, blocks in swapped:
            setattr(owner, name, blocks)


@contextmanager
def _recording(model: nn.Module, sink: list[tuple[Tensor, tuple, dict]]) -> Iterator[None]:
    """Every block's forward replaced by one that appends (hidden states, args, kwargs) to `sink`; the last
    raises _Stop. The blocks keep their attributes (the model reads some, e.g. ModernBERT's `attention_type`) and
    their weights are never touched (meta tensors when streaming). A stand-in returns (hidden states, None): what
    a model unpacks as (output, attention weights) (DeBERTa-v2) or indexes [0]; a model that takes one tensor
    passes the pair on to the next stand-in, which reads nothing of it: only the first block's hidden states
    are kept, the blocks' own outputs come from running them."""
    blocks = list(layers(model))
    returns = adapter_for(model).block_returns

    def recorder(index: int) -> Callable[..., tuple[Any, ...]]:
        def forward(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            sink.append((hidden, args[1:], kwargs))
            if index == len(blocks) - 1:
                raise _Stop
            return (hidden, *[None] * (returns - 1))
        return forward

    for i, block in enumerate(blocks):
        block.forward = recorder(i)  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def _with_relayed_bias(model: nn.Module, seen: list[tuple[Tensor, tuple, dict]],
                       biases: dict[int, Tensor]) -> list[tuple[Tensor, tuple, dict]]:
    """Every block's recorded call with the per-head bias the first block computes and every later one is handed
    (`FamilyAdapter.bias_relay`: T5's position bias; the stand-ins handed on none): each block replays alone on its own
    inputs, as inside the model. `biases`: one per sequence length, shared by the batches of that length (a T5-XXL's
    is 64 heads x length^2). Computed where the first block's bias table is (on the host: the blocks stay there until
    their turn) and kept there, as the streams are, in float32, as the blocks compute."""
    adapter, first = adapter_for(model), layers(model)[0]
    attention = first.get_submodule(adapter.head_bias)
    hidden = seen[0][0]  # (batch, length, hidden)
    length = hidden.shape[1]
    if length not in biases:
        table = attention.relative_attention_bias.weight
        bias = attention.compute_bias(length, length, device=table.device)  # (1, heads, length, length)
        biases[length] = bias.to(device="cpu", dtype=torch.float32)  # stored as it is: one copy per length
    bias = biases[length]
    at = list(inspect.signature(type(first).forward).parameters).index("position_bias") - 2  # past self, hidden
    out = []
    for hidden_states, args, kwargs in seen:
        if len(args) > at:
            args = (*args[:at], bias, *args[at + 1:])
        else:
            kwargs = {**kwargs, "position_bias": bias}
        out.append((hidden_states, args, kwargs))
    return out


def capture_block_inputs(model: nn.Module, batches: Sequence[dict[str, Tensor]], device: torch.device,
                         activation_dtype: torch.dtype) -> list[_Stream]:
    """Run the model's embeddings for every batch, with every block standing aside (`_recording`): the first
    block's hidden states and what each block is passed besides them, stored on the CPU."""
    streams: list[_Stream] = []
    with _without_blocks(model):
        model.to(device)
    use_cache = getattr(model.config, "use_cache", None)
    if use_cache is not None:
        model.config.use_cache = False  # no KV cache is built, nor passed to the blocks
    biases: dict[int, Tensor] = {}  # a relayed bias per sequence length (`_with_relayed_bias`)
    try:
        with torch.no_grad():
            for batch in batches:
                seen: list[tuple[Tensor, tuple, dict]] = []
                with _recording(model, seen), suppress(_Stop):
                    model(**_to(batch, device, non_blocking=True))
                if len(seen) != len(layers(model)):
                    raise RuntimeError(f"the model called {len(seen)} of its {len(layers(model))} blocks")
                if adapter_for(model).bias_relay is not None:
                    seen = _with_relayed_bias(model, seen, biases)
                hidden = _offload(seen[0][0].detach(), activation_dtype)
                mask = batch.get("attention_mask")
                mask = mask.bool().cpu() if mask is not None else None
                counted = None if mask is None or bool(mask.all()) else torch.nonzero(mask.reshape(-1)).squeeze(1)
                if counted is not None and device.type == "cuda":
                    counted = counted.pin_memory()  # uploaded per batch and layer: asynchronously
                memo: dict[int, Tensor] = {}  # layers of one kind share their masks and rotary tables: stored once
                inputs = [_to((args, kwargs), "cpu", non_blocking=True, memo=memo) for _, args, kwargs in seen]
                streams.append(_Stream(hidden, hidden, inputs, mask, counted))
    finally:
        if use_cache is not None:
            model.config.use_cache = use_cache
        with _without_blocks(model):
            model.to("cpu")
    return streams


def _block_output(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple | list) else out


def _exit_stage(model: nn.Module, index: int, streams: Sequence[_Stream], device: torch.device,
                activation_dtype: torch.dtype, pruned: bool = True) -> None:
    """After block `index`, the last of its stage (`adapters.stage_exit`: Swin's patch merging, never pruned),
    both streams (the dense one only, without `pruned`) through the stage's exit: the next block's inputs.
    Nothing for a block without one."""
    module = stage_exit(model, index)
    if module is None:
        return
    stored = _to_compute(module, device)
    try:
        with torch.no_grad():
            for s in streams:
                args = _to(s.args, device)  # the stage's own arguments (Swin: the grid's height and width)
                s.hidden = _offload(module(s.hidden.to(device, torch.float32), *args), activation_dtype)
                if pruned:
                    s.pruned = _offload(module(s.pruned.to(device, torch.float32), *args), activation_dtype)
    finally:
        _to_stored(module, stored, "cpu")


def _run(block: nn.Module, hidden: Tensor, stream: _Stream | Sequences, device: torch.device) -> Tensor | None:
    """block(hidden) on the device; None when a hook stopped it early."""
    try:
        # uploaded as stored (asynchronously from pinned memory), converted on the device
        x = hidden.to(device, non_blocking=True).to(torch.float32)
        return _block_output(block(x, *_to(stream.args, device, non_blocking=True),
                                   **_to(stream.kwargs, device, non_blocking=True)))
    except _Stop:
        return None


def _refine(block: nn.Module, streams: Sequence[_Stream], config: RefineConfig,
            device: torch.device) -> RefineReport:
    """Block reconstruction of a pruned block: its pruned-stream output fitted to the dense stream's (which
    `streams[*].hidden` holds once the dense block has run)."""
    batches = [Sequences(s.pruned, s.hidden, s.args, s.kwargs, s.mask) for s in streams]
    train, held_out = split(batches, config.held_out, config.seed)
    return BlockReconstruction(block, config).fit(train, held_out, lambda b, seqs: _run(b, seqs.x, seqs, device))


def _inputs_of(module: nn.Module, stop: bool) -> tuple[dict[str, Tensor], Any]:
    """A hook storing the module's input; with `stop`, the block stops right there."""
    store: dict[str, Tensor] = {}

    def hook(_module, inputs):
        store["x"] = inputs[0].detach()
        if stop:
            raise _Stop

    return store, module.register_forward_pre_hook(hook)


def _rows(x: Tensor, stream: _Stream) -> Tensor:
    """(batch, seq, d) -> (tokens, d) float64 over the stream's counted tokens, without a host
    synchronisation (the index was formed on the CPU)."""
    rows = x.reshape(-1, x.shape[-1])
    if stream.counted is not None and stream.mask.numel() == rows.shape[0]:
        rows = rows.index_select(0, stream.counted.to(rows.device, non_blocking=True))
    return rows.double()


GQA_UNITS = ("query-heads", "kv-groups")
# methods without bias compensation: no intercept in a projection's bias, and a removed sub-layer adds zeros
# instead of its mean (FLAP compensates; magnitude and Wanda-sp keep the kept weights as they are)
UNCOMPENSATED = ("mp", "wanda-sp")
# methods whose paper gives a bias-free output projection (Llama's) a bias to compensate into (FLAP)
ADDS_BIAS = ("flap",)


def check_gqa(gqa: str) -> None:
    if gqa not in GQA_UNITS:
        raise InputError(f"gqa must be one of {', '.join(GQA_UNITS)} (got {gqa!r})")


def group_cost(model: nn.Module, kind: str, sequence_length: int, gqa: str = "query-heads", index: int = 0,
               shared: bool = False) -> float:
    """Multiply-adds one group of block `index` costs per token of the model's input: a head group's q/k/v/o rows
    and its attention over `sequence_length` keys (a window's where the windows are separate products, Swin's), or
    one FFN neuron's rows. A sliding-window layer (Gemma, Mistral, ModernBERT's local layers) costs the full length:
    the exported graph, which the latency is measured on, computes every score and masks those outside the window.
    A single query head under GQA (`gqa` query-heads) carries a 1/group share of its KV head's k/v rows: they are
    saved only once the KV head empties. A block of a later stage (Swin) sees a share of the tokens at a wider
    stream. `shared`: one neuron of a MoE layer's shared expert (`FamilyAdapter.shared_down`), which every token
    visits."""
    adapter, d = adapter_at(model, index), dims(model, index)  # a MoE family's dense layer: its own FFN
    hidden = block_hidden(model, index)
    share = adapter.stage_tokens ** stage_of(model, index)[0]
    if kind == "attention_heads" and adapter.latent_attention:  # a head's query, key / value and output rows
        c = model.config
        qk = int(c.qk_nope_head_dim) + int(c.qk_rope_head_dim)
        rows = (c.q_lora_rank or hidden) * qk + int(c.kv_lora_rank) * (int(c.qk_nope_head_dim) + int(c.v_head_dim))
        return share * float(rows + d.head_dim * hidden + sequence_length * (qk + d.head_dim))
    if kind == "attention_heads" and adapter.recurrent and adapter.heads_prunable:
        return share * _mixer_unit_cost(model, index)
    if kind == "attention_heads" and adapter.recurrent:  # a linear-attention mixer without heads: whole
        return 0.0
    if kind == "attention_heads":
        if adapter.window_key is not None:
            sequence_length = min(sequence_length, int(getattr(model.config, adapter.window_key)) ** 2)
        heads = 1 if gqa == "query-heads" else d.group  # query heads in one group
        q = 2 if adapter.gated_query else 1  # a gated query's rows: its query's and its gate's
        owner, _, name = adapter.v.rpartition(".")
        attention = submodule(layers(model)[index], owner)  # Gemma 4's global layers' values are their keys:
        kv = 1 if attention is not None and getattr(attention, name, False) is None else 2  # v_proj None
        projections = hidden * d.head_dim * ((q + 1) * heads + kv * heads / d.group)  # q and o; k and v shared
        return share * float(projections + 2 * sequence_length * d.head_dim * heads)
    if shared:  # its input projections' rows and its down projection's column, at every token
        return share * float(hidden * (1 + len(adapter.shared_up) + int(adapter.shared_fused_up)))
    if adapter.experts:  # one neuron of every expert: a token passes through top-k of them (SwiGLU)
        return share * float(hidden * 3 * int(getattr(model.config, adapter.experts_per_token_key)))
    return share * float(hidden * (1 + adapter.up_matrices))


def _one_group_ssd(model: nn.Module, index: int) -> bool:
    """Whether block `index`'s linear-attention mixer is a Mamba2 mixer of one group (its units heads)."""
    mixer = linear_mixer(model, index)
    return is_ssd(mixer) and int(mixer.n_groups) == 1


def parallel_mixer_cost(model: nn.Module, index: int) -> float:
    """Multiply-adds per token of block `index`'s mixer beside its attention (`FamilyAdapter.parallel_mixer`:
    Falcon-H1's Mamba2, kept whole): its projections and depthwise conv (a multiply-add a weight) and its state's reads
    and writes, which only the layer's removal saves; 0 where the family has none."""
    path = adapter_for(model).parallel_mixer
    if path is None:
        return 0.0
    return _whole_mixer_cost(layers(model)[index].get_submodule(path), recurrent=True)


def _whole_mixer_cost(mixer: nn.Module, recurrent: bool) -> float:
    """Multiply-adds per token of a mixer kept whole: its projections and depthwise conv (a multiply-add a weight) and,
    where it carries a recurrent state (`recurrent`), that state read and written."""
    weights = sum(m.weight.numel() for m in mixer.modules() if isinstance(m, nn.Linear | nn.Conv1d))
    return float(weights + (4 * recurrent_state_size(mixer) if recurrent else 0))


def _mixer_unit_cost(model: nn.Module, index: int) -> float:
    """Multiply-adds per token of one unit of block `index`'s linear-attention mixer (`surgery.mixer_units`): a Mamba2
    mixer's group or head (`surgery.ssd_unit_heads`: its heads' z, x and time-step rows, output columns, conv taps and
    state, a group's B and C rows); a short convolution's channel (its B, C and x rows, output column, conv taps); a
    Gated DeltaNet's key group (one key head, the r value heads reading it): its query and key rows, its value heads'
    value, gate, beta and decay rows and output columns, their conv taps, and each value head's state (key size x value
    size) read and written a token."""
    mixer = linear_mixer(model, index)
    hidden = block_hidden(model, index)
    if is_ssd(mixer):  # a Mamba2 unit's heads: z, x and dt rows, output columns, conv taps, state; a group's B and C
        r, size, taps = ssd_unit_heads(mixer), int(mixer.head_dim), int(mixer.conv1d.kernel_size[0])
        shared = 2 * int(mixer.ssm_state_size) if int(mixer.n_groups) > 1 else 0
        return float(hidden * (r * (3 * size + 1) + shared) + taps * (r * size + shared)
                     + 4 * r * size * int(mixer.ssm_state_size))
    if is_short_conv(mixer):  # LFM2's
        return float(4 * hidden + int(mixer.conv.kernel_size[0]))
    hk, hv = int(mixer.head_k_dim), int(mixer.head_v_dim)
    r = int(mixer.num_v_heads) // int(mixer.num_k_heads)
    rows = 2 * hk + 2 * r * hv + 2 * r  # q, k; v, z; b, a
    taps = int(mixer.conv1d.kernel_size[0]) * (2 * hk + r * hv)
    return float(hidden * (rows + r * hv) + taps + 4 * r * hk * hv)


def recurrent_state_size(mixer: nn.Module) -> int:
    """Entries of a linear-attention mixer's recurrent state, each read and written a token: a Gated DeltaNet's, key
    size x value size a value head; a Mamba2 mixer's, head size x state size a head."""
    if hasattr(mixer, "ssm_state_size"):  # Mamba2
        return int(mixer.num_heads) * int(mixer.head_dim) * int(mixer.ssm_state_size)
    return int(mixer.num_v_heads) * int(mixer.head_k_dim) * int(mixer.head_v_dim)


def stand_in_scale(model: nn.Module, block: nn.Module) -> Tensor | None:
    """What a removed block leaves of the stream besides the stream itself: its output scalar
    (`FamilyAdapter.layer_scale`, Gemma 4's; `remove_layers` carries it into the next kept block), or None."""
    path = adapter_for(model).layer_scale
    return None if path is None else getattr(block, path).detach()


def _head_rows(d: TransformerDims, gqa: str) -> int:
    """The output projection's input columns of one prunable head unit: a query head's, or a KV group's."""
    return d.head_dim if gqa == "query-heads" else d.group * d.head_dim


def attention_fixed_cost(model: nn.Module, index: int = 0) -> float:
    """Multiply-adds per token of block `index`'s attention that no head owns, which only its removal saves:
    multi-head latent attention's down-projections into the query latent and the shared key / value latent with its
    rotary key (`FamilyAdapter.latent_attention`); a linear-attention mixer's projections and its state's reads and
    writes, all of it, where its units are not prunable (`FamilyAdapter.linear_heads` off); a Mamba2 mixer's B and C
    where it has one group (its heads the units); 0 elsewhere (a Gated DeltaNet's key groups, a short convolution's
    channels, a Mamba2 mixer's groups own its every part)."""
    record = adapter_at(model, index)
    if record.recurrent and record.heads_prunable:  # its units own all of it (`group_cost`) but a lone group's B and C
        mixer = linear_mixer(model, index)
        if not is_ssd(mixer) or int(mixer.n_groups) > 1:
            return 0.0
        shared = 2 * int(mixer.ssm_state_size)  # B's and C's rows and conv channels, which every head reads
        return float(shared * (block_hidden(model, index) + int(mixer.conv1d.kernel_size[0])))
    if record.recurrent:  # a linear-attention mixer, whole: its projections and its state's update
        mixer = layers(model)[index].get_submodule(adapter_for(model).linear_attention)
        # LFM2's short conv has no state beyond its conv's
        return _whole_mixer_cost(mixer, adapter_for(model).linear_recurrent_state)
    if not adapter_for(model).latent_attention:
        return 0.0
    c = model.config
    hidden = block_hidden(model, index)
    return float(hidden * ((c.q_lora_rank or 0) + int(c.kv_lora_rank) + int(c.qk_rope_head_dim)))


def check_fixed_heads(model: nn.Module, plan: Widths) -> None:
    """Refuse a plan that narrows an attention whose heads are not a prunable unit (`FamilyAdapter.heads_prunable`:
    OLMo 2's), naming every such layer, instead of returning another structure than the one asked for."""
    if not isinstance(plan, Mapping):
        return
    fixed = [(i, record) for i in range(len(layers(model))) if not (record := adapter_at(model, i)).heads_prunable]
    names = [(f"{block_path(model, i)}.{record.o}", i, record) for i, record in fixed]
    narrowed = [(name, record) for name, i, record in names if name in plan and plan[name] < query_heads(model, i)]
    if narrowed:
        why = LINEAR_MIXER if narrowed[0][1].recurrent else FIXED_HEADS
        raise UnsupportedArchitecture(f"{model.config.model_type}'s attention heads are not a prunable unit "
                                      f"({why}), but the plan narrows {', '.join(n for n, _ in narrowed)}")


def prune_blocks(
    source: BlockSource,
    batches: Sequence[dict[str, Tensor]],
    ratio: Widths,
    *,
    method: str = "osscar",
    device: str | torch.device | None = None,
    bias_correction: bool = True,
    weight_by_norm: bool = True,
    activation_dtype: torch.dtype = torch.float32,
    progress: ProgressFn | None = None,
    observe: Callable[[LayerObservation], None] | None = None,
    cost_sequence_length: int = 128,
    gqa: str = "query-heads",
    refine: RefineConfig | None = None,
    skip: Collection[int] = (),
    sublayers: Collection[tuple[int, str]] = (),
    add_bias: bool | None = None,
    token_cap: float | None = None,
    choose_rows: bool = False,
) -> list[LayerReport]:
    """Prune the heads and FFN neurons of every block of `source`, in place (`ratio`: a uniform ratio,
    or the kept groups of each projection by name). Under grouped-query attention the head unit is a
    single query head (`gqa="query-heads"`, the paper's groups) or a whole KV group ("kv-groups").
    `observe` sees each projection's statistics before its solve, with the latency-model cost of one
    group at `cost_sequence_length`. With `refine` (RefineConfig with steps > 0), each pruned block is
    then fitted to the dense block's output (`compressor.transformer.refine`; not with method "mp"); its
    `seconds`, when set, is the allowance of all the fits, each block getting an equal share of what is left;
    `per_solve`, when set, gives each block's fit that multiple of the seconds its own solves took.
    `skip`: blocks removed whole (in-memory sources only): the dense stream runs through them, the pruned
    stream does not, so the blocks after one are solved and fitted against the dense model's stream (what
    the removed block wrote included); they leave the model at the end (`surgery.remove_layers`).
    `sublayers`: (block, kind) of attentions ("attention_heads") and FFNs ("ffn_neurons") removed alone
    (`sublayers.remove_sublayer`), in-memory sources only: the sub-layer's update becomes its calibration mean
    over the dense stream (with `bias_correction`, for the methods that compensate: all but mp and wanda-sp,
    `UNCOMPENSATED`; zeros otherwise), and the rest
    of the block is solved and fitted against the dense block.
    `add_bias`: whether a bias-free output projection gets a bias for its intercept (`surgery.add_bias`; with
    `bias_correction`, for the methods that compensate); None: the method's own choice (`ADDS_BIAS`).
    `token_cap`: each projection's least squares, intercept and a removed sub-layer's mean weigh a token at most
    `token_cap` median tokens (`layerstats.token_weights`; None: every token alike, the paper's objective).
    `choose_rows` (methods that refit): each block keeps, per output projection, the refit rows or the dense
    weight's rows on the same support (with their own intercept), whichever combination gives the lower block
    error on the held-out calibration sequences, before its fit (`_choose_rows`); the choice is reported."""
    check_plan(ratio)
    check_fixed_heads(source.model, ratio)
    add_bias = method in ADDS_BIAS if add_bias is None else add_bias
    if (skip or sublayers) and not isinstance(source, InMemoryBlocks):
        raise ValueError("whole layers and sub-layers are removed from in-memory models only")
    for index, kind in sublayers:
        check_removable(source.model, index, kind)
    check_removable_layers(source.model, sorted(skip))  # before any solve, not once every block is pruned
    check_gqa(gqa)
    if adapter_for(source.model).experts and (method in ADDS_BIAS or add_bias):
        raise UnsupportedArchitecture(f"method {method!r} gives output projections a bias, which is not built for a "
                                      "Mixture-of-Experts layer's experts")
    refine = refine or RefineConfig()
    check_method(refine, method)
    choosing = choose_rows and method not in DENSE_ROWS_METHODS  # the others keep the dense rows anyway
    if not batches:
        raise CalibrationError("no calibration batches")
    device = compute_device(device)
    model = source.model.eval()
    adapter, d = adapter_for(model), dims(model)
    if not adapter.heads_prunable and not isinstance(ratio, Mapping) and ratio > 0:
        emit(progress, warning(f"{model.config.model_type}'s attention heads are not a prunable unit ({FIXED_HEADS}): "
                               "its attentions stay whole, the ratio prunes the FFN neurons"), log)
    if adapter.linear_attention is not None and not adapter.linear_heads and not isinstance(ratio, Mapping) \
            and ratio > 0:
        log.info("%s's linear-attention mixers stay whole (%s): the ratio prunes the FFN neurons and the attention "
                 "layers' heads", model.config.model_type, LINEAR_MIXER)
    if adapter.bias_relay is not None:
        source.load(0)  # the first block computes the bias every block is handed (a streamed one: read early)
    streams = capture_block_inputs(model, batches, device, activation_dtype)
    source.release_rest()  # a streamed checkpoint's embeddings and head leave memory until it is written
    prune_heads_by = prune_query_heads if gqa == "query-heads" else prune_heads
    reports = []
    flat_warned = False  # a projection calibrated on fewer tokens than it keeps inputs: said once
    align_warned = False  # a MoE layer's experts keeping more neurons than planned (`experts.ALIGN`): said once
    unplanned: set[str] = set()  # the units an earlier release's width plan does not name (kept whole): said once
    fitted = 0.0  # seconds the blocks' reconstructions took so far (of `refine.seconds`)
    # the blocks that will be fitted: not removed whole, not both sub-layers removed (they share the allowance)
    fitting = [j for j in range(d.layers) if j not in skip and not {(j, ATTENTION), (j, FFN)} <= set(sublayers)]
    for i in range(d.layers):
        block = source.load(i).eval()
        stored = _to_compute(block, device)
        for s in streams:
            s.layer = i  # this layer's masks and rotary tables
        _host_ready(device)  # the streams' asynchronous copies have landed
        here = block_path(model, i)
        if i in skip:  # removed whole: the dense stream goes through it, the pruned one past it
            scale = stand_in_scale(model, block)  # (times its output scalar, as `remove_layers` leaves it)
            with torch.no_grad():
                for s in streams:
                    s.hidden = _offload(_run(block, s.hidden, s, device), activation_dtype)
                    if scale is not None:
                        s.pruned = s.pruned * scale.to(s.pruned)
            emit(progress, Progress(REMOVED, here, i + 1, d.layers), log)
            _to_stored(block, stored)
            source.store(i)
            _exit_stage(model, i, streams, device, activation_dtype)
            continue
        solving = time.perf_counter()  # what this block's statistics and solves take (`refine.per_solve`)
        # the residual stream this block's projections add to, over the counted tokens
        stream_energy = 0.5 * float(sum(_rows(s.hidden, s).square().sum() for s in streams))  # CPU tensors
        dense = copy.deepcopy(block)  # advances the dense stream; its weights are W_hat
        solved = False  # whether a projection of this block was solved (what a reconstruction fits)
        choices: list[_Rows] = []  # with `choosing`: each solved projection's two sets of rows
        here_adapter = adapter.at(block)  # a MoE family's layer with a dense FFN: that FFN's paths
        for kind, path, norm in _outputs(here_adapter):
            shared = path == here_adapter.shared_down  # Qwen2-MoE's shared expert: its FFN's removal takes it too
            if shared and (i, FFN) in sublayers:
                continue
            if (i, kind) in sublayers:  # removed alone: its update becomes a constant, nothing is solved
                compensate = bias_correction and method not in UNCOMPENSATED
                update = _mean_update(dense, replaced_path(adapter, kind), streams, device, kind == FFN,
                                      activation_dtype, token_cap)
                remove_sublayer(model, i, kind, update if compensate else None)
                emit(progress, Progress(REMOVED, f"{here}.{path}", i + 1, d.layers), log)
                continue
            if kind == ATTENTION and not here_adapter.heads_prunable:  # OLMo 2's, a linear-attention mixer: whole
                continue
            name = f"{here}.{path}"
            linear = kind == ATTENTION and here_adapter.recurrent  # a linear-attention mixer's units
            # units that a plan of an earlier release does not name: kept whole, as then
            unit = "shared experts" if shared else "linear-attention mixers' units" if linear else None
            if unit is not None and isinstance(ratio, Mapping) and name not in ratio:
                if unit not in unplanned:
                    unplanned.add(unit)
                    emit(progress, warning(f"{name}: the width plan names no width for it (a plan from before {unit} "
                                           "were pruned): kept whole, as then; further such layers are not "
                                           "reported"), log)
                continue
            solved = True
            start = time.perf_counter()
            proj, proj_dense = projection(block, path), projection(dense, path)
            costs = functools.partial(_costs, model, i, kind, cost_sequence_length, gqa, stream_energy, shared)
            if is_experts(proj):  # a Mixture-of-Experts FFN: one solve per expert, one width for them all
                width = expert_width(proj)
                planned = width - planned_prune(name, width, ratio)
                kept_width = aligned_width(width, planned)
                if kept_width != planned and not align_warned:
                    align_warned = True
                    emit(progress, warning(f"{name}: its experts keep {kept_width} of {width} neurons where the plan "
                                           f"gives {planned}: an expert's width is a multiple of {ALIGN} "
                                           "(transformers' grouped_mm experts kernel wants 16-byte strides); further "
                                           "such layers are not reported"), log)
                reports += _prune_experts(name, proj, proj_dense, block, dense, streams, width - kept_width, method,
                                          device=device, activation_dtype=activation_dtype, token_cap=token_cap,
                                          observe=observe, progress=progress, costs=costs,
                                          position=(i + 1, d.layers))
                del proj, proj_dense
                continue
            # the intercept folded into the bias: FLAP's bias compensation too; mp and Wanda-sp have none
            # (not a shared expert's: its rows are gate-scaled, so an intercept fitted on them would be scaled too)
            center = bias_correction and method not in UNCOMPENSATED and (proj.bias is not None or add_bias) \
                and not shared
            W_hat = dense_weight(proj_dense).to(dtype=torch.float64)  # d1 x d2
            scale = None
            if weight_by_norm and norm is not None and method not in NO_REFIT_METHODS:  # scores see raw weights
                # post-norm: gamma_c scales output column c before anything reads it, so the error in
                # column c is weighted by gamma_c^2 (undone after the solve)
                scale = floored_scale(dense.get_submodule(norm).weight.detach().abs().double())
                W_hat = W_hat * scale
            stats = LayerStatistics(W_hat, token_cap)
            last = path == here_adapter.down  # the dense block runs to its end once: the next dense input
            x_store, h1 = _inputs_of(proj, stop=True)
            x_hat_store, h2 = _inputs_of(proj_dense, stop=not last)
            # a shared expert's output is scaled by its gate, s(t) = sigmoid(gate x_t) (each stream's own): its
            # rows are s(t) a(t), whose least squares is the error it adds to the stream
            gates = [_gate_of(b, here_adapter) for b in (block, dense)] if shared and here_adapter.shared_gate else []
            try:
                with torch.no_grad():
                    for s in streams:
                        out = _run(dense, s.hidden, s, device)
                        _run(block, s.pruned, s, device)
                        x, x_hat = x_store["x"], x_hat_store["x"]
                        if gates:
                            x, x_hat = x * gates[0][0]["s"], x_hat * gates[1][0]["s"]
                        stats.add(_rows(x, s), _rows(x_hat, s))
                        if last:
                            s.hidden = _offload(out, activation_dtype)
            finally:
                for handle in (h1, h2, *(h for _, h in gates)):
                    handle.remove()
            # a Mamba2 mixer's heads of one group: its inputs' mean squares (uncentred) rescale its gated norm
            energy = stats.H.diagonal().clone() if linear and _one_group_ssd(model, i) else None
            finished = stats.finish(center)
            g = mixer_unit_width(model, i) if linear else _head_rows(dims(model, i), gqa) if kind == ATTENTION else 1
            groups = finished.H.shape[0] // g
            _check_finite(name, finished, activation_dtype)
            num_prune = planned_prune(name, groups, ratio)
            kept_rows = finished.H.shape[0] - num_prune * g
            if not flat_warned and finished.rank is not None and finished.rank <= kept_rows:
                flat_warned = True
                flat = (f"{name}: rank(H) <= {finished.rank} (its calibration tokens) while it keeps {kept_rows} "
                        "inputs: every support whose kept inputs span those tokens reproduces them equally well, "
                        "so the solve cannot rank supports beyond its damping; calibrate on more tokens than a "
                        "projection keeps inputs (further such layers are not reported)")
                emit(progress, warning(flat), log)  # a job's warnings also go to its report
            cut = prune_mixer_units if linear else prune_heads_by if kind == ATTENTION else \
                prune_shared_ffn if shared else prune_ffn
            if energy is not None:
                cut = functools.partial(prune_mixer_units, energy=energy)
            apply = functools.partial(_surgery, model, i, cut, proj, center)
            if choosing:
                apply = functools.partial(_surgery_and_dense_rows, apply, choices, name, block, path, W_hat, scale,
                                          finished, g, center)
            report = prune_layer(
                name, kind, finished, g, num_prune, method, dense_weight=W_hat, scale=scale,
                apply=apply,
                position=(i + 1, d.layers), start=start, observe=observe, rank=finished.rank, progress=progress,
                costs=costs)
            reports.append(report)
            # every name that holds this projection's statistics (H: d1 x d1 float64), weights or last inputs (the
            # partial holds H when choosing rows): freed before the next projection, the rows' choice and the fit
            del finished, stats, W_hat, apply, x_store, x_hat_store, proj, proj_dense, gates
            out = x = x_hat = None
        if choices:
            _host_ready(device)
            picked = _choose_rows(block, choices, streams, refine, device)
            reports = _report_rows(reports, choices, picked)
            log.info("%s: rows kept %s", here, ", ".join(f"{c.name[len(here) + 1:]} {p}"
                                                      for c, p in zip(choices, picked, strict=True)))
            del choices
        if refine.steps and solved:
            _host_ready(device)
            share = _fit_allowance(refine, time.perf_counter() - solving, fitted, sum(j >= i for j in fitting))
            fit = _refine(block, streams, share, device)
            fitted += fit.seconds
            reports[-1] = dataclasses.replace(reports[-1], refine=fit)
            emit(progress, Progress(RECONSTRUCTION, here, i + 1, d.layers, numbers=fit_numbers(fit)), log)
        with torch.no_grad():
            for s in streams:
                s.pruned = _offload(_run(block, s.pruned, s, device), activation_dtype)
        _exit_stage(model, i, streams, device, activation_dtype)
        del dense
        _to_stored(block, stored)  # kept in the checkpoint's dtypes: the refit weights round once, here
        source.store(i)
        _release_memory()
    if skip:
        remove_layers(model, sorted(skip))
    return reports


# bytes of the experts' float64 statistics (H and G) gathered in one pass over the calibration streams: a layer whose
# experts need more is read in several passes, a share of its experts each (Mixtral 8x7B's 8 experts of 14,336
# neurons: 2.1 GB each, one a pass; Qwen3-30B-A3B's 128 of 768: all in one)
EXPERT_STATISTICS_BYTES = 4 * 1024**3
# an expert reads only the tokens routed to it (tokens x top-k / experts on average), often fewer than the neurons it
# keeps: its refit is then underdetermined, and least squares alone shrinks the unseen directions toward zero (a
# tiny Qwen3-MoE keeping 48 of 96 neurons on 9-56 tokens an expert: 0.115 relative output error against magnitude
# pruning's 0.073). Identity rows of weight EXPERT_PRIOR x kept / rows x mean(diag H) pull the refit toward the
# dense weights and weigh a pruned neuron by its weights' norm; the pull fades as the tokens grow (0.059 there;
# 0.045 against 0.047 with eight times the tokens; bench/RESULTS.md, session 51)
EXPERT_PRIOR = 1.0


def _prune_experts(name: str, experts: nn.Module, experts_dense: nn.Module, block: nn.Module, dense: nn.Module,
                   streams: Sequence[_Stream], num_prune: int, method: str, *, device: torch.device,
                   activation_dtype: torch.dtype, token_cap: float | None,
                   observe: Callable[[LayerObservation], None] | None, progress: ProgressFn | None,
                   costs: Callable[[], tuple[float, float]], position: tuple[int, int]) -> list[LayerReport]:
    """The FFN of a Mixture-of-Experts block (`name`: its experts, the width plan's entry): `num_prune` neurons of
    each expert pruned (the aligned width, `experts.aligned_width`), each expert keeping its own. One report for the
    layer, its error the calibration's (the ridge's rows left out), its `experts_kept` each expert's neurons; each
    expert's solve is a SOLVE record of its own.

    Each expert's down projection is solved on the routing-weighted activations of the calibration tokens routed to
    it (`experts.expert_inputs`), both streams read with the pruned stream's routing: the dense stream routes some
    tokens to other experts, and a token's two rows must pair. The experts are read in passes of as many as
    EXPERT_STATISTICS_BYTES holds, each pass solved before the next; the dense stream advances through the whole
    block in the last. Each expert's statistics get identity rows (EXPERT_PRIOR: a ridge toward its dense weights
    that fades as its tokens grow); an expert no calibration token reaches gets them alone, and so keeps its neurons
    of largest down-projection norm, unrefitted. The job warns of such experts and of those that saw fewer tokens
    than they keep neurons."""
    count, width = experts.gate_up_proj.shape[0], expert_width(experts)
    kept_width = width - num_prune
    start = time.perf_counter()
    per_pass = max(1, EXPERT_STATISTICS_BYTES // (8 * width * (width + expert_hidden(experts))))
    kept: list[KeptSolution] = []
    objective = energy = 0.0
    cost, stream_energy = costs()
    for first in range(0, count, per_pass):
        chosen = range(first, min(first + per_pass, count))
        stats = _expert_statistics(experts, experts_dense, block, dense, streams, chosen, device=device,
                                   activation_dtype=activation_dtype, token_cap=token_cap,
                                   last=chosen.stop == count)
        idle = [e for e, st in zip(chosen, stats, strict=True) if st.rows == 0]
        if idle:
            emit(progress, warning(f"{name}: no calibration token reached experts {idle}: they keep their neurons "
                                   "of largest down-projection norm, unrefitted"), log)
        few = [e for e, st in zip(chosen, stats, strict=True) if 0 < st.rows <= kept_width]
        if few:
            emit(progress, warning(f"{name}: experts {few} saw fewer calibration tokens than the {kept_width} "
                                   "neurons they keep: their refit leans on their dense weights; an expert sees "
                                   "about tokens x top-k / experts of the calibration, so calibrate on more"), log)
        for e in chosen:
            st = stats.pop(0)  # out of the list: this expert's H and G go once it is solved
            prior = 1.0 if st.rows == 0 else float(EXPERT_PRIOR * kept_width / st.rows * st.H.diagonal().mean())
            if prior > 0:  # nothing to add (EXPERT_PRIOR 0): the rank bound stays the tokens'
                st.add_ridge(prior)
            finished = st.finish(False)  # no intercept: experts have no bias
            _check_finite(f"{name}.{e}", finished, activation_dtype)
            report = prune_layer(
                f"{name}.{e}", FFN, finished, 1, num_prune, method, dense_weight=st.W_hat, scale=None,
                apply=kept.append, position=position, start=time.perf_counter(), observe=observe,
                rank=finished.rank, progress=progress, costs=lambda: (cost / count, stream_energy), unit=name,
                multiple=ALIGN)
            # the ridge's rows add 1/2 prior ||W - W_hat||^2 to the error (the pruned rows' dense weights included)
            # and 1/2 prior ||W_hat||^2 to the energy, which the solver's objective (error - energy) leaves out: both
            # taken out, what is left is the calibration's
            solution, dense_squares = kept[-1], float(st.W_hat.square().sum())
            kept_rows_dense = st.W_hat[solution.keep]
            change = dense_squares - float(kept_rows_dense.square().sum()) \
                + float((solution.weight - kept_rows_dense).square().sum())
            ridge_energy = 0.5 * prior * dense_squares
            objective += report.objective - (0.5 * prior * change - ridge_energy)
            energy += finished.energy - ridge_energy
            del finished, st  # this expert's H and G, before the next expert's solve
    keep_expert_neurons(experts, [k.keep for k in kept], [k.weight.T.float() for k in kept])
    # one report for the layer (the plan's unit): the experts' errors add up in the stream they all write to
    report = LayerReport.measure(name, FFN, width, kept_width, objective, energy, start)
    return [dataclasses.replace(report, experts_kept=tuple(tuple(k.keep) for k in kept))]


def _expert_statistics(experts: nn.Module, experts_dense: nn.Module, block: nn.Module, dense: nn.Module,
                       streams: Sequence[_Stream], chosen: range, *, device: torch.device,
                       activation_dtype: torch.dtype, token_cap: float | None, last: bool) -> list[LayerStatistics]:
    """One pass over the streams: the statistics of experts `chosen` (their down projections' H and G); with `last`,
    the dense stream advances through the whole block meanwhile."""
    stats = [LayerStatistics(down_weight(experts_dense, e).detach().to(torch.float64), token_cap) for e in chosen]
    captured: dict[str, tuple[Tensor, ...]] = {}

    def capture(key: str, stop: bool) -> Callable[..., None]:
        def hook(_module, args):
            captured[key] = tuple(a.detach() for a in args)  # (x (tokens, hidden), top_k_index, top_k_weights)
            if stop:
                raise _Stop
        return hook

    h1 = experts.register_forward_pre_hook(capture("pruned", True))
    h2 = experts_dense.register_forward_pre_hook(capture("dense", not last))
    try:
        with torch.no_grad():
            for s in streams:
                out = _run(dense, s.hidden, s, device)
                _run(block, s.pruned, s, device)
                x, index, weights = captured.pop("pruned")
                x_hat = captured.pop("dense")[0]
                rows = None
                if s.counted is not None and s.mask.numel() == x.shape[0]:
                    rows = s.counted.to(x.device)
                pairs = zip(expert_inputs(experts, x, index, weights, rows, chosen),
                            expert_inputs(experts_dense, x_hat, index, weights, rows, chosen), strict=True)
                for st, (a, a_hat) in zip(stats, pairs, strict=True):
                    if a.shape[0]:
                        st.add(a.double(), a_hat.double())
                if last:
                    s.hidden = _offload(out, activation_dtype)
    finally:
        h1.remove()
        h2.remove()
    return stats


def _fit_allowance(refine: RefineConfig, solve_seconds: float, fitted: float, blocks_left: int) -> RefineConfig:
    """One block's fit: the pipeline's allowance (`refine.seconds`, a job's time budget) shared by the blocks still
    to fit, and `refine.per_solve` x the seconds this block's solves took; the tighter one binds, and the floor of
    `refine.min_steps` holds only under the per-solve allowance (a time budget is not overrun for it)."""
    paced = None if refine.seconds is None else max(0.0, refine.seconds - fitted) / blocks_left
    matched = None if refine.per_solve is None else refine.per_solve * solve_seconds
    if matched is None:
        return refine if paced is None else dataclasses.replace(refine, seconds=paced, budgeted=True)
    if paced is not None and paced < matched:
        return dataclasses.replace(refine, seconds=paced, min_steps=0, budgeted=True)
    return dataclasses.replace(refine, seconds=matched)


def _outputs(adapter: FamilyAdapter) -> list[tuple[str, str, str | None]]:
    """(kind, path, the norm after it) of a block's solved output projections, in the order they are solved: the
    attention's, a MoE layer's shared expert's (before the routed experts, whose last pass advances the dense
    stream), the FFN's."""
    shared = [(FFN, adapter.shared_down, None)] if adapter.shared_down is not None else []
    return [(ATTENTION, adapter.o, adapter.o_norm), *shared, (FFN, adapter.down, adapter.down_norm)]


def _gate_of(block: nn.Module, adapter: FamilyAdapter) -> tuple[dict[str, Tensor], Any]:
    """A hook storing, as the block's shared expert is called, its gate's value at each token: sigmoid(gate x)
    (tokens, 1)."""
    store: dict[str, Tensor] = {}
    gate = block.get_submodule(adapter.shared_gate)

    def hook(_module, inputs):
        store["s"] = torch.sigmoid(gate(inputs[0])).detach()

    return store, block.get_submodule(adapter.shared_down.rpartition(".")[0]).register_forward_pre_hook(hook)


def _surgery(model: nn.Module, index: int, cut: Callable[..., None], proj: nn.Module, center: bool,
             kept: KeptSolution) -> None:
    """A projection's kept heads or neurons and its refit weight into block `index` (`cut`: the surgery of its unit);
    the intercept into its bias."""
    new_weight = kept.weight.T.float()  # (out, kept)
    if center:  # the intercept: the refit output's mean matches the dense one
        add_bias(proj)
        proj.bias.data += kept.shift.to(proj.bias)
    cut(model, index, kept.keep, new_weight)


REFIT_ROWS, DENSE_ROWS = "refit", "dense"  # a projection's kept rows under `choose_rows`


@dataclass
class _Rows:
    """A solved projection's kept rows two ways, each with its bias: the refit the surgery installed, and the dense
    weight's rows on the same support with their own intercept (`choose_rows`)."""

    name: str
    proj: nn.Module
    refit: tuple[Tensor, Tensor | None]  # (kept x out weight as `dense_weight` gives it, bias or None)
    dense: tuple[Tensor, Tensor | None]

    def install(self, which: str) -> None:
        weight, bias = self.refit if which == REFIT_ROWS else self.dense
        set_weight(self.proj, weight)
        if bias is not None:
            self.proj.bias.data.copy_(bias)


def _surgery_and_dense_rows(surgery: Callable[[KeptSolution], None], choices: list[_Rows], name: str,
                            block: nn.Module, path: str, W_hat: Tensor, scale: Tensor | None,
                            stats: FinishedStatistics, group_size: int, center: bool, kept: KeptSolution) -> None:
    """`surgery` of the refit solution, and the same support's dense rows beside it in `choices` (W_hat: the
    solver's d1 x d2 dense weight, columns scaled by `scale`; their intercept nu - mu_kept W_hat_kept)."""
    surgery(kept)
    proj = projection(block, path)  # as the surgery left it
    dense = kept_rows(W_hat, kept.keep, group_size, scale, stats)
    refit_bias = None if proj.bias is None else proj.bias.detach().clone()
    dense_bias = None
    if center:  # the surgery's bias holds the refit's intercept: swap it for the dense rows'
        dense_bias = refit_bias - kept.shift.to(refit_bias) + dense.shift.to(refit_bias)
    installed = dense_weight(proj)
    choices.append(_Rows(name, proj, (installed.clone(), refit_bias), (dense.weight.to(installed), dense_bias)))


def _choose_rows(block: nn.Module, choices: Sequence[_Rows], streams: Sequence[_Stream], config: RefineConfig,
                 device: torch.device) -> list[str]:
    """Install, of every combination of refit and dense rows of the block's solved projections, the one with the
    lowest error of the block fed the pruned stream against the dense block's output, on the held-out sequences
    of its fit (`refine.split`: the same ones, so the fit's held-out error starts from it). The layer solves cannot
    make this choice: on their own calibration least squares the refit is optimal by construction; a model whose
    few tokens of massive activation dominate that least squares (SmolLM2) can still lose by it downstream."""
    sequences = [Sequences(s.pruned, s.hidden, s.args, s.kwargs, s.mask) for s in streams]
    held_out = split(sequences, config.held_out, config.seed)[1]
    judge = BlockReconstruction(block, config)

    def run(b: nn.Module, seqs: Sequences) -> Tensor:
        return _run(b, seqs.x, seqs, device)

    best, lowest = None, float("inf")
    for combination in itertools.product((REFIT_ROWS, DENSE_ROWS), repeat=len(choices)):
        for rows, which in zip(choices, combination, strict=True):
            rows.install(which)
        error = judge.error(held_out, run)
        log.debug("%s: held-out block error %.6g", dict(zip([c.name for c in choices], combination, strict=True)),
                  error)
        if error < lowest:
            best, lowest = combination, error
    assert best is not None, "no combination of rows had a finite held-out error"
    for rows, which in zip(choices, best, strict=True):
        rows.install(which)
    return list(best)


def _report_rows(reports: list[LayerReport], choices: Sequence[_Rows], picked: Sequence[str]) -> list[LayerReport]:
    """The reports with the rows each chosen projection kept (by name: a MoE layer's experts choose none)."""
    rows = {c.name: p for c, p in zip(choices, picked, strict=True)}
    return [dataclasses.replace(r, rows=rows[r.name]) if r.name in rows else r for r in reports]


def _mean_update(dense: nn.Module, path: str, streams: Sequence[_Stream], device: torch.device, last: bool,
                 activation_dtype: torch.dtype, token_cap: float | None = None) -> Tensor:
    """The calibration mean of what a sub-layer of the dense block adds to the stream (the output of the module at
    `path`, which its removal replaces: `sublayers.replaced_path`; over the counted tokens of the dense stream),
    (hidden,) float32 on the device: the update that best stands in for it as one vector. `last`: the dense stream
    advances through the whole block meanwhile. `token_cap`: each token weighted by `token_weights` of its update.
    The replaced module, not the output projection: Qwen2-MoE's FFN adds its shared expert beside its experts."""
    store: dict[str, Tensor] = {}

    def hook(_module, _inputs, output):
        first = output[0] if isinstance(output, tuple | list) else output  # an attention's (output, weights)
        store["y"] = first.detach().clone()  # the block may add into it in place (Falcon: mlp_output += attention)
        if not last:
            raise _Stop

    total = count = torch.zeros((), dtype=torch.float64, device=device)
    handle = dense.get_submodule(path).register_forward_hook(hook)
    try:
        with torch.no_grad():
            for s in streams:
                out = _run(dense, s.hidden, s, device)
                rows = _rows(store.pop("y"), s)  # (tokens, hidden)
                if token_cap:  # weighted: w @ rows, no weighted copy of the rows
                    w = token_weights(rows, token_cap)
                    total, count = total + w @ rows, count + w.sum()
                else:
                    total, count = total + rows.sum(0), count + rows.shape[0]
                if last:
                    s.hidden = _offload(out, activation_dtype)
    finally:
        handle.remove()
    return (total / count.clamp_min(1e-30)).float()


def _costs(model: nn.Module, index: int, kind: str, sequence_length: int, gqa: str, stream_energy: float,
           shared: bool = False) -> tuple[float, float]:
    """What a projection's observation adds to its statistics: one group's FLOPs, the stream's energy."""
    return group_cost(model, kind, sequence_length, gqa, index, shared), stream_energy


def resize_transformer(model: nn.Module, plan: Widths, gqa: str = "query-heads", skip: Collection[int] = (),
                       sublayers: Collection[tuple[int, str]] = ()) -> nn.Module:
    """A copy of `model` with every block at the plan's widths (the names `prune_blocks` reports), weights
    sliced, nothing solved: the structure, and so the latency, that pruning to `plan` returns. Target mode
    measures these to search the widths before it pays for a solve.

    Single query heads (`gqa` query-heads) are kept spread over the KV heads (the first query head of each
    KV head, then the second, ...): the most KV heads a solve can keep at that width, so the latency is
    never flattered by KV heads that a solve's choice of heads would rarely empty. `skip` and `sublayers`:
    removed whole layers and sub-layers, as `prune_blocks` takes them."""
    check_plan(plan)
    check_fixed_heads(model, plan)
    check_gqa(gqa)
    check_removable_layers(model, sorted(skip))  # before the copy and the slicing
    resized = copy.deepcopy(model).to("cpu").eval()
    adapter, d = adapter_for(resized), dims(resized)
    single = gqa == "query-heads"
    with torch.no_grad():
        for i in range(d.layers):
            if i in skip:  # removed below: the plan need not name its widths
                continue
            for kind in KINDS:
                if (i, kind) in sublayers:  # removed alone: the plan need not name its width either
                    remove_sublayer(resized, i, kind)
            here = block_path(resized, i)
            record = adapter.at(layers(resized)[i])  # a linear-attention block's mixer
            linear = record.recurrent and record.heads_prunable  # a linear-attention mixer's units, in either gqa
            heads = 0 if (i, ATTENTION) in sublayers else mixer_units(resized, i) if linear else \
                query_heads(resized, i) if single else head_groups(resized, i)
            prunable = heads and record.heads_prunable  # OLMo 2's heads stay whole
            if linear and isinstance(plan, Mapping) and f"{here}.{record.o}" not in plan:
                prunable = False  # an earlier release's plan, which kept every linear-attention mixer whole
            kept = heads - planned_prune(f"{here}.{record.o}", heads, plan) if prunable else heads
            if linear and kept < heads:
                prune_mixer_units(resized, i, torch.arange(kept))
            elif kept < heads:
                # query head h reads KV head h // group: order by (rank within its KV group, KV head)
                group = dims(resized, i).group  # (Gemma 4's global layers: their own)
                spread = sorted(range(heads), key=lambda h: (h % group, h // group)) if single else range(heads)
                keep = torch.tensor(sorted(spread[:kept]))
                (prune_query_heads if single else prune_heads)(resized, i, keep)
            if (i, FFN) in sublayers:
                continue
            block = adapter.at(layers(resized)[i])  # a MoE family's layer with a dense FFN: that FFN's paths
            down = projection(layers(resized)[i], block.down)
            neurons = in_features(down)
            kept = neurons - planned_prune(f"{here}.{block.down}", neurons, plan)
            if is_experts(down):
                kept = aligned_width(neurons, kept)
            if kept < neurons:
                prune_ffn(resized, i, torch.arange(kept))
            shared = f"{here}.{block.shared_down}"
            if block.shared_down is not None and not (isinstance(plan, Mapping) and shared not in plan):
                neurons = in_features(projection(layers(resized)[i], block.shared_down))
                kept = neurons - planned_prune(shared, neurons, plan)  # an earlier release's plan: kept whole
                if kept < neurons:
                    prune_shared_ffn(resized, i, torch.arange(kept))
    if skip:
        remove_layers(resized, sorted(skip))
    return resized


@dataclass(frozen=True)
class RemovalLoss:
    """What removing a block, or one of its sub-layers, changes (relative to the stream the block reads, as a width
    curve's loss is): `removal_losses`."""

    layer: float
    attention: float | None  # None: not removable alone (`sublayers.check_removable`)
    ffn: float | None


@torch.no_grad()
def removal_losses(model: nn.Module, batches: Sequence[dict[str, Tensor]], device: str | torch.device | None = None,
                   activation_dtype: torch.dtype = torch.float32, sublayers: bool = True,
                   compensate: bool = True, token_cap: float | None = None) -> list[RemovalLoss]:
    """Each block's removal loss in the currency of the width curves: ||block(h) - h||^2 / ||h||^2 over the
    counted tokens of the calibration batches (dense model, one pass; a block whose output scalar c stays with the
    stream, `stand_in_scale`: ||block(h) - c h||^2 / ||c h||^2); with `sublayers`, also its attention's
    and its FFN's alone: ||block(h) - block'(h)||^2 / ||h||^2, block' the block with that sub-layer's update
    made its calibration mean (`compensate`; zeros otherwise; weighted by `token_cap`), as `prune_blocks`
    removes it.

    Removing a block takes its whole update out of the residual stream, and a width loss is an error in a
    projection's output relative to the stream the block reads (`prune_blocks`' `stream_energy`, h's); over
    the same denominator the two are error energies one allocation can add. Over the stream the block writes
    (block(h)), where it grows (SmolLM2's massive activations: ~100x in one layer) a removal was priced that
    much cheaper than the widths of the same layer. It is also ShortGPT's and SLEB's question (which layer
    changes the stream least), asked in the units the widths are priced in."""
    device = compute_device(device)
    model = model.eval()
    adapter = adapter_for(model)
    streams = capture_block_inputs(model, batches, device, activation_dtype)
    losses = []
    for i, block in enumerate(layers(model)):
        stored = _to_compute(block, device)
        for s in streams:
            s.layer = i
        kinds = []
        if sublayers:
            for kind in KINDS:
                try:
                    check_removable(model, i, kind)
                except (ValueError, UnsupportedArchitecture):
                    continue
                update = (_mean_update(block, replaced_path(adapter, kind), streams, device, False, activation_dtype,
                                       token_cap) if compensate else None)
                kinds.append((kind, update))
        outputs, stream, update_energy = [], 0.0, 0.0
        scale = stand_in_scale(model, block)  # a removed block leaves the stream times its output scalar
        for s in streams:
            out = _run(block, s.hidden, s, device)
            left = s.hidden.to(out) if scale is None else s.hidden.to(out) * scale.to(out)
            update_energy += float(_rows(out - left, s).square().sum())
            stream += float(_rows(left, s).square().sum())  # the stream it leaves: its update relative to that
            outputs.append(_offload(out, activation_dtype))  # the next block's input; compared with below
        stream = max(stream, 1e-30)
        alone: dict[str, float] = {}
        for kind, update in kinds:
            with sublayer_removed(model, i, kind, update):
                change = 0.0
                for s, out in zip(streams, outputs, strict=True):
                    without = _run(block, s.hidden, s, device)
                    change += float(_rows(out.to(without) - without, s).square().sum())
                alone[kind] = change / stream
        _host_ready(device)
        for s, out in zip(streams, outputs, strict=True):
            s.hidden = out
        del outputs
        _exit_stage(model, i, streams, device, activation_dtype, pruned=False)
        _to_stored(block, stored, "cpu")
        losses.append(RemovalLoss(update_energy / stream, alone.get(ATTENTION), alone.get(FFN)))
    return losses


def _release_memory() -> None:
    """Give a finished block's memory back: CUDA's cache, and glibc's free lists (without this, freed
    blocks stay in the process and RSS creeps up block after block)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        with suppress(OSError):  # not glibc (musl): nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def prune_transformer(model: nn.Module, batches: Sequence[dict[str, Tensor]], ratio: Widths,
                      **options: Any) -> tuple[nn.Module, list[LayerReport]]:
    """A pruned copy of an in-memory model (the input is left unchanged) and its layer reports;
    options as `prune_blocks`."""
    pruned = copy.deepcopy(model).to("cpu")
    reports = prune_blocks(InMemoryBlocks(pruned), batches, ratio, **options)
    return pruned, reports
