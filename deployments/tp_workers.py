"""Tensor-parallel workers of a model replica as Ray actors in its placement group.

A model with ``tensor_parallel: k`` gets a placement group of k bundles (``app.py``), one per
rank, packed on one node. Serve puts the replica (rank 0) in bundle 0; ``RayWorkerLauncher``
starts ranks 1..k-1 as actors in bundles 1..k-1, each asking for its bundle's resources (so
Ray gives each its own GPU), and runs ``run_worker`` there. The engine talks to them over
the sockets and process group it set up (``tokenrouter_ray/engine/tensor_parallel.py``);
Ray only places and stops them. When the replica dies, its workers' sockets close and their
loops end; Serve removes the placement group and with it the actors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenrouter_ray.engine.tensor_parallel import WorkerSpec, run_worker


@ray.remote(num_cpus=0, max_restarts=0)
class TensorParallelWorker:
    """One rank's process: ``run`` blocks for the replica's lifetime."""

    def run(self, spec: WorkerSpec) -> None:
        run_worker(spec)


class RayWorkerLauncher:
    """The ``WorkerLauncher`` for Serve replicas: rank i in bundle i of the current group."""

    def __init__(self) -> None:
        self.actors: list[Any] = []
        self.runs: list[Any] = []

    def launch(self, specs: Sequence[WorkerSpec]) -> None:
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError(
                "tensor_parallel > 1 needs the replica to run in a placement group of one "
                "bundle per rank (deployments/app.py sets placement_group_bundles)"
            )
        for spec in specs:
            bundle = group.bundle_specs[spec.rank]
            actor = TensorParallelWorker.options(
                name=f"tensor-parallel-rank{spec.rank}-of-{os.getpid()}",  # for inspection
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=spec.rank
                ),
            ).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(spec))

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        self.runs.clear()


def worker_bundles(
    tensor_parallel: int, num_cpus: float, num_gpus: float, resources: dict[str, float]
) -> list[dict[str, float]]:
    """One bundle per rank: rank 0 (the replica) also carries the custom resources that pin
    the model to its node; GPUs split evenly; zero amounts left out (Ray refuses them)."""
    gpu_each = num_gpus / tensor_parallel
    cpus = num_cpus if num_cpus > 0 else 0.01  # a bundle may not be empty

    def bundle(extra: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in {"CPU": cpus, "GPU": gpu_each, **extra}.items() if v > 0}

    return [bundle(dict(resources))] + [bundle({}) for _ in range(tensor_parallel - 1)]
