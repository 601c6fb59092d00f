"""The app behind Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``), as a user runs
it: ``serve run`` of the simulated app (conf/sim_paper.yaml on another port) in a subprocess
with its own Ray instance. HAProxy, not Serve's Python proxy, answers on the Serve port and
forwards to the ingress replica's own HTTP server; the OpenAI API must behave as it does
through the Python proxy (answers, streams, error envelopes, ``X-Request-Id``), and
SIGTERM must take HAProxy down with the rest (docs/benchmarks/README.md)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from loadtest.proc_cpu import HAPROXY_PROGRAM, find_program
from tests.deployments.serve_process import kill_serve_run, start_serve_run
from tests.net import free_port
from tokenrouter_ray.config import CONF_DIR
from tokenrouter_ray.simulation.served import sim_answer


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, str]]:
    tmp = tmp_path_factory.mktemp("haproxy")
    config = yaml.safe_load((CONF_DIR / "sim_paper.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["overrides"] += ["models.small.sim.profile=zero",
                                                       "models.large.sim.profile=zero"]  # fmt: skip
    (tmp / "app.yaml").write_text(yaml.safe_dump(config))
    own = tempfile.mkdtemp(prefix="trh-")
    env = {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",  # read when the fresh Ray instance starts
        # its own files, not another run's /tmp/haproxy-serve (a short directory: HAProxy's
        # admin socket is a Unix socket, whose path must stay under 108 bytes)
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{own}/haproxy.cfg",
        "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{own}/admin.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": own,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{own}/server-state",
    }
    before = set(find_program(HAPROXY_PROGRAM))
    base = f"http://127.0.0.1:{port}"
    proc = start_serve_run(tmp / "app.yaml", tmp / "serve.log", f"{base}/v1/models", env, 240)
    proc.haproxy = set(find_program(HAPROXY_PROGRAM)) - before  # type: ignore[attr-defined]
    yield proc, base
    kill_serve_run(proc)
    for pid in proc.haproxy:  # type: ignore[attr-defined]
        if pid in find_program(HAPROXY_PROGRAM):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(own, ignore_errors=True)


def test_haproxy_fronts_the_openai_api(served) -> None:
    proc, base = served
    assert proc.haproxy, "no HAProxy process started with the app"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    question = [{"role": "user", "content": "hello"}]
    raw = client.chat.completions.with_raw_response.create(
        model="tokenrouter", messages=question, max_tokens=12, temperature=0
    )
    chat = raw.parse()
    assert chat.usage.completion_tokens == 12
    assert chat.choices[0].message.content == sim_answer(chat.usage.prompt_tokens, 12)
    assert raw.http_response.headers["x-request-id"]  # made and echoed behind HAProxy too
    stream = client.chat.completions.create(
        model="tokenrouter", messages=question, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content


def test_errors_keep_their_envelope_and_request_id_behind_haproxy(served) -> None:
    _, base = served
    url = f"{base}/v1/chat/completions"
    bad = httpx.post(
        url,
        json={"model": "tokenrouter", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": -1},
        headers={"X-Request-Id": "trace-42"},
        timeout=30,
    )  # fmt: skip
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "trace-42"
    assert bad.json()["error"]["param"] == "max_tokens"
    unknown = httpx.post(
        url, json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, timeout=30
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    garbage = httpx.post(url, content=b"{not json", timeout=30)
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_json"


def test_sigterm_takes_haproxy_down_with_the_app(served) -> None:
    proc, base = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) is not None
    deadline = time.monotonic() + 30
    while proc.haproxy & set(find_program(HAPROXY_PROGRAM)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not proc.haproxy & set(find_program(HAPROXY_PROGRAM)), "HAProxy outlived serve run"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{base}/v1/models", timeout=2)
