"""Layer-wise structured pruning, in three parts:

* `compressor.solver`: the OSSCAR layer solver and its baselines (pure tensor math; imports nothing
  else of the compressor);
* `compressor.cnn`: conv graphs (torch.export ATen graphs): channel analysis, surgery, the pipeline;
* `compressor.transformer`: Hugging Face transformers: the family adapter table, head and FFN surgery,
  the block-by-block pipeline and streamed checkpoints.

What both pipelines share stays here: calibration data, layer statistics, width allocation, layer
reports, input errors and module helpers. Imports nothing from `exporters` or `service`.
"""

from .solver import METHODS, LayerSolution, OsscarConfig, solve_layer

__all__ = ["METHODS", "LayerSolution", "OsscarConfig", "solve_layer"]
