"""Every ``python -m loadtest`` benchmark at its tiniest size, as a user runs it: a subprocess
``python -m loadtest <name> <its registry entry's smoke arguments>``, so a benchmark that no
longer runs (a changed signature, a removed helper) fails here rather than on the next person
who needs it. Each run must exit 0 and print the command that reproduces it; a benchmark with
targets prints them PASS / MISS (a MISS is a figure, not a failure). Figures are not asserted.

Markers follow what a run uses: ``ray`` (it runs on the Ray cluster with Serve), ``demo``
(it loads the demo build), ``slow`` (tens of seconds or more on two cores). What stands in
for what a benchmark needs: ``serve`` and ``quality-target`` (a running server) get a chat
app in a thread of this process that writes a fixed filler, on a free port; ``gpu-check``
(a GPU) runs its dry run on the CPU (``--device cpu``: every check at toy sizes);
``router-bound`` runs on the demo build itself; ``host``, ``front-floor`` and ``autoscale``
run on the suite's Ray cluster (``RAY_ADDRESS``, its Serve port), as a user runs them on a
running cluster; started alone they start one of their own."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loadtest.__main__ import BENCHMARKS
from tests.net import free_port

ROOT = Path(__file__).resolve().parents[2]
RAY = {"host", "front-floor", "autoscale"}
DEMO = {"router-bound"}
SLOW = RAY | DEMO | {"gpu-check"}
# what each prints besides the reproduce line: its targets, or its table
PRINTS = {
    "serve": "tok/s",
    "host": "PASS|MISS",
    "front-floor": "PASS|MISS",
    "autoscale": "PASS|MISS",
    "router-bound": "PASS|MISS",
    "gpu-check": "exact",
    "quality-target": "rung moves",
}
# the reproduce line's prefix, as each benchmark prints it
REPRODUCE = ("command:", "reproduce:", "# python -m loadtest", "python -m loadtest")


def host_report(out: Path, printed: str) -> None:
    """The host path's figures, in process and served, are there and filled in."""
    assert "paper eager  N=  2" in printed and "zero         N=  2" in printed
    assert "open loop 50% of eager N=32" in printed
    (row,) = json.loads((out / "host.json").read_text())["served"]
    assert row["tok_s"] > 0 and row["ttft_ms_p50"] is not None and row["ttft_probe_ms_p50"] > 0
    paths = row["ttft_probe_paths_ms_p50"]  # each first-token path probed on its own
    assert set(paths) == {"mixed", "kept", "escalated"} and min(paths.values()) > 0
    by_httpx = row["ttft_probe_httpx_paths_ms_p50"]  # the same paths through httpx
    assert set(by_httpx) == set(paths) and min(by_httpx.values()) > 0
    assert set(row["models"]) == {"small", "large"}
    assert row["ingress_cpu_us_per_token"] > 0
    cpu = row["cpu_us_per_token"]  # per process, from /proc over the window
    assert {"ingress", "small", "large"} <= set(cpu) and cpu["ingress"] > 0
    assert all(m["applied_p50_us"] is not None for m in row["models"].values())


# what a run must have written, beyond its exit status and printed lines
REPORTS = {"host": host_report}


def marks(name: str) -> list[pytest.MarkDecorator]:
    out = []
    if name in RAY:
        out.append(pytest.mark.ray)
    if name in DEMO:
        out.append(pytest.mark.demo)
    if name in SLOW:
        out.append(pytest.mark.slow)
    return out


def test_every_benchmark_has_a_smoke_run_and_says_what_it_needs() -> None:
    assert set(PRINTS) == set(BENCHMARKS)
    for name, bench in BENCHMARKS.items():
        assert bench.smoke and bench.needs, name


def stand_in_server() -> object:
    """An OpenAI-style chat server that streams four-character pieces of a filler."""
    from loadtest.baselines.api import Answer, ChatRequest, ThreadServer, chat_app

    async def generate(req: ChatRequest, answer: Answer) -> AsyncIterator[str]:
        answer.prompt_tokens = 8
        for _ in range(req.max_tokens or 16):
            answer.completion_tokens += 1
            answer.tokens_per_model["small"] = answer.completion_tokens
            yield "word"

    return ThreadServer("stand-in", chat_app(generate, "stand-in"), free_port())


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=marks(n)) for n in BENCHMARKS], ids=list(BENCHMARKS)
)
def test_benchmark_runs_at_its_tiniest_size(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if name in DEMO:
        from tokenrouter_ray.demo import built_artifact

        built_artifact("large")  # the demo build is there (prepare-demo), or this says so
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    if name in RAY:  # on the suite's running cluster, as `RAY_ADDRESS=... python -m loadtest`
        import ray

        serve_url = request.getfixturevalue("serve_http")
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        port = int(serve_url.rsplit(":", 1)[1])
    server = stand_in_server() if name in ("serve", "quality-target") else None
    try:
        fill = {"{port}": str(port), "{out}": str(tmp_path),
                "{url}": server.url + "/v1" if server else ""}  # fmt: skip
        argv = []
        for arg in shlex.split(BENCHMARKS[name].smoke):
            for key, value in fill.items():
                arg = arg.replace(key, value)
            argv.append(arg)
        run = subprocess.run(
            [sys.executable, "-m", "loadtest", name, *argv],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        if server is not None:
            server.stop()
    out = run.stdout
    assert run.returncode == 0, f"{name}: {run.returncode}\n{out[-3000:]}\n{run.stderr[-3000:]}"
    assert f"loadtest {name}" in out and any(p in out for p in REPRODUCE), out[-2000:]
    assert any(p in out for p in PRINTS[name].split("|")), out[-2000:]
    if name in REPORTS:
        REPORTS[name](tmp_path, out)
