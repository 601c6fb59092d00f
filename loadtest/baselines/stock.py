"""Stock servers, not ours: ``transformers serve --continuous-batching`` (in transformers,
CPU-capable) pinned to one model, or vLLM's OpenAI server on a GPU host when installed.

They speak the legacy ``/v1/completions`` API with a text prompt: no token ids in, no
logprobs out (``transformers serve`` ignores ``logprobs``), which is what an external
dispatcher gets from them.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from loadtest.baselines.api import ServerProcess, launch_server, wait_healthy


def stock_command(
    model: str, port: int, device: str = "cpu", kind: str = "auto", kv_blocks: int = 512
) -> list[str]:
    """The command that serves ``model`` on ``port``: vLLM on a GPU when present, else
    ``transformers serve --continuous-batching`` with ``kv_blocks`` blocks of 32 tokens
    (left to itself on a CPU it sizes its KV cache to about half the machine's memory, so
    two of them do not fit on 24 GiB)."""
    if kind == "vllm" or (
        kind == "auto" and device != "cpu" and importlib.util.find_spec("vllm") is not None
    ):
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    return [exe, "serve", "--continuous-batching", "--cb-num-blocks", str(kv_blocks),
            "--cb-block-size", "32", "--device", device, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", model]  # fmt: skip


def launch_stock(
    models: dict[str, str], ports: dict[str, int], log_dir: str, device: str = "cpu"
) -> dict[str, ServerProcess]:
    """One stock server process per model (``name -> directory``), started side by side;
    ``wait_stock`` waits until they answer."""
    return {
        name: launch_server(
            f"stock_{name}", stock_command(model, ports[name], device), ports[name], log_dir
        )
        for name, model in models.items()
    }


def wait_stock(servers: dict[str, ServerProcess]) -> dict[str, ServerProcess]:
    """Until every server answers ``/v1/models``; on a failure all of them are stopped."""
    try:
        for server in servers.values():
            wait_healthy(server, "/v1/models")
    except Exception:
        for server in servers.values():
            server.stop()
        raise
    return servers
