"""Generated protobuf and gRPC modules of osscar.compression.v1 (proto/generate.py)."""
