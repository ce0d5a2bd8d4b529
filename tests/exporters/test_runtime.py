"""Latency measurement in ONNX Runtime: samples long enough to time a millisecond model."""

from __future__ import annotations

import statistics

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from onnx import TensorProto, helper

from exporters.runtime import MIN_SAMPLE_MS, measure_latency


def _matmul_model(path, width: int) -> None:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [width, width], np.ones(width * width, np.float32))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "m",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, width])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_a_fast_model_is_timed_in_blocks_of_runs(tmp_path):
    _matmul_model(tmp_path / "a.onnx", 64)
    feed = {"x": np.ones((4, 64), np.float32)}
    _matmul_model(tmp_path / "c.onnx", 64)
    latency = measure_latency(tmp_path / "a.onnx", tmp_path / "c.onnx", feed, threads=1, repeats=5)
    # a 64 x 64 matmul takes microseconds: one sample is many runs, and each time is per run
    assert latency.runs_per_sample > 10
    assert latency.baseline_ms < MIN_SAMPLE_MS / 10 and latency.compressed_ms < MIN_SAMPLE_MS / 10
    assert latency.repeats == 5 and latency.speedup > 0


def test_long_runs_are_sampled_for_a_time_not_a_count(tmp_path):
    from exporters import runtime

    _matmul_model(tmp_path / "a.onnx", 256)
    feed = {"x": np.ones((64, 256), np.float32)}
    path = str(tmp_path / "a.onnx")
    # no time left after each sample: the fewest samples allowed, however many were asked for
    base, comp, _ = runtime._latency_worker(path, path, feed, "cpu", 1, 1, 50, False, 0.0)
    assert len(base) == len(comp) == runtime.MIN_REPEATS
    # no limit: every sample asked for
    base, comp, _ = runtime._latency_worker(path, path, feed, "cpu", 1, 1, 12, False, None)
    assert len(base) == len(comp) == 12
    # fewer asked for than the floor: what was asked
    base, _, _ = runtime._latency_worker(path, path, feed, "cpu", 1, 1, 3, False, 0.0)
    assert len(base) == 3
    # and the Latency reports the samples it took
    latency = measure_latency(tmp_path / "a.onnx", tmp_path / "a.onnx", feed, threads=1, repeats=40, seconds=0.0)
    assert latency.repeats == runtime.MIN_REPEATS


def test_slow_warm_up_pairs_stop_after_two(tmp_path, monkeypatch):
    from exporters import runtime

    _matmul_model(tmp_path / "a.onnx", 64)
    feed = {"x": np.ones((4, 64), np.float32)}
    path = str(tmp_path / "a.onnx")
    calls = []
    real = runtime._unbound

    def counted(session, feed):
        run = real(session, feed)
        return lambda: calls.append(1) or run()

    monkeypatch.setattr(runtime, "_unbound", counted)
    monkeypatch.setattr(runtime, "MIN_SAMPLE_MS", 0.0)  # one run a sample: calls = 2 x (warm-ups + samples)
    monkeypatch.setattr(runtime, "SLOW_PAIR_S", 0.0)  # every pair counts as slow
    runtime._latency_worker(path, path, feed, "cpu", 1, 10, 5, False, None)
    assert len(calls) == 2 * (2 + 5)
    monkeypatch.setattr(runtime, "SLOW_PAIR_S", 1e9)  # no pair is slow: every warm-up asked for
    calls.clear()
    runtime._latency_worker(path, path, feed, "cpu", 1, 10, 5, False, None)
    assert len(calls) == 2 * (10 + 5)


def test_io_binding_times_bound_runs_and_reports_the_host_copy_figures_beside_them(tmp_path):
    _matmul_model(tmp_path / "a.onnx", 512)
    _matmul_model(tmp_path / "c.onnx", 256)
    feed = {"x": np.ones((64, 512), np.float32)}
    bound = measure_latency(tmp_path / "a.onnx", tmp_path / "a.onnx", feed, threads=1, repeats=5, io_binding=True)
    assert bound.io_binding and bound.baseline_ms > 0 and bound.host_baseline_ms > 0
    assert 0.5 < bound.speedup < 2 and 0.5 < bound.host_speedup < 2  # one model against itself
    plain = measure_latency(tmp_path / "a.onnx", tmp_path / "a.onnx", feed, threads=1, repeats=3)
    assert not plain.io_binding and plain.host_speedup is None  # the CPU default: host memory anyway


def test_in_turn_timing_holds_one_session_at_a_time_and_pairs_adjacent_turns(tmp_path, monkeypatch):
    from exporters import runtime

    _matmul_model(tmp_path / "a.onnx", 128)
    _matmul_model(tmp_path / "c.onnx", 128)
    feed = {"x": np.ones((16, 128), np.float32)}
    opened, alive, most = [], set(), []
    real = runtime._session

    class Counted:  # a session that says when it is gone
        def __init__(self, path, provider, threads):
            self.inner, self.path = real(path, provider, threads), path
            opened.append(path)
            alive.add(id(self))
            most.append(len(alive))

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __del__(self):
            alive.discard(id(self))

    monkeypatch.setattr(runtime, "_session", Counted)
    monkeypatch.setattr(runtime, "MIN_SAMPLE_MS", 0.0)  # one run a sample
    a, c = str(tmp_path / "a.onnx"), str(tmp_path / "c.onnx")
    base, comp, runs = runtime._in_turn_worker(a, c, feed, "cpu", 1, 2, 12, False, None)
    # five turns, dense first and last; k = 12 / 4 = 3 samples in the first and last, 6 in the middle three
    assert opened == [a, c, a, c, a] and max(most) == 1 and runs == 1
    assert len(base) == len(comp) == 12
    # no time left: the fewest samples allowed (5), rounded up to an even count, not to a multiple of four
    base, comp, _ = runtime._in_turn_worker(a, c, feed, "cpu", 1, 1, 50, False, 0.0)
    assert len(base) == len(comp) == runtime.MIN_REPEATS + runtime.MIN_REPEATS % 2 == 6
    # both ways of timing a run (I/O binding): four lists of equal length
    *times, _ = runtime._in_turn_worker(a, a, feed, "cpu", 1, 1, 4, True, None)
    assert len(times) == 4 and {len(t) for t in times} == {4}


def test_in_turn_pairs_cancel_a_steady_drift_of_the_host(monkeypatch):
    """One model against itself on a host that slows down steadily (each run 0.1 % slower than the one before):
    the pairs' median must read 1.0. Five turns put the second model's sample later in half of the pairs and
    earlier in the other half; four turns (k, 2k, 2k, k, session 38's) put it later in two pairs of three, and
    the median reads the drift as a slower second model."""
    from exporters import runtime

    clock = iter(range(10**6))

    def timed(run, runs=1) -> float:  # every run, warm-ups included, advances the host's drift
        return sum(1.0 + 1e-3 * next(clock) for _ in range(runs)) / runs

    monkeypatch.setattr(runtime, "_session", lambda path, provider, threads: object())
    monkeypatch.setattr(runtime, "_feed", lambda session, feed: feed)
    monkeypatch.setattr(runtime, "_timed", timed)
    monkeypatch.setattr(runtime, "MIN_SAMPLE_MS", 0.0)

    def speedup(loads: int, repeats: int = 40) -> float:
        base, comp, _ = runtime._in_turn_worker("m.onnx", "m.onnx", {}, "cpu", 1, 2, repeats, False, None, loads)
        return statistics.median(x / y for x, y in zip(base, comp, strict=True))

    assert runtime.IN_TURN_LOADS % 2 == 1
    balanced = speedup(runtime.IN_TURN_LOADS)
    assert abs(balanced - 1) < 2e-3, balanced
    for repeats in (5, 6, 10):  # counts that are no multiple of four: turns of unequal halves, still balanced
        assert abs(speedup(runtime.IN_TURN_LOADS, repeats) - 1) < 2e-3, repeats
    unbalanced = speedup(4)  # the second model's samples ~15 runs later in two pairs of three: ~1.4 % slower
    assert unbalanced < 1 - 1e-2, unbalanced


@pytest.mark.parametrize("loads", [3, 5, 7])
def test_turn_samples_give_both_models_as_many_pairs_later_as_earlier(loads):
    from exporters.runtime import turn_samples

    for wanted in range(1, 41):
        sizes = turn_samples(wanted, loads)
        turn_of = [[t for t in range(loads) if t % 2 == side for _ in range(sizes[t])] for side in (0, 1)]
        n = len(turn_of[0])
        assert n == len(turn_of[1]) == max(wanted + wanted % 2, loads - 1) and min(sizes) >= 1, (wanted, sizes)
        later = sum(t1 > t0 for t0, t1 in zip(*turn_of, strict=True))
        assert all(abs(t1 - t0) == 1 for t0, t1 in zip(*turn_of, strict=True))  # adjacent turns
        assert 2 * later == n, (wanted, sizes)
    assert turn_samples(5, 5) == [2, 3, 2, 3, 2] and turn_samples(8, 5) == [2, 4, 4, 4, 2]


def test_a_pair_the_host_cannot_hold_is_timed_in_turn_and_says_why(tmp_path, monkeypatch):
    from compressor.transformer import offload
    from exporters import runtime

    _matmul_model(tmp_path / "a.onnx", 256)  # 256 KiB of weights: ~1.3 GiB needed with the activations' floor
    feed = {"x": np.ones((8, 256), np.float32)}
    a = tmp_path / "a.onnx"
    _, needed, _ = runtime.sessions_fit(a, a)
    assert needed == 2 * runtime.session_bytes(a) > 2 * runtime.SESSION_ACTIVATIONS
    monkeypatch.setattr(offload, "available_memory", lambda: needed)  # 80 % of it is not enough
    assert not runtime.sessions_fit(a, a)[0] and runtime.sessions_fit(a, a, "cuda")[0]  # a GPU holds its own
    latency = measure_latency(a, a, feed, threads=1, repeats=8)
    assert latency.in_turn and "would need ~" in latency.in_turn and latency.repeats == 8
    assert 0.5 < latency.speedup < 2  # one model against itself
    monkeypatch.setattr(offload, "available_memory", lambda: 2 * needed)
    assert measure_latency(a, a, feed, threads=1, repeats=3).in_turn is None
    assert measure_latency(a, a, feed, threads=1, repeats=3, together=False).in_turn == \
        "asked to time one session at a time"


def test_a_provider_that_does_not_load_is_refused_not_replaced_by_the_cpu(tmp_path, monkeypatch):
    import onnxruntime as ort

    from exporters import runtime

    # a provider this build knows but cannot load (CUDA on a CPU build): ONNX Runtime would fall back
    missing = next(p for p in ort.get_all_providers() if p not in ort.get_available_providers())
    monkeypatch.setitem(runtime.PROVIDERS, "cuda", missing)
    _matmul_model(tmp_path / "a.onnx", 8)
    with pytest.raises(runtime.RuntimeFailure, match=f"{missing} did not load"):
        runtime._session(str(tmp_path / "a.onnx"), "cuda", 1)


def test_a_listed_cuda_provider_that_falls_back_is_logged_and_not_used(monkeypatch, caplog):
    import onnxruntime as ort

    from exporters import runtime

    if runtime.provider_loads("cuda")[0]:  # a GPU node whose provider loads: the probe says so
        assert runtime.default_provider() == "cuda"
        return
    runtime.provider_loads.cache_clear()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with caplog.at_level("ERROR"):
        assert runtime.default_provider() == "cpu"
    assert "falls back to ['CPUExecutionProvider']" in caplog.text and "refused" in caplog.text


def test_no_visible_gpu_measures_on_the_cpu_without_probing_or_an_error(monkeypatch, caplog, tmp_path):
    import onnxruntime as ort

    from exporters import runtime

    def probe(provider):
        raise AssertionError("probed a provider no GPU can serve")

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(runtime, "provider_loads", probe)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with caplog.at_level("ERROR"):
        assert runtime.default_provider() == "cpu"
    assert not caplog.text
    # a request that names the CUDA provider there is refused saying why, not sent to the libraries
    monkeypatch.setattr(ort, "InferenceSession", _FallsBack)
    with pytest.raises(runtime.RuntimeFailure, match="no GPU is visible to this process"):
        runtime._session(str(tmp_path / "a.onnx"), "cuda", 1)


class _FallsBack:
    """A session asked for CUDA that runs on the CPU, as ONNX Runtime's is where no GPU is visible."""

    def __init__(self, *args, **kwargs):
        pass

    def get_providers(self):
        return ["CPUExecutionProvider"]


def test_jobs_sharing_a_machine_take_turns_at_timing(tmp_path, monkeypatch):
    """With OSSCAR_LATENCY_LOCK set, a measurement waits while another process holds the machine's lock."""
    import fcntl
    import threading
    import time

    from exporters.runtime import measurement_turn

    lock = tmp_path / "locks" / "latency.lock"
    monkeypatch.setenv("OSSCAR_LATENCY_LOCK", str(lock))
    lock.parent.mkdir()
    # another job's measurement (flock locks per open file, as another process's would)
    holder = open(lock, "a")  # noqa: SIM115 (held while the thread below waits)
    fcntl.flock(holder, fcntl.LOCK_EX)
    entered = []

    def measure() -> None:
        with measurement_turn():
            entered.append(time.monotonic())

    thread = threading.Thread(target=measure)
    thread.start()
    time.sleep(0.5)
    assert not entered  # still waiting for its turn
    released = time.monotonic()
    fcntl.flock(holder, fcntl.LOCK_UN)
    holder.close()
    thread.join(10)
    assert entered and entered[0] >= released
    # the turn is over: the lock is free again (taken here without waiting)
    holder = open(lock, "a")  # noqa: SIM115 (held while the thread below measures)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        # without the setting: no lock at all, so the held lock does not delay a measurement
        monkeypatch.delenv("OSSCAR_LATENCY_LOCK")
        thread = threading.Thread(target=measure)
        thread.start()
        thread.join(5)
        assert not thread.is_alive() and len(entered) == 2
    finally:
        holder.close()


def test_a_measurements_own_seconds_leave_out_its_wait_for_the_machines_lock(tmp_path, monkeypatch):
    """`Latency.seconds` is the measurement's time, not its turn's wait: a job pausing "a measurement's time"
    after a busy reading must not pause for as long as another job held the lock."""
    import fcntl
    import threading
    import time

    _matmul_model(tmp_path / "a.onnx", 64)
    feed = {"x": np.ones((4, 64), np.float32)}
    lock = tmp_path / "latency.lock"
    monkeypatch.setenv("OSSCAR_LATENCY_LOCK", str(lock))
    holder = open(lock, "a")  # noqa: SIM115 (another job's turn, released from a timer thread)
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(3.0, holder.close).start()  # closing the file releases its lock
    start = time.perf_counter()
    latency = measure_latency(tmp_path / "a.onnx", tmp_path / "a.onnx", feed, threads=1, repeats=3)
    waited = time.perf_counter() - start
    assert waited >= 3.0 and latency.seconds is not None and 0 < latency.seconds <= waited - 2.9


def test_the_subprocess_never_imports_the_callers_main_and_needs_no_guard(tmp_path):
    """A script without `if __name__ == "__main__":` that runs ONNX Runtime: its body runs once (spawn would run it
    again in the child, importing whatever the caller imported: the CLI's torch and transformers)."""
    import subprocess
    import sys
    from pathlib import Path

    _matmul_model(tmp_path / "a.onnx", 8)
    script = tmp_path / "script.py"
    script.write_text(
        "from pathlib import Path\n"
        "import numpy as np\n"
        "from exporters.runtime import run_outputs\n"
        f"marks = Path({str(tmp_path / 'marks')!r})\n"
        "marks.write_text(marks.read_text() + 'x' if marks.exists() else 'x')\n"
        f"(y,) = run_outputs({str(tmp_path / 'a.onnx')!r}, [[np.ones((2, 8), np.float32)]])[0]\n"
        "assert (y == 8).all(), y\n")
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "marks").read_text() == "x"


def test_a_child_that_dies_or_raises_is_a_runtime_failure_with_its_cause():
    import os

    from exporters.runtime import RuntimeFailure, _call

    with pytest.raises(RuntimeFailure, match=r"crashed in its subprocess \(exit status 3\)"):
        _call(os._exit, 3)
    with pytest.raises(RuntimeFailure, match="ONNX Runtime failed: LinAlgError") as raised:
        _call(np.linalg.inv, np.zeros((2, 3)))
    assert type(raised.value.__cause__).__name__ == "LinAlgError"
    assert _call(np.add, np.ones(3), 1).tolist() == [2.0, 2.0, 2.0]


def _killed_by_the_host() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_a_subprocess_killed_from_outside_is_not_a_runtime_failure():
    """SIGKILL (the host's out-of-memory killer) is nothing the graph did: a job called its export broken for it."""
    from exporters.runtime import RuntimeFailure, RuntimeKilled, _call

    with pytest.raises(RuntimeKilled, match="SIGKILL") as raised:
        _call(_killed_by_the_host)
    assert not isinstance(raised.value, RuntimeFailure)


def _killed_in_pieces(path: str) -> None:
    """A subprocess killed while it runs `path` in pieces: its embedded weights moved out, its first piece written."""
    import os
    import signal

    from exporters import pieces as cut

    with cut.structure(path) as (model, source):
        plan = cut.plan_pieces(model, 1)
        cut.piece_file(model, plan, 0, source, {"x": np.ones((2, 64), np.float32)}, {})
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_subprocess_killed_in_pieces_leaves_no_piece_file(tmp_path):
    """Killed (the host's out-of-memory killer), the subprocess removes nothing itself: its pieces and the copy of the
    graph's embedded weights stayed beside the graph, and a decode step's folder moved them into the job's output."""
    from exporters.runtime import RuntimeKilled, _call

    _matmul_model(tmp_path / "a.onnx", 64)  # 16 KiB of embedded weights: moved to a file of their own to be cut
    with pytest.raises(RuntimeKilled):
        _call(_killed_in_pieces, str(tmp_path / "a.onnx"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx"]


def test_a_run_killed_for_memory_runs_again_in_pieces(tmp_path, monkeypatch):
    from exporters import runtime

    _matmul_model(tmp_path / "a.onnx", 8)
    model = onnx.load(tmp_path / "a.onnx")  # a graph large enough to be killed keeps its weights beside it
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.ones((8, 8), np.float32), "w"))
    onnx.save(model, tmp_path / "a.onnx", save_as_external_data=True, location="a.onnx.data", size_threshold=0)
    assert (tmp_path / "a.onnx.data").is_file()
    feed = {"x": np.ones((2, 8), np.float32)}
    calls, real = [], runtime._call

    def first_killed(fn, *args):
        calls.append((fn.__name__, args[-1]))
        if len(calls) == 1:
            raise runtime.RuntimeKilled("ONNX Runtime's subprocess was killed (SIGKILL: ...)")
        return real(fn, *args)

    monkeypatch.setattr(runtime, "_call", first_killed)
    (got,) = runtime.run_outputs(tmp_path / "a.onnx", [feed])[0]
    assert got.tolist() == [[8.0] * 8] * 2
    assert calls[0][1] is None and calls[1][1] >= runtime.MIN_PIECE_BYTES  # whole, then in pieces
    calls.clear()
    latency = runtime.measure_latency(tmp_path / "a.onnx", tmp_path / "a.onnx", feed, threads=1, repeats=3)
    assert [name for name, _ in calls] == ["_latency_worker", "_pieces_worker"]
    assert latency.pieces == 1 and "timed again in pieces" in latency.in_pieces and latency.speedup > 0
    # killed in pieces as small as this host allows: nothing smaller to try, the kill is the caller's to report
    calls.clear()
    with pytest.raises(runtime.RuntimeKilled):
        runtime.run_outputs(tmp_path / "a.onnx", [feed], piece_bytes=runtime.MIN_PIECE_BYTES)
    # nor for a graph that embeds its weights: cutting it holds them twice
    _matmul_model(tmp_path / "b.onnx", 8)
    calls.clear()
    with pytest.raises(runtime.RuntimeKilled):
        runtime.run_outputs(tmp_path / "b.onnx", [feed])


def test_the_nll_reduction_is_the_summed_cross_entropy_of_the_real_tokens():
    import torch

    from exporters.runtime import _reduce

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 7, 11)) * 4).astype(np.float32)
    ids = rng.integers(0, 11, size=(3, 7))
    mask = np.ones_like(ids)
    mask[1, 5:] = 0  # a padded window
    total, count = _reduce("nll", logits, {"input_ids": ids, "attention_mask": mask})
    each = torch.nn.functional.cross_entropy(torch.from_numpy(logits[:, :-1]).double().reshape(-1, 11),
                                             torch.from_numpy(ids[:, 1:]).reshape(-1), reduction="none")
    expected = float((each * torch.from_numpy(mask[:, 1:]).reshape(-1)).sum())
    assert count == 3 * 6 - 2
    assert abs(total - expected) < 1e-9 * expected


def test_the_cls_and_max_poolings_read_the_served_embedding():
    """A CLS-pooled (BGE-style) or max-pooled sentence model is scored on the embedding it serves, not a mean."""
    from exporters.runtime import _reduce

    states = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    states[1, 2] = 100.0  # padding: never the maximum
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    np.testing.assert_array_equal(_reduce("cls_pool", states, {"attention_mask": mask}), states[:, 0])
    np.testing.assert_array_equal(_reduce("max_pool", states, {"attention_mask": mask}), [[4, 5], [8, 9]])
    # a decoder's embedding: each row's last real token, right- or left-padded
    np.testing.assert_array_equal(_reduce("lasttoken_pool", states, {"attention_mask": mask}), [[4, 5], [8, 9]])
    left = np.array([[1, 1, 1], [0, 1, 1]])
    np.testing.assert_array_equal(_reduce("lasttoken_pool", states, {"attention_mask": left}), [[4, 5], [100, 100]])


def test_the_default_threads_keep_within_the_cgroups_cpu_quota(tmp_path, monkeypatch):
    """A container's CPU limit (docker --cpus, a Kubernetes limit) is a CFS quota the affinity does not show: ONNX
    Runtime was timed with every host core on a quota of two."""
    from exporters import runtime
    from exporters.runtime import cpu_quota

    v2, membership = tmp_path / "v2", tmp_path / "cgroup"
    (v2 / "pod" / "job").mkdir(parents=True)
    membership.write_text("0::/pod/job\n")
    (v2 / "pod" / "job" / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(v2, membership) == 2.5
    (v2 / "pod" / "job" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2, membership) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "c1").mkdir(parents=True)
    membership.write_text("4:memory:/docker/c1\n3:cpu,cpuacct:/docker/c1\n")
    for name, value in (("cpu.cfs_quota_us", "150000"), ("cpu.cfs_period_us", "100000")):
        (v1 / "cpu,cpuacct" / "docker" / "c1" / name).write_text(value + "\n")
    assert cpu_quota(v1, membership) == 1.5
    (v1 / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(v1, membership) is None
    assert cpu_quota(tmp_path / "none", tmp_path / "absent") is None
    # the tightest of the cgroup and those above it: a job's cgroup says max under a limited pod
    (v2 / "pod" / "job" / "cpu.max").write_text("max 100000\n")
    (v2 / "pod" / "cpu.max").write_text("200000 100000\n")
    membership.write_text("0::/pod/job\n")
    assert cpu_quota(v2, membership) == 2.0
    (v2 / "pod" / "job" / "cpu.max").write_text("300000 100000\n")
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(v2, membership) == 1.5
    monkeypatch.setattr(runtime, "cpu_quota", lambda: 1.5)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert runtime.default_threads() == 2
    monkeypatch.setattr(runtime, "cpu_quota", lambda: None)
    assert runtime.default_threads() == 64
