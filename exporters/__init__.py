"""ONNX export and ONNX Runtime validation/latency of pruned models: `onnx` (export through the dynamo
exporter, decode steps with a KV cache, the parity gate) and `runtime` (ONNX Runtime in a spawned
subprocess: outputs and alternating latency measurements).

May import `compressor`; never `service` (service -> exporters -> compressor).
"""
