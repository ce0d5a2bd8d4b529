import gc
import os
from pathlib import Path

import pytest

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"real weights and data live in {SHARED_DATA}, which is absent on this machine")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def osscar_home(tmp_path_factory, monkeypatch):
    """Caches (dense loss curves) go to a temporary $OSSCAR_HOME, never the user's."""
    home = tmp_path_factory.mktemp("osscar-home")
    monkeypatch.setenv("OSSCAR_HOME", str(home))
    return home


# every this many tests a worker collects its whole heap (frozen objects too) once
FULL_COLLECTION_EVERY = 200
_tests_run = [0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test (its fixtures, monkeypatches and arguments released), its garbage is collected and what it
    leaves alive (the import-time state, torch.export's and transformers' caches) is moved out of the collector's
    sight (`gc.freeze`): the pipeline collects after every block, and a full collection over a worker's heap, which
    grows through a thousand tests, took ~1 s where a job's own process takes milliseconds (the suite's family tests
    ran 10x slower in a worker than alone). Frozen objects that later become cyclic garbage (a module fixture's graph,
    a monkeypatched class) are collected every `FULL_COLLECTION_EVERY` tests."""
    result = yield
    _tests_run[0] += 1
    if _tests_run[0] % FULL_COLLECTION_EVERY == 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    return result


# most tests are single-threaded Python (exports, the service); each worker may hold a few GB
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


def pytest_configure(config) -> None:
    """Under pytest-xdist, each worker gets its own share of the cores (children inherit it): two workers
    each running 2-thread torch and ONNX Runtime on 2 cores would oversubscribe them and slow both, and
    the tests that time ONNX Runtime would time the other worker's load."""
    # not `service.core.executor.share_cores`: importing the project here loads torch and numpy, whose thread pools
    # are sized by the affinity they find at load, before the worker is pinned
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    count, index = int(workerinput["workercount"]), int(workerinput["workerid"].removeprefix("gw"))
    share = len(cores) // count
    if share >= 1:
        os.sched_setaffinity(0, cores[index * share:(index + 1) * share])
