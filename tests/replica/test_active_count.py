"""``ActiveCount``'s silence rule, on a given clock: an ingress is dropped after
``silence_s`` of the replica's own running time without a refresh, and a replica that was
itself away (frozen, stalled) drops nobody for the time it was not listening."""

from __future__ import annotations

from tokenrouter_ray.replica.active_count import ActiveCount


def test_an_ingress_silent_while_the_replica_checks_every_second_is_dropped() -> None:
    counts = ActiveCount(silence_s=10.0)
    counts.update("ingress-a", 2, now=0.0)
    counts.update("ingress-b", 1, now=0.0)
    dropped: dict[float, set[str]] = {}
    for t in range(1, 13):
        if t <= 11:
            counts.update("ingress-a", 2, now=float(t))  # a refreshes every second, b died
        dropped[t] = counts.forget_silent(now=float(t))
    assert all(not dropped[t] for t in range(1, 11))
    assert dropped[11] == {"ingress-b"} and counts.total == 2
    assert counts.ingresses() == ["ingress-a"]


def test_a_replica_back_from_a_long_stop_drops_nobody_for_its_own_absence() -> None:
    """Both ingresses were refreshing when the replica stopped at t = 2 (SIGSTOP, a stalled
    loop); it runs again at t = 40, before its event loop read the refreshes waiting in the
    socket. Nobody is dropped then, nor while the refreshes are read; an ingress that still
    says nothing is dropped ``silence_s`` of running time later."""
    counts = ActiveCount(silence_s=10.0)
    for t in (0.0, 1.0, 2.0):
        counts.update("ingress-a", 3, now=t)
        counts.update("ingress-b", 1, now=t)
        assert counts.forget_silent(now=t) == set()
    assert counts.forget_silent(now=40.0) == set()  # away 38 s: not their silence
    assert counts.total == 4
    for t in (41.0, 42.0, 43.0, 44.0, 45.0, 46.0, 47.0, 48.0, 49.0, 50.0):
        counts.update("ingress-a", 3, now=t - 0.5)  # a refreshes again; b is really gone
        assert counts.forget_silent(now=t) == set(), t
    assert counts.forget_silent(now=51.0) == {"ingress-b"}  # heard at 2 + 38 away: 11 s ago
    assert counts.total == 3


def test_an_ingress_whose_count_is_zero_is_never_dropped() -> None:
    counts = ActiveCount(silence_s=1.0)
    counts.update("ingress-a", 0, now=0.0)
    assert all(not counts.forget_silent(now=float(t)) for t in range(1, 6))
    assert counts.known and counts.total == 0
