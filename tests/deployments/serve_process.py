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


def start_serve_run(
    config: Path, log: Path, ready_url: str, env: Mapping[str, str] = {}, timeout_s: float = 300
) -> subprocess.Popen:
    """``serve run config`` with a fresh local Ray instance and ``env`` added, returned once
    ``ready_url`` answers 200; the test fails with the log's tail if it never does."""
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
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_serve_run(proc)
            pytest.fail(f"serve run {config.name} did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(1)


def kill_serve_run(proc: subprocess.Popen) -> None:
    """Kill ``serve run`` and its session's processes, if it is still running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
