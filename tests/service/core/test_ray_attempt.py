"""A Ray attempt's message loop against a stand-in actor (no cluster): what a transient outage interrupts."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from service.core.blobs import BlobStore

ray = pytest.importorskip("ray", reason="ray is not installed (pip install '.[ray]')")

DATA = b"artifact bytes " * 100
DIGEST = hashlib.sha256(DATA).hexdigest()


class _Remote:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)
        return call()


class _Actor:
    """The worker's actor as `RayRunner` answers: events after the cursor (those up to it forgotten), reads of a
    finished job's blob; its first read fails as an unreachable actor does."""

    def __init__(self) -> None:
        self.queue = [(1, ("progress", {})), (2, ("done", {"artifacts": [
            {"name": "model.onnx", "sha256": DIGEST, "size_bytes": len(DATA), "media_type": "application/onnx"}]}))]
        self.reads = 0
        self.events, self.read = _Remote(self._events), _Remote(self._read)

    def _events(self, cursor: int, wait_s: float):
        self.queue = [e for e in self.queue if e[0] > cursor]
        return list(self.queue), True

    def _read(self, digest: str, offset: int, size: int) -> bytes:
        self.reads += 1
        if self.reads == 1:
            error = ray.exceptions.ActorUnavailableError.__new__(ray.exceptions.ActorUnavailableError)
            Exception.__init__(error, "the actor is temporarily unavailable")
            raise error
        return DATA[offset:offset + size]


def test_a_result_whose_artifacts_an_outage_interrupted_is_asked_for_again(tmp_path, monkeypatch):
    """The "done" was acknowledged before its artifacts were pulled: after the outage the actor had forgotten it, the
    loop ended without a result and a job that had succeeded ended WORKER_CRASHED."""
    from types import SimpleNamespace

    from service.core import ray_executor

    sleep = asyncio.sleep
    monkeypatch.setattr(ray_executor.asyncio, "sleep", lambda seconds: sleep(0))
    blobs = BlobStore(tmp_path / "blobs")
    attempt = ray_executor.RayAttempt(SimpleNamespace(blobs=blobs, referenced=lambda digest: False), None)
    attempt.actor = _Actor()

    async def messages():
        return [message async for message in attempt.messages()]

    got = asyncio.run(messages())
    assert [m[0] for m in got] == ["progress", "done"] and attempt.finished and attempt.death is None
    assert blobs.exists(DIGEST) and blobs.path(DIGEST).read_bytes() == DATA and attempt.actor.reads >= 2


def test_an_actor_never_placed_gives_the_job_back_as_rays_failure(monkeypatch):
    """The cluster shrank between the slots' count and the placement: the actor waited for a node forever and the
    job stayed RUNNING, its slot held, when it had no time budget. Not placed within PLACEMENT_S, the attempt ends as
    Ray's failure (the job runs again, the slots are counted anew)."""
    from types import SimpleNamespace

    from service.core import ray_executor

    class Unplaced:
        def __init__(self) -> None:
            async def never():
                await asyncio.Event().wait()

            self.where = SimpleNamespace(remote=never)

    runner = SimpleNamespace(options=lambda **ask: SimpleNamespace(remote=lambda *args: Unplaced()))
    executor = SimpleNamespace(runner=runner, ask=lambda: {"num_cpus": 1}, config=SimpleNamespace(ray_scratch="/x"),
                               _shared=lambda path: True)
    monkeypatch.setattr(ray_executor, "PLACEMENT_S", 0.05)
    attempt = ray_executor.RayAttempt(executor, SimpleNamespace(spec={}, log_format="json"))
    asyncio.run(attempt.start())
    assert attempt.kind == "ray" and isinstance(attempt.death, TimeoutError)
    assert attempt.where == "nowhere: TimeoutError" and attempt.running is None
