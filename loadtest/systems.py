"""The systems compared (docs/benchmarks/README.md, "Systems"): ``SYSTEMS`` maps each name to
its label and an ``up(bench)`` context manager that brings it up and yields its OpenAI base
URL (``.../v1``), torn down on exit. The Serve apps differ from tokenrouter's by config
overrides only; the baselines are in ``baselines/``."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.baselines.api import ServerProcess, ThreadServer, python_module, start_server
from loadtest.baselines.stock import launch_stock, wait_stock
from loadtest.common import ServeDeploy, free_port, wait_ready

PORT_OFFSETS = {"stock_small": 0, "stock_large": 1, "dispatcher": 2, "step_sync": 3}


@dataclass
class Bench:
    """What every system needs: the model pair, the policy, ports, and how to deploy an app."""

    small_dir: str
    large_dir: str
    p: float
    app_overrides: list[str]  # the tuned app (policy bernoulli(p) included)
    deploy: ServeDeploy  # (overrides, app name) -> context manager yielding the v1 URL
    log_dir: str
    policy_apps: dict[str, list[str]] = field(default_factory=dict)  # r2r / rstitch overrides
    # stock small, stock large, dispatcher, step-sync: +0..+3; None: free ports
    port_base: int | None = None
    dtype: str = "auto"
    memory_budget_gb: float = 1.5
    in_process: bool = False  # baseline servers on threads here (tests), not processes
    stock_warm: tuple[int, int] = (8, 48)  # stock warm-up: concurrent requests, tokens each
    stock: dict[str, ServerProcess] = field(default_factory=dict)
    predeployed: dict[str, contextlib.AbstractContextManager[str]] = field(default_factory=dict)
    _stock_ready: bool = False
    _tokenizer: Any = None
    _ports: dict[str, int] = field(default_factory=dict)

    def port(self, server: str) -> int:
        """The port of a baseline ``server`` for the whole run: ``port_base`` plus its offset
        (``PORT_OFFSETS``), or a port free now."""
        if server not in self._ports:
            base = self.port_base
            self._ports[server] = free_port() if base is None else base + PORT_OFFSETS[server]
        return self._ports[server]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text with the pair's tokenizer (no special tokens)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.large_dir)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_tokens(self, text: str) -> int:
        """Tokens of a text (a request cut at the time limit), with the pair's tokenizer."""
        return len(self.tokenize(text))

    def policy_app(self, system: str) -> list[str]:
        if system not in self.policy_apps:
            raise ValueError(f"no app overrides for {system!r} (Bench.policy_apps)")
        return self.policy_apps[system]

    def eager_overrides(self) -> list[str]:
        keep = [o for o in self.app_overrides if not o.lstrip("+~").startswith("tuner")]
        return [*keep, "tuner=static", "scheduler.batch_thresholds=[1]"]

    def launch_stock(self) -> None:
        """Start both stock server processes now, without waiting for them (the CI run
        overlaps their start-up with the first systems'; a benchmark does not, since it
        would take CPU from the measurements)."""
        if not self.stock:  # both at once: their start-ups overlap
            models = {"small": self.small_dir, "large": self.large_dir}
            ports = {"small": self.port("stock_small"), "large": self.port("stock_large")}
            self.stock = launch_stock(models, ports, self.log_dir)
            self._stock_ready = False

    def stock_server(self, which: str) -> ServerProcess:
        """One stock server per model, shared by every system that uses it, kept up until
        ``close()`` (loading a model and its first continuous batch take seconds)."""
        self.launch_stock()
        if not self._stock_ready:
            wait_stock(self.stock)
            self._stock_ready = True
            self.count_tokens("")  # loads the tokenizer
            concurrency, tokens = self.stock_warm
            prompt = self._tokenizer.decode(list(range(5, 9)))
            with concurrent.futures.ThreadPoolExecutor(len(self.stock)) as pool:  # side by side
                warms = [
                    pool.submit(warm_stock, server.url, prompt, concurrency, tokens)
                    for server in self.stock.values()
                ]
                for warm in warms:
                    warm.result()
        return self.stock[which]

    def close(self) -> None:
        """Stop the stock servers."""
        for server in self.stock.values():
            server.stop()
        self.stock.clear()

    def close_all(self) -> None:
        """Stop the stock servers and delete apps deployed early and never measured."""
        self.close()
        for name in list(self.predeployed):
            with contextlib.suppress(Exception):  # its system failed already, or never ran
                self.predeployed.pop(name).__exit__(None, None, None)


def warm_stock(url: str, prompt: str, concurrency: int = 8, max_tokens: int = 48) -> None:
    """The first request builds the continuous-batching manager, and its generation config
    becomes the one every later request shares (``transformers serve`` has no per-request
    config in that mode yet): greedy, EOS off, as the benchmark's requests. On a CPU its
    first requests run ~20x slower than later ones (new shapes), so ``concurrency``
    requests of ``prompt`` x 8 (about the workload's prompt length) follow, unmeasured."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    config = json.dumps({"do_sample": False, "eos_token_id": None})

    def body(text: str, n: int) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": text,
            "max_tokens": n,
            "temperature": 0,
            "generation_config": config,
        }

    httpx.post(f"{url}/v1/completions", json=body(prompt, 2), timeout=300).raise_for_status()
    if concurrency < 1:
        return
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [
            pool.submit(
                httpx.post,
                f"{url}/v1/completions",
                json=body(" ".join([prompt] * 8), max_tokens),
                timeout=600,
            )
            for _ in range(concurrency)
        ]
        for future in futures:
            future.result().raise_for_status()


@contextlib.contextmanager
def serve_app(bench: Bench, overrides: list[str], name: str) -> Iterator[str]:
    """The app ``name`` (deployed now, or taken from ``predeploy``), deleted on exit."""
    early = bench.predeployed.pop(name, None)
    with early if early is not None else bench.deploy(overrides, name) as url:
        # a deploy may return before the app's route answers; several apps starting side
        # by side on two busy cores have taken more than 5 minutes (a start is not timed)
        wait_ready(f"{url}/models", timeout_s=900.0)
        yield url


SERVE_APPS: dict[str, tuple[str, Callable[[Bench], list[str]]]] = {
    "tokenrouter": ("lt_tokenrouter", lambda b: b.app_overrides),
    "eager_async": ("lt_eager", lambda b: b.eager_overrides()),
    "r2r": ("lt_r2r", lambda b: b.policy_app("r2r")),
    "rstitch": ("lt_rstitch", lambda b: b.policy_app("rstitch")),
}


def predeploy(bench: Bench, systems: list[str]) -> None:
    """Deploy the Serve apps of ``systems`` now, side by side, for ``serve_app`` to take
    in turn (the CI run: with a non-blocking deploy their start-ups overlap; a benchmark
    does not, since idle apps would share the CPU with the one measured)."""
    for system in systems:
        if system in SERVE_APPS:
            name, overrides = SERVE_APPS[system]
            try:
                cm = bench.deploy(overrides(bench), name)
                url = cm.__enter__()
            except Exception:  # the system's own deploy raises it again, and it is reported
                continue
            bench.predeployed[name] = _entered(cm, url)


@contextlib.contextmanager
def _entered(cm: contextlib.AbstractContextManager[str], url: str) -> Iterator[str]:
    """An already entered context manager, exited when this one is."""
    try:
        yield url
    finally:
        cm.__exit__(None, None, None)


def serve_system(system: str) -> Callable[[Bench], contextlib.AbstractContextManager[str]]:
    name, overrides = SERVE_APPS[system]
    return lambda b: serve_app(b, overrides(b), name)


@contextlib.contextmanager
def process(server: ServerProcess | ThreadServer) -> Iterator[str]:
    try:
        yield f"{server.url}/v1"
    finally:
        server.stop()


def step_sync_server(bench: Bench, models: list[str], name: str) -> ServerProcess | ThreadServer:
    port = bench.port("step_sync")
    if bench.in_process:
        from loadtest.baselines import step_sync

        app = step_sync.build_app(models, bench.p, bench.dtype, bench.memory_budget_gb)
        return ThreadServer(name, app, port)
    argv = python_module("loadtest.baselines.step_sync", "--models", ",".join(models),
                         "--p", str(bench.p), "--dtype", bench.dtype,
                         "--memory-budget-gb", str(bench.memory_budget_gb),
                         "--port", str(port))  # fmt: skip
    return start_server(name, argv, port, bench.log_dir)


def dispatcher(
    bench: Bench, urls: dict[str, str], p: float, name: str
) -> ServerProcess | ThreadServer:
    port = bench.port("dispatcher")
    if bench.in_process:
        from loadtest.baselines.dispatcher import build_app

        return ThreadServer(name, build_app(urls, bench.large_dir, p), port)
    argv = python_module("loadtest.baselines.dispatcher", "--small-url", urls["small"],
                         "--large-url", urls["large"], "--tokenizer", bench.large_dir,
                         "--p", str(p), "--port", str(port))  # fmt: skip
    return start_server(name, argv, port, bench.log_dir)


def dispatcher_server(bench: Bench) -> ServerProcess | ThreadServer:
    small, large = bench.stock_server("small"), bench.stock_server("large")
    return dispatcher(bench, {"small": small.url, "large": large.url}, bench.p, "dispatcher")


@contextlib.contextmanager
def stock_alone(bench: Bench, which: str) -> Iterator[str]:
    """A stock server behind the dispatcher, which never hands off."""
    url = bench.stock_server(which).url
    p = 1.0 if which == "large" else 0.0  # every position to that model, in one request
    with process(dispatcher(bench, {"small": url, "large": url}, p, f"{which}_stock")) as v1:
        yield v1


SYSTEMS: dict[str, tuple[str, Callable[[Bench], contextlib.AbstractContextManager[str]]]] = {
    "tokenrouter": ("tokenrouter (tuned)", serve_system("tokenrouter")),
    "eager_async": ("Eager-Async", serve_system("eager_async")),
    "r2r": ("R2R (demo router)", serve_system("r2r")),
    "rstitch": ("R-Stitch", serve_system("rstitch")),
    "step_sync": (
        "Step-Sync",
        lambda b: process(step_sync_server(b, [b.small_dir, b.large_dir], "step_sync")),
    ),
    "large_alone": (
        "large alone (our engine)",
        lambda b: process(step_sync_server(b, [b.large_dir], "large_alone")),
    ),
    "small_alone": (
        "small alone (our engine)",
        lambda b: process(step_sync_server(b, [b.small_dir], "small_alone")),
    ),
    "large_stock": ("large alone (stock server)", lambda b: stock_alone(b, "large")),
    "std_serving": ("Std. Serving", lambda b: process(dispatcher_server(b))),
}


def app_status(url: str) -> dict[str, Any]:
    """What a tokenrouter app reports about itself (``tuner``: the tuner's status, with its
    thresholds, step-time table and last decision; ``deferred_timeouts``); empty for the
    baselines."""
    out: dict[str, Any] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError):
        r = httpx.get(f"{url}/tokenrouter/tuner", timeout=10)
        if r.status_code == 200:
            out["tuner"] = r.json()
    with contextlib.suppress(httpx.HTTPError, ValueError):
        r = httpx.get(f"{url}/tokenrouter/stats", timeout=10)
        if r.status_code == 200:
            models = r.json().get("models", {})
            timeouts = [m.get("deferred_timeouts") for m in models.values()]
            if timeouts and all(t is not None for t in timeouts):
                out["deferred_timeouts"] = sum(timeouts)
    return out
