"""What more than one benchmark in ``loadtest/`` uses: the machine line and the command that
reproduces a run (the two header lines every benchmark prints), the one percentile
rule, a free port, waiting for a server's route, and Ray Serve started here with a
deploy function for an app on it. Every import that pulls in torch or Ray happens inside the
function that needs it. The load generator is ``loadtest/harness.py``."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

# (overrides, app name) -> a context manager that yields the app's v1 URL
ServeDeploy = Callable[[list[str], str], contextlib.AbstractContextManager[str]]
# Set by ``python -m loadtest <benchmark>`` so ``command()`` reproduces the subcommand.
INVOKED_AS: str | None = None


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {dev}, torch {torch.__version__}"


def command() -> str:
    """The command line that reproduces this run."""
    # ``python -m loadtest <benchmark>`` sets INVOKED_AS = "loadtest <benchmark>": two words
    module = INVOKED_AS or sys.modules["__main__"].__spec__.name.removesuffix(".__main__")
    return "python -m " + " ".join([module, *(shlex.quote(a) for a in sys.argv[1:])])


def header() -> str:
    """The two lines every benchmark prints first: the machine and the reproduce line."""
    return f"machine: {machine()}\nreproduce: {command()}"


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 <= q <= 1) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_targets(targets: Iterable[tuple[str, bool, str]]) -> None:
    """Each target PASS / MISS with its figures: they never fail the run."""
    print("\n# targets (PASS / MISS; they never fail the run)")
    for name, met, detail in targets:
        print(f"{'PASS' if met else 'MISS'}  {name}: {detail}")


def number(x: float | None, fmt: str = ".1f") -> str:
    """``x`` formatted, or a dash for a figure not measured (None or NaN)."""
    return "–" if x is None or math.isnan(x) else format(x, fmt)


def markdown_row(cells: Iterable[object]) -> str:
    return f"| {' | '.join(map(str, cells))} |"


def markdown_table(columns: Sequence[str], rows: Iterable[Iterable[object]]) -> str:
    """A Markdown table; a column named with a trailing ``:`` is right-aligned."""
    rule = "|" + "|".join("---:" if c.endswith(":") else "---" for c in columns) + "|"
    head = markdown_row(c.removesuffix(":") for c in columns)
    return "\n".join([head, rule, *map(markdown_row, rows)])


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None (with a note) where matplotlib, the
    optional ``bench`` extra, is not installed: the run's tables and JSON are written anyway."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]')")
        return None
    return plt


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 180.0) -> None:
    """Until ``GET url`` answers 200 (a server starting, an app deploying: Serve answers 404
    until the app's route is up, 503 while its replicas start)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def start_serve(http_port: int, num_cpus: int = 8) -> None:
    """Serve with its HTTP on ``http_port``, unless this process has Ray already: on the
    running cluster that ``RAY_ADDRESS`` names (whose Serve, if it runs, keeps its own
    port: pass that one), else on a cluster started here."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            # Ray starts its workers at nice 15; the baselines run at 0. On a machine shared
            # with other work that would starve the served app, so every system gets 0.
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(
                address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False
            )
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})


def ray_serve_deploy(http_port: int) -> ServeDeploy:
    """A deploy function on a Ray cluster started here on first use (Serve HTTP on
    ``http_port``): ``with deploy(overrides, name) as url`` runs the app of ``overrides``
    under ``/name`` and deletes it on the way out."""

    @contextlib.contextmanager
    def deploy(overrides: list[str], name: str) -> Iterator[str]:
        from ray import serve

        from deployments.app import build_app

        start_serve(http_port)
        serve.run(build_app({"overrides": overrides}), name=name, route_prefix=f"/{name}")
        url = f"http://127.0.0.1:{http_port}/{name}/v1"
        try:
            yield url  # systems.serve_app waits until it answers
        finally:
            serve.delete(name)

    return deploy
