"""The ingress's recovery and admission cap without Ray: ``Recovery`` waits until every model
has a replica again, then re-creates the lost replica's requests (exact, recorded, and
``running`` meanwhile); ``AdmissionCap`` is the configured cap or the tuner's share."""

from __future__ import annotations

import asyncio
import contextlib

from tests.local.test_protocol_runtime import all_free
from tests.local.test_reliability_runtime import TWO, prompts
from tests.tiny_models import chain_engines
from tests.waiting import wait_until
from tokenrouter_ray.ingress.recovery import AdmissionCap, Recovery
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.transport.base import endpoint_name

SPEC = SamplingSpec(temperature=0.0, max_tokens=200, seed=3, ignore_eos=True)


def test_recovery_waits_for_a_replica_then_recreates_exactly(chain_dirs) -> None:
    policy = build_policy("bernoulli", {"p": 0.4}, TWO)
    batch = prompts(4)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            want = await rt.complete_all(batch, SPEC)
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            gone = {"large"}  # until the test says a replica is back
            large = endpoint_name("large", "0")
            recovery = Recovery(
                rt.ingress, lambda: sorted(gone), lambda rid: {"large": large}, timeout_s=30
            )
            tasks = [asyncio.ensure_future(rt.complete(p, SPEC)) for p in batch]
            await wait_until(
                lambda: sum(len(live.log.tokens) for live in rt.ingress.live.values()) >= 30,
                60,
                "30 tokens committed",
            )
            recovery.lost({large})
            await asyncio.sleep(0.2)  # the large model stays gone this long (by design)
            assert recovery.running and recovery.log == []  # waiting for a replica
            assert any(not live.done for live in rt.ingress.live.values())
            gone.clear()
            await recovery.wait()
            got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            await rt.wait_idle()
            assert not recovery.running and all_free(rt)
            (entry,) = recovery.log
            assert entry["lost"] == [large] and entry["recreated"] > 0
            assert entry["waited_s"] >= 0.2
            assert sum(c.recreated for c in got) == entry["recreated"]
            assert [c.token_ids for c in got] == [c.token_ids for c in want]

    asyncio.run(go())


def test_admission_cap_is_the_configured_one_or_the_tuners_share() -> None:
    cap = AdmissionCap(64, ingress_replicas=3)
    assert cap.limit == 64
    cap.adopt(10)  # the app may run 10 at its SLO: ceil(10 / 3) per replica
    assert cap.limit == 4
    cap.adopt(1000)
    assert cap.limit == 64  # never above the configured cap
    cap.adopt(None)
    assert cap.limit == 64 and cap.slo is None

    async def follow() -> list[int | None]:
        answers = [7, RuntimeError("tuner restarting"), 2]
        seen: list[int | None] = []

        async def fetch() -> int:
            seen.append(cap.slo)  # what the previous poll left
            answer = answers.pop(0) if answers else None
            if answer is None:
                task.cancel()
                await asyncio.sleep(3600)  # never returns: cancelled just above
            if isinstance(answer, Exception):
                raise answer
            return answer

        task = asyncio.ensure_future(cap.follow(fetch, period_s=0.001))
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return [*seen, cap.slo]

    # 7 -> ceil(7 / 3) = 3; the failed poll keeps 3; 2 -> 1
    assert asyncio.run(follow()) == [None, 3, 3, 1, 1]
