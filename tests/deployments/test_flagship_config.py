"""The flagship ``conf/r2r_cross_node.yaml`` is servable as shipped: built the way ``serve
run`` builds it (its own ``import_path`` called with its own ``args``), on the two-node test
cluster whose nodes advertise the file's ``tokenrouter_small`` / ``tokenrouter_large``
resources, with a router from ``tokenrouter-ray import-router``.

What differs from the file: the model paths (tiny random-weight Qwen3 checkpoints with the
demo model's real tokenizer, saved here), the router directory (``TOKENROUTER_ROUTER_DIR``,
the documented way to point at routers), and, because this machine has no GPU, the two
hardware sizes: ``num_gpus=0`` and a CPU-sized ``memory_budget_gb`` (the file's 60/150 GB
would allocate that much KV in host memory). No other knob is touched.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import yaml

from tests.routing.test_import_router import reference_router, save_r2r_checkpoint
from tests.tiny_models import tiny_model
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.cli import main
from tokenrouter_ray.config import CONF_DIR, ConfigError

FLAGSHIP = CONF_DIR / "r2r_cross_node.yaml"
ROUTER_ENV = "TOKENROUTER_ROUTER_DIR"
CPU_ONLY = [  # hardware, not behaviour: no GPU here, and KV sized for host memory
    f"models.{name}.{key}={value}"
    for name in ("small", "large")
    for key, value in (("num_gpus", 0), ("memory_budget_gb", 0.25))
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def flagship_app() -> dict[str, Any]:
    (app,) = yaml.safe_load(FLAGSHIP.read_text())["applications"]
    return app


def flagship_args(extra: list[str]) -> dict[str, Any]:
    args = copy.deepcopy(flagship_app()["args"])
    args["overrides"] = list(args["overrides"]) + extra
    return args


def test_router_location_comes_from_the_environment(monkeypatch, tmp_path: Path) -> None:
    overrides = flagship_app()["args"]["overrides"]
    monkeypatch.delenv(ROUTER_ENV, raising=False)
    assert compose_config(overrides).policy.options["checkpoint"] == "routers/r2r.safetensors"
    monkeypatch.setenv(ROUTER_ENV, str(tmp_path))
    checkpoint = compose_config(overrides).policy.options["checkpoint"]
    assert checkpoint == f"{tmp_path}/r2r.safetensors"


def test_missing_router_is_one_clear_error_at_build(monkeypatch, tmp_path: Path) -> None:
    from deployments.app import build_app

    monkeypatch.setenv(ROUTER_ENV, str(tmp_path))
    with pytest.raises(ConfigError) as info:
        build_app(flagship_args([]))
    message = str(info.value)
    assert f"{tmp_path}/r2r.safetensors does not exist" in message
    assert "tokenrouter-ray import-router --format r2r" in message
    assert "tokenrouter-ray train-router --policy r2r" in message


def save_tiny_qwen3(path: Path, tokenizer_dir: Path, layers: int, seed: int) -> torch.nn.Module:
    """A random-weight Qwen3 (the flagship's architecture) at toy size, with a real tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(
        "qwen3", seed,
        vocab_size=len(tokenizer), num_hidden_layers=layers, max_position_embeddings=1024,
        initializer_range=0.2, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return model


def calibrated_r2r_router(
    small: torch.nn.Module, tokenizer_dir: Path, path: Path
) -> tuple[Path, float]:
    """A router in R2R's checkpoint layout for the tiny pair, its recorded threshold the
    median score over the small model's own greedy answer: some tokens go to each model."""
    from transformers import AutoTokenizer

    ref = reference_router([32, 64, 32], normalize=True, hidden=64, vocab=small.config.vocab_size,
                           top_k=100)  # fmt: skip
    with torch.no_grad():  # R2R fills the table from the small model; the slim file drops it
        ref.token_embeddings.weight.copy_(small.get_input_embeddings().weight)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    prompt = torch.tensor([list(prompt if isinstance(prompt, list) else prompt["input_ids"])])
    out = small.generate(
        prompt, max_new_tokens=24, do_sample=False, output_hidden_states=True,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    hidden = torch.stack([h[-1][0, -1] for h in out.hidden_states]).double()  # (T, 64)
    logits = torch.stack([step[0] for step in out.logits]).double()  # (T, V)
    tokens = out.sequences[0, prompt.shape[1] :]  # (T,)
    with torch.no_grad():
        scores = torch.sigmoid(ref(hidden, tokens, logits.topk(100, dim=-1).values)).squeeze(-1)
    threshold = float(scores.median())
    return save_r2r_checkpoint(path, ref, with_table=False, threshold=threshold), threshold


@pytest.fixture(scope="module")
def flagship_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tokenrouter_ray.demo.large import prepare_demo

    demo = Path(prepare_demo(quiet=True))
    root = tmp_path_factory.mktemp("flagship")
    small = save_tiny_qwen3(root / "small", demo, layers=1, seed=1)
    save_tiny_qwen3(root / "large", demo, layers=2, seed=2)
    published, threshold = calibrated_r2r_router(small, demo, root / "r2r_router.pt")
    routers = root / "routers"
    routers.mkdir()
    out = routers / "r2r.safetensors"
    assert main(["import-router", "--format", "r2r", str(published), "--out", str(out)]) == 0
    return {
        "small": str(root / "small"), "large": str(root / "large"), "routers": str(routers),
        "threshold": threshold,
    }  # fmt: skip


@pytest.fixture(scope="module")
def flagship(serve_http: str, flagship_paths: dict[str, Any]) -> Iterator[str]:
    """The file's application, built as ``serve run`` builds it, under /flagship."""
    import os

    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = flagship_app()
    paths = [f"models.{m}.path={flagship_paths[m]}" for m in ("small", "large")]
    previous = os.environ.get(ROUTER_ENV)
    os.environ[ROUTER_ENV] = flagship_paths["routers"]
    try:
        builder = import_attr(app["import_path"])
        application = call_user_app_builder_with_args_if_necessary(
            builder, flagship_args(paths + CPU_ONLY)
        )
    finally:
        if previous is None:
            del os.environ[ROUTER_ENV]
        else:
            os.environ[ROUTER_ENV] = previous
    serve.run(application, name="flagship", route_prefix="/flagship", blocking=False)
    try:
        yield f"{serve_http}/flagship/v1"
    finally:
        serve.delete("flagship")


@pytest.mark.demo
def test_flagship_streams_an_answer_from_both_models_across_nodes(
    flagship: str, flagship_paths: dict[str, Any]
) -> None:
    """A request routed at the router's recorded threshold. (One without ``routing`` is the
    speed bypass's to serve routed or by the large model alone, tested on its own.)"""
    from ray import serve

    client = openai.OpenAI(base_url=flagship, api_key="none", max_retries=0, timeout=300)
    routed = {"routing": {"threshold": flagship_paths["threshold"]}}
    stream = client.chat.completions.create(
        model="tokenrouter", messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=routed,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    routing = chunks[-1].model_extra["routing"]
    assert usage.completion_tokens > 0 and text
    assert (routing["mode"], routing["reason"]) == ("routed", "request"), routing
    per_model = routing["tokens_per_model"]
    assert sum(per_model.values()) == usage.completion_tokens
    assert per_model.get("small", 0) > 0 and per_model.get("large", 0) > 0, routing
    assert routing["handoffs"] > 0
    # Each model on its own node (the file's custom resources), PeerReqs over ZeroMQ TCP.
    handles = {name: serve.get_deployment_handle(name, "flagship") for name in ("small", "large")}
    infos = {name: h.info.remote().result().to_json() for name, h in handles.items()}
    status = {name: h.status.remote().result().to_json() for name, h in handles.items()}
    assert infos["small"]["node_id"] != infos["large"]["node_id"]
    assert all(s["address"].startswith("tcp://") for s in status.values()), status
    assert infos["large"]["steps"] > 0


def test_the_one_node_gpu_config_checks_and_builds(flagship_paths, monkeypatch, capsys) -> None:
    """``conf/r2r_one_node.yaml`` (Qwen3-0.6B and 8B on one GPU), its models swapped for the
    tiny random-weight Qwen3 pair with an imported R2R router: ``config check`` builds its
    policy and compares the tokenizers, and the app graph binds as ``serve run`` builds it
    (on CPU sizes here: no GPU)."""
    from deployments.app import build_app

    monkeypatch.setenv(ROUTER_ENV, flagship_paths["routers"])
    monkeypatch.delenv("TOKENROUTER_OVERRIDES", raising=False)
    paths = [f"models.{m}.path={flagship_paths[m]}" for m in ("small", "large")]
    conf = str(CONF_DIR / "r2r_one_node.yaml")
    assert main(["config", "check", conf, *paths]) == 0
    assert ": ok: models small, large; policy r2r" in capsys.readouterr().out
    (app,) = yaml.safe_load((CONF_DIR / "r2r_one_node.yaml").read_text())["applications"]
    cfg = compose_config(app["args"]["overrides"])
    assert {m: cfg.models[m].num_gpus for m in cfg.models} == {"small": 0.5, "large": 0.5}
    assert sum(spec.memory_budget_gb for spec in cfg.models.values()) <= 80 - 8
    assert cfg.transport.zmq.transport == "ipc" and cfg.tuner.enabled
    args = copy.deepcopy(app["args"])
    args["overrides"] = [*args["overrides"], *paths, *CPU_ONLY]
    assert build_app(args) is not None
