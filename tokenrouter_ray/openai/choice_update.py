"""One choice's output on its way to the client: the `ChoiceUpdate` of each step, and the
`ChoiceWriter` that makes them.

The ingress (ingress/openai_server.py `IngressServer.choice`) makes one `ChoiceWriter` per
choice and pushes each step's committed token ids into it. The writer runs them through
the choice's incremental detokenizer (openai/detokenizer.py: stop strings, held-back
bytes), its output parsers (openai/chat_output.py: reasoning, tool calls) and, when the
request asked, its token reports (openai/token_reports.py: logprobs, routing trace), and
returns one `ChoiceUpdate` per step that has something to send (streaming only). The
updates travel on the request's queue to the SSE encoder (openai/sse.py
`merge_choice_streams`). At the end, `end` gives the last update (what the detokenizer and
the parsers held back) and `result` the `ChoiceResult` (openai/responses.py) that the
finish chunk and the non-streamed response are built from.

A report covers the tokens whose text an update carries (the detokenizer's ``settled``);
the tokens no update reported go with the last update, or else with the result (all of
them when not streaming). Both stop at ``completion_tokens``: a token past a stop string
is never reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenrouter_ray.openai.chat_output import ChatDelta
from tokenrouter_ray.openai.responses import ChoiceResult, RoutingInfo, finish_reason
from tokenrouter_ray.openai.token_reports import (
    TokenDetails,
    chat_logprobs_part,
    completion_logprobs_part,
    request_metrics,
    trace_part,
)
from tokenrouter_ray.openai.validation import PreparedRequest
from tokenrouter_ray.protocol import CommitLog, FinishSummary, TokenInfo


@dataclass(frozen=True, slots=True)
class ChoiceUpdate:
    """What one step adds to choice ``index``'s stream: its text (completions) or its
    parsed delta (chat), the reports of the tokens that text settles (None: not asked, or
    no token settled), and the committed tokens it stands for (the backpressure count)."""

    index: int
    delta: str | ChatDelta
    details: TokenDetails | None = None
    num_tokens: int = 0


class FinishedChoice(Protocol):
    """What a writer reads of a choice's end (the ingress core's ``Completion``)."""

    finish_reason: str | None
    writers: list[str | None]  # the model of each output token
    infos: list[TokenInfo | None]  # each output token's report, when asked
    handoffs: int
    ttft_s: float | None
    mean_itl_s: float | None
    e2e_s: float | None
    summary: FinishSummary | None


class ChoiceWriter:
    """One choice's text pipeline: committed tokens -> detokenizer -> output parsers ->
    token reports -> `ChoiceUpdate` (``streaming``; else the text only accumulates).
    ``models(writers)`` names the deployment's models, entry first (the trace and the
    metrics list them all)."""

    def __init__(
        self,
        index: int,
        prepared: PreparedRequest,
        tokenizer: Any,
        token_text: Callable[[int], str],
        models: Callable[[Sequence[str | None]], Sequence[str]],
        *,
        chat: bool = False,
        streaming: bool = False,
    ) -> None:
        self.index = index
        self.sampling = prepared.sampling.spec  # what it reports: logprobs, the routing trace
        self.routing = prepared.routing
        self.detok = prepared.detokenizer(tokenizer)  # stop strings and tokens, special tokens
        self.parser = prepared.chat_parser() if chat else None  # reasoning / tool calls
        self.chat = chat
        self.streaming = streaming
        self.token_text = token_text
        self.models = models
        self.reports = self.sampling.reports_tokens
        self.out: list[int] = []  # output token ids received (kept when reports are asked)
        self.reported = 0  # output tokens already reported in an update
        self.details_left: TokenDetails | None = None  # the reports `end` left to `result`

    @property
    def stopped(self) -> bool:
        """A stop string or stop token ended the text: the choice is to be aborted."""
        return self.detok.stopped

    def push(self, tokens: Sequence[int], log: Callable[[], CommitLog]) -> ChoiceUpdate | None:
        """The update one step's committed ``tokens`` make; None when there is nothing to
        send (not streaming, or text held back). ``log()``: the choice's commit log, read
        for its writers and token reports when they are reported."""
        text = self.detok.push(tokens)
        delta = self.parser.push(text) if self.parser is not None else text
        if self.reports:
            self.out += tokens
        if not self.streaming or not delta:
            return None
        details = None
        settled = self.detok.settled()
        if self.reports and settled > self.reported:
            commits = log()
            details = self._details(commits.writers, commits.infos, settled)
        return ChoiceUpdate(self.index, delta, details, len(tokens))

    def end(
        self, writers: Sequence[str | None], infos: Sequence[TokenInfo | None]
    ) -> ChoiceUpdate | None:
        """The last update (streaming, when the detokenizer or the parsers held text back),
        with the reports of the tokens no update reported; without one, those reports go
        to `result`. Call once, after the last `push`."""
        tail = self.detok.finish()
        delta = self.parser.end(tail) if self.parser is not None else tail
        details = self._details(writers, infos, self.detok.num_tokens) if self.reports else None
        if self.streaming and delta:
            return ChoiceUpdate(self.index, delta, details)
        self.details_left = details
        return None

    def result(self, done: FinishedChoice) -> ChoiceResult:
        """The finished choice: its text, OpenAI finish reason, token count, routing and
        metrics, the reports `end` left, and the parsed message. Call after `end`. An
        engine finish reason ``"error"`` raises ``InternalServerError``."""
        detok, parser, n = self.detok, self.parser, self.detok.num_tokens
        reason = finish_reason(done.finish_reason, stopped_by_string=detok.stopped)
        metrics = request_metrics(
            n, done.writers, self.models(done.writers), done.ttft_s, done.mean_itl_s,
            done.e2e_s, done.handoffs, done.summary,
        )  # fmt: skip
        routing = RoutingInfo.of(
            metrics, done.handoffs, self.routing.alone is not None, self.routing.why
        )
        text, details = detok.text, self.details_left
        if parser is None:
            return ChoiceResult(self.index, text, reason, n, routing, metrics, details)
        return ChoiceResult(
            self.index,
            text,
            parser.finish_reason(reason),
            n,
            routing,
            metrics,
            details,
            parser.message,
            parser.reasoning_tokens(text, detok.token_ends, n),
        )

    def _details(
        self, writers: Sequence[str | None], infos: Sequence[TokenInfo | None], end: int
    ) -> TokenDetails:
        """The ``logprobs`` and/or ``routing_trace`` of the output tokens from the first
        not yet reported up to ``end`` (then reported)."""
        start, self.reported = self.reported, end
        logprobs = None
        if self.sampling.logprobs is not None:
            logprobs = (
                chat_logprobs_part(self.out, infos, start, end, self.token_text)
                if self.chat
                else completion_logprobs_part(
                    self.out, infos, start, end, self.token_text, self.detok.token_ends
                )
            )
        trace = None
        if self.sampling.trace:
            models = self.models(writers)
            trace = trace_part(self.out, writers, infos, start, end, self.token_text, models)
        return TokenDetails(logprobs, trace)
