"""``tokenrouter-ray trace``: draw a response's routing trace as HTML and/or PNG.

Input: ``--input FILE`` (a saved chat.completion or text_completion response, a JSON list
of its streamed chunks, server-sent events or JSON lines of them, or a bare routing_trace
object), or ``--url URL --prompt TEXT`` (one request to a running server with the official
``openai`` client and ``extra_body={"routing_trace": True}``). Output: ``--html`` and/or
``--png``; with neither, both as ``PREFIX.html`` and ``PREFIX.png`` (``--out``, default
``trace`` in the working directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.traceview.model import (
    RoutingTrace,
    TraceError,
    load_trace,
    trace_from_json,
)

NO_TRACE = (
    "the server did not return a routing trace (choice {choice} has no 'routing_trace'); "
    "is it a tokenrouter-ray server recent enough to support routing traces?"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="draw a response's per-token routing trace (which model wrote each token) as "
        "HTML and PNG",
        description=(
            "Render the routing trace of one response choice: each token shaded by the model "
            "that wrote it and the router's score there, the proposals the policy dropped, "
            "and a strip of handoffs. Read a saved response (--input) or send one prompt to "
            "a running server (--url, with extra_body={'routing_trace': True})."
        ),
        epilog="example (ask the served demo, write trace.html and trace.png):\n"
        "  tokenrouter-ray trace --url http://127.0.0.1:8000/v1 --prompt 'What is 2+2?' "
        "--out trace",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        type=Path,
        help="saved response JSON (chat.completion / text_completion), a JSON list of its "
        "streamed chunks (or their SSE / JSON lines), or a bare routing_trace object",
    )
    source.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--choice", type=int, default=0, help="which choice (default 0)")
    parser.add_argument("--prompt", help="the prompt to send (--url)")
    parser.add_argument("--model", help="served model name (--url; default: the server's first)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens (--url)")
    parser.add_argument("--temperature", type=float, help="temperature (--url; server default)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--chat", dest="chat", action="store_true", default=True,
        help="send a chat completion, the prompt as one user message (default)",
    )  # fmt: skip
    kind.add_argument(
        "--completion", dest="chat", action="store_false", help="send a text completion"
    )
    parser.add_argument(
        "--api-key", default=None, help="API key (--url; default $OPENAI_API_KEY, else 'none')"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="request timeout (s)")
    parser.add_argument("--save-response", type=Path, help="also save the raw response JSON")
    parser.add_argument("--html", type=Path, help="write the HTML page here")
    parser.add_argument("--png", type=Path, help="write the PNG here")
    parser.add_argument(
        "--out", default="trace",
        help="with neither --html nor --png: write PREFIX.html and PREFIX.png (default: trace)",
    )  # fmt: skip
    parser.add_argument("--title", default="Routing trace", help="page and figure title")
    parser.set_defaults(func=run_trace)


async def fetch_response(
    client: Any,
    prompt: str,
    *,
    model: str | None = None,
    chat: bool = True,
    max_tokens: int = 64,
    temperature: float | None = None,
    n: int = 1,
) -> dict[str, Any]:
    """One request through an ``openai.AsyncOpenAI`` client with the trace asked for; the
    raw response body as parsed JSON (extension fields included as the server sent them)."""
    import openai

    try:
        if model is None:
            models = [m.id async for m in client.models.list()]
            if not models:
                raise TraceError("the server lists no models; pass --model")
            model = models[0]
        extra: dict[str, Any] = {"max_tokens": max_tokens, "n": n}
        if temperature is not None:
            extra["temperature"] = temperature
        if chat:
            raw = await client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": prompt}],
                extra_body={"routing_trace": True}, **extra,
            )  # fmt: skip
        else:
            raw = await client.completions.with_raw_response.create(
                model=model, prompt=prompt, extra_body={"routing_trace": True}, **extra
            )
    except openai.APIStatusError as exc:
        raise TraceError(f"the server answered {exc.status_code}: {exc.message}") from None
    except openai.APIConnectionError as exc:
        raise TraceError(f"cannot reach {client.base_url}: {exc}") from None
    return raw.http_response.json()


def trace_of_response(body: Any, choice: int) -> RoutingTrace:
    """The trace of a server's answer; the message names the server when it sent none."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if isinstance(choices, list):
        for position, c in enumerate(choices):
            if c.get("index", position) == choice and "routing_trace" not in c:
                raise TraceError(NO_TRACE.format(choice=choice))
    return trace_from_json(body, choice)


def _outputs(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    if args.html is None and args.png is None:
        return Path(f"{args.out}.html"), Path(f"{args.out}.png")
    return args.html, args.png


def write_outputs(
    trace: RoutingTrace, html: Path | None, png: Path | None, title: str
) -> list[Path]:
    from tokenrouter_ray.traceview.html import render_html
    from tokenrouter_ray.traceview.png import render_png

    written = []
    if html is not None:
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text(render_html(trace, title=title), encoding="utf-8")
        written.append(html)
    if png is not None:
        try:
            written.append(render_png(trace, png, title=title))
        except UserFacingError as exc:
            done = f" ({', '.join(map(str, written))} written)" if written else ""
            raise UserFacingError(f"{exc}{done}") from None
    return written


def run_trace(args: argparse.Namespace) -> int:
    if args.url is not None:
        if not args.prompt:
            raise UserFacingError("--url needs --prompt")
        import openai

        api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "none"
        client = openai.AsyncOpenAI(
            base_url=args.url, api_key=api_key, timeout=args.timeout, max_retries=0
        )

        async def go() -> dict[str, Any]:
            async with client:
                return await fetch_response(
                    client, args.prompt, model=args.model, chat=args.chat,
                    max_tokens=args.max_tokens, temperature=args.temperature,
                    n=args.choice + 1,
                )  # fmt: skip

        body = asyncio.run(go())
        if args.save_response is not None:
            args.save_response.parent.mkdir(parents=True, exist_ok=True)
            args.save_response.write_text(json.dumps(body, indent=1), encoding="utf-8")
        trace = trace_of_response(body, args.choice)
    else:
        trace = load_trace(args.input, args.choice)
    summary = trace.summary()
    per_model = ", ".join(f"{m} {c}" for m, c in summary["tokens_per_model"].items())
    print(
        f"{summary['tokens']} tokens ({per_model}), {summary['writer_changes']} writer changes, "
        f"{summary['dropped']} dropped"
    )
    for path in write_outputs(trace, *_outputs(args), title=args.title):
        print(f"wrote {path}")
    return 0
