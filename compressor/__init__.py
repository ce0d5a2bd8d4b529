"""Layer-wise structured pruning, in three parts:

* `compressor.solver`: the OSSCAR layer solver and its baselines (pure tensor math; imports nothing
  else of the compressor);
* `compressor.cnn`: conv graphs (torch.export ATen graphs): channel analysis, surgery, the pipeline;
* `compressor.transformer`: Hugging Face transformers: the family adapter table, head and FFN surgery,
  the block-by-block pipeline and streamed checkpoints.

What both pipelines share stays here: calibration data, layer statistics, width allocation, layer
reports, input errors and module helpers. Imports nothing from `exporters` or `service`.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .solver import METHODS, LayerSolution, OsscarConfig, solve_layer

__all__ = ["METHODS", "LayerSolution", "OsscarConfig", "solve_layer"]


def __getattr__(name: str) -> Any:
    """The solver's names, imported when first used: `compressor.errors` (which the CLI and the health check import)
    stays free of torch, a few seconds of a container's health probe."""
    if name in __all__:
        from . import solver

        return getattr(solver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
