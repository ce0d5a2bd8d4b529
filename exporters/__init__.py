"""ONNX export and ONNX Runtime validation/latency of pruned models.

May import `compressor`; never `service`. The exporters arrive with the export issue; this package
exists now so the layering (service -> exporters -> compressor) is fixed from the start.
"""
