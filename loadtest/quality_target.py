"""``python -m loadtest quality-target``: how the quality target (``tuner.quality_target``)
moves the operating point of a running app as the prompt mix shifts.

Sends closed-loop default requests (no ``routing``) in phases, each from one prompt set
(``chat``: the ``short_chat`` workload; ``capitals``: the repo's capitals questions), polls
``GET /v1/tokenrouter/quality`` meanwhile, and writes ``<out>/quality_target.json`` and a plot
of the rung, its agreement and the large share over time. docs/user-guide/quality.md, "On the
demo", starts an app with a target and runs it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from loadtest.common import header, pyplot

PROMPT_SETS = ("chat", "capitals")


def conversations(name: str) -> list[list[dict[str, str]]]:
    """The phase's chat messages, one conversation per request in turn."""
    if name == "chat":
        from loadtest.workloads import short_chat

        return [list(messages) for messages in short_chat().prompts]
    from tokenrouter_ray.quality.builtin import capitals

    return [[{"role": "user", "content": item.prompt}] for item in capitals()]


def poll(
    status_url: str, started: float, stop: threading.Event, every_s: float, polls: list[dict]
) -> None:
    """Appends the quality target's state to ``polls`` every ``every_s`` until ``stop``
    (nothing: the app has no target)."""
    while not stop.wait(every_s):
        try:
            target = httpx.get(status_url, timeout=10).json().get("target")
        except (httpx.HTTPError, ValueError):
            target = None
        if target is None:
            continue
        rung = next((r for r in target["rungs"] if r["name"] == target["rung"]), None)
        polls.append({
            "t": time.monotonic() - started, "rung": target["rung"], "scored": target["scored"],
            "agreement": None if rung is None else rung["agreement"],
            "bounds": None if rung is None else rung["bounds"], "target": target["target"],
            "ladder": [r["name"] for r in target["rungs"]],
        })  # fmt: skip


def send_phase(
    url: str, chats: list[list[dict]], n: int, concurrency: int, max_tokens: int, record: Callable
) -> None:
    """``n`` chat requests, ``concurrency`` at a time, the conversations in turn."""
    with httpx.Client(timeout=300) as client:

        def one(i: int) -> None:
            body = {"model": "tokenrouter", "max_tokens": max_tokens, "temperature": 0,
                    "messages": chats[i % len(chats)]}  # fmt: skip
            reply = client.post(f"{url}/chat/completions", json=body)
            ok = reply.status_code == 200
            record(reply.status_code, reply.json().get("routing") if ok else None,
                   None if ok else reply.text[:300])  # fmt: skip

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(n)))


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    polls = result["polls"]
    answers = [a for a in result["answers"] if a["status"] == 200]
    ladder = list(polls[0]["ladder"]) if polls else []
    ladder += [] if "alone" in ladder or not ladder else ["alone"]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    t = [p["t"] for p in polls]
    axes[0].step(t, [ladder.index(p["rung"]) if p["rung"] in ladder else -1 for p in polls],
                 where="post")  # fmt: skip
    axes[0].set_yticks(range(len(ladder)), ladder)
    axes[0].set_ylabel("rung in use")
    axes[1].plot(t, [p["agreement"] for p in polls], label="live agreement (rung in use)")
    if polls:
        axes[1].axhline(polls[0]["target"], color="gray", linestyle="--", label="target")
    axes[1].set_ylabel("agreement")
    axes[1].legend(loc="lower right", fontsize=8)
    window = 16
    shares = [a["large_share"] for a in answers]
    rolling = [
        sum(part) / len(part)
        for part in (shares[max(0, i - window + 1) : i + 1] for i in range(len(shares)))
    ]
    axes[2].plot([a["t"] for a in answers], rolling)
    axes[2].set_ylabel(f"large share\n(last {window} answers)")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        for phase in result["phases"][1:]:
            ax.axvline(phase["t"], color="black", linewidth=0.8)
    axes[0].set_title(" | ".join(f"{p['prompts']} x{p['requests']}" for p in result["phases"]))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest quality-target",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the app's v1 URL")
    parser.add_argument("--phases", default="chat=120,capitals=120",
                        help="PROMPTS=REQUESTS in order, PROMPTS one of chat, capitals "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=4, help="default: %(default)s")
    parser.add_argument("--max-tokens", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--poll-s", type=float, default=1.0, help="default: %(default)s")
    parser.add_argument("--out", default="loadtest-results", help="default: %(default)s")
    args = parser.parse_args(argv)
    phases = []
    for part in args.phases.split(","):
        name, _, count = part.partition("=")
        if name not in PROMPT_SETS or not count.isdigit():
            parser.error(f"--phases: {part!r} is not PROMPTS=REQUESTS ({', '.join(PROMPT_SETS)})")
        phases.append((name, int(count)))
    url = args.url.rstrip("/")
    started = time.monotonic()
    answers: list[dict] = []

    def record(status: int, routing: dict | None, error: str | None) -> None:
        per_model = (routing or {}).get("tokens_per_model") or {}
        total = sum(per_model.values())
        answers.append({
            "t": time.monotonic() - started, "status": status, "error": error,
            "mode": (routing or {}).get("mode"), "reason": (routing or {}).get("reason"),
            "large_share": per_model.get("large", 0) / total if total else 0.0,
        })  # fmt: skip

    stop = threading.Event()
    polls: list[dict] = []
    status_url = url.removesuffix("/v1") + "/v1/tokenrouter/quality"
    poller = threading.Thread(
        target=poll, args=(status_url, started, stop, args.poll_s, polls), daemon=True
    )
    poller.start()
    result: dict[str, Any] = {"phases": [], "polls": polls, "answers": answers}
    for name, count in phases:
        result["phases"].append({"prompts": name, "requests": count,
                                 "t": time.monotonic() - started})  # fmt: skip
        send_phase(url, conversations(name), count, args.concurrency, args.max_tokens, record)
        last = polls[-1] if polls else {}
        phase = answers[-count:]
        share = sum(a["large_share"] for a in phase) / max(len(phase), 1)
        failed = [a for a in phase if a["status"] != 200]
        print(f"{name:9s} x{count}: rung at the end {last.get('rung')}, agreement "
              f"{last.get('agreement')}, large share {share:.2f}, failed {len(failed)}"
              + (f" (first: {failed[0]['error']})" if failed else ""))  # fmt: skip
    stop.set()
    poller.join()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality_target.json").write_text(json.dumps(result, indent=1) + "\n")
    if not polls:
        print("no quality target on this server (tuner.quality_target unset)")
    moves = [
        (p["t"], p["rung"]) for i, p in enumerate(polls) if i and p["rung"] != polls[i - 1]["rung"]
    ]
    print("rung moves: " + (", ".join(f"{t:.0f}s -> {r}" for t, r in moves) or "none"))
    if polls and plot(result, out / "quality_target.png"):
        print(f"wrote {out / 'quality_target.png'}")
    print(header())
    return 0
