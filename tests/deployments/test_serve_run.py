"""`serve run conf/local.yaml` as a user runs it: a subprocess with its own Ray instance,
answering the official openai client, and shutting down cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.deployments.serve_process import kill_serve_run, start_serve_run
from tokenrouter_ray.config import CONF_DIR

pytestmark = pytest.mark.demo
BASE = "http://127.0.0.1:8000"  # the API users call: the ingress's own port
PROXY = "http://127.0.0.1:8010"  # Serve's proxy, the same API


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = start_serve_run(CONF_DIR / "local.yaml", log, f"{BASE}/v1/models")
    yield proc
    kill_serve_run(proc)


def test_models_endpoint(served) -> None:
    models = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none").models.list()
    assert [m.id for m in models.data] == ["tokenrouter"]
    # 8000 is the ingress's own port (conf/local.yaml); Serve's proxy serves the same app
    proxied = openai.OpenAI(base_url=f"{PROXY}/v1", api_key="none").models.list()
    assert [m.id for m in proxied.data] == ["tokenrouter"]
    tuner = httpx.get(f"{BASE}/v1/tokenrouter/tuner", timeout=30).json()  # on by default
    assert sorted(tuner["thresholds"]) == ["large", "small"] and tuner["spec"]["enabled"]


def test_chat_and_completions_streaming_and_not(served) -> None:
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model="tokenrouter", messages=question, max_tokens=24, temperature=0
    )
    answer = chat.choices[0].message.content
    assert answer.strip() and chat.choices[0].finish_reason in ("stop", "length")
    routing = chat.model_extra["routing"]
    assert sum(routing["tokens_per_model"].values()) == chat.usage.completion_tokens
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tokenrouter", messages=question, max_tokens=24, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == answer
    completion = client.completions.create(
        model="tokenrouter", prompt="The sky is", max_tokens=8, temperature=0
    )
    pieces = client.completions.create(
        model="tokenrouter", prompt="The sky is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == completion.choices[0].text
    assert completion.usage.completion_tokens == 8


def test_the_readmes_first_example_answers_right_and_presets_trade_it(served) -> None:
    """README's first request on the default (calibrated) operating point: right. The
    ``fast`` preset (the router's training rate) hands more of it to the small model."""
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]

    def ask(quality: str | None) -> tuple[str, dict[str, int]]:
        body = {} if quality is None else {"routing": {"quality": quality}}
        r = client.chat.completions.create(
            model="tokenrouter", messages=question, max_tokens=32, temperature=0,
            extra_body=body,
        )  # fmt: skip
        return r.choices[0].message.content, r.model_extra["routing"]["tokens_per_model"]

    answer, default = ask(None)
    assert "Paris" in answer.split(".")[0], answer
    _, fast = ask("fast")
    share = lambda t: t.get("large", 0) / sum(t.values())  # noqa: E731
    assert share(fast) < share(default)


def test_sigterm_shuts_down_cleanly(served) -> None:
    served.send_signal(signal.SIGTERM)
    assert served.wait(timeout=120) is not None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{BASE}/v1/models", timeout=2)
