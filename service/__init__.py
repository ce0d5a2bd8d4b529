"""The application layer: the compression job, the `osscar` CLI and (later) the gRPC service."""
