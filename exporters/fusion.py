"""ONNX Runtime's fused transformer kernels for a dynamo export, kept only where the fused graph matches PyTorch.

ONNX Runtime's own transformer optimizer (`onnxruntime.transformers.optimizer`) matches the graphs the TorchScript
exporter wrote: on our dynamo exports it fuses the layer norms and GELUs but no attention ("failed to match qk
path"). onnxscript's ORT fusions (`onnxscript.rewriter.ort_fusions`) are written for dynamo graphs: on
all-MiniLM-L6-v2 they turn every layer's attention into one `com.microsoft.Attention` (its own head count per
layer, so a pruned model fuses as the dense one does) and fuse skip-LayerNorm and bias-GELU.

On the CPU one fusion is undone: ONNX Runtime's CPU skip-LayerNorm kernel is slower than the sum and the
norm apart (`split_skip_layer_norms`). With that, all-MiniLM-L6-v2's graphs run as fast as Optimum's export of
the dense model and a TorchScript export of the pruned one (bench/RESULTS.md).

A fusion is a pattern rewrite: the fused graph is checked against PyTorch like any export, and where it fails
(or the rewrite raises) the plain export ships instead, with a warning. The plain graph is kept beside
(`unfused_path`), so the job can also time the graphs as exported (report.json `measured.onnx_graph`).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .onnx import EXTERNAL_DATA_BYTES, Parity, ParityError, exact_constant_rules, stamp_metadata
from .runtime import RuntimeFailure, files_of

if TYPE_CHECKING:
    import onnx_ir as ir

log = logging.getLogger(__name__)

FUSIONS_KEY = "osscar.ort_fusions"  # metadata_props: the fusions applied (JSON), or why none were
UNFUSED = "unfused"  # the folder beside an export that holds the plain graph


NO_PATTERN = "no pattern to fuse"  # Fusion.fallback of a graph with nothing to fuse: no failure


@dataclass(frozen=True)
class Fusion:
    """What became of one export: the fusions applied (onnxscript's names -> count, none zero), or why the plain
    graph ships (`fallback`)."""

    counts: dict[str, int] = field(default_factory=dict)
    fallback: str | None = None

    @property
    def fused(self) -> bool:
        return self.fallback is None and bool(self.counts)

    @property
    def rejected(self) -> bool:
        """The fusion raised or its graph failed the check (not merely nothing to fuse): worth a warning."""
        return self.fallback not in (None, NO_PATTERN)

    def to_json(self) -> dict:
        return {"fusions": dict(self.counts), "fallback": self.fallback}


def unfused_path(path: str | Path) -> Path:
    """Where `fuse_checked` keeps the plain export of `path` (same file name: external data keep resolving)."""
    path = Path(path)
    return path.parent / UNFUSED / path.name


SKIP_AS_SUM = "skip_layer_normalization_as_sum"  # Fusion.counts: skip-LayerNorms split again (CPU graphs)


def fuse(source: Path, target: Path, provider: str = "cpu") -> dict[str, int]:
    """Write `source` with ONNX Runtime's fused transformer operators for `provider` ("cpu", "cuda") to `target`,
    stamped as fused (`FUSIONS_KEY`: one write of the file; `fuse_checked` re-stamps a graph it rejects); returns
    the fusions applied (onnxscript's names, and `SKIP_AS_SUM`) and how often."""
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = ir.load(str(source))
    as_matmul = gemms_as_matmuls(model)
    with exact_constant_rules():
        model, counts = optimize_for_ort(model)
    counts = {name: int(count) for name, count in counts.items() if count}
    if as_matmul and counts:
        counts[GEMM_AS_MATMUL] = as_matmul
    if cast := cast_norm_weights(model):
        counts[NORM_WEIGHTS_CAST] = cast
    if provider == "cpu" and (split := split_skip_layer_norms(model)):
        counts[SKIP_AS_SUM] = split
    _drop_intermediate_shapes(model)
    model.metadata_props[FUSIONS_KEY] = json.dumps(Fusion(counts).to_json(), sort_keys=True)
    weights = [v.const_value for v in model.graph.initializers.values() if v.const_value is not None]
    # torch's exporter writes external data from 1.5 GB on: a graph read from one keeps its weights in a file of its
    # own too (saved as read, they would point at the source's file, which `fuse_checked` moves away)
    external = any(isinstance(w, ir.ExternalTensor) for w in weights)
    if external or sum(w.nbytes for w in weights) >= EXTERNAL_DATA_BYTES:
        ir.save(model, str(target), external_data=f"{target.name}.data")
    else:
        ir.save(model, str(target))
    return counts


def _drop_intermediate_shapes(model: ir.Model) -> None:
    """Forget the shapes recorded for the fused graph's inner values (ONNX Runtime infers its own): a rewrite that
    removes reshapes leaves the 2-D shape of a value that is 3-D now, which ONNX Runtime warns of at every load
    (`MergeShapeInfo`, three lines per layer of GPT-2)."""
    import onnx_ir as ir

    outputs = {id(v) for v in model.graph.outputs}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            if id(value) not in outputs:
                value.shape = None


NORM_WEIGHTS_CAST = "norm_weights_cast"  # Fusion.counts: skip-norm weights cast to their input's type (half graphs)
# ONNX Runtime's fused norms whose every input is one type (T): the weights too
_ONE_TYPE_NORMS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")


def cast_norm_weights(model: ir.Model) -> int:
    """Give each fused skip-norm's weights (gamma, beta, bias) its input's type through a Cast; returns how many it
    cast. Gemma's RMSNorm scales by 1 + weight in float32 (the constant folds to a float32 initializer) and casts
    back, so in an fp16 graph the fused SkipSimplifiedLayerNormalization got fp16 inputs and a float32 gamma, which
    ONNX Runtime refuses to load ("bound to different types"): Gemma 2's fp16 graphs shipped unfused."""
    import onnx_ir as ir

    count = 0
    for node in list(model.graph):
        if node.op_type not in _ONE_TYPE_NORMS or node.domain != "com.microsoft" or not node.inputs:
            continue
        dtype = node.inputs[0].dtype if node.inputs[0] is not None else None
        if dtype is None:
            continue
        for index in range(2, len(node.inputs)):
            value = node.inputs[index]
            if value is None or value.dtype in (None, dtype):
                continue
            cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", dtype.value)], name=f"{node.name}_cast{index}")
            cast.outputs[0].dtype = dtype
            model.graph.insert_before(node, cast)
            node.replace_input_with(index, cast.outputs[0])
            count += 1
        # its outputs are of that type too: one recorded as another (the float32 norm the pattern replaced, cast back
        # after it) reaches its readers through a Cast to what they read
        for position, output in enumerate(node.outputs):
            if position in (1, 2):  # mean and inv_std_var: float whatever the input (the schema's U)
                continue
            if output is None or output.dtype in (None, dtype) or output.is_graph_output():
                continue
            wanted = output.dtype
            output.dtype = dtype
            back = ir.Node("", "Cast", [output], [ir.AttrInt64("to", wanted.value)], name=f"{node.name}_out{position}")
            back.outputs[0].dtype = wanted
            model.graph.insert_after(node, back)
            for user, index in list(output.uses()):
                if user is not back:
                    user.replace_input_with(index, back.outputs[0])
    return count


GEMM_AS_MATMUL = "gemm_as_matmul_add"  # Fusion.counts: Gemms written as MatMul + Add before the fusions


def gemms_as_matmuls(model: ir.Model) -> int:
    """Write each plain `Gemm` of `model` (alpha = beta = 1, A not transposed) as `MatMul` (of B transposed where
    transB) then `Add` of C; returns how many. GPT-2's Conv1D exports as Reshape -> Gemm -> Reshape, and onnxscript's
    pre-fusion shape optimizer removes the reshapes around it, which a Gemm (2-D only) does not survive: every GPT-2
    graph failed to load fused and shipped without its fused attention. A MatMul takes any rank."""
    import onnx_ir as ir

    graph, count = model.graph, 0
    for node in list(graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        attributes = {name: attr.value for name, attr in node.attributes.items()}
        if attributes.get("alpha", 1.0) != 1.0 or attributes.get("beta", 1.0) != 1.0 or attributes.get("transA", 0):
            continue
        a, b, c = [*node.inputs, None][:3]
        added: list[ir.Node] = []
        if attributes.get("transB", 0):
            added.append(ir.Node("", "Transpose", [b], [ir.AttrInt64s("perm", [1, 0])], name=f"{node.name}_bt"))
            b = added[-1].outputs[0]
        added.append(ir.Node("", "MatMul", [a, b], name=f"{node.name}_matmul"))
        if c is not None:
            added.append(ir.Node("", "Add", [added[-1].outputs[0], c], name=f"{node.name}_add"))
        graph.insert_before(node, added)
        old, new = node.outputs[0], added[-1].outputs[0]
        new.shape, new.type = old.shape, old.type
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        new.name = old.name
        count += 1
    return count


def split_skip_layer_norms(model: ir.Model) -> int:
    """Replace each `SkipLayerNormalization` of `model` (an `onnx_ir.Model`) by `Sum` then `LayerNormalization`;
    returns how many. ONNX Runtime's CPU SkipLayerNormalization (1.32) is a scalar loop per row: on
    all-MiniLM-L6-v2 at 8 x 128 (2-core EPYC) its 12 calls took 12.9 of 83 ms, ~7x what LayerNormalization
    (vectorised) and an Add take. The sum is written as `Sum`, not `Add`: ONNX Runtime's session-level
    SkipLayerNormFusion matches Add -> LayerNormalization and would fuse it back. The CUDA kernel is fast; CUDA
    graphs keep the fusion."""
    import onnx_ir as ir

    graph, split = model.graph, 0
    for node in list(graph):
        if node.op_type != "SkipLayerNormalization" or node.domain != "com.microsoft":
            continue
        # inputs: input, skip, gamma, [beta], [bias]; outputs: output, [mean], [inv_std_var], [input + skip + bias]
        inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
        outputs = list(node.outputs) + [None] * (4 - len(node.outputs))
        if any(o is not None and (o.uses() or o.is_graph_output()) for o in outputs[1:3]):
            continue  # its statistics are read (never in inference graphs): keep the node
        epsilon = node.attributes["epsilon"].value if "epsilon" in node.attributes else 1e-12
        total = ir.Node("", "Sum", [x for x in (inputs[0], inputs[1], inputs[4]) if x is not None],
                        name=f"{node.name}_sum")
        norm = ir.Node("", "LayerNormalization", [x for x in (total.outputs[0], inputs[2], inputs[3]) if x is not None],
                       [ir.AttrInt64("axis", -1), ir.AttrFloat32("epsilon", float(epsilon))], name=f"{node.name}_norm")
        graph.insert_before(node, [total, norm])
        for new, old in ((norm.outputs[0], outputs[0]), (total.outputs[0], outputs[3])):
            if old is not None:
                new.shape, new.type = old.shape, old.type
                old.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        # the values keep their names, now that the node holding them is gone
        norm.outputs[0].name = outputs[0].name
        total.outputs[0].name = outputs[3].name if outputs[3] is not None else f"{node.name}_sum"
        split += 1
    return split


def fuse_checked(path: str | Path, check: Callable[[Path], Parity], provider: str = "cpu") -> tuple[Parity, Fusion]:
    """`path` holds a plain export. Fuse it in place for `provider` (the plain graph moves to
    `unfused_path(path)`) and check the fused graph with `check` (raises ParityError / RuntimeFailure). A fusion
    that raises, or a fused graph that fails the check, is logged and the plain graph goes back to `path` and is
    checked instead: what ships is always what was checked. The outcome is stamped in the file's metadata
    (`FUSIONS_KEY`)."""
    path = Path(path)
    plain = unfused_path(path)
    plain.parent.mkdir(exist_ok=True)
    for file in files_of(path):
        file.replace(plain.parent / file.name)
    reason = None
    try:
        counts = fuse(plain, path, provider)
    except Exception as err:  # a rewrite rule's bug must not lose the export: the plain graph still ships
        log.warning("fusing %s for ONNX Runtime failed (%s: %s); it ships as exported", path, type(err).__name__, err)
        reason, counts = f"the fusion failed: {type(err).__name__}", {}
    if reason is None and not counts:
        reason = NO_PATTERN
    if reason is None:
        try:
            return check(path), Fusion(counts)  # `fuse` stamped it fused
        except (ParityError, RuntimeFailure) as err:
            log.warning("the fused graph of %s fails its check (%s); it ships as exported", path, err)
            reason = f"the fused graph failed its check: {str(err)[:200]}"
    for file in files_of(path):
        file.unlink()
    for file in files_of(plain):
        shutil.copy2(file, path.parent / file.name)
    parity = check(path)
    fusion = Fusion({}, reason)
    stamp_metadata(path, {FUSIONS_KEY: fusion.to_json()})
    return parity, fusion


def fusion_of(path: str | Path) -> Fusion | None:
    """The outcome `fuse_checked` stamped in an ONNX file, or None (a graph that never went through it)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == FUSIONS_KEY:
            data = json.loads(prop.value)
            return Fusion(dict(data.get("fusions") or {}), data.get("fallback"))
    return None
