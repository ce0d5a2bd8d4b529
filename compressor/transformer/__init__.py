"""Hugging Face transformers: `adapters` (the family table: module paths and config keys), `models`
(loading a supported family), `surgery` (heads and FFN neurons removed, widths saved and reloaded),
`pipeline` (`prune_transformer`, `prune_blocks`) and `offload` (streamed safetensors checkpoints).
Never imports `compressor.cnn`.
"""
