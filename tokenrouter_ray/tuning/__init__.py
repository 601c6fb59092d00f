"""Deferred-batching thresholds: the Markov-chain throughput model, its search, the live tuner.

``profile`` holds the routing statistics (step times, p, c) and ``step_times`` measures them
on a real model (the ``profile`` command); ``chain`` enumerates the reachable states,
``stationary`` solves the long-run distribution, ``markov`` turns that into predicted tokens
per second, ``montecarlo``/``simulate`` estimate the same chain by simulation, ``replicas``
extends it to data-parallel replicas, ``search`` picks ``B*(N)``, and ``commands`` is the
``tune`` CLI. Live: ``tuner`` (``TunerCore`` and the one tuner loop) feeds the replicas'
windows (``window``) to ``solver`` (``ThresholdSolver``); ``decision`` holds what it answers
(``TunerDecision``, ``TunerStatus``). The rules about thresholds themselves (lookup,
fill, no deadlock) live in ``tokenrouter_ray.thresholds``; the simulated runtime lives in
``tokenrouter_ray.simulation``.
"""
