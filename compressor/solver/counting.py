"""Count ATen ops and host synchronisations of a piece of solver code (benchmarks and tests).

A synchronisation is anything that makes the host wait for the device's values: `.item()`,
`.tolist()`, `bool(tensor)`, `float(tensor)`, a copy to the CPU, an explicit device synchronise,
and the ops whose output size depends on the data (nonzero, boolean-mask indexing, unique, ...).
On the CPU nothing waits, but the same calls are made, so the count found here is the count a GPU
would pay. `.tolist()`, `.numpy()` and `torch.cuda.synchronize` do not go through the dispatcher:
they are wrapped for the lifetime of the counter.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops that read device values on the host, or whose output shape depends on them
_SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(), float(), int()
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.repeat_interleave.Tensor,
}
_INDEXING_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in _SYNC_OPS:
        return func is not aten.repeat_interleave.Tensor or kwargs.get("output_size") is None
    if func in _INDEXING_OPS:  # a boolean mask index is a nonzero in disguise
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)
    # device -> host copies, unless asynchronous: a non-blocking `.to("cpu")` from a GPU lands in pinned memory
    # (`_to_copy` pins its output) and the host goes on; a non-blocking `copy_` only when its target is pinned
    if func is aten._to_copy.default:
        return _to_host(args[0], kwargs.get("device")) and not kwargs.get("non_blocking", False)
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return _to_host(src, dst.device) and not (non_blocking and dst.is_pinned())
    return False


def _to_host(src: object, dst_device: object) -> bool:
    return (isinstance(src, torch.Tensor) and src.device.type != "cpu"
            and dst_device is not None and torch.device(dst_device).type == "cpu")


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as c: ...` then `c.ops` (ATen ops run), `c.syncs`, `c.sync_ops` (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.sync_ops: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}

    def _note_sync(self, name: str) -> None:
        self.syncs += 1
        self.sync_ops[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if _is_sync(func, args, kwargs):
            self._note_sync(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    def __enter__(self) -> OpCounter:
        counter = self

        def wrap(name: str, original: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                counter._note_sync(name)
                return original(*args, **kwargs)
            return wrapped

        self._saved = {"tolist": torch.Tensor.tolist, "numpy": torch.Tensor.numpy,
                       "synchronize": torch.cuda.synchronize}
        torch.Tensor.tolist = wrap("tolist", self._saved["tolist"])
        torch.Tensor.numpy = wrap("numpy", self._saved["numpy"])
        torch.cuda.synchronize = wrap("cuda.synchronize", self._saved["synchronize"])
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.Tensor.tolist = self._saved["tolist"]
        torch.Tensor.numpy = self._saved["numpy"]
        torch.cuda.synchronize = self._saved["synchronize"]
