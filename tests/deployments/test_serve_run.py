"""`serve run conf/local.yaml` as a user runs it: a subprocess with its own Ray instance,
answering the official openai client, and shutting down cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import yaml

from tests.deployments.serve_process import PortTaken, kill_serve_run, start_serve_run
from tests.net import free_port
from tokenrouter_ray.config import CONF_DIR

pytestmark = pytest.mark.demo


@dataclass
class Served:
    """``serve run conf/local.yaml`` as shipped, on free ports instead of its 8000 (the
    ingress's own port, the API users call) and 8010 (Serve's proxy, the same API)."""

    proc: subprocess.Popen
    base: str
    proxy: str


def local_yaml_on(directory, direct: int, proxied: int) -> object:
    conf = yaml.safe_load((CONF_DIR / "local.yaml").read_text())
    conf["http_options"]["port"] = proxied
    overrides = conf["applications"][0]["args"]["overrides"]
    assert "ingress.direct_port=8000" in overrides and conf["http_options"]["port"]
    overrides[overrides.index("ingress.direct_port=8000")] = f"ingress.direct_port={direct}"
    path = directory / "local.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # a launch-time override (TOKENROUTER_OVERRIDES), after the config's tuner.grain_ms=2.0
    env = {"TOKENROUTER_OVERRIDES": "tuner.grain_ms=2.5"}
    for attempt in range(3):  # ports are chosen just before the start; taken ones are redrawn
        directory = tmp_path_factory.mktemp("serve")
        direct, proxied = free_port(), free_port()
        base = f"http://127.0.0.1:{direct}"
        config = local_yaml_on(directory, direct, proxied)
        try:
            proc = start_serve_run(config, directory / "serve.log", f"{base}/v1/models", env)
            break
        except PortTaken:
            if attempt == 2:
                raise
    yield Served(proc, base, f"http://127.0.0.1:{proxied}")
    kill_serve_run(proc)


def test_models_endpoint(served) -> None:
    models = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none").models.list()
    assert [m.id for m in models.data] == ["tokenrouter"]
    # 8000 is the ingress's own port (conf/local.yaml); Serve's proxy serves the same app
    proxied = openai.OpenAI(base_url=f"{served.proxy}/v1", api_key="none").models.list()
    assert [m.id for m in proxied.data] == ["tokenrouter"]
    tuner = httpx.get(f"{served.base}/v1/tokenrouter/tuner", timeout=30).json()  # on by default
    assert sorted(tuner["thresholds"]) == ["large", "small"] and tuner["spec"]["enabled"]
    assert tuner["spec"]["grain_ms"] == 2.5  # TOKENROUTER_OVERRIDES reached the app


def test_chat_and_completions_streaming_and_not(served) -> None:
    """Streamed text equals the whole response's, routed (a preset) and served by the large
    model alone. (A default request's mode is the speed bypass's to choose per request.)"""
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    routed = {"routing": {"quality": "high"}}
    chat = client.chat.completions.create(
        model="tokenrouter", messages=question, max_tokens=24, temperature=0, extra_body=routed
    )
    answer = chat.choices[0].message.content
    assert answer.strip() and chat.choices[0].finish_reason in ("stop", "length")
    routing = chat.model_extra["routing"]
    assert routing["mode"] == "routed"
    assert sum(routing["tokens_per_model"].values()) == chat.usage.completion_tokens
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tokenrouter", messages=question, max_tokens=24, temperature=0, stream=True,
            extra_body=routed,
        )
        if c.choices
    )  # fmt: skip
    assert streamed == answer
    alone = {"routing": {"model": "large"}}
    completion = client.completions.create(
        model="tokenrouter", prompt="The sky is", max_tokens=8, temperature=0, extra_body=alone
    )
    pieces = client.completions.create(
        model="tokenrouter", prompt="The sky is", max_tokens=8, temperature=0, stream=True,
        extra_body=alone,
    )  # fmt: skip
    assert "".join(p.choices[0].text for p in pieces if p.choices) == completion.choices[0].text
    assert completion.usage.completion_tokens == 8


def bypass_level_one(base: str) -> dict | None:
    """The speed bypass's state at load 1 (one request at a time), from the status route."""
    status = httpx.get(f"{base}/v1/tokenrouter/quality", timeout=30).json()["speed_bypass"]
    return next((lv for lv in status["levels"] if lv["load"] == "1"), None)


def test_the_readmes_first_example_answers_right_and_presets_trade_it(served) -> None:
    """README's first request at the default: the speed bypass, once it has measured both
    modes one request at a time, serves it by the large model alone (on these CPUs routing
    the demo pair is slower than its large model): right, with no handoff, the answer
    ``routing.model = large`` gives. The ``fast`` preset routes, and hands part of the
    answer to the small model; an unknown model is a 400 naming the field."""
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]

    def ask(routing: dict | None) -> tuple[str, dict]:
        body = {} if routing is None else {"routing": routing}
        r = client.chat.completions.create(
            model="tokenrouter", messages=question, max_tokens=32, temperature=0,
            extra_body=body,
        )  # fmt: skip
        return r.choices[0].message.content, r.model_extra["routing"]

    # default requests until load 1 has measured both modes and decided (min_samples 4
    # each; the decision is taken by the request after the last measured one)
    for _ in range(12):
        level = bypass_level_one(served.base)
        if level is not None and level["mode"] is not None:
            break
        client.completions.create(
            model="tokenrouter", prompt="Once upon a time", max_tokens=16, temperature=0
        )
    assert level is not None and level["mode"] == "alone", level
    assert level["alone_ms_per_token"] < level["routed_ms_per_token"]
    answer, default = ask(None)
    if default["reason"] == "explore":  # one request in explore_every: never two in a row
        answer, default = ask(None)
    assert "Paris" in answer.split(".")[0], answer
    assert (default["mode"], default["reason"], default["handoffs"]) == ("alone", "speed", 0)
    assert list(default["tokens_per_model"]) == ["large"]
    alone, by_request = ask({"model": "large"})
    assert (alone, by_request["reason"]) == (answer, "request")
    assert by_request["tokens_per_model"] == default["tokens_per_model"]
    _, fast = ask({"quality": "fast"})
    assert fast["mode"] == "routed" and fast["tokens_per_model"].get("small", 0) > 0
    with pytest.raises(openai.BadRequestError) as bad:
        ask({"model": "smal"})
    assert bad.value.body["param"] == "routing.model"


def test_the_default_holds_the_large_models_accuracy_on_held_out_capitals(served) -> None:
    """The repo's capitals set, test split (held out from every calibration), greedy: the
    default's accuracy, four requests in flight, lies within the Wilson 95 % interval of the
    large model alone (``routing.model = large``), whatever mode the speed bypass serves
    each request in. The large model's answers do not depend on the load (greedy, no
    bypass), so they are asked sixteen at a time, which the engine batches; the default's
    are asked at the load the bypass is meant to decide for here."""
    import asyncio

    from tokenrouter_ray.quality.builtin import capitals
    from tokenrouter_ray.quality.evaluate import run_eval
    from tokenrouter_ray.quality.tasks import split_items

    items = split_items(capitals(), "test")

    def accuracy(extra_body: dict | None, concurrency: int):
        return asyncio.run(run_eval(f"{served.base}/v1", "tokenrouter", items,
                                    concurrency=concurrency, max_tokens=32,
                                    extra_body=extra_body, progress=False,
                                    label="x"))  # fmt: skip

    large = accuracy({"routing": {"model": "large"}}, concurrency=16)
    default = accuracy(None, concurrency=4)
    assert large.failures == default.failures == 0
    low, high = large.interval
    print(f"capitals test split: default {default.correct}/{default.n}, large alone "
          f"{large.correct}/{large.n} [{low:.2f}, {high:.2f}]")  # fmt: skip
    assert low <= default.accuracy <= high, (default.accuracy, large.interval)


def test_sigterm_shuts_down_cleanly(served) -> None:
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=120) is not None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{served.base}/v1/models", timeout=2)
