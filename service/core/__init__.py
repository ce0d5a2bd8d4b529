"""The service core: durable compression jobs behind one transport-agnostic facade, `JobService`.

- `service`: the facade (life cycle, submit, get / list / cancel / delete / wait / watch, uploads,
  artifacts, retention);
- `submission`: what a submission must pass before it is queued;
- `supervisor`: the queue, slots, and how each job ends;
- `executor`: what runs a job (the interface; the local executor: one spawned worker process per job);
- `ray_executor`: the Ray executor (an actor per job on a Ray cluster; `ray` is an optional extra);
- `worker`: the job's process (runs `service.job.compress`, publishes the artifacts);
- `outcomes`: job states, the table of every way a job ends and the typed `JobError`;
- `feeds`: the in-memory event feeds behind watch and wait;
- `store`: the durable SQLite job store (and the list filter and page tokens);
- `config`: `ServiceConfig`;
- `blobs`, `references`, `policy`: the content-addressed store, what a request's references resolve to,
  and which of them a server allows;
- `metrics`: the Prometheus metrics.

Refusals are the domain errors of `service.errors`; the gRPC layer (`service.server`) maps them.
"""

from .config import ServiceConfig
from .outcomes import OUTCOMES, JobError
from .service import JobService, UploadHeader
from .submission import SubmitRequest

__all__ = ["OUTCOMES", "JobError", "JobService", "ServiceConfig", "SubmitRequest", "UploadHeader"]
