"""Shared fixtures.

`ray_cluster`: one local Ray cluster for every test that needs Ray, started once per session:
two nodes on this machine (`ray.cluster_utils.Cluster`), the head advertising the custom
resource `tokenrouter_small` and the second node `tokenrouter_large`, so cross-node
placement is testable on the same cluster every other Ray test uses.
`serve_http`: Ray Serve on that cluster, HTTP on a free port (or
``TOKENROUTER_TEST_SERVE_PORT``).

Ray is imported inside the fixtures, so sessions that never ask for it do not pay for it.

Markers are applied at collection (`pytest_collection_modifyitems`): `ray` on every test that
uses a Ray fixture (or sits in a module that starts Ray itself), `demo` on every test that
uses a demo fixture (the SmolLM2 build). The fast tier deselects them together with `slow`:
``pytest -m "not ray and not demo and not slow"`` (scripts/test_fast.sh).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from tests.net import free_port

SERVE_PORT = int(os.environ.get("TOKENROUTER_TEST_SERVE_PORT") or free_port())

# Fixtures (direct or through other fixtures) that start Ray or need the demo build.
RAY_FIXTURES = frozenset({"ray_cluster", "serve_http", "serve_app"})
DEMO_FIXTURES = frozenset({"demo_model_dir", "demo_tokenizer", "demo_pair", "flagship_paths"})
# Tests (node-id prefixes) that do so without those fixtures.
RAY_TESTS = (
    "tests/deployments/test_serve_run.py",  # `serve run` in a subprocess
    "tests/deployments/test_haproxy_front.py",  # starts Ray and HAProxy itself
)
DEMO_TESTS = (
    "tests/deployments/test_api_keys.py",  # its module fixture loads the demo tokenizer
    "tests/test_cli.py::test_prepare_demo_is_idempotent",
)


# Tests that take many seconds on two cores, out of the fast tier: the float64 reference
# runs of the tiny chain (a fixture), and (node-id prefixes) real-time measurement windows
# on the simulated runtime, the runtime-vs-reference exactness file, the device dry run.
SLOW_FIXTURES = frozenset({"chain_reference_models"})
SLOW_TESTS = (
    "tests/engine/test_gpu_check_dry_run.py::test_dry_run_gives_a_full_verdict",
    "tests/engine/test_static_path.py::test_the_forward_computes_the_mask_the_host_would_build",
    "tests/local/test_runtime_vs_reference.py",
    "tests/simulation/test_backend.py::test_measured_throughput_tracks_the_prediction",
    "tests/simulation/test_open_loop.py::test_open_loop_moderate_load_without_a_timeout",
    "tests/simulation/test_open_loop.py::test_step_load_follows_the_client_count",
    "tests/simulation/test_no_timeout.py::test_closed_loop_without_a_timeout_never_stalls",
    "tests/simulation/test_no_timeout.py::test_open_loop_without_a_timeout_never_stalls",
    "tests/tuning/test_tuner_core.py::test_tuner_follows_a_routing_shift_on_the_simulated",
    "tests/tuning/test_step_times.py::test_profile_file_feeds_tune",  # profiles a real model
    "tests/tuning/test_solver.py::test_three_models_past_the_exact_range_use_monte_carlo",
    "tests/tuning/test_replicas.py::test_tuner_choice_for_two_large_replicas_is_the_measured",
    "tests/tuning/test_replicas.py::test_tuner_resolves_and_stays_admissible_when_replicas",
    "tests/engine/test_tensor_parallel.py",  # worker processes per test
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `ray` / `demo` / `slow` from what each test uses, so ``-m`` can select tiers."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & SLOW_FIXTURES or item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
        if names & RAY_FIXTURES or item.nodeid.startswith(RAY_TESTS):
            item.add_marker(pytest.mark.ray)
        if names & DEMO_FIXTURES or item.nodeid.startswith(DEMO_TESTS):
            item.add_marker(pytest.mark.demo)


# Property tests draw the same examples on every run (no example database either): a test
# cannot pass on one run and fail on the next by what it happened to draw.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Every test starts from the same random state (``random``, numpy, torch): a test that
    draws without a generator of its own draws the same numbers on every run, in any
    order."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def demo_resolver() -> None:
    """The shipped configs name ``${demo:...}``: registered as the CLI and the app builder do."""
    from tokenrouter_ray.demo import register_resolver

    register_resolver()


@pytest.fixture(scope="session")
def chain_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny three-model chain (tests/tiny_models.py), float64."""
    from tests.tiny_models import save_chain

    return save_chain(tmp_path_factory.mktemp("chain"))


@pytest.fixture(scope="session")
def chain_reference_models(chain_dirs: dict[str, str]) -> dict[str, Any]:
    """The chain as plain transformers models: the sequential references."""
    import torch
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        for name, path in chain_dirs.items()
    }


@pytest.fixture(scope="session")
def served_chain_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The chain models again, each directory with the tiny tokenizer, for HTTP tests."""
    from tests.tiny_models import save_chain

    return save_chain(tmp_path_factory.mktemp("served"), with_tokenizer=True)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        yield ray.get_runtime_context()
        return
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 6,
            "resources": {"tokenrouter_small": 1},
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=6, resources={"tokenrouter_large": 1})
    cluster.wait_for_nodes()
    context = ray.init(address=cluster.address, log_to_driver=False)
    yield context
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def serve_http(ray_cluster: Any) -> Iterator[str]:
    """Base URL of Ray Serve's HTTP proxy on the shared cluster."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    yield f"http://127.0.0.1:{SERVE_PORT}"
    serve.shutdown()
