"""What the service core's tests share: a `JobService` on a temporary home, and a running job's record."""

import time

from service.core import JobService, ServiceConfig
from service.core.outcomes import RUNNING
from service.core.store import JobRecord


def service(tmp_path, **config) -> JobService:
    jobs = JobService(ServiceConfig(home=tmp_path / "home", **{"devices": ("cpu",), **config}))
    jobs.open()
    return jobs


def running_record(jobs: JobService, name: str = "operations/r", **fields) -> JobRecord:
    jobs.store.insert(JobRecord(name=name, body_sha256="x", request=b"", spec={}, state=RUNNING, attempt=1,
                                start_time=time.time(), **fields))
    return jobs.store.get(name)


