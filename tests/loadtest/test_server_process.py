"""A server process the benchmarks start ends with the process that started it: a test run or
a benchmark killed by a signal leaves no server behind holding its port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.baselines.api import dies_with_parent

ROOT = Path(__file__).resolve().parents[2]


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's reaper may be slow)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(dies_with_parent(["x"]) == ["x"], reason="no setpriv on this system")
def test_a_server_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    parent_code = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from loadtest.baselines.api import launch_server\n"
        "server = launch_server('sleeper', [sys.executable, '-c', 'import time; "
        f"time.sleep(300)'], 1, {str(tmp_path)!r})\n"
        "print(server.proc.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    server = int(parent.stdout.readline())
    try:
        assert _running(server)
        parent.kill()  # SIGKILL: no handler of the parent's can clean up
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(server)
    finally:
        if _running(server):
            os.killpg(server, 9)
