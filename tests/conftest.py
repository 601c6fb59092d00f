"""Shared fixtures. `ray_cluster`: one local Ray cluster for every test that needs Ray.

Ray is imported inside the fixture, so test sessions that never ask for it do not pay for
the import. Tests that need Serve start it in their own fixtures on top of this cluster.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster (2 CPUs, no dashboard), started once per session.

    Yields the `ray` module's context from `ray.init`; shut down at the end of the session.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    started_here = not ray.is_initialized()
    context = (
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        if started_here
        else ray.get_runtime_context()
    )
    yield context
    if started_here:
        ray.shutdown()
