"""Run task items against an OpenAI-compatible server and sum the answers into a result.

Items enter as `TaskItem`s with a base URL and a model name; each becomes one request
through the official ``openai`` client (``AsyncOpenAI``), ``concurrency`` at a time, no
retries: a failed request is an `ItemResult` with its ``error`` and ``correct=False``, not
a crash. Each response is scored (`scorers.score`) and its routing read: this server's
``routing`` extension (``tokens_per_model``, ``handoffs``) and the choice's ``metrics``
(``tokens_per_model`` with every model, in config order; ``dropped_tokens``). A stock
server has neither, so its items carry ``None`` there. The items leave summed into a
`SystemResult`.

Large-model token share: the models' order is the config order, which the choice metrics
list in full (the response-level ``routing`` dict, ordered the same, omits models that
wrote nothing). The large model is the last model of that order, the union over all
answered items in first-seen order; its share is its tokens over all routed tokens, summed
over items (``None`` when no response carried routing).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.scorers import score
from tokenrouter_ray.quality.stats import wilson_interval
from tokenrouter_ray.quality.tasks import TaskItem


@dataclass
class ItemResult:
    """One item's answer and what it cost."""

    id: str
    answer: str | None  # the expected one (None: a set judged by agreement)
    response: str  # the text the server returned ("" on a failure)
    correct: bool
    completion_tokens: int = 0
    tokens_per_model: dict[str, int] | None = None  # None: the server sent no routing
    handoffs: int | None = None
    dropped: int | None = None  # tokens the policy dropped (choice metrics), if reported
    latency_s: float = 0.0
    error: str | None = None  # the failure's text; None when answered


@dataclass
class SystemResult:
    """A system's answers on a task set: accuracy with its interval, routing, speed."""

    label: str
    base_url: str
    model: str
    n: int
    correct: int
    accuracy: float
    interval: tuple[float, float]  # Wilson 95 %
    large_model: str | None
    large_share: float | None  # large model's tokens / all routed tokens
    handoffs: int  # summed over answered items
    completion_tokens: int
    wall_s: float
    output_tok_s: float  # completion tokens / wall time
    failures: int
    items: list[ItemResult] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return self.n - self.failures

    @property
    def handoffs_per_request(self) -> float:
        return self.handoffs / self.answered if self.answered else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["interval"] = list(self.interval)
        data["handoffs_per_request"] = self.handoffs_per_request
        return data


def model_order(items: Sequence[ItemResult]) -> list[str]:
    """Model names in first-seen order over the items' per-model counts."""
    order: dict[str, None] = {}
    for item in items:
        order.update(dict.fromkeys(item.tokens_per_model or {}))
    return list(order)


def summarise(
    label: str, base_url: str, model: str, items: list[ItemResult], wall_s: float
) -> SystemResult:
    """The `SystemResult` of scored items that took ``wall_s`` in all."""
    correct = sum(item.correct for item in items)
    order = model_order(items)
    large = order[-1] if order else None
    routed = [item.tokens_per_model for item in items if item.tokens_per_model]
    total = sum(sum(counts.values()) for counts in routed)
    large_tokens = sum(counts.get(large, 0) for counts in routed) if large else 0
    tokens = sum(item.completion_tokens for item in items)
    return SystemResult(
        label=label,
        base_url=base_url,
        model=model,
        n=len(items),
        correct=correct,
        accuracy=correct / len(items) if items else 0.0,
        interval=wilson_interval(correct, len(items)),
        large_model=large,
        large_share=large_tokens / total if total else None,
        handoffs=sum(item.handoffs or 0 for item in items if item.error is None),
        completion_tokens=tokens,
        wall_s=wall_s,
        output_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        failures=sum(item.error is not None for item in items),
        items=items,
    )


def _extra(obj: Any, name: str) -> Any:
    return (getattr(obj, "model_extra", None) or {}).get(name)


def _routing_of(response: Any, choice: Any) -> tuple[dict[str, int] | None, int | None, int | None]:
    """``(tokens_per_model, handoffs, dropped)`` from the extension, or Nones."""
    routing = _extra(response, "routing") or {}
    metrics = _extra(choice, "metrics") or {}
    counts = metrics.get("tokens_per_model") or routing.get("tokens_per_model")
    handoffs = routing.get("handoffs", metrics.get("handoffs"))
    tokens = {str(k): int(v) for k, v in counts.items()} if isinstance(counts, Mapping) else None
    return tokens, handoffs, metrics.get("dropped_tokens")


async def _ask(client: Any, model: str, item: TaskItem, chat: bool, params: dict) -> ItemResult:
    started = time.monotonic()
    try:
        if chat:
            messages = item.messages or [{"role": "user", "content": item.prompt}]
            response = await client.chat.completions.create(
                model=model, messages=messages, **params
            )
            choice = response.choices[0]
            text = choice.message.content or ""
        else:
            response = await client.completions.create(model=model, prompt=item.prompt, **params)
            choice = response.choices[0]
            text = choice.text or ""
    except Exception as exc:  # a failed request is data, not a crash
        return ItemResult(
            item.id, item.answer, "", False,
            latency_s=time.monotonic() - started, error=f"{type(exc).__name__}: {exc}",
        )  # fmt: skip
    latency = time.monotonic() - started
    tokens, handoffs, dropped = _routing_of(response, choice)
    usage = getattr(response, "usage", None)
    return ItemResult(
        id=item.id,
        answer=item.answer,
        response=text,
        correct=score(item, text),
        completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
        tokens_per_model=tokens,
        handoffs=handoffs,
        dropped=dropped,
        latency_s=latency,
    )


async def run_eval(
    base_url: str,
    model: str,
    items: Sequence[TaskItem],
    *,
    concurrency: int = 4,
    seed: int = 0,
    max_tokens: int = 32,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
    api_key: str = "none",
    progress: bool = True,
    chat: bool = True,
    label: str | None = None,
    timeout_s: float = 600.0,
) -> SystemResult:
    """Ask every item once (``concurrency`` requests in flight) and score the answers."""
    import openai
    from tqdm import tqdm

    if concurrency < 1:
        raise UserFacingError(f"concurrency must be at least 1, got {concurrency}")
    if not chat and any(item.messages is not None for item in items):
        raise UserFacingError("items with 'messages' need the chat endpoint (chat=True)")
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    if extra_body:
        params["extra_body"] = dict(extra_body)
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s
    )
    gate = asyncio.Semaphore(concurrency)
    label = label or base_url
    bar = tqdm(total=len(items), desc=label, unit="item", file=sys.stderr, disable=not progress)

    async def one(item: TaskItem) -> ItemResult:
        async with gate:
            result = await _ask(client, model, item, chat, params)
        bar.update(1)
        return result

    started = time.monotonic()
    try:
        results = await asyncio.gather(*(one(item) for item in items))
    finally:
        bar.close()
        await client.close()
    return summarise(label, base_url, model, list(results), time.monotonic() - started)
