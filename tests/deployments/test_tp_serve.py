"""Tensor parallelism through Serve: the large model split over two ranks (the replica and a
worker actor in its placement group, gloo on CPU) serves the official openai client the same
text as the one-rank models in process; the placement group has one bundle per rank."""

from __future__ import annotations

import concurrent.futures

import openai
import ray

from deployments.app import model_options
from tests.deployments.conftest import local_outputs, tiny_overrides
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.config import ModelSpec

TWO = ["small", "large"]
POLICY = ["policy.options.threshold=0.45"]  # entropy policy: deterministic routing


def test_one_bundle_per_rank_packed_on_one_node() -> None:
    cfg = compose_config(["models=qwen3_r2r_tp2", "policy=r2r", "placement=cross_node"])
    spec = cfg.models["large"]
    assert (spec.path, spec.tensor_parallel, spec.num_gpus) == ("Qwen/Qwen3-32B", 2, 2)
    options = model_options("large", spec)
    assert options["placement_group_bundles"] == [
        {"CPU": 1, "GPU": 1, "tokenrouter_large": 0.001},  # rank 0: the replica, pinned
        {"CPU": 1, "GPU": 1},  # rank 1: a worker actor
    ]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_gpus"] == 1
    cpu = model_options("large", ModelSpec(path="x", num_cpus=0.5, tensor_parallel=2))
    assert cpu["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 0.5}]


def test_served_tp2_equals_one_rank(serve_app, served_chain_dirs) -> None:
    overrides = [
        o.replace("models.large.tensor_parallel=1", "models.large.tensor_parallel=2")
        for o in tiny_overrides(served_chain_dirs, TWO, "entropy", "zmq_ipc", POLICY)
    ]
    assert "models.large.tensor_parallel=2" in overrides
    prompts = [[(7 * i + j) % 128 for j in range(3 + 2 * i)] for i in range(6)]
    expected = local_outputs(served_chain_dirs, TWO, "entropy", {"threshold": 0.45}, prompts, 20)
    with serve_app(overrides, "tp2") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)

        def call(prompt: list[int]) -> openai.types.Completion:
            return client.completions.create(
                model="tokenrouter", prompt=prompt, max_tokens=20, temperature=0
            )

        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # batched on both models
            got = list(pool.map(call, prompts))
        actors = ray.util.list_named_actors(all_namespaces=True)
        assert any(a["name"].startswith("tensor-parallel-rank1-of-") for a in actors)
    for want, response in zip(expected, got, strict=True):
        assert [int(w[1:]) for w in response.choices[0].text.split()] == want.token_ids
        assert response.model_extra["routing"]["tokens_per_model"] == want.counts
    assert sum(w.handoffs for w in expected) > 10  # the large (TP) model took real extends
    assert sum(w.counts["large"] for w in expected) > 10
