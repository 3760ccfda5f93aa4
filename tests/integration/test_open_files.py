"""Long-running services raise their soft limit on open files (llmgw.openfiles): started
from a shell whose soft limit is 1024, a router would run out of descriptors near 500
concurrent streams, each holding a client's connection and its engine's."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw import openfiles
from tests.integration.router_kit import Router, Sim


def _soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open files line in /proc/{pid}/limits")


def _limited(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    ("soft", "hard", "wanted", "after"),
    [(256, 4096, 1 << 20, 4096), (256, 4096, 1000, 1000), (256, 256, 1 << 20, 256),
     (8192, 8192, 1000, 8192)],
)  # fmt: skip
def test_the_soft_limit_is_raised_to_the_hard_one_within_what_is_wanted(
    soft: int, hard: int, wanted: int, after: int
) -> None:
    code = f"from llmgw import openfiles; print(*openfiles.raise_soft_limit({wanted}))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: _limited(soft, hard),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == [str(soft), str(after)], out.stderr


@pytest.mark.parametrize("hard", [4096, openfiles.LOW])
def test_a_service_whose_hard_limit_is_low_says_so_once(hard: int) -> None:
    if hard > resource.getrlimit(resource.RLIMIT_NOFILE)[1]:
        pytest.skip("this hard limit is above the tests' own")
    code = "from llmgw import logs, openfiles; logs.setup('info', json=True); openfiles.at_start()"
    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: _limited(256, hard),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    said = [json.loads(line) for line in out.stderr.splitlines()]
    if hard < openfiles.LOW:
        assert [(d["event"], d["limit"], d["before"]) for d in said] == [
            ("open_files_low", hard, 256)
        ]
    else:
        assert said == []


def test_a_router_started_with_a_low_soft_limit_raises_its_own(tmp_path: Path) -> None:
    sim = Sim.start("m")
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        try:  # the router inherits this process's limits, as from a shell's
            router = Router.start(tmp_path, {"s0": sim})
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        try:
            infinite = hard == resource.RLIM_INFINITY
            wanted = openfiles.WANTED if infinite else min(hard, openfiles.WANTED)
            assert _soft_limit(router.proc.pid) == wanted
            if wanted < openfiles.LOW:
                assert "open_files_low" in router.log_tail(200)
        finally:
            router.stop()
    finally:
        sim.stop()
