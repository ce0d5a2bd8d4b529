"""An ONNX graph run a piece at a time, each piece in a session of its own: how ONNX Runtime evaluates and times a
model whose one session the host cannot hold (a float32 graph of a few billion parameters on a host of 24 GB).

The graph's nodes (topologically ordered, as ONNX requires) are cut into consecutive runs whose weights stay
within a byte budget, each cut where the fewest values cross it. A piece is written beside its source, so that
its external weights resolve to the source's file and its session reads only its own initializers from it; the
values that cross a cut are handed on as arrays. A piece's inputs are typed from the arrays it is fed (a fused
graph does not record the types of its inner values), so a piece is written when its inputs first exist.

Only the ONNX Runtime subprocess of `exporters.runtime` imports this module (no torch).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Piece:
    start: int  # the first node of the source graph it runs
    stop: int  # one past its last node
    inputs: tuple[str, ...]  # graph inputs and earlier pieces' values it reads
    outputs: tuple[str, ...]  # its values that later pieces read, and the graph's outputs it computes
    done: tuple[str, ...]  # values (not graph inputs) that no later piece reads: the carrier drops them
    weight_bytes: int  # its initializers' and constants' bytes


def _tensor_bytes(tensor) -> int:
    from onnx.helper import tensor_dtype_to_np_dtype

    try:
        item = np.dtype(tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):  # strings and exotic types: never a model's weights
        item = 1
    return item * math.prod(tensor.dims)


def _subgraph_reads(graph) -> set[str]:
    """Values a subgraph (an If's branch, a Loop's body) reads from the scopes around it."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    reads: set[str] = set()
    for node in graph.node:
        reads.update(n for n in node.input if n and n not in defined)
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                reads.update(n for n in _subgraph_reads(sub) if n not in defined)
        defined.update(node.output)
    return reads


def _reads(node) -> list[str]:
    names = [n for n in node.input if n]
    for attribute in node.attribute:
        for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
            names.extend(sorted(_subgraph_reads(sub)))
    return names


def _constant_bytes(node) -> int:
    return sum(_tensor_bytes(a.t) for a in node.attribute if a.HasField("t")) if node.op_type == "Constant" else 0


def plan_pieces(model, budget: int) -> list[Piece]:
    """Consecutive runs of `model`'s nodes whose weights stay within `budget` bytes (a node over it alone), each cut
    at the position where the fewest values cross it among those past half the budget."""
    assert budget > 0, f"a piece's weight budget must be positive (got {budget})"
    graph = model.graph
    nodes = list(graph.node)
    sizes = {t.name: _tensor_bytes(t) for t in graph.initializer}
    given = {v.name for v in graph.input} - set(sizes)
    outputs = [v.name for v in graph.output]
    reads = [_reads(node) for node in nodes]
    produced: dict[str, int] = {}
    last_use: dict[str, int] = {}
    unknown: list[str] = []
    for i, names in enumerate(reads):
        for name in names:
            if name not in produced and name not in given and name not in sizes:
                unknown.append(f"{nodes[i].name or nodes[i].op_type} reads {name!r}")
            last_use[name] = i
        for name in nodes[i].output:
            if name:
                produced[name] = i
    if unknown:  # not topologically sorted, or a value from nowhere: the cuts would hand on the wrong values
        raise ValueError("the graph cannot be cut into pieces: " + "; ".join(unknown[:10]))
    for name in outputs:
        if name not in produced:
            raise ValueError(f"the graph's output {name!r} is not computed by a node: it cannot be cut into pieces")
        last_use[name] = len(nodes)

    # values that cross the cut before node i (computed earlier, read at i or later)
    crossing = [0] * (len(nodes) + 1)
    ends: dict[int, int] = {}
    for name, at in produced.items():
        end = last_use.get(name, at)
        if end > at:
            ends[at + 1] = ends.get(at + 1, 0) + 1
            ends[end + 1] = ends.get(end + 1, 0) - 1
    running = 0
    for i in range(len(nodes) + 1):
        running += ends.get(i, 0)
        crossing[i] = running

    def weights(i: int) -> set[str]:
        return {n for n in reads[i] if n in sizes}

    starts = [0]
    held: set[str] = set()
    held_bytes = 0
    before: list[int] = []  # the piece's bytes before each of its nodes
    i = 0
    while i < len(nodes):
        start = starts[-1]
        new = weights(i) - held
        grown = held_bytes + sum(sizes[n] for n in new) + _constant_bytes(nodes[i])
        if i > start and grown > budget:
            at = [*before, held_bytes]  # at[k]: the piece's bytes were it cut before node start + k
            wide = [p for p in range(start + 1, i + 1) if at[p - start] * 2 >= budget] or [i]
            cut = min(wide, key=lambda p: (crossing[p], -p))
            starts.append(cut)
            held, held_bytes, before, i = set(), 0, [], cut  # the nodes from the cut on again, in a new piece
            continue
        before.append(held_bytes)
        held |= new
        held_bytes = grown
        i += 1

    pieces = []
    bounds = [*starts, len(nodes)]
    graph_outputs = set(outputs)
    for a, b in itertools.pairwise(bounds):
        inside = {name for k in range(a, b) for name in nodes[k].output if name}
        ins = list(dict.fromkeys(n for k in range(a, b) for n in reads[k] if n not in inside and n not in sizes))
        outs = [n for k in range(a, b) for n in nodes[k].output
                if n and (n in graph_outputs or last_use.get(n, k) >= b)]
        done = [n for n in (*ins, *inside) if n not in given and n not in graph_outputs and last_use.get(n, 0) < b]
        used = set().union(*(weights(k) for k in range(a, b)))
        piece = Piece(a, b, tuple(ins), tuple(outs), tuple(dict.fromkeys(done)),
                      sum(sizes[n] for n in used) + sum(_constant_bytes(nodes[k]) for k in range(a, b)))
        if outs:  # nodes whose values nothing reads are not run (an ONNX graph needs an output)
            pieces.append(piece)
    return pieces


def piece_path(source: str | Path, index: int | str, tag: str = "") -> Path:
    """Where piece `index` of `source` is written: a hidden file beside it (its external weights resolve there),
    named for this process and `tag` (two plans of one file, timed against each other, do not share files)."""
    source = Path(source)
    return source.with_name(f".{source.stem}.piece{index}{tag}.{os.getpid()}.onnx")


def write_piece(model, piece: Piece, path: Path, inputs: dict[str, np.ndarray]) -> Path:
    """`piece` of `model` as a model of its own at `path`, its inputs typed as the arrays `inputs` it will be fed
    (their shapes left free), its initializers as the source's: external ones still pointing into its file."""
    import onnx
    from onnx import helper

    graph = model.graph
    nodes = graph.node[piece.start:piece.stop]
    needed = {n for node in nodes for n in _reads(node)}
    known = {v.name: v for v in [*graph.value_info, *graph.output]}
    sub = helper.make_graph(
        list(nodes), f"{graph.name or 'graph'}_piece_{piece.start}_{piece.stop}",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(inputs[n].dtype), None)
         for n in piece.inputs],
        [known[n] if n in known else onnx.ValueInfoProto(name=n) for n in piece.outputs],
        [t for t in graph.initializer if t.name in needed])
    piece_model = helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                                    functions=list(model.functions))
    onnx.save(piece_model, str(path))  # external initializers keep their location, relative to this folder
    return path


@dataclass
class Carrier:
    """Values handed from piece to piece for several batches: each batch's graph inputs and what crosses the cuts."""

    values: list[dict[str, np.ndarray]]

    def feed(self, b: int, piece: Piece) -> dict[str, np.ndarray]:
        missing = [n for n in piece.inputs if n not in self.values[b]]
        assert not missing, f"piece {piece.start}-{piece.stop} reads values no earlier piece handed on: {missing}"
        return {n: self.values[b][n] for n in piece.inputs}

    def take(self, b: int, piece: Piece, got: Iterable[np.ndarray]) -> None:
        self.values[b].update(zip(piece.outputs, got, strict=True))
        for name in piece.done:
            self.values[b].pop(name, None)


def remove(paths: Iterable[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def remove_leftovers(sources: Iterable[str | Path], pid: int) -> None:
    """The piece files process `pid` wrote beside `sources` (`piece_path`: its pieces, and the external copy of
    embedded weights with its data), for a process killed before it could remove them itself."""
    for source in map(Path, sources):
        if source.is_file():
            # its pieces (".model.piece0.<pid>.onnx") and those of the embedded weights moved out ("..model.piece...")
            remove(source.parent.glob(f".*{glob.escape(source.stem)}.piece*.{pid}.onnx*"))


def graph_inputs(model) -> list[str]:
    initializers = {t.name for t in model.graph.initializer}
    return [v.name for v in model.graph.input if v.name not in initializers]


def load_structure(path: str | Path):
    """The graph without its external weights' bytes (an embedded graph's are read: see `structure`)."""
    import onnx

    return onnx.load(str(path), load_external_data=False)


EMBEDDED_BYTES = 1024  # an embedded initializer from this size on goes to the temporary external file


@contextlib.contextmanager
def structure(path: str | Path, tag: str = "") -> Iterator[tuple[Any, Path]]:
    """The graph without its weights' bytes, and the file its pieces are written beside. A graph that embeds its
    weights (an export under 2 GB) has them moved once into a temporary external file beside it, removed on exit,
    so that its pieces are small files reading from it (copies in every piece wrote the model to disk again). Its
    load still holds the graph's bytes twice for a moment (a 160 MB graph: 363 MB against 233 MB for its whole
    session), which is why only graphs with external weights run in pieces by themselves (`runtime.piece_budget`)."""
    import onnx
    from onnx.external_data_helper import convert_model_to_external_data

    model = load_structure(path)
    if not any(t.data_location != onnx.TensorProto.EXTERNAL and _tensor_bytes(t) >= EMBEDDED_BYTES
               for t in model.graph.initializer):
        yield model, Path(path)
        return
    moved = piece_path(path, "weights", tag)
    data = moved.with_name(moved.name + ".data")
    try:
        convert_model_to_external_data(model, all_tensors_to_one_file=True, location=data.name,
                                       size_threshold=EMBEDDED_BYTES)
        onnx.save_model(model, str(moved))  # writes each tensor's bytes out and drops them from the graph
        del model
        yield load_structure(moved), moved
    finally:
        remove([moved, data])



def piece_file(model, pieces: list[Piece], index: int, source: str | Path, first: dict[str, np.ndarray],
               written: dict[int, Path], tag: str = "") -> Path:
    """Piece `index`'s file, written on first use (typed from `first`, the values at hand for batch 0) and kept in
    `written` for the caller to remove (before it is written: a write the disk refuses half-way leaves nothing)."""
    if index not in written:
        written[index] = piece_path(source, index, tag)
        write_piece(model, pieces[index], written[index], first)
    return written[index]
