"""Jobs on a Ray cluster: one actor per job, placed by Ray, supervised by the server like a local worker.

`osscar serve --executor ray --ray-address ADDR` connects the server (the Ray driver) to a cluster; the job
store stays the server's, so a Ray restart loses no job (a job whose actor is gone ends or runs again as
below). Ray is an optional extra (`pip install '.[ray]'`); nothing here imports it before this executor is
chosen.

- **Placement.** Each job is a `JobRunner` actor asking for one GPU (`num_gpus=1`) on a cluster with GPUs,
  else only CPUs, and `cpus_per_job` CPUs (`--ray-cpus-per-job`; 0: a GPU node's CPUs per GPU, or a whole
  CPU-only node). The server offers as many slots as the live nodes hold such bundles (asked again every
  few seconds, in a thread: the cluster may grow or shrink); beyond that jobs wait QUEUED in our store.
- **Inputs travel** (no shared filesystem is assumed): a model, calibration or eval file that does not lie
  under `--shared-roots` is cut into 32 MiB chunks put in Ray's object store (`ray.put`); the actor writes
  them into its scratch directory, checks every file's sha256 against the server's and says so, and the
  server drops its references (the pieces may then leave the object store). Path references outside
  `--shared-roots` are refused at submission (INVALID_ARGUMENT): no node is known to see them.
- **Progress travels back by long poll**: the server calls the actor's `events(cursor)` in a loop; a call
  returns the events after `cursor` as soon as there are any (or after a second). Ray's own RPC carries it,
  so Ray's security (its auth token, its network) applies and we open no port; a dead actor ends the loop.
- **Artifacts come back** the same way, pulled in 32 MiB chunks (`read`) into the server's
  content-addressed store; a blob whose sha256 or size differs from what the worker announced is refused
  (the job fails INTERNAL, nothing of it kept: blobs this attempt brought in are deleted unless the store
  uses them, as after any transfer cut short). Then the actor removes its scratch and is killed.
- **How a job ends.** As with local workers: the job's own result or error; cancel = `ray.kill` of the
  actor (Ray's cancellation for actors: `ray.cancel` cannot stop a running actor task) and CANCELLED; an
  actor process that dies = WORKER_CRASHED. Only Ray knows more: the job's node left the cluster (Ray's
  death cause says so, or its node table does within a few seconds), or Ray itself failed under the job.
  Such a job is re-queued like a server restart re-queues it (attempts count; after `--max-attempts`,
  FAILED `NODE_LOST`); artifacts are only recorded from a finished run, so none is duplicated. An actor
  Ray calls temporarily unavailable gets 30 s to answer again; failures of the job's own calls or
  resources (a task error, a full object store) end it as a crash, since running it elsewhere would fail
  alike.
- **A node's scratch** (`--ray-scratch`, default `<tmp>/osscar-ray`, then the node's id: a directory the
  nodes share still keeps them apart) is that node's home for the jobs it runs: the dense-curves cache,
  each job's work directory (a crashed job's is removed by the next job to start there), the per-core
  lock files and the latency lock.
- **CPU cores.** Ray counts CPUs but does not pin them. Each actor claims as many cores as Ray granted it
  (one flock per core under the node's scratch: two jobs never claim the same core, and a dead process
  frees its claim) and pins itself and its threads to them; ONNX Runtime and torch use that many threads.
  Jobs on one node also take turns measuring latency (the node's latency lock), so a timing never shares
  the node with another job's timing, pinned or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import FieldViolation
from .blobs import BlobStore
from .config import ServiceConfig
from .executor import Attempt, Ended, Executor, Message, Slot
from .outcomes import INTERNAL_MESSAGE, JobError
from .worker import WorkerArgs, execute, latency_lock_path

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # inputs and artifacts travel in pieces of this size (bounded memory on both ends)
POLL_S = 1.0  # the longest an events() call waits for news
SLOTS_TTL_S = 5.0  # the cluster's shape is asked again after this
UNAVAILABLE_S = 30.0  # an actor Ray calls temporarily unavailable gets this long to answer again
# an actor not placed (constructed on a node) within this long: the cluster shrank below the slots counted a moment
# before, or cannot hold the ask; the job goes back to the queue and the slots are counted again (it waited for a
# node forever, RUNNING, its slot held, when it had no time budget)
PLACEMENT_S = 600.0
NODE_GRACE_CHECKS = 3  # looks (a second apart) at Ray's node table before a dead actor's node counts as alive
INPUT_FIELDS = ("model", "calibration", "eval", "widths_from")


def _is_path_reference(reference: str) -> bool:
    return not reference.startswith(("blob:", "embedded:"))


@dataclass(frozen=True)
class ShippedFile:
    relative: str  # the file's path inside the shipped input ("" when the input is this one file)
    sha256: str
    size: int
    chunks: tuple[Any, ...]  # ray.ObjectRef of each piece, in order


@dataclass(frozen=True)
class Shipped:
    """An input that travels to the worker through the object store."""

    field: str  # model | calibration | eval | widths_from
    name: str  # the file's or directory's name, kept (suffixes matter to the loaders)
    directory: bool
    files: tuple[ShippedFile, ...]


def ship(field: str, path: Path) -> Shipped:
    """Put a file or a directory tree into Ray's object store, piece by piece."""
    import ray

    def put(file: Path, relative: str) -> ShippedFile:
        digest, chunks, size = hashlib.sha256(), [], 0
        with open(file, "rb") as handle:
            while piece := handle.read(CHUNK_BYTES):
                digest.update(piece)
                chunks.append(ray.put(piece))
                size += len(piece)
        return ShippedFile(relative, digest.hexdigest(), size, tuple(chunks))

    if path.is_dir():
        files = tuple(put(f, f.relative_to(path).as_posix()) for f in sorted(path.rglob("*")) if f.is_file())
        return Shipped(field, path.name, True, files)
    return Shipped(field, path.name, False, (put(path, ""),))


def receive(shipped: Shipped, into: Path) -> Path:
    """Write a shipped input under `into`, every file's digest checked; returns its path."""
    import ray

    target = into / shipped.field / shipped.name
    for item in shipped.files:
        path = target / item.relative if shipped.directory else target
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with open(path, "wb") as handle:
            for ref in item.chunks:
                piece = ray.get(ref)
                digest.update(piece)
                handle.write(piece)
        if digest.hexdigest() != item.sha256:
            raise RuntimeError(f"input {shipped.field} ({item.relative or shipped.name}) arrived with sha256 "
                               f"{digest.hexdigest()}, shipped as {item.sha256}")
    if shipped.directory:
        target.mkdir(parents=True, exist_ok=True)  # an empty directory still arrives
    return target


# ---- the worker side: one actor per job ---------------------------------------------------------------------


def claim_cores(count: int, lock_dir: Path) -> tuple[list[int], list[Any]]:
    """Claim `count` of this process's allowed cores for as long as the returned handles stay open (one
    non-blocking flock per core, so jobs on a node never claim the same core); fewer when the node's jobs
    asked Ray for more CPUs than the node has cores."""
    import fcntl

    lock_dir.mkdir(parents=True, exist_ok=True)
    cores, handles = [], []
    for core in sorted(os.sched_getaffinity(0)):
        if len(cores) == count:
            break
        handle = open(lock_dir / f"core-{core}.lock", "a")  # noqa: SIM115 (held open: the claim)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        cores.append(core)
        handles.append(handle)
    return cores, handles


class JobRunner:
    """The actor that runs one job (`ray.remote` is applied by `RayExecutor`). Threaded: `run` works while
    `events` and `read` answer the server. Its node's scratch is `<scratch>/<node id>`, so a scratch
    directory on a filesystem the nodes share still keeps each node's work and core claims apart."""

    def __init__(self, scratch: str, cpus: int, log_format: str) -> None:
        import ray

        from ..logs import configure

        configure(log_format)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.home = Path(scratch or Path(tempfile.gettempdir()) / "osscar-ray") / self.node_id[:16]
        self.work: Path | None = None
        self.blobs: BlobStore | None = None
        self._events: list[tuple[int, Message]] = []
        self._seq = 0
        self._finished = False
        self._changed = threading.Condition()
        self._sweep_work()
        self.cores, self._claims = claim_cores(cpus, self.home / "cores")
        if len(self.cores) < cpus:  # the node's jobs asked for more CPUs than it has cores
            log.warning("could claim %d of the %d cores Ray granted; running unpinned (jobs on this node take "
                        "turns timing, but their other work shares cores)", len(self.cores), cpus)
            for handle in self._claims:
                handle.close()
            self.cores, self._claims = [], []

    def _sweep_work(self) -> None:
        """Remove work directories whose job's process is gone (a killed actor cannot clean up)."""
        for owner in (self.home / "work").glob("*/owner"):
            with contextlib.suppress(OSError, ValueError):
                if not Path(f"/proc/{int(owner.read_text())}").exists():
                    shutil.rmtree(owner.parent, ignore_errors=True)

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": self.node_id, "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "cores": self.cores}

    def run(self, args: WorkerArgs, shipped: list[Shipped]) -> None:
        """The job; whatever happens, its last event is its result or its error."""
        try:
            local = self._prepare(args, shipped)
        except BaseException as err:
            log.error("preparing the job failed", exc_info=err)
            self._send(("error", JobError.from_exception(err, stage="loading")))
            return
        del shipped  # the input pieces may leave the object store (the server drops its references too)
        self._send(("inputs", None))
        execute(local, self._send, self.blobs)

    def _prepare(self, args: WorkerArgs, shipped: list[Shipped]) -> WorkerArgs:
        import ray

        from ..logs import operation_id

        operation_id.set(args.operation)
        with contextlib.suppress(OSError):
            os.nice(10)
        job = self.home / "work" / args.operation.rsplit("/", 1)[-1]
        shutil.rmtree(job, ignore_errors=True)
        self.work = job / Path(args.work_dir).name
        self.work.mkdir(parents=True)
        (job / "owner").write_text(str(os.getpid()))
        self.blobs = BlobStore(self.work / "blobs")
        os.environ["OSSCAR_LATENCY_LOCK"] = latency_lock_path(self.home)
        spec = dict(args.spec)
        for item in shipped:
            spec[item.field] = str(receive(item, self.work / "inputs"))
        device = "cuda:0" if ray.get_gpu_ids() else "cpu"  # Ray set CUDA_VISIBLE_DEVICES to the granted GPU
        return replace(args, spec=spec, home=str(self.home), work_dir=str(self.work / "job"), device=device,
                       cores=tuple(self.cores))

    def _send(self, message: Message) -> None:
        with self._changed:
            self._seq += 1
            self._events.append((self._seq, message))
            self._finished = self._finished or message[0] in ("done", "error")
            self._changed.notify_all()

    def events(self, cursor: int, wait_s: float) -> tuple[list[tuple[int, Message]], bool]:
        """The events after `cursor` (waiting up to `wait_s` for one) and whether the job's result is among
        those sent; events up to `cursor` were received and are forgotten."""
        with self._changed:
            self._events = [e for e in self._events if e[0] > cursor]
            if not self._events and not self._finished:
                self._changed.wait(wait_s)
            return list(self._events), self._finished

    def read(self, digest: str, offset: int, size: int) -> bytes:
        with open(self.blobs.path(digest), "rb") as handle:
            handle.seek(offset)
            return handle.read(size)

    def close(self) -> None:
        if self.work is not None:
            shutil.rmtree(self.work.parent, ignore_errors=True)


# ---- the server side --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """What the cluster offers, as last seen."""

    slots: tuple[Slot, ...]
    ask: dict[str, float]  # what each job asks Ray for
    seen: float  # time.monotonic() of the look


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, config: ServiceConfig, blobs: BlobStore) -> None:
        try:
            import ray
        except ImportError:
            raise RuntimeError("--executor ray needs Ray: pip install 'osscar-service[ray]'") from None
        self.config, self.blobs = config, blobs
        self.shared_roots = tuple(Path(r) for r in config.shared_roots)
        if not ray.is_initialized():
            ray.init(address=config.ray_address or None, namespace="osscar", log_to_driver=False,
                     logging_level=logging.WARNING)
        self.runner = ray.remote(JobRunner)
        self.cpus_per_job = config.ray_cpus_per_job
        self._lock = threading.Lock()
        self._refreshing = False
        self._shape = self._measure()
        log.info("Ray executor: cluster at %s, %s; each job asks for %s", config.ray_address or "(local)",
                 ray.cluster_resources(), self._shape.ask)

    # -- capacity: asked of Ray in a thread, never on the event loop after the start -------------------

    def slots(self) -> list[Slot]:
        with self._lock:
            shape, stale = self._shape, time.monotonic() - self._shape.seen > SLOTS_TTL_S and not self._refreshing
            if stale:
                self._refreshing = True
        if stale:
            threading.Thread(target=self.refresh, name="ray-shape", daemon=True).start()
        return list(shape.slots)

    def refresh(self) -> None:
        """Look at the cluster again now (in the caller's thread); the last shape stays if Ray does not answer."""
        try:
            shape = self._measure()
        except Exception as err:
            log.warning("could not read the Ray cluster's resources (keeping the last seen): %s", err)
            shape = None
        with self._lock:
            if shape is not None and shape.seen > self._shape.seen:  # a look begun earlier may end later
                self._shape = shape
            self._refreshing = False

    def ask(self) -> dict[str, float]:
        return dict(self._shape.ask)

    def _measure(self) -> _Shape:
        import ray

        seen = time.monotonic()  # when the look began: what it sees is at least this fresh
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        gpu_nodes = [r for r in nodes if r.get("GPU", 0) >= 1]
        cpus = self.cpus_per_job
        if not cpus:  # from the cluster's shape, fixed once there is one (a job's request then stays put)
            shapes = [int(r.get("CPU", 0) // r["GPU"]) for r in gpu_nodes] if gpu_nodes else \
                [int(r.get("CPU", 0)) for r in nodes if r.get("CPU", 0) >= 1]
            shapes = [c for c in shapes if c >= 1]
            cpus = min(shapes, default=1)
            if shapes:
                self.cpus_per_job = cpus
        if gpu_nodes:
            count = sum(min(int(r["GPU"]), int(r.get("CPU", 0) // cpus)) for r in gpu_nodes)
        else:
            count = sum(int(r.get("CPU", 0) // cpus) for r in nodes)
        ask = {"num_gpus": 1 if gpu_nodes else 0, "num_cpus": cpus}
        return _Shape(tuple(Slot(f"ray-{i}", "auto") for i in range(count)), ask, seen)

    # -- submissions ---------------------------------------------------------------------------------

    def refusals(self, spec: dict[str, Any], references: dict[str, str]) -> list[FieldViolation]:
        refused = []
        for field, reference in references.items():
            if field in INPUT_FIELDS and _is_path_reference(reference) and not self._shared(Path(spec[field])):
                roots = ", ".join(map(str, self.shared_roots)) or "none configured"
                refused.append(FieldViolation(field, f"the Ray executor reads paths only under --shared-roots "
                                                     f"({roots}); upload the file instead"))
        return refused

    def _shared(self, path: Path) -> bool:
        real = path.resolve()
        return any(real == root or root in real.parents for root in self.shared_roots)

    def attempt(self, args: WorkerArgs, slot: Slot) -> Attempt:
        return RayAttempt(self, args)

    async def close(self) -> None:
        import ray

        ray.shutdown()


def _kind(err: BaseException) -> str:
    """How a Ray error during a job ends it: "died" (its actor is gone: crashed, or its node left),
    "transient" (the actor is unreachable for now), "job" (a failure of the job's own calls or resources:
    retrying elsewhere would fail the same way) or "ray" (Ray itself failed: the job runs again)."""
    import ray

    errors = ray.exceptions
    if isinstance(err, getattr(errors, "ActorUnavailableError", ())):
        return "transient"
    if isinstance(err, errors.RayActorError):
        return "died"
    job_errors = tuple(getattr(errors, name) for name in ("RayTaskError", "ObjectStoreFullError", "OutOfDiskError",
                                                          "RuntimeEnvSetupError", "OutOfMemoryError")
                       if hasattr(errors, name))
    return "job" if isinstance(err, job_errors) else "ray"


class RayAttempt(Attempt):
    def __init__(self, executor: RayExecutor, args: WorkerArgs) -> None:
        self.executor, self.args = executor, args
        self.actor = None
        self.shipped: list[Shipped] = []
        self.node: dict[str, Any] = {}
        self.death: BaseException | None = None  # why the actor is gone (or Ray failed) under us
        self.kind = ""  # of the death: see _kind
        self.stopped = False  # killed on purpose (cancel, time budget, shutdown)
        self.finished = False  # its result (or error) was received
        self.running = None  # the ObjectRef of its run()
        self.imported: list[str] = []  # digests brought into the server's store by this attempt

    def _died(self, err: BaseException, kind: str | None = None) -> None:
        self.death, self.kind = err, kind or _kind(err)
        if self.kind in ("job", "ray"):
            log.error("Ray failed under the job (%s): %s", self.kind, err)

    async def start(self) -> None:
        import ray

        try:
            await self._start()
        except ray.exceptions.RayError as err:
            self._died(err)
        except ValueError as err:  # e.g. an actor option Ray refuses: not the job's input
            self._died(err, "job")
        except TimeoutError:  # not placed: Ray's side, the job runs again once the slots are counted anew
            self._died(TimeoutError(f"the job's actor was not placed on a node within {PLACEMENT_S:.0f} s"), "ray")
        if self.death is not None:
            self.where = f"nowhere: {type(self.death).__name__}"

    async def _start(self) -> None:

        spec = self.args.spec
        for field in INPUT_FIELDS:
            if spec.get(field) and not self.executor._shared(Path(spec[field])) and not self.stopped:
                self.shipped.append(await asyncio.to_thread(ship, field, Path(spec[field])))
        if self.stopped:  # cancelled (or shut down) while its inputs travelled
            self.where = "nowhere: stopped before it was placed"
            return
        ask = self.executor.ask()
        self.actor = self.executor.runner.options(**ask, max_restarts=0, max_task_retries=0, max_concurrency=4
                                                  ).remote(self.executor.config.ray_scratch, ask["num_cpus"],
                                                           self.args.log_format)
        self.node = await asyncio.wait_for(self._placed(), PLACEMENT_S)  # placed and constructed
        self.running = self.actor.run.remote(self.args, self.shipped)
        self.where = (f"Ray actor pid {self.node['pid']} on node {self.node['node_id'][:12]} ({self.node['ip']}), "
                      f"cores {self.node['cores'] or 'unpinned'}, GPUs {self.node['gpus'] or 'none'}")

    async def _placed(self) -> dict[str, Any]:
        return await self.actor.where.remote()

    async def messages(self) -> AsyncIterator[Message]:
        import ray

        if self.death is not None or self.actor is None:
            return
        cursor, unavailable_since = 0, None
        while True:
            try:
                batch, finished = await self.actor.events.remote(cursor, POLL_S)
                unavailable_since = None
                for seq, message in batch:
                    if message[0] == "inputs":  # the worker wrote them: the pieces may leave the object store
                        self.shipped = []
                        cursor = seq
                        continue
                    if message[0] == "done":
                        message = await self._bring_back(message)
                    # acknowledged once handled: the actor forgets what the next call's cursor covers, so a "done"
                    # whose artifacts a transient outage interrupted is asked for again (it was lost, and a job
                    # that had succeeded ended WORKER_CRASHED)
                    cursor = seq
                    self.finished = self.finished or message[0] != "progress"
                    yield message
                if finished and not batch:
                    return
                if not batch and not finished and await self._run_ended():
                    self._died(RuntimeError("the job's run() ended without a result"), "died")
                    return
            except ray.exceptions.RayError as err:
                kind = _kind(err)
                if kind == "transient":  # unreachable for now: Ray says it may come back
                    unavailable_since = unavailable_since or time.monotonic()
                    if time.monotonic() - unavailable_since < UNAVAILABLE_S:
                        await asyncio.sleep(1.0)
                        continue
                    kind = "died"
                self._died(err, kind)
                return

    async def _run_ended(self) -> bool:
        """Whether run() has returned (it always sends its result first; this catches a bug that would not)."""
        import ray

        if self.running is None:
            return False
        ready, _ = await asyncio.to_thread(ray.wait, [self.running], timeout=0, fetch_local=False)
        if not ready:
            return False
        batch, finished = await self.actor.events.remote(0, 0)  # anything sent just before it returned?
        return not batch and not finished

    async def _bring_back(self, message: Message) -> Message:
        """Pull the artifacts the worker announced into the server's blob store, digests checked."""
        blobs = self.executor.blobs
        for artifact in message[1]["artifacts"]:
            digest, size = artifact["sha256"], artifact["size_bytes"]
            if blobs.exists(digest):  # content-addressed: already here (e.g. an earlier identical job)
                continue
            writer = blobs.writer()
            try:
                while writer.size < size:
                    piece = await self.actor.read.remote(digest, writer.size, CHUNK_BYTES)
                    if not piece:
                        break
                    await asyncio.to_thread(writer.write, piece)
                if writer.size != size or writer.hash.hexdigest() != digest:
                    log.error("artifact %s arrived with sha256 %s and %d bytes; the worker announced %s and %d",
                              artifact["name"], writer.hash.hexdigest(), writer.size, digest, size)
                    writer.abort()
                    self._forget_imported()
                    return "error", JobError.of("internal", INTERNAL_MESSAGE)
                await asyncio.to_thread(writer.commit)
                self.imported.append(digest)
            except BaseException:
                writer.abort()
                self._forget_imported()
                raise
        return message

    def _forget_imported(self) -> None:
        """The artifacts this attempt brought in, when its result will not keep them (unless used elsewhere)."""
        for digest in self.imported:
            if not self.executor.referenced(digest):
                self.executor.blobs.delete(digest)
        self.imported = []

    def stop(self) -> None:
        import ray

        self.stopped = True
        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)

    async def end(self) -> Ended:
        import ray

        if self.finished and self.death is None and not self.stopped:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):  # its scratch: the node's disk
                await asyncio.wait_for(self.actor.close.remote(), 30)
        on_purpose = self.stopped
        self.stop()
        self.shipped, self.running = [], None  # the object store may drop the input pieces
        if not self.finished:
            self._forget_imported()  # a transfer cut short: its result never reached the supervisor
        if self.death is None:
            return Ended(0 if self.finished else None, detail="" if self.finished else "stopped")
        text = str(self.death).strip()
        detail = text.splitlines()[-1].strip()[:300] if text else type(self.death).__name__
        lost = not on_purpose and (self.kind == "ray" or (
            self.kind == "died" and await asyncio.to_thread(self._node_lost, text)))
        if lost:
            await asyncio.to_thread(self.executor.refresh)  # the lost node's slots must not take the job again
        return Ended(None, node_lost=lost, detail=detail)

    def _node_lost(self, text: str) -> bool:
        """Whether the actor's node left the cluster: Ray's death cause says so, or the node is (or within
        a few seconds becomes) dead in Ray's node table; Ray not answering counts as lost too."""
        import ray

        if "node has died" in text or "node was terminated" in text:
            return True
        node = self.node.get("node_id")
        if node is None:
            return False
        try:
            for _ in range(NODE_GRACE_CHECKS):
                if not any(n["NodeID"] == node and n["Alive"] for n in ray.nodes()):
                    return True
                time.sleep(1.0)
        except Exception:
            return True
        return False
