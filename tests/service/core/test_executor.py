"""The local executor's slots: one per device named, CPU cores shared between the CPU slots."""

import os

import pytest

from tests.service.core.service_helpers import service


def test_a_device_named_twice_is_two_slots(tmp_path, monkeypatch):
    # a 4-core host, whatever this one has (a test worker under pytest-xdist is pinned to one core)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    jobs = service(tmp_path, devices=("cpu", "cpu", "cuda:1"))
    slots = jobs.executor.slots()
    assert [s.name for s in slots] == ["cpu", "cpu#2", "cuda:1"] and [s.device for s in slots] == ["cpu", "cpu",
                                                                                                    "cuda:1"]
    cores = [0, 1, 2, 3]
    # the two CPU slots share the cores between them, none twice; the GPU slot is not pinned
    assert sorted(slots[0].cores + slots[1].cores) == cores and slots[0].cores and slots[1].cores
    assert slots[2].cores == ()
    assert service(tmp_path / "one", devices=("cpu",)).executor.slots()[0].cores == ()  # alone: every core
    with pytest.raises(ValueError, match="needs a core of its own"):
        service(tmp_path / "many", devices=("cpu",) * (len(cores) + 1))


def test_cores_are_shared_in_contiguous_near_equal_parts():
    from service.core.executor import share_cores

    assert share_cores(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert share_cores([0, 1], 2) == [[0], [1]]
    assert share_cores([0], 2) is None
