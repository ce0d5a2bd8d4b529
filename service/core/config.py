"""The service core's settings (the transport builds them from `service.server.settings.ServerSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .policy import ReferencePolicy


@dataclass
class ServiceConfig:
    home: Path  # $OSSCAR_HOME: jobs.sqlite, blobs/, work/, curves/
    max_queue: int = 16  # queued jobs beyond this are refused with RESOURCE_EXHAUSTED
    devices: tuple[str, ...] = ()  # one job at a time on each; empty: every CUDA device, else ("cpu",)
    max_attempts: int = 3  # runs of a job interrupted by server restarts before it fails INTERRUPTED
    retention_s: float = 30 * 86400  # finished operations and unused uploads are forgotten after this
    max_upload_bytes: int = 64 << 30
    upload_idle_s: float = 120.0  # an upload that sends nothing for this long is ended (it held an RPC slot)
    max_wait_s: float = 600.0  # WaitOperation's timeout is capped here
    default_wait_s: float = 60.0
    retry_after_s: float = 30.0  # suggested to clients refused because the queue is full
    policy: ReferencePolicy = field(default_factory=ReferencePolicy)  # what references may name
    log_format: str = "json"  # of the workers' logs, as the server's
    executor: str = "local"  # local: worker processes on this machine; ray: actors on a Ray cluster
    ray_address: str = ""  # the cluster (ray.init's address: "HOST:6379", "ray://HOST:10001"; "": start a local one)
    shared_roots: tuple[str, ...] = ()  # Ray: directories every node reads at the same path (path references)
    ray_cpus_per_job: int = 0  # Ray: CPUs each job asks for and is pinned to; 0: from the cluster's shape
    ray_scratch: str = ""  # Ray: each node's scratch home (curves cache, jobs' work); "": <tmp>/osscar-ray
