"""The bounded admission queue (ingress/admission.py): a request waits for a slot first come,
first served; past ``max_waiting`` waiters or ``max_wait_s`` it is a 429 with Retry-After;
requests it admitted count against the slots until they leave their block."""

from __future__ import annotations

import asyncio

import pytest

from tests.waiting import wait_until
from tokenrouter_ray.ingress.admission import AdmissionQueue, QueueFullError
from tokenrouter_ray.openai.errors import error_response


class Slots:
    """What the ingress counts: requests submitted (``active``) under ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0

    def has_room(self, reserved: int) -> bool:
        return self.active + reserved < self.limit


async def hold(
    queue: AdmissionQueue, slots: Slots, order: list[int], i: int, release: asyncio.Event
) -> None:
    async with queue.admit(slots.has_room):
        order.append(i)
        slots.active += 1  # submitted: the core counts it now
    await release.wait()
    slots.active -= 1


@pytest.mark.asyncio
async def test_waiters_get_free_slots_in_arrival_order() -> None:
    queue, slots = AdmissionQueue(max_waiting=8, max_wait_s=10), Slots(limit=2)
    order: list[int] = []
    releases = [asyncio.Event() for _ in range(6)]
    tasks = []
    for i in range(6):
        tasks.append(asyncio.ensure_future(hold(queue, slots, order, i, releases[i])))
        # it arrived (admitted or waiting) before the next one comes
        await wait_until(lambda i=i: len(order) + queue.waiting == i + 1, 20, f"arrival {i}")
    assert order == [0, 1] and queue.waiting == 4
    for i in range(4):
        releases[i].set()  # one slot frees: the oldest waiter takes it, and only it
        await wait_until(lambda i=i: len(order) == i + 3, 20, f"a waiter admitted ({i})")
        assert order == list(range(i + 3)) and slots.active <= slots.limit
        assert queue.waiting == 3 - i  # the queue woke no other waiter with it
    for r in releases:
        r.set()
    await asyncio.gather(*tasks)
    assert queue.stats.admitted_at_once == 2 and queue.stats.admitted_after_wait == 4
    assert queue.reserved == 0 and queue.waiting == 0


@pytest.mark.asyncio
async def test_past_the_queue_or_the_wait_it_is_a_429_with_retry_after() -> None:
    queue, slots = AdmissionQueue(max_waiting=2, max_wait_s=1.0), Slots(limit=0)
    waiting = [asyncio.ensure_future(_enter(queue, slots)) for _ in range(2)]
    await wait_until(lambda: queue.waiting == 2, 0.8, "two waiters")  # (well inside their wait)
    with pytest.raises(QueueFullError) as full:
        await _enter(queue, slots)  # the queue is full: refused at once
    status, body = error_response(full.value)
    assert status == 429 and full.value.headers == {"Retry-After": "1"}
    assert body["error"]["code"] == "rate_limit_exceeded"
    for task in waiting:  # no slot ever frees: each waiter is refused at its deadline
        with pytest.raises(QueueFullError, match=r"within 1 s"):
            await task
    assert queue.stats.refused_full == 1 and queue.stats.refused_timeout == 2
    assert queue.waiting == 0 and queue.reserved == 0


@pytest.mark.asyncio
async def test_admitted_requests_hold_their_slot_until_they_submit() -> None:
    """Between admission and submission (body, parse, tokenize) a request is not in the
    core's count yet: the queue must not hand its slot to another waiter meanwhile."""
    queue, slots = AdmissionQueue(max_waiting=8, max_wait_s=5), Slots(limit=1)
    entered: list[int] = []
    gate = asyncio.Event()

    async def slow(i: int) -> None:
        async with queue.admit(slots.has_room):
            entered.append(i)
            await gate.wait()  # still reading its body: not submitted

    tasks = [asyncio.ensure_future(slow(i)) for i in range(3)]
    await wait_until(lambda: entered == [0] and queue.waiting == 2, 20, "one in, two waiting")
    # A negative check: the queue polls for room every 5 ms; in this window it must hand
    # the reserved slot to nobody else
    await asyncio.sleep(0.1)
    assert entered == [0]
    gate.set()
    await asyncio.gather(*tasks)
    assert entered == [0, 1, 2] and queue.reserved == 0


@pytest.mark.asyncio
async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    queue, slots = AdmissionQueue(max_waiting=1, max_wait_s=10), Slots(limit=0)
    waiter = asyncio.ensure_future(_enter(queue, slots))
    await wait_until(lambda: queue.waiting == 1, 20, "the waiter in the queue")
    waiter.cancel()  # the client went away
    await wait_until(lambda: queue.waiting == 0, 20, "the waiter leaving the queue")
    slots.limit = 1
    await asyncio.wait_for(_enter(queue, slots), 20)
    assert queue.waiting == 0 and queue.reserved == 0


async def _enter(queue: AdmissionQueue, slots: Slots) -> None:
    async with queue.admit(slots.has_room):
        pass
