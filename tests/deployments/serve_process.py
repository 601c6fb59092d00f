"""``serve run <config>`` as a user runs it, for the tests that need a Ray instance of their
own (not the test session's cluster): a subprocess in its own session, its output in a log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from loadtest.baselines.api import dies_with_parent
from tokenrouter_ray.config import CONF_DIR


class PortTaken(Exception):
    """``serve run`` could not bind a port it was given: another process took it between the
    test choosing it and the app binding it. The caller picks new ports and starts again."""


def start_serve_run(
    config: Path, log: Path, ready_url: str, env: Mapping[str, str] = {}, timeout_s: float = 300
) -> subprocess.Popen:
    """``serve run config`` with a fresh local Ray instance and ``env`` added, returned once
    ``ready_url`` answers 200; the test fails with the log's tail if it never does, and
    ``PortTaken`` is raised at once if a port the config names is already in use."""
    full_env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ADDRESS": "local",  # a fresh Ray instance, not the test session's cluster
        **env,
    }
    serve_bin = Path(sys.executable).with_name("serve")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            dies_with_parent([str(serve_bin), "run", str(config)]),  # not orphaned by a kill
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=CONF_DIR.parent,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if "[Errno 98] Address already in use" in log.read_text(errors="replace"):
            kill_serve_run(proc)
            raise PortTaken(log_tail(log))
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_serve_run(proc)
            pytest.fail(f"serve run {config.name} did not come up:\n{log_tail(log)}")
        time.sleep(1)


def log_tail(log: Path, chars: int = 6000) -> str:
    """The end of a ``serve run`` log without Serve's per-call access lines (``CALL ... OK``),
    which a healthy app writes every few seconds and which would push any error out of view."""
    lines = log.read_text(errors="replace").splitlines()
    kept = [line for line in lines if not (" -- CALL " in line and line.rstrip().endswith("ms"))]
    return "\n".join(kept)[-chars:]


def kill_serve_run(proc: subprocess.Popen) -> None:
    """Kill ``serve run`` and its session's processes, if it is still running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
