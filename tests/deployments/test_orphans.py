"""Orphan copies on the served app: one of two large-model replicas is
frozen past its directory lease; the ingress re-creates its requests on the other, and when
the frozen one runs again the old incarnations it still holds are aborted. Real Ray Serve,
ZeroMQ ipc, tiny models, the official openai client (docs/user-guide/reliability.md)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.deployments.conftest import local_outputs, tiny_overrides
from tests.deployments.test_reliability import (
    APP,
    EXTRA,
    OPTIONS,
    TWO,
    client,
    completions_in,
    prompts,
    stats,
    wait_clean,
    wait_healthy,
)


@pytest.fixture(scope="module")
def two_large_app(serve_app, served_chain_dirs) -> Iterator[str]:
    extra = [*EXTRA, "models.large.num_replicas=2"]
    overrides = tiny_overrides(served_chain_dirs, TWO, "entropy", "zmq_ipc", extra)
    with serve_app(overrides, APP + "-2l") as base:
        wait_healthy(base, 180)
        yield base


def large_statuses(app_name: str, want: int = 2, tries: int = 40) -> dict[int, dict[str, Any]]:
    """The status of each large replica, by pid (Serve routes each call to one of them)."""
    from ray import serve

    handle = serve.get_deployment_handle("large", app_name=app_name)
    seen: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        status = handle.status.remote().result(timeout_s=30).to_json()  # ReplicaStatus
        seen[status["pid"]] = status
        if len(seen) >= want:
            break
    return seen


def holding_replica(app_name: str, timeout_s: float = 30.0) -> int:
    """The pid of the large replica that holds the most requests, once one holds any (the
    requests reach the large model at their first escalation; placement decides which)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = {pid: s["tracked"] for pid, s in large_statuses(app_name).items()}
        if any(held.values()):
            return max(held, key=held.__getitem__)
        time.sleep(0.05)
    raise AssertionError(f"no request reached a large replica in {timeout_s:.0f} s")


def test_copies_on_a_replica_that_stalled_past_its_lease_are_aborted_when_it_returns(
    two_large_app: str, served_chain_dirs
) -> None:
    """One of two large replicas is frozen (SIGSTOP) past its 5 s lease: the ingress
    re-creates its requests on the other one. When it runs again (SIGCONT) it still holds
    the old incarnations: they are aborted (nothing held on either replica afterwards) and
    every request finishes equal to an undisturbed run."""
    name = APP + "-2l"
    batch = prompts(8)
    want = local_outputs(served_chain_dirs, TWO, "entropy", OPTIONS, batch, 160)
    statuses = large_statuses(name)
    assert len(statuses) == 2, statuses
    before = len(stats(two_large_app)["recoveries"])
    api = client(two_large_app, timeout=240)
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        futures = completions_in(pool, api, batch, 160)
        victim = holding_replica(name)  # (a fixed choice held nothing in one run of many:
        os.kill(victim, signal.SIGSTOP)  # nothing to re-create, no recovery to see)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30 and len(stats(two_large_app)["recoveries"]) == before:
                time.sleep(0.2)  # its lease runs out, its requests are re-created elsewhere
            recovered_s = time.monotonic() - t0
        finally:
            os.kill(victim, signal.SIGCONT)
        got = [f.result(timeout=300) for f in futures]
    assert got == [w.token_ids for w in want]
    recoveries = stats(two_large_app)["recoveries"][before:]
    assert recoveries and recoveries[0]["recreated"] >= 1, recoveries
    t0 = time.monotonic()
    while True:  # both large replicas, the returned one included, end up holding nothing
        held = {pid: (s["requests"], s["tracked"], s["kv_blocks_used"])
                for pid, s in large_statuses(name).items()}  # fmt: skip
        if len(held) == 2 and all(h == (0, 0, 0) for h in held.values()):
            break
        assert time.monotonic() - t0 < 60, held
        time.sleep(0.5)
    orphans = stats(two_large_app)["orphans_aborted"]
    print(
        f"stalled past its lease: re-created after {recovered_s:.1f} s ({recoveries}); "
        f"clean {time.monotonic() - t0:.1f} s after the requests finished; "
        f"{orphans} orphan copies aborted"
    )
    wait_clean(two_large_app)
