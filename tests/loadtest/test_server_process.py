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


def _argv0(pid: int) -> str | None:
    """The program ``pid`` runs now (its argv[0]), None once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0].decode()
    except OSError:
        return None


def _status(pid: int) -> str:
    """What the kernel says of ``pid`` (why it may still run: its parent, its signals)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            keep = ("State", "PPid", "SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")
            return " ".join(line.strip() for line in f if line.startswith(keep))
    except OSError:
        return "gone"


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
        # setpriv sets the parent-death signal, then executes the server: a parent killed
        # before that (within a millisecond of the start) leaves it running, so the kill
        # waits until the server runs (a clean-clone CI run once killed it sooner)
        deadline = time.monotonic() + 30
        while _argv0(server) != sys.executable and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _running(server) and _argv0(server) == sys.executable
        parent.kill()  # SIGKILL: no handler of the parent's can clean up
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(server), _status(server)
    finally:
        if _running(server):
            os.killpg(server, 9)
