"""Waiting for a subprocess to announce itself works whatever descriptors the waiting
process already holds (a test holding a thousand client connections starts engines too)."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from typing import Any

import pytest

from llmgw.sim.testing import wait_for_line


def test_a_line_is_read_on_a_descriptor_beyond_selects_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} descriptors, fewer than the test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('ready on http://127.0.0.1:1', flush=True)"],
            stdout=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.fileno() > 1024
            found = wait_for_line(proc, re.compile(r"ready on (\S+)"), "the child", 60)
            assert found.group(1) == "http://127.0.0.1:1"
        finally:
            proc.wait(30)
            assert proc.stdout is not None
            proc.stdout.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_child_that_exits_silently_is_said_to_have_exited() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE)
    with pytest.raises(RuntimeError, match=r"exited \(0\) before announcing itself"):
        wait_for_line(proc, re.compile("never"), "the child", 60)
    assert proc.stdout is not None
    proc.stdout.close()


def test_a_sim_whose_wait_fails_otherwise_is_not_left_running(monkeypatch: Any) -> None:
    from llmgw.sim import testing

    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        return proc

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ValueError("the wait itself failed")

    monkeypatch.setattr(testing.subprocess, "Popen", popen)
    monkeypatch.setattr(testing, "wait_for_line", broken)
    with pytest.raises(ValueError, match="the wait itself failed"):
        testing.SimProcess.start()
    assert len(started) == 1
    assert started[0].poll() is not None  # killed and reaped
    assert started[0].stdout is not None
    started[0].stdout.close()
