"""docs/design/architecture.md's round-trip file list is what a round trip runs.

One streamed chat request, through the real FastAPI app, ``IngressServer``, ``IngressCore``
and two model replicas with tiny real models (``LocalRuntime``, in-process channels), is
traced with a profile hook on every thread; every package file whose code ran is a file the
round trip touches. The docs list them (the section "Files on a round trip", one file per
table row, in backticks); this test fails when the list and the trace disagree, so the
count the docs quote stays the count of this rule."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from tests.ingress.test_ingress_server import SERVED, run_flow

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "tokenrouter_ray") + "/"
DOC = ROOT / "docs" / "design" / "architecture.md"


def traced_round_trip(dirs: dict[str, str]) -> tuple[set[str], int]:
    """The package files (relative to ``tokenrouter_ray/``) whose functions ran during one
    streamed chat request after a warm-up one, and the handoffs it made. The hook is on
    every thread from the start (the replicas' threads start with the runtime) and records
    only while the traced request runs."""
    files: set[str] = set()
    on = [False]

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if on[0] and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE):
                files.add(name[len(PACKAGE) :])

    async def body(client: Any, runtime: Any, server: Any) -> int:
        messages = [{"role": "user", "content": "w5 w6 w7 w8 w9 w10 w11"}]
        kw = {"model": SERVED, "messages": messages, "max_tokens": 16, "temperature": 0}
        async for _ in await client.chat.completions.create(stream=True, **kw):
            pass  # warm-up: imports and first-use caches are not the round trip
        await runtime.wait_idle()
        before = len(runtime.handoffs)
        on[0] = True
        try:
            async for _ in await client.chat.completions.create(stream=True, **kw):
                pass
            await runtime.wait_idle()
        finally:
            on[0] = False
        return len(runtime.handoffs) - before

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        handoffs = run_flow(dirs, body)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return files, handoffs


def documented() -> set[str]:
    """The files of the docs' round-trip table (``tokenrouter_ray/...`` in its first column)."""
    text = DOC.read_text()
    section = text.split("## Files on a round trip", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `tokenrouter_ray/([\w/]+\.py)`", section, flags=re.M))


def test_the_docs_list_the_files_a_round_trip_runs(served_chain_dirs: dict[str, str]) -> None:
    traced, handoffs = traced_round_trip(served_chain_dirs)
    assert handoffs >= 2  # handed to the other model and back: both replicas' paths ran
    assert {"replica/step.py", "ingress/core.py", "engine/engine.py"} <= traced
    listed = documented()
    assert sorted(traced - listed) == [], "traced, not in docs/design/architecture.md"
    assert sorted(listed - traced) == [], "in docs/design/architecture.md, not traced"
