"""The Ray tests' start-up retry: a node start that missed Ray's registration window is killed and retried."""

from __future__ import annotations

import subprocess

import pytest

from tests.service.core import ray_helpers


def test_a_start_that_timed_out_is_retried_and_what_it_spawned_is_killed(monkeypatch):
    monkeypatch.setattr(ray_helpers.time, "sleep", lambda seconds: None)
    spawned: list[subprocess.Popen] = []

    def start():
        if not spawned:
            spawned.append(subprocess.Popen(["sleep", "60"]))  # a raylet left behind by the failed start
            raise Exception("The current node timed out during startup. This could happen because ...")
        return "node"

    assert ray_helpers._started(start) == "node"
    assert spawned[0].wait(timeout=10) == -9  # SIGKILLed before the retry


def test_other_errors_and_the_last_timeout_are_raised_as_they_came(monkeypatch):
    monkeypatch.setattr(ray_helpers.time, "sleep", lambda seconds: None)
    calls = []

    def broken():
        calls.append(1)
        raise ValueError("bad node args")

    with pytest.raises(ValueError, match="bad node args"):
        ray_helpers._started(broken)
    assert len(calls) == 1

    def always_late():
        calls.append(1)
        raise Exception("The current node timed out during startup.")

    calls.clear()
    with pytest.raises(Exception, match="timed out during startup"):
        ray_helpers._started(always_late)
    assert len(calls) == ray_helpers.STARTUP_ATTEMPTS
