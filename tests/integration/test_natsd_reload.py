"""`llmgw ctl cert` reloads nats-server through its pid file (llmgw.natsd.reload_from_pid_file).
nats-server leaves that file behind when it exits, and the pid may since belong to another
process, which a SIGHUP would end: only a nats-server is signalled."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from llmgw import natsd

# Notes each SIGHUP in the file argv[1]; exits on SIGTERM.
BYSTANDER = r"""
import signal, sys, time
def hup(signum, frame):
    with open(sys.argv[1], "a") as f:
        f.write("hup\n")
signal.signal(signal.SIGHUP, hup)
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_stale_pid_file_naming_another_process_signals_nothing(tmp_path: Path) -> None:
    record = tmp_path / "signals"
    proc = subprocess.Popen([sys.executable, "-c", BYSTANDER, str(record)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        pid_file = tmp_path / "nats-server.pid"
        pid_file.write_text(f"{proc.pid}\n")
        assert natsd.reload_from_pid_file(pid_file) is None
    finally:
        # A SIGHUP sent before this SIGTERM is handled first (the lower signal number).
        proc.terminate()
        assert proc.wait(30) == 0
    assert not record.exists()
