"""Simulated models behind the real app (conf/sim_paper.yaml's models=sim_paper): the official
openai client against Serve, ZeroMQ and the real step loop, no model files; and the host-path
benchmark end to end at a tiny size, so it cannot rot (its figures are not asserted)."""

from __future__ import annotations

import httpx
import openai

from loadtest.host_path import sim_overrides
from tests.net import free_port
from tests.waiting import wait_for
from tokenrouter_ray.simulation.served import sim_answer as expected_text


def test_sim_app_answers_the_openai_client_and_reports_its_host_path(serve_app) -> None:
    with serve_app(sim_overrides("zero"), "sim-zero") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Plan a trip to Lisbon."}]
        reply = client.chat.completions.create(
            model="tokenrouter", messages=messages, max_tokens=64, temperature=0
        )
        chunks = [
            c.choices[0].delta.content
            for c in client.chat.completions.create(
                model="tokenrouter", messages=messages, max_tokens=64, stream=True
            )
            if c.choices and c.choices[0].delta.content
        ]
        stats = httpx.get(base.removesuffix("/v1") + "/v1/tokenrouter/stats", timeout=10).json()
    usage = reply.usage
    assert usage.completion_tokens == 64 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == expected_text(usage.prompt_tokens, 64)
    assert "".join(chunks) == reply.choices[0].message.content
    assert 1 <= len(chunks) <= 64  # one SSE chunk per arrival, several tokens when queued
    counts = reply.model_extra["routing"]["tokens_per_model"]
    assert sum(counts.values()) == 64 and counts["small"] > 0 and counts["large"] > 0
    assert stats["tokens_received"] >= 128
    for name in ("small", "large"):
        model = stats["models"][name]
        assert model["sim"]["steps"] > 0 and model["host"]["steps"] > 0
        assert model["host"]["per_step_us"]["critical"] > 0
    # every serving process set its collector once started (config gc: host_gc.py)
    for gc_now in (stats["gc"], stats["models"]["small"]["gc"], stats["models"]["large"]["gc"]):
        assert gc_now["threshold"] == [20_000, 20, 100] and gc_now["frozen_objects"] > 10_000
        assert len(gc_now["collections"]) == 3 and gc_now["longest_pause_s"] >= 0


def test_the_direct_port_serves_the_same_api_and_cuts_clients_that_stop_reading(
    serve_app,
) -> None:
    """``ingress.direct_port``: the ingress replica's own HTTP server answers as Serve's
    proxy does (same text, its own X-Request-Id), and there a client that never reads is
    seen: two such clients' ``n=16`` streams are cut and freed, while Serve's proxy would
    have taken all of it (docs/user-guide/reliability.md, backpressure)."""
    port = free_port()
    overrides = [
        *sim_overrides("zero"),
        f"ingress.direct_port={port}",
        "ingress.direct_send_buffer_kib=8",
        "ingress.stream_buffer_tokens=8",
        "ingress.client_stall_s=1",
    ]
    with serve_app(overrides, "sim-direct") as base:
        direct = f"http://127.0.0.1:{port}"
        wait_healthy(direct)
        body = {"model": "tokenrouter", "messages": [{"role": "user", "content": "Hi there."}],
                "max_tokens": 24, "temperature": 0}  # fmt: skip
        proxied = httpx.post(f"{base}/chat/completions", json=body, timeout=30)
        own = httpx.post(f"{direct}/v1/chat/completions", json=body, timeout=30)
        assert own.status_code == 200 and own.headers.get("x-request-id")
        text = own.json()["choices"][0]["message"]["content"]
        assert text == proxied.json()["choices"][0]["message"]["content"]
        assert text == expected_text(own.json()["usage"]["prompt_tokens"], 24)

        stats, peak = stall_two_readers("127.0.0.1", port, base)
    assert stats["client_stalls"] >= 2  # both cut ...
    assert stats["active_requests"] == 0  # ... and their 32 choices freed everywhere
    # the ingress held at most its bound for them: 8 tokens per choice (and a chunk's worth)
    assert peak <= 2 * 16 * (8 + 8)


def test_the_charts_default_front_cuts_a_client_that_stops_reading(serve_app) -> None:
    """The Helm chart's default values route clients to the ingress replicas' own port
    (``directPort``): its ingress overrides, served on the simulated pair (the pod's own
    address, here the Ray node's; a free port instead of 8001, and a short stall limit),
    cut two clients that stop reading and free what they held."""
    import socket

    import ray
    import yaml

    from tests.k8s import manifests

    (rayservice,) = [o for o in manifests.render() if o["kind"] == "RayService"]
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    front = [o for o in app["args"]["overrides"] if o.startswith("ingress.")]
    assert "ingress.direct_port=8001" in front and "ingress.direct_host=null" in front
    host = ray.util.get_node_ip_address()
    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    keep = [o for o in front if not o.startswith(("ingress.direct_port=", "ingress.resources="))]
    overrides = [
        *sim_overrides("zero"),
        *keep,  # the chart's: one replica, bound to the node's own address
        f"ingress.direct_port={port}",
        "ingress.stream_buffer_tokens=8",
        "ingress.client_stall_s=1",
    ]
    with serve_app(overrides, "sim-chart-front") as base:
        wait_healthy(f"http://{host}:{port}")
        stats, _ = stall_two_readers(host, port, base)
    assert stats["client_stalls"] >= 2 and stats["active_requests"] == 0


def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")


def stall_two_readers(host: str, port: int, base: str) -> tuple[dict, int]:
    """Two raw-socket clients send an ``n=16`` stream of 4,000 tokens each to ``host:port``
    and never read; waits until the ingress has cut both and holds nothing (at most 90 s).
    Returns the last stats and the most tokens buffered for clients meanwhile."""
    import time

    from tests.ingress.test_backpressure_http import http_post, small_socket

    long_body = {"model": "tokenrouter", "prompt": "once upon", "max_tokens": 4000,
                 "n": 16, "stream": True, "temperature": 0, "ignore_eos": True}  # fmt: skip
    t0 = time.monotonic()
    stuck = [small_socket(port, host) for _ in range(2)]
    try:
        for sock in stuck:
            sock.sendall(http_post("/v1/completions", long_body))  # then never read
        stats_url = base.removesuffix("/v1") + "/v1/tokenrouter/stats"
        peak, stats = 0, {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            stats = httpx.get(stats_url, timeout=10).json()
            peak = max(peak, stats["stream_buffered_tokens"])
            if stats["client_stalls"] >= 2 and stats["active_requests"] == 0:
                break
            time.sleep(0.2)
        print(f"direct port: cut after {time.monotonic() - t0:.1f} s, peak {peak} tokens buffered")
    finally:
        for sock in stuck:
            sock.close()
    return stats, peak


def test_speed_bypass_routes_where_routing_is_faster_and_bypasses_where_it_is_not(
    serve_app,
) -> None:
    """The speed bypass on the served simulation at the paper's step times (6.0 ms small,
    27.9 ms large): with p = 0.35 routing is faster and default requests settle routed; with
    p = 0.95 the top model alone is, and they settle on it. Each response says which mode and
    why; the status route lists the decision with both means."""
    bypass = "tuner.speed_bypass={min_samples: 2, explore_every: 0}"
    tuner = ["tuner=live", "tuner.period_s=0.5"]  # its prediction, shown beside the measured
    for p, faster in ((0.35, "routed"), (0.95, "alone")):
        overrides = [*sim_overrides("paper"), f"policy.options.p={p}", bypass, *tuner]
        with serve_app(overrides, f"sim-bypass-{faster}") as base:
            client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)

            def ask(client: openai.OpenAI = client) -> dict:
                reply = client.completions.create(
                    model="tokenrouter", prompt="Plan a trip.", max_tokens=48,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                return reply.model_extra["routing"]

            learning = [ask() for _ in range(4)]  # nothing decided: both modes, in turn
            assert [(r["mode"], r["reason"]) for r in learning] == [
                ("alone", "learning"), ("routed", "learning"),
            ] * 2  # fmt: skip
            decided = [ask() for _ in range(3)]
            assert {(r["mode"], r["reason"]) for r in decided} == {(faster, "speed")}
            if faster == "alone":
                assert all(r["handoffs"] == 0 for r in decided)
            status = httpx.get(base.removesuffix("/v1") + "/v1/tokenrouter/quality", timeout=10)
            (level,) = status.json()["speed_bypass"]["levels"]
            assert (level["load"], level["mode"]) == ("1", faster)
            slower = "alone" if faster == "routed" else "routed"
            assert level[f"{faster}_ms_per_token"] < level[f"{slower}_ms_per_token"]
            # the tuner's Markov model, from the live routing and step times, predicts the
            # same side: routed faster at p = 0.35, slower at p = 0.95

            def ratio(base: str = base) -> dict | None:
                ask()  # traffic for the tuner's window
                url = base.removesuffix("/v1") + "/v1/tokenrouter/quality"
                (level,) = httpx.get(url, timeout=10).json()["speed_bypass"]["levels"]
                found = level["routed_over_alone"]
                return found if found["predicted"] is not None else None

            both = wait_for(ratio, 120.0, "the tuner's prediction on the status route")
            assert (both["measured"] > 1) == (faster == "routed"), both
            assert (both["predicted"] > 1) == (faster == "routed"), both
