"""ONNX export through the dynamo exporter, with a torch-vs-ONNX Runtime parity gate."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx

from compressor.precision import float32_view
from compressor.transformer.adapters import ADAPTERS, adapter_at, max_sequence
from compressor.transformer.attention import GATHERED
from compressor.transformer.experts import experts_as_operator, kept_in_float32, routing_settled
from compressor.transformer.sublayers import kv_layers

from .experts import translation_table
from .recurrent import (
    CHUNK,
    chunk_for,
    has_chunked_scans,
    scanned_linear_attention,
    spanning_chunks,
    stepped_scan,
    tiled,
    traced_chunk,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParityTolerance:
    """How far an export may be from PyTorch, relative to the scale of each compared output.

    With t the PyTorch output, o the ONNX Runtime one and s = RMS(t) over the whole tensor:

    * peak: max_i |o_i - t_i| / (s + |t_i|) -- every element's error against the output's typical size
      (its own size where it is larger: half precision rounds relative to each value's magnitude, so an
      outlier feature of 20x the RMS carries a proportionally larger rounding error);
    * aggregate: RMS(o - t) / s -- the error of the output as a whole, which catches a small systematic
      error (a wrong epsilon, a slightly wrong weight) that stays under the peak bound everywhere.

    Absolute tolerances do not scale: a deep LM's logits (RMS ~10) carry fp32 reduction-order noise
    larger than an encoder's hidden states (RMS ~0.3) do.
    """

    peak: float
    aggregate: float


# Measured here on fp32 / fp16 exports (errors as defined above; bench-free, tests/exporters/test_onnx_parity.py
# has the deep case): ResNet-20/56 logits 8.6e-7 / 2.6e-3 peak; all-MiniLM-L6-v2 hidden states 6.6e-6 / 7.8e-3
# (an outlier feature 23x the RMS); stories260K logits 1.2e-6 / 3.1e-3; a random-init 30-layer Llama with
# vocabulary 49152 and logits of RMS 15: 3.2e-6 / 8.8e-3. Aggregates were 0.15-0.5x the peaks (at most
# 1.2e-6 / 1.4e-3). Trained LLMs are noisier than any of these (massive activations): a 135M-parameter one
# had fp32 logits off by 7.6e-3 absolute at a scale of ~10-30 (<= 7.6e-4 of it) and a decoder's fp16 export
# 2.5e-2 absolute. The limits sit above those, 2.6x (fp32) and 5.7x (fp16, measured) over the worst. An
# export that computes another model is off by more: one FFN weight of a 12-layer decoder 2% off gives
# 5.2e-3 / 1.1e-3 (peak / aggregate), refused in fp32; a wrong op, mask or layer gives O(0.1-1).
PARITY_TOLERANCES = {"fp32": ParityTolerance(peak=2e-3, aggregate=5e-4),
                     "fp16": ParityTolerance(peak=5e-2, aggregate=1e-2)}


@dataclass(frozen=True)
class Parity:
    """How close an export came to PyTorch: each error field the largest over the outputs (they may come from
    different outputs; each output is judged alone, see ParityTolerance)."""

    max_abs_error: float
    peak_error: float  # max |o - t| / (RMS(t) + |t|)
    aggregate_error: float  # RMS(o - t) / RMS(t)


@dataclass
class ParityMismatch:
    output: str
    problem: str
    peak_error: float | None = None
    aggregate_error: float | None = None
    max_abs_error: float | None = None


@dataclass
class ParityError(RuntimeError):
    """Every difference between the PyTorch model and its ONNX export, in one error."""

    mismatches: list[ParityMismatch] = field(default_factory=list)

    def __str__(self) -> str:
        return "ONNX export does not match PyTorch: " + "; ".join(f"{m.output}: {m.problem}" for m in self.mismatches)


ERROR_CHUNK = 1 << 22  # elements per step of `output_errors` (32 MB in float64)


def output_errors(got: np.ndarray, expected: np.ndarray) -> Parity:
    """The errors of one output (`got` from ONNX Runtime, `expected` from PyTorch), as ParityTolerance
    defines them. Non-finite values count as infinitely wrong unless both sides agree on them.

    Computed `ERROR_CHUNK` elements at a time: whole-array float64 temporaries of a decoder's logits (16 x 128
    tokens x a 128,256 vocabulary: 2.1 GB each, half a dozen of them) took a 1B model's job to the machine's
    memory."""
    if not got.size:
        return Parity(0.0, 0.0, 0.0)
    t_all, o_all = expected.reshape(-1), got.reshape(-1)
    chunks = range(0, t_all.size, ERROR_CHUNK)
    squares, count = 0.0, 0  # the scale: RMS of the finite expected values
    for start in chunks:
        t = t_all[start:start + ERROR_CHUNK].astype(np.float64)
        finite = t[np.isfinite(t)]
        squares, count = squares + float(np.sum(finite**2)), count + finite.size
    scale = float(np.sqrt(squares / count)) if count else 0.0
    scale = scale if scale > 0 else 1.0  # an all-zero output: errors are absolute
    max_abs = peak = squared = 0.0
    for start in chunks:
        t = t_all[start:start + ERROR_CHUNK].astype(np.float64)
        o = o_all[start:start + ERROR_CHUNK].astype(np.float64)
        same = (t == o) | (np.isnan(t) & np.isnan(o))  # equal infinities and NaNs in the same places agree
        diff = np.where(same, 0.0, np.abs(o - t))
        diff = np.where(np.isnan(diff), np.inf, diff)
        with np.errstate(invalid="ignore", over="ignore"):
            peak = max(peak, float(np.max(diff / (scale + np.nan_to_num(np.abs(t), posinf=0.0)))))
            squared += float(np.sum(diff**2))
        max_abs = max(max_abs, float(diff.max()))
    with np.errstate(invalid="ignore", over="ignore"):
        aggregate = float(np.sqrt(squared / t_all.size) / scale)
    return Parity(max_abs, peak, aggregate)


def export_onnx(
    module: fx.GraphModule | torch.nn.Module,
    example: torch.Tensor,
    path: str | Path,
    *,
    input_name: str = "x",
    output_name: str = "logits",
    opset: int = 18,
) -> Path:
    """Export with a dynamic batch dimension, fp32, the model's input name and `output_name` first."""
    batch = torch.export.Dim.DYNAMIC
    return _export(module, (example,), path, weights=module, input_names=[input_name],
                   output_names=[output_name], dynamic_shapes=({0: batch},), opset_version=opset)


EXTERNAL_DATA_BYTES = 2 * 1024**3  # protobuf's limit: larger models keep their weights beside the .onnx


def _export(module: torch.nn.Module, args: tuple[Any, ...], path: str | Path, *, weights: torch.nn.Module,
            **options: Any) -> Path:
    """torch.onnx.export through the dynamo exporter, saved to `path` (with `weights`' size deciding
    whether the weights go to an external data file)."""
    path = Path(path)
    _mark_eval(module)
    with torch.no_grad(), _kept_tensor_attributes(module), exact_constant_rules(), contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_real_rotary(module))
            stack.enter_context(scanned_linear_attention(module))  # linear attention by chunks: any length
            if stack.enter_context(experts_as_operator(module)):  # MoE layers as ONNX Runtime's MoE node
                options = {**options, "custom_translation_table": translation_table()}
            program = torch.onnx.export(module, args, dynamo=True, verbose=False, **options)
        except MemoryError:
            raise
        except Exception as err:  # the tracer's errors run to hundreds of lines: the innermost one's first says why
            cause = next((c for c in _causes(err) if str(c).strip()), err)
            raise ExportError(f"{type(cause).__name__}: {_gist(str(cause))}") from err
    upcast = _upcast_initializers(program.model.graph)
    _drop_trace_metadata(program.model)
    # the size as saved: a half-precision weight read through `float32_view` is written in float32
    size = sum(p.numel() * (4 if upcast else p.element_size()) for p in weights.parameters())
    try:
        program.save(str(path), external_data=size >= EXTERNAL_DATA_BYTES)
    finally:
        _drop_constants(program.model.graph)
    return path


# rotary embeddings computed in complex numbers (torch.polar, view_as_complex), by class name: the ONNX exporter
# translates no complex-valued tensor, so the export rotates with their real and imaginary parts (`_real_rotary`)
COMPLEX_ROTARY = ("DeepseekV2RotaryEmbedding",)


def _real_tables(rotary: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """A complex rotary embedding's tables as (cos, sin) pairs: (batch, length, rotary dim / 2, 2)."""
    freqs = position_ids[..., None].float() * rotary.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack([freqs.cos(), freqs.sin()], -1) * rotary.attention_scaling


def _rotated_real(complex_rotate: Any, xq: torch.Tensor, xk: torch.Tensor,
                  tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What DeepSeek-V2's `apply_rotary_emb` computes (each pair of a head's rotary dims a complex number times
    cos + i sin) in real arithmetic, from `_real_tables`' (batch, length, dim / 2, 2); complex tables (a model
    outside the export) go to the model's own function."""
    if tables.is_complex():
        return complex_rotate(xq, xk, tables)
    cos, sin = tables[..., 0].unsqueeze(1), tables[..., 1].unsqueeze(1)  # (batch, 1, length, dim / 2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # (batch, heads, length, dim / 2, 2): real, imaginary
        real, imag = pairs[..., 0], pairs[..., 1]
        return torch.stack([real * cos - imag * sin, real * sin + imag * cos], -1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


# modeling modules whose `apply_rotary_emb` `_real_rotary` replaced, with how many exports use the replacement
_REAL_ROTARY_USERS: dict[str, int] = {}
_REAL_ROTARY_LOCK = threading.Lock()


@contextlib.contextmanager
def _real_rotary(model: torch.nn.Module) -> Iterator[None]:
    """Within it, `model`'s complex rotary embeddings (`COMPLEX_ROTARY`) give real (cos, sin) tables (through the
    family's `dynamic_rope_update`, as their forward: longrope's tables per input length) and their modeling module
    rotates with them. Complex tables still rotate as before, so another model of the family running meanwhile is
    unchanged, and the module's function is restored when the last export using it ends."""
    import functools
    import sys

    from transformers.modeling_rope_utils import dynamic_rope_update

    found = [m for m in model.modules() if type(m).__name__ in COMPLEX_ROTARY]
    if not found:
        yield
        return
    modeling = sys.modules[type(found[0]).__module__]
    with _REAL_ROTARY_LOCK:
        if not _REAL_ROTARY_USERS.get(modeling.__name__):
            modeling.apply_rotary_emb = functools.partial(_rotated_real, modeling.apply_rotary_emb)
        _REAL_ROTARY_USERS[modeling.__name__] = _REAL_ROTARY_USERS.get(modeling.__name__, 0) + 1
    for rotary in found:
        rotary.forward = functools.partial(dynamic_rope_update(_real_tables), rotary)
    try:
        yield
    finally:
        for rotary in found:
            rotary.__dict__.pop("forward", None)
        with _REAL_ROTARY_LOCK:
            _REAL_ROTARY_USERS[modeling.__name__] -= 1
            if not _REAL_ROTARY_USERS[modeling.__name__]:
                modeling.apply_rotary_emb = modeling.apply_rotary_emb.args[0]


@contextlib.contextmanager
def exact_constant_rules() -> Iterator[None]:
    """Within it, onnxscript's optimizer (which the dynamo exporter and the ORT fusions run) leaves `x + c`, `x - c`,
    `x * c` and `x / c` alone: its no-op rules took c for 0 or 1 within a tolerance (0.7: 1e-8 absolute, 1e-5
    relative), so an RMSNorm's epsilon of 1e-8 (Helium's) was dropped from the graph and a zero vector (a padding
    token's embedding) normalised to NaN, which attention spread to every token of its row. An exact no-op then stays
    in the graph (ONNX Runtime drops it as it loads the graph, and keeps `x + 1e-8`); the Dropout rules stay. A
    release without the private names this reads is left as it is (the test of a 1e-8 epsilon then says so)."""
    try:
        from onnxscript import rewriter
        from onnxscript.rewriter.rules.common import _no_op
    except ImportError:
        yield
        return
    saved = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    keep = {id(r) for r in (_no_op.dropout_zero_rule, _no_op.dropout_inference_rule)}
    approximate = {id(r) for r in _no_op.rules} - keep
    if saved is None or not approximate:
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in saved if id(r) not in approximate)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = saved


# node metadata the exporter records for debugging: each node's Python stack trace (absolute paths of the host
# that exported it, 80 % of a small graph's bytes), FX node name and module namespace
TRACE_METADATA = ("pkg.torch.onnx.", "namespace")


def _drop_trace_metadata(model: Any) -> None:
    """Remove the exporter's per-node debugging metadata (TRACE_METADATA) from every graph and function of `model`:
    a returned artifact would carry the server's file layout to every client, and its size."""
    import onnx_ir as ir

    graphs = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for key in [k for k in node.metadata_props if k.startswith(TRACE_METADATA)]:
                del node.metadata_props[key]


def _gist(message: str, limit: int = 400) -> str:
    """A tracer error's first line, with the lines after it where it ends in a colon (the reason is there: "Found the
    following conflicts ...:"), up to `limit` characters."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0]
    for line in lines[1:]:
        if not text.endswith(":") or len(text) >= limit:
            break
        text += " " + line
    return text[:limit]


class ExportError(RuntimeError):
    """torch.onnx.export could not export the model (one line of why; the tracer's whole error is its cause)."""


def _causes(err: BaseException) -> Iterator[BaseException]:
    """The errors `err` was raised from, the innermost first (torch.onnx wraps the tracer's in its own)."""
    chain = []
    while err.__cause__ is not None and err.__cause__ not in chain:
        err = err.__cause__
        chain.append(err)
    return reversed(chain)


@contextlib.contextmanager
def _kept_tensor_attributes(model: torch.nn.Module) -> Iterator[None]:
    """The model's tensors as they were before an export traced it. A forward that caches a tensor in a plain
    attribute (transformers' longrope rotary embedding sets `long_inv_freq` on its first call) leaves the
    tracer's fake tensor there, after which the model cannot be copied ("Cannot access data pointer of Tensor")
    and computes another model in eager mode: the parity check would compare the export against that."""
    kept = [(m, {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)}, dict(m._buffers))
            for m in model.modules()]
    try:
        yield
    finally:
        for module, attributes, buffers in kept:
            for name in [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and k not in attributes]:
                delattr(module, name)
            for name, value in attributes.items():
                object.__setattr__(module, name, value)
            module._buffers.clear()
            module._buffers.update(buffers)


def _upcast_initializers(graph: Any) -> bool:
    """Turn every half-precision initializer that is only read through Casts to float32 (a `float32_view`
    export) into a float32 initializer without them, its bytes made from the module's tensor when the graph
    is saved (`onnx_ir.LazyTensor`: one tensor at a time). A linear layer's weight read through a Transpose
    becomes the transposed initializer, as the exporter's constant folding makes it of a float32 weight (the
    Cast kept it from folding here), so the graph is the one a float32 copy exports. Returns whether any was."""
    import onnx_ir as ir

    half = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)
    # a tied weight (embeddings and LM head) read through two parametrizations is two initializers of one
    # tensor: one again, as the float32 copy's single parameter is
    first: dict[tuple, Any] = {}
    for value in list(graph.initializers.values()):
        raw = _module_tensor(value)
        if value.dtype not in half or raw is None:
            continue
        key = (raw.untyped_storage().data_ptr(), raw.storage_offset(), tuple(raw.shape), raw.stride(), raw.dtype)
        if key not in first:
            first[key] = value
            continue
        ir.convenience.replace_all_uses_with(value, first[key])
        graph.initializers.pop(value.name)
    changed = False
    for value in list(graph.initializers.values()):
        casts = [node for node, _ in value.uses()]
        if value.dtype not in half or value.const_value is None or not casts:
            continue
        if any(node.op_type != "Cast" or node.attributes["to"].as_int() != ir.DataType.FLOAT for node in casts):
            continue
        # parametrize's names ("...parametrizations.weight.original") back to the module's own
        name = (value.name or "").replace(".parametrizations.", ".").removesuffix(".original")
        tensor = _module_tensor(value)
        if tensor is None:  # a constant the exporter made (numpy), not one of the module's tensors
            tensor = torch.from_numpy(value.const_value.numpy().astype(np.float32))
        value.name = name
        value.const_value = _lazy_float32(tensor, name, transpose=False)
        value.dtype = ir.DataType.FLOAT
        for cast in casts:
            ir.convenience.replace_all_uses_with(cast.outputs[0], value)
            graph.remove(cast, safe=True)
        transposes = [node for node, _ in value.uses()]
        if tensor.dim() == 2 and all(_swaps_two_axes(node) for node in transposes):
            # only ever read transposed (a linear layer's weight): stored so, as folding a float32 weight stores
            # it; a weight read both ways (tied embeddings and LM head) keeps its Transpose, as it does there
            value.name = f"{name}.T"
            value.shape = ir.Shape(list(reversed(tensor.shape)))
            value.const_value = _lazy_float32(tensor, value.name, transpose=True)
            for node in transposes:
                ir.convenience.replace_all_uses_with(node.outputs[0], value)
                graph.remove(node, safe=True)
        changed = True
    if changed:  # the exporter's record of the program's signature names the parameters as parametrize does
        props = getattr(graph, "metadata_props", {})
        for key, text in list(props.items()):
            text = re.sub(r"\.parametrizations\.(\w+)\.original\b", r".\1", text)
            props[key] = re.sub(r"_parametrizations_(\w+?)_original\b", r"_\1", text)
    return changed


def _module_tensor(value: Any) -> torch.Tensor | None:
    """The module's own tensor behind an initializer (the exporter's TorchTensor wraps it), if it is one."""
    raw = getattr(value.const_value, "raw", None)
    return raw.detach() if isinstance(raw, torch.Tensor) else None


def _swaps_two_axes(node: Any) -> bool:
    perm = node.attributes.get("perm")
    return node.op_type == "Transpose" and (perm is None or list(perm.as_ints()) == [1, 0])


def _lazy_float32(tensor: torch.Tensor, name: str, *, transpose: bool) -> Any:
    """`tensor` (half precision, the module's own) as float32, transposed or not, made when the graph is saved."""
    import onnx_ir as ir

    shape = list(reversed(tensor.shape)) if transpose else list(tensor.shape)

    def made() -> Any:  # one float32 allocation, laid out as stored
        source = tensor.t() if transpose else tensor
        return ir.Tensor(source.to(torch.float32, memory_format=torch.contiguous_format).numpy(), name=name)

    return ir.LazyTensor(made, ir.DataType.FLOAT, ir.Shape(shape), name=name)


def _drop_constants(graph: Any) -> None:
    """Let go of the exported module's tensors once its graph (an `onnx_ir.Graph`) is saved. onnxscript's rewrite
    rules are module-level objects whose matchers keep the last graph they ran on, and that graph keeps every value
    that was ever one of its inputs (onnx_ir counts them, and keeps those counted down to zero: the parameters,
    lifted to initializers), each with the module's tensor as its constant. A 1.2 B decoder's float32 copy
    (4.9 GB) outlived its export until the next one, beside the next model's."""
    former_inputs = getattr(graph.inputs, "_ref_counter", {})  # onnx_ir 1.1's count of the inputs
    for value in itertools.chain(graph.initializers.values(), graph.inputs, former_inputs):
        value.const_value = None


def _mark_eval(module: torch.nn.Module) -> None:
    """Put `module` in eval mode before export. A torch.export graph module (a conv graph: ATen ops whose
    mode was fixed when it was captured, in eval mode) refuses `.eval()` and computes the same either
    way, but is created with `training=True`, which made every export warn "Exporting a model while it is
    in training mode": its flags are set directly. Other modules get `.eval()`."""
    if not module.training:
        return
    if isinstance(module, fx.GraphModule):
        for sub in module.modules():
            sub.training = False
    else:
        module.eval()


def stamp_metadata(path: str | Path, metadata: dict[str, object]) -> None:
    """Record preprocessing and provenance in the ONNX file's metadata_props (values as JSON strings)."""
    import json

    import onnx

    model = onnx.load(str(path), load_external_data=False)
    existing = {p.key: p for p in model.metadata_props}
    for key, value in metadata.items():
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        if key in existing:
            existing[key].value = text
        else:
            model.metadata_props.add(key=key, value=text)
    onnx.save(model, str(path))


# buffers a float16 copy keeps in float32: a rotary embedding's inverse frequencies (transformers computes its
# angles in float32 from them, then casts the cos / sin tables to the activations' dtype)
FLOAT32_BUFFERS = frozenset({"inv_freq", "original_inv_freq"})


class Float16(torch.nn.Module):
    """A float16 copy of a model behind float32 inputs and outputs: the export computes in half precision
    and stays a drop-in for the float32 one (same input and output dtypes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        import copy

        self.model = copy.deepcopy(model).half().eval()
        # the rotary frequencies stay as the model keeps them (float32, as transformers keeps them in a half
        # model): in float16, 0.01 became 0.01000214 and the angles at position 1,000 were 0.035 off
        kept = dict(model.named_buffers())
        for name, buffer in self.model.named_buffers():
            if name.rsplit(".", 1)[-1] in FLOAT32_BUFFERS and kept[name].dtype == torch.float32:
                buffer.data = kept[name].detach().clone()
        # a grouped sigmoid router (GLM-4.5's) is kept in float32 as transformers keeps it in a half model, with the
        # model's own values: its correction bias rounded to float16 would pick other experts than the model does
        # (LFM2-MoE's router and its block's bias run in the model's dtype there, and here)
        originals = dict(model.named_modules())
        for name, module in self.model.named_modules():
            if kept_in_float32(module):
                module.float().load_state_dict(originals[name].state_dict())
        if hasattr(model, "config"):
            self.config = model.config

    def forward(self, x: torch.Tensor | None = None, **named: torch.Tensor) -> Any:
        """One positional input (graph models) or keyword inputs (HF models)."""
        def cast(t, dtype):
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        args = () if x is None else (cast(x, torch.float16),)
        out = self.model(*args, **{k: cast(v, torch.float16) for k, v in named.items()})
        if isinstance(out, torch.Tensor):
            return out.float()
        for key in list(out.keys()) if hasattr(out, "keys") else []:
            out[key] = cast(out[key], torch.float32)
        return out


def in_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The module to export for `precision` ("fp32" or "fp16"): `Float16` for fp16; for fp32 the model itself,
    or a float32 copy of a half-precision (bf16 / fp16) one: ONNX Runtime's CPU kernels lack bf16 for most
    operators, and the exported graph keeps float32 inputs and outputs either way."""
    if precision == "fp16":
        return Float16(model)
    if precision != "fp32":
        raise ValueError(f"precision must be fp32 or fp16, not {precision!r}")
    if all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point()):
        return model
    import copy

    return copy.deepcopy(model).float().eval()


@contextlib.contextmanager
def exported_in(model: torch.nn.Module, precision: str) -> Iterator[torch.nn.Module]:
    """The module to export and check for `precision` while the block runs: `Float16` for fp16; for fp32 the
    model itself, read through `float32_view` when it is half precision (no float32 copy of it)."""
    if precision != "fp32":  # fp16's wrapper, or in_precision's error
        yield in_precision(model, precision)
        return
    with float32_view(model) as view:
        yield view


class _NamedInputs(torch.nn.Module):
    """Positional inputs in a fixed order -> the HF model's keyword inputs; returns the named output, or the named
    outputs in order (a CLIP vision tower's pooler_output, then its last_hidden_state)."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...], output: str | tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names, self.output = model, names, output
        self.positions = _positions_from_mask(model) and "attention_mask" in names
        # a hybrid decoder builds no cache: filling a linear-attention layer's conv state branches on the prompt's
        # length against the conv's (a graph would keep prompts of at least that many tokens only)
        family = ADAPTERS.get(getattr(getattr(model, "config", None), "model_type", None))
        self.uncached = family is not None and family.recurrent_mixers

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        named = dict(zip(self.names, inputs, strict=True))
        if self.positions:
            named["position_ids"] = mask_positions(named["attention_mask"])
        if self.uncached:
            named["use_cache"] = False
        out = self.model(**named)
        if isinstance(self.output, str):
            return getattr(out, self.output)
        return tuple(getattr(out, name) for name in self.output)


def _positions_from_mask(model: torch.nn.Module) -> bool:
    family = ADAPTERS.get(getattr(getattr(model, "config", None), "model_type", None))
    return family is not None and family.positions_from_mask


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted along its row's attention mask (padding at 0), as generate() counts them."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def export_hf_onnx(
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    path: str | Path,
    *,
    output_name: str | tuple[str, ...],
    max_length: int | None = None,
    opset: int = 18,
) -> Path:
    """Export a HF model with its input names (input_ids, attention_mask, token_type_ids; pixel_values),
    a dynamic batch, a dynamic sequence length for token inputs, and `output_name` (last_hidden_state,
    logits) as the first output, or the outputs of a tuple of names in order."""
    chunked = contextlib.nullcontext()
    if has_chunked_scans(model):  # linear attention traced over several of its chunks: nothing specialised to one
        example, chunk = spanning_chunks(example, max_length or max_sequence(model))
        chunked = traced_chunk(chunk)
    names = tuple(example)
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("sequence", max=max_length) if max_length else torch.export.Dim("sequence")
    # token inputs are (batch, sequence) integers; images keep their channel and spatial sizes
    dynamic = tuple({0: batch, 1: seq} if not example[n].is_floating_point() else {0: batch} for n in names)
    wrapper = _NamedInputs(model.eval(), names, output_name).eval()
    config = getattr(model, "config", None)
    family = ADAPTERS.get(getattr(config, "model_type", None))
    previous = getattr(config, "_attn_implementation", None)
    # a family whose default attention path torch.export cannot trace (Swin's SDPA path with a dynamic batch)
    # is traced through the one it names; pruned query heads keep their gathered attention
    switch = family is not None and family.export_attention is not None and previous != GATHERED
    if switch:
        config._attn_implementation = family.export_attention
    try:
        with chunked:
            return _export(wrapper, tuple(example[n] for n in names), path, weights=model, input_names=list(names),
                           output_names=[output_name] if isinstance(output_name, str) else list(output_name),
                           dynamic_shapes=(dynamic,),  # one entry: *inputs
                           opset_version=opset)
    finally:
        if switch:
            config._attn_implementation = previous



def output_names_of(path: str | Path) -> list[str]:
    import onnx

    return [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]


def reference_outputs(module: torch.nn.Module, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    """`module`'s outputs on `inputs` (its pytree's leaves, in order) as arrays: what an export is checked against.
    Computed apart from the check so that a caller can free the module (a float32 copy of a half-precision model)
    before ONNX Runtime loads the export."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    with torch.no_grad():
        out = module(*inputs)
    leaves = [out] if isinstance(out, torch.Tensor) else list(torch.utils._pytree.tree_leaves(out))
    return [leaf.detach().cpu().numpy() for leaf in leaves]


def check_parity(
    module: torch.nn.Module,
    path: str | Path,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    tolerance: ParityTolerance = PARITY_TOLERANCES["fp32"],
    valid: torch.Tensor | None = None,
) -> Parity:
    """Run the ONNX file in ONNX Runtime (CPU, a spawned subprocess) and compare with `module`, each
    output relative to its own scale (`ParityTolerance`); returns each error field's largest over the outputs.
    `valid` (batch, sequence) bool: only those positions of outputs that start with (batch, sequence) are compared.

    Raises ParityError listing every mismatch (output count, shape, errors beyond tolerance, with the
    numbers), and RuntimeFailure when ONNX Runtime cannot run the file.
    """
    return compare_outputs(path, inputs, reference_outputs(module, inputs), tolerance=tolerance, valid=valid)


def compare_outputs(
    path: str | Path,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    expected: list[np.ndarray],
    *,
    tolerance: ParityTolerance = PARITY_TOLERANCES["fp32"],
    valid: torch.Tensor | None = None,
) -> Parity:
    """`check_parity` against outputs computed before (`reference_outputs`)."""
    from .runtime import run_outputs

    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    got = run_outputs(path, [[x.detach().cpu().numpy() for x in inputs]])[0]  # ONNX Runtime in a subprocess
    return _compared(got, expected, output_names_of(path), tolerance, valid)


def _compared(got: list[np.ndarray], expected: list[np.ndarray], output_names: list[str],
              tolerance: ParityTolerance, valid: torch.Tensor | None) -> Parity:
    """The worst errors of ONNX Runtime's outputs `got` against `expected` at the `valid` (batch, length) positions;
    ParityError listing every output beyond `tolerance`."""
    mismatches = []
    if len(got) != len(expected):
        mismatches.append(ParityMismatch("outputs", f"ONNX has {len(got)} outputs, PyTorch {len(expected)}"))
    worst = Parity(0.0, 0.0, 0.0)
    for index, (g, e) in enumerate(zip(got, expected, strict=False)):
        name = output_names[index] if index < len(output_names) else f"output {index}"
        if g.shape != e.shape:
            mismatches.append(ParityMismatch(name, f"shape {g.shape} != {e.shape}"))
            continue
        if valid is not None and g.shape[:2] == tuple(valid.shape):
            keep = valid.cpu().numpy().astype(bool)
            g, e = g[keep], e[keep]
        err = output_errors(g, e)
        worst = Parity(*(max(a, b) for a, b in zip(dataclasses.astuple(worst), dataclasses.astuple(err),
                                                   strict=True)))
        if not (err.peak_error <= tolerance.peak and err.aggregate_error <= tolerance.aggregate):
            problem = (f"peak error {err.peak_error:.3g} of scale (limit {tolerance.peak:g}), aggregate "
                       f"{err.aggregate_error:.3g} (limit {tolerance.aggregate:g}), max abs error "
                       f"{err.max_abs_error:.3g}")
            mismatches.append(ParityMismatch(name, problem, err.peak_error, err.aggregate_error, err.max_abs_error))
    if mismatches:
        raise ParityError(mismatches)
    return worst


# the share of a Mixture-of-Experts reference's real tokens that must come before every near tie of its routers for
# an export failing at all of them to be checked at those alone (`check_hf_outputs`)
SETTLED_SHARE = 0.5


@dataclass(frozen=True)
class HFReference:
    """A HF model's outputs on the parity inputs, and the tokens they vouch for whatever ONNX Runtime's rounding in a
    Mixture-of-Experts model: `settled` (batch, length) is True where every router of the pass chose its experts by
    a clear margin at that token and at each token before it in its row (`experts.routing_settled`); None without
    MoE layers."""

    outputs: list[np.ndarray]
    settled: torch.Tensor | None = None


def hf_reference(model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                 output_name: str | tuple[str, ...]) -> HFReference:
    """`reference_outputs` of a HF model: named inputs, the one named output; and, where a router's top-k experts
    were a near tie at some token, the tokens before it (ONNX Runtime's rounding may pick the other expert there,
    and the causal tokens after it read that token)."""
    with routing_settled(model) as found:
        outputs = reference_outputs(_NamedInputs(model.eval(), tuple(inputs), output_name), tuple(inputs.values()))
    if not found:
        return HFReference(outputs)
    clear = torch.stack([f.cpu() for f in found]).all(0)  # (batch, length): no router near a tie
    return HFReference(outputs, clear.long().cumprod(1).bool())


def check_hf_outputs(path: str | Path, inputs: dict[str, torch.Tensor], expected: HFReference | list[np.ndarray],
                     *, tolerance: ParityTolerance = PARITY_TOLERANCES["fp32"]) -> Parity:
    """`check_hf_parity` against outputs computed before (`hf_reference`), at the tokens that are not padding. A
    Mixture-of-Experts export that fails there is checked once more at the tokens its reference vouches for
    (`HFReference.settled`: a near tie of a router's experts may have gone the other way in ONNX Runtime), when those
    are at least `SETTLED_SHARE` of the tokens; otherwise its error stands, saying so."""
    from .runtime import run_outputs

    reference = expected if isinstance(expected, HFReference) else HFReference(list(expected))
    mask = inputs.get("attention_mask")
    valid = None if mask is None else mask.bool()
    got = run_outputs(path, [[x.detach().cpu().numpy() for x in inputs.values()]])[0]  # ONNX Runtime in a subprocess
    names = output_names_of(path)
    try:
        return _compared(got, reference.outputs, names, tolerance, valid)
    except ParityError as err:
        if reference.settled is None:
            raise
        real = valid if valid is not None else torch.ones_like(reference.settled)
        settled = real & reference.settled
        share = float(settled.sum()) / max(float(real.sum()), 1.0)
        if share < SETTLED_SHARE:
            note = ParityMismatch("routing", f"only {share:.0%} of the tokens come before every near tie of a router's "
                                  f"top-k experts (a tie ONNX Runtime may break the other way; {SETTLED_SHARE:.0%} "
                                  "needed to check those alone)")
            raise ParityError([*err.mismatches, note]) from err
        parity = _compared(got, reference.outputs, names, tolerance, settled)
        log.warning("parity holds at the %d of %d tokens before every near tie of a router's top-k experts (%s at "
                    "all of them: a tie ONNX Runtime broke the other way)", int(settled.sum()), int(real.sum()), err)
        return parity


def check_hf_parity(model: torch.nn.Module, path: str | Path, inputs: dict[str, torch.Tensor],
                    output_name: str | tuple[str, ...],
                    *, tolerance: ParityTolerance = PARITY_TOLERANCES["fp32"]) -> Parity:
    """`check_parity` for a HF model: named inputs, one named output, at the tokens that are not padding.
    A padding token's output is not defined alike everywhere: under a sliding window a padding query may
    see no key at all, a fully masked row that sdpa and eager attention, in PyTorch and ONNX Runtime, fill
    differently (ModernBERT, window 4: 3.2e-3 apart there, 2.4e-7 at every real token); nothing reads it."""
    return check_hf_outputs(path, inputs, hf_reference(model, inputs, output_name), tolerance=tolerance)


class _DecodeStep(torch.nn.Module):
    """One decoding step of a HF causal LM with its KV cache as plain tensors: (input_ids, attention_mask,
    past key/value per layer with an attention) -> (logits, present key/value of those layers). Layers may have
    different KV head counts (pruned models). A layer mixing tokens by linear attention (`layer_states`) carries
    its conv state (batch, channels, kernel) and, where it has one, its recurrent state (batch, value heads, key size,
    value size) instead; a layer with a mixer beside its attention (Falcon-H1's) carries both, keys and values
    first."""

    def __init__(self, model: torch.nn.Module, layers: int) -> None:
        super().__init__()
        self.model, self.layers = model, layers
        self.states = layer_states(model)
        # rotary positions of a hybrid cache are counted along the mask: its first layer may keep no positions
        self.positions = _positions_from_mask(model) or _hybrid(self.states)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = _cache_of(self.model, past, self.states)
        extra = {}
        if self.positions:  # the new tokens' positions: the last columns of the whole mask's count
            extra["position_ids"] = mask_positions(attention_mask)[:, -input_ids.shape[1]:]
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                         **{_cache_argument(self.model): cache}, **extra)
        return (out.logits, *_state_of(_returned_cache(out), self.states))


# what a cached layer carries from one step to the next: an attention's keys and values; a linear-attention mixer's
# conv state and recurrent state (Gated DeltaNet), or its conv state alone (LFM2's short convolution)
KEY_VALUE, CONV_RECURRENT, CONV = ("key", "value"), ("conv", "recurrent"), ("conv",)
# a layer with a Mamba2 mixer beside its attention (`FamilyAdapter.parallel_mixer`): both layers' states
BOTH = KEY_VALUE + CONV_RECURRENT


def layer_states(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """What each cached layer carries (`KEY_VALUE`, `CONV_RECURRENT`, `CONV`, `BOTH`). A linear-attention mixer
    (`FamilyAdapter.linear_attention`) is never removed alone, nor an attention beside a parallel mixer, so the cached
    layers are the blocks of such a family."""
    family = ADAPTERS.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is not None and family.parallel_mixer is not None:
        return [BOTH] * kv_layers(model)
    if family is None or family.linear_attention is None:
        return [KEY_VALUE] * kv_layers(model)
    linear = CONV_RECURRENT if family.linear_recurrent_state else CONV
    return [linear if adapter_at(model, i).recurrent else KEY_VALUE for i in range(kv_layers(model))]


def _hybrid(states: list[tuple[str, ...]]) -> bool:
    """Whether some cached layer mixes tokens by linear attention."""
    return any(s != KEY_VALUE for s in states)


def _cache_of(model: torch.nn.Module, past: tuple[torch.Tensor, ...], states: list[tuple[str, ...]]) -> Any:
    """The model's cache holding `past` (each layer's `states`, in turn). A linear-attention layer's states are copies
    (its layer updates them in place), marked as following earlier tokens: zeros are the states of no token at all."""
    from transformers import DynamicCache

    if not _hybrid(states):
        cache = DynamicCache()
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        return cache
    cache = DynamicCache(config=model.config)  # a linear-attention layer's slot where the config builds one
    tensors = iter(past)
    for i, names in enumerate(states):
        given = dict(zip(names, itertools.islice(tensors, len(names)), strict=True))
        layer = cache.layers[i]
        if "key" in given:
            layer.update(given["key"], given["value"])
        if "conv" not in given:
            continue
        conv = given["conv"]
        layer.device, layer.dtype = conv.device, conv.dtype
        layer.conv_states[0] = conv.clone()
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.is_conv_states_initialized[0] = True
        if "recurrent" in given:
            layer.recurrent_states[0] = given["recurrent"].clone()
            layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True
    # its token count stays 0: the step's positions come from the mask (`_DecodeStep.positions`), never the cache
    return cache


def _state_of(cache: Any, states: list[tuple[str, ...]]) -> list[torch.Tensor]:
    """Each cached layer's `states` in turn: its keys and values, a linear-attention layer's conv state (and
    recurrent state), or both."""
    out = []
    for layer, names in zip(cache.layers, states, strict=False):  # a config's cache may hold more layers
        if "key" in names:
            out += [layer.keys, layer.values]
        if "conv" in names:
            out += [layer.conv_states[0], *([layer.recurrent_states[0]] if "recurrent" in names else [])]
    return out


def _cache_argument(model: torch.nn.Module) -> str:
    """The forward's KV-cache argument: transformers 5.25 renamed `past_key_values` to `cache` (the old name warns, and
    is removed in 5.40); earlier 5.x releases know the old one only."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(output: Any) -> Any:
    """The KV cache a forward returned, under either name (`_cache_argument`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def decode_step_names(layers: int, states: list[tuple[str, ...]] | None = None) -> tuple[list[str], list[str]]:
    """The decode step's input and output names: optimum's past_key_values.N.key / present.N.value for a layer with
    an attention; past_conv.N (and past_recurrent.N) / present_conv.N (and present_recurrent.N) for a linear-attention
    layer's states (`layer_states`; N the layer's index); both, in that order, for a layer with both."""
    past, present = [], []
    for i, names in enumerate(states if states is not None else [KEY_VALUE] * layers):
        for part in names:
            past.append(f"past_key_values.{i}.{part}" if part in KEY_VALUE else f"past_{part}.{i}")
            present.append(f"present.{i}.{part}" if part in KEY_VALUE else f"present_{part}.{i}")
    return ["input_ids", "attention_mask", *past], ["logits", *present]


def _past_of(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each cached layer's key and value after `ids`, as the decode step keeps them: every position, sliding-window
    layers too (`_DecodeStep`'s cache has no window; their attention mask hides what lies outside it). The cache a
    model builds from its config keeps only a sliding layer's last window, which is not what the graph takes."""
    from transformers import DynamicCache

    states = layer_states(model)
    # a linear-attention layer's slot is the one its config builds (no sliding-window layer beside such layers)
    empty = DynamicCache(config=model.config) if _hybrid(states) else DynamicCache()
    with torch.no_grad():
        cache = _returned_cache(model(input_ids=ids, use_cache=True, **{_cache_argument(model): empty}))
    # the attentions left are numbered 0, 1, ... (`sublayers`): one cache layer each, none for a removed attention
    return _state_of(cache, states)


def export_decode_step(model: torch.nn.Module, example_ids: torch.Tensor, path: str | Path, *,
                       opset: int = 18, max_length: int = 4096) -> Path:
    """Export a causal LM's decode step with past key/values: any batch, any number of new tokens, any past
    length from 0 (so one graph prefills a prompt from an empty cache and decodes token by token, as ONNX
    Runtime GenAI runs it); the attention mask spans past and new tokens. Sliding-window layers (Gemma 2 and 3, Qwen2's
    upper layers) keep every position in their cache like the others, their mask restricting attention to the window:
    the same logits as the model's own cache, which keeps only the window, with a cache that grows with the text.
    Input and output names follow the
    optimum convention (past_key_values.N.key / present.N.value); N counts the layers that keep an attention
    (a removed one keeps no cache)."""
    layers, states = kv_layers(model), layer_states(model)
    recurrent = any("recurrent" in names for names in states)  # a Gated DeltaNet's or Mamba2's scan, by chunks
    # two new tokens, so the export does not specialise the step to one; linear attention's, over more than one of its
    # chunks (a step of one chunk would be traced as one)
    new = min(CHUNK + 2, max_length) if recurrent else 2
    if recurrent:  # a past of two tokens: within any max_length
        example_ids = tiled(example_ids, new + 2)
    past_len = example_ids.shape[1] - new
    if past_len < 2:
        raise ValueError("the example needs at least 4 tokens (a past and a step of two, neither traced as 1)")
    past = _past_of(model, example_ids[:, :past_len])
    mask = torch.ones_like(example_ids)
    batch = torch.export.Dim("batch")
    step, length = torch.export.Dim("sequence", min=1, max=max_length), torch.export.Dim("past", min=0, max=max_length)
    total = torch.export.Dim("total", min=1, max=2 * max_length)  # past + sequence
    # a linear-attention layer's states have no length: only their batch varies
    per_layer = [{0: batch, 2: length} if part in KEY_VALUE else {0: batch} for names in states for part in names]
    dynamic = ({0: batch, 1: step}, {0: batch, 1: total}, tuple(per_layer))
    inputs, outputs = decode_step_names(layers, states)
    # the eager attention path traces with a symbolic past length (SDPA's is_causal flag does not, e.g. OPT);
    # both compute the same attention. Pruned query heads keep their gathered attention (eager's repeat_kv
    # assumes even groups); it never sets is_causal for the one-token step.
    previous = model.config._attn_implementation
    if previous != GATHERED:
        model.config._attn_implementation = "eager"
    try:
        chunked = traced_chunk(chunk_for(new)) if recurrent else contextlib.nullcontext()
        with chunked, stepped_scan():
            return _export(_DecodeStep(model.eval(), layers).eval(), (example_ids[:, past_len:], mask, *past), path,
                           weights=model, dynamic_shapes=dynamic, input_names=inputs, output_names=outputs,
                           opset_version=opset)
    finally:
        model.config._attn_implementation = previous


def decode_reference(model: torch.nn.Module, ids: torch.Tensor, new: int = 1
                     ) -> tuple[tuple[torch.Tensor, ...], HFReference]:
    """The decode step's inputs for the last `new` tokens of `ids` after the cache of the ones before (all of them: a
    prefill from an empty cache), and the model's own outputs there; in a Mixture-of-Experts model, with `settled`
    (batch, new): whether every router chose that new token's experts by a clear margin (`experts.routing_settled`)."""
    past = _past_of(model, ids[:, :-new]) if new < ids.shape[1] else _empty_past(model, ids)
    step = _DecodeStep(model.eval(), kv_layers(model)).eval()
    inputs = (ids[:, -new:], torch.ones_like(ids), *past)
    with routing_settled(model) as found:
        outputs = reference_outputs(step, inputs)
    settled = torch.stack([f.cpu() for f in found]).all(0) if found else None
    return inputs, HFReference(outputs, settled)


def check_decode_outputs(path: str | Path, inputs: tuple[torch.Tensor, ...], reference: HFReference, *,
                         tolerance: ParityTolerance = PARITY_TOLERANCES["fp32"]) -> Parity:
    """The exported decode step against `decode_reference`. A Mixture-of-Experts step that fails is checked once more
    on the rows whose new tokens every router decided clearly, when those are at least `SETTLED_SHARE` of the rows:
    a near tie ONNX Runtime breaks the other way changes that token's logits and, past its layer, its keys and values
    (every present output of the row), so a row is compared whole or not at all."""
    from .runtime import run_outputs

    got = run_outputs(path, [[x.detach().cpu().numpy() for x in inputs]])[0]  # ONNX Runtime in a subprocess
    names = output_names_of(path)
    try:
        return _compared(got, reference.outputs, names, tolerance, None)
    except ParityError as err:
        if reference.settled is None:
            raise
        rows = reference.settled.all(1)  # (batch,)
        share = float(rows.float().mean())
        if share < SETTLED_SHARE:
            note = ParityMismatch("routing", f"only {share:.0%} of the rows' new tokens have every router's top-k "
                                  f"experts clear of a near tie (a tie ONNX Runtime may break the other way; "
                                  f"{SETTLED_SHARE:.0%} needed to check those rows alone)")
            raise ParityError([*err.mismatches, note]) from err
        keep = rows.nonzero().squeeze(1).numpy()  # the same run's rows: a batch of fewer rows is another test
        parity = _compared([g[keep] for g in got], [o[keep] for o in reference.outputs], names, tolerance, None)
        log.warning("the decode step's parity holds on the %d of %d rows whose new tokens have no near tie of a "
                    "router's top-k experts (%s on all of them: a tie ONNX Runtime broke the other way)",
                    len(keep), len(rows), err)
        return parity


def check_decode_parity(model: torch.nn.Module, path: str | Path, ids: torch.Tensor, *,
                        tolerance: ParityTolerance = PARITY_TOLERANCES["fp32"], new: int = 1) -> Parity:
    """The exported decode step against the model's own logits of the last `new` tokens of `ids` after the
    cache of the ones before (all of them: a prefill from an empty cache); `check_decode_outputs`."""
    inputs, reference = decode_reference(model, ids, new)
    return check_decode_outputs(path, inputs, reference, tolerance=tolerance)


def _empty_past(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each cached layer's key and value with no position yet: (batch, its KV heads, 0, head size); a linear-attention
    layer's states of no token, zeros."""
    kinds = [part in KEY_VALUE for names in layer_states(model) for part in names]
    return [t[:, :, :0] if attention else torch.zeros_like(t)
            for attention, t in zip(kinds, _past_of(model, ids[:, :1]), strict=True)]
