"""The benchmarks' shared harness: what more than one benchmark in ``loadtest/`` uses sits here,
what one benchmark uses sits in that benchmark's module. It holds the machine description
and the command that reproduces a run (the two header lines every benchmark prints), demo
prompts, the one percentile rule, the demo pair (its engine configs, its engines with and
without prefix caching, its trained R2R router as a policy) and a deploy function for a
Serve app on a Ray cluster started here. Nothing is measured here; every import that pulls
in torch, Ray or the models happens inside the function that needs it.

The load generator (streaming chat over the OpenAI API, closed or open loop) is
``loadtest/harness.py``, shared by the comparison (``run.py``) and ``python -m loadtest
serve``. The random-weight model factory is the package's
``tokenrouter_ray/engine/random_model.py``, which the tests share."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine

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


QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a short poem about the sea.",
    "List five uses of a paperclip.",
    "How do I boil an egg?",
    "Summarise the plot of Hamlet.",
    "What is 17 times 23?",
    "Give three tips for learning a language.",
]


def chat_prompts(tokenizer: object, n: int) -> list[list[int]]:
    """``n`` chat-templated prompts (cycling through QUESTIONS) as token ids."""
    from tokenrouter_ray.openai.chat import render_chat

    return [
        render_chat(tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(n)
    ]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 <= q <= 1) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def demo_r2r_policy() -> Any:
    """The demo pair's trained R2R router (``prepare_demo``'s artifacts) as a policy."""
    from tokenrouter_ray.demo import register_resolver
    from tokenrouter_ray.demo.artifacts import built_artifact
    from tokenrouter_ray.routing.policy import build_policy

    register_resolver()
    options = {
        "checkpoint": built_artifact("router"),
        "threshold": float(built_artifact("router_threshold")),
    }
    return build_policy("r2r", options, ["small", "large"])


def demo_pair_configs() -> tuple[EngineConfig, EngineConfig, str]:
    """The demo pair's engine configs (small, large; 2 GiB of KV each) and the small model's
    label, building the demo and its trained small model on first use (without the small
    model's code in this build: the large model truncated to 8 layers)."""
    from tokenrouter_ray.demo import prepare_demo
    from tokenrouter_ray.engine.config import EngineConfig

    large = str(prepare_demo(quiet=True))
    try:
        from tokenrouter_ray.demo.small import prepare_small_model

        small = EngineConfig(model=str(prepare_small_model(large, quiet=True)))
        label = "demo small model"
    except ImportError:
        small = EngineConfig(model=large, num_hidden_layers=8)
        label = "large truncated to 8 layers"
    budget = dict(memory_budget_bytes=2 * 2**30)
    return (small.model_copy(update=budget), EngineConfig(model=large, **budget), label)


def demo_pair() -> tuple[list[Engine], Any, str]:
    """The demo pair's engines ``[small, large]`` (``demo_pair_configs``), the large model's
    tokenizer and the small model's label."""
    from transformers import AutoTokenizer

    from tokenrouter_ray.engine.engine import Engine

    small_cfg, large_cfg, label = demo_pair_configs()
    engines = [Engine.from_config(small_cfg), Engine.from_config(large_cfg)]
    return engines, AutoTokenizer.from_pretrained(large_cfg.model), label


def demo_pair_engines(caching: bool) -> tuple[list[tuple[str, Engine]], str]:
    """The demo pair as ``LocalRuntime``'s named engines with prefix caching on or off, and
    the small model's label: the trained demo small model where it is already built (it is
    not built here), else the large model truncated to 8 layers."""
    from tokenrouter_ray.demo import prepare_demo
    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine

    large = str(prepare_demo(quiet=True))
    small_cfg, label = EngineConfig(model=large, num_hidden_layers=8), "large truncated to 8"
    try:
        from tokenrouter_ray.demo.small import is_current, small_model_dir

        if is_current(small_model_dir(large)):  # the trained demo small model, if built
            small_cfg, label = EngineConfig(model=str(small_model_dir(large))), "demo small"
    except ImportError:
        pass
    common = dict(memory_budget_bytes=2 * 2**30, prefix_caching=caching)
    engines = [
        ("small", Engine.from_config(small_cfg.model_copy(update=common))),
        ("large", Engine.from_config(EngineConfig(model=large, **common))),
    ]
    return engines, label


def ray_serve_deploy(http_port: int) -> ServeDeploy:
    """A deploy function on a Ray cluster started here on first use (Serve HTTP on
    ``http_port``): ``with deploy(overrides, name) as url`` runs the app of ``overrides``
    under ``/name`` and deletes it on the way out."""

    @contextlib.contextmanager
    def deploy(overrides: list[str], name: str) -> Iterator[str]:
        import ray
        from ray import serve

        from deployments.app import build_app

        if not ray.is_initialized():
            # Ray starts its workers at nice 15; the baselines run at 0. On a machine shared
            # with other work that would starve the served app, so every system gets 0.
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app({"overrides": overrides}), name=name, route_prefix=f"/{name}")
        url = f"http://127.0.0.1:{http_port}/{name}/v1"
        try:
            yield url  # systems.serve_app waits until it answers
        finally:
            serve.delete(name)

    return deploy
