"""EleutherAI's lm-evaluation-harness runs against this server, offline, as a user runs it
(the recipe: docs/user-guide/lm-eval.md): the ``lm_eval`` CLI in a subprocess,
with no
tokenizer on the client, on a local two-item generate_until task (JSONL + YAML through
``--include_path``), once with ``--model local-chat-completions`` (``--apply_chat_template``,
the ``routing_trace`` extension passed with ``--gen_kwargs``) and once with
``--model local-completions``, against the real ingress FastAPI app served by uvicorn on a
socket -> ``IngressServer`` -> ``LocalRuntime`` with the tiny chain (small + large, entropy
policy). Each run exits 0, writes a results file with the task's ``exact_match`` in [0, 1]
and logs both samples with non-empty responses (the random models write noise, so
correctness is not checked); the server saw exactly one request per document on each
endpoint, in the shape the recipe documents, and nothing is left running afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lm_eval",
    reason="lm-eval is not installed (`uv pip install 'lm-eval[api]'`); it is not a "
    "dependency of the package or of the dev extra",
)

TWO = ["small", "large"]
TASK = "tokenrouter_tiny_qa"
DOCS = [  # words of the tiny tokenizer (w0..w127), so every prompt token is in vocabulary
    {"question": "w5 w17 w3 w99", "answer": "w9"},
    {"question": "w40 w41 w42", "answer": "w43"},
]
TASK_YAML = f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["w0"]
  max_gen_toks: 8
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
"""


class CountingApp:
    """The ASGI app, recording the JSON body of every completion request, by path."""

    PATHS = ("/v1/chat/completions", "/v1/completions")

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: dict[str, list[dict[str, Any]]] = {path: [] for path in self.PATHS}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.bodies[scope["path"]].append(json.loads(body))
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()  # a disconnect, later
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def write_task(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "tiny_qa.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tasks / "tiny_qa.yaml").write_text(TASK_YAML.replace("{data}", str(data)))
    return tasks


def lm_eval_commands(port: int, tasks: Path, out: Path) -> dict[str, list[str]]:
    """The two commands of docs/user-guide/lm-eval.md, by endpoint: chat (messages built by lm-eval,
    the routing extension added with ``--gen_kwargs``) and completions (a text prompt;
    no client-side tokenizer, so generate_until tasks only)."""
    from tests.openai.ingress_app import SERVED

    url = f"http://127.0.0.1:{port}/v1"
    common = f"model={SERVED},num_concurrent=1,max_retries=1,timeout=60"
    run = [sys.executable, "-m", "lm_eval", "run", "--include_path", str(tasks),
           "--tasks", TASK, "--log_samples"]  # fmt: skip
    return {
        "/v1/chat/completions": [
            *run, "--model", "local-chat-completions", "--output_path", str(out / "chat"),
            "--model_args", f"base_url={url}/chat/completions,{common}",
            "--apply_chat_template", "--gen_kwargs", "routing_trace=True",
        ],
        "/v1/completions": [
            *run, "--model", "local-completions", "--output_path", str(out / "completions"),
            "--model_args",
            f"base_url={url}/completions,{common},tokenizer_backend=None,tokenized_requests=False",
        ],
    }  # fmt: skip


def check_outputs(out: Path) -> list[dict[str, Any]]:
    """The results file's exact_match and the logged samples; returns the samples."""
    (results_file,) = out.rglob("results_*.json")
    score = json.loads(results_file.read_text())["results"][TASK]["exact_match,none"]
    assert 0.0 <= score <= 1.0
    (samples_file,) = out.rglob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    print(f"lm-eval {out.name}: exact_match {score}, responses {[s['resps'] for s in samples]}")
    assert len(samples) == len(DOCS)
    assert sorted(s["target"] for s in samples) == sorted(d["answer"] for d in DOCS)
    for sample in samples:
        (response,) = sample["filtered_resps"]
        assert isinstance(response, str) and response.strip()
        assert sample["exact_match"] in (0.0, 1.0)
    return samples


@pytest.mark.slow  # two lm_eval processes (about 5 s of imports each) + the runtime
def test_lm_eval_cli_runs_a_local_task_against_the_server(served_chain_dirs, tmp_path) -> None:
    from transformers import AutoTokenizer

    from tests.openai.ingress_app import SERVED, served
    from tests.tiny_models import chain_engines
    from tokenrouter_ray.openai.validation import RequestLimits
    from tokenrouter_ray.routing.policy import build_policy

    tokenizer = AutoTokenizer.from_pretrained(served_chain_dirs["small"])
    limits = RequestLimits(max_model_len=256, vocab_size=128)
    tasks, out = write_task(tmp_path), tmp_path / "out"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"),  # not the user's cache
        "TOKENIZERS_PARALLELISM": "false",
    }

    async def go() -> tuple[dict[str, tuple[int, str]], int, CountingApp]:
        policy = build_policy("entropy", {"threshold": 0.45}, TWO)
        engines = chain_engines(served_chain_dirs, TWO)
        async with served(
            engines, policy, tokenizer, limits=limits, socket=True, wrap=CountingApp
        ) as flow:
            runtime, port = flow.runtime, flow.port
            runs = {}
            # each CLI runs in its own process while this loop serves its requests
            for path, command in lm_eval_commands(port, tasks, out).items():
                proc = await asyncio.create_subprocess_exec(
                    *command, env=env, cwd=tmp_path,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                )  # fmt: skip
                log, _ = await asyncio.wait_for(proc.communicate(), timeout=180)
                runs[path] = proc.returncode, log.decode(errors="replace")
            await runtime.wait_idle()
            active = runtime.ingress.num_active
            return runs, active, flow.asgi

    runs, active, counting = asyncio.run(go())
    for rc, log in runs.values():
        assert rc == 0, log[-4000:]
    assert active == 0

    # chat: exactly one request per document, lm-eval's messages, the extension passed on
    check_outputs(out / "chat")
    chat = counting.bodies["/v1/chat/completions"]
    assert len(chat) == len(DOCS)
    for body in chat:
        assert body["model"] == SERVED and body["max_tokens"] == 8
        assert body["temperature"] == 0 and "w0" in body["stop"]
        assert body["routing_trace"] is True  # unknown --gen_kwargs reach the body
    # lm-eval may reorder requests (longest first), so compare as sets
    messages = sorted(json.dumps(b["messages"]) for b in chat)
    assert messages == sorted(
        json.dumps([{"role": "user", "content": d["question"]}]) for d in DOCS
    )

    # completions: the same, with the task's text as the prompt
    check_outputs(out / "completions")
    plain = counting.bodies["/v1/completions"]
    assert len(plain) == len(DOCS)
    assert sorted(b["prompt"] for b in plain) == sorted(d["question"] for d in DOCS)
    assert all(b["max_tokens"] == 8 and "routing_trace" not in b for b in plain)
