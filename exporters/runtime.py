"""ONNX Runtime, always in a spawned subprocess: outputs for the parity gate and evaluation, and
latency of a baseline and a compressed model measured alternately in one process (in turns, one session at
a time, when the host cannot hold both).

A crashing session (a bad kernel, an out-of-memory provider) ends the subprocess, not the caller: it
surfaces as `RuntimeFailure`. A hanging one is not timed out here (a large model's measurement takes
minutes): a server's job time budget ends its worker, and the subprocess with it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import pickle
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

log = logging.getLogger(__name__)
T = TypeVar("T")
Batch = list[np.ndarray] | dict[str, np.ndarray]  # model inputs in input order, or by name

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class RuntimeFailure(RuntimeError):
    """ONNX Runtime failed or crashed in its subprocess."""


class RuntimeKilled(RuntimeError):
    """ONNX Runtime's subprocess was killed from outside (SIGKILL: on a host short of memory, its out-of-memory
    killer): nothing the graph did, so not a `RuntimeFailure` (a job must not call its export broken for it)."""


def default_provider() -> str:
    """"cuda" when ONNX Runtime offers the CUDA provider and a session really runs on it, else "cpu" (also where
    CUDA_VISIBLE_DEVICES hides every GPU, as for a server's cpu slot: not a provider that fails to load)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers() or no_visible_gpu():
        return "cpu"
    loads, providers = provider_loads("cuda")
    if not loads:
        log.error("ONNX Runtime lists CUDAExecutionProvider but a session falls back to %s: its libraries do not "
                  "load (run ldd on onnxruntime/capi/libonnxruntime_providers_cuda.so). CUDA latency measurement "
                  "is refused; jobs measure on the CPU", providers)
        return "cpu"
    return "cuda"


def no_visible_gpu() -> bool:
    return os.environ.get("CUDA_VISIBLE_DEVICES") is not None and not os.environ["CUDA_VISIBLE_DEVICES"].strip()


def _probe_worker(provider: str) -> list[str]:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=[PROVIDERS[provider], "CPUExecutionProvider"])
    return list(session.get_providers())


@functools.cache
def provider_loads(provider: str) -> tuple[bool, list[str]]:
    """Whether a session asked for `provider` really runs on it (ONNX Runtime falls back to the CPU
    silently when a provider's libraries do not load), and the providers it got; once per process, in
    a subprocess."""
    providers = _call(_probe_worker, provider)
    return bool(providers) and providers[0] == PROVIDERS[provider], providers


def default_threads() -> int:
    """The cores this process may use: its affinity, within its cgroup's CPU quota (`docker run --cpus`, a Kubernetes
    CPU limit), which the affinity does not show: 64 threads timed on a 2-CPU quota would measure the throttling."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cpu_quota(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs the process may use by the CFS quotas of its cgroup and every cgroup above it, the tightest (what the
    kernel enforces: a job's cgroup says `max` under a limited pod or slice): cgroup v2 `cpu.max`, v1
    `cpu.cfs_quota_us` over `cpu.cfs_period_us`; None without a quota or where none can be read."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]  # id:controllers:path
    own_v2 = next((path for number, controllers, path in entries if number == "0" and not controllers), "/")
    own_v1 = next((path for _, controllers, path in entries if "cpu" in controllers.split(",")), "/")
    quotas = []
    for folder in _ancestors(root, own_v2):
        try:
            limit, period = (folder / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if limit != "max" and (quota := _ratio(limit, period)) is not None:
            quotas.append(quota)
    for base in (root / "cpu", root / "cpu,cpuacct"):
        for folder in _ancestors(base, own_v1):
            try:
                limit, period = ((folder / name).read_text().strip() for name in ("cpu.cfs_quota_us",
                                                                                   "cpu.cfs_period_us"))
            except OSError:
                continue
            if limit and not limit.startswith("-") and (quota := _ratio(limit, period)) is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _ancestors(base: Path, path: str) -> list[Path]:
    """`base` / `path`, then each folder above it up to `base` (a container sees its own cgroup as "/")."""
    parts = [part for part in path.strip().strip("/").split("/") if part and part not in (".", "..")]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _ratio(limit: str, period: str) -> float | None:
    try:
        value = int(limit) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 else None


def device_name(provider: str) -> str:
    if provider == "cuda":
        try:
            import torch

            return torch.cuda.get_device_name(0)
        except Exception:  # a name is informative only
            return "CUDA device"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({default_threads()} cores available)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _session(path: str, provider: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # latency timing alternates two sessions in one process: an idle one's spinning workers would steal the
    # cores of the one being timed (ResNet-20 dense/pruned pair: 1.72-2.60x with spinning, 1.95-2.30x without)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = [PROVIDERS[provider]] + (["CPUExecutionProvider"] if provider != "cpu" else [])
    session = ort.InferenceSession(path, options, providers=providers)
    if session.get_providers()[0] != PROVIDERS[provider]:
        # ONNX Runtime falls back to the CPU silently when a provider's libraries do not load: a "CUDA"
        # latency would then be the CPU's
        why = ("no GPU is visible to this process (CUDA_VISIBLE_DEVICES is empty, as in a server's cpu slot)"
               if no_visible_gpu() else "check the provider's libraries (ldd)")
        raise RuntimeFailure(f"{PROVIDERS[provider]} did not load (the session runs on {session.get_providers()}): "
                             f"refusing to measure on another device; {why}")
    return session


def _feed(session, inputs: Batch) -> dict[str, np.ndarray]:
    if isinstance(inputs, dict):
        return {i.name: inputs[i.name] for i in session.get_inputs()}
    return {i.name: x for i, x in zip(session.get_inputs(), inputs, strict=True)}


def _reduce(kind: str, output: np.ndarray, feed: dict[str, np.ndarray]) -> Any:
    if kind == "raw":
        return output
    if kind == "mean_pool":  # sentence embeddings: mean over non-padding tokens
        mask = feed.get("attention_mask", np.ones(output.shape[:2], np.int64))[..., None].astype(np.float64)
        return (output * mask).sum(1) / np.maximum(mask.sum(1), 1)
    if kind == "cls_pool":  # a sentence model that pools its first token's state (BGE-style)
        return output[:, 0]
    if kind == "lasttoken_pool":  # a decoder's embedding: the state of each row's last non-padding token (either side)
        mask = feed.get("attention_mask", np.ones(output.shape[:2], np.int64)).astype(bool)
        last = np.where(mask, np.arange(mask.shape[1]), -1).max(1)  # (batch,); -1 (the last) for a row all padding
        return output[np.arange(len(output)), last]
    if kind == "max_pool":  # one that pools each channel's largest value over non-padding tokens
        mask = feed.get("attention_mask", np.ones(output.shape[:2], np.int64))[..., None].astype(bool)
        return np.where(mask, output, -np.inf).max(1)
    if kind == "nll":  # causal LM: summed next-token NLL and token count (padding excluded)
        target = feed["input_ids"][:, 1:]
        mask = feed.get("attention_mask", np.ones_like(feed["input_ids"]))[:, 1:].astype(bool)
        total = 0.0
        # one window at a time: float64 temporaries of a whole batch's logits (16 x 128 tokens x a 128,256
        # vocabulary: 2.1 GB each, three of them) took the subprocess of a 1B decoder's job from 7.7 to 11 GB
        for row, ids, keep in zip(output, target, mask, strict=True):
            logits = row[:-1].astype(np.float64)  # (sequence - 1, vocabulary)
            logits -= logits.max(-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            total -= float(logp[np.arange(len(ids)), ids][keep].sum())
        return total, int(mask.sum())
    raise ValueError(f"unknown reduction {kind!r}")


def _outputs_worker(path: str, batches: list[Batch], provider: str, threads: int, reduce: str,
                    piece_bytes: int | None = None) -> list[Any]:
    if piece_bytes is not None:
        return _pieces_outputs(path, batches, provider, threads, reduce, piece_bytes)
    session = _session(path, provider, threads)
    out = []
    for inputs in batches:
        feed = _feed(session, inputs)
        results = session.run(None, feed)
        out.append(results if reduce == "all" else _reduce(reduce, results[0], feed))
    return out


def _pieces_outputs(path: str, batches: list[Batch], provider: str, threads: int, reduce: str,
                    piece_bytes: int) -> list[Any]:
    """`_outputs_worker`'s answer with the graph run in pieces of at most `piece_bytes` of weights, one session at a
    time, every batch through a piece before the next opens; the first output reduced as soon as a piece computes it
    (a 1 B decoder's logits of 64 windows would take 16 GB held to the end)."""
    from . import pieces as cut

    with cut.structure(path) as (model, source):
        return _pieces_of(model, source, batches, provider, threads, reduce, piece_bytes)


def _pieces_of(model: Any, path: Path, batches: list[Batch], provider: str, threads: int, reduce: str,
               piece_bytes: int) -> list[Any]:
    from . import pieces as cut

    if not batches:  # as the whole graph answers
        return []
    plan = cut.plan_pieces(model, piece_bytes)
    names = cut.graph_inputs(model)
    carrier = cut.Carrier([dict(b) if isinstance(b, dict) else dict(zip(names, b, strict=True)) for b in batches])
    first = model.graph.output[0].name
    read_later = [{n for later in plan[k + 1:] for n in later.inputs} for k in range(len(plan))]
    reduced: list[Any] = [None] * len(batches)
    written: dict[int, Path] = {}
    log.info("running %s in %d pieces of at most %s of weights", path, len(plan), _size(piece_bytes))
    try:
        for k, piece in enumerate(plan):
            file = cut.piece_file(model, plan, k, path, carrier.values[0], written)

            def reduced_now(b: int, values: dict[str, np.ndarray], later: set[str] = read_later[k]) -> None:
                output = values[first] if first in later else values.pop(first)
                reduced[b] = _reduce(reduce, output, {n: values[n] for n in names})

            computes = reduce != "all" and first in piece.outputs
            _run_piece(str(file), piece, carrier, provider, threads, reduced_now if computes else None)
    finally:
        cut.remove(written.values())
    if reduce == "all":
        return [[values[o.name] for o in model.graph.output] for values in carrier.values]
    return reduced


def _run_piece(path: str, piece: Any, carrier: Any, provider: str, threads: int,
               then: Callable[[int, dict[str, np.ndarray]], None] | None = None) -> None:
    """Every batch of `carrier` through one piece, `then(batch, its values)` after each (a reduction, before the
    next batch's outputs exist beside it); the session is gone on return."""
    session = _session(path, provider, threads)
    for b in range(len(carrier.values)):
        carrier.take(b, piece, session.run(list(piece.outputs), carrier.feed(b, piece)))
        if then is not None:
            then(b, carrier.values[b])


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when `parent_pid` does (PR_SET_PDEATHSIG on Linux, and a watchdog on the
    parent's pid everywhere): a killed parent must not leave children holding a device or blocking on a
    pipe forever."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)

    def watchdog() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watchdog, daemon=True, name="parent-watchdog").start()


# the child's whole program: this module and its function, nothing of the caller's `__main__`
_CHILD = "import sys; from exporters.runtime import _child; _child(int(sys.argv[1]), int(sys.argv[2]))"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


def _call(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a fresh interpreter that imports this module only. Not `multiprocessing`'s spawn: it
    re-imports the caller's `__main__` in every child (the `osscar` CLI and the server's workers: torch and
    transformers, 2.2 s and 240 MB per call on the 2-core VM). The arguments go in on stdin, the pickled
    result (or exception) comes back on a pipe of its own, so nothing the child prints can corrupt it; a
    child that dies without answering is a crash."""
    read_fd, write_fd = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    try:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(write_fd), str(os.getpid())],
                                 stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as answers:
            with contextlib.suppress(BrokenPipeError):  # a child that died at once: reported below
                child.stdin.write(pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
                child.stdin.close()
            answer = answers.read()
        code = child.wait()
    finally:
        if child.poll() is None:  # the caller was interrupted (Ctrl-C, a cancelled job): no orphan
            child.kill()
            child.wait()
        if child.returncode < 0:  # killed: its pieces' files (a copy of embedded weights too) are left behind
            from .pieces import remove_leftovers

            remove_leftovers([a for a in args if isinstance(a, str | Path)], child.pid)
    if not answer and code == -signal.SIGKILL:
        raise RuntimeKilled("ONNX Runtime's subprocess was killed (SIGKILL: most likely the host's out-of-memory "
                            "killer)")
    if not answer:
        raise RuntimeFailure(f"ONNX Runtime crashed in its subprocess (exit status {code})")
    try:
        ok, value = pickle.loads(answer)
    except Exception as err:  # an exception type that pickles but does not rebuild here
        raise RuntimeFailure(f"ONNX Runtime failed with an answer that does not unpickle: {err}") from err
    if ok:
        return value
    raise RuntimeFailure(f"ONNX Runtime failed: {type(value).__name__}: {value}") from value


def _child(answer_fd: int, parent_pid: int) -> None:
    """The child's side of `_call`: read (fn, args), answer (True, result) or (False, exception)."""
    die_with_parent(parent_pid)
    fn, args = pickle.loads(sys.stdin.buffer.read())
    try:
        answer = (True, fn(*args))
    except Exception as err:  # the caller re-raises it typed
        answer = (False, err)
    try:
        payload = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # an exception that does not pickle (a binding's own type): its text survives
        payload = pickle.dumps((False, RuntimeError(f"{type(answer[1]).__name__}: {answer[1]} ({err})")))
    with os.fdopen(answer_fd, "wb") as out:
        out.write(payload)


def run_outputs(path: str | Path, batches: list[Batch], *, provider: str = "cpu", threads: int | None = None,
                reduce: str = "all", piece_bytes: int | None = None) -> list[Any]:
    """Run `path` on each batch (a list in input order, or a dict by name) in a subprocess; per batch all
    outputs (`reduce="all"`) or the first output reduced ("raw", "mean_pool", "cls_pool", "max_pool",
    "lasttoken_pool", "nll").
    A graph whose one session the host cannot hold (`piece_budget`), or any graph given `piece_bytes`, runs in
    pieces of at most that many bytes of weights, one session at a time (`exporters.pieces`)."""
    if piece_bytes is None:
        piece_bytes, why = piece_budget((path,), provider)
        if why:
            log.info("%s: it runs in pieces of at most %s of weights, one session at a time", why, _size(piece_bytes))
    threads = threads or default_threads()
    try:
        return _call(_outputs_worker, str(path), batches, provider, threads, reduce, piece_bytes)
    except RuntimeKilled as err:
        smaller = _after_kill(err, provider, piece_bytes, (path,))
        return _call(_outputs_worker, str(path), batches, provider, threads, reduce, smaller)


def _after_kill(err: RuntimeKilled, provider: str, piece_bytes: int | None, paths: tuple[str | Path, ...]) -> int:
    """The pieces to run `paths` in once more after the subprocess was killed for the host's memory (the pieces this
    host allows now, if smaller than what was killed), or `err` again where there is nothing smaller to try."""
    from compressor.transformer.offload import available_memory

    smaller = _host_piece_bytes(available_memory())
    if provider != "cpu" or (piece_bytes is not None and piece_bytes <= smaller) or not external_weights(paths):
        raise err  # nothing smaller to try: pieces of an embedded graph hold it twice while they are cut
    log.warning("%s; running it again in pieces of at most %s of weights, one session at a time", err,
                _size(smaller))
    return smaller


@dataclass(frozen=True)
class Latency:
    baseline_ms: float  # median
    compressed_ms: float
    baseline_p90_ms: float
    compressed_p90_ms: float
    speedup: float  # median of the paired ratios baseline / compressed
    provider: str
    threads: int
    device: str
    repeats: int  # samples taken of each model (fewer than asked when long runs hit TIMING_SECONDS)
    runs_per_sample: int = 1  # back-to-back runs in each timed sample (MIN_SAMPLE_MS)
    # With I/O binding (the default on CUDA) the figures above keep inputs and outputs on the device, as a
    # server does; these are the same runs timed with the inputs uploaded and outputs copied to the host.
    io_binding: bool = False
    host_baseline_ms: float | None = None
    host_compressed_ms: float | None = None
    host_speedup: float | None = None
    # why the two sessions were timed one at a time, in turns (None: paired, both in one process at once)
    in_turn: str | None = None
    # the measurement's own wall time (its subprocess, sessions and warm-ups included), not the wait for the
    # machine's latency lock before it: what a caller pausing "a measurement's time" should scale by
    seconds: float | None = None
    # the most pieces either model ran in (`exporters.pieces`: a model whose one session the host cannot hold),
    # piece k of both timed side by side, and why; 0 and None: each model whole
    pieces: int = 0
    in_pieces: str | None = None


# A timed sample lasts at least this long: a model that runs in a millisecond or two is timed as n
# back-to-back runs (n from the warm-up), so one scheduler hiccup on a shared machine is a small part of
# a sample rather than most of it.
MIN_SAMPLE_MS = 20.0
# A large model's runs are long (a 1.2 B-parameter decoder: 8.4 s for 1 x 512 tokens on 2 CPU cores), and a pair
# of them sampled 20 times took 5 of every 6 minutes of a latency probe: its samples stop once they have
# taken TIMING_SECONDS and number at least MIN_REPEATS (a run that long averages out the scheduler's hiccups
# that many short samples are for), and its warm-up after the second pair (the first run allocates, the
# second is steady). Models that run a pair in under TIMING_SECONDS / 20 (3 s) are timed as before.
TIMING_SECONDS = 60.0
MIN_REPEATS = 5
SLOW_PAIR_S = 1.0  # warm-up pairs at least this long: two warm-ups are enough


def _timed(run: Callable[[], None], runs: int = 1) -> float:
    """Milliseconds per run of `runs` back-to-back runs."""
    start = time.perf_counter()
    for _ in range(runs):
        run()
    return 1000 * (time.perf_counter() - start) / runs


def _bound(session, feed: dict[str, np.ndarray], provider: str) -> Callable[[], None]:
    """A run of `session` on `feed` with I/O binding: inputs uploaded to the provider's device once,
    outputs left there (what a server that keeps its tensors on the GPU pays per request)."""
    import onnxruntime as ort

    device = "cuda" if provider == "cuda" else "cpu"
    binding = session.io_binding()
    inputs = {name: ort.OrtValue.ortvalue_from_numpy(value, device, 0) for name, value in feed.items()}
    for name, value in inputs.items():
        binding.bind_ortvalue_input(name, value)
    for output in session.get_outputs():
        binding.bind_output(output.name, device)

    def run() -> None:
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()  # the device's work is done when the timer stops

    run.inputs = inputs  # the device copies live as long as the runs that read them
    return run


def _unbound(session, feed: dict[str, np.ndarray]) -> Callable[[], None]:
    """A plain run: inputs from host memory, outputs copied back to it."""
    return lambda: session.run(None, feed)


def _latency_worker(baseline: str, compressed: str, feed: dict[str, np.ndarray], provider: str, threads: int,
                    warmup: int, repeats: int, io_binding: bool = False,
                    seconds: float | None = TIMING_SECONDS) -> tuple[list[float], ...]:
    """Per-run milliseconds of each timed sample of both models, alternating, and the runs per sample;
    with `io_binding` each sample is timed both ways (bound first, then with host copies). At most `repeats`
    samples each; fewer (never under MIN_REPEATS) once the samples have taken `seconds` (None: no limit)."""
    sessions = [_session(baseline, provider, threads), _session(compressed, provider, threads)]
    host = [_unbound(s, _feed(s, feed)) for s in sessions]
    ways = [[_bound(s, _feed(s, feed), provider) for s in sessions], host] if io_binding else [host]
    last = [MIN_SAMPLE_MS, MIN_SAMPLE_MS]  # without a warm-up: one run per sample
    for done in range(1, warmup + 1):
        pair = time.perf_counter()
        for runners in ways:
            for k, run in enumerate(runners):
                last[k] = _timed(run)
        if done >= 2 and time.perf_counter() - pair >= SLOW_PAIR_S:
            break
    runs = max(1, math.ceil(MIN_SAMPLE_MS / max(max(last), 1e-3)))  # the slower model's last warm-up run
    times: list[list[float]] = [[] for _ in range(2 * len(ways))]
    began = time.perf_counter()
    for done in range(1, repeats + 1):  # alternate, so a noisy neighbour slows both alike
        for w, runners in enumerate(ways):
            for k, run in enumerate(runners):
                times[2 * w + k].append(_timed(run, runs))
        if seconds is not None and done >= MIN_REPEATS and time.perf_counter() - began >= seconds:
            break
    return (*times, runs)


# When the host cannot hold both sessions (`sessions_fit`), they are timed one at a time in IN_TURN_LOADS turns that
# alternate, baseline first and last (`turn_samples`), so that every sample is paired with one of the other model's
# in an adjacent turn, the compressed sample later in half of the pairs and earlier in the other half, and a steady
# drift of the host's speed cancels in the pairs' median. An even number of turns cannot balance them: session 38's
# four (k, 2k, 2k, k) put the compressed sample later in two pairs of three, so the median read a drift as a slower
# compressed model (tests/exporters/test_runtime.py measures both).
IN_TURN_LOADS = 5
# A session's host memory per byte of its ONNX file and weights (ONNX Runtime's prepacked weights and their
# arena; a 1.2 B float32 decoder: 4.94 GB of weights, 6.19 GB at its peak on 1 x 512 tokens), plus a floor for the
# activations, and the share of the available memory a pair may take before it is timed in turn.
SESSION_BYTES_PER_FILE_BYTE = 1.3
SESSION_ACTIVATIONS = 512 << 20
PAIR_SHARE = 0.8


def files_of(path: str | Path) -> list[Path]:
    """The .onnx file and its external weights (`<name>.data`, as `exporters.onnx._export` saves them)."""
    path = Path(path)
    return [p for p in (path, path.with_name(path.name + ".data")) if p.exists()]


def session_bytes(path: str | Path) -> int:
    """Host memory a CPU session of `path` (and its `<name>.data` external weights) is expected to hold."""
    return int(SESSION_BYTES_PER_FILE_BYTE * sum(p.stat().st_size for p in files_of(path))) + SESSION_ACTIVATIONS


def sessions_fit(baseline: str | Path, compressed: str | Path, provider: str = "cpu") -> tuple[bool, int, int]:
    """Whether both sessions fit in PAIR_SHARE of the host's available memory at once, the bytes they need and
    the bytes available. A CUDA pair lives in the device's memory: always True there."""
    from compressor.transformer.offload import available_memory

    needed, available = session_bytes(baseline) + session_bytes(compressed), available_memory()
    return provider != "cpu" or needed <= PAIR_SHARE * available, needed, available


# A graph whose one CPU session would take more than SESSION_SHARE of the available memory runs in pieces whose
# weights take at most PIECE_SHARE of it each (the session ~1.3x that, the values handed between pieces beside it).
SESSION_SHARE = PAIR_SHARE  # one session may take what a pair may
PIECE_SHARE = 0.125
MIN_PIECE_BYTES = 1 << 20  # a host with next to nothing available still gets pieces of a layer's size or so


def piece_budget(paths: tuple[str | Path, ...], provider: str = "cpu") -> tuple[int | None, str | None]:
    """The weight bytes a piece of each of `paths` may hold on this host and why, or (None, None) when every one
    of their sessions fits whole. A CUDA session lives in the device's memory: never in pieces there; nor a graph
    that embeds its weights (under 2 GB), whose load alone holds them twice (`pieces.structure`)."""
    if provider != "cpu" or not external_weights(paths):
        return None, None
    from compressor.transformer.offload import available_memory

    available = available_memory()
    needed = max(session_bytes(p) for p in paths)
    if needed <= SESSION_SHARE * available:
        return None, None
    return _host_piece_bytes(available), (f"one ONNX Runtime session would need ~{needed / 2**30:.1f} GiB of the "
                                          f"host's {available / 2**30:.1f} GiB available")


def external_weights(paths: tuple[str | Path, ...]) -> bool:
    """Whether every one of `paths` keeps its weights in `<name>.data` (an export of 2 GB and more)."""
    return all(len(files_of(p)) > 1 for p in paths)


def _host_piece_bytes(available: int) -> int:
    """A piece's weights on a host with `available` bytes free."""
    return max(MIN_PIECE_BYTES, int(PIECE_SHARE * available / SESSION_BYTES_PER_FILE_BYTE))


def _pair_pieces(piece_bytes: int) -> str:
    """What a pair's pieces hold: half the budget each, as `_paired_pieces` cuts them (two sessions at a time)."""
    return f"at most {_size(max(1, piece_bytes // 2))} of weights per graph, two sessions at a time"


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _piece_pair(paths: list[str | None], pieces: list[Any], carriers: list[Any], provider: str, threads: int,
                warmup: int, totals: list[list[float]]) -> int:
    """Piece k of each model (None: that model has no k-th piece) opened side by side, warmed up, and sampled
    alternately as `_latency_worker` samples two whole graphs, each sample's milliseconds added to that model's
    `totals`; their outputs handed on, the sessions gone on return. The runs per sample (the most either took)."""
    live = [k for k, path in enumerate(paths) if path is not None]
    sessions = {k: _session(str(paths[k]), provider, threads) for k in live}
    feeds = {k: carriers[k].feed(0, pieces[k]) for k in live}
    names = {k: list(pieces[k].outputs) for k in live}

    def runner(k: int) -> Callable[[], None]:
        return lambda: sessions[k].run(names[k], feeds[k])

    runs_of = {k: runner(k) for k in live}
    last = dict.fromkeys(live, MIN_SAMPLE_MS)
    for done in range(1, warmup + 1):
        for k in live:
            last[k] = _timed(runs_of[k])
        if done >= 2 and sum(last.values()) / 1000 >= SLOW_PAIR_S:
            break
    runs = {k: max(1, math.ceil(MIN_SAMPLE_MS / max(last[k], 1e-3))) for k in live}
    for j in range(len(totals[0])):  # alternate, so a slow spell of the host slows both pieces alike
        for k in live:
            totals[k][j] += _timed(runs_of[k], runs[k])
    for k in live:
        carriers[k].take(0, pieces[k], sessions[k].run(names[k], feeds[k]))
    return max(runs.values())


def _pieces_worker(baseline: str, compressed: str, feed: dict[str, np.ndarray], provider: str, threads: int,
                   warmup: int, repeats: int, io_binding: bool = False, seconds: float | None = TIMING_SECONDS,
                   piece_bytes: int = 1 << 30) -> tuple[Any, ...]:
    """`_latency_worker`'s samples of two models that each run in pieces (`exporters.pieces`) of at most half of
    `piece_bytes` of weights: piece k of both open side by side and sampled alternately, then piece k + 1, so a
    sample of a model is the sum of its pieces' and each piece's samples sit beside the other model's (timing one
    model's pieces in a turn of their own, then the other's, read a graph against itself at 0.91-1.14x on a busy
    2-core VM: the host's slow spells outlast a turn). Samples: `repeats`, or MIN_REPEATS when `seconds` bounds them
    (a model this large runs for seconds). The runs per sample (the most any piece took) and each model's pieces
    come last."""
    from . import pieces as cut

    assert not io_binding, "pieces run on the CPU, where there is no device to bind to"
    with cut.structure(baseline, "m0") as (first, base), cut.structure(compressed, "m1") as (second, comp):
        return _paired_pieces((first, second), (base, comp), feed, provider, threads, warmup, repeats, seconds,
                              piece_bytes)


def _paired_pieces(models: tuple[Any, Any], sources: tuple[Path, Path], feed: dict[str, np.ndarray], provider: str,
                   threads: int, warmup: int, repeats: int, seconds: float | None,
                   piece_bytes: int) -> tuple[Any, ...]:
    from . import pieces as cut

    plans = [cut.plan_pieces(m, max(1, piece_bytes // 2)) for m in models]  # `_pair_pieces` says so
    samples = repeats if seconds is None else min(repeats, MIN_REPEATS)
    totals: list[list[float]] = [[0.0] * samples, [0.0] * samples]
    carriers = [cut.Carrier([dict(feed)]), cut.Carrier([dict(feed)])]
    written: list[dict[int, Path]] = [{}, {}]
    runs = 1
    try:
        for index in range(max(len(p) for p in plans)):
            paths: list[str | None] = [None, None]
            pieces: list[Any] = [None, None]
            for k in range(2):
                if index < len(plans[k]):
                    pieces[k] = plans[k][index]
                    paths[k] = str(cut.piece_file(models[k], plans[k], index, sources[k], carriers[k].values[0],
                                                  written[k], f"m{k}"))
            runs = max(runs, _piece_pair(paths, pieces, carriers, provider, threads, warmup, totals))
            gc.collect()
    finally:
        for files in written:
            cut.remove(files.values())
    return (*totals, runs, [len(p) for p in plans])


def _turn(path: str, feed: dict[str, np.ndarray], provider: str, threads: int, warmup: int, io_binding: bool,
          plan: Callable[[float], tuple[int, int]]) -> list[list[float]]:
    """One turn of `_in_turn_worker`: a session of `path` opened, warmed up, sampled and gone on return (nothing
    outlives the call: a loop variable holding its last runner would keep it beside the next turn's).
    `plan(ms of a warm run)` gives the runs per sample and the samples; per-run milliseconds per way."""
    session = _session(path, provider, threads)
    runners = ([_bound(session, _feed(session, feed), provider)] if io_binding else []) \
        + [_unbound(session, _feed(session, feed))]
    last = MIN_SAMPLE_MS
    for done in range(1, warmup + 1):
        last = sum(_timed(run) for run in runners) / len(runners)
        if done >= 2 and last / 1000 * len(runners) >= SLOW_PAIR_S / 2:
            break
    runs, samples = plan(last)
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(samples):
        for w, run in enumerate(runners):
            times[w].append(_timed(run, runs))
    return times


def turn_samples(wanted: int, loads: int) -> list[int]:
    """Samples in each of `loads` turns, baseline first, so that both models get the same number, `wanted` or
    the next even number (at least one a turn).

    An odd number of turns, 2m + 1: the baseline's are [a, c, ..., c, a], the compressed model's [a + c/2, c, ...,
    c, c/2 + a] with c even. Zipping the two lists pairs the baseline's first turn with the start of the
    compressed model's first, each middle baseline turn's halves with the end of the turn before and the start
    of the turn after, and its last turn with the end of the compressed model's last: the compressed sample is
    the later one in a + (m - 1) c / 2 pairs and the earlier one in as many. Multiples of k, 2k, ..., 2k, k only
    (the scheme before) took 8 samples where 5 were wanted: on a 1.2 B decoder, ~7 s a run, ~40 s a measurement
    more. An even number of turns (for comparison only) keeps k, 2k, ..., 2k, k."""
    assert loads >= 2 and wanted >= 1, f"need two turns and a sample at least (got {loads}, {wanted})"
    if loads % 2 == 0:
        k = math.ceil(wanted / (loads - 1))
        return [k if turn in (0, loads - 1) else 2 * k for turn in range(loads)]
    m = loads // 2  # the compressed model's turns
    n = max(2 * m, wanted + wanted % 2)  # samples of each model
    c = 2 * max(1, n // (2 * m))
    a = (n - (m - 1) * c) // 2
    baseline = [a] + [c] * (m - 1) + [a]
    compressed = [n] if m == 1 else [a + c // 2] + [c] * (m - 2) + [c // 2 + a]
    assert sum(baseline) == sum(compressed) == n and min(baseline + compressed) >= 1, (baseline, compressed)
    return [(baseline if turn % 2 == 0 else compressed)[turn // 2] for turn in range(loads)]


def _in_turn_worker(baseline: str, compressed: str, feed: dict[str, np.ndarray], provider: str, threads: int,
                    warmup: int, repeats: int, io_binding: bool = False, seconds: float | None = TIMING_SECONDS,
                    loads: int = IN_TURN_LOADS) -> tuple[list[float], ...]:
    """`_latency_worker`'s samples with one session in memory at a time: `loads` turns alternating baseline and
    compressed, `turn_samples` in each, so both models get as many samples and zipping the two lists pairs each
    sample with one of an adjacent turn. An odd number of turns (baseline first and last) balances the pairs
    (IN_TURN_LOADS); an even one is allowed for comparison. The samples wanted follow from `repeats`, or from
    `seconds` and the first turn's warm-up runs (never under MIN_REPEATS)."""
    assert loads >= 2, f"need two turns at least (got {loads})"
    ways = 2 if io_binding else 1
    times: list[list[float]] = [[] for _ in range(2 * ways)]
    chosen: list[int] = []  # runs per sample, then the samples of each turn, set by the baseline's first warm-up

    def plan(turn: int, last_ms: float) -> tuple[int, int]:
        if not chosen:
            runs = max(1, math.ceil(MIN_SAMPLE_MS / max(last_ms, 1e-3)))
            wanted = repeats
            if seconds is not None:  # as many samples of both as `seconds` allow, at least MIN_REPEATS
                affordable = int(seconds / max(2 * ways * runs * last_ms / 1000, 1e-9))
                wanted = min(repeats, max(MIN_REPEATS, affordable))
            chosen.extend((runs, *turn_samples(wanted, loads)))
        return chosen[0], chosen[1 + turn]

    for turn in range(loads):
        for w, samples in enumerate(_turn((baseline, compressed)[turn % 2], feed, provider, threads, warmup,
                                          io_binding, functools.partial(plan, turn))):
            times[2 * w + turn % 2].extend(samples)
        gc.collect()  # the turn's session is gone before the next one opens
    return (*times, chosen[0])


@contextlib.contextmanager
def measurement_turn() -> Iterator[None]:
    """Hold the machine's latency lock, when OSSCAR_LATENCY_LOCK names one, while timing on the CPU: jobs
    that share a machine's cores (two service slots, two Ray jobs on one node) take turns, so neither times
    the other's load. An advisory flock: released when its process dies, however it dies."""
    path = os.environ.get("OSSCAR_LATENCY_LOCK")
    if not path:
        yield
        return
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        start = time.perf_counter()
        fcntl.flock(handle, fcntl.LOCK_EX)
        waited = time.perf_counter() - start
        if waited > 1.0:
            log.info("waited %.1fs for another job's latency measurement to finish", waited)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def measure_latency(baseline: str | Path, compressed: str | Path, feed: dict[str, np.ndarray], *,
                    provider: str = "cpu", threads: int | None = None, warmup: int = 3,
                    repeats: int = 20, io_binding: bool | None = None,
                    seconds: float | None = TIMING_SECONDS, together: bool | None = None,
                    piece_bytes: int | None = None) -> Latency:
    """Median and p90 latency of two models on one input, samples alternating in one subprocess, and the
    speedup (median of the paired ratios). Each sample is the mean of enough back-to-back runs to last
    MIN_SAMPLE_MS (one run for most models). `repeats` samples of each, or as many as `seconds` allow
    (at least MIN_REPEATS; the Latency's `repeats` says how many were taken).

    `io_binding` (default: on for CUDA) times runs with the inputs on the device and the outputs left there:
    on a GPU, copying a decoder's fp32 logits back was half of every run (21 -> 19.5 ms, 1.08x, against
    11.0 -> 8.8 ms, 1.25x, bound). Those figures are the Latency's; the host-copy ones come beside them.

    `together` (default: when `sessions_fit`) holds both sessions at once; otherwise they are timed in turn
    (`_in_turn_worker`) and the Latency's `in_turn` says why: a host that cannot hold two float32 sessions of a
    large model gets a measurement with more of the host's drift in it instead of a subprocess killed for memory.
    A model whose one session the host cannot hold (`piece_budget`), or any given `piece_bytes`, is timed in pieces
    instead, piece k of both models side by side (`_pieces_worker`; the Latency's `in_pieces` says why), and so is
    a pair whose subprocess the host killed for memory."""
    if provider not in PROVIDERS:
        raise ValueError(f"execution provider must be one of {sorted(PROVIDERS)} (got {provider!r})")
    threads = threads or default_threads()
    bind = provider == "cuda" if io_binding is None else io_binding
    why = pieced = None
    if piece_bytes is not None:
        pieced = f"asked to run in pieces ({_pair_pieces(piece_bytes)})"
    elif together is None:
        piece_bytes, pieced = piece_budget((baseline, compressed), provider)
        if pieced:
            pieced = f"{pieced}; {_pair_pieces(piece_bytes)}"
        fits, needed, available = (True, 0, 0) if piece_bytes else sessions_fit(baseline, compressed, provider)
        if not fits:
            why = (f"the two ONNX Runtime sessions would need ~{needed / 2**30:.1f} GiB of the host's "
                   f"{available / 2**30:.1f} GiB available")
    elif not together:
        why = "asked to time one session at a time"
    if piece_bytes is not None and provider != "cpu":
        raise ValueError(f"only CPU sessions run in pieces (got provider {provider!r})")
    args = (str(baseline), str(compressed), feed, provider, threads, warmup, repeats, bind, seconds)
    with measurement_turn() if provider == "cpu" else contextlib.nullcontext():  # a GPU is its job's alone
        start = time.perf_counter()
        try:
            if piece_bytes is not None:
                *times, runs, counts = _call(_pieces_worker, *args, piece_bytes)
            else:
                *times, runs = _call(_latency_worker if why is None else _in_turn_worker, *args)
                counts = [0]
        except RuntimeKilled as err:
            piece_bytes = _after_kill(err, provider, piece_bytes, (baseline, compressed))
            why, pieced = None, f"{err}; timed again in pieces ({_pair_pieces(piece_bytes)})"
            *times, runs, counts = _call(_pieces_worker, *args, piece_bytes)
        took = time.perf_counter() - start

    def p90(values: list[float]) -> float:
        return float(np.percentile(values, 90))

    def paired(base: list[float], comp: list[float]) -> float:
        # the median of each sample pair's ratio: a slow spell of the machine that spans a pair slows both
        # of its models, so it cancels there, where it would shift one median more than the other
        return statistics.median(x / y for x, y in zip(base, comp, strict=True))

    base, comp = times[0], times[1]
    host = {}
    if bind:
        host = {"host_baseline_ms": statistics.median(times[2]), "host_compressed_ms": statistics.median(times[3]),
                "host_speedup": paired(times[2], times[3])}
    return Latency(statistics.median(base), statistics.median(comp), p90(base), p90(comp), paired(base, comp),
                   provider, threads, device_name(provider), len(base), runs, io_binding=bind, in_turn=why,
                   seconds=took, pieces=max(counts), in_pieces=pieced, **host)
