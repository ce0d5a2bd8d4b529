"""The server side's gRPC layer over `service.core` (the transport-agnostic job service): the server's
life cycle (`app`), its interceptors and servicers, and its settings."""
