"""Half-precision models computing in float32 without a float32 copy (`float32_view`): the exporter's traces and
the whole-model fit's dense reference read a bf16 / fp16 checkpoint this way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class _Upcast(torch.nn.Module):
    """A parametrization that reads a half-precision weight as float32 (a new tensor at each access)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.float()


@contextlib.contextmanager
def float32_view(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` computing in float32 without a float32 copy of it: every half-precision parameter is read through
    an upcast (`_Upcast`) and its floating buffers (rotary frequencies) are float32 until the block ends, when
    the same parameter and buffer objects are back. A 1.2 B bf16 decoder's float32 copy was 4.9 GB beside its
    2.4 GB (bench/RESULTS.md, session 32); here one layer's weights are float32 at a time, and the forward is the
    copy's to the last bit (bf16 -> float32 is exact). An export traces each upcast as a Cast of the bf16
    initializer, which `_upcast_initializers` turns back into a float32 initializer written one tensor at a time."""
    from torch.nn.utils import parametrize

    half = [(module, name) for module in model.modules() for name, p in module._parameters.items()
            if p is not None and p.is_floating_point() and p.dtype != torch.float32]
    buffers = [(module, name, b) for module in model.modules() for name, b in module._buffers.items()
               if b is not None and b.is_floating_point() and b.dtype != torch.float32]
    done: list[tuple[torch.nn.Module, str]] = []
    try:
        for module, name in half:
            # unsafe: the upcast changes the dtype, which parametrize refuses to check otherwise
            parametrize.register_parametrization(module, name, _Upcast(), unsafe=True)
            done.append((module, name))
        for module, name, buffer in buffers:
            module._buffers[name] = buffer.float()
        yield model
    finally:
        for module, name in reversed(done):
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)
        for module, name, buffer in buffers:
            module._buffers[name] = buffer
