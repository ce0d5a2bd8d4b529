"""Prometheus metrics of the service (one registry per server, no globals), served on their own port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

STAGE_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 14400)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Gauge("osscar_jobs", "Operations in the store by state", ["state"], registry=r)
        self.queue_depth = Gauge("osscar_queue_depth", "Jobs waiting for a device", registry=r)
        self.finished = Counter("osscar_jobs_finished", "Jobs that ended, by final state and status code",
                                ["state", "code"], registry=r)
        self.job_seconds = Histogram("osscar_job_seconds", "Wall time of a job's last attempt", ["state"],
                                     buckets=STAGE_BUCKETS, registry=r)
        self.stage_seconds = Histogram("osscar_stage_seconds", "Wall time of each job stage", ["stage"],
                                       buckets=STAGE_BUCKETS, registry=r)
        self.rpc_seconds = Histogram("osscar_rpc_seconds", "Handling time of unary RPCs", ["method"],
                                     buckets=RPC_BUCKETS, registry=r)
        self.rpc_errors = Counter("osscar_rpc_errors", "RPCs answered with an error status", ["method", "code"],
                                  registry=r)

    def serve(self, host: str, port: int) -> int:
        """Start /metrics over HTTP on a daemon thread; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
