"""Small helpers on module trees shared by the CNN and transformer parts: dotted attribute paths,
kept-index checks and parameter counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .errors import SurgeryError


def owner_of(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """(the module that holds `path`'s last component, that component): "a.b.weight" -> (root.a.b, "weight")."""
    owner, _, name = path.rpartition(".")
    return (root.get_submodule(owner) if owner else root), name


def get_attr(root: nn.Module, path: str) -> Any:
    """The attribute at a dotted path below `root` (a parameter, buffer, submodule or plain value)."""
    owner, name = owner_of(root, path)
    return getattr(owner, name)


def check_keep(keep: Sequence[int] | Tensor, size: int, what: str) -> Tensor:
    """Sorted unique kept indices in [0, size), at least one; raise listing every bad index."""
    idx = torch.as_tensor(keep, dtype=torch.long).flatten()
    bad = sorted({int(i) for i in idx.tolist() if not 0 <= int(i) < size})
    problems = []
    if bad:
        problems.append(f"indices out of range [0, {size}): {bad}")
    dupes = sorted({int(i) for i in idx.tolist() if int((idx == i).sum()) > 1})
    if dupes:
        problems.append(f"repeated indices: {dupes}")
    if idx.numel() == 0:
        problems.append("no channel kept")
    if problems:
        raise SurgeryError(f"{what}: " + "; ".join(problems))
    return torch.sort(idx).values


def count_parameters(module: nn.Module) -> int:
    """Learned parameters (BatchNorm running statistics are buffers and not counted)."""
    return sum(p.numel() for p in module.parameters())
