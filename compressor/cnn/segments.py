"""Advance activations through an fx graph segment by segment, with only one segment on the device.

The graph is cut at chosen nodes (in graph order). At each cut the *live* values — computed before
or at the cut and used after it — are all that later segments need; they are kept on the CPU for
every calibration batch, and a segment runs with its own parameters copied to the compute device.
Memory is then one segment's parameters plus the live activations, not the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, fx

from .surgery import get_tensor


class GraphWalker:
    """Live activations of one graph module at a cut, advanced cut by cut.

    Life cycle: __init__ (model input batches) -> advance(cut) ... ; `values[node]` holds the
    current live tensors (one per batch, on the CPU).
    """

    def __init__(self, gm: fx.GraphModule, batches: Iterable[Tensor], device: torch.device) -> None:
        self.gm = gm
        self.device = device
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise ValueError(f"expected one graph input, found {len(placeholders)}")
        self.at = placeholders[0]  # the current cut
        self._reorder()
        self.values: dict[fx.Node, list[Tensor]] = {placeholders[0]: [b.cpu() for b in batches]}

    def _reorder(self) -> None:
        """Positions of the graph's nodes now (surgery may have inserted or removed nodes after the cut)."""
        self.order = {node: i for i, node in enumerate(self.gm.graph.nodes)}
        self.position = self.order[self.at]
        if hasattr(self, "values"):  # a live value of a node surgery replaced is recomputed from its inputs
            self.values = {n: v for n, v in self.values.items() if n in self.order}

    def _live_after(self, position: int) -> list[fx.Node]:
        """Nodes computed at or before `position` whose value is used after it."""
        live = []
        for node, pos in self.order.items():
            if pos > position or node.op in ("get_attr", "output") or node.op == "call_module":
                continue
            if any(self.order[user] > position for user in node.users):
                live.append(node)
        return live

    def advance(self, cut: fx.Node) -> list[Tensor]:
        """Run the graph from the current cut to `cut`; returns `cut`'s value per batch (CPU)."""
        self._reorder()
        target = self.order[cut]
        if target < self.position:
            raise ValueError(f"cannot go back from position {self.position} to {cut.name}")
        outputs = [n for n in self._live_after(target) if self.order[n] > self.position] + [cut]
        outputs = list(dict.fromkeys(outputs))
        inputs = list(self.values)
        segment = self._segment(inputs, outputs)
        new_values: dict[fx.Node, list[Tensor]] = {n: [] for n in outputs}
        with torch.no_grad():
            for b in range(len(next(iter(self.values.values())))):
                args = [_moved(self.values[n][b], self.device) for n in inputs]
                results = segment(*args)
                for node, value in zip(outputs, results, strict=True):
                    new_values[node].append(_moved(value, torch.device("cpu")))
        keep = self._live_after(target)
        self.values = {n: v for n, v in {**self.values, **new_values}.items() if n in keep or n is cut}
        self.position, self.at = target, cut
        return self.values[cut]

    def peek(self, nodes: list[fx.Node]) -> Iterator[list[Tensor]]:
        """The values of `nodes` (live now or computed later in the graph) for each batch in turn, on the
        device, without moving the cut: one batch's values at a time are held."""
        self._reorder()
        missing = [n for n in dict.fromkeys(nodes) if n not in self.values]
        if any(self.order[n] < self.position for n in missing):
            raise ValueError("peek needs nodes that are live or after the cut")
        inputs = list(self.values)
        segment = self._segment(inputs, missing) if missing else None
        with torch.no_grad():
            for b in range(len(next(iter(self.values.values())))):
                known = {n: _moved(self.values[n][b], self.device) for n in inputs}
                if segment is not None:
                    known.update(zip(missing, segment(*(known[n] for n in inputs)), strict=True))
                yield [known[n] for n in nodes]

    def select_channels(self, names: frozenset[str], keep: Tensor, dim: int = 1) -> None:
        """Keep channels `keep` (along `dim`: -1 for a channels-last map) of every live value whose node is one
        of `names` (after surgery removed the others from the graph that computes them)."""
        for node, values in self.values.items():
            if node.name in names:
                self.values[node] = [x.index_select(dim, keep.to(x.device)) for x in values]

    def replace(self, node: fx.Node, values: list[Tensor]) -> None:
        """Overwrite a live value (e.g. after surgery removed channels of it)."""
        self.values[node] = values

    def _segment(self, inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
        """A module computing `outputs` from `inputs`, its parameters copied to the device."""
        needed: set[fx.Node] = set()
        stack = list(outputs)
        boundary = set(inputs)
        while stack:
            node = stack.pop()
            if node in needed or node in boundary:
                continue
            needed.add(node)
            stack.extend(n for n in node.all_input_nodes)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in inputs:
            env[node] = graph.placeholder(node.name)
        attrs: dict[str, Tensor] = {}
        for node in self.gm.graph.nodes:
            if node not in needed:
                continue
            if node.op == "placeholder":
                raise ValueError(f"segment needs the model input {node.name}, which is no longer live")
            if node.op == "get_attr":
                attrs[node.target] = get_tensor(self.gm, node.target).to(self.device)
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in outputs))
        return fx.GraphModule(attrs, graph)


def _moved(value: object, device: torch.device) -> object:
    """A live value on `device`: tensors move; scalars a graph computes (a shape's size) stay as they are."""
    return value.to(device) if isinstance(value, Tensor) else value
