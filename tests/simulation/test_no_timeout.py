"""The launch rule alone keeps every admitted request moving (part 2): with
``max_defer_s = inf`` (no safety net) and admissible per-N thresholds, runs on the simulation
backend never stall; the safety net, when it does fire, is counted."""

from __future__ import annotations

import asyncio
import math
import time

from tests.waiting import wait_until
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.simulation.backend import calibrate_sleep_bias, sim_engine
from tokenrouter_ray.simulation.loads import ClosedLoop
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.search import threshold_lists, tune


def _tuned_lists(top: int) -> tuple[list[int], list[int]]:
    lists = threshold_lists(tune(paper_r2r(), [1, 2, 4, 8], {"small": 1}), max_n=top)
    return lists["small"], lists["large"]  # large: 1, 1, 2, 2, 3, 3, 3, 3, 5, ...


def test_the_safety_net_is_counted_when_it_fires() -> None:
    engine = sim_engine(lambda b: 0.0, batch_thresholds=[2], max_defer_s=0.02, num_blocks=16)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.execute() is None  # one runnable < B = 2: deferred
    assert engine.scheduler.deferred_timeouts == 0
    time.sleep(0.03)
    assert engine.execute() is not None  # the deadline passed: launched below B
    assert engine.scheduler.deferred_timeouts == 1


def test_closed_loop_without_a_timeout_never_stalls() -> None:
    """N = 8 clients, tuned thresholds (B_large = 5 at N = 8), 24-token requests: every
    client keeps finishing requests, and nothing ever waited for a deadline."""
    small, large = _tuned_lists(16)

    async def run() -> tuple[list[int], list[int], int, float]:
        loop = ClosedLoop(paper_r2r(), 8, (small, large), sleep_bias_s=calibrate_sleep_bias(),
                          max_defer_s=math.inf, max_tokens=24)  # fmt: skip
        async with loop:
            # every client finishes a request, then every client another one (a stalled
            # client would never: the deadlines only bound a broken run)
            await wait_until(lambda: min(loop.finished_by_client) >= 1, 120.0)
            first = list(loop.finished_by_client)
            measured = await loop.measure(1.5)
            await wait_until(
                lambda: all(b > a for a, b in zip(first, loop.finished_by_client, strict=True)),
                120.0,
            )
            second = list(loop.finished_by_client)
            timeouts = sum(e.scheduler.deferred_timeouts for e in loop.engines)
        return first, second, timeouts, measured.mean_batch[1]

    first, second, timeouts, large_batch = asyncio.run(run())
    assert min(first) >= 1 and all(b > a for a, b in zip(first, second, strict=True))
    assert timeouts == 0
    assert large_batch > 1.5  # the threshold did defer (batches near B_large, not 1)


def test_open_loop_without_a_timeout_never_stalls() -> None:
    """Poisson arrivals of 40 short requests, then none: N rises and falls to 0 (a closed
    loop whose clients stop is the same case)."""
    small, large = _tuned_lists(48)

    async def run() -> tuple[int, int]:
        loop = ClosedLoop(paper_r2r(), 48, (small, large), sleep_bias_s=calibrate_sleep_bias(),
                          max_defer_s=math.inf, max_tokens=16, clients=0)  # fmt: skip
        async with loop:
            result = await loop.open_loop(rate_per_s=200.0, count=40, max_tokens=16,
                                          timeout_s=5.0, seed=1)  # fmt: skip
        return result.stalled, result.finished

    stalled, finished = asyncio.run(run())
    assert stalled == 0 and finished == 40
