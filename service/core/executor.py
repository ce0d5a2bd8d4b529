"""What the supervisor needs from "something that runs a job", and the local executor.

An `Executor` offers slots (one job each) and starts an `Attempt` of a job on one. An attempt

- `start()`s (the worker exists and runs once it returns),
- yields `messages()`: ("progress", event) while the job runs, then ("done", {"report", "artifacts"}) or
  ("error", JobError); the stream ends early when the worker is gone,
- is `stop()`ped (cancel, time budget, shutdown: the worker is killed; idempotent),
- and `end()`s: waits until the worker is gone and its resources are free, and says how it ended
  (`Ended`: an exit code, or that the node it ran on left the cluster).

The artifacts a "done" names are in the server's blob store when the message is yielded (the local worker
writes them there itself; a remote executor brings them back first, digests checked). Job state never
lives in an executor: the supervisor persists every transition in the job store.

`LocalExecutor`: a spawned worker process per job on this machine (`service.core.worker`), one slot per
configured device (a device may be named twice: two CPU slots). With several CPU slots, each gets its
own share of the machine's cores and its worker is pinned to them: two jobs that each ran torch and ONNX
Runtime on every core oversubscribed the machine (two small ResNet-20 jobs on 2 cores: 85.5 s each,
against 25.5 s each pinned to one core on Ray; bench/RESULTS.md). GPU slots are not pinned.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from ..errors import FieldViolation
from .blobs import BlobStore
from .worker import WorkerArgs
from .worker import run as run_worker

EXIT_GRACE_S = 5.0  # how long a worker whose pipe closed may take to exit on its own before it is killed

Message = tuple[str, Any]  # ("progress", event) | ("done", {"report", "artifacts"}) | ("error", JobError)


@dataclass(frozen=True)
class Slot:
    """Room for one job: its name (for logs and progress), the device the job is given, and its cores."""

    name: str  # "cpu", "cuda:1", "cpu#2" (a device named twice), "ray-0"
    device: str  # "cpu" or "cuda:N"; "auto": chosen where the job lands (Ray)
    cores: tuple[int, ...] = ()  # the job is pinned to these; empty: not pinned (where it runs decides)


@dataclass(frozen=True)
class Ended:
    """How an attempt's worker ended."""

    exitcode: int | None = None  # a process's exit code (negative: the signal), None when unknown
    node_lost: bool = False  # the node it ran on left the cluster (Ray): the job runs again
    detail: str = ""  # what the executor knows of why, for the log


class Attempt(ABC):
    """One run of one job (see the module docstring for its life cycle)."""

    where: str = ""  # "worker pid 123", "Ray actor ... on node ...": for the log, set by start()

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    def messages(self) -> AsyncIterator[Message]: ...

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    async def end(self) -> Ended: ...


class Executor(ABC):
    name: str
    # whether the job store still uses a blob (JobService sets it): a half-imported result deletes only others
    referenced: Callable[[str], bool] = staticmethod(lambda digest: True)

    @abstractmethod
    def slots(self) -> list[Slot]:
        """The slots jobs may run on now (asked on every scheduling pass: a cluster may grow or shrink)."""

    @abstractmethod
    def attempt(self, args: WorkerArgs, slot: Slot) -> Attempt: ...

    def refusals(self, spec: dict[str, Any], references: dict[str, str]) -> list[FieldViolation]:
        """What this executor cannot run in an accepted submission (e.g. a path no worker can read)."""
        return []

    async def close(self) -> None:  # noqa: B027 (optional: most executors hold nothing)
        """Release what the executor holds (after every attempt has ended)."""


# ---- the local executor ------------------------------------------------------------------------------------


class LocalExecutor(Executor):
    name = "local"

    def __init__(self, devices: list[str], blobs: BlobStore) -> None:
        assert devices, "at least one device"
        self.blobs = blobs
        seen: dict[str, int] = {}
        cpu_slots = sum(device == "cpu" for device in devices)
        cores = sorted(os.sched_getaffinity(0))
        if cpu_slots > len(cores):
            raise ValueError(f"{cpu_slots} cpu slots on {len(cores)} cores: each CPU job needs a core of its own")
        shares = iter(share_cores(cores, cpu_slots) if cpu_slots > 1 else [])
        self._slots = []
        for device in devices:
            seen[device] = seen.get(device, 0) + 1
            name = device if seen[device] == 1 else f"{device}#{seen[device]}"
            # CPU jobs side by side each keep to their share; a lone CPU job and GPU jobs use every core
            self._slots.append(Slot(name, device, tuple(next(shares)) if device == "cpu" and cpu_slots > 1 else ()))

    def slots(self) -> list[Slot]:
        return list(self._slots)

    def attempt(self, args: WorkerArgs, slot: Slot) -> Attempt:
        return _LocalAttempt(replace(args, cores=slot.cores))


def share_cores(cores: list[int], slots: int) -> list[list[int]] | None:
    """`cores` cut into `slots` contiguous shares as equal as can be; None when there are fewer cores
    than slots (then nobody is pinned: the shares would overlap)."""
    if len(cores) < slots:
        return None
    size, extra = divmod(len(cores), slots)
    shares, start = [], 0
    for i in range(slots):
        end = start + size + (1 if i < extra else 0)
        shares.append(cores[start:end])
        start = end
    return shares


class _LocalAttempt(Attempt):
    """A spawned process running `service.core.worker.run`, its messages up a pipe."""

    def __init__(self, args: WorkerArgs) -> None:
        context = multiprocessing.get_context("spawn")
        self.receiver, sender = context.Pipe(duplex=False)
        self._sender = sender
        self.process = context.Process(target=run_worker, args=(args, sender),
                                       name=f"osscar-worker-{args.operation.rsplit('/', 1)[-1][:8]}")

    async def start(self) -> None:
        self.process.start()
        self._sender.close()  # the worker holds the only writing end: its exit ends the stream
        self.where = f"worker pid {self.process.pid}"

    async def messages(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await asyncio.to_thread(self.receiver.recv)
            except (EOFError, OSError):
                return

    def stop(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            self.process.kill()

    async def end(self) -> Ended:
        if self.process.pid is not None:  # a worker that closed its pipe is exiting: its own exit code, not -9
            await asyncio.to_thread(self.process.join, EXIT_GRACE_S)
        self.stop()
        if self.process.pid is not None:
            await asyncio.to_thread(self.process.join)
        self.receiver.close()
        return Ended(self.process.exitcode)

