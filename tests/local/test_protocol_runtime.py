"""The protocol's rules where they matter: in a running system. Aborts mid-handoff free KV
on every model; stale, replayed and post-FINISHED messages change nothing."""

from __future__ import annotations

import asyncio
from typing import ClassVar

from tests.tiny_models import chain_engines
from tests.waiting import wait_until
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import MsgKind, SamplingSpec, decode_batch
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.transport.inproc import InProcChannel

TWO = ["small", "large"]
SPEC = SamplingSpec(temperature=0.0, max_tokens=60, seed=3)


class RecordingChannel(InProcChannel):
    """Keeps every frame it sent, and counts those received; HANDOFF frames are delivered
    late (a slow network)."""

    sent: ClassVar[list[tuple[str, list]]] = []
    received: ClassVar[int] = 0

    async def _send_frame(self, dst, msgs) -> None:
        RecordingChannel.sent.append((dst.name, list(msgs)))
        if any(m.kind == MsgKind.HANDOFF for m in msgs):
            await asyncio.sleep(0.02)  # the simulated network's delay
        await super()._send_frame(dst, msgs)

    async def recv(self) -> list:
        batch = await super().recv()
        RecordingChannel.received += 1  # (its receiver hands it on before it next yields)
        return batch


async def quiet(runtime: LocalRuntime) -> None:
    """Until every message delivered so far was applied and what that sent has arrived,
    and a round of that sent nothing new. Two calls through each step thread: calls run
    first in a turn, so the second runs after the turn that applied what was delivered
    before the first, and posted what that produced."""
    while True:
        before = len(RecordingChannel.sent)
        for server in runtime.model_replicas:
            for _ in range(2):
                await server.call(lambda: None)
        await wait_until(
            lambda: (
                RecordingChannel.received == len(RecordingChannel.sent)
                and not any(
                    s.mailbox.sending or s.mailbox._handed != s.mailbox._finished
                    for s in runtime.model_replicas
                )
            ),
            30,
            "every frame sent received",
        )
        if len(RecordingChannel.sent) == before:
            return


def all_free(runtime: LocalRuntime) -> bool:
    return all(
        s.engine.kv.pool.num_free_blocks == s.engine.kv.pool.num_blocks
        and not s.engine.requests
        and not s.requests.tracked
        for s in runtime.model_replicas
    )


def test_abort_mid_handoff_frees_kv_everywhere(chain_dirs) -> None:
    policy = build_policy("bernoulli", {"p": 0.5}, TWO)

    async def go() -> None:
        RecordingChannel.sent = []
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy, RecordingChannel) as rt:
            ingress = rt.ingress
            rids = [f"a{i}" for i in range(6)]
            for i, rid in enumerate(rids):
                await ingress.submit(rid, [i + 1] * (i + 3), SPEC)
            # requests are bouncing between the models
            await wait_until(lambda: len(rt.handoffs) >= 20, 60, "20 handoffs")
            in_flight = [
                m.rid
                for _, msgs in RecordingChannel.sent[-6:]
                for m in msgs
                if m.kind == MsgKind.HANDOFF
            ]
            for rid in rids:
                await ingress.abort(rid)
            await rt.wait_idle()
            assert all_free(rt)
            assert in_flight  # some aborts raced a handoff still on the wire
            # The system keeps serving.
            done = await asyncio.wait_for(rt.complete([5, 6, 7], SPEC), 60)
            assert len(done.token_ids) == SPEC.max_tokens
            await rt.wait_idle()
            assert all_free(rt)

    asyncio.run(go())


def test_replayed_stale_and_post_finished_messages_change_nothing(chain_dirs) -> None:
    policy = build_policy("bernoulli", {"p": 0.35}, TWO)

    async def go() -> None:
        RecordingChannel.sent, RecordingChannel.received = [], 0
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy, RecordingChannel) as rt:
            first = await asyncio.wait_for(rt.complete([9, 8, 7, 6], SPEC, "r"), 60)
            await rt.wait_idle()
            servers = {s.endpoint: s for s in rt.model_replicas}
            replay = [(dst, msgs) for dst, msgs in RecordingChannel.sent if dst in servers]
            assert any(m.kind == MsgKind.HANDOFF for _, msgs in replay for m in msgs)
            # Every message of the finished request again, newest first (reordered, stale,
            # and after FINISHED): nothing may come back to life.
            for dst, msgs in reversed(replay):
                servers[dst].deliver(decode_batch_roundtrip(msgs))
            await asyncio.wait_for(quiet(rt), 60)  # whatever they would set off, done
            await rt.wait_idle()
            assert all_free(rt)
            again = await asyncio.wait_for(rt.complete([9, 8, 7, 6], SPEC, "r2"), 60)
            assert again.token_ids == first.token_ids

    asyncio.run(go())


def decode_batch_roundtrip(msgs: list) -> list:
    from tokenrouter_ray.protocol import encode_batch

    return decode_batch(encode_batch(msgs))


def test_a_failing_step_ends_its_requests_with_an_error_and_the_model_keeps_serving(
    chain_dirs,
) -> None:
    policy = build_policy("never", {}, TWO)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            runner = rt.model_replicas[0].engine.runner
            real = runner.launch
            calls = {"n": 0}

            def flaky(out, timings):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("device fell over")
                return real(out, timings)

            runner.launch = flaky
            broken = await asyncio.wait_for(rt.complete([1, 2, 3], SPEC), 60)
            assert broken.finish_reason == "error" and "device fell over" in broken.error
            await rt.wait_idle()
            assert all_free(rt)
            fine = await asyncio.wait_for(rt.complete([1, 2, 3], SPEC), 60)
            assert fine.finish_reason == "length" and len(fine.token_ids) == SPEC.max_tokens

    asyncio.run(go())


def test_out_of_vocabulary_prompt_is_refused_without_harm(chain_dirs) -> None:
    async def go() -> None:
        policy = build_policy("never", {}, TWO)
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            bad = await asyncio.wait_for(rt.complete([1, 999], SPEC), 60)
            assert bad.finish_reason == "error" and "vocabulary" in bad.error
            ok = await asyncio.wait_for(rt.complete([1, 2], SPEC), 60)
            assert len(ok.token_ids) == SPEC.max_tokens
            await rt.wait_idle()
            assert all_free(rt)

    asyncio.run(go())


def test_replicas_record_the_statistics_the_tuner_needs(chain_dirs) -> None:
    from tokenrouter_ray.replica.window import Tally
    from tokenrouter_ray.tuning.tuner import build_profile

    policy = build_policy("bernoulli", {"p": 0.35}, TWO)

    async def go() -> dict:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            done = await asyncio.wait_for(rt.complete_all([[1, 2], [3, 4, 5]], SPEC), 60)
            snaps = {s.name: [s.stats.snapshot()] for s in rt.model_replicas}
            return snaps, done

    snaps, done = asyncio.run(go())
    moves = snaps["small"][0].moves
    escalations = moves[("small", "large")].count
    assert moves[("small", "large")].total == 0  # the escalated token was dropped
    assert snaps["large"][0].moves == {("large", "small"): Tally(escalations, escalations)}
    assert moves[("small", "small")].total == sum(d.counts["small"] for d in done)
    profile = build_profile(snaps, TWO, grain_ms=1.0, min_moves=10)
    assert 0.15 < profile.route_prob[0][1] < 0.55  # bernoulli(0.35), 120 draws
