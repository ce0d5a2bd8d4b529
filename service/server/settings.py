"""The server's configuration: environment variables (`OSSCAR_<FIELD>`) overridden by `osscar serve` flags.

One table in the README lists every field (a test keeps the two in step). Lists are comma-separated in
both places (`OSSCAR_ALLOWED_ROOTS=/models,/data`).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..files import default_home

SCHEMES = ("path", "blob", "embedded")


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OSSCAR_", extra="forbid", validate_default=True)

    # --- network
    host: str = Field("127.0.0.1", description="address to bind; non-loopback needs TLS and auth (or --insecure)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one (printed at start)")
    insecure: bool = Field(False, description="allow a non-loopback bind without TLS and auth")
    tls_cert: Path | None = Field(None, description="PEM server certificate (chain); TLS when set with tls_key")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    tls_client_ca: Path | None = Field(None, description="PEM CA bundle: clients must present a certificate it "
                                                         "signed (mTLS)")
    tokens: SecretStr | None = Field(None, description="comma-separated bearer tokens accepted in `authorization` "
                                                       "metadata (health is exempt)")
    tokens_file: Path | None = Field(None, description="file with one bearer token per line (# comments)")
    # at least 2: a download's or an upload's chunk is 1 MiB of data plus its message's framing
    max_message_mb: int = Field(8, ge=2, le=64, description="largest gRPC message accepted (uploads are chunked)")
    max_concurrent_rpcs: int = Field(1000, ge=1, description="RPCs in flight before RESOURCE_EXHAUSTED")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus /metrics port on the same "
                                                                       "host (unset: off; 0: a free one)")
    health_port: int | None = Field(None, ge=0, le=65535, description="plaintext grpc.health.v1 only, on "
                                                                      "127.0.0.1 (for probes that cannot do TLS); "
                                                                      "unset: off")
    # --- jobs and data
    home: Path = Field(default_factory=default_home, description="jobs.sqlite, blobs/, work/, curves/ "
                                                                  "(default ~/.osscar)")
    max_queue: int = Field(16, ge=1, description="queued jobs before RESOURCE_EXHAUSTED")
    devices: str = Field("", description="comma-separated device slots, one job each (default: every CUDA "
                                         "device, else cpu)")
    max_attempts: int = Field(3, ge=1, description="runs of a job interrupted by restarts before it fails")
    retention_days: float = Field(30.0, gt=0, description="finished jobs and unused uploads are deleted after this")
    grace_s: float = Field(30.0, ge=0, description="seconds running jobs get on shutdown before they are re-queued")
    max_upload_mb: int = Field(65536, ge=1, description="largest upload")
    upload_idle_s: float = Field(120.0, gt=0, description="an upload that sends nothing for this long is ended")
    allowed_roots: str = Field("", description="comma-separated directories that path references must resolve "
                                               "inside (symlinks followed); empty: any absolute path")
    allowed_schemes: str = Field(",".join(SCHEMES), description="reference kinds accepted: path, blob, embedded")
    trust_remote_code: str = Field("", description="comma-separated model directories allowed to run their own "
                                                   "code (transformers trust_remote_code); empty: none")
    log_format: Literal["json", "text"] = Field("json", description="json: one object per line with the "
                                                                    "operation id; text: for people")
    # --- where jobs run
    executor: Literal["local", "ray"] = Field("local", description="local: a worker process per job on this "
                                                                   "machine's devices; ray: a Ray actor per job on "
                                                                   "a Ray cluster (pip install '.[ray]')")
    ray_address: str = Field("", description="the Ray cluster (HOST:6379 from a cluster node, or ray://HOST:10001); "
                                             "empty: a local one-node cluster")
    shared_roots: str = Field("", description="Ray: comma-separated directories every node reads at the same path; "
                                              "path references must lie under them (uploads travel to the worker)")
    ray_cpus_per_job: int = Field(0, ge=0, description="Ray: CPUs each job asks for and is pinned to (0: a GPU "
                                                       "node's CPUs per GPU, or a whole CPU-only node)")
    ray_scratch: str = Field("", description="Ray: each node's scratch directory (curves cache, jobs' work); "
                                             "empty: <tmp>/osscar-ray")

    @field_validator("allowed_schemes")
    @classmethod
    def _schemes(cls, value: str) -> str:
        bad = [s for s in _split(value) if s not in SCHEMES]
        if bad:
            raise ValueError(f"unknown schemes {bad}; known: {', '.join(SCHEMES)}")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> ServerSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if self.executor == "local" and (self.ray_address or self.shared_roots):
            raise ValueError("ray_address and shared_roots are settings of --executor ray")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if self.list_of("devices").count("cpu") > cores:
            raise ValueError(f"devices: {self.list_of('devices').count('cpu')} cpu slots on {cores} cores; each CPU "
                             "job needs a core of its own")
        if self.executor == "ray" and self.devices:
            raise ValueError("devices are local slots; on --executor ray, Ray places jobs (one GPU each)")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "tokens_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
        if not self.loopback and not self.insecure and not (self.tls and self.authenticated):
            raise ValueError(f"refusing to serve on {self.host} without TLS and authentication (tokens or mTLS); "
                             "set them, bind 127.0.0.1, or pass --insecure")
        return self

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def authenticated(self) -> bool:
        return bool(self.bearer_tokens()) or self.tls_client_ca is not None

    def bearer_tokens(self) -> frozenset[str]:
        found = set(_split(self.tokens.get_secret_value())) if self.tokens else set()
        if self.tokens_file is not None:
            lines = Path(self.tokens_file).read_text().splitlines()
            found |= {line.strip() for line in lines if line.strip() and not line.strip().startswith("#")}
        return frozenset(found)

    def list_of(self, name: str) -> tuple[str, ...]:
        return tuple(_split(getattr(self, name)))


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]
