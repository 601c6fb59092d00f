"""Per-token reports and per-request metrics through the whole OpenAI flow: the
official ``openai`` client -> the real FastAPI app over ASGI ->
``IngressServer`` -> ``LocalRuntime`` on two tiny real-architecture models.

- ``routing_trace``: every output token with its writer and the router's score, and the
  dropped proposals; the same, chunk by chunk, when streaming; cut with the output at a
  stop string; the trace viewer reads both.
- ``logprobs``: equal (1e-4, the engine's logits are fp32) to ``log_softmax`` of a plain
  transformers forward of the model that wrote each token, on the committed prefix.
- ``metrics``: present on every choice (and on each streamed choice's finish chunk) and
  consistent with the usage, the routing extension and the trace.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.openai.ingress_app import SERVED, run_served_flow
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.traceview.model import trace_from_json

TWO = ["small", "large"]
THRESHOLD = 0.45
PROMPTS = [[(5 * i + j) % 128 for j in range(4 + 3 * i)] for i in range(3)]


def words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def run_flow(dirs: dict[str, str], policy: tuple[str, dict], body: Any) -> Any:
    """``body(client, runtime)`` against the app over a LocalRuntime of small + large with
    ``policy``; checks nothing is left anywhere afterwards."""
    return run_served_flow(dirs, policy, lambda client, rt, _http: body(client, rt))


async def collect(stream: Any) -> list[dict[str, Any]]:
    """A stream's chunks as the JSON objects the server sent (extensions included)."""
    return [chunk.model_dump(mode="json", exclude_unset=True) async for chunk in stream]


def choice_extra(choice: Any, name: str) -> Any:
    return (choice.model_extra or {}).get(name)


def check_trace(trace: dict[str, Any], text: str, usage_tokens: int) -> None:
    """One choice's trace against its text and the policy (entropy at the small model)."""
    tokens, dropped = trace["tokens"], trace["dropped"]
    assert trace["models"] == TWO
    assert len(tokens) == usage_tokens and [t["id"] for t in tokens] == ids_of(text)
    assert all(t["text"] == f"w{t['id']}" for t in tokens)
    for t in tokens:  # the entropy policy scores the small model's output only
        if t["model"] == "small":
            assert 0 <= t["score"] <= THRESHOLD
        else:
            assert t["model"] == "large" and t["score"] is None
    for d in dropped:  # each drop: the small model's proposal, scored over the threshold
        assert d["model"] == "small" and d["score"] > THRESHOLD
        assert d["replaced_by"] == tokens[d["index"]]["model"] == "large"
        assert d["text"] == f"w{d['id']}"


def test_routing_trace_round_trips_through_the_openai_client(served_chain_dirs) -> None:
    async def body(client: openai.AsyncOpenAI, rt: LocalRuntime) -> None:
        traced = {"routing_trace": True}
        for prompt in PROMPTS:
            kw = dict(model=SERVED, max_tokens=24, temperature=0, extra_body=traced)
            plain = await client.completions.create(prompt=prompt, **kw)
            choice = plain.choices[0]
            trace = choice_extra(choice, "routing_trace")
            check_trace(trace, choice.text, plain.usage.completion_tokens)
            metrics = choice_extra(choice, "metrics")
            counts = {m: sum(t["model"] == m for t in trace["tokens"]) for m in TWO}
            assert counts == metrics["tokens_per_model"]
            assert len(trace["dropped"]) == metrics["dropped_tokens"]
            # the viewer reads the response, and its streamed chunks give the same trace
            assert trace_from_json(plain.model_dump(mode="json")).to_json() == trace
            chunks = await collect(await client.completions.create(
                prompt=prompt, stream=True, **kw))  # fmt: skip
            parts = [c["choices"][0]["routing_trace"] for c in chunks if c["choices"]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == choice.text
            assert sum(len(p["tokens"]) for p in parts) == len(trace["tokens"])
            assert trace_from_json(chunks).to_json() == trace
            for chunk in chunks:  # a chunk's tokens are those its text shows
                c = chunk["choices"][0]
                shown = ids_of(c["text"])
                assert [t["id"] for t in c["routing_trace"]["tokens"]] == shown
        assert len(rt.handoffs) > 3  # both models wrote
        # chat: the same trace shape, streaming too; not asked, no trace at all
        msgs = [{"role": "user", "content": words(PROMPTS[1])}]
        chat = await client.chat.completions.create(
            model=SERVED, messages=msgs, max_tokens=20, temperature=0, extra_body=traced
        )
        trace = choice_extra(chat.choices[0], "routing_trace")
        check_trace(trace, chat.choices[0].message.content, chat.usage.completion_tokens)
        chunks = await collect(await client.chat.completions.create(
            model=SERVED, messages=msgs, max_tokens=20, temperature=0, stream=True,
            extra_body=traced))  # fmt: skip
        assert trace_from_json(chunks).to_json() == trace
        bare = await client.chat.completions.create(
            model=SERVED, messages=msgs, max_tokens=20, temperature=0
        )
        assert "routing_trace" not in bare.choices[0].model_extra
        assert bare.choices[0].message.content == chat.choices[0].message.content
        bare_chunks = await collect(await client.chat.completions.create(
            model=SERVED, messages=msgs, max_tokens=20, temperature=0, stream=True))  # fmt: skip
        assert not any("routing_trace" in c for ch in bare_chunks for c in ch["choices"])

    run_flow(served_chain_dirs, ("entropy", {"threshold": THRESHOLD}), body)


def test_a_stop_string_cuts_the_trace_with_the_usage(served_chain_dirs) -> None:
    async def body(client: openai.AsyncOpenAI, rt: LocalRuntime) -> None:
        kw = dict(model=SERVED, prompt=PROMPTS[2], max_tokens=20, temperature=0)
        text = (await client.completions.create(**kw)).choices[0].text
        full = text.split()
        stop = full[4]
        traced = {"routing_trace": True, "logprobs": 2}
        cut = await client.completions.create(stop=[stop], extra_body=traced, **kw)
        choice, n = cut.choices[0], cut.usage.completion_tokens
        assert choice.finish_reason == "stop" and choice.text == text[: text.index(stop)]
        # the tokens up to the one completing the stop string, never the ones after it
        want = next(i for i in range(1, len(full) + 1) if stop in " ".join(full[:i]))
        trace = choice_extra(choice, "routing_trace")
        assert [t["id"] for t in trace["tokens"]] == ids_of(text)[:want]
        assert n == want < len(full) and len(choice.logprobs.tokens) == n
        assert sum(choice_extra(choice, "metrics")["tokens_per_model"].values()) == n
        chunks = await collect(await client.completions.create(
            stop=[stop], stream=True, extra_body=traced, **kw))  # fmt: skip
        assert trace_from_json(chunks).to_json() == trace
        streamed = [t for c in chunks if c["choices"]
                    for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]  # fmt: skip
        assert streamed == choice.logprobs.tokens
        assert (
            chunks[-1]["choices"][0]["metrics"]["tokens_per_model"]
            == choice_extra(choice, "metrics")["tokens_per_model"]
        )

    run_flow(served_chain_dirs, ("entropy", {"threshold": THRESHOLD}), body)


def reference_logprobs(model: Any, prefix: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


def test_logprobs_equal_a_plain_forward_of_the_writer(served_chain_dirs) -> None:
    """Greedy, bernoulli(0.5) routing (both models write, drops included): each token's
    logprob and top-k are those of the model that wrote it, on the committed prefix."""
    models = {
        name: AutoModelForCausalLM.from_pretrained(served_chain_dirs[name], dtype=torch.float64)
        for name in TWO
    }
    k = 5

    def check(prompt: list[int], ids: list[int], writers: list[str], entries: list[tuple]) -> int:
        assert len(ids) == len(writers) == len(entries)
        for i, (token, logprob, top) in enumerate(entries):
            want = reference_logprobs(models[writers[i]].eval(), prompt + ids[:i])
            assert abs(logprob - want[ids[i]].item()) < 1e-4, (i, writers[i])
            best = torch.topk(want, k)
            assert [t for t, _ in top] == best.indices.tolist()
            values = best.values.tolist()
            assert max(abs(a - b) for (_, a), b in zip(top, values, strict=True)) < 1e-4
            assert token == ids[i] == best.indices[0].item()  # greedy: the argmax
        return len(set(writers))

    async def body(client: openai.AsyncOpenAI, rt: LocalRuntime) -> None:
        prompt = PROMPTS[1]
        msgs = [{"role": "user", "content": words(prompt)}]  # renders to "w.. w.. "
        kw = dict(model=SERVED, max_tokens=16, temperature=0, seed=3)
        extra = {"routing_trace": True}
        chat = await client.chat.completions.create(
            messages=msgs, logprobs=True, top_logprobs=k, extra_body=extra, **kw
        )
        choice = chat.choices[0]
        ids = ids_of(choice.message.content)
        writers = [t["model"] for t in choice_extra(choice, "routing_trace")["tokens"]]
        content = choice.logprobs.content
        assert all(e.bytes == list(e.token.encode()) for e in content)
        entries = [
            (int(e.token[1:]), e.logprob, [(int(t.token[1:]), t.logprob) for t in e.top_logprobs])
            for e in content
        ]
        assert check(prompt, ids, writers, entries) == 2  # both models wrote
        assert choice_extra(choice, "metrics")["dropped_tokens"] > 0  # and drops happened
        # streamed: the same entries, chunk by chunk
        chunks = await collect(
            await client.chat.completions.create(
                messages=msgs, logprobs=True, top_logprobs=k, stream=True, extra_body=extra, **kw
            )
        )
        streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for e in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
        assert streamed == [e.model_dump(mode="json") for e in content]
        # completions: OpenAI's legacy shape, the same values
        comp = await client.completions.create(prompt=prompt, logprobs=k, extra_body=extra, **kw)
        lp = comp.choices[0].logprobs
        assert lp.tokens == [f"w{t}" for t in ids] and len(lp.top_logprobs) == len(ids)
        assert lp.text_offset == [len(" ".join(f"w{t}" for t in ids[:i])) + (i > 0)
                                  for i in range(len(ids))]  # fmt: skip
        rows = zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
        entries = [
            (int(tok[1:]), value, sorted(((int(s[1:]), v) for s, v in top.items()),
                                         key=lambda x: -x[1]))
            for tok, value, top in rows
        ]  # fmt: skip
        check(prompt, ids, writers, entries)
        stream = await collect(await client.completions.create(
            prompt=prompt, logprobs=k, stream=True, **kw))  # fmt: skip
        parts = [c["choices"][0]["logprobs"] for c in stream if c["choices"]]
        merged = {key: [v for p in parts if p for v in p[key]] for key in lp.model_dump()}
        assert merged == lp.model_dump(mode="json")
        plain = await client.completions.create(prompt=prompt, **kw)
        assert plain.choices[0].logprobs is None and plain.choices[0].text == comp.choices[0].text

    run_flow(served_chain_dirs, ("bernoulli", {"p": 0.5}), body)


@pytest.mark.parametrize("policy", [("bernoulli", {"p": 0.4}), ("never", {})])
def test_metrics_are_on_every_choice_and_consistent(served_chain_dirs, policy) -> None:
    async def body(client: openai.AsyncOpenAI, rt: LocalRuntime) -> list[dict]:
        seen = []
        for prompt in PROMPTS:
            r = await client.completions.create(
                model=SERVED, prompt=prompt, max_tokens=20, temperature=0, n=2
            )
            for choice in r.choices:
                seen.append((choice_extra(choice, "metrics"), choice_extra(choice, "routing"),
                             r.usage.completion_tokens // 2))  # fmt: skip
            chunks = await collect(await client.completions.create(
                model=SERVED, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                stream_options={"include_usage": True}))  # fmt: skip
            finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert len(finish) == 1 and all(
                "metrics" not in c["choices"][0] for c in chunks if c["choices"] and c not in finish
            )
            seen.append((finish[0]["choices"][0]["metrics"], finish[0]["routing"],
                         chunks[-1]["usage"]["completion_tokens"]))  # fmt: skip
        return seen

    seen = run_flow(served_chain_dirs, policy, body)
    handed = 0
    for m, routing, n in seen:
        assert set(m) == {"ttft_s", "queue_s", "mean_itl_s", "e2e_s", "tokens_per_s",
                          "tokens_per_model", "handoffs", "dropped_tokens", "pending_s",
                          "peer_bytes", "cached_tokens"}  # fmt: skip
        assert 0 <= m["queue_s"] <= m["ttft_s"] <= m["e2e_s"]
        assert 0 < m["mean_itl_s"] <= m["e2e_s"]
        assert m["tokens_per_s"] == pytest.approx(n / m["e2e_s"])
        assert sum(m["tokens_per_model"].values()) == n == 20
        assert {k: v for k, v in m["tokens_per_model"].items() if v} == routing["tokens_per_model"]
        assert m["handoffs"] == routing["handoffs"]
        assert (m["peer_bytes"] > 0) == (m["handoffs"] > 0)
        # bernoulli escalates one token at a time: a drop and a handoff there, one back
        assert m["dropped_tokens"] == m["tokens_per_model"]["large"]
        assert m["handoffs"] in range(2 * m["dropped_tokens"] - 1, 2 * m["dropped_tokens"] + 1)
        assert set(m["pending_s"]) == set(TWO) and min(m["pending_s"].values()) >= 0
        assert m["pending_s"]["small"] <= m["e2e_s"] and m["pending_s"]["large"] <= m["e2e_s"]
        if m["handoffs"]:  # the small model kept the KV while the large one wrote
            assert m["pending_s"]["small"] > 0
        handed += m["handoffs"]
    assert (handed > 0) == (policy[0] == "bernoulli")
    json.dumps(seen)  # plain JSON all the way


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(served_chain_dirs) -> None:
    """``usage.prompt_tokens_details.cached_tokens``: 0 for a prompt the entry model has
    not seen, its cached full blocks (never the last prompt token) for one that shares
    them; on completions and chat, streamed (the usage chunk) and not, with n = 2."""
    system = [(7 * j + 3) % 128 for j in range(22)]  # five full 4-token blocks and a bit

    async def body(client: openai.AsyncOpenAI, rt: LocalRuntime) -> list[Any]:
        first = await client.completions.create(
            model=SERVED, prompt=system, max_tokens=3, temperature=0
        )
        again = await client.completions.create(
            model=SERVED, prompt=[*system, 9, 8], max_tokens=3, temperature=0, n=2
        )
        chunks = await collect(await client.completions.create(
            model=SERVED, prompt=[*system, 5], max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True}))  # fmt: skip
        chat = [{"role": "user", "content": words(system)}]
        chat_first = await client.chat.completions.create(
            model=SERVED, messages=chat, max_tokens=3, temperature=0
        )
        chat_chunks = await collect(await client.chat.completions.create(
            model=SERVED, messages=chat, max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True}))  # fmt: skip
        return [first.usage, again.usage, chunks[-1]["usage"], chat_first.usage,
                chat_chunks[-1]["usage"], again.choices]  # fmt: skip

    first, again, streamed, chat_first, chat_streamed, choices = run_flow(
        served_chain_dirs, ("never", {}), body
    )
    assert first.prompt_tokens == 22 and first.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens == 24 and again.prompt_tokens_details.cached_tokens == 20
    for choice in choices:  # each choice is its own request at the entry model
        assert choice_extra(choice, "metrics")["cached_tokens"] == 20
    assert streamed["prompt_tokens"] == 23
    assert streamed["prompt_tokens_details"] == {"cached_tokens": 20}
    # the chat prompt (a template around the words) was new once, then found again
    assert chat_first.prompt_tokens_details.cached_tokens < chat_first.prompt_tokens
    assert chat_streamed["prompt_tokens"] == chat_first.prompt_tokens
    full = (chat_first.prompt_tokens - 1) // 4 * 4  # every full block but the last token's
    assert chat_streamed["prompt_tokens_details"] == {"cached_tokens": full}
