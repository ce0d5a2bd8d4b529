"""The service core: durable compression jobs behind one transport-agnostic facade, `JobService`.

- `service`: the facade (life cycle, submit, get / list / cancel / delete / wait / watch, uploads,
  artifacts, retention);
- `submission`: what a submission must pass before it is queued;
- `supervisor`: the queue, device slots, one spawned worker process per job, and how each job ends;
- `worker`: the job's process (runs `service.job.compress`, publishes the artifacts);
- `outcomes`: job states, the table of every way a job ends and the typed `JobError`;
- `feeds`: the in-memory event feeds behind watch and wait;
- `store`: the durable SQLite job store (and the list filter and page tokens);
- `config`: `ServiceConfig`.

Refusals are the domain errors of `service.errors`; the gRPC layer (`service.grpc_server`) maps them.
"""

from .config import ServiceConfig
from .outcomes import OUTCOMES, JobError
from .service import JobService, UploadHeader
from .submission import SubmitRequest

__all__ = ["OUTCOMES", "JobError", "JobService", "ServiceConfig", "SubmitRequest", "UploadHeader"]
